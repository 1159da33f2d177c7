//! Process-wide resources that every policy, the host, wasmtime and the client share:
//! the policies together may hold only a share of each, so that what a policy maps can
//! never leave the host without the means to go on (wasmtime maps a signal stack for
//! every thread that first enters wasm, and aborts when it cannot).
//!
//! The regions mapped for policies (`memory.map-region`, 0.2.0) count against a share of
//! each process limit they touch, read once: kernel mappings against [`MAPPING_SHARE`]
//! of `vm.max_map_count`, locked bytes against [`LOCKED_SHARE`] of `RLIMIT_MEMLOCK` (a
//! process the kernel lets lock without limit, as root, has none to share). A region
//! past a share is refused as over the limit; the policy sees the refusal and goes on.
//! Policies cannot open descriptors or start threads at all (see SECURITY.md).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The fraction of the process's mapping limit the policies may hold together, as
/// `(numerator, denominator)`: a quarter, three quarters kept for the host, wasmtime
/// (code, stacks, instances) and the client (NumPy, Python, its threads).
pub const MAPPING_SHARE: (u64, u64) = (1, 4);

/// The fraction of the process's locked-memory limit the policies may lock together.
pub const LOCKED_SHARE: (u64, u64) = (1, 2);

/// The limit when `/proc/sys/vm/max_map_count` cannot be read: Linux's default.
const DEFAULT_MAX_MAP_COUNT: u64 = 65_530;

static MAPPINGS_HELD: AtomicU64 = AtomicU64::new(0);

/// Kernel mappings the policies of this process may hold together.
pub fn mapping_share() -> u64 {
    static SHARE: OnceLock<u64> = OnceLock::new();
    *SHARE.get_or_init(|| {
        let limit = std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(DEFAULT_MAX_MAP_COUNT);
        limit / MAPPING_SHARE.1 * MAPPING_SHARE.0
    })
}

/// Kernel mappings the policies of this process hold now.
pub fn mappings_held() -> u64 {
    MAPPINGS_HELD.load(Ordering::Relaxed)
}

static LOCKED_HELD: AtomicU64 = AtomicU64::new(0);

/// Bytes the policies of this process may lock together: `None` when the process may
/// lock without limit.
pub fn locked_share() -> Option<u64> {
    static SHARE: OnceLock<Option<u64>> = OnceLock::new();
    *SHARE.get_or_init(|| {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `getrlimit` writes the limit into the live struct it is given.
        let read = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } == 0;
        (read && limit.rlim_cur != libc::RLIM_INFINITY)
            .then(|| limit.rlim_cur / LOCKED_SHARE.1 * LOCKED_SHARE.0)
    })
}

/// Bytes the policies of this process have locked now.
pub fn locked_held() -> u64 {
    LOCKED_HELD.load(Ordering::Relaxed)
}

/// Take `amount` from `held` within `share`: false, and nothing taken, past it.
fn take(held: &AtomicU64, amount: u64, share: u64) -> bool {
    held.try_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
        now.checked_add(amount).filter(|&after| after <= share)
    })
    .is_ok()
}

/// Mappings taken from the policies' share; given back when dropped.
#[derive(Debug)]
pub(crate) struct Mappings(u64);

impl Mappings {
    /// Take `count` mappings from the share, taken before any is made; `None` when the
    /// share does not hold them.
    pub(crate) fn take(count: u64) -> Option<Mappings> {
        // Made only once taken: dropping one gives back what it holds.
        take(&MAPPINGS_HELD, count, mapping_share()).then(|| Mappings(count))
    }
}

impl Drop for Mappings {
    fn drop(&mut self) {
        MAPPINGS_HELD.fetch_sub(self.0, Ordering::Relaxed);
    }
}

/// Locked bytes taken from the policies' share; given back when dropped.
#[derive(Debug)]
pub(crate) struct LockedBytes(u64);

impl LockedBytes {
    /// Take `bytes` from the share before they are locked; `None` when the share does not
    /// hold them. Without a limit to share, they are only counted.
    pub(crate) fn take(bytes: u64) -> Option<LockedBytes> {
        take(&LOCKED_HELD, bytes, locked_share().unwrap_or(u64::MAX)).then(|| LockedBytes(bytes))
    }
}

impl Drop for LockedBytes {
    fn drop(&mut self) {
        LOCKED_HELD.fetch_sub(self.0, Ordering::Relaxed);
    }
}

/// The fraction of a GPU's memory, free when a policy first maps some, that the policies
/// may hold together: the rest is the program's (its kernels' workspaces, its libraries'
/// own pools, the copies it makes).
pub const DEVICE_SHARE: (u64, u64) = (3, 4);

