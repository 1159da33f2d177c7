//! The bridge: the C callbacks NumPy calls for a block, over a Rust handler. NumPy calls
//! them with or without the GIL and from several threads at once, so they never touch
//! the Python C-API; a panic inside one stops the bridge, never unwinds into C.

use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use allocbox::nep49::MemHandler;
use allocbox::trace::{EventOp, Recorder, Served, Watcher};
use allocbox::{Error, Handler, PolicyHandler};

use crate::diagnosis;
use crate::nrt_lending::{Lender, NrtFunctions, NrtLending};

/// The context behind a capsule: the handler and what went wrong inside callbacks,
/// where no Python exception can be raised (NumPy sees NULL and raises MemoryError).
pub(crate) struct Bridge {
    pub(crate) handler: Arc<dyn MemHandler>,
    /// `handler` itself when it is a wasm chain with nothing in between: malloc and free
    /// call it without the trait object, so its magazine path is inlined into them and
    /// a small array's malloc and free touch fewer instruction-cache lines.
    direct: Option<Arc<Handler>>,
    /// The recording `handler` is, when `direct` is the handler it records: a block
    /// served from a magazine is written to the trace here.
    recording: Option<Arc<Recorder>>,
    /// Shared with the bridge that lends to Numba for this one (see [`Bridge::nrt_lender`]).
    pub(crate) failures: Arc<Mutex<Vec<Error>>>,
    /// Set when a callback panicked: the handler's books may be half-updated, so from
    /// then on every request is refused (NULL) and frees are left to the handler's drop,
    /// which releases all its memory once no array holds the capsule.
    pub(crate) panicked: Arc<OnceLock<String>>,
    /// The wasm chain when one of its policies diagnoses its client
    /// ([`PolicyHandler::diagnoses`]): every block's allocation site is recorded, and the
    /// misuse its policies report becomes a warning.
    diagnosing: Option<Arc<dyn PolicyHandler>>,
    /// What Numba's runtime lends through (`numba_route`), made on first use: a bridge
    /// over the same handler, which lives on after this one until Numba has freed
    /// every block it lent.
    nrt: OnceLock<NrtLending<Bridge>>,
}

impl Bridge {
    pub(crate) fn new(handler: Arc<dyn MemHandler>, direct: Option<Arc<Handler>>) -> Self {
        Bridge {
            handler,
            direct,
            recording: None,
            failures: Arc::default(),
            panicked: Arc::default(),
            diagnosing: None,
            nrt: OnceLock::new(),
        }
    }

    /// What Numba's runtime lends through, made on first use with `functions`.
    pub(crate) fn nrt_lender(&self, functions: impl FnOnce() -> NrtFunctions) -> &Lender<Bridge> {
        self.nrt
            .get_or_init(|| {
                let owner = Bridge {
                    handler: self.handler.clone(),
                    direct: self.direct.clone(),
                    recording: self.recording.clone(),
                    failures: self.failures.clone(),
                    panicked: self.panicked.clone(),
                    diagnosing: self.diagnosing.clone(),
                    nrt: OnceLock::new(),
                };
                NrtLending::new(owner, self.handler.alignment(), functions())
            })
            .lender()
    }

    /// A bridge whose handler is `recording`, over the `direct` handler given to
    /// [`Bridge::new`].
    pub(crate) fn recording(mut self, recording: Arc<Recorder>) -> Self {
        self.recording = Some(recording);
        self
    }

    /// The handler itself when nothing records it: then `handler` is `direct`, and the
    /// paths past the magazine may be called on it directly.
    #[inline(always)]
    fn unrecorded_direct(&self) -> Option<&Handler> {
        self.direct.as_deref().filter(|_| self.recording.is_none())
    }

    /// Where a free served from a magazine falls in the recording (taken before the
    /// block can be handed to another thread); 0 when nothing is recorded.
    #[inline(always)]
    fn before_free(&self) -> u64 {
        self.recording.as_ref().map_or(0, |r| r.watcher.before())
    }

