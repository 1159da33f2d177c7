//! Typed failures. Every message names the policy, the call, the address and the sizes,
//! so a log line alone is enough to find the bug.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The operation during which something went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    Init,
    Malloc,
    Calloc,
    Realloc,
    Free,
    MallocMany,
    FreeMany,
    Trim,
    BytesRead,
    BytesWrite,
    BytesFill,
    BytesCopy,
    Report,
    MemoryMap,
    MemoryMapGpu,
    MemoryMapPinned,
    MemoryMapDevice,
    MemoryUnmap,
    ClientMisuse,
    Observe,
    Renew,
    /// An event hook told of one event (`events.on-event`).
    Event,
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Call::Init => "init",
            Call::Malloc => "malloc",
            Call::Calloc => "calloc",
            Call::Realloc => "realloc",
            Call::Free => "free",
            Call::MallocMany => "malloc-many",
            Call::FreeMany => "free-many",
            Call::Trim => "trim",
            Call::BytesRead => "bytes.read",
            Call::BytesWrite => "bytes.write",
            Call::BytesFill => "bytes.fill",
            Call::BytesCopy => "bytes.copy",
            Call::Report => "report",
            Call::MemoryMap => "memory.map-region",
            Call::MemoryMapGpu => "memory.map-gpu",
            Call::MemoryMapPinned => "memory.map-pinned",
            Call::MemoryMapDevice => "memory.map-device",
            Call::MemoryUnmap => "memory.unmap-region",
            Call::ClientMisuse => "diagnostics.client-misuse",
            Call::Observe => "observe",
            Call::Renew => "renew",
            Call::Event => "on-event",
        })
    }
}

/// A rule of the handler contract (`ARCHITECTURE.md`, "The contract") that a policy broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// C6: a returned block is not inside one block the policy got from upstream.
    OutsideOwned,
    /// C6: a returned block lies in upstream memory the policy gave back during the same
    /// call (in a realloc: freed, or moved by an upstream realloc): a use after free.
    UseAfterFree { released: u64, released_size: u64 },
    /// C6: a returned block overlaps a block the policy has lent and not had back.
    Overlap { other: u64, other_size: u64 },
    /// C6: a returned block is not aligned as the policy declared.
    Misaligned { alignment: u64 },
    /// C5: an upstream free or realloc with another size than the block was lent with.
    WrongSizeFree { recorded: u64 },
    /// An upstream free or realloc of an address that was lent and already given back.
    DoubleFree,
    /// An upstream free or realloc of an address that was never lent to this policy.
    UnknownFree,
    /// `bytes` access outside the blocks the policy owns and has not lent out; `lent`,
    /// the block lent to the client that the access falls in, if it does: its address,
    /// its size, and where the access starts.
    BytesOutOfBounds { lent: Option<(u64, u64, u64)> },
    /// A `bytes` write into the block the client's `realloc` is resizing: until the
    /// answer, the block is the client's and may be read, not written (C4: on an answer
    /// of none it must be unchanged).
    ResizedBlockWritten,
    /// An upstream free or realloc of memory that holds a block the policy has lent and
    /// not had back: the client's data would be pulled out from under it.
    GaveBackLentMemory { block: u64, block_size: u64 },
    /// C3: calloc returned bytes that are not zero (checked mode).
    CallocNotZeroed { offset: u64 },
    /// C4: realloc answered a block that does not hold the old block's bytes (checked on
    /// every realloc: the client keeps its old block).
    ReallocLostBytes { offset: u64 },
    /// A block's bytes changed while the client held it (checked mode).
    LiveBlockChanged { offset: u64 },
    /// After every block was freed and the policy trimmed, it still holds upstream memory
    /// (`blocks` of it, `bytes` in all) or regions mapped for it (`regions`,
    /// `region_bytes`).
    Leak {
        blocks: usize,
        bytes: u64,
        regions: usize,
        region_bytes: u64,
    },
    /// The policy answered `malloc-many` with more blocks than were asked for.
    TooManyBlocks { asked: u32, got: usize },
    /// C6: a returned block lies in memory of another place than the handler serves:
    /// host memory for a GPU program's request, or GPU memory for a host client's.
    WrongMemory {
        wanted: crate::gpu::Placement,
        found: crate::gpu::Placement,
    },
    /// A `bytes` access to memory of GPU `device`, which the host never reads or writes.
    DeviceBytes { device: u32 },
}

