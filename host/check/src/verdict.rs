//! What a check is asked to do and what it found.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use allocbox::mapped::KindGrant;
use allocbox::{Adversary, Error, Limits, Rule, TimeLimit, WasmHook};

use super::holdings::Holdings;
use super::script::Script;

/// The rule of a finding that is no verdict: a call ran past the wall clock's safety
/// net before its counted limit, so the machine, not the policy, was too slow.
pub const MACHINE_TOO_SLOW: &str = "machine-too-slow";

/// A broken rule, found by running a script.
#[derive(Debug, Clone)]
pub struct Finding {
    /// A short stable name: [`Error::kind`].
    pub rule: &'static str,
    pub message: String,
}

impl Finding {
    pub(super) fn from_error(e: &Error) -> Finding {
        match e {
            Error::Poisoned { cause, .. } => Finding::from_error(cause),
            Error::Timeout {
                limit: TimeLimit::Clock(_),
                ..
            } => Finding {
                rule: MACHINE_TOO_SLOW,
                message: format!(
                    "{e}; but a checked call's work is counted (`--call-work`), and the \
                     wall clock is only a safety net far above it: the machine was too slow \
                     to do the call's work in time (busy?), which says nothing of the \
                     policy; run again, or give a higher --call-time-ms"
                ),
            },
            _ => Finding {
                rule: e.kind(),
                message: e.to_string(),
            },
        }
    }

    pub(super) fn checked(policy: &str, call: &str, addr: usize, size: u64, rule: Rule) -> Finding {
        Finding {
            rule: rule.name(),
            message: format!(
                "policy `{policy}` broke the contract in `{call}` at {addr:#x} ({size} bytes): {rule}"
            ),
        }
    }
}

impl Finding {
    /// The finding, saying which upstream request the checker refused last before it:
    /// where a policy's out-of-memory path went wrong.
    pub(super) fn after_refusals(mut self, adversary: &Adversary) -> Finding {
        if let Some(last) = adversary.last_refusal() {
            self.message += &format!(" (after {last})");
        }
        self
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.rule, self.message)
    }
}

/// How hard to check.
#[derive(Clone)]
pub struct CheckOptions {
    /// Random sequences to run, per round. Default 64.
    pub cases: u32,
    /// Keep running rounds, each with a seed of its own, until this much time has
    /// passed (at least one round). Every fourth round runs long-lived instances
    /// instead ([`LONG_CASES`] sequences of up to [`LONG_OPS`] operations), where bugs
    /// that need thousands of operations in one instance show. Default none: one round.
    pub time: Option<Duration>,
    /// Run exactly this many rounds, long-lived ones every fourth as with `time`: the
    /// same work whatever the machine's speed (tests use it). With `time` too, whichever
    /// ends first. Default none.
    pub rounds: Option<u32>,
    /// Longest a failure is shrunk, beside its counted budget of trials and operations;
    /// past it the smallest script found so far is reported. Default `None`: shrinking
    /// is bounded by its counts alone, so that a seed shrinks to the same script on any
    /// machine.
    pub shrink_time: Option<Duration>,
    /// Most operations in one sequence (per thread). Default 128.
    pub max_ops: usize,
    /// Seed for a reproducible run; default a fixed seed (runs are deterministic unless
    /// a seed is given).
    pub seed: Option<u64>,
    /// Client threads calling one handler at once. Default 1.
    pub threads: usize,
    /// Bounds on the policy; default [`Limits::default`] with a 10 s call limit: in a
    /// check the counted [`Limits::call_work`] decides, and the wall clock is a safety
    /// net far above it.
    pub limits: Limits,
    /// Where failing seeds persist (`<dir>/<policy>.txt`, retried first by later runs).
    /// Default none; the command line keeps them in [`default_regressions_dir`].
    pub regressions: Option<PathBuf>,
    /// Called after every finished case.
    pub progress: Option<Arc<ProgressFn>>,
    /// An event hook told about every block the checker's clients get, resize and
    /// free, in every case and every shrinking step. Default none.
    pub hook: Option<Arc<WasmHook>>,
}

/// The wall clock's limit on a checked call: a safety net far above
/// [`allocbox::DEFAULT_CALL_WORK`]'s counted work on any machine likely to run it.
pub const CHECK_CALL_TIME: Duration = Duration::from_secs(10);

/// What [`CheckOptions::progress`] calls.
pub type ProgressFn = dyn Fn(&Progress) + Send + Sync;

/// Sequences in a round of long-lived instances.
pub const LONG_CASES: u32 = 4;
/// Most operations per sequence in a round of long-lived instances.
pub const LONG_OPS: usize = 16_384;

