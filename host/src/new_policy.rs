//! `allocbox new`: write a policy project that builds with one command and passes
//! `allocbox check` as it stands.
//!
//! Nothing here is a second copy of a policy: the Rust project is the `template` guest's
//! source over a vendored copy of the `allocbox-policy` SDK crate, the WAT project is the
//! built-in `passthrough` policy renamed, all embedded from `guest-handlers/` when
//! allocbox is built.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The languages `allocbox new` writes projects in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lang {
    /// A cargo project over the `allocbox-policy` SDK, built for `wasm32-wasip2`.
    Rust,
    /// A hand-written core module in WebAssembly text: no toolchain, no build.
    Wat,
}

impl Lang {
    const AVAILABLE: &str = "rust, wat";
}

/// Guest languages the policy world suits that have no project template yet.
const PLANNED: &[&str] = &[
    "c",
    "cpp",
    "c++",
    "zig",
    "go",
    "tinygo",
    "python",
    "py",
    "js",
    "javascript",
    "ts",
    "typescript",
    "assemblyscript",
];

/// `--lang`'s parser: the shipped languages, and a plain answer for the others.
pub fn parse_lang(s: &str) -> Result<Lang, String> {
    match s.to_ascii_lowercase().as_str() {
        "rust" | "rs" => Ok(Lang::Rust),
        "wat" | "wasm" => Ok(Lang::Wat),
        other if PLANNED.contains(&other) => Err(format!(
            "`{s}` policy projects are not shipped yet; available: {}",
            Lang::AVAILABLE
        )),
        _ => Err(format!(
            "unknown language `{s}`; available: {}",
            Lang::AVAILABLE
        )),
    }
}

/// Package names cargo refuses or that would clash with the project's own dependency.
const RESERVED: &[&str] = &[
    "allocbox-policy",
    "allocbox_policy",
    "wit-bindgen",
    "wit_bindgen",
    "core",
    "std",
    "alloc",
    "proc_macro",
    "proc-macro",
    "test",
    "self",
    "super",
    "crate",
    "Self",
];

/// Rust keywords, which cargo refuses as package names.
const KEYWORDS: &[&str] = &[
    "abstract", "as", "async", "await", "become", "box", "break", "const", "continue", "do", "dyn",
    "else", "enum", "extern", "false", "final", "fn", "for", "gen", "if", "impl", "in", "let",
    "loop", "macro", "match", "mod", "move", "mut", "override", "priv", "pub", "ref", "return",
    "static", "struct", "trait", "true", "try", "type", "typeof", "unsafe", "unsized", "use",
    "virtual", "where", "while", "yield",
];

/// A policy name is a crate name (it names the package, the `.wasm` and the policy):
/// 1..=64 ASCII letters, digits, `-` and `_`, starting with a letter or `_`.
pub fn validate_name(name: &str) -> Result<()> {
    let Some(first) = name.chars().next() else {
        bail!("the policy name is empty; it names the crate, the .wasm file and the policy");
    };
    if name.len() > 64 {
        bail!(
            "the policy name `{name}` is {} bytes long; at most 64",
            name.len()
        );
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        bail!(
            "the policy name `{name}` contains {c:?}; use ASCII letters, digits, `-` and `_` (it is a crate name)"
        );
    }
    if !(first.is_ascii_alphabetic() || first == '_') {
        bail!("the policy name `{name}` starts with {first:?}; start it with a letter or `_`");
    }
    if KEYWORDS.contains(&name) || RESERVED.contains(&name) {
        bail!("`{name}` cannot name a policy: cargo or the policy SDK reserves it");
    }
    Ok(())
}

/// What `new` wrote, for the message it prints.
#[derive(Debug)]
pub struct Created {
    pub dir: PathBuf,
    /// The command that checks the project, run from the current directory.
    pub next: String,
}

