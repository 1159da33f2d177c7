//! The host's modules form layers: each uses only the modules below it, in the order
//! ARCHITECTURE.md gives (its `Module order:` line). A `crate::` path outside comments
//! and test modules that points at a module above its own, or a module the order does
//! not place, fails here, so the map stays true as the code grows.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn module_order() -> Vec<String> {
    let architecture = include_str!("../ARCHITECTURE.md");
    let line = architecture
        .lines()
        .find_map(|line| line.strip_prefix("Module order: "))
        .expect("ARCHITECTURE.md has a `Module order:` line");
    line.split(" > ")
        .map(|name| name.trim().trim_matches('`').to_string())
        .collect()
}

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// Each `crate::NAME` a line of code (not a comment) names.
fn crate_paths(line: &str) -> impl Iterator<Item = &str> {
    let code = line.split("//").next().unwrap_or("");
    code.match_indices("crate::").map(move |(at, _)| {
        let rest = &code[at + "crate::".len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        &rest[..end]
    })
}

#[test]
fn every_crate_path_in_the_host_points_down_the_layers() {
    let order = module_order();
    let rank: HashMap<&str, usize> = order
        .iter()
        .enumerate()
        .map(|(i, m)| (m.as_str(), i))
        .collect();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut wrong = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).unwrap();
        if relative == Path::new("lib.rs") {
            continue;
        }
        let first = relative.components().next().unwrap().as_os_str();
        let module = first.to_str().unwrap().trim_end_matches(".rs");
        let Some(&own) = rank.get(module) else {
            wrong.push(format!(
                "{}: module `{module}` is not in ARCHITECTURE.md's `Module order:` line",
                relative.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        let code = text.split("#[cfg(test)]\nmod ").next().unwrap();
        for (n, line) in code.lines().enumerate() {
            for used in crate_paths(line).filter(|&used| used != module) {
                match rank.get(used) {
                    Some(&below) if below > own => {}
                    Some(_) => wrong.push(format!(
                        "{}:{}: `{module}` uses `{used}`, which is above it",
                        relative.display(),
                        n + 1
                    )),
                    None if used.starts_with(char::is_uppercase) => wrong.push(format!(
                        "{}:{}: `crate::{used}` is the crate root's re-export, which hides \
                         its layer: name the module that defines it",
                        relative.display(),
                        n + 1
                    )),
                    None => wrong.push(format!(
                        "{}:{}: `{used}` is not in ARCHITECTURE.md's `Module order:` line",
                        relative.display(),
                        n + 1
                    )),
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports that do not point down the layers:\n{}",
        wrong.join("\n")
    );
    assert!(files.len() > 30, "found only {} files", files.len());
}

#[test]
fn a_path_in_a_comment_is_not_an_import_and_each_path_is_named_to_its_module() {
    let line = "use crate::link::{Link, bindings}; // see [`crate::handler::Handler`]";
    assert_eq!(crate_paths(line).collect::<Vec<_>>(), ["link"]);
    let line = "let x = crate::observe::observation(b, crate::wit::X);";
    assert_eq!(crate_paths(line).collect::<Vec<_>>(), ["observe", "wit"]);
}