    /// Write a call served from a magazine to the recording, if there is one.
    #[inline(always)]
    fn record(&self, call: Served) {
        if let Some(recording) = &self.recording {
            self.guard((), || recording.watcher.served(call));
        }
    }

    /// A bridge to `chain`, which diagnoses its client.
    pub(crate) fn diagnosing(mut self, chain: Arc<dyn PolicyHandler>) -> Self {
        diagnosis::install_fault_handler();
        self.diagnosing = Some(chain);
        self
    }

    /// For a diagnosing bridge, before `old` goes back to the handler (a free or a
    /// realloc): take its site out, so that a block another thread gets at its address
    /// meanwhile keeps its own. Given to [`Bridge::diagnose`] after.
    #[inline(always)]
    fn before_giving_back(&self, old: *mut c_void) -> Option<diagnosis::Site> {
        match self.diagnosing.is_some() {
            true => self.guard(None, || diagnosis::take_site(old)),
            false => None,
        }
    }

    /// Record where `new` (of `size` bytes) was allocated, for a diagnosing bridge, and
    /// warn about misuse its policies reported meanwhile; `old` is the block given back
    /// (null for none) with its site, as [`Bridge::before_giving_back`] took it.
    #[inline(always)]
    fn diagnose(
        &self,
        old: *mut c_void,
        old_site: Option<diagnosis::Site>,
        new: *mut c_void,
        size: usize,
    ) {
        if self.diagnosing.is_some() {
            self.diagnose_slowly(old, old_site, new, size);
        }
    }

    #[cold]
    #[inline(never)]
    fn diagnose_slowly(
        &self,
        old: *mut c_void,
        old_site: Option<diagnosis::Site>,
        new: *mut c_void,
        size: usize,
    ) {
        self.guard((), || {
            let Some(chain) = &self.diagnosing else {
                return;
            };
            if let Ok(reports) = chain.take_client_misuse()
                && !reports.is_empty()
            {
                let given_back = old_site.as_ref().map(|site| (old as u64, site));
                diagnosis::warn(reports, given_back);
            }
            diagnosis::record_site(new, size);
        });
    }

    /// Run one callback unless the bridge has stopped; a panic stops it for good.
    fn guard<R>(&self, refused: R, f: impl FnOnce() -> R) -> R {
        if self.panicked.get().is_some() {
            return refused;
        }
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(r) => r,
            Err(payload) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".into());
                let _ = self.panicked.set(format!(
                    "handler `{}` stopped: the host panicked inside a NumPy callback ({message})",
                    self.handler.name()
                ));
                refused
            }
        }
    }

    /// Tell the event hook (`allocbox.set_event_hook`) about an event NumPy's call
    /// caused, as `PyDataMem_UserNEW` and its siblings did before NumPy 2.0: nothing
    /// for a request that got no block or a free of NULL. Every malloc and free crosses
    /// this: without a hook it is one relaxed load.
    #[inline(always)]
    fn tell_hook(&self, old: *mut c_void, new: *mut c_void, size: usize) {
        if allocbox::nep49::event_hook_set() {
            self.tell_hook_slowly(old, new, size);
        }
    }

    #[cold]
    #[inline(never)]
    fn tell_hook_slowly(&self, old: *mut c_void, new: *mut c_void, size: usize) {
        let (old, new) = (NonNull::new(old.cast()), NonNull::new(new.cast()));
        if new.is_some() || old.is_some() {
            self.guard((), || allocbox::nep49::notify_event_hook(old, new, size));
        }
    }

    fn note(&self, error: Error) {
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        // The first failures say what happened; a bound keeps a flood from growing.
        if failures.len() < 64 {
            failures.push(error);
        }
    }

    /// A block for NumPy: NULL for none, for a failure (noted), or once stopped.
    fn block(&self, f: impl FnOnce() -> Result<Option<NonNull<u8>>, Error>) -> *mut c_void {
        self.guard(std::ptr::null_mut(), || match f() {
            Ok(Some(p)) => p.as_ptr().cast(),
            Ok(None) => std::ptr::null_mut(),
            Err(e) => {
                self.note(e);
                std::ptr::null_mut()
            }
        })
    }
}

