//! Loading policy components and starting them: one `Engine` per runtime, one `Linker`
//! filled once, one `Store` per policy instance.
//!
//! - [`engine`]: the engine's features, the compile cache on disk, compiler threads
//!   after a fork;
//! - [`componentize`]: component bytes from a component, a core module or WAT;
//! - [`policy`]: a compiled [`Policy`] and the checks on what it says about itself.

mod componentize;
mod engine;
mod policy;

use componentize::{WASM_MAGIC, to_component_binary};
pub use engine::{COMPILE_CACHE_ENV, cache_dir, compile_cache_dir};
use engine::{compile_cache, forked_compiler_threads, sandbox_features};
pub use policy::Policy;
use policy::{PolicyMeta, Pre, Said, check_info, source_language};

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use wasmtime::component::{Component, Linker};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolConcurrencyLimitError, PoolingAllocationConfig,
    Store,
};

use crate::clock::{CallTicks, Clock, Deadline};
use crate::compile_bounds::CompileBounds;
use crate::error::{Call, LoadError};
use crate::link::classify;
use crate::link::{Exports, Limits, Link, LinkStart, LinkState, Sandbox};
use crate::wit::{bindings, bindings_v2};

/// The package of the WIT worlds this host speaks.
pub const WORLD_PACKAGE: &str = "allocbox:policy";
/// The first version of the policy world, still served: every policy built against it
/// loads. The hook world is in this version.
pub const WORLD_VERSION: &str = "0.1.0";
/// The newest version of the policy world: 0.1.0 with memory kinds, client diagnostics,
/// counters and the limits told at `init`.
pub const WORLD_VERSION_2: &str = "0.2.0";
/// The WIT source of the 0.1.0 policy world, for tools that need it.
pub const POLICY_WIT: &str = include_str!("../../wit/policy.wit");
/// The WIT source of the 0.2.0 policy world.
pub const POLICY_WIT_2: &str = include_str!("../../wit/0.2.0/policy.wit");
/// The built-in default policy: the hand-written WAT `passthrough`, which needs no wasm
/// toolchain to build.
pub const DEFAULT_POLICY_WAT: &str =
    include_str!("../../guest-handlers/policies/wat/passthrough/passthrough.wat");

/// Bytes of a policy's `init` error kept, as many as of what it prints
/// (`Limits::output`'s default): a message, or a report of what it found, not its
/// memory.
const MAX_INIT_ERROR: usize = 16 << 10;

/// Resource handles a guest's component instances may hold at once (wasmtime's default
/// is 100,000): the policy world defines no resource, and WASI's are bounded more tightly
/// by `wasi::MAX_RESOURCES`.
const MAX_COMPONENT_HANDLES: usize = 4096;

/// No bound: for a policy already loaded within bounds.
const UNBOUNDED: CompileBounds = CompileBounds {
    functions: u64::MAX,
    code_bytes: u64::MAX,
    function_bytes: u64::MAX,
    data_bytes: u64::MAX,
    modules: u64::MAX,
    text_bytes: u64::MAX,
    file_bytes: u64::MAX,
};

/// SHA-256 of a policy's bytes.
type PolicyDigest = [u8; 32];

/// A policy in the runtime's cache and the bytes it was loaded from.
struct Compiled {
    loaded_from: Arc<[u8]>,
    policy: Policy,
}

/// Compiles and caches policy components, and starts policy instances.
///
/// Cheap to clone. Compiling a component is the costly step, so a runtime keeps every
/// component it compiled, keyed by its bytes: loading the same policy again is free.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<RuntimeInner>,
}

struct RuntimeInner {
    engine: Engine,
    linker: Linker<LinkState>,
    hook_linker: Linker<Sandbox>,
    /// Keyed by the SHA-256 of the bytes a policy was loaded from; a hit is taken only
    /// when those bytes are equal too.
    compiled: Mutex<HashMap<PolicyDigest, Compiled>>,
    /// Epoch ticks since the runtime started: host code inside imports reads it to
    /// keep the same time limits as wasm code.
    clock: Arc<Clock>,
    /// Each call's work is counted ([`Limits::call_work`]): the engine consumes fuel.
    counted: bool,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("compiled", &self.inner.compiled.lock().len())
            .finish_non_exhaustive()
    }
}

