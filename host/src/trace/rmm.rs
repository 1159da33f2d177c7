//! A log of RMM's logging resource adaptor read as a trace of GPU memory: the CSV whose
//! header is `Thread,Time,Action,Pointer,Size,Stream`, one allocation or deallocation a
//! row. What a user who ran out of GPU memory under RAPIDS already has, replayed under
//! any device policy by `allocbox report`.
//!
//! Every event is of GPU 0 (a log is one device's resource), a deallocation carries its
//! stream, threads are numbered from 1 in the order they first appear, blocks by the
//! order they are made (as the binary reader numbers addresses), and times are
//! nanoseconds since the first row when its time is seconds since the epoch (a later
//! row whose time is not keeps its predecessor's). Read row by row, holding the live
//! blocks: a log of any length.

use std::collections::HashMap;
use std::io::BufRead;

use super::lines::Lines;
use super::recorded::Recorded;
use super::{Event, EventOp, TraceError, UNKNOWN_ID};
use crate::fasthash::FastMap;

const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// Is `line` (a file's first) the header of an RMM log?
pub(super) fn is_header(line: &str) -> bool {
    line.trim_start_matches('\u{feff}').replace(' ', "") == HEADER
}

/// The most of the log's threads numbered each on its own; the rest share the last
/// number (a log of a job's threads has a few dozen).
const MAX_THREADS: usize = 1 << 16;

/// The rows after the header read one at a time, as events of GPU 0's memory: holding
/// the live blocks' addresses and the threads' numbers.
#[derive(Debug)]
pub(super) struct RmmEvents {
    threads: HashMap<u64, u32>,
    ids: FastMap<u64, u64>,
    next_id: u64,
    /// The first row's time, when it is seconds since the epoch (as RMM writes them):
    /// a log whose first time is not has no times.
    first_time: Option<Option<f64>>,
    /// The last time given: a row whose time does not read keeps it.
    time: Option<u64>,
}

impl Default for RmmEvents {
    fn default() -> Self {
        RmmEvents {
            threads: HashMap::new(),
            ids: FastMap::default(),
            next_id: 1,
            first_time: None,
            time: None,
        }
    }
}

impl RmmEvents {
    /// The next row's event; `None` at the log's end.
    pub(super) fn next<R: BufRead>(
        &mut self,
        lines: &mut Lines<R>,
    ) -> Result<Option<Recorded>, TraceError> {
        while let Some((n, line)) = lines.next_line()? {
            if line.is_empty() {
                continue;
            }
            if let Some(recorded) = self.row(n, line)? {
                return Ok(Some(recorded));
            }
        }
        Ok(None)
    }