/// # Safety
/// `ctx` is the `Bridge` of a live capsule (NumPy passes the allocator's ctx back).
unsafe fn bridge<'a>(ctx: *mut c_void) -> &'a Bridge {
    // SAFETY: the caller's contract; the capsule owns the Bridge until its destructor.
    unsafe { &*ctx.cast::<Bridge>() }
}

pub(crate) unsafe extern "C" fn bridge_malloc(ctx: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: NumPy calls this with the ctx of the handler it found in our capsule.
    let b = unsafe { bridge(ctx) };
    if let Some(h) = &b.direct
        && let Some(block) = b.guard(None, || h.malloc_from_magazine(size))
    {
        b.record(Served::lent(EventOp::Malloc, Some(block), size));
        b.tell_hook(std::ptr::null_mut(), block.as_ptr().cast(), size);
        return block.as_ptr().cast();
    }
    malloc_slowly(b, size)
}

/// Out of line, so that the magazine hit above stays short.
#[inline(never)]
fn malloc_slowly(b: &Bridge, size: usize) -> *mut c_void {
    let block = b.block(|| match b.unrecorded_direct() {
        // The in-place hit was just tried: not again.
        Some(h) => h.malloc_past_magazine(size),
        None => b.handler.malloc(size),
    });
    b.diagnose(std::ptr::null_mut(), None, block, size);
    b.tell_hook(std::ptr::null_mut(), block, size);
    block
}

pub(crate) unsafe extern "C" fn bridge_calloc(
    ctx: *mut c_void,
    nelem: usize,
    elsize: usize,
) -> *mut c_void {
    // SAFETY: as in `bridge_malloc`.
    let b = unsafe { bridge(ctx) };
    if let Some(h) = &b.direct
        && let Some(block) = b.guard(None, || h.calloc_from_magazine(nelem, elsize))
    {
        let size = nelem * elsize;
        b.record(Served::lent(EventOp::Calloc, Some(block), size));
        b.tell_hook(std::ptr::null_mut(), block.as_ptr().cast(), size);
        return block.as_ptr().cast();
    }
    calloc_slowly(b, nelem, elsize)
}

#[inline(never)]
fn calloc_slowly(b: &Bridge, nelem: usize, elsize: usize) -> *mut c_void {
    let block = b.block(|| b.handler.calloc(nelem, elsize));
    b.diagnose(
        std::ptr::null_mut(),
        None,
        block,
        nelem.saturating_mul(elsize),
    );
    b.tell_hook(std::ptr::null_mut(), block, nelem.saturating_mul(elsize));
    block
}

pub(crate) unsafe extern "C" fn bridge_realloc(
    ctx: *mut c_void,
    ptr: *mut c_void,
    size: usize,
) -> *mut c_void {
    // SAFETY: as in `bridge_malloc`.
    let b = unsafe { bridge(ctx) };
    let old = NonNull::new(ptr.cast::<u8>());
    let old_site = b.before_giving_back(ptr);
    let block = b.block(|| b.handler.realloc(old, size));
    // A refused realloc left the old block as it was: no event, and it keeps its site.
    if block.is_null() {
        diagnosis::put_back_site(ptr, old_site);
    } else {
        b.diagnose(ptr, old_site, block, size);
        b.tell_hook(ptr, block, size);
    }
    block
}

