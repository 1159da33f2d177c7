//! Regions of GPU memory kinds: `pinned` (ordinary pages, registered with the driver so
//! copies to and from a GPU run as DMA) and `device` (memory on a GPU, which no host
//! code reads or writes). Both are taken from the policies' process-wide shares
//! ([`crate::shares`]) before the driver is asked, and count against the asking
//! policy's overhead budget like any region.

use std::sync::Arc;

use super::{Guard, Kind, KindGrant, KindGrants, Numa, Pages, Refusal, Region, base_page, map};
use crate::gpu::{DEVICE_ALIGNMENT, Gpu, GpuError};
use crate::shares::{DeviceBytes, PinnedBytes};

/// What a region holds of a GPU, given back when the region is dropped.
#[derive(Debug)]
pub(super) enum Held {
    Pinned {
        gpu: Gpu,
        _share: PinnedBytes,
    },
    Device {
        gpu: Gpu,
        device: u32,
        _share: DeviceBytes,
    },
}

impl Held {
    /// Give what the region at `start` holds back to the driver: true when host pages
    /// remain to be unmapped (pinned), false when it was device memory.
    pub(super) fn release(&self, start: u64) -> bool {
        match self {
            Held::Pinned { gpu, .. } => {
                // SAFETY: the region registered `start` when it was made, and is dropped
                // once.
                unsafe { gpu.0.unregister(start) };
                true
            }
            Held::Device { gpu, device, .. } => {
                // SAFETY: `start` is the device memory the region was made with, given
                // back once, when the region (no block lent from it live) is dropped.
                unsafe { gpu.0.free(*device, start) };
                false
            }
        }
    }
}

fn refusal(e: GpuError) -> Refusal {
    match e {
        GpuError::Unavailable(_) => Refusal::Unavailable,
        GpuError::OutOfMemory | GpuError::Driver { .. } => Refusal::OutOfMemory,
    }
}

/// Map a region of at least `size` bytes of ordinary pages for `policy` and register it
/// with `gpu`'s driver.
pub(crate) fn map_pinned(
    policy: &Arc<str>,
    size: u64,
    grants: &KindGrants,
    gpu: &Gpu,
    cost_allowed: impl FnOnce(u64) -> bool,
) -> Result<Region, Refusal> {
    if !grants.pinned {
        return Err(Refusal::NotGranted(KindGrant::Pinned));
    }
    let len = size
        .max(1)
        .checked_next_multiple_of(base_page())
        .ok_or(Refusal::OutOfMemory)?;
    let share = PinnedBytes::take(len).ok_or(Refusal::OverLimit)?;
    let pages = Kind {
        pages: Pages::Normal,
        numa: Numa::Any,
        locked: false,
        guard: Guard::None,
    };
    let mut region = map(policy, size, pages, grants, cost_allowed)?;
    // SAFETY: the region's pages were just mapped, page-aligned, and stay mapped until
    // the region is dropped, which unregisters them first (`Held::release`).
    unsafe { gpu.0.register(region.start, region.len) }.map_err(refusal)?;
    region.gpu = Some(Held::Pinned {
        gpu: gpu.clone(),
        _share: share,
    });
    Ok(region)
}

/// Allocate a region of at least `size` bytes of memory on GPU `device`.
pub(crate) fn map_device(
    size: u64,
    device: u32,
    grants: &KindGrants,
    gpu: &Gpu,
    cost_allowed: impl FnOnce(u64) -> bool,
) -> Result<Region, Refusal> {
    if !grants.device {
        return Err(Refusal::NotGranted(KindGrant::Device));
    }
    let len = size
        .max(1)
        .checked_next_multiple_of(DEVICE_ALIGNMENT)
        .ok_or(Refusal::OutOfMemory)?;
    let (free, _) = gpu.memory(device).map_err(refusal)?;
    if !cost_allowed(len) {
        return Err(Refusal::OverLimit);
    }
    let share = DeviceBytes::take(device, len, || free).ok_or(Refusal::OverLimit)?;
    let start = gpu.0.alloc(device, len).map_err(refusal)?;
    Ok(Region {
        start,
        len,
        asked: size,
        map_start: start,
        map_len: len,
        guard: None,
        _mappings: None,
        _locked: None,
        gpu: Some(Held::Device {
            gpu: gpu.clone(),
            device,
            _share: share,
        }),
    })
}
