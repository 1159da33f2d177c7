//! Each crate's modules form layers: each uses only the modules below it, in the order
//! its `Module order:` line gives (the host's in ARCHITECTURE.md, the others' in their
//! `lib.rs` docs). A path to a module (`crate::NAME`, or `super::NAME` in a module of
//! the crate root) outside comments and test modules that points at a module above its
//! own, or one the order does not place, fails here, so the map stays true as the code
//! grows and no two modules use each other. Test code (test modules, `tests.rs`, loom's
//! `models.rs`) is left out: it uses a module's public face.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The modules of a `Module order: a > b > c` line in `text`, top first.
fn module_order(text: &str, whose: &str) -> Vec<String> {
    let line = text
        .lines()
        .find_map(|line| {
            line.trim_start_matches("//! ")
                .strip_prefix("Module order: ")
        })
        .unwrap_or_else(|| panic!("{whose} has a `Module order:` line"));
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

/// Each module `prefix` names (`crate::NAME`, `super::NAME`, each of
/// `crate::{A, B::C}`) in a line of code (not a comment).
fn paths<'a>(line: &'a str, prefix: &'a str) -> impl Iterator<Item = &'a str> {
    let code = line.split("//").next().unwrap_or("");
    let name = |rest: &'a str| {
        let rest = rest.trim_start();
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        &rest[..end]
    };
    code.match_indices(prefix).flat_map(move |(at, _)| {
        let rest = &code[at + prefix.len()..];
        match rest.strip_prefix('{') {
            // The items of a group, each by its first segment (nested groups within an
            // item belong to that item).
            Some(group) => {
                let mut depth = 0;
                let mut items = vec![group];
                for (i, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => {
                            let last = items.pop().unwrap();
                            let start = group.len() - last.len();
                            items.push(&group[start..i]);
                            break;
                        }
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            let last = items.pop().unwrap();
                            let start = group.len() - last.len();
                            items.push(&group[start..i]);
                            items.push(&group[i + 1..]);
                        }
                        _ => {}
                    }
                }
                items
                    .into_iter()
                    .map(name)
                    .filter(|n| !n.is_empty())
                    .collect()
            }
            None => vec![name(rest)],
        }
    })
}

/// Each `crate::NAME` a line of code (not a comment) names.
fn crate_paths(line: &str) -> impl Iterator<Item = &str> {
    paths(line, "crate::")
}

/// The paths under `src` that do not point down `order`: a crate's (whose modules
/// `crate::NAME` names), or with [`layer_violations_within`] the folder of one module
/// (whose files `crate::MODULE::NAME` names).
fn layer_violations(src: &Path, order: &[String]) -> (Vec<String>, usize) {
    layer_violations_within(src, order, "crate::")
}

fn layer_violations_within(src: &Path, order: &[String], named_by: &str) -> (Vec<String>, usize) {
    let rank: HashMap<&str, usize> = order
        .iter()
        .enumerate()
        .map(|(i, m)| (m.as_str(), i))
        .collect();
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let mut wrong = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(src).unwrap();
        // Test code (a `tests.rs`, loom's `models.rs`) uses a module's public face.
        let stem = file.file_stem().and_then(|s| s.to_str());
        if matches!(relative.to_str(), Some("lib.rs" | "main.rs" | "mod.rs"))
            || matches!(stem, Some("tests" | "models"))
        {
            continue;
        }
        let first = relative.components().next().unwrap().as_os_str();
        let module = first.to_str().unwrap().trim_end_matches(".rs");
        let Some(&own) = rank.get(module) else {
            wrong.push(format!(
                "{}: module `{module}` is not in its crate's `Module order:` line",
                relative.display()
            ));
            continue;
        };
        // In a module of the crate root, `super::` is the crate root.
        let at_root = relative.components().count() == 1;
        let text = std::fs::read_to_string(file).unwrap();
        let code = text.split("#[cfg(test)]\nmod ").next().unwrap();
        for (n, line) in code.lines().enumerate() {
            // Only module names: an item after `super::` is an inline module's parent's.
            let supers = paths(line, "super::")
                .filter(|name| at_root && name.starts_with(|c: char| c.is_ascii_lowercase()));
            let named = paths(line, named_by);
            for used in named.chain(supers).filter(|&used| used != module) {
                match rank.get(used) {
                    Some(&below) if below > own => {}
                    Some(_) => wrong.push(format!(
                        "{}:{}: `{module}` uses `{used}`, which is above it",
                        relative.display(),
                        n + 1
                    )),
                    None if used.starts_with(char::is_uppercase) || used.is_empty() => {
                        wrong.push(format!(
                            "{}:{}: `{used}` is the crate root's item, which hides its layer: \
                             name the module that defines it",
                            relative.display(),
                            n + 1
                        ))
                    }
                    None => wrong.push(format!(
                        "{}:{}: `{used}` is not in its crate's `Module order:` line",
                        relative.display(),
                        n + 1
                    )),
                }
            }
        }
    }
    (wrong, files.len())
}

