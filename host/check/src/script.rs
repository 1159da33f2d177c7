//! The text form of a check case: client operations and scripts of them, one thread
//! per section, that `allocbox replay` reads back. Besides the client's calls a script
//! says which way the host asked the policy (`magazines`, `per-call` or `per-thread`)
//! and what the
//! checker's upstream does: its seed, and where it runs out of memory (`oom` lines).

use std::fmt;

/// What each line of a script means: `allocbox replay --help` prints it, and the
/// README has the same table.
pub const SCRIPT_NOTATION: &str = "\
A script has one line each (`#` starts a comment, on its own line or after an operation,
where the checker notes what the numbers do not show: `# 2^32 - 15`):
  policy PATH             the policy the check ran (one named on the command line goes first)
  digest HEX              the SHA-256 of its binary: a replay of another binary says so
  config KEY=VALUE        a setting the policy was started with (a line each)
  grant KINDS             the kinds of memory the check granted, comma-separated
  limit NAME N            a bound the check ran under that is not the default: call-work,
                          guest-memory, overhead or batch
  upstream seed N         the seed the checker's upstream places blocks by (first; 0 if absent)
  magazines | per-call    how the host asked a policy that batches: small requests served
                          from its per-thread magazines (the default), or every call asked
  per-thread              every call asked, of an instance per client thread (a policy
                          that says its state is per instance)
  magazines N             through magazines of at most N blocks each (64 unless said): the
                          checker's shallower ones batch less and more often
  bN = malloc SIZE        make the block named bN
  bN = calloc NELEM ELSIZE
  bN = realloc - SIZE     realloc from no block (`-` is no pointer): makes bN
  realloc bN SIZE         resize bN, which keeps its name
  free bN                 free bN with its size
  pass bN                 hand bN to the next client thread, which frees it (the last
                          thread's go to the first)
  trim                    ask every policy of the chain to give back what it caches
  oom next                the upstream refuses the next request a policy makes
  oom after N             in the next operation that makes more than N upstream requests,
                          the one after the first N is refused (part way through a batch
                          when N > 0)
  oom every N             from here on, every Nth request of the case is refused
  oom above SIZE          from here on, every request for more than SIZE bytes is refused
  tN LINE                 with several client threads: LINE ran on thread N, in the order
                          the handler saw them (or each thread's lines after a `thread` line)
After the last line the checker frees every block still live, trims, and looks for leaks.
An operation on a block that is not live is a mistake in a script, refused with its line.";

/// Names a block in a script. The operation that makes a block names it (`b3 = malloc
/// 64`); later operations use the name (`free b3`). Deleting an operation therefore
/// never changes which block another one means: an operation on a block that was never
/// made (or is already gone) is skipped, so every sequence is valid.
pub type BlockId = u32;

/// One client operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `bN = malloc SIZE`
    Malloc { block: BlockId, size: u64 },
    /// `bN = calloc NELEM ELSIZE`
    Calloc {
        block: BlockId,
        nelem: u64,
        elsize: u64,
    },
    /// `bN = realloc - SIZE`: realloc from none, which makes a block.
    ReallocNew { block: BlockId, size: u64 },
    /// `realloc bN SIZE`: resize a live block, which keeps its name.
    Realloc { block: BlockId, size: u64 },
    /// `free bN`
    Free { block: BlockId },
    /// `pass bN`: hand the block to the next client thread, which checks and frees it
    /// before its next operation: a free from a thread that did not make the block.
    Pass { block: BlockId },
    /// `trim`: ask every policy of the chain to give back what it caches; a policy must
    /// stay correct across it at any point of its life, not only once everything is
    /// freed.
    Trim,
    /// `oom after N`: in the next operation that makes more than `N` upstream requests,
    /// the upstream lets `N` through and refuses the one after, whatever it is: with `N`
    /// past 0, one block part way through a batch a magazine's refill asks for. `oom
    /// next` (`oom after 0`) refuses the next request.
    OomAfter { requests: u64 },
    /// `oom every N`: from here on the upstream refuses every `N`th request, counting
    /// from the first of the case.
    OomEvery { n: u64 },
    /// `oom above SIZE`: from here on the upstream refuses every request for more than
    /// `SIZE` bytes.
    OomAbove { size: u64 },
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Op::Malloc { block, size } => write!(f, "b{block} = malloc {size}"),
            Op::Calloc {
                block,
                nelem,
                elsize,
            } => write!(f, "b{block} = calloc {nelem} {elsize}"),
            Op::ReallocNew { block, size } => write!(f, "b{block} = realloc - {size}"),
            Op::Realloc { block, size } => write!(f, "realloc b{block} {size}"),
            Op::Free { block } => write!(f, "free b{block}"),
            Op::Pass { block } => write!(f, "pass b{block}"),
            Op::Trim => write!(f, "trim"),
            Op::OomAfter { requests: 0 } => write!(f, "oom next"),
            Op::OomAfter { requests } => write!(f, "oom after {requests}"),
            Op::OomEvery { n } => write!(f, "oom every {n}"),
            Op::OomAbove { size } => write!(f, "oom above {size}"),
        }
    }
}

