//! Regions of the GPU kinds (`memory.map-gpu`), made as each kind's row says
//! ([`super::GpuRow`]): host pages registered with the driver (`pinned`, copies to and
//! from a GPU run as DMA) or memory the driver allocates (`device`, on a GPU, which no
//! host code reads or writes). Each is taken from its process-wide share
//! ([`crate::shares`]) before the driver is asked. A region of host pages counts
//! against the asking policy's overhead budget like any region; a GPU's own memory does
//! not (it is no host memory): what a device policy caches is bounded by the GPU's share.

use std::sync::Arc;

use super::{
    GpuRow, Guard, Kind, KindGrant, KindGrants, MadeBy, Maps, Numa, Pages, Refusal, Region, Share,
    base_page, map,
};
use crate::gpu::{DEVICE_ALIGNMENT, Gpu, GpuError, Placement};
use crate::shares::{DeviceBytes, PinnedBytes};

/// What a region holds of a GPU, given back when the region is dropped.
#[derive(Debug)]
pub(super) struct Held {
    gpu: Gpu,
    kind: KindGrant,
    row: GpuRow,
    device: u32,
    _share: Taken,
}

/// A share taken for a region's bytes, given back when dropped.
#[derive(Debug)]
#[expect(dead_code, reason = "held only to be dropped with the region")]
enum Taken {
    Pinned(PinnedBytes),
    Device(DeviceBytes),
}

impl Held {
    /// Whether its bytes are host memory (pinned pages), which a policy's overhead
    /// budget counts; a GPU's own memory is bounded by the GPU's share instead.
    pub(super) fn is_host_memory(&self) -> bool {
        self.row.host_memory
    }

    /// Give what the region at `start` holds back to the driver: true when host pages
    /// remain to be unmapped.
    pub(super) fn release(&self, start: u64) -> bool {
        match self.row.made_by {
            MadeBy::HostRegistered => {
                // SAFETY: the region registered `start` when it was made, and is dropped
                // once.
                unsafe { self.gpu.0.unregister(self.kind, start) };
                true
            }
            MadeBy::Driver => {
                // SAFETY: `start` is the memory the driver allocated for the region, given
                // back once, when the region (no block lent from it live) is dropped.
                unsafe { self.gpu.0.free(self.kind, self.device, start) };
                false
            }
        }
    }

    /// Where the region's bytes are.
    pub(super) fn placement(&self) -> Placement {
        if self.row.host_memory {
            Placement::Host
        } else {
            Placement::Device(self.device)
        }
    }
}

fn refusal(e: GpuError) -> Refusal {
    match e {
        GpuError::Unavailable(_) => Refusal::Unavailable,
        GpuError::OutOfMemory | GpuError::Driver { .. } => Refusal::OutOfMemory,
    }
}

/// Take `len` bytes from `share` (of GPU `device`'s, for [`Share::Device`]).
fn take(share: Share, device: u32, len: u64, gpu: &Gpu) -> Result<Taken, Refusal> {
    match share {
        Share::Pinned => PinnedBytes::take(len).map(Taken::Pinned),
        // What the GPU has free is read once, when its share is first set.
        Share::Device => DeviceBytes::take(device, len, || {
            gpu.memory(device).map_or(0, |(free, _)| free)
        })
        .map(Taken::Device),
    }
    .ok_or(Refusal::OverLimit)
}

/// Map a region of at least `size` bytes of GPU kind `kind` for `policy`, a policy of a
/// handler whose blocks are in `place`.
pub(crate) fn map_gpu(
    policy: &Arc<str>,
    size: u64,
    kind: KindGrant,
    place: Placement,
    grants: &KindGrants,
    gpu: &Gpu,
    cost_allowed: impl FnOnce(u64) -> bool,
) -> Result<Region, Refusal> {
    let Maps::Gpu(row) = kind.row().maps else {
        return Err(Refusal::Unavailable);
    };
    if !grants.granted(kind) {
        return Err(Refusal::NotGranted(kind));
    }
    if place == Placement::Host && !row.host_memory {
        // A host handler's client reads and writes its blocks: memory it cannot touch
        // could only ever be a wrong answer.
        return Err(Refusal::Unavailable);
    }
    let device = place.driver_device();
    let held = |share| Held {
        gpu: gpu.clone(),
        kind,
        row,
        device,
        _share: share,
    };
    match row.made_by {
        MadeBy::HostRegistered => {
            let len = size
                .max(1)
                .checked_next_multiple_of(base_page())
                .ok_or(Refusal::OutOfMemory)?;
            let share = take(row.share, device, len, gpu)?;
            let pages = Kind {
                pages: Pages::Normal,
                numa: Numa::Any,
                locked: false,
                guard: Guard::None,
            };
            let mut region = map(policy, size, pages, grants, cost_allowed)?;
            // SAFETY: the region's pages were just mapped, page-aligned, and stay mapped
            // until the region is dropped, which unregisters them first (`Held::release`).
            unsafe { gpu.0.register(kind, region.start, region.len) }.map_err(refusal)?;
            region.gpu = Some(held(share));
            Ok(region)
        }
        MadeBy::Driver => {
            let len = size
                .max(1)
                .checked_next_multiple_of(DEVICE_ALIGNMENT)
                .ok_or(Refusal::OutOfMemory)?;
            // Asked first: without a driver the answer is `unavailable`, not a budget.
            gpu.memory(device).map_err(refusal)?;
            if !cost_allowed(len) {
                return Err(Refusal::OverLimit);
            }
            let share = take(row.share, device, len, gpu)?;
            let start = gpu.0.alloc(kind, device, len).map_err(refusal)?;
            Ok(Region {
                start,
                len,
                asked: size,
                map_start: start,
                map_len: len,
                guard: None,
                _mappings: None,
                _locked: None,
                gpu: Some(held(share)),
            })
        }
    }
}