pub(crate) unsafe extern "C" fn bridge_free(ctx: *mut c_void, ptr: *mut c_void, size: usize) {
    // SAFETY: as in `bridge_malloc`.
    let b = unsafe { bridge(ctx) };
    let block = NonNull::new(ptr.cast::<u8>());
    let before = b.before_free();
    if let Some(h) = &b.direct
        && let Some(block) = block
        && b.guard(false, || h.free_to_magazine(block, size))
    {
        b.record(Served::freed(Some(block), size, before));
        b.tell_hook(ptr, std::ptr::null_mut(), 0);
        return;
    }
    let site = b.before_giving_back(ptr);
    free_slowly(b, block, size);
    // The policy checked the block as it was freed: its report names the block's site.
    b.diagnose(ptr, site, std::ptr::null_mut(), 0);
    b.tell_hook(ptr, std::ptr::null_mut(), 0);
}

impl Bridge {
    /// Give back a block whose client says no size (Numba's runtime): the handler's
    /// ledger supplies it. Events and failures as for `bridge_free`.
    pub(crate) fn free_unsized(&self, block: NonNull<u8>) {
        let ptr = block.as_ptr().cast::<c_void>();
        // A recording needs the size, which the handler's own path tells it.
        if let Some(h) = self.unrecorded_direct()
            && self.guard(false, || h.free_unsized_to_magazine(block))
        {
            self.tell_hook(ptr, std::ptr::null_mut(), 0);
            return;
        }
        let site = self.before_giving_back(ptr);
        self.guard((), || {
            if let Err(e) = self.handler.free_unsized(block) {
                self.note(e);
            }
        });
        self.diagnose(ptr, site, std::ptr::null_mut(), 0);
        self.tell_hook(ptr, std::ptr::null_mut(), 0);
    }
}

/// Out of line, so that the magazine hit above stays short.
#[inline(never)]
fn free_slowly(b: &Bridge, block: Option<NonNull<u8>>, size: usize) {
    b.guard((), || {
        let freed = match (b.unrecorded_direct(), block) {
            // The in-place hit was just tried: not again.
            (Some(h), Some(block)) => h.free_past_magazine(block, size),
            _ => b.handler.free(block, size),
        };
        if let Err(e) = freed {
            b.note(e);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handler whose every call panics, as a bug in the host would.
    #[derive(Debug)]
    struct Panicking;

    impl MemHandler for Panicking {
        fn name(&self) -> &str {
            "panicking"
        }
        fn malloc(&self, _: usize) -> Result<Option<NonNull<u8>>, Error> {
            panic!("books half-updated")
        }
        fn calloc(&self, _: usize, _: usize) -> Result<Option<NonNull<u8>>, Error> {
            panic!("books half-updated")
        }
        fn realloc(&self, _: Option<NonNull<u8>>, _: usize) -> Result<Option<NonNull<u8>>, Error> {
            panic!("books half-updated")
        }
        fn free(&self, _: Option<NonNull<u8>>, _: usize) -> Result<(), Error> {
            panic!("books half-updated")
        }
        fn free_unsized(&self, _: NonNull<u8>) -> Result<usize, Error> {
            panic!("books half-updated")
        }
        fn stats(&self) -> Result<allocbox::Stats, Error> {
            Ok(allocbox::Stats::default())
        }
    }

    #[test]
    fn a_panic_in_a_callback_stops_the_bridge_with_a_message_naming_the_handler() {
        let bridge = Bridge::new(Arc::new(Panicking), None);
        assert!(bridge.block(|| bridge.handler.malloc(16)).is_null());
        let message = bridge.panicked.get().expect("the bridge stopped");
        assert!(
            message.contains("panicking") && message.contains("books half-updated"),
            "{message}"
        );
        // Stopped: later calls are refused without reaching the handler (which would
        // panic again).
        let mut reached = false;
        assert!(
            bridge
                .block(|| {
                    reached = true;
                    Ok(None)
                })
                .is_null()
        );
        bridge.guard((), || reached = true);
        assert!(!reached);
    }
}