/// How far a check has got, for a progress display.
#[derive(Debug, Clone)]
pub struct Progress {
    pub cases: u64,
    pub ops: u64,
    pub elapsed: Duration,
    /// The time budget, when the check runs for one.
    pub time: Option<Duration>,
    /// The cases wanted, when the check runs a fixed number.
    pub cases_wanted: Option<u32>,
}

impl fmt::Debug for CheckOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckOptions")
            .field("cases", &self.cases)
            .field("time", &self.time)
            .field("max_ops", &self.max_ops)
            .field("seed", &self.seed)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            cases: 64,
            time: None,
            rounds: None,
            shrink_time: None,
            max_ops: 128,
            seed: None,
            threads: 1,
            limits: Limits {
                call_time: CHECK_CALL_TIME,
                ..Limits::default()
            },
            regressions: None,
            progress: None,
            hook: None,
        }
    }
}

/// What a check run found.
#[derive(Debug, Clone)]
pub struct CheckReport {
    pub policy: String,
    /// The seed the check drew its cases from: [`CheckOptions::seed`]'s, or the fixed
    /// default. A check given it again runs the same cases.
    pub seed: u64,
    /// The name its failing seeds and script are kept under in
    /// [`CheckOptions::regressions`]: the policy's name, and a digest of its binary and
    /// configuration, so that two policies of one name keep theirs apart.
    pub regression_name: String,
    /// Rounds run (begun: the last may have been cut by the time cap).
    pub rounds: u32,
    /// [`CheckOptions::time`] ended the check before the rounds asked for were run:
    /// the depth was cut by the clock, and another machine may run more.
    pub cut_by_time: bool,
    /// Cases run, shrinking runs included.
    pub cases: u32,
    /// Operations run, shrinking runs included.
    pub ops: u64,
    pub elapsed: Duration,
    /// Upstream requests answered "none" for passing the policy's overhead budget
    /// ([`Limits::overhead`]), over every case: the impossible sizes the checker asks
    /// for on purpose, and `budget_refusals_held`.
    pub budget_refusals: u64,
    /// Of those, the ones a request would have fit alone, refused for what the policy
    /// held beyond its client's bytes: a budget smaller than its caches grow to (or a
    /// policy that hoards).
    pub budget_refusals_held: u64,
    /// Upstream requests the checker refused on purpose (`oom` operations), over every
    /// case, to run the policy's out-of-memory paths.
    pub injected_refusals: u64,
    /// Blocks freed by a client thread other than the one that made them (`pass`, in
    /// the cases that give each thread an instance of a policy that says its state is
    /// per instance), over every case.
    pub cross_thread_frees: u64,
    /// In the `per-thread` cases, the instances started when fewer than the client
    /// threads (which then share them): the guest memory budget split further would
    /// leave an instance too little to start in. `None` when each thread had its own.
    pub instances_shared: Option<usize>,
    /// Cases left unjudged because a call waited past its time limit behind the other
    /// client threads' calls of one instance (too many `--threads` for the policy's
    /// speed and the call limit): no policy's fault.
    pub cases_waited: u64,
    /// The policy's own counters (`lifecycle.report`, 0.2.0) at the end of each case,
    /// over the cases (summed; a `peak-` counter its largest), in the policy's order;
    /// none for a 0.1.0 policy.
    pub counters: Vec<(String, u64)>,
    /// Counter values reported under names past the first [`COUNTERS_KEPT`] (a policy
    /// whose names change from case to case): counted, not listed.
    pub counters_left_out: u64,
    /// Regions a policy asked for of a kind the check did not grant
    /// ([`allocbox::Grants::memory`]), by kind, over every case: the paths that would have used
    /// them ran only as refusals, untested.
    pub ungranted: Vec<(KindGrant, u64)>,
    /// What the policy held from the host beside its client's bytes, before each trim
    /// and at each case's end, over the cases of one client thread.
    pub holdings: Holdings,
    /// The first broken rule, with the shrunk script that shows it (the script's
    /// configuration the round's: the one given, and what the check drew).
    pub failure: Option<(Finding, Script)>,
    /// The configuration the check drew for the round that failed, beyond the one
    /// given: a bug found only there names it. Empty when it failed under the one given.
    pub drawn_config: Vec<(String, String)>,
    /// The standard configuration keys some rounds drew values for (those the policy
    /// accepted and the caller left unset): `alignment`.
    pub swept: Vec<&'static str>,
    /// Shrinking the failure ran out of its budget (its counted trials and operations,
    /// or [`CheckOptions::shrink_time`]): the script shows the broken rule but may not be
    /// the shortest that does.
    pub shrink_stopped_early: bool,
    /// How long the check ran before the first failing case, shrinking not included.
    pub time_to_failure: Option<Duration>,
}

