//! The WASI a policy sees: every function it can reach, answered without real time,
//! files, network or waiting (see `host/src/wasi.rs`).

use allocbox::{HandlerBuilder, LoadError, Runtime};

use super::support::*;

/// What the `sandbox-probe` fixture's `init` reports for `probe` (it answers `err`).
fn probe_init(probe: &str, arg: u64) -> String {
    let arg = arg.to_string();
    let err = HandlerBuilder::new(Runtime::shared())
        .link_with(
            &load(&allocbox_artifacts::SANDBOX_PROBE),
            &[("probe", probe), ("arg", &arg)],
        )
        .build()
        .unwrap_err();
    match err {
        // The SDK prefixes a policy's `err` with its name; the host escapes its line
        // breaks, as it escapes every control character a policy supplies.
        LoadError::ConfigRejected { message, .. } => message
            .strip_prefix("sandbox-probe: ")
            .unwrap_or(&message)
            .replace("\\n", "\n"),
        other => panic!("{other}"),
    }
}

#[test]
fn every_wasi_function_a_policy_can_reach_answers_without_the_real_world() {
    let seen = probe_init("every-wasi", 0);
    let answers: std::collections::HashMap<&str, &str> =
        seen.lines().filter_map(|l| l.split_once('=')).collect();
    let expected = [
        // Virtual time: 1 ns a read; a wait jumps to its deadline at once.
        ("monotonic-clock.now", "step 1"),
        ("monotonic-clock.resolution", "1"),
        ("monotonic-clock.subscribe-duration+block", "advanced 3600s"),
        ("pollable.ready", "true"),
        ("monotonic-clock.subscribe-instant+ready", "true"),
        ("poll.poll", "[0, 1]"),
        ("wall-clock.now", "3605s"),
        ("wall-clock.resolution", "0s 1ns"),
        // A fixed random stream.
        ("random.get-random-bytes", "[13, 117, 145, 204]"),
        ("insecure-seed.insecure-seed", "(7020105144828325752, 0)"),
        // Nothing from the command line.
        ("environment.get-environment", "[]"),
        ("environment.get-arguments", "[]"),
        ("environment.initial-cwd", "None"),
        ("terminal-stdin.get-terminal-stdin", "false"),
        ("terminal-stdout.get-terminal-stdout", "false"),
        ("terminal-stderr.get-terminal-stderr", "false"),
        // Empty stdin; output always accepted.
        ("input-stream.read", "Err(StreamError::Closed)"),
        ("input-stream.blocking-read", "Err(StreamError::Closed)"),
        ("input-stream.skip", "Err(StreamError::Closed)"),
        ("input-stream.blocking-skip", "Err(StreamError::Closed)"),
        ("input-stream.subscribe+block", "returned"),
        ("output-stream.check-write", "Ok(65536)"),
        ("output-stream.write", "Ok(())"),
        ("output-stream.blocking-write-and-flush", "Ok(())"),
        ("output-stream.flush", "Ok(())"),
        ("output-stream.blocking-flush", "Ok(())"),
        ("output-stream.write-zeroes", "Ok(())"),
        ("output-stream.blocking-write-zeroes-and-flush", "Ok(())"),
        ("output-stream.splice", "Err(StreamError::Closed)"),
        ("output-stream.blocking-splice", "Err(StreamError::Closed)"),
        ("output-stream.subscribe+block", "returned"),
        ("stderr.blocking-write-and-flush", "Ok(())"),
        // No file system, no network.
        ("preopens.get-directories", "0"),
    ];
    for (name, answer) in expected {
        assert_eq!(answers.get(name), Some(&answer), "{name} in:\n{seen}");
    }
    for name in [
        "random.get-random-u64",
        "insecure.get-insecure-random-bytes",
        "insecure.get-insecure-random-u64",
    ] {
        assert!(answers.contains_key(name), "{name} in:\n{seen}");
    }
    for (name, code) in [
        ("tcp-create-socket.create-tcp-socket", "access-denied"),
        ("udp-create-socket.create-udp-socket", "access-denied"),
        (
            "ip-name-lookup.resolve-addresses",
            "permanent-resolver-failure",
        ),
    ] {
        assert!(answers[name].contains(code), "{name} in:\n{seen}");
    }
    assert_eq!(
        probe_init("every-wasi", 0),
        seen,
        "every instance sees the same virtual world"
    );
}

