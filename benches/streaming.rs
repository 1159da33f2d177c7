//! Reading a long recording: the memory and the speed of `allocbox report` and
//! `allocbox replay-trace` on a trace of small arrays made over and over (what a
//! program making millions of `np.ones(8)` records), as the user runs them.
//!
//! Run: `cargo bench -p allocbox-cli --bench streaming` (`-- 300` for 300 M events; the
//! default is 30 M). The trace is generated once under `target/streaming/` through the
//! recorder `allocbox run` uses, with times and sites, and kept for later runs.
//!
//! Each command runs as a child process; its peak resident memory is the kernel's
//! (`wait4`'s `ru_maxrss`), its speed the trace's events over its wall time per policy
//! replayed.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use allocbox::MemHandler;
use allocbox::trace::{RecordOptions, Recorder, Site};

/// Events per iteration of the generated program's loop.
const EVENTS_PER_ROUND: u64 = 6;

fn main() {
    let millions: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(30);
    let events = millions * 1_000_000;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/streaming");
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join(format!("small-arrays-{millions}m.abt"));
    if !trace.exists() {
        let start = Instant::now();
        generate(&trace, events);
        eprintln!(
            "generated {} ({} bytes) in {:.1} s",
            trace.display(),
            std::fs::metadata(&trace).unwrap().len(),
            start.elapsed().as_secs_f64()
        );
    }
    let page = dir.join("page.html");
    let trace_arg = trace.to_str().unwrap();
    let page_arg = page.to_str().unwrap();
    let runs: [(&str, Vec<&str>, u64); 3] = [
        (
            "replay-trace -p size-classes",
            vec!["replay-trace", trace_arg, "-p", "size-classes"],
            1,
        ),
        (
            "report -p default",
            vec!["report", trace_arg, "-p", "default", "-o", page_arg],
            1,
        ),
        (
            "report -p default -p size-classes",
            vec![
                "report",
                trace_arg,
                "-p",
                "default",
                "-p",
                "size-classes",
                "-o",
                page_arg,
            ],
            2,
        ),
    ];
    println!(
        "{} M events of small arrays ({})",
        millions,
        trace.display()
    );
    let start = Instant::now();
    let mut reader = allocbox::trace::TraceReader::open(&trace).unwrap();
    while reader.next_event().unwrap().is_some() {}
    let read = start.elapsed().as_secs_f64();
    println!(
        "reading alone (in this process): {read:.2} s, {:.1} M events/s",
        reader.events_read() as f64 / read / 1e6
    );
    println!(
        "{:<36} {:>9} {:>12} {:>16}",
        "command", "wall s", "peak MiB", "M events/s/policy"
    );
    for (name, args, policies) in runs {
        let (wall, peak_kib, ok) = measure(&args);
        println!(
            "{name:<36} {wall:>9.1} {:>12.0} {:>16.2}{}",
            peak_kib as f64 / 1024.0,
            (events * policies) as f64 / wall / 1e6,
            if ok { "" } else { "  (exit status not 0)" }
        );
    }
}

/// One command's wall time, peak resident KiB and whether it succeeded.
fn measure(args: &[&str]) -> (f64, i64, bool) {
    let start = Instant::now();
    // Reaped by `wait4` below, which gives its resources too.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(env!("CARGO_BIN_EXE_allocbox"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: all-zero is a valid `rusage` (plain integers) for `wait4` to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: the pid is this process's own child, not yet waited for; `status` and
    // `usage` are valid places for the kernel to write.
    let waited = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    assert_eq!(waited, child.id() as i32, "wait4 failed");
    let wall = start.elapsed().as_secs_f64();
    (
        wall,
        usage.ru_maxrss,
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
    )
}

/// A recording of `events` events: each round makes an 8-element array (64 bytes) and a
/// temporary of its shape, and frees them; 1,000 longer-lived arrays of 320 bytes are
/// made again in turn, so the client holds ~313 KiB at its peak.
fn generate(path: &Path, events: u64) {
    let sites = [
        ("program.py", 12, "<module>"),
        ("program.py", 14, "step"),
        ("numpy/_core/numeric.py", 192, "ones"),
    ]
    .map(|(file, line, function)| Site {
        file: file.into(),
        line,
        function: function.into(),
        via: None,
    });
    let next = std::sync::atomic::AtomicUsize::new(0);
    let options = RecordOptions {
        time: true,
        sites: Some(Box::new(move || {
            let at = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(sites[at % sites.len()].clone())
        })),
    };
    let recorder = Recorder::create(path, Arc::new(allocbox::NumpyDefault::new()), options)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut kept: Vec<Option<std::ptr::NonNull<u8>>> = vec![None; 1000];
    for round in 0..events / EVENTS_PER_ROUND {
        let array = recorder.malloc(64).unwrap();
        let temporary = recorder.malloc(64).unwrap();
        recorder.free(temporary, 64).unwrap();
        let slot = &mut kept[(round % 1000) as usize];
        if let Some(old) = slot.take() {
            recorder.free(Some(old), 320).unwrap();
        }
        *slot = recorder.malloc(320).unwrap();
        recorder.free(array, 64).unwrap();
    }
    recorder.finish().unwrap();
}
