//! Policies and event hooks named on the command line: a shipped one by its name, or a
//! file, loaded within the process's compile bounds (`--compile-bound`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use allocbox::{CompileBounds, Limits, Policy, Runtime, WasmHook};
use anyhow::{Context, Result, bail};

use crate::{progress, report};

/// The compile bounds of this process (`--compile-bound`), set by its first command.
static COMPILE_BOUNDS: std::sync::OnceLock<CompileBounds> = std::sync::OnceLock::new();

/// Use `bounds` for every policy this process loads: false when an earlier command of
/// the process set others (a second run from Python), which are kept.
pub(crate) fn set_compile_bounds(bounds: CompileBounds) -> bool {
    *COMPILE_BOUNDS.get_or_init(|| bounds) == bounds
}

mod shipped {
    include!(concat!(env!("OUT_DIR"), "/shipped.rs"));
}

/// A policy named on the command line: a file, a shipped policy by its name (the same
/// names as in Python: `size-classes`, ...), or `builtin` (also called by the name it
/// gives itself, `passthrough`); none is `builtin`. A file of a shipped policy's name
/// in the working directory wins.
pub(crate) fn load(runtime: &Runtime, path: Option<&PathBuf>) -> Result<Policy> {
    let bounds = COMPILE_BOUNDS.get_or_init(CompileBounds::default);
    let name = path
        .and_then(|p| p.to_str())
        .filter(|_| !path.is_some_and(|p| p.exists()));
    let embedded = match name {
        None if path.is_some() => None,
        None | Some("builtin" | "passthrough") => {
            Some(("builtin", allocbox::DEFAULT_POLICY_WAT.as_bytes()))
        }
        Some(name) => shipped::SHIPPED
            .iter()
            .find(|(shipped, _, _)| *shipped == name)
            .map(|&(name, _, bytes)| (name, bytes)),
    };
    if let Some((name, bytes)) = embedded {
        return runtime
            .load_named(bytes, name, bounds)
            .with_context(|| format!("the shipped policy `{name}` cannot be loaded"));
    }
    let path = path.expect("no path is builtin");
    let looks_like_a_name = path.components().count() == 1 && path.extension().is_none();
    if looks_like_a_name && !path.exists() {
        if path == Path::new("default") {
            bail!(
                "`default` is NumPy's own handler, run natively: `report` and \
                 `replay-trace` compare policies against it, but it is no policy, so \
                 there is nothing in it to check, replay or inspect; the built-in policy \
                 is `builtin`"
            );
        }
        bail!(
            "no file or shipped policy is called `{}`; shipped: {}",
            path.display(),
            shipped_names()
        );
    }
    // A large policy (Python, JavaScript) compiles for seconds the first time; the
    // compile cache serves it after that.
    let message = format!(
        "loading {} (compiled once, then served by the compile cache)",
        path.display()
    );
    progress::spinning(&message, || runtime.load_file_bounded(path, bounds))
        .with_context(|| format!("`{}` cannot be loaded", path.display()))
}

/// The event hooks this command (and the Python wheel) ships: `(name, what its report
/// holds, WAT source)`.
pub const SHIPPED_HOOKS: &[(&str, &str, &str)] = &[
    (
        "sizes",
        "a histogram of request sizes: 64 counts, the k-th of sizes in [2^k, 2^(k+1)) bytes",
        include_str!("../../../guest-handlers/hooks/wat/sizes-hook/sizes-hook.wat"),
    ),
    (
        "counting",
        "events by kind: [new, free, renew, bytes newly allocated]",
        include_str!("../../../guest-handlers/hooks/wat/counting-hook/counting-hook.wat"),
    ),
];

/// An event hook named on the command line: a shipped hook's name or a hook file.
pub(crate) fn load_hook(path: &Path, limits: &Limits) -> Result<Arc<WasmHook>> {
    let runtime = Runtime::shared();
    let name = path.to_str().filter(|_| !path.exists());
    if let Some(&(name, _, source)) = name.and_then(|n| SHIPPED_HOOKS.iter().find(|h| h.0 == n)) {
        return WasmHook::start(runtime, source.as_bytes(), name, limits.clone())
            .with_context(|| format!("the shipped hook `{name}` cannot be started"));
    }
    let bytes =
        allocbox::read_policy_file(path, COMPILE_BOUNDS.get_or_init(CompileBounds::default))
            .map_err(|e| {
                let shipped: Vec<&str> = SHIPPED_HOOKS.iter().map(|h| h.0).collect();
                let why = match e {
                    allocbox::LoadError::Io { error, .. } => {
                        format!("cannot read the hook: {error}")
                    }
                    other => other.to_string(),
                };
                anyhow::anyhow!(
                    "the hook `{}`: {why}; shipped hooks: {}",
                    path.display(),
                    shipped.join(", ")
                )
            })?;
    let name = path
        .file_stem()
        .map_or("hook".into(), |s| s.to_string_lossy());
    WasmHook::start(runtime, &bytes, &name, limits.clone())
        .with_context(|| format!("the hook `{}` cannot be started", path.display()))
}

/// Run `f` on `handler`, with `hook` told about its every event when there is one.
pub(crate) fn observed<R>(
    handler: &dyn allocbox::MemHandler,
    hook: Option<&WasmHook>,
    f: impl FnOnce(&dyn allocbox::MemHandler) -> R,
) -> R {
    match hook {
        Some(hook) => f(&allocbox::trace::Watched {
            handler,
            watcher: hook,
        }),
        None => f(handler),
    }
}

/// A hook's report as a sentence: the `sizes` hook's as a histogram, any other's as its
/// numbers.
pub(crate) fn hook_report(hook: &WasmHook, handler: &str) -> String {
    let numbers = match hook.report() {
        Ok(numbers) => numbers,
        Err(e) => return format!("FAILED     on `{handler}`, {e}\n"),
    };
    if hook.name() != "sizes" {
        let numbers: Vec<String> = numbers.iter().map(u64::to_string).collect();
        return format!(
            "hook `{}` on `{handler}`: {}\n",
            hook.name(),
            numbers.join(" ")
        );
    }
    let mut out = format!("hook `sizes` on `{handler}`: requests by size, [from, to)\n");
    // 2^k bytes; a hook's list is its own, so past 2^63 is not a size.
    let power = |k: usize| {
        u32::try_from(k)
            .ok()
            .and_then(|k| 1u64.checked_shl(k))
            .map_or_else(|| "16384 PiB".to_string(), report::bytes)
    };
    for (k, &count) in numbers.iter().enumerate().take(64).filter(|(_, c)| **c > 0) {
        out += &format!("  {:>7} – {:<7} {count}\n", power(k), power(k + 1));
    }
    out
}

/// The names a policy can be given by, for a message.
fn shipped_names() -> String {
    let mut names = vec!["builtin (the `passthrough` policy)"];
    names.extend(shipped::SHIPPED.iter().map(|(name, _, _)| *name));
    match shipped::SHIPPED_MISSING {
        Some(why) => format!("{} (this build carries no other: {why})", names.join(", ")),
        None => names.join(", "),
    }
}
