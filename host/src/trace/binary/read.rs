//! Reading a binary trace: its chunks, bounded before they are read, and their calls put
//! back in the recording's order and numbered as a text trace's blocks are.

use std::collections::HashMap;
use std::io::{self, BufRead, Read};
use std::sync::Arc;

use super::{MAGIC, MARK, MAX_CHUNK_BYTES, PLACE, SITE, SITES, STREAM, TIMES, VERSION, unzigzag};
use crate::trace::kept::{Keeper, left_out_mark};
use crate::trace::{
    Event, EventOp, MAX_LINE_BYTES, MAX_MARK_BYTES, Mark, Site, Trace, TraceError, UNKNOWN_ID,
};
use crate::untrusted::escape_at_most;

/// Whether `input` starts as a binary trace does.
pub(crate) fn is_binary(input: &mut impl BufRead) -> io::Result<bool> {
    Ok(input.fill_buf()?.starts_with(&MAGIC))
}

/// One thing a chunk says, at its place in the recording's order.
struct Item {
    seq: u64,
    what: What,
}

enum What {
    Call {
        op: EventOp,
        thread: u32,
        old: u64,
        new: u64,
        size: u64,
        time: u64,
        /// The site's number in the whole trace, 0 for none.
        site: u32,
        /// A realloc's: where its [`What::Release`] left the old block's id.
        held: u32,
        /// The GPU whose memory the block is; `None` for host memory.
        device: Option<u16>,
        /// The stream a free of GPU memory waited for.
        stream: Option<u64>,
    },
    /// A realloc letting its old block go, before the handler could hand it to anyone.
    Release {
        address: u64,
        device: Option<u16>,
        held: u32,
    },
    Mark(String),
}

