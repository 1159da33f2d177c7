//! Reading a binary trace event by event: its chunks, bounded before they are read, and
//! their calls put back in the recording's order and numbered as a text trace's blocks
//! are, holding only the chunks that overlap the point reached.
//!
//! Each thread's chunks are in order, but a chunk is written when it is full or the
//! recording ends, so a thread that called once early and then waited has its chunk at
//! the file's end. A first pass reads where each chunk's calls start; the events then
//! come from the chunks loaded in that order, each call given once no chunk still
//! unread can hold an earlier one. A chunk far ahead in the file is read by a decoder of
//! its own, so nothing between is held: the decoders are as many as the file's order
//! strays from the recording's, within [`MAX_DECODERS`].

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::fs::File;
use std::io::{self, BufRead, Read};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::{MAGIC, MARK, MAX_CHUNK_BYTES, PLACE, SITE, SITES, STREAM, TIMES, VERSION, unzigzag};
use crate::fasthash::FastMap;
use crate::trace::reader::{Beside, Recorded};
use crate::trace::{Event, EventOp, MAX_LINE_BYTES, TraceError, UNKNOWN_ID};

/// Whether `input` starts as a binary trace does.
pub(crate) fn is_binary(input: &mut impl BufRead) -> io::Result<bool> {
    Ok(input.fill_buf()?.starts_with(&MAGIC))
}

/// The most decoders reading one file at once: past it, the one furthest on starts
/// again from the file's start (time, not memory).
const MAX_DECODERS: usize = 16;

/// How many times over the decoders may read a file's chunks in all: a recording's
/// file is read about twice (once in order, once ahead for the chunks of threads that
/// waited). A file whose chunks run against the recording's order (the last written
/// first, and so on) would otherwise be read once for each of its chunks.
const MAX_READS_OVER: u64 = 32;

/// The most bytes of chunks held at once: the chunks of every thread writing at one
/// point of the recording, far below this for any program; a file whose chunks all
/// overlap (not a recorder's) is refused here rather than held whole.
pub(crate) const MAX_HELD_CHUNK_BYTES: usize = 256 << 20;

/// What the first pass learns of a chunk.
struct ChunkInfo {
    thread: u32,
    /// The recording's number of its first call or mark (0 for a chunk with none).
    first: u64,
}

/// A file read from `offset` on, by position: every decoder reads the one file opened,
/// whatever happens to its name meanwhile.
struct ReadAt {
    file: Arc<File>,
    offset: u64,
}

impl Read for ReadAt {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let read = self.file.read_at(buf, self.offset)?;
        self.offset += read as u64;
        Ok(read)
    }
}

type Decoder = io::BufReader<zstd::stream::read::Decoder<'static, io::BufReader<ReadAt>>>;

/// A decoder of the file's stream and the number of the next chunk it reads.
struct FileCursor {
    stream: Decoder,
    next: usize,
}

/// Where the chunks are read again from.
enum Chunks {
    File {
        file: Arc<File>,
        cursors: Vec<FileCursor>,
        /// Bytes of chunks the decoders may still read ([`MAX_READS_OVER`]).
        left: u64,
    },
    /// A trace read from a stream that cannot be read twice: its chunks held, as many
    /// as it has.
    Held(Vec<Vec<u8>>),
}

