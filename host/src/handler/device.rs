//! A handler of GPU memory, and the host's half of stream order: a block a GPU program
//! frees may still be read or written by work queued on its streams before the free,
//! so the host records an event on each of those streams and gives the block back to
//! its policy only once every event has completed. A policy may then reuse what it is
//! given at once, as in host memory, and never hands one kernel memory another still
//! uses.

use std::collections::{HashSet, VecDeque};
use std::ptr::NonNull;

use parking_lot::Mutex;

use super::{Handler, to_ptr};
use crate::error::{ClientError, Error};
use crate::gpu::{Event, Gpu, Stream};
use crate::link::LinkStats;
use crate::memhandler::Stats;

/// Frees waiting for their streams, looked at per call: enough to keep up with a
/// program's frees, few enough that a call never queries the driver for long.
const REAPED_PER_CALL: usize = 32;

/// A [`Handler`] of memory on one GPU ([`crate::HandlerBuilder::build_device`]): blocks
/// are device addresses, which the host never dereferences; a client allocates and
/// frees, naming the streams that may still use a block it frees.
pub struct DeviceHandler {
    handler: Handler,
    gpu: Gpu,
    device: u32,
    pending: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    waiting: VecDeque<Waiting>,
    /// The addresses of `waiting`, so that a second free of one is refused at once.
    addrs: HashSet<u64>,
    bytes: u64,
    /// [`DeviceHandler::defer`] guards alive: nothing is given back meanwhile.
    deferrals: u32,
}

/// A block freed by its client, not yet given back to its policy.
struct Waiting {
    addr: u64,
    /// The size the client said, checked when the block is given back.
    size: u64,
    /// The size the ledger has for it, counted in [`Pending::bytes`].
    recorded: u64,
    /// One per stream the client named, each after the work queued before the free.
    events: Vec<Event>,
}

/// Blocks freed by their clients and waiting for the work on their streams.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PendingFrees {
    pub blocks: u64,
    pub bytes: u64,
}

