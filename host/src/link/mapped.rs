//! The host side of the 0.2.0 policy world: its allocator and bytes are 0.1.0's (the
//! same checks serve both), `memory` maps regions of granted kinds straight from the
//! operating system, around the links below (their ledgers never see them), and
//! `diagnostics` records a client's misuse the policy found.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::LinkState;
use super::bindings::allocbox::policy as v1;
use super::bindings_v2::allocbox::policy::{allocator, bytes, diagnostics, memory};
use crate::error::Call;
use crate::gpu::{Gpu, Placement};
use crate::ledger::TakeBack;
use crate::mapped::{self as os, KindGrant, KindGrants, Region};

/// A client's misuse of a block, as its policy reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientMisuse {
    /// The policy that reported it.
    pub policy: Arc<str>,
    pub block: u64,
    /// The block's size as allocated.
    pub size: u64,
    /// Where, from the block's start.
    pub offset: u64,
    /// The policy's sentence, escaped.
    pub message: String,
}

impl ClientMisuse {
    /// Reports kept per policy; older ones are counted only.
    pub const KEPT: usize = 16;
    /// Longest message kept, in bytes.
    const MESSAGE_BYTES: usize = 256;
}

impl std::fmt::Display for ClientMisuse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "policy `{}` reports its client misused the {}-byte block at {:#x}, at offset {}: {}",
            self.policy, self.size, self.block, self.offset, self.message
        )
    }
}

/// One link's regions of mapped memory and the misuse its policy reported.
#[derive(Debug, Default)]
pub(super) struct Mapped {
    grants: KindGrants,
    gpu: Gpu,
    regions: BTreeMap<u64, Region>,
    /// Host memory the regions take, guard pages included.
    cost: u64,
    /// Regions unmapped during the policy's own realloc that hold the client's block in
    /// transit: kept mapped until the answer is admitted, as upstream memory is held
    /// back ([`super::Transit`]).
    held_back: Vec<Region>,
    /// Regions refused because their kind was not granted, by [`KindGrant::ALL`]'s order.
    ungranted: [u64; KindGrant::ALL.len()],
    /// Why the latest request for GPU memory (pinned or device) was refused as
    /// unavailable: no driver, no such device, a driver that will not start.
    gpu_unavailable: Option<String>,
    misuse_total: u64,
    recent: Vec<ClientMisuse>,
    /// Reports not yet taken by [`Mapped::take_new_misuse`] (at most [`ClientMisuse::KEPT`]).
    new: Vec<ClientMisuse>,
}

impl Mapped {
    pub(super) fn new(grants: KindGrants, gpu: Gpu) -> Self {
        Mapped {
            grants,
            gpu,
            ..Mapped::default()
        }
    }

    pub(super) fn regions(&self) -> usize {
        self.regions.len()
    }

    pub(super) fn bytes(&self) -> u64 {
        self.regions.values().map(|r| r.len).sum()
    }

    pub(super) fn cost(&self) -> u64 {
        self.cost
    }

    /// The region `[at, at+len)` lies in, `(start, len)`, and where its memory is.
    pub(super) fn containing(&self, at: u64, len: u64) -> Option<(u64, u64, Placement)> {
        let (&start, region) = self.regions.range(..=at).next_back()?;
        let end = at.checked_add(len)?;
        (end <= start + region.len).then_some((start, region.len, region.placement()))
    }

    /// Unmap every region for which `clear(start, len)` says no block lent from it is
    /// live (a stopped link's, whose client keeps only the blocks it holds).
    pub(super) fn unmap_where(&mut self, mut clear: impl FnMut(u64, u64) -> bool) {
        let regions = std::mem::take(&mut self.regions);
        for (start, region) in regions {
            if clear(start, region.len) {
                self.cost -= region.cost();
            } else {
                self.regions.insert(start, region);
            }
        }
    }

    pub(super) fn unmap_all(&mut self) {
        self.end_transit(false);
        self.regions.clear();
        self.cost = 0;
    }

    /// The first region held back in the current realloc, `(start, asked size)`.
    pub(super) fn first_held_back(&self) -> Option<(u64, u64)> {
        self.held_back.first().map(|r| (r.start, r.asked))
    }

    /// The realloc's transit ended: unmap the regions held back (`release`, the answer
    /// was admitted), or put them back on the books (the client keeps its old block).
    pub(super) fn end_transit(&mut self, release: bool) {
        for region in std::mem::take(&mut self.held_back) {
            if release {
                self.cost -= region.cost();
            } else {
                self.regions.insert(region.start, region);
            }
        }
    }

    pub(super) fn misuse_total(&self) -> u64 {
        self.misuse_total
    }

    /// Each kind a region was refused for because it was not granted, with how many.
    pub(super) fn ungranted(&self) -> Vec<(KindGrant, u64)> {
        KindGrant::ALL
            .into_iter()
            .zip(self.ungranted)
            .filter(|&(_, refused)| refused > 0)
            .collect()
    }

