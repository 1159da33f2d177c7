//! Instances per thread (0.2.0 `sharding`): each thread's requests go to a chain of its
//! own, and every block goes back to the chain that lent it, whichever thread frees it.

use std::ptr::NonNull;
use std::sync::{Barrier, mpsc};

use allocbox::{ClientError, Error, HandlerBuilder, PolicyHandler, Runtime, ShardedHandler};
use allocbox_artifacts::Guest;

use super::support::*;

fn sharded(guest: &Guest, most: usize) -> ShardedHandler {
    HandlerBuilder::new(Runtime::shared())
        .link(&load(guest))
        .build_sharded(most)
        .unwrap_or_else(|e| panic!("starting {}: {e}", guest.name))
}

fn ptr(addr: usize) -> NonNull<u8> {
    NonNull::new(addr as *mut u8).unwrap()
}

/// Each started shard's `(mallocs, frees, live blocks)`, read from the shard itself:
/// nothing queued for it is given back by reading.
fn per_shard(h: &ShardedHandler) -> Vec<(u64, u64, u64)> {
    h.started()
        .map(|shard| {
            let s = shard.stats().unwrap();
            (s.mallocs, s.frees, s.live_blocks)
        })
        .collect()
}

#[test]
fn shipped_policies_in_every_language_that_keep_per_instance_state_say_they_are_shardable() {
    use allocbox_artifacts::{ALIGNED, ARENA, BINNING, BUDDY, BUMP, SIZE_CLASSES, SLAB, SYSTEM};
    // Rust components say so through the SDK; the C, Zig, Go and AssemblyScript core
    // modules by exporting `sharding@0.2.0#shardable` themselves.
    for guest in [
        SYSTEM,
        SIZE_CLASSES,
        ARENA,
        ALIGNED,
        BINNING,
        BUDDY,
        BUMP,
        SLAB,
    ] {
        assert!(
            handler(&guest, &[]).shardable(),
            "{} ({})",
            guest.name,
            guest.language
        );
    }
    assert!(
        !handler(&allocbox_artifacts::QUOTA, &[]).shardable(),
        "a policy that does not say so is one instance"
    );
}

/// The core modules of other languages under a chain per thread: each thread's blocks,
/// small ones from the policy's own bins, arenas, chunks or slabs and large ones passed
/// upstream, are freed by the other thread, and each goes back to the instance that lent
/// it, its bytes untouched until then.
#[test]
fn core_module_policies_run_a_chain_per_thread_and_take_back_blocks_freed_on_the_other() {
    use allocbox_artifacts::{BINNING, BUDDY, BUMP, SLAB};
    const SIZES: [usize; 7] = [16, 48, 64, 200, 4096, 300 << 10, 2 << 20];
    const BLOCKS: usize = 3 * SIZES.len();
    for guest in [BINNING, BUDDY, BUMP, SLAB] {
        let h = sharded(&guest, 2);
        assert_eq!(h.shard_count(), 2, "{}", guest.name);
        let (to_b, b_gets) = mpsc::channel::<Vec<usize>>();
        let (to_a, a_gets) = mpsc::channel::<Vec<usize>>();
        let h_ref = &h;
        let name = guest.name;
        // Each thread fills its own blocks with `mine` and finds `theirs` in the other's.
        let thread = |mine: u8,
                      theirs: u8,
                      send: mpsc::Sender<Vec<usize>>,
                      receive: mpsc::Receiver<Vec<usize>>| {
            move || {
                let h = h_ref;
                let made = (0..BLOCKS)
                    .map(|i| {
                        let size = SIZES[i % SIZES.len()];
                        let p = h.malloc(size).unwrap().unwrap();
                        fill(p, size, mine);
                        p.as_ptr() as usize
                    })
                    .collect();
                send.send(made).unwrap();
                for (i, addr) in receive.recv().unwrap().into_iter().enumerate() {
                    let size = SIZES[i % SIZES.len()];
                    assert!(holds(ptr(addr), size, theirs), "{name}: the maker's bytes");
                    h.free(Some(ptr(addr)), size).unwrap();
                }
            }
        };
        std::thread::scope(|s| {
            let a = s.spawn(thread(0x5a, 0xa5, to_b, a_gets));
            let b = s.spawn(thread(0xa5, 0x5a, to_a, b_gets));
            a.join().unwrap();
            b.join().unwrap();
        });
        assert_eq!(h.started().count(), 2, "{name}: a chain per thread");
        assert_eq!(h.live_blocks().unwrap(), [], "{name}");
        for (index, shard) in per_shard(&h).into_iter().enumerate() {
            let made = BLOCKS as u64;
            assert_eq!(
                shard,
                (made, made, 0),
                "{name}: shard {index} took back its own"
            );
        }
        for shard in h.started() {
            shard.audit().unwrap();
            // Each instance's counters are its own: each took memory from its own upstream.
            let counters = &shard.link_stats().unwrap()[0].counters;
            let (taken, n) = &counters[0];
            assert!(taken.ends_with("-taken") && *n >= 1, "{name}: {counters:?}");
        }
        h.leak_check().unwrap();
    }
}

