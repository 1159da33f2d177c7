//! Memory of kinds only the host can make, mapped straight from the operating system for
//! one policy (`memory` in the 0.2.0 policy world): huge pages, NUMA placement, locked
//! pages, and guard pages. A policy asks for a kind; the embedder grants kinds
//! ([`KindGrants`]); the host alone calls `mmap`, `madvise`, `mbind`, `mlock` and
//! `mprotect`, and records every region so that blocks lent from it are checked as
//! blocks lent from upstream memory.
//!
//! Guard pages are registered process-wide ([`guard_page_at`]), so that an embedder's
//! fault handler can tell a client's overrun into one from any other crash, and name
//! the policy whose region it was.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

mod gpu;

pub use crate::kind::{
    GpuRow, Guard, Kind, KindGrant, KindGrants, KindRow, MadeBy, Maps, Numa, Pages, Share,
    kind_list,
};
pub(crate) use gpu::map_gpu;

/// A grant name that is none of [`KindGrant::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{given}` is not a kind of memory allocbox can grant: use {}",
    kind_list()
)]
pub struct UnknownGrant {
    pub given: String,
}

impl std::str::FromStr for KindGrant {
    type Err = UnknownGrant;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KindGrant::ALL
            .into_iter()
            .find(|g| g.name() == s)
            .ok_or_else(|| UnknownGrant {
                given: crate::untrusted::escape(s),
            })
    }
}

impl KindGrants {
    /// Grants from names (`["numa", "guarded"]`), refusing an unknown one.
    pub fn from_names<S: AsRef<str>>(
        names: impl IntoIterator<Item = S>,
    ) -> Result<Self, UnknownGrant> {
        names
            .into_iter()
            .map(|name| name.as_ref().parse())
            .collect()
    }
}

/// Why a region was not mapped; the policy sees it and goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the embedder did not grant `{0}`")]
    NotGranted(KindGrant),
    #[error("the machine cannot give that kind of memory")]
    Unavailable,
    #[error(
        "the policy's overhead budget, the memory-lock limit or the policies' share of \
         the process's mappings does not allow it"
    )]
    OverLimit,
    #[error("the operating system refused the memory")]
    OutOfMemory,
}

/// The size of one page of `pages` on this machine; 0 when it has none of them.
pub fn page_size(pages: Pages) -> u64 {
    match pages {
        Pages::Normal | Pages::TransparentHuge => base_page(),
        Pages::Hugetlb => hugetlb_page(),
    }
}

fn base_page() -> u64 {
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).unwrap_or(4096)
}

/// The size of a transparent huge page (`hpage_pmd_size`); the base page when unknown.
fn transparent_huge_page() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or_else(base_page)
}