impl Chunks {
    /// Chunk `index`'s bytes.
    fn read(&mut self, index: usize) -> Result<Vec<u8>, TraceError> {
        let (file, cursors, left) = match self {
            Chunks::Held(chunks) => return Ok(std::mem::take(&mut chunks[index])),
            Chunks::File {
                file,
                cursors,
                left,
            } => (file, cursors, left),
        };
        // The decoder furthest on that has not passed it; a new one if none.
        let found = cursors
            .iter()
            .enumerate()
            .filter(|(_, c)| c.next <= index)
            .max_by_key(|(_, c)| c.next)
            .map(|(at, _)| at);
        let at = match found {
            Some(at) => at,
            None => {
                let cursor = FileCursor {
                    stream: decoder(file.clone())?.1,
                    next: 0,
                };
                if cursors.len() >= MAX_DECODERS {
                    let furthest = (0..cursors.len())
                        .max_by_key(|&at| cursors[at].next)
                        .expect("decoders");
                    cursors[furthest] = cursor;
                    furthest
                } else {
                    cursors.push(cursor);
                    cursors.len() - 1
                }
            }
        };
        let cursor = &mut cursors[at];
        let mut bytes = Vec::new();
        while cursor.next <= index {
            let number = cursor.next as u64 + 1;
            let (_, length) = read_frame(&mut cursor.stream, number, &mut false)?
                .ok_or_else(|| chunk_error(number, "the file changed while it was read"))?;
            *left = left.checked_sub(length as u64 + 2).ok_or_else(|| {
                format_error(&format!(
                    "the file's chunks run against the order of its calls past what a \
                     recorder writes: putting them in order would read the file more than \
                     {MAX_READS_OVER} times over (is this file a recording?)"
                ))
            })?;
            bytes.resize(length, 0);
            cursor.stream.read_exact(&mut bytes)?;
            cursor.next += 1;
        }
        Ok(bytes)
    }
}

/// A decoder of `file`'s compressed stream, after its header; and the header's flags.
fn decoder(file: Arc<File>) -> Result<(u8, Decoder), TraceError> {
    let mut input = io::BufReader::new(ReadAt { file, offset: 0 });
    let flags = read_header(&mut input)?;
    let stream = zstd::stream::read::Decoder::with_buffer(input)?;
    Ok((flags, io::BufReader::new(stream)))
}

/// The header's flags, after checking its magic and version.
fn read_header(input: &mut impl Read) -> Result<u8, TraceError> {
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
    Ok(head[9])
}

/// One thing a chunk says, at its place in the recording's order.
enum What {
    Call {
        op: EventOp,
        old: u64,
        new: u64,
        size: u64,
        time: u64,
        /// The site's number in the whole trace, 0 for none.
        site: u32,
        device: Option<u16>,
        stream: Option<u64>,
    },
    /// A realloc letting its old block go, before the handler could hand it to anyone.
    Release {
        address: u64,
        device: Option<u16>,
    },
    Mark(String),
}

/// Site numbers a chunk's reader remembers ([`ChunkDecoder::recent_sites`]).
const RECENT_SITES: usize = 16;

/// A loaded chunk, read item by item.
struct ChunkDecoder {
    /// Its number in the file, from 1.
    number: u64,
    thread: u32,
    bytes: Vec<u8>,
    at: usize,
    seq: u64,
    address: u64,
    time: u64,
    device: Option<u16>,
    stream: Option<u64>,
    /// The item at the front, by its place in the order.
    next: Option<(u64, What)>,
    /// A realloc's call, after its release.
    then: Option<(u64, What)>,
    /// The id its release let go, for its call to keep.
    released: Option<u64>,
    /// The thread's site numbers met lately and the trace's numbers for them, by the
    /// low bits of the thread's: a loop makes its blocks at a few lines.
    recent_sites: [(u64, u32); RECENT_SITES],
}

/// What the chunks' site records build: each thread's numbers mapped to the trace's.
#[derive(Default)]
struct SiteNumbers {
    of_thread: FastMap<(u32, u32), u32>,
}

impl ChunkDecoder {
    fn new(number: u64, thread: u32, bytes: Vec<u8>) -> ChunkDecoder {
        ChunkDecoder {
            number,
            thread,
            bytes,
            at: 0,
            seq: 0,
            address: 0,
            time: 0,
            device: None,
            stream: None,
            next: None,
            then: None,
            released: None,
            recent_sites: [(0, 0); RECENT_SITES],
        }
    }

    fn bad(&self, message: impl Into<String>) -> TraceError {
        chunk_error(self.number, message)
    }

    /// Read up to the next item (site records on the way go into `beside`): its place
    /// in the order, `None` at the chunk's end.
    fn advance(
        &mut self,
        flags: u8,
        sites: &mut SiteNumbers,
        beside: &mut Beside,
    ) -> Result<Option<u64>, TraceError> {
        if let Some(then) = self.then.take() {
            let seq = then.0;
            self.next = Some(then);
            return Ok(Some(seq));
        }
        // Out of `self` while its items are read into `self`.
        let bytes = std::mem::take(&mut self.bytes);
        let mut cursor = Cursor {
            bytes: &bytes,
            at: self.at,
        };
        let found = self.item(&mut cursor, flags, sites, beside);
        self.at = cursor.at;
        self.bytes = bytes;
        let found = found.map_err(|message| self.bad(message))?;
        self.next = found;
        Ok(self.next.as_ref().map(|(seq, _)| *seq))
    }

