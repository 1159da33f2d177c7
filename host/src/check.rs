//! The contract checker: drives random sequences of client operations through a policy
//! with every host check on, plus deep checks that cost bandwidth (checked mode), and
//! shrinks a failure to a short, replayable script.
//!
//! The reference model is the list of live blocks and the bytes each must hold; the
//! system under test is a fresh [`Handler`] per case. Operations name blocks by *slot*
//! (index into the live blocks, oldest first, modulo their number), so every sequence is
//! valid and proptest can shrink by dropping operations without preconditions.
//!
//! ```no_run
//! // In a policy author's own `cargo test`:
//! allocbox::check::assert_contract("target/wasm32-wasip2/release/my_policy.wasm", &[]);
//! ```

use std::fmt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{
    Config, FileFailurePersistence, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner,
};

use crate::error::{Error, LoadError, Rule};
use crate::handler::{Handler, HandlerBuilder};
use crate::link::Limits;
use crate::runtime::{Policy, Runtime};

/// One client operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Malloc(u64),
    Calloc(u64, u64),
    /// Resize the block in the slot; `None` (or no live block) is realloc from null.
    Realloc(Option<usize>, u64),
    /// Free the block in the slot (nothing when no block is live).
    Free(usize),
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Malloc(size) => write!(f, "malloc {size}"),
            Op::Calloc(n, e) => write!(f, "calloc {n} {e}"),
            Op::Realloc(None, size) => write!(f, "realloc - {size}"),
            Op::Realloc(Some(slot), size) => write!(f, "realloc #{slot} {size}"),
            Op::Free(slot) => write!(f, "free #{slot}"),
        }
    }
}

impl std::str::FromStr for Op {
    type Err = String;

    fn from_str(line: &str) -> Result<Op, String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |w: &str| w.parse::<u64>().map_err(|e| format!("`{w}`: {e}"));
        let slot = |w: &str| {
            w.strip_prefix('#')
                .ok_or_else(|| format!("`{w}`: a block is written #N"))?
                .parse::<usize>()
                .map_err(|e| format!("`{w}`: {e}"))
        };
        match words.as_slice() {
            ["malloc", size] => Ok(Op::Malloc(num(size)?)),
            ["calloc", n, e] => Ok(Op::Calloc(num(n)?, num(e)?)),
            ["realloc", "-", size] => Ok(Op::Realloc(None, num(size)?)),
            ["realloc", s, size] => Ok(Op::Realloc(Some(slot(s)?), num(size)?)),
            ["free", s] => Ok(Op::Free(slot(s)?)),
            _ => Err(format!("not an operation: `{line}`")),
        }
    }
}

impl Op {
    /// The `field`th number of the operation (sizes, counts, slots), for shrinking.
    fn number(&self, field: usize) -> Option<u64> {
        match (self, field) {
            (Op::Malloc(size), 0) | (Op::Realloc(None, size), 0) => Some(*size),
            (Op::Calloc(n, _), 0) => Some(*n),
            (Op::Calloc(_, e), 1) => Some(*e),
            (Op::Realloc(Some(slot), _), 0) | (Op::Free(slot), 0) => Some(*slot as u64),
            (Op::Realloc(Some(_), size), 1) => Some(*size),
            _ => None,
        }
    }

    fn set_number(&mut self, field: usize, value: u64) {
        match (self, field) {
            (Op::Malloc(size), 0) | (Op::Realloc(None, size), 0) => *size = value,
            (Op::Calloc(n, _), 0) => *n = value,
            (Op::Calloc(_, e), 1) => *e = value,
            (Op::Realloc(Some(slot), _), 0) | (Op::Free(slot), 0) => *slot = value as usize,
            (Op::Realloc(Some(_), size), 1) => *size = value,
            _ => unreachable!("no number {field} in this operation"),
        }
    }
}

/// A replayable sequence: one list of operations per client thread, slots resolved.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Script {
    pub threads: Vec<Vec<Op>>,
}

impl Script {
    /// Number of operations in all threads.
    pub fn len(&self) -> usize {
        self.threads.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Parse the text form: one operation a line, `# ` comments, `thread` lines between
    /// the operations of different client threads.
    pub fn parse(text: &str) -> Result<Script, String> {
        let mut threads = vec![Vec::new()];
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if line == "thread" {
                if !threads.last().is_some_and(Vec::is_empty) {
                    threads.push(Vec::new());
                }
                continue;
            }
            let op = line.parse().map_err(|e| format!("line {}: {e}", n + 1))?;
            threads.last_mut().expect("one thread at least").push(op);
        }
        Ok(Script { threads })
    }
}

