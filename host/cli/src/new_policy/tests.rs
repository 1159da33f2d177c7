//! `allocbox new`'s unit checks: names, languages, the placeholder's replacement, and
//! templates pinning the same toolchains as the repository's own policies.

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
fn shipped_languages_parse_and_the_others_are_named() {
    for (name, lang) in [
        ("Rust", Lang::Rust),
        ("wat", Lang::Wat),
        ("c", Lang::C),
        ("Zig", Lang::Zig),
        ("assemblyscript", Lang::AssemblyScript),
        ("AS", Lang::AssemblyScript),
        ("python", Lang::Python),
        ("py", Lang::Python),
        ("go", Lang::Go),
        ("js", Lang::Js),
        ("JavaScript", Lang::Js),
    ] {
        assert_eq!(parse_lang(name), Ok(lang), "{name}");
    }
    let shipped = "rust, wat, c, zig, assemblyscript (as), python, go, js (javascript)";
    let e = parse_lang("typescript").unwrap_err();
    assert!(e.contains("not shipped yet") && e.contains(shipped), "{e}");
    let e = parse_lang("cobol").unwrap_err();
    assert!(e.contains("unknown language") && e.contains(shipped), "{e}");
}

const FOREIGN: [Lang; 6] = [
    Lang::C,
    Lang::Zig,
    Lang::AssemblyScript,
    Lang::Python,
    Lang::Go,
    Lang::Js,
];

#[test]
fn template_projects_carry_the_name_everywhere_the_placeholder_was() {
    let name = format!("My-Policy_{}", "n".repeat(54));
    for lang in FOREIGN {
        let files = foreign_project(&name, lang);
        for (file, text) in &files {
            assert!(!text.contains(PLACEHOLDER), "{lang:?} {file}");
        }
        let has = |file: &str, text: &str| {
            files
                .iter()
                .any(|(f, t)| f.as_str() == file && t.contains(text))
        };
        // The policy says its name, build.sh writes NAME.wasm, and the README says so.
        assert!(
            files
                .iter()
                .any(|(f, t)| !f.ends_with(".md") && !f.ends_with(".sh") && t.contains(&name)),
            "{lang:?}: no source names the policy"
        );
        assert!(has("build.sh", &format!("{name}.wasm")), "{lang:?}");
        assert!(has("setup.sh", ""), "{lang:?}");
        for command in [
            "./setup.sh",
            "./build.sh",
            &format!("allocbox check {name}.wasm"),
        ] {
            assert!(
                has("README.md", command),
                "{lang:?}: README lacks `{command}`"
            );
        }
        // Each build.sh stamps the language, except Go's and JavaScript's, whose
        // toolchains record it.
        let stamps = has("build.sh", "stamp_language.py");
        assert_eq!(stamps, !matches!(lang, Lang::Go | Lang::Js), "{lang:?}");
        assert_eq!(stamps, has("stamp_language.py", ""), "{lang:?}");
    }
}

/// The value of `VAR=value` on a line of a shell script.
fn pin<'a>(script: &'a str, var: &str) -> &'a str {
    script
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{var}=")))
        .unwrap_or_else(|| panic!("no {var}= in\n{script}"))
}