/// Write a `lang` project for the policy `name` into `path` (default `./NAME`), which
/// must not exist or be empty.
pub fn create(name: &str, lang: Lang, path: Option<PathBuf>) -> Result<Created> {
    validate_name(name)?;
    let dir = path.unwrap_or_else(|| PathBuf::from(name));
    if dir.exists() {
        let empty = dir.is_dir()
            && std::fs::read_dir(&dir)
                .with_context(|| format!("reading {}", dir.display()))?
                .next()
                .is_none();
        if !empty {
            bail!(
                "{} already exists and is not an empty directory; choose another name or `--path`",
                dir.display()
            );
        }
    }
    let files = match lang {
        Lang::Rust => rust_project(name),
        Lang::Wat => wat_project(name),
    };
    for (file, text) in &files {
        write(&dir.join(file), text)?;
    }
    let next = match lang {
        Lang::Rust => format!(
            "cd {} && cargo build --release --target wasm32-wasip2 && allocbox check {}",
            dir.display(),
            rust_wasm_path(name)
        ),
        Lang::Wat => format!(
            "allocbox check {}",
            dir.join(format!("{name}.wat")).display()
        ),
    };
    Ok(Created { dir, next })
}

fn write(file: &Path, text: &str) -> Result<()> {
    if let Some(parent) = file.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(file, text).with_context(|| format!("writing {}", file.display()))
}

/// Where `cargo build --release --target wasm32-wasip2` puts the policy.
fn rust_wasm_path(name: &str) -> String {
    format!(
        "target/wasm32-wasip2/release/{}.wasm",
        name.replace('-', "_")
    )
}

/// The SDK crate as the project vendors it, under `allocbox-policy/`: every file of
/// `guest-handlers/sdk` (its `wit` link made a plain file).
const SDK_FILES: &[(&str, &str)] = &[
    (
        "Cargo.toml",
        include_str!("../../guest-handlers/sdk/Cargo.toml"),
    ),
    (
        "src/lib.rs",
        include_str!("../../guest-handlers/sdk/src/lib.rs"),
    ),
    (
        "src/config.rs",
        include_str!("../../guest-handlers/sdk/src/config.rs"),
    ),
    (
        "src/bytes.rs",
        include_str!("../../guest-handlers/sdk/src/bytes.rs"),
    ),
    (
        "src/upstream.rs",
        include_str!("../../guest-handlers/sdk/src/upstream.rs"),
    ),
    ("wit/policy.wit", allocbox::POLICY_WIT),
];

/// The `template` guest: the policy a new Rust project starts from.
const TEMPLATE_LIB: &str = include_str!("../../guest-handlers/template/src/lib.rs");

/// The toolchain allocbox and its SDK are built and tested with.
const TOOLCHAIN: &str = include_str!("../../rust-toolchain.toml");

