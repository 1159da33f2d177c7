//! The text form (`op id size thread`, one event a line): read within its bounds, and
//! written, as `trace-convert` makes it of a binary trace, line for line as it reads back.

use std::cell::Cell;
use std::collections::HashSet;
use std::io::{self, BufRead, Write};
use std::rc::Rc;

use super::lines::Lines;
use super::recorded::{Beside, FormatEvents, Recorded};
use super::write::TraceSink;
use super::{Event, EventOp, Site, Trace, TraceError};

/// The first line of a trace written in the text form.
const HEADER: &str = "# op(m=malloc,c=calloc,r=realloc,f=free) ptr-id size thread; \
                      free(NULL)->id 0; unknown ptr->id 18446744073709551615\n";

/// `trace` in the text form: the header, then each event with its marks before it and
/// its site's `#@site` (and `#@via`) record before the first event made there. An
/// event's line is the one a binary trace's reader gave it.
pub fn write_text(trace: &Trace, out: impl Write) -> io::Result<()> {
    trace.write_to(TextSink::new(out)?).map(drop)
}

/// The text form written event by event ([`TraceSink`]).
pub struct TextSink<W: Write> {
    out: io::BufWriter<W>,
    named: HashSet<u32>,
}

impl<W: Write> std::fmt::Debug for TextSink<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextSink").finish_non_exhaustive()
    }
}

impl<W: Write> TextSink<W> {
    /// Write the header into `out`.
    pub fn new(out: W) -> io::Result<Self> {
        let mut out = io::BufWriter::new(out);
        out.write_all(HEADER.as_bytes())?;
        Ok(TextSink {
            out,
            named: HashSet::new(),
        })
    }
}

impl<W: Write> TraceSink for TextSink<W> {
    fn mark(&mut self, text: &str) -> io::Result<()> {
        writeln!(self.out, "# {text}")
    }

    fn event(&mut self, recorded: &Recorded, site: Option<&Site>) -> io::Result<()> {
        let out = &mut self.out;
        let number = recorded.site.unwrap_or(0);
        if number != 0
            && let Some(place) = site
            && self.named.insert(number)
        {
            out.write_all(site_record("site", number, place).as_bytes())?;
            if let Some(via) = &place.via {
                out.write_all(site_record("via", number, via).as_bytes())?;
            }
        }
        let event = &recorded.event;
        let op = match event.op {
            EventOp::Malloc => 'm',
            EventOp::Calloc => 'c',
            EventOp::Realloc => 'r',
            EventOp::Free => 'f',
        };
        write!(out, "{op} {} {} {}", event.id, event.size, event.thread)?;
        if number != 0 {
            write!(out, " s={number}")?;
        }
        if let Some(time) = recorded.time {
            write!(out, " t={time}")?;
        }
        if let Some(device) = event.device {
            write!(out, " d={device}")?;
        }
        if let Some(stream) = recorded.stream {
            write!(out, " q={stream}")?;
        }
        out.write_all(b"\n")
    }

    type Out = W;

    fn finish(self) -> io::Result<W> {
        self.out
            .into_inner()
            .map_err(io::IntoInnerError::into_error)
    }
}

/// A `#@site` (or `#@via`) record: `#@KIND NUMBER LINE FUNCTION FILE`.
fn site_record(kind: &str, number: u32, site: &Site) -> String {
    format!(
        "#@{kind} {number} {} {} {}\n",
        site.line,
        site_name(&site.function),
        site_name(&site.file)
    )
}

impl<R: BufRead> FormatEvents for TextEvents<R> {
    fn next_event(&mut self, beside: &mut Beside) -> Result<Option<Recorded>, TraceError> {
        self.next(beside)
    }

    fn cut_short(&self) -> bool {
        TextEvents::cut_short(self)
    }
}

/// The text form read event by event: sites and marks go beside the events as they
/// come. Comment lines before the first event are the file's header.
pub(super) struct TextEvents<R> {
    lines: Lines<R>,
    /// A log of RMM's logging adaptor, read as its dialect.
    rmm: Option<super::rmm::RmmEvents>,
    /// The time of the last event that had one: an event without one has it.
    time: Option<u64>,
}

impl<R: BufRead> TextEvents<R> {
    /// Read `input`, `cut_short` set once it was (its last line, without an end, is
    /// then a part of one, and left out).
    pub(super) fn new(input: R, cut_short: Rc<Cell<bool>>) -> Self {
        TextEvents {
            lines: Lines::new(input, cut_short),
            rmm: None,
            time: None,
        }
    }

    /// Whether the stream ended early.
    pub(super) fn cut_short(&self) -> bool {
        self.lines.cut_short()
    }

