//! Where requests go once the chain has failed: the fallback handler, if the embedder
//! gave one (the blocks the chain lent stay with it, and their frees are rerouted there
//! too), or a refusal.

use std::ptr::NonNull;

use super::{Books, Handler, Mine, Via, count, count_request, poisoned};
use crate::clock::Deadline;
use crate::error::Error;

impl Handler {
    /// [`Self::lend_from_chain`] once the chain has failed: the fallback serves, if
    /// there is one.
    #[cold]
    #[inline(never)]
    pub(super) fn lend_from_fallback<const ZEROED: bool>(
        &self,
        mut c: Books<'_>,
        mut mine: Option<Mine<'_>>,
        size: u64,
    ) -> Result<(Option<NonNull<u8>>, Via), Error> {
        let unserved = self.fallback.is_none();
        count(&mut c, &mut mine, |n| {
            count_request::<ZEROED>(n);
            n.failed += u64::from(unserved);
        });
        drop(c);
        let rerouted = self.reroute(|f| match ZEROED {
            true => f.calloc(size as usize, 1),
            false => f.malloc(size as usize),
        });
        rerouted.map(|block| (block, Via::Policy))
    }

    /// The fallback that lends the blocks rerouted to it on this handler's behalf.
    pub(super) fn rerouted_to(&self) -> &Handler {
        self.fallback
            .as_ref()
            .expect("rerouted blocks have a fallback")
    }

    pub(super) fn reroute(
        &self,
        f: impl FnOnce(&Handler) -> Result<Option<NonNull<u8>>, Error>,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let Some(fallback) = &self.fallback else {
            let c = self.lock()?;
            let cause = c.failure.clone().expect("rerouting only after a failure");
            return Err(poisoned(&cause));
        };
        let block = f(fallback)?;
        if let Some(p) = block {
            self.lock()?.rerouted.insert(p.as_ptr() as u64);
        }
        Ok(block)
    }

    /// Realloc on a failed chain: copy the block into the fallback, then release it here.
    pub(super) fn move_to_fallback(
        &self,
        mut c: Books<'_>,
        deadline: &mut Deadline,
        mine: &mut Option<Mine<'_>>,
        addr: u64,
        old: u64,
        new: u64,
    ) -> Result<Option<NonNull<u8>>, Error> {
        let Some(fallback) = &self.fallback else {
            count(&mut c, mine, |n| n.failed += 1);
            return Err(poisoned(c.failure.as_ref().expect("failed chain")));
        };
        let Some(fresh) = fallback.malloc(new as usize)? else {
            return Ok(None);
        };
        // SAFETY: `addr` is a live block of `old` bytes this handler lent (found in the
        // ledger, held by the client), and `fresh` a new block of at least `new` bytes
        // from another handler; distinct live blocks do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(addr as *const u8, fresh.as_ptr(), old.min(new) as usize)
        };
        count(&mut c, mine, |n| n.take_back(old));
        // The block was found with its size; a dead head only updates its books.
        let _ = c.head.free(deadline, addr, old);
        c.rerouted.insert(fresh.as_ptr() as u64);
        Ok(Some(fresh))
    }
}