impl fmt::Display for Script {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, ops) in self.threads.iter().enumerate() {
            if i > 0 {
                writeln!(f, "thread")?;
            }
            for op in ops {
                writeln!(f, "{op}")?;
            }
        }
        Ok(())
    }
}

/// A broken rule, found by running a script.
#[derive(Debug, Clone)]
pub struct Finding {
    /// A short stable name: a [`Rule::name`], a [`crate::Bound::name`], or `trap`,
    /// `timeout`, `memory-limit`, `client`.
    pub rule: &'static str,
    pub message: String,
}

impl Finding {
    fn from_error(e: &Error) -> Finding {
        let rule = match e {
            Error::Violation(v) => v.rule.name(),
            Error::Trap { .. } => "trap",
            Error::Timeout { .. } => "timeout",
            Error::MemoryLimit { .. } => "memory-limit",
            Error::WorkLimit { bound, .. } => bound.name(),
            Error::Poisoned { cause, .. } => return Finding::from_error(cause),
            Error::Client(_) => "client",
        };
        Finding {
            rule,
            message: e.to_string(),
        }
    }

    fn checked(policy: &str, call: &str, addr: usize, size: u64, rule: Rule) -> Finding {
        Finding {
            rule: rule.name(),
            message: format!(
                "policy `{policy}` broke the contract in `{call}` at {addr:#x} ({size} bytes): {rule}"
            ),
        }
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
    /// Random sequences to run. Default 64.
    pub cases: u32,
    /// Most operations in one sequence (per thread). Default 128.
    pub max_ops: usize,
    /// Seed for a reproducible run; default a fixed seed (runs are deterministic unless
    /// a seed is given).
    pub seed: Option<u64>,
    /// Client threads calling one handler at once. Default 1.
    pub threads: usize,
    /// Bounds on the policy; default [`Limits::default`] with a 250 ms call limit.
    pub limits: Limits,
    /// Where failing seeds persist (`proptest-regressions/<policy>.txt`). Default none.
    pub regressions: Option<PathBuf>,
    /// Called after every finished case with (cases done, cases wanted).
    pub progress: Option<Arc<dyn Fn(u32, u32) + Send + Sync>>,
}

impl fmt::Debug for CheckOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckOptions")
            .field("cases", &self.cases)
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
            max_ops: 128,
            seed: None,
            threads: 1,
            limits: Limits {
                call_time: Duration::from_millis(250),
                ..Limits::default()
            },
            regressions: None,
            progress: None,
        }
    }
}