    /// Row `n`'s event, `None` for a row that made no block.
    fn row(&mut self, n: u32, line: &str) -> Result<Option<Recorded>, TraceError> {
        let bad = |message: String| TraceError::Syntax { line: n, message };
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let [thread, time, action, pointer, size, stream] = fields[..] else {
            return Err(bad(format!(
                "an RMM log's row has 6 fields ({HEADER}), this one {}",
                fields.len()
            )));
        };
        let op = match action {
            "allocate" => EventOp::Malloc,
            "deallocate" | "free" => EventOp::Free,
            // A failed allocation made no block.
            "allocate failure" | "allocate_failure" => return Ok(None),
            other => {
                return Err(bad(format!(
                    "`{}` is no action of an RMM log: allocate or deallocate",
                    crate::untrusted::escape_at_most(other, 32)
                )));
            }
        };
        let number = |what: &str, word: &str| -> Result<u64, TraceError> {
            let parsed = match word.strip_prefix("0x").or_else(|| word.strip_prefix("0X")) {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => word.parse(),
            };
            parsed.map_err(|e| {
                bad(format!(
                    "{what} `{}`: {e}",
                    crate::untrusted::escape_at_most(word, 32)
                ))
            })
        };
        let (thread, pointer, size, stream) = (
            number("thread", thread)?,
            number("pointer", pointer)?,
            number("size", size)?,
            number("stream", stream)?,
        );
        let count = self.threads.len() as u32;
        let thread = match self.threads.get(&thread) {
            Some(&number) => number,
            None if self.threads.len() < MAX_THREADS => {
                self.threads.insert(thread, count + 1);
                count + 1
            }
            None => count,
        };
        let id = match op {
            EventOp::Free => self.ids.remove(&pointer).unwrap_or(UNKNOWN_ID),
            _ => {
                self.next_id += 1;
                self.ids.insert(pointer, self.next_id - 1);
                self.next_id - 1
            }
        };
        let seconds = time.parse::<f64>().ok().filter(|s| s.is_finite());
        if let Some(first) = *self.first_time.get_or_insert(seconds)
            && let Some(seconds) = seconds
        {
            self.time = Some(((seconds - first).max(0.0) * 1e9) as u64);
        }
        let event = Event {
            op,
            id,
            size,
            thread,
            line: n,
            device: Some(0),
        };
        Ok(Some(Recorded {
            event,
            time: self.time,
            site: None,
            stream: (op == EventOp::Free).then_some(stream),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_trace_marked;
    use super::*;

    #[test]
    fn an_rmm_log_reads_as_a_trace_of_gpu_memory() {
        let log = "Thread,Time,Action,Pointer,Size,Stream\n\
            140573312345856,1634567890.5,allocate,0x7f8a40000000,1024,0x7f8a38001020\n\
            140573312345999,1634567890.75,allocate,0x7f8a40000400,2048,0x0\n\
            140573312345856,1634567891.5,deallocate,0x7f8a40000000,1024,0x7f8a38001020\n\
            140573312345856,1634567891.5,allocate failure,0x0,1099511627776,0x0\n";
        let trace = parse_trace_marked(log.as_bytes()).unwrap();
        let events: Vec<_> = trace
            .events
            .iter()
            .map(|e| (e.op, e.id, e.size, e.thread, e.device))
            .collect();
        assert_eq!(
            events,
            [
                (EventOp::Malloc, 1, 1024, 1, Some(0)),
                (EventOp::Malloc, 2, 2048, 2, Some(0)),
                (EventOp::Free, 1, 1024, 1, Some(0)),
            ]
        );
        assert_eq!(trace.times, [0, 250_000_000, 1_000_000_000]);
        assert_eq!(trace.streams, [None, None, Some(0x7f8a_3800_1020)]);
    }

    #[test]
    fn times_are_kept_when_the_first_row_s_is_seconds_and_a_row_without_keeps_the_last() {
        let header = "Thread,Time,Action,Pointer,Size,Stream\n";
        let rows = "1,100.5,allocate,0x10,8,0\n1,later,allocate,0x20,8,0\n1,101.0,free,0x10,8,0\n";
        let trace = parse_trace_marked(format!("{header}{rows}").as_bytes()).unwrap();
        assert_eq!(trace.times, [0, 0, 500_000_000]);
        let rows = "1,12:00:01,allocate,0x10,8,0\n1,100.5,free,0x10,8,0\n";
        let trace = parse_trace_marked(format!("{header}{rows}").as_bytes()).unwrap();
        assert!(trace.times.is_empty(), "another clock's: {:?}", trace.times);
    }

    #[test]
    fn a_row_that_is_not_rmm_s_is_refused_with_its_line() {
        let log = "Thread,Time,Action,Pointer,Size,Stream\n1,2,allocate,0x10,8,0\n1,2,steal,0x10\n";
        let error = parse_trace_marked(log.as_bytes()).unwrap_err().to_string();
        assert!(
            error.starts_with("line 3: ") && error.contains("6 fields"),
            "{error}"
        );
        let log = "Thread,Time,Action,Pointer,Size,Stream\n1,2,borrow,0x10,8,0\n";
        let error = parse_trace_marked(log.as_bytes()).unwrap_err().to_string();
        assert!(error.contains("`borrow` is no action"), "{error}");
    }
}
