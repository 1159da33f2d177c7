//! A policy that breaks the contract is caught, named and stopped; no client data is lost.
//!
//! Every planted break of the `broken` policy that one client call meets is a row of
//! [`planted!`]: its fault, what the client does, and the call and rule the host must
//! name. One runner ([`Planted::run`]) checks each row the same way. Breaks that need a
//! check of their own (which block a rule names, traps, batches) follow as plain tests.

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

/// What a client does to a planted fault: blocks are numbered in the order they were
/// made, from 0.
#[derive(Debug, Clone, Copy)]
enum Step {
    Malloc(usize),
    Calloc(usize, usize),
    /// Resize block `.0` to `.1` bytes.
    Realloc(usize, usize),
    Free(usize),
}

/// A planted break of the contract and what the host must say of it.
struct Planted {
    /// The `broken` policy's `fault` setting.
    fault: &'static str,
    /// The call the violation is reported in.
    call: Call,
    /// The rule that must be named.
    rule: fn(&Rule) -> bool,
    rule_text: &'static str,
    /// Words the message must hold.
    says: &'static [&'static str],
}

impl Planted {
    /// Run `steps` against a fresh `broken` beside a precious block: every step but the
    /// last succeeds, the last is refused with the row's call and rule, and then the
    /// policy is stopped, every block the client held is intact and freeable, an audit
    /// passes, and the dead policy's memory has all come back to the host.
    fn run(&self, steps: &[Step]) {
        let fault = self.fault;
        let h = broken(fault);
        let keep = precious(&h);
        let mut blocks: Vec<Option<(NonNull<u8>, usize)>> = Vec::new();
        let (last, before) = steps.split_last().expect("a row has steps");
        for step in before {
            if let Err(err) = take_step(&h, &mut blocks, *step) {
                panic!("{fault}: {step:?} failed before the fault: {err}");
            }
        }
        let err = take_step(&h, &mut blocks, *last).expect_err(fault);
        let (rule, call) = violation(&err);
        assert!(
            (self.rule)(rule) && call == self.call,
            "{fault}: expected {} in {:?}, got: {err}",
            self.rule_text,
            self.call
        );
        for word in self.says {
            assert!(err.to_string().contains(word), "{fault}: {err}");
        }
        assert!(
            matches!(h.malloc(8), Err(Error::Poisoned { .. })),
            "{fault}: stopped after a violation"
        );
        for (i, &(p, size)) in blocks
            .iter()
            .enumerate()
            .filter_map(|(i, b)| Some((i, b.as_ref()?)))
        {
            assert!(holds(p, size, pattern(i)), "{fault}: block {i} changed");
        }
        h.audit().unwrap();
        for (p, size) in blocks.into_iter().flatten() {
            h.free(Some(p), size).unwrap();
        }
        assert_intact_and_freeable(&h, keep);
        assert_eq!(
            h.held_from_host().unwrap(),
            (0, 0),
            "{fault}: a dead policy's memory is returned"
        );
    }
}

/// The byte block `i` of a row holds.
fn pattern(i: usize) -> u8 {
    0x30 + i as u8
}

/// Take one step; a block it makes or resizes is filled with its pattern. A block whose
/// free was refused is gone all the same: the client let go of it.
fn take_step(
    h: &allocbox::Handler,
    blocks: &mut Vec<Option<(NonNull<u8>, usize)>>,
    step: Step,
) -> Result<(), Error> {
    let made = match step {
        Malloc(size) => Some((h.malloc(size)?, size)),
        Calloc(nelem, elsize) => Some((h.calloc(nelem, elsize)?, nelem * elsize)),
        Realloc(i, new) => {
            let (p, _) = blocks[i].expect("a live block");
            let moved = h.realloc(Some(p), new)?.expect("a resized block");
            fill(moved, new, pattern(i));
            blocks[i] = Some((moved, new));
            None
        }
        Free(i) => {
            let (p, size) = blocks[i].take().expect("a live block");
            h.free(Some(p), size)?;
            None
        }
    };
    if let Some((p, size)) = made {
        let p = p.expect("a block before the fault");
        fill(p, size, pattern(blocks.len()));
        blocks.push(Some((p, size)));
    }
    Ok(())
}

