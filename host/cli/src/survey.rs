//! A trace file read in passes, in memory bounded by what the program held rather than
//! by how long it ran: a first pass ([`survey`]) finds, for each placement (the host's
//! memory, each GPU's), how many events it has, its marks, its times and its lines;
//! then each replay reads that placement's events again, one at a time ([`Pass`]).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use allocbox::trace::by_site::{AtPeak, BySite, BySitePass};
use allocbox::trace::{Event, Mark, Recorded, Trace, TraceError, TraceFile, TraceReader};
use anyhow::{Context, Result};

use crate::progress;
use crate::report::TimeAxis;

/// The most GPUs a trace may name: each is a part of a report, replayed per policy, and
/// a survey keeps each one's counts and marks (a machine has far fewer).
pub(crate) const MAX_GPUS: usize = 64;

/// The most threads counted one by one; past them, "at least".
const MAX_THREADS_COUNTED: usize = 1 << 16;

/// What the first pass finds of one placement's events.
#[derive(Debug, Default)]
pub(crate) struct Placement {
    pub(crate) events: u64,
    /// Where each of the trace's marks falls among this placement's events (its text is
    /// the trace's, kept once: [`Survey::marks`]).
    mark_at: Vec<u64>,
    pub(crate) times: TimeAxis,
    threads: HashSet<u32>,
    last_thread: Option<u32>,
    /// Whether any event names a site.
    sites: bool,
    by_site: BySitePass,
}

impl Placement {
    fn add(&mut self, recorded: &Recorded) {
        self.events += 1;
        self.times.add(recorded.time);
        let thread = recorded.event.thread;
        if self.last_thread != Some(thread) && self.threads.len() < MAX_THREADS_COUNTED {
            self.threads.insert(thread);
            self.last_thread = Some(thread);
        }
        self.sites |= recorded.site.is_some();
        self.by_site
            .add(&recorded.event, recorded.site.unwrap_or(0));
    }

    /// Whether any event names a site (0 for none counts).
    pub(crate) fn has_sites(&self) -> bool {
        self.sites
    }

    /// The recorded threads (at least this many when it is [`MAX_THREADS_COUNTED`]).
    pub(crate) fn threads(&self) -> usize {
        self.threads.len()
    }
}

/// What the first pass finds of a trace.
#[derive(Debug)]
pub(crate) struct Survey {
    pub(crate) path: PathBuf,
    /// The file, open: every later pass reads it through this descriptor, refused if
    /// it changed since this one.
    file: Arc<TraceFile>,
    /// By placement: `None` for the host's memory, `Some(n)` for GPU n's.
    pub(crate) placements: BTreeMap<Option<u16>, Placement>,
    /// The marks, the sites and what was left out, without the events.
    pub(crate) trace: Trace,
}

impl Survey {
    /// The host memory's part (empty when the trace has none).
    pub(crate) fn host(&self) -> &Placement {
        static EMPTY: std::sync::OnceLock<Placement> = std::sync::OnceLock::new();
        self.placements
            .get(&None)
            .unwrap_or_else(|| EMPTY.get_or_init(Placement::default))
    }

    /// The trace's marks, each where it falls among `placement`'s events.
    pub(crate) fn marks(&self, placement: Option<u16>) -> Vec<Mark> {
        let at = self
            .placements
            .get(&placement)
            .map_or(&[][..], |p| &p.mark_at[..]);
        (self.trace.marks.iter().zip(at))
            .map(|(mark, &at)| Mark {
                at,
                text: mark.text.clone(),
            })
            .collect()
    }

    /// The GPUs whose memory the trace has events of, in order.
    pub(crate) fn gpus(&self) -> Vec<u16> {
        self.placements.keys().filter_map(|p| *p).collect()
    }

    /// Every event of every placement.
    pub(crate) fn events(&self) -> u64 {
        self.placements.values().map(|p| p.events).sum()
    }

