//! Event hooks as sandboxed wasm components (the `hook` world): loaded like policies,
//! with the same deny-by-default WASI, memory cap and time limit.

use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;
use wasmtime::Store;

use crate::clock::{CallTicks, Clock, Deadline};
use crate::error::{Call, Error, LoadError};
use crate::link::{Limits, Sandbox};
use crate::nep49::{Hook, HookData};
use crate::runtime::Runtime;
use crate::trace::{EventOp, Served, Watcher};

mod bindings {
    wasmtime::component::bindgen!({ path: "../wit", world: "hook" });
}

/// Numbers of a hook's report kept: more are left out.
pub const MAX_REPORTED_NUMBERS: usize = 1024;

/// A started hook component. A hook that fails (traps, loops, grows too much) is stopped:
/// later events skip it, and [`WasmHook::failure`] says why. Allocation never fails
/// because of a hook.
pub struct WasmHook {
    name: String,
    state: Mutex<HookState>,
}

struct HookState {
    store: Store<Sandbox>,
    bindings: bindings::Hook,
    clock: Arc<Clock>,
    limits: Limits,
    failure: Option<Arc<Error>>,
}

impl std::fmt::Debug for WasmHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmHook")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl WasmHook {
    /// Compile (or reuse) and start a hook component from bytes: a component binary or
    /// WAT (a core module is made a component of the `hook` world).
    pub fn start(
        runtime: &Runtime,
        bytes: &[u8],
        name: &str,
        limits: Limits,
    ) -> Result<Arc<WasmHook>, LoadError> {
        let pre = runtime.compile_hook(bytes)?;
        let mut store = runtime.guest_store(name, &limits, |s| s, |s| s);
        let instance = pre.instantiate(&mut store).map_err(|e| {
            LoadError::Start(Box::new(Error::Hook {
                hook: name.into(),
                cause: Box::new(store.data_mut().classify(&limits, Call::Init, e)),
            }))
        })?;
        let bindings =
            bindings::Hook::new(&mut store, &instance).map_err(|e| LoadError::WrongWorld {
                detail: crate::untrusted::escape(&format!("{e:#}")),
            })?;
        Ok(Arc::new(WasmHook {
            name: name.to_string(),
            state: Mutex::new(HookState {
                store,
                bindings,
                clock: runtime.clock().clone(),
                limits,
                failure: None,
            }),
        }))
    }

    fn call<R>(
        &self,
        call: Call,
        f: impl FnOnce(
            &bindings::exports::allocbox::policy::events::Guest,
            &mut Store<Sandbox>,
        ) -> wasmtime::Result<R>,
    ) -> Result<R, Error> {
        let mut st = self.state.lock();
        if let Some(cause) = &st.failure {
            return Err(self.as_hook_s(Error::Poisoned {
                policy: self.name.as_str().into(),
                cause: cause.clone(),
            }));
        }
        // Each event is a call of the embedder's of its own: the hook is told after the
        // client's call has ended.
        let deadline = Deadline::for_client_call(&st.clock, CallTicks::of(st.limits.call_time));
        let armed = st.store.data_mut().begin_call(deadline);
        armed.arm(&mut st.store);
        let HookState {
            store,
            bindings,
            limits,
            failure,
            ..
        } = &mut *st;
        f(bindings.allocbox_policy_events(), store).map_err(|e| {
            let err = self.as_hook_s(store.data_mut().classify(limits, call, e));
            log::warn!("{err}");
            *failure = Some(Arc::new(err.clone()));
            err
        })
    }

    /// A failure of this hook, told as a hook's.
    fn as_hook_s(&self, cause: Error) -> Error {
        Error::Hook {
            hook: self.name.as_str().into(),
            cause: Box::new(cause),
        }
    }

    /// The name it was started with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tell the hook about one event.
    pub fn on_event(
        &self,
        old: Option<NonNull<u8>>,
        new: Option<NonNull<u8>>,
        size: usize,
    ) -> Result<(), Error> {
        let addr = |p: Option<NonNull<u8>>| p.map_or(0, |p| p.as_ptr() as u64);
        self.call(Call::Event, |g, s| {
            g.call_on_event(s, addr(old), addr(new), size as u64)
        })
    }

    /// The numbers the hook keeps, the first [`MAX_REPORTED_NUMBERS`] of them: a hook
    /// may answer with its whole memory, which no reader wants printed.
    pub fn report(&self) -> Result<Vec<u64>, Error> {
        let mut numbers = self.call(Call::Report, |g, s| g.call_report(s))?;
        numbers.truncate(MAX_REPORTED_NUMBERS);
        numbers.shrink_to_fit();
        Ok(numbers)
    }

    /// Why the hook was stopped, if it was.
    pub fn failure(&self) -> Option<Arc<Error>> {
        self.state.lock().failure.clone()
    }

    /// This hook as a NEP 49 hook, for [`crate::nep49::set_event_hook`]; its data is the
    /// hook itself.
    pub fn as_hook(self: &Arc<Self>) -> (Hook, HookData) {
        let hook: Hook = Arc::new(|old, new, size, data: &HookData| {
            if let Some(hook) = data.downcast_ref::<WasmHook>() {
                // A failing hook is stopped and logged; the allocation stands.
                let _ = hook.on_event(old, new, size);
            }
        });
        (hook, self.clone())
    }
}

/// A hook watching a handler ([`crate::trace::Watched`]), as NumPy's `PyDataMem_User*`
/// entry points told the event hook: for replaying with a hook attached (`allocbox
/// replay-trace --hook`) without installing it process-wide. A failing hook is stopped
/// (see [`WasmHook::failure`]); the allocation stands.
impl Watcher for WasmHook {
    fn served(&self, call: Served) {
        // A free carries no size for a hook, and a free of NULL is no event.
        let size = if call.op == EventOp::Free {
            0
        } else {
            call.size
        };
        if call.old.is_some() || call.new.is_some() {
            let _ = self.on_event(call.old, call.new, size);
        }
    }
}
