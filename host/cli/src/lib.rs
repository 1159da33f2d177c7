//! The `allocbox` command line, as a library: the binary, the Python wheel's `allocbox`
//! command and the integration tests all run [`run`].

pub mod report;

mod arguments;
mod check_command;
mod convert;
mod inspect;
mod new_policy;
mod progress;
mod run_args;
mod trace_command;

pub use run_args::{Program, RunCommand, parse_run};

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use allocbox::{CompileBound, CompileBounds, Limits, Policy, Runtime, WasmHook};
use allocbox_check::CheckOptions;
use anyhow::{Context, Result, bail};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use arguments::{
    at_least_one, batch_limit, call_time_ms, check_seconds, client_threads, guest_memory,
    kind_grant, max_ops, overhead, parse_compile_bound, parse_key_value,
};
use check_command::{CheckArgs, run_check, run_replay};
use inspect::inspect;
use trace_command::{ReportArgs, config_per_policy, run_replay_trace, run_report};

#[derive(Parser)]
#[command(
    name = "allocbox",
    version,
    about = "Sandboxed, checkable NEP 49 allocation policies"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Allow a policy of this shape to be compiled, as NAME=N (repeatable): `functions`
    /// [default: 65536], `code-bytes` [32 MiB], `function-bytes` [2 MiB], `data-bytes`
    /// [32 MiB], `modules` [32], `text-bytes` (WAT) [16 MiB]. A policy past one is
    /// refused before it is compiled.
    #[arg(long = "compile-bound", global = true, value_parser = parse_compile_bound)]
    compile_bounds: Vec<(CompileBound, u64)>,
}

/// The compile bounds of this process (`--compile-bound`), set by its first [`run`].
static COMPILE_BOUNDS: std::sync::OnceLock<CompileBounds> = std::sync::OnceLock::new();