impl Op {
    /// What a reader of the script would not see from the numbers: a request of 0 bytes
    /// reaches the policy as 1 (C7), and a size near a power of two past 2^31 is where
    /// 32- or 64-bit arithmetic wraps (`  # 2^32 - 15`). Empty for the rest.
    fn note(&self) -> String {
        let size = match *self {
            Op::Malloc { size, .. } | Op::ReallocNew { size, .. } | Op::Realloc { size, .. } => {
                size
            }
            Op::Calloc { nelem, elsize, .. } => match nelem.checked_mul(elsize) {
                Some(size) => size,
                None => return "  # nelem * elsize overflows: calloc must answer none".into(),
            },
            _ => return String::new(),
        };
        if size == 0 {
            return "  # the policy is asked for 1 byte: a request of 0 is 1".into();
        }
        near_a_power_of_two(size).map_or(String::new(), |near| format!("  # {near}"))
    }
}

/// `size` as `2^N`, `2^N - D` or `2^N + D` when it lies within a page of a power of two
/// from 2^31 up (where 32- and 64-bit size arithmetic wraps).
fn near_a_power_of_two(size: u64) -> Option<String> {
    const NEAR: u64 = 4096;
    (31..=64u32).find_map(|power| {
        let at = 1u128 << power;
        let size = u128::from(size);
        match size.cmp(&at) {
            std::cmp::Ordering::Equal => Some(format!("2^{power}")),
            std::cmp::Ordering::Less if at - size <= u128::from(NEAR) => {
                Some(format!("2^{power} - {}", at - size))
            }
            std::cmp::Ordering::Greater if size - at <= u128::from(NEAR) => {
                Some(format!("2^{power} + {}", size - at))
            }
            _ => None,
        }
    })
}

impl std::str::FromStr for Op {
    type Err = String;

    fn from_str(line: &str) -> Result<Op, String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |w: &str| w.parse::<u64>().map_err(|e| format!("`{w}`: {e}"));
        let name = |w: &str| {
            w.strip_prefix('b')
                .ok_or_else(|| format!("`{w}`: a block is written bN"))?
                .parse::<BlockId>()
                .map_err(|e| format!("`{w}`: {e}"))
        };
        match words.as_slice() {
            [b, "=", "malloc", size] => Ok(Op::Malloc {
                block: name(b)?,
                size: num(size)?,
            }),
            [b, "=", "calloc", n, e] => Ok(Op::Calloc {
                block: name(b)?,
                nelem: num(n)?,
                elsize: num(e)?,
            }),
            [b, "=", "realloc", "-", size] => Ok(Op::ReallocNew {
                block: name(b)?,
                size: num(size)?,
            }),
            ["realloc", b, size] => Ok(Op::Realloc {
                block: name(b)?,
                size: num(size)?,
            }),
            ["free", b] => Ok(Op::Free { block: name(b)? }),
            ["pass", b] => Ok(Op::Pass { block: name(b)? }),
            ["trim"] => Ok(Op::Trim),
            ["oom", "next"] => Ok(Op::OomAfter { requests: 0 }),
            ["oom", "after", n] => Ok(Op::OomAfter { requests: num(n)? }),
            ["oom", "every", n] => Ok(Op::OomEvery { n: num(n)? }),
            ["oom", "above", size] => Ok(Op::OomAbove { size: num(size)? }),
            _ => Err(format!("not an operation: `{line}`")),
        }
    }
}