impl Rule {
    /// A short, stable name, for scripts, JSON reports and tests.
    pub fn name(&self) -> &'static str {
        match self {
            Rule::OutsideOwned => "outside-owned",
            Rule::UseAfterFree { .. } => "use-after-free",
            Rule::Overlap { .. } => "overlap",
            Rule::Misaligned { .. } => "misaligned",
            Rule::WrongSizeFree { .. } => "wrong-size-free",
            Rule::DoubleFree => "double-free",
            Rule::UnknownFree => "unknown-free",
            Rule::BytesOutOfBounds { .. } => "bytes-out-of-bounds",
            Rule::ResizedBlockWritten => "resized-block-written",
            Rule::GaveBackLentMemory { .. } => "gave-back-lent-memory",
            Rule::CallocNotZeroed { .. } => "calloc-not-zeroed",
            Rule::ReallocLostBytes { .. } => "realloc-lost-bytes",
            Rule::LiveBlockChanged { .. } => "live-block-changed",
            Rule::Leak { .. } => "leak",
            Rule::TooManyBlocks { .. } => "too-many-blocks",
            Rule::WrongMemory { .. } => "wrong-memory",
            Rule::DeviceBytes { .. } => "device-bytes",
        }
    }
}

/// What an access at `at` into the block `[block, block+size)` the client holds says.
/// Past the block's start, the usual cause is a policy's own header or link placed
/// where it thinks the block ends: it took the block for shorter than it was asked,
/// and both sizes are named.
fn lent_block_hit(f: &mut fmt::Formatter<'_>, block: u64, size: u64, at: u64) -> fmt::Result {
    let offset = at.wrapping_sub(block);
    match at.cmp(&block) {
        std::cmp::Ordering::Less => write!(
            f,
            "it reaches into the block {block:#x} ({size} bytes) the policy lent its client \
             from below: whatever lies before that block was taken for longer than it is"
        ),
        std::cmp::Ordering::Equal => write!(
            f,
            "it falls at the start of the block {block:#x} ({size} bytes) the policy lent \
             its client, which only the client may write until it is freed (a stale \
             pointer to it, or a header written over the client's first bytes)"
        ),
        std::cmp::Ordering::Greater => write!(
            f,
            "it falls at byte {offset} of the block {block:#x} ({size} bytes) the policy \
             lent its client, which only the client may write until it is freed: a policy \
             writing its header or link there took that block for {offset} bytes, shorter \
             than the {size} asked"
        ),
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rule::OutsideOwned => f.write_str("block outside the memory the policy owns"),
            Rule::UseAfterFree {
                released,
                released_size,
            } => write!(
                f,
                "use after free: block lies in upstream memory {released:#x} ({released_size} bytes) it gave back in this call"
            ),
            Rule::Overlap { other, other_size } => write!(
                f,
                "block overlaps the live block {other:#x} ({other_size} bytes)"
            ),
            Rule::Misaligned { alignment } => {
                write!(f, "block not aligned to the declared {alignment} bytes")
            }
            Rule::WrongSizeFree { recorded } => write!(
                f,
                "sized-free rule broken: the block was lent with {recorded} bytes"
            ),
            Rule::DoubleFree => f.write_str("block already given back (double free)"),
            Rule::UnknownFree => f.write_str("address was never lent to this policy"),
            Rule::BytesOutOfBounds { lent: None } => {
                f.write_str("bytes access outside owned, not-lent-out memory")
            }
            Rule::BytesOutOfBounds {
                lent: Some((block, block_size, at)),
            } => {
                f.write_str("bytes access outside owned, not-lent-out memory: ")?;
                lent_block_hit(f, *block, *block_size, *at)
            }
            Rule::ResizedBlockWritten => f.write_str(
                "bytes write into the block the client's realloc is resizing, which stays the \
                 client's, readable and unchanged, until realloc answers (C4: on an answer of \
                 none it must be intact); free the old block once realloc has returned (the \
                 Rust SDK's `free_after_this_call`, which its default realloc uses)",
            ),
            Rule::GaveBackLentMemory { block, block_size } => write!(
                f,
                "gave back upstream memory under the live block {block:#x} ({block_size} bytes) it lent"
            ),
            Rule::CallocNotZeroed { offset } => {
                write!(f, "calloc block not zero-filled (byte {offset})")
            }
            Rule::ReallocLostBytes { offset } => {
                write!(f, "realloc did not preserve the old bytes (byte {offset})")
            }
            Rule::LiveBlockChanged { offset } => {
                write!(
                    f,
                    "a live block's bytes changed under its client (byte {offset})"
                )
            }
            Rule::Leak {
                blocks,
                bytes,
                regions,
                region_bytes,
            } => {
                let plural = |n: usize| if n == 1 { "" } else { "s" };
                let mut held = Vec::new();
                if *blocks > 0 {
                    let s = plural(*blocks);
                    held.push(format!("{blocks} upstream block{s} ({bytes} bytes)"));
                }
                if *regions > 0 {
                    let s = plural(*regions);
                    held.push(format!("{regions} mapped region{s} ({region_bytes} bytes)"));
                }
                write!(
                    f,
                    "{} still held after the client freed every block and the policy was \
                     trimmed",
                    held.join(" and ")
                )
            }
            Rule::TooManyBlocks { asked, got } => {
                write!(f, "malloc-many returned {got} blocks for {asked} asked")
            }
            Rule::WrongMemory { wanted, found } => {
                write!(f, "block in {found}, where its client needs {wanted}")
            }
            Rule::DeviceBytes { device } => write!(
                f,
                "bytes access to memory of GPU {device}, which the host never reads or writes"
            ),
        }
    }
}