impl Runtime {
    /// A runtime with its own engine. Most programs want [`Runtime::shared`].
    pub fn new() -> Result<Runtime, wasmtime::Error> {
        let mut config = Config::new();
        config.cache(compile_cache());
        Runtime::with_config(config, false)
    }

    /// A runtime whose guests' calls are limited by counted work ([`Limits::call_work`]:
    /// wasm fuel, and the host's work in imports by what it moves) as well as by the
    /// wall clock, which stays as a safety net: the same call passes or fails whatever
    /// the machine's load. For checked runs (`allocbox check`, `replay`,
    /// `assert_contract`), whose verdict must not depend on the machine; counting costs
    /// the guest's code some speed, so clients' runtimes are clocked.
    pub fn counted() -> Result<Runtime, wasmtime::Error> {
        let mut config = Config::new();
        config.cache(compile_cache());
        Runtime::with_config(config, true)
    }

    /// [`Runtime::pooled`] and [`Runtime::counted`] at once: the contract checker's.
    pub fn counted_pool(instances: u32, memory: u64) -> Result<Runtime, wasmtime::Error> {
        Runtime::with_config(pool_config(instances, memory)?, true)
    }

    /// Whether this runtime counts its guests' work ([`Runtime::counted`]).
    pub fn is_counted(&self) -> bool {
        self.inner.counted
    }

    /// A runtime that keeps no compiled policy on disk ([`compile_cache_dir`]): for
    /// policies loaded once (generated ones, in a fuzzer), or where no cache directory
    /// can be trusted. It still keeps what it compiled in memory while it lives.
    pub fn without_disk_cache() -> Result<Runtime, wasmtime::Error> {
        Runtime::with_config(Config::new(), false)
    }

    /// A runtime that starts instances in a pool of `instances` slots, each with room for
    /// `memory` bytes of linear memory (rounded up to whole wasm pages).
    ///
    /// [`Runtime::new`] maps a fresh memory reservation for every instance and unmaps it
    /// when the instance ends, and the guest page-faults its memory in anew; from a pool,
    /// a start reuses a warm slot. A slot's memory is reset to the component's initial
    /// image when its instance ends, so every instance still starts clean. The pool is
    /// fixed: starting more than `instances` at once fails with [`LoadError::PoolFull`].
    /// For programs that start many short-lived handlers a few at a time; the contract
    /// checker starts one per case.
    pub fn pooled(instances: u32, memory: u64) -> Result<Runtime, wasmtime::Error> {
        Runtime::with_config(pool_config(instances, memory)?, false)
    }

    fn with_config(mut config: Config, counted: bool) -> Result<Runtime, wasmtime::Error> {
        // Component calls cost 2.5-3x more with async concurrency support on; policies
        // are synchronous.
        config.concurrency_support(false);
        sandbox_features(&mut config);
        config.epoch_interruption(true);
        config.consume_fuel(counted);
        let engine = Engine::new(&config)?;
        let mut linker = Linker::new(&engine);
        // A std wasm32-wasip2 guest imports wasi:io and wasi:cli even if it never prints.
        crate::wasi::add_to_linker(&mut linker)?;
        type Me = wasmtime::component::HasSelf<LinkState>;
        bindings::Policy::add_to_linker::<LinkState, Me>(&mut linker, |s| s)?;
        bindings_v2::Policy::add_to_linker::<LinkState, Me>(&mut linker, |s| s)?;
        let mut hook_linker = Linker::new(&engine);
        crate::wasi::add_to_linker(&mut hook_linker)?;
        let clock = Clock::start(&engine);
        Ok(Runtime {
            inner: Arc::new(RuntimeInner {
                engine,
                linker,
                hook_linker,
                compiled: Mutex::new(HashMap::new()),
                clock,
                counted,
            }),
        })
    }