/// What a check run found.
#[derive(Debug, Clone)]
pub struct CheckReport {
    pub policy: String,
    /// Cases run, shrinking runs included.
    pub cases: u32,
    /// Operations run, shrinking runs included.
    pub ops: u64,
    pub elapsed: Duration,
    /// Upstream requests answered "none" for passing the policy's overhead budget
    /// ([`Limits::overhead`]), over every case.
    pub budget_refusals: u64,
    /// The first broken rule, with the shrunk script that shows it.
    pub failure: Option<(Finding, Script)>,
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

/// The size mix, in percent: NumPy's common small sizes dominate (72% of its mallocs
/// are 8-15 bytes); edges, pages, large blocks and sizes that must fail all appear in
/// most sequences.
fn draw_size(rng: &mut TestRng) -> u64 {
    const EDGES: [u64; 6] = [15, 16, 17, 63, 64, 65];
    const PAGES: [u64; 4] = [4095, 4096, 4097, 65536];
    const IMPOSSIBLE: [u64; 4] = [u64::MAX, u64::MAX - 15, 1 << 63, (1 << 62) + 3];
    match rng.random_range(0..100u32) {
        0..40 => rng.random_range(8..=15),
        40..65 => rng.random_range(1..=256),
        65..80 => rng.random_range(257..=4096),
        80..84 => 0,
        84..89 => EDGES[rng.random_range(0..EDGES.len())],
        89..94 => PAGES[rng.random_range(0..PAGES.len())],
        94..96 => rng.random_range(65537..=(2 << 20)),
        _ => IMPOSSIBLE[rng.random_range(0..IMPOSSIBLE.len())],
    }
}

/// `calloc` arguments: mostly small products, some zero counts, some that overflow.
fn draw_calloc(rng: &mut TestRng) -> Op {
    const ZERO: [(u64, u64); 3] = [(0, 8), (8, 0), (0, 0)];
    const OVERFLOW: [(u64, u64); 3] = [
        (u64::MAX / 2 + 1, 2),
        (1 << 32, 1 << 32),
        (u64::MAX, u64::MAX),
    ];
    let (n, e) = match rng.random_range(0..8u32) {
        0..6 => (rng.random_range(1..=64), rng.random_range(1..=64)),
        6 => ZERO[rng.random_range(0..ZERO.len())],
        _ => OVERFLOW[rng.random_range(0..OVERFLOW.len())],
    };
    Op::Calloc(n, e)
}

/// One operation: malloc 4, calloc 2, realloc 3 (a tenth of them from none), free 4.
fn draw_op(rng: &mut TestRng) -> Op {
    const SLOTS: usize = 64;
    match rng.random_range(0..13u32) {
        0..4 => Op::Malloc(draw_size(rng)),
        4..6 => draw_calloc(rng),
        6..9 => {
            let slot = rng.random_bool(0.9).then(|| rng.random_range(0..SLOTS));
            Op::Realloc(slot, draw_size(rng))
        }
        _ => Op::Free(rng.random_range(0..SLOTS)),
    }
}

/// Sequences of operations, one per client thread, drawn straight from the RNG.
///
/// proptest's `vec(prop_oneof![..])` builds a value tree per operation, and building
/// those cost more than running the operations; this strategy keeps plain operations
/// and shrinks them with [`ScriptTree`].
#[derive(Debug, Clone, Copy)]
struct Scripts {
    threads: usize,
    max_ops: usize,
}

impl Strategy for Scripts {
    type Tree = ScriptTree;
    type Value = Vec<Vec<Op>>;

    fn new_tree(&self, runner: &mut TestRunner) -> proptest::strategy::NewTree<Self> {
        let rng = runner.rng();
        let threads = (0..self.threads)
            .map(|_| {
                let len = rng.random_range(1..=self.max_ops);
                (0..len).map(|_| draw_op(rng)).collect()
            })
            .collect();
        Ok(ScriptTree::new(threads))
    }
}

/// Where shrinking has got to.
#[derive(Debug, Clone, Copy)]
enum Step {
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
enum Trial {
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
/// each number (size, count, slot) of the operations left by binary search.
///
/// Every `complicate` both takes back the trial that passed and puts up the next one, so
/// no run is spent on re-running a case already known to fail.
#[derive(Debug, Clone)]
struct ScriptTree {
    threads: Vec<Vec<Op>>,
    step: Step,
    trial: Option<Trial>,
}

impl ScriptTree {
    fn new(threads: Vec<Vec<Op>>) -> Self {
        let run = Self::first_run(&threads, 0);
        ScriptTree {
            threads,
            step: Step::Delete {
                thread: 0,
                run,
                at: 0,
            },
            trial: None,
        }
    }

    fn first_run(threads: &[Vec<Op>], thread: usize) -> usize {
        threads
            .get(thread)
            .map_or(1, |ops| ops.len().div_ceil(2).max(1))
    }

