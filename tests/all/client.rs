//! The client's side of the contract: the host corrects and refuses, the policy never
//! sees a wrong size.

use allocbox::{ClientError, Error};

use super::support::*;

#[test]
fn a_client_double_free_is_refused_and_harmless() {
    for guest in [&allocbox_artifacts::SYSTEM, &allocbox_artifacts::ALIGNED] {
        let h = handler(guest, &[]);
        let p = h.malloc(64).unwrap();
        h.free(p, 64).unwrap();
        let err = h.free(p, 64).unwrap_err();
        assert!(
            matches!(err, Error::Client(ClientError::DoubleFree { .. })),
            "{err}"
        );
        let q = h.malloc(64).unwrap();
        h.free(q, 64).unwrap();
        assert!(
            h.failure().is_none(),
            "a client mistake does not stop the policy"
        );
    }
}

#[test]
fn a_free_of_an_address_never_lent_is_refused() {
    let h = handler(&allocbox_artifacts::SYSTEM, &[]);
    let mut local = [0u8; 16];
    let err = h
        .free(std::ptr::NonNull::new(local.as_mut_ptr()), 16)
        .unwrap_err();
    assert!(
        matches!(err, Error::Client(ClientError::UnknownBlock { .. })),
        "{err}"
    );
}

#[test]
fn a_wrong_size_free_is_corrected_so_the_policy_gets_the_right_size() {
    // `aligned` traps if the size it is given is not the one in its header.
    let h = handler(&allocbox_artifacts::ALIGNED, &[]);
    let p = h.malloc(8).unwrap();
    h.free(p, 1).unwrap();
    assert_eq!(h.stats().unwrap().size_corrections, 1);
    assert!(h.failure().is_none());
}

#[test]
fn free_of_null_with_a_size_does_nothing() {
    let h = handler(&allocbox_artifacts::SYSTEM, &[]);
    h.free(None, 32).unwrap();
    assert_eq!(h.stats().unwrap().frees, 0);
}

#[test]
fn zero_size_requests_get_distinct_blocks_freed_with_either_size() {
    let h = handler(&allocbox_artifacts::ALIGNED, &[]);
    let a = h.malloc(0).unwrap();
    let b = h.malloc(0).unwrap();
    assert!(a.is_some() && a != b);
    h.free(a, 0).unwrap();
    h.free(b, 1).unwrap();
    assert_eq!(
        h.stats().unwrap().size_corrections,
        0,
        "0 and 1 both name a 0-byte block"
    );
    let c = h.calloc(0, 8).unwrap();
    h.free(c, 0).unwrap();
}

#[test]
fn an_overflowing_calloc_is_none_without_asking_the_policy() {
    let h = broken("trap-calloc");
    assert_eq!(h.calloc(usize::MAX, 2).unwrap(), None);
    assert!(h.failure().is_none());
}

#[test]
fn impossible_sizes_are_none_not_errors() {
    let h = handler(&allocbox_artifacts::SYSTEM, &[]);
    assert_eq!(h.malloc(usize::MAX - 4).unwrap(), None);
    let p = h.malloc(16).unwrap();
    assert_eq!(h.realloc(p, usize::MAX - 4).unwrap(), None);
    h.free(p, 16).unwrap();
}

#[test]
fn mid_size_blocks_up_to_64_kib_are_served_from_magazines() {
    let h = handler(&allocbox_artifacts::SYSTEM, &[]);
    // 64 KiB and a runtime's header before it (Numba's 48 bytes, 31 of padding).
    for size in [1500, 4096, 65536, 65536 + 128] {
        let p = h.malloc(size).unwrap().unwrap();
        fill(p, size, 0x6D);
        h.free(Some(p), size).unwrap();
        let before = h.stats().unwrap().magazine_hits;
        let q = h.malloc(size).unwrap().unwrap();
        assert_eq!(h.stats().unwrap().magazine_hits, before + 1, "{size} bytes");
        h.free(Some(q), size).unwrap();
    }
    let past = 65536 + 129;
    let p = h.malloc(past).unwrap().unwrap();
    h.free(Some(p), past).unwrap();
    let before = h.stats().unwrap().magazine_hits;
    let q = h.malloc(past).unwrap().unwrap();
    assert_eq!(
        h.stats().unwrap().magazine_hits,
        before,
        "past 64 KiB and a header: no magazine"
    );
    h.free(Some(q), past).unwrap();
    h.trim().unwrap();
    assert_eq!(h.held_from_host().unwrap(), (0, 0));
}

#[test]
fn magazines_cache_a_bounded_number_of_bytes_across_all_sizes() {
    // `system` keeps nothing itself: whatever the host still holds after the client
    // freed everything is in the magazines.
    let h = handler(&allocbox_artifacts::SYSTEM, &[]);
    let blocks: Vec<_> = (0..400)
        .map(|i| {
            let size = 60_000 + 16 * i;
            (h.malloc(size).unwrap().unwrap(), size)
        })
        .collect();
    for (p, size) in blocks {
        h.free(Some(p), size).unwrap();
    }
    let (_, cached) = h.held_from_host().unwrap();
    assert!(cached > 0 && cached <= 16 << 20, "{cached} bytes cached");
    h.trim().unwrap();
    assert_eq!(h.held_from_host().unwrap(), (0, 0));
}

#[test]
fn a_calloc_served_from_a_magazine_is_zero_and_counted_as_a_calloc() {
    // `system` batches: a small calloc is served from the thread's magazine like a
    // malloc, and the host zeroes the block, whatever its last user left in it.
    let h = handler(&allocbox_artifacts::SYSTEM, &[]);
    for size in [1usize, 24, 1000, 65536] {
        let p = h.malloc(size).unwrap().unwrap();
        fill(p, size, 0xEE);
        h.free(Some(p), size).unwrap();
        let z = h.calloc(size, 1).unwrap().unwrap();
        assert!(holds(z, size, 0), "{size} bytes");
        h.free(Some(z), size).unwrap();
    }
    let stats = h.stats().unwrap();
    assert_eq!((stats.mallocs, stats.callocs), (4, 4));
    assert!(stats.magazine_hits >= 4, "{stats:?}");
    assert_eq!(
        h.calloc(usize::MAX, 2).unwrap(),
        None,
        "an overflowing product"
    );
    assert_eq!(h.stats().unwrap().callocs, 5);
}

#[test]
fn an_unsized_free_gives_the_policy_the_size_the_ledger_recorded() {
    // `aligned` traps if the size it is given is not the one in its header; `size-classes`
    // batches, so its small blocks go back through the host's magazines.
    for guest in [
        &allocbox_artifacts::ALIGNED,
        &allocbox_artifacts::SIZE_CLASSES,
    ] {
        for size in [1, 48, 5000, 300_000] {
            let h = handler(guest, &[]);
            let p = h.malloc(size).unwrap().unwrap();
            assert!(!h.free_unsized_to_magazine(std::ptr::NonNull::dangling()));
            let freed = match h.free_unsized_to_magazine(p) {
                true => size,
                false => h.free_unsized(p).unwrap(),
            };
            assert_eq!(freed, size);
            let stats = h.stats().unwrap();
            assert_eq!(
                (stats.frees, stats.live_blocks, stats.size_corrections),
                (1, 0, 0)
            );
            assert!(h.failure().is_none(), "{}", h.failure().unwrap());
            let again = h.free_unsized(p).unwrap_err();
            assert!(
                matches!(again, Error::Client(ClientError::DoubleFree { .. })),
                "{again}"
            );
        }
    }
}
