//! `allocbox check` and `allocbox replay`: the contract checker's findings, as text or
//! JSON, and the scripts it saves for replaying them.

use std::path::{Path, PathBuf};

use allocbox::{Limits, Runtime};
use allocbox_check::{self as check, CheckOptions, CheckReport, Script};
use anyhow::{Result, bail};

use crate::named::{hook_report, load, load_hook};
use crate::outcome::{Outcome, print_report};
use crate::progress;

pub(crate) struct CheckArgs {
    pub(crate) policies: Vec<PathBuf>,
    pub(crate) options: CheckOptions,
    pub(crate) json: bool,
    pub(crate) config: Vec<(String, String)>,
    pub(crate) hook: Option<PathBuf>,
}

pub(crate) fn run_check(args: CheckArgs) -> Result<Outcome> {
    // Said before any case runs: a folder that cannot be made saved nothing, unsaid.
    if let Some(dir) = &args.options.regressions
        && std::fs::symlink_metadata(dir).is_ok_and(|meta| !meta.is_dir())
    {
        bail!(
            "--regressions `{}` is not a folder: name the folder (made if missing) that \
             keeps the failing seeds and shrunk scripts",
            dir.display()
        );
    }
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
        // A hook of its own per policy, so that each report is that policy's.
        options.hook = match &args.hook {
            Some(path) => Some(load_hook(path, &options.limits)?),
            None => None,
        };
        let label = target.map_or("built-in default".to_string(), |p| p.display().to_string());
        let bar = progress::check_progress(&label, &options);
        options.progress = bar.as_ref().map(progress::CheckBar::callback);
        let report = check::check(runtime, &policy, &config, &options);
        if let Some(bar) = bar {
            bar.finish();
        }
        let report = report?;
        if report.failure.is_none() && report.cases == 0 && report.cases_waited > 0 {
            bail!(
                "no case of `{label}` could be judged: a call waited past its time limit \
                 behind the other {} client threads' calls (in {} of the cases run; no \
                 policy's fault); give fewer --threads, or a higher --call-time-ms",
                args.options.threads.saturating_sub(1),
                report.cases_waited
            );
        }
        if report.failure.is_none() && report.cases == 0 {
            bail!(
                "no case of `{label}` ran to its end in the time given ({} operations in \
                 {:.2} s): nothing was judged, so nothing is said to hold; give --time \
                 more seconds",
                report.ops,
                report.elapsed.as_secs_f64()
            );
        }
        if let Some((finding, _)) = &report.failure
            && finding.rule == check::MACHINE_TOO_SLOW
        {
            bail!("no verdict on `{label}`: {}", finding.message);
        }
        let script_file = match &report.failure {
            Some((_, script)) => {
                let ran = ran_with(script.clone(), target, &policy, &args.options);
                save_script(&args.options, &report, &ran)
            }
            None => None,
        };
        if args.json {
            print_report(&format!(
                "{}\n",
                json_report(&report, &label, script_file.as_deref())
            ));
        } else {
            print_report(&text_report(&report, &label, script_file.as_deref()));
            if let Some(hook) = &options.hook {
                print_report(&hook_report(hook, &report.policy));
            }
        }
        // A hook that failed broke the check it watched, whatever the policy did.
        let hook_failed = options.hook.as_ref().is_some_and(|h| h.failure().is_some());
        if !report.passed() || hook_failed {
            outcome = Outcome::Broken;
        }
    }
    Ok(outcome)
}

/// `script` with what the check ran it with: the policy's file (absolute, so the replay
/// runs from anywhere; a shipped policy by its name) and digest, its grants and the
/// bounds not at their defaults, so that `allocbox replay FILE` alone reproduces the
/// finding. (The check wrote the round's configuration: the one given, and what it drew.)
fn ran_with(
    mut script: Script,
    target: Option<&PathBuf>,
    policy: &allocbox::Policy,
    options: &CheckOptions,
) -> Script {
    script.ran.digest = Some(hex(&policy.digest()));
    script.ran.record_limits(&options.limits);
    script.ran.policy = target.map(|path| match path.is_file() {
        true => std::path::absolute(path)
            .unwrap_or_else(|_| path.clone())
            .display()
            .to_string(),
        false => path.display().to_string(),
    });
    script.ran.grants = allocbox::mapped::KindGrant::ALL
        .iter()
        .filter(|&&kind| options.limits.grants.memory.granted(kind))
        .map(|kind| kind.name().to_string())
        .collect();
    script
}

