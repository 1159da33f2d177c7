//! `allocbox new`: every project it writes builds with the command its README gives and
//! passes `allocbox check` as it stands; bad names and occupied directories are refused.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::support::allocbox_cli;

/// A fresh directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(test: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("allocbox-new-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `allocbox` in `dir` and insists on exit 0.
fn allocbox_ok(args: &[&str], dir: &Path) -> String {
    let (code, out) = allocbox_cli(args, dir);
    assert_eq!(code, 0, "allocbox {}:\n{out}", args.join(" "));
    out
}

#[test]
fn new_wat_policy_passes_check_under_its_own_name() {
    let tmp = TempDir::new("wat");
    allocbox_ok(&["new", "demo", "--lang", "wat"], &tmp.0);
    let readme = std::fs::read_to_string(tmp.0.join("demo/README.md")).unwrap();
    assert!(readme.contains("allocbox check demo.wat"), "{readme}");

    let out = allocbox_ok(
        &["check", "demo/demo.wat", "--rounds", "1", "--cases", "64"],
        &tmp.0,
    );
    assert!(out.contains("every rule held"), "{out}");
    let out = allocbox_ok(&["inspect", "demo/demo.wat"], &tmp.0);
    assert!(out.starts_with("policy     demo\n"), "{out}");
    // Its init error names it too.
    let (code, out) = allocbox_cli(&["inspect", "demo/demo.wat", "-c", "k=v"], &tmp.0);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("demo takes no configuration"), "{out}");
}

#[test]
fn new_rust_policy_builds_with_its_readme_command_and_passes_check() {
    let tmp = TempDir::new("rust");
    allocbox_ok(&["new", "demo", "--lang", "rust"], &tmp.0);
    let project = tmp.0.join("demo");
    let readme = std::fs::read_to_string(project.join("README.md")).unwrap();
    let wasm = "target/wasm32-wasip2/release/demo.wasm";
    for command in [
        "cargo build --release --target wasm32-wasip2".to_string(),
        format!("allocbox check {wasm}"),
    ] {
        assert!(
            readme.contains(&command),
            "README lacks `{command}`:\n{readme}"
        );
    }

    // One target directory for every run, so that only the project itself is rebuilt.
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/new-policy");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["build", "--release", "--target", "wasm32-wasip2"])
        .current_dir(&project)
        .env("CARGO_TARGET_DIR", &target)
        // Flags and wrappers meant for the host build are not for the policy.
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "building the new project failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let wasm = target.join("wasm32-wasip2/release/demo.wasm");
    let wasm = wasm.to_str().unwrap();
    let out = allocbox_ok(&["check", wasm, "--rounds", "1", "--cases", "64"], &project);
    assert!(out.contains("every rule held"), "{out}");
    assert!(
        out.contains(
            "its counters, summed over the cases (a `peak-` one: its largest): lent-blocks 0"
        ),
        "{out}"
    );
    let out = allocbox_ok(&["inspect", wasm], &project);
    assert!(out.starts_with("policy     demo\n"), "{out}");
    assert!(
        out.contains("language   Rust\n")
            && out.contains("contract   0.2.0 (world allocbox:policy/policy@0.2.0)\n")
            && out.contains("\nshardable  no\n"),
        "the language and the world it was built against: {out}"
    );
    // Unknown configuration is refused by the SDK, naming the policy and the key.
    let (code, out) = allocbox_cli(&["inspect", wasm, "-c", "colour=red"], &project);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("demo: unknown config key `colour`"), "{out}");

    // Its own `cargo test` checks the contract with the installed `allocbox`, building
    // nothing of allocbox; without one it says how to install it.
    let cargo_test = |allocbox: &str| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        Command::new(cargo)
            .args(["test", "--quiet"])
            .current_dir(&project)
            .env("CARGO_TARGET_DIR", &target)
            .env("ALLOCBOX", allocbox)
            .env("ALLOCBOX_CHECK_SEED", "11")
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("CARGO_BUILD_RUSTFLAGS")
            .env_remove("CARGO_BUILD_TARGET")
            .env_remove("RUSTC_WRAPPER")
            .env_remove("RUSTC_WORKSPACE_WRAPPER")
            .output()
            .unwrap()
    };
    let out = cargo_test(env!("CARGO_BIN_EXE_allocbox"));
    let said = |out: &std::process::Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    assert!(
        out.status.success(),
        "the project's cargo test failed:\n{}",
        said(&out)
    );
    let built: Vec<String> = std::fs::read_dir(target.join("debug/.fingerprint"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        built.iter().any(|name| name.starts_with("demo-"))
            && !built.iter().any(|name| name.starts_with("wasmtime")),
        "built {built:?}"
    );
    let out = cargo_test("/no/such/allocbox");
    assert!(!out.status.success());
    assert!(
        said(&out).contains("was not found: install allocbox's wheel"),
        "{}",
        said(&out)
    );
}

