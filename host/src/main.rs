//! The `allocbox` command line.
//!
//! Exit status: 0 every rule held (or the command succeeded), 1 a rule was broken,
//! 2 unusable input (a file that is not a policy, a bad configuration, a bad script).

mod new_policy;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use allocbox::check::{self, CheckOptions, CheckReport, Script};
use allocbox::{CompileBound, CompileBounds, HandlerBuilder, Limits, Policy, Runtime};
use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

mod progress;

#[derive(Parser)]
#[command(version, about = "Sandboxed, checkable NEP 49 allocation policies")]
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

/// The compile bounds of this run (`--compile-bound`), set once in `main`.
static COMPILE_BOUNDS: std::sync::OnceLock<CompileBounds> = std::sync::OnceLock::new();

fn parse_compile_bound(s: &str) -> Result<(CompileBound, u64)> {
    let (name, value) = parse_key_value(s)?;
    let Some(bound) = CompileBound::named(&name) else {
        let names: Vec<&str> = CompileBound::ALL.iter().map(|b| b.name()).collect();
        bail!(
            "no compile bound is called `{name}`; the bounds are {}",
            names.join(", ")
        );
    };
    let value = value
        .parse()
        .with_context(|| format!("`{value}` is not a whole number for `{name}`"))?;
    Ok((bound, value))
}

