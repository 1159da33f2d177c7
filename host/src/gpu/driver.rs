//! The CUDA driver API, loaded from `libcuda.so.1` when a GPU is first asked for:
//! allocbox neither builds nor links against CUDA. Each call runs in the primary
//! context of its device (the one the CUDA runtime, and so PyTorch, CuPy and Numba,
//! use), pushed for the call and popped after, so the calling thread's own context is
//! left as it was.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::{Backend, DEVICE_ALIGNMENT, Event, Gpu, GpuError, Stream};
use crate::kind::KindGrant;

type CuResult = c_int;
type Context = *mut c_void;

const SUCCESS: CuResult = 0;
const OUT_OF_MEMORY: CuResult = 2;
/// `cuMemHostRegister`: pinned for every context, not only the current one.
const HOST_REGISTER_PORTABLE: c_uint = 1;
/// `cuEventCreate`: no timing, the cheapest event to record and query.
const EVENT_DISABLE_TIMING: c_uint = 2;

/// A kind this backend has no call for: a row of `kind.rs` added without its driver call.
fn not_made(kind: KindGrant) -> GpuError {
    GpuError::Unavailable(format!("the CUDA driver is not asked for `{kind}` memory"))
}

/// The driver's functions allocbox calls, resolved once.
struct Api {
    // Kept loaded as long as the pointers below are used: for the process's life.
    _library: libloading::Library,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut Context, c_int) -> CuResult,
    ctx_push: unsafe extern "C" fn(Context) -> CuResult,
    ctx_pop: unsafe extern "C" fn(*mut Context) -> CuResult,
    ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(u64) -> CuResult,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult,
    host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> CuResult,
    event_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult,
    event_record: unsafe extern "C" fn(*mut c_void, *mut c_void) -> CuResult,
    event_query: unsafe extern "C" fn(*mut c_void) -> CuResult,
    event_synchronize: unsafe extern "C" fn(*mut c_void) -> CuResult,
    error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

impl Api {
    fn load() -> Result<Api, String> {
        // SAFETY: loading the CUDA driver runs its initialisers, which expect nothing of
        // the process beyond what any CUDA program has.
        let library = unsafe { libloading::Library::new("libcuda.so.1") }.map_err(|_| {
            "no CUDA driver was found (libcuda.so.1 could not be loaded): GPU memory needs \
             an NVIDIA driver"
                .to_string()
        })?;
        macro_rules! symbol {
            ($name:literal) => {
                // SAFETY: each symbol is the driver API function of that name, whose C
                // signature the field it is stored in spells out (cuda.h, API v2).
                *unsafe { library.get($name) }.map_err(|_| {
                    format!(
                        "the CUDA driver lacks {}: it is older than allocbox needs",
                        String::from_utf8_lossy(&$name[..$name.len() - 1])
                    )
                })?
            };
        }
        let init: unsafe extern "C" fn(c_uint) -> CuResult = symbol!(b"cuInit\0");
        let api = Api {
            device_get_count: symbol!(b"cuDeviceGetCount\0"),
            device_get: symbol!(b"cuDeviceGet\0"),
            primary_ctx_retain: symbol!(b"cuDevicePrimaryCtxRetain\0"),
            ctx_push: symbol!(b"cuCtxPushCurrent_v2\0"),
            ctx_pop: symbol!(b"cuCtxPopCurrent_v2\0"),
            ctx_synchronize: symbol!(b"cuCtxSynchronize\0"),
            mem_alloc: symbol!(b"cuMemAlloc_v2\0"),
            mem_free: symbol!(b"cuMemFree_v2\0"),
            mem_get_info: symbol!(b"cuMemGetInfo_v2\0"),
            host_register: symbol!(b"cuMemHostRegister_v2\0"),
            host_unregister: symbol!(b"cuMemHostUnregister\0"),
            event_create: symbol!(b"cuEventCreate\0"),
            event_record: symbol!(b"cuEventRecord\0"),
            event_query: symbol!(b"cuEventQuery\0"),
            event_synchronize: symbol!(b"cuEventSynchronize\0"),
            error_string: symbol!(b"cuGetErrorString\0"),
            _library: library,
        };
        // SAFETY: cuInit takes flags (0) and starts the driver; it is safe to call more
        // than once and from any thread.
        let started = unsafe { init(0) };
        if started != SUCCESS {
            return Err(format!(
                "the CUDA driver did not start: {}",
                api.message(started)
            ));
        }
        Ok(api)
    }

    /// The driver's own words for `code`.
    fn message(&self, code: CuResult) -> String {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorString writes a pointer to a static, NUL-terminated string
        // (or leaves it null for an unknown code).
        let known = unsafe { (self.error_string)(code, &mut text) } == SUCCESS;
        if known && !text.is_null() {
            // SAFETY: non-null, static and NUL-terminated, as above.
            let text = unsafe { CStr::from_ptr(text) };
            text.to_string_lossy().into_owned()
        } else {
            format!("error {code}")
        }
    }

