//! The contract checker: drives random sequences of client operations through a policy
//! with every host check on, plus deep checks that cost bandwidth (checked mode), and
//! shrinks a failure to a short, replayable script.
//!
//! The reference model is the list of live blocks and the bytes each must hold; the
//! system under test is a fresh [`allocbox::Handler`] per case. A block is named by the
//! operation that made it (`b3 = malloc 64`, then `free b3`), and an operation on a block
//! that is not live is skipped: every sequence is valid, and deleting an operation while
//! shrinking never changes which block another one means.
//!
//! Where each part lives: `script` (the text form `allocbox replay` reads, and a drawn
//! case), `strategy` (drawing scripts), `shrink` (shrinking a failing one), `pattern`
//! (the bytes every block holds), `model` (the live blocks and their bytes), `client`
//! (one client thread's calls and checks), `runner` (a script against a fresh handler),
//! `verdict` (options and findings), `holdings` (what the policy held beside its
//! client's bytes), `seeds` (failing seeds kept), `build` (an author's
//! policy crate built for the checker), `sweep` (the configurations a check draws).
//! Each uses only those after it here (`tests/layers.rs`):
//!
//! Module order: `runner` > `client` > `model` > `strategy` > `shrink` > `verdict` > `holdings` > `pattern` > `script` > `seeds` > `build` > `sweep`
//!
//! ```no_run
//! // In a policy author's own `cargo test` (`tests/contract.rs`):
//! let wasm = allocbox_check::build_policy(env!("CARGO_MANIFEST_DIR"), env!("CARGO_PKG_NAME"))
//!     .unwrap_or_else(|e| panic!("{e}"));
//! allocbox_check::assert_contract(&wasm, &[]);
//! ```

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

use allocbox::Limits;
use allocbox::LoadError;
use allocbox::{Policy, Runtime};

mod build;
mod client;
mod holdings;
mod model;
mod pattern;
mod runner;
mod script;
mod seeds;
mod shrink;
mod strategy;
mod sweep;
mod verdict;

pub use build::{BuildError, build_policy};
pub use holdings::{Holdings, REUSE_SPAN};
use runner::Subject;
use script::Case;
pub use script::{CallPath, Op, RanWith, SCRIPT_NOTATION, Script, ScriptLimit};
use seeds::SeedFile;
use strategy::Scripts;
use verdict::Tally;
pub use verdict::{
    CHECK_CALL_TIME, COUNTERS_KEPT, CheckOptions, CheckReport, Finding, LONG_CASES, LONG_OPS,
    MACHINE_TOO_SLOW, Progress, ProgressFn, default_regressions_dir,
};

/// The seed of a check given none: fixed, so a library caller's check (a test's
/// `assert_contract`) runs the same cases every time. The command line draws a fresh one
/// per run instead, and prints it.
pub const DEFAULT_SEED: u64 = 0x5EED_A110_CB0C;

/// What a policy's failing seeds and script are kept under: its name, and the first
/// 12 hex digits of a digest of its binary and `config`.
fn regression_name(name: &str, policy: &Policy, config: &[(&str, &str)]) -> String {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    policy.digest().hash(&mut hasher);
    config.hash(&mut hasher);
    let file_safe: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    format!("{file_safe}-{:012x}", hasher.finish() >> 16)
}

/// Why a case was rejected: the time budget ran out before it, which ends the round.
const OUT_OF_TIME: &str = "the time budget ran out";

/// A proptest runner for one round of `cases` sequences from `seed`, persisting failing
/// seeds where the options say.
fn round_runner(options: &CheckOptions, policy: &str, cases: u32, seed: u64) -> TestRunner {
    // Shrinking is bounded by the strategy's own budget (`ShrinkBudget`), not here:
    // proptest's bounds announce themselves on standard error. (`u32::MAX` would mean
    // four per case to proptest.)
    let mut config = Config {
        cases,
        max_shrink_iters: u32::MAX - 1,
        max_shrink_time: 0,
        failure_persistence: None,
        // A case rejected is the time budget spent ([`OUT_OF_TIME`]): the round ends
        // there, rather than draw every case left (`--cases 4294967295` drew them for
        // minutes past `--time`).
        max_global_rejects: 0,
        ..Config::default()
    };
    if let Some(dir) = &options.regressions {
        config.failure_persistence = Some(Box::new(SeedFile::new(dir, policy)));
    }
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    TestRunner::new_with_rng(
        config,
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes),
    )
}