/// A bound on the host work one call of a policy may cause ([`crate::Limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bound {
    /// Blocks asked of the host in one `malloc-many` or `free-many` ([`crate::Limits::batch`]).
    Batch,
    /// Bytes asked of `bytes.read` in one call ([`crate::Limits::memory`]: no guest could
    /// take more).
    ReadLength,
    /// WASI resources (streams, pollables, errors) a policy holds at once.
    Resources,
    /// Core instances, linear memories or tables one policy instance creates.
    Objects,
    /// Bytes a policy holds beyond what its client holds once a request is answered
    /// ([`crate::Limits::overhead`]): what it took for a request it refused is not kept.
    Overhead,
}

impl Bound {
    /// A short, stable name, for JSON reports and tests.
    pub fn name(&self) -> &'static str {
        match self {
            Bound::Batch => "batch-limit",
            Bound::ReadLength => "read-limit",
            Bound::Resources => "resource-limit",
            Bound::Objects => "object-limit",
            Bound::Overhead => "overhead-limit",
        }
    }
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Bound::Batch => "batch bound (blocks in one malloc-many or free-many; `--batch-limit`)",
            Bound::ReadLength => {
                "read bound (bytes in one bytes.read: no more than the guest-memory budget)"
            }
            Bound::Resources => "resource bound (WASI streams, pollables and errors held at once)",
            Bound::Objects => {
                "object bound (core instances, linear memories and tables one policy creates)"
            }
            Bound::Overhead => {
                "overhead budget (bytes held beyond the client's once a request is answered; \
                 `--overhead`)"
            }
        })
    }
}