    /// A reader of every event, from the start again.
    pub(crate) fn reader(&self) -> Result<TraceReader<'static>> {
        TraceReader::of(&self.file).with_context(|| self.path.display().to_string())
    }

    /// The events of `placement`, read again.
    pub(crate) fn pass(&self, placement: Option<u16>) -> Result<Pass> {
        Pass::start(self.file.clone(), placement)
    }

    /// The second pass for the program's lines behind `placement`'s bytes, when the
    /// recording names them: it takes the events from the start up to the moment the
    /// client held the most, in a pass of [`Survey::lines`] or of a replay.
    pub(crate) fn at_peak(&mut self, placement: Option<u16>) -> Option<AtPeak> {
        let found = self.placements.get_mut(&placement)?;
        if !found.sites || self.trace.site_table.is_empty() {
            return None;
        }
        Some(std::mem::take(&mut found.by_site).second_pass())
    }

    /// The program's lines behind `placement`'s bytes, when the recording names them:
    /// `at_peak` (from [`Survey::at_peak`]) finished, in a pass of its own if it needs.
    pub(crate) fn lines(
        &self,
        placement: Option<u16>,
        at_peak: Option<AtPeak>,
    ) -> Result<Option<BySite>> {
        let Some(mut at_peak) = at_peak else {
            return Ok(None);
        };
        if !at_peak.done() {
            let mut pass = self.pass(placement)?;
            for recorded in pass.by_ref() {
                at_peak.add(&recorded.event, recorded.site.unwrap_or(0));
                if at_peak.done() {
                    break;
                }
            }
            pass.finish()?;
        }
        Ok(Some(at_peak.finish()))
    }
}

/// The first pass through the trace at `path`, under a spinner (a long trace takes
/// seconds), with a line on standard error for each thing of it that was not kept whole.
pub(crate) fn survey(path: &Path) -> Result<Survey> {
    let file = TraceFile::open(path).with_context(|| path.display().to_string())?;
    survey_of(Arc::new(file))
}

/// [`survey`] of a trace already open.
pub(crate) fn survey_of(file: Arc<TraceFile>) -> Result<Survey> {
    let path = file.path().to_owned();
    let path = path.as_path();
    let done = AtomicU64::new(0);
    let reading = format!("reading {}", path.display());
    let read = progress::counting_unknown(&reading, &done, || first_pass(file, &done))
        .with_context(|| path.display().to_string())?;
    let trace = &read.trace;
    if trace.cut_short {
        eprintln!(
            "allocbox: {} ends early (its process was killed before it finished \
             recording?): read up to its last whole event, the {}th",
            path.display(),
            read.events()
        );
    }
    if trace.marks_left_out > 0 {
        eprintln!(
            "allocbox: {} has {} marks past the {} (or {} MiB of text) a trace keeps: \
             they are counted, not kept, and one mark where they start says how many",
            path.display(),
            trace.marks_left_out,
            allocbox::trace::MAX_MARKS,
            allocbox::trace::MAX_MARK_TEXT_BYTES >> 20,
        );
    }
    if trace.sites_left_out > 0 {
        eprintln!(
            "allocbox: {} names {} sites past the {} (or {} MiB of names) a trace keeps: \
             their blocks are shown with no line",
            path.display(),
            trace.sites_left_out,
            allocbox::trace::MAX_SITES,
            allocbox::trace::MAX_SITE_NAME_BYTES >> 20,
        );
    }
    Ok(read)
}

/// Events between two updates of the count a progress spinner shows.
const PROGRESS_STRIDE: u64 = 1 << 16;

