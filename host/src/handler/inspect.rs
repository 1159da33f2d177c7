//! What a handler tells about itself without serving a request: its counters, the
//! blocks its client holds, an audit of every ledger and thread cache against the
//! others, leaks, and the failure that stopped it.

use std::ptr::NonNull;
use std::sync::Arc;

use allocbox_ledger::cache::{Magazines, Unreachable};

use super::Handler;
use super::chain::{Books, fail, settle, unreachable};
use crate::error::{Error, InvariantBroken};
use crate::ledger::Ordered;
use crate::link::Link;
use crate::memhandler::Stats;

impl Handler {
    /// A copy of the counters, every thread's included. Counts are exact. The peak is
    /// exact while one thread at a time uses the handler; with several at once it is the
    /// highest total seen when their counters are gathered (here and on each read).
    pub fn stats(&self) -> Result<Stats, Error> {
        let mut c = self.lock()?;
        let deadline = &mut self.client_call();
        // An observing policy hears of everything served before anyone reads counters.
        let delivered = c.head.deliver(deadline).map(|()| 0);
        settle(&mut c, delivered)?;
        let mut cached_blocks = 0;
        for slot in c.slots() {
            let counts = c.claim(slot).map(|mut cache| {
                cached_blocks += cache
                    .magazines
                    .iter()
                    .map(|m| m.blocks().count())
                    .sum::<usize>();
                std::mem::take(&mut cache.counts)
            });
            match counts {
                Ok(counts) => c.stats.fold(counts),
                Err(reason) => return Err(unreachable(&c, reason)),
            }
        }
        let counts = std::mem::take(&mut c.counts);
        c.stats.fold(counts);
        let mut stats = c.stats.clone();
        stats.cached_blocks = cached_blocks as u64;
        let links: Vec<_> = c.links().map(|l| l.stats()).collect();
        stats.budget_refusals = links.iter().map(|l| l.budget_refusals).sum();
        stats.budget_refusals_held = links.iter().map(|l| l.budget_refusals_held).sum();
        Ok(stats)
    }

    /// Check the host's own invariants, for tests and fuzzing: every block a link lent
    /// lies inside memory that link holds from its upstream, so every block a client
    /// holds lies in live host memory; no client block lies in memory the host released
    /// (with [`super::HandlerBuilder::quarantine`]); each ledger's indexes agree; the thread
    /// caches hold exactly the blocks the ledger says they hold.
    pub fn audit(&self) -> Result<(), InvariantBroken> {
        let unaudited = |reason| InvariantBroken {
            link: format!("{} (thread caches)", self.info.name),
            addr: 0,
            size: 0,
            what: match reason {
                Unreachable::Stuck { .. } => "is in a thread cache whose thread stopped in a call",
                Unreachable::ForkedMidCall => {
                    "is out of reach: the process forked while another thread was in a call"
                }
            },
        };
        let mut c = self.caches.lock().map_err(unaudited)?;
        self.audit_caches(&mut c).map_err(|e| e.either(unaudited))?;
        for link in c.links() {
            let broken = |addr, size, what| InvariantBroken {
                link: link.name().to_string(),
                addr,
                size,
                what,
            };
            let lent = link.lent();
            if let Err(what) = lent.check_consistent() {
                return Err(broken(0, 0, what));
            }
            let upstream = link.upstream().lent().order_afresh();
            for (addr, e) in lent.iter() {
                let owned = Ordered::from(&upstream).containing(addr, e.size).is_some()
                    || link.mapped_containing(addr, e.size).is_some();
                if !owned {
                    return Err(broken(
                        addr,
                        e.size,
                        "lies outside the memory its policy holds from upstream",
                    ));
                }
                if let Some((released, _)) = c.bottom().released_overlapping(addr, e.size) {
                    return Err(broken(
                        addr,
                        e.size,
                        if released == addr {
                            "was released to the system while lent"
                        } else {
                            "lies in memory released to the system"
                        },
                    ));
                }
            }
        }
        c.bottom()
            .lent
            .check_consistent()
            .map_err(|what| InvariantBroken {
                link: "host memory".into(),
                addr: 0,
                size: 0,
                what,
            })
    }

    /// Every block a thread cache holds is the top policy's, recorded with its size and
    /// that cache; every block the ledger gives a cache is in it.
    fn audit_caches(&self, c: &mut Books<'_>) -> Result<(), AuditError> {
        let broken = |addr, size, what| InvariantBroken {
            link: format!("{} (thread caches)", self.info.name),
            addr,
            size,
            what,
        };
        let mut held = 0;
        for slot in c.slots() {
            let blocks: Vec<(u64, u64)> = c
                .claim(slot)
                .map(|t| {
                    let in_magazines = t.magazines.iter().flat_map(Magazines::blocks);
                    t.lent.iter().chain(in_magazines).collect()
                })
                .map_err(AuditError::Unreachable)?;
            for (addr, size) in blocks {
                let entry = c.head.lent().get(addr);
                if entry.is_none_or(|e| e.size != size || e.cache != Some(slot.id)) {
                    return Err(AuditError::Broken(broken(
                        addr,
                        size,
                        "is in a thread cache the ledger does not name",
                    )));
                }
                held += 1;
            }
        }
        let named: Vec<_> = c
            .head
            .lent()
            .iter()
            .filter(|(_, e)| e.cache.is_some())
            .collect();
        match named.len() == held {
            true => Ok(()),
            false => {
                let (addr, e) = named[0];
                Err(AuditError::Broken(broken(
                    addr,
                    e.size,
                    "is given to a thread cache that does not hold it",
                )))
            }
        }
    }

