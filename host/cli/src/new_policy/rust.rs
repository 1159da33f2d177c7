//! The Rust project `allocbox new --lang rust` writes: the template policy, the SDK
//! vendored, the pinned toolchain, and a `cargo test` that builds the policy and checks
//! the whole contract.

/// Where `cargo build --release --target wasm32-wasip2` puts the policy.
pub(super) fn rust_wasm_path(name: &str) -> String {
    format!(
        "target/wasm32-wasip2/release/{}.wasm",
        name.replace('-', "_")
    )
}

/// The SDK crate as the project vendors it, under `allocbox-policy/`: every file of
/// `guest-handlers/sdk` (its `wit` link made a plain file).
pub(super) const SDK_FILES: &[(&str, &str)] = &[
    (
        "Cargo.toml",
        include_str!("../../../../guest-handlers/sdk/Cargo.toml"),
    ),
    (
        "src/lib.rs",
        include_str!("../../../../guest-handlers/sdk/src/lib.rs"),
    ),
    (
        "src/config.rs",
        include_str!("../../../../guest-handlers/sdk/src/config.rs"),
    ),
    (
        "src/bytes.rs",
        include_str!("../../../../guest-handlers/sdk/src/bytes.rs"),
    ),
    (
        "src/upstream.rs",
        include_str!("../../../../guest-handlers/sdk/src/upstream.rs"),
    ),
    (
        "src/memory.rs",
        include_str!("../../../../guest-handlers/sdk/src/memory.rs"),
    ),
    (
        "src/diagnostics.rs",
        include_str!("../../../../guest-handlers/sdk/src/diagnostics.rs"),
    ),
    (
        "src/info.rs",
        include_str!("../../../../guest-handlers/sdk/src/info.rs"),
    ),
    (
        "src/deferred.rs",
        include_str!("../../../../guest-handlers/sdk/src/deferred.rs"),
    ),
    ("wit/policy.wit", allocbox::POLICY_WIT_2),
];

/// The `template` guest: the policy a new Rust project starts from.
const TEMPLATE_LIB: &str = include_str!("../../../../guest-handlers/templates/rust/src/lib.rs");

/// The toolchain allocbox and its SDK are built and tested with.
const TOOLCHAIN: &str = include_str!("../../../../rust-toolchain.toml");

/// A new Rust project's `cargo test` of the whole contract: the policy built for
/// wasm32-wasip2, then checked by the `allocbox` installed on PATH, so that the test
/// builds nothing of allocbox (no wasmtime: seconds, not an hour).
const CONTRACT_TEST: &str = r#"//! The whole handler contract, checked as a default `allocbox check` checks it, by the
//! `allocbox` on PATH (or the one `$ALLOCBOX` names). The policy is built for
//! wasm32-wasip2 first, so the test checks this source; nothing of allocbox is built.
//! `ALLOCBOX_CHECK_SEED=N cargo test` checks from seed N again.

use std::process::Command;

#[test]
fn keeps_the_handler_contract() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // A target folder of its own: the `cargo test` running this holds `target`'s lock.
    let built = Command::new(&cargo)
        .args(["build", "--release", "--target", "wasm32-wasip2"])
        .args(["--target-dir", "target/contract"])
        .current_dir(dir)
        .status()
        .unwrap_or_else(|e| panic!("cannot run `{cargo}` to build the policy: {e}"));
    assert!(built.success(), "the policy did not build for wasm32-wasip2 (cargo said why above)");
    let wasm = format!(
        "{dir}/target/contract/wasm32-wasip2/release/{}.wasm",
        env!("CARGO_PKG_NAME").replace('-', "_")
    );
    let allocbox = std::env::var("ALLOCBOX").unwrap_or_else(|_| "allocbox".into());
    let mut check = Command::new(&allocbox);
    check.args(["check", &wasm]);
    if let Ok(seed) = std::env::var("ALLOCBOX_CHECK_SEED") {
        check.args(["--seed", seed.trim()]);
    }
    let out = match check.output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "`{allocbox}` was not found: install allocbox's wheel (`pip install allocbox-*.whl`, \
             which puts `allocbox` on PATH; allocbox's `python/build_wheel.sh` builds it), or \
             set ALLOCBOX to the `allocbox` command's path"
        ),
        Err(e) => panic!("cannot run `{allocbox}`: {e}"),
    };
    let report = String::from_utf8_lossy(&out.stdout);
    // Shown with a failing test's output: the verdict, the seed, the shrunk script.
    print!("{report}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "`{allocbox} check {wasm}` did not pass (exit {:?}): {}",
        out.status.code(),
        report.lines().next().unwrap_or("no report; see the errors above")
    );
}
"#;