/// Read a binary trace from its first byte: the calls put back in order and numbered as
/// a text trace's, every bound of a text trace kept (`docs/traces.md`).
pub(crate) fn read_binary(mut input: impl Read) -> Result<Trace, TraceError> {
    let mut head = [0u8; 10];
    input
        .read_exact(&mut head)
        .map_err(|_| format_error("the file ends inside the header of a binary trace"))?;
    if head[..8] != MAGIC {
        return Err(format_error("the file is not a binary trace"));
    }
    if head[8] != VERSION {
        return Err(format_error(&format!(
            "the trace is in version {} of the binary form and this allocbox reads version {VERSION}: \
             read it with the allocbox that wrote it (its `trace-convert` writes the text form)",
            head[8]
        )));
    }
    let flags = head[9];
    let mut stream = io::BufReader::new(zstd::stream::read::Decoder::new(input)?);
    let mut items = Vec::new();
    let mut site_table = HashMap::new();
    let mut site_numbers: HashMap<(u32, u32), u32> = HashMap::new();
    let mut keeper = Keeper::default();
    let (mut marks_kept, mut first_left_out) = (0, None::<u64>);
    let mut held = 0u32;
    let mut cut_short = false;
    let mut chunk = Vec::new();
    for number in 1u64.. {
        let bad = |message: String| TraceError::Chunk {
            chunk: number,
            message,
        };
        let Some(thread) = read_varint(&mut stream, &mut cut_short)? else {
            break;
        };
        let Some(length) = read_varint(&mut stream, &mut cut_short)? else {
            break;
        };
        if thread == 0 && length == 0 {
            if !matches!(stream.fill_buf().map(<[u8]>::is_empty), Ok(true)) {
                return Err(format_error(
                    "the file goes on past the end of its trace (binary traces joined with \
                     `cat`?): a binary trace is one recording; give each file on its own",
                ));
            }
            break;
        }
        let thread = u32::try_from(thread)
            .map_err(|_| bad(format!("thread {thread} is past any thread's number")))?;
        if length > MAX_CHUNK_BYTES as u64 {
            return Err(bad(format!(
                "the chunk says it is {length} bytes long, past the {MAX_CHUNK_BYTES} a chunk may be (is this file damaged?)"
            )));
        }
        chunk.resize(length as usize, 0);
        if let Err(error) = stream.read_exact(&mut chunk) {
            ended_early(error, &mut cut_short)?;
            break;
        }
        let mut chunk = Cursor {
            bytes: &chunk,
            at: 0,
        };
        let (mut seq, mut address, mut time) = (0u64, 0u64, 0u64);
        let (mut device, mut stream) = (None::<u16>, None::<u64>);
        while !chunk.done() {
            let tag = chunk.byte().map_err(bad)?;
            let mut at = |delta: u64| -> u64 {
                seq = seq.wrapping_add(delta);
                seq
            };
            match tag {
                0..=3 => {
                    let op = [
                        EventOp::Malloc,
                        EventOp::Calloc,
                        EventOp::Realloc,
                        EventOp::Free,
                    ][tag as usize];
                    let first = at(chunk.varint().map_err(bad)?);
                    let mut next_address = |chunk: &mut Cursor| -> Result<u64, String> {
                        address = address.wrapping_add(unzigzag(chunk.varint()?));
                        Ok(address)
                    };
                    let (old, new) = match op {
                        EventOp::Malloc | EventOp::Calloc => {
                            (0, next_address(&mut chunk).map_err(bad)?)
                        }
                        EventOp::Free => (next_address(&mut chunk).map_err(bad)?, 0),
                        EventOp::Realloc => (
                            next_address(&mut chunk).map_err(bad)?,
                            next_address(&mut chunk).map_err(bad)?,
                        ),
                    };
                    let mut seq_of_call = first;
                    if op == EventOp::Realloc {
                        held += 1;
                        items.push(Item {
                            seq: first,
                            what: What::Release {
                                address: old,
                                device,
                                held,
                            },
                        });
                        seq_of_call = at(chunk.varint().map_err(bad)?);
                    }
                    let size = chunk.varint().map_err(bad)?;
                    if flags & TIMES != 0 {
                        time = time.wrapping_add(unzigzag(chunk.varint().map_err(bad)?));
                    }
                    let site = match flags & SITES != 0 {
                        true => {
                            let local = chunk.varint().map_err(bad)?;
                            match local {
                                0 => 0,
                                local => match u32::try_from(local)
                                    .ok()
                                    .and_then(|local| site_numbers.get(&(thread, local)))
                                {
                                    Some(&number) => number,
                                    // One of the sites past the bound, not kept.
                                    None if keeper.sites_left_out() > 0 => 0,
                                    None => {
                                        return Err(bad(format!(
                                            "thread {thread} names site {local} before saying where it is"
                                        )));
                                    }
                                },
                            }
                        }
                        false => 0,
                    };
                    let held = if op == EventOp::Realloc { held } else { 0 };
                    items.push(Item {
                        seq: seq_of_call,
                        what: What::Call {
                            op,
                            thread,
                            old,
                            new,
                            size,
                            time,
                            site,
                            held,
                            device,
                            stream: stream.take(),
                        },
                    });
                }
                PLACE => {
                    let place = chunk.varint().map_err(bad)?;
                    device = match place {
                        0 => None,
                        gpu => Some(u16::try_from(gpu - 1).map_err(|_| {
                            bad(format!("GPU {} is past any GPU's number", gpu - 1))
                        })?),
                    };
                }
                STREAM => stream = Some(chunk.varint().map_err(bad)?),
                SITE => {
                    let local = chunk.varint().map_err(bad)?;
                    let local = u32::try_from(local)
                        .map_err(|_| bad(format!("site {local} is past any site's number")))?;
                    // Named again under its number (a damaged or hostile trace; a
                    // recorder never does): it replaces itself.
                    let known = site_numbers.get(&(thread, local)).copied();
                    let kept = site_table.len();
                    let mut site = chunk
                        .place(&mut keeper, kept, known.is_some())
                        .map_err(bad)?;
                    match chunk.byte().map_err(bad)? {
                        0 => {}
                        1 => {
                            let via = chunk.place(&mut keeper, 0, true).map_err(bad)?;
                            if let Some(site) = &mut site {
                                site.via = via.map(Arc::new);
                            }
                        }
                        other => {
                            return Err(bad(format!(
                                "a site's library line is marked {other}, not 0 or 1"
                            )));
                        }
                    }
                    match (site, known) {
                        (Some(site), Some(number)) => {
                            site_table.insert(number, site);
                        }
                        (Some(site), None) => {
                            let number = kept as u32 + 1;
                            site_table.insert(number, site);
                            site_numbers.insert((thread, local), number);
                        }
                        (None, Some(number)) => {
                            site_table.remove(&number);
                        }
                        (None, None) => {}
                    }
                }
                MARK => {
                    let seq = at(chunk.varint().map_err(bad)?);
                    let text = escape_at_most(chunk.string().map_err(bad)?.trim(), MAX_MARK_BYTES);
                    if keeper.keep_mark(marks_kept, &text) {
                        marks_kept += 1;
                        items.push(Item {
                            seq,
                            what: What::Mark(text),
                        });
                    } else {
                        first_left_out = Some(first_left_out.map_or(seq, |first| first.min(seq)));
                    }
                }
                other => {
                    return Err(bad(format!(
                        "{other} is not a kind of record (a newer allocbox's trace?)"
                    )));
                }
            }
        }
    }
    // The marks left out are summed by one where the first of them was.
    if let Some(seq) = first_left_out {
        items.push(Item {
            seq,
            what: What::Mark(left_out_mark(0, keeper.marks_left_out()).text),
        });
    }
    // Chunks come in the order threads handed them over; each thread's are in order.
    // A stable sort keeps the sum after the marks kept at its number.
    items.sort_by_key(|item| item.seq);
    let mut trace = Trace {
        site_table,
        cut_short,
        ..Trace::default()
    };
    replay_order(items, flags, held, &mut trace);
    keeper.finish(&mut trace, None);
    Ok(trace)
}

