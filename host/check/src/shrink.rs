//! Shrinking a failing script: a proptest value tree that deletes runs of operations
//! (blocks are named by the operation that made it, so a deletion never changes which
//! block another operation means), then narrows each number, within a budget of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::script::{CallPath, Case, Op};

/// The most trials shrinking one failure runs and the most operations they run
/// together, counted so that a seed shrinks to the same script on any machine, and
/// optionally how long it may take from its first trial. Past any, the smallest failing
/// script found so far stands. Kept here rather than in proptest's configuration, which
/// says so on standard error when it stops shrinking.
#[derive(Debug, Clone)]
pub(super) struct ShrinkBudget {
    trials_left: u32,
    ops_left: u64,
    time: Option<Duration>,
    started: Option<Instant>,
    /// Set when the budget ran out before shrinking ended (the check's report says so).
    spent: Arc<AtomicBool>,
}

impl ShrinkBudget {
    /// Trials one failure's shrinking may run.
    pub(super) const TRIALS: u32 = 2048;
    /// Operations one failure's trials may run together: room for a long-lived
    /// instance's failure of 16,384 operations to shrink to the few hundred that show
    /// it (`tests/all/check.rs`), some 20 s of shrinking at the checker's rate here.
    pub(super) const OPS: u64 = 4_000_000;

    /// `spent` is set if this budget runs out.
    pub(super) fn new(time: Option<Duration>, spent: Arc<AtomicBool>) -> Self {
        ShrinkBudget {
            trials_left: Self::TRIALS,
            ops_left: Self::OPS,
            time,
            started: None,
            spent,
        }
    }

    /// Take one trial of at most `ops` operations; false once the budget is spent.
    fn take(&mut self, ops: u64) -> bool {
        let started = *self.started.get_or_insert_with(Instant::now);
        let in_time = self.time.is_none_or(|limit| started.elapsed() < limit);
        if self.trials_left == 0 || self.ops_left < ops || !in_time {
            self.spent.store(true, Ordering::Relaxed);
            return false;
        }
        self.trials_left -= 1;
        self.ops_left -= ops;
        true
    }
}

/// Numbers at or below this are narrowed by trying each from the smallest up, not by
/// bisection.
const LINEAR_BELOW: u64 = 16;

/// Where shrinking has got to.
#[derive(Debug, Clone, Copy)]
pub(super) enum Step {
    /// Delete `run` operations of `thread` at `at`; the run halves after each pass.
    Delete {
        thread: usize,
        run: usize,
        at: usize,
    },
    /// Binary search for the smallest value of one number of one operation that still
    /// fails: the answer lies in `lo..=hi`, and `hi` fails.
    Narrow {
        thread: usize,
        index: usize,
        field: usize,
        bounds: Option<(u64, u64)>,
    },
    Done,
}

/// The candidate on trial, and how to take it back if it passes.
#[derive(Debug, Clone)]
pub(super) enum Trial {
    Deleted {
        thread: usize,
        at: usize,
        ops: Vec<Op>,
    },
    Narrowed {
        thread: usize,
        index: usize,
        was: Op,
    },
}

/// Shrinks a failing script: deletes runs of operations (delta debugging, so a long
/// sequence with two guilty operations takes tens of runs, not hundreds), then lowers
/// each number (size, count) of the operations left by binary search.
///
/// Every `complicate` both takes back the trial that passed and puts up the next one, so
/// no run is spent on re-running a case already known to fail.
#[derive(Debug, Clone)]
pub(super) struct ScriptTree {
    /// Kept as drawn: shrinking the operations is what makes a script readable.
    pub(super) path: CallPath,
    pub(super) magazine_depth: Option<u8>,
    pub(super) threads: Vec<Vec<Op>>,
    pub(super) step: Step,
    pub(super) trial: Option<Trial>,
    /// A trial failed (and was kept) since deleting last began.
    pub(super) kept_since_pass: bool,
    pub(super) budget: ShrinkBudget,
}

impl ScriptTree {
    pub(super) fn new(
        path: CallPath,
        magazine_depth: Option<u8>,
        threads: Vec<Vec<Op>>,
        budget: ShrinkBudget,
    ) -> Self {
        let run = Self::first_run(&threads, 0);
        ScriptTree {
            path,
            magazine_depth,
            threads,
            step: Step::Delete {
                thread: 0,
                run,
                at: 0,
            },
            trial: None,
            kept_since_pass: false,
            budget,
        }
    }

    pub(super) fn first_run(threads: &[Vec<Op>], thread: usize) -> usize {
        threads
            .get(thread)
            .map_or(1, |ops| ops.len().div_ceil(2).max(1))
    }

