//! How a handler serves a trace over time: [`timeline`] replays a trace through one
//! handler on one thread in trace order, timing every event and sampling the bytes the
//! client holds and the bytes the handler holds from the host (what `allocbox report`
//! draws).
//!
//! Unlike [`crate::trace::replay_trace`] (the benchmark), a timeline ignores the
//! recorded threads: a report is about the trace's timeline, so its events run one
//! after another, each timed on its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::latency::Latencies;
use super::replay::stats_of;
use super::{Event, EventOp, Held, Mark, ReplayReport};
use crate::fasthash::FastMap;
use crate::handler::Handler;
use crate::memhandler::MemHandler;
use crate::native::NumpyDefault;

/// The most samples a timeline keeps per series: events are sampled in windows of
/// `ceil(events / MAX_POINTS)`.
pub const MAX_POINTS: usize = 2000;

/// Request-size buckets: bucket 0 is size 0, bucket `b` is `2^(b-1) ..= 2^b - 1`.
pub const SIZE_BUCKETS: usize = 65;

/// One window of events of a [`Timeline`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Events replayed up to the end of the window (the x of every chart).
    pub end: u64,
    /// The most bytes the client held at once during the window (the sizes it asked
    /// for, summed over its live blocks).
    pub live: u64,
    /// The most bytes the handler held from the host at once during the window.
    pub held: u64,
    /// The highest `held / live` after an event of the window (`0` while the client
    /// holds nothing).
    pub ratio: f64,
    /// Mean nanoseconds per event in the window.
    pub ns_per_event: f64,
    /// Median nanoseconds per event in the window: unlike the mean, not moved by the
    /// odd event that waited for the OS.
    pub ns_median: u32,
}

/// The events between two marks of a trace (one test of a recorded test suite), as a
/// handler served them.
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    /// The mark's text; empty for the events before the first mark.
    pub name: String,
    /// Its events: `start..end`, counted from 0.
    pub start: u64,
    pub end: u64,
    /// The most bytes the client held after one of its events.
    pub peak_live: u64,
    /// What the handler held from the host then.
    pub held_at_peak_live: u64,
    /// The most bytes the handler held after one of its events.
    pub peak_held: u64,
}

impl Phase {
    /// Held/live when the client held the most in this phase.
    pub fn ratio_at_peak_live(&self) -> Option<f64> {
        ratio(self.held_at_peak_live, self.peak_live)
    }
}

/// One handler's run through a trace, as a report shows it.
#[derive(Debug)]
pub struct Timeline {
    /// What the handler was called on the command line (a policy file, `default`).
    pub label: String,
    /// The handler's own name (a chain's: its top policy's).
    pub handler: String,
    /// Counts, corrections, the handler's statistics and the first failure; `elapsed`
    /// is the sum of the events' own times.
    pub replay: ReplayReport,
    /// Events per sample.
    pub every: u64,
    pub samples: Vec<Sample>,
    /// Allocation requests (malloc, calloc, realloc) per size bucket ([`SIZE_BUCKETS`]).
    pub sizes: [u64; SIZE_BUCKETS],
    pub peak_live: u64,
    /// The events replayed when the client first held `peak_live`.
    pub peak_live_at: u64,
    pub peak_held: u64,
    /// The events replayed when the handler first held `peak_held`.
    pub peak_held_at: u64,
    /// What the handler held from the host when the client held the most.
    pub held_at_peak_live: u64,
    /// One per mark of the trace, and one for the events before the first mark, in
    /// order; the replay's last phase ends where it stopped.
    pub phases: Vec<Phase>,
    /// Blocks the trace left live after its last event (it never freed them), per size
    /// bucket ([`SIZE_BUCKETS`]): `(blocks, bytes)`.
    pub left_live: Vec<(u64, u64)>,
    /// The most held/live seen after any event, `None` if the client never held a
    /// byte.
    pub peak_ratio: Option<f64>,
    /// Bytes live and held after the last replayed event (before the replay frees
    /// what the trace left live).
    pub final_live: u64,
    pub final_held: u64,
    /// Where what the handler held went when it held the most, by size class; filled
    /// by the caller with [`holdings_at`] (a second replay, up to [`Self::peak_held_at`]).
    pub holdings: Option<Holdings>,
    /// Per-event time: median, 99th percentile and most, in nanoseconds.
    pub ns_median: u64,
    pub ns_p99: u64,
    pub ns_max: u64,
}

impl Timeline {
    /// Held/live at the end of the trace; `None` when the client held nothing then.
    pub fn final_ratio(&self) -> Option<f64> {
        ratio(self.final_held, self.final_live)
    }

    /// Held/live when the client held the most.
    pub fn ratio_at_peak_live(&self) -> Option<f64> {
        ratio(self.held_at_peak_live, self.peak_live)
    }

