//! Asymmetric memory barriers: a `light` one for a hot path that runs often and a
//! `heavy` one for a slow path that runs rarely, which together order memory as two full
//! fences would. On Linux the heavy one is the `membarrier` system call (private
//! expedited), which runs a full barrier on every CPU that runs a thread of this process,
//! so the light one only has to stop the compiler from reordering. Elsewhere, when the
//! kernel refuses `membarrier`, and under Miri, both are ordinary `SeqCst` fences. Under
//! loom both are `SeqCst` fences: that is what the pair stands for, and what loom can
//! model.

#[cfg(not(allocbox_loom))]
use std::sync::atomic::{AtomicU8, Ordering, compiler_fence, fence};

#[cfg(not(allocbox_loom))]
const UNKNOWN: u8 = 0;
#[cfg(not(allocbox_loom))]
const EXPEDITED: u8 = 1;
#[cfg(not(allocbox_loom))]
const FENCES: u8 = 2;

/// Whether this process is registered for private expedited `membarrier`: decided on
/// first use, before any light barrier relies on it. Registration is for the whole
/// process and is never undone (a forked child keeps it), so a thread that reads
/// `EXPEDITED` may rely on it.
#[cfg(not(allocbox_loom))]
static KIND: AtomicU8 = AtomicU8::new(UNKNOWN);

#[cfg(not(allocbox_loom))]
#[inline]
fn expedited() -> bool {
    match KIND.load(Ordering::Acquire) {
        UNKNOWN => decide(),
        kind => kind == EXPEDITED,
    }
}

/// Registering twice is harmless, so threads racing here need no lock.
#[cfg(not(allocbox_loom))]
#[cold]
fn decide() -> bool {
    let expedited = register();
    KIND.store(
        if expedited { EXPEDITED } else { FENCES },
        Ordering::Release,
    );
    expedited
}

#[cfg(all(target_os = "linux", not(miri), not(allocbox_loom)))]
mod sys {
    // From the kernel's `include/uapi/linux/membarrier.h`.
    pub const QUERY: libc::c_int = 0;
    pub const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
    pub const REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

    /// `membarrier(cmd)`: `Ok` with its answer, or the error number.
    pub fn membarrier(cmd: libc::c_int) -> Result<libc::c_long, i32> {
        // SAFETY: `membarrier(cmd, flags, cpu_id)` reads no memory of ours; with flags 0
        // the CPU argument is ignored.
        let answer = unsafe {
            libc::syscall(
                libc::SYS_membarrier,
                cmd,
                0 as libc::c_uint,
                0 as libc::c_int,
            )
        };
        match answer {
            0.. => Ok(answer),
            _ => Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)),
        }
    }
}

#[cfg(all(target_os = "linux", not(miri), not(allocbox_loom)))]
fn register() -> bool {
    let supported = sys::membarrier(sys::QUERY).unwrap_or(0);
    supported & libc::c_long::from(sys::PRIVATE_EXPEDITED) != 0
        && sys::membarrier(sys::REGISTER_PRIVATE_EXPEDITED).is_ok()
}

#[cfg(all(not(all(target_os = "linux", not(miri))), not(allocbox_loom)))]
fn register() -> bool {
    false
}

/// Decide now whether this process uses `membarrier`, so that later light barriers are
/// compiler-only where the kernel allows it.
pub fn prepare() {
    #[cfg(not(allocbox_loom))]
    expedited();
}

/// The hot side. It calls nothing, so a fast path that inlines it needs no stack frame:
/// until [`prepare`] (or a heavy barrier) has decided, it is a full fence, which pairs
/// with either heavy side.
#[cfg(not(allocbox_loom))]
#[inline]
pub fn light() {
    if KIND.load(Ordering::Acquire) == EXPEDITED {
        compiler_fence(Ordering::SeqCst);
    } else {
        fence(Ordering::SeqCst);
    }
}

/// The slow side: costs a system call (about 150 ns measured here with two CPUs busy).
#[cfg(not(allocbox_loom))]
pub fn heavy() {
    #[cfg(all(target_os = "linux", not(miri)))]
    if expedited() {
        let done = match sys::membarrier(sys::PRIVATE_EXPEDITED) {
            Ok(_) => true,
            // Not registered (in case a kernel forgets a registration across fork or
            // restore): register again, and try once more.
            Err(libc::EPERM) => {
                sys::membarrier(sys::REGISTER_PRIVATE_EXPEDITED).is_ok()
                    && sys::membarrier(sys::PRIVATE_EXPEDITED).is_ok()
            }
            Err(_) => false,
        };
        // Light barriers that relied on this one have run as compiler fences only, so
        // there is no safe way on: falling back to fences now would leave them unpaired.
        assert!(
            done,
            "membarrier failed after this process registered for it; the thread caches \
             cannot be kept safe without it"
        );
        return;
    }
    fence(Ordering::SeqCst);
}

#[cfg(allocbox_loom)]
std::thread_local! {
    /// A model that checks what breaks without the light barrier turns it off here
    /// (loom runs a model's threads on the thread that runs the model).
    static LIGHT_OFF: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Under loom: a full fence, the light side of the pair, unless the model turned it off
/// ([`turn_light_barrier_off`]).
#[cfg(allocbox_loom)]
pub fn light() {
    if !LIGHT_OFF.with(std::cell::Cell::get) {
        crate::sync::fence(crate::sync::Ordering::SeqCst);
    }
}

/// Under loom: a full fence, the heavy side of the pair.
#[cfg(allocbox_loom)]
pub fn heavy() {
    crate::sync::fence(crate::sync::Ordering::SeqCst);
}

/// Under loom: leave the light barrier out of the models run on this thread from now
/// on, to see the protocol fail without it.
#[cfg(allocbox_loom)]
#[doc(hidden)]
pub fn turn_light_barrier_off() {
    LIGHT_OFF.with(|off| off.set(true));
}

#[cfg(all(test, not(allocbox_loom)))]
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
    #[cfg_attr(
        miri,
        ignore = "a litmus test of the hardware, which Miri does not model"
    )]
    fn a_light_and_a_heavy_barrier_forbid_both_sides_missing_each_other() {
        assert_eq!(store_buffering(20_000, light, heavy), 0);
    }
}
