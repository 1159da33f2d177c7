//! NEP 49 as its users know it: a current handler per thread and per task, buffers that
//! remember the handler that made them, and event hooks.
//!
//! ```
//! use std::sync::Arc;
//! use allocbox::nep49::{self, Buffer};
//! use allocbox::{HandlerBuilder, Runtime};
//!
//! let policy = Runtime::shared().load(allocbox::DEFAULT_POLICY_WAT.as_bytes())?;
//! let wasm: Arc<dyn nep49::MemHandler> =
//!     Arc::new(HandlerBuilder::new(Runtime::shared()).link(&policy).build()?);
//!
//! let before = Buffer::new(16)?;                       // made by the default handler
//! let during = nep49::with_handler(wasm, || Buffer::new(16))?;
//! assert_eq!(before.handler_name(), "default_allocator");
//! assert_eq!(during.handler_name(), "passthrough");     // and freed by it, later
//! assert_eq!(nep49::current_handler_name(), "default_allocator");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::cell::{Cell, RefCell};
use std::fmt;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use parking_lot::RwLock;

use crate::error::Error;
pub use crate::memhandler::MemHandler;
use crate::native::NumpyDefault;

/// A shared handler.
pub type SharedHandler = Arc<dyn MemHandler>;

/// The process-wide default handler: one [`NumpyDefault`], always the same object.
pub fn default_handler() -> SharedHandler {
    static DEFAULT: OnceLock<SharedHandler> = OnceLock::new();
    DEFAULT
        .get_or_init(|| Arc::new(NumpyDefault::new()))
        .clone()
}

thread_local! {
    /// The current handler of this thread; `None` means the default. A new thread starts
    /// at the default (NumPy's behaviour), it does not inherit.
    static CURRENT: RefCell<Option<SharedHandler>> = const { RefCell::new(None) };
}

/// The current handler of this thread (or task, inside [`scoped`]).
pub fn get_handler() -> SharedHandler {
    CURRENT
        .with(|c| c.borrow().clone())
        .unwrap_or_else(default_handler)
}

/// Make `handler` current for this thread (or task); `None` resets to the default.
/// Returns the previous one. A handler that cannot take requests (a stopped chain) is
/// refused with the reason.
pub fn set_handler(handler: Option<SharedHandler>) -> Result<SharedHandler, Error> {
    if let Some(h) = &handler {
        h.usable()?;
    }
    let previous = CURRENT.with(|c| std::mem::replace(&mut *c.borrow_mut(), handler));
    Ok(previous.unwrap_or_else(default_handler))
}

/// Run `f` with `handler` current, then restore the previous one (also on panic).
pub fn with_handler<R>(handler: SharedHandler, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<SharedHandler>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| *c.borrow_mut() = self.0.take());
        }
    }
    let previous = CURRENT.with(|c| c.borrow_mut().replace(handler));
    let _restore = Restore(previous);
    f()
}

/// A future with its own current handler, like a task with its own ContextVar context:
/// it starts with the handler current when it was made, `set_handler` inside it changes
/// only its own, and nothing leaks back to whoever polls it.
pub fn scoped<F: Future>(future: F) -> Scoped<F> {
    Scoped {
        handler: CURRENT.with(|c| c.borrow().clone()),
        future,
    }
}

/// See [`scoped`].
#[derive(Debug)]
pub struct Scoped<F> {
    handler: Option<SharedHandler>,
    future: F,
}

impl<F: Future> Future for Scoped<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // SAFETY: `future` is structurally pinned: it is never moved out of `self`, and
        // `handler` is an ordinary field that is only swapped, never pinned.
        let this = unsafe { self.get_unchecked_mut() };
        let outer = CURRENT.with(|c| std::mem::replace(&mut *c.borrow_mut(), this.handler.take()));
        // SAFETY: as above, `future` stays where it is.
        let polled = unsafe { Pin::new_unchecked(&mut this.future) }.poll(cx);
        this.handler = CURRENT.with(|c| std::mem::replace(&mut *c.borrow_mut(), outer));
        polled
    }
}

