//! The binary trace format recordings write (`docs/traces.md`, "The binary form"):
//! compact, compressed as it is written, and written by many threads at once without a
//! lock or a shared map between them.
//!
//! Each thread encodes its own calls into chunks: the block's *address*, not an id (ids
//! would need a map shared by every thread), and a *sequence number* from one counter,
//! taken where the call's order is decided (before a free, after a malloc, both sides of
//! a realloc). The reader puts every chunk's calls back in sequence order and numbers
//! the blocks as the text form does. Chunks go through one zstd stream.

use std::collections::HashMap;
use std::io::{self, BufRead, Read, Write};
use std::sync::Arc;

use super::{
    Event, EventOp, MAX_LINE_BYTES, MAX_MARK_BYTES, Mark, Site, Trace, TraceError, UNKNOWN_ID,
};

/// The first bytes of a binary trace: not text (no trace line starts with them) and not
/// gzip's or zstd's magic. The version and the flags follow, uncompressed.
pub const MAGIC: [u8; 8] = *b"\x89ABT\r\n\x1a\n";
/// The version this allocbox writes and reads.
pub const VERSION: u8 = 1;
/// Flags: every call has a time; every allocation has a site (0 for none).
pub(crate) const TIMES: u8 = 1;
pub(crate) const SITES: u8 = 2;

/// The largest chunk a reader accepts: a writer ends a chunk at [`CHUNK_BYTES`], and one
/// call with its site's names (each at most [`MAX_NAME_BYTES`]) is far below the rest.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;
/// Where a writer ends a chunk and hands it to be compressed.
pub(crate) const CHUNK_BYTES: usize = 64 << 10;
/// The most of a file's or function's name kept in a site: what a reader accepts of a
/// name in a text trace's line.
const MAX_NAME_BYTES: usize = 16 << 10;

/// Tags of the items of a chunk, after the four operations (`EventOp as u8`).
const SITE: u8 = 4;
const MARK: u8 = 5;

fn op_code(op: EventOp) -> u8 {
    match op {
        EventOp::Malloc => 0,
        EventOp::Calloc => 1,
        EventOp::Realloc => 2,
        EventOp::Free => 3,
    }
}

/// One call, as a thread's [`ChunkEncoder`] writes it.
pub(crate) struct Call {
    pub op: EventOp,
    /// Where the call falls in the recording's order: a free's and a realloc's taken
    /// before the handler let the old block go (no other thread can be handed it
    /// earlier), a malloc's after it was made.
    pub seq: u64,
    /// A realloc's sequence number after the new block was made (≥ `seq`).
    pub done: u64,
    /// The block before (free, realloc; 0 for none) and after (malloc, calloc, realloc).
    pub old: u64,
    pub new: u64,
    pub size: u64,
    pub time: u64,
    pub site: Option<Site>,
}

/// One thread's calls, encoded into chunks that stand alone (each number written as the
/// difference from the chunk's previous one) but for sites, named once per thread.
pub(crate) struct ChunkEncoder {
    thread: u32,
    flags: u8,
    bytes: Vec<u8>,
    seq: u64,
    address: u64,
    time: u64,
    sites: HashMap<Site, u32, foldhash::fast::RandomState>,
    sites_named: u32,
    /// The last site and its number: a loop allocates at one line over and over, and
    /// its names are the same `Arc`s each time, compared by address, where the map
    /// hashes the names' text.
    last_site: Option<(Site, u32)>,
}

/// The most sites a thread remembers having named (a program that makes code objects
/// without end, `exec` in a loop, names sites without end); forgotten ones are named
/// again, under new numbers.
const MAX_SITES_KEPT: usize = 1 << 16;

impl ChunkEncoder {
    pub(crate) fn new(thread: u32, flags: u8) -> ChunkEncoder {
        ChunkEncoder {
            thread,
            flags,
            bytes: Vec::with_capacity(CHUNK_BYTES + 256),
            seq: 0,
            address: 0,
            time: 0,
            sites: HashMap::default(),
            sites_named: 0,
            last_site: None,
        }
    }