    /// Put up the next candidate; false when there is none left (the current script is
    /// then the smallest failing one found).
    pub(super) fn next_trial(&mut self) -> bool {
        // A trial runs at most the operations of the script it deletes from or narrows.
        let ops = self.threads.iter().map(|ops| ops.len() as u64).sum();
        if !self.budget.take(ops) {
            self.step = Step::Done;
            return false;
        }
        loop {
            match &mut self.step {
                Step::Delete { thread, run, at } => {
                    let Some(ops) = self.threads.get_mut(*thread) else {
                        self.step = Step::Narrow {
                            thread: 0,
                            index: 0,
                            field: 0,
                            bounds: None,
                        };
                        continue;
                    };
                    if *at < ops.len() {
                        let end = (*at + *run).min(ops.len());
                        let removed = ops.drain(*at..end).collect();
                        self.trial = Some(Trial::Deleted {
                            thread: *thread,
                            at: *at,
                            ops: removed,
                        });
                        return true;
                    }
                    if *run > 1 {
                        *run /= 2;
                        *at = 0;
                    } else {
                        *thread += 1;
                        *run = Self::first_run(&self.threads, *thread);
                        *at = 0;
                    }
                }
                Step::Narrow {
                    thread,
                    index,
                    field,
                    bounds,
                } => {
                    let Some(ops) = self.threads.get_mut(*thread) else {
                        // Smaller numbers can make operations redundant that were not
                        // (two sizes became one): delete again, until a pass of both
                        // steps keeps nothing.
                        self.step = match std::mem::take(&mut self.kept_since_pass) {
                            true => Step::Delete {
                                thread: 0,
                                run: Self::first_run(&self.threads, 0),
                                at: 0,
                            },
                            false => Step::Done,
                        };
                        continue;
                    };
                    let Some(op) = ops.get_mut(*index) else {
                        (*thread, *index, *field, *bounds) = (*thread + 1, 0, 0, None);
                        continue;
                    };
                    let Some(value) = op.number(*field) else {
                        (*index, *field, *bounds) = (*index + 1, 0, None);
                        continue;
                    };
                    let (lo, hi) = *bounds.get_or_insert((0, value));
                    if lo >= hi {
                        (*field, *bounds) = (*field + 1, None);
                        continue;
                    }
                    let was = *op;
                    // Small numbers (counts of requests, sizes below a size class) are
                    // tried one by one from the smallest: a failure need not be
                    // monotonic in them (`oom every 4` may pass where 2 and 9 fail), and
                    // a bisection past a passing middle never sees the smaller ones.
                    let candidate = match hi <= LINEAR_BELOW {
                        true => lo,
                        false => lo + (hi - lo) / 2,
                    };
                    op.set_number(*field, candidate);
                    self.trial = Some(Trial::Narrowed {
                        thread: *thread,
                        index: *index,
                        was,
                    });
                    return true;
                }
                Step::Done => return false,
            }
        }
    }
}

impl proptest::strategy::ValueTree for ScriptTree {
    type Value = Case;

    fn current(&self) -> Case {
        Case {
            path: self.path,
            magazine_depth: self.magazine_depth,
            threads: self.threads.clone(),
        }
    }

    /// The current script failed: keep it and try a smaller one.
    fn simplify(&mut self) -> bool {
        self.kept_since_pass |= self.trial.is_some();
        if let (Some(Trial::Narrowed { thread, index, .. }), Step::Narrow { field, bounds, .. }) =
            (self.trial.take(), &mut self.step)
        {
            let value = self.threads[thread][index]
                .number(*field)
                .expect("narrowed");
            if let Some((_, hi)) = bounds {
                *hi = value;
            }
        }
        self.next_trial()
    }

    /// The current script passed: take the trial back and put up the next one.
    fn complicate(&mut self) -> bool {
        match self.trial.take() {
            None => return false,
            Some(Trial::Deleted { thread, at, ops }) => {
                let run = ops.len();
                self.threads[thread].splice(at..at, ops);
                if let Step::Delete { at: next, .. } = &mut self.step {
                    *next = at + run;
                }
            }
            Some(Trial::Narrowed { thread, index, was }) => {
                let op = &mut self.threads[thread][index];
                if let Step::Narrow {
                    field,
                    bounds: Some((lo, _)),
                    ..
                } = &mut self.step
                {
                    *lo = op.number(*field).expect("narrowed") + 1;
                }
                *op = was;
            }
        }
        self.next_trial()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::ValueTree;

    /// Shrinking stops at its own bound, on the last failing script, before proptest's
    /// bound would (which says so on standard error).
    #[test]
    fn shrinking_stops_after_its_budget_of_trials_on_the_last_failing_script() {
        let ops: Vec<Op> = (0..256)
            .map(|block| Op::Malloc { block, size: 8 })
            .collect();
        let spent = Arc::new(AtomicBool::new(false));
        let mut tree = ScriptTree::new(
            CallPath::Magazines,
            None,
            vec![ops.clone()],
            ShrinkBudget::new(None, spent.clone()),
        );
        // Only the whole script fails: every one of the thousands of deletions passes.
        let mut trials = 0;
        let mut more = tree.simplify();
        while more {
            trials += 1;
            assert!(trials <= ShrinkBudget::TRIALS, "ran past its budget");
            more = tree.complicate();
        }
        assert_eq!(trials, ShrinkBudget::TRIALS);
        assert_eq!(tree.current().threads, [ops]);
        assert!(spent.load(Ordering::Relaxed), "the report is told");
    }

    /// Long scripts spend the operations' budget before the trials': shrinking a long
    /// failure stops after a count of work, the same on any machine.
    #[test]
    fn shrinking_a_long_script_stops_after_its_budget_of_operations() {
        let len = 16_384;
        let ops: Vec<Op> = (0..len)
            .map(|block| Op::Malloc { block, size: 8 })
            .collect();
        let spent = Arc::new(AtomicBool::new(false));
        let mut tree = ScriptTree::new(
            CallPath::Magazines,
            None,
            vec![ops],
            ShrinkBudget::new(None, spent.clone()),
        );
        let mut trials = 0;
        let mut more = tree.simplify();
        while more {
            trials += 1;
            more = tree.complicate();
        }
        assert_eq!(trials, ShrinkBudget::OPS / u64::from(len));
        assert!(spent.load(Ordering::Relaxed));
    }
}
