//! Any handler wrapped so that a watcher sees each call it served: a trace being
//! recorded (`trace/record.rs`) or an event hook (`hook.rs`).

use std::fmt;
use std::ptr::NonNull;

use super::EventOp;
use crate::error::Error;
use crate::gpu::Stream;
use crate::handler::{DeviceHandler, PolicyHandler};
use crate::memhandler::{MemHandler, Stats};

/// One call a [`Watched`] handler forwarded and that did not fail: the operation, the
/// block before and after (`None` for none), the size (a free's: what the client
/// passed), and what [`Watcher::before`] answered for a free or a realloc (0 for the
/// others). A `realloc` answered "none" is not told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    pub op: EventOp,
    pub old: Option<NonNull<u8>>,
    pub new: Option<NonNull<u8>>,
    pub size: usize,
    pub before: u64,
    /// The GPU whose memory the block is (a [`DeviceHandler`]'s); `None` for host
    /// memory.
    pub device: Option<u16>,
    /// For a free of GPU memory, the stream whose queued work it waited for.
    pub stream: Option<u64>,
}

impl Served {
    /// A block lent by `op` (a malloc or a calloc), `None` when there was none.
    pub fn lent(op: EventOp, new: Option<NonNull<u8>>, size: usize) -> Self {
        Served {
            op,
            old: None,
            new,
            size,
            before: 0,
            device: None,
            stream: None,
        }
    }

    /// A free of `old`, said to be of `size` bytes, numbered `before`.
    pub fn freed(old: Option<NonNull<u8>>, size: usize, before: u64) -> Self {
        Served {
            op: EventOp::Free,
            old,
            new: None,
            size,
            before,
            device: None,
            stream: None,
        }
    }
}

/// What a [`Watched`] handler tells its watcher after each call it served.
pub trait Watcher: Send + Sync {
    /// Called before a free or a realloc reaches the handler: the moment after which the
    /// old block may be handed to another thread.
    fn before(&self) -> u64 {
        0
    }
    fn served(&self, call: Served);
}

impl<W: Watcher + ?Sized> Watcher for &W {
    fn before(&self) -> u64 {
        (**self).before()
    }
    fn served(&self, call: Served) {
        (**self).served(call);
    }
}

impl<W: Watcher + ?Sized> Watcher for std::sync::Arc<W> {
    fn before(&self) -> u64 {
        (**self).before()
    }
    fn served(&self, call: Served) {
        (**self).served(call);
    }
}

/// A watcher that may be absent: one slot of a [`Watched`] handler's watchers.
impl<W: Watcher> Watcher for Option<W> {
    fn before(&self) -> u64 {
        self.as_ref().map_or(0, Watcher::before)
    }
    fn served(&self, call: Served) {
        if let Some(watcher) = self {
            watcher.served(call);
        }
    }
}

/// Two watchers, each told every call, the first first: a recording and an event hook.
/// A call's place in the order ([`Watcher::before`]) is the first's, which is the one a
/// recording keeps.
impl<A: Watcher, B: Watcher> Watcher for (A, B) {
    fn before(&self) -> u64 {
        self.0.before()
    }
    fn served(&self, call: Served) {
        self.0.served(call);
        self.1.served(call);
    }
}

/// `handler`, with `watcher` told about every call it serves: a trace being recorded
/// ([`Recorder`]) or an event hook ([`crate::WasmHook`]).
#[derive(Debug)]
pub struct Watched<H, W> {
    pub handler: H,
    pub watcher: W,
}

impl<H, W> MemHandler for Watched<H, W>
where
    H: std::ops::Deref<Target: MemHandler> + Send + Sync + fmt::Debug,
    W: Watcher + fmt::Debug,
{
    fn name(&self) -> &str {
        self.handler.name()
    }
    fn version(&self) -> u8 {
        self.handler.version()
    }
    fn alignment(&self) -> u64 {
        self.handler.alignment()
    }
    fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.handler.malloc(size)?;
        self.watcher.served(Served::lent(EventOp::Malloc, p, size));
        Ok(p)
    }
    fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.handler.calloc(nelem, elsize)?;
        let size = nelem.saturating_mul(elsize);
        self.watcher.served(Served::lent(EventOp::Calloc, p, size));
        Ok(p)
    }
    fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let before = self.watcher.before();
        let p = self.handler.realloc(ptr, new_size)?;
        if p.is_some() {
            self.watcher.served(Served {
                op: EventOp::Realloc,
                old: ptr,
                new: p,
                size: new_size,
                before,
                device: None,
                stream: None,
            });
        }
        Ok(p)
    }
    fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        let before = self.watcher.before();
        self.handler.free(ptr, size)?;
        self.watcher.served(Served::freed(ptr, size, before));
        Ok(())
    }
    fn free_unsized(&self, ptr: NonNull<u8>) -> Result<usize, Error> {
        let before = self.watcher.before();
        let size = self.handler.free_unsized(ptr)?;
        self.watcher.served(Served::freed(Some(ptr), size, before));
        Ok(size)
    }
    fn stats(&self) -> Result<Stats, Error> {
        self.handler.stats()
    }
    fn usable(&self) -> Result<(), Error> {
        self.handler.usable()
    }
}

/// A GPU's handler watched: its client's calls, each told with its GPU, and a free with
/// the stream it waits for, when the client makes it (the block goes back to the policy
/// once that stream's work is done, which the trace does not wait for).
impl<H, W> Watched<H, W>
where
    H: std::ops::Deref<Target = DeviceHandler>,
    W: Watcher,
{
    /// [`DeviceHandler::malloc`], told.
    pub fn device_malloc(&self, size: u64) -> Result<Option<u64>, Error> {
        let block = self.handler.malloc(size)?;
        let mut call = Served::lent(EventOp::Malloc, block.and_then(to_ptr), size as usize);
        call.device = Some(self.gpu());
        self.watcher.served(call);
        Ok(block)
    }

    /// [`DeviceHandler::free`], told with the first stream named (a trace keeps one).
    pub fn device_free(
        &self,
        addr: u64,
        size: Option<u64>,
        streams: &[Stream],
    ) -> Result<(), Error> {
        let ptr = to_ptr(addr);
        let said = size.or_else(|| {
            ptr.and_then(|p| self.handler.block_size(p))
                .map(|s| s as u64)
        });
        let before = self.watcher.before();
        self.handler.free(addr, size, streams)?;
        let mut call = Served::freed(ptr, said.unwrap_or(0) as usize, before);
        call.device = Some(self.gpu());
        call.stream = streams.first().copied();
        self.watcher.served(call);
        Ok(())
    }

    fn gpu(&self) -> u16 {
        u16::try_from(self.handler.device()).unwrap_or(u16::MAX)
    }
}

fn to_ptr(addr: u64) -> Option<NonNull<u8>> {
    NonNull::new(addr as usize as *mut u8)
}