    /// Put up the next candidate; false when there is none left (the current script is
    /// then the smallest failing one found).
    fn next_trial(&mut self) -> bool {
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
                        self.step = Step::Done;
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
                    let was = op.clone();
                    op.set_number(*field, lo + (hi - lo) / 2);
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
    type Value = Vec<Vec<Op>>;

    fn current(&self) -> Vec<Vec<Op>> {
        self.threads.clone()
    }

    /// The current script failed: keep it and try a smaller one.
    fn simplify(&mut self) -> bool {
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

/// The period of the byte pattern written into every block: prime, so that a copy from
/// a wrong offset is seen unless the offset is a multiple of it.
const PERIOD: usize = 251;
/// Blocks are filled and compared in chunks of this many bytes (a multiple of PERIOD).
const CHUNK: usize = PERIOD * 64;

/// `PERIOD + CHUNK` bytes of the pattern; a block with phase `p` holds, from every chunk
/// boundary on, `template()[p..p + CHUNK]` — so fill and compare run at memcpy speed.
fn template() -> &'static [u8] {
    static TEMPLATE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TEMPLATE.get_or_init(|| {
        (0..PERIOD + CHUNK)
            .map(|i| (i % PERIOD) as u8 ^ 0xA5)
            .collect()
    })
}

struct Live {
    ptr: NonNull<u8>,
    size: usize,
    /// Where in the pattern this block starts (0..PERIOD), distinct from block to block.
    phase: usize,
}

impl Live {
    fn bytes(&self) -> &[u8] {
        // SAFETY: the block is live (lent by the handler, not yet freed by this model)
        // and `size` bytes long; only this model's thread touches it.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.size) }
    }

    fn expected(&self) -> &'static [u8] {
        &template()[self.phase..self.phase + CHUNK]
    }

    /// The byte ranges that hold the pattern: all of a block up to `SAMPLED_ABOVE`
    /// bytes; for larger ones the first and last 4 KiB and 64 probes of 64 bytes between.
    /// Writing every byte of a megabyte block page-faults every page and costs more
    /// than it finds; the probes still see a lost or shifted copy.
    fn ranges(size: usize) -> Vec<std::ops::Range<usize>> {
        const SAMPLED_ABOVE: usize = 64 << 10;
        const EDGE: usize = 4 << 10;
        if size <= SAMPLED_ABOVE {
            return std::iter::once(0..size).collect();
        }
        let mut ranges: Vec<_> = std::iter::once(0..EDGE).collect();
        let step = (size - 2 * EDGE) / 65;
        ranges.extend((1..=64).map(|k| EDGE + k * step..EDGE + k * step + 64));
        ranges.push(size - EDGE..size);
        ranges
    }

    fn fill(&mut self, phase: usize) {
        self.phase = phase % PERIOD;
        let expected = self.expected();
        // SAFETY: as in `bytes`; writing through the block's own pointer.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.size) };
        for range in Self::ranges(self.size) {
            for (k, chunk) in bytes[range.clone()].chunks_mut(CHUNK).enumerate() {
                let from = (range.start + k * CHUNK) % PERIOD;
                chunk.copy_from_slice(&expected_at(expected, from)[..chunk.len()]);
            }
        }
    }

    /// The first offset below `len` that does not hold the pattern this block was
    /// filled with (`filled` is the size it had then).
    fn first_changed_as(&self, filled: usize, len: usize) -> Option<usize> {
        let bytes = &self.bytes()[..len.min(self.size)];
        let expected = self.expected();
        Self::ranges(filled).into_iter().find_map(|range| {
            let range = range.start.min(bytes.len())..range.end.min(bytes.len());
            bytes[range.clone()]
                .chunks(CHUNK)
                .enumerate()
                .find_map(|(k, chunk)| {
                    let start = range.start + k * CHUNK;
                    let want = &expected_at(expected, start % PERIOD)[..chunk.len()];
                    (chunk != want).then(|| {
                        start
                            + chunk
                                .iter()
                                .zip(want)
                                .position(|(a, b)| a != b)
                                .expect("differs")
                    })
                })
        })
    }

    /// The first offset below `len` that does not hold the pattern.
    fn first_changed(&self, len: usize) -> Option<usize> {
        self.first_changed_as(self.size, len)
    }

    /// A cheap look after every call: the first and last 16 bytes.
    fn first_changed_sparse(&self) -> Option<usize> {
        let bytes = self.bytes();
        let expected = self.expected();
        (0..self.size.min(16))
            .chain(self.size.saturating_sub(16)..self.size)
            .find(|&i| bytes[i] != expected[i % PERIOD])
    }
}

/// The pattern as it runs from offset `from` (mod PERIOD) of a block on: `CHUNK` bytes.
fn expected_at(expected: &'static [u8], from: usize) -> &'static [u8] {
    // `expected` starts at the block's phase; the template is PERIOD + CHUNK long and
    // periodic, so starting `from` further in is another window of it.
    let base = expected.as_ptr() as usize - template().as_ptr() as usize;
    &template()[(base + from) % PERIOD..][..CHUNK]
}

/// Runs one client's operations against a handler and checks every answer.
struct Client<'h> {
    handler: &'h Handler,
    live: Vec<Live>,
    next_phase: usize,
    /// Where the rotating look at live blocks goes on from.
    next_look: usize,
    ran: Vec<Op>,
}

// SAFETY: the raw block pointers are owned by this client alone (each thread has its own
// `Client` and its own blocks); the handler is Sync.
unsafe impl Send for Client<'_> {}

impl<'h> Client<'h> {
    fn new(handler: &'h Handler, thread: usize) -> Self {
        Client {
            handler,
            live: Vec::new(),
            next_phase: thread * 67,
            next_look: 0,
            ran: Vec::new(),
        }
    }

