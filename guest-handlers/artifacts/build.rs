//! Builds every guest in `guest-handlers/` (the policies, the test fixtures and the Rust
//! template) and generates constants naming them, so tests never hard-code paths. A missing wasm32-wasip2 target
//! does not fail this build: the test that needs a guest reports it, with the command
//! that installs it.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Guest crates of the guest workspace: `(name, folder, good)`, good meaning a policy
/// (every good one is fuzzed and tested) rather than a fixture. The crate is
/// `policy-<name>`; its constant is the name in capitals.
const RUST_GUESTS: &[(&str, &str, bool)] = &[
    ("system", "policies/rust/system", true),
    ("aligned", "policies/rust/aligned", true),
    ("size-classes", "policies/rust/size-classes", true),
    ("arena", "policies/rust/arena", true),
    ("guard", "policies/rust/guard", true),
    ("numa", "policies/rust/numa", true),
    ("thp-arena", "policies/rust/thp-arena", true),
    // Maps only GPU memory (granted `device` or `pinned`): checked on the stand-in GPU by
    // its own tests (`tests/all/gpu.rs`) rather than by the grant-less contract runs.
    ("gpu-pool", "policies/rust/gpu-pool", false),
    ("torch-caching", "policies/rust/torch-caching", false),
    ("template", "templates/rust", true),
    ("broken", "fixtures/broken", false),
    ("chaos", "fixtures/chaos", false),
    ("sandbox-probe", "fixtures/sandbox-probe", false),
    ("kinds-probe", "fixtures/kinds-probe", false),
    ("quota", "fixtures/quota", false),
    ("freelist", "fixtures/freelist", false),
];

/// Hand-written WAT policies, `(name, folder)`: `<folder>/<name>.wat`, loaded from source
/// at run time, no toolchain needed.
const WAT_GUESTS: &[(&str, &str)] = &[("passthrough", "policies/wat/passthrough")];

/// Policies in other languages: `(name, folder, language)`. Each folder has `setup.sh`
/// (installs its toolchain; `.ci/setup` runs them all) and `build.sh OUT`, which exits 3
/// with the install command when the toolchain is missing. All are good policies.
const FOREIGN_GUESTS: &[(&str, &str, &str)] = &[
    ("binning", "policies/c/binning", "C"),
    ("buddy", "policies/zig/buddy", "Zig"),
    ("slab", "policies/assemblyscript/slab", "AssemblyScript"),
    ("limit", "policies/python/limit", "Python"),
    ("bump", "policies/go/bump", "Go"),
    ("tracker", "policies/js/tracker", "JavaScript"),
];

