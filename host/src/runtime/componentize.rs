//! Turning what a user hands the host (a component, a core module, WAT) into component
//! bytes: a core module written to the world's canonical ABI is made a component here,
//! with the host's own WASI preview-1 stub as its adapter.

use std::sync::OnceLock;

use super::{POLICY_WIT, POLICY_WIT_2, detail};
use crate::compile_bounds::CompileBounds;
use crate::error::LoadError;

/// How every wasm binary, module or component, starts.
pub(super) const WASM_MAGIC: &[u8] = b"\0asm";

/// Turn file contents into component bytes, or say clearly why they are not one.
pub(super) fn to_component_binary(
    bytes: &[u8],
    world: &str,
    bounds: &CompileBounds,
) -> Result<Vec<u8>, LoadError> {
    if bytes.starts_with(WASM_MAGIC) {
        bounds.check_binary(bytes)?;
        // Bytes 6..8 are the layer: 0 for a core module, 1 for a component. A core module
        // written to the world's canonical ABI (what C, Zig, AssemblyScript or Go
        // toolchains emit) is made a component here, as WAT is: no outside tool needed.
        return match bytes.get(6..8) {
            Some([1, 0]) => Ok(bytes.to_vec()),
            Some([0, 0]) => componentize(bytes.to_vec(), world),
            _ => Err(LoadError::Invalid {
                detail: "unknown wasm binary layer".into(),
            }),
        };
    }
    let Ok(text) = std::str::from_utf8(bytes) else {
        return Err(LoadError::NotWasm {
            detail: "binary data without the `\\0asm` magic".into(),
        });
    };
    bounds.check_text(bytes)?;
    let looks_like_wat = text
        .lines()
        .map(str::trim_start)
        .find(|l| !l.is_empty() && !l.starts_with(";;"))
        .is_some_and(|l| l.starts_with('('));
    let binary = wat::parse_str(text).map_err(|e| {
        if looks_like_wat {
            LoadError::Invalid { detail: detail(&e) }
        } else {
            LoadError::NotWasm {
                detail: "text that is not WAT".into(),
            }
        }
    })?;
    bounds.check_binary(&binary)?;
    match binary.get(6..8) {
        Some([0, 0]) => componentize(binary, world),
        _ => Ok(binary),
    }
}

/// The `wasi_snapshot_preview1` that core modules get: a sandbox with nothing in it,
/// see the file for what each call answers.
const WASI_STUB_WAT: &str = include_str!("../wasi_stub.wat");

/// [`WASI_STUB_WAT`] in binary, with the world it imports from the host, built once per
/// process.
fn wasi_stub() -> &'static [u8] {
    static STUB: OnceLock<Vec<u8>> = OnceLock::new();
    STUB.get_or_init(|| {
        let mut stub = wat::parse_str(WASI_STUB_WAT).expect("the WASI stub is valid WAT");
        let mut resolve = wit_parser::Resolve::default();
        let package = resolve
            .push_str("sandbox.wit", crate::wasi::STUB_WIT)
            .expect("the stub's WIT is valid");
        let world = resolve
            .select_world(&[package], Some("stub"))
            .expect("the stub's WIT has its world");
        wit_component::embed_component_metadata(
            &mut stub,
            &resolve,
            world,
            wit_component::StringEncoding::UTF8,
            false,
        )
        .expect("the stub's imports are its world's");
        stub
    })
}

/// Make a core module (binary, or from WAT) a component of `world` (`policy` or
/// `hook`), as `wasm-tools component new` would: embed the world's type information,
/// then encode. The module must import and export the world's functions under their
/// canonical-ABI names (`allocbox:policy/allocator@0.1.0#malloc`, ...).
///
/// A module that names an interface of contract 0.2.0 (imports or exports
/// `allocbox:policy/...@0.2.0`) is written to the 0.2.0 policy world, or to its
/// `sharding-policy` world when it exports `sharding`; any other to 0.1.0.
///
/// It may also import `wasi_snapshot_preview1` (language runtimes such as Go's do even
/// when they never print): those imports are served by allocbox's own stub adapter,
/// which imports nothing but the module's memory and so grants nothing: clocks that
/// carry no real time, a fixed random sequence, output dropped, no descriptors. A
/// module that imports no WASI gets no adapter (wit-component skips an unused one).
fn componentize(mut module: Vec<u8>, world: &str) -> Result<Vec<u8>, LoadError> {
    let err = |e: anyhow::Error| LoadError::Componentize { detail: detail(&e) };
    let mut resolve = wit_parser::Resolve::default();
    let wit = match world == "policy" && names_contract_0_2_0(&module) {
        true => POLICY_WIT_2,
        false => POLICY_WIT,
    };
    // A 0.2.0 module that exports `sharding` is written to the world that has it.
    let world = match wit == POLICY_WIT_2 && exports_sharding(&module) {
        true => "sharding-policy",
        false => world,
    };
    let pkg = resolve.push_str("policy.wit", wit).map_err(err)?;
    let world = resolve.select_world(&[pkg], Some(world)).map_err(err)?;
    wit_component::embed_component_metadata(
        &mut module,
        &resolve,
        world,
        wit_component::StringEncoding::UTF8,
        false,
    )
    .map_err(err)?;
    wit_component::ComponentEncoder::default()
        .module(&module)
        .map_err(err)?
        .adapter("wasi_snapshot_preview1", wasi_stub())
        .map_err(err)?
        .validate(true)
        .encode()
        .map_err(err)
}

/// Does the core module export a function of 0.2.0's optional `sharding` interface?
fn exports_sharding(module: &[u8]) -> bool {
    for payload in wasmparser::Parser::new(0).parse_all(module) {
        match payload {
            Ok(wasmparser::Payload::ExportSection(section)) => {
                return section
                    .into_iter()
                    .flatten()
                    .any(|e| e.name.starts_with("allocbox:policy/sharding@0.2.0#"));
            }
            Ok(_) => {}
            Err(_) => return false,
        }
    }
    false
}

/// Does the core module import or export a function of a contract 0.2.0 interface?
/// A module that does not parse says no; the encoder names what is wrong with it.
fn names_contract_0_2_0(module: &[u8]) -> bool {
    const VERSION: &str = "allocbox:policy/";
    let of_0_2_0 = |name: &str| name.starts_with(VERSION) && name.contains("@0.2.0");
    for payload in wasmparser::Parser::new(0).parse_all(module) {
        match payload {
            Ok(wasmparser::Payload::ImportSection(section)) => {
                for import in section.into_imports().flatten() {
                    if of_0_2_0(import.module) {
                        return true;
                    }
                }
            }
            Ok(wasmparser::Payload::ExportSection(section)) => {
                if section.into_iter().flatten().any(|e| of_0_2_0(e.name)) {
                    return true;
                }
            }
            Ok(_) => {}
            Err(_) => return false,
        }
    }
    false
}