    /// The first failure, as the report words it: `line N: `op id size`: error`, the
    /// leak found after the last event, or the requests answered out of memory (each an
    /// error the program would have seen there).
    pub fn failure_text(&self) -> Option<String> {
        match (&self.replay.failure, &self.replay.leak) {
            (Some((event, error)), _) => Some(format!("{event}: {error}")),
            (None, Some(leak)) => Some(format!("after the last event: {leak}")),
            (None, None) => self.ran_out_text(),
        }
    }

    /// Whether the replay did not run as the program did: it failed, leaked, or
    /// answered a request out of memory that the program had served.
    pub fn failed(&self) -> bool {
        self.replay.failed() || self.replay.out_of_memory > 0
    }

    /// The requests answered out of memory, as the report words them.
    pub fn ran_out_text(&self) -> Option<String> {
        match self.replay.out_of_memory {
            0 => None,
            n => Some(format!(
                "ran out of memory {n} time{} (the program would have seen an out-of-memory \
                 error there)",
                if n == 1 { "" } else { "s" }
            )),
        }
    }
}

fn ratio(held: u64, live: u64) -> Option<f64> {
    (live > 0).then(|| held as f64 / live as f64)
}

fn held_from_host(handler: &Handler) -> (usize, u64) {
    handler
        .held_from_host()
        .expect("a handler this process's live threads called is reachable")
}

/// What a wasm chain holds from the host's memory, for [`timeline`].
pub fn chain_held(handler: &Handler) -> impl FnMut() -> u64 + '_ {
    move || held_from_host(handler).1
}

/// What a native handler ([`crate::NumpyDefault`]) holds from the C library, for
/// [`timeline`]: its live bytes, which it counts as the C library's usable sizes (the
/// blocks in its small-block cache are not counted).
pub fn native_held(handler: &dyn MemHandler) -> impl FnMut() -> u64 + '_ {
    move || stats_of(handler).live_bytes
}

/// Replay `events` through `handler` on this thread, in trace order (the recorded
/// threads are ignored), timing every event and reading `held_from_host` after each.
/// Stops at the first failing event, as [`crate::trace::replay_trace`] does; every
/// block still live at the end is freed, so the handler is left empty.
pub fn timeline(
    label: &str,
    handler: &dyn MemHandler,
    held_from_host: impl FnMut() -> u64,
    events: &[Event],
) -> Timeline {
    timeline_counted(
        label,
        handler,
        held_from_host,
        Replayed::held(events, &[]),
        &AtomicU64::new(0),
    )
}

/// What a timeline replays: the events, as many as `len` (which sets the charts'
/// windows; the events may come one at a time from a trace of any length), and the
/// marks that divide them into [`Phase`]s.
#[derive(Debug)]
pub struct Replayed<'a, I> {
    pub events: I,
    pub len: u64,
    pub marks: &'a [Mark],
}

impl<'a> Replayed<'a, std::iter::Copied<std::slice::Iter<'a, Event>>> {
    /// A trace held whole: its events, and the marks among them.
    pub fn held(events: &'a [Event], marks: &'a [Mark]) -> Self {
        Replayed {
            events: events.iter().copied(),
            len: events.len() as u64,
            marks,
        }
    }
}

