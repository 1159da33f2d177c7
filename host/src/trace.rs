//! Allocation traces: read event by event in any form through one reader
//! (`trace/reader.rs`, holding what the program held at once, never the whole trace):
//! the text form of `shared/traces/README.md` (`op id size thread`, one event a line,
//! `trace/text.rs`, and RMM's log, `trace/rmm.rs`), the binary form recordings write
//! (`trace/binary.rs`), a PyTorch snapshot (`trace/torch_snapshot.rs`); written in
//! either form through one sink (`trace/write.rs`); any handler's calls watched
//! (`trace/watched.rs`) and recorded (`trace/record.rs`); a trace replayed through any
//! handler, naming the event that fails (`trace/replay.rs`); [`timeline`], which
//! replays one for a report, event by event, its times counted in bounded memory
//! (`trace/latency.rs`); and [`by_site`], its live bytes by the program's line.

mod binary;
pub mod by_site;
mod file;
mod kept;
mod latency;
mod lines;
mod pickle;
mod reader;
mod record;
mod recorded;
mod replay;
mod rmm;
mod text;
pub mod timeline;
mod torch_snapshot;
mod watched;
mod write;

pub use binary::{BinarySink, MAGIC as BINARY_MAGIC, MAX_CHUNK_BYTES, write_binary};
pub use file::TraceFile;
pub use kept::{MAX_MARK_TEXT_BYTES, MAX_MARKS, MAX_NAME_BYTES, MAX_SITE_NAME_BYTES, MAX_SITES};
pub use reader::{Recorded, TraceReader};
pub use record::{DeviceRecorder, RecordOptions, Recorder, SiteOf, TraceWriter, child_path};
pub(crate) use replay::Held;
pub use replay::{
    MAX_REPLAY_THREADS, ReplayReport, leak_after_replay, replay_events, replay_trace,
    replay_trace_counted,
};
pub use text::{TextSink, write_text};
pub use torch_snapshot::MAX_SNAPSHOT_BYTES;
pub use watched::{Served, Watched, Watcher};
pub use write::{CopyError, TraceSink, copy_trace};

use std::fmt;
use std::io::{BufRead, Read};
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
    /// The line it came from, for error messages: in a binary trace, the line it has in
    /// the text form `allocbox trace-convert` writes.
    pub line: u32,
    /// The GPU whose memory the block is (the text form's `d=N`); `None` for host
    /// memory. Ids are a placement's own: GPU and host blocks never share one.
    pub device: Option<u16>,
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
    /// A binary trace whose header or framing is not one.
    #[error("{0}")]
    Format(String),
    #[error("chunk {chunk} of the binary trace: {message}")]
    Chunk { chunk: u64, message: String },
    #[error(
        "it is {0}, not a file: allocbox reads a trace from a regular file (it reads it more \
         than once); save it to one and name that"
    )]
    NotAFile(&'static str),
    /// A trace read in passes whose file was not the same at a later pass.
    #[error(
        "the trace changed since it was first read ({was} bytes then, {is} now): allocbox \
         reads a trace more than once; let its recording end, or copy the file, and run again"
    )]
    Changed { was: u64, is: u64 },
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
/// trace's `#@site N LINE FUNCTION FILE` record; `allocbox run --sites` writes them),
/// and the library line it was in when that is not its own (`#@via N LINE FUNCTION
/// FILE`): the program's `D = cdist(P, P)`, via SciPy's line that made the array.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Site {
    /// Shared: a recording names the same few files and functions over and over.
    pub file: std::sync::Arc<str>,
    pub line: u32,
    pub function: std::sync::Arc<str>,
    /// The innermost library frame inside the program's line, if the block was made in
    /// a library's code (one that is not NumPy's own).
    pub via: Option<std::sync::Arc<Site>>,
}

impl Site {
    /// `file:line`, and ` → file:line` of the library line it went through.
    pub fn place(&self) -> String {
        match &self.via {
            None => format!("{}:{}", self.file, self.line),
            Some(via) => format!("{}:{} → {}:{}", self.file, self.line, via.file, via.line),
        }
    }