#[test]
fn timers_of_100_and_300_ms_fire_after_the_same_number_of_polls() {
    let loops = |ms| {
        let seen = probe_init("timer-count", ms);
        let (loops, elapsed) = seen.split_once(' ').expect("loops=N elapsed-ns=T");
        let elapsed: u64 = elapsed.trim_start_matches("elapsed-ns=").parse().unwrap();
        assert!(
            elapsed >= ms * 1_000_000,
            "virtual time moved to the deadline: {seen}"
        );
        loops.to_string()
    };
    assert_eq!(loops(100), loops(300));
    assert_eq!(loops(100), "loops=0");
}

fn probing(probe: &str, arg: u64) -> allocbox::Handler {
    let arg = arg.to_string();
    HandlerBuilder::new(Runtime::shared())
        .link_with(
            &load(&allocbox_artifacts::SANDBOX_PROBE),
            &[("probe", probe), ("arg", &arg)],
        )
        .build()
        .unwrap()
}

#[test]
fn a_policy_that_sleeps_an_hour_in_malloc_is_answered_at_once_in_virtual_time() {
    for probe in ["sleep", "poll-sleep"] {
        let h = probing(probe, 3600);
        let p = h
            .malloc(64)
            .unwrap()
            .expect("served after the virtual hour");
        h.free(Some(p), 64).unwrap();
    }
}

#[test]
fn a_policy_that_spins_until_its_clock_moves_is_stopped_at_its_time_limit() {
    let h = HandlerBuilder::new(Runtime::shared())
        .link_with(
            &load(&allocbox_artifacts::SANDBOX_PROBE),
            &[("probe", "spin"), ("arg", "100")],
        )
        .limits(allocbox::Limits {
            call_time: std::time::Duration::from_millis(50),
            ..allocbox::Limits::default()
        })
        .build()
        .unwrap();
    let err = h.malloc(64).unwrap_err();
    assert!(
        matches!(&err, allocbox::Error::Timeout { policy, .. } if &**policy == "sandbox-probe"),
        "{err}"
    );
}

/// A policy whose name sets the terminal's title and clears its screen.
fn policy_named_with_escapes() -> String {
    passthrough_variant(
        "(data (i32.const 64) \"passthrough\")",
        "(data (i32.const 64) \"\\1b]0;owned\\07\\1b[2J\\1b[31mevil\")",
    )
    .replace(
        "(i32.store (i32.const 12) (i32.const 11))",
        "(i32.store (i32.const 12) (i32.const 23))",
    )
}

#[test]
fn control_characters_in_a_policy_s_name_are_escaped_wherever_it_is_shown() {
    let wat = policy_named_with_escapes();
    let policy = Runtime::shared().load(wat.as_bytes()).unwrap();
    let h = HandlerBuilder::new(Runtime::shared())
        .link(&policy)
        .build()
        .unwrap();
    assert_eq!(h.name(), "\\u{1b}]0;owned\\u{7}\\u{1b}[2J\\u{1b}[31mevil");
    assert_eq!(h.link_stats().unwrap()[0].name, h.name());

    let dir = tempdir("escaped-name");
    let file = dir.join("evil.wat");
    std::fs::write(&file, &wat).unwrap();
    for args in [
        vec!["check", "evil.wat", "--rounds", "1", "--cases", "4"],
        vec!["inspect", "evil.wat"],
    ] {
        let (_, out) = allocbox_cli(&args, &dir);
        assert!(out.contains("evil"), "{args:?}: {out}");
        assert!(
            !out.contains('\u{1b}') && !out.contains('\u{7}'),
            "{args:?} printed raw control characters: {out:?}"
        );
    }
}

/// The `passthrough` policy as a component that also imports `interface` (an interface
/// of a package declared here) and calls nothing from it.
fn passthrough_importing(package: &str, interface: &str) -> Vec<u8> {
    let mut resolve = wit_parser::Resolve::default();
    let policy = resolve
        .push_str("policy.wit", allocbox::POLICY_WIT)
        .unwrap();
    resolve
        .push_str(
            "extra.wit",
            &format!("package {package}; interface {interface} {{ ping: func(); }}"),
        )
        .unwrap();
    let (name, version) = package.split_once('@').unwrap();
    let world = format!(
        "package test:extra; world extra {{ include allocbox:policy/policy@0.1.0; \
         import {name}/{interface}@{version}; }}"
    );
    let extra = resolve.push_str("world.wit", &world).unwrap();
    let _ = policy;
    let world = resolve.select_world(&[extra], Some("extra")).unwrap();
    let import = format!(
        "(import \"{name}/{interface}@{version}\" \"ping\" (func))\n  \
         (import \"allocbox:policy/allocator@0.1.0\" \"malloc\""
    );
    let wat = allocbox::DEFAULT_POLICY_WAT.replacen(
        "(import \"allocbox:policy/allocator@0.1.0\" \"malloc\"",
        &import,
        1,
    );
    let mut module = wat::parse_str(&wat).unwrap();
    wit_component::embed_component_metadata(
        &mut module,
        &resolve,
        world,
        wit_component::StringEncoding::UTF8,
        false,
    )
    .unwrap();
    wit_component::ComponentEncoder::default()
        .module(&module)
        .unwrap()
        .validate(true)
        .encode()
        .unwrap()
}

