//! Recording and replaying allocation traces.

use std::io::Write;
use std::sync::{Arc, Mutex};

use allocbox::nep49::{MemHandler, default_handler};
use allocbox::trace::{Recorder, parse_trace, read_trace, replay_trace};

use super::support::*;

/// A `Write` the test can read back.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);
impl Write for Shared {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Shared {
    /// What was recorded into it, in the text form.
    fn text(&self) -> String {
        let trace = allocbox::trace::parse_trace_marked(&self.0.lock().unwrap()[..]).unwrap();
        let mut text = Vec::new();
        allocbox::trace::write_text(&trace, &mut text).unwrap();
        String::from_utf8(text).unwrap()
    }
}

#[test]
fn a_trace_recorded_with_time_and_sites_reads_back_with_both_and_replays_alike() {
    use allocbox::trace::{RecordOptions, Site, parse_trace_marked};
    let out = Shared::default();
    // Line 11 made its blocks inside a library's function.
    let site = |line| Site {
        file: "/home/me/my job.py".into(),
        line,
        function: "build_peak".into(),
        via: (line == 11).then(|| {
            Arc::new(Site {
                file: "/venv/site-packages/scipy/spatial/distance.py".into(),
                line: 2926,
                function: "cdist".into(),
                via: None,
            })
        }),
    };
    let next = std::sync::atomic::AtomicU32::new(0);
    let options = RecordOptions {
        time: true,
        sites: Some(Box::new(move || {
            let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(site(10 + n % 2))
        })),
    };
    let rec = Recorder::with_options(
        Arc::new(handler(&allocbox_artifacts::SYSTEM, &[])),
        out.clone(),
        options,
    );
    let a = rec.malloc(10).unwrap();
    let b = rec.malloc(20).unwrap();
    let c = rec.malloc(30).unwrap();
    for (p, size) in [(a, 10), (b, 20), (c, 30)] {
        rec.free(p, size).unwrap();
    }
    rec.finish().unwrap();
    let text = out.text();
    let trace = parse_trace_marked(text.as_bytes()).unwrap();
    assert_eq!(trace.events.len(), 6);
    assert!(trace.marks.is_empty(), "site records are not marks: {text}");
    assert_eq!(trace.times.len(), 6);
    assert!(trace.times.is_sorted(), "{:?}", trace.times);
    assert_eq!(trace.sites, [1, 2, 1, 0, 0, 0], "{text}");
    assert_eq!(trace.site_table[&1], site(10));
    assert_eq!(trace.site_table[&2], site(11));
    assert_eq!(
        trace.site_table[&2].place(),
        "/home/me/my job.py:11 → /venv/site-packages/scipy/spatial/distance.py:2926"
    );
    // The same events as a trace without the new fields.
    let plain: Vec<_> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(' ').take(4).collect::<Vec<_>>().join(" "))
        .collect();
    let plain = parse_trace(plain.join("\n").as_bytes()).unwrap();
    let ops = |events: &[allocbox::trace::Event]| {
        events
            .iter()
            .map(|e| (e.op, e.id, e.size, e.thread))
            .collect::<Vec<_>>()
    };
    assert_eq!(ops(&plain), ops(&trace.events));
}

#[test]
fn a_recording_ends_where_it_is_finished_so_what_is_live_then_is_what_leaked() {
    let out = Shared::default();
    let rec = Recorder::new(
        Arc::new(handler(&allocbox_artifacts::SYSTEM, &[])),
        out.clone(),
    );
    let kept = rec.malloc(10).unwrap();
    rec.finish().unwrap();
    let later = rec.malloc(20).unwrap();
    rec.free(later, 20).unwrap();
    rec.free(kept, 10).unwrap();
    rec.finish().unwrap();
    let text = out.text();
    let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(lines, ["m 1 10 1"], "served after the end, not written");
}

