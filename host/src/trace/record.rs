//! Recording a handler's calls as a trace: any handler wrapped so that a watcher sees
//! each call it served, and the watcher that writes the trace format.

use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::ptr::NonNull;

use parking_lot::Mutex;

use super::{EventOp, UNKNOWN_ID};
use crate::error::Error;
use crate::memhandler::{MemHandler, Stats};
use crate::nep49::SharedHandler;

/// What a [`Watched`] handler tells its watcher after each call it forwarded and that
/// did not fail: the operation, the block before and after (`None` for none), and the
/// size (a free's: what the client passed). A `realloc` answered "none" is not told.
pub trait Watcher: Send + Sync {
    fn served(&self, op: EventOp, old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize);
}

impl<W: Watcher + ?Sized> Watcher for &W {
    fn served(&self, op: EventOp, old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize) {
        (**self).served(op, old, new, size);
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
        self.watcher.served(EventOp::Malloc, None, p, size);
        Ok(p)
    }
    fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.handler.calloc(nelem, elsize)?;
        let size = nelem.saturating_mul(elsize);
        self.watcher.served(EventOp::Calloc, None, p, size);
        Ok(p)
    }
    fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.handler.realloc(ptr, new_size)?;
        if p.is_some() {
            self.watcher.served(EventOp::Realloc, ptr, p, new_size);
        }
        Ok(p)
    }
    fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        self.handler.free(ptr, size)?;
        self.watcher.served(EventOp::Free, ptr, None, size);
        Ok(())
    }
    fn free_unsized(&self, ptr: NonNull<u8>) -> Result<usize, Error> {
        let size = self.handler.free_unsized(ptr)?;
        self.watcher.served(EventOp::Free, Some(ptr), None, size);
        Ok(size)
    }
    fn stats(&self) -> Result<Stats, Error> {
        self.handler.stats()
    }
    fn usable(&self) -> Result<(), Error> {
        self.handler.usable()
    }
}

/// A handler that writes every call it forwards to `handler` as a trace.
pub type Recorder = Watched<SharedHandler, TraceWriter>;

/// The trace a [`Recorder`] writes.
pub struct TraceWriter {
    state: Mutex<RecorderState>,
}

struct RecorderState {
    out: Box<dyn Write + Send>,
    ids: HashMap<usize, u64>,
    next_id: u64,
    threads: HashMap<std::thread::ThreadId, u32>,
    error: Option<std::io::Error>,
}

impl fmt::Debug for TraceWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TraceWriter").finish_non_exhaustive()
    }
}

impl Recorder {
    /// Record the calls made to `inner` into `out`.
    pub fn new(inner: SharedHandler, out: impl Write + Send + 'static) -> Recorder {
        let mut out: Box<dyn Write + Send> = Box::new(out);
        let header = "# op(m=malloc,c=calloc,r=realloc,f=free) ptr-id size thread; \
                      free(NULL)->id 0; unknown ptr->id 18446744073709551615\n";
        let error = out.write_all(header.as_bytes()).err();
        Watched {
            handler: inner,
            watcher: TraceWriter {
                state: Mutex::new(RecorderState {
                    out,
                    ids: HashMap::new(),
                    next_id: 1,
                    threads: HashMap::new(),
                    error,
                }),
            },
        }
    }

    /// Flush the trace; the first write error, if any, is returned here.
    pub fn finish(&self) -> std::io::Result<()> {
        let mut state = self.watcher.state.lock();
        if let Some(e) = state.error.take() {
            return Err(e);
        }
        state.out.flush()
    }
}

impl Watcher for TraceWriter {
    fn served(&self, op: EventOp, old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize) {
        let op = match op {
            EventOp::Malloc => 'm',
            EventOp::Calloc => 'c',
            EventOp::Realloc => 'r',
            EventOp::Free => 'f',
        };
        let mut st = self.state.lock();
        let next_thread = st.threads.len() as u32 + 1;
        let thread = *st
            .threads
            .entry(std::thread::current().id())
            .or_insert(next_thread);
        let key = |p: NonNull<u8>| p.as_ptr() as usize;
        let id = match (op, old, new) {
            ('f', None, _) => 0,
            ('f', Some(p), _) => st.ids.remove(&key(p)).unwrap_or(UNKNOWN_ID),
            (_, Some(p), Some(q)) => {
                let id = st.ids.remove(&key(p)).unwrap_or(UNKNOWN_ID);
                st.ids.insert(key(q), id);
                id
            }
            (_, _, Some(q)) => {
                let id = st.next_id;
                st.next_id += 1;
                st.ids.insert(key(q), id);
                id
            }
            _ => return,
        };
        let line = format!("{op} {id} {size} {thread}\n");
        if st.error.is_none() {
            st.error = st.out.write_all(line.as_bytes()).err();
        }
    }
}