    pub(crate) fn thread(&self) -> u32 {
        self.thread
    }

    /// Whether the chunk is big enough to hand over.
    pub(crate) fn full(&self) -> bool {
        self.bytes.len() >= CHUNK_BYTES
    }

    pub(crate) fn call(&mut self, call: Call) {
        let site = match (self.flags & SITES != 0, call.op, &call.site) {
            (true, EventOp::Free, _) | (true, _, None) => Some(0),
            (true, _, Some(site)) => Some(self.site_number(site)),
            (false, ..) => None,
        };
        let bytes = &mut self.bytes;
        bytes.push(op_code(call.op));
        put(bytes, call.seq.wrapping_sub(self.seq));
        self.seq = call.seq;
        let mut address = |bytes: &mut Vec<u8>, at: u64| {
            put(bytes, zigzag(at.wrapping_sub(self.address)));
            self.address = at;
        };
        match call.op {
            EventOp::Malloc | EventOp::Calloc => address(bytes, call.new),
            EventOp::Free => address(bytes, call.old),
            EventOp::Realloc => {
                address(bytes, call.old);
                address(bytes, call.new);
                put(bytes, call.done.wrapping_sub(call.seq));
                self.seq = call.done;
            }
        }
        put(bytes, call.size);
        if self.flags & TIMES != 0 {
            put(bytes, zigzag(call.time.wrapping_sub(self.time)));
            self.time = call.time;
        }
        if let Some(site) = site {
            put(bytes, u64::from(site));
        }
    }

    /// A mark (a comment between events, `trace-convert` of a text trace) at `seq`.
    pub(crate) fn mark(&mut self, seq: u64, text: &str) {
        self.bytes.push(MARK);
        put(&mut self.bytes, seq.wrapping_sub(self.seq));
        self.seq = seq;
        put_str(&mut self.bytes, text, MAX_MARK_BYTES);
    }

    /// The number of `site` on this thread, named first in the chunk if it is new.
    fn site_number(&mut self, site: &Site) -> u32 {
        if let Some((last, number)) = &self.last_site
            && same_site(last, site)
        {
            return *number;
        }
        let number = self.named_site_number(site);
        self.last_site = Some((site.clone(), number));
        number
    }

    fn named_site_number(&mut self, site: &Site) -> u32 {
        if let Some(&number) = self.sites.get(site) {
            return number;
        }
        if self.sites.len() >= MAX_SITES_KEPT {
            self.sites.clear();
        }
        self.sites_named += 1;
        let number = self.sites_named;
        let bytes = &mut self.bytes;
        bytes.push(SITE);
        put(bytes, u64::from(number));
        let place = |bytes: &mut Vec<u8>, site: &Site| {
            put(bytes, u64::from(site.line));
            put_str(bytes, &site.function, MAX_NAME_BYTES);
            put_str(bytes, &site.file, MAX_NAME_BYTES);
        };
        place(bytes, site);
        match &site.via {
            Some(via) => {
                bytes.push(1);
                place(bytes, via);
            }
            None => bytes.push(0),
        }
        self.sites.insert(site.clone(), number);
        number
    }

    /// The chunk so far, framed for the stream (its thread, its length), or `None` when
    /// it holds nothing; the next chunk starts afresh.
    pub(crate) fn take(&mut self) -> Option<Vec<u8>> {
        if self.bytes.is_empty() {
            return None;
        }
        let mut framed = Vec::with_capacity(self.bytes.len() + 10);
        put(&mut framed, u64::from(self.thread));
        put(&mut framed, self.bytes.len() as u64);
        framed.extend_from_slice(&self.bytes);
        self.bytes.clear();
        (self.seq, self.address, self.time) = (0, 0, 0);
        Some(framed)
    }