    /// Read the first line: a log of RMM's logging adaptor (its CSV header first) is
    /// read as its dialect (`trace/rmm.rs`) from here on; any other text's first line
    /// is read again by [`TextEvents::next`].
    pub(super) fn know_dialect(&mut self) -> Result<(), TraceError> {
        if let Some((_, first)) = self.lines.next_line()? {
            match super::rmm::is_header(first) {
                true => self.rmm = Some(super::rmm::RmmEvents::default()),
                false => self.lines.read_again(),
            }
        }
        Ok(())
    }

    /// The next event, the site records and comments before it put `beside`.
    pub(super) fn next(&mut self, beside: &mut Beside) -> Result<Option<Recorded>, TraceError> {
        if let Some(rmm) = &mut self.rmm {
            return rmm.next(&mut self.lines);
        }
        loop {
            let Some((n, text)) = self.lines.next_line()? else {
                return Ok(None);
            };
            if let Some(record) = text.strip_prefix("#@site ") {
                let (number, line, function, file) =
                    parse_site(record).ok_or_else(|| TraceError::Syntax {
                        line: n,
                        message: "a site is `#@site NUMBER LINE FUNCTION FILE`".into(),
                    })?;
                let kept = beside.site_table.len();
                let replaces = beside.site_table.contains_key(&number);
                match beside.keeper.site(kept, replaces, line, &function, &file) {
                    Some(site) => beside.site_table.insert(number, site),
                    None => beside.site_table.remove(&number),
                };
                continue;
            }
            if let Some(record) = text.strip_prefix("#@via ") {
                let (number, line, function, file) =
                    parse_site(record).ok_or_else(|| TraceError::Syntax {
                        line: n,
                        message: "a library line is `#@via NUMBER LINE FUNCTION FILE`".into(),
                    })?;
                let via = beside
                    .keeper
                    .site(0, true, line, &function, &file)
                    .map(std::sync::Arc::new);
                let Some(site) = beside.site_table.get_mut(&number) else {
                    if beside.keeper.sites_left_out() > 0 {
                        continue;
                    }
                    return Err(TraceError::Syntax {
                        line: n,
                        message: format!("`#@via {number}` comes before site {number}'s `#@site`"),
                    });
                };
                site.via = via;
                continue;
            }
            if let Some(comment) = text.strip_prefix('#') {
                if beside.events > 0 {
                    beside.mark(comment);
                }
                continue;
            }
            if text.is_empty() {
                continue;
            }
            return parse_event(n, text, &mut self.time).map(Some);
        }
    }
}

/// One event's line `n`: `op id size [thread] [key=value ...]`.
fn parse_event(n: u32, text: &str, last_time: &mut Option<u64>) -> Result<Recorded, TraceError> {
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
    let (mut time, mut site, mut device, mut stream) = (None, None, None, None);
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
            Some(("d", w)) => {
                let gpu = field(w)?;
                device =
                    Some(u16::try_from(gpu).map_err(|_| {
                        bad(format!("`{word}`: GPU {gpu} is past any GPU's number"))
                    })?);
            }
            Some(("q", w)) => stream = Some(field(w)?),
            _ => {}
        }
    }
    if time.is_some() {
        *last_time = time;
    }
    Ok(Recorded {
        event: Event {
            op,
            id,
            size,
            thread,
            line: n,
            device,
        },
        time: *last_time,
        site,
        stream,
    })
}

/// `NUMBER LINE FUNCTION FILE`, each name as [`site_name`] writes it (the file last:
/// one written before names were escaped may hold spaces), decoded.
fn parse_site(record: &str) -> Option<(u32, u32, String, String)> {
    let mut words = record.splitn(4, ' ');
    let number = words.next()?.parse().ok()?;
    let line = words.next()?.parse().ok()?;
    let function = site_name_read(words.next()?);
    let file = site_name_read(words.next()?.trim());
    Some((number, line, function, file))
}

/// A file's or function's name as one word of a `#@site` record: `%`, white space and
/// control characters as `%XX` (each byte of their UTF-8), the empty name as a lone
/// `%`. Any name a program has is written, and read back by [`parse_site`].
fn site_name(name: &str) -> String {
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

#[cfg(test)]
mod tests {
    use super::super::MAX_LINE_BYTES;
    use super::*;
    use proptest::prelude::*;

    fn parsed(text: &[u8]) -> Result<Trace, TraceError> {
        super::super::parse_trace_marked(text)
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
            let record = format!(
                "#@site 7 12 {} {}\nm 1 8 1 s=7\n",
                site_name(name),
                site_name(name)
            );
            let trace = parsed(record.as_bytes()).unwrap_or_else(|e| panic!("{record:?}: {e}"));
            let site = &trace.site_table[&7];
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
        let (_, _, _, file) = parse_site("3 4 main /home/me/my project/run.py").unwrap();
        assert_eq!(file, "/home/me/my project/run.py");
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
