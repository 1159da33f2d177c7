//! A policy that breaks the contract is caught, named and stopped; no client data is lost.

use std::ptr::NonNull;

use allocbox::{Call, Error, HandlerBuilder, Rule, Runtime};

use super::support::*;

/// A live block with known contents, to prove that a failure loses no data. It comes
/// from `calloc`, which the malloc faults leave alone.
fn precious(h: &allocbox::Handler) -> NonNull<u8> {
    let p = h.calloc(1, 4000).unwrap().unwrap();
    fill(p, 4000, 0xC7);
    p
}

fn assert_intact_and_freeable(h: &allocbox::Handler, p: NonNull<u8>) {
    assert!(holds(p, 4000, 0xC7), "live data changed");
    fill(p, 4000, 0x11);
    assert!(holds(p, 4000, 0x11), "live block no longer writable");
    h.free(Some(p), 4000).unwrap();
}

fn violation(err: &Error) -> (&Rule, Call) {
    match err {
        Error::Violation(v) => (&v.rule, v.call),
        other => panic!("expected a violation, got: {other}"),
    }
}

#[test]
fn a_block_outside_the_policy_s_memory_is_refused() {
    let h = broken("outside");
    let p = precious(&h);
    let err = h.malloc(64).unwrap_err();
    assert_eq!(violation(&err), (&Rule::OutsideOwned, Call::Malloc));
    assert!(
        err.to_string().contains("broken") && err.to_string().contains("64 bytes"),
        "{err}"
    );
    assert!(
        matches!(h.malloc(8), Err(Error::Poisoned { .. })),
        "stopped after a violation"
    );
    assert_intact_and_freeable(&h, p);
}

#[test]
fn an_overlapping_block_is_refused() {
    let h = broken("overlap");
    let first = h.malloc(64).unwrap().unwrap();
    fill(first, 64, 0xC7);
    let err = h.malloc(64).unwrap_err();
    assert!(matches!(violation(&err).0, Rule::Overlap { .. }), "{err}");
    assert!(holds(first, 64, 0xC7));
    h.free(Some(first), 64).unwrap();
}

#[test]
fn a_misaligned_block_is_refused() {
    let h = broken("misaligned");
    let err = h.malloc(32).unwrap_err();
    assert_eq!(violation(&err).0, &Rule::Misaligned { alignment: 16 });
}

#[test]
fn a_block_shorter_than_asked_is_refused() {
    let h = broken("off-by-one");
    let err = h.malloc(100).unwrap_err();
    assert_eq!(violation(&err).0, &Rule::OutsideOwned, "{err}");
}

#[test]
fn an_upstream_free_with_the_wrong_size_is_caught() {
    let h = broken("wrong-size-free");
    let keep = precious(&h);
    let p = h.malloc(48).unwrap();
    let err = h.free(p, 48).unwrap_err();
    assert_eq!(
        violation(&err),
        (&Rule::WrongSizeFree { recorded: 48 }, Call::Free),
        "{err}"
    );
    assert_intact_and_freeable(&h, keep);
    assert_eq!(
        h.held_from_host().unwrap(),
        (0, 0),
        "a dead policy's memory is returned"
    );
}

#[test]
fn an_upstream_double_free_is_caught() {
    let h = broken("double-free");
    let p = h.malloc(48).unwrap();
    let err = h.free(p, 48).unwrap_err();
    assert_eq!(violation(&err).0, &Rule::DoubleFree, "{err}");
}

#[test]
fn an_upstream_free_of_an_address_never_lent_is_caught() {
    let h = broken("foreign-free");
    let p = h.malloc(48).unwrap();
    let err = h.free(p, 48).unwrap_err();
    assert_eq!(violation(&err).0, &Rule::UnknownFree, "{err}");
}

#[test]
fn giving_back_upstream_memory_under_a_lent_block_is_refused_and_the_block_survives() {
    // On a free, `free-other` also frees upstream the oldest block it still has lent.
    let h = broken("free-other");
    let keep = h.malloc(4000).unwrap().unwrap();
    fill(keep, 4000, 0xC7);
    let other = h.malloc(64).unwrap();
    let err = h.free(other, 64).unwrap_err();
    assert!(
        matches!(violation(&err), (Rule::GaveBackLentMemory { block, block_size: 4000 }, Call::Free) if *block == keep.as_ptr() as u64),
        "{err}"
    );
    assert_intact_and_freeable(&h, keep);
    assert_eq!(
        h.held_from_host().unwrap(),
        (0, 0),
        "the refused block was returned once, by the host"
    );
}

