//! Drawing random scripts: a proptest strategy of client operations in the shapes real
//! workloads have, whose value tree ([`ScriptTree`], in `shrink.rs`) shrinks a failure.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use proptest::test_runner::{TestRng, TestRunner};

use proptest::prelude::{RngExt, Strategy};

use super::script::{BlockId, CallPath, Case, Op};
use super::shrink::{ScriptTree, ShrinkBudget};

/// The size mix, in percent: NumPy's common small sizes dominate (72% of its mallocs
/// are 8-15 bytes); edges, pages, large blocks and sizes that must fail all appear in
/// most sequences.
pub(super) fn draw_size(rng: &mut TestRng) -> u64 {
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
        96..98 => boundary_size(rng, 20),
        98 => wrapping_size(rng),
        _ => IMPOSSIBLE[rng.random_range(0..IMPOSSIBLE.len())],
    }
}

/// A size where arithmetic on 32 bits wraps or turns negative: half the time just under
/// 2^32 (where rounding up to any class of up to 16 bytes wraps to 0), else within a
/// few bytes or a page of 2^32 or 2^31. A wasm32 policy in C, Zig or AssemblyScript
/// computes sizes in its 32-bit `size_t` (or `int`). All pass the overhead budget, so a
/// right policy answers none.
pub(super) fn wrapping_size(rng: &mut TestRng) -> u64 {
    const DELTAS: [u64; 5] = [1, 16, 17, 4095, 4096];
    if rng.random_bool(0.5) {
        return (1 << 32) - rng.random_range(1..=16u64);
    }
    let at = [1u64 << 32, 1 << 31][rng.random_range(0..2usize)];
    let delta = DELTAS[rng.random_range(0..DELTAS.len())];
    match rng.random_range(0..3u32) {
        0 => at - delta,
        1 => at,
        _ => at + delta,
    }
}

/// A power of two from 8 bytes to `2^max_power`, one of its neighbours, or three times
/// it: where size classes, pages and alignment multiples begin and end (an alignment
/// is a power of two, and its odd multiples are where a rounding bug shows).
pub(super) fn boundary_size(rng: &mut TestRng, max_power: u32) -> u64 {
    let power = 1u64 << rng.random_range(3..=max_power);
    match rng.random_range(0..4u32) {
        0 => power - 1,
        1 => power,
        2 => power + 1,
        _ => power * 3,
    }
}

/// What a sequence looks like. Most are the general mix; the rest are shapes that real
/// workloads have and a random mix rarely reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
    Mixed,
    /// Many blocks of one size made and freed in runs: a pool filling and draining.
    Burst(u64),
    /// Two sizes in turn: a class boundary crossed back and forth.
    Alternating(u64, u64),
    /// The newest block resized again and again: a growing buffer.
    ReallocChain,
    /// A few large blocks (16 KiB to 256 KiB) grown and shrunk, past the page and the
    /// 64 KiB class limits where policies switch to their large-block paths.
    GrowShrink,
    /// The general mix with the upstream running out of memory: one request refused
    /// here and there, the next (`oom next`) or one a few requests on (`oom after N`,
    /// which lands part way through the batch a refill asks for), and from the start,
    /// half the time, every `N`th request or every request above a size.
    OutOfMemory,
    /// Two near sizes (one size class of many a policy's) made in a run and freed in a
    /// run, in turn, the upstream refusing a request now and then: the host's magazines
    /// give a run's blocks back to the policy, and the next run of the other size asks
    /// for them in batches, so a refusal lands part way through a batch the policy's
    /// lists began.
    Tides(u64, u64),
}

