//! The combining queue with real threads (Miri and ThreadSanitizer run these too).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::SERVE_AT_MOST;
use crate::cache::{Books, Caches, Locked};

/// Books that count the requests run on them and note which thread ran each.
#[derive(Debug, Default)]
struct Tally {
    runs: usize,
    ran_by: Vec<std::thread::ThreadId>,
}

impl Books for Tally {
    fn thread_ended(_: &mut Locked<'_, Self>, _: Vec<(u64, Vec<u64>)>, _: Vec<u64>) {}
}

fn caches() -> std::sync::Arc<Caches<Tally>> {
    Caches::new(Tally::default(), None, Duration::from_secs(1))
}

/// One request: count it, and answer with its place in the order served.
fn ticket(books: &mut Locked<'_, Tally>) -> usize {
    books.runs += 1;
    books.ran_by.push(std::thread::current().id());
    books.runs
}

/// Wait, holding the books, until `count` requests are queued.
fn until_queued(books: &Locked<'_, Tally>, count: usize) {
    while books.caches().waiting.count() < count {
        std::thread::yield_now();
    }
}

fn rounds(full: usize) -> usize {
    if cfg!(miri) { full.min(20) } else { full }
}

#[test]
fn requests_from_many_threads_are_each_served_once_with_their_own_answer() {
    const THREADS: usize = 16;
    let per_thread = rounds(2000);
    let caches = caches();
    let mut tickets: Vec<usize> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| {
                    (0..per_thread)
                        .map(|_| caches.combine(ticket).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    tickets.sort_unstable();
    let all: Vec<usize> = (1..=THREADS * per_thread).collect();
    assert_eq!(
        tickets, all,
        "a request was lost, run twice or answered another's"
    );
    assert!(!caches.requests_waiting());
}

/// Hold the books with the plain lock on this thread while `count` requests of other
/// threads queue, then let go; returns when every one has its answer.
fn queued_behind_the_plain_lock(caches: &Caches<Tally>, count: usize) {
    std::thread::scope(|s| {
        let books = caches.lock().unwrap();
        let waiters: Vec<_> = (0..count)
            .map(|_| s.spawn(|| caches.combine(ticket).unwrap()))
            .collect();
        until_queued(&books, count);
        drop(books);
        for w in waiters {
            w.join().unwrap();
        }
    });
}

#[test]
fn a_holder_of_the_plain_lock_serves_what_queued_while_it_held_it() {
    const QUEUED: usize = 4;
    let caches = caches();
    let holder = std::thread::current().id();
    queued_behind_the_plain_lock(&caches, QUEUED);
    let books = caches.lock().unwrap();
    assert_eq!(books.runs, QUEUED);
    assert!(
        books.ran_by.iter().all(|&t| t == holder),
        "its release served them all"
    );
}

#[test]
fn a_request_that_panics_comes_back_to_its_own_thread_and_the_queue_goes_on() {
    const QUEUED: usize = 3;
    let caches = caches();
    std::thread::scope(|s| {
        let books = caches.lock().unwrap();
        let panicking = s.spawn(|| {
            catch_unwind(AssertUnwindSafe(|| {
                caches.combine(|_: &mut Locked<'_, Tally>| -> usize { panic!("planted") })
            }))
        });
        until_queued(&books, 1);
        let others: Vec<_> = (0..QUEUED)
            .map(|_| s.spawn(|| caches.combine(ticket).unwrap()))
            .collect();
        until_queued(&books, 1 + QUEUED);
        drop(books);
        let panic = panicking
            .join()
            .unwrap()
            .expect_err("the request's own panic");
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"planted"));
        let mut served: Vec<usize> = others.into_iter().map(|w| w.join().unwrap()).collect();
        served.sort_unstable();
        assert_eq!(served, [1, 2, 3]);
    });
}

#[test]
fn a_serving_thread_that_dies_mid_queue_leaves_every_queued_request_served() {
    const QUEUED: usize = 5;
    let caches = caches();
    let started = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let (caches, started) = (&caches, &started);
        let server = s.spawn(move || {
            catch_unwind(AssertUnwindSafe(|| {
                caches.combine(|books: &mut Locked<'_, Tally>| {
                    started.store(1, Ordering::Release);
                    until_queued(books, QUEUED);
                    panic!("the serving thread dies")
                })
            }))
        });
        while started.load(Ordering::Acquire) == 0 {
            std::thread::yield_now();
        }
        let waiters: Vec<_> = (0..QUEUED)
            .map(|_| s.spawn(move || caches.combine(ticket).unwrap()))
            .collect();
        assert!(server.join().unwrap().is_err(), "its own panic reached it");
        let mut served: Vec<usize> = waiters.into_iter().map(|w| w.join().unwrap()).collect();
        served.sort_unstable();
        assert_eq!(served, (1..=QUEUED).collect::<Vec<_>>());
    });
}

#[test]
fn past_its_bound_a_release_hands_the_rest_of_the_queue_to_a_waiting_thread() {
    let queued = if cfg!(miri) {
        SERVE_AT_MOST + 2
    } else {
        SERVE_AT_MOST + 16
    };
    let caches = caches();
    let holder = std::thread::current().id();
    queued_behind_the_plain_lock(&caches, queued);
    let books = caches.lock().unwrap();
    assert_eq!(books.runs, queued);
    let by_holder = books.ran_by.iter().filter(|&&t| t == holder).count();
    assert_eq!(
        by_holder, SERVE_AT_MOST,
        "one release serves at most its bound"
    );
}