    fn check(&self, call: &'static str, code: CuResult) -> Result<(), GpuError> {
        match code {
            SUCCESS => Ok(()),
            OUT_OF_MEMORY => Err(GpuError::OutOfMemory),
            _ => Err(GpuError::Driver {
                call,
                message: self.message(code),
            }),
        }
    }
}

/// A context pointer, owned by the driver for the process's life (retained, never
/// released): sent between threads as the driver allows.
#[derive(Clone, Copy)]
struct Primary(Context);
// SAFETY: a CUDA context handle may be made current on any thread; the driver
// synchronises its own use of it.
unsafe impl Send for Primary {}

struct Driver {
    api: Api,
    devices: c_int,
    contexts: Mutex<HashMap<u32, Primary>>,
    /// Events no longer needed, by device, for the next frees.
    spare_events: Mutex<HashMap<u32, Vec<u64>>>,
}

/// The primary context of a device, current on this thread until dropped.
struct Current<'d> {
    api: &'d Api,
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        let mut previous: Context = std::ptr::null_mut();
        // SAFETY: pops the context `Driver::enter` pushed on this thread.
        unsafe { (self.api.ctx_pop)(&mut previous) };
    }
}

impl Driver {
    fn enter(&self, device: u32) -> Result<Current<'_>, GpuError> {
        let context = {
            let mut contexts = self.contexts.lock();
            match contexts.get(&device) {
                Some(c) => *c,
                None => {
                    if c_int::try_from(device).map_or(true, |d| d >= self.devices) {
                        return Err(GpuError::Unavailable(format!(
                            "this machine has no GPU {device} ({} found)",
                            self.devices
                        )));
                    }
                    let mut handle: c_int = 0;
                    // SAFETY: writes the device handle of a valid ordinal (checked).
                    let found = unsafe { (self.api.device_get)(&mut handle, device as c_int) };
                    self.api.check("cuDeviceGet", found)?;
                    let mut context: Context = std::ptr::null_mut();
                    // SAFETY: writes the device's primary context, retained for the
                    // process's life.
                    let retained = unsafe { (self.api.primary_ctx_retain)(&mut context, handle) };
                    self.api.check("cuDevicePrimaryCtxRetain", retained)?;
                    contexts.insert(device, Primary(context));
                    Primary(context)
                }
            }
        };
        // SAFETY: a retained context, pushed on this thread; `Current` pops it.
        let pushed = unsafe { (self.api.ctx_push)(context.0) };
        self.api.check("cuCtxPushCurrent", pushed)?;
        Ok(Current { api: &self.api })
    }
}

impl Backend for Driver {
    fn name(&self) -> &'static str {
        "the CUDA driver"
    }

    fn memory(&self, device: u32) -> Result<(u64, u64), GpuError> {
        let _current = self.enter(device)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two sizes for the current context's device.
        let read = unsafe { (self.api.mem_get_info)(&mut free, &mut total) };
        self.api.check("cuMemGetInfo", read)?;
        Ok((free as u64, total as u64))
    }

    fn alloc(&self, kind: KindGrant, device: u32, size: u64) -> Result<u64, GpuError> {
        let size = usize::try_from(size).map_err(|_| GpuError::OutOfMemory)?;
        let _current = self.enter(device)?;
        let mut addr = 0u64;
        let (call, made) = match kind {
            // SAFETY: writes the address of `size` fresh bytes of device memory.
            KindGrant::Device => ("cuMemAlloc", unsafe {
                (self.api.mem_alloc)(&mut addr, size)
            }),
            _ => return Err(not_made(kind)),
        };
        self.api.check(call, made)?;
        debug_assert_eq!(addr % DEVICE_ALIGNMENT, 0);
        Ok(addr)
    }

    unsafe fn free(&self, _: KindGrant, device: u32, addr: u64) {
        if let Ok(_current) = self.enter(device) {
            // SAFETY: the caller gives back memory `alloc`'s driver call answered, once.
            unsafe { (self.api.mem_free)(addr) };
        }
    }

    unsafe fn register(&self, kind: KindGrant, addr: u64, len: u64) -> Result<(), GpuError> {
        if kind != KindGrant::Pinned {
            return Err(not_made(kind));
        }
        let _current = self.enter(0)?;
        // SAFETY: the caller owns the mapped, page-aligned range until `unregister`.
        let done = unsafe {
            (self.api.host_register)(addr as *mut c_void, len as usize, HOST_REGISTER_PORTABLE)
        };
        self.api.check("cuMemHostRegister", done)
    }

    unsafe fn unregister(&self, _: KindGrant, addr: u64) {
        if let Ok(_current) = self.enter(0) {
            // SAFETY: the caller unregisters a range `register` registered, once.
            unsafe { (self.api.host_unregister)(addr as *mut c_void) };
        }
    }

    fn record(&self, device: u32, stream: Stream) -> Result<Event, GpuError> {
        let _current = self.enter(device)?;
        let spare = self.spare_events.lock().get_mut(&device).and_then(Vec::pop);
        let handle = match spare {
            Some(handle) => handle,
            None => {
                let mut event: *mut c_void = std::ptr::null_mut();
                // SAFETY: writes a new event of the current context.
                let made = unsafe { (self.api.event_create)(&mut event, EVENT_DISABLE_TIMING) };
                self.api.check("cuEventCreate", made)?;
                event as u64
            }
        };
        // SAFETY: an event of this device's context, recorded on the client's stream
        // (a handle the client's library made in the same context, or 0).
        let recorded =
            unsafe { (self.api.event_record)(handle as *mut c_void, stream as *mut c_void) };
        let event = Event { device, handle };
        if let Err(e) = self.api.check("cuEventRecord", recorded) {
            self.release(event);
            return Err(e);
        }
        Ok(event)
    }

    fn finished(&self, event: &Event) -> bool {
        // SAFETY: a live event this backend made (no context needed to query it).
        unsafe { (self.api.event_query)(event.handle as *mut c_void) == SUCCESS }
    }

    fn wait(&self, event: &Event) {
        // SAFETY: as in `finished`.
        unsafe { (self.api.event_synchronize)(event.handle as *mut c_void) };
    }

    fn wait_idle(&self, device: u32) {
        if let Ok(_current) = self.enter(device) {
            // SAFETY: waits for the current context's work; touches no memory.
            unsafe { (self.api.ctx_synchronize)() };
        }
    }

    fn release(&self, event: Event) {
        self.spare_events
            .lock()
            .entry(event.device)
            .or_default()
            .push(event.handle);
    }
}