#[test]
fn a_recorded_trace_replays_to_the_same_calls() {
    let out = Shared::default();
    let rec = Recorder::new(
        Arc::new(handler(&allocbox_artifacts::SYSTEM, &[])),
        out.clone(),
    );
    let a = rec.malloc(10).unwrap();
    let b = rec.calloc(4, 8).unwrap();
    let a = rec.realloc(a, 100).unwrap();
    rec.free(None, 5).unwrap();
    rec.free(b, 32).unwrap();
    rec.free(a, 100).unwrap();
    rec.finish().unwrap();
    let text = out.text();
    let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(
        lines,
        [
            "m 1 10 1",
            "c 2 32 1",
            "r 1 100 1",
            "f 0 5 1",
            "f 2 32 1",
            "f 1 100 1"
        ]
    );

    let events = parse_trace(text.as_bytes()).unwrap();
    let report = replay_trace(&handler(&allocbox_artifacts::ARENA, &[]), &events);
    assert!(report.failure.is_none());
    assert_eq!(
        (
            report.stats.mallocs,
            report.stats.callocs,
            report.stats.reallocs,
            report.stats.frees
        ),
        (1, 1, 1, 2)
    );
    assert_eq!(report.null_frees, 1);
}

#[test]
fn replay_tolerates_the_trace_quirks_and_counts_wrong_size_frees() {
    let text = "# header\nm 1 8 1\nr 1 16 1\nf 1 8 1\nf 77 8 1\nf 0 3 1\nr 99 24 1\nf 99 24 1\n";
    let events = parse_trace(text.as_bytes()).unwrap();
    let report = replay_trace(&handler(&allocbox_artifacts::SIZE_CLASSES, &[]), &events);
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert_eq!(
        report.stats.size_corrections, 1,
        "realloc to 16 then free with 8"
    );
    assert_eq!(
        report.unknown_ids, 2,
        "the free of 77 and the realloc of 99"
    );
    assert_eq!(report.null_frees, 1);
}

#[test]
fn replay_names_the_event_that_failed() {
    let events = parse_trace("m 1 8 1\nm 2 8 1\nf 2 8 1\n".as_bytes()).unwrap();
    let report = replay_trace(&broken("double-free"), &events);
    let (event, error) = report.failure.expect("the free breaks a rule");
    assert_eq!(event.line, 3);
    assert!(event.to_string().contains("line 3"));
    assert_eq!(error.rule().map(|r| r.name()), Some("double-free"));
}

#[test]
fn a_trace_of_several_threads_replays_each_block_s_life_in_order_across_threads() {
    // Block 1 is made on thread 1, grown on thread 2, freed back on thread 1; block 2
    // is made on thread 2 and freed on thread 1 with a wrong size.
    let text = "m 1 16 1\nm 2 32 2\nr 1 4000 2\nf 2 8 1\nm 3 24 2\nf 1 4000 1\nf 3 24 2\n";
    let events = parse_trace(text.as_bytes()).unwrap();
    assert_eq!(events.iter().map(|e| e.thread).max(), Some(2));
    let h = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    let report = replay_trace(&h, &events);
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert_eq!(report.events, 7);
    let s = &report.stats;
    assert_eq!((s.mallocs, s.reallocs, s.frees), (3, 1, 3));
    assert_eq!((s.live_blocks, s.size_corrections), (0, 1));
    h.audit().unwrap();
    h.leak_check().unwrap();
}

#[test]
fn a_trace_recorded_on_several_threads_replays_on_as_many() {
    let out = Shared::default();
    let rec = Recorder::new(
        Arc::new(handler(&allocbox_artifacts::SYSTEM, &[])),
        out.clone(),
    );
    let (send, receive) = std::sync::mpsc::channel::<usize>();
    std::thread::scope(|s| {
        s.spawn(|| {
            for size in 1..200 {
                let p = rec.malloc(size).unwrap().unwrap();
                send.send(p.as_ptr() as usize).unwrap();
            }
            drop(send);
        });
        s.spawn(|| {
            for (size, addr) in (1..200).zip(receive) {
                rec.free(std::ptr::NonNull::new(addr as *mut u8), size)
                    .unwrap();
            }
        });
    });
    rec.finish().unwrap();
    let events = parse_trace(&out.0.lock().unwrap()[..]).unwrap();
    let threads: std::collections::BTreeSet<u32> = events.iter().map(|e| e.thread).collect();
    assert_eq!(threads.len(), 2, "each client thread is numbered");
    let h = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    let report = replay_trace(&h, &events);
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert_eq!((report.stats.mallocs, report.stats.frees), (199, 199));
    assert_eq!(report.unknown_ids, 0, "every free came after its malloc");
    h.leak_check().unwrap();
}

#[test]
fn a_bad_trace_line_is_a_syntax_error_with_its_number() {
    let err = parse_trace("m 1 8 1\nx 1 2 3\n".as_bytes()).unwrap_err();
    assert!(err.to_string().starts_with("line 2"), "{err}");
}