/// The calls in sequence order, as a text trace's events: each block numbered when it
/// is made, a free of an address never made `UNKNOWN_ID`, and each event's `line` the
/// line it has in the text form `trace-convert` writes.
fn replay_order(items: Vec<Item>, flags: u8, holds: u32, trace: &mut Trace) {
    // A placement's own addresses: a GPU's and the host's may be the same numbers.
    let mut ids: HashMap<(Option<u16>, u64), u64, foldhash::fast::RandomState> = HashMap::default();
    let mut released = vec![None; holds as usize + 1];
    let mut next_id = 1;
    // Line 1 is the header; each new site's record precedes its first event.
    let mut line = 1u32;
    let mut named = std::collections::HashSet::new();
    for item in items {
        match item.what {
            What::Release {
                address,
                device,
                held,
            } => {
                released[held as usize] = ids.remove(&(device, address));
            }
            What::Mark(text) => {
                line = line.saturating_add(1);
                trace.marks.push(Mark {
                    at: trace.events.len() as u64,
                    text,
                });
            }
            What::Call {
                op,
                thread,
                old,
                new,
                size,
                time,
                site,
                held,
                device,
                stream,
            } => {
                let id = match op {
                    EventOp::Free if old == 0 => 0,
                    EventOp::Free => ids.remove(&(device, old)).unwrap_or(UNKNOWN_ID),
                    EventOp::Malloc | EventOp::Calloc | EventOp::Realloc => {
                        let id = released[held as usize].take().unwrap_or_else(|| {
                            next_id += 1;
                            next_id - 1
                        });
                        ids.insert((device, new), id);
                        id
                    }
                };
                if site != 0 && named.insert(site) {
                    let via = trace.site_table.get(&site).is_some_and(|s| s.via.is_some());
                    line = line.saturating_add(1 + u32::from(via));
                }
                line = line.saturating_add(1);
                if flags & TIMES != 0 {
                    trace.times.push(time);
                }
                if flags & SITES != 0 {
                    trace.sites.push(site);
                }
                if stream.is_some() || !trace.streams.is_empty() {
                    trace.streams.resize(trace.events.len(), None);
                    trace.streams.push(stream);
                }
                trace.events.push(Event {
                    op,
                    id,
                    size,
                    thread,
                    line,
                    device,
                });
            }
        }
    }
}

