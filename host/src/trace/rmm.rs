//! A log of RMM's logging resource adaptor read as a trace of GPU memory: the CSV whose
//! header is `Thread,Time,Action,Pointer,Size,Stream`, one allocation or deallocation a
//! row. What a user who ran out of GPU memory under RAPIDS already has, replayed under
//! any device policy by `allocbox report`.
//!
//! Every event is of GPU 0 (a log is one device's resource), a deallocation carries its
//! stream, threads are numbered from 1 in the order they first appear, blocks by the
//! order they are made (as the binary reader numbers addresses), and times are
//! nanoseconds since the first row when the log's times are seconds since the epoch.

use std::collections::HashMap;
use std::io::BufRead;

use super::text::Lines;
use super::{Event, EventOp, Trace, TraceError, UNKNOWN_ID};

const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// Is `line` (a file's first) the header of an RMM log?
pub(super) fn is_header(line: &str) -> bool {
    line.trim_start_matches('\u{feff}').replace(' ', "") == HEADER
}

/// The rows after the header, as a trace of GPU 0's memory.
pub(super) fn parse<R: BufRead>(lines: &mut Lines<R>) -> Result<Trace, TraceError> {
    let mut trace = Trace::default();
    let mut threads: HashMap<u64, u32> = HashMap::new();
    let mut ids: HashMap<u64, u64> = HashMap::new();
    let mut next_id = 1;
    let mut first_time: Option<f64> = None;
    let mut times_kept = true;
    while let Some((n, line)) = lines.next_line()? {
        if line.is_empty() {
            continue;
        }
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
            "allocate failure" | "allocate_failure" => continue,
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
        let count = threads.len() as u32;
        let thread = *threads.entry(thread).or_insert(count + 1);
        let id = match op {
            EventOp::Free => ids.remove(&pointer).unwrap_or(UNKNOWN_ID),
            _ => {
                next_id += 1;
                ids.insert(pointer, next_id - 1);
                next_id - 1
            }
        };
        // Seconds since the epoch, as RMM writes them; another clock's times are left out.
        match (time.parse::<f64>(), times_kept) {
            (Ok(seconds), true) if seconds.is_finite() => {
                let first = *first_time.get_or_insert(seconds);
                trace.times.push(((seconds - first).max(0.0) * 1e9) as u64);
            }
            _ => {
                times_kept = false;
                trace.times.clear();
            }
        }
        trace.streams.push((op == EventOp::Free).then_some(stream));
        trace.events.push(Event {
            op,
            id,
            size,
            thread,
            line: n,
            device: Some(0),
        });
    }
    if trace.streams.iter().all(Option::is_none) {
        trace.streams.clear();
    }
    Ok(trace)
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