/// The first events of NumPy's own recorded suite, through every shipped policy and the
/// native default: zero violations. (All 11.6 M events: `cargo bench --bench replay`.)
#[test]
fn numpy_s_recorded_trace_replays_through_every_policy_without_violation() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/traces/numpy-core-sample.txt.gz"
    );
    let Ok(events) = read_trace(path) else {
        panic!("{path} is missing: the NumPy trace lives in shared/ beside the repository");
    };
    let prefix = &events[..events.len().min(400_000)];
    let native = replay_trace(&*default_handler(), prefix);
    assert!(native.failure.is_none());
    for guest in allocbox_artifacts::GOOD {
        let report = replay_trace(&handler(guest, &[]), prefix);
        assert!(
            report.failure.is_none(),
            "{}: {:?}",
            guest.name,
            report.failure
        );
        assert_eq!(report.stats.live_blocks, 0, "{}", guest.name);
    }
}

/// The start of NumPy's own recorded suite, converted to the binary form and back by
/// `trace-convert`: every event, mark and thread as it was, in a fraction of the gzip
/// text's bytes.
#[test]
fn numpy_s_trace_converted_to_binary_and_back_keeps_every_event_and_mark() {
    let shared = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/traces/numpy-core-sample.txt.gz"
    );
    let mut original = allocbox::trace::read_trace_marked(shared).unwrap();
    original.events.truncate(400_000);
    original.marks.retain(|m| m.at < 400_000);
    let dir = tempdir("convert-numpy");
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(dir.join("numpy.txt.gz")).unwrap(),
        flate2::Compression::default(),
    );
    allocbox::trace::write_text(&original, &mut gz).unwrap();
    gz.finish().unwrap();
    for (from, to) in [("numpy.txt.gz", "numpy.trace"), ("numpy.trace", "back.txt")] {
        let (code, out) = allocbox_cli(&["trace-convert", from, to], &dir);
        assert_eq!(code, 0, "{out}");
    }
    let back = allocbox::trace::read_trace_marked(dir.join("back.txt")).unwrap();
    // Its ids are renumbered in the order blocks are made (the binary form names
    // blocks by address): the same calls, each block's life the same.
    let calls = |t: &allocbox::trace::Trace| {
        t.events
            .iter()
            .map(|e| (e.op, e.size, e.thread))
            .collect::<Vec<_>>()
    };
    assert!(calls(&back) == calls(&original), "the calls differ");
    // One block of one is one block of the other, for its whole life.
    let mut as_back = std::collections::HashMap::new();
    for (at, (was, is)) in original.events.iter().zip(&back.events).enumerate() {
        use allocbox::trace::EventOp::*;
        let same = match was.op {
            Malloc | Calloc => {
                as_back.insert(was.id, is.id);
                true
            }
            Realloc => *as_back.entry(was.id).or_insert(is.id) == is.id,
            Free => match as_back.remove(&was.id) {
                Some(id) => id == is.id,
                None if was.id == 0 => is.id == 0,
                None => is.id == allocbox::trace::UNKNOWN_ID,
            },
        };
        assert!(same, "event {at}: {was} is {is}");
    }
    assert_eq!(back.marks, original.marks);
    let binary = std::fs::metadata(dir.join("numpy.trace")).unwrap().len();
    let gzip = std::fs::metadata(dir.join("numpy.txt.gz")).unwrap().len();
    assert!(binary * 2 < gzip, "{binary} bytes binary, {gzip} gzip text");
}