impl Op {
    /// The `field`th number of the operation (sizes and counts, never block names), for
    /// shrinking.
    pub(super) fn number(&self, field: usize) -> Option<u64> {
        match (*self, field) {
            (Op::Malloc { size, .. }, 0)
            | (Op::ReallocNew { size, .. }, 0)
            | (Op::Realloc { size, .. }, 0)
            | (Op::OomAbove { size }, 0) => Some(size),
            (Op::OomEvery { n }, 0) | (Op::OomAfter { requests: n }, 0) => Some(n),
            (Op::Calloc { nelem, .. }, 0) => Some(nelem),
            (Op::Calloc { elsize, .. }, 1) => Some(elsize),
            _ => None,
        }
    }

    /// The block the operation makes or names, if any.
    pub(super) fn block_mut(&mut self) -> Option<&mut BlockId> {
        match self {
            Op::Malloc { block, .. }
            | Op::Calloc { block, .. }
            | Op::ReallocNew { block, .. }
            | Op::Realloc { block, .. }
            | Op::Free { block }
            | Op::Pass { block } => Some(block),
            Op::Trim | Op::OomAfter { .. } | Op::OomEvery { .. } | Op::OomAbove { .. } => None,
        }
    }

    /// Set the `field`th number; a field the operation does not have is left alone.
    pub(super) fn set_number(&mut self, field: usize, value: u64) {
        match (self, field) {
            (Op::Malloc { size, .. }, 0)
            | (Op::ReallocNew { size, .. }, 0)
            | (Op::Realloc { size, .. }, 0)
            | (Op::OomAbove { size }, 0) => *size = value,
            (Op::OomEvery { n }, 0) | (Op::OomAfter { requests: n }, 0) => *n = value,
            (Op::Calloc { nelem, .. }, 0) => *nelem = value,
            (Op::Calloc { elsize, .. }, 1) => *elsize = value,
            _ => {}
        }
    }
}

/// Which way the host asks a policy that declares `batch` (or observes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CallPath {
    /// `magazines`: the production path. Small requests are served from the host's
    /// per-thread magazines, which the policy refills with `malloc-many` and takes back
    /// with `free-many`; the rest are asked of the policy one call at a time.
    #[default]
    Magazines,
    /// `per-call`: every request is asked of the policy, as an embedder that turns
    /// batching off asks it, so its own `malloc`, `calloc`, `realloc` and `free` of
    /// small blocks run. A policy that does not batch is always asked this way.
    PerCall,
    /// `per-thread`: every request asked, of an instance of its own per client thread
    /// ([`allocbox::HandlerBuilder::build_sharded`]), for a policy that says its state
    /// is per instance; blocks passed between threads go back to their maker.
    PerThread,
}

/// One drawn case, before it runs: which way the host asks the policy, and each client
/// thread's operations (the strategy draws it, shrinking makes it smaller, the runner
/// runs it into a [`Script`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Case {
    pub(super) path: CallPath,
    /// Through the magazines: the most blocks one holds, when shallower than the
    /// host's own.
    pub(super) magazine_depth: Option<u8>,
    pub(super) threads: Vec<Vec<Op>>,
}

impl CallPath {
    fn word(self) -> &'static str {
        match self {
            CallPath::Magazines => "magazines",
            CallPath::PerCall => "per-call",
            CallPath::PerThread => "per-thread",
        }
    }
}

/// A replayable sequence: one list of operations per client thread (each thread names
/// its own blocks).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Script {
    pub threads: Vec<Vec<Op>>,
    /// The order the operations of several threads reached the handler in: the thread
    /// of each operation, in turn. Empty when no order was recorded (one thread, or a
    /// script written with `thread` sections).
    pub order: Vec<usize>,
    /// The seed of the checker's upstream ([`allocbox::Adversary`]), which places every
    /// block: written `upstream seed N`, first; a script without the line ran with 0.
    pub upstream_seed: u64,
    /// Written `magazines`, `per-call` or `per-thread`, before the operations; a script
    /// without the line ran through the magazines.
    pub path: CallPath,
    /// Written `magazines N`: the host's magazines held at most N blocks each, not the
    /// 64 they hold in production.
    pub magazine_depth: Option<u8>,
    /// What the check ran, so that `allocbox replay SCRIPT` alone runs it again the
    /// same way (boxed: a script is passed by value through every case).
    pub ran: Box<RanWith>,
}