fn first_pass(file: Arc<TraceFile>, done: &AtomicU64) -> Result<Survey, TraceError> {
    let path = file.path().to_owned();
    let path = path.as_path();
    let mut reader = TraceReader::of(&file)?;
    let mut placements: BTreeMap<Option<u16>, Placement> = BTreeMap::new();
    let mut marks_placed = 0;
    // Where each placement stood when the first mark was left out: the mark that sums
    // them goes there.
    let mut left_out_at: Option<BTreeMap<Option<u16>, u64>> = None;
    // The marks read since the last event, where each placement stands.
    fn place_marks(
        reader: &TraceReader<'_>,
        placements: &mut BTreeMap<Option<u16>, Placement>,
        marks_placed: &mut usize,
    ) {
        let new = reader.marks().len() - *marks_placed;
        for placement in placements.values_mut() {
            let at = placement.events;
            placement.mark_at.extend(std::iter::repeat_n(at, new));
        }
        *marks_placed = reader.marks().len();
    }
    while let Some(recorded) = reader.next_event()? {
        place_marks(&reader, &mut placements, &mut marks_placed);
        let gpus = placements.keys().filter(|p| p.is_some()).count();
        if recorded.event.device.is_some()
            && !placements.contains_key(&recorded.event.device)
            && gpus >= MAX_GPUS
        {
            return Err(TraceError::Format(format!(
                "{} names more than {MAX_GPUS} GPUs, past the {MAX_GPUS} a command reads (a \
                 machine has far fewer: is this file a trace?)",
                path.display()
            )));
        }
        if left_out_at.is_none() && reader.marks_left_out() > 0 {
            left_out_at = Some(
                placements
                    .iter()
                    .map(|(&p, found)| (p, found.events))
                    .collect(),
            );
        }
        let placement = placements
            .entry(recorded.event.device)
            .or_insert_with(|| Placement {
                // A placement met late has every mark so far before its first event.
                mark_at: vec![0; marks_placed],
                ..Placement::default()
            });
        placement.add(&recorded);
        if reader.events_read().is_multiple_of(PROGRESS_STRIDE) {
            done.store(reader.events_read(), Ordering::Relaxed);
        }
    }
    place_marks(&reader, &mut placements, &mut marks_placed);
    let trace = reader.finish();
    if trace.marks.len() > marks_placed {
        for (p, placement) in &mut placements {
            let at = left_out_at
                .as_ref()
                .and_then(|at| at.get(p).copied())
                .unwrap_or(0);
            placement.mark_at.push(at);
        }
    }
    Ok(Survey {
        path: path.to_owned(),
        file,
        placements,
        trace,
    })
}

/// Events a pass's reading thread hands over at once.
const BATCH: usize = 1 << 14;

/// Batches read ahead of the replay: the memory of a pass, whatever the trace's length.
const BATCHES_AHEAD: usize = 4;

/// One placement's events, read again from the file on a thread of its own (the replay
/// that takes them runs on another core meanwhile): an iterator that ends at the
/// trace's end or at an error, which [`Pass::finish`] then says.
pub(crate) struct Pass {
    /// The trace, for what the pass's error says.
    path: PathBuf,
    batches: Option<Receiver<Result<Vec<Recorded>, TraceError>>>,
    batch: std::vec::IntoIter<Recorded>,
    error: Option<TraceError>,
    reading: Option<std::thread::JoinHandle<()>>,
}

impl Pass {
    fn start(file: Arc<TraceFile>, placement: Option<u16>) -> Result<Pass> {
        let (send, batches) = sync_channel(BATCHES_AHEAD);
        let path = file.path().to_owned();
        let reading = std::thread::Builder::new()
            .name("allocbox-read".into())
            .spawn(move || read_batches(&file, placement, &send))
            .context("cannot start a thread to read the trace")?;
        Ok(Pass {
            path,
            batches: Some(batches),
            batch: Vec::new().into_iter(),
            error: None,
            reading: Some(reading),
        })
    }

    /// The events alone.
    pub(crate) fn events(&mut self) -> impl Iterator<Item = Event> + '_ {
        self.by_ref().map(|r| r.event)
    }

    /// The error that ended the pass early, if one did, naming the trace (the file
    /// changed since the first pass read it whole).
    pub(crate) fn finish(mut self) -> Result<()> {
        match self.error.take() {
            None => Ok(()),
            Some(error @ TraceError::Changed { .. }) => {
                Err(anyhow::Error::new(error).context(self.path.display().to_string()))
            }
            Some(error) => Err(anyhow::anyhow!(
                "{}: {error} (the trace was read whole a moment before: did the file change?)",
                self.path.display()
            )),
        }
    }
}

