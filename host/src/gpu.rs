//! GPUs, for the memory kinds `device` (memory on the GPU a handler serves) and `pinned`
//! (host pages registered with the driver, so copies to and from the GPU run at full
//! speed), and the events that tell when the work queued on a stream has finished.
//!
//! Two backends: the CUDA driver, loaded at run time (`gpu/driver.rs`: nothing links
//! against CUDA, and a machine without a driver answers every request `unavailable`
//! with the reason), and the stand-in (`gpu/stand_in.rs`): host memory that the host
//! treats as device memory, with streams a test finishes by hand, so that the policy,
//! the ledger and stream-ordered frees are checked on machines without a GPU.
//!
//! The invariants this layer keeps (ARCHITECTURE.md's map names them in short):
//! Nothing links against CUDA: the driver is loaded when a GPU is first used, and
//! without one every request is `unavailable` with the reason. A handler has a
//! `Placement` (host memory, or GPU `n` for a `DeviceHandler`), and so has every
//! stretch of memory a link holds: an upstream block is in its upstream's placement
//! (the host's memory is host memory; a link below serves the same client), a
//! region in its own (`map-gpu`'s `device` regions are GPU memory, its `pinned`
//! ones host memory). An answer must lie in memory of the link's placement
//! (`Rule::WrongMemory`), a `bytes` access in host memory (`Rule::DeviceBytes`); a
//! clearance carries the placement it was found in, so the fast paths keep both
//! rules. Device memory is mapped only in a device handler, whose `calloc` and
//! `realloc` are refused (the host never zeroes or copies GPU memory) and which has
//! no fallback. A client's free names the streams that may still use the block:
//! `DeviceHandler` records an event on each and gives the block back to its policy
//! only once all have completed (looked at on every call, waited for when the
//! policy has nothing left). Device and pinned bytes come from process-wide shares
//! (`shares.rs`: 3/4 of what a GPU had free, 1/4 of the machine's memory).

mod driver;
mod stand_in;

use std::sync::Arc;

pub use stand_in::StandIn;

use crate::kind::KindGrant;

/// Where a handler's blocks live: in host memory, or on a GPU, which the host never
/// reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    Host,
    Device(u32),
}

impl Placement {
    /// The GPU whose driver serves memory for this placement: its own, or GPU 0 for
    /// host memory (pinned pages are registered for every GPU through it).
    pub(crate) fn driver_device(self) -> u32 {
        match self {
            Placement::Device(device) => device,
            Placement::Host => 0,
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Host => f.write_str("host memory"),
            Placement::Device(n) => write!(f, "memory of GPU {n}"),
        }
    }
}

/// A stream of work on a GPU, as the driver names it (a `CUstream`); 0 is the default
/// stream, which waits for the work of every other blocking stream.
pub type Stream = u64;

/// Why a GPU could not do what was asked; each reads as a sentence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// No driver, no such device, or a driver that refuses to start: the reason.
    #[error("{0}")]
    Unavailable(String),
    #[error("the GPU has no memory left for the request")]
    OutOfMemory,
    /// The driver answered an error code: the call and the driver's own words.
    #[error("the CUDA driver failed in {call}: {message}")]
    Driver { call: &'static str, message: String },
}

/// An event recorded on a stream: complete once the work queued on the stream before it
/// has finished.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) device: u32,
    pub(crate) handle: u64,
}

/// What a GPU backend does for the host.
pub(crate) trait Backend: Send + Sync {
    /// The backend's name in messages.
    fn name(&self) -> &'static str;
    /// Memory on `device`: `(free, total)` bytes; an error when there is no such device.
    fn memory(&self, device: u32) -> Result<(u64, u64), GpuError>;
    /// `size` bytes of `kind` (a kind the driver makes: [`crate::kind::MadeBy::Driver`]) on
    /// `device`, aligned to at least [`DEVICE_ALIGNMENT`].
    fn alloc(&self, kind: KindGrant, device: u32, size: u64) -> Result<u64, GpuError>;
    /// Give back memory `alloc` answered.
    ///
    /// # Safety
    ///
    /// `addr` was answered by `alloc` for `kind` on `device`, is given back once, and
    /// nothing uses it afterwards.
    unsafe fn free(&self, kind: KindGrant, device: u32, addr: u64);
    /// Register `[addr, addr+len)` of host memory with the driver as `kind` (a kind made
    /// of host pages: [`crate::kind::MadeBy::HostRegistered`]).
    ///
    /// # Safety
    ///
    /// The range is mapped host memory the caller owns, page-aligned, and stays mapped
    /// until `unregister`.
    unsafe fn register(&self, kind: KindGrant, addr: u64, len: u64) -> Result<(), GpuError>;
    /// Undo `register`.
    ///
    /// # Safety
    ///
    /// `addr` starts a range `register` registered as `kind`, unregistered once.
    unsafe fn unregister(&self, kind: KindGrant, addr: u64);
    /// An event on `stream` of `device`, after the work queued on it so far.
    fn record(&self, device: u32, stream: Stream) -> Result<Event, GpuError>;
    /// Has the work before `event` finished? A driver error counts as not finished: the
    /// memory waits rather than risk a kernel still using it.
    fn finished(&self, event: &Event) -> bool;
    /// Wait until the work before `event` has finished.
    fn wait(&self, event: &Event);
    /// Wait until every stream of `device` is idle (when an event could not be recorded).
    fn wait_idle(&self, device: u32);
    /// The event is no longer needed.
    fn release(&self, event: Event);
}

/// Device memory is aligned at least this much (CUDA's allocation guarantee, which the
/// stand-in keeps too); a device region's size is rounded up to it.
pub const DEVICE_ALIGNMENT: u64 = 256;

/// A GPU backend: the CUDA driver ([`Gpu::cuda`], the default) or a stand-in
/// ([`Gpu::stand_in`]). Cheap to clone; two are equal when they are the same backend.
#[derive(Clone)]
pub struct Gpu(pub(crate) Arc<dyn Backend>);

impl Gpu {
    /// The process's CUDA driver, loaded the first time one is asked for. Without a
    /// driver every request is `unavailable`, with the reason.
    pub fn cuda() -> Gpu {
        driver::shared()
    }

    /// A GPU backend over host memory: see [`StandIn`].
    pub fn stand_in(stand_in: Arc<StandIn>) -> Gpu {
        Gpu(stand_in)
    }

    /// The backend's name, for messages.
    pub fn name(&self) -> &'static str {
        self.0.name()
    }

    /// `(free, total)` bytes of memory on `device`.
    pub fn memory(&self, device: u32) -> Result<(u64, u64), GpuError> {
        self.0.memory(device)
    }
}

impl Default for Gpu {
    fn default() -> Self {
        Gpu::cuda()
    }
}

impl PartialEq for Gpu {
    fn eq(&self, other: &Gpu) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Gpu {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Gpu").field(&self.0.name()).finish()
    }
}
