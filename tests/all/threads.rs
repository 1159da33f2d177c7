//! One handler, many threads: each thread's magazines serve it without the chain's lock,
//! and a block may be freed by any thread, with every client check still made.

use std::ptr::NonNull;

use allocbox::{ClientError, Error, Handler};

use super::support::*;

fn ptr(addr: usize) -> Option<NonNull<u8>> {
    NonNull::new(addr as *mut u8)
}

/// A block from `h`'s magazines on a thread of its own, as an address (pointers are not
/// `Send`). The thread ends, so its cache outlives it.
fn taken_on_another_thread(h: &Handler, size: usize) -> usize {
    std::thread::scope(|s| {
        s.spawn(|| {
            // Warm the magazine so that the block comes from it, not from the policy.
            let warm = h.malloc(size).unwrap();
            h.free(warm, size).unwrap();
            let p = h.malloc(size).unwrap().unwrap();
            fill(p, size, 0x3c);
            p.as_ptr() as usize
        })
        .join()
        .unwrap()
    })
}

#[test]
fn a_block_taken_on_one_thread_is_freed_on_another() {
    let h = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    let addr = taken_on_another_thread(&h, 48);
    assert!(holds(ptr(addr).unwrap(), 48, 0x3c));
    assert_eq!(h.live_blocks().unwrap(), [(addr, 48)]);
    assert_eq!(h.block_size(ptr(addr).unwrap()), Some(48));
    h.free(ptr(addr), 48).unwrap();
    h.audit().unwrap();
    let stats = h.stats().unwrap();
    assert_eq!((stats.live_blocks, stats.live_bytes), (0, 0));
    assert_eq!((stats.mallocs, stats.frees), (2, 2));
    assert!(stats.magazine_hits >= 1);
    h.leak_check().unwrap();
}

#[test]
fn a_block_freed_on_its_thread_and_again_on_another_is_a_double_free() {
    let h = handler(&allocbox_artifacts::SYSTEM, &[]);
    let addr = std::thread::scope(|s| {
        s.spawn(|| {
            let p = h.malloc(32).unwrap();
            h.free(p, 32).unwrap();
            p.unwrap().as_ptr() as usize
        })
        .join()
        .unwrap()
    });
    // The block sits in the other thread's magazine now.
    let err = h.free(ptr(addr), 32).unwrap_err();
    assert!(
        matches!(err, Error::Client(ClientError::DoubleFree { .. })),
        "{err}"
    );
    let err = h.realloc(ptr(addr), 64).unwrap_err();
    assert!(
        matches!(err, Error::Client(ClientError::UnknownRealloc { .. })),
        "{err}"
    );
    assert!(
        h.failure().is_none(),
        "a client mistake does not stop the policy"
    );
    h.audit().unwrap();
    h.leak_check().unwrap();
}

#[test]
fn a_wrong_size_free_on_another_thread_is_corrected() {
    let h = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    let addr = taken_on_another_thread(&h, 24);
    h.free(ptr(addr), 1000).unwrap();
    assert_eq!(h.stats().unwrap().size_corrections, 1);
    h.leak_check().unwrap();
}

#[test]
fn a_block_taken_on_one_thread_is_resized_on_another_with_its_bytes() {
    let h = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    let addr = taken_on_another_thread(&h, 40);
    let moved = h.realloc(ptr(addr), 4000).unwrap().unwrap();
    assert!(holds(moved, 40, 0x3c));
    assert_eq!(h.live_blocks().unwrap(), [(moved.as_ptr() as usize, 4000)]);
    h.free(Some(moved), 4000).unwrap();
    h.audit().unwrap();
    h.leak_check().unwrap();
}

/// How many worker threads the stress test keeps running at once, how many it starts
/// in all, and the rounds each runs: a short run by default; set
/// `ALLOCBOX_STRESS=long` for the long one (README, "Testing").
fn stress_plan() -> (usize, usize, usize) {
    match std::env::var("ALLOCBOX_STRESS").as_deref() {
        Ok("long") => (32, 5_000, 2_000),
        _ => (32, 320, 200),
    }
}