#[test]
fn a_chain_with_a_policy_that_is_not_shardable_is_one_instance() {
    let h = HandlerBuilder::new(Runtime::shared())
        .link(&load(&allocbox_artifacts::SYSTEM))
        .link(&load(&allocbox_artifacts::QUOTA))
        .build_sharded(4)
        .unwrap();
    assert_eq!(h.shard_count(), 1);
    let blocks: Vec<usize> = std::thread::scope(|s| {
        (0..3)
            .map(|_| s.spawn(|| h.malloc(64).unwrap().unwrap().as_ptr() as usize))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect()
    });
    assert_eq!(h.started().count(), 1, "every thread shares the one chain");
    for addr in blocks {
        h.free(Some(ptr(addr)), 64).unwrap();
    }
    h.leak_check().unwrap();
}

#[test]
fn threads_get_chains_of_their_own_up_to_the_most_then_share_them() {
    let h = sharded(&allocbox_artifacts::SIZE_CLASSES, 3);
    assert_eq!(h.shard_count(), 3);
    let all_there = Barrier::new(5);
    std::thread::scope(|s| {
        for _ in 0..5 {
            s.spawn(|| {
                let p = h.malloc(48).unwrap();
                all_there.wait();
                h.free(p, 48).unwrap();
            });
        }
    });
    assert_eq!(h.started().count(), 3);
    for (index, (mallocs, frees, live)) in per_shard(&h).into_iter().enumerate() {
        assert!(mallocs >= 1, "shard {index} served a thread");
        assert_eq!((frees, live), (mallocs, 0), "shard {index}");
    }
    h.leak_check().unwrap();
}

/// The case: one thread allocates, another frees, 100,000 blocks; every block
/// goes back to the chain that made it, none at the freeing thread's, and nothing is
/// left queued once both threads have ended, with no one reading the statistics.
#[test]
fn a_hundred_thousand_blocks_freed_on_another_thread_all_go_back_to_their_maker() {
    const BLOCKS: usize = 100_000;
    let h = sharded(&allocbox_artifacts::SYSTEM, 2);
    let (send, receive) = mpsc::sync_channel::<Vec<usize>>(16);
    let h_ref = &h;
    std::thread::scope(|s| {
        let maker = s.spawn(move || {
            let h = h_ref;
            for _ in 0..BLOCKS / 1000 {
                let batch = (0..1000)
                    .map(|i| {
                        let size = 16 + i % 200;
                        let p = h.malloc(size).unwrap().unwrap();
                        p.as_ptr() as usize
                    })
                    .collect();
                send.send(batch).unwrap();
            }
            // The maker ends first: what is freed after this waits in its queue.
        });
        let freer = s.spawn(move || {
            let h = h_ref;
            // The freeing thread has a chain of its own before the first free.
            let own = h.malloc(8).unwrap();
            h.free(own, 8).unwrap();
            for batch in receive {
                for (i, addr) in batch.into_iter().enumerate() {
                    h.free(Some(ptr(addr)), 16 + i % 200).unwrap();
                }
            }
        });
        // Joined, not left to the scope's end: a join waits for the thread's exit,
        // where what it queued is given back; the scope waits only for its closure.
        maker.join().unwrap();
        freer.join().unwrap();
    });
    let shards = per_shard(&h);
    let maker = shards
        .iter()
        .position(|&(mallocs, ..)| mallocs == BLOCKS as u64)
        .expect("one shard made every block");
    assert_eq!(
        shards[maker],
        (BLOCKS as u64, BLOCKS as u64, 0),
        "every block back at its maker, nothing left queued"
    );
    assert_eq!(shards[1 - maker], (1, 1, 0), "none at the freeing thread's");
    for shard in h.started() {
        shard.audit().unwrap();
    }
    h.leak_check().unwrap();
}