    /// A new phase for the next block, so neighbouring blocks hold different bytes.
    fn phase(&mut self) -> usize {
        self.next_phase = (self.next_phase + 37) % PERIOD;
        self.next_phase
    }

    fn policy(&self) -> &str {
        self.handler.name()
    }

    fn lost(&self, call: &str, live: &Live, offset: usize, rule: fn(u64) -> Rule) -> Finding {
        Finding::checked(
            self.policy(),
            call,
            live.ptr.as_ptr() as usize,
            live.size as u64,
            rule(offset as u64),
        )
    }

    /// Track a block the handler just lent, filled with a pattern of its own.
    fn adopt(&mut self, ptr: NonNull<u8>, size: usize) {
        let mut block = Live {
            ptr,
            size,
            phase: 0,
        };
        let phase = self.phase();
        block.fill(phase);
        self.live.push(block);
    }

    fn run(&mut self, op: &Op) -> Result<(), Finding> {
        let h = self.handler;
        let err = |e: Error| Finding::from_error(&e);
        match *op {
            Op::Malloc(size) => {
                self.ran.push(op.clone());
                if let Some(ptr) = h.malloc(size as usize).map_err(err)? {
                    self.adopt(ptr, size as usize);
                }
            }
            Op::Calloc(n, e) => {
                self.ran.push(op.clone());
                if let Some(ptr) = h.calloc(n as usize, e as usize).map_err(err)? {
                    let size = n.checked_mul(e).expect("an overflowing calloc is none") as usize;
                    let block = Live {
                        ptr,
                        size,
                        phase: 0,
                    };
                    if let Some(at) = block.bytes().iter().position(|&b| b != 0) {
                        return Err(self.lost("calloc", &block, at, |offset| {
                            Rule::CallocNotZeroed { offset }
                        }));
                    }
                    self.adopt(ptr, size);
                }
            }
            Op::Realloc(slot, size) => {
                let Some(slot) = slot.filter(|_| !self.live.is_empty()) else {
                    self.ran.push(Op::Realloc(None, size));
                    if let Some(ptr) = h.realloc(None, size as usize).map_err(err)? {
                        self.adopt(ptr, size as usize);
                    }
                    return self.look_around();
                };
                let slot = slot % self.live.len();
                self.ran.push(Op::Realloc(Some(slot), size));
                let old = &self.live[slot];
                let (old_ptr, old_size) = (old.ptr, old.size);
                match h.realloc(Some(old_ptr), size as usize).map_err(err)? {
                    None => {
                        if let Some(at) = old.first_changed(old_size) {
                            return Err(self.lost("realloc", old, at, |offset| {
                                Rule::LiveBlockChanged { offset }
                            }));
                        }
                    }
                    Some(ptr) => {
                        let moved = Live {
                            ptr,
                            size: size as usize,
                            phase: old.phase,
                        };
                        if let Some(at) = moved.first_changed_as(old_size, old_size) {
                            return Err(self.lost("realloc", &moved, at, |offset| {
                                Rule::ReallocLostBytes { offset }
                            }));
                        }
                        self.live[slot] = moved;
                        let phase = self.phase();
                        self.live[slot].fill(phase);
                    }
                }
            }
            Op::Free(slot) => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let slot = slot % self.live.len();
                self.ran.push(Op::Free(slot));
                self.free_slot(slot)?;
            }
        }
        self.look_around()
    }

    fn free_slot(&mut self, slot: usize) -> Result<(), Finding> {
        let block = &self.live[slot];
        if let Some(at) = block.first_changed(block.size) {
            return Err(
                self.lost("free", block, at, |offset| Rule::LiveBlockChanged {
                    offset,
                }),
            );
        }
        let block = self.live.remove(slot);
        self.handler
            .free(Some(block.ptr), block.size)
            .map_err(|e| Finding::from_error(&e))
    }

