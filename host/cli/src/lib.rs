//! The `allocbox` command line, as a library: the binary, the Python wheel's `allocbox`
//! command and the integration tests all run [`run`].
//!
//! Where each part lives: `grammar` (every subcommand's clap definition), `run_command`
//! (`run`'s arguments parsed for the Python package, which runs the program),
//! `check_command` (`check`, `replay`), `trace_command` (`replay-trace`, `report`),
//! `device_report` (a report's GPU parts), `convert` (`trace-convert`), `inspect`,
//! `new_policy` (`allocbox new`), `named` (policies and hooks named on the command line),
//! `survey` (a trace read in passes: the first, then one per replay), `report` (the HTML
//! page), `progress`,
//! `outcome` (exit status and printing), `arguments` (the values options take). Each
//! uses only those after it here (`tests/layers.rs`):
//!
//! Module order: `run_command` > `grammar` > `convert` > `inspect` > `trace_command` > `device_report` > `check_command` > `new_policy` > `named` > `outcome` > `survey` > `progress` > `report` > `arguments`

pub mod report;

mod arguments;
mod check_command;
mod convert;
mod device_report;
mod grammar;
mod inspect;
mod named;
mod new_policy;
mod outcome;
mod progress;
mod run_command;
mod survey;
mod trace_command;

pub use named::SHIPPED_HOOKS;
pub use run_command::{Program, RunCommand, parse_run};

use std::ffi::OsString;
use std::time::Duration;

use allocbox::{CompileBounds, Limits};
use allocbox_check::CheckOptions;

use check_command::{CheckArgs, run_check, run_replay};
use grammar::{CHECK_CALL_TIME, Command, DEFAULT_DEVICE_MEMORY, DEFAULT_DEVICE_POLICY};
use inspect::inspect;
use outcome::{Outcome, print_report};
use trace_command::{ReportArgs, config_per_policy, run_replay_trace, run_report};

/// Run the command line `args` (the program's name first, as [`std::env::args_os`]
/// gives it) and return the exit status: 0 every rule held (or the command succeeded),
/// 1 a rule was broken, 2 unusable input. The `allocbox` binary and the Python wheel's
/// `allocbox` command both run this.
/// Parse a command line as [`run`] would, running nothing and printing nothing: `Err`
/// holds the one line a usage error prints (empty for help or the version). What the
/// option fuzzer (`fuzz/`) drives.
pub fn parse_only<I, T>(args: I) -> Result<(), String>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match grammar::parse_or_say(args) {
        Ok(_) => Ok(()),
        Err(grammar::Stop::Help(_)) => Err(String::new()),
        Err(grammar::Stop::Usage(line)) => Err(line),
    }
}

pub fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let (cli, matches) = match grammar::parse(args) {
        Ok(parsed) => parsed,
        Err(code) => return code,
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
    if !named::set_compile_bounds(bounds) {
        eprintln!(
            "allocbox: --compile-bound differs from an earlier command in this process; \
             run each set of bounds in a process of its own"
        );
        return 2;
    }
    for input in cli.command.inputs() {
        allocbox::output::note_input(&input);
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
            rounds,
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
            work,
        } => run_check(CheckArgs {
            policies,
            options: CheckOptions {
                cases,
                rounds: Some(rounds),
                time: time.map(Duration::from_secs_f64),
                // A fresh seed each run finds what the last did not; the report prints it.
                seed: Some(seed.unwrap_or_else(allocbox_check::fresh_seed)),
                max_ops,
                threads,
                regressions: regressions.or_else(allocbox_check::default_regressions_dir),
                limits: work.apply(limits.limits(CHECK_CALL_TIME)),
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
            work,
        } => run_replay(
            script,
            policy,
            config,
            work.apply(limits.limits(CHECK_CALL_TIME)),
        ),
        Command::Report {
            traces,
            policies,
            output,
            json,
            config,
            hook,
            limits,
            device_policies,
            device_memory,
        } => per_policy(config).and_then(|config| {
            run_report(ReportArgs {
                traces,
                policies,
                output,
                json,
                config,
                hook: hook.path,
                limits: limits.limits(Limits::default().call_time),
                device: device_report::DevicePolicies {
                    policies: match device_policies.is_empty() {
                        true => vec![DEFAULT_DEVICE_POLICY.to_string()],
                        false => device_policies,
                    },
                    memory: device_memory.unwrap_or(DEFAULT_DEVICE_MEMORY),
                },
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
            // One line, whatever the user's paths and names hold.
            eprintln!(
                "allocbox: {}",
                allocbox::untrusted::escape(&format!("{e:#}"))
            );
            2
        }
    }
}