/// The name of the current handler.
pub fn current_handler_name() -> String {
    get_handler().name().to_string()
}

/// The version of the current handler.
pub fn current_handler_version() -> u8 {
    get_handler().version()
}

// ---------------------------------------------------------------- event hooks

/// What a hook sees after every allocation event: `(old, new, size)` as NumPy passes
/// them — new: `(None, Some(p), size)`; free: `(Some(p), None, 0)`; renew:
/// `(Some(old), Some(new), size)`.
pub type Hook =
    Arc<dyn Fn(Option<NonNull<u8>>, Option<NonNull<u8>>, usize, &HookData) + Send + Sync>;
/// The user data given with a hook, handed back to it on every event.
pub type HookData = Arc<dyn std::any::Any + Send + Sync>;

static HOOK: RwLock<Option<(Hook, HookData)>> = RwLock::new(None);
/// Whether [`HOOK`] is set: the one load an event pays while no hook is.
static HOOKED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Inside a hook on this thread: allocations it makes do not call hooks again.
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Install `hook` with its `data` (or remove it with `None`); returns the previous hook
/// and its data, as `PyDataMem_SetEventHook` does.
pub fn set_event_hook(hook: Option<(Hook, HookData)>) -> Option<(Hook, HookData)> {
    let mut current = HOOK.write();
    HOOKED.store(hook.is_some(), Ordering::Relaxed);
    std::mem::replace(&mut *current, hook)
}

/// Remove the hook if `is_it` says its data is the one meant, in one step under the
/// hook's lock, so that a hook another thread set meanwhile stays; returns what was
/// removed, for the caller to drop outside the lock.
pub fn remove_event_hook_if(is_it: impl FnOnce(&HookData) -> bool) -> Option<(Hook, HookData)> {
    let mut current = HOOK.write();
    if !current.as_ref().is_some_and(|(_, data)| is_it(data)) {
        return None;
    }
    HOOKED.store(false, Ordering::Relaxed);
    current.take()
}

/// Whether an event hook is set: one relaxed load, for callers that skip the work of
/// telling it when none is.
#[inline]
pub fn event_hook_set() -> bool {
    HOOKED.load(Ordering::Relaxed)
}

/// Tell the event hook, if one is set, about an event a handler served outside
/// [`user_new`] and its siblings (the NumPy bridge's own callbacks): `(None, Some(p),
/// size)` new, `(Some(p), None, 0)` free, `(Some(old), Some(new), size)` renew.
#[inline]
pub fn notify_event_hook(old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize) {
    if event_hook_set() {
        fire(old, new, size);
    }
}

#[cold]
fn fire(old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize) {
    if IN_HOOK.with(Cell::get) {
        return;
    }
    let Some((hook, data)) = HOOK.read().clone() else {
        return;
    };
    // The lock is released before the hook runs, so a hook may set hooks or allocate.
    IN_HOOK.with(|f| f.set(true));
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            IN_HOOK.with(|f| f.set(false));
        }
    }
    let _leave = Leave;
    hook(old, new, size, &data);
}

/// `PyDataMem_UserNEW`: allocate through `handler`, then tell the hook.
pub fn user_new(handler: &dyn MemHandler, size: usize) -> Result<Option<NonNull<u8>>, Error> {
    let p = handler.malloc(size)?;
    if p.is_some() {
        notify_event_hook(None, p, size);
    }
    Ok(p)
}

/// `PyDataMem_UserNEW_ZEROED`.
pub fn user_new_zeroed(
    handler: &dyn MemHandler,
    nelem: usize,
    elsize: usize,
) -> Result<Option<NonNull<u8>>, Error> {
    let p = handler.calloc(nelem, elsize)?;
    if p.is_some() {
        notify_event_hook(None, p, nelem * elsize);
    }
    Ok(p)
}