/// The default explicit huge page size (`Hugepagesize` in /proc/meminfo); 0 when unknown.
fn hugetlb_page() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("Hugepagesize:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

/// One region mapped for a policy. Unmapped when dropped.
#[derive(Debug)]
pub(crate) struct Region {
    /// The usable part: page-aligned, `len` bytes, all of it the policy's.
    pub(crate) start: u64,
    pub(crate) len: u64,
    /// The size the policy asked for: the one `unmap` must be given.
    pub(crate) asked: u64,
    /// The whole mapping, guard page included.
    map_start: u64,
    map_len: u64,
    guard: Option<u64>,
    /// The kernel mappings it holds, and the bytes it locks, taken from the policies'
    /// shares.
    _mappings: Option<crate::shares::Mappings>,
    _locked: Option<crate::shares::LockedBytes>,
    /// Registered with a GPU's driver, or allocated by it.
    gpu: Option<gpu::Held>,
}

impl Region {
    /// Host memory the region takes, which the policy's overhead budget counts: every
    /// page mapped, the guard page included. A GPU's own memory takes none (issue 74:
    /// the host's 256 MiB budget capped what a device policy cached on an 80 GiB GPU);
    /// its bound is the GPU's share, taken before the driver was asked.
    pub(crate) fn cost(&self) -> u64 {
        match &self.gpu {
            Some(held) if !held.is_host_memory() => 0,
            _ => self.map_len,
        }
    }

    /// Where the region's memory is: host memory (pinned or not), or a GPU's.
    pub(crate) fn placement(&self) -> crate::gpu::Placement {
        self.gpu
            .as_ref()
            .map_or(crate::gpu::Placement::Host, gpu::Held::placement)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if let Some(guard) = self.guard {
            GUARDS.lock().remove(&guard);
            GUARDED.fetch_sub(1, Ordering::Relaxed);
        }
        if self
            .gpu
            .as_ref()
            .is_some_and(|held| !held.release(self.start))
        {
            // Given back to the driver, which made it: nothing was mapped here.
            return;
        }
        // SAFETY: `[map_start, map_start + map_len)` is the mapping `map` made for this
        // region and nothing else; the region is dropped only once its policy unmapped
        // it (no block lent from it is live: `memory.unmap` checked) or its link ended
        // (the client's blocks from it are gone with the handler).
        unsafe { libc::munmap(self.map_start as *mut libc::c_void, self.map_len as usize) };
    }
}

/// Map a region of at least `size` bytes of `kind` for `policy`, if `grants` allow it
/// and `cost_allowed` says its cost (every page mapped) fits the policy's budget.
pub(crate) fn map(
    policy: &Arc<str>,
    size: u64,
    kind: Kind,
    grants: &KindGrants,
    cost_allowed: impl FnOnce(u64) -> bool,
) -> Result<Region, Refusal> {
    if let Some(grant) = grants.missing_for(&kind) {
        return Err(Refusal::NotGranted(grant));
    }
    let page = page_size(kind.pages);
    if page == 0 {
        return Err(Refusal::Unavailable);
    }
    let base = base_page();
    let len = size
        .max(1)
        .checked_next_multiple_of(page)
        .ok_or(Refusal::OutOfMemory)?;
    // A guard is one base page; with huge pages, a whole huge page keeps the region's
    // alignment (a hugetlb mapping is made of huge pages only).
    let guard_len = match kind.guard {
        Guard::None => 0,
        _ if kind.pages == Pages::Hugetlb => page,
        _ => base,
    };
    let map_len = len.checked_add(guard_len).ok_or(Refusal::OutOfMemory)?;
    if usize::try_from(map_len).is_err() || !cost_allowed(map_len) {
        return Err(Refusal::OverLimit);
    }
    // A guard page, and any advice on the usable part alone, splits the mapping in two.
    let split = kind.guard != Guard::None
        || kind.locked
        || kind.numa != Numa::Any
        || kind.pages == Pages::TransparentHuge;
    let mappings = crate::shares::Mappings::take(1 + u64::from(split)).ok_or(Refusal::OverLimit)?;
    // Explicit huge pages are reserved when mapped (no MAP_NORESERVE), so an empty pool
    // refuses here rather than with a SIGBUS when a page is first touched.
    let flags = match kind.pages {
        Pages::Hugetlb => libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB,
        _ => libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
    };
    // Transparent huge pages back only whole, aligned huge pages of a mapping: the
    // usable part starts on one, from a mapping made larger by the slack it takes.
    let usable_at = match kind.guard {
        Guard::Before => guard_len,
        _ => 0,
    };
    let align = match kind.pages {
        Pages::TransparentHuge => transparent_huge_page().max(base),
        _ => base,
    };
    let slack = align - base;
    // SAFETY: a fresh anonymous mapping at an address the kernel chooses; it overlaps
    // nothing that exists.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            (map_len + slack) as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return Err(match kind.pages {
            Pages::Hugetlb => Refusal::Unavailable,
            _ => Refusal::OutOfMemory,
        });
    }
    let raw = at as u64;
    let map_start = (raw + usable_at).next_multiple_of(align) - usable_at;
    let (head, tail) = (map_start - raw, raw + slack - map_start);
    for (from, bytes) in [(raw, head), (map_start + map_len, tail)] {
        if bytes > 0 {
            // SAFETY: the slack before and after `[map_start, map_start + map_len)`,
            // inside the mapping just made, which no one else knows of.
            unsafe { libc::munmap(from as *mut libc::c_void, bytes as usize) };
        }
    }
    let (start, guard) = match kind.guard {
        Guard::None => (map_start, None),
        Guard::After => (map_start, Some(map_start + len)),
        Guard::Before => (map_start + guard_len, Some(map_start)),
    };
    // Owned from here: an early return unmaps it.
    let mut region = Region {
        start,
        len,
        asked: size,
        map_start,
        map_len,
        guard: None,
        _mappings: Some(mappings),
        _locked: None,
        gpu: None,
    };
    if let Some(guard) = guard {
        // SAFETY: `[guard, guard + guard_len)` lies inside the mapping just made, which
        // no one else knows of yet.
        let protected =
            unsafe { libc::mprotect(guard as *mut libc::c_void, guard_len as usize, 0) };
        if protected != 0 {
            return Err(Refusal::OutOfMemory);
        }
    }
    if kind.pages == Pages::TransparentHuge {
        // SAFETY: advice on the usable part of the mapping just made; it changes no
        // contents. Without THP support it fails, and the pages stay small.
        unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                len as usize,
                libc::MADV_HUGEPAGE,
            )
        };
    }
    if kind.numa != Numa::Any {
        place(start, len, kind.numa)?;
    }
    if kind.locked {
        region._locked = Some(crate::shares::LockedBytes::take(len).ok_or(Refusal::OverLimit)?);
        // SAFETY: locks the usable part of the mapping just made in RAM; no contents
        // change. Past RLIMIT_MEMLOCK it fails with ENOMEM or EPERM, and the region is
        // unmapped on the way out.
        if unsafe { libc::mlock(start as *const libc::c_void, len as usize) } != 0 {
            return Err(Refusal::OverLimit);
        }
    }
    if let Some(guard) = guard {
        region.guard = Some(guard);
        GUARDS.lock().insert(
            guard,
            GuardPage {
                policy: policy.clone(),
                len: guard_len,
                region_start: start,
                region_len: len,
            },
        );
        GUARDED.fetch_add(1, Ordering::Relaxed);
    }
    Ok(region)
}