/// The reading thread: `placement`'s events in batches, until the trace ends, an error
/// (sent), or the pass is dropped.
fn read_batches(
    file: &TraceFile,
    placement: Option<u16>,
    send: &SyncSender<Result<Vec<Recorded>, TraceError>>,
) {
    let mut reader = match TraceReader::of(file) {
        Ok(reader) => reader,
        Err(error) => return drop(send.send(Err(error))),
    };
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        match reader.next_event() {
            Ok(Some(recorded)) => {
                if recorded.event.device == placement {
                    batch.push(recorded);
                }
                if batch.len() == BATCH {
                    let full = std::mem::replace(&mut batch, Vec::with_capacity(BATCH));
                    if send.send(Ok(full)).is_err() {
                        return;
                    }
                }
            }
            Ok(None) => {
                if !batch.is_empty() {
                    let _ = send.send(Ok(batch));
                }
                return;
            }
            Err(error) => {
                let _ = send.send(Ok(batch));
                let _ = send.send(Err(error));
                return;
            }
        }
    }
}

impl Iterator for Pass {
    type Item = Recorded;

    fn next(&mut self) -> Option<Recorded> {
        loop {
            if let Some(recorded) = self.batch.next() {
                return Some(recorded);
            }
            match self.batches.as_ref()?.recv() {
                Ok(Ok(batch)) => self.batch = batch.into_iter(),
                Ok(Err(error)) => {
                    self.error = Some(error);
                    self.batches = None;
                    return None;
                }
                // The reader is done.
                Err(_) => {
                    self.batches = None;
                    return None;
                }
            }
        }
    }
}

impl Drop for Pass {
    /// A pass left before its end stops its reading thread (its next batch finds no
    /// one to take it).
    fn drop(&mut self) {
        self.batches = None;
        if let Some(reading) = self.reading.take() {
            let _ = reading.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allocbox::trace::EventOp;

    #[test]
    fn each_placement_s_events_marks_times_and_streams_are_its_own() {
        let text = "m 1 8 1 t=1\n# first\nm 1 256 1 t=2 d=0\n# second\nf 1 256 1 t=3 d=0 q=7\n\
                    m 2 16 1 t=4\n# third\nm 2 512 1 t=5 d=1\nf 1 8 1\n# last\n";
        let path = std::env::temp_dir().join(format!("allocbox-survey-{}.txt", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let file = Arc::new(TraceFile::open(&path).unwrap());
        let found = first_pass(file, &AtomicU64::new(0)).unwrap();
        assert_eq!(
            found.placements.keys().copied().collect::<Vec<_>>(),
            [None, Some(0), Some(1)]
        );
        let counts: Vec<u64> = found.placements.values().map(|p| p.events).collect();
        assert_eq!(counts, [3, 2, 1]);
        assert_eq!(found.events(), 6);
        // Each mark stands after the placement's events before it; a placement met
        // late has the marks before its first event at 0.
        let at = |placement| -> Vec<(u64, String)> {
            found
                .marks(placement)
                .into_iter()
                .map(|m| (m.at, m.text))
                .collect()
        };
        let marks = |at: [u64; 4]| -> Vec<(u64, String)> {
            at.into_iter()
                .zip(["first", "second", "third", "last"])
                .map(|(at, text)| (at, text.to_string()))
                .collect()
        };
        assert_eq!(at(None), marks([1, 1, 2, 3]));
        assert_eq!(at(Some(0)), marks([0, 1, 2, 2]));
        assert_eq!(at(Some(1)), marks([0, 0, 0, 1]));
        // An event without a time has its predecessor's, whichever placement made it.
        let host = found.host();
        assert_eq!(
            (host.times.at(1), host.times.at(2), host.times.at(3)),
            (Some(1), Some(4), Some(5))
        );
        // A pass gives the placement's events alone, with their streams.
        let mut pass = found.pass(Some(0)).unwrap();
        let gpu: Vec<(EventOp, Option<u64>)> =
            pass.by_ref().map(|r| (r.event.op, r.stream)).collect();
        pass.finish().unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(gpu, [(EventOp::Malloc, None), (EventOp::Free, Some(7))]);
    }
}
