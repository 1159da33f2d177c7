//! Chains of policies, with the host between every two links.

use allocbox::{HandlerBuilder, Runtime};

use super::support::*;

#[test]
fn aligned_over_size_classes_over_system_places_aligned_blocks_and_keeps_bytes() {
    // The smallest and largest alignments bound the offset `aligned` packs into its
    // one-word header.
    for alignment in [16usize, 256, 65536] {
        let h = HandlerBuilder::new(Runtime::shared())
            .link_with(
                &load(&allocbox_artifacts::ALIGNED),
                &[("alignment", &alignment.to_string())],
            )
            .link(&load(&allocbox_artifacts::SIZE_CLASSES))
            .link(&load(&allocbox_artifacts::SYSTEM))
            .build()
            .unwrap();
        assert_eq!(
            h.policy_names().iter().map(|n| &**n).collect::<Vec<_>>(),
            ["aligned", "size-classes", "system"]
        );
        let mut blocks = Vec::new();
        for (i, size) in [1usize, 15, 100, 1000, 5000, 70000].into_iter().enumerate() {
            let p = h.malloc(size).unwrap().unwrap();
            assert_eq!(p.as_ptr() as usize % alignment, 0, "{size} bytes");
            fill(p, size, i as u8);
            blocks.push((p, size, i as u8));
        }
        for (p, size, byte) in &mut blocks {
            let q = h.realloc(Some(*p), *size * 2).unwrap().unwrap();
            assert!(holds(q, *size, *byte));
            *p = q;
            *size *= 2;
        }
        for (p, size, _) in blocks {
            h.free(Some(p), size).unwrap();
        }
        assert!(h.failure().is_none(), "alignment {alignment}");
        h.trim().unwrap();
        assert_eq!(h.held_from_host().unwrap(), (0, 0));
    }
}

#[test]
fn a_violation_deep_in_a_chain_names_the_inner_policy_and_stops_the_handler() {
    let h = HandlerBuilder::new(Runtime::shared())
        .link(&load(&allocbox_artifacts::SYSTEM))
        .link_with(
            &load(&allocbox_artifacts::BROKEN),
            &[("fault", "misaligned")],
        )
        .build()
        .unwrap();
    let err = h.malloc(16).unwrap_err();
    assert_eq!(err.policy(), Some("broken"), "{err}");
    assert!(matches!(h.malloc(8), Err(allocbox::Error::Poisoned { .. })));
}

#[test]
fn the_arena_serves_from_chunks_and_returns_them_on_trim() {
    let h = handler(&allocbox_artifacts::ARENA, &[("chunk-size", "65536")]);
    let blocks: Vec<_> = (1..200)
        .map(|s| (h.malloc(s * 8).unwrap().unwrap(), s * 8))
        .collect();
    let (held, _) = h.held_from_host().unwrap();
    assert!(
        held < 20,
        "carved from a few chunks, not one upstream block each: {held}"
    );
    for (p, s) in blocks {
        h.free(Some(p), s).unwrap();
    }
    h.trim().unwrap();
    assert_eq!(h.held_from_host().unwrap(), (0, 0));
}

#[test]
fn the_large_block_cache_keeps_the_newest_blocks_and_reuses_them() {
    const MIB: usize = 1 << 20;
    let h = handler(&allocbox_artifacts::SIZE_CLASSES, &[("large-cache", "2")]);
    let first: Vec<_> = (0..2)
        .map(|_| h.malloc(3 * MIB).unwrap().unwrap())
        .collect();
    for p in first {
        h.free(Some(p), 3 * MIB).unwrap();
    }
    assert_eq!(
        h.held_from_host().unwrap(),
        (2, 6 << 20),
        "both freed blocks kept"
    );
    // A smaller size misses, and the larger blocks stay cached beside it.
    let q = h.malloc(2 * MIB).unwrap().unwrap();
    assert_eq!(h.held_from_host().unwrap(), (3, 8 << 20));
    // A full cache still takes a new size: it gives back its oldest block instead.
    h.free(Some(q), 2 * MIB).unwrap();
    assert_eq!(
        h.held_from_host().unwrap(),
        (2, 5 << 20),
        "the oldest block made room"
    );
    let again = h.malloc(2 * MIB).unwrap().unwrap();
    assert_eq!(again, q, "the newest size is served from the cache");
    assert_eq!(
        h.held_from_host().unwrap(),
        (2, 5 << 20),
        "nothing new from the host"
    );
    h.free(Some(again), 2 * MIB).unwrap();
    h.trim().unwrap();
    assert_eq!(h.held_from_host().unwrap(), (0, 0));
}