/// Half the sequences are the general mix; the shapes share the rest, running out of
/// memory most (its refusals land anywhere a request crosses: a call, a refill, a
/// flush), large blocks least (each of their operations moves or fills hundreds of
/// kilobytes). Bursts and alternations stay at or below 64 KiB so a sequence holds a few
/// megabytes at most.
pub(super) fn draw_shape(rng: &mut TestRng) -> Shape {
    match rng.random_range(0..20u32) {
        0..8 => Shape::Mixed,
        8..10 => {
            // Sizes 16 or 32 bytes apart: in one class of a policy whose classes are
            // 32 bytes or wider, more often than not.
            let a = 16 * rng.random_range(2..=32u64);
            let apart = 16 * rng.random_range(1..=2u64);
            let b = match rng.random_bool(0.5) {
                true => a + apart,
                false => a - apart,
            };
            Shape::Tides(a, b)
        }
        10..13 => Shape::OutOfMemory,
        13..15 => Shape::Burst(boundary_size(rng, 16)),
        15..17 => Shape::Alternating(boundary_size(rng, 16), boundary_size(rng, 16)),
        17..19 => Shape::ReallocChain,
        _ => Shape::GrowShrink,
    }
}

/// `calloc` arguments: mostly small products; a quarter arrays of 8-byte elements of
/// every size [`draw_size`] draws up to 2 MiB (`np.zeros` of float64, where pages and
/// large-block paths begin); some zero counts, some that overflow.
pub(super) fn draw_calloc(rng: &mut TestRng, block: BlockId) -> Op {
    const ZERO: [(u64, u64); 3] = [(0, 8), (8, 0), (0, 0)];
    const OVERFLOW: [(u64, u64); 3] = [
        (u64::MAX / 2 + 1, 2),
        (1 << 32, 1 << 32),
        (u64::MAX, u64::MAX),
    ];
    let (n, e) = match rng.random_range(0..8u32) {
        0..4 => (rng.random_range(1..=64), rng.random_range(1..=64)),
        4..6 => (draw_size(rng).min(2 << 20).div_ceil(8), 8),
        6 => ZERO[rng.random_range(0..ZERO.len())],
        _ => OVERFLOW[rng.random_range(0..OVERFLOW.len())],
    };
    Op::Calloc {
        block,
        nelem: n,
        elsize: e,
    }
}

/// The blocks a thread's operations have made so far, as the drawing sees them (a
/// block whose malloc answers none is skipped when the script runs).
#[derive(Debug, Default)]
pub(super) struct Drawing {
    next: BlockId,
    live: Vec<BlockId>,
    /// [`Shape::Tides`]: making blocks (not freeing them), and the runs made so far.
    filling: bool,
    runs: u32,
}

impl Drawing {
    fn make(&mut self) -> BlockId {
        let block = self.next;
        self.next += 1;
        self.live.push(block);
        block
    }

    /// A random block made and not freed, as its place in `live`.
    fn pick(&mut self, rng: &mut TestRng) -> Option<usize> {
        (!self.live.is_empty()).then(|| rng.random_range(0..self.live.len()))
    }
}

