//! The shard each thread was given, one per handler, and giving that shard its queued
//! frees when the thread ends.

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use super::Shared;

/// The shards the calling thread was given, one per handler.
#[derive(Default)]
struct Seated(RefCell<Vec<(Weak<Shared>, usize)>>);

impl Drop for Seated {
    fn drop(&mut self) {
        // Every shard's queue, not only this thread's shard's: the frees this
        // thread queued for others are given back before it is gone, whether or
        // not their threads call again.
        for (shared, _) in self.0.take() {
            if let Some(shared) = shared.upgrade() {
                shared.give_back_all_queued();
            }
        }
    }
}

std::thread_local! {
    static SEATED: Seated = Seated::default();
}

/// The shard of `shared` the calling thread was given, if any yet.
#[inline]
pub(super) fn seat(shared: &Arc<Shared>) -> Option<usize> {
    SEATED
        .try_with(|seated| {
            let seated = seated.0.borrow();
            let mine = Arc::as_ptr(shared);
            seated
                .iter()
                .find(|(s, _)| std::ptr::eq(s.as_ptr(), mine))
                .map(|&(_, index)| index)
        })
        .ok()
        .flatten()
}

/// The calling thread has shard `index` of `shared` from now on; give every shard
/// its queued frees when the thread ends.
pub(super) fn remember(shared: &Arc<Shared>, index: usize) {
    // A thread already ending is not remembered: it calls `first_seat` again if it
    // calls at all, and what it queues waits for the shard's next call or a read
    // of the statistics. Nothing is lost.
    let _ = SEATED.try_with(|seated| {
        let mut seated = seated.0.borrow_mut();
        seated.retain(|(s, _)| s.strong_count() > 0);
        seated.push((Arc::downgrade(shared), index));
    });
}