/// What every foreign guest's `setup.sh` and `build.sh` source or run.
const SCRIPTS: &str = "scripts";

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let guests = manifest_dir.parent().unwrap().to_path_buf();
    let root = guests.parent().unwrap().to_path_buf();
    // A target directory of its own: the outer cargo holds the lock on the shared one.
    let target_dir = root.join("target").join("guests");

    println!("cargo:rerun-if-changed={}", root.join("wit").display());
    println!(
        "cargo:rerun-if-changed={}",
        guests.join("Cargo.toml").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        guests.join("Cargo.lock").display()
    );
    for (_, folder, _) in RUST_GUESTS {
        println!("cargo:rerun-if-changed={}", guests.join(folder).display());
    }
    // The policy SDK (a library, not a policy) that guests such as `template` build on.
    println!("cargo:rerun-if-changed={}", guests.join("sdk").display());

    let built = build_guests(&guests, &target_dir);
    let out_dir = target_dir.join("wasm32-wasip2").join("release");
    // Built after the Rust guests, into the same directory: cargo creates it.
    let foreign: Vec<(&str, Option<String>)> = FOREIGN_GUESTS
        .iter()
        .map(|(name, folder, _)| {
            let file = out_dir.join(format!("policy_{name}.wasm"));
            (*name, build_foreign(&guests, folder, &file).err())
        })
        .collect();

    let mut code = String::new();
    let error = built.err();
    writeln!(
        code,
        "/// Why the Rust guests could not be built, if they could not."
    )
    .unwrap();
    writeln!(code, "pub const BUILD_ERROR: Option<&str> = {error:?};").unwrap();
    for (name, _, _) in RUST_GUESTS {
        let file = out_dir.join(format!("policy_{}.wasm", name.replace('-', "_")));
        let ident = name.replace('-', "_").to_uppercase();
        writeln!(code, "/// The `{name}` policy component.").unwrap();
        writeln!(
            code,
            "pub const {ident}: Guest = Guest {{ name: {name:?}, language: \"Rust\", path: {:?}, error: BUILD_ERROR }};",
            file.display().to_string()
        )
        .unwrap();
    }
    for ((name, _, language), (_, error)) in FOREIGN_GUESTS.iter().zip(&foreign) {
        let file = out_dir.join(format!("policy_{name}.wasm"));
        let ident = name.to_uppercase();
        writeln!(code, "/// The `{name}` policy, written in {language}.").unwrap();
        writeln!(
            code,
            "pub const {ident}: Guest = Guest {{ name: {name:?}, language: {language:?}, path: {:?}, error: {error:?} }};",
            file.display().to_string()
        )
        .unwrap();
    }
    for (name, folder) in WAT_GUESTS {
        let file = guests.join(folder).join(format!("{name}.wat"));
        let ident = format!("WAT_{}", name.replace('-', "_").to_uppercase());
        writeln!(
            code,
            "/// The hand-written WAT `{name}` policy (source, compiled at load)."
        )
        .unwrap();
        writeln!(
            code,
            "pub const {ident}: Guest = Guest {{ name: {name:?}, language: \"WAT\", path: {:?}, error: None }};",
            file.display().to_string()
        )
        .unwrap();
    }
    // The policies the wheel and the command line ship: the crates marked
    // `[package.metadata.allocbox] ship = true`, with their descriptions.
    let shipped: Vec<String> = RUST_GUESTS
        .iter()
        .filter_map(|(name, folder, _)| {
            let manifest = std::fs::read_to_string(guests.join(folder).join("Cargo.toml")).ok()?;
            let description = shipped_description(&manifest)?;
            Some(format!(
                "({name:?}, {description:?}, {})",
                name.replace('-', "_").to_uppercase()
            ))
        })
        .collect();
    writeln!(
        code,
        "/// The shipped policies: `(name, description, guest)`, from each crate's \
         `[package.metadata.allocbox] ship = true`."
    )
    .unwrap();
    writeln!(
        code,
        "pub const SHIPPED: &[(&str, &str, Guest)] = &[{}];",
        shipped.join(", ")
    )
    .unwrap();
    let good: Vec<String> = RUST_GUESTS
        .iter()
        .filter(|(_, _, good)| *good)
        .map(|(n, _, _)| n.replace('-', "_").to_uppercase())
        .chain(
            WAT_GUESTS
                .iter()
                .map(|(n, _)| format!("WAT_{}", n.to_uppercase())),
        )
        .chain(FOREIGN_GUESTS.iter().map(|(n, _, _)| n.to_uppercase()))
        .collect();
    writeln!(code, "/// Every good policy, in every language.").unwrap();
    writeln!(code, "pub const GOOD: &[Guest] = &[{}];", good.join(", ")).unwrap();
    let idents: Vec<String> = good.iter().map(|g| g.to_lowercase()).collect();
    writeln!(
        code,
        "/// Calls `$m!(ident, GUEST)` for every good policy: a test module per policy,"
    )
    .unwrap();
    writeln!(code, "/// so a policy without tests cannot exist.").unwrap();
    writeln!(
        code,
        "#[macro_export]\nmacro_rules! foreach_good_policy {{ ($m:ident) => {{"
    )
    .unwrap();
    for (ident, konst) in idents.iter().zip(&good) {
        writeln!(code, "    $m!({ident}, $crate::{konst});").unwrap();
    }
    writeln!(code, "}}; }}").unwrap();

    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("artifacts.rs");
    std::fs::write(out, code).unwrap();
}

