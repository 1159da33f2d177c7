//! `allocbox.cuda.StandInGpu`: a GPU made of host memory, for machines without one,
//! which both kinds of handler take (`load(..., gpu=)` for pinned memory, and
//! `allocbox.cuda.load` for device memory).

use std::sync::Arc;

use allocbox::gpu::{Gpu, StandIn, Stream};
use pyo3::prelude::*;

/// A GPU made of host memory (see `allocbox::gpu::StandIn`): its streams finish only
/// when told to, so that stream-ordered frees can be watched.
#[pyclass(frozen, module = "allocbox")]
pub(crate) struct StandInGpu {
    stand_in: Arc<StandIn>,
    gpu: Gpu,
}

impl StandInGpu {
    pub(crate) fn gpu(&self) -> Gpu {
        self.gpu.clone()
    }
}

#[pymethods]
impl StandInGpu {
    #[new]
    #[pyo3(signature = (devices = 1, memory = 1 << 30))]
    fn new(devices: u32, memory: u64) -> Self {
        let stand_in = Arc::new(StandIn::new(devices, memory));
        StandInGpu {
            gpu: Gpu::stand_in(stand_in.clone()),
            stand_in,
        }
    }

    /// Work is queued on `stream`: frees on it wait until `finish`.
    #[pyo3(signature = (stream, device = 0))]
    fn queue(&self, stream: Stream, device: u32) {
        self.stand_in.queue(device, stream);
    }

    /// Every piece of work queued on `stream` has finished.
    #[pyo3(signature = (stream, device = 0))]
    fn finish(&self, stream: Stream, device: u32) {
        self.stand_in.finish(device, stream);
    }

    /// Bytes of device memory the driver has lent now.
    #[pyo3(signature = (device = 0))]
    fn allocated(&self, device: u32) -> u64 {
        self.stand_in.allocated(device)
    }

    /// Host bytes registered (pinned) now.
    fn registered(&self) -> u64 {
        self.stand_in.registered()
    }
}
