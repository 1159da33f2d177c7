//! The block a policy's own `realloc` is resizing.

/// The block a policy's own `realloc` is resizing, and the upstream memory the policy
/// gave back during that call.
///
/// The invariant it keeps: while a block is in transit the client's bytes stay where
/// they are — upstream memory under the block is held back, not released — and no
/// answer may lie in memory the policy gave back. Once the answer is admitted the
/// held-back memory is released; if the call fails, the policy is stopped and the
/// memory stays on its books until its client lets go of the old block.
#[derive(Debug, Default)]
pub(super) struct Transit {
    block: Option<(u64, u64)>,
    held_back: Vec<(u64, u64)>,
}

impl Transit {
    pub(super) fn begin(&mut self, ptr: u64, size: u64) {
        debug_assert!(self.block.is_none() && self.held_back.is_empty());
        self.block = Some((ptr, size));
    }

    /// End the transit, returning what was held back.
    pub(super) fn end(&mut self) -> Vec<(u64, u64)> {
        self.block = None;
        std::mem::take(&mut self.held_back)
    }

    /// Does `[at, at+len)` lie wholly inside the block in transit?
    pub(super) fn within_block(&self, at: u64, len: u64) -> bool {
        self.block
            .is_some_and(|(p, s)| at >= p && at.checked_add(len).is_some_and(|e| e <= p + s))
    }

    /// Does the upstream block `[ptr, ptr+size)` hold (part of) the block in transit?
    pub(super) fn under_block(&self, ptr: u64, size: u64) -> bool {
        self.block
            .is_some_and(|(p, s)| p < ptr.saturating_add(size) && ptr < p + s)
    }

    /// A held-back upstream block that `[at, at+len)` overlaps.
    pub(super) fn held_back_overlapping(&self, at: u64, len: u64) -> Option<(u64, u64)> {
        let end = at.saturating_add(len);
        self.held_back
            .iter()
            .copied()
            .find(|&(p, s)| p < end && at < p + s)
    }

    /// Is no upstream memory held back?
    pub(super) fn holds_back_nothing(&self) -> bool {
        self.held_back.is_empty()
    }

    /// Keep `[ptr, ptr+size)`, given back during the transit, until it ends.
    pub(super) fn hold_back(&mut self, ptr: u64, size: u64) {
        self.held_back.push((ptr, size));
    }

    /// Was the block at `ptr` given back during the transit?
    pub(super) fn is_held_back(&self, ptr: u64) -> bool {
        self.held_back.iter().any(|&(p, _)| p == ptr)
    }

    /// The address of the block in transit.
    pub(super) fn block_addr(&self) -> Option<u64> {
        self.block.map(|(p, _)| p)
    }
}