fn save_script(options: &CheckOptions, report: &CheckReport, script: &Script) -> Option<PathBuf> {
    let dir = options.regressions.as_ref()?;
    let file = dir.join(format!("{}.script", report.regression_name));
    let (finding, _) = report.failure.as_ref()?;
    let text = format!(
        "# allocbox replay script for `{}`\n# {finding}\n{script}",
        report.policy
    );
    let saved = std::fs::create_dir_all(dir)
        .map_err(|error| format!("cannot make the folder `{}`: {error}", dir.display()))
        .and_then(|()| {
            allocbox::output::write_whole(&file, text.as_bytes()).map_err(|e| e.to_string())
        });
    match saved {
        Ok(()) => Some(file),
        Err(why) => {
            eprintln!("allocbox: the shrunk script was not saved ({why}): it is printed below");
            None
        }
    }
}

fn text_report(report: &CheckReport, label: &str, saved: Option<&Path>) -> String {
    let mut totals = format!(
        "{} rounds, {} cases, {} operations in {:.2} s ({:.0} ops/s) from seed {} (`--seed \
         {}` runs them again)",
        report.rounds,
        report.cases,
        report.ops,
        report.elapsed.as_secs_f64(),
        report.ops_per_second(),
        report.seed,
        report.seed,
    );
    if report.cut_by_time {
        totals += &format!(
            "; --time stopped the check after {} rounds, before the depth asked for: a \
             faster machine runs more from the same seed (leave out --time for the same \
             depth everywhere)",
            report.rounds
        );
    }
    if !report.swept.is_empty() {
        totals += &format!(
            "; every third round under a drawn `{}` (standard keys the policy accepts)",
            report.swept.join("`, `")
        );
    }
    if let Some(refused) = refused_on_purpose(report) {
        totals += &format!("; {refused}");
    }
    if report.cases_waited > 0 {
        totals += &format!(
            "; {} cases not judged: a call waited past its time limit behind the other \
             client threads' calls (no policy's fault; fewer --threads or a higher \
             --call-time-ms judges them)",
            report.cases_waited
        );
    }
    match (report.cross_thread_frees, report.instances_shared) {
        (0, _) => {}
        (frees, None) => {
            totals += &format!(
                "; {frees} blocks freed by a client thread other than their maker's, each \
                 thread with an instance of its own"
            )
        }
        (frees, Some(instances)) => {
            totals += &format!(
                "; {frees} blocks freed by a client thread other than their maker's, the \
                 threads sharing {instances} instances (the guest memory budget split \
                 further would leave an instance too little to start in; raise \
                 --guest-memory for one each)"
            )
        }
    }
    // A shipped policy named by its name is not named twice.
    let named = if label == report.policy {
        label.to_string()
    } else {
        format!("{} ({label})", report.policy)
    };
    let Some((finding, script)) = &report.failure else {
        let mut out = format!("{named}: every rule held — {totals}\n");
        if !report.counters.is_empty() {
            out += &format!(
                "  its counters, summed over the cases (a `peak-` one: its largest): {}\n",
                counter_list(&report.counters, report.counters_left_out)
            );
        }
        out += &held_lines(&report.holdings);
        out += &not_tested(report);
        return out;
    };
    let mut out = format!("{named}: BROKEN {finding}\n");
    if !report.drawn_config.is_empty() {
        let options: Vec<String> = (report.drawn_config.iter())
            .map(|(key, value)| format!("-c {key}={value}"))
            .collect();
        out += &format!(
            "  found under `{}`, a configuration the check drew (the policy accepts it; \
             the rounds before, under the configuration given, found nothing): the script carries it\n",
            options.join(" ")
        );
    }
    let path = match script.path {
        check::CallPath::Magazines => "through the host's magazines",
        check::CallPath::PerCall => "the policy asked on every call",
        check::CallPath::PerThread => "an instance of the policy per client thread",
    };
    out += &format!("  shrunk to {} operations, {path}", script.len());
    if report.shrink_stopped_early {
        out += " (shrinking stopped at its budget of trials: a shorter script may exist)";
    }
    out += ":\n";
    for line in script.to_string().lines() {
        out += &format!("    {line}\n");
    }
    if let Some(file) = saved {
        // The script names the policy, its configuration and grants.
        out += &format!("  replay: allocbox replay {}\n", file.display());
    }
    out += &format!("  ({totals}, shrinking included)\n");
    out += &not_tested(report);
    out
}