impl std::fmt::Debug for DeviceHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceHandler")
            .field("handler", &self.handler)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl DeviceHandler {
    pub(super) fn new(handler: Handler, gpu: Gpu, device: u32) -> Self {
        DeviceHandler {
            handler,
            gpu,
            device,
            pending: Mutex::default(),
        }
    }

    /// The handler itself, for inspection and the contract checker: its `calloc` and
    /// `realloc` are refused (the host never zeroes or copies GPU memory), and its
    /// frees give a block back at once, with no stream to wait for.
    pub fn handler(&self) -> &Handler {
        &self.handler
    }

    /// The GPU whose memory this handler lends.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The chain's name, as [`Handler::name`].
    pub fn name(&self) -> &str {
        self.handler.name()
    }

    /// `size` bytes (at least 1) of device memory, `None` when out of memory. Frees
    /// whose streams have finished are given back first; when the policy has no block,
    /// every waiting free is waited for and given back, and the policy asked again.
    pub fn malloc(&self, size: u64) -> Result<Option<u64>, Error> {
        self.give_back_finished(REAPED_PER_CALL)?;
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        if let Some(block) = self.handler.malloc(size)? {
            return Ok(Some(block.as_ptr() as u64));
        }
        if self.wait_for_pending()? {
            return Ok(self.handler.malloc(size)?.map(|b| b.as_ptr() as u64));
        }
        Ok(None)
    }

    /// Free `addr`: `size` is what it was allocated with (`None` when the client does
    /// not say; a wrong size is corrected from the ledger and counted, as for host
    /// memory), `streams` the streams whose work queued so far may still use it. It
    /// goes back to the policy once that work has finished; at once with no stream.
    pub fn free(&self, addr: u64, size: Option<u64>, streams: &[Stream]) -> Result<(), Error> {
        let Some(ptr) = to_ptr(addr) else {
            return Ok(());
        };
        let mut pending = self.pending.lock();
        if pending.addrs.contains(&addr) {
            return Err(Error::Client(ClientError::DoubleFree { addr }));
        }
        let Some(recorded) = self.handler.block_size(ptr) else {
            return Err(Error::Client(ClientError::UnknownBlock { addr }));
        };
        let mut events = Vec::with_capacity(streams.len());
        for &stream in streams {
            match self.gpu.0.record(self.device, stream) {
                Ok(event) => events.push(event),
                Err(_) => {
                    // No event to wait on: wait for the whole device instead, once.
                    self.gpu.0.wait_idle(self.device);
                    events.drain(..).for_each(|e| self.gpu.0.release(e));
                    break;
                }
            }
        }
        if events.is_empty() && pending.deferrals == 0 {
            drop(pending);
            self.give(ptr, size)?;
        } else {
            let said = size.unwrap_or(recorded as u64);
            pending.addrs.insert(addr);
            pending.bytes += recorded as u64;
            pending.waiting.push_back(Waiting {
                addr,
                size: said,
                recorded: recorded as u64,
                events,
            });
            drop(pending);
        }
        self.give_back_finished(REAPED_PER_CALL)
    }

    fn give(&self, ptr: NonNull<u8>, size: Option<u64>) -> Result<(), Error> {
        match size {
            Some(size) => self
                .handler
                .free(Some(ptr), usize::try_from(size).unwrap_or(0)),
            None => self.handler.free_unsized(ptr).map(drop),
        }
    }

    /// Give back up to `most` waiting frees whose streams have finished (none while a
    /// deferral is alive).
    fn give_back_finished(&self, most: usize) -> Result<(), Error> {
        let finished = {
            let mut pending = self.pending.lock();
            if pending.deferrals > 0 || pending.waiting.is_empty() {
                return Ok(());
            }
            let mut finished = Vec::new();
            let mut looked = 0;
            let mut index = 0;
            while index < pending.waiting.len() && looked < most {
                looked += 1;
                let done = pending.waiting[index]
                    .events
                    .iter()
                    .all(|e| self.gpu.0.finished(e));
                if done {
                    let waiting = pending.waiting.remove(index).expect("in range");
                    finished.push(self.take(&mut pending, waiting));
                } else {
                    index += 1;
                }
            }
            finished
        };
        self.give_all(finished)
    }

    fn take(&self, pending: &mut Pending, waiting: Waiting) -> (u64, u64) {
        pending.addrs.remove(&waiting.addr);
        for event in waiting.events {
            self.gpu.0.release(event);
        }
        pending.bytes -= waiting.recorded;
        (waiting.addr, waiting.size)
    }

    fn give_all(&self, blocks: Vec<(u64, u64)>) -> Result<(), Error> {
        let mut first_error = None;
        for (addr, size) in blocks {
            let ptr = to_ptr(addr).expect("a waiting block is not null");
            if let Err(e) = self.give(ptr, Some(size)) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Wait for every waiting free's streams and give each back: true if there were
    /// any (and no deferral kept them).
    fn wait_for_pending(&self) -> Result<bool, Error> {
        let blocks = {
            let mut pending = self.pending.lock();
            if pending.deferrals > 0 || pending.waiting.is_empty() {
                return Ok(false);
            }
            let waiting: Vec<Waiting> = pending.waiting.drain(..).collect();
            waiting
                .into_iter()
                .map(|w| {
                    w.events.iter().for_each(|e| self.gpu.0.wait(e));
                    self.take(&mut pending, w)
                })
                .collect()
        };
        self.give_all(blocks)?;
        Ok(true)
    }

    /// Wait for every waiting free's streams, and give each back to its policy.
    pub fn synchronize(&self) -> Result<(), Error> {
        self.wait_for_pending().map(drop)
    }

    /// Give back every waiting free whose streams have finished, then ask every policy
    /// to give back what it caches.
    pub fn trim(&self) -> Result<(), Error> {
        self.give_back_finished(usize::MAX)?;
        self.handler.trim()
    }

    /// Keep every block freed while the guard lives from its policy, even once its
    /// streams have finished (Numba's `defer_cleanup`); they go back after.
    pub fn defer(&self) -> Deferral<'_> {
        self.defer_begin();
        Deferral { handler: self }
    }

    /// [`Self::defer`] for a caller that cannot hold a guard (Python's context
    /// managers): each call must be matched by one [`Self::defer_end`].
    pub fn defer_begin(&self) {
        self.pending.lock().deferrals += 1;
    }

    /// End one [`Self::defer_begin`]; whatever finished meanwhile goes back at the next
    /// call.
    pub fn defer_end(&self) {
        let mut pending = self.pending.lock();
        pending.deferrals = pending.deferrals.saturating_sub(1);
    }

    /// Frees waiting for their streams.
    pub fn pending_frees(&self) -> PendingFrees {
        let pending = self.pending.lock();
        PendingFrees {
            blocks: pending.waiting.len() as u64,
            bytes: pending.bytes,
        }
    }

    /// The client's counters, as [`Handler::stats`]: a waiting free counts as live.
    pub fn stats(&self) -> Result<Stats, Error> {
        self.handler.stats()
    }

    /// Each policy's counters, as [`Handler::link_stats`].
    pub fn link_stats(&self) -> Result<Vec<LinkStats>, Error> {
        self.handler.link_stats()
    }

    /// After every block was freed and given back: what a policy still holds, as
    /// [`Handler::leak_check`]. Waits for waiting frees first.
    pub fn leak_check(&self) -> Result<(), Error> {
        self.synchronize()?;
        self.handler.leak_check()
    }

    /// Why the chain was stopped, if it was.
    /// Why the chain's latest request for memory of the GPU was refused as unavailable
    /// (no CUDA driver, no such device), if one was: what a client that got no block
    /// should be told rather than "no memory left".
    pub fn gpu_unavailable(&self) -> Option<String> {
        let links = self.handler.link_stats().ok()?;
        links.into_iter().find_map(|link| link.gpu_unavailable)
    }

    pub fn failure(&self) -> Option<std::sync::Arc<Error>> {
        self.handler.failure()
    }

    /// `(free, total)` bytes of the GPU, as its driver says.
    pub fn device_memory(&self) -> Result<(u64, u64), crate::gpu::GpuError> {
        self.gpu.memory(self.device)
    }
}

impl Drop for DeviceHandler {
    fn drop(&mut self) {
        // The chain's regions go back to the driver with the handler: no kernel may still
        // be using a block freed into one.
        for waiting in self.pending.get_mut().waiting.drain(..) {
            for event in waiting.events {
                self.gpu.0.wait(&event);
                self.gpu.0.release(event);
            }
        }
    }
}

/// Keeps frees from going back to their policy while it lives ([`DeviceHandler::defer`]).
#[derive(Debug)]
pub struct Deferral<'h> {
    handler: &'h DeviceHandler,
}

impl Drop for Deferral<'_> {
    fn drop(&mut self) {
        self.handler.defer_end();
    }
}