/// Bind `[start, start + len)` to NUMA nodes with `mbind`, before any page of it is
/// touched (the kernel places a page when it is first faulted in).
fn place(start: u64, len: u64, numa: Numa) -> Result<(), Refusal> {
    const MPOL_PREFERRED: libc::c_long = 1;
    const MPOL_BIND: libc::c_long = 2;
    const MPOL_INTERLEAVE: libc::c_long = 3;
    let nodes = online_nodes();
    let (mode, mask): (libc::c_long, u64) = match numa {
        Numa::Any => return Ok(()),
        Numa::Bind(node) | Numa::Preferred(node) => {
            if node >= 64 || nodes & (1 << node) == 0 {
                return Err(Refusal::Unavailable);
            }
            let mode = if matches!(numa, Numa::Bind(_)) {
                MPOL_BIND
            } else {
                MPOL_PREFERRED
            };
            (mode, 1 << node)
        }
        Numa::Interleave => (MPOL_INTERLEAVE, nodes),
    };
    // SAFETY: mbind reads `mask` (one word, 64 nodes) and changes the placement policy
    // of the mapping just made; no contents change.
    let done = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            start as usize,
            len as usize,
            mode,
            &mask as *const u64,
            64usize,
            0usize,
        )
    };
    if done == 0 {
        Ok(())
    } else {
        Err(Refusal::Unavailable)
    }
}

/// The NUMA nodes online, as a bit mask of the first 64 (`/sys/devices/system/node/
/// online`, e.g. `0-1,3`); node 0 alone on a machine that says nothing.
pub fn online_nodes() -> u64 {
    let listed = std::fs::read_to_string("/sys/devices/system/node/online").unwrap_or_default();
    let mut mask = 0u64;
    for part in listed.trim().split(',').filter(|p| !p.is_empty()) {
        let (first, last) = part.split_once('-').unwrap_or((part, part));
        let (Ok(first), Ok(last)) = (first.parse::<u32>(), last.parse::<u32>()) else {
            continue;
        };
        for node in first..=last.min(63) {
            mask |= 1 << node;
        }
    }
    if mask == 0 { 1 } else { mask }
}

/// A guard page of a live region, as [`guard_page_at`] reports it.
#[derive(Debug, Clone)]
pub struct GuardPage {
    /// The policy the region was mapped for.
    pub policy: Arc<str>,
    /// Bytes of the guard.
    pub len: u64,
    /// The usable region it guards.
    pub region_start: u64,
    pub region_len: u64,
}

static GUARDS: Mutex<BTreeMap<u64, GuardPage>> = Mutex::new(BTreeMap::new());
/// Guard pages live, so that a fault handler in a process that has none answers at once.
static GUARDED: AtomicUsize = AtomicUsize::new(0);

