//! `allocbox new`: write a policy project that builds with one command and passes
//! `allocbox check` as it stands.
//!
//! Nothing here is a second copy of a policy: the Rust project is the `template` guest's
//! source over a vendored copy of the `allocbox-policy` SDK crate, the WAT project is the
//! built-in `passthrough` policy renamed, and the projects in other languages are the
//! template folders `guest-handlers/templates/<lang>/`, all embedded from `guest-handlers/`
//! when allocbox is built.
//!
//! A template folder is a project named `policy_name` ([`PLACEHOLDER`]): `new` writes
//! each of its files with every occurrence of that word replaced by the policy's name
//! (which [`validate_name`] keeps to letters, digits, `-` and `_`, so it is safe inside
//! any string literal and file name). `*.sh` files are made executable. A few files come
//! from elsewhere, unchanged, so that they have one source: `stamp_language.py`, the
//! WIT world, the `slab` policy's `rename.mjs` and `package-lock.json`, and the
//! `tracker` policy's `build.mjs` and `package-lock.json`.
//!
//! Adding a language: a template folder, a [`Lang`] variant, a row in [`LANGS`] and an
//! arm in [`foreign_files`], and a test in `tests/all/new_policy.rs`.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

mod rust;
#[cfg(test)]
use rust::SDK_FILES;
use rust::{rust_project, rust_wasm_path};

/// The languages `allocbox new` writes projects in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lang {
    /// A cargo project over the `allocbox-policy` SDK, built for `wasm32-wasip2`.
    Rust,
    /// A hand-written core module in WebAssembly text: no toolchain, no build.
    Wat,
    /// Freestanding C (clang 14): a core module.
    C,
    /// Zig 0.17: a core module.
    Zig,
    /// AssemblyScript 0.28: a core module.
    AssemblyScript,
    /// Python through componentize-py: a component.
    Python,
    /// Go 1.27 (`wasip1`): a core module.
    Go,
    /// JavaScript through componentize-js 0.23: a component.
    Js,
}

/// Every language `new` writes, with the names `--lang` takes for it (the first is the
/// one messages show).
const LANGS: &[(Lang, &[&str])] = &[
    (Lang::Rust, &["rust", "rs"]),
    (Lang::Wat, &["wat", "wasm"]),
    (Lang::C, &["c"]),
    (Lang::Zig, &["zig"]),
    (Lang::AssemblyScript, &["assemblyscript", "as"]),
    (Lang::Python, &["python", "py"]),
    (Lang::Go, &["go"]),
    (Lang::Js, &["js", "javascript"]),
];

/// Guest languages the policy world suits that have no project template yet.
const PLANNED: &[&str] = &["cpp", "c++", "tinygo", "ts", "typescript"];

