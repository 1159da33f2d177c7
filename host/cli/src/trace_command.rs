//! `allocbox replay-trace` and `allocbox report`: a recorded trace through handlers
//! named on the command line.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::report;
use allocbox::output::Output;
use allocbox::trace::leak_after_replay;
use allocbox::trace::timeline::{
    HeldBy, Replayed, Timeline, chain_held, holdings_at, native_held, timeline_counted,
};
use allocbox::{HandlerBuilder, Limits, Runtime};
use anyhow::{Context, Result, bail};

use crate::device_report::{GpuPart, gpu_parts};
use crate::named::{hook_report, load, load_hook, observed};
use crate::outcome::{Outcome, print_report};
use crate::progress;
use crate::survey::{Survey, survey};

/// A handler named on the command line: NumPy's default natively, or a chain of policies.
enum BuiltHandler {
    Native(Arc<allocbox::NumpyDefault>),
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

/// The handler `policies` name: NumPy's default (`default`, or none), or a chain, top
/// first, link `i` configured with `configs[i]`.
fn build_handler(
    policies: &[String],
    configs: &[Vec<(String, String)>],
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
                    "builtin" | "passthrough" => load(runtime, None)?,
                    "default" => {
                        bail!("`default` is the native handler; it cannot be a link of a chain")
                    }
                    path => load(runtime, Some(&PathBuf::from(path)))?,
                };
                let link_config: Vec<(&str, &str)> = configs
                    .get(i)
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                builder = builder.link_with(&policy, &link_config);
            }
            BuiltHandler::Chain(Arc::new(builder.build()?))
        }
    })
}

/// One policy's `init` settings, as `KEY=VALUE` pairs.
type Settings = Vec<(String, String)>;

/// A report's handler named `name`: one policy, or a chain written `top>next>...`, its
/// links configured by `config`, where `LINK:KEY=VALUE` goes to the link named `LINK`
/// and a plain `KEY=VALUE` to the top one. What `allocbox run --report` replays a chain
/// as.
fn chain_of(name: &str, config: &[(String, String)]) -> Result<(Vec<String>, Vec<Settings>)> {
    let links: Vec<String> = name.split('>').map(str::to_string).collect();
    let mut configs = vec![Vec::new(); links.len()];
    for (key, value) in config {
        let (at, key) = match key.split_once(':') {
            Some((link, key)) if links.len() > 1 => {
                let Some(at) = links.iter().position(|l| l == link) else {
                    bail!("-c {link}:{key}={value}: `{link}` is no link of the chain `{name}`");
                };
                (at, key)
            }
            _ => (0, key.as_str()),
        };
        configs[at].push((key.to_string(), value.clone()));
    }
    Ok((links, configs))
}

/// The first pass through `trace` ([`survey`]), saying on standard error how many
/// events of GPU memory a command that replays the host's alone leaves out.
pub(crate) fn survey_host(trace: &Path) -> Result<Survey> {
    let found = survey(trace)?;
    let taken: u64 = found
        .placements
        .iter()
        .filter(|(placement, _)| placement.is_some())
        .map(|(_, p)| p.events)
        .sum();
    if taken > 0 {
        eprintln!(
            "allocbox: {} has {taken} events of GPU memory, which this command does not \
             replay: it replays the host memory's events through host policies \
             (`allocbox trace-convert` writes every event, each with its GPU)",
            trace.display()
        );
    }
    Ok(found)
}