pub(super) fn rust_project(name: &str) -> Vec<(String, String)> {
    let wasm = rust_wasm_path(name);
    let cargo_toml = format!(
        r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2024"
publish = false

# A wasm32-wasip2 cdylib is a component: what `allocbox check` loads.
[lib]
crate-type = ["cdylib"]

[dependencies]
# The policy SDK, vendored: a trait to implement and an export macro.
allocbox-policy = {{ path = "allocbox-policy" }}

# `cargo test` checks the whole handler contract (`tests/contract.rs`) with the
# `allocbox` command on PATH: nothing of allocbox is built here.

# Small and fast: one codegen unit, whole-program LTO, no unwinding machinery. Debug
# info goes; the name section (function names in a trap's backtrace) and the producers
# section (`allocbox inspect` shows the language) stay.
[profile.release]
opt-level = "s"
lto = true
codegen-units = 1
panic = "abort"
strip = "debuginfo"

# A project of its own, even inside another cargo workspace.
[workspace]
"#
    );
    // The pinned toolchain, with allocbox's own comments replaced by one for this project.
    let toolchain = format!(
        "# The toolchain allocbox's policy SDK is built and tested with, and the guest target.\n{}",
        TOOLCHAIN
            .lines()
            .skip_while(|l| l.starts_with('#'))
            .map(|l| format!("{l}\n"))
            .collect::<String>()
    );
    let readme = format!(
        r#"# {name}

An allocbox allocation policy (NumPy NEP 49) in Rust, started from allocbox's template: a
pass-through that counts the blocks it lends. `src/lib.rs` is the policy; it explains the
rules the host enforces. The policy's name is the package name in `Cargo.toml`.

## Build

```sh
cargo build --release --target wasm32-wasip2
```

`rust-toolchain.toml` pins the toolchain and the `wasm32-wasip2` target (rustup installs
them on first use). The component is `{wasm}`.

## Check

```sh
allocbox check {wasm}
allocbox inspect {wasm}
```

`check` fuzzes the whole handler contract (24 rounds of 64 cases, counted, so the same
`--seed` gives the same verdict on any machine; `--rounds N` for more; `-c KEY=VALUE`
passes configuration to `init`) and shrinks any failure to a short script that
`allocbox replay SCRIPT` repeats as printed.

## Tests

Logic that does not call the host (size classes, header layout, configuration) is tested
natively with plain `#[test]`s in `src/lib.rs` and `cargo test` (calls into `upstream` or
`bytes` panic outside wasm):

```rust
#[cfg(test)]
mod tests {{
    use allocbox_policy::Config;

    #[test]
    fn reads_its_depth() {{
        let mut config = Config::new(vec![("depth".into(), "8".into())]);
        assert_eq!(config.get_or("depth", 4u32), Ok(8));
    }}
}}
```

`cargo test` also checks the whole contract (`tests/contract.rs`): it builds the policy
for wasm32-wasip2 into `target/contract/`, runs `allocbox check` on it as a default check
runs (the same depth, counted, from a fresh seed it prints), and fails with the broken
rule and the shrunk script if any rule breaks (`ALLOCBOX_CHECK_SEED=N cargo test` checks
from seed N again). It builds nothing of allocbox: `allocbox` must be on PATH, which
installing allocbox's wheel does (`pip install allocbox-*.whl`; allocbox's
`python/build_wheel.sh` builds it), or named by `ALLOCBOX=/path/to/allocbox`. A Rust
test of the host's own can call the checker as a library instead
(`allocbox_check::assert_contract(&wasm, &[])`, the `allocbox-check` crate of allocbox's
checkout), at the cost of building wasmtime.

## Layout

- `src/lib.rs`: the policy: one `Policy` implementation and `export_policy!`.
- `allocbox-policy/`: the policy SDK (`Policy`, `Config`, `Info`, `upstream`, `bytes`,
  `memory`, `diagnostics`), vendored from allocbox with the WIT world it implements
  (`allocbox-policy/wit/policy.wit`, contract 0.2.0).
"#
    );
    let mut files = vec![
        ("Cargo.toml".to_string(), cargo_toml),
        ("src/lib.rs".to_string(), TEMPLATE_LIB.to_string()),
        ("rust-toolchain.toml".to_string(), toolchain),
        ("tests/contract.rs".to_string(), CONTRACT_TEST.to_string()),
        ("README.md".to_string(), readme),
        (".gitignore".to_string(), "/target\n".to_string()),
    ];
    files.extend(
        SDK_FILES
            .iter()
            .map(|(file, text)| (format!("allocbox-policy/{file}"), text.to_string())),
    );
    files
}