    /// The function, and ` → function` of the library line it went through.
    pub fn functions(&self) -> String {
        match &self.via {
            None => self.function.to_string(),
            Some(via) => format!("{} → {}", self.function, via.function),
        }
    }
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{} ({})", self.file, self.line, self.function)?;
        if let Some(via) = &self.via {
            write!(f, " → {via}")?;
        }
        Ok(())
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
    /// Per event, the stream whose queued work a free of GPU memory waited for before
    /// its block went back to the policy (the text form's `q=STREAM`); `None` for
    /// none. Empty when no free named one.
    pub streams: Vec<Option<u64>>,
    /// The stream ended before its end (a recording whose process was killed, as
    /// `multiprocessing` ends its idle workers): read up to its last whole event.
    pub cut_short: bool,
    /// Marks past [`MAX_MARKS`] (or their text's bound), counted and not kept: one mark
    /// where the first of them was says how many.
    pub marks_left_out: u64,
    /// Sites past [`MAX_SITES`] (or their names' bound), counted and not kept: their
    /// events have no line.
    pub sites_left_out: u64,
}

/// The longest line a trace may have, its end of line aside: an event is a few dozen
/// bytes, a site record a path and a function's name. A longer line (a file that is no
/// trace, or a compressed one that expands without end) is refused when it is reached,
/// having held at most this much.
pub const MAX_LINE_BYTES: usize = 64 << 10;

/// The most of a comment kept as a mark's text: a test's name.
pub(crate) const MAX_MARK_BYTES: usize = 1024;

/// Read a trace: binary, or text (plain, or gzip when the file starts with the gzip
/// magic).
pub fn read_trace(path: impl AsRef<Path>) -> Result<Vec<Event>, TraceError> {
    read_trace_marked(path).map(|trace| trace.events)
}

/// [`read_trace`], with the marks. A gzip file is read member after member: two
/// recordings concatenated are one trace. Every event is held: [`TraceReader`] reads
/// one at a time.
pub fn read_trace_marked(path: impl AsRef<Path>) -> Result<Trace, TraceError> {
    TraceReader::open(path)?.read_all()
}

/// A gzip stream that ends early ends there, saying so in `cut_short`.
struct CutShort<R> {
    inner: R,
    cut_short: std::rc::Rc<std::cell::Cell<bool>>,
}

impl<R: Read> Read for CutShort<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.inner.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                self.cut_short.set(true);
                Ok(0)
            }
            other => other,
        }
    }
}

/// Parse the text form.
pub fn parse_trace(input: impl BufRead) -> Result<Vec<Event>, TraceError> {
    parse_trace_marked(input).map(|trace| trace.events)
}

/// [`parse_trace`], with the marks: comment lines after the first event (those before
/// it are the file's header). No line is held past [`MAX_LINE_BYTES`]. A binary trace
/// is read as one.
pub fn parse_trace_marked(input: impl BufRead) -> Result<Trace, TraceError> {
    TraceReader::new(input)?.read_all()
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = match self.op {
            EventOp::Malloc => 'm',
            EventOp::Calloc => 'c',
            EventOp::Realloc => 'r',
            EventOp::Free => 'f',
        };
        write!(f, "line {}: `{op} {} {}`", self.line, self.id, self.size)?;
        match self.device {
            Some(device) => write!(f, " (GPU {device})"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_member_of_a_gzip_trace_is_read() {
        use std::io::Write;
        let member = |text: &str| {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(text.as_bytes()).unwrap();
            gz.finish().unwrap()
        };
        let mut both = member("m 1 8\n");
        both.extend(member("f 1 8\n"));
        let path = std::env::temp_dir().join(format!("allocbox-members-{}.gz", std::process::id()));
        std::fs::write(&path, both).unwrap();
        let events = read_trace(&path);
        std::fs::remove_file(&path).unwrap();
        let ops: Vec<EventOp> = events.unwrap().iter().map(|e| e.op).collect();
        assert_eq!(ops, [EventOp::Malloc, EventOp::Free]);
    }

    #[test]
    fn a_gzip_recording_cut_short_reads_up_to_its_last_whole_event_and_says_so() {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        for id in 1..=1000 {
            writeln!(gz, "m {id} 64").unwrap();
        }
        let whole = gz.finish().unwrap();
        // A process killed before its stream's end: the last 10 bytes never written.
        let path = std::env::temp_dir().join(format!("allocbox-cut-{}.gz", std::process::id()));
        std::fs::write(&path, &whole[..whole.len() - 10]).unwrap();
        let trace = read_trace_marked(&path);
        std::fs::remove_file(&path).unwrap();
        let trace = trace.unwrap();
        assert!(trace.cut_short);
        assert!(
            trace.events.len() >= 990 && trace.events.len() < 1000,
            "{}",
            trace.events.len()
        );
        assert!(
            trace
                .events
                .iter()
                .enumerate()
                .all(|(i, e)| e.id == i as u64 + 1)
        );
    }
}