/// What a check ran a script's policy with: written `policy PATH` (the file, as the
/// check was given it), `digest HEX` (the SHA-256 of its binary, so a replay of a
/// changed file says so), each `config KEY=VALUE` the policy was started with, `grant
/// KINDS`, and `limit NAME N` for each bound not at its default (`call-work`,
/// `guest-memory`, `overhead`, `batch`). A script without them ran the policy the
/// command line names, unconfigured, granted nothing, within the default bounds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RanWith {
    pub policy: Option<String>,
    pub digest: Option<String>,
    pub config: Vec<(String, String)>,
    pub grants: Vec<String>,
    pub limits: Vec<(ScriptLimit, u64)>,
}

/// A bound of [`allocbox::Limits`] a script records (`limit NAME N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptLimit {
    CallWork,
    GuestMemory,
    Overhead,
    Batch,
}

impl ScriptLimit {
    pub const ALL: [ScriptLimit; 4] = [
        ScriptLimit::CallWork,
        ScriptLimit::GuestMemory,
        ScriptLimit::Overhead,
        ScriptLimit::Batch,
    ];

    /// Its name in a script: the command line's option without `--` (`batch-limit`'s
    /// is `batch`).
    pub fn name(self) -> &'static str {
        match self {
            ScriptLimit::CallWork => "call-work",
            ScriptLimit::GuestMemory => "guest-memory",
            ScriptLimit::Overhead => "overhead",
            ScriptLimit::Batch => "batch",
        }
    }

    /// Its value in `limits`.
    pub fn of(self, limits: &allocbox::Limits) -> u64 {
        match self {
            ScriptLimit::CallWork => limits.call_work,
            ScriptLimit::GuestMemory => limits.memory,
            ScriptLimit::Overhead => limits.overhead,
            ScriptLimit::Batch => limits.batch.into(),
        }
    }

    /// `limits` with this bound set to `value` (a batch past `u32` is the most there is).
    pub fn set(self, limits: &mut allocbox::Limits, value: u64) {
        match self {
            ScriptLimit::CallWork => limits.call_work = value,
            ScriptLimit::GuestMemory => limits.memory = value,
            ScriptLimit::Overhead => limits.overhead = value,
            ScriptLimit::Batch => limits.batch = u32::try_from(value).unwrap_or(u32::MAX),
        }
    }
}

impl RanWith {
    /// What `limits` holds of the bounds a script records, each that is not at its
    /// default.
    pub fn record_limits(&mut self, limits: &allocbox::Limits) {
        let defaults = allocbox::Limits::default();
        self.limits = ScriptLimit::ALL
            .into_iter()
            .filter(|b| b.of(limits) != b.of(&defaults))
            .map(|b| (b, b.of(limits)))
            .collect();
    }
}