/// [`timeline`] of `replayed`, storing the events replayed so far in `done` after every
/// sample window, so another thread can show progress. Holds the live blocks, the
/// charts' points and one window's times, whatever the trace's length.
pub fn timeline_counted(
    label: &str,
    handler: &dyn MemHandler,
    mut held_from_host: impl FnMut() -> u64,
    replayed: Replayed<'_, impl Iterator<Item = Event>>,
    done: &AtomicU64,
) -> Timeline {
    let phase_named = |name: &str, start: u64| Phase {
        name: name.to_string(),
        start,
        end: start,
        peak_live: 0,
        held_at_peak_live: 0,
        peak_held: 0,
    };
    let mut phases = vec![phase_named("", 0)];
    let mut next_mark = replayed.marks.iter().peekable();
    let (mut peak_live_at, mut peak_held_at) = (0, 0);
    let every = replayed.len.div_ceil(MAX_POINTS as u64).max(1);
    let mut live: FastMap<u64, Held> = FastMap::default();
    let mut replay = ReplayReport::default();
    let mut sizes = [0u64; SIZE_BUCKETS];
    let mut latencies = Latencies::default();
    let mut window_times: Vec<u32> = Vec::with_capacity(every.min(1 << 20) as usize);
    let mut samples = Vec::with_capacity(MAX_POINTS + 1);
    let empty_window = |end| Sample {
        end,
        live: 0,
        held: 0,
        ratio: 0.0,
        ns_per_event: 0.0,
        ns_median: 0,
    };
    let mut window = empty_window(0);
    let (mut live_bytes, mut held) = (0u64, held_from_host());
    let (mut peak_live, mut peak_held, mut held_at_peak_live) = (0, held, held);
    let mut peak_ratio: Option<f64> = None;
    let mut replayed_events = 0u64;
    let mut close_window = |window: &mut Sample, times: &mut Vec<u32>, end: u64| {
        done.store(end, Ordering::Relaxed);
        let sum: u64 = times.iter().map(|&t| u64::from(t)).sum();
        let median = match times.is_empty() {
            true => 0,
            false => {
                let middle = times.len() / 2;
                *times.select_nth_unstable(middle).1
            }
        };
        samples.push(Sample {
            end,
            ns_per_event: sum as f64 / times.len().max(1) as f64,
            ns_median: median,
            ..*window
        });
        *window = empty_window(end);
        times.clear();
    };
    for (i, event) in replayed.events.enumerate() {
        let i = i as u64;
        while let Some(mark) = next_mark.next_if(|m| m.at <= i) {
            phases.push(phase_named(&mark.text, i));
        }
        if event.op != EventOp::Free {
            sizes[size_bucket(event.size)] += 1;
        }
        let before = live.get(&event.id).copied();
        let start = Instant::now();
        let after = replay.apply(handler, &event, before);
        let ns = start.elapsed().as_nanos().min(u32::MAX as u128) as u32;
        match after {
            Some(block) => drop(live.insert(event.id, block)),
            None => drop(live.remove(&event.id)),
        }
        latencies.add(ns);
        window_times.push(ns);
        live_bytes =
            live_bytes - before.map_or(0, |(_, s)| s as u64) + after.map_or(0, |(_, s)| s as u64);
        held = held_from_host();
        replayed_events = i + 1;
        if live_bytes > peak_live {
            (peak_live, held_at_peak_live, peak_live_at) = (live_bytes, held, replayed_events);
        }
        let phase = phases.last_mut().expect("a phase from the start");
        phase.end = replayed_events;
        if live_bytes > phase.peak_live {
            (phase.peak_live, phase.held_at_peak_live) = (live_bytes, held);
        }
        phase.peak_held = phase.peak_held.max(held);
        if held > peak_held {
            (peak_held, peak_held_at) = (held, replayed_events);
        }
        window.live = window.live.max(live_bytes);
        window.held = window.held.max(held);
        if let Some(r) = ratio(held, live_bytes) {
            window.ratio = window.ratio.max(r);
            peak_ratio = Some(peak_ratio.map_or(r, |p| p.max(r)));
        }
        if replayed_events.is_multiple_of(every) || replay.failure.is_some() {
            close_window(&mut window, &mut window_times, replayed_events);
        }
        if replay.failure.is_some() {
            break;
        }
    }
    if !window_times.is_empty() {
        close_window(&mut window, &mut window_times, replayed_events);
    }
    replay.elapsed = Duration::from_nanos(latencies.sum());
    let (ns_median, ns_p99, ns_max) = (
        latencies.quantile(0.5),
        latencies.quantile(0.99),
        latencies.most(),
    );
    let mut left_live = vec![(0, 0); SIZE_BUCKETS];
    for (_, (p, size)) in live.drain() {
        let left = &mut left_live[size_bucket(size as u64)];
        (left.0, left.1) = (left.0 + 1, left.1 + size as u64);
        let _ = handler.free(Some(p), size);
    }
    // A phase no event of the replay reached (after a failure) is not one it served.
    phases.retain(|p| p.end > p.start || p.start == 0);
    replay.stats = stats_of(handler);
    Timeline {
        label: label.to_string(),
        handler: handler.name().to_string(),
        replay,
        every,
        samples,
        sizes,
        peak_live,
        peak_live_at,
        peak_held,
        peak_held_at,
        held_at_peak_live,
        phases,
        left_live,
        holdings: None,
        peak_ratio,
        final_live: live_bytes,
        final_held: held,
        ns_median,
        ns_p99,
        ns_max,
    }
}

/// The bucket of a request of `size` bytes: 0 for 0, else the bit length of `size`.
pub fn size_bucket(size: u64) -> usize {
    (u64::BITS - size.leading_zeros()) as usize
}

/// Where what a handler holds goes, by the size class of the client's blocks: the
/// memory it held from the host at one moment, each host block's bytes shared among the
/// client blocks inside it in proportion to their sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holdings {
    /// The events replayed before the moment.
    pub at: u64,
    /// Per size bucket ([`SIZE_BUCKETS`], of the client's sizes): `(blocks, live bytes,
    /// held bytes)`. Held less live is what that class wastes (headers, rounding, room
    /// kept in its blocks).
    pub classes: Vec<(u64, u64, u64)>,
    /// Host blocks holding no client block at all (free room a policy keeps, caches):
    /// `(blocks, bytes)`.
    pub idle: (u64, u64),
}