    /// The blocks the client holds, `(address, size)`, by address.
    pub fn live_blocks(&self) -> Result<Vec<(usize, usize)>, Error> {
        let mut c = self.lock()?;
        let mut blocks: Vec<(usize, usize)> = c
            .head
            .lent()
            .iter()
            .filter(|(_, e)| e.cache.is_none())
            .map(|(a, e)| (a as usize, e.size as usize))
            .collect();
        for slot in c.slots() {
            let lent = c.claim(slot).map(|t| {
                let lent = t.lent.iter().map(|(a, s)| (a as usize, s as usize));
                lent.collect::<Vec<_>>()
            });
            blocks.extend(lent.map_err(|reason| self.unreachable(reason))?);
        }
        blocks.sort_unstable();
        Ok(blocks)
    }

    /// The size a live block was (re)allocated with; `None` for a block the handler
    /// has not lent, or cannot reach.
    pub fn block_size(&self, ptr: NonNull<u8>) -> Option<usize> {
        let addr = ptr.as_ptr() as u64;
        let mut mine = self.caches.mine();
        let mut c = self.lock().ok()?;
        let e = c.head.lent().get(addr)?;
        let size = match e.cache {
            None => e.size,
            Some(id) => c.cache_of(&mut mine, id).ok()?.lent.get(addr)?,
        };
        Some(size as usize)
    }

    /// Counters of every policy in the chain, top first, each policy's own counters
    /// included (it is asked for them: `lifecycle.report`).
    /// A policy that fails to report is stopped, and the chain with it, as for a
    /// failure in any other call: the failure is the handler's from then on.
    pub fn link_stats(&self) -> Result<Vec<crate::link::LinkStats>, Error> {
        let mut c = self.lock()?;
        let deadline = &mut self.client_call();
        let mut all = Vec::new();
        let mut failed = None;
        c.each_link_mut(|link| {
            let stopped_before = link.poisoned.is_some();
            all.push(link.report(deadline));
            if !stopped_before && let Some(cause) = &link.poisoned {
                failed.get_or_insert_with(|| cause.clone());
            }
        });
        if let Some(cause) = failed {
            fail(&mut c, cause);
        }
        Ok(all)
    }

    /// Misuse by the client that the chain's policies reported (0.2.0 `diagnostics`)
    /// since this was last asked, top policy first. Each is also counted in
    /// [`crate::LinkStats::client_misuse`].
    pub fn take_client_misuse(&self) -> Result<Vec<crate::link::ClientMisuse>, Error> {
        let mut c = self.lock()?;
        let mut all = Vec::new();
        c.each_link_mut(|link| all.extend(link.take_new_misuse()));
        Ok(all)
    }

    /// Trim, then fail with a [`crate::error::Rule::Leak`] violation if the chain still holds memory
    /// from the host — to be called once the client has freed everything (a test's last
    /// assertion).
    pub fn leak_check(&self) -> Result<(), Error> {
        self.trim()?;
        let (blocks, bytes, regions, region_bytes) = {
            let c = self.lock()?;
            let host = &c.bottom().lent;
            let (regions, region_bytes) = c
                .links()
                .map(Link::mapped_held)
                .fold((0, 0), |(n, b), (regions, bytes)| (n + regions, b + bytes));
            (host.len(), host.bytes(), regions, region_bytes)
        };
        if blocks + regions == 0 {
            return Ok(());
        }
        Err(Error::Violation(crate::error::Violation {
            policy: self.info.name.clone(),
            call: crate::error::Call::Trim,
            addr: 0,
            size: bytes + region_bytes,
            rule: crate::error::Rule::Leak {
                blocks,
                bytes,
                regions,
                region_bytes,
            },
        }))
    }

    /// Upstream blocks still held from the host's memory, `(blocks, bytes)`: after every
    /// block was freed and the handler trimmed, anything here is a leak.
    pub fn held_from_host(&self) -> Result<(usize, u64), Error> {
        let c = self.lock()?;
        let host = &c.bottom().lent;
        let (mut blocks, mut bytes) = (host.len(), host.bytes());
        for (regions, mapped) in c.links().map(Link::mapped_held) {
            blocks += regions;
            bytes += mapped;
        }
        Ok((blocks, bytes))
    }

    /// The blocks the chain holds from the host's memory, `(address, size)`, by address.
    pub fn host_blocks(&self) -> Result<Vec<(u64, u64)>, Error> {
        let c = self.lock()?;
        Ok(c.bottom().lent.iter().map(|(a, e)| (a, e.size)).collect())
    }

    /// The failure that stopped this handler's chain, or that keeps it out of reach.
    pub fn failure(&self) -> Option<Arc<Error>> {
        match self.lock() {
            Ok(c) => c.failure.clone(),
            Err(unreachable) => Some(Arc::new(unreachable)),
        }
    }
}

/// Why an audit of the thread caches failed.
enum AuditError {
    Broken(InvariantBroken),
    Unreachable(Unreachable),
}

impl AuditError {
    fn either(self, unreachable: impl FnOnce(Unreachable) -> InvariantBroken) -> InvariantBroken {
        match self {
            AuditError::Broken(broken) => broken,
            AuditError::Unreachable(reason) => unreachable(reason),
        }
    }
}