fn rust_project(name: &str) -> Vec<(String, String)> {
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

# Small and fast: one codegen unit, whole-program LTO, no unwinding machinery.
[profile.release]
opt-level = "s"
lto = true
codegen-units = 1
panic = "abort"
strip = true

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

`check` fuzzes the whole handler contract (`--time SECONDS` or `--cases N`; `-c KEY=VALUE`
passes configuration to `init`) and shrinks any failure to a short script that
`allocbox replay` repeats.

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

The whole contract is tested from the host side: a test crate with a dev-dependency on
`allocbox` (a path or git dependency on an allocbox checkout) runs, after the build,

```rust
#[test]
fn keeps_the_handler_contract() {{
    allocbox::check::assert_contract("{wasm}", &[]);
}}
```

## Layout

- `src/lib.rs`: the policy: one `Policy` implementation and `export_policy!`.
- `allocbox-policy/`: the policy SDK (`Policy`, `Config`, `Info`, `upstream`, `bytes`),
  vendored from allocbox with the WIT world it implements (`allocbox-policy/wit/policy.wit`).
"#
    );
    let mut files = vec![
        ("Cargo.toml".to_string(), cargo_toml),
        ("src/lib.rs".to_string(), TEMPLATE_LIB.to_string()),
        ("rust-toolchain.toml".to_string(), toolchain),
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

/// Where the renamed passthrough keeps its name: past its other strings (64..130, at most
/// 96 + 23 + 64 = 183 after renaming), before its `malloc-many` answer at 1024, with room
/// for the longest name (64 bytes).
const WAT_NAME_AT: usize = 256;

/// The built-in `passthrough` policy named `name`. Each edit must match exactly once, so
/// a change to `passthrough.wat` that these edits do not fit fails loudly (and the
/// `new_policy` tests with it) instead of writing a policy with the wrong name.
pub fn wat_source(name: &str) -> String {
    const OLD: &str = "passthrough";
    let error = format!("{name} takes no configuration");
    let edits: [(&str, String); 5] = [
        (
            ";; Memory map: 0..64 the `init` answer, 64..130 its strings,",
            format!(
                ";; Memory map: 0..64 the `init` answer, 96..{} its error, {WAT_NAME_AT}.. its name,",
                96 + error.len()
            ),
        ),
        (
            "(data (i32.const 64) \"passthrough\")",
            format!("(data (i32.const {WAT_NAME_AT}) \"{OLD}\")"),
        ),
        (
            "(i32.store (i32.const 8) (i32.const 64))\n    (i32.store (i32.const 12) (i32.const 11))",
            format!(
                "(i32.store (i32.const 8) (i32.const {WAT_NAME_AT}))\n    (i32.store (i32.const 12) (i32.const {}))",
                name.len()
            ),
        ),
        (
            "(i32.store (i32.const 12) (i32.const 34))",
            format!("(i32.store (i32.const 12) (i32.const {}))", error.len()),
        ),
        // Last: every remaining mention (the header, the data strings, comments).
        (OLD, name.to_string()),
    ];
    let mut text = allocbox::DEFAULT_POLICY_WAT.to_string();
    for (from, to) in edits {
        let n = text.matches(from).count();
        if from != OLD {
            assert_eq!(
                n, 1,
                "passthrough.wat changed: `{from}` occurs {n} times; update host/src/new_policy.rs"
            );
        }
        text = text.replace(from, &to);
    }
    text
}

fn wat_project(name: &str) -> Vec<(String, String)> {
    let readme = format!(
        r#"# {name}

An allocbox allocation policy (NumPy NEP 49) written by hand in WebAssembly text, started
from allocbox's built-in `passthrough` policy: every call goes upstream unchanged, and the
module counts the blocks it lends. `{name}.wat` explains its memory map and the canonical
ABI it is written to; allocbox makes it a component when it loads it, so there is nothing
to build.

## Check

From this directory:

```sh
allocbox check {name}.wat
allocbox inspect {name}.wat
```

`check` fuzzes the whole handler contract (`--time SECONDS` or `--cases N`) and shrinks any
failure to a short script that `allocbox replay` repeats.
"#
    );
    vec![
        (format!("{name}.wat"), wat_source(name)),
        ("README.md".to_string(), readme),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_crate_names() {
        for good in ["demo", "my-policy", "_x", "a1_b-2", &"p".repeat(64)] {
            validate_name(good).unwrap();
        }
        for (bad, says) in [
            ("", "empty"),
            ("1st", "starts with '1'"),
            ("-x", "starts with '-'"),
            ("my policy", "contains ' '"),
            ("a.b", "contains '.'"),
            ("ünï", "contains"),
            (&"p".repeat(65), "at most 64"),
            ("fn", "reserves"),
            ("allocbox-policy", "reserves"),
        ] {
            let e = validate_name(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn other_languages_are_named_as_not_shipped() {
        assert_eq!(parse_lang("Rust"), Ok(Lang::Rust));
        assert_eq!(parse_lang("wat"), Ok(Lang::Wat));
        let e = parse_lang("zig").unwrap_err();
        assert!(
            e.contains("not shipped yet") && e.contains("rust, wat"),
            "{e}"
        );
        let e = parse_lang("cobol").unwrap_err();
        assert!(
            e.contains("unknown language") && e.contains("rust, wat"),
            "{e}"
        );
    }

    #[test]
    fn the_renamed_passthrough_keeps_no_old_name() {
        let text = wat_source(&"n".repeat(64));
        assert!(!text.contains("passthrough"));
        assert!(text.contains(&format!(
            "(data (i32.const {WAT_NAME_AT}) \"{}\")",
            "n".repeat(64)
        )));
    }
}
