//! Allocation traces in the format of `shared/traces/README.md` (`op id size thread`,
//! one event a line): read and parsed here; any handler's calls recorded in it
//! (`trace/record.rs`); a trace replayed through any handler, naming the event that
//! fails (`trace/replay.rs`); [`timeline`], which replays one for a report, event
//! by event; and [`by_site`], its live bytes by the program's line.

pub mod by_site;
mod record;
mod replay;
pub mod timeline;

pub use record::{RecordOptions, Recorder, SiteOf, TraceWriter, Watched, Watcher};
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

/// Where a program was when it made a block: the innermost line of its own code (a
/// trace's `#@site N LINE FUNCTION FILE` record; `allocbox run --sites` writes them).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Site {
    /// Shared: a recording names the same few files and functions over and over.
    pub file: std::sync::Arc<str>,
    pub line: u32,
    pub function: std::sync::Arc<str>,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{} ({})", self.file, self.line, self.function)
    }
}

/// A trace's events and the marks between them, and where the recording gave them, the
/// time and the site of each event.
#[derive(Debug, Default)]
pub struct Trace {
    pub events: Vec<Event>,
    pub marks: Vec<Mark>,
    /// Per event, nanoseconds since the recording started (its `t=` field); empty when
    /// the trace has no times. An event without one has its predecessor's.
    pub times: Vec<u64>,
    /// Per event, the number of its site in `site_table` (its `s=` field), 0 for none;
    /// empty when the trace names no sites.
    pub sites: Vec<u32>,
    /// The sites the trace names, by number.
    pub site_table: std::collections::HashMap<u32, Site>,
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
    let mut line = String::new();
    let mut n = 0u32;
    loop {
        line.clear();
        if input.read_line(&mut line)? == 0 {
            return Ok(trace);
        }
        n += 1;
        let text = line.trim();
        if let Some(record) = text.strip_prefix("#@site ") {
            let (number, site) = parse_site(record).ok_or_else(|| TraceError::Syntax {
                line: n,
                message: "a site is `#@site NUMBER LINE FUNCTION FILE`".into(),
            })?;
            trace.site_table.insert(number, site);
            continue;
        }
        if let Some(comment) = text.strip_prefix('#') {
            if !trace.events.is_empty() {
                trace.marks.push(Mark {
                    at: trace.events.len() as u64,
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
        // Optional `key=value` fields; unknown keys are for newer readers.
        let (mut time, mut site) = (None, None);
        for word in words {
            let field = |w: &str| w.parse::<u64>().map_err(|e| bad(format!("`{word}`: {e}")));
            match word.split_once('=') {
                Some(("t", w)) => time = Some(field(w)?),
                Some(("s", w)) => site = Some(field(w)? as u32),
                _ => {}
            }
        }
        let at = trace.events.len();
        if let Some(time) = time {
            trace.times.resize(at, 0);
            trace.times.push(time);
        } else if !trace.times.is_empty() {
            let last = trace.times.last().copied().unwrap_or(0);
            trace.times.push(last);
        }
        if let Some(site) = site {
            trace.sites.resize(at, 0);
            trace.sites.push(site);
        } else if !trace.sites.is_empty() {
            trace.sites.push(0);
        }
        trace.events.push(Event {
            op,
            id,
            size,
            thread,
            line: n,
        });
    }
}

/// `NUMBER LINE FUNCTION FILE` (the file last: it may hold spaces), escaped: a trace is
/// input.
fn parse_site(record: &str) -> Option<(u32, Site)> {
    let mut words = record.splitn(4, ' ');
    let number = words.next()?.parse().ok()?;
    let line = words.next()?.parse().ok()?;
    let function = crate::untrusted::escape(words.next()?).into();
    let file = crate::untrusted::escape(words.next()?.trim()).into();
    Some((
        number,
        Site {
            file,
            line,
            function,
        },
    ))
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
