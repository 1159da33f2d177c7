//! A PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot`'s pickle) read as a
//! trace of GPU memory: what a user who hit a CUDA out-of-memory error has, replayed by
//! `allocbox report` under any device policy.
//!
//! The pickle is read as plain data (`trace/pickle.rs`: one naming code is refused).
//! Of its `device_traces` (one list of entries per GPU), an `alloc` is a malloc and a
//! `free_requested` a free with its stream; the caching allocator's own entries
//! (`free_completed`, `segment_*`, `snapshot`, `oom`) are not the program's and are left
//! out. An entry's `frames` (innermost first) name its site: the innermost frame outside
//! PyTorch's own code. With `time_us` on every entry, GPUs' entries are put in time
//! order; otherwise one GPU's follow another's.

use std::collections::HashMap;
use std::io::Read;

use super::file::TraceFile;
use super::kept::Keeper;
use super::pickle::{Id, Pickle, decode};
use super::{Event, EventOp, Trace, TraceError, UNKNOWN_ID};

/// The largest snapshot read: it is decoded whole, holding at most
/// [`super::pickle::budget`] bytes however far its bytes expand.
pub const MAX_SNAPSHOT_BYTES: u64 = 256 << 20;

/// The most GPUs a snapshot's traces are read for (a machine has far fewer).
const MAX_GPUS: usize = 64;

/// Do a file's first bytes say it is a pickle (protocol 2 to 5)?
pub(super) fn is_pickle(magic: &[u8]) -> bool {
    matches!(magic, [0x80, 2..=5, ..])
}

/// Read the snapshot in `file`: refused by its size, before any of it is read, past
/// [`MAX_SNAPSHOT_BYTES`].
pub(super) fn read(file: &TraceFile) -> Result<Trace, TraceError> {
    if file.len() > MAX_SNAPSHOT_BYTES {
        return Err(format_error(format!(
            "the memory snapshot is {} MiB, past the {} MiB allocbox reads",
            file.len() >> 20,
            MAX_SNAPSHOT_BYTES >> 20
        )));
    }
    let mut bytes = Vec::new();
    file.bytes()?
        .take(MAX_SNAPSHOT_BYTES + 1)
        .read_to_end(&mut bytes)?;
    read_bytes(&bytes)
}

/// The snapshot pickled in `bytes`.
fn read_bytes(bytes: &[u8]) -> Result<Trace, TraceError> {
    let pickle = decode(bytes).map_err(format_error)?;
    trace_of(&pickle)
}

fn format_error(message: String) -> TraceError {
    TraceError::Format(format!("a PyTorch memory snapshot: {message}"))
}

/// One entry of a device trace that the trace keeps.
#[derive(Clone, Copy)]
struct Entry {
    op: EventOp,
    device: u16,
    addr: u64,
    size: u64,
    stream: u64,
    time_us: Option<u64>,
    site: Option<Id>,
}