/// `PyDataMem_UserRENEW`.
pub fn user_renew(
    handler: &dyn MemHandler,
    ptr: Option<NonNull<u8>>,
    size: usize,
) -> Result<Option<NonNull<u8>>, Error> {
    let p = handler.realloc(ptr, size)?;
    if p.is_some() {
        notify_event_hook(ptr, p, size);
    }
    Ok(p)
}

/// `PyDataMem_UserFREE`.
pub fn user_free(
    handler: &dyn MemHandler,
    ptr: Option<NonNull<u8>>,
    size: usize,
) -> Result<(), Error> {
    handler.free(ptr, size)?;
    if ptr.is_some() {
        notify_event_hook(ptr, None, 0);
    }
    Ok(())
}

// ---------------------------------------------------------------- buffers

/// Owned bytes placed by a handler; remembers that handler and is freed by it with the
/// recorded size, whatever handler is current by then (NEP 49's per-array handler).
pub struct Buffer {
    ptr: NonNull<u8>,
    len: usize,
    handler: SharedHandler,
}

// SAFETY: a Buffer owns its block exclusively (like a Vec<u8>); the handler is Send+Sync.
unsafe impl Send for Buffer {}
// SAFETY: shared access only reads the bytes.
unsafe impl Sync for Buffer {}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("len", &self.len)
            .field("handler", &self.handler.name())
            .finish()
    }
}

/// The handler is out of memory.
fn oom(size: usize) -> Error {
    Error::Client(crate::error::ClientError::OutOfMemory { size: size as u64 })
}

impl Buffer {
    /// `len` bytes from the current handler's malloc; their contents are whatever the
    /// handler left there.
    pub fn new(len: usize) -> Result<Buffer, Error> {
        Self::new_in(get_handler(), len)
    }

    /// `len` zero bytes from the current handler's calloc.
    pub fn zeroed(len: usize) -> Result<Buffer, Error> {
        let handler = get_handler();
        let ptr = user_new_zeroed(&*handler, len, 1)?.ok_or_else(|| oom(len))?;
        Ok(Buffer { ptr, len, handler })
    }

    /// `len` bytes from `handler`.
    pub fn new_in(handler: SharedHandler, len: usize) -> Result<Buffer, Error> {
        let ptr = user_new(&*handler, len)?.ok_or_else(|| oom(len))?;
        Ok(Buffer { ptr, len, handler })
    }

    /// Resize through the buffer's own handler; on error the buffer is unchanged.
    pub fn resize(&mut self, len: usize) -> Result<(), Error> {
        let ptr = user_renew(&*self.handler, Some(self.ptr), len)?.ok_or_else(|| oom(len))?;
        self.ptr = ptr;
        self.len = len;
        Ok(())
    }

    /// The handler that made this buffer and will free it.
    pub fn handler(&self) -> &SharedHandler {
        &self.handler
    }

    pub fn handler_name(&self) -> &str {
        self.handler.name()
    }

    pub fn handler_version(&self) -> u8 {
        self.handler.version()
    }

    /// A borrowed view of part of the buffer.
    pub fn view(&self, range: std::ops::Range<usize>) -> View<'_> {
        View {
            bytes: &self[range],
            base: self,
        }
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is a live block of at least `len` bytes owned by this buffer;
        // handlers lend memory that is readable (possibly uninitialised for malloc, so
        // bytes may be arbitrary but are plain u8).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if let Err(e) = user_free(&*self.handler, Some(self.ptr), self.len) {
            log::warn!("freeing a buffer of `{}`: {e}", self.handler.name());
        }
    }
}

/// Borrowed bytes of a [`Buffer`]: a view owns no data, so it has no handler (NumPy
/// reports `None` for views); its base has one.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    bytes: &'a [u8],
    base: &'a Buffer,
}

impl<'a> View<'a> {
    /// Always `None`: a view's data belongs to its base.
    pub fn handler_name(&self) -> Option<&str> {
        None
    }

    /// The buffer that owns the data.
    pub fn base(&self) -> &'a Buffer {
        self.base
    }
}

impl Deref for View<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes
    }
}