/// A policy broke the handler contract. The policy instance is stopped (poisoned).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub policy: Arc<str>,
    pub call: Call,
    pub addr: u64,
    pub size: u64,
    pub rule: Rule,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Violation {
            policy,
            call,
            addr,
            size,
            rule,
        } = self;
        // A leak is found after the last call, not in one, and at no one address.
        if let Rule::Leak { .. } = rule {
            return write!(f, "policy `{policy}` leaks: {rule}");
        }
        // The batch calls are the host's own, made for a client's malloc or free.
        let whose = match call {
            Call::MallocMany => " (the host refilling its thread caches for a malloc)",
            Call::FreeMany => " (the host giving its thread caches' blocks back)",
            _ => "",
        };
        write!(
            f,
            "policy `{policy}` broke the contract in `{call}`{whose} at {addr:#x} ({size} \
             bytes): {rule}"
        )?;
        match crate::fill::named_in(*addr) {
            Some(cause) => write!(f, "; {cause}"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for Violation {}

impl From<crate::compile_bounds::Exceeded> for LoadError {
    fn from(e: crate::compile_bounds::Exceeded) -> LoadError {
        LoadError::CompileBound {
            bound: e.bound,
            asked: e.asked,
            limit: e.limit,
        }
    }
}

/// The host's own bookkeeping is wrong: a bug in allocbox, never a policy's fault.
/// Reported by [`crate::Handler::audit`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("host invariant broken in `{link}`: block {addr:#x} ({size} bytes) {what}")]
pub struct InvariantBroken {
    pub link: String,
    pub addr: u64,
    pub size: u64,
    pub what: &'static str,
}

/// Why a component could not be loaded or started as a policy.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read `{path}`: {error}")]
    Io { path: String, error: std::io::Error },
    #[error("not a WebAssembly file (neither the wasm binary magic nor WAT text): {detail}")]
    NotWasm { detail: String },
    #[error("invalid component: {detail}")]
    Invalid { detail: String },
    #[error(
        "this core module could not be made a component of the policy world (it must import \
         and export the world's functions under their canonical-ABI names, and may import \
         only the `wasi_snapshot_preview1` functions the host's stub provides): {detail}"
    )]
    Componentize { detail: String },
    #[error("the component targets another world: {detail}")]
    WrongWorld { detail: String },
    /// The component imports an interface the sandbox does not serve.
    #[error(
        "the component imports `{import}`, which the sandbox does not serve: a policy may \
         import the policy world's `allocator` and `bytes` (and at 0.2.0 `memory` and \
         `diagnostics`) and WASI 0.2's clocks, random, \
         io, cli, filesystem and sockets interfaces (served without real time, files or \
         network); build it without that import"
    )]
    Import { import: String },
    #[error(
        "the component speaks allocbox:policy@{found}; this host speaks @0.1.0 and @{expected}: \
         build it against one of those"
    )]
    WrongVersion {
        found: String,
        expected: &'static str,
    },
    /// The binary is past one of the [`crate::CompileBounds`]: refused before it is
    /// compiled.
    #[error(
        "the policy has {asked} {bound}, more than the {limit} allowed before compiling it \
         (the `{name}` compile bound; if you trust the policy, raise it: `--compile-bound \
         {name}=N` on the command line, `compile_bounds={{\"{name}\": N}}` in Python)",
        name = bound.name()
    )]
    CompileBound {
        bound: crate::compile_bounds::CompileBound,
        asked: u64,
        limit: u64,
    },
    #[error("policy start-up failed: {0}")]
    Start(Box<Error>),
    /// A forked child could not start threads of its own to compile on.
    #[error(
        "cannot start threads to compile the policy in this forked process ({detail}); \
         load it before forking, or in a process with fewer threads"
    )]
    NoCompilerThreads { detail: String },
    /// A pooled runtime ([`crate::Runtime::pooled`]) has every slot in use.
    #[error("the runtime's instance pool is full ({detail}); end a handler first, or pool more")]
    PoolFull { detail: String },
    #[error("policy `{policy}` refused its configuration: {message}")]
    ConfigRejected { policy: String, message: String },
    #[error("policy name must be 1..=127 bytes of UTF-8, got {len} bytes")]
    BadName { len: usize },
    #[error("policy `{policy}` declares contract version {version}; this host speaks version 1")]
    BadVersion { policy: String, version: u8 },
    #[error("policy `{policy}` declares alignment {alignment}, which is not a power of two")]
    BadAlignment { policy: String, alignment: u64 },
    #[error("a handler needs at least one policy")]
    EmptyChain,
    /// A device handler's chain in which no policy can map memory (none imports the
    /// `memory` interface of contract 0.2.0): it could only answer host memory, which a
    /// GPU client must never get.
    #[error(
        "`{chain}` maps no memory of its own (no policy of it imports `memory`), so it \
         cannot place a GPU's memory: a device handler needs a device policy, such as \
         `gpu-pool` or `torch-caching`"
    )]
    NotADevicePolicy { chain: String },
    /// Checked mode's upstream could not reserve its address space.
    #[error(
        "the contract checker could not reserve address space for its upstream ({detail}); \
         raise the process's address-space limit (`ulimit -v`)"
    )]
    CheckerMemory { detail: String },
}