/// Slots in a check's instance pool. Cases run one handler (one instance) at a time;
/// the rest is headroom.
const POOL_INSTANCES: u32 = 4;

/// Fuzz the handler contract of `policy` (started with `config`) with proptest.
///
/// Errs only when the policy cannot be started at all; a broken rule is a report with
/// `failure` set, holding the shrunk script.
pub fn check(
    runtime: &Runtime,
    policy: &Policy,
    config: &[(&str, &str)],
    options: &CheckOptions,
) -> Result<CheckReport, LoadError> {
    // Every case starts a fresh instance. From a pool of warm slots that skips a memory
    // mapping and the guest's page faults each time. A pool reserves its address space
    // up front; where that is refused (a `ulimit -v`), cases start the ordinary way.
    // Either way the runtime counts each call's work, so the verdict is the machine's
    // whatever its load.
    let pooled = Runtime::counted_pool(POOL_INSTANCES, options.limits.memory)
        .ok()
        .and_then(|pool| Some((pool.adopt(policy).ok()?, pool)));
    let counted;
    let (runtime, policy) = match &pooled {
        Some((policy, pool)) => (pool, policy),
        None => {
            counted = in_counted(runtime, policy)?;
            (&counted.0, &counted.1)
        }
    };
    let mut subject = Subject {
        runtime,
        policy,
        config: owned(config),
        limits: &options.limits,
        upstream_seed: 0,
        hook: options.hook.as_deref(),
        tally: Tally::default(),
    };
    let (name, shardable) = match subject.start(CallPath::Magazines, None, 1)?.0 {
        runner::Started::Host(h) => (h.name().to_string(), h.shardable()),
        started => (started.name().to_string(), false),
    };
    // The standard configurations this policy starts with, which some rounds draw.
    let accepted: Vec<(&'static str, String)> = sweep::candidates(config)
        .into_iter()
        .filter(|(key, value)| {
            let mut config = owned(config);
            config.push((key.to_string(), value.clone()));
            let probe = Subject {
                runtime,
                policy,
                config,
                limits: &options.limits,
                upstream_seed: 0,
                hook: None,
                tally: Tally::default(),
            };
            probe.start(CallPath::Magazines, None, 1).is_ok()
        })
        .collect();

    let cases = AtomicU64::new(0);
    let ops = AtomicU64::new(0);
    let start = Instant::now();
    let base_seed = options.seed.unwrap_or(DEFAULT_SEED);
    let regression_name = regression_name(&name, policy, config);
    let mut failure = None;
    let shrink_spent = Arc::new(AtomicBool::new(false));
    let mut time_to_failure = None;
    let mut rounds_run = 0;
    let mut failure_drawn = Vec::new();
    for round in 0u64.. {
        // Every fourth round (from the fourth on): a few long-lived instances.
        let several = options.time.is_some() || options.rounds.is_some();
        let long = several && round % 4 == 3;
        let (round_cases, max_ops) = match long {
            true => (LONG_CASES, LONG_OPS),
            false => (options.cases, options.max_ops.max(1)),
        };
        let seed = base_seed.wrapping_add(round.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        subject.upstream_seed = seed;
        let drawn = match several && sweep::draws(round) {
            true => sweep::drawn(&accepted, seed),
            false => Vec::new(),
        };
        subject.config = owned(config);
        subject.config.extend(drawn.iter().cloned());
        let mut runner = round_runner(options, &regression_name, round_cases, seed);
        let strategy = Scripts {
            threads: options.threads.max(1),
            max_ops,
            long,
            // Several client threads on a policy that says its state is per instance:
            // a third of the cases give each thread an instance and pass blocks on.
            per_thread: shardable && options.threads > 1,
            // A long-lived instance's failure replays thousands of operations per
            // trial: past this, the smallest script found so far is reported.
            shrink_time: options.shrink_time,
            shrink_spent: shrink_spent.clone(),
        };
        let first_failure = std::sync::OnceLock::new();
        // A call past the wall clock's safety net judges the machine, not the policy:
        // the check ends with no verdict, and no case after it (shrinking's included)
        // is run.
        let too_slow = std::sync::OnceLock::new();
        // The case shrinking settles on is the last that failed: its script and finding
        // are kept as it runs, so the verdict is what was seen, not a run again.
        let last_failure = std::sync::Mutex::new(None);
        let outcome = runner.run(&strategy, |case| {
            if too_slow.get().is_some() {
                return Ok(());
            }
            // Past the time budget, the round ends, its remaining cases undrawn;
            // shrinking a failure found before it runs to its own bound.
            let out_of_time = options.time.is_some_and(|t| start.elapsed() >= t);
            if out_of_time && first_failure.get().is_none() {
                return Err(TestCaseError::reject(OUT_OF_TIME));
            }
            // While no case has failed, a case stops at the time budget; shrinking a
            // failure runs each trial whole, to its own bound.
            let deadline = match first_failure.get() {
                None => options.time.map(|t| start + t),
                Some(_) => None,
            };
            let (script, finding) = match subject.run(&case, deadline) {
                Ok(judged) => judged,
                Err(unfinished) => {
                    // Ran, but not to its end: no case, nothing to judge.
                    ops.fetch_add(unfinished.len() as u64, Ordering::Relaxed);
                    return Ok(());
                }
            };
            let ops = ops.fetch_add(script.len() as u64, Ordering::Relaxed) + script.len() as u64;
            let cases = cases.fetch_add(1, Ordering::Relaxed) + 1;
            if let Some(progress) = &options.progress {
                progress(&Progress {
                    cases,
                    ops,
                    elapsed: start.elapsed(),
                    time: options.time,
                    cases_wanted: options.time.is_none().then_some(options.cases),
                });
            }
            match finding {
                None => Ok(()),
                Some(f) if f.rule == MACHINE_TOO_SLOW => {
                    let reason = TestCaseError::fail(f.to_string());
                    let _ = too_slow.set((f, script));
                    Err(reason)
                }
                Some(f) => {
                    first_failure.get_or_init(Instant::now);
                    let reason = TestCaseError::fail(f.to_string());
                    *last_failure.lock().unwrap_or_else(|p| p.into_inner()) = Some((f, script));
                    Err(reason)
                }
            }
        });
        let last_failure = last_failure.into_inner().unwrap_or_else(|p| p.into_inner());
        rounds_run += 1;
        time_to_failure = first_failure.get().map(|at| at.duration_since(start));
        let out_of_time = options.time.is_some_and(|t| start.elapsed() >= t);
        failure = match (outcome, last_failure) {
            _ if too_slow.get().is_some() => too_slow.into_inner(),
            (Ok(()), _) => None,
            (Err(TestError::Abort(_)), None) if out_of_time => None,
            (Err(TestError::Fail(..)), Some((finding, script))) => {
                let mut script = script.with_names_in_order();
                script.ran.config = subject.config.clone();
                failure_drawn = drawn;
                Some((confirmed(&subject, finding, &script)?, script))
            }
            (Err(TestError::Fail(reason, _)), None) => Some((
                Finding {
                    rule: "aborted",
                    message: reason.to_string(),
                },
                Script::default(),
            )),
            (Err(TestError::Abort(reason)), _) => Some((
                Finding {
                    rule: "aborted",
                    message: reason.to_string(),
                },
                Script::default(),
            )),
        };
        let rounds_left = options.rounds.is_some_and(|r| round + 1 < u64::from(r));
        let time_left = options.time.is_some_and(|t| start.elapsed() < t);
        let more = match (options.rounds, options.time) {
            (Some(_), Some(_)) => rounds_left && time_left,
            _ => rounds_left || time_left,
        };
        if failure.is_some() || !more {
            break;
        }
    }
    // Rounds were asked for, and the time cap ended the check first.
    let cut_by_time = failure.is_none()
        && options.rounds.is_some()
        && options.time.is_some_and(|t| start.elapsed() >= t);
    Ok(CheckReport {
        policy: name,
        seed: base_seed,
        rounds: rounds_run,
        cut_by_time,
        regression_name,
        cases: cases.into_inner() as u32,
        ops: ops.into_inner(),
        elapsed: start.elapsed(),
        budget_refusals: subject.tally.budget.into_inner(),
        budget_refusals_held: subject.tally.budget_held.into_inner(),
        injected_refusals: subject.tally.injected.into_inner(),
        cross_thread_frees: subject.tally.passed.into_inner(),
        cases_waited: subject.tally.waited.load(Ordering::Relaxed),
        instances_shared: (subject.tally.fewest_instances.into_inner())
            .unwrap_or_else(|p| p.into_inner())
            .filter(|&fewest| fewest < options.threads),
        counters: subject
            .tally
            .counters
            .into_inner()
            .unwrap_or_else(|p| p.into_inner()),
        counters_left_out: subject.tally.counters_left_out.into_inner(),
        ungranted: subject
            .tally
            .ungranted
            .into_inner()
            .unwrap_or_else(|p| p.into_inner()),
        holdings: (subject.tally.holdings.into_inner()).unwrap_or_else(|p| p.into_inner()),
        failure,
        drawn_config: failure_drawn,
        swept: {
            let mut keys: Vec<&'static str> = accepted.iter().map(|(key, _)| *key).collect();
            keys.dedup();
            keys
        },
        shrink_stopped_early: shrink_spent.load(Ordering::Relaxed),
        time_to_failure,
    })
}

/// A configuration as the runner keeps it.
fn owned(config: &[(&str, &str)]) -> Vec<(String, String)> {
    config
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `policy` in a counted runtime ([`Runtime::counted`]): `runtime` if it counts, else
/// the process's counted runtime, the policy compiled there once.
fn in_counted(runtime: &Runtime, policy: &Policy) -> Result<(Runtime, Policy), LoadError> {
    if runtime.is_counted() {
        return Ok((runtime.clone(), policy.clone()));
    }
    static COUNTED: std::sync::OnceLock<Runtime> = std::sync::OnceLock::new();
    let counted = COUNTED
        .get_or_init(|| Runtime::counted().expect("the counted wasmtime configuration is valid"));
    Ok((counted.clone(), counted.adopt(policy)?))
}

/// Run a script exactly, with every check on, each call's work counted as `check`
/// counts it (in `runtime` if it counts, else in the process's counted runtime).
/// `Ok(None)`: every rule held.
pub fn replay(
    runtime: &Runtime,
    policy: &Policy,
    config: &[(&str, &str)],
    script: &Script,
    limits: &Limits,
) -> Result<Option<Finding>, LoadError> {
    let (runtime, policy) = in_counted(runtime, policy)?;
    let subject = Subject {
        runtime: &runtime,
        policy: &policy,
        config: owned(config),
        limits,
        upstream_seed: script.upstream_seed,
        hook: None,
        tally: Tally::default(),
    };
    // One client thread runs exactly as the check ran it: on this thread, its cache
    // given back the same way, so the policy sees the same calls in the same order.
    if let [ops] = script.threads.as_slice() {
        let case = Case {
            path: script.path,
            magazine_depth: script.magazine_depth,
            threads: vec![ops.clone()],
        };
        return Ok(subject.run(&case, None).ok().and_then(|judged| judged.1));
    }
    let (handler, adversary) =
        subject.start(script.path, script.magazine_depth, script.threads.len())?;
    // Operations reach the handler in the recorded order; a script without one runs its
    // threads one after the other.
    let sections: Vec<usize>;
    let threads = script.threads.len();
    let recorded = !script.order.is_empty() && script.order.iter().all(|&t| t < threads);
    let order = match recorded {
        true => &script.order,
        false => {
            sections = (0..script.threads.len())
                .flat_map(|t| std::iter::repeat_n(t, script.threads[t].len()))
                .collect();
            &sections
        }
    };
    Ok(runner::run_in_order(&*handler, &adversary, script, order))
}

/// The finding of a shrunk script, once it has been replayed as `allocbox replay` runs
/// it. One client thread's script fails the same way every time (the checker's upstream
/// places every block by its seed); several threads' may not, and such a script is
/// `flaky`.
fn confirmed(
    subject: &Subject<'_>,
    finding: Finding,
    script: &Script,
) -> Result<Finding, LoadError> {
    let config: Vec<(&str, &str)> = (subject.config.iter())
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let again = replay(
        subject.runtime,
        subject.policy,
        &config,
        script,
        subject.limits,
    )?;
    if again.as_ref().is_some_and(|f| f.rule == finding.rule) {
        return Ok(finding);
    }
    let seen = again.map_or("passed".to_string(), |f| format!("found {f}"));
    Ok(match script.threads.len() {
        1 => Finding {
            message: format!(
                "{} (replaying the script {seen}: the checker's upstream should have made \
                 it fail the same way; please report this)",
                finding.message
            ),
            ..finding
        },
        _ => Finding {
            rule: "flaky",
            message: format!(
                "{finding}, but the script {seen} when replayed in the order its threads \
                 reached the handler: the failure depends on timing"
            ),
        },
    })
}

/// The rounds a default `allocbox check` and [`assert_contract`] run: about what the
/// check's earlier default of 3 s ran here on a quiet machine (24 rounds of 64 cases,
/// every fourth of them a few long-lived instances), counted rather than timed, so the
/// same seed does the same work, and gives the same verdict, on any machine.
pub const DEFAULT_ROUNDS: u32 = 24;

/// What [`assert_contract`] checks with: [`DEFAULT_ROUNDS`] rounds (from the fixed
/// seed, which it replaces by a fresh one), failing seeds kept where the command line
/// keeps them.
pub fn contract_options() -> CheckOptions {
    CheckOptions {
        rounds: Some(DEFAULT_ROUNDS),
        regressions: default_regressions_dir(),
        ..CheckOptions::default()
    }
}

/// A seed no earlier run is likely to have used, for a check given none: the clock's
/// nanoseconds and the process id, through a hasher keyed at random for this process.
pub fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(nanos ^ u64::from(std::process::id()));
    hasher.finish()
}

/// The variable that pins [`assert_contract`]'s seed.
pub const SEED_ENV: &str = "ALLOCBOX_CHECK_SEED";

/// For a policy author's `#[test]`: check the component at `path` as a default
/// `allocbox check` does ([`contract_options`]: the same depth, counted in cases) from a
/// fresh seed each run, so each `cargo test` looks somewhere new, and panic with the
/// broken rule, the shrunk script and the seed if any rule breaks. The seed is printed
/// (shown with a failing test's output); `ALLOCBOX_CHECK_SEED=N` runs that one again.
pub fn assert_contract(path: impl AsRef<Path>, config: &[(&str, &str)]) {
    let runtime = Runtime::shared();
    let path = path.as_ref();
    let policy = runtime
        .load_file(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let seed = match std::env::var(SEED_ENV) {
        Ok(pinned) => pinned
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{SEED_ENV}={pinned:?} is not a seed: give a whole number")),
        Err(_) => fresh_seed(),
    };
    eprintln!(
        "allocbox_check: {} from seed {seed} ({SEED_ENV}={seed} runs it again)",
        path.display()
    );
    let options = CheckOptions {
        seed: Some(seed),
        ..contract_options()
    };
    let report = check(runtime, &policy, config, &options).unwrap_or_else(|e| panic!("{e}"));
    if let Some((finding, script)) = report.failure {
        if finding.rule == MACHINE_TOO_SLOW {
            // No verdict: the wall clock's limit, not a rule, stopped a case.
            eprintln!(
                "allocbox_check: no verdict on {}: {}",
                path.display(),
                finding.message
            );
            return;
        }
        panic!(
            "{finding}\nshrunk script ({} operations):\n{script}\nfrom seed {seed}: \
             `{SEED_ENV}={seed} cargo test` runs it again",
            script.len()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drive `Scripts` through proptest's own runner against a predicate and return the
    /// minimal failing script it settles on.
    fn minimal(threads: usize, fails: impl Fn(&[Vec<Op>]) -> bool) -> Vec<Vec<Op>> {
        let config = Config {
            cases: 256,
            failure_persistence: None,
            ..Config::default()
        };
        let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
        let mut runner = TestRunner::new_with_rng(config, rng);
        let strategy = Scripts {
            threads,
            max_ops: 128,
            long: false,
            per_thread: false,
            shrink_time: None,
            shrink_spent: Default::default(),
        };
        match runner.run(&strategy, |case| {
            if fails(&case.threads) {
                Err(TestCaseError::fail("predicate"))
            } else {
                Ok(())
            }
        }) {
            Err(TestError::Fail(_, minimal)) => minimal.threads,
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn shrinking_keeps_only_the_guilty_operations_at_their_smallest_numbers() {
        // Fails when a malloc of at least 100 bytes is later freed.
        let found = minimal(1, |t| {
            let ops = &t[0];
            ops.iter().enumerate().any(|(i, op)| match *op {
                Op::Malloc { block, size } if size >= 100 => {
                    ops[i + 1..].contains(&Op::Free { block })
                }
                _ => false,
            })
        });
        match found.as_slice() {
            [ops] => match ops.as_slice() {
                [Op::Malloc { block, size: 100 }, Op::Free { block: freed }] => {
                    assert_eq!(block, freed)
                }
                other => panic!("not minimal: {other:?}"),
            },
            other => panic!("not minimal: {other:?}"),
        }
    }

    #[test]
    fn shrinking_empties_the_threads_that_do_not_matter() {
        let found = minimal(2, |t| {
            t[1].iter()
                .any(|op| matches!(op, Op::Calloc { nelem, .. } if *nelem >= 3))
        });
        assert_eq!(found.len(), 2);
        assert!(found[0].is_empty(), "{found:?}");
        assert!(
            matches!(
                found[1].as_slice(),
                [Op::Calloc {
                    nelem: 3,
                    elsize: 0,
                    ..
                }]
            ),
            "{found:?}"
        );
    }

    #[test]
    fn a_script_survives_its_text_form() {
        let script = Script {
            threads: vec![
                vec![
                    Op::Malloc { block: 0, size: 8 },
                    Op::Realloc {
                        block: 0,
                        size: 4096,
                    },
                    Op::Trim,
                    Op::Free { block: 0 },
                ],
                vec![
                    Op::Calloc {
                        block: 0,
                        nelem: u64::MAX,
                        elsize: 2,
                    },
                    Op::OomAfter { requests: 0 },
                    Op::OomAfter { requests: 5 },
                    Op::OomEvery { n: 3 },
                    Op::OomAbove { size: 4096 },
                    Op::ReallocNew { block: 1, size: 0 },
                ],
            ],
            order: Vec::new(),
            upstream_seed: 77,
            path: CallPath::PerCall,
            magazine_depth: None,
            ..Script::default()
        };
        assert_eq!(Script::parse(&script.to_string()).unwrap(), script);
        let interleaved = Script {
            order: vec![0, 1, 1, 0, 0, 0, 1, 1, 1, 1],
            ..script
        };
        let text = interleaved.to_string();
        assert!(
            text.starts_with("upstream seed 77\nper-call\nt0 b0 = malloc 8\nt1 b0 = calloc"),
            "{text}"
        );
        assert_eq!(Script::parse(&text).unwrap(), interleaved);
    }
}