impl Script {
    /// Number of operations in all threads.
    pub fn len(&self) -> usize {
        self.threads.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The same script with each thread's blocks named b0, b1, ... in the order they
    /// first appear: what a shrunk script prints.
    pub fn with_names_in_order(mut self) -> Script {
        for ops in &mut self.threads {
            let mut names = std::collections::HashMap::new();
            for block in ops.iter_mut().filter_map(Op::block_mut) {
                let next = names.len() as BlockId;
                *block = *names.entry(*block).or_insert(next);
            }
        }
        self
    }

    /// Parse the text form: one operation a line, `# ` comments. Several client threads
    /// are written either interleaved, each line led by its thread (`t1 free b0`, in the
    /// order the handler saw them), or in sections separated by `thread` lines.
    pub fn parse(text: &str) -> Result<Script, String> {
        let mut script = Script {
            threads: vec![Vec::new()],
            ..Script::default()
        };
        let mut sections = false;
        // Every operation with its line and thread, for `check_blocks`.
        let mut lines = Vec::new();
        for (n, line) in text.lines().enumerate() {
            // A `#` starts a comment: a whole line, or a note after an operation
            // (` # `, a space each side: `free #0` is a mistake to name, not a note).
            let line = line.trim();
            let line = match line.starts_with('#') {
                true => "",
                false => line.split_once(" # ").map_or(line, |(op, _)| op).trim(),
            };
            let at = |e: String| format!("line {}: {e}", n + 1);
            if line.is_empty() {
                continue;
            }
            if let Some(path) = line.strip_prefix("policy ") {
                let path = path.trim();
                if path.is_empty() {
                    return Err(at("`policy` names the policy's file: `policy PATH`".into()));
                }
                script.ran.policy = Some(path.to_string());
                continue;
            }
            if let Some(digest) = line.strip_prefix("digest ") {
                let digest = digest.trim();
                if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(at(format!(
                        "`digest {digest}`: a digest is the policy's SHA-256, 64 hex digits"
                    )));
                }
                script.ran.digest = Some(digest.to_ascii_lowercase());
                continue;
            }
            if let Some(limit) = line.strip_prefix("limit ") {
                let (name, value) = limit.trim().split_once(' ').unwrap_or((limit.trim(), ""));
                let bound = ScriptLimit::ALL
                    .into_iter()
                    .find(|b| b.name() == name)
                    .ok_or_else(|| {
                        let names: Vec<&str> = ScriptLimit::ALL.iter().map(|b| b.name()).collect();
                        at(format!(
                            "`limit {}`: a limit is one of {} and a whole number",
                            limit.trim(),
                            names.join(", ")
                        ))
                    })?;
                let value = value.trim().parse().map_err(|_| {
                    at(format!(
                        "`limit {}`: `{}` is not a whole number",
                        limit.trim(),
                        value.trim()
                    ))
                })?;
                script.ran.limits.retain(|(b, _)| *b != bound);
                script.ran.limits.push((bound, value));
                continue;
            }
            if let Some(setting) = line.strip_prefix("config ") {
                let (key, value) = setting
                    .trim()
                    .split_once('=')
                    .ok_or_else(|| at(format!("`config {setting}`: a setting is KEY=VALUE")))?;
                script.ran.config.push((key.to_string(), value.to_string()));
                continue;
            }
            if let Some(kinds) = line.strip_prefix("grant ") {
                for kind in kinds.split(',').map(str::trim) {
                    if kind.is_empty() {
                        return Err(at(format!(
                            "`grant {}`: a grant names kinds of memory, comma-separated",
                            kinds.trim()
                        )));
                    }
                    script.ran.grants.push(kind.to_string());
                }
                continue;
            }
            if let Some(seed) = line.strip_prefix("upstream seed ") {
                script.upstream_seed = seed
                    .trim()
                    .parse()
                    .map_err(|e| at(format!("`{seed}`: {e}")))?;
                continue;
            }
            if let Some(depth) = line.strip_prefix("magazines ") {
                script.path = CallPath::Magazines;
                script.magazine_depth = Some(
                    depth
                        .trim()
                        .parse()
                        .ok()
                        .filter(|&d| d > 0)
                        .ok_or_else(|| {
                            at(format!(
                                "`magazines {depth}`: the most blocks a magazine holds, 1 to 64"
                            ))
                        })?,
                );
                continue;
            }
            if let Some(path) = [CallPath::Magazines, CallPath::PerCall, CallPath::PerThread]
                .into_iter()
                .find(|path| line == path.word())
            {
                script.path = path;
                continue;
            }
            if line == "thread" {
                sections = true;
                if !script.threads.last().is_some_and(Vec::is_empty) {
                    script.threads.push(Vec::new());
                }
                continue;
            }
            let thread = line
                .split_once(' ')
                .and_then(|(t, _)| t.strip_prefix('t')?.parse::<usize>().ok());
            let Some(thread) = thread else {
                if !script.order.is_empty() {
                    return Err(at(
                        "interleaved lines (`tN ...`) cannot mix with others".into()
                    ));
                }
                let op = line.parse().map_err(at)?;
                lines.push((n + 1, script.threads.len() - 1, op));
                script
                    .threads
                    .last_mut()
                    .expect("one thread at least")
                    .push(op);
                continue;
            };
            if sections || (script.order.is_empty() && !script.threads[0].is_empty()) {
                return Err(at(
                    "interleaved lines (`tN ...`) cannot mix with others".into()
                ));
            }
            if thread >= MAX_THREADS {
                return Err(at(format!(
                    "thread {thread}: at most {MAX_THREADS} threads"
                )));
            }
            let op = line
                .split_once(' ')
                .expect("checked above")
                .1
                .parse()
                .map_err(at)?;
            if script.threads.len() <= thread {
                script.threads.resize_with(thread + 1, Vec::new);
            }
            lines.push((n + 1, thread, op));
            script.threads[thread].push(op);
            script.order.push(thread);
        }
        check_blocks(&lines)?;
        Ok(script)
    }
}