/// 32 threads at a time on whatever cores there are, started and ended throughout,
/// share a magazine handler and a per-call one: each takes blocks, fills them, hands
/// some to another thread to free and frees the rest, checking every block's bytes,
/// while another thread reads statistics, audits and trims. The books balance and
/// nothing leaks.
#[test]
fn thirty_two_threads_starting_and_ending_keep_every_block_and_the_books_balanced() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let (at_once, in_all, rounds) = stress_plan();
    let handlers = [
        handler(&allocbox_artifacts::SIZE_CLASSES, &[]),
        handler(&allocbox_artifacts::SYSTEM, &[]),
    ];
    /// A block handed between threads: its handler, address, size and fill byte.
    type Handed = (usize, usize, usize, u8);
    // One mailbox per running place.
    let mailboxes: Vec<Mutex<Vec<Handed>>> = (0..at_once).map(|_| Mutex::new(Vec::new())).collect();
    let started = AtomicUsize::new(0);
    let done = AtomicBool::new(false);
    let check = |(w, addr, size, byte): (usize, usize, usize, u8)| {
        assert!(
            holds(ptr(addr).unwrap(), size, byte),
            "a block lost its bytes"
        );
        handlers[w].free(ptr(addr), size).unwrap();
    };
    std::thread::scope(|s| {
        let observer = s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                for h in &handlers {
                    h.audit().unwrap();
                    let _ = h.stats().unwrap();
                    h.trim().unwrap();
                }
                std::thread::yield_now();
            }
        });
        // Each place runs threads one after another until `in_all` have started.
        let places: Vec<_> = (0..at_once)
            .map(|place| {
                let (mailboxes, started, handlers, check) =
                    (&mailboxes, &started, &handlers, &check);
                s.spawn(move || {
                    while started.fetch_add(1, Ordering::Relaxed) < in_all {
                        std::thread::scope(|t| {
                            t.spawn(|| {
                                let mut own = Vec::new();
                                let mut n = place as u64 + 1;
                                for round in 0..rounds {
                                    n = n
                                        .wrapping_mul(6364136223846793005)
                                        .wrapping_add(1442695040888963407);
                                    let w = (n >> 60) as usize % 2;
                                    let size = [16, 24, 64, 100, 1000, 5000, 70_000]
                                        [(n >> 33) as usize % 7];
                                    let byte = (round % 251) as u8;
                                    let p = handlers[w].malloc(size).unwrap().unwrap();
                                    fill(p, size, byte);
                                    let block = (w, p.as_ptr() as usize, size, byte);
                                    match n % 3 {
                                        0 => mailboxes[(n >> 40) as usize % at_once]
                                            .lock()
                                            .unwrap()
                                            .push(block),
                                        _ => own.push(block),
                                    }
                                    if own.len() > 24 {
                                        own.drain(..12).for_each(check);
                                    }
                                    let handed =
                                        std::mem::take(&mut *mailboxes[place].lock().unwrap());
                                    handed.into_iter().for_each(check);
                                }
                                // Half the threads leave their blocks to a later one.
                                match n % 2 {
                                    0 => own.into_iter().for_each(check),
                                    _ => mailboxes[place].lock().unwrap().extend(own),
                                }
                            });
                        });
                    }
                })
            })
            .collect();
        for place in places {
            place.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        observer.join().unwrap();
    });
    for mailbox in mailboxes {
        mailbox.into_inner().unwrap().into_iter().for_each(check);
    }
    let mut mallocs = 0;
    for h in &handlers {
        h.audit().unwrap();
        let stats = h.stats().unwrap();
        assert_eq!((stats.live_blocks, stats.live_bytes), (0, 0));
        assert_eq!(stats.frees, stats.mallocs);
        assert!(h.failure().is_none());
        mallocs += stats.mallocs;
        h.leak_check().unwrap();
    }
    assert_eq!(mallocs, (in_all * rounds) as u64);
    assert!(handlers[0].stats().unwrap().magazine_hits > 0);
}

/// A thread that ends gives the blocks in its magazines back to the policy then, not
/// at the next trim; a block it lent stays the client's, freed from another thread.
#[test]
fn a_thread_that_ends_gives_its_magazines_back_to_the_policy() {
    let h = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    // This thread's own cache first, so that the other thread's is not the primary one.
    h.free(h.malloc(16).unwrap(), 16).unwrap();
    let policy_lent = || h.link_stats().unwrap()[0].live_blocks;
    let before = policy_lent();
    let kept = std::thread::scope(|s| {
        s.spawn(|| {
            for size in [16, 48, 4096] {
                let blocks: Vec<_> = (0..8).map(|_| h.malloc(size).unwrap()).collect();
                for p in blocks {
                    h.free(p, size).unwrap();
                }
            }
            let kept = h.malloc(48).unwrap().unwrap();
            fill(kept, 48, 0x3c);
            assert!(
                policy_lent() > before + 1,
                "the thread's magazines hold blocks ahead of demand"
            );
            kept.as_ptr() as usize
        })
        .join()
        .unwrap()
    });
    assert_eq!(
        policy_lent(),
        before + 1,
        "only the client's block is still lent"
    );
    assert!(holds(ptr(kept).unwrap(), 48, 0x3c));
    h.free(ptr(kept), 48).unwrap();
    h.audit().unwrap();
    assert_eq!(h.stats().unwrap().live_blocks, 0);
}