/// A crate of the workspace: its `src` and the order its `lib.rs` docs give.
fn check_crate(folder: &str) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let src = root.join(folder).join("src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let order = module_order(&lib, &format!("{folder}/src/lib.rs"));
    let (wrong, files) = layer_violations(&src, &order);
    assert!(
        wrong.is_empty(),
        "imports in {folder} that do not point down its layers:\n{}",
        wrong.join("\n")
    );
    files
}

#[test]
fn every_crate_path_in_the_host_points_down_the_layers() {
    let order = module_order(include_str!("../ARCHITECTURE.md"), "ARCHITECTURE.md");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let (wrong, files) = layer_violations(&src, &order);
    assert!(
        wrong.is_empty(),
        "imports that do not point down the layers:\n{}",
        wrong.join("\n")
    );
    assert!(files > 30, "found only {files} files");
}

/// Issue 65: `caches` and `combining` used each other (the queue of waiting requests
/// is `waiting.rs` of its own now).
#[test]
fn every_module_of_the_ledger_and_every_file_of_its_caches_points_down_its_layers() {
    check_crate("host/ledger");
    let cache = Path::new(env!("CARGO_MANIFEST_DIR")).join("ledger/src/cache");
    let docs = std::fs::read_to_string(cache.join("mod.rs")).unwrap();
    let order = module_order(&docs, "host/ledger/src/cache/mod.rs");
    let (wrong, files) = layer_violations_within(&cache, &order, "crate::cache::");
    assert!(
        wrong.is_empty(),
        "imports in the caches that do not point down their layers:\n{}",
        wrong.join("\n")
    );
    assert!(files > 8, "found only {files} files");
}

/// Issue 65: `shrink` and `strategy` used each other.
#[test]
fn every_module_of_the_checker_points_down_its_layers() {
    assert!(check_crate("host/check") > 8);
}

/// Issue 65: `cuda` and `loading`, `numba_route` and `numba_blocks` used each other.
#[test]
fn every_module_of_the_python_bridge_points_down_its_layers() {
    assert!(check_crate("python") > 10);
}

/// Issue 65: every command's module used the crate root's items (`Outcome`, `load`,
/// the grammar) while the root used every module.
#[test]
fn every_module_of_the_command_line_points_down_its_layers() {
    assert!(check_crate("host/cli") > 10);
}

#[test]
fn a_path_in_a_comment_is_not_an_import_and_each_path_is_named_to_its_module() {
    let line = "use crate::link::{Link, bindings}; // see [`crate::handler::Handler`]";
    assert_eq!(crate_paths(line).collect::<Vec<_>>(), ["link"]);
    let line = "let x = crate::observe::observation(b, crate::wit::X);";
    assert_eq!(crate_paths(line).collect::<Vec<_>>(), ["observe", "wit"]);
    let line = "use super::script::{Case, Op};";
    assert_eq!(paths(line, "super::").collect::<Vec<_>>(), ["script"]);
    let line = "use crate::{convert, named::{load, Hook}, outcome::Outcome};";
    assert_eq!(
        crate_paths(line).collect::<Vec<_>>(),
        ["convert", "named", "outcome"]
    );
}