    /// Forget what this thread wrote (a forked child's, whose parent writes it): the
    /// sites too, named again in the child's file.
    pub(crate) fn forget(&mut self) {
        self.bytes.clear();
        (self.seq, self.address, self.time) = (0, 0, 0);
        self.sites.clear();
        self.last_site = None;
    }
}

/// Whether two sites are the same by the addresses of their names (and lines): a
/// cheap test that may say no for equal sites, never yes for different ones.
fn same_site(a: &Site, b: &Site) -> bool {
    let place = |a: &Site, b: &Site| {
        a.line == b.line && Arc::ptr_eq(&a.file, &b.file) && Arc::ptr_eq(&a.function, &b.function)
    };
    place(a, b)
        && match (&a.via, &b.via) {
            (None, None) => true,
            (Some(a), Some(b)) => place(a, b),
            _ => false,
        }
}

/// The header of a binary trace, uncompressed: the magic, the version, the flags.
pub(crate) fn header(flags: u8) -> [u8; 10] {
    let mut header = [0; 10];
    header[..8].copy_from_slice(&MAGIC);
    header[8] = VERSION;
    header[9] = flags;
    header
}

/// What follows the last chunk: thread 0, length 0. A stream without it was cut short.
pub(crate) const END: [u8; 2] = [0, 0];

/// The compressed stream a recording writes after the header, at zstd's fast level: the
/// writer runs beside the program, and a trace's repeats compress well at any level.
pub(crate) fn compressor<W: Write>(out: W) -> io::Result<zstd::stream::write::Encoder<'static, W>> {
    zstd::stream::write::Encoder::new(out, 1)
}

/// `trace` in the binary form, into `out`: what `trace-convert` writes from a text
/// trace. Each event's id stands for its block's address, so the reader numbers the
/// blocks again in the order they are first made.
pub fn write_binary(trace: &Trace, out: impl Write) -> io::Result<()> {
    let flags = if trace.times.is_empty() { 0 } else { TIMES }
        | if trace.sites.is_empty() { 0 } else { SITES };
    let mut out = out;
    out.write_all(&header(flags))?;
    let mut stream = compressor(out)?;
    let mut threads: HashMap<u32, ChunkEncoder> = HashMap::new();
    let mut marks = trace.marks.iter().peekable();
    let mut last_thread = 1;
    for (at, event) in trace.events.iter().enumerate() {
        let encoder = threads
            .entry(event.thread)
            .or_insert_with(|| ChunkEncoder::new(event.thread, flags));
        // Sequence numbers four apart: a mark, then the two sides of a realloc.
        let seq = 4 * at as u64 + 4;
        while let Some(mark) = marks.next_if(|m| m.at <= at as u64) {
            encoder.mark(seq - 3, &mark.text);
        }
        let (old, new) = match event.op {
            EventOp::Malloc | EventOp::Calloc => (0, event.id),
            EventOp::Realloc => (event.id, event.id),
            EventOp::Free => (event.id, 0),
        };
        let site = trace
            .sites
            .get(at)
            .and_then(|n| trace.site_table.get(n))
            .cloned();
        encoder.call(Call {
            op: event.op,
            seq: seq - 2,
            done: seq - 1,
            old,
            new,
            size: event.size,
            time: trace.times.get(at).copied().unwrap_or(0),
            site,
        });
        if encoder.full() {
            stream.write_all(&encoder.take().unwrap_or_default())?;
        }
        last_thread = event.thread;
    }
    let end = 4 * trace.events.len() as u64 + 1;
    for mark in marks {
        threads
            .entry(last_thread)
            .or_insert_with(|| ChunkEncoder::new(last_thread, flags))
            .mark(end, &mark.text);
    }
    let mut threads: Vec<_> = threads.into_values().collect();
    threads.sort_by_key(ChunkEncoder::thread);
    for mut encoder in threads {
        if let Some(chunk) = encoder.take() {
            stream.write_all(&chunk)?;
        }
    }
    stream.write_all(&END)?;
    stream.finish()?.flush()
}

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
    },
    /// A realloc letting its old block go, before the handler could hand it to anyone.
    Release {
        address: u64,
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
                            what: What::Release { address: old, held },
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
                                local => *u32::try_from(local)
                                    .ok()
                                    .and_then(|local| site_numbers.get(&(thread, local)))
                                    .ok_or_else(|| bad(format!("thread {thread} names site {local} before saying where it is")))?,
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
                        },
                    });
                }
                SITE => {
                    let local = chunk.varint().map_err(bad)?;
                    let local = u32::try_from(local)
                        .map_err(|_| bad(format!("site {local} is past any site's number")))?;
                    let mut site = chunk.place().map_err(bad)?;
                    match chunk.byte().map_err(bad)? {
                        0 => {}
                        1 => site.via = Some(Arc::new(chunk.place().map_err(bad)?)),
                        other => {
                            return Err(bad(format!(
                                "a site's library line is marked {other}, not 0 or 1"
                            )));
                        }
                    }
                    let number = site_table.len() as u32 + 1;
                    site_table.insert(number, site);
                    site_numbers.insert((thread, local), number);
                }
                MARK => {
                    let seq = at(chunk.varint().map_err(bad)?);
                    let text = chunk.string().map_err(bad)?;
                    items.push(Item {
                        seq,
                        what: What::Mark(crate::untrusted::escape_at_most(
                            text.trim(),
                            MAX_MARK_BYTES,
                        )),
                    });
                }
                other => {
                    return Err(bad(format!(
                        "{other} is not a kind of record (a newer allocbox's trace?)"
                    )));
                }
            }
        }
    }
    // Chunks come in the order threads handed them over; each thread's are in order.
    items.sort_by_key(|item| item.seq);
    let mut trace = Trace {
        site_table,
        cut_short,
        ..Trace::default()
    };
    replay_order(items, flags, held, &mut trace);
    Ok(trace)
}