/// A client broke the sized-free rule or freed something it does not own. The handler is
/// not harmed: the call does nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    #[error("free of {addr:#x}, which this handler never lent")]
    UnknownBlock { addr: u64 },
    #[error("double free of {addr:#x}")]
    DoubleFree { addr: u64 },
    #[error("realloc of {addr:#x}, which this handler never lent")]
    UnknownRealloc { addr: u64 },
    #[error("out of memory: the handler has no block of {size} bytes")]
    OutOfMemory { size: u64 },
    #[error(
        "`{call}` of memory of GPU {device}: a device handler only allocates and frees, \
         since the host never reads or writes GPU memory (fill or copy it on the GPU)"
    )]
    DeviceBytes { call: Call, device: u32 },
}

/// Everything that can go wrong when using a handler.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Violation(#[from] Violation),
    #[error("policy `{policy}` trapped in `{call}`: {message}")]
    Trap {
        policy: Arc<str>,
        call: Call,
        message: String,
    },
    #[error("{}", timeout_text(policy, *call, limit))]
    Timeout {
        policy: Arc<str>,
        call: Call,
        limit: TimeLimit,
    },
    #[error(
        "policy `{policy}` passed its memory budget of {limit} bytes (its linear memories \
         and tables together) in `{call}`; if it needs more, raise the budget \
         (`--guest-memory` on the command line, `memory=` in Python, `Limits::memory` in \
         Rust)"
    )]
    MemoryLimit {
        policy: Arc<str>,
        call: Call,
        limit: u64,
    },
    #[error(
        "policy `{policy}` passed the host's {bound} in `{call}`: asked {asked}, limit {limit}"
    )]
    WorkLimit {
        policy: Arc<str>,
        call: Call,
        bound: Bound,
        asked: u64,
        limit: u64,
    },
    #[error("policy `{policy}` was stopped earlier and takes no more calls; cause: {cause}")]
    Poisoned { policy: Arc<str>, cause: Arc<Error> },
    /// The host cannot reach the handler's books or a thread's cache: no policy is at
    /// fault.
    #[error("handler `{handler}` cannot serve this call: {reason}")]
    Unreachable {
        handler: Arc<str>,
        reason: allocbox_ledger::cache::Unreachable,
    },
    /// A request waited for other threads' calls of the same policy past its client's
    /// time limit and was not served: no policy is at fault, and the handler goes on.
    #[error(
        "handler `{handler}` did not reach this call within its time limit of {}: other \
         threads' calls of the same policy were being served; no policy is at fault and it \
         goes on serving. Raise the limit (`--call-time-ms` on the command line, \
         `call_time=` in Python, `Limits::call_time` in Rust), or let fewer threads share \
         one handler",
        duration_text(*limit)
    )]
    Waited { handler: Arc<str>, limit: Duration },
    #[error(transparent)]
    Client(#[from] ClientError),
    /// An event hook (the `hook` world) failed: `cause` is what it did, which names the
    /// hook as a policy would be named.
    #[error("{}", hook_message(cause))]
    Hook { hook: Arc<str>, cause: Box<Error> },
}

/// A hook's failure, told as a hook's: "event hook `sizes` trapped in `on-event`: ...".
fn hook_message(cause: &Error) -> String {
    let text = cause.to_string();
    match text.strip_prefix("policy ") {
        Some(rest) => format!("event hook {rest}"),
        None => text,
    }
}

impl Error {
    /// The policy at fault, when a policy is at fault.
    pub fn policy(&self) -> Option<&str> {
        match self {
            Error::Violation(v) => Some(&v.policy),
            Error::Trap { policy, .. }
            | Error::Timeout { policy, .. }
            | Error::MemoryLimit { policy, .. }
            | Error::WorkLimit { policy, .. }
            | Error::Poisoned { policy, .. } => Some(policy),
            Error::Hook { hook, .. } => Some(hook),
            Error::Client(_) | Error::Unreachable { .. } | Error::Waited { .. } => None,
        }
    }

