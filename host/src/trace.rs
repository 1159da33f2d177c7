//! Allocation traces in the format of `shared/traces/README.md` (`op id size thread`,
//! one event a line): read and parsed here; any handler's calls recorded in it
//! (`trace/record.rs`); a trace replayed through any handler, naming the event that
//! fails (`trace/replay.rs`); and [`timeline`], which replays one for a report, event
//! by event.

mod record;
mod replay;
pub mod timeline;

pub use record::{Recorder, TraceWriter, Watched, Watcher};
pub(crate) use replay::Held;
pub use replay::{ReplayReport, leak_after_replay, replay_trace, replay_trace_counted};

use std::fmt;
use std::io::{BufRead, BufReader, Read, Seek};
use std::path::Path;

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