fn build_guests(guests: &Path, target_dir: &Path) -> Result<(), String> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(guests)
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--workspace",
        ])
        .arg("--target-dir")
        .arg(target_dir)
        // Flags meant for the host build (coverage, sanitizers, -D warnings) are not for
        // the guests.
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTC_WRAPPER");
    let output = cmd
        .output()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    if stderr.contains("wasm32-wasip2")
        && (stderr.contains("may not be installed") || stderr.contains("can't find crate"))
    {
        return Err("the wasm32-wasip2 target is not installed; run `rustup target add wasm32-wasip2` (or `.ci/setup`)".into());
    }
    let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    println!("cargo:warning=guest policies failed to build; tests that need them will fail");
    Err(format!("guest build failed:\n{}", tail.join("\n")))
}

/// Build the foreign-language guest in `guests/folder` with its `build.sh` into `out`,
/// unless `out` is newer than every source file (the toolchains are slow to start; some
/// take seconds per build).
fn build_foreign(guests: &Path, folder: &str, out: &Path) -> Result<(), String> {
    let dir = guests.join(folder);
    let mut sources = source_files(&dir);
    // Every build.sh sources the shared toolchain script and stamps its language with it.
    sources.extend(source_files(&guests.join(SCRIPTS)));
    // And binds the policy to the contract's WIT: a changed contract is a changed guest.
    let root = guests
        .parent()
        .expect("guest-handlers lies in the repository");
    sources.extend(source_files(&root.join("wit")));
    for file in &sources {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let newest_source = sources.iter().filter_map(|f| modified(f)).max();
    if let (Some(built), Some(source)) = (modified(out), newest_source)
        && built >= source
    {
        return Ok(());
    }
    let output = Command::new("bash")
        .arg(dir.join("build.sh"))
        .arg(out)
        .output()
        .map_err(|e| format!("could not run bash: {e}"))?;
    if output.status.success() {
        return Ok(());
    }
    let _ = std::fs::remove_file(out);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let name = dir.file_name().unwrap().to_string_lossy();
    println!("cargo:warning=the `{name}` guest was not built; tests that need it will fail");
    // Exit 3: the toolchain is missing, and the one line says how to install it.
    if output.status.code() == Some(3) {
        return Err(stderr.trim().to_string());
    }
    let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    Err(format!("`{name}` failed to build:\n{}", tail.join("\n")))
}

/// The files a foreign guest is built from: everything in its folder but the build
/// outputs and installed toolchains its `.gitignore` names.
fn source_files(dir: &Path) -> Vec<PathBuf> {
    const NOT_SOURCES: &[&str] = &[
        "build",
        "node_modules",
        "__pycache__",
        "proptest-regressions",
    ];
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !NOT_SOURCES.contains(&name.as_str()) {
                    todo.push(path);
                }
            } else if !name.ends_with(".wasm") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The `description` of a guest crate whose manifest marks it shipped
/// (`[package.metadata.allocbox]` with `ship = true`); none for the others.
fn shipped_description(manifest: &str) -> Option<String> {
    let marked = manifest
        .split("[package.metadata.allocbox]")
        .nth(1)?
        .lines()
        .take_while(|line| !line.trim_start().starts_with('['))
        .any(|line| line.split_whitespace().collect::<String>() == "ship=true");
    let description = manifest.lines().find_map(|line| {
        let value = line
            .strip_prefix("description")?
            .trim_start()
            .strip_prefix('=')?;
        Some(value.trim().trim_matches('"').to_string())
    })?;
    marked.then_some(description)
}