    fn item(
        &mut self,
        chunk: &mut Cursor,
        flags: u8,
        sites: &mut SiteNumbers,
        beside: &mut Beside,
    ) -> Result<Option<(u64, What)>, String> {
        while !chunk.done() {
            let tag = chunk.byte()?;
            match tag {
                0..=3 => {
                    let op = [
                        EventOp::Malloc,
                        EventOp::Calloc,
                        EventOp::Realloc,
                        EventOp::Free,
                    ][tag as usize];
                    self.seq = self.seq.wrapping_add(chunk.varint()?);
                    let first = self.seq;
                    let mut next_address = |chunk: &mut Cursor| -> Result<u64, String> {
                        self.address = self.address.wrapping_add(unzigzag(chunk.varint()?));
                        Ok(self.address)
                    };
                    let (old, new) = match op {
                        EventOp::Malloc | EventOp::Calloc => (0, next_address(chunk)?),
                        EventOp::Free => (next_address(chunk)?, 0),
                        EventOp::Realloc => (next_address(chunk)?, next_address(chunk)?),
                    };
                    if op == EventOp::Realloc {
                        self.seq = self.seq.wrapping_add(chunk.varint()?);
                    }
                    let size = chunk.varint()?;
                    if flags & TIMES != 0 {
                        self.time = self.time.wrapping_add(unzigzag(chunk.varint()?));
                    }
                    let site = match flags & SITES != 0 {
                        true => match chunk.varint()? {
                            0 => 0,
                            local
                                if self.recent_sites[local as usize % RECENT_SITES].0 == local =>
                            {
                                self.recent_sites[local as usize % RECENT_SITES].1
                            }
                            local => match u32::try_from(local)
                                .ok()
                                .and_then(|local| sites.of_thread.get(&(self.thread, local)))
                            {
                                Some(&number) => {
                                    self.recent_sites[local as usize % RECENT_SITES] =
                                        (local, number);
                                    number
                                }
                                // One of the sites past the bound, not kept.
                                None if beside.keeper.sites_left_out() > 0 => 0,
                                None => {
                                    return Err(format!(
                                        "thread {} names site {local} before saying where it is",
                                        self.thread
                                    ));
                                }
                            },
                        },
                        false => 0,
                    };
                    let call = What::Call {
                        op,
                        old,
                        new,
                        size,
                        time: self.time,
                        site,
                        device: self.device,
                        stream: self.stream.take(),
                    };
                    if op == EventOp::Realloc {
                        self.then = Some((self.seq, call));
                        let release = What::Release {
                            address: old,
                            device: self.device,
                        };
                        return Ok(Some((first, release)));
                    }
                    return Ok(Some((self.seq, call)));
                }
                PLACE => {
                    let place = chunk.varint()?;
                    self.device = match place {
                        0 => None,
                        gpu => Some(
                            u16::try_from(gpu - 1)
                                .map_err(|_| format!("GPU {} is past any GPU's number", gpu - 1))?,
                        ),
                    };
                }
                STREAM => self.stream = Some(chunk.varint()?),
                SITE => {
                    self.recent_sites = [(0, 0); RECENT_SITES];
                    self.site(chunk, sites, beside)?;
                }
                MARK => {
                    self.seq = self.seq.wrapping_add(chunk.varint()?);
                    let text = chunk.string()?.to_owned();
                    return Ok(Some((self.seq, What::Mark(text))));
                }
                other => {
                    return Err(format!(
                        "{other} is not a kind of record (a newer allocbox's trace?)"
                    ));
                }
            }
        }
        Ok(None)
    }

