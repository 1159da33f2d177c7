//! A text trace's lines, read within their bound: what every text dialect (the trace's
//! own form, RMM's log) reads through.

use std::cell::Cell;
use std::io::{BufRead, Read};
use std::rc::Rc;

use super::{MAX_LINE_BYTES, TraceError};

/// A trace's lines, each read within [`MAX_LINE_BYTES`] and as UTF-8, numbered from 1;
/// a last line without its end, in a stream cut short, is left out. Every text dialect
/// (the trace's own, RMM's log) reads through it.
pub(super) struct Lines<R> {
    input: R,
    cut_short: Rc<Cell<bool>>,
    raw: Vec<u8>,
    /// The number of the line read last.
    n: u32,
    /// The line read last is given again by the next call.
    again: bool,
}

impl<R: BufRead> Lines<R> {
    pub(super) fn new(input: R, cut_short: Rc<Cell<bool>>) -> Self {
        Lines {
            input,
            cut_short,
            raw: Vec::new(),
            n: 0,
            again: false,
        }
    }

    /// Whether the stream ended early.
    pub(super) fn cut_short(&self) -> bool {
        self.cut_short.get()
    }

    /// Give the line read last again at the next call.
    pub(super) fn read_again(&mut self) {
        self.again = true;
    }

    /// The next line, trimmed, with its number; `None` at the end.
    pub(super) fn next_line(&mut self) -> Result<Option<(u32, &str)>, TraceError> {
        if !std::mem::take(&mut self.again) {
            self.raw.clear();
            if (&mut self.input)
                .take(MAX_LINE_BYTES as u64 + 1)
                .read_until(b'\n', &mut self.raw)?
                == 0
                || self.cut_short.get() && !self.raw.ends_with(b"\n")
            {
                return Ok(None);
            }
            self.n = self.n.saturating_add(1);
        }
        let content = self.raw.strip_suffix(b"\n").unwrap_or(&self.raw);
        if content.len() > MAX_LINE_BYTES {
            return Err(TraceError::Syntax {
                line: self.n,
                message: format!(
                    "the line is longer than {MAX_LINE_BYTES} bytes: a trace's lines are \
                     events, sites and short comments (is this file a trace?)"
                ),
            });
        }
        match std::str::from_utf8(content) {
            Ok(text) => Ok(Some((self.n, text.trim()))),
            Err(_) => Err(TraceError::Syntax {
                line: self.n,
                message: "the line is not UTF-8 text (is this file a trace?)".into(),
            }),
        }
    }
}