#[test]
fn new_refuses_bad_names_and_occupied_directories() {
    let tmp = TempDir::new("refusals");
    for (name, says) in [
        ("1demo", "starts with '1'"),
        ("my.policy", "contains '.'"),
        ("fn", "reserves"),
        (&"p".repeat(65), "at most 64"),
    ] {
        let (code, out) = allocbox_cli(&["new", name, "--lang", "wat"], &tmp.0);
        assert_eq!(code, 2, "{name}: {out}");
        assert!(out.contains(says), "{name}: {out}");
        assert!(!tmp.0.join(name).exists(), "{name} was created");
    }

    std::fs::create_dir(tmp.0.join("taken")).unwrap();
    std::fs::write(tmp.0.join("taken/keep.txt"), "mine").unwrap();
    let (code, out) = allocbox_cli(&["new", "taken", "--lang", "rust"], &tmp.0);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("is a folder with files in it"), "{out}");
    assert_eq!(std::fs::read_dir(tmp.0.join("taken")).unwrap().count(), 1);
    // Issue 72: NAME or `--path` a link to an empty folder got the project through it.
    std::fs::create_dir(tmp.0.join("elsewhere")).unwrap();
    std::os::unix::fs::symlink(tmp.0.join("elsewhere"), tmp.0.join("linked")).unwrap();
    for args in [
        &["new", "linked", "--lang", "wat"][..],
        &["new", "other", "--lang", "rust", "--path", "linked"],
    ] {
        let (code, out) = allocbox_cli(args, &tmp.0);
        assert_eq!(code, 2, "{out}");
        assert!(out.contains("it is a symbolic link"), "{out}");
        assert_eq!(out.trim().lines().count(), 1, "{out}");
    }
    assert_eq!(
        std::fs::read_dir(tmp.0.join("elsewhere")).unwrap().count(),
        0
    );
    // An empty directory is fine, and `--path` picks it.
    std::fs::create_dir(tmp.0.join("empty")).unwrap();
    allocbox_ok(
        &["new", "other", "--lang", "wat", "--path", "empty"],
        &tmp.0,
    );
    assert!(tmp.0.join("empty/other.wat").exists());

    let (code, out) = allocbox_cli(&["new", "demo", "--lang", "typescript"], &tmp.0);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("not shipped yet")
            && out.contains("rust, wat, c, zig, assemblyscript (as), python, go, js (javascript)"),
        "{out}"
    );
}