/// The guard page containing `addr`, with its start, if a live region has one there.
/// For a fault handler: it does not wait for the registry's lock (a thread that
/// faulted while holding it would wait forever) and answers none when it is taken.
pub fn guard_page_at(addr: u64) -> Option<(u64, GuardPage)> {
    if GUARDED.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let guards = GUARDS.try_lock()?;
    let (&start, page) = guards.range(..=addr).next_back()?;
    (addr < start + page.len).then(|| (start, page.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NORMAL: Kind = Kind {
        pages: Pages::Normal,
        numa: Numa::Any,
        locked: false,
        guard: Guard::None,
    };

    fn name() -> Arc<str> {
        Arc::from("test")
    }

    #[test]
    fn normal_memory_needs_no_grant_and_every_other_kind_does() {
        let none = KindGrants::default();
        assert!(map(&name(), 100, NORMAL, &none, |_| true).is_ok());
        let kinds = [
            (
                Kind {
                    pages: Pages::TransparentHuge,
                    ..NORMAL
                },
                KindGrant::HugePages,
            ),
            (
                Kind {
                    numa: Numa::Bind(0),
                    ..NORMAL
                },
                KindGrant::Numa,
            ),
            (
                Kind {
                    locked: true,
                    ..NORMAL
                },
                KindGrant::Locked,
            ),
            (
                Kind {
                    guard: Guard::After,
                    ..NORMAL
                },
                KindGrant::Guarded,
            ),
        ];
        for (kind, grant) in kinds {
            let refused = map(&name(), 100, kind, &none, |_| true).unwrap_err();
            assert_eq!(refused, Refusal::NotGranted(grant));
            let mut granted = KindGrants::default();
            granted.grant(grant);
            // Granted, it is mapped or refused by the machine (no such node, a lock
            // limit), never for want of a grant.
            let answer = map(&name(), 100, kind, &granted, |_| true);
            assert!(!matches!(answer, Err(Refusal::NotGranted(_))), "{grant}");
        }
    }

    #[test]
    fn a_guard_page_is_registered_while_its_region_lives() {
        let grants = KindGrants::from_iter([KindGrant::Guarded]);
        let kind = Kind {
            guard: Guard::After,
            ..NORMAL
        };
        let region = map(&name(), 1000, kind, &grants, |_| true).unwrap();
        let end = region.start + region.len;
        assert_eq!(region.len, base_page());
        let (start, page) = guard_page_at(end + 1).expect("registered");
        assert_eq!((start, &*page.policy), (end, "test"));
        assert!(guard_page_at(region.start).is_none());
        drop(region);
        assert!(guard_page_at(end + 1).is_none());
    }

    #[test]
    fn a_region_past_the_budget_is_over_limit_and_its_cost_counts_the_guard() {
        let grants = KindGrants::from_iter([KindGrant::Guarded]);
        let kind = Kind {
            guard: Guard::Before,
            ..NORMAL
        };
        assert_eq!(
            map(&name(), 1, kind, &grants, |_| false).unwrap_err(),
            Refusal::OverLimit
        );
        let region = map(&name(), 1, kind, &grants, |_| true).unwrap();
        assert_eq!(region.cost(), 2 * base_page());
    }

    #[test]
    fn a_transparent_huge_region_starts_on_a_huge_page() {
        let grants = KindGrants::from_iter([KindGrant::HugePages]);
        let kind = Kind {
            pages: Pages::TransparentHuge,
            ..NORMAL
        };
        for _ in 0..4 {
            let region = map(&name(), 3 << 20, kind, &grants, |_| true).unwrap();
            assert_eq!(region.start % transparent_huge_page(), 0);
            assert_eq!(region.len, 3 << 20);
            // SAFETY: the region is mapped, writable and this test's alone.
            unsafe { std::ptr::write_bytes(region.start as *mut u8, 1, region.len as usize) };
        }
    }

    #[test]
    fn grant_names_are_the_documented_ones() {
        let grants = KindGrants::from_names(["numa", "guarded"]).unwrap();
        let granted: Vec<_> = KindGrant::ALL
            .into_iter()
            .filter(|&kind| grants.granted(kind))
            .collect();
        assert_eq!(granted, [KindGrant::Numa, KindGrant::Guarded]);
        let err = KindGrants::from_names(["gpu"]).unwrap_err();
        assert!(err.to_string().contains("`gpu` is not a kind"));
    }

    #[test]
    fn a_node_the_machine_lacks_is_unavailable() {
        let grants = KindGrants::from_iter([KindGrant::Numa]);
        let kind = Kind {
            numa: Numa::Bind(63),
            ..NORMAL
        };
        if online_nodes() & (1 << 63) == 0 {
            assert_eq!(
                map(&name(), 1, kind, &grants, |_| true).unwrap_err(),
                Refusal::Unavailable
            );
        }
    }
}
