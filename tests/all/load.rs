//! Loading and starting: every kind of bad input is a clear, typed `LoadError`.

use allocbox::{Error, HandlerBuilder, LoadError, Runtime};

use super::support::*;

fn start(bytes: &[u8]) -> Result<allocbox::Handler, LoadError> {
    let policy = Runtime::shared().load(bytes)?;
    HandlerBuilder::new(Runtime::shared()).link(&policy).build()
}

fn start_broken(fault: &str) -> LoadError {
    let policy = load(&allocbox_artifacts::BROKEN);
    HandlerBuilder::new(Runtime::shared())
        .link_with(&policy, &[("fault", fault)])
        .build()
        .expect_err("start-up must fail")
}

#[test]
fn a_file_that_is_not_wasm_is_refused() {
    let err = start(b"\x89PNG\r\n\x1a\n not a policy").unwrap_err();
    assert!(matches!(err, LoadError::NotWasm { .. }), "{err}");
    let err = start(b"hello, I am plain text").unwrap_err();
    assert!(matches!(err, LoadError::NotWasm { .. }), "{err}");
}

#[test]
fn a_binary_core_module_of_the_world_becomes_a_policy_as_wat_does() {
    // What a C, Zig or AssemblyScript toolchain emits: a core module, in binary.
    let core = wat::parse_str(allocbox::DEFAULT_POLICY_WAT).unwrap();
    assert_eq!(&core[6..8], &[0, 0], "a core module, not a component");
    let h = start(&core).unwrap();
    let p = h.malloc(100).unwrap().unwrap();
    fill(p, 100, 0x42);
    assert!(holds(p, 100, 0x42));
    h.free(Some(p), 100).unwrap();
    h.leak_check().unwrap();
}

#[test]
fn a_binary_core_module_of_another_shape_is_refused_with_the_names_it_needs() {
    let core = wat::parse_str("(module (func (export \"f\")))").unwrap();
    let err = start(&core).unwrap_err();
    assert!(matches!(err, LoadError::Componentize { .. }), "{err}");
    assert!(err.to_string().contains("canonical-ABI names"), "{err}");
}

#[test]
fn a_component_of_another_world_is_refused() {
    let err = start(b"(component)").unwrap_err();
    assert!(matches!(err, LoadError::WrongWorld { .. }), "{err}");
    assert!(
        err.to_string().contains(
            "`allocbox:policy/allocator` and `allocbox:policy/lifecycle` at version 0.1.0 or 0.2.0"
        ),
        "{err}"
    );
}

#[test]
fn a_component_of_another_version_is_refused() {
    let wat = r#"(component
        (core module $m (func (export "f") (param i64) (result i64) local.get 0))
        (core instance $i (instantiate $m))
        (func $f (param "size" u64) (result u64) (canon lift (core func $i "f")))
        (instance $alloc (export "malloc" (func $f)))
        (export "allocbox:policy/allocator@0.3.0" (instance $alloc))
        (export "allocbox:policy/lifecycle@0.3.0" (instance $alloc)))"#;
    let err = start(wat.as_bytes()).unwrap_err();
    assert!(
        matches!(&err, LoadError::WrongVersion { found, .. } if found == "0.3.0"),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("this host speaks @0.1.0 and @0.2.0"),
        "{err}"
    );
}

#[test]
fn broken_wat_text_is_invalid_not_silently_accepted() {
    let err = start(b"(module (func (export \"x\") (i32.add)").unwrap_err();
    assert!(matches!(err, LoadError::Invalid { .. }), "{err}");
}

#[test]
fn a_wat_core_module_missing_exports_cannot_become_a_policy() {
    let err = start(b"(module (memory (export \"memory\") 1))").unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::WrongWorld { .. } | LoadError::Componentize { .. }
        ),
        "{err}"
    );
}

#[test]
fn a_trap_during_start_up_is_a_start_error_naming_the_trap() {
    let err = start_broken("trap-init");
    let LoadError::Start(inner) = &err else {
        panic!("{err}")
    };
    assert!(matches!(**inner, Error::Trap { .. }), "{err}");
    assert!(
        err.to_string().contains("trapping on purpose"),
        "guest output is shown: {err}"
    );
}