    /// After every call, a sparse look at a few live blocks in turn, so the cost per
    /// call stays flat however many blocks are live; every block is compared in full
    /// when it is freed or reallocated, and at the end of the sequence.
    fn look_around(&mut self) -> Result<(), Finding> {
        const BLOCKS_PER_CALL: usize = 4;
        for _ in 0..BLOCKS_PER_CALL.min(self.live.len()) {
            self.next_look = (self.next_look + 1) % self.live.len();
            let block = &self.live[self.next_look];
            if let Some(at) = block.first_changed_sparse() {
                return Err(
                    self.lost("(any call)", block, at, |offset| Rule::LiveBlockChanged {
                        offset,
                    }),
                );
            }
        }
        Ok(())
    }

    /// Free every live block, oldest first.
    fn free_all(&mut self) -> Result<(), Finding> {
        while !self.live.is_empty() {
            self.free_slot(0)?;
        }
        Ok(())
    }
}

/// Everything needed to start a fresh handler for one case.
struct Subject<'a> {
    runtime: &'a Runtime,
    policy: &'a Policy,
    config: &'a [(&'a str, &'a str)],
    limits: &'a Limits,
    /// Summed over the cases run.
    budget_refusals: AtomicU64,
}

impl Subject<'_> {
    fn start(&self) -> Result<Handler, LoadError> {
        HandlerBuilder::new(self.runtime)
            .link_with(self.policy, self.config)
            .limits(self.limits.clone())
            .build()
    }

    /// Run `threads` (one op list per client thread), then free everything, trim, and
    /// look for leaks. Returns the resolved script and the first finding.
    fn run(&self, threads: &[Vec<Op>]) -> (Script, Option<Finding>) {
        let handler = match self.start() {
            Ok(h) => h,
            Err(e) => {
                let finding = Finding {
                    rule: "start",
                    message: e.to_string(),
                };
                return (Script::default(), Some(finding));
            }
        };
        let results: Vec<(Vec<Op>, Option<Finding>)> = if threads.len() == 1 {
            vec![run_client(&handler, 0, &threads[0])]
        } else {
            std::thread::scope(|s| {
                let running: Vec<_> = threads
                    .iter()
                    .enumerate()
                    .map(|(t, ops)| {
                        let handler = &handler;
                        s.spawn(move || run_client(handler, t, ops))
                    })
                    .collect();
                running
                    .into_iter()
                    .map(|t| t.join().expect("client thread"))
                    .collect()
            })
        };
        let mut script = Script::default();
        let mut finding = None;
        for (ops, found) in results {
            script.threads.push(ops);
            finding = finding.or(found);
        }
        if finding.is_none() {
            finding = leak_check(&handler);
        }
        self.budget_refusals
            .fetch_add(handler.stats().budget_refusals, Ordering::Relaxed);
        (script, finding)
    }
}

fn run_client(handler: &Handler, thread: usize, ops: &[Op]) -> (Vec<Op>, Option<Finding>) {
    let mut client = Client::new(handler, thread);
    let mut finding = None;
    for op in ops {
        if let Err(f) = client.run(op) {
            finding = Some(f);
            break;
        }
    }
    if finding.is_none() {
        finding = client.free_all().err();
    }
    // After a failure the rest are released host-side, so nothing leaks here either.
    let _ = client.free_all();
    (client.ran, finding)
}

fn leak_check(handler: &Handler) -> Option<Finding> {
    handler.leak_check().err().map(|e| Finding::from_error(&e))
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
    let pooled = Runtime::pooled(POOL_INSTANCES, options.limits.memory)
        .ok()
        .and_then(|pool| Some((pool.adopt(policy).ok()?, pool)));
    let (runtime, policy) = match &pooled {
        Some((policy, pool)) => (pool, policy),
        None => (runtime, policy),
    };
    let subject = Subject {
        runtime,
        policy,
        config,
        limits: &options.limits,
        budget_refusals: AtomicU64::new(0),
    };
    let name = subject.start()?.name().to_string();

    let mut proptest_config = Config {
        cases: options.cases,
        max_shrink_iters: 2048,
        failure_persistence: None,
        ..Config::default()
    };
    if let Some(dir) = &options.regressions {
        let file = dir.join(format!("{name}.txt"));
        // proptest wants a 'static path; one small string per distinct path is kept.
        let file: &'static str = Box::leak(file.display().to_string().into_boxed_str());
        proptest_config.failure_persistence = Some(Box::new(FileFailurePersistence::Direct(file)));
    }
    let seed = options.seed.unwrap_or(0x5EED_A110_CB0C);
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes);
    let mut runner = TestRunner::new_with_rng(proptest_config, rng);