    /// The process-wide runtime.
    pub fn shared() -> &'static Runtime {
        static SHARED: OnceLock<Runtime> = OnceLock::new();
        SHARED.get_or_init(|| Runtime::new().expect("the default wasmtime configuration is valid"))
    }

    /// Load a policy from a file: a component binary, or WAT text (a component, or a
    /// core module written to the policy world's canonical ABI, which is made a
    /// component here — no wasm toolchain needed). Within the default
    /// [`CompileBounds`].
    pub fn load_file(&self, path: impl AsRef<Path>) -> Result<Policy, LoadError> {
        self.load_file_bounded(path, &CompileBounds::default())
    }

    /// [`Runtime::load_file`] within `bounds`.
    pub fn load_file_bounded(
        &self,
        path: impl AsRef<Path>,
        bounds: &CompileBounds,
    ) -> Result<Policy, LoadError> {
        let path = path.as_ref();
        let bytes = read_policy_file(path, bounds)?;
        self.load_named(&bytes, &path.display().to_string(), bounds)
    }

    /// Load a policy from bytes (see [`Runtime::load_file`]).
    pub fn load(&self, bytes: &[u8]) -> Result<Policy, LoadError> {
        self.load_bounded(bytes, &CompileBounds::default())
    }

    /// [`Runtime::load`] within `bounds`.
    pub fn load_bounded(&self, bytes: &[u8], bounds: &CompileBounds) -> Result<Policy, LoadError> {
        self.load_named(bytes, "<bytes>", bounds)
    }

    /// The same policy compiled for this runtime (a handler built here adopts a policy
    /// loaded by another runtime itself). It was within bounds when it was loaded.
    pub fn adopt(&self, policy: &Policy) -> Result<Policy, LoadError> {
        self.load_named(&policy.meta.binary, &policy.meta.source, &UNBOUNDED)
    }

    /// Load `bytes`, named `source` in errors. The shape is checked on every load, a
    /// policy already compiled included, so a bound means the same whatever was loaded
    /// before.
    /// [`Runtime::load_bounded`], naming the policy `source` (a shipped name, a file) in
    /// errors until it names itself at `init`.
    pub fn load_named(
        &self,
        bytes: &[u8],
        source: &str,
        bounds: &CompileBounds,
    ) -> Result<Policy, LoadError> {
        use sha2::Digest;
        bounds.check_file_len(bytes.len() as u64)?;
        let key: PolicyDigest = sha2::Sha256::digest(bytes).into();
        let hit = self.inner.compiled.lock().get(&key).and_then(|hit| {
            (*hit.loaded_from == *bytes)
                .then(|| (hit.policy.clone(), hit.policy.meta.binary.clone()))
        });
        if let Some((policy, binary)) = hit {
            if !bytes.starts_with(WASM_MAGIC) {
                bounds.check_text(bytes)?;
            }
            bounds.check_binary(&binary)?;
            // The same bytes under another name are that name's policy in errors.
            return Ok(policy.named(source));
        }
        let binary = to_component_binary(bytes, "policy", bounds)?;
        let component = self.compile(&binary)?;
        let policy = self.check_world(component, binary.into(), source)?;
        self.inner.compiled.lock().insert(
            key,
            Compiled {
                loaded_from: bytes.into(),
                policy: policy.clone(),
            },
        );
        Ok(policy)
    }

    fn compile(&self, binary: &[u8]) -> Result<Component, LoadError> {
        let compile = || {
            Component::new(&self.inner.engine, binary)
                .map_err(|e| LoadError::Invalid { detail: detail(&e) })
        };
        match forked_compiler_threads()? {
            Some(threads) => threads.install(compile),
            None => compile(),
        }
    }

    /// Compile a component of the `hook` world (binary, or WAT as for policies) and
    /// check it exports `events`.
    pub(crate) fn compile_hook(
        &self,
        bytes: &[u8],
    ) -> Result<wasmtime::component::InstancePre<Sandbox>, LoadError> {
        let binary = to_component_binary(bytes, "hook", &CompileBounds::default())?;
        let component = self.compile(&binary)?;
        refuse_unserved_imports(&component, &self.inner.engine, WORLD_VERSION, &[])?;
        let want = format!("{WORLD_PACKAGE}/events@{WORLD_VERSION}");
        let exports: Vec<String> = component
            .component_type()
            .exports(&self.inner.engine)
            .map(|(n, _)| n.to_string())
            .collect();
        if !exports.contains(&want) {
            return Err(LoadError::WrongWorld {
                detail: format!(
                    "a hook exports `{want}`; this exports: {}",
                    list_or_none(&exports)
                ),
            });
        }
        self.inner
            .hook_linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::WrongWorld { detail: detail(&e) })
    }

    /// A store for one guest: the virtual WASI (`crate::wasi`: no files, network,
    /// environment or real time unless `limits.grants` says otherwise), output kept up
    /// to the limit, memory capped, calls time-limited.
    /// Starting the guest is the embedder's call: its instantiation (a start function)
    /// and `init` run under one deadline, armed here.
    pub(crate) fn guest_store<T>(
        &self,
        name: &str,
        limits: &Limits,
        state: impl FnOnce(Sandbox) -> T,
        sandbox: fn(&mut T) -> &mut Sandbox,
    ) -> Store<T> {
        let sandboxed = Sandbox::new(
            Arc::from(name),
            limits,
            self.inner.clock.clone(),
            self.inner.counted,
        );
        let mut store = Store::new(&self.inner.engine, state(sandboxed));
        store.limiter(move |s| sandbox(s).limiter());
        store.set_max_component_handles(MAX_COMPONENT_HANDLES);
        store.epoch_deadline_callback(move |mut ctx| Ok(sandbox(ctx.data_mut()).on_epoch()));
        let starting =
            Deadline::for_client_call(&self.inner.clock, CallTicks::of(limits.call_time));
        sandbox(store.data_mut())
            .begin_call(starting)
            .arm(&mut store);
        store
    }

    /// The clock every guest of this runtime is timed by: the embedder's entry points
    /// start their calls' deadlines on it.
    pub(crate) fn clock(&self) -> &Arc<Clock> {
        &self.inner.clock
    }

    fn check_world(
        &self,
        component: Component,
        binary: Arc<[u8]>,
        source: &str,
    ) -> Result<Policy, LoadError> {
        let ty = component.component_type();
        let engine = &self.inner.engine;
        let imports: Vec<String> = ty.imports(engine).map(|(n, _)| n.to_string()).collect();
        let exports: Vec<String> = ty.exports(engine).map(|(n, _)| n.to_string()).collect();
        let exported = |version: &str| {
            ["allocator", "lifecycle"]
                .iter()
                .all(|i| exports.contains(&format!("{WORLD_PACKAGE}/{i}@{version}")))
        };
        let version = if exported(WORLD_VERSION_2) {
            WORLD_VERSION_2
        } else if exported(WORLD_VERSION) {
            WORLD_VERSION
        } else {
            let other = format!("{WORLD_PACKAGE}/lifecycle@");
            if let Some(found) = exports.iter().find_map(|e| e.strip_prefix(&other)) {
                return Err(LoadError::WrongVersion {
                    found: found.to_string(),
                    expected: WORLD_VERSION_2,
                });
            }
            return Err(LoadError::WrongWorld {
                detail: format!(
                    "it does not export `{WORLD_PACKAGE}/allocator` and `{WORLD_PACKAGE}/lifecycle` at version {WORLD_VERSION} or {WORLD_VERSION_2} (it exports: {})",
                    list_or_none(&exports)
                ),
            });
        };
        let world_imports: &[&str] = if version == WORLD_VERSION {
            &["allocator", "bytes"]
        } else {
            &["allocator", "bytes", "memory", "diagnostics"]
        };
        refuse_unserved_imports(&component, engine, version, world_imports)?;
        let pre = self
            .inner
            .linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::WrongWorld { detail: detail(&e) })?;
        let wrong = |e: wasmtime::Error| LoadError::WrongWorld { detail: detail(&e) };
        let pre = if version == WORLD_VERSION {
            Pre::V1(bindings::PolicyPre::new(pre).map_err(wrong)?)
        } else {
            Pre::V2(bindings_v2::PolicyPre::new(pre).map_err(wrong)?)
        };
        Ok(Policy {
            pre,
            meta: Arc::new(PolicyMeta {
                source: source.to_string(),
                language: source_language(&binary),
                binary,
                imports,
                exports,
            }),
        })
    }

    /// Start one instance of `policy` as `start` says and initialise it with `config`.
    pub(crate) fn start(
        &self,
        policy: &Policy,
        config: &[(String, String)],
        start: LinkStart<'_>,
    ) -> Result<Link, LoadError> {
        if !Engine::same(policy.pre.engine(), &self.inner.engine) {
            // A policy loaded by another runtime: compiled again here, once.
            let adopted = self.adopt(policy)?;
            return self.start(&adopted, config, start);
        }
        let limits = start.limits;
        let mut store = self.guest_store(
            &policy.meta.source,
            limits,
            |sandbox| LinkState::new(sandbox, start),
            |s: &mut LinkState| &mut s.sandbox,
        );
        let start_err = |store: &mut Store<LinkState>, e| {
            LoadError::Start(Box::new(classify(store, limits, Call::Init, e)))
        };
        let instantiated = match &policy.pre {
            Pre::V1(pre) => pre.instantiate(&mut store).map(|b| (Exports::V1(b), None)),
            Pre::V2(pre) => pre.instance_pre().instantiate(&mut store).and_then(|i| {
                let b = bindings_v2::Policy::new(&mut store, &i)?;
                Ok((Exports::V2(b), Some(i)))
            }),
        };
        let (bindings, instance) = match instantiated {
            Ok(b) => b,
            Err(e) if e.is::<PoolConcurrencyLimitError>() => {
                return Err(LoadError::PoolFull { detail: detail(&e) });
            }
            Err(e) => return Err(start_err(&mut store, e)),
        };
        let answer = match &bindings {
            Exports::V1(b) => b
                .allocbox_policy_lifecycle()
                .call_init(&mut store, config)
                .map(|r| r.map(Said::from)),
            Exports::V2(b) => {
                use bindings_v2::exports::allocbox::policy::lifecycle::Limits as Told;
                let told = Told {
                    batch: limits.batch,
                    memory: limits.memory,
                    overhead: limits.overhead,
                };
                b.allocbox_policy_lifecycle()
                    .call_init(&mut store, config, told)
                    .map(|r| r.map(Said::from))
            }
        };
        let info = match answer {
            Ok(Ok(info)) => info,
            Ok(Err(message)) => {
                return Err(LoadError::ConfigRejected {
                    policy: policy.meta.source.clone(),
                    message: crate::untrusted::escape_at_most(&message, MAX_INIT_ERROR),
                });
            }
            Err(e) => return Err(start_err(&mut store, e)),
        };
        let mut info = check_info(info)?;
        if let Some(instance) = instance
            && policy.meta.exports.iter().any(|e| e == SHARDING_EXPORT)
        {
            info.shardable =
                ask_shardable(&mut store, &instance).map_err(|e| start_err(&mut store, e))?;
        }
        store.data_mut().sandbox.name = info.name.clone();
        Ok(Link::new(store, bindings, info, limits.clone()))
    }
}

