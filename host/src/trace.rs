//! Allocation traces: record any handler's calls in the format of
//! `shared/traces/README.md` (`op id size thread`, one event a line), and replay a trace
//! through any handler, naming the event that fails; [`timeline`] replays one for a
//! report, event by event.

pub mod timeline;

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::io::{BufRead, BufReader, Read, Seek, Write};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::Error;
use crate::fasthash::FastMap;
use crate::memhandler::MemHandler;
use crate::memhandler::Stats;
use crate::nep49::SharedHandler;

/// The id NumPy's recorder writes for a pointer it never saw allocated.
pub const UNKNOWN_ID: u64 = u64::MAX;

/// One recorded call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub op: EventOp,
    /// Logical block id, stable across realloc; 0 is NULL.
    pub id: u64,
    /// Bytes: the (new) size, or for `free` what the client passed.
    pub size: u64,
    /// The recording's number for the thread that made the call (1 when the line has
    /// none).
    pub thread: u32,
    /// The line it came from, for error messages.
    pub line: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventOp {
    Malloc,
    Calloc,
    Realloc,
    Free,
}

/// A trace that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The OS error is the message itself, not a cause printed after it again.
    #[error("cannot read the trace: {0}")]
    Io(std::io::Error),
    #[error("line {line}: {message}")]
    Syntax { line: u32, message: String },
}

impl From<std::io::Error> for TraceError {
    fn from(error: std::io::Error) -> TraceError {
        TraceError::Io(error)
    }
}

/// A comment line of a trace between its events: NumPy's recorder writes the name of
/// each test before that test's events, so a mark names the phase that follows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    /// The events before it.
    pub at: u64,
    /// The comment, without its `#` (control characters replaced: a trace is input).
    pub text: String,
}

/// A trace's events and the marks between them.
#[derive(Debug, Default)]
pub struct Trace {
    pub events: Vec<Event>,
    pub marks: Vec<Mark>,
}

/// Read a trace (plain text, or gzip when the file starts with the gzip magic).
pub fn read_trace(path: impl AsRef<Path>) -> Result<Vec<Event>, TraceError> {
    read_trace_marked(path).map(|trace| trace.events)
}

/// [`read_trace`], with the marks.
pub fn read_trace_marked(path: impl AsRef<Path>) -> Result<Trace, TraceError> {
    let mut file = std::fs::File::open(path)?;
    let mut magic = [0u8; 2];
    let gz = file.read(&mut magic)? == 2 && magic == [0x1f, 0x8b];
    file.seek(std::io::SeekFrom::Start(0))?;
    if gz {
        parse_trace_marked(BufReader::with_capacity(
            1 << 20,
            flate2::read::GzDecoder::new(file),
        ))
    } else {
        parse_trace_marked(BufReader::with_capacity(1 << 20, file))
    }
}

/// Parse the text form.
pub fn parse_trace(input: impl BufRead) -> Result<Vec<Event>, TraceError> {
    parse_trace_marked(input).map(|trace| trace.events)
}

