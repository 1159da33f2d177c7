//! A client giving a block back: into the calling thread's magazine when it can, else
//! to the chain, the policy getting the size the ledger recorded (a client's wrong size
//! is corrected and counted; a client that says none, as Numba's runtime, gets the
//! ledger's), or to the fallback that lends it on this handler's behalf.

use std::ptr::NonNull;

use super::{Books, Handler, Mine, Via, count, settle, shelve};
use crate::error::{ClientError, Error};
use crate::ledger::TakeBack;
use allocbox_ledger::cache::{MAGAZINE_MAX_SIZE, MAGAZINE_TABLE_SIZE, Reach};

impl Handler {
    /// Give back a block. `size` should be what it was (re)allocated with; a wrong size
    /// is corrected from the ledger and counted, never passed on. `None` does nothing.
    #[inline]
    pub fn free(&self, ptr: Option<NonNull<u8>>, size: usize) -> Result<(), Error> {
        match ptr {
            // The commonest frees first, on the path that builds no `Result`.
            Some(ptr) if self.free_to_magazine(ptr, size) => Ok(()),
            Some(ptr) => self.free_past_magazine(ptr, size),
            None => Ok(()),
        }
    }

    /// [`Handler::free`] for a caller that has just tried [`Handler::free_to_magazine`]
    /// (the NumPy bridge): the rest of the path, so that a miss does not look up the
    /// thread's cache in place twice.
    #[inline]
    pub fn free_past_magazine(&self, ptr: NonNull<u8>, size: usize) -> Result<(), Error> {
        self.give_back(ptr, Some(size as u64)).map(drop)
    }

    /// Give back a block whose client does not say its size (Numba's runtime frees so):
    /// the ledger's record is the size, as it is for every free. Returns that size.
    pub fn free_unsized(&self, ptr: NonNull<u8>) -> Result<usize, Error> {
        self.give_back(ptr, None).map(|size| size as usize)
    }

    /// A client's free of `ptr`, said to have `said` bytes (`None`: said no size);
    /// returns the size the ledger had for it.
    #[inline]
    pub(super) fn give_back(&self, ptr: NonNull<u8>, said: Option<u64>) -> Result<u64, Error> {
        // A block this thread's cache lent goes back into its magazine when there is
        // room; otherwise it takes the chain's path, still on the books.
        let mut mine = self.thread_cache();
        let addr = ptr.as_ptr() as u64;
        if let Some(mine) = &mut mine
            && let Some(kept) = mine.with(|c| c.put_back::<{ Reach::FULL }>(addr, said))
        {
            if let Some(obs) = &self.observed
                && obs.returned(addr, kept, true)
            {
                self.deliver(&mut self.client_call());
            }
            return Ok(kept);
        }
        self.free_to_chain(mine, ptr, said)
    }

    /// The most common magazine frees alone: true when the block went back into the
    /// calling thread's magazine, counted as `free` would; false leaves everything as
    /// it was, for `free` to do. Calls nothing, as [`Handler::malloc_from_magazine`].
    #[inline]
    pub fn free_to_magazine(&self, ptr: NonNull<u8>, size: usize) -> bool {
        // The size said is only a filter here (the recorded one is what counts): a block
        // said to be larger than the table's sizes is left to the full path.
        size as u64 <= MAGAZINE_TABLE_SIZE && self.put_back_in_place(ptr, Some(size as u64))
    }

    /// [`Handler::free_to_magazine`] for a client that says no size: the ledger's
    /// record decides, as in [`Handler::free_unsized`].
    #[inline]
    pub fn free_unsized_to_magazine(&self, ptr: NonNull<u8>) -> bool {
        self.put_back_in_place(ptr, None)
    }

    #[inline]
    fn put_back_in_place(&self, ptr: NonNull<u8>, said: Option<u64>) -> bool {
        if !self.caches.keeps_magazines() || self.observed.is_some() {
            return false;
        }
        let Some(mut mine) = self.caches.mine_by_pointer() else {
            return false;
        };
        mine.try_with(|c| c.put_back::<{ Reach::IN_PLACE }>(ptr.as_ptr() as u64, said))
            .flatten()
            .is_some()
    }