/// Each block an operation names was made earlier on its thread and not freed since: a
/// user's script that says otherwise has a mistake, which this names with its line.
/// (Scripts the checker prints always pass: it records only operations on live blocks.)
fn check_blocks(ops: &[(usize, usize, Op)]) -> Result<(), String> {
    use std::collections::HashMap;
    // Per thread: each block's state, and the line that made it so.
    let mut blocks: HashMap<(usize, BlockId), (bool, usize)> = HashMap::new();
    for &(line, thread, op) in ops {
        let makes = matches!(
            op,
            Op::Malloc { .. } | Op::Calloc { .. } | Op::ReallocNew { .. }
        );
        let mut named = op;
        let Some(block) = named.block_mut().copied() else {
            continue;
        };
        if makes {
            if let Some(&(true, made)) = blocks.get(&(thread, block)) {
                return Err(format!(
                    "line {line}: `{op}`: b{block} is still live, made on line {made}: free \
                     it first, or give the new block a name of its own"
                ));
            }
            blocks.insert((thread, block), (true, line));
            continue;
        }
        match blocks.get(&(thread, block)) {
            None => {
                return Err(format!(
                    "line {line}: `{op}`: b{block} was never made (a block is made by \
                     `bN = malloc`, `calloc` or `realloc -` on the same thread)"
                ));
            }
            Some(&(false, freed)) => {
                return Err(format!(
                    "line {line}: `{op}`: b{block} was freed on line {freed}"
                ));
            }
            Some(_) => {}
        }
        if matches!(op, Op::Free { .. } | Op::Pass { .. }) {
            blocks.insert((thread, block), (false, line));
        }
    }
    Ok(())
}

/// The most client threads a script may name.
const MAX_THREADS: usize = 256;

