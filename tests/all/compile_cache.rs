//! The compile cache: a policy compiled once is kept on disk, keyed by its bytes and the
//! engine's configuration, so a new process loads it without compiling.

use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("allocbox-cache-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Runs `allocbox inspect` on the `size-classes` guest in a new process with the cache
/// in `cache` (a path or `off`); returns its stdout.
fn inspect_in_new_process(cache: &str) -> String {
    inspect_with_env(&[(allocbox::COMPILE_CACHE_ENV, cache)])
}

fn inspect_with_env(env: &[(&str, &str)]) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_allocbox"));
    command.args(["inspect", allocbox_artifacts::SIZE_CLASSES.path()]);
    command.env_remove(allocbox::COMPILE_CACHE_ENV);
    command.envs(env.iter().copied());
    let out = command.output().expect("running allocbox");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Every file under `dir`, with its size, sorted.
fn entries(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let meta = e.metadata().unwrap();
            if meta.is_dir() {
                todo.push(e.path());
            } else if !e.file_name().to_string_lossy().starts_with('.') {
                found.push((e.path(), meta.len()));
            }
        }
    }
    found.sort();
    found
}

#[test]
fn a_second_process_loads_the_compiled_policy_from_the_cache() {
    let dir = scratch("hit");
    let first = inspect_in_new_process(dir.to_str().unwrap());
    let compiled: Vec<_> = entries(&dir)
        .into_iter()
        .filter(|(p, _)| p.extension().is_none())
        .collect();
    assert_eq!(
        compiled.len(),
        1,
        "one compiled component kept: {compiled:?}"
    );
    assert!(compiled[0].1 > 1000, "machine code, not an empty file");
    let second = inspect_in_new_process(dir.to_str().unwrap());
    assert_eq!(first, second);
    let after: Vec<_> = entries(&dir)
        .into_iter()
        .filter(|(p, _)| p.extension().is_none())
        .collect();
    assert_eq!(after, compiled, "a hit adds nothing and rewrites nothing");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_corrupted_cache_entry_is_compiled_again_not_run() {
    let dir = scratch("corrupt");
    inspect_in_new_process(dir.to_str().unwrap());
    let (entry, _) = entries(&dir)
        .into_iter()
        .find(|(p, _)| p.extension().is_none())
        .expect("a compiled entry");
    std::fs::write(&entry, b"not machine code").unwrap();
    let out = inspect_in_new_process(dir.to_str().unwrap());
    assert!(out.contains("size-classes"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_cache_lives_in_the_user_cache_directory_unless_switched_off() {
    let home = scratch("home");
    std::fs::create_dir_all(&home).unwrap();
    let xdg = home.join("xdg");
    let (home_s, xdg_s) = (home.to_str().unwrap(), xdg.to_str().unwrap());
    inspect_with_env(&[
        ("HOME", home_s),
        ("XDG_CACHE_HOME", xdg_s),
        (allocbox::COMPILE_CACHE_ENV, "off"),
    ]);
    assert!(entries(&home).is_empty(), "off writes nothing");
    inspect_with_env(&[("HOME", home_s), ("XDG_CACHE_HOME", xdg_s)]);
    assert!(
        entries(&xdg.join("allocbox"))
            .iter()
            .any(|(p, _)| p.extension().is_none())
    );
    inspect_with_env(&[("HOME", home_s), ("XDG_CACHE_HOME", "")]);
    assert!(!entries(&home.join(".cache").join("allocbox")).is_empty());
    std::fs::remove_dir_all(&home).unwrap();
}