    /// A short stable name for what went wrong: a [`Rule::name`], a [`Bound::name`], or
    /// `trap`, `timeout`, `memory-limit`, `client`, `unreachable`, `waited`; a poisoning is named
    /// by its cause.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Violation(v) => v.rule.name(),
            Error::WorkLimit { bound, .. } => bound.name(),
            Error::Trap { .. } => "trap",
            Error::Timeout { .. } => "timeout",
            Error::MemoryLimit { .. } => "memory-limit",
            Error::Poisoned { cause, .. } => cause.kind(),
            Error::Client(_) => "client",
            Error::Unreachable { .. } => "unreachable",
            Error::Waited { .. } => "waited",
            Error::Hook { cause, .. } => cause.kind(),
        }
    }

    /// The broken rule, when the error is a contract violation (directly or as the cause
    /// of a poisoning).
    pub fn rule(&self) -> Option<&Rule> {
        match self {
            Error::Violation(v) => Some(&v.rule),
            Error::Poisoned { cause, .. } => cause.rule(),
            _ => None,
        }
    }
}

/// A duration as a person writes it: `250 ms`, `1.5 s`.
/// The limit a call ran past: the wall clock's, or (under a counted runtime, the
/// checker's) its counted work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeLimit {
    /// [`crate::Limits::call_time`].
    Clock(Duration),
    /// [`crate::Limits::call_work`], in units of counted work.
    Work(u64),
}

fn timeout_text(policy: &str, call: Call, limit: &TimeLimit) -> String {
    match limit {
        TimeLimit::Clock(time) => format!(
            "policy `{policy}` ran past the time limit of {} in `{call}` (one limit covers \
             a client's call through the whole chain, every guest call it causes and host \
             work in imports included); if it needs more, raise the limit (`--call-time-ms` \
             on the command line, `call_time=` in Python, `Limits::call_time` in Rust)",
            duration_text(*time)
        ),
        TimeLimit::Work(units) => format!(
            "policy `{policy}` ran past its counted limit of {units} units of work in \
             `{call}` (a checked call's work is counted, not timed: about a unit per wasm \
             instruction of the policy's, and the host's work in its imports by what it \
             moves, each within the limit); if it needs more, raise the limit \
             (`--call-work` on the command line, `Limits::call_work` in Rust)"
        ),
    }
}

fn duration_text(d: Duration) -> String {
    match d.as_millis() {
        ms if ms < 1000 => format!("{ms} ms"),
        _ => format!("{} s", d.as_secs_f64()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_says_its_limit_as_a_person_writes_it_and_how_to_raise_it() {
        let timeout = Error::Timeout {
            policy: "slow".into(),
            call: Call::Malloc,
            limit: TimeLimit::Clock(Duration::from_millis(250)),
        };
        let text = timeout.to_string();
        assert!(text.contains("time limit of 250 ms in `malloc`"), "{text}");
        assert!(
            text.contains("`--call-time-ms` on the command line, `call_time=` in Python"),
            "{text}"
        );
        assert_eq!(duration_text(Duration::from_millis(1500)), "1.5 s");
    }

    #[test]
    fn a_counted_timeout_says_its_units_and_how_to_raise_them() {
        let timeout = Error::Timeout {
            policy: "slow".into(),
            call: Call::Free,
            limit: TimeLimit::Work(1000),
        };
        let text = timeout.to_string();
        assert!(
            text.contains("counted limit of 1000 units of work in `free`"),
            "{text}"
        );
        assert!(text.contains("`--call-work` on the command line"), "{text}");
        assert_eq!(timeout.kind(), "timeout");
    }

    /// Issue 73: a block 16 bytes too short showed as a later out-of-bounds write
    /// that did not name the short block. A write into a lent block names it, where the
    /// write falls, and both sizes.
    #[test]
    fn a_write_into_a_lent_block_names_the_block_and_the_size_the_policy_took_it_for() {
        let into = |at| {
            Rule::BytesOutOfBounds {
                lent: Some((0x1000, 40, at)),
            }
            .to_string()
        };
        let past_start = into(0x1000 + 24);
        assert!(
            past_start.contains("byte 24 of the block 0x1000 (40 bytes)")
                && past_start.contains("took that block for 24 bytes, shorter than the 40 asked"),
            "{past_start}"
        );
        assert!(into(0x1000).contains("at the start of the block 0x1000"));
        assert!(into(0xff8).contains("from below"));
        let elsewhere = Rule::BytesOutOfBounds { lent: None }.to_string();
        assert_eq!(elsewhere, "bytes access outside owned, not-lent-out memory");
    }
}
