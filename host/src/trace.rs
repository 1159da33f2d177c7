//! Allocation traces: the text form of `shared/traces/README.md` (`op id size thread`,
//! one event a line), read and parsed here and written by `trace/text.rs`; the binary
//! form recordings write (`trace/binary.rs`); any handler's calls watched
//! (`trace/watched.rs`) and recorded (`trace/record.rs`); a trace replayed through any handler, naming the event that
//! fails (`trace/replay.rs`); [`timeline`], which replays one for a report, event
//! by event; and [`by_site`], its live bytes by the program's line.

mod binary;
pub mod by_site;
mod record;
mod replay;
mod text;
pub mod timeline;
mod watched;

pub use binary::{MAGIC as BINARY_MAGIC, MAX_CHUNK_BYTES, write_binary};
pub use record::{RecordOptions, Recorder, SiteOf, TraceWriter, child_path};
pub(crate) use replay::Held;
pub use replay::{ReplayReport, leak_after_replay, replay_trace, replay_trace_counted};
pub use text::write_text;
pub use watched::{Watched, Watcher};

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
    /// The line it came from, for error messages: in a binary trace, the line it has in
    /// the text form `allocbox trace-convert` writes.
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
    /// A binary trace whose header or framing is not one.
    #[error("{0}")]
    Format(String),
    #[error("chunk {chunk} of the binary trace: {message}")]
    Chunk { chunk: u64, message: String },
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
    /// The gzip stream ended before its end (a recording whose process was killed, as
    /// `multiprocessing` ends its idle workers): read up to its last whole line.
    pub cut_short: bool,
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
/// recordings concatenated are one trace.
pub fn read_trace_marked(path: impl AsRef<Path>) -> Result<Trace, TraceError> {
    let mut file = std::fs::File::open(path)?;
    if file.metadata()?.is_dir() {
        return Err(TraceError::Io(std::io::ErrorKind::IsADirectory.into()));
    }
    let mut magic = [0u8; binary::MAGIC.len()];
    let read = read_up_to(&mut file, &mut magic)?;
    file.seek(std::io::SeekFrom::Start(0))?;
    if magic[..read] == binary::MAGIC {
        return binary::read_binary(BufReader::with_capacity(1 << 16, file));
    }
    if magic[..read].starts_with(&[0x1f, 0x8b]) {
        let cut_short = std::cell::Cell::new(false);
        let stream = CutShort {
            inner: flate2::read::MultiGzDecoder::new(BufReader::new(file)),
            cut_short: &cut_short,
        };
        let mut trace = parse_lines(BufReader::with_capacity(1 << 20, stream), &cut_short)?;
        trace.cut_short = cut_short.get();
        Ok(trace)
    } else {
        parse_trace_marked(BufReader::with_capacity(1 << 20, file))
    }
}

/// As many bytes as `file` has, up to `buf`'s length.
fn read_up_to(file: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut read = 0;
    while read < buf.len() {
        match file.read(&mut buf[read..])? {
            0 => break,
            n => read += n,
        }
    }
    Ok(read)
}

/// A gzip stream that ends early ends there, saying so in `cut_short`.
struct CutShort<'a, R> {
    inner: R,
    cut_short: &'a std::cell::Cell<bool>,
}

impl<R: Read> Read for CutShort<'_, R> {
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
pub fn parse_trace_marked(mut input: impl BufRead) -> Result<Trace, TraceError> {
    if binary::is_binary(&mut input)? {
        return binary::read_binary(input);
    }
    parse_lines(input, &std::cell::Cell::new(false))
}

