//! Serving an observing policy's client (0.2.0 `observer`): each request within the
//! lease, renewed when it does not cover one, and what was served without asking the
//! policy delivered to it at its batch size.

use std::ptr::NonNull;

use super::{
    Handler, MAGAZINE_MAX_SIZE, Via, count_request, settle, take_counted, to_ptr, zeroed_if,
};
use crate::clock::Deadline;
use crate::error::Error;
use crate::observe::{Observations, Op};

impl Handler {
    /// [`Handler::lend`] for an observing policy: within its lease (renewed when it does
    /// not cover the request), from a magazine or the policy, and told to the policy.
    #[inline(never)]
    pub(super) fn lend_observed<const ZEROED: bool>(
        &self,
        obs: &Observations,
        size: u64,
    ) -> Result<Option<NonNull<u8>>, Error> {
        // The renewal, the request and the delivery it completes are one call.
        let deadline = &mut self.client_call();
        if !obs.reserve(size) && !self.renew(deadline, obs, size)? {
            let mut mine = self.caches.mine();
            mine.with(|c| {
                count_request::<ZEROED>(&mut c.counts);
                c.counts.failed += 1;
            });
            return Ok(None);
        }
        let op = if ZEROED { Op::Calloc } else { Op::Malloc };
        let mut mine = self.thread_cache();
        let from_magazine = mine.is_some() && size <= MAGAZINE_MAX_SIZE;
        if from_magazine
            && let Some(mine) = &mut mine
            && let Some(addr) = take_counted::<ZEROED>(mine, size)
        {
            let addr = zeroed_if::<ZEROED>(addr, size);
            if obs.lent(op, addr, size) {
                self.deliver(deadline);
            }
            return Ok(to_ptr(addr));
        }
        let answer = self.lend_from_chain::<ZEROED>(Some(deadline), mine, size, from_magazine);
        match &answer {
            Ok((Some(block), Via::Magazine)) => {
                if obs.lent(op, block.as_ptr() as u64, size) {
                    self.deliver(deadline);
                }
            }
            Ok((Some(_), Via::Policy)) => obs.served_by_policy(size),
            _ => obs.cancel(size),
        }
        answer.map(|(block, _)| block)
    }

    /// Renew an observing policy's lease for a request of `size` bytes and reserve the
    /// request from it: false when the policy's answer does not cover it.
    #[cold]
    pub(super) fn renew(
        &self,
        deadline: &mut Deadline,
        obs: &Observations,
        size: u64,
    ) -> Result<bool, Error> {
        let mut c = self.lock_for(deadline)?;
        if c.failure.is_some() {
            // Served by the fallback, or refused as on every path of a failed chain.
            return Ok(true);
        }
        let renewed = c.head.renew(deadline, size).map(|()| 0);
        settle(&mut c, renewed)?;
        Ok(obs.reserve(size))
    }

    /// Tell an observing policy what was served without it. A failure stops the chain
    /// (settled here); the blocks already lent stand.
    #[cold]
    pub(super) fn deliver(&self, deadline: &mut Deadline) {
        if let Ok(mut c) = self.lock_for(deadline) {
            let delivered = c.head.deliver(deadline).map(|()| 0);
            let _ = settle(&mut c, delivered);
        }
    }
}