#[test]
fn a_free_from_another_thread_waits_for_the_maker_s_next_call() {
    let h = sharded(&allocbox_artifacts::SYSTEM, 2);
    let (to_freer, freer_gets) = mpsc::channel::<usize>();
    let (to_maker, maker_gets) = mpsc::channel::<()>();
    let (maker_done, freer_waits) = mpsc::channel::<()>();
    let h_ref = &h;
    std::thread::scope(|s| {
        s.spawn(move || {
            let h = h_ref;
            let p = h.malloc(100).unwrap().unwrap();
            to_freer.send(p.as_ptr() as usize).unwrap();
            maker_gets.recv().unwrap();
            // The maker's shard is the one still lending a block: the other's thread
            // freed its own at once.
            let shards = per_shard(h);
            let maker = shards.iter().position(|&(.., live)| live == 1).unwrap();
            assert_eq!(shards[maker], (1, 0, 1), "queued, not yet given back");
            // The maker's next call gives it back first.
            let q = h.malloc(100).unwrap();
            assert_eq!(per_shard(h)[maker], (2, 1, 1));
            h.free(q, 100).unwrap();
            assert_eq!(h.live_blocks().unwrap(), [], "the client holds nothing");
            maker_done.send(()).unwrap();
        });
        s.spawn(move || {
            let h = h_ref;
            let own = h.malloc(8).unwrap();
            h.free(own, 8).unwrap();
            let addr = freer_gets.recv().unwrap();
            h.free(Some(ptr(addr)), 100).unwrap();
            // The same block again, while its free waits in the queue.
            let err = h.free(Some(ptr(addr)), 100).unwrap_err();
            assert!(
                matches!(err, Error::Client(ClientError::DoubleFree { .. })),
                "{err}"
            );
            to_maker.send(()).unwrap();
            // Alive until the maker has looked: a thread's end gives back every queue.
            freer_waits.recv().unwrap();
        });
    });
    let stats = h.stats().unwrap();
    assert_eq!((stats.mallocs, stats.frees, stats.live_blocks), (3, 3, 0));
    h.leak_check().unwrap();
}

#[test]
fn a_wrong_size_from_another_thread_is_corrected_by_the_maker() {
    let h = sharded(&allocbox_artifacts::SIZE_CLASSES, 2);
    let addr = std::thread::scope(|s| {
        s.spawn(|| h.malloc(40).unwrap().unwrap().as_ptr() as usize)
            .join()
            .unwrap()
    });
    std::thread::scope(|s| {
        s.spawn(|| {
            let own = h.malloc(8).unwrap();
            h.free(own, 8).unwrap();
            assert_eq!(
                h.free_unsized(ptr(addr)).unwrap(),
                40,
                "the size it was lent with"
            );
        });
    });
    let addr = std::thread::scope(|s| {
        s.spawn(|| h.malloc(40).unwrap().unwrap().as_ptr() as usize)
            .join()
            .unwrap()
    });
    h.free(Some(ptr(addr)), 24).unwrap();
    let stats = h.stats().unwrap();
    assert_eq!(stats.size_corrections, 1);
    assert_eq!(stats.live_blocks, 0);
    h.leak_check().unwrap();
}

#[test]
fn realloc_on_another_thread_stays_with_the_block_s_maker() {
    let h = sharded(&allocbox_artifacts::SIZE_CLASSES, 2);
    let addr = std::thread::scope(|s| {
        s.spawn(|| {
            let p = h.malloc(64).unwrap().unwrap();
            fill(p, 64, 0x5a);
            p.as_ptr() as usize
        })
        .join()
        .unwrap()
    });
    let moved = std::thread::scope(|s| {
        s.spawn(|| {
            let own = h.malloc(8).unwrap();
            h.free(own, 8).unwrap();
            let q = h.realloc(Some(ptr(addr)), 4096).unwrap().unwrap();
            assert!(holds(q, 64, 0x5a), "the old bytes kept");
            q.as_ptr() as usize
        })
        .join()
        .unwrap()
    });
    let shards = per_shard(&h);
    assert_eq!(shards[0].2, 1, "the maker lends the resized block");
    assert_eq!(shards[1].2, 0);
    h.free(Some(ptr(moved)), 4096).unwrap();
    h.leak_check().unwrap();
}