fn trace_of(pickle: &Pickle) -> Result<Trace, TraceError> {
    let traces = pickle.get(pickle.root, "device_traces").ok_or_else(|| {
        format_error("it has no `device_traces` (record with `torch.cuda.memory._record_memory_history()` first)".into())
    })?;
    let mut entries = Vec::new();
    // Each list and entry is read once: one shared through the memo (which no snapshot
    // does) would otherwise be read again for each place it is named.
    let mut read = vec![false; pickle.nodes.len()];
    let mut first_read = |id: Id| !std::mem::replace(&mut read[id], true);
    for (device, &list) in pickle.items(traces).iter().enumerate() {
        if device >= MAX_GPUS {
            return Err(format_error(format!(
                "it has traces of more than {MAX_GPUS} GPUs, more than any machine"
            )));
        }
        let device = device as u16;
        let shared = || {
            format_error(
                "one of its traces or entries is named twice (shared through the pickle's \
                 memo), which PyTorch never writes: is this file a memory snapshot?"
                    .into(),
            )
        };
        if !first_read(list) {
            return Err(shared());
        }
        for &entry in pickle.items(list) {
            if !first_read(entry) {
                return Err(shared());
            }
            let op = match pickle.get(entry, "action").and_then(|a| pickle.str(a)) {
                Some("alloc") => EventOp::Malloc,
                Some("free_requested") => EventOp::Free,
                _ => continue,
            };
            let number = |key| {
                pickle
                    .get(entry, key)
                    .and_then(|v| pickle.int(v))
                    .and_then(|n| u64::try_from(n).ok())
            };
            let (Some(addr), Some(size)) = (number("addr"), number("size")) else {
                return Err(format_error(format!(
                    "an `{}` entry of GPU {device} has no address or size",
                    if op == EventOp::Malloc {
                        "alloc"
                    } else {
                        "free_requested"
                    }
                )));
            };
            entries.push(Entry {
                op,
                device,
                addr,
                size,
                stream: number("stream").unwrap_or(0),
                time_us: number("time_us"),
                site: pickle.get(entry, "frames"),
            });
        }
    }
    if entries.iter().all(|e| e.time_us.is_some()) {
        entries.sort_by_key(|e| e.time_us);
    }
    let before = live_before_the_window(pickle, &entries)?;
    let before_bytes: u64 = before.iter().map(|e| e.size).sum();
    let before_count = before.len();
    let first_time = entries.first().and_then(|e| e.time_us);
    entries.splice(
        0..0,
        before.into_iter().map(|mut e| {
            e.time_us = first_time;
            e
        }),
    );
    let mut trace = Trace::default();
    let mut keeper = Keeper::default();
    let mut ids: HashMap<(u16, u64), u64> = HashMap::new();
    let mut site_numbers: HashMap<(String, u32, String), u32> = HashMap::new();
    // The site of each list of frames, found once: a list shared by many entries
    // through the memo is searched once, not once per entry.
    let mut site_of_frames: HashMap<Id, u32> = HashMap::new();
    let mut next_id = 1;
    let first_time = first_time.unwrap_or(0);
    let timed = entries.iter().all(|e| e.time_us.is_some());
    if before_count > 0 {
        // Said where the recorded window starts, as a mark the page shows.
        trace.marks.push(super::Mark {
            at: before_count as u64,
            text: format!(
                "the recorded window starts here: {before_count} blocks ({}) were live before \
                 it (the snapshot's segments, and blocks freed in it but allocated before it)",
                bytes_text(before_bytes)
            ),
        });
    }
    for (n, entry) in entries.iter().enumerate() {
        let id = match entry.op {
            EventOp::Free => ids
                .remove(&(entry.device, entry.addr))
                .unwrap_or(UNKNOWN_ID),
            _ => {
                next_id += 1;
                ids.insert((entry.device, entry.addr), next_id - 1);
                next_id - 1
            }
        };
        let site = match (entry.op, entry.site) {
            (EventOp::Malloc, Some(frames)) => match site_of_frames.get(&frames) {
                Some(&site) => site,
                None => {
                    let site = site_of(pickle, frames, &mut keeper, &mut trace, &mut site_numbers);
                    site_of_frames.insert(frames, site);
                    site
                }
            },
            _ => 0,
        };
        trace.sites.push(site);
        if timed {
            let us = entry
                .time_us
                .unwrap_or(first_time)
                .saturating_sub(first_time);
            trace.times.push(us.saturating_mul(1000));
        }
        trace
            .streams
            .push((entry.op == EventOp::Free).then_some(entry.stream));
        trace.events.push(Event {
            op: entry.op,
            id,
            size: entry.size,
            thread: 1,
            line: u32::try_from(n + 1).unwrap_or(u32::MAX),
            device: Some(entry.device),
        });
    }
    if trace.site_table.is_empty() {
        trace.sites.clear();
    }
    if trace.streams.iter().all(Option::is_none) {
        trace.streams.clear();
    }
    keeper.finish(&mut trace, None);
    Ok(trace)
}

/// The blocks live when the recorded window started, each as an allocation of it: a
/// block the snapshot's `segments` hold (their state when the snapshot was taken, at the
/// window's end) that the window never allocated, and a block the window frees but
/// never allocated. Ignored, they left the model's weights out of every peak.
fn live_before_the_window(pickle: &Pickle, window: &[Entry]) -> Result<Vec<Entry>, TraceError> {
    let mut made = std::collections::HashSet::new();
    let mut before = Vec::new();
    let mut known = std::collections::HashSet::new();
    for entry in window {
        let key = (entry.device, entry.addr);
        match entry.op {
            EventOp::Free if !made.contains(&key) && known.insert(key) => before.push(Entry {
                op: EventOp::Malloc,
                site: None,
                ..*entry
            }),
            EventOp::Free => {}
            _ => {
                made.insert(key);
                known.insert(key);
            }
        }
    }
    let number = |id: Id, key| {
        pickle
            .get(id, key)
            .and_then(|v| pickle.int(v))
            .and_then(|n| u64::try_from(n).ok())
    };
    let segments = pickle.get(pickle.root, "segments");
    for &segment in segments.map_or(&[][..], |s| pickle.items(s)) {
        let device = number(segment, "device").unwrap_or(0);
        let device = u16::try_from(device)
            .ok()
            .filter(|&d| usize::from(d) < MAX_GPUS)
            .ok_or_else(|| {
                format_error(format!("a segment is of GPU {device}, past any machine's"))
            })?;
        // A block's address is its own when the snapshot says it, else where the
        // blocks before it in the segment end.
        let mut at = number(segment, "address").unwrap_or(0);
        let blocks = pickle
            .get(segment, "blocks")
            .map_or(&[][..], |b| pickle.items(b));
        for &block in blocks {
            let size = number(block, "size").unwrap_or(0);
            let addr = number(block, "address").unwrap_or(at);
            at = addr.saturating_add(size);
            let state = pickle.get(block, "state").and_then(|s| pickle.str(s));
            if !matches!(state, Some("active_allocated" | "active_pending_free")) {
                continue;
            }
            if known.insert((device, addr)) {
                let asked = number(block, "requested_size")
                    .filter(|&n| n > 0)
                    .unwrap_or(size);
                before.push(Entry {
                    op: EventOp::Malloc,
                    device,
                    addr,
                    size: asked,
                    stream: 0,
                    time_us: None,
                    site: None,
                });
            }
        }
    }
    Ok(before)
}