/// The fraction of the machine's memory the policies may pin together: pinned pages
/// cannot be swapped or moved, and the kernel and every other program need the rest.
pub const PINNED_SHARE: (u64, u64) = (1, 4);

/// Per GPU: the policies' share of its memory (fixed when first asked), and what they
/// hold of it.
static DEVICE_HELD: parking_lot::Mutex<Vec<(u32, u64, u64)>> = parking_lot::Mutex::new(Vec::new());

/// Device bytes taken from the policies' share of one GPU; given back when dropped.
#[derive(Debug)]
pub(crate) struct DeviceBytes {
    device: u32,
    bytes: u64,
}

impl DeviceBytes {
    /// Take `bytes` of `device`'s share before they are allocated; `None` past it.
    /// `free` reads what the GPU has free, once per device, when the share is set.
    pub(crate) fn take(device: u32, bytes: u64, free: impl FnOnce() -> u64) -> Option<Self> {
        let mut held = DEVICE_HELD.lock();
        let index = match held.iter().position(|&(d, _, _)| d == device) {
            Some(index) => index,
            None => {
                let share = free() / DEVICE_SHARE.1 * DEVICE_SHARE.0;
                held.push((device, share, 0));
                held.len() - 1
            }
        };
        let (_, share, now) = &mut held[index];
        let after = now.checked_add(bytes).filter(|&after| after <= *share)?;
        *now = after;
        Some(DeviceBytes { device, bytes })
    }
}

impl Drop for DeviceBytes {
    fn drop(&mut self) {
        let mut held = DEVICE_HELD.lock();
        if let Some(entry) = held.iter_mut().find(|e| e.0 == self.device) {
            entry.2 -= self.bytes;
        }
    }
}

/// Bytes of memory the policies of this process may pin together.
pub fn pinned_share() -> u64 {
    static SHARE: OnceLock<u64> = OnceLock::new();
    *SHARE.get_or_init(|| {
        // SAFETY: sysconf reads constants of the system; no memory is passed.
        let (pages, page) = unsafe {
            (
                libc::sysconf(libc::_SC_PHYS_PAGES),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        let total = u64::try_from(pages).unwrap_or(0) * u64::try_from(page).unwrap_or(0);
        total / PINNED_SHARE.1 * PINNED_SHARE.0
    })
}

static PINNED_HELD: AtomicU64 = AtomicU64::new(0);

/// Bytes the policies of this process have pinned now.
pub fn pinned_held() -> u64 {
    PINNED_HELD.load(Ordering::Relaxed)
}

/// Pinned bytes taken from the policies' share; given back when dropped.
#[derive(Debug)]
pub(crate) struct PinnedBytes(u64);

impl PinnedBytes {
    /// Take `bytes` from the share before they are pinned; `None` past it.
    pub(crate) fn take(bytes: u64) -> Option<PinnedBytes> {
        take(&PINNED_HELD, bytes, pinned_share()).then(|| PinnedBytes(bytes))
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        PINNED_HELD.fetch_sub(self.0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shares_refuse_past_themselves_and_what_is_taken_comes_back() {
        let share = mapping_share();
        assert!(share >= DEFAULT_MAX_MAP_COUNT / 8, "{share}");
        // Other tests of this process may hold some; all of the share is never free
        // for one taker, and a taking past it is refused.
        assert!(Mappings::take(share + 1).is_none());
        // A refusal takes nothing, and gives nothing back either.
        assert!(mappings_held() <= share);
        if let Some(locked) = locked_share() {
            assert!(LockedBytes::take(locked + 1).is_none());
            assert!(locked_held() <= locked);
        }
        let before = mappings_held();
        let taken = Mappings::take(2).expect("two mappings fit");
        assert!(mappings_held() >= before + 2 || mappings_held() >= 2);
        drop(taken);
        assert!(Mappings::take(share - mappings_held()).is_some());
    }

    #[test]
    fn a_gpu_s_share_is_three_quarters_of_what_it_had_free_and_comes_back() {
        // A device number no other test uses.
        let device = 1_000;
        let first = DeviceBytes::take(device, 500, || 1000).expect("within 750");
        assert!(DeviceBytes::take(device, 251, || unreachable!("read once")).is_none());
        let second = DeviceBytes::take(device, 250, || 0).expect("exactly the share");
        drop(first);
        assert!(DeviceBytes::take(device, 500, || 0).is_some());
        drop(second);
        assert!(PinnedBytes::take(pinned_share() + 1).is_none());
    }
}