/// The optional 0.2.0 export by which a policy says its state is per instance.
const SHARDING_EXPORT: &str = "allocbox:policy/sharding@0.2.0";

/// The policy's answer to `sharding.shardable`, asked once after `init` under the
/// deadline armed for its start.
fn ask_shardable(
    store: &mut Store<LinkState>,
    instance: &wasmtime::component::Instance,
) -> wasmtime::Result<bool> {
    let interface = instance
        .get_export_index(&mut *store, None, SHARDING_EXPORT)
        .ok_or_else(|| wasmtime::format_err!("`{SHARDING_EXPORT}` is not an instance"))?;
    let function = instance
        .get_export_index(&mut *store, Some(&interface), "shardable")
        .ok_or_else(|| wasmtime::format_err!("`{SHARDING_EXPORT}` has no `shardable`"))?;
    let shardable = instance.get_typed_func::<(), (bool,)>(&mut *store, &function)?;
    let (answer,) = shardable.call(&mut *store, ())?;
    Ok(answer)
}

/// Refuse a component that imports anything but `world_imports` (interfaces of this
/// package at `version`: a policy speaks one version) and the WASI the sandbox serves
/// (`crate::wasi::SERVED`), naming the first such import: an allow-list, checked before
/// anything is instantiated.
/// The bytes of the policy (or hook) file at `path`, refused as
/// [`LoadError::CompileBound`] past `bounds.file_bytes` before they are read, so a
/// file far past every bound costs a `stat`, not its size in memory.
pub fn read_policy_file(path: &Path, bounds: &CompileBounds) -> Result<Vec<u8>, LoadError> {
    use crate::compile_bounds::ReadRefused;
    bounds.read_file(path).map_err(|refused| match refused {
        ReadRefused::Io(error) => LoadError::Io {
            path: path.display().to_string(),
            error,
        },
        ReadRefused::Bound(exceeded) => exceeded.into(),
    })
}

