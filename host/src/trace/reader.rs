//! A trace read event by event, in its recorded order, holding no more than its live
//! blocks, its sites and marks (within their bounds, `trace/kept.rs`) and, for a binary
//! trace, the chunks of the threads still writing at one point: a recording of any
//! length reads in the memory of its busiest moment. Every form reads through it; a
//! whole [`Trace`] is one read to the end.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::rc::Rc;

use super::binary::BinaryEvents;
use super::file::TraceFile;
use super::kept::left_out_mark;
pub use super::recorded::Recorded;
use super::recorded::{Beside, FormatEvents};
use super::text::TextEvents;
use super::{CutShort, Mark, Site, Trace, TraceError, binary};

/// A form read whole (a PyTorch snapshot, bounded in its size), given event by event.
struct Loaded(std::vec::IntoIter<Recorded>);

impl FormatEvents for Loaded {
    fn next_event(&mut self, _: &mut Beside) -> Result<Option<Recorded>, TraceError> {
        Ok(self.0.next())
    }

    fn cut_short(&self) -> bool {
        false
    }
}

/// A trace being read: [`TraceReader::next_event`] until `None`, then
/// [`TraceReader::finish`] for its marks, sites and what was left out.
pub struct TraceReader<'a> {
    source: Box<dyn FormatEvents + 'a>,
    beside: Beside,
}

impl std::fmt::Debug for TraceReader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceReader")
            .field("events_read", &self.beside.events)
            .finish_non_exhaustive()
    }
}

impl TraceReader<'static> {
    /// Open the trace at `path` for one pass: binary, a PyTorch snapshot, or text
    /// (plain, or gzip when the file starts with the gzip magic, every member of it
    /// read). A command that reads it more than once opens a [`TraceFile`].
    pub fn open(path: impl AsRef<Path>) -> Result<TraceReader<'static>, TraceError> {
        TraceReader::of(&TraceFile::open(path)?)
    }

    /// A pass through `trace` from its start, once it is checked to be the file it was
    /// when opened.
    pub fn of(trace: &TraceFile) -> Result<TraceReader<'static>, TraceError> {
        let mut magic = [0u8; binary::MAGIC.len()];
        let read = super::file::read_up_to(&mut trace.bytes()?, &mut magic)?;
        if magic[..read] == binary::MAGIC {
            let events = BinaryEvents::open_file(trace.shared()?)?;
            return Ok(TraceReader::with(Box::new(events)));
        }
        if super::torch_snapshot::is_pickle(&magic[..read]) {
            return TraceReader::loaded(super::torch_snapshot::read(trace)?);
        }
        let file = trace.bytes()?;
        if magic[..read].starts_with(&[0x1f, 0x8b]) {
            let cut_short = Rc::new(std::cell::Cell::new(false));
            let stream = CutShort {
                inner: flate2::read::MultiGzDecoder::new(BufReader::new(file)),
                cut_short: cut_short.clone(),
            };
            let input: Box<dyn BufRead> = Box::new(BufReader::with_capacity(1 << 20, stream));
            return TraceReader::text(input, cut_short);
        }
        let input: Box<dyn BufRead> = Box::new(BufReader::with_capacity(1 << 20, file));
        TraceReader::text(input, Rc::default())
    }
}

impl<'a> TraceReader<'a> {
    /// Read a trace from `input`, in any form but a PyTorch snapshot (a file's). A
    /// binary trace read so is held compressed, as it was written, to be put in order.
    pub fn new(mut input: impl BufRead + 'a) -> Result<TraceReader<'a>, TraceError> {
        if binary::is_binary(&mut input)? {
            let events = BinaryEvents::read_held(input)?;
            return Ok(TraceReader::with(Box::new(events)));
        }
        TraceReader::text(Box::new(input), Rc::default())
    }

    /// The events of a binary trace being read.
    #[cfg(test)]
    pub(crate) fn binary(events: BinaryEvents) -> Self {
        TraceReader::with(Box::new(events))
    }

    fn with(source: Box<dyn FormatEvents + 'a>) -> Self {
        TraceReader {
            source,
            beside: Beside::default(),
        }
    }

    fn text(
        input: Box<dyn BufRead + 'a>,
        cut_short: Rc<std::cell::Cell<bool>>,
    ) -> Result<Self, TraceError> {
        let mut text = TextEvents::new(input, cut_short);
        text.know_dialect()?;
        Ok(TraceReader::with(Box::new(text)))
    }

    fn loaded(trace: Trace) -> Result<Self, TraceError> {
        let mut recorded = Vec::with_capacity(trace.events.len());
        for (at, &event) in trace.events.iter().enumerate() {
            recorded.push(Recorded {
                event,
                time: trace.times.get(at).copied(),
                site: trace.sites.get(at).copied(),
                stream: trace.streams.get(at).copied().flatten(),
            });
        }
        let mut reader = TraceReader::with(Box::new(Loaded(recorded.into_iter())));
        reader.beside.marks = trace.marks;
        reader.beside.site_table = trace.site_table;
        reader.beside.cut_short = trace.cut_short;
        Ok(reader)
    }

    /// The next event in the recording's order; `None` at the end.
    pub fn next_event(&mut self) -> Result<Option<Recorded>, TraceError> {
        let next = self.source.next_event(&mut self.beside)?;
        if next.is_some() {
            self.beside.events += 1;
        }
        Ok(next)
    }

    /// Events given so far.
    pub fn events_read(&self) -> u64 {
        self.beside.events
    }

    /// The sites named so far, by number.
    pub fn site_table(&self) -> &HashMap<u32, Site> {
        &self.beside.site_table
    }

    /// Marks past the bounds so far, counted and not kept.
    pub fn marks_left_out(&self) -> u64 {
        self.beside.keeper.marks_left_out()
    }

    /// The marks read so far.
    pub fn marks(&self) -> &[Mark] {
        &self.beside.marks
    }

    /// Everything but the events, once they are read: the marks (the one that sums
    /// those left out among them), the sites, and what was cut short or left out.
    pub fn finish(self) -> Trace {
        let mut beside = self.beside;
        let mut trace = Trace {
            cut_short: beside.cut_short,
            site_table: beside.site_table,
            ..Trace::default()
        };
        trace.cut_short |= self.source.cut_short();
        trace.marks = std::mem::take(&mut beside.marks);
        trace.marks_left_out = beside.keeper.marks_left_out();
        trace.sites_left_out = beside.keeper.sites_left_out();
        if let Some(at) = beside.first_left_out.filter(|_| trace.marks_left_out > 0) {
            trace.marks.push(left_out_mark(at, trace.marks_left_out));
        }
        trace
    }

    /// The whole trace, every event held.
    pub fn read_all(mut self) -> Result<Trace, TraceError> {
        let (mut events, mut times, mut sites, mut streams) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        while let Some(recorded) = self.next_event()? {
            let at = events.len();
            if let Some(time) = recorded.time {
                times.resize(at, 0);
                times.push(time);
            }
            if let Some(site) = recorded.site {
                sites.resize(at, 0);
                sites.push(site);
            } else if !sites.is_empty() {
                sites.push(0);
            }
            if recorded.stream.is_some() || !streams.is_empty() {
                streams.resize(at, None);
                streams.push(recorded.stream);
            }
            events.push(recorded.event);
        }
        let mut trace = self.finish();
        (trace.events, trace.times, trace.sites, trace.streams) = (events, times, sites, streams);
        Ok(trace)
    }
}