    /// A site record: the thread's number for a line, kept in the trace's table.
    fn site(
        &self,
        chunk: &mut Cursor,
        sites: &mut SiteNumbers,
        beside: &mut Beside,
    ) -> Result<(), String> {
        let local = chunk.varint()?;
        let local =
            u32::try_from(local).map_err(|_| format!("site {local} is past any site's number"))?;
        // Named again under its number (a damaged or hostile trace; a recorder never
        // does): it replaces itself.
        let known = sites.of_thread.get(&(self.thread, local)).copied();
        let kept = beside.site_table.len();
        let keeper = &mut beside.keeper;
        let mut site = chunk.place(keeper, kept, known.is_some())?;
        match chunk.byte()? {
            0 => {}
            1 => {
                let via = chunk.place(keeper, 0, true)?;
                if let Some(site) = &mut site {
                    site.via = via.map(Arc::new);
                }
            }
            other => {
                return Err(format!(
                    "a site's library line is marked {other}, not 0 or 1"
                ));
            }
        }
        match (site, known) {
            (Some(site), Some(number)) => {
                beside.site_table.insert(number, site);
            }
            (Some(site), None) => {
                let number = kept as u32 + 1;
                beside.site_table.insert(number, site);
                sites.of_thread.insert((self.thread, local), number);
            }
            (None, Some(number)) => {
                beside.site_table.remove(&number);
            }
            (None, None) => {}
        }
        Ok(())
    }
}

/// A binary trace's events in the recording's order.
pub(crate) struct BinaryEvents {
    flags: u8,
    chunks: Chunks,
    infos: Vec<ChunkInfo>,
    /// Chunk numbers (from 0) in the order of their first calls.
    order: Vec<u32>,
    loaded: usize,
    /// Loaded chunks by their next item: `(seq, chunk)`; ties in the file's order.
    front: BinaryHeap<Reverse<(u64, u32)>>,
    open: FastMap<u32, ChunkDecoder>,
    held_bytes: usize,
    most_held_bytes: usize,
    sites: SiteNumbers,
    /// A placement's own addresses: a GPU's and the host's may be the same numbers.
    ids: FastMap<(Option<u16>, u64), u64>,
    next_id: u64,
    /// The line each event has in the text form `trace-convert` writes.
    line: u32,
    named: HashSet<u32, foldhash::fast::RandomState>,
    cut_short: bool,
}

impl BinaryEvents {
    /// Read the binary trace in `file`.
    pub(crate) fn open_file(file: File) -> Result<BinaryEvents, TraceError> {
        let file = Arc::new(file);
        let (flags, mut stream) = decoder(file.clone())?;
        let mut cut_short = false;
        let mut bytes = 0u64;
        let infos = index(&mut stream, &mut cut_short, |_, chunk| {
            bytes += chunk.len() as u64 + 2;
        })?;
        let chunks = Chunks::File {
            file,
            cursors: Vec::new(),
            left: bytes.saturating_mul(MAX_READS_OVER).saturating_add(1 << 20),
        };
        Ok(BinaryEvents::with(flags, chunks, infos, cut_short))
    }

    /// Read a binary trace from its first byte, holding its chunks.
    pub(crate) fn read_held(mut input: impl Read) -> Result<BinaryEvents, TraceError> {
        let flags = read_header(&mut input)?;
        let mut stream = io::BufReader::new(zstd::stream::read::Decoder::new(input)?);
        let mut cut_short = false;
        let mut held = Vec::new();
        let infos = index(&mut stream, &mut cut_short, |_, bytes| {
            held.push(bytes.to_vec())
        })?;
        Ok(BinaryEvents::with(
            flags,
            Chunks::Held(held),
            infos,
            cut_short,
        ))
    }

    fn with(flags: u8, chunks: Chunks, infos: Vec<ChunkInfo>, cut_short: bool) -> BinaryEvents {
        let mut order: Vec<u32> = (0..infos.len() as u32).collect();
        order.sort_by_key(|&at| infos[at as usize].first);
        BinaryEvents {
            flags,
            chunks,
            infos,
            order,
            loaded: 0,
            front: BinaryHeap::new(),
            open: FastMap::default(),
            held_bytes: 0,
            most_held_bytes: 0,
            sites: SiteNumbers::default(),
            ids: FastMap::default(),
            next_id: 1,
            // Line 1 is the header.
            line: 1,
            named: HashSet::default(),
            cut_short,
        }
    }

