//! Helpers shared by the test modules.

use std::ptr::NonNull;

use allocbox::{Handler, HandlerBuilder, Policy, Runtime};
use allocbox_artifacts::Guest;
pub use allocbox_artifacts::hostile::*;

pub fn load(guest: &Guest) -> Policy {
    Runtime::shared()
        .load_file(guest.path())
        .unwrap_or_else(|e| panic!("loading {}: {e}", guest.name))
}

pub fn handler(guest: &Guest, config: &[(&str, &str)]) -> Handler {
    HandlerBuilder::new(Runtime::shared())
        .link_with(&load(guest), config)
        .build()
        .unwrap_or_else(|e| panic!("starting {}: {e}", guest.name))
}

/// A handler over the `broken` policy with one fault switched on.
pub fn broken(fault: &str) -> Handler {
    handler(&allocbox_artifacts::BROKEN, &[("fault", fault)])
}

pub fn fill(p: NonNull<u8>, len: usize, byte: u8) {
    // SAFETY: tests only pass blocks of at least `len` bytes that the handler lent them.
    unsafe { std::ptr::write_bytes(p.as_ptr(), byte, len) }
}

pub fn holds(p: NonNull<u8>, len: usize, byte: u8) -> bool {
    // SAFETY: as in `fill`.
    let bytes = unsafe { std::slice::from_raw_parts(p.as_ptr(), len) };
    // Compared a page at a time (memcmp): tests check megabytes after every step.
    let page = [byte; 4096];
    bytes.chunks(page.len()).all(|c| c == &page[..c.len()])
}

/// Run the `allocbox` command in `dir`: its exit code and everything it printed.
pub fn allocbox_cli(args: &[&str], dir: &std::path::Path) -> (i32, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_allocbox"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap(), text)
}

/// A fresh, empty directory for one test: `name` and this process's id, under the
/// system's temporary directory.
pub fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("allocbox-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Run the `allocbox` command in `dir` as [`allocbox_cli`] does, and also say the most
/// memory it had resident at once, in KiB. Without the compile cache, so that every run
/// compiles what it loads and runs compare.
///
/// The kernel counts a child's peak from the moment it was forked, when it still shared
/// this (large, busy) test process's memory; so a small Python process starts the
/// command and reports the peak of its own child.
pub fn allocbox_cli_peak_rss(args: &[&str], dir: &std::path::Path) -> (i32, String, u64) {
    const MEASURE: &str = "import resource, subprocess, sys\n\
        run = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)\n\
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n\
        sys.stdout.write(f'{run.returncode} {peak}\\n')\n\
        sys.stdout.buffer.write(run.stdout)\n";
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(MEASURE)
        .arg(env!("CARGO_BIN_EXE_allocbox"))
        .args(args)
        .current_dir(dir)
        .env(allocbox::COMPILE_CACHE_ENV, "off")
        .output()
        .expect("python3 runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (first, rest) = text.split_once('\n').unwrap_or_else(|| panic!("{text}"));
    let (code, peak) = first.split_once(' ').unwrap();
    (
        code.parse().unwrap(),
        rest.to_string(),
        peak.parse().unwrap(),
    )
}
