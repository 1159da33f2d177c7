//! The counted clock ([`Runtime::counted`]): a checked run limits each call into a
//! policy by the work it does (wasm fuel, and the host's work in its imports by what it
//! moves), not by the time it takes, so the same call passes or fails on a quiet machine
//! and a busy one. Every test here gives the wall clock a limit no machine reaches: its
//! outcome is decided by counts alone.

use std::sync::OnceLock;
use std::time::Duration;

use allocbox::{Call, Error, HandlerBuilder, Limits, LoadError, Runtime, TimeLimit};
use allocbox_artifacts::hostile::passthrough_variant;

use super::support::*;

/// The wall clock's limit in these tests: a safety net no call here comes near.
const SAFETY_NET: Duration = Duration::from_secs(600);

fn counted() -> &'static Runtime {
    static COUNTED: OnceLock<Runtime> = OnceLock::new();
    COUNTED.get_or_init(|| Runtime::counted().unwrap())
}

fn work(units: u64) -> Limits {
    Limits {
        call_time: SAFETY_NET,
        call_work: units,
        ..Limits::default()
    }
}

#[test]
fn an_endless_loop_stops_at_its_counted_limit() {
    let h = HandlerBuilder::new(counted())
        .link_with(
            &load(&allocbox_artifacts::BROKEN),
            &[("fault", "loop-malloc")],
        )
        .limits(work(1_000_000))
        .build()
        .unwrap();
    let keep = h.malloc(64).unwrap().unwrap();
    fill(keep, 64, 9);
    let err = h.malloc(13).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Timeout {
                call: Call::Malloc,
                limit: TimeLimit::Work(1_000_000),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("--call-work"), "{err}");
    assert!(holds(keep, 64, 9));
    h.free(Some(keep), 64).unwrap();
}

/// `passthrough`, asked on every call (not batching), its `malloc` running a loop of
/// `n` turns before it asks upstream.
fn looping(n: u32) -> String {
    let passthrough_malloc =
        "(func (export \"allocbox:policy/allocator@0.1.0#malloc\") (param $size i64) (result i64)
    (call $count (call $up_malloc (local.get $size))))";
    let looping_malloc = format!(
        r#"(func (export "allocbox:policy/allocator@0.1.0#malloc") (param $size i64) (result i64)
    (local $i i32)
    (local.set $i (i32.const {n}))
    (block $done
      (loop $again
        (br_if $done (i32.eqz (local.get $i)))
        (local.set $i (i32.sub (local.get $i) (i32.const 1)))
        (br $again)))
    (call $count (call $up_malloc (local.get $size))))"#
    );
    passthrough_variant(
        "(i32.store8 (i32.const 32) (i32.const 1))",
        "(i32.store8 (i32.const 32) (i32.const 0))",
    )
    .replace(passthrough_malloc, &looping_malloc)
}

/// The same call passes under a limit above its work and fails under one below it,
/// every time: the limit is the work's, not the machine's.
#[test]
fn a_call_passes_or_stops_by_its_counted_work_alone() {
    // 10,000 turns of a loop of a handful of instructions each: some 60,000 units.
    let policy = counted().load(looping(10_000).as_bytes()).unwrap();
    for _ in 0..3 {
        for (units, passes) in [(10_000, false), (1_000_000, true)] {
            let h = HandlerBuilder::new(counted())
                .link(&policy)
                .limits(work(units))
                .build()
                .unwrap();
            match h.malloc(64) {
                Ok(Some(p)) if passes => h.free(Some(p), 64).unwrap(),
                Err(Error::Timeout {
                    limit: TimeLimit::Work(limit),
                    ..
                }) if !passes => assert_eq!(limit, units),
                other => panic!("under {units} units: {other:?}"),
            }
        }
    }
}

#[test]
fn every_bytes_import_at_its_largest_stops_at_the_counted_limit() {
    // As `limits.rs`'s test of the time limit: a GiB block worked on until the call is
    // stopped; here the host's work in the imports is counted by the bytes it moves.
    for (probe, mib) in [
        ("copy-up", 0),
        ("copy-down", 0),
        ("fill", 0),
        ("read", 48),
        ("write", 48),
    ] {
        let h = HandlerBuilder::new(counted())
            .link_with(
                &load(&allocbox_artifacts::SANDBOX_PROBE),
                &[("probe", probe), ("arg", &mib.to_string())],
            )
            .limits(work(20_000_000))
            .build()
            .unwrap();
        let err = h.malloc(1 << 30).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::Timeout { policy, limit: TimeLimit::Work(20_000_000), .. }
                    if &**policy == "sandbox-probe"
            ),
            "{probe}: {err}"
        );
        assert_eq!(h.held_from_host().unwrap(), (0, 0), "{probe}");
    }
}