    /// The most bytes of chunks held at once so far.
    #[cfg(test)]
    pub(crate) fn most_held_bytes(&self) -> usize {
        self.most_held_bytes
    }

    /// The decoders reading the file.
    #[cfg(test)]
    pub(crate) fn decoders(&self) -> usize {
        match &self.chunks {
            Chunks::File { cursors, .. } => cursors.len(),
            Chunks::Held(_) => 0,
        }
    }

    /// Whether the stream ended before its trace's end (a killed recording).
    pub(crate) fn cut_short(&self) -> bool {
        self.cut_short
    }

    /// The next event in the recording's order; `None` at the end.
    pub(crate) fn next(&mut self, beside: &mut Beside) -> Result<Option<Recorded>, TraceError> {
        beside.cut_short |= self.cut_short;
        loop {
            self.load_up_to_front(beside)?;
            let Some(Reverse((_, index))) = self.front.pop() else {
                return Ok(None);
            };
            let decoder = self.open.get_mut(&index).expect("a chunk in front is open");
            let (_, what) = decoder.next.take().expect("a chunk in front has an item");
            let released = match &what {
                What::Release { address, device } => {
                    decoder.released = self.ids.remove(&(*device, *address));
                    None
                }
                What::Call {
                    op: EventOp::Realloc,
                    ..
                } => decoder.released.take(),
                _ => None,
            };
            let thread = decoder.thread;
            match decoder.advance(self.flags, &mut self.sites, beside)? {
                Some(seq) => self.front.push(Reverse((seq, index))),
                None => {
                    let done = self.open.remove(&index).expect("open");
                    self.held_bytes -= done.bytes.len();
                }
            }
            match what {
                What::Release { .. } => {}
                What::Mark(text) => {
                    self.line = self.line.saturating_add(1);
                    beside.mark(&text);
                }
                What::Call {
                    op,
                    old,
                    new,
                    size,
                    time,
                    site,
                    device,
                    stream,
                } => {
                    let id = match op {
                        EventOp::Free if old == 0 => 0,
                        EventOp::Free => self.ids.remove(&(device, old)).unwrap_or(UNKNOWN_ID),
                        EventOp::Malloc | EventOp::Calloc | EventOp::Realloc => {
                            let id = released.unwrap_or_else(|| {
                                self.next_id += 1;
                                self.next_id - 1
                            });
                            self.ids.insert((device, new), id);
                            id
                        }
                    };
                    if site != 0 && self.named.insert(site) {
                        let via = beside
                            .site_table
                            .get(&site)
                            .is_some_and(|s| s.via.is_some());
                        self.line = self.line.saturating_add(1 + u32::from(via));
                    }
                    self.line = self.line.saturating_add(1);
                    let event = Event {
                        op,
                        id,
                        size,
                        thread,
                        line: self.line,
                        device,
                    };
                    return Ok(Some(Recorded {
                        event,
                        time: (self.flags & TIMES != 0).then_some(time),
                        site: (self.flags & SITES != 0).then_some(site),
                        stream,
                    }));
                }
            }
        }
    }

    /// Load every chunk whose first item is no later than the earliest loaded one: no
    /// chunk still unread can then hold an item before the front.
    fn load_up_to_front(&mut self, beside: &mut Beside) -> Result<(), TraceError> {
        while let Some(&index) = self.order.get(self.loaded) {
            let info = &self.infos[index as usize];
            if let Some(Reverse((seq, _))) = self.front.peek()
                && info.first > *seq
            {
                return Ok(());
            }
            self.loaded += 1;
            let bytes = self.chunks.read(index as usize)?;
            let mut decoder = ChunkDecoder::new(u64::from(index) + 1, info.thread, bytes);
            self.held_bytes += decoder.bytes.len();
            self.most_held_bytes = self.most_held_bytes.max(self.held_bytes);
            if self.held_bytes > MAX_HELD_CHUNK_BYTES {
                return Err(decoder.bad(format!(
                    "the chunks that overlap here pass the {} MiB a reader holds at once: \
                     the file was not written by allocbox's recorder",
                    MAX_HELD_CHUNK_BYTES >> 20
                )));
            }
            match decoder.advance(self.flags, &mut self.sites, beside)? {
                Some(seq) => {
                    self.front.push(Reverse((seq, index)));
                    self.open.insert(index, decoder);
                }
                None => self.held_bytes -= decoder.bytes.len(),
            }
        }
        Ok(())
    }
}

