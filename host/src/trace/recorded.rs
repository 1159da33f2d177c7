//! What every format's reader shares, below them all: the event it gives with what the
//! recording said beside it ([`Recorded`]), what a reader keeps beside the events
//! ([`Beside`]), and the one trait each format implements ([`FormatEvents`]), which
//! [`super::reader::TraceReader`] reads every form through.

use std::collections::HashMap;

use super::kept::Keeper;
use super::{Event, MAX_MARK_BYTES, Mark, Site, TraceError};

/// One event as a reader gives it, with what the recording said beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    pub event: Event,
    /// Nanoseconds since the recording started; an event without a time has its
    /// predecessor's, and every one before the first time has none.
    pub time: Option<u64>,
    /// The number of its site in the reader's site table (0: none); `None` when the
    /// trace names no site for it.
    pub site: Option<u32>,
    /// For a free of GPU memory, the stream whose queued work it waited for.
    pub stream: Option<u64>,
}

/// What a reader keeps beside the events: the marks and sites within their bounds, and
/// how many events it has given.
#[derive(Debug, Default)]
pub(crate) struct Beside {
    pub(crate) marks: Vec<Mark>,
    pub(crate) site_table: HashMap<u32, Site>,
    pub(crate) keeper: Keeper,
    pub(crate) first_left_out: Option<u64>,
    /// Events given so far: where a mark read now stands.
    pub(crate) events: u64,
    pub(crate) cut_short: bool,
}

impl Beside {
    /// A comment between events, as a mark where the reader is (escaped and cut: a
    /// trace is input); past the bounds, counted.
    pub(crate) fn mark(&mut self, comment: &str) {
        let text = crate::untrusted::escape_at_most(comment.trim(), MAX_MARK_BYTES);
        if self.keeper.keep_mark(self.marks.len(), &text) {
            self.marks.push(Mark {
                at: self.events,
                text,
            });
        } else {
            self.first_left_out.get_or_insert(self.events);
        }
    }
}

/// A trace's events in one form, as its reader gives them: the text form, RMM's log,
/// the binary form, a snapshot read whole.
pub(crate) trait FormatEvents {
    /// The next event in the recording's order, its marks and sites put `beside` as
    /// they come; `None` at the end.
    fn next_event(&mut self, beside: &mut Beside) -> Result<Option<Recorded>, TraceError>;

    /// Whether the input ended before the trace's end (a killed recording).
    fn cut_short(&self) -> bool;
}