fn format_error(message: &str) -> TraceError {
    TraceError::Format(message.to_owned())
}

/// A stream that ended where it should not: a recording whose process was killed ends
/// inside its compressed stream, and is read up to its last whole chunk.
fn ended_early(error: io::Error, cut_short: &mut bool) -> Result<(), TraceError> {
    match error.kind() {
        io::ErrorKind::UnexpectedEof => {
            *cut_short = true;
            Ok(())
        }
        _ => Err(TraceError::Io(error)),
    }
}

/// A number of the stream's framing, or `None` where the stream ends (cut short: a
/// whole trace ends with [`END`]).
fn read_varint(stream: &mut impl BufRead, cut_short: &mut bool) -> Result<Option<u64>, TraceError> {
    let mut value = 0u64;
    for shift in (0..70).step_by(7) {
        let mut byte = [0u8];
        match stream.read(&mut byte) {
            Ok(0) => {
                *cut_short = true;
                return Ok(None);
            }
            Ok(_) => {}
            Err(error) => {
                ended_early(error, cut_short)?;
                return Ok(None);
            }
        }
        match varint_step(&mut value, shift, byte[0]) {
            Ok(true) => return Ok(Some(value)),
            Ok(false) => {}
            Err(message) => {
                return Err(format_error(&format!("{message} (is this file damaged?)")));
            }
        }
    }
    Err(format_error(
        "a number of the stream runs past ten bytes (is this file damaged?)",
    ))
}

/// One byte of a varint into `value`, at `shift`: whether it was the last. The tenth
/// byte holds the 64th bit alone; one with more is a number no `u64` holds.
pub(super) fn varint_step(value: &mut u64, shift: u32, byte: u8) -> Result<bool, &'static str> {
    if shift == 63 && byte & 0x7e != 0 {
        return Err("a number runs past 64 bits");
    }
    *value |= u64::from(byte & 0x7f) << shift;
    Ok(byte & 0x80 == 0)
}

/// Reading one chunk's items.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn done(&self) -> bool {
        self.at >= self.bytes.len()
    }

    fn byte(&mut self) -> Result<u8, String> {
        let byte = *self
            .bytes
            .get(self.at)
            .ok_or("the chunk ends inside a record")?;
        self.at += 1;
        Ok(byte)
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut value = 0u64;
        for shift in (0..70).step_by(7) {
            if varint_step(&mut value, shift, self.byte()?)? {
                return Ok(value);
            }
        }
        Err("a number runs past ten bytes".into())
    }

    fn string(&mut self) -> Result<&'a str, String> {
        let length = self.varint()?;
        if length > MAX_LINE_BYTES as u64 {
            return Err(format!(
                "a name says it is {length} bytes long, past the {MAX_LINE_BYTES} a name may be"
            ));
        }
        let end = self.at + length as usize;
        let bytes = self
            .bytes
            .get(self.at..end)
            .ok_or("the chunk ends inside a name")?;
        self.at = end;
        std::str::from_utf8(bytes).map_err(|_| "a name is not UTF-8 text".into())
    }

    /// A site's line, function and file, as `keeper` keeps them beside `kept` sites
    /// (`replaces`: in place of one): `None` when it is past their bounds.
    fn place(
        &mut self,
        keeper: &mut Keeper,
        kept: usize,
        replaces: bool,
    ) -> Result<Option<Site>, String> {
        let line =
            u32::try_from(self.varint()?).map_err(|_| "a site's line is past any line's number")?;
        let function = self.string()?;
        let file = self.string()?;
        Ok(keeper.site(kept, replaces, line, function, file))
    }
}
