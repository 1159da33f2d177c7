//! Helpers shared by the test modules.

use std::ptr::NonNull;

use allocbox::{Handler, HandlerBuilder, Policy, Runtime};
use allocbox_artifacts::Guest;

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

/// The hand-written `passthrough` policy with `from` replaced by `to` in its source: a
/// hostile variant a few lines away from a good policy.
pub fn passthrough_variant(from: &str, to: &str) -> String {
    let source = allocbox::DEFAULT_POLICY_WAT;
    assert!(source.contains(from), "passthrough.wat has no `{from}`");
    source.replace(from, to)
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
/// memory it had resident at once, in KiB (the kernel's count for the child).
pub fn allocbox_cli_peak_rss(args: &[&str], dir: &std::path::Path) -> (i32, String, u64) {
    let out_path = dir.join(format!("cli-output-{}", std::process::id()));
    let out = std::fs::File::create(&out_path).unwrap();
    #[expect(
        clippy::zombie_processes,
        reason = "reaped below with wait4, which also reports its peak memory"
    )]
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_allocbox"))
        .args(args)
        .current_dir(dir)
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: an all-zero `rusage` is a valid value of that plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `child.id()` is our child, not yet waited for (std waits only on
    // `wait`/`drop` of a handle it owns, and this one is never waited by std); `status`
    // and `usage` are live, writable locals.
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as libc::pid_t, "wait4 failed");
    let text = std::fs::read_to_string(&out_path).unwrap();
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    (code, text, usage.ru_maxrss as u64)
}
