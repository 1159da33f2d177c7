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
use std::sync::Arc;

use super::chunk::{ChunkDecoder, SiteNumbers, What, chunk_error, first_seq, varint_step};
use super::{MAGIC, MAX_CHUNK_BYTES, SITES, TIMES, VERSION};
use crate::fasthash::FastMap;
use crate::trace::file::ReadAt;
use crate::trace::recorded::{Beside, FormatEvents, Recorded};
use crate::trace::{Event, EventOp, TraceError, UNKNOWN_ID};

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

/// The largest window (log 2 of its bytes) a decoder keeps: the recorder's zstd level
/// uses 2^19 (and zstd's level 19, 2^23); a stream that asks for more (zstd allows 2^31)
/// is not a recording. Each decoder holds its window, so this bounds the decoders'
/// memory: [`MAX_DECODERS`] of them 132 MiB at most, within the chunks' budget.
const WINDOW_LOG_MAX: u32 = 23;

/// What one decoder holds at most: its window and zstd's buffers beside it, counted in
/// the chunks' budget ([`MAX_HELD_CHUNK_BYTES`]) for each decoder reading ahead.
const DECODER_BYTES: usize = (1 << WINDOW_LOG_MAX) + (256 << 10);

/// The most chunks a trace's index holds (20 bytes each: 80 MiB): a chunk is 64 KiB of
/// calls, or what a thread wrote before it ended, so a recording has far fewer.
const MAX_CHUNKS: usize = 1 << 22;

/// What the first pass learns of a chunk.
struct ChunkInfo {
    thread: u32,
    /// The recording's number of its first call or mark (0 for a chunk with none).
    first: u64,
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
    /// The decoders reading ahead in the file.
    fn decoders(&self) -> usize {
        match self {
            Chunks::File { cursors, .. } => cursors.len(),
            Chunks::Held(_) => 0,
        }
    }

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
    let mut stream = zstd::stream::read::Decoder::with_buffer(input)?;
    stream.window_log_max(WINDOW_LOG_MAX)?;
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

impl FormatEvents for BinaryEvents {
    fn next_event(&mut self, beside: &mut Beside) -> Result<Option<Recorded>, TraceError> {
        self.next(beside)
    }

    fn cut_short(&self) -> bool {
        BinaryEvents::cut_short(self)
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
    pub(crate) fn open_file(file: Arc<File>) -> Result<BinaryEvents, TraceError> {
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
        let mut decoder = zstd::stream::read::Decoder::new(input)?;
        decoder.window_log_max(WINDOW_LOG_MAX)?;
        let mut stream = io::BufReader::new(decoder);
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
        self.chunks.decoders()
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
            let decoding = self.chunks.decoders() * DECODER_BYTES;
            if self.held_bytes + decoding > MAX_HELD_CHUNK_BYTES {
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
        if infos.len() == MAX_CHUNKS {
            return Err(format_error(&format!(
                "the trace has more than {MAX_CHUNKS} chunks, past what a reader indexes (a \
                 recorder writes a chunk per 64 KiB of calls: is this file a recording?)"
            )));
        }
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
    if length == 0 {
        return Err(chunk_error(
            number,
            "it is empty, which no recorder writes (is this file damaged?)",
        ));
    }
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
        _ => Err(decoding_error(error)),
    }
}

/// An error of the compressed stream in one sentence: zstd names a window past
/// [`WINDOW_LOG_MAX`] only in its message.
fn decoding_error(error: io::Error) -> TraceError {
    if error.to_string().contains("too much memory") {
        return format_error(&format!(
            "the trace's compressed stream asks for a window past the {} MiB a reader \
             keeps, which allocbox's recorder never does (is this file a recording?)",
            (1u32 << WINDOW_LOG_MAX) >> 20
        ));
    }
    TraceError::Io(error)
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
