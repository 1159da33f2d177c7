//! A link that fails: its failure recorded once and carried up beside the answer, and
//! the memory it holds given back once nothing above depends on it (at the stop, every
//! upstream block and mapped region no client block lies in; the rest once its client
//! lets go).

use std::sync::Arc;

use super::{Link, Upstream};
use crate::clock::Deadline;
use crate::error::Error;

impl Link {
    /// Stop this link and every link below it because the chain failed at `cause`: no
    /// new request will reach them, so each gives its upstream memory back once its
    /// client holds nothing, rather than keeping caches no one can use. Bottom first, so
    /// that the give-backs of a link above reach a stopped link, not a guest.
    pub(crate) fn retire(&mut self, cause: &Arc<Error>) {
        if let Upstream::Policy(next) = &mut self.store.data_mut().upstream {
            next.retire(cause);
        }
        if self.poisoned.is_none() {
            // The chain knows why: nothing to report.
            self.stop(Arc::new(Error::Poisoned {
                policy: cause.policy().unwrap_or("?").into(),
                cause: cause.clone(),
            }));
        } else {
            // Stopped earlier, over a link that was still running: its give-backs waited
            // for that link to stop too.
            self.release(true);
        }
        self.store.data_mut().unreported = None;
    }

    /// Stop the link for its own failure, which its caller is told of.
    pub(crate) fn poison(&mut self, cause: Error) {
        if self.poisoned.is_some() {
            return;
        }
        log::warn!("{cause}");
        let cause = Arc::new(cause);
        self.store
            .data_mut()
            .unreported
            .get_or_insert(cause.clone());
        self.stop(cause);
    }

    /// Stop the link for good. Its upstream blocks are given back once its client has
    /// given back everything it holds.
    pub(super) fn stop(&mut self, cause: Arc<Error>) {
        self.poisoned = Some(cause);
        // Held-back memory may lie under the client's old block: it stays on the dead
        // link's books and is released with the rest once the client lets go.
        self.store.data_mut().transit.end();
        self.store.data_mut().mapped.end_transit(false);
        self.release(true);
    }

    /// The failure of this link, or of one below it, that happened since the last time
    /// this was asked: the caller of this link acts on it.
    pub(crate) fn take_unreported(&mut self) -> Option<Arc<Error>> {
        self.store.data_mut().unreported.take()
    }

    /// A dead link whose client holds nothing returns all its upstream memory.
    pub(super) fn release_if_done(&mut self) {
        self.release(false);
    }

    /// A dead link gives its upstream memory back once the link below is stopped too
    /// (the chain stops every link when one fails): a give-back never calls a guest that
    /// no embedder's call is waiting for, so it needs no deadline, and a running link
    /// below is never timed out for a link above. All of it once its client holds
    /// nothing; with `clear_of_lent`, while its client still holds blocks, every upstream
    /// block none of them lies in (what the policy cached, or kept of a request it
    /// refused), so a stopped policy holds no more than its client's blocks need. That is
    /// a range query per upstream block: made once, when the link stops.
    pub(super) fn release(&mut self, clear_of_lent: bool) {
        let whole = self.lent().is_empty();
        if self.poisoned.is_none() || !(whole || clear_of_lent) {
            return;
        }
        let state = self.store.data_mut();
        if let Upstream::Policy(next) = &state.upstream
            && next.poisoned.is_none()
        {
            return;
        }
        let held: Vec<(u64, u64)> = state
            .upstream
            .lent()
            .iter()
            .map(|(a, e)| (a, e.size))
            .collect();
        for (addr, size) in held {
            if !whole && state.lent.ordered().overlapping(addr, size).is_some() {
                continue;
            }
            // These are exactly the recorded sizes, so the upstream cannot refuse them;
            // it is the host's memory or a stopped link, so no guest is called.
            let _ = state.call_upstream(&mut Deadline::passed(), |u, d| u.free(d, addr, size));
        }
        if whole {
            state.mapped.unmap_all();
        } else {
            // Mapped regions as upstream blocks: those no client block lies in go now.
            let lent = &mut state.lent;
            state
                .mapped
                .unmap_where(|start, len| lent.ordered().overlapping(start, len).is_none());
        }
    }
}
