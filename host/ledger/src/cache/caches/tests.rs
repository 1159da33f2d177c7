//! The caches' lifecycle with real threads: thread exits, slot reuse, frees across
//! threads, forks (Miri and ThreadSanitizer run these too).

use super::*;
use crate::cache::{MAGAZINES_THREAD_BYTES, Reach};

const SIZE: u64 = 16;

/// Books that keep what thread caches give back.
#[derive(Debug, Default)]
struct GivenBack {
    cached: Vec<u64>,
    lent: Vec<u64>,
}

impl Books for GivenBack {
    fn thread_ended(locked: &mut Locked<'_, Self>, cached: Vec<(u64, Vec<u64>)>, lent: Vec<u64>) {
        locked
            .cached
            .extend(cached.into_iter().flat_map(|(_, blocks)| blocks));
        locked.lent.extend(lent);
    }
}

/// On the calling thread: `blocks` into its magazine, the last one lent.
fn keep_and_lend_last(caches: &Caches<GivenBack>, blocks: &[u64]) {
    let mut mine = caches.mine();
    let mut books = caches.lock().unwrap();
    let mut cache = books.own(&mut mine);
    for &block in blocks {
        assert!(cache.keep(block, SIZE));
    }
    assert_eq!(cache.take::<false>(SIZE), blocks.last().copied());
}

#[test]
fn a_thread_that_ends_gives_its_magazines_and_its_lent_blocks_back() {
    let caches = Caches::new(
        GivenBack::default(),
        Some(crate::cache::MAGAZINE_DEPTH),
        Duration::from_secs(1),
    );
    // Joined: a scope's end waits for the thread's closure, not its exit, where
    // the thread-local destructor that gives the cache back runs.
    std::thread::scope(|s| {
        s.spawn(|| keep_and_lend_last(&caches, &[0x1000, 0x2000, 0x3000]))
            .join()
            .unwrap();
    });
    let books = caches.lock().unwrap();
    let mut cached = books.cached.clone();
    cached.sort_unstable();
    assert_eq!(
        (cached, books.lent.clone()),
        (vec![0x1000, 0x2000], vec![0x3000])
    );
}

#[test]
fn a_thread_that_inherits_an_ended_threads_slot_starts_empty_and_is_given_back_too() {
    let caches = Caches::new(
        GivenBack::default(),
        Some(crate::cache::MAGAZINE_DEPTH),
        Duration::from_secs(1),
    );
    // This thread keeps its slot; the others' slots are reused as they end.
    keep_and_lend_last(&caches, &[0x100]);
    for round in 0..3u64 {
        let base = 0x10_000 * (round + 1);
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut mine = caches.mine();
                let mut books = caches.lock().unwrap();
                let cache = books.own(&mut mine);
                let held = cache.magazines.as_ref().unwrap().cached_bytes;
                assert_eq!((held, cache.lent.iter().count()), (0, 0), "round {round}");
                drop(cache);
                drop(books);
                keep_and_lend_last(&caches, &[base, base + 0x1000]);
            })
            .join()
            .unwrap();
        });
    }
    let books = caches.lock().unwrap();
    assert_eq!(books.cached.len(), 3, "one cached block per ended thread");
    assert_eq!(books.lent.len(), 3, "one lent block per ended thread");
    assert!(
        !books.cached.contains(&0x100),
        "this thread's cache is its own"
    );
}

