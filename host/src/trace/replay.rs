//! Replaying a trace through a handler: on one thread, or on as many as recorded with
//! each block's events in their recorded order; the report names the first event that
//! failed, and what the handler still holds after it.

use std::collections::hash_map::Entry;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{Event, EventOp};
use crate::error::Error;
use crate::fasthash::FastMap;
use crate::memhandler::{MemHandler, Stats};

/// What a replay saw.
#[derive(Debug, Clone, Default)]
pub struct ReplayReport {
    pub events: u64,
    pub elapsed: Duration,
    /// The handler's counters at the end (peak bytes, size corrections, ...).
    pub stats: Stats,
    /// Frees and reallocs of ids the trace never allocated (their allocation fell in an
    /// unsampled test); frees are skipped, reallocs act as malloc.
    pub unknown_ids: u64,
    /// `free(NULL, size)` events, passed on (a no-op).
    pub null_frees: u64,
    /// Requests the handler answered "none".
    pub out_of_memory: u64,
    /// The first event that failed and why; the replay stops there.
    pub failure: Option<(Event, Error)>,
    /// What a chain still held from the host after the replay freed every block and
    /// trimmed it: a leak ([`leak_after_replay`]). Set by whoever replayed a chain.
    pub leak: Option<Error>,
}

/// After a replay that freed every block of the trace, the leak of `handler`'s chain if it
/// has one: it is trimmed, and whatever it still holds from the host is named, as
/// `allocbox check` names it. A failing trim is the answer too, and so is a policy that
/// fails when asked for its counters (`lifecycle.report`), which stops the chain.
pub fn leak_after_replay(handler: &crate::handler::Handler) -> Option<Error> {
    if let Err(e) = handler.trim().and_then(|()| handler.leak_check()) {
        return Some(e);
    }
    let _ = handler.link_stats();
    handler.failure().map(|cause| (*cause).clone())
}

impl ReplayReport {
    /// The first event that failed, else the leak found after the last one.
    pub fn failed(&self) -> bool {
        self.failure.is_some() || self.leak.is_some()
    }

    pub fn ns_per_event(&self) -> f64 {
        self.elapsed.as_nanos() as f64 / self.events.max(1) as f64
    }
}

/// A block the replay holds for an id: where, and the size it was (re)allocated with.
pub(crate) type Held = (NonNull<u8>, usize);

impl ReplayReport {
    /// Replay one event against the block held for its id; returns what is held for the
    /// id afterwards. A failure is kept in `self.failure` (the error is large: returning
    /// it by value on every event cost the replay loop more than some handlers).
    pub(crate) fn apply(
        &mut self,
        handler: &dyn MemHandler,
        event: &Event,
        held: Option<Held>,
    ) -> Option<Held> {
        let (after, result) = self.call(handler, event, held);
        if let Err(e) = result {
            self.failure = Some((*event, e));
        }
        after
    }

    #[inline(always)]
    fn call(
        &mut self,
        handler: &dyn MemHandler,
        event: &Event,
        held: Option<Held>,
    ) -> (Option<Held>, Result<(), Error>) {
        let size = usize::try_from(event.size).unwrap_or(usize::MAX);
        self.events += 1;
        match event.op {
            EventOp::Malloc | EventOp::Calloc => {
                let got = match event.op {
                    EventOp::Malloc => handler.malloc(size),
                    _ => handler.calloc(size, 1),
                };
                match got {
                    Ok(Some(p)) => {
                        if let Some((old, old_size)) = held {
                            // A reused id: the trace lost the free; give the old block back.
                            let _ = handler.free(Some(old), old_size);
                        }
                        (Some((p, size)), Ok(()))
                    }
                    Ok(None) => {
                        self.out_of_memory += 1;
                        (held, Ok(()))
                    }
                    Err(e) => (held, Err(e)),
                }
            }
            EventOp::Realloc => {
                let old = held.map(|(p, _)| p);
                if old.is_none() {
                    self.unknown_ids += 1;
                }
                match handler.realloc(old, size) {
                    Ok(Some(p)) => (Some((p, size)), Ok(())),
                    Ok(None) => {
                        self.out_of_memory += 1;
                        (held, Ok(()))
                    }
                    Err(e) => (held, Err(e)),
                }
            }
            EventOp::Free if event.id == 0 => {
                self.null_frees += 1;
                (held, handler.free(None, size))
            }
            // The trace's size, not the recorded one: wrong-size frees are part of what
            // is replayed; allocbox's ledger corrects and counts them.
            EventOp::Free => match held {
                Some((p, _)) => (None, handler.free(Some(p), size)),
                None => {
                    self.unknown_ids += 1;
                    (None, Ok(()))
                }
            },
        }
    }

