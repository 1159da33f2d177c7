//! The reference model: the blocks a client holds and the bytes each must hold.

use std::ptr::NonNull;

use super::pattern::{CHUNK, PERIOD, expected_at, template};
use super::script::BlockId;

pub(super) struct Live {
    /// The script's name for the block.
    pub(super) block: BlockId,
    pub(super) ptr: NonNull<u8>,
    pub(super) size: usize,
    /// Where in the pattern this block starts (0..PERIOD), distinct from block to block.
    pub(super) phase: usize,
}

impl Live {
    pub(super) fn bytes(&self) -> &[u8] {
        // SAFETY: the block is live (lent by the handler, not yet freed by this model)
        // and `size` bytes long; only this model's thread touches it.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.size) }
    }

    pub(super) fn expected(&self) -> &'static [u8] {
        &template()[self.phase..self.phase + CHUNK]
    }

    /// The byte ranges that hold the pattern: all of a block up to `SAMPLED_ABOVE`
    /// bytes; for larger ones the first and last 4 KiB and 64 probes of 64 bytes between.
    /// Writing every byte of a megabyte block page-faults every page and costs more
    /// than it finds; the probes still see a lost or shifted copy.
    pub(super) fn ranges(size: usize) -> Vec<std::ops::Range<usize>> {
        const SAMPLED_ABOVE: usize = 64 << 10;
        const EDGE: usize = 4 << 10;
        if size <= SAMPLED_ABOVE {
            return std::iter::once(0..size).collect();
        }
        let mut ranges: Vec<_> = std::iter::once(0..EDGE).collect();
        let step = (size - 2 * EDGE) / 65;
        ranges.extend((1..=64).map(|k| EDGE + k * step..EDGE + k * step + 64));
        ranges.push(size - EDGE..size);
        ranges
    }

    pub(super) fn fill(&mut self, phase: usize) {
        self.phase = phase % PERIOD;
        let expected = self.expected();
        // SAFETY: as in `bytes`; writing through the block's own pointer.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.size) };
        for range in Self::ranges(self.size) {
            for (k, chunk) in bytes[range.clone()].chunks_mut(CHUNK).enumerate() {
                let from = (range.start + k * CHUNK) % PERIOD;
                chunk.copy_from_slice(&expected_at(expected, from)[..chunk.len()]);
            }
        }
    }

    /// The first offset below `len` that does not hold the pattern this block was
    /// filled with (`filled` is the size it had then).
    pub(super) fn first_changed_as(&self, filled: usize, len: usize) -> Option<usize> {
        let bytes = &self.bytes()[..len.min(self.size)];
        let expected = self.expected();
        Self::ranges(filled).into_iter().find_map(|range| {
            let range = range.start.min(bytes.len())..range.end.min(bytes.len());
            bytes[range.clone()]
                .chunks(CHUNK)
                .enumerate()
                .find_map(|(k, chunk)| {
                    let start = range.start + k * CHUNK;
                    let want = &expected_at(expected, start % PERIOD)[..chunk.len()];
                    (chunk != want).then(|| {
                        start
                            + chunk
                                .iter()
                                .zip(want)
                                .position(|(a, b)| a != b)
                                .expect("differs")
                    })
                })
        })
    }

    /// The first offset below `len` that does not hold the pattern.
    pub(super) fn first_changed(&self, len: usize) -> Option<usize> {
        self.first_changed_as(self.size, len)
    }

    /// A cheap look after every call: the first and last 16 bytes.
    pub(super) fn first_changed_sparse(&self) -> Option<usize> {
        let bytes = self.bytes();
        let expected = self.expected();
        (0..self.size.min(16))
            .chain(self.size.saturating_sub(16)..self.size)
            .find(|&i| bytes[i] != expected[i % PERIOD])
    }
}