/// A handler whose holdings [`holdings_at`] can break down: a wasm chain (its host
/// blocks are its bottom ledger's) or the native default (each client block is a block
/// of the C library, of its usable size, as [`native_held`] counts them).
#[derive(Debug, Clone, Copy)]
pub enum HeldBy<'a> {
    Chain(&'a Handler),
    Native(&'a NumpyDefault),
}

/// Replay the first `at` of `events` through a fresh handler (untimed) and say where
/// what it holds then goes ([`Holdings`]); then free every block, leaving it empty.
/// `at` is a moment a [`timeline`] found, such as [`Timeline::peak_held_at`]: a policy
/// placing the same requests the same way holds the same then.
pub fn holdings_at(
    held_by: HeldBy<'_>,
    events: impl IntoIterator<Item = Event>,
    at: u64,
) -> Holdings {
    let handler: &dyn MemHandler = match held_by {
        HeldBy::Chain(h) => h,
        HeldBy::Native(h) => h,
    };
    let mut live: FastMap<u64, Held> = FastMap::default();
    let mut replay = ReplayReport::default();
    for event in events.into_iter().take(at as usize) {
        let before = live.get(&event.id).copied();
        match replay.apply(handler, &event, before) {
            Some(block) => drop(live.insert(event.id, block)),
            None => drop(live.remove(&event.id)),
        }
        if replay.failure.is_some() {
            break;
        }
    }
    let mut client: Vec<(u64, u64)> = live
        .values()
        .map(|&(p, size)| (p.as_ptr() as u64, size as u64))
        .collect();
    client.sort_unstable();
    let mut host: Vec<(u64, u64)> = match held_by {
        HeldBy::Chain(h) => h
            .host_blocks()
            .expect("a handler this thread called is reachable"),
        // Every client block is live and came from this native handler's C malloc.
        HeldBy::Native(_) => live
            .values()
            .map(|&(p, _)| (p.as_ptr() as u64, crate::native::usable_size(p)))
            .collect(),
    };
    host.sort_unstable();
    let holdings = attribute(replay.events, &client, &host);
    for (_, (p, size)) in live.drain() {
        let _ = handler.free(Some(p), size);
    }
    holdings
}

/// Share each host block among the client blocks inside it. Both lists by address.
fn attribute(at: u64, client: &[(u64, u64)], host: &[(u64, u64)]) -> Holdings {
    let mut classes = vec![(0, 0, 0); SIZE_BUCKETS];
    let mut idle = (0, 0);
    for &(_, size) in client {
        let class = &mut classes[size_bucket(size)];
        (class.0, class.1) = (class.0 + 1, class.1 + size);
    }
    let mut next = 0;
    for &(start, len) in host {
        let end = start.saturating_add(len);
        while next < client.len() && client[next].0 < start {
            next += 1;
        }
        let inside: Vec<(u64, u64)> = client[next..]
            .iter()
            .take_while(|&&(addr, _)| addr < end)
            .copied()
            .collect();
        let total: u128 = inside.iter().map(|&(_, size)| u128::from(size)).sum();
        if total == 0 {
            (idle.0, idle.1) = (idle.0 + 1, idle.1 + len);
            continue;
        }
        // Integer shares that add up to the block: the last block takes the remainder.
        let mut given = 0;
        for (i, &(_, size)) in inside.iter().enumerate() {
            let share = match i + 1 == inside.len() {
                true => len - given,
                false => (u128::from(len) * u128::from(size) / total) as u64,
            };
            given += share;
            classes[size_bucket(size)].2 += share;
        }
    }
    Holdings { at, classes, idle }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_block_is_shared_among_the_client_blocks_inside_it_by_size() {
        // Host blocks: [0, 100) holds blocks of 10 and 30 bytes; [100, 164) holds one of
        // 64; [1000, 1050) holds none.
        let client = [(0, 10), (40, 30), (100, 64)];
        let host = [(0, 100), (100, 64), (1000, 50)];
        let h = attribute(7, &client, &host);
        assert_eq!(h.at, 7);
        assert_eq!(h.classes[size_bucket(10)], (1, 10, 25), "a quarter of 100");
        assert_eq!(
            h.classes[size_bucket(30)],
            (1, 30, 75),
            "the rest of the block"
        );
        assert_eq!(
            h.classes[size_bucket(64)],
            (1, 64, 64),
            "a block of its own"
        );
        assert_eq!(h.idle, (1, 50));
        let held: u64 = h.classes.iter().map(|c| c.2).sum::<u64>() + h.idle.1;
        assert_eq!(held, 214, "every host byte is somewhere");
    }
}