#[test]
fn a_block_given_back_clears_itself_for_its_policy_and_not_its_lent_neighbour() {
    let h = broken("scribble-after-free");
    let first = h.malloc(64).unwrap().unwrap();
    let second = h.malloc(64).unwrap().unwrap();
    assert_eq!(second.as_ptr() as usize, first.as_ptr() as usize + 64);
    fill(second, 64, 0xC7);
    let err = h.free(Some(first), 64).unwrap_err();
    let Error::Violation(v) = &err else {
        panic!("expected a violation, got: {err}");
    };
    // The policy's write into the block it got back passed; the next one did not.
    assert_eq!(
        (&v.rule, v.call),
        (&Rule::BytesOutOfBounds, Call::BytesWrite)
    );
    assert_eq!(v.addr, second.as_ptr() as u64, "{err}");
    assert!(holds(second, 64, 0xC7), "the lent neighbour changed");
}

#[test]
fn a_write_beside_a_lent_block_does_not_clear_the_block() {
    for fault in ["scribble-beside", "scribble-stale"] {
        let h = broken(fault);
        let first = h.malloc(64).unwrap().unwrap();
        fill(first, 64, 0xC7);
        let err = h.malloc(64).unwrap_err();
        assert_eq!(
            violation(&err),
            (&Rule::BytesOutOfBounds, Call::BytesWrite),
            "{fault}"
        );
        assert!(
            holds(first, 64, 0xC7),
            "{fault}: the client's bytes are intact"
        );
        h.free(Some(first), 64).unwrap();
        assert_eq!(h.held_from_host().unwrap(), (0, 0), "{fault}");
    }
}

#[test]
fn writing_into_a_lent_block_through_bytes_is_refused() {
    let h = broken("scribble");
    let first = h.malloc(64).unwrap().unwrap();
    fill(first, 64, 0xC7);
    let err = h.malloc(64).unwrap_err();
    assert_eq!(violation(&err), (&Rule::BytesOutOfBounds, Call::BytesWrite));
    assert!(
        holds(first, 64, 0xC7),
        "the scribble never reached the client's block"
    );
    h.free(Some(first), 64).unwrap();
    assert_eq!(h.held_from_host().unwrap(), (0, 0));
}

#[test]
fn a_trap_in_every_export_is_an_error_and_loses_nothing() {
    type Op = fn(&allocbox::Handler) -> Result<(), Error>;
    let cases: &[(&str, Call, Op)] = &[
        ("trap-malloc", Call::Malloc, |h| h.malloc(64).map(drop)),
        ("trap-calloc", Call::Calloc, |h| h.calloc(8, 8).map(drop)),
        ("trap-realloc", Call::Realloc, |h| {
            let p = h.malloc(64)?;
            h.realloc(p, 128).map(drop)
        }),
        ("trap-free", Call::Free, |h| {
            let p = h.malloc(64)?;
            h.free(p, 64)
        }),
        ("trap-trim", Call::Trim, |h| h.trim()),
    ];
    for (fault, call, op) in cases {
        let h = broken(fault);
        let keep = match *fault {
            "trap-calloc" => {
                let p = h.malloc(4000).unwrap().unwrap();
                fill(p, 4000, 0xC7);
                p
            }
            _ => precious(&h),
        };
        let err = op(&h).expect_err(fault);
        match &err {
            Error::Trap {
                call: c, message, ..
            } => {
                assert_eq!(c, call, "{fault}");
                assert!(
                    message.contains("trapping on purpose"),
                    "{fault}: {message}"
                );
            }
            other => panic!("{fault}: expected a trap, got {other}"),
        }
        assert_intact_and_freeable(&h, keep);
    }
}