pub(crate) fn run_replay_trace(
    trace: PathBuf,
    policies: Vec<String>,
    config: Vec<Vec<(String, String)>>,
    hook: Option<PathBuf>,
    limits: Limits,
) -> Result<Outcome> {
    let found = survey_host(&trace)?;
    let hook = hook.map(|h| load_hook(&h, &limits)).transpose()?;
    let built = build_handler(&policies, &config, limits)?;
    let handler = built.handler();
    let done = AtomicU64::new(0);
    let host = found.host();
    let mut pass = found.pass(None)?;
    let mut report = progress::counting_events("replay", host.events, &done, || {
        observed(handler, hook.as_deref(), |handler| {
            allocbox::trace::replay_events(handler, pass.events(), &done)
        })
    });
    pass.finish()?;
    if let (None, BuiltHandler::Chain(chain)) = (&report.failure, &built) {
        report.leak = leak_after_replay(chain);
    }
    let stats = &report.stats;
    // A recording names each thread the program started; at most so many run at once.
    let recorded = host.threads();
    let threads = recorded.min(allocbox::trace::MAX_REPLAY_THREADS as usize);
    let shared = match recorded > threads {
        true => format!(", the recording's {recorded} threads sharing them"),
        false => String::new(),
    };
    let mut out = format!(
        "trace      {} ({} events, replayed on {threads} thread{}{shared})\nhandler    {}\ntime       {:.2} s, {:.0} ns/event\n\
         peak       {} bytes live\ncalls      {} malloc, {} calloc, {} realloc, {} free\n\
         quirks     {} ids not allocated in the trace, {} free(NULL), {} wrong-size frees corrected\n\
         none       {} requests answered out-of-memory\n\
         budget     {} upstream requests refused past a policy's overhead budget\n",
        trace.display(),
        host.events,
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
    if let BuiltHandler::Chain(chain) = &built {
        for link in chain.link_stats().unwrap_or_default() {
            if !link.counters.is_empty() {
                out += &format!(
                    "counters   {}: {}\n",
                    link.name,
                    crate::check_command::counter_list(&link.counters, 0)
                );
            }
            if let Some(latest) = link.recent_misuse.last() {
                out += &format!(
                    "misuse     {} client misuse reported by `{}`; the latest: {latest}\n",
                    link.client_misuse, link.name
                );
            }
        }
    }
    let mut outcome = match (&report.failure, &report.leak) {
        (None, None) => {
            out += "failures   none (and nothing held from the host once every block was freed)\n";
            Outcome::Held
        }
        (Some((event, error)), _) => {
            out += &format!("FAILED     at {event}: {error}\n");
            Outcome::Broken
        }
        (None, Some(leak)) => {
            out += &format!("FAILED     after the last event, every block freed: {leak}\n");
            Outcome::Broken
        }
    };
    if let Some(hook) = &hook {
        out += &hook_report(hook, handler.name());
        // A hook that failed broke the run it watched, though every allocation stood.
        if hook.failure().is_some() {
            outcome = Outcome::Broken;
        }
    }
    print_report(&out);
    Ok(outcome)
}

/// The configuration of each `-p` of a subcommand: the `-c`s between it and the next
/// `-p`, in order. A `-c` before every `-p` configures nothing, and is refused.
pub(crate) fn config_per_policy(
    matches: &clap::ArgMatches,
    config: Vec<(String, String)>,
) -> Result<Vec<Vec<(String, String)>>> {
    let at = |id| -> Vec<usize> {
        matches
            .indices_of(id)
            .map(Iterator::collect)
            .unwrap_or_default()
    };
    let (policy_at, config_at) = (at("policies"), at("config"));
    let mut per_policy = vec![Vec::new(); policy_at.len()];
    for ((key, value), at) in config.into_iter().zip(config_at) {
        let Some(owner) = policy_at.iter().rposition(|&p| p < at) else {
            bail!(
                "-c {key}={value} comes before any -p: each -c configures the policy named \
                 before it (-p size-classes -c bucket-depth=7)"
            );
        };
        per_policy[owner].push((key, value));
    }
    Ok(per_policy)
}

pub(crate) struct ReportArgs {
    /// One or more: a program's trace and its child processes'.
    pub(crate) traces: Vec<PathBuf>,
    pub(crate) policies: Vec<String>,
    pub(crate) output: PathBuf,
    pub(crate) json: bool,
    /// One per policy, in order.
    pub(crate) config: Vec<Vec<(String, String)>>,
    pub(crate) hook: Option<PathBuf>,
    pub(crate) limits: Limits,
    /// What each GPU's events are replayed through.
    pub(crate) device: crate::device_report::DevicePolicies,
}

pub(crate) fn run_report(args: ReportArgs) -> Result<Outcome> {
    // Before the replays, which take seconds to minutes: a page that cannot be written
    // is said at once.
    let mut page_file = Output::create(&args.output)?;
    // So is a trace that is not there, whichever of several.
    for trace in &args.traces {
        std::fs::metadata(trace).with_context(|| trace.display().to_string())?;
    }
    let mut parts = Vec::new();
    let mut json = Vec::new();
    let mut broken = false;
    for trace in &args.traces {
        let name = trace.display().to_string();
        let (reported, gpus) = report_trace(&args, trace)?;
        broken |= reported.hook_failed || reported.timelines.iter().any(Timeline::failed);
        let several = args.traces.len() > 1 || !gpus.is_empty();
        let mut summarise = |name: &str, timelines: &[Timeline], gpu: Option<u16>| {
            if args.json {
                json.extend(timelines.iter().map(|t| {
                    let mut object = report::timeline_json(t);
                    object["trace"] = name.into();
                    if let Some(gpu) = gpu {
                        object["gpu"] = gpu.into();
                    }
                    object
                }));
            } else if several {
                print_report(&format!("{name}:\n"));
            }
            if !args.json {
                let memory = gpu.map_or(report::Memory::Host, report::Memory::Gpu);
                print_report(&report::summary_table(timelines, memory));
            }
        };
        summarise(&name, &reported.timelines, None);
        if !args.json {
            print_report(&reported.hook_reports);
        }
        parts.push((name.clone(), reported.part));
        for gpu in gpus {
            broken |= gpu.hook_failed || gpu.timelines.iter().any(Timeline::failed);
            summarise(&gpu.name, &gpu.timelines, Some(gpu.gpu));
            if !args.json {
                print_report(&crate::device_report::fit_lines(&gpu, args.device.memory));
                print_report(&gpu.hook_reports);
            }
            parts.push((gpu.name, gpu.part));
        }
    }
    std::io::Write::write_all(page_file.file(), report::render_parts(&parts).as_bytes())
        .with_context(|| format!("cannot write the page `{}`", args.output.display()))?;
    page_file.commit()?;
    if args.json {
        print_report(&format!("{}\n", serde_json::Value::Array(json)));
    }
    Ok(match broken {
        true => Outcome::Broken,
        false => Outcome::Held,
    })
}

/// One trace through every handler: its part of the page, and what the summaries say.
struct TraceReport {
    part: String,
    timelines: Vec<Timeline>,
    hook_reports: String,
    hook_failed: bool,
}

/// One trace through every handler, and each GPU's memory of it through every device
/// policy: each replay a pass of its own through the file.
fn report_trace(args: &ReportArgs, trace: &Path) -> Result<(TraceReport, Vec<GpuPart>)> {
    let mut found = survey(trace)?;
    let gpus = gpu_parts(&mut found, &args.device, args.hook.as_deref(), &args.limits)?;
    // The program's lines behind its bytes, when the recording says which they were:
    // taken from the first replay's pass.
    let mut at_peak = found.at_peak(None);
    let host = found.host();
    let (len, marks) = (host.events, found.marks(None));
    let mut timelines = Vec::new();
    let mut hook_reports = String::new();
    let mut hook_failed = false;
    for (name, config) in args.policies.iter().zip(&args.config) {
        let (links, configs) = chain_of(name, config)?;
        let built = build_handler(&links, &configs, args.limits.clone())?;
        let done = AtomicU64::new(0);
        let short = Path::new(name)
            .file_name()
            .map_or(name.into(), |f| f.to_string_lossy());
        let hook = args
            .hook
            .as_ref()
            .map(|h| load_hook(h, &args.limits))
            .transpose()?;
        let mut pass = found.pass(None)?;
        let mut tap = |recorded: &allocbox::trace::Recorded| {
            if let Some(at_peak) = &mut at_peak {
                at_peak.add(&recorded.event, recorded.site.unwrap_or(0));
            }
        };
        let mut timeline = progress::counting_events(&short, len, &done, || {
            let replayed = Replayed {
                events: pass.by_ref().inspect(&mut tap).map(|r| r.event),
                len,
                marks: &marks,
            };
            observed(built.handler(), hook.as_deref(), |handler| match &built {
                BuiltHandler::Native(h) => {
                    timeline_counted(name, handler, native_held(&**h), replayed, &done)
                }
                BuiltHandler::Chain(h) => {
                    timeline_counted(name, handler, chain_held(h), replayed, &done)
                }
            })
        });
        pass.finish()?;
        if let Some(hook) = &hook {
            hook_reports += &hook_report(hook, name);
            hook_failed |= hook.failure().is_some();
        }
        if let (None, BuiltHandler::Chain(chain)) = (&timeline.replay.failure, &built) {
            timeline.replay.leak = leak_after_replay(chain);
        }
        if timeline.replay.failure.is_none() {
            // A second replay, on a handler of its own, up to the moment this one held
            // the most: where those bytes went.
            let fresh = build_handler(&links, &configs, args.limits.clone())?;
            let at = timeline.peak_held_at;
            let mut pass = found.pass(None)?;
            timeline.holdings = Some(progress::spinning(
                &format!("{short}: where the most it held went"),
                || match &fresh {
                    BuiltHandler::Native(h) => holdings_at(HeldBy::Native(h), pass.events(), at),
                    BuiltHandler::Chain(h) => holdings_at(HeldBy::Chain(h), pass.events(), at),
                },
            ));
            pass.finish()?;
        }
        timelines.push(timeline);
    }
    let lines = found.lines(None, at_peak)?;
    let host = found.host();
    let recorded = report::Recorded {
        times: Some(&host.times),
        lines: lines
            .as_ref()
            .map(|found_lines| (found_lines, &found.trace.site_table)),
    };
    let part = report::render_part(
        &trace.display().to_string(),
        &timelines,
        &marks,
        &recorded,
        report::Memory::Host,
    );
    let reported = TraceReport {
        part,
        timelines,
        hook_reports,
        hook_failed,
    };
    Ok((reported, gpus))
}