    /// Add what another thread of the same replay saw; the earliest failure wins.
    fn merge(&mut self, other: ReplayReport) {
        self.events += other.events;
        self.unknown_ids += other.unknown_ids;
        self.null_frees += other.null_frees;
        self.out_of_memory += other.out_of_memory;
        if let Some((event, e)) = other.failure
            && self
                .failure
                .as_ref()
                .is_none_or(|(f, _)| event.line < f.line)
        {
            self.failure = Some((event, e));
        }
    }
}

/// `handler`'s statistics, for a replay in this process: a handler whose calls all came
/// from this process's live threads is always reachable.
pub(super) fn stats_of(handler: &dyn MemHandler) -> Stats {
    handler
        .stats()
        .expect("a handler this process's live threads called is reachable")
}

/// Replay `events` through `handler`. A trace recorded on one thread is replayed on
/// this thread; a trace with several threads is replayed with one thread each, every
/// event waiting for the event before it on the same block, so each block's life runs
/// in the recorded order while the threads run at once. Every block still live at the
/// end is freed (outside the timing), so the handler is left empty.
pub fn replay_trace(handler: &dyn MemHandler, events: &[Event]) -> ReplayReport {
    replay_trace_counted(handler, events, &AtomicU64::new(0))
}

/// Events between two additions to a replay's progress counter: rare enough to cost
/// nothing next to the events, often enough for a progress bar.
const PROGRESS_STRIDE: u64 = 1 << 14;

/// [`replay_trace`], adding the events replayed so far to `done` as it goes (in steps of
/// a few thousand), so another thread can show progress.
pub fn replay_trace_counted(
    handler: &dyn MemHandler,
    events: &[Event],
    done: &AtomicU64,
) -> ReplayReport {
    replay_events(handler, events.iter().copied(), done)
}

/// Events a replay takes at once from a trace read one event at a time: a window's
/// events on several threads wait for each other within the window, and the next
/// window starts when every thread is done with this one.
const WINDOW: usize = 1 << 18;

/// [`replay_trace_counted`] of events read one at a time, from a trace of any length:
/// holding a window of them and the blocks live.
pub fn replay_events(
    handler: &dyn MemHandler,
    events: impl IntoIterator<Item = Event>,
    done: &AtomicU64,
) -> ReplayReport {
    let mut events = events.into_iter();
    // The replay's own bookkeeping should cost little next to the handler it measures.
    let mut live: FastMap<u64, Held> =
        FastMap::with_capacity_and_hasher(1 << 16, Default::default());
    let mut report = ReplayReport::default();
    let mut window = Vec::with_capacity(WINDOW);
    loop {
        window.clear();
        window.extend(events.by_ref().take(WINDOW));
        let Some(first) = window.first().map(|e| e.thread) else {
            break;
        };
        let start = Instant::now();
        let part = match window.iter().all(|e| e.thread == first) {
            true => replay_on_one_thread(handler, &window, &mut live, done),
            false => replay_on_recorded_threads(handler, &window, &mut live, done),
        };
        report.elapsed += start.elapsed();
        report.merge(part);
        if report.failure.is_some() {
            break;
        }
    }
    for (_, (p, size)) in live.drain() {
        let _ = handler.free(Some(p), size);
    }
    report.stats = stats_of(handler);
    report
}

/// One window on this thread, `live` the blocks held for ids before and after it.
fn replay_on_one_thread(
    handler: &dyn MemHandler,
    events: &[Event],
    live: &mut FastMap<u64, Held>,
    done: &AtomicU64,
) -> ReplayReport {
    let mut report = ReplayReport::default();
    for (i, event) in events.iter().enumerate() {
        if i as u64 % PROGRESS_STRIDE == PROGRESS_STRIDE - 1 {
            done.fetch_add(PROGRESS_STRIDE, Ordering::Relaxed);
        }
        // One lookup per event: the entry stays open across the call.
        match live.entry(event.id) {
            Entry::Occupied(mut place) => match report.apply(handler, event, Some(*place.get())) {
                Some(held) => *place.get_mut() = held,
                None => drop(place.remove()),
            },
            Entry::Vacant(place) => {
                if let Some(held) = report.apply(handler, event, None) {
                    place.insert(held);
                }
            }
        }
        if report.failure.is_some() {
            break;
        }
    }
    report
}