/// One test per row: `name: [faults], [scenarios] => (call, rule), says [words];` runs every
/// scenario (a list of steps) against every fault of the row.
macro_rules! planted {
    ($(
        $(#[$meta:meta])*
        $name:ident: [$($fault:literal),+], [$($steps:expr),+] => ($call:expr, $rule:pat)
            $(, says [$($word:literal),*])?;
    )*) => {$(
        $(#[$meta])*
        #[test]
        fn $name() {
            for fault in [$($fault),+] {
                let row = Planted {
                    fault,
                    call: $call,
                    rule: |rule| matches!(rule, $rule),
                    rule_text: stringify!($rule),
                    says: &[$($($word),*)?],
                };
                $(row.run(&$steps);)+
            }
        }
    )*};
}

use Step::*;

planted! {
    a_block_outside_the_policy_s_memory_is_refused:
        ["outside"], [[Malloc(64)]] => (Call::Malloc, Rule::OutsideOwned),
            says ["broken", "64 bytes"];
    an_overlapping_block_is_refused:
        ["overlap"], [[Malloc(64), Malloc(64)]] => (Call::Malloc, Rule::Overlap { .. });
    a_misaligned_block_is_refused:
        ["misaligned"], [[Malloc(32)]] => (Call::Malloc, Rule::Misaligned { alignment: 16 });
    a_block_shorter_than_asked_is_refused:
        ["off-by-one"], [[Malloc(100)]] => (Call::Malloc, Rule::OutsideOwned);
    an_upstream_free_with_the_wrong_size_is_caught:
        ["wrong-size-free"], [[Malloc(48), Free(0)]]
            => (Call::Free, Rule::WrongSizeFree { recorded: 48 });
    an_upstream_double_free_is_caught:
        ["double-free"], [[Malloc(48), Free(0)]] => (Call::Free, Rule::DoubleFree);
    an_upstream_free_of_an_address_never_lent_is_caught:
        ["foreign-free"], [[Malloc(48), Free(0)]] => (Call::Free, Rule::UnknownFree);
    /// `scribble-beside` writes just past a block it lent, `scribble-stale` through a
    /// stale pointer into one; neither write reaches the client's bytes.
    a_write_beside_a_lent_block_does_not_clear_the_block:
        ["scribble-beside", "scribble-stale"], [[Malloc(64), Malloc(64)]]
            => (Call::BytesWrite, Rule::BytesOutOfBounds { lent: Some((_, 64, _)) });
    writing_into_a_lent_block_through_bytes_is_refused:
        ["scribble"], [[Malloc(64), Malloc(64)]]
            => (Call::BytesWrite, Rule::BytesOutOfBounds { lent: Some((_, 64, _)) }),
            says ["at the start of the block", "(64 bytes) the policy lent"];
    /// `realloc-outside` moves the bytes, frees the old block upstream, then answers 64 KiB
    /// past the new block: outside everything the policy holds, or, where the C allocator
    /// happened to put the old block there, inside the memory the policy just gave back.
    /// Both are refused, each with its own rule.
    a_realloc_that_returns_a_bad_block_keeps_the_old_block_intact:
        ["realloc-outside"], [[Calloc(1, 4000), Realloc(0, 8000)]]
            => (Call::Realloc, Rule::OutsideOwned | Rule::UseAfterFree { .. });
    /// The trace of issue 9: `m 1 64 1`, `r 1 32 1`, through a policy whose realloc gives
    /// the old block back upstream and answers it again. The host must refuse the answer
    /// (the client keeps its intact old block), not release memory the client holds.
    a_realloc_answering_the_block_it_freed_is_a_named_use_after_free:
        ["realloc-free-answer-old"], [[Malloc(64), Realloc(0, 32)]]
            => (Call::Realloc, Rule::UseAfterFree { .. }), says ["use after free"];
    a_realloc_answering_the_old_address_after_an_upstream_move_is_refused:
        ["realloc-upstream-answer-old"],
        [
            [Malloc(64), Realloc(0, 4000)],
            [Malloc(4000), Realloc(0, 64)],
            [Malloc(100), Realloc(0, 100)]
        ] => (Call::Realloc, Rule::UseAfterFree { .. });
    /// `realloc-loses` copies half the bytes. No checked mode here: the host compares the
    /// answer with the old block, which is intact while in transit.
    a_realloc_answer_without_the_client_s_bytes_is_refused_on_the_production_path:
        ["realloc-loses"], [[Malloc(256), Realloc(0, 1024)]]
            => (Call::Realloc, Rule::ReallocLostBytes { offset: 128 });
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
        (
            &Rule::BytesOutOfBounds {
                lent: Some((second.as_ptr() as u64, 64, second.as_ptr() as u64))
            },
            Call::BytesWrite
        )
    );
    assert_eq!(v.addr, second.as_ptr() as u64, "{err}");
    assert!(holds(second, 64, 0xC7), "the lent neighbour changed");
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