/// `--hook` attaches an event hook to a replay: the shipped `sizes` hook by name reports
/// a histogram of the trace's requests; `counting` on each handler of a report; a name
/// that is neither a file nor shipped lists the shipped hooks.
#[test]
fn replay_trace_and_report_run_an_event_hook_and_print_its_report() {
    let dir = tempdir("hook-replay");
    std::fs::write(
        dir.join("t.trace"),
        "m 1 100 1\nm 2 3000 1\nr 1 200 1\nf 1 200 1\nf 2 3000 1\n",
    )
    .unwrap();
    let (code, out) = allocbox_cli(
        &[
            "replay-trace",
            "t.trace",
            "-p",
            "size-classes",
            "--hook",
            "sizes",
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("hook `sizes` on `size-classes`"), "{out}");
    let count = |range: &str| {
        out.lines()
            .find(|l| l.contains(range))
            .and_then(|l| l.split_whitespace().last())
            .map(str::to_string)
    };
    assert_eq!(count("64 B – 128 B").as_deref(), Some("1"), "{out}");
    assert_eq!(count("2.0 KiB – 4.0 KiB").as_deref(), Some("1"), "{out}");
    let (code, out) = allocbox_cli(
        &[
            "report", "t.trace", "-p", "system", "-p", "default", "--hook", "counting", "-o",
            "r.html",
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("hook `counting` on `system`: 2 2 1 3100"),
        "{out}"
    );
    assert!(
        out.contains("hook `counting` on `default`: 2 2 1 3100"),
        "{out}"
    );
    let (code, out) = allocbox_cli(&["replay-trace", "t.trace", "--hook", "sises"], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("the hook `sises`: cannot read the hook: No such file")
            && out.contains("sizes, counting"),
        "{out}"
    );
}

/// `check --hook` tells the hook about every block the checker's clients get and give
/// back, and prints its report after the policy's: every new block is freed.
#[test]
fn check_runs_an_event_hook_over_every_case() {
    let dir = tempdir("hook-check");
    let (code, out) = allocbox_cli(
        &[
            "check",
            "size-classes",
            "--rounds",
            "1",
            "--cases",
            "4",
            "--hook",
            "counting",
            "--regressions",
            ".",
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    let numbers: Vec<u64> = out
        .lines()
        .find_map(|l| l.strip_prefix("hook `counting` on `size-classes`: "))
        .unwrap_or_else(|| panic!("no hook report: {out}"))
        .split(' ')
        .map(|n| n.parse().unwrap())
        .collect();
    let [new, free, _renew, bytes] = numbers[..] else {
        panic!("{out}")
    };
    assert!(new > 0 && new == free && bytes > 0, "{out}");
}

/// A hook's report is the hook's own: one named `sizes` (by its file) that answers a
/// hundred huge counts is printed as far as sizes go, without the host overflowing.
#[test]
fn a_hook_report_longer_than_the_sizes_there_are_is_cut_not_a_crash() {
    let dir = tempdir("hook-long-report");
    std::fs::write(dir.join("t.trace"), "m 1 100 1\nf 1 100 1\n").unwrap();
    std::fs::write(
        dir.join("sizes.wat"),
        r#"(module
            (memory (export "memory") 1)
            (func (export "allocbox:policy/events@0.1.0#on-event") (param i64 i64 i64))
            (func (export "allocbox:policy/events@0.1.0#report") (result i32)
              (memory.fill (i32.const 64) (i32.const 255) (i32.const 800))
              (i32.store (i32.const 0) (i32.const 64))
              (i32.store (i32.const 4) (i32.const 100))
              (i32.const 0)))"#,
    )
    .unwrap();
    let (code, out) = allocbox_cli(&["replay-trace", "t.trace", "--hook", "sizes.wat"], &dir);
    assert_eq!(code, 0, "{out}");
    let rows = out.lines().filter(|l| l.contains(" – ")).count();
    assert_eq!(rows, 64, "{out}");
    assert!(out.contains("16384 PiB"), "{out}");
}

/// Found probing the hook world: a hook that trapped was stopped and the run went on,
/// yet `replay-trace` and `report` exited 0 and said the hook failed "in `malloc`" as a
/// policy. A failed hook is named as a hook, in its own call, and fails the run.
#[test]
fn a_failing_hook_fails_the_run_and_is_named_as_a_hook() {
    let dir = tempdir("hook-fails");
    std::fs::write(dir.join("t.trace"), "m 1 100\nf 1 100\n").unwrap();
    let trapping = r#"(module
        (func (export "allocbox:policy/events@0.1.0#on-event") (param i64 i64 i64) unreachable)
        (func (export "allocbox:policy/events@0.1.0#report") (result i32) unreachable)
        (memory (export "memory") 1))"#;
    std::fs::write(dir.join("trapping.wat"), trapping).unwrap();
    let (code, out) = allocbox_cli(
        &[
            "replay-trace",
            "t.trace",
            "-p",
            "system",
            "--hook",
            "trapping.wat",
        ],
        &dir,
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("event hook `trapping` trapped in `on-event`"),
        "{out}"
    );
    assert!(!out.contains("policy `trapping`"), "{out}");
    let (code, out) = allocbox_cli(
        &[
            "report",
            "t.trace",
            "-p",
            "system",
            "--hook",
            "trapping.wat",
            "-o",
            "r.html",
        ],
        &dir,
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("event hook `trapping`"), "{out}");
    let (code, out) = allocbox_cli(
        &[
            "check",
            "--rounds",
            "1",
            "--cases",
            "4",
            "--hook",
            "trapping.wat",
        ],
        &dir,
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAILED") && out.contains("event hook `trapping` trapped in `on-event`"),
        "{out}"
    );
}

/// Issue 65: a trace with a GPU's blocks among the host's. `trace-convert` keeps every
/// event with its GPU and stream; `replay-trace` replays the host's events through host
/// policies and says how many of the GPU's it left out; `report` replays those through
/// a device policy on a stand-in GPU, as a part of the page of their own.
#[test]
fn a_trace_with_gpu_memory_converts_whole_and_replays_each_memory_through_its_own_policies() {
    let dir = tempdir("gpu-events");
    std::fs::write(
        dir.join("t.trace"),
        "m 1 100 1\nm 1 4096 1 d=0\n# phase\nf 1 4096 1 d=0 q=7\nm 2 64 1\nf 1 100 1\nf 2 64 1\n",
    )
    .unwrap();
    let (code, out) = allocbox_cli(&["trace-convert", "t.trace", "t.bin"], &dir);
    assert_eq!(code, 0, "{out}");
    let (code, out) = allocbox_cli(
        &["trace-convert", "t.bin", "back.txt", "--to", "text"],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    let back = std::fs::read_to_string(dir.join("back.txt")).unwrap();
    assert!(back.contains("m 2 4096 1 d=0\n"), "{back}");
    assert!(back.contains("f 2 4096 1 d=0 q=7\n"), "{back}");
    let (code, out) = allocbox_cli(&["replay-trace", "t.bin", "-p", "size-classes"], &dir);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("has 2 events of GPU memory, which this command does not replay"),
        "{out}"
    );
    assert!(out.contains("(4 events, replayed on"), "{out}");
    let (code, out) = allocbox_cli(
        &[
            "report",
            "t.bin",
            "-p",
            "size-classes",
            "-o",
            "r.html",
            "--hook",
            "sizes",
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    let gpu = &out[out.find("t.bin, GPU 0:").unwrap_or_else(|| panic!("{out}"))..];
    let row = gpu.lines().find(|l| l.starts_with("gpu-pool")).unwrap();
    // Two events; 4 KiB live at the peak; gpu-pool maps a 64 MiB region to start with.
    assert_eq!(row.split_whitespace().nth(1), Some("2"), "{row}");
    assert!(row.contains("4.0 KiB") && row.contains("64 MiB"), "{row}");
    assert!(
        gpu.contains("held in the regions it mapped of the GPU's memory"),
        "{gpu}"
    );
    assert!(
        gpu.contains("hook `sizes` on `gpu-pool`"),
        "the hook is told the GPU's events: {gpu}"
    );
    assert!(
        gpu.contains("on GPU 0 of 80 GiB (--device-memory), `gpu-pool` fit"),
        "{gpu}"
    );
    // Would it have fit a smaller GPU?
    let (code, out) = allocbox_cli(
        &[
            "report",
            "t.bin",
            "-p",
            "system",
            "-o",
            "small.html",
            "--device-memory",
            "1MiB",
        ],
        &dir,
    );
    // Issue 74: a replay that ran out of memory was compared as if it had run, its row
    // said `failure none` and the command ended 0.
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("on GPU 0 of 1.0 MiB (--device-memory), `gpu-pool` ran out of memory 1 time"),
        "{out}"
    );
    let gpu = &out[out.find("t.bin, GPU 0:").unwrap_or_else(|| panic!("{out}"))..];
    let row = gpu.lines().find(|l| l.starts_with("gpu-pool")).unwrap();
    assert!(row.contains("ran out of memory 1 time"), "{row}");
    let page = std::fs::read_to_string(dir.join("r.html")).unwrap();
    assert!(
        page.contains("<h1>allocbox report: t.bin, GPU 0</h1>"),
        "a part of its own"
    );
    assert!(
        page.contains("held in the GPU&#39;s regions"),
        "the legend says whose memory"
    );
}

/// Issue 62: a user who ran out of GPU memory under RAPIDS has RMM's log of it; `report`
/// reads it as a trace of GPU memory and says which device policy would have fit.
#[test]
fn an_rmm_log_is_replayed_under_device_policies_and_says_which_would_fit() {
    let dir = tempdir("rmm-log");
    let mut log = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
    for i in 0..200u64 {
        let at = 0x7f00_0000_0000 + i * 0x10_0000;
        log += &format!(
            "7,{}.0,allocate,{at:#x},{},0x1\n",
            1_700_000_000 + i,
            4096 + i * 64
        );
        if i % 3 == 0 {
            log += &format!(
                "7,{}.5,deallocate,{at:#x},{},0x1\n",
                1_700_000_000 + i,
                4096 + i * 64
            );
        }
    }
    std::fs::write(dir.join("rmm.csv"), log).unwrap();
    let (code, out) = allocbox_cli(
        &[
            "report",
            "rmm.csv",
            "-p",
            "default",
            "-o",
            "r.html",
            "--device-memory",
            "512MiB",
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("rmm.csv, GPU 0:"), "{out}");
    assert!(
        out.contains("of 512 MiB (--device-memory), `gpu-pool` fit"),
        "{out}"
    );
    let (code, out) = allocbox_cli(
        &["trace-convert", "rmm.csv", "rmm.txt", "--to", "text"],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    let text = std::fs::read_to_string(dir.join("rmm.txt")).unwrap();
    assert!(
        text.contains("\nf 1 4096 1 t=500000000 d=0 q=1\n"),
        "{text}"
    );
}

/// A trace naming more GPUs than any machine has would make a report replay it once
/// a GPU: refused in one line.
#[test]
fn a_trace_naming_more_gpus_than_a_report_draws_is_refused_in_one_line() {
    let dir = tempdir("many-gpus");
    let text: String = (0..65).map(|gpu| format!("m 1 64 1 d={gpu}\n")).collect();
    std::fs::write(dir.join("t.trace"), text).unwrap();
    let (code, out) = allocbox_cli(
        &["report", "t.trace", "-p", "default", "-o", "r.html"],
        &dir,
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("names more than 64 GPUs, past the 64 a command reads"),
        "{out}"
    );
}

/// Issue 61: `report` held every event (~98 bytes each), so a long recording did not fit
/// in memory. Now it holds what the program held at once: a recording of 1.2 M events
/// whose client never holds more than a few blocks, with a thread that made one block at
/// the start and freed it at the end (its chunk, written last, comes first in order),
/// is reported within a bound far below what holding its events took.
#[test]
fn a_long_recording_is_reported_in_the_memory_of_what_it_held_not_of_its_length() {
    let dir = tempdir("long-recording");
    let path = dir.join("long.trace");
    let recorder = Recorder::create(
        &path,
        default_handler(),
        allocbox::trace::RecordOptions::default(),
    )
    .unwrap();
    let (made, is_made) = std::sync::mpsc::channel::<()>();
    let (free_it, to_free) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let recorder = &recorder;
        s.spawn(move || {
            let block = recorder.malloc(4096).unwrap();
            made.send(()).unwrap();
            to_free.recv().unwrap();
            recorder.free(block, 4096).unwrap();
        });
        is_made.recv().unwrap();
        for _ in 0..300_000 {
            let a = recorder.malloc(64).unwrap();
            let b = recorder.malloc(64).unwrap();
            recorder.free(b, 64).unwrap();
            recorder.free(a, 64).unwrap();
        }
        free_it.send(()).unwrap();
    });
    recorder.finish().unwrap();
    let (code, out, peak_kib) = allocbox_cli_peak_rss(
        &["report", "long.trace", "-p", "default", "-o", "page.html"],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    // 1.2 M events held whole took ~115 MiB beside the command's own.
    assert!(peak_kib < 48 << 10, "report took {peak_kib} KiB: {out}");
    let page = std::fs::read_to_string(dir.join("page.html")).unwrap();
    assert!(page.contains("1200002"), "every event replayed");
    // The waiting thread's block is live throughout: the peak counts it.
    assert!(out.contains("4.1 KiB") || out.contains("4.2 KiB"), "{out}");
}

/// Issue 72: "replayed on 65536 threads" where at most 64 run: the line says how many
/// ran and how many recorded threads shared them.
#[test]
fn replay_trace_says_how_many_threads_ran_and_how_many_shared_them() {
    let dir = tempdir("replay-threads");
    let mut text = String::new();
    for thread in 1..=100 {
        text += &format!("m {thread} 64 {thread}\nf {thread} 64 {thread}\n");
    }
    std::fs::write(dir.join("t.trace"), text).unwrap();
    let (code, out) = allocbox_cli(&["replay-trace", "t.trace", "-p", "default"], &dir);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(
            "(200 events, replayed on 64 threads, the recording's 100 threads sharing them)"
        ),
        "{out}"
    );
}

/// Issue 74: `trace-convert S.pickle S.txt.gz` wrote the binary form into a `.txt.gz`.
/// An output named `.txt` or `.txt.gz` is text, whatever the input's form.
#[test]
fn trace_convert_writes_text_where_the_output_s_name_says_text() {
    let dir = tempdir("convert-by-name");
    std::fs::write(dir.join("t.txt"), "m 1 8\nf 1 8\n").unwrap();
    for output in ["again.txt", "again.txt.gz"] {
        let (code, out) = allocbox_cli(&["trace-convert", "t.txt", output], &dir);
        assert_eq!(code, 0, "{out}");
        assert!(out.contains("(text)"), "{output}: {out}");
        let bytes = std::fs::read(dir.join(output)).unwrap();
        let text = match output.ends_with(".gz") {
            true => {
                let mut text = String::new();
                std::io::Read::read_to_string(
                    &mut flate2::read::GzDecoder::new(&bytes[..]),
                    &mut text,
                )
                .unwrap();
                text
            }
            false => String::from_utf8(bytes).unwrap(),
        };
        assert!(text.contains("m 1 8"), "{output}: {text}");
    }
}

/// Issue 74: `--device-memory X` let policies map three quarters of X, and the host's
/// 256 MiB overhead budget capped what a device policy cached: a run that fit in X ran
/// out of memory on X. A GPU trace of 100 MiB live fits a 128 MiB GPU.
#[test]
fn a_gpu_trace_that_fits_in_the_device_memory_runs_out_of_none() {
    let dir = tempdir("device-fits");
    let mut text = String::new();
    for id in 1..=4u64 {
        text += &format!("m {id} {} 1 d=0\n", 25u64 << 20);
    }
    for id in 1..=4u64 {
        text += &format!("f {id} {} 1 d=0\n", 25u64 << 20);
    }
    std::fs::write(dir.join("g.trace"), text).unwrap();
    let (code, out) = allocbox_cli(
        &[
            "report",
            "g.trace",
            "-p",
            "default",
            "-o",
            "g.html",
            "--device-memory",
            "128MiB",
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("on GPU 0 of 128 MiB (--device-memory), `gpu-pool` fit"),
        "{out}"
    );
}

/// Issue 74: a snapshot's blocks live before its trace window (its `segments`: the
/// model's weights) were left out of every peak ("6.3 GiB at the most" against 19.37
/// GiB allocated), and every GPU line was `??:0 torch::unwind::unwind()`. The fixture
/// has the public snapshots' shape: 2 GiB of weights in `segments`, an activation
/// freed in the window but allocated before it, C++ frames above PyTorch's and the
/// user's. The replay starts with those blocks live, says so, and names the user's
/// lines.
#[test]
fn a_snapshot_replays_with_what_was_live_before_its_window_and_the_user_s_lines() {
    let dir = tempdir("snapshot-whole");
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/snapshot-weights-before-the-window.pickle");
    let fixture = fixture.to_str().unwrap();
    let (code, out) = allocbox_cli(&["report", fixture, "-p", "default", "-o", "s.html"], &dir);
    assert_eq!(code, 0, "{out}");
    let gpu = &out[out.find("GPU 0:").unwrap_or_else(|| panic!("{out}"))..];
    let row = gpu.lines().find(|l| l.starts_with("gpu-pool")).unwrap();
    assert!(
        row.contains("3.5 GiB"),
        "2.25 GiB before the window, 1.5 in it: {row}"
    );
    let page = std::fs::read_to_string(dir.join("s.html")).unwrap();
    assert!(
        page.contains("the recorded window starts here: 3 blocks (2.25 GiB) were live before it"),
        "the page says what was live before"
    );
    assert!(page.contains("modeling_llama.py:88"), "the user's line");
    assert!(
        !page.contains("??") && !page.contains("torch::unwind"),
        "no C++ frame"
    );
}