    pub(super) fn gpu_unavailable(&self) -> Option<&str> {
        self.gpu_unavailable.as_deref()
    }

    pub(super) fn recent_misuse(&self) -> &[ClientMisuse] {
        &self.recent
    }

    pub(super) fn take_new_misuse(&mut self) -> Vec<ClientMisuse> {
        std::mem::take(&mut self.new)
    }

    fn record(&mut self, misuse: ClientMisuse) {
        self.misuse_total += 1;
        for kept in [&mut self.recent, &mut self.new] {
            if kept.len() == ClientMisuse::KEPT {
                kept.remove(0);
            }
            kept.push(misuse.clone());
        }
    }
}

impl LinkState {
    /// The memory this policy holds that `[at, at+len)` lies in, `(start, len)`, and
    /// where that memory is: an upstream block (in the upstream's placement), or a
    /// mapped region.
    pub(super) fn owned_containing(&mut self, at: u64, len: u64) -> Option<(u64, u64, Placement)> {
        let upstream = self.upstream_placement();
        self.upstream
            .lent_mut()
            .nearby()
            .containing(at, len)
            .map(|(start, len)| (start, len, upstream))
            .or_else(|| self.mapped.containing(at, len))
    }

    /// A region of GPU kind `kind`, or why not. A request refused as unavailable: the
    /// GPU says why (asked only then).
    fn map_gpu_region(&mut self, size: u64, kind: KindGrant) -> Result<u64, memory::Refusal> {
        let (grants, gpu, place) = (self.mapped.grants, self.mapped.gpu.clone(), self.place);
        let name = self.sandbox.name.clone();
        let region = os::map_gpu(&name, size, kind, place, &grants, &gpu, |cost| {
            self.within_budget(cost)
        });
        if let Err(os::Refusal::Unavailable) = region
            && let Err(why) = gpu.memory(place.driver_device())
        {
            self.mapped.gpu_unavailable = Some(why.to_string());
        }
        self.mapped_or_refused(region)
    }

    /// Record a region just mapped, or why none was.
    fn mapped_or_refused(
        &mut self,
        region: Result<Region, os::Refusal>,
    ) -> Result<u64, memory::Refusal> {
        match region {
            Ok(region) => {
                let start = region.start;
                self.mapped.cost += region.cost();
                self.mapped.regions.insert(start, region);
                Ok(start)
            }
            Err(refusal) => Err(match refusal {
                os::Refusal::NotGranted(grant) => {
                    let kind = KindGrant::ALL.iter().position(|&g| g == grant);
                    let refused = &mut self.mapped.ungranted[kind.expect("one of ALL")];
                    *refused = refused.saturating_add(1);
                    memory::Refusal::NotGranted
                }
                os::Refusal::Unavailable => memory::Refusal::Unavailable,
                os::Refusal::OverLimit => memory::Refusal::OverLimit,
                os::Refusal::OutOfMemory => memory::Refusal::OutOfMemory,
            }),
        }
    }
}

fn kind_of(kind: memory::Kind) -> os::Kind {
    os::Kind {
        pages: pages_of(kind.pages),
        numa: match kind.numa {
            memory::Numa::Any => os::Numa::Any,
            memory::Numa::Bind(node) => os::Numa::Bind(node),
            memory::Numa::Interleave => os::Numa::Interleave,
            memory::Numa::Preferred(node) => os::Numa::Preferred(node),
        },
        locked: kind.locked,
        guard: match kind.guard {
            memory::Guard::None => os::Guard::None,
            memory::Guard::After => os::Guard::After,
            memory::Guard::Before => os::Guard::Before,
        },
    }
}

fn pages_of(pages: memory::Pages) -> os::Pages {
    match pages {
        memory::Pages::Normal => os::Pages::Normal,
        memory::Pages::TransparentHuge => os::Pages::TransparentHuge,
        memory::Pages::Hugetlb => os::Pages::Hugetlb,
    }
}

impl memory::Host for LinkState {
    fn map_region(
        &mut self,
        size: u64,
        kind: memory::Kind,
    ) -> wasmtime::Result<Result<u64, memory::Refusal>> {
        self.on_time(Call::MemoryMap)?;
        let grants = self.mapped.grants;
        let name = self.sandbox.name.clone();
        let region = os::map(&name, size, kind_of(kind), &grants, |cost| {
            self.within_budget(cost)
        });
        Ok(self.mapped_or_refused(region))
    }

    fn map_gpu(
        &mut self,
        size: u64,
        kind: memory::GpuKind,
    ) -> wasmtime::Result<Result<u64, memory::Refusal>> {
        self.on_time(Call::MemoryMapGpu)?;
        let kind = match kind {
            memory::GpuKind::Pinned => KindGrant::Pinned,
            memory::GpuKind::Device => KindGrant::Device,
        };
        Ok(self.map_gpu_region(size, kind))
    }

