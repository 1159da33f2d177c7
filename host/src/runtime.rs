//! Loading policy components and starting them: one `Engine` per runtime, one `Linker`
//! filled once, one `Store` per policy instance.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use allocbox_ledger::platform::fork;
use parking_lot::Mutex;
use wasmtime::component::{Component, Linker};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolConcurrencyLimitError, PoolingAllocationConfig,
    Store,
};

use crate::clock::{Clock, EPOCH_TICK};
use crate::compile_bounds::CompileBounds;
use crate::error::{Call, LoadError};
use crate::link::bindings::{Policy as Bindings, PolicyPre};
use crate::link::{Limits, Link, LinkState, PolicyInfo, Sandbox, Upstream, classify};

/// The package and version of the WIT world this host speaks.
pub const WORLD_PACKAGE: &str = "allocbox:policy";
pub const WORLD_VERSION: &str = "0.1.0";
/// The WIT source of the policy world, for tools that need it.
pub const POLICY_WIT: &str = include_str!("../../wit/policy.wit");
/// The built-in default policy: the hand-written WAT `passthrough`, which needs no wasm
/// toolchain to build.
pub const DEFAULT_POLICY_WAT: &str =
    include_str!("../../guest-handlers/passthrough/passthrough.wat");

/// Resource handles a guest's component instances may hold at once (wasmtime's default
/// is 100,000): the policy world defines no resource, and WASI's are bounded more tightly
/// by `wasi::MAX_RESOURCES`.
const MAX_COMPONENT_HANDLES: usize = 4096;

/// How every wasm binary, module or component, starts.
const WASM_MAGIC: &[u8] = b"\0asm";