/// The host's copy of the client's block in a resize is the client's work: a policy
/// that only writes a footer passes under a limit a thousandth of the copy's bytes.
#[test]
fn a_client_s_large_resize_costs_an_honest_policy_no_counted_work() {
    let resizing = load(&allocbox_artifacts::SANDBOX_PROBE);
    for below in [None, Some(load(&allocbox_artifacts::SYSTEM))] {
        let mut builder = HandlerBuilder::new(counted())
            .limits(work(100_000))
            .link_with(&resizing, &[("probe", "resize-then-write")]);
        if let Some(below) = &below {
            builder = builder.link(below);
        }
        let h = builder.build().unwrap();
        let size = 256 << 20;
        let p = h.malloc(size).unwrap().unwrap();
        fill(p, size, 0x42);
        let q = h.realloc(Some(p), 2 * size).unwrap().expect("resized");
        assert!(holds(q, size, 0x42));
        h.free(Some(q), 2 * size).unwrap();
        assert!(h.failure().is_none());
    }
}

#[test]
fn a_start_function_that_loops_stops_at_the_counted_limit() {
    let wat = passthrough_variant(
        "(memory (export \"memory\") 1)",
        "(memory (export \"memory\") 1)
         (func $forever (loop $again (br $again)))
         (start $forever)",
    );
    let policy = counted().load(wat.as_bytes()).unwrap();
    let err = HandlerBuilder::new(counted())
        .link(&policy)
        .limits(work(1_000_000))
        .build()
        .unwrap_err();
    let LoadError::Start(err) = err else {
        panic!("{err}")
    };
    assert!(
        matches!(
            *err,
            Error::Timeout {
                call: Call::Init,
                limit: TimeLimit::Work(1_000_000),
                ..
            }
        ),
        "{err}"
    );
}

/// Issue 73: a check's verdict, shrunk script and operation count are its seed's on any
/// machine. Twice from one seed: a policy that loops in its `malloc` (a timeout, whose
/// script replays to the same rule) and one that holds every rule.
#[test]
fn the_same_seed_checks_to_the_same_verdict_script_and_operation_count() {
    use allocbox_check::{CheckOptions, check, replay};
    let options = CheckOptions {
        seed: Some(7),
        cases: 16,
        rounds: Some(2),
        limits: Limits {
            memory: 32 << 20,
            ..work(2_000_000)
        },
        ..CheckOptions::default()
    };
    let broken = load(&allocbox_artifacts::BROKEN);
    let config = [("fault", "loop-malloc")];
    let runs: Vec<_> = (0..2)
        .map(|_| check(Runtime::shared(), &broken, &config, &options).unwrap())
        .collect();
    let (finding, script) = runs[0].failure.clone().expect("the loop is found");
    assert_eq!(finding.rule, "timeout", "{finding}");
    let (again, again_script) = runs[1].failure.clone().unwrap();
    assert_eq!(again.message, finding.message);
    assert_eq!(again_script.to_string(), script.to_string());
    assert_eq!((runs[0].ops, runs[0].cases), (runs[1].ops, runs[1].cases));
    let replayed = replay(
        Runtime::shared(),
        &broken,
        &config,
        &script,
        &options.limits,
    )
    .unwrap()
    .expect("the script fails again");
    assert_eq!(replayed.rule, "timeout", "{replayed}");

    let sound = load(&allocbox_artifacts::SIZE_CLASSES);
    let runs: Vec<_> = (0..2)
        .map(|_| check(Runtime::shared(), &sound, &[], &options).unwrap())
        .collect();
    assert!(runs[0].passed() && runs[1].passed());
    assert_eq!((runs[0].ops, runs[0].cases), (runs[1].ops, runs[1].cases));
    assert_eq!(runs[0].rounds, 2);
}
