//! Sandbox limits: time, the guest's own memory, and many threads at once.

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use allocbox::{Call, Error, HandlerBuilder, Limits, Runtime};

use super::support::*;

#[test]
fn an_endless_loop_is_a_timeout() {
    let h = HandlerBuilder::new(Runtime::shared())
        .link_with(
            &load(&allocbox_artifacts::BROKEN),
            &[("fault", "loop-malloc")],
        )
        .limits(Limits {
            call_time: Duration::from_millis(100),
            ..Limits::default()
        })
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
                ..
            }
        ),
        "{err}"
    );
    assert!(holds(keep, 64, 9));
    h.free(Some(keep), 64).unwrap();
}

#[test]
fn a_guest_growing_its_memory_without_bound_hits_the_cap() {
    let h = HandlerBuilder::new(Runtime::shared())
        .link_with(
            &load(&allocbox_artifacts::BROKEN),
            &[("fault", "grow-memory")],
        )
        .limits(Limits {
            memory: 16 << 20,
            ..Limits::default()
        })
        .build()
        .unwrap();
    let err = h.malloc(64).unwrap_err();
    assert!(
        matches!(err, Error::MemoryLimit { limit, .. } if limit == 16 << 20),
        "{err}"
    );
}

#[test]
fn a_fallback_handler_takes_new_requests_after_a_failure() {
    let fallback = Arc::new(handler(&allocbox_artifacts::SYSTEM, &[]));
    let h = HandlerBuilder::new(Runtime::shared())
        .link_with(
            &load(&allocbox_artifacts::BROKEN),
            &[("fault", "trap-realloc")],
        )
        .fallback(fallback.clone())
        .build()
        .unwrap();
    let p = h.malloc(100).unwrap().unwrap();
    fill(p, 100, 3);
    assert!(
        h.realloc(Some(p), 200).is_err(),
        "the failing call reports the trap"
    );
    let q = h.realloc(Some(p), 200).unwrap().unwrap();
    assert!(holds(q, 100, 3), "moved into the fallback with its bytes");
    let r = h.malloc(10).unwrap();
    assert!(r.is_some());
    assert_eq!(fallback.stats().unwrap().live_blocks, 2);
    h.free(Some(q), 200).unwrap();
    h.free(r, 10).unwrap();
    assert_eq!(fallback.stats().unwrap().live_blocks, 0);
    assert_eq!(h.held_from_host().unwrap(), (0, 0));
}