/// No bound: for a policy already loaded within bounds.
const UNBOUNDED: CompileBounds = CompileBounds {
    functions: u64::MAX,
    code_bytes: u64::MAX,
    function_bytes: u64::MAX,
    data_bytes: u64::MAX,
    modules: u64::MAX,
    text_bytes: u64::MAX,
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
        Runtime::with_config(config)
    }

    /// A runtime that keeps no compiled policy on disk ([`compile_cache_dir`]): for
    /// policies loaded once (generated ones, in a fuzzer), or where no cache directory
    /// can be trusted. It still keeps what it compiled in memory while it lives.
    pub fn without_disk_cache() -> Result<Runtime, wasmtime::Error> {
        Runtime::with_config(Config::new())
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
        Runtime::with_config(config)
    }

    fn with_config(mut config: Config) -> Result<Runtime, wasmtime::Error> {
        // Component calls cost 2.5-3x more with async concurrency support on; policies
        // are synchronous.
        config.concurrency_support(false);
        sandbox_features(&mut config);
        config.epoch_interruption(true);
        let engine = Engine::new(&config)?;
        let mut linker = Linker::new(&engine);
        // A std wasm32-wasip2 guest imports wasi:io and wasi:cli even if it never prints.
        crate::wasi::add_to_linker(&mut linker)?;
        Bindings::add_to_linker::<LinkState, wasmtime::component::HasSelf<LinkState>>(
            &mut linker,
            |s| s,
        )?;
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
        let bytes = std::fs::read(path).map_err(|error| LoadError::Io {
            path: path.display().to_string(),
            error,
        })?;
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
    fn load_named(
        &self,
        bytes: &[u8],
        source: &str,
        bounds: &CompileBounds,
    ) -> Result<Policy, LoadError> {
        use sha2::Digest;
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
            return Ok(policy);
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
        refuse_unserved_imports(&component, &self.inner.engine, &[])?;
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
    /// Returns the store and the epoch ticks of one call's time limit.
    pub(crate) fn guest_store<T>(
        &self,
        name: &str,
        limits: &Limits,
        state: impl FnOnce(Sandbox) -> T,
        sandbox: fn(&mut T) -> &mut Sandbox,
    ) -> (Store<T>, u64) {
        let sandboxed = Sandbox::new(Arc::from(name), limits, self.inner.clock.clone());
        let mut store = Store::new(&self.inner.engine, state(sandboxed));
        store.limiter(move |s| sandbox(s).limiter());
        store.set_max_component_handles(MAX_COMPONENT_HANDLES);
        store.epoch_deadline_callback(move |mut ctx| Ok(sandbox(ctx.data_mut()).on_epoch()));
        let ticks = limits.call_time.as_nanos().div_ceil(EPOCH_TICK.as_nanos()) as u64 + 1;
        // Instantiation (a start function) and `init` run under one call's deadline.
        let armed = sandbox(store.data_mut()).begin_call(ticks, None);
        store.set_epoch_deadline(armed);
        (store, ticks)
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
        for needed in ["allocator", "lifecycle"] {
            let want = format!("{WORLD_PACKAGE}/{needed}@{WORLD_VERSION}");
            if exports.contains(&want) {
                continue;
            }
            let other = format!("{WORLD_PACKAGE}/{needed}@");
            if let Some(found) = exports.iter().find_map(|e| e.strip_prefix(&other)) {
                return Err(LoadError::WrongVersion {
                    found: found.to_string(),
                    expected: WORLD_VERSION,
                });
            }
            return Err(LoadError::WrongWorld {
                detail: format!(
                    "it does not export `{want}` (it exports: {})",
                    list_or_none(&exports)
                ),
            });
        }
        refuse_unserved_imports(&component, engine, &["allocator", "bytes"])?;
        let pre = self
            .inner
            .linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::WrongWorld { detail: detail(&e) })?;
        let pre = PolicyPre::new(pre).map_err(|e| LoadError::WrongWorld { detail: detail(&e) })?;
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

    /// Start one instance of `policy` over `upstream` and initialise it with `config`.
    pub(crate) fn start(
        &self,
        policy: &Policy,
        config: &[(String, String)],
        upstream: Upstream,
        limits: &Limits,
        checked: bool,
    ) -> Result<Link, LoadError> {
        if !Engine::same(policy.pre.instance_pre().engine(), &self.inner.engine) {
            // A policy loaded by another runtime: compiled again here, once.
            return self.start(&self.adopt(policy)?, config, upstream, limits, checked);
        }
        let (mut store, ticks) = self.guest_store(
            &policy.meta.source,
            limits,
            |sandbox| LinkState::new(sandbox, upstream, limits, checked),
            |s: &mut LinkState| &mut s.sandbox,
        );
        let start_err = |store: &mut Store<LinkState>, e| {
            LoadError::Start(Box::new(classify(store, limits, Call::Init, e)))
        };
        let bindings = match policy.pre.instantiate(&mut store) {
            Ok(b) => b,
            Err(e) if e.is::<PoolConcurrencyLimitError>() => {
                return Err(LoadError::PoolFull { detail: detail(&e) });
            }
            Err(e) => return Err(start_err(&mut store, e)),
        };
        let answer = bindings
            .allocbox_policy_lifecycle()
            .call_init(&mut store, config);
        let info = match answer {
            Ok(Ok(info)) => info,
            Ok(Err(message)) => {
                return Err(LoadError::ConfigRejected {
                    policy: policy.meta.source.clone(),
                    message: crate::untrusted::escape(&message),
                });
            }
            Err(e) => return Err(start_err(&mut store, e)),
        };
        let info = check_info(info)?;
        store.data_mut().sandbox.name = info.name.clone();
        Ok(Link::new(store, bindings, info, ticks, limits.clone()))
    }
}

/// Refuse a component that imports anything but `world_imports` (interfaces of this
/// package and version) and the WASI the sandbox serves (`crate::wasi::SERVED`), naming
/// the first such import: an allow-list, checked before anything is instantiated.
fn refuse_unserved_imports(
    component: &Component,
    engine: &Engine,
    world_imports: &[&str],
) -> Result<(), LoadError> {
    let ours = |name: &str| {
        world_imports
            .iter()
            .any(|i| name == format!("{WORLD_PACKAGE}/{i}@{WORLD_VERSION}"))
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

/// Check what a policy says about itself (C1, C6).
fn check_info(
    info: crate::link::bindings::exports::allocbox::policy::lifecycle::Info,
) -> Result<PolicyInfo, LoadError> {
    if info.name.is_empty() || info.name.len() > 127 {
        return Err(LoadError::BadName {
            len: info.name.len(),
        });
    }
    let name = crate::untrusted::escape(&info.name);
    if info.version != 1 {
        return Err(LoadError::BadVersion {
            policy: name,
            version: info.version,
        });
    }
    if !info.alignment.is_power_of_two() {
        return Err(LoadError::BadAlignment {
            policy: name,
            alignment: info.alignment,
        });
    }
    Ok(PolicyInfo {
        name: name.into(),
        version: info.version,
        alignment: info.alignment,
        batch: info.batch,
    })
}

/// In a forked child, a pool of compiler threads of its own. wasmtime compiles on
/// rayon's global pool, whose threads stayed in the parent: a job handed to it in the
/// child would wait forever. None in a process that was never forked.
fn forked_compiler_threads() -> Result<Option<Arc<rayon_core::ThreadPool>>, LoadError> {
    static POOL: Mutex<Option<(u64, Arc<rayon_core::ThreadPool>)>> = Mutex::new(None);
    let generation = fork::generation();
    if generation == 0 {
        return Ok(None);
    }
    let mut pool = POOL.lock();
    if let Some((made_in, threads)) = pool.as_ref()
        && *made_in == generation
    {
        return Ok(Some(Arc::clone(threads)));
    }
    // Built by an earlier generation, its threads are gone too; dropping it would only
    // signal them.
    if let Some(stale) = pool.take() {
        std::mem::forget(stale);
    }
    let threads = rayon_core::ThreadPoolBuilder::new()
        .build()
        .map(Arc::new)
        .map_err(|e| LoadError::NoCompilerThreads {
            detail: e.to_string(),
        })?;
    *pool = Some((generation, Arc::clone(&threads)));
    Ok(Some(threads))
}

/// The environment variable that says where compiled policies are kept between
/// processes: a directory, or `off`.
pub const COMPILE_CACHE_ENV: &str = "ALLOCBOX_COMPILE_CACHE";

/// Where compiled policies are kept between processes: `$ALLOCBOX_COMPILE_CACHE`
/// (`off` for nowhere), else `$XDG_CACHE_HOME/allocbox`, else `~/.cache/allocbox`.
///
/// Compiling a large policy (an interpreter inside, as Python and JavaScript policies
/// have) takes seconds; wasmtime's own cache keeps the machine code keyed by the
/// component's bytes and the engine's configuration, so a later process loads it in
/// milliseconds. The directory holds native code the host will run: it must be as
/// trusted as the program itself (a per-user cache directory is).
pub fn compile_cache_dir() -> Option<PathBuf> {
    let from_env = |key| {
        std::env::var_os(key)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    match from_env(COMPILE_CACHE_ENV) {
        Some(dir) if dir.as_os_str() == "off" => None,
        Some(dir) => Some(dir),
        None => from_env("XDG_CACHE_HOME")
            .or_else(|| from_env("HOME").map(|home| home.join(".cache")))
            .map(|base| base.join("allocbox")),
    }
}

/// wasmtime's compile cache in [`compile_cache_dir`]; none when there is no such
/// directory or it cannot be used (loading then compiles every time, as without a cache).
fn compile_cache() -> Option<wasmtime::Cache> {
    let dir = compile_cache_dir()?;
    let dir = std::path::absolute(&dir).unwrap_or(dir);
    let mut config = wasmtime::CacheConfig::new();
    config.with_directory(&dir);
    wasmtime::Cache::new(config)
        .inspect_err(|e| log::warn!("no compile cache in {}: {e:#}", dir.display()))
        .ok()
}

/// Turn off every WebAssembly feature the policy and hook worlds do not need, so that
/// the engine's surface a guest can reach is what the shipped policies' toolchains use
/// (SECURITY.md lists each decision). On: the WebAssembly 2.0 core the toolchains emit
/// (bulk memory, multi-value, reference types, SIMD, sign extension, saturating
/// conversions, mutable globals, extended constants), tail calls and the component
/// model's synchronous core. Off: threads and shared memory (a policy runs on one thread
/// at a time), 64-bit and multiple memories, GC and typed function references,
/// exceptions, stack switching, relaxed SIMD (results that vary by host CPU), wide
/// arithmetic, custom page sizes, and the component model's async, threading, GC and
/// later additions.
fn sandbox_features(config: &mut Config) {
    use wasmtime::WasmFeatures as F;
    let off = F::THREADS
        | F::SHARED_EVERYTHING_THREADS
        | F::MEMORY64
        | F::MULTI_MEMORY
        | F::GC
        | F::FUNCTION_REFERENCES
        | F::EXCEPTIONS
        | F::LEGACY_EXCEPTIONS
        | F::STACK_SWITCHING
        | F::RELAXED_SIMD
        | F::WIDE_ARITHMETIC
        | F::CUSTOM_PAGE_SIZES
        | F::CM_ASYNC
        | F::CM_ASYNC_STACKFUL
        | F::CM_MORE_ASYNC_BUILTINS
        | F::CM_THREADING
        | F::CM_ERROR_CONTEXT
        | F::CM_GC
        | F::CM_MAP
        | F::CM64
        | F::CM_FIXED_LENGTH_LISTS;
    config.wasm_features(off, false);
}

/// Turn file contents into component bytes, or say clearly why they are not one.
fn to_component_binary(
    bytes: &[u8],
    world: &str,
    bounds: &CompileBounds,
) -> Result<Vec<u8>, LoadError> {
    if bytes.starts_with(WASM_MAGIC) {
        bounds.check_binary(bytes)?;
        // Bytes 6..8 are the layer: 0 for a core module, 1 for a component. A core module
        // written to the world's canonical ABI (what C, Zig, AssemblyScript or Go
        // toolchains emit) is made a component here, as WAT is: no outside tool needed.
        return match bytes.get(6..8) {
            Some([1, 0]) => Ok(bytes.to_vec()),
            Some([0, 0]) => componentize(bytes.to_vec(), world),
            _ => Err(LoadError::Invalid {
                detail: "unknown wasm binary layer".into(),
            }),
        };
    }
    let Ok(text) = std::str::from_utf8(bytes) else {
        return Err(LoadError::NotWasm {
            detail: "binary data without the `\\0asm` magic".into(),
        });
    };
    bounds.check_text(bytes)?;
    let looks_like_wat = text
        .lines()
        .map(str::trim_start)
        .find(|l| !l.is_empty() && !l.starts_with(";;"))
        .is_some_and(|l| l.starts_with('('));
    let binary = wat::parse_str(text).map_err(|e| {
        if looks_like_wat {
            LoadError::Invalid { detail: detail(&e) }
        } else {
            LoadError::NotWasm {
                detail: "text that is not WAT".into(),
            }
        }
    })?;
    bounds.check_binary(&binary)?;
    match binary.get(6..8) {
        Some([0, 0]) => componentize(binary, world),
        _ => Ok(binary),
    }
}

/// The `wasi_snapshot_preview1` that core modules get: a sandbox with nothing in it,
/// see the file for what each call answers.
const WASI_STUB_WAT: &str = include_str!("wasi_stub.wat");

/// [`WASI_STUB_WAT`] in binary, with the world it imports from the host, built once per
/// process.
fn wasi_stub() -> &'static [u8] {
    static STUB: OnceLock<Vec<u8>> = OnceLock::new();
    STUB.get_or_init(|| {
        let mut stub = wat::parse_str(WASI_STUB_WAT).expect("the WASI stub is valid WAT");
        let mut resolve = wit_parser::Resolve::default();
        let package = resolve
            .push_str("sandbox.wit", crate::wasi::STUB_WIT)
            .expect("the stub's WIT is valid");
        let world = resolve
            .select_world(&[package], Some("stub"))
            .expect("the stub's WIT has its world");
        wit_component::embed_component_metadata(
            &mut stub,
            &resolve,
            world,
            wit_component::StringEncoding::UTF8,
            false,
        )
        .expect("the stub's imports are its world's");
        stub
    })
}

/// Make a core module (binary, or from WAT) a component of `world` (`policy` or
/// `hook`), as `wasm-tools component new` would: embed the world's type information,
/// then encode. The module must import and export the world's functions under their
/// canonical-ABI names (`allocbox:policy/allocator@0.1.0#malloc`, ...).
///
/// It may also import `wasi_snapshot_preview1` (language runtimes such as Go's do even
/// when they never print): those imports are served by allocbox's own stub adapter,
/// which imports nothing but the module's memory and so grants nothing: clocks that
/// carry no real time, a fixed random sequence, output dropped, no descriptors. A
/// module that imports no WASI gets no adapter (wit-component skips an unused one).
fn componentize(mut module: Vec<u8>, world: &str) -> Result<Vec<u8>, LoadError> {
    let err = |e: anyhow::Error| LoadError::Componentize { detail: detail(&e) };
    let mut resolve = wit_parser::Resolve::default();
    let pkg = resolve.push_str("policy.wit", POLICY_WIT).map_err(err)?;
    let world = resolve.select_world(&[pkg], Some(world)).map_err(err)?;
    wit_component::embed_component_metadata(
        &mut module,
        &resolve,
        world,
        wit_component::StringEncoding::UTF8,
        false,
    )
    .map_err(err)?;
    wit_component::ComponentEncoder::default()
        .module(&module)
        .map_err(err)?
        .adapter("wasi_snapshot_preview1", wasi_stub())
        .map_err(err)?
        .validate(true)
        .encode()
        .map_err(err)
}

/// A compiled policy component, checked against the policy world. Cheap to clone;
/// start instances of it with [`crate::HandlerBuilder`].
#[derive(Clone)]
pub struct Policy {
    pre: PolicyPre<LinkState>,
    meta: Arc<PolicyMeta>,
}

struct PolicyMeta {
    source: String,
    /// The component binary, to compile the policy again for another runtime.
    binary: Arc<[u8]>,
    imports: Vec<String>,
    exports: Vec<String>,
    language: Option<String>,
}

/// The source language a policy's `producers` sections name, e.g. `Rust`, `C`: the
/// first its own top-level section names (a core module or component that says what it
/// was written in), else the first a core module inside names (a Rust component's main
/// module says `Rust`, then `C11` for the libc linked into it); none when the toolchain
/// says nothing.
fn source_language(binary: &[u8]) -> Option<String> {
    use wasmparser::{KnownCustom, Parser, Payload};
    let (mut top, mut inner) = (Vec::new(), Vec::new());
    let mut depth = 0usize;
    for payload in Parser::new(0).parse_all(binary) {
        let section = match payload {
            Ok(Payload::Version { .. }) => {
                depth += 1;
                continue;
            }
            Ok(Payload::End(_)) => {
                depth = depth.saturating_sub(1);
                continue;
            }
            Ok(Payload::CustomSection(section)) => section,
            Ok(_) => continue,
            Err(_) => break,
        };
        let KnownCustom::Producers(fields) = section.as_known() else {
            continue;
        };
        let found = if depth <= 1 { &mut top } else { &mut inner };
        for field in fields.into_iter().flatten() {
            if field.name != "language" {
                continue;
            }
            found.extend(
                field
                    .values
                    .into_iter()
                    .flatten()
                    .map(|v| v.name.to_string()),
            );
        }
    }
    top.into_iter()
        .chain(inner)
        .next()
        .map(|language| crate::untrusted::escape(&language))
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("source", &self.meta.source)
            .field("size", &self.size())
            .field("imports", &self.meta.imports)
            .field("exports", &self.meta.exports)
            .finish()
    }
}

impl Policy {
    /// Where it was loaded from.
    pub fn source(&self) -> &str {
        &self.meta.source
    }
    /// Size of the component binary in bytes.
    pub fn size(&self) -> usize {
        self.meta.binary.len()
    }
    /// The names the component imports.
    pub fn imports(&self) -> &[String] {
        &self.meta.imports
    }
    /// The names the component exports.
    pub fn exports(&self) -> &[String] {
        &self.meta.exports
    }
    /// The source language the component's toolchain recorded (`producers` sections),
    /// e.g. `Rust`; none when it recorded none.
    pub fn language(&self) -> Option<&str> {
        self.meta.language.as_deref()
    }
}
