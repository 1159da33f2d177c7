//! A trace written event by event, in either form ([`super::text::TextSink`],
//! [`super::binary::BinarySink`]): from a whole [`Trace`], or from a
//! [`TraceReader`] as it reads, holding no more than the reader does.

use std::io;

use super::{Recorded, Site, Trace, TraceError, TraceReader};

/// Where a trace is written, one mark or event at a time, in the order read.
pub trait TraceSink {
    /// A mark, before the events that follow it.
    fn mark(&mut self, text: &str) -> io::Result<()>;
    /// An event, with its site's place when it names a known one.
    fn event(&mut self, recorded: &Recorded, site: Option<&Site>) -> io::Result<()>;
    /// Where the trace is written.
    type Out;
    /// The end of the trace: everything still buffered written out, and where it went
    /// given back (a compressed file to finish, say).
    fn finish(self) -> io::Result<Self::Out>;
}

/// A trace that could not be copied: reading it, or writing the copy.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error(transparent)]
    Read(#[from] TraceError),
    #[error("{0}")]
    Write(#[from] io::Error),
}

impl Trace {
    /// Every event and mark of the trace into `sink`, in order.
    pub fn write_to<S: TraceSink>(&self, mut sink: S) -> io::Result<S::Out> {
        let mut marks = self.marks.iter().peekable();
        for (at, &event) in self.events.iter().enumerate() {
            while let Some(mark) = marks.next_if(|m| m.at <= at as u64) {
                sink.mark(&mark.text)?;
            }
            let recorded = Recorded {
                event,
                time: self.times.get(at).copied(),
                site: self.sites.get(at).copied(),
                stream: self.streams.get(at).copied().flatten(),
            };
            let site = recorded.site.and_then(|n| self.site_table.get(&n));
            sink.event(&recorded, site)?;
        }
        for mark in marks {
            sink.mark(&mark.text)?;
        }
        sink.finish()
    }
}

/// Every event and mark `reader` reads into `sink`, as it reads them: the events
/// copied, and where the sink wrote them.
pub fn copy_trace<S: TraceSink>(
    mut reader: TraceReader<'_>,
    mut sink: S,
) -> Result<(u64, S::Out), CopyError> {
    let mut marks = 0;
    while let Some(recorded) = reader.next_event()? {
        for mark in &reader.marks()[marks..] {
            sink.mark(&mark.text)?;
        }
        marks = reader.marks().len();
        let site = recorded.site.and_then(|n| reader.site_table().get(&n));
        sink.event(&recorded, site)?;
    }
    let events = reader.events_read();
    for mark in &reader.finish().marks[marks..] {
        sink.mark(&mark.text)?;
    }
    Ok((events, sink.finish()?))
}