/// The `--lang` names, for messages: `rust, wat, c, zig, assemblyscript (as), ...`.
fn available() -> String {
    LANGS
        .iter()
        .map(|(lang, names)| match *lang {
            // Other aliases (`rs`, `wasm`, `py`) are file extensions and go unmentioned.
            Lang::AssemblyScript | Lang::Js => format!("{} ({})", names[0], names[1]),
            _ => names[0].to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `--lang`'s parser: the shipped languages, and a plain answer for the others.
pub fn parse_lang(s: &str) -> Result<Lang, String> {
    let wanted = s.to_ascii_lowercase();
    if let Some((lang, _)) = LANGS
        .iter()
        .find(|(_, names)| names.contains(&wanted.as_str()))
    {
        return Ok(*lang);
    }
    if PLANNED.contains(&wanted.as_str()) {
        return Err(format!(
            "`{s}` policy projects are not shipped yet; available: {}",
            available()
        ));
    }
    Err(format!(
        "unknown language `{s}`; available: {}",
        available()
    ))
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
    // Made beneath the folder's parent with no link followed, and removed whole if any
    // file of it cannot be written.
    let mut folder = allocbox::output::NewFolder::create(&dir)
        .map_err(|error| anyhow::anyhow!("{error}; choose another name or `--path`"))?;
    let files = match lang {
        Lang::Rust => rust_project(name),
        Lang::Wat => wat_project(name),
        foreign => foreign_project(name, foreign),
    };
    for (file, text) in &files {
        // The build and setup scripts run as `./build.sh`.
        let mode = if file.ends_with(".sh") { 0o777 } else { 0o666 };
        folder.write(Path::new(file), text.as_bytes(), mode)?;
    }
    folder.commit();
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
        _ => format!(
            "cd {} && ./setup.sh && ./build.sh && allocbox check {name}.wasm",
            dir.display()
        ),
    };
    Ok(Created { dir, next })
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
                "passthrough.wat changed: `{from}` occurs {n} times; update host/cli/src/new_policy.rs"
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

/// The word the template folders `guest-handlers/templates/<lang>/` use for the policy's name.
pub const PLACEHOLDER: &str = "policy_name";

/// `(path in the project, text)` of each named file of `guest-handlers/templates/$lang/`.
macro_rules! template {
    ($lang:literal: $($file:literal),+ $(,)?) => {
        &[$(($file, include_str!(concat!("../../../guest-handlers/templates/", $lang, "/", $file)))),+]
    };
}

/// Records the language in the module's `producers` section; every `build.sh` but Go's
/// and JavaScript's runs it (the Go toolchain and componentize-js record the language
/// themselves).
const STAMP_LANGUAGE: &str = include_str!("../../../guest-handlers/scripts/stamp_language.py");

/// The `slab` policy's export renamer and npm lockfile: the AssemblyScript project pins
/// the same packages.
const SLAB_RENAME: &str =
    include_str!("../../../guest-handlers/policies/assemblyscript/slab/rename.mjs");
const SLAB_LOCK: &str =
    include_str!("../../../guest-handlers/policies/assemblyscript/slab/package-lock.json");

/// The `tracker` policy's build script (componentize-js's API) and npm lockfile: the
/// JavaScript project builds the same way with the same packages.
const TRACKER_BUILD: &str = include_str!("../../../guest-handlers/policies/js/tracker/build.mjs");
const TRACKER_LOCK: &str =
    include_str!("../../../guest-handlers/policies/js/tracker/package-lock.json");

/// A template folder's files, the placeholder unreplaced: `(path, text)`.
type TemplateFiles = &'static [(&'static str, &'static str)];

/// The template files of a language other than Rust and WAT, and the files from
/// elsewhere in the repository that its project carries unchanged.
fn foreign_files(lang: Lang) -> (TemplateFiles, Vec<(&'static str, String)>) {
    let stamp = ("stamp_language.py", STAMP_LANGUAGE.to_string());
    match lang {
        Lang::C => (
            template!("c": "policy.c", "build.sh", "setup.sh", "README.md", ".gitignore"),
            vec![stamp],
        ),
        Lang::Zig => (
            template!("zig": "policy.zig", "build.sh", "setup.sh", "README.md", ".gitignore"),
            vec![stamp],
        ),
        Lang::AssemblyScript => (
            template!("assemblyscript": "assembly/policy.ts", "package.json", "build.sh",
                "setup.sh", "README.md", ".gitignore"),
            vec![
                stamp,
                ("rename.mjs", SLAB_RENAME.to_string()),
                ("package-lock.json", assemblyscript_lock()),
            ],
        ),
        Lang::Js => (
            template!("js": "policy.js", "package.json", "build.sh", "setup.sh", "README.md",
                ".gitignore"),
            vec![
                ("build.mjs", TRACKER_BUILD.to_string()),
                ("package-lock.json", js_lock()),
                ("wit/policy.wit", allocbox::POLICY_WIT_2.to_string()),
            ],
        ),
        Lang::Python => (
            template!("python": "app.py", "build.sh", "setup.sh", "README.md", ".gitignore"),
            vec![
                stamp,
                ("wit/policy.wit", allocbox::POLICY_WIT_2.to_string()),
            ],
        ),
        Lang::Go => (
            template!("go": "policy.go", "go.mod", "build.sh", "setup.sh", "README.md",
                ".gitignore"),
            vec![],
        ),
        Lang::Rust | Lang::Wat => unreachable!("{lang:?} projects are not template folders"),
    }
}

/// `slab`'s `package-lock.json` for the AssemblyScript template's `package.json`.
fn assemblyscript_lock() -> String {
    template_lock("slab", SLAB_LOCK)
}

/// `tracker`'s `package-lock.json` for the JavaScript template's `package.json`.
fn js_lock() -> String {
    template_lock("tracker", TRACKER_LOCK)
}

/// The lockfile of the policy `policy` for a template's `package.json`, which names the
/// same packages (and overrides): only the root package's name differs
/// (`allocbox-policy-POLICY` becomes `allocbox-policy`), and its license is the user's to
/// choose. `npm ci` installs exactly what it lists. Each edit must match as often as
/// said, so a lockfile these edits no longer fit fails the tests instead of being
/// written half-edited.
fn template_lock(policy: &str, lock: &str) -> String {
    let edits = [
        (
            format!("\"name\": \"allocbox-policy-{policy}\""),
            "\"name\": \"allocbox-policy\"",
            2,
        ),
        (
            "\n      \"license\": \"Apache-2.0 WITH LLVM-exception\",".to_string(),
            "",
            1,
        ),
    ];
    let mut lock = lock.to_string();
    for (from, to, times) in edits {
        let n = lock.matches(&from).count();
        assert_eq!(
            n, times,
            "the `{policy}` policy's package-lock.json changed: `{from}` occurs {n} times; update host/cli/src/new_policy.rs"
        );
        lock = lock.replace(&from, to);
    }
    lock
}

fn foreign_project(name: &str, lang: Lang) -> Vec<(String, String)> {
    let (templates, verbatim) = foreign_files(lang);
    templates
        .iter()
        .map(|(file, text)| (file.to_string(), text.replace(PLACEHOLDER, name)))
        .chain(
            verbatim
                .into_iter()
                .map(|(file, text)| (file.to_string(), text)),
        )
        .collect()
}

#[cfg(test)]
mod tests;