#[test]
fn bad_descriptions_are_refused() {
    assert!(matches!(
        start_broken("bad-name"),
        LoadError::BadName { len: 200 }
    ));
    assert!(matches!(
        start_broken("empty-name"),
        LoadError::BadName { len: 0 }
    ));
    assert!(matches!(
        start_broken("bad-version"),
        LoadError::BadVersion { version: 2, .. }
    ));
    assert!(matches!(
        start_broken("bad-alignment"),
        LoadError::BadAlignment { alignment: 24, .. }
    ));
}

#[test]
fn a_bad_configuration_is_refused_with_the_policy_s_reason() {
    let err = start_broken("no-such-fault");
    let LoadError::ConfigRejected { message, .. } = &err else {
        panic!("{err}")
    };
    assert!(message.contains("no-such-fault"), "{message}");

    let policy = load(&allocbox_artifacts::ALIGNED);
    let err = HandlerBuilder::new(Runtime::shared())
        .link_with(&policy, &[("alignment", "48")])
        .build()
        .unwrap_err();
    assert!(matches!(err, LoadError::ConfigRejected { .. }), "{err}");
    assert!(err.to_string().contains("48"), "{err}");
}

#[test]
fn an_empty_chain_is_refused() {
    let err = HandlerBuilder::new(Runtime::shared()).build().unwrap_err();
    assert!(matches!(err, LoadError::EmptyChain));
}

#[test]
fn a_missing_file_names_the_path() {
    let err = Runtime::shared()
        .load_file("/no/such/policy.wasm")
        .unwrap_err();
    assert!(err.to_string().contains("/no/such/policy.wasm"), "{err}");
}

#[test]
fn a_core_module_importing_wasi_preview1_gets_a_stub_that_grants_nothing() {
    // What Go's runtime (and wasi-libc's) needs at start-up: a clock that moves and never
    // reads 0, and writes that succeed. The passthrough, with `init` first checking what
    // the stub answers: any wrong answer is a trap, so a start-up error.
    let passthrough_with = |imports: &str, funcs: &str| {
        let wat = allocbox::DEFAULT_POLICY_WAT
            .replacen("(module", &format!("(module {imports}"), 1)
            .replacen(
                "(func (export \"allocbox:policy/lifecycle@0.1.0#init\")",
                "(func $passthrough_init",
                1,
            );
        let end = wat.rfind(')').unwrap();
        wat::parse_str(format!("{}{funcs}\n)", &wat[..end])).unwrap()
    };
    let imports = r#"
      (import "wasi_snapshot_preview1" "clock_time_get" (func $clock (param i32 i64 i32) (result i32)))
      (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "fd_prestat_get" (func $prestat (param i32 i32) (result i32)))"#;
    let init = r#"
      (func (export "allocbox:policy/lifecycle@0.1.0#init") (param i32 i32) (result i32)
        ;; two reads of the monotonic clock, at 2048 and 2056
        (if (call $clock (i32.const 1) (i64.const 0) (i32.const 2048)) (then unreachable))
        (if (call $clock (i32.const 1) (i64.const 0) (i32.const 2056)) (then unreachable))
        (if (i64.eqz (i64.load (i32.const 2048))) (then unreachable))
        (if (i64.le_u (i64.load (i32.const 2056)) (i64.load (i32.const 2048))) (then unreachable))
        ;; no real time: far below a second since the epoch, let alone today
        (if (i64.gt_u (i64.load (i32.const 2056)) (i64.const 1000000)) (then unreachable))
        ;; 11 bytes to stderr: all written (and dropped)
        (i32.store (i32.const 2064) (i32.const 64))
        (i32.store (i32.const 2068) (i32.const 11))
        (if (call $write (i32.const 2) (i32.const 2064) (i32.const 1) (i32.const 2072)) (then unreachable))
        (if (i32.ne (i32.load (i32.const 2072)) (i32.const 11)) (then unreachable))
        ;; no descriptors: BADF, which ends wasi-libc's scan for preopened directories
        (if (i32.ne (call $prestat (i32.const 3) (i32.const 2080)) (i32.const 8)) (then unreachable))
        (call $passthrough_init (local.get 0) (local.get 1)))"#;
    let h = start(&passthrough_with(imports, init)).unwrap();
    let p = h.malloc(64).unwrap().unwrap();
    h.free(Some(p), 64).unwrap();
    h.leak_check().unwrap();

    // A preview-1 name that does not exist is refused when the module is loaded.
    let imports =
        r#"(import "wasi_snapshot_preview1" "sock_open" (func (param i32) (result i32)))"#;
    let init = r#"
      (func (export "allocbox:policy/lifecycle@0.1.0#init") (param i32 i32) (result i32)
        (call $passthrough_init (local.get 0) (local.get 1)))"#;
    let err = start(&passthrough_with(imports, init)).unwrap_err();
    assert!(matches!(err, LoadError::Componentize { .. }), "{err}");
    assert!(err.to_string().contains("sock_open"), "{err}");
}