impl CheckReport {
    pub fn passed(&self) -> bool {
        self.failure.is_none()
    }

    /// Operations per second, shrinking included.
    pub fn ops_per_second(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Where the command line keeps failing seeds and scripts unless told otherwise:
/// `regressions` in allocbox's cache directory ([`allocbox::cache_dir`]), so a check run
/// inside a policy's source tree writes nothing there.
pub fn default_regressions_dir() -> Option<PathBuf> {
    allocbox::cache_dir().map(|dir| dir.join("regressions"))
}

/// Distinct counter names a check keeps over its cases, as the host keeps per report:
/// a policy that names new counters in every case cannot make the report unbounded.
pub const COUNTERS_KEPT: usize = 64;

/// Upstream requests refused on purpose, and the policy's own counters, over the cases
/// run: summed, a `peak-` counter (a high-water mark) its largest.
#[derive(Debug, Default)]
pub(super) struct Tally {
    /// Past the overhead budget: the impossible sizes the checker asks for, and
    /// `budget_held`.
    pub(super) budget: AtomicU64,
    /// Past the overhead budget for what the policy held beyond its client's bytes.
    pub(super) budget_held: AtomicU64,
    /// By `oom` operations.
    pub(super) injected: AtomicU64,
    /// Blocks passed to another client thread and freed there.
    pub(super) passed: AtomicU64,
    /// The policy's `lifecycle.report` at the end of each case, by name, in the order
    /// the policy first named them.
    pub(super) counters: std::sync::Mutex<Vec<(String, u64)>>,
    /// Values under names past the first [`COUNTERS_KEPT`].
    pub(super) counters_left_out: AtomicU64,
    /// Regions a policy of the chain asked for of a kind not granted, by kind.
    pub(super) ungranted: std::sync::Mutex<Vec<(KindGrant, u64)>>,
    /// Cases not judged because a call waited past its limit behind other client
    /// threads' calls.
    pub(super) waited: AtomicU64,
    /// The fewest instances a `per-thread` case started: fewer than its threads when
    /// the guest memory budget split further leaves an instance too little to start in.
    pub(super) fewest_instances: std::sync::Mutex<Option<usize>>,
    /// What the policy held beside its client's bytes ([`CheckReport::holdings`]).
    pub(super) holdings: std::sync::Mutex<Holdings>,
}

impl Tally {
    pub(super) fn instances(&self, started: usize) {
        let mut fewest = (self.fewest_instances.lock()).unwrap_or_else(|p| p.into_inner());
        *fewest = Some(fewest.map_or(started, |f| f.min(started)));
    }

    pub(super) fn add_ungranted(&self, refused: &[(KindGrant, u64)]) {
        let mut all = self.ungranted.lock().unwrap_or_else(|p| p.into_inner());
        for &(kind, n) in refused {
            match all.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, sum)) => *sum = sum.saturating_add(n),
                None => all.push((kind, n)),
            }
        }
        all.sort_unstable();
    }

    pub(super) fn add_counters(&self, counters: Vec<(String, u64)>) {
        let mut all = self.counters.lock().unwrap_or_else(|p| p.into_inner());
        for (name, value) in counters {
            let full = all.len() >= COUNTERS_KEPT;
            match all.iter_mut().find(|(n, _)| *n == name) {
                Some((n, peak)) if n.starts_with("peak-") => *peak = (*peak).max(value),
                Some((_, sum)) => *sum = sum.saturating_add(value),
                None if !full => all.push((name, value)),
                None => {
                    self.counters_left_out.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_add_up_over_cases_but_a_peak_is_the_largest() {
        let tally = Tally::default();
        let case = |lent, peak| vec![("lent".to_string(), lent), ("peak-bytes".to_string(), peak)];
        tally.add_counters(case(3, 4096));
        tally.add_counters(case(5, 100));
        tally.add_counters(vec![("refused".to_string(), 1)]);
        let all = tally.counters.into_inner().unwrap();
        let expected = [("lent", 8), ("peak-bytes", 4096), ("refused", 1)];
        let expected: Vec<(String, u64)> =
            expected.iter().map(|&(n, v)| (n.to_string(), v)).collect();
        assert_eq!(all, expected);
    }

    #[test]
    fn names_past_the_kept_ones_are_counted_not_listed() {
        let tally = Tally::default();
        for case in 0..1000 {
            tally.add_counters(vec![(format!("counter-{case}"), 1)]);
        }
        assert_eq!(tally.counters.into_inner().unwrap().len(), COUNTERS_KEPT);
        assert_eq!(
            tally.counters_left_out.into_inner(),
            1000 - COUNTERS_KEPT as u64
        );
    }
}
