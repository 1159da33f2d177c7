//! The engine's configuration that is not per runtime: the WebAssembly features a guest
//! may use, the compile cache on disk, and compiler threads in a forked child.

use std::path::PathBuf;
use std::sync::Arc;

use allocbox_ledger::platform::fork;
use parking_lot::Mutex;
use wasmtime::Config;

use crate::error::LoadError;

/// In a forked child, a pool of compiler threads of its own. wasmtime compiles on
/// rayon's global pool, whose threads stayed in the parent: a job handed to it in the
/// child would wait forever. None in a process that was never forked.
pub(super) fn forked_compiler_threads() -> Result<Option<Arc<rayon_core::ThreadPool>>, LoadError> {
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

/// allocbox's directory in the user's cache: `$XDG_CACHE_HOME/allocbox`, else
/// `~/.cache/allocbox`; none when neither variable is set.
pub fn cache_dir() -> Option<PathBuf> {
    from_env("XDG_CACHE_HOME")
        .or_else(|| from_env("HOME").map(|home| home.join(".cache")))
        .map(|base| base.join("allocbox"))
}

/// A non-empty environment variable, as a path.
fn from_env(key: &str) -> Option<PathBuf> {
    std::env::var_os(key)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Where compiled policies are kept between processes: `$ALLOCBOX_COMPILE_CACHE`
/// (`off` for nowhere), else `compiled` in [`cache_dir`] (wasmtime's cache manages that
/// directory alone: it cleans up what it finds there).
///
/// Compiling a large policy (an interpreter inside, as Python and JavaScript policies
/// have) takes seconds; wasmtime's own cache keeps the machine code keyed by the
/// component's bytes and the engine's configuration, so a later process loads it in
/// milliseconds. The directory holds native code the host will run: it must be as
/// trusted as the program itself (a per-user cache directory is).
pub fn compile_cache_dir() -> Option<PathBuf> {
    match from_env(COMPILE_CACHE_ENV) {
        Some(dir) if dir.as_os_str() == "off" => None,
        Some(dir) => Some(dir),
        None => cache_dir().map(|dir| dir.join("compiled")),
    }
}

/// wasmtime's compile cache in [`compile_cache_dir`]; none when there is no such
/// directory or it cannot be used (loading then compiles every time, as without a cache).
pub(super) fn compile_cache() -> Option<wasmtime::Cache> {
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
pub(super) fn sandbox_features(config: &mut Config) {
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