/// The calls in sequence order, as a text trace's events: each block numbered when it
/// is made, a free of an address never made `UNKNOWN_ID`, and each event's `line` the
/// line it has in the text form `trace-convert` writes.
fn replay_order(items: Vec<Item>, flags: u8, holds: u32, trace: &mut Trace) {
    let mut ids: HashMap<u64, u64, foldhash::fast::RandomState> = HashMap::default();
    let mut released = vec![None; holds as usize + 1];
    let mut next_id = 1;
    // Line 1 is the header; each new site's record precedes its first event.
    let mut line = 1u32;
    let mut named = std::collections::HashSet::new();
    for item in items {
        match item.what {
            What::Release { address, held } => {
                released[held as usize] = ids.remove(&address);
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
            } => {
                let id = match op {
                    EventOp::Free if old == 0 => 0,
                    EventOp::Free => ids.remove(&old).unwrap_or(UNKNOWN_ID),
                    EventOp::Malloc | EventOp::Calloc | EventOp::Realloc => {
                        let id = released[held as usize].take().unwrap_or_else(|| {
                            next_id += 1;
                            next_id - 1
                        });
                        ids.insert(new, id);
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
                trace.events.push(Event {
                    op,
                    id,
                    size,
                    thread,
                    line,
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
        value |= u64::from(byte[0] & 0x7f).checked_shl(shift).unwrap_or(0);
        if byte[0] & 0x80 == 0 {
            return Ok(Some(value));
        }
    }
    Err(format_error(
        "a number of the stream runs past ten bytes (is this file damaged?)",
    ))
}

/// Reading one chunk's items.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
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
            let byte = self.byte()?;
            value |= u64::from(byte & 0x7f).checked_shl(shift).unwrap_or(0);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("a number runs past ten bytes".into())
    }

    fn string(&mut self) -> Result<&str, String> {
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

    /// A site's line, function and file, escaped: a trace is input.
    fn place(&mut self) -> Result<Site, String> {
        let line =
            u32::try_from(self.varint()?).map_err(|_| "a site's line is past any line's number")?;
        let function = crate::untrusted::escape(self.string()?).into();
        let file = crate::untrusted::escape(self.string()?).into();
        Ok(Site {
            file,
            line,
            function,
            via: None,
        })
    }
}

fn put(bytes: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        bytes.push(value as u8 | 0x80);
        value >>= 7;
    }
    bytes.push(value as u8);
}

/// `text`, its first `most` bytes at most (cut at a character's end), after its length.
fn put_str(bytes: &mut Vec<u8>, text: &str, most: usize) {
    let text = &text[..text.floor_char_boundary(most)];
    put(bytes, text.len() as u64);
    bytes.extend_from_slice(text.as_bytes());
}

/// A difference as an unsigned number that stays short for small ones of either sign.
fn zigzag(difference: u64) -> u64 {
    let difference = difference as i64;
    ((difference << 1) ^ (difference >> 63)) as u64
}

fn unzigzag(value: u64) -> u64 {
    ((value >> 1) as i64 ^ -((value & 1) as i64)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A well-formed trace: blocks numbered in the order they are made, freed at most
    /// once, over a few threads, with marks, times and sites when asked.
    fn traces() -> impl Strategy<Value = Trace> {
        let step = (
            0u8..6,
            0usize..64,
            1u64..1 << 20,
            1u32..4,
            any::<u64>(),
            0u32..4,
        );
        (
            proptest::collection::vec(step, 0..200),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(steps, times, sites)| {
                let mut trace = Trace::default();
                let mut live: Vec<(u64, u64)> = Vec::new();
                let mut next = 1;
                let site_of = |n: u32| Site {
                    file: format!("/job/part {n}.py").into(),
                    line: n * 10,
                    function: "work".into(),
                    via: n.is_multiple_of(2).then(|| {
                        Arc::new(Site {
                            file: "/venv/lib/site-packages/lib.py".into(),
                            line: n,
                            function: "inner name".into(),
                            via: None,
                        })
                    }),
                };
                let mut time = 0;
                for (kind, pick, size, thread, mark, site) in steps {
                    let (op, id) = match (kind, live.is_empty()) {
                        (0 | 1, _) | (_, true) => {
                            next += 1;
                            live.push((next - 1, size));
                            (
                                [EventOp::Malloc, EventOp::Calloc][kind as usize % 2],
                                next - 1,
                            )
                        }
                        (2, false) => {
                            let at = pick % live.len();
                            live[at].1 = size;
                            (EventOp::Realloc, live[at].0)
                        }
                        (3, false) => (EventOp::Free, 0),
                        _ => {
                            let (id, _) = live.swap_remove(pick % live.len());
                            (EventOp::Free, id)
                        }
                    };
                    if mark.is_multiple_of(7) && !trace.events.is_empty() {
                        trace.marks.push(Mark {
                            at: trace.events.len() as u64,
                            text: format!("test {mark}"),
                        });
                    }
                    if times {
                        time += mark % 1000;
                        trace.times.push(time);
                    }
                    if sites {
                        let number = if op == EventOp::Free { 0 } else { site };
                        if number != 0 {
                            trace.site_table.insert(number, site_of(number));
                        }
                        trace.sites.push(number);
                    }
                    trace.events.push(Event {
                        op,
                        id,
                        size,
                        thread,
                        line: 0,
                    });
                }
                trace
            })
    }

    fn binary(trace: &Trace) -> Vec<u8> {
        let mut bytes = Vec::new();
        write_binary(trace, &mut bytes).unwrap();
        bytes
    }

    /// Events without their lines (a text trace's and a binary one's differ).
    fn calls(trace: &Trace) -> Vec<(EventOp, u64, u64, u32)> {
        trace
            .events
            .iter()
            .map(|e| (e.op, e.id, e.size, e.thread))
            .collect()
    }

    proptest! {
        #[test]
        fn a_trace_written_binary_reads_back_with_every_event_mark_time_and_site(trace in traces()) {
            let back = read_binary(&binary(&trace)[..]).unwrap();
            prop_assert_eq!(calls(&back), calls(&trace));
            prop_assert_eq!(&back.marks, &trace.marks);
            prop_assert_eq!(&back.times, &trace.times);
            prop_assert!(!back.cut_short);
            prop_assert_eq!(back.sites.len(), trace.sites.len());
            for (read, written) in back.sites.iter().zip(&trace.sites) {
                prop_assert_eq!(back.site_table.get(read), trace.site_table.get(written));
            }
        }

        #[test]
        fn a_binary_trace_s_event_lines_are_those_of_its_text_form(trace in traces()) {
            let back = read_binary(&binary(&trace)[..]).unwrap();
            let mut text = Vec::new();
            super::super::write_text(&back, &mut text).unwrap();
            let reread = super::super::parse_trace_marked(&text[..]).unwrap();
            prop_assert_eq!(calls(&reread), calls(&back));
            let lines = |t: &Trace| t.events.iter().map(|e| e.line).collect::<Vec<_>>();
            prop_assert_eq!(lines(&reread), lines(&back));
        }

        #[test]
        fn any_bytes_after_the_header_read_or_are_refused_never_a_panic(
            body in proptest::collection::vec(any::<u8>(), 0..512),
            compress in any::<bool>(),
        ) {
            let mut bytes = header(TIMES | SITES).to_vec();
            match compress {
                true => bytes.extend(zstd::bulk::compress(&body, 1).unwrap()),
                false => bytes.extend(&body),
            }
            let _ = read_binary(&bytes[..]);
        }
    }

    #[test]
    fn calls_from_threads_interleaved_read_back_in_the_order_they_were_numbered() {
        // Thread 2 frees the block thread 1 made, and thread 1 is handed the same
        // address again while thread 2's realloc of another block is under way.
        let mut first = ChunkEncoder::new(1, 0);
        let mut second = ChunkEncoder::new(2, 0);
        let call = |op, seq, done, old, new| Call {
            op,
            seq,
            done,
            old,
            new,
            size: 8,
            time: 0,
            site: None,
        };
        first.call(call(EventOp::Malloc, 1, 1, 0, 0x1000));
        second.call(call(EventOp::Malloc, 2, 2, 0, 0x2000));
        second.call(call(EventOp::Free, 3, 3, 0x1000, 0));
        second.call(call(EventOp::Realloc, 4, 6, 0x2000, 0x3000));
        first.call(call(EventOp::Malloc, 5, 5, 0, 0x2000));
        let mut bytes = header(0).to_vec();
        let mut stream = compressor(&mut bytes).unwrap();
        // Thread 2's chunk first: the reader orders by number, not by arrival.
        for encoder in [&mut second, &mut first] {
            stream.write_all(&encoder.take().unwrap()).unwrap();
        }
        stream.write_all(&END).unwrap();
        stream.finish().unwrap();
        let trace = read_binary(&bytes[..]).unwrap();
        assert_eq!(
            calls(&trace),
            [
                (EventOp::Malloc, 1, 8, 1),
                (EventOp::Malloc, 2, 8, 2),
                (EventOp::Free, 1, 8, 2),
                (EventOp::Malloc, 3, 8, 1),
                (EventOp::Realloc, 2, 8, 2),
            ],
            "the address thread 1 is handed again is a new block; the realloc keeps its id"
        );
    }

    #[test]
    fn a_recording_cut_short_reads_up_to_its_last_whole_chunk_and_says_so() {
        let mut trace = Trace::default();
        for id in 1..=40_000 {
            trace.events.push(Event {
                op: EventOp::Malloc,
                id,
                size: id * 16,
                thread: 1,
                line: 0,
            });
        }
        let whole = binary(&trace);
        let cut = read_binary(&whole[..whole.len() - 20]).unwrap();
        assert!(cut.cut_short);
        assert!(cut.events.len() < 40_000, "{}", cut.events.len());
        assert_eq!(calls(&cut), calls(&trace)[..cut.events.len()]);
        let mut without_end = header(0).to_vec();
        without_end.extend(zstd::bulk::compress(&[], 1).unwrap());
        assert!(read_binary(&without_end[..]).unwrap().cut_short);
    }

    #[test]
    fn a_chunk_longer_than_the_bound_is_refused_before_it_is_read() {
        let mut body = Vec::new();
        put(&mut body, 1);
        put(&mut body, MAX_CHUNK_BYTES as u64 + 1);
        let mut bytes = header(0).to_vec();
        bytes.extend(zstd::bulk::compress(&body, 1).unwrap());
        let error = read_binary(&bytes[..]).unwrap_err().to_string();
        assert_eq!(
            error,
            "chunk 1 of the binary trace: the chunk says it is 1048577 bytes long, past the \
             1048576 a chunk may be (is this file damaged?)"
        );
    }

    #[test]
    fn a_newer_version_is_refused_naming_both_versions() {
        let mut bytes = header(0).to_vec();
        bytes[8] = 2;
        let error = read_binary(&bytes[..]).unwrap_err().to_string();
        assert!(
            error.starts_with(
                "the trace is in version 2 of the binary form and this allocbox reads version 1"
            ),
            "{error}"
        );
    }

    #[test]
    fn a_site_met_again_by_the_same_names_keeps_its_number_and_another_gets_its_own() {
        let site = |line| Site {
            file: "/job.py".into(),
            line,
            function: "work".into(),
            via: None,
        };
        let (ten, eleven) = (site(10), site(11));
        // A copy of `ten` with names of its own: equal, not the same `Arc`s.
        let also_ten = site(10);
        let mut encoder = ChunkEncoder::new(1, SITES);
        for (at, site) in [&ten, &ten, &eleven, &ten, &also_ten, &eleven]
            .into_iter()
            .enumerate()
        {
            let at = at as u64 + 1;
            encoder.call(Call {
                op: EventOp::Malloc,
                seq: at,
                done: at,
                old: 0,
                new: 16 * at,
                size: 8,
                time: 0,
                site: Some(site.clone()),
            });
        }
        let mut bytes = header(SITES).to_vec();
        let mut stream = compressor(&mut bytes).unwrap();
        stream.write_all(&encoder.take().unwrap()).unwrap();
        stream.write_all(&END).unwrap();
        stream.finish().unwrap();
        let trace = read_binary(&bytes[..]).unwrap();
        let lines: Vec<u32> = trace
            .sites
            .iter()
            .map(|n| trace.site_table[n].line)
            .collect();
        assert_eq!(lines, [10, 10, 11, 10, 10, 11]);
        assert_eq!(trace.site_table.len(), 2, "each site named once");
    }

    #[test]
    fn a_site_s_long_names_are_cut_to_the_bound_a_reader_takes() {
        let long = "é".repeat(MAX_NAME_BYTES);
        let mut encoder = ChunkEncoder::new(1, SITES);
        let site = Site {
            file: long.clone().into(),
            line: 1,
            function: "f".into(),
            via: None,
        };
        encoder.call(Call {
            op: EventOp::Malloc,
            seq: 1,
            done: 1,
            old: 0,
            new: 16,
            size: 8,
            time: 0,
            site: Some(site),
        });
        let mut bytes = header(SITES).to_vec();
        let mut stream = compressor(&mut bytes).unwrap();
        stream.write_all(&encoder.take().unwrap()).unwrap();
        stream.write_all(&END).unwrap();
        stream.finish().unwrap();
        let trace = read_binary(&bytes[..]).unwrap();
        let file = &trace.site_table[&1].file;
        assert_eq!(file.len(), MAX_NAME_BYTES);
        assert!(long.starts_with(&**file));
    }
}
