//! What a handler per thread tells about itself, gathered from every started chain
//! after every queued free was given back, so that what is read counts every free the
//! client made.

use std::ptr::NonNull;
use std::sync::Arc;

use super::{Handler, ShardedHandler, locked};
use crate::error::{Error, InvariantBroken};
use crate::gpu::Placement;
use crate::handler::PolicyHandler;
use crate::link::{ClientMisuse, LinkStats};
use crate::memhandler::Stats;

impl ShardedHandler {
    /// Every shard's counters, summed, after every queued free was given back. The
    /// peak is the sum of each shard's: at most that many bytes were live at once.
    pub fn stats(&self) -> Result<Stats, Error> {
        self.reachable()?;
        self.shared.give_back_all_queued();
        let mut total = Stats::default();
        for shard in self.started() {
            total.add(&shard.stats()?);
        }
        Ok(total)
    }
}

/// Each call asks every started chain, after every queued free was given back.
impl PolicyHandler for ShardedHandler {
    /// Every chain of a handler per thread is of host memory.
    fn placement(&self) -> Placement {
        Placement::Host
    }

    /// A handler per thread keeps no magazines: each thread has its chain to itself.
    fn keeps_magazines(&self) -> bool {
        false
    }

    fn diagnoses(&self) -> bool {
        self.started().any(Handler::diagnoses)
    }

    fn instances(&self) -> usize {
        self.started().count()
    }

    /// Trim every shard, after every queued free was given back.
    fn trim(&self) -> Result<(), Error> {
        self.reachable()?;
        self.shared.give_back_all_queued();
        self.started().try_for_each(Handler::trim)
    }

    /// Every chain's, summed.
    fn held_from_host(&self) -> Result<(usize, u64), Error> {
        self.reachable()?;
        self.started().try_fold((0, 0), |(blocks, bytes), shard| {
            let (b, n) = shard.held_from_host()?;
            Ok((blocks + b, bytes + n))
        })
    }

    /// [`Handler::leak_check`] of every shard, after every queued free was given back.
    fn leak_check(&self) -> Result<(), Error> {
        self.reachable()?;
        self.shared.give_back_all_queued();
        self.started().try_for_each(Handler::leak_check)
    }

    /// The blocks the client holds, `(address, size)`, by address, every shard's.
    fn live_blocks(&self) -> Result<Vec<(usize, usize)>, Error> {
        self.reachable()?;
        self.shared.give_back_all_queued();
        let mut blocks = Vec::new();
        for shard in self.started() {
            blocks.extend(shard.live_blocks()?);
        }
        blocks.sort_unstable();
        Ok(blocks)
    }

    /// Counters of every policy of every started chain: each chain's links, top first,
    /// chain after chain (see [`Handler::link_stats`]).
    fn link_stats(&self) -> Result<Vec<LinkStats>, Error> {
        let mut all = Vec::new();
        for shard in self.started() {
            all.extend(shard.link_stats()?);
        }
        Ok(all)
    }

    /// The first failure that stopped a shard's chain.
    fn failure(&self) -> Option<Arc<Error>> {
        self.started().find_map(Handler::failure)
    }

    /// Every shard's [`Handler::audit`], and each shard's table of the client's blocks
    /// against its ledger: every block in the table is lent by that shard with that
    /// size, and the shard lends no block the tables do not name.
    fn audit(&self) -> Result<(), InvariantBroken> {
        self.shared.give_back_all_queued();
        for (index, shard) in self.started().enumerate() {
            shard.audit()?;
            let broken = |addr, size, what| InvariantBroken {
                link: format!("{} (the table of instance {index})", shard.name()),
                addr,
                size,
                what,
            };
            let table: Vec<(u64, u64)> = locked(&self.shared.lent[index].0)
                .iter()
                .map(|(&a, &s)| (a, s))
                .collect();
            for &(addr, size) in &table {
                let ptr = NonNull::new(addr as usize as *mut u8).expect("a lent block");
                if shard.block_size(ptr) != Some(size as usize) {
                    return Err(broken(
                        addr,
                        size,
                        "is in the table but not lent by its instance with that size",
                    ));
                }
            }
            let lent = shard
                .live_blocks()
                .map_err(|_| broken(0, 0, "is out of reach"))?;
            if lent.len() != table.len() {
                return Err(broken(0, 0, "lends a block the table does not name"));
            }
        }
        Ok(())
    }

    /// The size a live block was (re)allocated with, from the table of the shard that
    /// lent it; `None` for a block not lent (or queued to go back).
    fn block_size(&self, ptr: NonNull<u8>) -> Option<usize> {
        let addr = ptr.as_ptr() as u64;
        self.shared
            .lent
            .iter()
            .find_map(|table| locked(&table.0).get(&addr).copied())
            .map(|size| size as usize)
    }

    /// Misuse the policies of every started chain reported since this was last asked.
    fn take_client_misuse(&self) -> Result<Vec<ClientMisuse>, Error> {
        let mut all = Vec::new();
        for shard in self.started() {
            all.extend(shard.take_client_misuse()?);
        }
        Ok(all)
    }
}

impl Stats {
    /// Add another handler's counters: counts and live totals add; so do the peaks,
    /// an upper bound of the peak of both together.
    fn add(&mut self, other: &Stats) {
        self.mallocs += other.mallocs;
        self.callocs += other.callocs;
        self.reallocs += other.reallocs;
        self.frees += other.frees;
        self.failed += other.failed;
        self.live_blocks += other.live_blocks;
        self.live_bytes += other.live_bytes;
        self.peak_bytes += other.peak_bytes;
        self.total_bytes += other.total_bytes;
        self.size_corrections += other.size_corrections;
        self.magazine_hits += other.magazine_hits;
        self.budget_refusals += other.budget_refusals;
        self.budget_refusals_held += other.budget_refusals_held;
        self.cached_blocks += other.cached_blocks;
    }
}