/// [`parse_trace_marked`] of a stream that may be cut short (`cut_short` set once it
/// was): its last line, without an end, is then a part of one, and left out.
fn parse_lines(
    mut input: impl BufRead,
    cut_short: &std::cell::Cell<bool>,
) -> Result<Trace, TraceError> {
    let mut trace = Trace::default();
    let mut raw = Vec::new();
    let mut n = 0u32;
    loop {
        raw.clear();
        if (&mut input)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut raw)?
            == 0
        {
            return Ok(trace);
        }
        n = n.saturating_add(1);
        if cut_short.get() && !raw.ends_with(b"\n") {
            return Ok(trace);
        }
        let content = raw.strip_suffix(b"\n").unwrap_or(&raw);
        if content.len() > MAX_LINE_BYTES {
            return Err(TraceError::Syntax {
                line: n,
                message: format!(
                    "the line is longer than {MAX_LINE_BYTES} bytes: a trace's lines are \
                     events, sites and short comments (is this file a trace?)"
                ),
            });
        }
        let Ok(text) = std::str::from_utf8(content) else {
            return Err(TraceError::Syntax {
                line: n,
                message: "the line is not UTF-8 text (is this file a trace?)".into(),
            });
        };
        let text = text.trim();
        if let Some(record) = text.strip_prefix("#@site ") {
            let (number, site) = parse_site(record).ok_or_else(|| TraceError::Syntax {
                line: n,
                message: "a site is `#@site NUMBER LINE FUNCTION FILE`".into(),
            })?;
            trace.site_table.insert(number, site);
            continue;
        }
        if let Some(record) = text.strip_prefix("#@via ") {
            let (number, via) = parse_site(record).ok_or_else(|| TraceError::Syntax {
                line: n,
                message: "a library line is `#@via NUMBER LINE FUNCTION FILE`".into(),
            })?;
            let site = trace
                .site_table
                .get_mut(&number)
                .ok_or_else(|| TraceError::Syntax {
                    line: n,
                    message: format!("`#@via {number}` comes before site {number}'s `#@site`"),
                })?;
            site.via = Some(std::sync::Arc::new(via));
            continue;
        }
        if let Some(comment) = text.strip_prefix('#') {
            if !trace.events.is_empty() {
                trace.marks.push(Mark {
                    at: trace.events.len() as u64,
                    text: crate::untrusted::escape_at_most(comment.trim(), MAX_MARK_BYTES),
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
                    "`{}` is not an operation: a line is `m`, `c`, `r` or `f`, then id, \
                     size and (optionally) thread",
                    crate::untrusted::escape_at_most(other, 32)
                )));
            }
            None => unreachable!("a line that is not empty has a first word"),
        };
        let mut number = |what: &str| -> Result<u64, TraceError> {
            let w = words.next().ok_or_else(|| bad(format!("missing {what}")))?;
            w.parse().map_err(|e| {
                bad(format!(
                    "{what} `{}`: {e}",
                    crate::untrusted::escape_at_most(w, 32)
                ))
            })
        };
        let id = number("id")?;
        let size = number("size")?;
        let thread = match words.next() {
            None => 1,
            Some(w) => w.parse().map_err(|e| {
                bad(format!(
                    "thread `{}`: {e}",
                    crate::untrusted::escape_at_most(w, 32)
                ))
            })?,
        };
        // Optional `key=value` fields; unknown keys are for newer readers.
        let (mut time, mut site) = (None, None);
        for word in words {
            let field = |w: &str| {
                w.parse::<u64>().map_err(|e| {
                    bad(format!(
                        "`{}`: {e}",
                        crate::untrusted::escape_at_most(word, 32)
                    ))
                })
            };
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

/// `NUMBER LINE FUNCTION FILE`, each name as [`site_name`] writes it (the file last:
/// one written before names were escaped may hold spaces), escaped: a trace is input.
fn parse_site(record: &str) -> Option<(u32, Site)> {
    let mut words = record.splitn(4, ' ');
    let number = words.next()?.parse().ok()?;
    let line = words.next()?.parse().ok()?;
    let function = crate::untrusted::escape(&site_name_read(words.next()?)).into();
    let file = crate::untrusted::escape(&site_name_read(words.next()?.trim())).into();
    Some((
        number,
        Site {
            file,
            line,
            function,
            via: None,
        },
    ))
}

/// A file's or function's name as one word of a `#@site` record: `%`, white space and
/// control characters as `%XX` (each byte of their UTF-8), the empty name as a lone
/// `%`. Any name a program has is written, and read back by [`parse_site`].
pub(crate) fn site_name(name: &str) -> String {
    if name.is_empty() {
        return "%".into();
    }
    let mut word = String::with_capacity(name.len());
    for c in name.chars() {
        if c == '%' || c.is_whitespace() || c.is_control() {
            let mut utf8 = [0u8; 4];
            for byte in c.encode_utf8(&mut utf8).bytes() {
                word.push_str(&format!("%{byte:02X}"));
            }
        } else {
            word.push(c);
        }
    }
    word
}

/// [`site_name`] undone; a `%` not followed by two hexadecimal digits is itself.
fn site_name_read(word: &str) -> String {
    if word == "%" {
        return String::new();
    }
    let bytes = word.as_bytes();
    let mut name = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let hex = bytes
            .get(at + 1..at + 3)
            .filter(|_| bytes[at] == b'%')
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(byte) => {
                name.push(byte);
                at += 3;
            }
            None => {
                name.push(bytes[at]);
                at += 1;
            }
        }
    }
    String::from_utf8_lossy(&name).into_owned()
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parsed(text: &[u8]) -> Result<Trace, TraceError> {
        parse_trace_marked(text)
    }

    #[test]
    fn a_line_past_the_bound_is_refused_with_its_number_having_held_no_more() {
        let mut text = b"m 1 8\n".to_vec();
        text.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES + 1));
        let error = parsed(&text).unwrap_err().to_string();
        assert!(
            error.starts_with("line 2: the line is longer than 65536 bytes"),
            "{error}"
        );
        let mut at_bound = b"m 1 8\n#".to_vec();
        at_bound.extend(std::iter::repeat_n(b'x', MAX_LINE_BYTES - 1));
        at_bound.push(b'\n');
        assert_eq!(parsed(&at_bound).unwrap().marks.len(), 1);
    }

    #[test]
    fn a_line_that_is_not_text_is_refused_with_its_number() {
        let error = parsed(b"m 1 8\nm \xff 8\n").unwrap_err().to_string();
        assert_eq!(
            error,
            "line 2: the line is not UTF-8 text (is this file a trace?)"
        );
    }

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

    #[test]
    fn names_the_format_cannot_hold_as_they_are_are_written_so_they_read_back() {
        for name in [
            "",
            " ",
            "\t",
            "a b",
            "line\nbreak",
            "100%",
            "%41",
            "<string>",
            "é ü",
        ] {
            let record = format!("7 12 {} {}", site_name(name), site_name(name));
            let (number, site) = parse_site(&record).unwrap_or_else(|| panic!("{record:?}"));
            assert_eq!(number, 7);
            assert_eq!(&*site.file, crate::untrusted::escape(name), "{record:?}");
            assert_eq!(
                &*site.function,
                crate::untrusted::escape(name),
                "{record:?}"
            );
        }
    }

    #[test]
    fn a_site_written_before_names_were_escaped_still_reads_with_spaces_in_its_file() {
        let (_, site) = parse_site("3 4 main /home/me/my project/run.py").unwrap();
        assert_eq!(&*site.file, "/home/me/my project/run.py");
    }

    proptest! {
        #[test]
        fn any_name_reads_back_as_written_with_control_characters_escaped(
            function in any::<String>(),
            file in any::<String>(),
            line in any::<u32>(),
        ) {
            let text = format!(
                "#@site 1 {line} {} {}\nm 1 8 1 s=1\n",
                site_name(&function),
                site_name(&file)
            );
            let trace = parsed(text.as_bytes()).unwrap();
            let site = &trace.site_table[&1];
            prop_assert_eq!(&*site.function, crate::untrusted::escape(&function));
            prop_assert_eq!(&*site.file, crate::untrusted::escape(&file));
            prop_assert_eq!(site.line, line);
        }

        #[test]
        fn any_bytes_parse_or_are_refused_with_a_line_number(
            text in proptest::collection::vec(any::<u8>(), 0..512),
        ) {
            match parsed(&text) {
                Ok(_) => {}
                Err(TraceError::Syntax { line, .. }) => prop_assert!(line >= 1),
                Err(e) => prop_assert!(false, "{e}"),
            }
        }
    }
}
