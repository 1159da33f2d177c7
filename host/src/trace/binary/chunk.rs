//! One chunk of a binary trace, read item by item: its calls, releases and marks with
//! their places in the recording's order, its site records kept as they come.

use std::sync::Arc;

use super::{MARK, PLACE, SITE, SITES, STREAM, TIMES, unzigzag};
use crate::fasthash::FastMap;
use crate::trace::recorded::Beside;
use crate::trace::{EventOp, MAX_LINE_BYTES, Site, TraceError};

/// One thing a chunk says, at its place in the recording's order.
pub(super) enum What {
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
pub(super) struct ChunkDecoder {
    /// Its number in the file, from 1.
    number: u64,
    pub(super) thread: u32,
    pub(super) bytes: Vec<u8>,
    at: usize,
    seq: u64,
    address: u64,
    time: u64,
    device: Option<u16>,
    stream: Option<u64>,
    /// The item at the front, by its place in the order.
    pub(super) next: Option<(u64, What)>,
    /// A realloc's call, after its release.
    then: Option<(u64, What)>,
    /// The id its release let go, for its call to keep.
    pub(super) released: Option<u64>,
    /// The thread's site numbers met lately and the trace's numbers for them, by the
    /// low bits of the thread's: a loop makes its blocks at a few lines.
    recent_sites: [(u64, u32); RECENT_SITES],
}

/// What the chunks' site records build: each thread's numbers mapped to the trace's.
#[derive(Default)]
pub(super) struct SiteNumbers {
    of_thread: FastMap<(u32, u32), u32>,
    /// Each site's number by what it names: a line every thread names (each under a
    /// number of its own) is one site of the trace, so its bytes are one row of a
    /// table by line, not one per thread.
    by_content: FastMap<Site, u32>,
}

impl ChunkDecoder {
    pub(super) fn new(number: u64, thread: u32, bytes: Vec<u8>) -> ChunkDecoder {
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

    pub(super) fn bad(&self, message: impl Into<String>) -> TraceError {
        chunk_error(self.number, message)
    }

    /// Read up to the next item (site records on the way go into `beside`): its place
    /// in the order, `None` at the chunk's end.
    pub(super) fn advance(
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
        // Each thread's name for a site is held, one site or many: the sites' bound
        // counts them, so a trace naming one line under millions of numbers holds no
        // more than one naming millions of lines.
        let counted = kept.max(sites.of_thread.len());
        let keeper = &mut beside.keeper;
        let mut site = chunk.place(keeper, counted, known.is_some())?;
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
                let number = match sites.by_content.get(&site) {
                    Some(&number) => number,
                    None => {
                        let number = kept as u32 + 1;
                        sites.by_content.insert(site.clone(), number);
                        beside.site_table.insert(number, site);
                        number
                    }
                };
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

/// Where a chunk's items start in the recording's order: its first call's or mark's
/// number (0 for a chunk of site records alone).
pub(super) fn first_seq(bytes: &[u8]) -> Result<u64, String> {
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
    ) -> Result<Option<Site>, String> {
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

/// An error of chunk number `chunk` (from 1), as every part of the binary reader says
/// it.
pub(super) fn chunk_error(chunk: u64, message: impl Into<String>) -> TraceError {
    TraceError::Chunk {
        chunk,
        message: message.into(),
    }
}