    /// A free the calling thread's magazine could not take.
    #[cold]
    #[inline(never)]
    fn free_to_chain<'h>(
        &'h self,
        mut mine: Option<Mine<'h>>,
        ptr: NonNull<u8>,
        said: Option<u64>,
    ) -> Result<u64, Error> {
        if mine.is_none()
            && self.combines()
            && let Some(size) = self.free_combined(ptr, said)?
        {
            return Ok(size);
        }
        let addr = ptr.as_ptr() as u64;
        let mut c = self.lock()?;
        let deadline = &mut self.client_call();
        // A block the client holds straight from the policy, and that no magazine may
        // keep, leaves the books in the probe that finds it: the policy gets it back.
        let may_shelve = mine.is_some() && c.keeps_magazines();
        let found = c.head.lent_mut().remove_unless(addr, |e| {
            e.cache.is_some() || (may_shelve && e.size <= MAGAZINE_MAX_SIZE)
        });
        let (entry, taken) = match found {
            Ok(e) => (e, true),
            Err(Some(e)) => (e, false),
            Err(None) => return self.free_off_the_books(c, mine, ptr, said),
        };
        // A block in a thread cache that the cache has not lent sits in a magazine:
        // the client gave it back already.
        if let Some(holder) = entry.cache
            && !self.take_from_cache(&mut c, &mut mine, addr, holder)?
        {
            count(&mut c, &mut mine, |n| n.frees += 1);
            return Err(ClientError::DoubleFree { addr }.into());
        }
        if let Some(said) = said
            && said.max(1) != entry.size
        {
            self.note_size_correction(addr, said, entry.size);
        }
        count(&mut c, &mut mine, |n| {
            n.frees += 1;
            n.freed(entry.size, said);
        });
        let answer = match &mut mine {
            _ if taken => c
                .head
                .free_taken(deadline, addr, entry.size)
                .map(|()| Via::Policy),
            Some(mine) if c.keeps_magazines() && entry.size <= MAGAZINE_MAX_SIZE => {
                shelve(&mut c, deadline, mine, addr, entry.size)
            }
            _ => c.give_back(deadline, addr, entry.size).map(|_| Via::Policy),
        };
        let full = self.observed.as_ref().is_some_and(|obs| {
            let kept = matches!(answer, Ok(Via::Magazine));
            obs.returned(addr, entry.size, kept)
        });
        settle(&mut c, answer.map(|_| 0))?;
        if full {
            let delivered = c.head.deliver(deadline).map(|()| 0);
            settle(&mut c, delivered)?;
        }
        Ok(entry.size)
    }

    /// [`Self::free_to_chain`] of a block the policy's books do not hold: one the
    /// fallback lends on this handler's behalf, or the client's mistake.
    #[cold]
    #[inline(never)]
    fn free_off_the_books<'h>(
        &'h self,
        mut c: Books<'_>,
        mut mine: Option<Mine<'h>>,
        ptr: NonNull<u8>,
        said: Option<u64>,
    ) -> Result<u64, Error> {
        let addr = ptr.as_ptr() as u64;
        count(&mut c, &mut mine, |n| n.frees += 1);
        if c.rerouted.remove(&addr) {
            drop(c);
            return self.rerouted_to().give_back(ptr, said);
        }
        Err(match c.head.lent().why_unknown(addr) {
            TakeBack::AlreadyFreed => ClientError::DoubleFree { addr },
            _ => ClientError::UnknownBlock { addr },
        }
        .into())
    }

    /// A free said the wrong size; the recorded one was used.
    #[cold]
    pub(super) fn note_size_correction(&self, addr: u64, said: u64, recorded: u64) {
        log::debug!(
            "{}: free of {addr:#x} with {said} bytes corrected to {recorded}",
            self.info.name
        );
    }
}
