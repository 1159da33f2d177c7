//! The Rust project `allocbox new --lang rust` writes: the template policy, the SDK
//! vendored, the pinned toolchain, and a `cargo test` that builds the policy and checks
//! the whole contract.

use std::path::Path;

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

/// The checker as a new Rust project's dev-dependency: the allocbox checkout this
/// command was built from, when it is still there; else the repository.
fn checker_dependency() -> String {
    let checkout = Path::new(env!("CARGO_MANIFEST_DIR")).join("../check");
    match checkout.canonicalize() {
        Ok(path) if path.join("Cargo.toml").is_file() => {
            format!("{{ path = \"{}\" }}", path.display())
        }
        _ => format!("{{ git = \"{}\" }}", env!("CARGO_PKG_REPOSITORY")),
    }
}

/// A new Rust project's `cargo test` of the whole contract.
const CONTRACT_TEST: &str = r#"//! The whole handler contract, checked as a default `allocbox check` checks it: the
//! policy is built for wasm32-wasip2 first, so the test checks this source.

#[test]
fn keeps_the_handler_contract() {
    let wasm = allocbox_check::build_policy(env!("CARGO_MANIFEST_DIR"), env!("CARGO_PKG_NAME"))
        .unwrap_or_else(|e| panic!("{e}"));
    allocbox_check::assert_contract(&wasm, &[]);
}
"#;

pub(super) fn rust_project(name: &str) -> Vec<(String, String)> {
    let wasm = rust_wasm_path(name);
    let checker = checker_dependency();
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

# `cargo test` checks the whole handler contract (`tests/contract.rs`) with allocbox's
# checker, built for this machine the first time (several minutes: wasmtime).
[dev-dependencies]
allocbox-check = {checker}

# The checker runs thousands of cases: its code optimised, as in allocbox's own tests.
[profile.dev.package."*"]
opt-level = 2

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

`cargo test` also checks the whole contract (`tests/contract.rs`), as a default
`allocbox check` does (the same depth, counted in cases, from a fixed seed): it builds the
policy for wasm32-wasip2 into `target/contract/`, then

```rust
allocbox_check::assert_contract(&wasm, &[]);
```

panics with the broken rule and the shrunk script if any rule breaks. `allocbox-check` is
a dev-dependency on the allocbox checkout this project was made from (`Cargo.toml`; a
`git` dependency on its repository works as well); the first `cargo test` builds it,
wasmtime and all, which takes several minutes.

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