#[derive(Subcommand)]
enum Command {
    /// Fuzz the handler contract of policies: random malloc/calloc/realloc/free sequences
    /// with every check on; a failure is shrunk to a short replayable script. With no
    /// file, checks the built-in default policy.
    Check {
        /// Policy components (.wasm) or WAT sources (.wat).
        policies: Vec<PathBuf>,
        /// Seconds to spend on each policy, in rounds of `--cases` sequences (every
        /// fourth round long-lived instances of thousands of operations). Default 3,
        /// unless `--cases` is given alone.
        #[arg(long)]
        time: Option<f64>,
        /// Random sequences per round. Given without `--time`: run exactly this many.
        #[arg(long)]
        cases: Option<u32>,
        /// Seed, for a run that repeats exactly.
        #[arg(long)]
        seed: Option<u64>,
        /// Most operations per sequence (per thread).
        #[arg(long, default_value_t = 128)]
        max_ops: usize,
        /// Client threads calling one handler at once.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// One JSON report per line instead of text.
        #[arg(long)]
        json: bool,
        /// Where failing seeds and scripts are kept.
        #[arg(long, default_value = "proptest-regressions")]
        regressions: PathBuf,
        /// Configuration passed to every policy's `init`, as KEY=VALUE (repeatable).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Replay an allocation trace (`op id size thread` lines, plain or gzip) through a
    /// handler and report time per event, peak bytes, corrections and the first failing
    /// event. Exit 1 if an event fails.
    ReplayTrace {
        trace: PathBuf,
        /// The chain, top first: a policy file, `default` (NumPy's default handler,
        /// natively) or `builtin` (the built-in default policy). Default: `default`.
        #[arg(long = "policy", short = 'p')]
        policies: Vec<String>,
        /// Configuration for the top policy's `init`, as KEY=VALUE (repeatable).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Replay an allocation trace through each handler, one event after another on one
    /// thread, and write one self-contained HTML page comparing them: live and held bytes
    /// over time, held/live, time per event, request sizes, the first failing event.
    /// Prints a summary table (or JSON). Exit 1 if an event fails in any handler (the
    /// page is still written).
    Report {
        /// The trace: `op id size thread` lines, plain or gzip.
        trace: PathBuf,
        /// A handler (repeatable, at least one): `default` (NumPy's default handler,
        /// natively), `builtin` (the built-in default policy) or a policy file, each on
        /// its own over the host's memory.
        #[arg(long = "policy", short = 'p', required = true)]
        policies: Vec<String>,
        /// Where the HTML page is written.
        #[arg(long, short = 'o')]
        output: PathBuf,
        /// Print the summary as JSON (an array, one object per handler).
        #[arg(long)]
        json: bool,
        /// Configuration for every policy's `init`, as KEY=VALUE (repeatable; `default`
        /// takes none).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Run a script (one operation a line, as `check` prints it) through a policy with
    /// every check on.
    Replay {
        script: PathBuf,
        /// With no file, the built-in default policy.
        policy: Option<PathBuf>,
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Show what a policy is: name, version, alignment, world, imports, exports, size.
    /// With no file, the built-in default policy.
    Inspect {
        /// A policy component (.wasm) or WAT source (.wat).
        policy: Option<PathBuf>,
        /// Configuration passed to the policy's `init`, as KEY=VALUE (repeatable).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
    },
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

/// The bounds on every policy instance ([`Limits`]); each defaults to the library's.
#[derive(Args, Debug, Clone, Default)]
struct LimitArgs {
    /// Longest one call into a policy may run, time in its imports included, in ms
    /// [default: 1000; 250 for check and replay].
    #[arg(long)]
    call_time_ms: Option<u64>,
    /// Most bytes of its own memory a policy may grow to [default: 128 MiB].
    #[arg(long)]
    guest_memory: Option<u64>,
    /// Most blocks one malloc-many or free-many may ask of the host [default: 4096].
    #[arg(long)]
    batch_limit: Option<u32>,
    /// Most bytes a policy may hold from upstream beyond what its client holds and asks
    /// for; past it, upstream requests are answered out-of-memory [default: 256 MiB].
    #[arg(long)]
    overhead: Option<u64>,
}

impl LimitArgs {
    fn limits(&self, call_time: Duration) -> Limits {
        let defaults = Limits::default();
        Limits {
            call_time: self.call_time_ms.map_or(call_time, Duration::from_millis),
            memory: self.guest_memory.unwrap_or(defaults.memory),
            batch: self.batch_limit.unwrap_or(defaults.batch),
            overhead: self.overhead.unwrap_or(defaults.overhead),
            ..defaults
        }
    }
}

/// The call limit of checking runs: short, so a looping policy is found quickly.
const CHECK_CALL_TIME: Duration = Duration::from_millis(250);
/// How long `allocbox check` spends on a policy unless told otherwise.
const DEFAULT_CHECK_TIME: Duration = Duration::from_secs(3);

fn parse_key_value(s: &str) -> Result<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => bail!("expected KEY=VALUE, got `{s}`"),
    }
}

fn load(runtime: &Runtime, path: Option<&PathBuf>) -> Result<Policy> {
    let bounds = COMPILE_BOUNDS.get_or_init(CompileBounds::default);
    Ok(match path {
        Some(path) => runtime
            .load_file_bounded(path, bounds)
            .with_context(|| format!("`{}` cannot be loaded", path.display()))?,
        None => runtime
            .load_bounded(allocbox::DEFAULT_POLICY_WAT.as_bytes(), bounds)
            .context("the built-in default policy")?,
    })
}

fn inspect(policy: Option<PathBuf>, config: Vec<(String, String)>) -> Result<()> {
    let runtime = Runtime::shared();
    let loaded = load(runtime, policy.as_ref())?;
    let config: Vec<(&str, &str)> = config
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let handler = HandlerBuilder::new(runtime)
        .link_with(&loaded, &config)
        .build()?;
    let info = handler.info();
    let source = policy.map_or("built-in default".to_string(), |p| p.display().to_string());
    let batch = if info.batch {
        "yes (host magazines allowed)"
    } else {
        "no"
    };
    let report = format!(
        "policy     {name}\nsource     {source}\nlanguage   {language}\nversion    {version}\n\
         alignment  {alignment}\nbatch      {batch}\nworld      {package}/policy@{world_version}\n\
         size       {size} bytes\nimports    {imports}\nexports    {exports}\n",
        name = info.name,
        language = loaded.language().unwrap_or("not stated by its toolchain"),
        version = info.version,
        alignment = info.alignment,
        package = allocbox::WORLD_PACKAGE,
        world_version = allocbox::WORLD_VERSION,
        size = loaded.size(),
        imports = loaded.imports().join("\n           "),
        exports = loaded.exports().join("\n           "),
    );
    print_report(&report);
    Ok(())
}

/// A failed check exits 1; input that cannot be used exits 2.
enum Outcome {
    Held,
    Broken,
}

struct CheckArgs {
    policies: Vec<PathBuf>,
    options: CheckOptions,
    json: bool,
    config: Vec<(String, String)>,
}

fn run_check(args: CheckArgs) -> Result<Outcome> {
    let runtime = Runtime::shared();
    let config: Vec<(&str, &str)> = args
        .config
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let targets: Vec<Option<&PathBuf>> = if args.policies.is_empty() {
        vec![None]
    } else {
        args.policies.iter().map(Some).collect()
    };
    let mut outcome = Outcome::Held;
    for target in targets {
        let policy = load(runtime, target)?;
        let mut options = args.options.clone();
        let label = target.map_or("built-in default".to_string(), |p| p.display().to_string());
        let bar = progress::check_progress(&label, &options);
        options.progress = bar.as_ref().map(progress::CheckBar::callback);
        let report = check::check(runtime, &policy, &config, &options);
        if let Some(bar) = bar {
            bar.finish();
        }
        let report = report?;
        let script_file = match &report.failure {
            Some((_, script)) => save_script(&args.options, &report, script),
            None => None,
        };
        if args.json {
            print_report(&format!("{}\n", json_report(&report, &label)));
        } else {
            print_report(&text_report(
                &report,
                &label,
                target,
                script_file.as_deref(),
            ));
        }
        if !report.passed() {
            outcome = Outcome::Broken;
        }
    }
    Ok(outcome)
}

fn save_script(options: &CheckOptions, report: &CheckReport, script: &Script) -> Option<PathBuf> {
    let dir = options.regressions.as_ref()?;
    let file = dir.join(format!("{}.script", report.policy));
    let (finding, _) = report.failure.as_ref()?;
    let text = format!(
        "# allocbox replay script for `{}`\n# {finding}\n{script}",
        report.policy
    );
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&file, text))
        .ok()?;
    Some(file)
}

fn text_report(
    report: &CheckReport,
    label: &str,
    target: Option<&PathBuf>,
    saved: Option<&Path>,
) -> String {
    let mut totals = format!(
        "{} cases, {} operations in {:.2} s ({:.0} ops/s)",
        report.cases,
        report.ops,
        report.elapsed.as_secs_f64(),
        report.ops_per_second()
    );
    if report.budget_refusals > 0 {
        totals += &format!(
            "; {} upstream requests refused past the overhead budget",
            report.budget_refusals
        );
    }
    let Some((finding, script)) = &report.failure else {
        return format!("{} ({label}): every rule held — {totals}\n", report.policy);
    };
    let mut out = format!("{} ({label}): BROKEN {finding}\n", report.policy);
    out += &format!("  shrunk to {} operations", script.len());
    if report.shrink_stopped_early {
        out += &format!(
            " (shrinking stopped after {} s: a shorter script may exist)",
            check::MAX_SHRINK_TIME.as_secs()
        );
    }
    out += ":\n";
    for line in script.to_string().lines() {
        out += &format!("    {line}\n");
    }
    if let Some(file) = saved {
        let policy = target.map_or(String::new(), |p| format!(" {}", p.display()));
        out += &format!("  replay: allocbox replay {}{policy}\n", file.display());
    }
    out += &format!("  ({totals}, shrinking included)\n");
    out
}

fn json_report(report: &CheckReport, label: &str) -> serde_json::Value {
    let (rule, message, script) = match &report.failure {
        Some((f, s)) => (
            Some(f.rule),
            Some(f.message.clone()),
            Some(
                s.to_string()
                    .lines()
                    .map(str::to_string)
                    .collect::<Vec<_>>(),
            ),
        ),
        None => (None, None, None),
    };
    serde_json::json!({
        "policy": report.policy,
        "source": label,
        "passed": report.passed(),
        "cases": report.cases,
        "operations": report.ops,
        "seconds": report.elapsed.as_secs_f64(),
        "operations_per_second": report.ops_per_second(),
        "budget_refusals": report.budget_refusals,
        "rule": rule,
        "message": message,
        "script": script,
        "shrink_stopped_early": report.shrink_stopped_early,
    })
}

fn run_replay(
    script: PathBuf,
    policy: Option<PathBuf>,
    config: Vec<(String, String)>,
    limits: Limits,
) -> Result<Outcome> {
    let runtime = Runtime::shared();
    let text = std::fs::read_to_string(&script)
        .with_context(|| format!("reading {}", script.display()))?;
    let parsed = Script::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", script.display()))?;
    let loaded = load(runtime, policy.as_ref())?;
    let config: Vec<(&str, &str)> = config
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    match check::replay(runtime, &loaded, &config, &parsed, &limits)? {
        None => {
            print_report(&format!(
                "every rule held over {} operations\n",
                parsed.len()
            ));
            Ok(Outcome::Held)
        }
        Some(finding) => {
            print_report(&format!("BROKEN {finding}\n"));
            Ok(Outcome::Broken)
        }
    }
}

/// A handler named on the command line: NumPy's default natively, or a chain of policies.
enum BuiltHandler {
    Native(Arc<dyn allocbox::MemHandler>),
    Chain(Arc<allocbox::Handler>),
}

impl BuiltHandler {
    fn handler(&self) -> &dyn allocbox::MemHandler {
        match self {
            BuiltHandler::Native(h) => &**h,
            BuiltHandler::Chain(h) => &**h,
        }
    }
}

/// The handler for `--policy` names, top first: none or `default` is NumPy's default
/// handler (natively, a new one), else a chain of `builtin` and policy files; `config`
/// goes to the top policy's `init`.
fn build_handler(
    policies: &[String],
    config: &[(String, String)],
    limits: Limits,
) -> Result<BuiltHandler> {
    let native = || BuiltHandler::Native(Arc::new(allocbox::NumpyDefault::new()));
    Ok(match policies {
        [] => native(),
        [only] if only == "default" => native(),
        chain => {
            let runtime = Runtime::shared();
            let mut builder = HandlerBuilder::new(runtime).limits(limits);
            for (i, name) in chain.iter().enumerate() {
                let policy = match name.as_str() {
                    "builtin" => load(runtime, None)?,
                    "default" => {
                        bail!("`default` is the native handler; it cannot be a link of a chain")
                    }
                    path => load(runtime, Some(&PathBuf::from(path)))?,
                };
                let link_config: Vec<(&str, &str)> = if i == 0 {
                    config
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect()
                } else {
                    Vec::new()
                };
                builder = builder.link_with(&policy, &link_config);
            }
            BuiltHandler::Chain(Arc::new(builder.build()?))
        }
    })
}

/// A trace file's events, under a spinner (a large trace takes seconds to read).
fn read_trace(trace: &Path) -> Result<Vec<allocbox::trace::Event>> {
    progress::spinning(&format!("reading {}", trace.display()), || {
        allocbox::trace::read_trace(trace)
    })
    .with_context(|| trace.display().to_string())
}

fn run_replay_trace(
    trace: PathBuf,
    policies: Vec<String>,
    config: Vec<(String, String)>,
    limits: Limits,
) -> Result<Outcome> {
    let events = read_trace(&trace)?;
    let built = build_handler(&policies, &config, limits)?;
    let handler = built.handler();
    let done = AtomicU64::new(0);
    let report = progress::counting_events("replay", events.len() as u64, &done, || {
        allocbox::trace::replay_trace_counted(handler, &events, &done)
    });
    let stats = &report.stats;
    let threads = events
        .iter()
        .map(|e| e.thread)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let mut out = format!(
        "trace      {} ({} events, replayed on {threads} thread{})\nhandler    {}\ntime       {:.2} s, {:.0} ns/event\n\
         peak       {} bytes live\ncalls      {} malloc, {} calloc, {} realloc, {} free\n\
         quirks     {} ids not allocated in the trace, {} free(NULL), {} wrong-size frees corrected\n\
         none       {} requests answered out-of-memory\n\
         budget     {} upstream requests refused past a policy's overhead budget\n",
        trace.display(),
        events.len(),
        if threads == 1 { "" } else { "s" },
        handler.name(),
        report.elapsed.as_secs_f64(),
        report.ns_per_event(),
        stats.peak_bytes,
        stats.mallocs,
        stats.callocs,
        stats.reallocs,
        stats.frees,
        report.unknown_ids,
        report.null_frees,
        stats.size_corrections,
        report.out_of_memory,
        stats.budget_refusals,
    );
    let outcome = match &report.failure {
        None => {
            out += "failures   none\n";
            Outcome::Held
        }
        Some((event, error)) => {
            out += &format!("FAILED     at {event}: {error}\n");
            Outcome::Broken
        }
    };
    print_report(&out);
    Ok(outcome)
}

struct ReportArgs {
    trace: PathBuf,
    policies: Vec<String>,
    output: PathBuf,
    json: bool,
    config: Vec<(String, String)>,
    limits: Limits,
}

fn run_report(args: ReportArgs) -> Result<Outcome> {
    use allocbox::report;
    let events = read_trace(&args.trace)?;
    let mut timelines = Vec::new();
    for name in &args.policies {
        let built = build_handler(
            std::slice::from_ref(name),
            &args.config,
            args.limits.clone(),
        )?;
        let done = AtomicU64::new(0);
        let len = events.len() as u64;
        let short = Path::new(name)
            .file_name()
            .map_or(name.into(), |f| f.to_string_lossy());
        timelines.push(progress::counting_events(
            &short,
            len,
            &done,
            || match &built {
                BuiltHandler::Native(h) => {
                    report::timeline_counted(name, &**h, report::native_held(&**h), &events, &done)
                }
                BuiltHandler::Chain(h) => {
                    report::timeline_counted(name, &**h, report::chain_held(h), &events, &done)
                }
            },
        ));
    }
    let page = report::render_html(&args.trace.display().to_string(), &timelines);
    std::fs::write(&args.output, page)
        .with_context(|| format!("writing {}", args.output.display()))?;
    if args.json {
        let all: Vec<_> = timelines.iter().map(report::Timeline::to_json).collect();
        print_report(&format!("{}\n", serde_json::Value::Array(all)));
    } else {
        print_report(&report::summary_table(&timelines));
    }
    Ok(match timelines.iter().any(|t| t.replay.failure.is_some()) {
        true => Outcome::Broken,
        false => Outcome::Held,
    })
}

/// Print to stdout; a reader that went away (`| head`) is not an error.
fn print_report(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut bounds = CompileBounds::default();
    for &(bound, value) in &cli.compile_bounds {
        bounds.set(bound, value);
    }
    COMPILE_BOUNDS.set(bounds).expect("set once, here");
    let result = match cli.command {
        Command::Inspect { policy, config } => inspect(policy, config).map(|()| Outcome::Held),
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
            limits,
        } => run_check(CheckArgs {
            policies,
            options: CheckOptions {
                cases: cases.unwrap_or(64),
                time: match (time, cases) {
                    (Some(secs), _) => Some(Duration::from_secs_f64(secs.max(0.0))),
                    (None, Some(_)) => None,
                    (None, None) => Some(DEFAULT_CHECK_TIME),
                },
                seed,
                max_ops,
                threads,
                regressions: Some(regressions),
                limits: limits.limits(CHECK_CALL_TIME),
                ..CheckOptions::default()
            },
            json,
            config,
        }),
        Command::Replay {
            script,
            policy,
            config,
            limits,
        } => run_replay(script, policy, config, limits.limits(CHECK_CALL_TIME)),
        Command::Report {
            trace,
            policies,
            output,
            json,
            config,
            limits,
        } => run_report(ReportArgs {
            trace,
            policies,
            output,
            json,
            config,
            limits: limits.limits(Limits::default().call_time),
        }),
        Command::ReplayTrace {
            trace,
            policies,
            config,
            limits,
        } => run_replay_trace(
            trace,
            policies,
            config,
            limits.limits(Limits::default().call_time),
        ),
    };
    match result {
        Ok(Outcome::Held) => ExitCode::SUCCESS,
        Ok(Outcome::Broken) => ExitCode::from(1),
        Err(e) => {
            eprintln!("allocbox: {e:#}");
            ExitCode::from(2)
        }
    }
}
