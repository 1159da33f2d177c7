//! The `allocbox` command line.
//!
//! Exit status: 0 every rule held (or the command succeeded), 1 a rule was broken,
//! 2 unusable input (a file that is not a policy, a bad configuration, a bad script).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use std::io::IsTerminal;
use std::sync::Arc;

use allocbox::check::{self, CheckOptions, CheckReport, Script};
use allocbox::{HandlerBuilder, Limits, Policy, Runtime};
use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(version, about = "Sandboxed, checkable NEP 49 allocation policies")]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
}

/// The bounds on every policy instance ([`Limits`]); each defaults to the library's.
#[derive(Args, Debug, Clone, Default)]
struct LimitArgs {
    /// Longest one call into a policy may run, time in its imports included, in ms
    /// [default: 1000; 250 for check and replay].
    #[arg(long)]
    call_time_ms: Option<u64>,
    /// Most bytes of its own memory a policy may grow to [default: 64 MiB].
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
    Ok(match path {
        Some(path) => runtime.load_file(path)?,
        None => runtime
            .load(allocbox::DEFAULT_POLICY_WAT.as_bytes())
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
        "policy     {name}\nsource     {source}\nversion    {version}\nalignment  {alignment}\n\
         batch      {batch}\nworld      {package}/policy@{world_version}\nsize       {size} bytes\n\
         imports    {imports}\nexports    {exports}\n",
        name = info.name,
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
        if std::io::stderr().is_terminal() && !args.json {
            let label = label.clone();
            options.progress = Some(Arc::new(move |p: &check::Progress| {
                let rate = p.ops as f64 / p.elapsed.as_secs_f64().max(1e-9);
                let of = match (p.time, p.cases_wanted) {
                    (Some(t), _) => {
                        format!("{:.1}/{:.1} s", p.elapsed.as_secs_f64(), t.as_secs_f64())
                    }
                    (None, Some(n)) => format!("case {}/{n}", p.cases),
                    (None, None) => String::new(),
                };
                eprint!(
                    "\r{label}: {} cases, {} ops, {rate:.0} ops/s, {of}   ",
                    p.cases, p.ops
                );
            }));
        }
        let report = check::check(runtime, &policy, &config, &options)?;
        if options.progress.is_some() {
            eprint!("\r\x1b[K");
        }
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
    saved: Option<&std::path::Path>,
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

fn run_replay_trace(
    trace: PathBuf,
    policies: Vec<String>,
    config: Vec<(String, String)>,
    limits: Limits,
) -> Result<Outcome> {
    use allocbox::nep49::{MemHandler, default_handler};
    let events =
        allocbox::trace::read_trace(&trace).with_context(|| trace.display().to_string())?;
    let handler: Arc<dyn MemHandler> = match policies.as_slice() {
        [] => default_handler(),
        [only] if only == "default" => default_handler(),
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
            Arc::new(builder.build()?)
        }
    };
    let report = allocbox::trace::replay_trace(&*handler, &events);
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

/// Print to stdout; a reader that went away (`| head`) is not an error.
fn print_report(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect { policy, config } => inspect(policy, config).map(|()| Outcome::Held),
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
                progress: None,
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