/// [`parse_trace`], with the marks: comment lines after the first event (those before
/// it are the file's header).
pub fn parse_trace_marked(mut input: impl BufRead) -> Result<Trace, TraceError> {
    let mut trace = Trace::default();
    let events = &mut trace.events;
    let mut line = String::new();
    let mut n = 0u32;
    loop {
        line.clear();
        if input.read_line(&mut line)? == 0 {
            return Ok(trace);
        }
        n += 1;
        let text = line.trim();
        if let Some(comment) = text.strip_prefix('#') {
            if !events.is_empty() {
                trace.marks.push(Mark {
                    at: events.len() as u64,
                    text: crate::untrusted::escape(comment.trim()),
                });
            }
            continue;
        }
        if text.is_empty() {
            continue;
        }
        let bad = |message: String| TraceError::Syntax { line: n, message };
        let mut words = text.split_ascii_whitespace();
        let op = match words.next() {
            Some("m") => EventOp::Malloc,
            Some("c") => EventOp::Calloc,
            Some("r") => EventOp::Realloc,
            Some("f") => EventOp::Free,
            Some(other) => {
                return Err(bad(format!(
                    "`{other}` is not an operation: a line is `m`, `c`, `r` or `f`, then id, \
                     size and (optionally) thread"
                )));
            }
            None => unreachable!("a line that is not empty has a first word"),
        };
        let mut number = |what: &str| -> Result<u64, TraceError> {
            let w = words.next().ok_or_else(|| bad(format!("missing {what}")))?;
            w.parse().map_err(|e| bad(format!("{what} `{w}`: {e}")))
        };
        let id = number("id")?;
        let size = number("size")?;
        let thread = match words.next() {
            None => 1,
            Some(w) => w.parse().map_err(|e| bad(format!("thread `{w}`: {e}")))?,
        };
        events.push(Event {
            op,
            id,
            size,
            thread,
            line: n,
        });
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = match self.op {
            EventOp::Malloc => 'm',
            EventOp::Calloc => 'c',
            EventOp::Realloc => 'r',
            EventOp::Free => 'f',
        };
        write!(f, "line {}: `{op} {} {}`", self.line, self.id, self.size)
    }
}

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
fn stats_of(handler: &dyn MemHandler) -> Stats {
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
    let first = events.first().map_or(1, |e| e.thread);
    let mut report = match events.iter().all(|e| e.thread == first) {
        true => replay_on_one_thread(handler, events, done),
        false => replay_on_recorded_threads(handler, events, done),
    };
    report.stats = stats_of(handler);
    report
}

fn replay_on_one_thread(
    handler: &dyn MemHandler,
    events: &[Event],
    done: &AtomicU64,
) -> ReplayReport {
    // The replay's own bookkeeping should cost little next to the handler it measures.
    let mut live: FastMap<u64, Held> =
        FastMap::with_capacity_and_hasher(1 << 16, Default::default());
    let mut report = ReplayReport::default();
    let start = Instant::now();
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
    report.elapsed = start.elapsed();
    for (_, (p, size)) in live.drain() {
        let _ = handler.free(Some(p), size);
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

fn replay_on_recorded_threads(
    handler: &dyn MemHandler,
    events: &[Event],
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
        by_thread.entry(event.thread).or_default().push(i as u32);
    }
    let schedule = Schedule {
        block_of,
        before,
        done: events.iter().map(|_| AtomicBool::new(false)).collect(),
        held: (0..blocks.len()).map(|_| Mutex::new(None)).collect(),
        stop: AtomicBool::new(false),
    };
    let start = Instant::now();
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
    let mut report = ReplayReport {
        elapsed: start.elapsed(),
        ..ReplayReport::default()
    };
    for r in reports {
        report.merge(r);
    }
    for held in schedule.held {
        if let Some((addr, size)) = held.into_inner() {
            let _ = handler.free(NonNull::new(addr as *mut u8), size);
        }
    }
    report
}

/// One recorded thread's events, in order, each after the event before it on its block.
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

/// What a [`Watched`] handler tells its watcher after each call it forwarded and that
/// did not fail: the operation, the block before and after (`None` for none), and the
/// size (a free's: what the client passed). A `realloc` answered "none" is not told.
pub trait Watcher: Send + Sync {
    fn served(&self, op: EventOp, old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize);
}

impl<W: Watcher + ?Sized> Watcher for &W {
    fn served(&self, op: EventOp, old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize) {
        (**self).served(op, old, new, size);
    }
}

/// `handler`, with `watcher` told about every call it serves: a trace being recorded
/// ([`Recorder`]) or an event hook ([`crate::WasmHook`]).
#[derive(Debug)]
pub struct Watched<H, W> {
    pub handler: H,
    pub watcher: W,
}

impl<H, W> MemHandler for Watched<H, W>
where
    H: std::ops::Deref<Target: MemHandler> + Send + Sync + fmt::Debug,
    W: Watcher + fmt::Debug,
{
    fn name(&self) -> &str {
        self.handler.name()
    }
    fn version(&self) -> u8 {
        self.handler.version()
    }
    fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.handler.malloc(size)?;
        self.watcher.served(EventOp::Malloc, None, p, size);
        Ok(p)
    }
    fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.handler.calloc(nelem, elsize)?;
        let size = nelem.saturating_mul(elsize);
        self.watcher.served(EventOp::Calloc, None, p, size);
        Ok(p)
    }
    fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.handler.realloc(ptr, new_size)?;
        if p.is_some() {
            self.watcher.served(EventOp::Realloc, ptr, p, new_size);
        }
        Ok(p)
    }
    fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        self.handler.free(ptr, size)?;
        self.watcher.served(EventOp::Free, ptr, None, size);
        Ok(())
    }
    fn stats(&self) -> Result<Stats, Error> {
        self.handler.stats()
    }
    fn usable(&self) -> Result<(), Error> {
        self.handler.usable()
    }
}