#[test]
fn a_component_importing_an_interface_the_sandbox_does_not_serve_is_refused_naming_it() {
    for (package, interface) in [
        ("wasi:keyvalue@0.2.0", "store"),
        ("wasi:http@0.2.0", "outgoing-handler"),
        ("wasi:clocks@0.3.0", "monotonic-clock"),
        ("example:anything@1.0.0", "thing"),
    ] {
        let component = passthrough_importing(package, interface);
        let err = Runtime::shared().load(&component).unwrap_err();
        let (name, version) = package.split_once('@').unwrap();
        let import = format!("{name}/{interface}@{version}");
        assert!(
            matches!(&err, LoadError::Import { import: i } if *i == import),
            "{import}: {err}"
        );
        assert!(err.to_string().contains(&import), "{err}");
    }
    // The same policy without the import loads.
    Runtime::shared()
        .load(allocbox::DEFAULT_POLICY_WAT.as_bytes())
        .unwrap();
}

#[test]
fn a_policy_that_takes_wasi_handles_without_dropping_them_passes_a_typed_bound() {
    let h = probing("streams", 0);
    let err = h.malloc(64).unwrap_err();
    assert!(
        matches!(
            err,
            allocbox::Error::WorkLimit {
                bound: allocbox::Bound::Resources,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_policy_that_calls_exit_is_a_trap_that_says_so() {
    let err = probing("exit", 0).malloc(64).unwrap_err();
    assert_eq!(
        err.to_string(),
        "policy `sandbox-probe` trapped in `malloc`: it called `exit` with status 1"
    );
}

#[test]
fn what_a_failing_policy_printed_last_is_in_its_error_in_order_and_bounded() {
    // A megabyte of output, then a panic: the error shows the last lines, in the order
    // printed, and the host kept only the last `Limits::output` bytes of it.
    let err = probing("print", 1 << 20).malloc(64).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("its last output: probe printed | thread '<unnamed>' (1) panicked at")
            && message.ends_with("| probe panics)"),
        "{message}"
    );
    assert!(message.len() < 1024, "{} bytes: {message}", message.len());
}

#[test]
fn a_lower_link_that_sleeps_an_hour_is_answered_at_once_in_virtual_time() {
    let h = HandlerBuilder::new(Runtime::shared())
        .link(&load(&allocbox_artifacts::SYSTEM))
        .link_with(
            &load(&allocbox_artifacts::SANDBOX_PROBE),
            &[("probe", "sleep"), ("arg", "3600")],
        )
        .build()
        .unwrap();
    let p = h
        .malloc(64)
        .unwrap()
        .expect("served after the virtual hour");
    h.free(Some(p), 64).unwrap();
    assert!(h.failure().is_none());
}

#[test]
fn what_a_core_module_policy_prints_through_preview1_is_in_its_error() {
    // A core module (as Go, C or Zig toolchains emit) writes through WASI preview 1,
    // served by the host's stub, then traps: its words reach the error, as a Go panic's
    // would.
    let wat = passthrough_variant(
        "(memory (export \"memory\") 1)",
        "(import \"wasi_snapshot_preview1\" \"fd_write\"
           (func $fd_write (param i32 i32 i32 i32) (result i32)))
         (memory (export \"memory\") 1)
         (data (i32.const 2048) \"panic: out of ideas\\n\")",
    )
    .replace(
        "(call $count (call $up_malloc (local.get $size))))",
        "(i32.store (i32.const 2100) (i32.const 2048))
         (i32.store (i32.const 2104) (i32.const 20))
         (drop (call $fd_write (i32.const 2) (i32.const 2100) (i32.const 1) (i32.const 2108)))
         unreachable)",
    )
    .replace(
        "(i32.store8 (i32.const 32) (i32.const 1))",
        "(i32.store8 (i32.const 32) (i32.const 0))",
    );
    let policy = Runtime::shared().load(wat.as_bytes()).unwrap();
    let h = HandlerBuilder::new(Runtime::shared())
        .link(&policy)
        .build()
        .unwrap();
    let err = h.malloc(8).unwrap_err();
    assert!(
        err.to_string()
            .ends_with("(its last output: panic: out of ideas)"),
        "{err}"
    );
}