#[test]
fn a_thread_that_only_frees_starts_no_instance_and_its_frees_wait_for_the_maker() {
    let h = sharded(&allocbox_artifacts::SYSTEM, 4);
    let addr = std::thread::scope(|s| {
        s.spawn(|| h.malloc(72).unwrap().unwrap().as_ptr() as usize)
            .join()
            .unwrap()
    });
    std::thread::scope(|s| {
        s.spawn(|| assert_eq!(h.free_unsized(ptr(addr)).unwrap(), 72))
            .join()
            .unwrap()
    });
    assert_eq!(h.started().count(), 1, "only the maker's instance started");
    assert_eq!(per_shard(&h), [(1, 0, 1)], "queued for the maker");
    let stats = h.stats().unwrap();
    assert_eq!(
        (stats.frees, stats.live_blocks),
        (1, 0),
        "given back before reading"
    );
    h.leak_check().unwrap();
}

#[test]
fn the_limits_are_the_handler_s_in_all_each_instance_an_even_share() {
    let h = HandlerBuilder::new(Runtime::shared())
        .link(&load(&allocbox_artifacts::SYSTEM))
        .host_memory_limit(1 << 20)
        .build_sharded(4)
        .unwrap();
    assert_eq!(
        h.malloc(512 << 10).unwrap(),
        None,
        "a quarter of 1 MiB cannot hold 512 KiB"
    );
    let p = h.malloc(200 << 10).unwrap();
    assert!(p.is_some(), "within the share");
    h.free(p, 200 << 10).unwrap();
    h.leak_check().unwrap();
}

/// Issue 64: `check size-classes --threads 128` called the shipped policy broken, "past
/// its memory budget of 524288 bytes in `init`": its guest memory split 128 ways left an
/// instance too little to start in. Fewer instances start, each with a share it starts
/// in, and every thread is served.
#[test]
fn a_guest_memory_share_too_small_to_start_in_starts_fewer_instances_not_a_failure() {
    let h = sharded(&allocbox_artifacts::SIZE_CLASSES, 256);
    let count = h.shard_count();
    assert!((1..256).contains(&count), "{count} instances");
    let blocks: Vec<_> = std::thread::scope(|s| {
        (0..8)
            .map(|_| s.spawn(|| h.malloc(64).unwrap().unwrap().as_ptr() as usize))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect()
    });
    for block in blocks {
        h.free(Some(ptr(block)), 64).unwrap();
    }
    h.leak_check().unwrap();
    // A share that does fit is not cut: two instances of the default budget start.
    assert_eq!(
        sharded(&allocbox_artifacts::SIZE_CLASSES, 2).shard_count(),
        2
    );
}

/// Issue 65: a handler per thread answers the handler interface as one chain does:
/// the size of each block the client holds (none for one whose free is queued for its
/// chain), an audit of every chain against its table, and its chains counted.
#[test]
fn a_handler_per_thread_answers_the_handler_interface_as_one_chain_does() {
    use allocbox::gpu::Placement;
    let h = sharded(&allocbox_artifacts::SIZE_CLASSES, 2);
    let handle: &dyn PolicyHandler = &h;
    let (to_main, from_thread) = mpsc::channel::<Vec<(usize, usize)>>();
    let blocks: Vec<(usize, usize)> = [24usize, 100, 5000]
        .iter()
        .map(|&size| {
            (
                handle.malloc(size).unwrap().unwrap().as_ptr() as usize,
                size,
            )
        })
        .collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            let theirs = [48usize, 700]
                .iter()
                .map(|&size| {
                    (
                        handle.malloc(size).unwrap().unwrap().as_ptr() as usize,
                        size,
                    )
                })
                .collect();
            to_main.send(theirs).unwrap();
        });
    });
    let theirs = from_thread.recv().unwrap();
    assert_eq!(handle.instances(), 2, "one chain per thread that called it");
    assert_eq!(
        (handle.placement(), handle.keeps_magazines()),
        (Placement::Host, false)
    );
    for &(addr, size) in blocks.iter().chain(&theirs) {
        assert_eq!(handle.block_size(ptr(addr)), Some(size), "{addr:#x}");
    }
    handle
        .audit()
        .expect("every table agrees with its chain's ledger");
    // Freed on this thread, the other chain's blocks are queued for it.
    for &(addr, size) in &theirs {
        handle.free(Some(ptr(addr)), size).unwrap();
        assert_eq!(
            handle.block_size(ptr(addr)),
            None,
            "queued: the client's no more"
        );
    }
    handle.audit().expect("the queued frees given back first");
    let mut live = handle.live_blocks().unwrap();
    live.sort_unstable();
    let mut expected = blocks.clone();
    expected.sort_unstable();
    assert_eq!(live, expected);
    assert!(handle.take_client_misuse().unwrap().is_empty());
    for (addr, size) in blocks {
        handle.free(Some(ptr(addr)), size).unwrap();
    }
    handle.leak_check().unwrap();
    assert!(handle.failure().is_none());
}
