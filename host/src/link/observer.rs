//! What the host tells and asks a policy besides its allocator calls: how it observes
//! (0.2.0 `observer`: its terms, the deliveries of what was served without it, the
//! renewals of its lease) and its own counters (`lifecycle.report`). Each is a guest
//! call under the deadline of the embedder's call that causes it; a failure stops the
//! policy, as in any call.

use wasmtime::Store;

use super::{Exports, Link, LinkState, LinkStats, Observer};
use crate::clock::Deadline;
use crate::error::{Bound, Call, Error};
use crate::observe::Observations;
use std::sync::Arc;

/// Counters of one policy kept from one `report`: more are left out.
const MAX_COUNTERS: usize = 64;
/// Bytes of a counter's name kept: a longer one is cut.
const MAX_COUNTER_NAME: usize = 64;

impl Link {
    /// One call into an observing policy's `observer` export, under the deadline of the
    /// embedder's call that causes it; a failure stops the policy.
    fn observer_call<R>(
        &mut self,
        call: Call,
        deadline: &mut Deadline,
        f: impl FnOnce(&Observer, &mut Store<LinkState>) -> wasmtime::Result<R>,
    ) -> Result<R, Error> {
        self.start_call(*deadline, 0);
        let Exports::V2(b) = &self.bindings else {
            unreachable!("only a 0.2.0 policy observes");
        };
        let answer = f(b.allocbox_policy_observer(), &mut self.store);
        self.end_call(deadline);
        answer.map_err(|e| self.failed(call, e))
    }

    /// How the policy observes, `(batch, lease, detail)`, asked once after `init`: none for a
    /// 0.1.0 policy or one that does not. A batch outside 1..=the batch limit passes a
    /// bound, and the policy is stopped.
    pub(crate) fn observes(
        &mut self,
        deadline: &mut Deadline,
    ) -> Result<Option<(u32, Option<u64>, crate::observe::Detail)>, Error> {
        if !matches!(self.bindings, Exports::V2(_)) {
            return Ok(None);
        }
        let terms = self.observer_call(Call::Observe, deadline, |o, s| o.call_observes(s))?;
        let Some(terms) = terms else {
            return Ok(None);
        };
        if terms.batch == 0 || terms.batch > self.limits.batch {
            let err = Error::WorkLimit {
                policy: self.info.name.clone(),
                call: Call::Observe,
                bound: Bound::Batch,
                asked: terms.batch.into(),
                limit: self.limits.batch.into(),
            };
            self.poison(err.clone());
            return Err(err);
        }
        Ok(Some((terms.batch, terms.lease, terms.detail)))
    }

    /// From now on the host serves this link's client from magazines and tells it
    /// through `obs`.
    pub(crate) fn observe_with(&mut self, obs: Arc<Observations>) {
        self.observed = Some(obs);
    }

    /// Deliver every event not yet delivered, a batch per call, every batch under the
    /// one deadline of the embedder's call that causes the delivery.
    pub(crate) fn deliver(&mut self, deadline: &mut Deadline) -> Result<(), Error> {
        let Some(obs) = self.observed.clone() else {
            return Ok(());
        };
        let events = obs.take();
        if self.poisoned.is_some() {
            // A stopped policy is told nothing more.
            return Ok(());
        }
        for batch in events.chunks(obs.batch()) {
            self.calls.observed += 1;
            let batch = crate::observe::observation(batch, obs.detail());
            self.observer_call(Call::Observe, deadline, |o, s| o.call_observe(s, &batch))?;
        }
        Ok(())
    }

    /// Ask the policy for a new lease for a request of `size` bytes, every event
    /// delivered first; the lease is set on the observations.
    pub(crate) fn renew(&mut self, deadline: &mut Deadline, size: u64) -> Result<(), Error> {
        self.deliver(deadline)?;
        let Some(obs) = self.observed.clone() else {
            return Ok(());
        };
        self.calls.renewals += 1;
        let headroom = self.observer_call(Call::Renew, deadline, |o, s| o.call_renew(s, size))?;
        obs.renewed(headroom);
        Ok(())
    }

    /// [`Link::stats`] with the policy's own counters, which it is asked for
    /// (`lifecycle.report`; a 0.1.0 policy has none). A policy that fails to answer is
    /// stopped, as for any call, and its counters are left out.
    pub(crate) fn report(&mut self, deadline: &mut Deadline) -> LinkStats {
        // What it counts includes everything served without it. A failure stops it.
        let _ = self.deliver(deadline);
        let reports = matches!(self.bindings, Exports::V2(_)) && self.poisoned.is_none();
        if reports {
            self.start_call(*deadline, 0);
        }
        let counters = match &self.bindings {
            Exports::V2(b) if reports => {
                let lifecycle = b.allocbox_policy_lifecycle();
                let answer = lifecycle.call_report(&mut self.store);
                self.end_call(deadline);
                match answer {
                    Ok(counters) => counters
                        .into_iter()
                        .take(MAX_COUNTERS)
                        .map(|(name, value)| {
                            let name = crate::untrusted::escape_at_most(&name, MAX_COUNTER_NAME);
                            (name, value)
                        })
                        .collect(),
                    Err(e) => {
                        self.failed(Call::Report, e);
                        Vec::new()
                    }
                }
            }
            _ => Vec::new(),
        };
        LinkStats {
            counters,
            ..self.stats()
        }
    }
}