#[test]
fn one_thread_s_peak_is_exact_across_its_magazine_hits() {
    let h = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    let blocks: Vec<_> = (0..10).map(|_| h.malloc(64).unwrap()).collect();
    for &p in &blocks {
        h.free(p, 64).unwrap();
    }
    let p = h.malloc(64).unwrap();
    let stats = h.stats().unwrap();
    assert_eq!(stats.peak_bytes, 640);
    assert_eq!(stats.live_bytes, 64);
    h.free(p, 64).unwrap();
}

/// A handler that asks its policy on every call keeps no thread caches: it counts
/// under the chain's lock. What several threads did adds up exactly, and the peak one
/// thread made is exact.
#[test]
fn a_handler_without_magazines_counts_every_thread_s_calls_under_its_lock() {
    let runtime = allocbox::Runtime::shared();
    let policy = runtime
        .load_file(allocbox_artifacts::SYSTEM.path())
        .unwrap();
    let h = allocbox::HandlerBuilder::new(runtime)
        .magazines(false)
        .link(&policy)
        .build()
        .unwrap();
    let blocks: Vec<_> = (0..10).map(|_| h.malloc(64).unwrap()).collect();
    for &p in &blocks {
        h.free(p, 64).unwrap();
    }
    let kept = taken_on_another_thread(&h, 32);
    let stats = h.stats().unwrap();
    assert_eq!(stats.peak_bytes, 640);
    assert_eq!((stats.mallocs, stats.frees), (12, 11));
    assert_eq!((stats.live_blocks, stats.live_bytes), (1, 32));
    assert_eq!(stats.magazine_hits, 0);
    h.free(ptr(kept), 32).unwrap();
    let stats = h.stats().unwrap();
    assert_eq!(
        (stats.frees, stats.live_blocks, stats.live_bytes),
        (12, 0, 0)
    );
    h.audit().unwrap();
}

/// The first thread to use a handler owns the cache found by its thread pointer. Once
/// that thread has exited, its blocks are still freed from other threads (a double free
/// still caught), later threads are served, its magazines still flush, and nothing leaks.
#[test]
fn the_handler_goes_on_after_its_first_thread_exits() {
    let h = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    let first = taken_on_another_thread(&h, 48);
    for _ in 0..4 {
        std::thread::scope(|s| {
            s.spawn(|| {
                for size in [16, 48, 4096, 65536] {
                    let p = h.malloc(size).unwrap().unwrap();
                    fill(p, size, 0x5a);
                    assert!(holds(p, size, 0x5a));
                    h.free(Some(p), size).unwrap();
                }
            });
        });
    }
    assert!(holds(ptr(first).unwrap(), 48, 0x3c));
    h.free(ptr(first), 48).unwrap();
    assert!(matches!(
        h.free(ptr(first), 48),
        Err(Error::Client(ClientError::DoubleFree { .. }))
    ));
    h.trim().unwrap();
    h.audit().unwrap();
    let stats = h.stats().unwrap();
    assert_eq!((stats.live_blocks, stats.live_bytes), (0, 0));
    // Calls are counted, the refused double free among them.
    assert_eq!(stats.frees, stats.mallocs + 1);
    h.leak_check().unwrap();
}

/// The fast path the NumPy bridge inlines (`malloc_from_magazine`, `free_to_magazine`)
/// serves the first thread's hits and keeps every client check: a wrong size is
/// corrected from the record, and a second free is left to `free`, which names it.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[test]
fn the_fast_path_serves_hits_and_leaves_client_errors_to_be_named() {
    let h = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    // Through the full path first, so that the magazine for 16 bytes holds blocks.
    let warm = h.malloc(16).unwrap();
    h.free(warm, 16).unwrap();
    let p = h.malloc_from_magazine(16).expect("a hit on the fast path");
    fill(p, 16, 0x11);
    assert!(holds(p, 16, 0x11));
    assert_eq!(h.block_size(p), Some(16));
    assert!(h.free_to_magazine(p, 24), "a wrong size said is corrected");
    assert_eq!(h.stats().unwrap().size_corrections, 1);
    assert!(
        !h.free_to_magazine(p, 16),
        "not lent any more: left to `free`"
    );
    assert!(matches!(
        h.free(Some(p), 16),
        Err(Error::Client(ClientError::DoubleFree { .. }))
    ));
    // Beyond the fast path (a mid size): nothing happens, and `malloc` serves it.
    assert_eq!(h.malloc_from_magazine(4096), None);
    let mid = h.malloc(4096).unwrap();
    assert!(!h.free_to_magazine(mid.unwrap(), 4096));
    h.free(mid, 4096).unwrap();
    h.audit().unwrap();
    let stats = h.stats().unwrap();
    assert_eq!((stats.mallocs, stats.live_blocks), (3, 0));
    assert!(stats.magazine_hits >= 1);
    h.trim().unwrap();
    h.leak_check().unwrap();
}