#[test]
fn a_miss_for_a_larger_block_gives_back_the_smaller_cached_ones_first() {
    const MIB: usize = 1 << 20;
    let h = handler(&allocbox_artifacts::SIZE_CLASSES, &[("large-cache", "4")]);
    let kept: Vec<_> = [2 * MIB, 3 * MIB, 5 * MIB]
        .into_iter()
        .map(|size| (h.malloc(size).unwrap().unwrap(), size))
        .collect();
    for &(p, size) in &kept {
        h.free(Some(p), size).unwrap();
    }
    assert_eq!(h.held_from_host().unwrap(), (3, 10 << 20));
    // 4 MiB: the 2 and 3 MiB blocks cannot serve it and go back upstream; 5 MiB stays.
    let p = h.malloc(4 * MIB).unwrap().unwrap();
    assert_eq!(h.held_from_host().unwrap(), (2, 9 << 20));
    h.free(Some(p), 4 * MIB).unwrap();
    let again = h.malloc(5 * MIB).unwrap().unwrap();
    assert_eq!(again, kept[2].0, "the larger block was kept for its size");
    h.free(Some(again), 5 * MIB).unwrap();
    h.trim().unwrap();
    assert_eq!(h.held_from_host().unwrap(), (0, 0));
}

#[test]
fn a_request_the_overhead_budget_refuses_is_asked_again_after_the_large_cache_is_given_back() {
    const MIB: usize = 1 << 20;
    let h = HandlerBuilder::new(Runtime::shared())
        .limits(allocbox::Limits {
            overhead: 2 * MIB as u64,
            ..allocbox::Limits::default()
        })
        .link_with(
            &load(&allocbox_artifacts::SIZE_CLASSES),
            &[("large-cache", "4")],
        )
        .build()
        .unwrap();
    let first = h.malloc(3 * MIB).unwrap().unwrap();
    h.free(Some(first), 3 * MIB).unwrap();
    assert_eq!(h.held_from_host().unwrap(), (1, 3 << 20), "kept, idle");
    // A zeroed block never comes from the cache: with the kept one beside it the
    // policy would hold 3 MiB beyond its client's, over the budget of 2.
    let zeroed = h.calloc(3 * MIB, 1).unwrap();
    assert!(zeroed.is_some(), "served once the kept block went back");
    assert_eq!(h.held_from_host().unwrap(), (1, 3 << 20));
    // And a malloc of another size likewise.
    h.free(zeroed, 3 * MIB).unwrap();
    let other = h.malloc(4 * MIB).unwrap();
    assert!(other.is_some());
    h.free(other, 4 * MIB).unwrap();
    assert!(h.failure().is_none());
}

/// A chain of `uppers` (top first) over a `broken` policy whose `malloc(13)` never
/// returns, under a 100 ms call limit; magazines on or off.
fn over_a_looping_link(
    uppers: &[&allocbox_artifacts::Guest],
    magazines: bool,
) -> allocbox::Handler {
    let mut builder = HandlerBuilder::new(Runtime::shared())
        .limits(allocbox::Limits {
            call_time: std::time::Duration::from_millis(100),
            ..allocbox::Limits::default()
        })
        .magazines(magazines);
    for upper in uppers {
        builder = builder.link(&load(upper));
    }
    builder
        .link_with(
            &load(&allocbox_artifacts::BROKEN),
            &[("fault", "loop-malloc")],
        )
        .build()
        .unwrap()
}

fn assert_the_looping_link_is_named(err: &allocbox::Error) {
    assert!(
        matches!(err, allocbox::Error::Timeout { policy, .. } if &**policy == "broken"),
        "{err}"
    );
}

#[test]
fn a_looping_lower_link_is_the_one_named_in_chains_of_two_and_three_links() {
    use allocbox_artifacts::{SIZE_CLASSES, SYSTEM, WAT_PASSTHROUGH};
    let chains: [&[&allocbox_artifacts::Guest]; 4] = [
        &[&SYSTEM],
        &[&WAT_PASSTHROUGH],
        &[&SYSTEM, &SIZE_CLASSES],
        &[&WAT_PASSTHROUGH, &SYSTEM],
    ];
    for uppers in chains {
        for magazines in [true, false] {
            let h = over_a_looping_link(uppers, magazines);
            let kept = h.malloc(64).unwrap().unwrap();
            fill(kept, 64, 0x77);
            let err = h.malloc(13).unwrap_err();
            assert_the_looping_link_is_named(&err);
            let failure = h.failure().expect("the chain stopped");
            assert_the_looping_link_is_named(&failure);
            for stats in h.link_stats().unwrap() {
                if let Some(why) = stats.failure {
                    assert!(
                        !why.contains(&format!("`{}` ran past", stats.name))
                            || stats.name == "broken",
                        "{} is blamed: {why}",
                        stats.name
                    );
                }
            }
            assert!(holds(kept, 64, 0x77));
            h.free(Some(kept), 64).unwrap();
            assert_eq!(h.held_from_host().unwrap(), (0, 0));
        }
    }
}

#[test]
fn a_looping_lower_link_is_named_when_two_client_threads_share_the_chain() {
    let h = std::sync::Arc::new(over_a_looping_link(
        &[
            &allocbox_artifacts::SYSTEM,
            &allocbox_artifacts::SIZE_CLASSES,
        ],
        true,
    ));
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let h = h.clone();
            std::thread::spawn(move || match h.malloc(13) {
                Err(allocbox::Error::Poisoned { cause, .. }) => (*cause).clone(),
                Err(e) => e,
                Ok(_) => panic!("malloc(13) cannot be served"),
            })
        })
        .collect();
    for t in threads {
        assert_the_looping_link_is_named(&t.join().unwrap());
    }
}
