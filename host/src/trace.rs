//! Allocation traces: record any handler's calls in the format of
//! `shared/traces/README.md` (`op id size thread`, one event a line), and replay a trace
//! through any handler, naming the event that fails.

use std::collections::HashMap;
use std::fmt;
use std::io::{BufRead, BufReader, Read, Seek, Write};
use std::path::Path;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::Error;
use crate::fasthash::FastMap;
use crate::handler::Stats;
use crate::nep49::{MemHandler, SharedHandler};

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
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    #[error("line {line}: {message}")]
    Syntax { line: u32, message: String },
}

/// Read a trace (plain text, or gzip when the file starts with the gzip magic).
pub fn read_trace(path: impl AsRef<Path>) -> Result<Vec<Event>, TraceError> {
    let mut file = std::fs::File::open(path)?;
    let mut magic = [0u8; 2];
    let gz = file.read(&mut magic)? == 2 && magic == [0x1f, 0x8b];
    file.seek(std::io::SeekFrom::Start(0))?;
    if gz {
        parse_trace(BufReader::with_capacity(
            1 << 20,
            flate2::read::GzDecoder::new(file),
        ))
    } else {
        parse_trace(BufReader::with_capacity(1 << 20, file))
    }
}

/// Parse the text form.
pub fn parse_trace(mut input: impl BufRead) -> Result<Vec<Event>, TraceError> {
    let mut events = Vec::new();
    let mut line = String::new();
    let mut n = 0u32;
    loop {
        line.clear();
        if input.read_line(&mut line)? == 0 {
            return Ok(events);
        }
        n += 1;
        let text = line.trim();
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        let bad = |message: String| TraceError::Syntax { line: n, message };
        let mut words = text.split_ascii_whitespace();
        let op = match words.next() {
            Some("m") => EventOp::Malloc,
            Some("c") => EventOp::Calloc,
            Some("r") => EventOp::Realloc,
            Some("f") => EventOp::Free,
            other => return Err(bad(format!("unknown operation {other:?}"))),
        };
        let mut number = |what: &str| -> Result<u64, TraceError> {
            let w = words.next().ok_or_else(|| bad(format!("missing {what}")))?;
            w.parse().map_err(|e| bad(format!("{what} `{w}`: {e}")))
        };
        let id = number("id")?;
        let size = number("size")?;
        events.push(Event {
            op,
            id,
            size,
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
}

impl ReplayReport {
    pub fn ns_per_event(&self) -> f64 {
        self.elapsed.as_nanos() as f64 / self.events.max(1) as f64
    }
}

/// Replay `events` through `handler`, in one thread. Every block still live at the end
/// is freed (outside the timing), so the handler is left empty.
pub fn replay_trace(handler: &dyn MemHandler, events: &[Event]) -> ReplayReport {
    // The replay's own bookkeeping should cost little next to the handler it measures.
    let mut live: FastMap<u64, (NonNull<u8>, usize)> =
        FastMap::with_capacity_and_hasher(1 << 16, Default::default());
    let mut report = ReplayReport::default();
    let start = Instant::now();
    for event in events {
        let size = usize::try_from(event.size).unwrap_or(usize::MAX);
        let result = match event.op {
            EventOp::Malloc | EventOp::Calloc => {
                let got = if event.op == EventOp::Malloc {
                    handler.malloc(size)
                } else {
                    handler.calloc(size, 1)
                };
                got.map(|p| match p {
                    Some(p) => {
                        if let Some((old, old_size)) = live.insert(event.id, (p, size)) {
                            // A reused id: the trace lost the free; give the old block back.
                            let _ = handler.free(Some(old), old_size);
                        }
                    }
                    None => report.out_of_memory += 1,
                })
            }
            EventOp::Realloc => {
                let old = live.get(&event.id).map(|&(p, _)| p);
                if old.is_none() {
                    report.unknown_ids += 1;
                }
                handler.realloc(old, size).map(|p| match p {
                    Some(p) => {
                        live.insert(event.id, (p, size));
                    }
                    None => report.out_of_memory += 1,
                })
            }
            EventOp::Free if event.id == 0 => {
                report.null_frees += 1;
                handler.free(None, size)
            }
            EventOp::Free => match live.remove(&event.id) {
                // The trace's size, not the recorded one: wrong-size frees are part of
                // what is replayed; allocbox's ledger corrects and counts them.
                Some((p, _)) => handler.free(Some(p), size),
                None => {
                    report.unknown_ids += 1;
                    Ok(())
                }
            },
        };
        report.events += 1;
        if let Err(e) = result {
            report.failure = Some((*event, e));
            break;
        }
    }
    report.elapsed = start.elapsed();
    for (_, (p, size)) in live.drain() {
        let _ = handler.free(Some(p), size);
    }
    report.stats = handler.stats();
    report
}

/// A handler that writes every call it forwards to `inner` as a trace.
pub struct Recorder {
    inner: SharedHandler,
    state: Mutex<RecorderState>,
}

struct RecorderState {
    out: Box<dyn Write + Send>,
    ids: HashMap<usize, u64>,
    next_id: u64,
    threads: HashMap<std::thread::ThreadId, u32>,
    error: Option<std::io::Error>,
}

impl fmt::Debug for Recorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recorder")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl Recorder {
    /// Record the calls made to `inner` into `out`.
    pub fn new(inner: SharedHandler, out: impl Write + Send + 'static) -> Recorder {
        let mut out: Box<dyn Write + Send> = Box::new(out);
        let header = "# op(m=malloc,c=calloc,r=realloc,f=free) ptr-id size thread; \
                      free(NULL)->id 0; unknown ptr->id 18446744073709551615\n";
        let error = out.write_all(header.as_bytes()).err();
        Recorder {
            inner,
            state: Mutex::new(RecorderState {
                out,
                ids: HashMap::new(),
                next_id: 1,
                threads: HashMap::new(),
                error,
            }),
        }
    }

    /// Flush the trace; the first write error, if any, is returned here.
    pub fn finish(&self) -> std::io::Result<()> {
        let mut state = self.state.lock();
        if let Some(e) = state.error.take() {
            return Err(e);
        }
        state.out.flush()
    }

    fn record(&self, op: char, old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize) {
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

impl MemHandler for Recorder {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn version(&self) -> u8 {
        self.inner.version()
    }
    fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.inner.malloc(size)?;
        self.record('m', None, p, size);
        Ok(p)
    }
    fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.inner.calloc(nelem, elsize)?;
        self.record('c', None, p, nelem.saturating_mul(elsize));
        Ok(p)
    }
    fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let p = self.inner.realloc(ptr, new_size)?;
        if p.is_some() {
            self.record('r', ptr, p, new_size);
        }
        Ok(p)
    }
    fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        self.inner.free(ptr, size)?;
        self.record('f', ptr, None, size);
        Ok(())
    }
    fn stats(&self) -> Stats {
        self.inner.stats()
    }
    fn usable(&self) -> Result<(), Error> {
        self.inner.usable()
    }
}