    let threads = options.threads.max(1);
    let strategy = Scripts {
        threads,
        max_ops: options.max_ops.max(1),
    };
    let cases = AtomicU64::new(0);
    let ops = AtomicU64::new(0);
    let start = Instant::now();
    let outcome = runner.run(&strategy, |threads| {
        let (script, finding) = subject.run(&threads);
        ops.fetch_add(script.len() as u64, Ordering::Relaxed);
        let done = cases.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(progress) = &options.progress {
            progress(done.min(u64::from(options.cases)) as u32, options.cases);
        }
        match finding {
            None => Ok(()),
            Some(f) => Err(TestCaseError::fail(f.to_string())),
        }
    });
    let failure = match outcome {
        Ok(()) => None,
        Err(TestError::Fail(_, minimal)) => {
            // Run the minimal case once more for its resolved script and finding.
            let (script, finding) = subject.run(&minimal);
            let finding = finding.unwrap_or_else(|| Finding {
                rule: "flaky",
                message: "the shrunk case passed when run again (threads?)".into(),
            });
            Some((finding, script))
        }
        Err(TestError::Abort(reason)) => Some((
            Finding {
                rule: "aborted",
                message: reason.to_string(),
            },
            Script::default(),
        )),
    };
    Ok(CheckReport {
        policy: name,
        cases: cases.into_inner() as u32,
        ops: ops.into_inner(),
        elapsed: start.elapsed(),
        budget_refusals: subject.budget_refusals.into_inner(),
        failure,
    })
}

/// Run a script exactly, with every check on. `Ok(None)`: every rule held.
pub fn replay(
    runtime: &Runtime,
    policy: &Policy,
    config: &[(&str, &str)],
    script: &Script,
    limits: &Limits,
) -> Result<Option<Finding>, LoadError> {
    let subject = Subject {
        runtime,
        policy,
        config,
        limits,
        budget_refusals: AtomicU64::new(0),
    };
    subject.start()?;
    // Threads run one after the other so that a replay is exact.
    let mut finding = None;
    for ops in &script.threads {
        let (_, found) = subject.run(std::slice::from_ref(ops));
        if found.is_some() {
            finding = found;
            break;
        }
    }
    Ok(finding)
}

/// For a policy author's `#[test]`: check the component at `path` with the default
/// options and panic with the broken rule and the shrunk script if any rule breaks.
pub fn assert_contract(path: impl AsRef<Path>, config: &[(&str, &str)]) {
    let runtime = Runtime::shared();
    let path = path.as_ref();
    let policy = runtime
        .load_file(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let options = CheckOptions {
        regressions: Some(PathBuf::from("proptest-regressions")),
        ..CheckOptions::default()
    };
    let report = check(runtime, &policy, config, &options).unwrap_or_else(|e| panic!("{e}"));
    if let Some((finding, script)) = report.failure {
        panic!(
            "{finding}\nshrunk script ({} operations):\n{script}",
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
        };
        match runner.run(&strategy, |script| {
            if fails(&script) {
                Err(TestCaseError::fail("predicate"))
            } else {
                Ok(())
            }
        }) {
            Err(TestError::Fail(_, minimal)) => minimal,
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn shrinking_keeps_only_the_guilty_operations_at_their_smallest_numbers() {
        // Fails when a malloc of at least 100 bytes is followed by any free.
        let found = minimal(1, |t| {
            let ops = &t[0];
            ops.iter().enumerate().any(|(i, op)| {
                matches!(op, Op::Malloc(s) if *s >= 100)
                    && ops[i + 1..].iter().any(|o| matches!(o, Op::Free(_)))
            })
        });
        assert_eq!(found, vec![vec![Op::Malloc(100), Op::Free(0)]]);
    }

    #[test]
    fn shrinking_empties_the_threads_that_do_not_matter() {
        let found = minimal(2, |t| {
            t[1].iter()
                .any(|op| matches!(op, Op::Calloc(n, _) if *n >= 3))
        });
        assert_eq!(found, vec![vec![], vec![Op::Calloc(3, 0)]]);
    }

    #[test]
    fn a_script_survives_its_text_form() {
        let script = Script {
            threads: vec![
                vec![Op::Malloc(8), Op::Realloc(Some(0), 4096), Op::Free(0)],
                vec![Op::Calloc(u64::MAX, 2), Op::Realloc(None, 0)],
            ],
        };
        assert_eq!(Script::parse(&script.to_string()).unwrap(), script);
    }
}