/// A backend that answers every request with why there is no GPU.
struct Missing(String);

impl Backend for Missing {
    fn name(&self) -> &'static str {
        "the CUDA driver"
    }
    fn memory(&self, _: u32) -> Result<(u64, u64), GpuError> {
        Err(GpuError::Unavailable(self.0.clone()))
    }
    fn alloc(&self, _: KindGrant, _: u32, _: u64) -> Result<u64, GpuError> {
        Err(GpuError::Unavailable(self.0.clone()))
    }
    unsafe fn free(&self, _: KindGrant, _: u32, _: u64) {}
    unsafe fn register(&self, _: KindGrant, _: u64, _: u64) -> Result<(), GpuError> {
        Err(GpuError::Unavailable(self.0.clone()))
    }
    unsafe fn unregister(&self, _: KindGrant, _: u64) {}
    fn record(&self, _: u32, _: Stream) -> Result<Event, GpuError> {
        Err(GpuError::Unavailable(self.0.clone()))
    }
    fn finished(&self, _: &Event) -> bool {
        true
    }
    fn wait(&self, _: &Event) {}
    fn wait_idle(&self, _: u32) {}
    fn release(&self, _: Event) {}
}

/// The process's CUDA backend: the driver is loaded when a GPU is first used, not when
/// a handle to it is made (every `Grants` holds one).
struct Cuda(OnceLock<Box<dyn Backend>>);

impl Cuda {
    fn loaded(&self) -> &dyn Backend {
        &**self.0.get_or_init(load)
    }
}

fn load() -> Box<dyn Backend> {
    match Api::load() {
        Ok(api) => {
            let mut devices: c_int = 0;
            // SAFETY: writes the number of devices of a started driver.
            let counted = unsafe { (api.device_get_count)(&mut devices) };
            if counted != SUCCESS {
                Box::new(Missing(format!(
                    "the CUDA driver could not count its GPUs: {}",
                    api.message(counted)
                )))
            } else if devices == 0 {
                Box::new(Missing("the CUDA driver sees no GPU".to_string()))
            } else {
                Box::new(Driver {
                    api,
                    devices,
                    contexts: Mutex::default(),
                    spare_events: Mutex::default(),
                })
            }
        }
        Err(reason) => Box::new(Missing(reason)),
    }
}

impl Backend for Cuda {
    fn name(&self) -> &'static str {
        "the CUDA driver"
    }
    fn memory(&self, device: u32) -> Result<(u64, u64), GpuError> {
        self.loaded().memory(device)
    }
    fn alloc(&self, kind: KindGrant, device: u32, size: u64) -> Result<u64, GpuError> {
        self.loaded().alloc(kind, device, size)
    }
    unsafe fn free(&self, kind: KindGrant, device: u32, addr: u64) {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.loaded().free(kind, device, addr) }
    }
    unsafe fn register(&self, kind: KindGrant, addr: u64, len: u64) -> Result<(), GpuError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.loaded().register(kind, addr, len) }
    }
    unsafe fn unregister(&self, kind: KindGrant, addr: u64) {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.loaded().unregister(kind, addr) }
    }
    fn record(&self, device: u32, stream: Stream) -> Result<Event, GpuError> {
        self.loaded().record(device, stream)
    }
    fn finished(&self, event: &Event) -> bool {
        self.loaded().finished(event)
    }
    fn wait(&self, event: &Event) {
        self.loaded().wait(event)
    }
    fn wait_idle(&self, device: u32) {
        self.loaded().wait_idle(device)
    }
    fn release(&self, event: Event) {
        self.loaded().release(event)
    }
}

/// The process's CUDA backend, one for every caller.
pub(super) fn shared() -> Gpu {
    static SHARED: OnceLock<Gpu> = OnceLock::new();
    SHARED
        .get_or_init(|| Gpu(Arc::new(Cuda(OnceLock::new()))))
        .clone()
}