#[test]
fn a_policy_of_200_000_functions_is_refused_before_it_is_compiled_naming_the_bound() {
    let binary = wat::parse_str(with_functions(200_000)).unwrap();
    let err = Runtime::shared().load(&binary).unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::CompileBound {
                bound: allocbox::CompileBound::Functions,
                asked: 200_010,
                limit: 65_536,
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("`functions` compile bound"),
        "{err}"
    );
}

#[test]
fn compile_bounds_can_be_tightened_and_loosened_per_load() {
    let runtime = Runtime::shared();
    let wat = allocbox::DEFAULT_POLICY_WAT.as_bytes();
    let tight = allocbox::CompileBounds {
        functions: 5,
        ..allocbox::CompileBounds::default()
    };
    let err = runtime.load_bounded(wat, &tight).unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::CompileBound {
                asked: 10,
                limit: 5,
                ..
            }
        ),
        "{err}"
    );
    // The same bytes, compiled already, are still measured against the bounds given.
    runtime.load(wat).unwrap();
    assert!(runtime.load_bounded(wat, &tight).is_err());
    let text = allocbox::CompileBounds {
        text_bytes: 100,
        ..allocbox::CompileBounds::default()
    };
    let err = runtime.load_bounded(wat, &text).unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::CompileBound {
                bound: allocbox::CompileBound::TextBytes,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn the_command_line_names_the_file_and_the_bound_and_takes_a_looser_one() {
    let dir = tempdir("compile-bound");
    std::fs::write(dir.join("p.wat"), allocbox::DEFAULT_POLICY_WAT).unwrap();
    let (code, out) = allocbox_cli(
        &["inspect", "p.wat", "--compile-bound", "functions=5"],
        &dir,
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("`p.wat` cannot be loaded: the policy has 10 functions, more than the 5"),
        "{out}"
    );
    let (code, out) = allocbox_cli(
        &["inspect", "p.wat", "--compile-bound", "functions=10"],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    let (code, out) = allocbox_cli(&["inspect", "p.wat", "--compile-bound", "funcs=10"], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("no compile bound is called `funcs`"), "{out}");
}

/// Found while writing the module fuzzer: a policy loaded by one runtime, linked into a
/// handler built on another, failed at start with wasmtime's "cross-`Engine` usage";
/// the handler's runtime now compiles it again for itself.
#[test]
fn a_policy_loaded_by_another_runtime_is_adopted_by_the_handler_s() {
    let other = Runtime::without_disk_cache().unwrap();
    let policy = Runtime::shared()
        .load(allocbox::DEFAULT_POLICY_WAT.as_bytes())
        .unwrap();
    let h = HandlerBuilder::new(&other).link(&policy).build().unwrap();
    let p = h.malloc(10).unwrap().unwrap();
    h.free(Some(p), 10).unwrap();
}