#[test]
fn a_trap_in_the_batch_exports_is_caught_through_the_magazines() {
    let h = broken("trap-malloc-many");
    let err = h.malloc(24).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Trap {
                call: Call::MallocMany,
                ..
            }
        ),
        "{err}"
    );

    let h = broken("trap-free-many");
    let blocks: Vec<_> = (0..100).map(|_| h.malloc(24).unwrap()).collect();
    let errors: Vec<_> = blocks
        .into_iter()
        .filter_map(|p| h.free(p, 24).err())
        .collect();
    assert!(
        matches!(
            errors.first(),
            Some(Error::Trap {
                call: Call::FreeMany,
                ..
            })
        ),
        "{errors:?}"
    );
    assert_eq!(
        h.held_from_host().unwrap(),
        (0, 0),
        "every block returned once the client let go"
    );
}

#[test]
fn a_realloc_that_returns_a_bad_block_keeps_the_old_block_intact() {
    // `realloc-outside` moves the bytes, frees the old block upstream, then lies.
    let h = broken("realloc-outside");
    let p = precious(&h);
    let err = h.realloc(Some(p), 8000).unwrap_err();
    // The lie lies 64 KiB past the new block: outside everything the policy holds, or,
    // where the C allocator happened to put the old block there, inside the memory the
    // policy just gave back. Both are refused, each with its own rule.
    assert!(
        matches!(
            violation(&err).0,
            Rule::OutsideOwned | Rule::UseAfterFree { .. }
        ),
        "{err}"
    );
    assert_intact_and_freeable(&h, p);
}

#[test]
fn a_dirty_calloc_answer_reaches_the_client_zeroed_on_the_production_path() {
    // `calloc-dirty` fills its answers with 0xAB; `recycled-calloc-dirty` reuses freed
    // blocks without zeroing them. The client sees zeros either way, and the policy goes
    // on serving.
    for fault in ["calloc-dirty", "recycled-calloc-dirty"] {
        let h = broken(fault);
        for size in [1usize, 100, 5000, 70_000] {
            let p = h.malloc(size).unwrap().unwrap();
            fill(p, size, 0xEE);
            h.free(Some(p), size).unwrap();
            let z = h.calloc(size, 1).unwrap().unwrap();
            assert!(holds(z, size, 0), "{fault}, {size} bytes");
            h.free(Some(z), size).unwrap();
        }
        assert!(h.failure().is_none(), "{fault}");
    }
}

#[test]
fn with_deep_checks_a_dirty_calloc_answer_is_a_named_violation() {
    let h = HandlerBuilder::new(Runtime::shared())
        .link_with(
            &load(&allocbox_artifacts::BROKEN),
            &[("fault", "calloc-dirty")],
        )
        .checked(true)
        .build()
        .unwrap();
    let err = h.calloc(10, 10).unwrap_err();
    assert_eq!(
        err.rule(),
        Some(&Rule::CallocNotZeroed { offset: 0 }),
        "{err}"
    );
    assert_eq!(err.policy(), Some("broken"));
}

/// Pages of `[p, p+len)` resident in memory now.
fn resident_pages(p: NonNull<u8>, len: usize) -> usize {
    let page = 4096;
    let start = p.as_ptr() as usize & !(page - 1);
    let pages = (p.as_ptr() as usize + len - start).div_ceil(page);
    let mut resident = vec![0u8; pages];
    // SAFETY: `[start, start + pages*page)` covers the live block `[p, p+len)` rounded
    // out to whole pages of its mapping; `resident` has one byte per page.
    let status = unsafe {
        libc::mincore(
            start as *mut libc::c_void,
            pages * page,
            resident.as_mut_ptr(),
        )
    };
    assert_eq!(status, 0, "mincore");
    resident.iter().filter(|&&r| r & 1 != 0).count()
}

#[test]
fn a_large_calloc_a_policy_takes_zeroed_from_upstream_stays_lazily_zeroed() {
    // `system` answers a calloc with the host's own zeroed block: nothing to zero again,
    // so a GiB of zeros costs no page until it is used.
    let h = handler(&allocbox_artifacts::SYSTEM, &[]);
    let size = 1 << 30;
    let z = h.calloc(size, 1).unwrap().unwrap();
    let resident = resident_pages(z, size);
    assert!(
        resident < size / 4096 / 100,
        "{resident} of {} pages resident",
        size / 4096
    );
    h.free(Some(z), size).unwrap();
}
