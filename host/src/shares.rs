//! Process-wide resources that every policy, the host, wasmtime and the client share:
//! the policies together may hold only a share of each, so that what a policy maps can
//! never leave the host without the means to go on (wasmtime maps a signal stack for
//! every thread that first enters wasm, and aborts when it cannot).
//!
//! Today that is kernel mappings: the regions mapped for policies (`memory.map-region`,
//! 0.2.0) count against [`MAPPING_SHARE`] of the process's limit, `vm.max_map_count`,
//! read once. A region past the share is refused as over the limit; the policy sees
//! the refusal and goes on. Locked memory needs no share of its own: the kernel refuses
//! `mlock` past `RLIMIT_MEMLOCK` with the same typed refusal, and the host locks none.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The fraction of the process's mapping limit the policies may hold together, as
/// `(numerator, denominator)`: a quarter, three quarters kept for the host, wasmtime
/// (code, stacks, instances) and the client (NumPy, Python, its threads).
pub const MAPPING_SHARE: (u64, u64) = (1, 4);

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

/// Mappings taken from the policies' share; given back when dropped.
#[derive(Debug)]
pub(crate) struct Mappings(u64);

impl Mappings {
    /// Take `count` mappings from the share, taken before any is made; `None` when the
    /// share does not hold them.
    pub(crate) fn take(count: u64) -> Option<Mappings> {
        let share = mapping_share();
        MAPPINGS_HELD
            .try_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                held.checked_add(count).filter(|&after| after <= share)
            })
            .ok()
            .map(|_| Mappings(count))
    }
}

impl Drop for Mappings {
    fn drop(&mut self) {
        MAPPINGS_HELD.fetch_sub(self.0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_is_a_quarter_of_the_limit_and_what_is_taken_comes_back() {
        let share = mapping_share();
        assert!(share >= DEFAULT_MAX_MAP_COUNT / 8, "{share}");
        // Other tests of this process may hold some; all of the share is never free
        // for one taker, and a taking past it is refused.
        assert!(Mappings::take(share + 1).is_none());
        let before = mappings_held();
        let taken = Mappings::take(2).expect("two mappings fit");
        assert!(mappings_held() >= before + 2 || mappings_held() >= 2);
        drop(taken);
        assert!(Mappings::take(share - mappings_held()).is_some());
    }
}
