//! Sandbox limits: time, the guest's own memory, and many threads at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use allocbox::{Call, Error, HandlerBuilder, Limits, Runtime};

use super::support::*;

#[test]
fn an_endless_loop_is_a_timeout_within_the_limit() {
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
    let start = Instant::now();
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
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
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
    assert_eq!(fallback.stats().live_blocks, 2);
    h.free(Some(q), 200).unwrap();
    h.free(r, 10).unwrap();
    assert_eq!(fallback.stats().live_blocks, 0);
    assert_eq!(h.held_from_host(), (0, 0));
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
    assert_eq!(h.stats().live_blocks, 0);
    h.trim().unwrap();
    assert_eq!(h.held_from_host(), (0, 0));
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
    });
    assert!(
        seen.starts_with("probe: env=[POLICY_MODE=fast] monotonic=moving wall="),
        "{seen}"
    );
    assert!(!seen.ends_with("wall=0"), "{seen}");
}
