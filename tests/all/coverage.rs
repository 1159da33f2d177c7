//! Every function of every interface the host serves a guest or calls in one, in each
//! world it serves (the policy world of contracts 0.1.0 and 0.2.0, the hook world), has
//! an arm in the adversarial fuzzers: the module fuzzer (`smith`) may import or must
//! export it, and the hostile policy (`chaos`) calls or implements it. A function added
//! to the WIT without an arm fails here, so no interface can be served unfuzzed.
//! WASI is left to `tests/all/wasi.rs`, which calls every function of it.

use super::smith::World;

/// For each function of the policy world (0.2.0 holds all of 0.1.0's), what in the
/// `chaos` fixture's source drives it: a call of an import, or the method of an export.
const CHAOS_ARMS: &[(&str, &str)] = &[
    ("import allocator#malloc", "upstream::malloc("),
    ("import allocator#calloc", "upstream::calloc("),
    ("import allocator#realloc", "upstream::realloc("),
    ("import allocator#free", "upstream::free("),
    ("import allocator#malloc-many", "upstream::malloc_many("),
    ("import allocator#free-many", "upstream::free_many("),
    ("import bytes#read", "bytes::read("),
    ("import bytes#write", "bytes::write("),
    ("import bytes#fill", "bytes::fill("),
    ("import bytes#copy", "bytes::copy("),
    ("import bytes#read-u64", "bytes::read_u64("),
    ("import bytes#write-u64", "bytes::write_u64("),
    ("import memory#map-region", "memory::map("),
    ("import memory#unmap-region", "memory::unmap("),
    ("import memory#page-size", "memory::page_size("),
    ("import memory#map-gpu", "memory::map_gpu("),
    ("import memory#map-pinned", "before_map_gpu::map_pinned("),
    ("import memory#map-device", "before_map_gpu::map_device("),
    (
        "import diagnostics#client-misuse",
        "diagnostics::client_misuse(",
    ),
    ("export allocator#malloc", "fn malloc("),
    ("export allocator#calloc", "fn calloc("),
    ("export allocator#realloc", "fn realloc("),
    ("export allocator#free", "fn free("),
    ("export allocator#malloc-many", "fn malloc_many("),
    // The SDK's default `free-many` calls the policy's `free`, mischief and all.
    ("export allocator#free-many", "`free_many` is the default"),
    ("export lifecycle#init", "fn init("),
    ("export lifecycle#trim", "fn trim("),
    ("export lifecycle#report", "fn report("),
    ("export observer#observes", "fn observes("),
    ("export observer#observe", "fn observe_survivors("),
    ("export observer#renew", "fn renew("),
    // The SDK answers `shardable` from the policy's `info`, as its seed says.
    ("export sharding#shardable", ".shardable("),
];

const CHAOS_SOURCE: &str = include_str!("../../guest-handlers/fixtures/chaos/src/lib.rs");

/// Every allocbox function of `world`: `("import" | "export", interface id, function)`.
fn functions(world: World) -> Vec<(&'static str, String, String)> {
    let (wit, name) = world.wit();
    let mut resolve = wit_parser::Resolve::default();
    let package = resolve.push_str("policy.wit", wit).unwrap();
    let id = resolve.select_world(&[package], Some(name)).unwrap();
    let world = &resolve.worlds[id];
    let mut all = Vec::new();
    for (direction, items) in [("import", &world.imports), ("export", &world.exports)] {
        for item in items.values() {
            let wit_parser::WorldItem::Interface { id, .. } = item else {
                continue;
            };
            let interface = resolve.id_of(*id).expect("a named interface");
            if !interface.starts_with("allocbox:") {
                continue;
            }
            for function in resolve.interfaces[*id].functions.keys() {
                all.push((direction, interface.clone(), function.clone()));
            }
        }
    }
    all
}

/// The function imports (`module`, `name`) and export names of a core module.
fn names(module: &[u8]) -> (Vec<(String, String)>, Vec<String>) {
    let (mut imports, mut exports) = (Vec::new(), Vec::new());
    for payload in wasmparser::Parser::new(0).parse_all(module) {
        match payload.unwrap() {
            wasmparser::Payload::ImportSection(section) => {
                for import in section.into_imports() {
                    let import = import.unwrap();
                    imports.push((import.module.to_string(), import.name.to_string()));
                }
            }
            wasmparser::Payload::ExportSection(section) => {
                exports.extend(section.into_iter().map(|e| e.unwrap().name.to_string()));
            }
            _ => {}
        }
    }
    (imports, exports)
}

#[test]
fn every_function_of_every_served_world_has_an_arm_in_both_fuzzers() {
    let mut chaos_rows_used = Vec::new();
    let mut missing = Vec::new();
    for world in World::ALL {
        let listed = functions(world);
        assert!(!listed.is_empty(), "{world:?} has no functions");
        let (imports, _) = names(world.imports());
        let (_, exports) = names(world.exports());
        for (direction, interface, function) in listed {
            let reached = match direction {
                "import" => imports.contains(&(interface.clone(), function.clone())),
                _ => exports.contains(&format!("{interface}#{function}")),
            };
            if !reached {
                missing.push(format!(
                    "smith ({world:?}): {direction} {interface}#{function}"
                ));
            }
            if world == World::Hook {
                // A hook is no policy: the module fuzzer alone writes hooks.
                continue;
            }
            let short = interface
                .trim_start_matches("allocbox:policy/")
                .split('@')
                .next()
                .unwrap()
                .to_string();
            let key = format!("{direction} {short}#{function}");
            match CHAOS_ARMS.iter().find(|(k, _)| *k == key) {
                Some((_, needle)) if CHAOS_SOURCE.contains(needle) => chaos_rows_used.push(key),
                Some((_, needle)) => {
                    missing.push(format!("chaos: {key}: its source no longer has `{needle}`"))
                }
                None => missing.push(format!("chaos: {key} has no row in CHAOS_ARMS")),
            }
        }
    }
    assert!(
        missing.is_empty(),
        "functions no fuzzer reaches: give each an arm in the fuzzer named:\n{}",
        missing.join("\n")
    );
    for (key, _) in CHAOS_ARMS {
        assert!(
            chaos_rows_used.iter().any(|k| k == key),
            "CHAOS_ARMS lists `{key}`, which no served world has"
        );
    }
}
