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
use std::io::{self, Write};
use std::sync::Arc;

use super::write::TraceSink;
use super::{EventOp, MAX_MARK_BYTES, MAX_NAME_BYTES, Recorded, Site, Trace};

mod chunk;
mod read;
pub(crate) use read::{BinaryEvents, is_binary};

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

/// Tags of the items of a chunk, after the four operations (`EventOp as u8`).
const SITE: u8 = 4;
const MARK: u8 = 5;
/// The placement of the calls after it in its chunk: 0 for host memory, n + 1 for GPU
/// n. A chunk starts in host memory, so a trace of host memory has none.
const PLACE: u8 = 6;
/// The stream the next call (a free of GPU memory) waited for.
const STREAM: u8 = 7;

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
    /// The GPU whose memory the block is; `None` for host memory.
    pub device: Option<u16>,
    /// For a free of GPU memory, the stream whose work it waited for.
    pub stream: Option<u64>,
}

impl Call {
    /// The `at`-th event of a trace written anew (`trace-convert`), as a recorder's call:
    /// each event takes four numbers (a mark before it, then the two sides of a
    /// realloc), and its id stands for its block's address, so a reader numbers the
    /// blocks again in the order they are made.
    fn of(recorded: &Recorded, site: Option<&Site>, at: u64) -> Call {
        let event = &recorded.event;
        let seq = 4 * at + 4;
        let (old, new) = match event.op {
            EventOp::Malloc | EventOp::Calloc => (0, event.id),
            EventOp::Realloc => (event.id, event.id),
            EventOp::Free => (event.id, 0),
        };
        Call {
            op: event.op,
            seq: seq - 2,
            done: seq - 1,
            old,
            new,
            size: event.size,
            time: recorded.time.unwrap_or(0),
            site: site.cloned(),
            device: event.device,
            stream: recorded.stream,
        }
    }
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
    /// The placement of the chunk's calls so far ([`PLACE`]).
    device: Option<u16>,
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
            device: None,
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
        if call.device != self.device {
            bytes.push(PLACE);
            put(bytes, call.device.map_or(0, |gpu| u64::from(gpu) + 1));
            self.device = call.device;
        }
        if let Some(stream) = call.stream {
            bytes.push(STREAM);
            put(bytes, stream);
        }
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
        (self.seq, self.address, self.time, self.device) = (0, 0, 0, None);
        Some(framed)
    }

    /// Forget what this thread wrote (a forked child's, whose parent writes it): the
    /// sites too, named again in the child's file.
    pub(crate) fn forget(&mut self) {
        self.bytes.clear();
        (self.seq, self.address, self.time, self.device) = (0, 0, 0, None);
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
    let sink = BinarySink::new(out, !trace.times.is_empty(), !trace.sites.is_empty())?;
    trace.write_to(sink).map(drop)
}

/// The binary form written event by event ([`TraceSink`]): each thread's events into
/// its chunks, as a recording's, numbered in the order they come.
pub struct BinarySink<W: Write> {
    flags: u8,
    stream: zstd::stream::write::Encoder<'static, W>,
    threads: HashMap<u32, ChunkEncoder>,
    /// Events written: each takes four numbers (a mark before it, then the two sides
    /// of a realloc).
    events: u64,
    last_thread: u32,
}

impl<W: Write> std::fmt::Debug for BinarySink<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BinarySink")
            .field("events", &self.events)
            .finish_non_exhaustive()
    }
}

impl<W: Write> BinarySink<W> {
    /// Write the header into `out`, saying whether events have times and sites.
    pub fn new(mut out: W, times: bool, sites: bool) -> io::Result<Self> {
        let flags = if times { TIMES } else { 0 } | if sites { SITES } else { 0 };
        out.write_all(&header(flags))?;
        Ok(BinarySink {
            flags,
            stream: compressor(out)?,
            threads: HashMap::new(),
            events: 0,
            last_thread: 1,
        })
    }

    fn encoder(&mut self, thread: u32) -> &mut ChunkEncoder {
        let flags = self.flags;
        self.threads
            .entry(thread)
            .or_insert_with(|| ChunkEncoder::new(thread, flags))
    }
}

impl<W: Write> TraceSink for BinarySink<W> {
    fn mark(&mut self, text: &str) -> io::Result<()> {
        let seq = 4 * self.events + 1;
        let thread = self.last_thread;
        self.encoder(thread).mark(seq, text);
        Ok(())
    }

    fn event(&mut self, recorded: &Recorded, site: Option<&Site>) -> io::Result<()> {
        let call = Call::of(recorded, site, self.events);
        self.events += 1;
        self.last_thread = recorded.event.thread;
        let encoder = self.encoder(recorded.event.thread);
        encoder.call(call);
        if encoder.full() {
            let chunk = encoder.take().unwrap_or_default();
            self.stream.write_all(&chunk)?;
        }
        Ok(())
    }

    type Out = W;

    fn finish(self) -> io::Result<W> {
        let mut stream = self.stream;
        let mut threads: Vec<_> = self.threads.into_values().collect();
        threads.sort_by_key(ChunkEncoder::thread);
        for mut encoder in threads {
            if let Some(chunk) = encoder.take() {
                stream.write_all(&chunk)?;
            }
        }
        stream.write_all(&END)?;
        let mut out = stream.finish()?;
        out.flush()?;
        Ok(out)
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
mod tests;