#[test]
fn a_handler_is_shared_by_many_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<allocbox::Handler>();
    let h = Arc::new(handler(&allocbox_artifacts::SIZE_CLASSES, &[]));
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let h = h.clone();
            std::thread::spawn(move || {
                for i in 0..2000usize {
                    let size = 1 + (i * 37 + t as usize) % 3000;
                    let p = h.malloc(size).unwrap().unwrap();
                    fill(p, size, t);
                    let q = h.realloc(Some(p), size + 100).unwrap().unwrap();
                    assert!(holds(q, size, t));
                    h.free(Some(q), size + 100).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(h.stats().unwrap().live_blocks, 0);
    h.trim().unwrap();
    assert_eq!(h.held_from_host().unwrap(), (0, 0));
}

fn probe(grants: allocbox::Grants) -> String {
    let err = HandlerBuilder::new(Runtime::shared())
        .link_with(
            &load(&allocbox_artifacts::BROKEN),
            &[("fault", "probe-sandbox")],
        )
        .limits(Limits {
            grants,
            ..Limits::default()
        })
        .build()
        .unwrap_err();
    match err {
        allocbox::LoadError::ConfigRejected { message, .. } => message,
        other => panic!("{other}"),
    }
}

#[test]
fn the_sandbox_grants_no_environment_and_virtual_clocks_by_default() {
    // Virtual time moves 1 ns a read, so the wall clock still reads 1970 + 0 s.
    let seen = probe(allocbox::Grants::default());
    assert_eq!(seen, "probe: env=[] monotonic=moving wall=0");
}

#[test]
fn an_embedder_can_grant_clocks_and_environment_variables() {
    let seen = probe(allocbox::Grants {
        clocks: true,
        env: vec![("POLICY_MODE".into(), "fast".into())],
        ..allocbox::Grants::default()
    });
    assert!(
        seen.starts_with("probe: env=[POLICY_MODE=fast] monotonic=moving wall="),
        "{seen}"
    );
    assert!(!seen.ends_with("wall=0"), "{seen}");
}

fn start(wat: &str, limits: Limits) -> Result<allocbox::Handler, allocbox::LoadError> {
    let policy = Runtime::shared().load(wat.as_bytes())?;
    HandlerBuilder::new(Runtime::shared())
        .link(&policy)
        .limits(limits)
        .build()
}

#[test]
fn tables_count_against_the_policy_s_memory_budget() {
    // Six tables of 2^20 entries take 48 MiB of host memory: past a 16 MiB budget.
    let limits = Limits {
        memory: 16 << 20,
        ..Limits::default()
    };
    let err = start(&with_tables(6, 1 << 20), limits.clone()).unwrap_err();
    let allocbox::LoadError::Start(err) = err else {
        panic!("{err}")
    };
    assert!(
        matches!(*err, Error::MemoryLimit { limit, .. } if limit == 16 << 20),
        "{err}"
    );
    // One table of 2^20 entries (8 MiB) fits.
    start(&with_tables(1, 1 << 20), limits).unwrap();
}

#[test]
fn a_policy_creating_more_tables_than_allowed_passes_a_typed_object_bound() {
    let err = start(&with_tables(100, 1), Limits::default()).unwrap_err();
    let allocbox::LoadError::Start(err) = err else {
        panic!("{err}")
    };
    assert!(
        matches!(
            *err,
            Error::WorkLimit {
                bound: allocbox::Bound::Objects,
                limit: 8,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_core_module_with_a_second_memory_is_refused_at_load() {
    let wat = passthrough_variant(
        "(memory (export \"memory\") 1)",
        "(memory (export \"memory\") 1)\n(memory 2000)",
    );
    let err = Runtime::shared().load(wat.as_bytes()).unwrap_err();
    assert!(
        matches!(err, allocbox::LoadError::Invalid { .. })
            && err.to_string().contains("multiple memories"),
        "{err}"
    );
}

#[test]
fn a_policy_s_memories_and_tables_together_stay_under_its_budget_in_resident_memory() {
    let dir = tempdir("hog-rss");
    std::fs::write(dir.join("one.script"), "b0 = malloc 64\n").unwrap();
    std::fs::write(dir.join("hog.wat"), memory_and_table_hog()).unwrap();
    // A call limit far past any delay of a busy machine: memory is what stops the hog.
    let slack = ["--call-time-ms", "60000"];
    let (code, out, baseline) =
        allocbox_cli_peak_rss(&["replay", "one.script", slack[0], slack[1]], &dir);
    assert_eq!(code, 0, "{out}");
    let (code, out, hog) = allocbox_cli_peak_rss(
        &["replay", "one.script", "hog.wat", slack[0], slack[1]],
        &dir,
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("passed its memory budget of 134217728 bytes"),
        "{out}"
    );
    // The budget (128 MiB) plus what wasmtime keeps beside a memory and a table.
    let allowed_kib = (128 << 10) + (16 << 10);
    assert!(
        hog.saturating_sub(baseline) <= allowed_kib,
        "the hostile policy took {} KiB over the {} KiB of a plain run",
        hog.saturating_sub(baseline),
        baseline
    );
}

/// A hook component with `hogs` core instances besides its own, each with a memory of
/// 1000 pages (62.5 MiB) that its start function touches, page by page.
fn hook_with_memory_hogs(hogs: usize) -> String {
    let instances = "(core instance (instantiate $hog))\n".repeat(hogs);
    format!(
        r#"(component
  (core module $hog
    (memory 1000)
    (func $touch (memory.fill (i32.const 0) (i32.const 1) (i32.const 65536000)))
    (start $touch))
  {instances}
  (core module $m
    (memory (export "memory") 1)
    (func (export "on-event") (param i64 i64 i64))
    (func (export "report") (result i32)
      (i32.store (i32.const 8) (i32.const 0))
      (i32.store (i32.const 12) (i32.const 0))
      (i32.const 8)))
  (core instance $i (instantiate $m))
  (func $on (param "old" u64) (param "new" u64) (param "size" u64)
    (canon lift (core func $i "on-event")))
  (func $report (result (list u64)) (canon lift (core func $i "report") (memory (core memory $i "memory"))))
  (instance $events (export "on-event" (func $on)) (export "report" (func $report)))
  (export "allocbox:policy/events@0.1.0" (instance $events)))"#
    )
}

#[test]
fn the_memory_budget_covers_every_memory_of_every_instance_a_component_creates() {
    let runtime = Runtime::shared();
    // Two memories of 62.5 MiB and the hook's own page fit in 128 MiB.
    let hook = allocbox::WasmHook::start(
        runtime,
        hook_with_memory_hogs(2).as_bytes(),
        "two-hogs",
        Limits::default(),
    )
    .unwrap();
    assert_eq!(hook.report().unwrap(), Vec::<u64>::new());
    // A third does not: the component is refused, not run at 190 MiB.
    let err = allocbox::WasmHook::start(
        runtime,
        hook_with_memory_hogs(3).as_bytes(),
        "three-hogs",
        Limits::default(),
    )
    .unwrap_err();
    let allocbox::LoadError::Start(err) = err else {
        panic!("{err}")
    };
    assert!(
        matches!(&*err, Error::Hook { cause, .. } if matches!(**cause, Error::MemoryLimit { .. })),
        "{err}"
    );
}

#[test]
fn every_bytes_import_at_its_largest_is_stopped_by_the_call_s_time_limit() {
    // A GiB block, worked on until the call is stopped: overlapping copies both ways
    // (one move of the whole block, before the host copied in chunks), fills, and
    // reads and writes as large as the guest's memory allows.
    for (probe, mib) in [
        ("copy-up", 0),
        ("copy-down", 0),
        ("fill", 0),
        ("read", 48),
        ("write", 48),
    ] {
        let h = HandlerBuilder::new(Runtime::shared())
            .link_with(
                &load(&allocbox_artifacts::SANDBOX_PROBE),
                &[("probe", probe), ("arg", &mib.to_string())],
            )
            .limits(Limits {
                call_time: Duration::from_millis(20),
                ..Limits::default()
            })
            .build()
            .unwrap();
        let err = h.malloc(1 << 30).unwrap_err();
        assert!(
            matches!(&err, Error::Timeout { policy, .. } if &**policy == "sandbox-probe"),
            "{probe}: {err}"
        );
        assert_eq!(
            h.held_from_host().unwrap(),
            (0, 0),
            "{probe}: the stopped policy held on"
        );
    }
}

#[test]
fn a_client_s_large_resize_does_not_count_against_an_honest_policy_s_time() {
    // Resizing the client's block makes the host copy it (the original stays intact
    // until the policy's answer is checked): work whose size the client chose, given
    // back to the policy's time. Over a 256 MiB block that takes several times the
    // 100 ms limit here (about 0.5 s); the policy then writes a footer (the host checks
    // the time there), alone and over another link. What the policy itself does in the
    // call takes microseconds, far inside the limit even on a loaded machine.
    let resizing = load(&allocbox_artifacts::SANDBOX_PROBE);
    for below in [None, Some(load(&allocbox_artifacts::SYSTEM))] {
        let mut builder = HandlerBuilder::new(Runtime::shared())
            .limits(Limits {
                call_time: Duration::from_millis(100),
                ..Limits::default()
            })
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
        assert!(holds(
            NonNull::new(q.as_ptr().wrapping_add(2 * size - 8)).unwrap(),
            8,
            0x5a
        ));
        h.free(Some(q), 2 * size).unwrap();
        assert!(h.failure().is_none());
    }
}

/// Found by the module fuzzer (`smith`, its first module): a start function that loops,
/// run while the policy is instantiated, before any call armed a deadline, was never
/// stopped once the epoch consulted the sandbox's deadline.
#[test]
fn a_policy_whose_start_function_loops_is_stopped_at_start() {
    let wat = passthrough_variant(
        "(memory (export \"memory\") 1)",
        "(memory (export \"memory\") 1)
         (func $forever (loop $again (br $again)))
         (start $forever)",
    );
    let err = start(
        &wat,
        Limits {
            call_time: Duration::from_millis(50),
            ..Limits::default()
        },
    )
    .unwrap_err();
    let allocbox::LoadError::Start(err) = err else {
        panic!("{err}")
    };
    assert!(
        matches!(
            *err,
            Error::Timeout {
                call: Call::Init,
                ..
            }
        ),
        "{err}"
    );
}

/// `memory.grow` past the memory budget answers -1, as the core specification allows
/// (and the 0.2.0 WIT says): a policy that checks it answers "none" and goes on.
#[test]
fn a_growth_past_the_memory_budget_answers_minus_one_and_the_policy_recovers() {
    let malloc = r#"(func (export "allocbox:policy/allocator@0.1.0#malloc") (param $size i64) (result i64)
    (call $count (call $up_malloc (local.get $size))))"#;
    assert!(allocbox::DEFAULT_POLICY_WAT.contains(malloc));
    // A malloc that first asks for 256 MiB more of its own memory, and answers none
    // when it is refused.
    let growing = r#"(func (export "allocbox:policy/allocator@0.1.0#malloc") (param $size i64) (result i64)
    (if (i32.eq (memory.grow (i32.const 4096)) (i32.const -1))
      (then (return (i64.const 0))))
    (call $count (call $up_malloc (local.get $size))))"#;
    let wat = allocbox::DEFAULT_POLICY_WAT.replace(malloc, growing);
    let policy = Runtime::shared().load(wat.as_bytes()).unwrap();
    let h = HandlerBuilder::new(Runtime::shared())
        .link_with(&policy, &[])
        .limits(Limits {
            memory: 16 << 20,
            ..Limits::default()
        })
        .build()
        .unwrap();
    // Past the magazines' sizes: the policy's own malloc is asked.
    assert_eq!(
        h.malloc(100_000).unwrap(),
        None,
        "out of memory, not stopped"
    );
    assert_eq!(h.malloc(100_000).unwrap(), None);
    assert!(h.failure().is_none());
    // The other calls still work.
    let p = h.calloc(8, 8).unwrap().expect("calloc does not grow");
    h.free(Some(p), 64).unwrap();
}

/// The `quota` fixture observing with a batch of one event, spending `dawdle_ms` of its
/// granted clock in every call, under a 200 ms limit.
fn dawdling_observer(dawdle_ms: u64) -> allocbox::Handler {
    let dawdle = dawdle_ms.to_string();
    HandlerBuilder::new(Runtime::shared())
        .link_with(
            &load(&allocbox_artifacts::QUOTA),
            &[("observe", "true"), ("batch", "1"), ("dawdle-ms", &dawdle)],
        )
        .limits(Limits {
            call_time: Duration::from_millis(200),
            grants: allocbox::Grants {
                clocks: true,
                ..Default::default()
            },
            ..Limits::default()
        })
        .build()
        .unwrap()
}

/// Found probing 0.2.0: each guest call one client call caused (a magazine refill, the
/// delivery of the events it completed, a renewal) started a deadline of its own, so a
/// policy spending most of the limit in each made one client call last several limits.
/// Here one `malloc` causes a `malloc-many` and an `observe` of 190 ms each under a
/// 200 ms limit: the second runs out of the call's time, and the policy is named. (Each
/// alone fits the limit; together they pass it by nearly twice, so a loaded machine
/// whose clock thread ticks late still reaches the deadline.)
#[test]
fn one_client_call_has_one_deadline_through_every_guest_call_it_causes() {
    let h = dawdling_observer(190);
    // The block was served before the delivery ran out of time: it stands.
    let block = h.malloc(64).unwrap().expect("served from the refill");
    fill(block, 64, 7);
    let failure = h
        .failure()
        .expect("the delivery ran past the call's deadline");
    assert!(
        matches!(
            &*failure,
            Error::Timeout { policy, call: Call::Observe, .. } if &**policy == "quota"
        ),
        "{failure}"
    );
    assert!(holds(block, 64, 7));
    h.free(Some(block), 64).unwrap();
    // The same policy spending a little in each call serves on.
    let h = dawdling_observer(0);
    let blocks: Vec<_> = (0..8).map(|_| h.malloc(64).unwrap().unwrap()).collect();
    for b in blocks {
        h.free(Some(b), 64).unwrap();
    }
    assert!(h.failure().is_none());
}

/// Found probing 0.2.0: a `lifecycle.report` that trapped stopped the policy, yet the
/// handler said nothing had failed, so `replay-trace` and `check` reported success.
#[test]
fn a_policy_that_fails_to_report_stops_its_chain_and_is_named() {
    let h = handler(&allocbox_artifacts::QUOTA, &[("trap-report", "true")]);
    let p = h.malloc(100).unwrap().unwrap();
    let stats = h.link_stats().unwrap();
    assert!(stats[0].counters.is_empty());
    let failure = h.failure().expect("the failed report stopped the chain");
    assert!(
        matches!(
            &*failure,
            Error::Trap { policy, call: Call::Report, .. } if &**policy == "quota"
        ),
        "{failure}"
    );
    // The client's block stands, and is given back.
    fill(p, 100, 1);
    h.free(Some(p), 100).unwrap();
    assert_eq!(h.held_from_host().unwrap(), (0, 0));

    let dir = tempdir("report-trap");
    let trace = dir.join("t.trace");
    std::fs::write(&trace, "m 1 100\nf 1 100\n").unwrap();
    let quota = allocbox_artifacts::QUOTA.path();
    let (code, out) = allocbox_cli(
        &[
            "replay-trace",
            trace.to_str().unwrap(),
            "-p",
            quota,
            "-c",
            "trap-report=true",
        ],
        &dir,
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAILED") && out.contains("`report`"), "{out}");
}

/// Found probing 0.2.0's outputs: an `init` error is the policy's text, and a policy
/// may make it its whole memory (here 60,000 NUL bytes, each escaped to six). It is cut
/// before it is escaped, so the error a user reads stays a sentence.
#[test]
fn a_policy_s_init_error_is_cut_before_it_is_escaped() {
    let short = "(i32.store (i32.const 12) (i32.const 34))";
    assert!(allocbox::DEFAULT_POLICY_WAT.contains(short));
    let wat =
        allocbox::DEFAULT_POLICY_WAT.replace(short, "(i32.store (i32.const 12) (i32.const 60000))");
    let policy = Runtime::shared().load(wat.as_bytes()).unwrap();
    let err = HandlerBuilder::new(Runtime::shared())
        .link_with(&policy, &[("any", "key")])
        .build()
        .unwrap_err();
    let allocbox::LoadError::ConfigRejected { message, .. } = &err else {
        panic!("{err}")
    };
    assert!(
        message.len() <= 6 * (16 << 10) + 8,
        "{} bytes",
        message.len()
    );
    assert!(message.ends_with('…'), "{message}");
}