/// `allocbox new demo --lang LANG`, built with the command its README gives (`./build.sh`)
/// over the toolchains this checkout's `.ci/setup` installed (`ALLOCBOX_TOOLCHAINS`:
/// nothing is downloaded), then checked and inspected under its own name. A missing
/// toolchain (build.sh exits 3) skips the test, and fails it when `CI` is set.
fn new_project_builds_and_passes_check(lang: &str, language: &str) {
    let tmp = TempDir::new(lang);
    allocbox_ok(&["new", "demo", "--lang", lang], &tmp.0);
    let project = tmp.0.join("demo");
    let readme = std::fs::read_to_string(project.join("README.md")).unwrap();
    for command in ["./setup.sh", "./build.sh", "allocbox check demo.wasm"] {
        assert!(
            readme.contains(command),
            "README lacks `{command}`:\n{readme}"
        );
    }

    let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let started = std::time::Instant::now();
    // By its path, as `./build.sh` runs it: `new` made it executable.
    let out = Command::new(project.join("build.sh"))
        .current_dir(&project)
        .env("ALLOCBOX_TOOLCHAINS", &checkout)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(3) {
        let fix = format!(
            "the {language} toolchain is missing ({}); `.ci/setup` installs it",
            stderr.trim()
        );
        if std::env::var_os("CI").is_some() {
            panic!("{fix}");
        }
        eprintln!("skipped: {fix}");
        return;
    }
    assert!(
        out.status.success(),
        "./build.sh of the new {language} project failed:\n{stderr}"
    );
    eprintln!("{language}: built in {:.1?}", started.elapsed());
    assert!(project.join("demo.wasm").is_file(), "no demo.wasm");

    let out = allocbox_ok(
        &["check", "demo.wasm", "--rounds", "1", "--cases", "200"],
        &project,
    );
    assert!(out.contains("every rule held"), "{out}");
    // The templates of languages that speak contract 0.2.0 report their counter.
    if ["Python", "JavaScript"].contains(&language) {
        assert!(
            out.contains(
                "its counters, summed over the cases (a `peak-` one: its largest): lent-blocks 0"
            ),
            "{out}"
        );
    }
    let out = allocbox_ok(&["inspect", "demo.wasm"], &project);
    assert!(out.starts_with("policy     demo\n"), "{out}");
    assert!(out.contains(&format!("\nlanguage   {language}\n")), "{out}");
    // Its init error names it too.
    let (code, out) = allocbox_cli(&["inspect", "demo.wasm", "-c", "k=v"], &project);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("demo takes no configuration"), "{out}");
}

#[test]
fn new_c_policy_builds_with_its_readme_command_and_passes_check() {
    new_project_builds_and_passes_check("c", "C");
}

#[test]
fn new_zig_policy_builds_with_its_readme_command_and_passes_check() {
    new_project_builds_and_passes_check("zig", "Zig");
}

#[test]
fn new_assemblyscript_policy_builds_with_its_readme_command_and_passes_check() {
    new_project_builds_and_passes_check("assemblyscript", "AssemblyScript");
}

#[test]
fn new_python_policy_builds_with_its_readme_command_and_passes_check() {
    new_project_builds_and_passes_check("python", "Python");
}

#[test]
fn new_go_policy_builds_with_its_readme_command_and_passes_check() {
    new_project_builds_and_passes_check("go", "Go");
}

#[test]
fn new_js_policy_builds_with_its_readme_command_and_passes_check() {
    new_project_builds_and_passes_check("js", "JavaScript");
}

/// Issue 60: the C template's README said `--guest-memory` is 64 MiB by default where
/// the CLI's default is 128 MiB. Every default a template's README states of the guest
/// memory is the host's.
#[test]
fn the_templates_readmes_state_the_host_s_guest_memory_default() {
    let templates = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../guest-handlers/templates");
    let default_mib = allocbox::Limits::default().memory >> 20;
    let mut stated = 0;
    for entry in std::fs::read_dir(&templates).unwrap() {
        let readme = entry.unwrap().path().join("README.md");
        let Ok(text) = std::fs::read_to_string(&readme) else {
            continue;
        };
        let text = text.replace('\n', " ");
        // "(N MiB by default)" and "default of N MiB".
        let before = |at: usize| {
            text[..at]
                .split_whitespace()
                .last()
                .unwrap_or("")
                .trim_start_matches('(')
                .to_string()
        };
        let after = |at: usize| {
            text[at..]
                .split_whitespace()
                .next()
                .unwrap_or("")
                .to_string()
        };
        let mut numbers: Vec<String> = text
            .match_indices(" MiB by default")
            .map(|(at, _)| before(at))
            .collect();
        numbers.extend(
            text.match_indices("default of ")
                .map(|(at, m)| after(at + m.len())),
        );
        for number in numbers {
            stated += 1;
            assert_eq!(number, default_mib.to_string(), "{}", readme.display());
        }
    }
    assert!(stated >= 2, "the C and JavaScript READMEs state it");
}
