//! The client that drives a handler through a script's operations: it checks every
//! answer against the model of its live blocks and reports the first broken rule.

use std::ptr::NonNull;
use std::time::Instant;

use allocbox::gpu::Placement;
use allocbox::{Adversary, Error, Rule, WasmHook};
use allocbox_ledger::fasthash::FastMap;

use super::holdings::Holdings;
use super::model::Live;
use super::pattern::PERIOD;
use super::script::{BlockId, Op};
use super::verdict::Finding;
use allocbox::PolicyHandler;

/// Blocks passed to each client thread (`pass bN`), waiting for it to take them:
/// `(address, size, phase)` of each, the pattern it was filled with.
pub(super) struct Mailboxes {
    boxes: Vec<std::sync::Mutex<Vec<(usize, usize, usize)>>>,
    /// Passed blocks taken and freed, by a thread other than their maker's.
    freed: std::sync::atomic::AtomicU64,
}

impl Mailboxes {
    pub(super) fn new(threads: usize) -> Self {
        Mailboxes {
            boxes: (0..threads.max(1)).map(|_| Default::default()).collect(),
            freed: Default::default(),
        }
    }

    /// Passed blocks freed so far.
    pub(super) fn freed(&self) -> u64 {
        self.freed.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn put(&self, thread: usize, block: &Live) {
        let mailbox = &self.boxes[thread % self.boxes.len()];
        let mut held = mailbox.lock().unwrap_or_else(|p| p.into_inner());
        held.push((block.ptr.as_ptr() as usize, block.size, block.phase));
    }

    fn take(&self, thread: usize) -> Vec<(usize, usize, usize)> {
        let mailbox = &self.boxes[thread % self.boxes.len()];
        std::mem::take(&mut *mailbox.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// How many threads the boxes are for.
    pub(super) fn len(&self) -> usize {
        self.boxes.len()
    }
}

/// Runs one client's operations against a handler and checks every answer.
pub(super) struct Client<'h> {
    pub(super) handler: &'h dyn PolicyHandler,
    /// Where `pass` sends a block, and where this thread takes passed ones from.
    mailboxes: &'h Mailboxes,
    thread: usize,
    /// The checker's upstream under the handler, which `oom` operations instruct.
    adversary: &'h Adversary,
    /// Told about every block lent, resized and freed ([`crate::CheckOptions::hook`]).
    hook: Option<&'h WasmHook>,
    pub(super) live: Vec<Live>,
    /// Where each named block is in `live`.
    pub(super) named: FastMap<BlockId, usize>,
    pub(super) next_phase: usize,
    /// Where the rotating look at live blocks goes on from.
    pub(super) next_look: usize,
    pub(super) ran: Vec<Op>,
    /// Bytes the client was lent since the last trim (blocks made, and blocks resized,
    /// at their new size).
    asked: u64,
    /// Bytes the client freed since the last trim.
    freed: u64,
    /// What the policy held beside this client's bytes, sampled before each trim (one
    /// client thread's cases only: the handler's holdings are every thread's).
    pub(super) holdings: Holdings,
}

// SAFETY: the raw block pointers are owned by this client alone (each thread has its own
// `Client` and its own blocks); the handler is Sync.
unsafe impl Send for Client<'_> {}

impl<'h> Client<'h> {
    pub(super) fn new(
        handler: &'h dyn PolicyHandler,
        adversary: &'h Adversary,
        hook: Option<&'h WasmHook>,
        (thread, mailboxes): (usize, &'h Mailboxes),
    ) -> Self {
        Client {
            handler,
            mailboxes,
            thread,
            adversary,
            hook,
            live: Vec::new(),
            named: FastMap::default(),
            next_phase: thread * 67,
            next_look: 0,
            ran: Vec::new(),
            asked: 0,
            freed: 0,
            holdings: Holdings::default(),
        }
    }

    /// Tell the hook, if there is one, about an event; a hook that fails is stopped
    /// (and says so in its report), the check goes on.
    fn tell(&self, old: Option<NonNull<u8>>, new: Option<NonNull<u8>>, size: usize) {
        if let Some(hook) = self.hook {
            let _ = hook.on_event(old, new, size);
        }
    }

    /// A new phase for the next block, so neighbouring blocks hold different bytes.
    pub(super) fn phase(&mut self) -> usize {
        self.next_phase = (self.next_phase + 37) % PERIOD;
        self.next_phase
    }

    pub(super) fn policy(&self) -> &str {
        self.handler.name()
    }

    pub(super) fn lost(
        &self,
        call: &str,
        live: &Live,
        offset: usize,
        rule: fn(u64) -> Rule,
    ) -> Finding {
        Finding::checked(
            self.policy(),
            call,
            live.ptr.as_ptr() as usize,
            live.size as u64,
            rule(offset as u64),
        )
    }

    /// Track a block the handler just lent under its name, filled with a pattern of its
    /// own. A name used again names the new block; the old one stays live until the end.
    pub(super) fn adopt(&mut self, name: BlockId, ptr: NonNull<u8>, size: usize) {
        self.tell(None, Some(ptr), size);
        let mut block = Live {
            block: name,
            ptr,
            size,
            phase: 0,
        };
        let phase = self.phase();
        block.fill(phase);
        self.asked += size as u64;
        self.named.insert(name, self.live.len());
        self.live.push(block);
    }

    /// Where the block named `name` is in `live`, if it is live.
    fn slot(&self, name: BlockId) -> Option<usize> {
        self.named.get(&name).copied()
    }

    /// What the policy holds beside this client's bytes now, when this is the case's
    /// one client thread; the stretch since the last trim ends here.
    pub(super) fn sample_holdings(&mut self) {
        if self.mailboxes.len() != 1 {
            return;
        }
        if let Ok((_, held)) = self.handler.held_from_host() {
            let live = self.live.iter().map(|b| b.size as u64).sum();
            self.holdings.sample(held, live, self.asked, self.freed);
        }
        (self.asked, self.freed) = (0, 0);
    }

    /// Run one operation; an operation on a block that is not live is skipped (and not
    /// recorded).
    pub(super) fn run(&mut self, op: &Op) -> Result<(), Finding> {
        let h = self.handler;
        if h.placement() != Placement::Host
            && matches!(
                op,
                Op::Calloc { .. } | Op::Realloc { .. } | Op::ReallocNew { .. }
            )
        {
            // A GPU program's memory is only allocated and freed: the host never zeroes
            // or copies it.
            return Ok(());
        }
        self.take_passed()?;
        self.adversary.begin_operation();
        let err = |e: Error| Finding::from_error(&e);
        match *op {
            Op::Malloc { block, size } => {
                self.ran.push(*op);
                if let Some(ptr) = h.malloc(size as usize).map_err(err)? {
                    self.adopt(block, ptr, size as usize);
                }
            }
            Op::Calloc {
                block,
                nelem,
                elsize,
            } => {
                self.ran.push(*op);
                // The handler checks the answer is zero (`HandlerBuilder::checked`).
                if let Some(ptr) = h.calloc(nelem as usize, elsize as usize).map_err(err)? {
                    let size = nelem
                        .checked_mul(elsize)
                        .expect("an overflowing calloc is none")
                        as usize;
                    self.adopt(block, ptr, size);
                }
            }
            Op::ReallocNew { block, size } => {
                self.ran.push(*op);
                if let Some(ptr) = h.realloc(None, size as usize).map_err(err)? {
                    self.adopt(block, ptr, size as usize);
                }
            }
            Op::Realloc { block, size } => {
                let Some(slot) = self.slot(block) else {
                    return Ok(());
                };
                self.ran.push(*op);
                let old = &self.live[slot];
                let (old_ptr, old_size) = (old.ptr, old.size);
                match h.realloc(Some(old_ptr), size as usize).map_err(err)? {
                    None => {
                        if let Some(at) = old.first_changed(old_size) {
                            return Err(self.lost("realloc", old, at, |offset| {
                                Rule::LiveBlockChanged { offset }
                            }));
                        }
                    }
                    Some(ptr) => {
                        self.tell(Some(old_ptr), Some(ptr), size as usize);
                        let moved = Live {
                            block,
                            ptr,
                            size: size as usize,
                            phase: old.phase,
                        };
                        if let Some(at) = moved.first_changed_as(old_size, old_size) {
                            return Err(self.lost("realloc", &moved, at, |offset| {
                                Rule::ReallocLostBytes { offset }
                            }));
                        }
                        self.live[slot] = moved;
                        self.asked += size;
                        let phase = self.phase();
                        self.live[slot].fill(phase);
                    }
                }
            }
            Op::Free { block } => {
                let Some(slot) = self.slot(block) else {
                    return Ok(());
                };
                self.ran.push(*op);
                self.free_slot(slot)?;
            }
            Op::Pass { block } => {
                let Some(slot) = self.slot(block) else {
                    return Ok(());
                };
                self.ran.push(*op);
                let block = self.forget(slot);
                self.mailboxes.put(self.thread + 1, &block);
            }
            Op::OomAfter { .. } | Op::OomEvery { .. } | Op::OomAbove { .. } => {
                self.ran.push(*op);
                match *op {
                    Op::OomAfter { requests } => self.adversary.refuse_after(requests),
                    Op::OomEvery { n } => self
                        .adversary
                        .refuse_every(u32::try_from(n).unwrap_or(u32::MAX)),
                    Op::OomAbove { size } => self.adversary.refuse_above(size),
                    _ => unreachable!("matched above"),
                }
                return Ok(());
            }
            Op::Trim => {
                self.ran.push(Op::Trim);
                self.sample_holdings();
                h.trim().map_err(err)?;
                // What a policy gives back must not be under a live block.
                for block in &self.live {
                    if let Some(at) = block.first_changed(block.size) {
                        return Err(self.lost("trim", block, at, |offset| {
                            Rule::LiveBlockChanged { offset }
                        }));
                    }
                }
            }
        }
        self.look_around()
    }

    pub(super) fn free_slot(&mut self, slot: usize) -> Result<(), Finding> {
        let block = &self.live[slot];
        if let Some(at) = block.first_changed(block.size) {
            return Err(
                self.lost("free", block, at, |offset| Rule::LiveBlockChanged {
                    offset,
                }),
            );
        }
        let block = self.forget(slot);
        self.freed += block.size as u64;
        self.give_back(&block)
    }

    /// Take the block at `slot` out of this thread's live blocks.
    fn forget(&mut self, slot: usize) -> Live {
        // The last block moves into the freed place. A name points at one block only (a
        // name made again points at the newer block), so each is updated only where it
        // pointed at the place that changed.
        let last = self.live.len() - 1;
        let block = self.live.swap_remove(slot);
        if self.named.get(&block.block) == Some(&slot) {
            self.named.remove(&block.block);
        }
        if let Some(moved) = self.live.get(slot)
            && self.named.get(&moved.block) == Some(&last)
        {
            self.named.insert(moved.block, slot);
        }
        block
    }

    /// Free a block that is no longer live here, checked intact already.
    fn give_back(&mut self, block: &Live) -> Result<(), Finding> {
        self.adversary.begin_operation();
        self.handler
            .free(Some(block.ptr), block.size)
            .map_err(|e| Finding::from_error(&e))?;
        self.tell(Some(block.ptr), None, 0);
        Ok(())
    }

    /// After every call, a sparse look at a few live blocks in turn, so the cost per
    /// call stays flat however many blocks are live; every block is compared in full
    /// when it is freed or reallocated, and at the end of the sequence.
    pub(super) fn look_around(&mut self) -> Result<(), Finding> {
        const BLOCKS_PER_CALL: usize = 4;
        for _ in 0..BLOCKS_PER_CALL.min(self.live.len()) {
            self.next_look = (self.next_look + 1) % self.live.len();
            let block = &self.live[self.next_look];
            if let Some(at) = block.first_changed_sparse() {
                return Err(
                    self.lost("(any call)", block, at, |offset| Rule::LiveBlockChanged {
                        offset,
                    }),
                );
            }
        }
        Ok(())
    }

    /// Check and free the blocks other threads passed to this one: frees from a thread
    /// that did not make them.
    pub(super) fn take_passed(&mut self) -> Result<(), Finding> {
        for (addr, size, phase) in self.mailboxes.take(self.thread) {
            let block = Live {
                block: 0,
                ptr: NonNull::new(addr as *mut u8).expect("a passed block is lent"),
                size,
                phase,
            };
            if let Some(at) = block.first_changed(size) {
                return Err(
                    self.lost("free", &block, at, |offset| Rule::LiveBlockChanged {
                        offset,
                    }),
                );
            }
            self.give_back(&block)?;
            (self.mailboxes.freed).fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// Free every live block, newest first, and every block passed to this thread.
    pub(super) fn free_all(&mut self) -> Result<(), Finding> {
        self.free_all_by(None).map(drop)
    }

    /// [`Self::free_all`], starting no free past `deadline`: whether every block was
    /// freed. A case's frees at its end are calls of the policy like any other, and
    /// with many threads on a slow policy they take longer than the case's operations.
    pub(super) fn free_all_by(&mut self, deadline: Option<Instant>) -> Result<bool, Finding> {
        self.take_passed()?;
        while let Some(last) = self.live.len().checked_sub(1) {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            self.free_slot(last)?;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use allocbox::{HandlerBuilder, Runtime};

    use super::*;

    /// Issue 64: `--threads 64 --time 2` over a slow policy ran 71 s, each thread's
    /// closing frees unbounded by the deadline. Past it no free starts; the blocks are
    /// the dropped handler's to release, calling no policy.
    #[test]
    fn no_closing_free_starts_past_the_deadline() {
        let policy = Runtime::shared()
            .load(allocbox::DEFAULT_POLICY_WAT.as_bytes())
            .unwrap();
        let adversary = Arc::new(Adversary::new(1));
        let handler = HandlerBuilder::new(Runtime::shared())
            .link(&policy)
            .checked(true)
            .adversary(Arc::clone(&adversary))
            .build()
            .unwrap();
        let mailboxes = Mailboxes::new(1);
        let mut client = Client::new(&handler, &adversary, None, (0, &mailboxes));
        for block in 0..3 {
            client.run(&Op::Malloc { block, size: 64 }).unwrap();
        }
        assert!(matches!(
            client.free_all_by(Some(Instant::now())),
            Ok(false)
        ));
        assert_eq!(client.live.len(), 3, "no free started");
        assert!(matches!(client.free_all_by(None), Ok(true)));
        assert!(client.live.is_empty());
        handler.leak_check().unwrap();
    }
}