#[test]
fn a_module_using_one_above_it_or_one_the_order_does_not_place_is_named() {
    let src = std::env::temp_dir().join(format!("allocbox-layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("top.rs"), "use super::bottom::X;\n").unwrap();
    std::fs::write(
        src.join("bottom.rs"),
        "use crate::top::Y;\nuse crate::gone::Z;\n",
    )
    .unwrap();
    let order = ["top".to_string(), "bottom".to_string()];
    let (wrong, _) = layer_violations(&src, &order);
    assert_eq!(
        wrong,
        [
            "bottom.rs:1: `bottom` uses `top`, which is above it",
            "bottom.rs:2: `gone` is not in its crate's `Module order:` line",
        ]
    );
}

/// The modules `line` (code, not a comment) names by path from `at` (a file's module
/// path, `["trace", "binary", "read"]`): each `crate::`, `super::` or `self::` path as
/// the module path it starts with, the items of a `{...}` group each on its own.
fn module_paths(line: &str, at: &[String]) -> Vec<Vec<String>> {
    let code = line.split("//").next().unwrap_or("");
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut found = Vec::new();
    for prefix in ["crate::", "super::", "self::"] {
        for (start, _) in code.match_indices(prefix) {
            if code[..start].ends_with(ident) || code[..start].ends_with("::") {
                continue;
            }
            let mut base: Vec<String> = match prefix {
                "crate::" => Vec::new(),
                "self::" => at.to_vec(),
                _ => at[..at.len().saturating_sub(1)].to_vec(),
            };
            let mut rest = &code[start + prefix.len()..];
            while let Some(after) = rest.strip_prefix("super::") {
                base.pop();
                rest = after;
            }
            let mut segments = Vec::new();
            loop {
                let end = rest.find(|c: char| !ident(c)).unwrap_or(rest.len());
                if end == 0 {
                    break;
                }
                segments.push(rest[..end].to_string());
                match rest[end..].strip_prefix("::") {
                    Some(after) => rest = after,
                    None => {
                        rest = "";
                        break;
                    }
                }
            }
            match rest.strip_prefix('{') {
                Some(group) => {
                    let group = group.split('}').next().unwrap_or("");
                    for item in group.split(',') {
                        let item = item.trim().split("::").next().unwrap_or("").trim();
                        if !item.is_empty() && item != "self" {
                            let mut path = base.clone();
                            path.extend(segments.iter().cloned());
                            path.push(item.to_string());
                            found.push(path);
                        }
                    }
                }
                None => {
                    let mut path = base.clone();
                    path.extend(segments);
                    found.push(path);
                }
            }
        }
    }
    found
}

/// Issue 72: `trace/` had two import circles (its readers and their shared types;
/// `binary/chunk.rs` and `binary/read.rs`) that the order of the top modules cannot
/// see. Among the files of every folder of `host/src`, at any depth, the imports form
/// no circle: each module uses its siblings in one direction only. (A file may use the
/// module whose folder it is in, whose concept it implements.)
#[test]
fn no_files_of_one_folder_of_the_host_use_each_other_in_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let module_of = |file: &Path| -> Option<Vec<String>> {
        let relative = file.strip_prefix(&src).ok()?.with_extension("");
        let mut path: Vec<String> = relative
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        match path.last().map(String::as_str) {
            Some("lib") => path.clear(),
            Some("mod") => drop(path.pop()),
            Some("tests" | "models") => return None,
            _ => {}
        }
        Some(path)
    };
    let modules: Vec<(Vec<String>, PathBuf)> = files
        .iter()
        .filter_map(|f| module_of(f).map(|m| (m, f.clone())))
        .collect();
    let known: std::collections::HashSet<&[String]> =
        modules.iter().map(|(m, _)| m.as_slice()).collect();
    // Each sibling one module uses, lifted to the children of their common parent.
    let mut uses: HashMap<Vec<String>, Vec<(Vec<String>, String)>> = HashMap::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(file).unwrap();
        let code = text.split("#[cfg(test)]\nmod ").next().unwrap();
        for (n, line) in code.lines().enumerate() {
            for path in module_paths(line, module) {
                let Some(target) = (1..=path.len())
                    .rev()
                    .map(|n| &path[..n])
                    .find(|p| known.contains(p))
                else {
                    continue;
                };
                let common = module
                    .iter()
                    .zip(target)
                    .take_while(|(a, b)| a == b)
                    .count();
                if common >= module.len() || common >= target.len() {
                    continue;
                }
                let at = format!("{}:{}", file.strip_prefix(&src).unwrap().display(), n + 1);
                uses.entry(module[..=common].to_vec())
                    .or_default()
                    .push((target[..=common].to_vec(), at));
            }
        }
    }
    // A circle is a module that reaches itself: found by a walk from each.
    let mut circles = Vec::new();
    for start in uses.keys() {
        let mut seen = std::collections::HashSet::new();
        let mut stack: Vec<(Vec<String>, Vec<String>)> = vec![(start.clone(), Vec::new())];
        while let Some((module, trail)) = stack.pop() {
            for (next, at) in uses.get(&module).into_iter().flatten() {
                let mut trail = trail.clone();
                trail.push(format!(
                    "{} uses {} ({at})",
                    module.join("::"),
                    next.join("::")
                ));
                if next == start {
                    circles.push(trail.join(", "));
                } else if seen.insert(next.clone()) {
                    stack.push((next.clone(), trail));
                }
            }
        }
    }
    circles.sort();
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
    assert!(
        uses.len() > 20,
        "found only {} modules using siblings",
        uses.len()
    );
}

#[test]
fn a_path_names_its_module_from_where_it_is_written() {
    let at = [
        "trace".to_string(),
        "binary".to_string(),
        "read".to_string(),
    ];
    let joined = |line: &str| -> Vec<String> {
        module_paths(line, &at)
            .iter()
            .map(|p| p.join("::"))
            .collect()
    };
    assert_eq!(
        joined("use super::chunk::{ChunkDecoder, chunk_error};"),
        [
            "trace::binary::chunk::ChunkDecoder",
            "trace::binary::chunk::chunk_error"
        ]
    );
    assert_eq!(
        joined("use super::super::file::ReadAt;"),
        ["trace::file::ReadAt"]
    );
    assert_eq!(
        joined("let x = crate::output::note_input(p);"),
        ["output::note_input"]
    );
    assert_eq!(joined("// crate::gone::X"), Vec::<String>::new());
}