/// One operation of a sequence of `shape`.
pub(super) fn draw_op(rng: &mut TestRng, drawing: &mut Drawing, shape: Shape) -> Op {
    let roll = rng.random_range(0..100u32);
    let free = |drawing: &mut Drawing, rng: &mut TestRng| match drawing.pick(rng) {
        Some(at) => Op::Free {
            block: drawing.live.swap_remove(at),
        },
        None => Op::Trim,
    };
    match shape {
        Shape::Mixed => draw_mixed_op(rng, drawing),
        Shape::OutOfMemory => match roll {
            // Mostly just past a batch's first blocks: a magazine's first refills of a
            // size ask for 1, 2, then 4 blocks.
            0..3 => Op::OomAfter { requests: 0 },
            3..6 => Op::OomAfter {
                requests: rng.random_range(1..=3),
            },
            6..8 => Op::OomAfter {
                requests: rng.random_range(4..=16),
            },
            _ => draw_mixed_op(rng, drawing),
        },
        Shape::Burst(size) => match roll {
            0..55 => Op::Malloc {
                size,
                block: drawing.make(),
            },
            55..97 => free(drawing, rng),
            _ => Op::Trim,
        },
        Shape::Alternating(a, b) => {
            let size = if drawing.next.is_multiple_of(2) { a } else { b };
            match (roll, drawing.pick(rng)) {
                (0..50, _) | (80..98, None) => Op::Malloc {
                    size,
                    block: drawing.make(),
                },
                (50..80, _) => free(drawing, rng),
                (80..98, Some(at)) => Op::Realloc {
                    block: drawing.live[at],
                    size,
                },
                _ => Op::Trim,
            }
        }
        Shape::Tides(a, b) => {
            // The next request refused: in a run that draws on the lists, the first
            // request upstream is the batch the lists ran short in.
            if roll < 6 {
                return Op::OomAfter { requests: 0 };
            }
            if drawing.live.is_empty() && !drawing.filling {
                drawing.filling = true;
                drawing.runs += 1;
            } else if drawing.filling && drawing.live.len() >= rng.random_range(6..=24) {
                drawing.filling = false;
            }
            match drawing.filling {
                true => Op::Malloc {
                    size: if drawing.runs.is_multiple_of(2) { a } else { b },
                    block: drawing.make(),
                },
                false => free(drawing, rng),
            }
        }
        Shape::ReallocChain => match (roll, drawing.live.last()) {
            (0..70, Some(&block)) => Op::Realloc {
                block,
                size: draw_size(rng),
            },
            (0..85, _) => Op::Malloc {
                size: draw_size(rng),
                block: drawing.make(),
            },
            (85..98, _) => free(drawing, rng),
            _ => Op::Trim,
        },
        Shape::GrowShrink => {
            let size = rng.random_range((16 << 10)..=(256 << 10));
            match (roll, drawing.pick(rng)) {
                // A few blocks at a time: large ones add up fast.
                (_, Some(_)) if drawing.live.len() >= 8 => free(drawing, rng),
                (0..30, _) | (30..75, None) => Op::Malloc {
                    size,
                    block: drawing.make(),
                },
                (30..75, Some(at)) => Op::Realloc {
                    block: drawing.live[at],
                    size,
                },
                (75..98, _) => free(drawing, rng),
                _ => Op::Trim,
            }
        }
    }
}

/// One operation of the general mix, in 100ths: malloc 30, calloc 15, realloc 23 (a
/// tenth of them from none), free 30, trim 2 (so most sequences of a hundred operations
/// trim once or twice while blocks are live). A realloc or free with no block made yet
/// is a malloc.
fn draw_mixed_op(rng: &mut TestRng, drawing: &mut Drawing) -> Op {
    let roll = rng.random_range(0..100u32);
    let picked = match roll {
        45..98 if !rng.random_bool(0.1) || roll >= 68 => drawing.pick(rng),
        _ => None,
    };
    match (roll, picked) {
        (30..45, _) => draw_calloc(rng, drawing.make()),
        (45..68, Some(at)) => Op::Realloc {
            block: drawing.live[at],
            size: draw_size(rng),
        },
        (45..68, None) => Op::ReallocNew {
            size: draw_size(rng),
            block: drawing.make(),
        },
        (68..98, Some(at)) => Op::Free {
            block: drawing.live.swap_remove(at),
        },
        (98.., _) => Op::Trim,
        _ => Op::Malloc {
            size: draw_size(rng),
            block: drawing.make(),
        },
    }
}

/// A refusal that stands from the start of an out-of-memory sequence, half the time:
/// every `N`th request (from every second to every 64th), or every request above a size
/// where size classes and pages begin and end.
fn draw_standing_oom(rng: &mut TestRng) -> Option<Op> {
    match rng.random_range(0..4u32) {
        0 => Some(Op::OomEvery {
            n: rng.random_range(2..=64),
        }),
        1 => Some(Op::OomAbove {
            size: boundary_size(rng, 20),
        }),
        _ => None,
    }
}