/// Threads take blocks on their fast paths (refilling under the lock when empty),
/// hand each to another thread, which frees it into the cache that lent it (a
/// claim), while another thread claims every cache in turn; then the threads end.
/// Every block made is in exactly one place at the end. Miri and ThreadSanitizer
/// run it (`.ci/verify`).
#[test]
fn threads_freeing_each_others_blocks_keep_every_block_in_one_place() {
    const THREADS: u64 = 4;
    let rounds: u64 = if cfg!(miri) { 40 } else { 3000 };
    let caches = Caches::new(
        GivenBack::default(),
        Some(crate::cache::MAGAZINE_DEPTH),
        Duration::from_secs(1),
    );
    let mailboxes: Vec<std::sync::Mutex<Vec<(u64, CacheId)>>> =
        (0..THREADS).map(|_| Default::default()).collect();
    let stop = AtomicBool::new(false);
    // Free `block`, lent by the cache `owner`, from the calling thread.
    let free = |mine: &mut Mine<'_>, block: u64, owner: CacheId| {
        let mut books = caches.lock().unwrap();
        let mut cache = books.cache_of(mine, owner).unwrap();
        match cache.lent.remove(block) {
            Some(size) if cache.keep(block, size) => {}
            Some(_) => {
                drop(cache);
                books.cached.push(block);
            }
            // Its thread ended: the books hold it now.
            None => {
                drop(cache);
                let at = books.lent.iter().position(|&b| b == block);
                books
                    .lent
                    .swap_remove(at.expect("a lent block is somewhere"));
                books.cached.push(block);
            }
        }
    };
    let made: Vec<u64> = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let mut books = caches.lock().unwrap();
                for slot in books.slots() {
                    let cache = books.claim(slot).unwrap();
                    let magazines = cache.magazines.as_ref().unwrap();
                    assert!(magazines.cached_bytes <= MAGAZINES_THREAD_BYTES);
                }
                drop(books);
                std::thread::yield_now();
            }
        });
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (caches, mailboxes, free) = (&caches, &mailboxes, &free);
                s.spawn(move || {
                    let mut mine = caches.mine();
                    let mut made = Vec::new();
                    for round in 0..rounds {
                        let taken = mine.with(|c| c.take::<{ Reach::FULL }>(SIZE));
                        // A miss refills under the lock, unless a free from
                        // another thread refilled the magazine meanwhile.
                        let block = taken.unwrap_or_else(|| {
                            let mut books = caches.lock().unwrap();
                            let mut cache = books.own(&mut mine);
                            if let Some(block) = cache.take::<{ Reach::FULL }>(SIZE) {
                                return block;
                            }
                            let fresh = ((t + 1) << 40) | ((made.len() as u64 + 1) << 4);
                            made.push(fresh);
                            assert!(cache.keep(fresh, SIZE));
                            cache.take::<{ Reach::FULL }>(SIZE).unwrap()
                        });
                        let to = ((t + 1 + round % (THREADS - 1)) % THREADS) as usize;
                        mailboxes[to].lock().unwrap().push((block, mine.id()));
                        let handed = std::mem::take(&mut *mailboxes[t as usize].lock().unwrap());
                        for (block, owner) in handed {
                            free(&mut mine, block, owner);
                        }
                    }
                    made
                })
            })
            .collect();
        // Joined, so that each thread's exit has given its cache back.
        let made = workers.into_iter().map(|w| w.join()).collect::<Vec<_>>();
        stop.store(true, Ordering::Relaxed);
        made.into_iter()
            .flat_map(|m| m.expect("a thread panicked"))
            .collect()
    });
    let mut mine = caches.mine();
    for mailbox in &mailboxes {
        for (block, owner) in std::mem::take(&mut *mailbox.lock().unwrap()) {
            free(&mut mine, block, owner);
        }
    }
    let mut books = caches.lock().unwrap();
    assert!(books.lent.is_empty(), "every block was freed");
    let mut found = books.cached.clone();
    for slot in books.slots() {
        let mut cache = books.claim(slot).unwrap();
        assert_eq!(cache.lent.iter().count(), 0, "every block was freed");
        found.extend(
            cache
                .magazines
                .as_mut()
                .unwrap()
                .drain()
                .into_iter()
                .flat_map(|(_, b)| b),
        );
    }
    found.sort_unstable();
    let mut made = made;
    made.sort_unstable();
    assert_eq!(found, made, "a block was lost or is in two places");
}

/// Found by `tests/fork.rs` in CI, once in thousands of forks: an owner that met the
/// fork's claim on its fast path was forked before it stepped back, and the child's
/// claim of its cache waited for good.
#[test]
fn a_child_forked_as_an_owner_met_the_fork_s_claim_gives_that_owner_s_cache_back() {
    let caches = Caches::new(
        GivenBack::default(),
        Some(crate::cache::MAGAZINE_DEPTH),
        Duration::from_secs(1),
    );
    let (kept, keep_alive) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    std::thread::scope(|s| {
        let owner = s.spawn(|| {
            keep_and_lend_last(&caches, &[0x1000, 0x2000]);
            kept.wait();
            keep_alive.wait();
        });
        kept.wait();
        // Not a real fork, which would leave this test's harness threads behind.
        let held = Forkable::before_fork(caches.clone());
        let [slot] = caches.slots().collect::<Vec<_>>()[..] else {
            panic!("the owner's is the only cache");
        };
        slot.step_on_as_owner();
        held.after_fork(true);
        let given_back = caches
            .lock()
            .map(|books| (books.cached.clone(), books.lent.clone()));
        keep_alive.wait();
        owner.join().unwrap();
        assert_eq!(given_back, Ok((vec![0x1000], vec![0x2000])));
    });
}

#[test]
#[cfg_attr(miri, ignore = "four million yields")]
fn a_claim_on_a_cache_whose_owner_stopped_on_its_fast_path_ends_stuck() {
    let caches = Caches::new(
        GivenBack::default(),
        Some(crate::cache::MAGAZINE_DEPTH),
        Duration::from_secs(1),
    );
    let mut mine = caches.mine();
    let id = mine.id();
    // As an owner whose thread stopped mid-path would: in, and never out.
    std::mem::forget(mine.cache());
    let mut books = caches.lock().unwrap();
    let slot = books.slots().find(|s| s.id == id).unwrap();
    assert_eq!(
        books.claim(slot).map(drop),
        Err(Unreachable::Stuck { cache: id })
    );
}