/// What the threads of a replay share: per block id, the block held for it; per event,
/// the event before it on the same id and whether it is done.
struct Schedule {
    block_of: Vec<u32>,
    before: Vec<Option<u32>>,
    done: Vec<AtomicBool>,
    /// `(address, size)`: pointers are not `Send`.
    held: Vec<Mutex<Option<(usize, usize)>>>,
    stop: AtomicBool,
}

/// The most threads a replay runs at once. A recording names a new thread for every
/// one the program started, over its whole run: past this, recorded threads share a
/// replay thread (each keeps its order, and every event still waits for the one before
/// it on its block, so the earliest unfinished event can always run).
pub const MAX_REPLAY_THREADS: u32 = 64;

/// One window on as many threads as it names, `live` the blocks held for ids before
/// and after it.
fn replay_on_recorded_threads(
    handler: &dyn MemHandler,
    events: &[Event],
    live: &mut FastMap<u64, Held>,
    done: &AtomicU64,
) -> ReplayReport {
    let mut blocks: FastMap<u64, u32> = FastMap::default();
    let mut last_event: Vec<Option<u32>> = Vec::new();
    let mut block_of = Vec::with_capacity(events.len());
    let mut before = Vec::with_capacity(events.len());
    let mut by_thread: std::collections::BTreeMap<u32, Vec<u32>> = Default::default();
    for (i, event) in events.iter().enumerate() {
        let next = blocks.len() as u32;
        let block = *blocks.entry(event.id).or_insert(next);
        if block as usize == last_event.len() {
            last_event.push(None);
        }
        block_of.push(block);
        before.push(last_event[block as usize].replace(i as u32));
        let worker = event.thread % MAX_REPLAY_THREADS;
        by_thread.entry(worker).or_default().push(i as u32);
    }
    // The window's blocks start as the windows before left them.
    let mut held: Vec<Mutex<Option<(usize, usize)>>> =
        (0..blocks.len()).map(|_| Mutex::new(None)).collect();
    for (id, &block) in &blocks {
        if let Some((p, size)) = live.remove(id) {
            held[block as usize] = Mutex::new(Some((p.as_ptr() as usize, size)));
        }
    }
    let schedule = Schedule {
        block_of,
        before,
        done: events.iter().map(|_| AtomicBool::new(false)).collect(),
        held,
        stop: AtomicBool::new(false),
    };
    let reports: Vec<ReplayReport> = std::thread::scope(|s| {
        let workers: Vec<_> = by_thread
            .values()
            .map(|mine| s.spawn(|| replay_thread(handler, events, mine, &schedule, done)))
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a replay thread panicked"))
            .collect()
    });
    let mut report = ReplayReport::default();
    for r in reports {
        report.merge(r);
    }
    for (id, block) in blocks {
        let held = schedule.held[block as usize].lock().take();
        if let Some((addr, size)) = held
            && let Some(p) = NonNull::new(addr as *mut u8)
        {
            live.insert(id, (p, size));
        }
    }
    report
}

/// One replay thread's events (a recorded thread's, or several's), in order, each after
/// the event before it on its block.
fn replay_thread(
    handler: &dyn MemHandler,
    events: &[Event],
    mine: &[u32],
    schedule: &Schedule,
    done: &AtomicU64,
) -> ReplayReport {
    let mut report = ReplayReport::default();
    for (n, &i) in mine.iter().enumerate() {
        if n as u64 % PROGRESS_STRIDE == PROGRESS_STRIDE - 1 {
            done.fetch_add(PROGRESS_STRIDE, Ordering::Relaxed);
        }
        let i = i as usize;
        if let Some(before) = schedule.before[i] {
            // Events wait only for earlier events, so the earliest unfinished one can
            // always run: this ends unless a thread stopped at a failure.
            while !schedule.done[before as usize].load(Ordering::Acquire) {
                if schedule.stop.load(Ordering::Relaxed) {
                    return report;
                }
                std::thread::yield_now();
            }
        }
        let mut slot = schedule.held[schedule.block_of[i] as usize].lock();
        let held = slot.and_then(|(a, size)| Some((NonNull::new(a as *mut u8)?, size)));
        let held = report.apply(handler, &events[i], held);
        *slot = held.map(|(p, size)| (p.as_ptr() as usize, size));
        drop(slot);
        schedule.done[i].store(true, Ordering::Release);
        if report.failure.is_some() {
            schedule.stop.store(true, Ordering::Relaxed);
            return report;
        }
        if schedule.stop.load(Ordering::Relaxed) {
            return report;
        }
    }
    report
}