    fn map_pinned(&mut self, size: u64) -> wasmtime::Result<Result<u64, memory::Refusal>> {
        self.on_time(Call::MemoryMapPinned)?;
        Ok(self.map_gpu_region(size, KindGrant::Pinned))
    }

    fn map_device(&mut self, size: u64) -> wasmtime::Result<Result<u64, memory::Refusal>> {
        self.on_time(Call::MemoryMapDevice)?;
        Ok(self.map_gpu_region(size, KindGrant::Device))
    }

    fn unmap_region(&mut self, addr: u64, size: u64) -> wasmtime::Result<()> {
        self.on_time(Call::MemoryUnmap)?;
        let Some(region) = self.mapped.regions.get(&addr) else {
            return Err(self.caller_fault(Call::MemoryUnmap, addr, size, TakeBack::Unknown));
        };
        if region.asked != size {
            let recorded = region.asked;
            let fault = TakeBack::WrongSize { recorded };
            return Err(self.caller_fault(Call::MemoryUnmap, addr, size, fault));
        }
        let len = region.len;
        self.check_nothing_lent_inside(Call::MemoryUnmap, addr, len)?;
        let Some(region) = self.mapped.regions.remove(&addr) else {
            unreachable!("found above");
        };
        if self.transit.under_block(addr, len) {
            // The block the policy's realloc is resizing lies in it: the client's bytes
            // stay mapped until the answer is admitted.
            self.mapped.held_back.push(region);
        } else {
            self.mapped.cost -= region.cost();
        }
        // A clearance may lie in the region just unmapped.
        self.clearance = None;
        self.zeroed.forget(addr, len);
        Ok(())
    }

    fn page_size(&mut self, pages: memory::Pages) -> wasmtime::Result<u64> {
        Ok(os::page_size(pages_of(pages)))
    }
}

impl diagnostics::Host for LinkState {
    fn client_misuse(
        &mut self,
        block: u64,
        size: u64,
        offset: u64,
        message: String,
    ) -> wasmtime::Result<()> {
        self.on_time(Call::ClientMisuse)?;
        // Cut before escaping: a policy may send a message as long as a host call
        // allows, and only the first bytes are kept.
        let mut cut = message.len().min(ClientMisuse::MESSAGE_BYTES);
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        let mut kept = crate::untrusted::escape(&message[..cut]);
        if cut < message.len() {
            kept.push('…');
        }
        let misuse = ClientMisuse {
            policy: self.sandbox.name.clone(),
            block,
            size,
            offset,
            message: kept,
        };
        // The embedder is handed each report (`Handler::take_client_misuse`); a policy
        // that reports in a loop must not flood the log too.
        log::debug!("{misuse}");
        self.mapped.record(misuse);
        Ok(())
    }
}

/// 0.2.0's allocator import is 0.1.0's: the same checks.
impl allocator::Host for LinkState {
    fn malloc(&mut self, size: u64) -> wasmtime::Result<u64> {
        v1::allocator::Host::malloc(self, size)
    }
    fn calloc(&mut self, nelem: u64, elsize: u64) -> wasmtime::Result<u64> {
        v1::allocator::Host::calloc(self, nelem, elsize)
    }
    fn realloc(&mut self, ptr: u64, old: u64, new: u64) -> wasmtime::Result<u64> {
        v1::allocator::Host::realloc(self, ptr, old, new)
    }
    fn free(&mut self, ptr: u64, size: u64) -> wasmtime::Result<()> {
        v1::allocator::Host::free(self, ptr, size)
    }
    fn malloc_many(&mut self, size: u64, count: u32) -> wasmtime::Result<Vec<u64>> {
        v1::allocator::Host::malloc_many(self, size, count)
    }
    fn free_many(&mut self, ptrs: Vec<u64>, size: u64) -> wasmtime::Result<()> {
        v1::allocator::Host::free_many(self, ptrs, size)
    }
}

/// 0.2.0's bytes import is 0.1.0's: the same checks.
impl bytes::Host for LinkState {
    fn read(&mut self, at: u64, len: u32) -> wasmtime::Result<Vec<u8>> {
        v1::bytes::Host::read(self, at, len)
    }
    fn write(&mut self, at: u64, data: Vec<u8>) -> wasmtime::Result<()> {
        v1::bytes::Host::write(self, at, data)
    }
    fn fill(&mut self, at: u64, len: u64, byte: u8) -> wasmtime::Result<()> {
        v1::bytes::Host::fill(self, at, len, byte)
    }
    fn copy(&mut self, dst: u64, src: u64, len: u64) -> wasmtime::Result<()> {
        v1::bytes::Host::copy(self, dst, src, len)
    }
    fn read_u64(&mut self, at: u64) -> wasmtime::Result<u64> {
        v1::bytes::Host::read_u64(self, at)
    }
    fn write_u64(&mut self, at: u64, value: u64) -> wasmtime::Result<()> {
        v1::bytes::Host::write_u64(self, at, value)
    }
}
