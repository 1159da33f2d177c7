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
