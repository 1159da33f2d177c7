//! Asymmetric memory barriers: a `light` one for a hot path that runs often and a
//! `heavy` one for a slow path that runs rarely, which together order memory as two full
//! fences would. On Linux the heavy one is the `membarrier` system call (private
//! expedited), which runs a full barrier on every CPU that runs a thread of this process,
//! so the light one only has to stop the compiler from reordering. Elsewhere, or when the
//! kernel refuses `membarrier`, both are ordinary `SeqCst` fences.

use std::sync::atomic::{AtomicU8, Ordering, compiler_fence, fence};

const UNKNOWN: u8 = 0;
const EXPEDITED: u8 = 1;
const FENCES: u8 = 2;

/// Whether this process is registered for private expedited `membarrier`: decided on
/// first use, before any light barrier relies on it. Registration is for the whole
/// process and is never undone, so a thread that reads `EXPEDITED` may rely on it.
static KIND: AtomicU8 = AtomicU8::new(UNKNOWN);

#[inline]
fn expedited() -> bool {
    match KIND.load(Ordering::Acquire) {
        UNKNOWN => decide(),
        kind => kind == EXPEDITED,
    }
}

/// Registering twice is harmless, so threads racing here need no lock.
#[cold]
fn decide() -> bool {
    let expedited = register();
    KIND.store(
        if expedited { EXPEDITED } else { FENCES },
        Ordering::Release,
    );
    expedited
}

#[cfg(target_os = "linux")]
mod sys {
    // From the kernel's `include/uapi/linux/membarrier.h`.
    pub const QUERY: libc::c_int = 0;
    pub const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
    pub const REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

    pub fn membarrier(cmd: libc::c_int) -> libc::c_long {
        // SAFETY: `membarrier(cmd, flags, cpu_id)` reads no memory of ours; with flags 0
        // the CPU argument is ignored. Any failure is a negative return, checked by the
        // callers.
        unsafe {
            libc::syscall(
                libc::SYS_membarrier,
                cmd,
                0 as libc::c_uint,
                0 as libc::c_int,
            )
        }
    }
}

#[cfg(target_os = "linux")]
fn register() -> bool {
    let supported = sys::membarrier(sys::QUERY);
    supported >= 0
        && supported & libc::c_long::from(sys::PRIVATE_EXPEDITED) != 0
        && sys::membarrier(sys::REGISTER_PRIVATE_EXPEDITED) == 0
}

#[cfg(not(target_os = "linux"))]
fn register() -> bool {
    false
}

/// Decide now whether this process uses `membarrier`, so that later light barriers are
/// compiler-only where the kernel allows it.
pub fn prepare() {
    expedited();
}

/// The hot side. It calls nothing, so a fast path that inlines it needs no stack frame:
/// until [`prepare`] (or a heavy barrier) has decided, it is a full fence, which pairs
/// with either heavy side.
#[inline]
pub fn light() {
    if KIND.load(Ordering::Acquire) == EXPEDITED {
        compiler_fence(Ordering::SeqCst);
    } else {
        fence(Ordering::SeqCst);
    }
}

/// The slow side: costs a system call (about 150 ns measured here with two CPUs busy).
pub fn heavy() {
    #[cfg(target_os = "linux")]
    if expedited() {
        // Once registered, the kernel does not refuse this command; if it ever did, the
        // light side would have had no fence, so going on would be unsound.
        assert!(
            sys::membarrier(sys::PRIVATE_EXPEDITED) == 0,
            "membarrier failed after registration"
        );
        return;
    }
    fence(Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU32};

    /// The store-buffering litmus test, `rounds` times: each side stores its flag,
    /// fences, loads the other's; returns how often both sides missed the other's store.
    /// The sides meet at a spinning start line each round so that their stores race:
    /// with compiler fences only, about 500 of 20,000 rounds missed both ways here.
    fn store_buffering(rounds: u32, fast_side: fn(), slow_side: fn()) -> u32 {
        let (x, y) = (AtomicBool::new(false), AtomicBool::new(false));
        let (go, ready) = (AtomicU32::new(0), AtomicU32::new(0));
        let other_saw_x = AtomicBool::new(false);
        let mut both_missed = 0;
        std::thread::scope(|s| {
            s.spawn(|| {
                for round in 1..=rounds {
                    while go.load(Ordering::Acquire) != round {
                        std::hint::spin_loop();
                    }
                    y.store(true, Ordering::Relaxed);
                    slow_side();
                    other_saw_x.store(x.load(Ordering::Relaxed), Ordering::Relaxed);
                    ready.store(round, Ordering::Release);
                }
            });
            for round in 1..=rounds {
                x.store(false, Ordering::Relaxed);
                y.store(false, Ordering::Relaxed);
                go.store(round, Ordering::Release);
                x.store(true, Ordering::Relaxed);
                fast_side();
                let saw_y = y.load(Ordering::Relaxed);
                while ready.load(Ordering::Acquire) != round {
                    std::hint::spin_loop();
                }
                if !saw_y && !other_saw_x.load(Ordering::Relaxed) {
                    both_missed += 1;
                }
            }
        });
        both_missed
    }

    #[test]
    fn a_light_and_a_heavy_barrier_forbid_both_sides_missing_each_other() {
        assert_eq!(store_buffering(20_000, light, heavy), 0);
    }
}
