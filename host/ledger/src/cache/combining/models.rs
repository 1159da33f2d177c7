//! loom models of the combining queue: every interleaving of requests pushed, served,
//! handed off and parked, on the very code of `combining.rs`. loom fails a model that
//! deadlocks (a request parked that nobody serves or hands the queue to) or whose
//! assertions fail. Under loom one release serves one request ([`super::SERVE_AT_MOST`]),
//! so three threads reach the hand-off. Run with the claim protocol's models:
//!
//! ```text
//! RUSTFLAGS="--cfg allocbox_loom" CARGO_TARGET_DIR=target/loom \
//!     cargo test -p allocbox-ledger --lib --release models
//! ```

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use crate::cache::{Books, Caches, Locked};

#[derive(Debug, Default)]
struct Count(usize);

impl Books for Count {
    fn thread_ended(_: &mut Locked<'_, Self>, _: Vec<(u64, Vec<u64>)>, _: Vec<u64>) {}
}

fn caches() -> std::sync::Arc<Caches<Count>> {
    Caches::new(Count::default(), None, Duration::from_secs(1))
}

/// Count one request and answer with its place in the order served. It gives way
/// while it holds the books: loom switches threads only where one may, and a request
/// that finds the books held is the case the queue is for.
fn ticket(books: &mut Locked<'_, Count>) -> usize {
    books.0 += 1;
    thread::yield_now();
    books.0
}

/// `threads` threads and this one each make one request; every answer is its own.
fn every_request_served_once(threads: usize) {
    let caches = Arc::new(caches());
    let others: Vec<_> = (0..threads)
        .map(|_| {
            let caches = Arc::clone(&caches);
            thread::spawn(move || caches.combine(ticket).unwrap())
        })
        .collect();
    let mut answers = vec![caches.combine(ticket).unwrap()];
    answers.extend(others.into_iter().map(|t| t.join().unwrap()));
    answers.sort_unstable();
    assert_eq!(answers, (1..=threads + 1).collect::<Vec<_>>());
    assert_eq!(caches.lock().unwrap().0, threads + 1);
    assert!(!caches.requests_waiting());
}

#[test]
fn models_two_threads_requests_are_each_served_once() {
    loom::model(|| every_request_served_once(1));
}

#[test]
fn models_three_threads_requests_are_served_past_a_hand_off() {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(3);
    model.check(|| every_request_served_once(2));
}

#[test]
fn models_a_request_queued_behind_a_plain_lock_is_served_at_its_release() {
    loom::model(|| {
        let caches = Arc::new(caches());
        let requester = {
            let caches = Arc::clone(&caches);
            thread::spawn(move || caches.combine(ticket).unwrap())
        };
        let mut books = caches.lock().unwrap();
        books.0 += 10;
        thread::yield_now();
        drop(books);
        let answer = requester.join().unwrap();
        assert!(
            answer == 1 || answer == 11,
            "served before or after the lock: {answer}"
        );
        assert_eq!(caches.lock().unwrap().0, 11);
    });
}