/// `n` bytes as a person reads them.
fn bytes_text(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n => format!("{n} bytes"),
    }
}

/// The number of the site `frames` names, 0 for none; each site numbered once. As for a
/// host trace: the innermost frame of the program's own Python files, with the
/// innermost library frame inside it (PyTorch's, an installed package's) as the line it
/// was in. A frame of no Python file (the C++ unwinder's `??`, PyTorch's own C++) is
/// neither.
fn site_of(
    pickle: &Pickle,
    frames: Id,
    keeper: &mut Keeper,
    trace: &mut Trace,
    numbers: &mut HashMap<(String, u32, String), u32>,
) -> u32 {
    let frame = |id: Id| {
        let file = pickle.get(id, "filename").and_then(|f| pickle.str(f))?;
        if !file.ends_with(".py") {
            return None;
        }
        let line = pickle.get(id, "line").and_then(|l| pickle.int(l))?;
        let name = pickle
            .get(id, "name")
            .and_then(|n| pickle.str(n))
            .unwrap_or("?");
        let library = [
            "/torch/",
            "/site-packages/",
            "/dist-packages/",
            "/lib/python3",
        ]
        .iter()
        .any(|part| file.contains(part));
        Some((library, (file, u32::try_from(line).unwrap_or(0), name)))
    };
    let mut via = None;
    let mut own = None;
    for &id in pickle.items(frames) {
        match frame(id) {
            Some((true, found)) => {
                via.get_or_insert(found);
            }
            Some((false, found)) => {
                own = Some(found);
                break;
            }
            None => {}
        }
    }
    // No frame of the program's own: the library line it was in.
    let Some((file, line, name)) = own.or(via.take()) else {
        return 0;
    };
    let key = match via {
        Some((via_file, via_line, via_name)) => (
            format!("{file}\u{0}{via_file}"),
            line,
            format!("{name}\u{0}{via_line}\u{0}{via_name}"),
        ),
        None => (file.to_owned(), line, name.to_owned()),
    };
    if let Some(&number) = numbers.get(&key) {
        return number;
    }
    let kept = trace.site_table.len();
    let Some(mut site) = keeper.site(kept, false, line, name, file) else {
        return 0;
    };
    if let Some((via_file, via_line, via_name)) = via {
        site.via = keeper
            .site(kept, false, via_line, via_name, via_file)
            .map(std::sync::Arc::new);
    }
    let number = kept as u32 + 1;
    trace.site_table.insert(number, site);
    numbers.insert(key, number);
    number
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot pickled by protocol 4 as `pickle.dumps` writes one: the dict's keys and
    /// values with MARK / SETITEMS, lists with APPENDS (no memo: plain nesting).
    fn snapshot(entries: &[(&str, u64, u64, u64, u64, &str)]) -> Vec<u8> {
        fn s(out: &mut Vec<u8>, text: &str) {
            out.push(0x8c);
            out.push(text.len() as u8);
            out.extend(text.as_bytes());
        }
        fn int(out: &mut Vec<u8>, n: u64) {
            out.push(0x8a);
            out.push(8);
            out.extend(n.to_le_bytes());
        }
        let mut out = vec![0x80, 4, b'}', b'('];
        s(&mut out, "segments");
        out.push(b']');
        s(&mut out, "device_traces");
        out.extend(*b"](](");
        for &(action, addr, size, stream, time, file) in entries {
            out.extend(*b"}(");
            s(&mut out, "action");
            s(&mut out, action);
            for (key, value) in [
                ("addr", addr),
                ("size", size),
                ("stream", stream),
                ("time_us", time),
            ] {
                s(&mut out, key);
                int(&mut out, value);
            }
            s(&mut out, "frames");
            out.extend(*b"](");
            for (file, line) in [
                (
                    "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py",
                    125,
                ),
                (file, 7),
            ] {
                out.extend(*b"}(");
                s(&mut out, "filename");
                s(&mut out, file);
                s(&mut out, "line");
                int(&mut out, line);
                s(&mut out, "name");
                s(&mut out, "forward");
                out.push(b'u');
            }
            out.push(b'e');
            out.push(b'u');
        }
        out.extend(*b"eeu.");
        out
    }

    #[test]
    fn a_snapshot_s_allocations_and_requested_frees_are_a_trace_of_its_gpu() {
        let bytes = snapshot(&[
            ("segment_alloc", 0x7000, 2 << 20, 0, 5, "train.py"),
            ("alloc", 0x7000, 4096, 0, 10, "train.py"),
            ("alloc", 0x8000, 512, 7, 12, "model.py"),
            ("free_requested", 0x7000, 4096, 7, 20, "train.py"),
            ("free_completed", 0x7000, 4096, 7, 30, "train.py"),
        ]);
        let trace = read_bytes(&bytes).unwrap();
        let events: Vec<_> = trace
            .events
            .iter()
            .map(|e| (e.op, e.id, e.size, e.device))
            .collect();
        assert_eq!(
            events,
            [
                (EventOp::Malloc, 1, 4096, Some(0)),
                (EventOp::Malloc, 2, 512, Some(0)),
                (EventOp::Free, 1, 4096, Some(0)),
            ]
        );
        assert_eq!(trace.times, [0, 2000, 10_000]);
        assert_eq!(trace.streams, [None, None, Some(7)]);
        let site = &trace.site_table[&trace.sites[0]];
        assert_eq!(
            (&*site.file, site.line),
            ("train.py", 7),
            "the innermost frame outside torch"
        );
        assert_eq!(&*trace.site_table[&trace.sites[1]].file, "model.py");
    }

    /// Issue 72: snapshots of 5-11 MB took past 75-120 s: a list of frames shared by
    /// every entry through the memo was searched again for each. Here 20,000 entries
    /// share one list of 20,000 frames of PyTorch's own (4 x 10^8 frames searched, were
    /// each entry to search it); each list is searched once.
    #[test]
    fn a_list_of_frames_shared_by_every_entry_is_searched_once() {
        const N: u32 = 20_000;
        fn s(out: &mut Vec<u8>, text: &str) {
            out.push(0x8c);
            out.push(text.len() as u8);
            out.extend(text.as_bytes());
        }
        fn int(out: &mut Vec<u8>, n: u32) {
            out.push(b'J');
            out.extend(n.to_le_bytes());
        }
        let mut out = vec![0x80, 4, b'}', b'('];
        s(&mut out, "device_traces");
        out.extend(*b"](](");
        for n in 0..N {
            out.extend(*b"}(");
            s(&mut out, "action");
            s(&mut out, "alloc");
            s(&mut out, "addr");
            int(&mut out, n * 512);
            s(&mut out, "size");
            int(&mut out, 512);
            s(&mut out, "frames");
            if n == 0 {
                // The list, memoized as value 0, of frames all in PyTorch's own files.
                out.extend(*b"]\x94(");
                for line in 0..N {
                    out.extend(*b"}(");
                    s(&mut out, "filename");
                    s(&mut out, "/site-packages/torch/nn/modules/module.py");
                    s(&mut out, "line");
                    int(&mut out, line);
                    out.push(b'u');
                }
                out.push(b'e');
            } else {
                out.extend(*b"h\x00");
            }
            out.push(b'u');
        }
        out.extend(*b"eeu.");
        let trace = read_bytes(&out).unwrap();
        assert_eq!(trace.events.len(), N as usize);
        // No frame is the program's own: every entry has the one library line.
        assert_eq!(trace.site_table.len(), 1);
        assert!(trace.sites.iter().all(|&site| site == 1));
    }

    /// Issue 72: a 16 MB memo bomb was refused only after holding +831 MiB. What a
    /// decode holds is counted in bytes against a budget of the file's size: a
    /// megabyte of `None`s (48 bytes held each) is refused within 25 MiB.
    #[test]
    fn a_pickle_expanding_past_its_budget_is_refused_within_it() {
        let mut nones = vec![0x80, 4];
        nones.extend(std::iter::repeat_n(b'N', 1 << 20));
        let error = read_bytes(&nones).unwrap_err().to_string();
        assert!(
            error.contains("expands to more than 25 MiB of values (24 bytes for each of its own"),
            "{error}"
        );
        assert_eq!(super::super::pickle::budget(1 << 20), 25 << 20);
    }

    #[test]
    fn a_pickle_that_is_no_snapshot_says_what_it_lacks() {
        let error = read_bytes(&[0x80, 4, b'}', b'.']).unwrap_err().to_string();
        assert!(error.contains("no `device_traces`"), "{error}");
    }
}