/// The first pass: each chunk's thread and where its items start, every frame's bounds
/// checked; `each` sees every chunk's bytes.
fn index(
    stream: &mut impl BufRead,
    cut_short: &mut bool,
    mut each: impl FnMut(usize, &[u8]),
) -> Result<Vec<ChunkInfo>, TraceError> {
    let mut infos = Vec::new();
    let mut chunk = Vec::new();
    loop {
        let number = infos.len() as u64 + 1;
        let Some((thread, length)) = read_frame(stream, number, cut_short)? else {
            return Ok(infos);
        };
        chunk.resize(length, 0);
        if let Err(error) = stream.read_exact(&mut chunk) {
            ended_early(error, cut_short)?;
            return Ok(infos);
        }
        let first = first_seq(&chunk).map_err(|message| chunk_error(number, message))?;
        each(infos.len(), &chunk);
        infos.push(ChunkInfo { thread, first });
    }
}

/// A chunk's frame: its thread and length, checked; `None` at the trace's end (or where
/// a stream cut short ends).
fn read_frame(
    stream: &mut impl BufRead,
    number: u64,
    cut_short: &mut bool,
) -> Result<Option<(u32, usize)>, TraceError> {
    let Some(thread) = read_varint(stream, cut_short)? else {
        return Ok(None);
    };
    let Some(length) = read_varint(stream, cut_short)? else {
        return Ok(None);
    };
    if thread == 0 && length == 0 {
        if !matches!(stream.fill_buf().map(<[u8]>::is_empty), Ok(true)) {
            return Err(format_error(
                "the file goes on past the end of its trace (binary traces joined with \
                 `cat`?): a binary trace is one recording; give each file on its own",
            ));
        }
        return Ok(None);
    }
    let thread = u32::try_from(thread).map_err(|_| {
        chunk_error(
            number,
            format!("thread {thread} is past any thread's number"),
        )
    })?;
    if length > MAX_CHUNK_BYTES as u64 {
        return Err(chunk_error(
            number,
            format!(
                "the chunk says it is {length} bytes long, past the {MAX_CHUNK_BYTES} a chunk may be (is this file damaged?)"
            ),
        ));
    }
    Ok(Some((thread, length as usize)))
}

/// Where a chunk's items start in the recording's order: its first call's or mark's
/// number (0 for a chunk of site records alone).
fn first_seq(bytes: &[u8]) -> Result<u64, String> {
    let mut chunk = Cursor { bytes, at: 0 };
    while !chunk.done() {
        match chunk.byte()? {
            0..=3 | MARK => return chunk.varint(),
            PLACE | STREAM => drop(chunk.varint()?),
            SITE => {
                chunk.varint()?;
                chunk.skip_place()?;
                if chunk.byte()? == 1 {
                    chunk.skip_place()?;
                }
            }
            other => {
                return Err(format!(
                    "{other} is not a kind of record (a newer allocbox's trace?)"
                ));
            }
        }
    }
    Ok(0)
}

fn chunk_error(chunk: u64, message: impl Into<String>) -> TraceError {
    TraceError::Chunk {
        chunk,
        message: message.into(),
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
        keeper: &mut crate::trace::kept::Keeper,
        kept: usize,
        replaces: bool,
    ) -> Result<Option<crate::trace::Site>, String> {
        let line =
            u32::try_from(self.varint()?).map_err(|_| "a site's line is past any line's number")?;
        let function = self.string()?;
        let file = self.string()?;
        Ok(keeper.site(kept, replaces, line, function, file))
    }

    /// A site's line, function and file, passed over.
    fn skip_place(&mut self) -> Result<(), String> {
        self.varint()?;
        self.string()?;
        self.string()?;
        Ok(())
    }
}
