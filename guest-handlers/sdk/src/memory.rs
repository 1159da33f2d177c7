//! Memory of a kind only the host can make, mapped for this policy straight from the
//! operating system or a GPU's driver: huge pages, NUMA placement, locked pages, guard
//! pages ([`map`]), pinned host pages and a GPU's memory ([`map_gpu`]).
//! Each kind must be granted by the embedder (`numa`, `huge-pages`, `locked`,
//! `guarded`, `pinned`, `device`); without the grant the call answers
//! [`Refusal::NotGranted`] and the policy goes on.
//!
//! A region is page-aligned and zero-filled; the policy holds it as it holds an
//! upstream block (lend blocks inside it, touch its bytes through
//! [`bytes`](crate::bytes)) until it gives it back with [`unmap`] and the size it asked
//! for. A guard page is never part of the region: no one may touch it.

use crate::bindings::allocbox::policy::memory as imports;
pub use crate::bindings::allocbox::policy::memory::{GpuKind, Guard, Kind, Numa, Pages, Refusal};

impl Kind {
    /// Ordinary pages, anywhere, not locked, unguarded: needs no grant.
    pub const NORMAL: Kind = Kind {
        pages: Pages::Normal,
        numa: Numa::Any,
        locked: false,
        guard: Guard::None,
    };
}

/// A region of at least `size` bytes of `kind`: its start, page-aligned, or why not.
#[inline]
pub fn map(size: u64, kind: Kind) -> Result<u64, Refusal> {
    imports::map_region(size, kind)
}

/// Give back the region at `addr`, mapped with `size`; no block lent from it may be live.
#[inline]
pub fn unmap(addr: u64, size: u64) {
    imports::unmap_region(addr, size)
}

/// The size of one page of `pages` here (0 when the machine has none): the unit a
/// region's size is rounded up to.
#[inline]
pub fn page_size(pages: Pages) -> u64 {
    imports::page_size(pages)
}

/// The bytes a region of `size` bytes of `pages` really holds: `size` rounded up to
/// whole pages (0 when the machine has no such pages).
pub fn region_size(size: u64, pages: Pages) -> u64 {
    match page_size(pages) {
        0 => 0,
        page => size.max(1).next_multiple_of(page),
    }
}

/// A region of at least `size` bytes of `kind` from the GPU driver, or why not:
/// [`GpuKind::Pinned`], ordinary pages registered with the driver (host memory like any
/// region, which copies to and from a GPU reach at full speed), or [`GpuKind::Device`],
/// memory (rounded up to 256 bytes) on the GPU the handler serves, whose blocks the
/// policy lends as in host memory but never touches (a [`bytes`](crate::bytes) call on
/// it stops the policy; [`Refusal::Unavailable`] in a handler of host memory). Each
/// needs its grant; [`Refusal::Unavailable`] without a GPU driver. Given back with
/// [`unmap`].
#[inline]
pub fn map_gpu(size: u64, kind: GpuKind) -> Result<u64, Refusal> {
    imports::map_gpu(size, kind)
}
