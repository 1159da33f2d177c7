//! What every handler of sandboxed policies does beyond NEP 49's routines, whatever its
//! kind: one chain ([`Handler`]), a chain per thread ([`super::ShardedHandler`], whose
//! implementation is in `sharded/inspect.rs`) or a GPU's ([`DeviceHandler`]). The checker, the Python policies and anything that inspects,
//! trims or judges a handler go through [`PolicyHandler`], so a capability written for
//! one kind serves the others.

use std::ptr::NonNull;
use std::sync::Arc;

use super::{DeviceHandler, Handler};
use crate::error::{Error, InvariantBroken};
use crate::gpu::Placement;
use crate::link::{ClientMisuse, LinkStats};
use crate::memhandler::{MemHandler, Stats};

/// A handler of sandboxed policies: NEP 49's routines ([`MemHandler`]) and what the
/// host knows of the policies behind them.
pub trait PolicyHandler: MemHandler {
    /// Where its blocks lie: host memory, or a GPU's (whose blocks the host never reads,
    /// zeroes or copies: `calloc` and `realloc` are refused).
    fn placement(&self) -> Placement;
    /// Whether small requests are served from the host's per-thread magazines.
    fn keeps_magazines(&self) -> bool;
    /// Does a policy say it diagnoses its client (0.2.0 `info.diagnoses`)? Then the
    /// embedder records where each block was allocated to name it in a misuse report.
    fn diagnoses(&self) -> bool;
    /// The chains started: one per thread that called a per-thread handler, else 1.
    fn instances(&self) -> usize {
        1
    }
    /// Ask every policy to give back what it caches.
    fn trim(&self) -> Result<(), Error>;
    /// Every policy's counters, top first; chain after chain for a handler per thread.
    fn link_stats(&self) -> Result<Vec<LinkStats>, Error>;
    /// The failure that stopped a chain (the first one to stop), or that keeps it out of
    /// reach.
    fn failure(&self) -> Option<Arc<Error>>;
    /// Trim, then fail with a leak violation if a policy still holds memory: for once the
    /// client freed everything.
    fn leak_check(&self) -> Result<(), Error>;
    /// Check the host's own invariants (every ledger against its upstream and its thread
    /// caches), for tests and fuzzing.
    fn audit(&self) -> Result<(), InvariantBroken>;
    /// The blocks the client holds, `(address, size)`, by address.
    fn live_blocks(&self) -> Result<Vec<(usize, usize)>, Error>;
    /// The size a live block was (re)allocated with; `None` for a block not lent.
    fn block_size(&self, ptr: NonNull<u8>) -> Option<usize>;
    /// Misuse by the client that the policies reported since this was last asked.
    fn take_client_misuse(&self) -> Result<Vec<ClientMisuse>, Error>;
    /// What the chains hold from the host's memory, `(blocks, bytes)`, regions mapped
    /// included: beside the client's bytes, what the policies keep.
    fn held_from_host(&self) -> Result<(usize, u64), Error>;
}

impl PolicyHandler for Handler {
    fn held_from_host(&self) -> Result<(usize, u64), Error> {
        Handler::held_from_host(self)
    }
    fn placement(&self) -> Placement {
        Handler::placement(self)
    }
    fn keeps_magazines(&self) -> bool {
        Handler::keeps_magazines(self)
    }
    fn diagnoses(&self) -> bool {
        Handler::diagnoses(self)
    }
    fn trim(&self) -> Result<(), Error> {
        Handler::trim(self)
    }
    fn link_stats(&self) -> Result<Vec<LinkStats>, Error> {
        Handler::link_stats(self)
    }
    fn failure(&self) -> Option<Arc<Error>> {
        Handler::failure(self)
    }
    fn leak_check(&self) -> Result<(), Error> {
        Handler::leak_check(self)
    }
    fn audit(&self) -> Result<(), InvariantBroken> {
        Handler::audit(self)
    }
    fn live_blocks(&self) -> Result<Vec<(usize, usize)>, Error> {
        Handler::live_blocks(self)
    }
    fn block_size(&self, ptr: NonNull<u8>) -> Option<usize> {
        Handler::block_size(self, ptr)
    }
    fn take_client_misuse(&self) -> Result<Vec<ClientMisuse>, Error> {
        Handler::take_client_misuse(self)
    }
}

/// A device handler through NEP 49's routines is its GPU's memory with no stream to
/// wait for: a free goes back to the policy at once (after any free whose streams have
/// finished), and `calloc` and `realloc` are refused, as the host never touches a
/// block's bytes.
impl MemHandler for DeviceHandler {
    fn name(&self) -> &str {
        DeviceHandler::name(self)
    }
    fn version(&self) -> u8 {
        self.handler().info().version
    }
    fn alignment(&self) -> u64 {
        self.handler().info().alignment
    }
    fn malloc(&self, size: usize) -> Result<Option<NonNull<u8>>, Error> {
        let block = DeviceHandler::malloc(self, size as u64)?;
        Ok(block.and_then(super::to_ptr))
    }
    fn calloc(&self, nelem: usize, elsize: usize) -> Result<Option<NonNull<u8>>, Error> {
        self.handler().calloc(nelem, elsize)
    }
    fn realloc(
        &self,
        ptr: Option<NonNull<u8>>,
        new_size: usize,
    ) -> Result<Option<NonNull<u8>>, Error> {
        self.handler().realloc(ptr, new_size)
    }
    fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        match ptr {
            Some(ptr) => DeviceHandler::free(self, ptr.as_ptr() as u64, Some(size as u64), &[]),
            None => Ok(()),
        }
    }
    fn free_unsized(&self, ptr: NonNull<u8>) -> Result<usize, Error> {
        let size = self.handler().block_size(ptr);
        DeviceHandler::free(self, ptr.as_ptr() as u64, None, &[])?;
        Ok(size.unwrap_or(0))
    }
    fn stats(&self) -> Result<Stats, Error> {
        DeviceHandler::stats(self)
    }
    fn usable(&self) -> Result<(), Error> {
        self.handler().usable()
    }
}

impl PolicyHandler for DeviceHandler {
    fn held_from_host(&self) -> Result<(usize, u64), Error> {
        self.handler().held_from_host()
    }
    fn placement(&self) -> Placement {
        self.handler().placement()
    }
    fn keeps_magazines(&self) -> bool {
        self.handler().keeps_magazines()
    }
    fn diagnoses(&self) -> bool {
        self.handler().diagnoses()
    }
    fn trim(&self) -> Result<(), Error> {
        DeviceHandler::trim(self)
    }
    fn link_stats(&self) -> Result<Vec<LinkStats>, Error> {
        DeviceHandler::link_stats(self)
    }
    fn failure(&self) -> Option<Arc<Error>> {
        DeviceHandler::failure(self)
    }
    fn leak_check(&self) -> Result<(), Error> {
        DeviceHandler::leak_check(self)
    }
    fn audit(&self) -> Result<(), InvariantBroken> {
        self.handler().audit()
    }
    /// A block whose free waits for its streams is still the client's here.
    fn live_blocks(&self) -> Result<Vec<(usize, usize)>, Error> {
        self.handler().live_blocks()
    }
    fn block_size(&self, ptr: NonNull<u8>) -> Option<usize> {
        self.handler().block_size(ptr)
    }
    fn take_client_misuse(&self) -> Result<Vec<ClientMisuse>, Error> {
        self.handler().take_client_misuse()
    }
}