/// Sequences of operations, one per client thread, drawn straight from the RNG.
///
/// proptest's `vec(prop_oneof![..])` builds a value tree per operation, and building
/// those cost more than running the operations; this strategy keeps plain operations
/// and shrinks them with [`ScriptTree`].
#[derive(Debug, Clone)]
pub(super) struct Scripts {
    pub(super) threads: usize,
    pub(super) max_ops: usize,
    /// Long-lived instances: every sequence is the general mix, holding at most
    /// [`LONG_LIVE_BLOCKS`] blocks at once. Otherwise a [`Shape`] is drawn per sequence.
    pub(super) long: bool,
    /// The policy says its state is per instance and the case has several threads:
    /// some cases then run [`CallPath::PerThread`], each thread passing every other
    /// block it would free to the next thread.
    pub(super) per_thread: bool,
    /// How long shrinking a failure may take ([`ShrinkBudget`]).
    pub(super) shrink_time: Option<Duration>,
    /// Set when a failure's shrinking ran out of its budget.
    pub(super) shrink_spent: Arc<AtomicBool>,
}

/// The most blocks a long-lived instance's thread holds at once; past it, the next
/// operation frees one. What a long instance is for (bugs that need hundreds of calls
/// to one instance) needs calls, not blocks, and an unbounded mix piles up tens of
/// megabytes that every operation's checks then wade through.
pub(super) const LONG_LIVE_BLOCKS: usize = 512;

impl Strategy for Scripts {
    type Tree = ScriptTree;
    type Value = Case;

    /// Half the cases through the magazines, half asking the policy on every call: the
    /// paths of a batching policy's own code that each reaches are disjoint for small
    /// sizes.
    fn new_tree(&self, runner: &mut TestRunner) -> proptest::strategy::NewTree<Self> {
        let rng = runner.rng();
        // A policy that cannot run per thread draws as it always did, so its seeds
        // name the same cases.
        let path = match (self.per_thread, rng.random_bool(0.5)) {
            (true, _) if rng.random_range(0..3u32) == 0 => CallPath::PerThread,
            (_, true) => CallPath::Magazines,
            (_, false) => CallPath::PerCall,
        };
        let threads = (0..self.threads)
            .map(|_| {
                let len = rng.random_range(1..=self.max_ops);
                let mut drawing = Drawing::default();
                let shape = match self.long {
                    true => Shape::Mixed,
                    false => draw_shape(rng),
                };
                let standing = match shape {
                    Shape::OutOfMemory => draw_standing_oom(rng),
                    _ => None,
                };
                let mut draw = |drawing: &mut Drawing| match drawing.pick(rng) {
                    Some(at) if self.long && drawing.live.len() >= LONG_LIVE_BLOCKS => Op::Free {
                        block: drawing.live.swap_remove(at),
                    },
                    _ => draw_op(rng, drawing, shape),
                };
                let ops = (0..len).map(|_| draw(&mut drawing));
                let ops: Vec<Op> = standing.into_iter().chain(ops).collect();
                match path {
                    CallPath::PerThread => passing_every_other_free(ops),
                    _ => ops,
                }
            })
            .collect();
        // Drawn after the operations, so that a seed names the same operations it did.
        let magazine_depth = match path {
            CallPath::Magazines => draw_magazine_depth(rng),
            _ => None,
        };
        Ok(ScriptTree::new(
            path,
            magazine_depth,
            threads,
            ShrinkBudget::new(self.shrink_time, self.shrink_spent.clone()),
        ))
    }
}

/// Through the magazines, half the cases with magazines shallower than production's: 8
/// or 16 blocks, whose refills (1, 2, then 2 or 4 blocks) and spills (4 or 8 blocks)
/// come every few operations and leave a policy's own lists part full when the next
/// batch comes, so that an out-of-memory refusal lands part way through a batch the
/// lists began. Production's 64 spill only past 64 frees of one size.
fn draw_magazine_depth(rng: &mut TestRng) -> Option<u8> {
    match rng.random_range(0..4u32) {
        0 => Some(8),
        1 => Some(16),
        _ => None,
    }
}

/// `ops` with every other `free` a `pass` to the next thread, which frees the block.
fn passing_every_other_free(mut ops: Vec<Op>) -> Vec<Op> {
    let frees = ops.iter_mut().filter(|op| matches!(op, Op::Free { .. }));
    for op in frees.step_by(2) {
        if let Op::Free { block } = *op {
            *op = Op::Pass { block };
        }
    }
    ops
}