#[test]
fn templates_pin_the_toolchains_of_the_repositorys_policies() {
    let repo = [
        (
            Lang::Zig,
            include_str!("../../../../guest-handlers/policies/zig/buddy/setup.sh"),
            "ZIG_VERSION",
        ),
        (
            Lang::Python,
            include_str!("../../../../guest-handlers/policies/python/limit/setup.sh"),
            "VERSION",
        ),
        (
            Lang::Go,
            include_str!("../../../../guest-handlers/policies/go/bump/setup.sh"),
            "VERSION",
        ),
        (
            Lang::AssemblyScript,
            include_str!("../../../../guest-handlers/policies/assemblyscript/slab/setup.sh"),
            "ASC_VERSION",
        ),
        (
            Lang::Js,
            include_str!("../../../../guest-handlers/policies/js/tracker/setup.sh"),
            "CJS_VERSION",
        ),
    ];
    for (lang, repo_setup, var) in repo {
        let (files, _) = foreign_files(lang);
        let script = |name: &str| files.iter().find(|(f, _)| *f == name).unwrap().1;
        let version = pin(repo_setup, var).trim_matches('"');
        assert_eq!(
            pin(script("setup.sh"), "VERSION"),
            version,
            "{lang:?} setup.sh"
        );
        assert_eq!(
            pin(script("build.sh"), "VERSION"),
            version,
            "{lang:?} build.sh"
        );
    }
    // C: the Debian packages the binning policy's setup.sh installs.
    let binning = include_str!("../../../../guest-handlers/policies/c/binning/setup.sh");
    let (c, _) = foreign_files(Lang::C);
    for package in [pin(binning, "CLANG_PKG"), pin(binning, "LLD_PKG")] {
        let package = package.trim_matches('"');
        assert!(
            c.iter()
                .any(|(f, t)| *f == "setup.sh" && t.contains(package))
        );
    }
    // AssemblyScript: the same dependency as slab, and slab's lockfile for it.
    let slab = include_str!("../../../../guest-handlers/policies/assemblyscript/slab/package.json");
    let (files, _) = foreign_files(Lang::AssemblyScript);
    let package = files.iter().find(|(f, _)| *f == "package.json").unwrap().1;
    let dependencies = |json: &str| {
        serde_json::from_str::<serde_json::Value>(json).unwrap()["devDependencies"].clone()
    };
    assert_eq!(dependencies(package), dependencies(slab));
    let lock: serde_json::Value = serde_json::from_str(&assemblyscript_lock()).unwrap();
    assert_eq!(lock["packages"][""]["devDependencies"], dependencies(slab));
    assert_eq!(lock["name"], "allocbox-policy");
    assert_eq!(lock["packages"][""].get("license"), None);
    // JavaScript: tracker's dependency and overrides, and tracker's lockfile for them.
    let tracker = include_str!("../../../../guest-handlers/policies/js/tracker/package.json");
    let (files, _) = foreign_files(Lang::Js);
    let package = files.iter().find(|(f, _)| *f == "package.json").unwrap().1;
    let json = |json: &str| serde_json::from_str::<serde_json::Value>(json).unwrap();
    for key in ["devDependencies", "overrides", "type"] {
        assert_eq!(json(package)[key], json(tracker)[key], "{key}");
    }
    let lock = json(&js_lock());
    assert_eq!(
        lock["packages"][""]["devDependencies"],
        json(tracker)["devDependencies"]
    );
    assert_eq!(lock["name"], "allocbox-policy");
    assert_eq!(lock["packages"][""].get("license"), None);
    assert_eq!(json(package)["name"], "allocbox-policy");
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

/// Issue 73: a new Rust project's `cargo test` depended on `allocbox-check` (a git
/// dependency on `example.invalid`, or a path into the checkout) and built wasmtime for
/// an hour. It builds the policy and runs the installed `allocbox check`, and says how
/// to install it when it is not found; the README says the same.
#[test]
fn a_new_rust_project_checks_its_contract_with_the_installed_allocbox() {
    let files = rust_project("probe");
    let file = |name: &str| {
        &files
            .iter()
            .find(|(f, _)| f == name)
            .unwrap_or_else(|| panic!("no {name}"))
            .1
    };
    let test = file("tests/contract.rs");
    assert!(test.contains(r#"check.args(["check", &wasm]);"#), "{test}");
    assert!(test.contains("pip install allocbox-*.whl"), "{test}");
    let cargo = file("Cargo.toml");
    assert!(!cargo.contains("allocbox-check"), "{cargo}");
    assert!(!cargo.contains("example.invalid"), "{cargo}");
    let readme = file("README.md");
    assert!(readme.contains("`allocbox` must be on PATH"), "{readme}");
    assert!(readme.contains("python/build_wheel.sh"), "{readme}");
}

/// A file added to the SDK's sources is vendored into every new Rust project: the
/// project builds only with all of them.
#[test]
fn a_new_rust_project_vendors_every_source_file_of_the_sdk() {
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../guest-handlers/sdk/src");
    let vendored: Vec<&str> = SDK_FILES.iter().map(|(path, _)| *path).collect();
    for entry in std::fs::read_dir(&sources).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let path = format!("src/{name}");
        assert!(
            vendored.contains(&path.as_str()),
            "{path} is not in SDK_FILES"
        );
    }
}