fn refuse_unserved_imports(
    component: &Component,
    engine: &Engine,
    version: &str,
    world_imports: &[&str],
) -> Result<(), LoadError> {
    let ours = |name: &str| {
        world_imports
            .iter()
            .any(|i| name == format!("{WORLD_PACKAGE}/{i}@{version}"))
    };
    let ty = component.component_type();
    let unserved = ty
        .imports(engine)
        .map(|(name, _)| name)
        .find(|name| !ours(name) && !crate::wasi::is_served(name));
    match unserved {
        Some(import) => Err(LoadError::Import {
            import: import.to_string(),
        }),
        None => Ok(()),
    }
}

/// An error from a library that reads the policy's binary (wasmtime, wit-component,
/// the WAT parser), with its causes, as text safe to print: it may echo names from the
/// binary.
fn detail(error: &dyn std::fmt::Display) -> String {
    crate::untrusted::escape(&format!("{error:#}"))
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "nothing".to_string()
    } else {
        items.join(", ")
    }
}

/// The configuration of a runtime that starts instances from a pool ([`Runtime::pooled`]).
fn pool_config(instances: u32, memory: u64) -> Result<Config, wasmtime::Error> {
    const WASM_PAGE: u64 = 64 << 10;
    /// Memory kept mapped when a slot is freed (its dirty pages reset with memset),
    /// instead of handed back to the kernel and faulted in again by the next
    /// instance: a Rust guest's 1 MiB stack and its heap above it. Measured with
    /// `allocbox check`: 4 MiB beat 0, 1 and 2 MiB for `size-classes`.
    const KEEP_RESIDENT: usize = 4 << 20;
    let mut pool = PoolingAllocationConfig::new();
    // A Rust wasm32-wasip2 component has a few core instances, each with a table or
    // two, and one memory between them; a componentize-py one has 14 core instances
    // (CPython and its runtime). Room for the larger kind in every slot: unused slots
    // of the pool cost address space only.
    pool.total_component_instances(instances)
        .total_core_instances(instances.saturating_mul(16))
        .total_memories(instances.saturating_mul(4))
        .total_tables(instances.saturating_mul(16))
        .max_memory_size(usize::try_from(
            memory
                .div_ceil(WASM_PAGE)
                .saturating_mul(WASM_PAGE)
                .min(4 << 30),
        )?)
        .linear_memory_keep_resident(KEEP_RESIDENT)
        // Tables are a few KiB; memset beats madvise for them too (start+end of a
        // `system` instance: 34 µs against 43 µs).
        .table_keep_resident(64 << 10);
    let mut config = Config::new();
    config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    config.cache(compile_cache());
    Ok(config)
}