impl fmt::Display for Script {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(policy) = &self.ran.policy {
            writeln!(f, "policy {policy}")?;
        }
        if let Some(digest) = &self.ran.digest {
            writeln!(f, "digest {digest}")?;
        }
        for (key, value) in &self.ran.config {
            writeln!(f, "config {key}={value}")?;
        }
        if !self.ran.grants.is_empty() {
            writeln!(f, "grant {}", self.ran.grants.join(","))?;
        }
        for (bound, value) in &self.ran.limits {
            writeln!(f, "limit {} {value}", bound.name())?;
        }
        if self.upstream_seed != 0 {
            writeln!(f, "upstream seed {}", self.upstream_seed)?;
        }
        match (self.path, self.magazine_depth) {
            (CallPath::Magazines, Some(depth)) => writeln!(f, "magazines {depth}")?,
            (path, _) => writeln!(f, "{}", path.word())?,
        }
        if !self.order.is_empty() {
            let mut next = vec![0; self.threads.len()];
            for &thread in &self.order {
                let Some(op) = self
                    .threads
                    .get(thread)
                    .and_then(|ops| ops.get(next[thread]))
                else {
                    continue;
                };
                writeln!(f, "t{thread} {op}{}", op.note())?;
                next[thread] += 1;
            }
            return Ok(());
        }
        for (i, ops) in self.threads.iter().enumerate() {
            if i > 0 {
                writeln!(f, "thread")?;
            }
            for op in ops {
                writeln!(f, "{op}{}", op.note())?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 73: a failure found under `-c` did not reproduce from its saved script:
    /// neither it nor the printed line kept the configuration.
    #[test]
    fn a_script_keeps_the_policy_its_configuration_and_grants_and_reads_them_back() {
        let digest = "ab".repeat(32);
        let script = Script::parse(&format!(
            "policy fixtures/broken.wasm\ndigest {digest}\nconfig fault=overlap\n\
             config alignment=64\ngrant numa,guarded\nlimit call-work 5000\nlimit batch 8\n\
             upstream seed 3\nb0 = malloc 8\nfree b0\n",
        ))
        .unwrap();
        assert_eq!(script.ran.digest.as_deref(), Some(digest.as_str()));
        assert_eq!(
            script.ran.limits,
            [(ScriptLimit::CallWork, 5000), (ScriptLimit::Batch, 8)]
        );
        assert_eq!(script.ran.policy.as_deref(), Some("fixtures/broken.wasm"));
        assert_eq!(
            script.ran.config,
            [
                ("fault".to_string(), "overlap".to_string()),
                ("alignment".to_string(), "64".to_string())
            ]
        );
        assert_eq!(script.ran.grants, ["numa", "guarded"]);
        assert_eq!(Script::parse(&script.to_string()).unwrap(), script);
        assert!(
            Script::parse("config nokey\n")
                .unwrap_err()
                .contains("KEY=VALUE")
        );
    }

    #[test]
    fn a_digest_or_limit_line_of_another_form_is_refused_naming_its_form() {
        for (line, says) in [
            ("digest abc", "64 hex digits"),
            ("limit call-work", "not a whole number"),
            ("limit speed 9", "a limit is one of call-work"),
            ("limit overhead -1", "not a whole number"),
        ] {
            let err = Script::parse(&format!("{line}\nb0 = malloc 8\n")).unwrap_err();
            assert!(
                err.contains(says) && err.starts_with("line 1:"),
                "{line}: {err}"
            );
        }
    }

    /// Found by `.ci/fuzz`'s `replay_script` target (its first long run): `grant ` of
    /// nothing but form feeds parsed as a grant of no kind, which printed as `grant `
    /// and read back as no operation. A grant or policy line naming nothing is refused.
    #[test]
    fn a_grant_or_policy_line_naming_nothing_is_refused_so_a_script_prints_as_it_parses() {
        for text in [
            "grant \u{c}\u{c}\n",
            "grant numa,\n",
            "grant \u{c},\u{c}\n",
            "policy \u{c}\n",
        ] {
            let error = Script::parse(text).unwrap_err();
            assert!(error.starts_with("line 1: "), "{text:?}: {error}");
        }
        let script = Script::parse("grant numa, guarded\nb0 = malloc 8\n").unwrap();
        assert_eq!(Script::parse(&script.to_string()).unwrap(), script);
    }

    /// Issue 60: a script said `malloc 0` where the policy got 1, and printed sizes near
    /// 2^64 as twenty digits. Each now has a note, and the script still reads back.
    #[test]
    fn a_script_through_shallow_magazines_says_their_depth_and_reads_back_so() {
        let script =
            Script::parse("upstream seed 5\nmagazines 8\nb0 = malloc 224\nfree b0\n").unwrap();
        assert_eq!(
            (script.path, script.magazine_depth),
            (CallPath::Magazines, Some(8))
        );
        assert!(script.to_string().contains("\nmagazines 8\n"), "{script}");
        let production = Script::parse("magazines\nb0 = malloc 8\n").unwrap();
        assert_eq!(production.magazine_depth, None);
        assert!(production.to_string().starts_with("magazines\n"));
        let bad = Script::parse("magazines 0\n").unwrap_err();
        assert!(bad.contains("line 1") && bad.contains("1 to 64"), "{bad}");
    }

    #[test]
    fn a_script_notes_zero_sizes_and_sizes_near_a_power_of_two_and_reads_back() {
        let script = Script {
            threads: vec![vec![
                Op::Malloc { block: 0, size: 0 },
                Op::Malloc {
                    block: 1,
                    size: (1 << 32) - 15,
                },
                Op::Realloc {
                    block: 1,
                    size: u64::MAX - 14,
                },
                Op::Calloc {
                    block: 2,
                    nelem: u64::MAX,
                    elsize: 2,
                },
                Op::Malloc { block: 3, size: 24 },
            ]],
            ..Script::default()
        };
        let text = script.to_string();
        let lines: Vec<&str> = text.lines().skip(1).collect();
        assert_eq!(
            lines,
            [
                "b0 = malloc 0  # the policy is asked for 1 byte: a request of 0 is 1",
                "b1 = malloc 4294967281  # 2^32 - 15",
                "realloc b1 18446744073709551601  # 2^64 - 15",
                "b2 = calloc 18446744073709551615 2  # nelem * elsize overflows: calloc must answer none",
                "b3 = malloc 24",
            ]
        );
        assert_eq!(Script::parse(&text).unwrap(), script);
    }
}