#[derive(Subcommand)]
enum Command {
    /// Fuzz the handler contract of policies: random malloc/calloc/realloc/free sequences
    /// with every check on; a failure is shrunk to a short replayable script. With no
    /// file, checks the built-in default policy.
    Check {
        /// Policies: shipped ones by name (`system`, `aligned`, `size-classes`, `arena`,
        /// `builtin`), components (.wasm) or WAT sources (.wat).
        policies: Vec<PathBuf>,
        /// Seconds to spend on each policy, in rounds of `--cases` sequences (every
        /// fourth round long-lived instances of thousands of operations). Default 3,
        /// unless `--cases` is given alone.
        #[arg(long, allow_negative_numbers = true, value_parser = check_seconds)]
        time: Option<f64>,
        /// Random sequences per round. Given without `--time`: run exactly this many.
        #[arg(long, value_parser = at_least_one::<u32>)]
        cases: Option<u32>,
        /// Seed, for a run that repeats exactly.
        #[arg(long)]
        seed: Option<u64>,
        /// Most operations per sequence (per thread).
        #[arg(long, default_value_t = 128, value_parser = max_ops)]
        max_ops: usize,
        /// Client threads calling one handler at once.
        #[arg(long, default_value_t = 1, value_parser = client_threads)]
        threads: usize,
        /// One JSON report per line instead of text.
        #[arg(long)]
        json: bool,
        /// Where failing seeds and scripts are kept [default: `regressions` in the user's
        /// cache directory, `~/.cache/allocbox/regressions`]; the report names the file.
        #[arg(long, value_name = "DIR")]
        regressions: Option<PathBuf>,
        /// Configuration passed to every policy's `init`, as KEY=VALUE (repeatable).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        hook: HookArg,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Convert a trace between the binary form recordings write and the text form
    /// (`op id size thread` lines) people read and write by hand.
    TraceConvert {
        /// The trace to convert (either form).
        input: PathBuf,
        /// Where to write it; replaced only once written whole. Text is gzip-compressed
        /// when the name ends in `.gz`.
        output: PathBuf,
        /// The form to write [default: the other form than the input's].
        #[arg(long, value_enum)]
        to: Option<convert::Form>,
    },
    /// Replay an allocation trace (binary, or `op id size thread` lines, plain or gzip) through a
    /// handler and report time per event, peak bytes, corrections and the first failing
    /// event. Exit 1 if an event fails, or if a policy still holds host memory once every
    /// block is freed and it is trimmed (a leak).
    ReplayTrace {
        trace: PathBuf,
        /// The chain, top first: a shipped policy's name (`size-classes`, ...), a policy
        /// file, `default` (NumPy's default handler, natively) or `builtin` (the built-in
        /// default policy). Default: `default`.
        #[arg(long = "policy", short = 'p')]
        policies: Vec<String>,
        /// Configuration for the `init` of the policy named before it, as KEY=VALUE
        /// (repeatable: `-p aligned -c alignment=128 -p size-classes -c bucket-depth=7`).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        hook: HookArg,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Replay an allocation trace through each handler, one event after another on one
    /// thread, and write one self-contained HTML page comparing them: live and held bytes
    /// over time, the peak and the test it fell in (the trace's comment lines), the
    /// phases with the most bytes and overhead, where the most each handler held went
    /// by size class, what the trace left live, held/live, time per event, request
    /// sizes, the first failing event. Prints a summary table (or JSON). Exit 1 if an event fails in any handler, or a
    /// policy leaks (the page is still written).
    Report {
        /// The trace: `op id size thread` lines, plain or gzip. Several (a program's and
        /// its child processes', as `allocbox run` writes them) make one page, a part
        /// per trace, each replayed on its own.
        #[arg(required = true)]
        traces: Vec<PathBuf>,
        /// A handler (repeatable, at least one): `default` (NumPy's default handler,
        /// natively), a shipped policy's name (`size-classes`, ..., `builtin`) or a policy
        /// file, each on its own over the host's memory.
        #[arg(long = "policy", short = 'p', required = true)]
        policies: Vec<String>,
        /// Where the HTML page is written.
        #[arg(long, short = 'o')]
        output: PathBuf,
        /// Print the summary as JSON (an array, one object per handler).
        #[arg(long)]
        json: bool,
        /// Configuration for the `init` of the policy named before it, as KEY=VALUE
        /// (repeatable: `-p size-classes -c bucket-depth=7 -p arena`; `default` takes
        /// none).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        hook: HookArg,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Run a script (one operation a line, as `check` prints it) through a policy with
    /// every check on.
    #[command(after_help = allocbox_check::SCRIPT_NOTATION)]
    Replay {
        /// The script: as `check` printed and saved it, or written by hand.
        script: PathBuf,
        /// A shipped policy's name or a policy file; with none, the built-in default
        /// policy.
        policy: Option<PathBuf>,
        /// Configuration passed to the policy's `init`, as KEY=VALUE (repeatable).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Show what a policy is: name, version, alignment, world, imports, exports, size.
    /// With no file, the built-in default policy.
    Inspect {
        /// A shipped policy's name, a policy component (.wasm) or WAT source (.wat).
        policy: Option<PathBuf>,
        /// Configuration passed to the policy's `init`, as KEY=VALUE (repeatable).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
    },
    Run(run_args::RunArgs),
    /// Start a policy project in `./NAME` that builds with one command and passes `check`
    /// as it stands; its README.md says how to build, check and test it.
    New {
        /// The policy's name: a crate name (letters, digits, `-`, `_`; 1..=64 bytes).
        name: String,
        /// `rust` (a cargo project over the allocbox-policy SDK), `wat` (WebAssembly
        /// text, nothing to build), or `c`, `zig`, `assemblyscript` (`as`), `python`, `go`,
        /// `js` (`javascript`) (a `./build.sh` project with a `./setup.sh` that installs
        /// its toolchain).
        #[arg(long, value_parser = new_policy::parse_lang)]
        lang: new_policy::Lang,
        /// The project's directory, instead of `./NAME`; it must not exist or be empty.
        #[arg(long)]
        path: Option<PathBuf>,
    },
}

/// `--hook`, the same for every command that replays events.
#[derive(Args, Debug, Clone, Default)]
struct HookArg {
    /// An event hook told about every block each policy or handler lends, resizes and
    /// frees (one instance each; in `check`, shrinking included), its report printed
    /// after their results: a shipped hook's name (`sizes`, `counting`) or a hook
    /// component (.wasm, .wat).
    #[arg(long = "hook", value_name = "HOOK")]
    path: Option<PathBuf>,
}

/// The bounds on every policy instance ([`Limits`]); each defaults to the library's.
#[derive(Args, Debug, Clone, Default)]
struct LimitArgs {
    /// Longest one call into a policy may run, time in its imports included, in ms
    /// [default: 1000; 250 for check and replay].
    #[arg(long, value_parser = call_time_ms)]
    call_time_ms: Option<u64>,
    /// Most bytes of its own memory a policy may grow to, as bytes or with a unit
    /// (`64MiB`, `1GiB`) [default: 128 MiB].
    #[arg(long, value_parser = guest_memory)]
    guest_memory: Option<u64>,
    /// Most blocks one malloc-many or free-many may ask of the host [default: 4096].
    #[arg(long, value_parser = batch_limit)]
    batch_limit: Option<u32>,
    /// Most bytes a policy may hold from upstream beyond what its client holds and asks
    /// for, as bytes or with a unit; past it, upstream requests are answered
    /// out-of-memory [default: 256 MiB].
    #[arg(long, value_parser = overhead)]
    overhead: Option<u64>,
    /// Kinds of memory a policy may ask the host to map for it, comma-separated:
    /// numa, huge-pages, locked, guarded [default: none].
    #[arg(long = "grant", value_name = "KINDS", value_delimiter = ',', value_parser = kind_grant)]
    grants: Vec<allocbox::mapped::KindGrant>,
}

impl LimitArgs {
    fn limits(&self, call_time: Duration) -> Limits {
        let defaults = Limits::default();
        Limits {
            call_time: self.call_time_ms.map_or(call_time, Duration::from_millis),
            memory: self.guest_memory.unwrap_or(defaults.memory),
            batch: self.batch_limit.unwrap_or(defaults.batch),
            overhead: self.overhead.unwrap_or(defaults.overhead),
            grants: allocbox::Grants {
                memory: self.grants.iter().fold(Default::default(), |mut all, &g| {
                    all.grant(g);
                    all
                }),
                ..defaults.grants
            },
            ..defaults
        }
    }
}

/// The call limit of checking runs: short, so a looping policy is found quickly.
const CHECK_CALL_TIME: Duration = Duration::from_millis(250);
/// How long `allocbox check` spends on a policy unless told otherwise.
const DEFAULT_CHECK_TIME: Duration = Duration::from_secs(3);

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

/// A failed check exits 1; input that cannot be used exits 2.
pub(crate) enum Outcome {
    Held,
    Broken,
}

/// Print to stdout; a reader that went away (`| head`) is not an error.
pub(crate) fn print_report(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

/// Run the command line `args` (the program's name first, as [`std::env::args_os`]
/// gives it) and return the exit status: 0 every rule held (or the command succeeded),
/// 1 a rule was broken, 2 unusable input. The `allocbox` binary and the Python wheel's
/// `allocbox` command both run this.
pub fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let parsed = Cli::command()
        .try_get_matches_from(args)
        .and_then(|matches| Cli::from_arg_matches(&matches).map(|cli| (cli, matches)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            // Help and version are printed to stdout and succeed; a usage error is
            // printed to stderr and exits 2, as clap's own `exit` would.
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(2);
        }
    };
    // `report` and `replay-trace` give each `-c` to the `-p` before it.
    let per_policy = |config| {
        let sub = matches
            .subcommand()
            .map(|(_, m)| m)
            .expect("a subcommand is required");
        config_per_policy(sub, config)
    };
    let mut bounds = CompileBounds::default();
    for &(bound, value) in &cli.compile_bounds {
        bounds.set(bound, value);
    }
    // A second run in one process (from Python) keeps the first run's bounds only if
    // they are the same; a different set is a usage error, not a silent mix.
    if *COMPILE_BOUNDS.get_or_init(|| bounds) != bounds {
        eprintln!(
            "allocbox: --compile-bound differs from an earlier command in this process; \
             run each set of bounds in a process of its own"
        );
        return 2;
    }
    let result = match cli.command {
        Command::Inspect { policy, config } => inspect(policy, config).map(|()| Outcome::Held),
        // The program runs in a Python process, with NumPy: the wheel's `allocbox`
        // command runs it (its `run` parsed by `parse_run`, this same grammar).
        Command::Run(_) => Err(anyhow::anyhow!(
            "`allocbox run` runs a Python program, so it needs the Python package: install \
             the wheel (python/build_wheel.sh), then run its `allocbox run` (or `python -m \
             allocbox run`)"
        )),
        Command::New { name, lang, path } => new_policy::create(&name, lang, path).map(|made| {
            print_report(&format!(
                "created `{name}` in {}\nnext: {}\n",
                made.dir.display(),
                made.next
            ));
            Outcome::Held
        }),
        Command::Check {
            policies,
            time,
            cases,
            seed,
            max_ops,
            threads,
            json,
            regressions,
            config,
            hook,
            limits,
        } => run_check(CheckArgs {
            policies,
            options: CheckOptions {
                cases: cases.unwrap_or(64),
                time: match (time, cases) {
                    (Some(secs), _) => Some(Duration::from_secs_f64(secs)),
                    (None, Some(_)) => None,
                    (None, None) => Some(DEFAULT_CHECK_TIME),
                },
                seed,
                max_ops,
                threads,
                regressions: regressions.or_else(allocbox_check::default_regressions_dir),
                limits: limits.limits(CHECK_CALL_TIME),
                ..CheckOptions::default()
            },
            json,
            config,
            hook: hook.path,
        }),
        Command::Replay {
            script,
            policy,
            config,
            limits,
        } => run_replay(script, policy, config, limits.limits(CHECK_CALL_TIME)),
        Command::Report {
            traces,
            policies,
            output,
            json,
            config,
            hook,
            limits,
        } => per_policy(config).and_then(|config| {
            run_report(ReportArgs {
                traces,
                policies,
                output,
                json,
                config,
                hook: hook.path,
                limits: limits.limits(Limits::default().call_time),
            })
        }),
        Command::TraceConvert { input, output, to } => {
            convert::run_trace_convert(&input, &output, to)
        }
        Command::ReplayTrace {
            trace,
            policies,
            config,
            hook,
            limits,
        } => per_policy(config).and_then(|config| {
            run_replay_trace(
                trace,
                policies,
                config,
                hook.path,
                limits.limits(Limits::default().call_time),
            )
        }),
    };
    match result {
        Ok(Outcome::Held) => 0,
        Ok(Outcome::Broken) => 1,
        Err(e) => {
            eprintln!("allocbox: {e:#}");
            2
        }
    }
}