/// What the policy held beside its client's bytes, and a warning when it reused none of
/// what was freed between trims.
fn held_lines(holdings: &check::Holdings) -> String {
    let Some((held, live)) = holdings.most_beyond else {
        return String::new();
    };
    let bytes = crate::report::bytes;
    let mut out = format!(
        "  held: at most {} beyond its client's bytes, before a trim or at a case's end ({} \
         from the host while the client held {})\n",
        bytes(held.saturating_sub(live)),
        bytes(held),
        bytes(live)
    );
    if holdings.grows_between_trims() {
        out += &format!(
            "  warning: between trims it kept nearly every byte its client freed ({n} of {n} \
             stretches of {} or more freed): freed blocks are not lent again until a trim, \
             so a program that never trims grows without bound under it (no rule is \
             broken)\n",
            bytes(check::REUSE_SPAN),
            n = holdings.stretches,
        );
    }
    out
}

/// What the check could not test because it was not granted, and how to grant it.
fn not_tested(report: &CheckReport) -> String {
    if report.ungranted.is_empty() {
        return String::new();
    }
    let asked: Vec<String> = report
        .ungranted
        .iter()
        .map(|(kind, n)| format!("`{kind}` memory {n} times"))
        .collect();
    let kinds: Vec<&str> = report
        .ungranted
        .iter()
        .map(|(kind, _)| kind.name())
        .collect();
    format!(
        "  not tested: the policy asked for {} and was refused, as the check did not \
         grant it, so the paths that use it did not run; to test them, run again with \
         `--grant {}`\n",
        asked.join(", "),
        kinds.join(",")
    )
}

/// A policy's counters as `name value, name value`, and how many values under other
/// names were left out.
pub(crate) fn counter_list(counters: &[(String, u64)], left_out: u64) -> String {
    let mut shown: Vec<String> = counters
        .iter()
        .map(|(name, value)| format!("{name} {value}"))
        .collect();
    if left_out > 0 {
        shown.push(format!(
            "and {left_out} more values under other names (the first {} names are kept)",
            allocbox_check::COUNTERS_KEPT
        ));
    }
    shown.join(", ")
}

/// What the checker refused on purpose, and what for, so that it does not read like a
/// fault of the policy.
fn refused_on_purpose(report: &CheckReport) -> Option<String> {
    let held = report.budget_refusals_held;
    let parts: Vec<String> = [
        (report.injected_refusals, "injected by `oom` operations"),
        (
            report.budget_refusals - held,
            "past the overhead budget for impossible sizes",
        ),
        (
            held,
            "past it for what the policy held beyond its client's bytes: its caches \
             outgrow --overhead (raise it), or it hoards",
        ),
    ]
    .into_iter()
    .filter(|&(n, _)| n > 0)
    .map(|(n, why)| format!("{n} {why}"))
    .collect();
    (!parts.is_empty()).then(|| {
        format!(
            "out-of-memory paths run by refusing upstream requests on purpose ({})",
            parts.join("; ")
        )
    })
}

fn json_report(report: &CheckReport, label: &str, saved: Option<&Path>) -> serde_json::Value {
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
        "rounds": report.rounds,
        "cut_by_time": report.cut_by_time,
        "cases": report.cases,
        "operations": report.ops,
        "seconds": report.elapsed.as_secs_f64(),
        "operations_per_second": report.ops_per_second(),
        "seed": report.seed,
        "budget_refusals": report.budget_refusals,
        "budget_refusals_held": report.budget_refusals_held,
        "held_most_beyond_client": report.holdings.most_beyond.map(|(held, live)| {
            serde_json::json!({"held": held, "client": live})
        }),
        "grows_between_trims": report.holdings.grows_between_trims(),
        "injected_refusals": report.injected_refusals,
        "cross_thread_frees": report.cross_thread_frees,
        "instances_shared": report.instances_shared,
        "cases_waited": report.cases_waited,
        "ungranted": report
            .ungranted
            .iter()
            .map(|(kind, n)| (kind.name().to_string(), serde_json::Value::from(*n)))
            .collect::<serde_json::Map<_, _>>(),
        "counters": report
            .counters
            .iter()
            .map(|(name, value)| (name.clone(), serde_json::Value::from(*value)))
            .collect::<serde_json::Map<_, _>>(),
        "counters_left_out": report.counters_left_out,
        "rule": rule,
        "message": message,
        "script": script,
        "shrink_stopped_early": report.shrink_stopped_early,
        "drawn_config": report
            .drawn_config
            .iter()
            .map(|(key, value)| (key.clone(), serde_json::Value::from(value.clone())))
            .collect::<serde_json::Map<_, _>>(),
        "swept": report.swept,
        "script_file": saved.map(|file| file.display().to_string()),
    })
}