/// A handler that writes every call it forwards to `handler` as a trace.
pub type Recorder = Watched<SharedHandler, TraceWriter>;

/// The trace a [`Recorder`] writes.
pub struct TraceWriter {
    state: Mutex<RecorderState>,
}

struct RecorderState {
    out: Box<dyn Write + Send>,
    ids: HashMap<usize, u64>,
    next_id: u64,
    threads: HashMap<std::thread::ThreadId, u32>,
    error: Option<std::io::Error>,
}

impl fmt::Debug for TraceWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TraceWriter").finish_non_exhaustive()
    }
}

impl Recorder {
    /// Record the calls made to `inner` into `out`.
    pub fn new(inner: SharedHandler, out: impl Write + Send + 'static) -> Recorder {
        let mut out: Box<dyn Write + Send> = Box::new(out);
        let header = "# op(m=malloc,c=calloc,r=realloc,f=free) ptr-id size thread; \
                      free(NULL)->id 0; unknown ptr->id 18446744073709551615\n";
        let error = out.write_all(header.as_bytes()).err();
        Watched {
            handler: inner,
            watcher: TraceWriter {
                state: Mutex::new(RecorderState {
                    out,
                    ids: HashMap::new(),
                    next_id: 1,
                    threads: HashMap::new(),
                    error,
                }),
            },
        }
    }

    /// Flush the trace; the first write error, if any, is returned here.
    pub fn finish(&self) -> std::io::Result<()> {
        let mut state = self.watcher.state.lock();
        if let Some(e) = state.error.take() {
            return Err(e);
        }
        state.out.flush()
    }
}

impl Watcher for TraceWriter {
    fn served(&self, op: EventOp, old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize) {
        let op = match op {
            EventOp::Malloc => 'm',
            EventOp::Calloc => 'c',
            EventOp::Realloc => 'r',
            EventOp::Free => 'f',
        };
        let mut st = self.state.lock();
        let next_thread = st.threads.len() as u32 + 1;
        let thread = *st
            .threads
            .entry(std::thread::current().id())
            .or_insert(next_thread);
        let key = |p: NonNull<u8>| p.as_ptr() as usize;
        let id = match (op, old, new) {
            ('f', None, _) => 0,
            ('f', Some(p), _) => st.ids.remove(&key(p)).unwrap_or(UNKNOWN_ID),
            (_, Some(p), Some(q)) => {
                let id = st.ids.remove(&key(p)).unwrap_or(UNKNOWN_ID);
                st.ids.insert(key(q), id);
                id
            }
            (_, _, Some(q)) => {
                let id = st.next_id;
                st.next_id += 1;
                st.ids.insert(key(q), id);
                id
            }
            _ => return,
        };
        let line = format!("{op} {id} {size} {thread}\n");
        if st.error.is_none() {
            st.error = st.out.write_all(line.as_bytes()).err();
        }
    }
}