/// The most bytes a replay script may have: a shrunk script is a few lines, and a
/// hand-written one that exercises a policy hard is thousands; what is past this is
/// not a script.
const MAX_SCRIPT_BYTES: u64 = 64 << 20;

/// The script's bytes, refused by its size before they are read.
fn read_script(script: &Path) -> Result<Vec<u8>> {
    use allocbox::input::TooLong;
    allocbox::input::read_at_most(script, MAX_SCRIPT_BYTES).map_err(|refused| match refused {
        TooLong::Io(error) => {
            anyhow::anyhow!("cannot read the script `{}`: {error}", script.display())
        }
        TooLong::Bytes { .. } => anyhow::anyhow!(
            "the script `{}` has more than {MAX_SCRIPT_BYTES} bytes: a script is one \
             operation a line, and shorter than that",
            script.display()
        ),
    })
}

pub(crate) fn run_replay(
    script: PathBuf,
    policy: Option<PathBuf>,
    config: Vec<(String, String)>,
    limits: Limits,
) -> Result<Outcome> {
    let runtime = Runtime::shared();
    let bytes = read_script(&script)?;
    let text = String::from_utf8(bytes)
        .ok()
        .filter(|text| !text.starts_with("\0asm") && !text.trim_start().starts_with('('));
    let Some(text) = text else {
        bail!(
            "`{}` is a policy or binary data, not a script (one operation a line): the \
             script comes first, then the policy (`allocbox replay SCRIPT [POLICY]`)",
            script.display()
        );
    };
    let parsed = Script::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", script.display()))?;
    // What the command line names goes first; the rest as the check ran it.
    let policy = policy.or_else(|| parsed.ran.policy.as_ref().map(PathBuf::from));
    if let Some(policy) = &policy {
        allocbox::output::note_input(policy);
    }
    let loaded = load(runtime, policy.as_ref())?;
    if let Some(digest) = &parsed.ran.digest
        && *digest != hex(&loaded.digest())
    {
        eprintln!(
            "allocbox: the policy `{}` is not the binary the script was made with (its \
             digest differs from the script's `digest` line): the replay may not find \
             what the check found",
            policy
                .as_ref()
                .map_or("built-in default".to_string(), |p| p.display().to_string())
        );
    }
    let config = match config.is_empty() {
        true => &parsed.ran.config,
        false => &config,
    };
    let config: Vec<(&str, &str)> = config
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut limits = limits;
    // A bound the command line left at its default is the script's.
    let defaults = Limits::default();
    for &(bound, value) in &parsed.ran.limits {
        if bound.of(&limits) == bound.of(&defaults) {
            bound.set(&mut limits, value);
        }
    }
    if limits.grants.memory == allocbox::mapped::KindGrants::default() {
        for name in &parsed.ran.grants {
            let kind = name
                .parse::<allocbox::mapped::KindGrant>()
                .map_err(|e| anyhow::anyhow!("{}: `grant {name}`: {e}", script.display()))?;
            limits.grants.memory.grant(kind);
        }
    }
    match check::replay(runtime, &loaded, &config, &parsed, &limits)? {
        None => {
            print_report(&format!(
                "every rule held over {} operations\n",
                parsed.len()
            ));
            Ok(Outcome::Held)
        }
        Some(finding) if finding.rule == check::MACHINE_TOO_SLOW => {
            bail!("no verdict on `{}`: {}", script.display(), finding.message)
        }
        Some(finding) => {
            print_report(&format!("BROKEN {finding}\n"));
            Ok(Outcome::Broken)
        }
    }
}

/// Bytes as lowercase hex digits: a digest as a script writes it.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
