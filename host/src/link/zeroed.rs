//! Memory known to hold only zeros during one call of a policy: what lets the host hand
//! a `calloc` answer to the client without zeroing it again.

/// Ranges of upstream memory that hold only zeros as far as the host saw in the
/// current call: blocks upstream answered a `calloc` with (the host's memory comes
/// zeroed from the system; a lower link's `calloc` answer is made zero by the host),
/// and ranges the policy filled with 0. Bytes are forgotten when anything may write
/// them: a `bytes` write, fill or copy into them, or a give-back or new upstream block
/// over them; the rest of a range stays known (a policy writes a header just before
/// the block it answers). Only a bounded number of ranges is remembered; forgetting one
/// costs a host-side zeroing, never a wrong answer.
#[derive(Debug, Default)]
pub(super) struct Zeroed {
    /// `(start, end)`.
    ranges: Vec<(u64, u64)>,
}

/// Ranges remembered in one call; a policy filling many stretches with 0 in one call
/// gets the oldest forgotten.
const RANGES: usize = 16;

impl Zeroed {
    /// A new call starts: nothing is known yet.
    #[inline]
    pub(super) fn clear(&mut self) {
        self.ranges.clear();
    }

    /// `[at, at+len)` holds only zeros now.
    pub(super) fn add(&mut self, at: u64, len: u64) {
        if let Some(end) = at.checked_add(len).filter(|_| len > 0) {
            self.keep(at, end);
        }
    }

    fn keep(&mut self, start: u64, end: u64) {
        if self.ranges.len() == RANGES {
            self.ranges.remove(0);
        }
        self.ranges.push((start, end));
    }

    /// `[at, at+len)` may change: forget those bytes, keeping the rest of every range.
    #[inline]
    pub(super) fn forget(&mut self, at: u64, len: u64) {
        if self.ranges.is_empty() {
            return;
        }
        let end = at.saturating_add(len);
        let mut i = 0;
        while i < self.ranges.len() {
            let (start, stop) = self.ranges[i];
            if stop <= at || end <= start {
                i += 1;
                continue;
            }
            self.ranges.swap_remove(i);
            if start < at {
                self.keep(start, at);
            }
            if end < stop {
                self.keep(end, stop);
            }
        }
    }

    /// Does `[at, at+len)` lie inside one range known to hold only zeros?
    pub(super) fn covers(&self, at: u64, len: u64) -> bool {
        let end = at.saturating_add(len);
        self.ranges
            .iter()
            .any(|&(start, stop)| start <= at && end <= stop)
    }
}

#[cfg(test)]
mod tests {
    use super::Zeroed;

    #[test]
    fn a_range_is_known_zero_until_anything_overlapping_it_may_change() {
        let mut z = Zeroed::default();
        z.add(100, 50);
        assert!(z.covers(100, 50) && z.covers(120, 10));
        assert!(!z.covers(90, 20) && !z.covers(140, 20));
        z.forget(149, 1);
        assert!(
            !z.covers(100, 50),
            "a write at its last byte forgets that byte"
        );
        assert!(z.covers(100, 49), "and keeps the rest");
        z.forget(92, 16);
        assert!(
            !z.covers(100, 8) && z.covers(108, 41),
            "a header written over its start"
        );
        z.forget(120, 2);
        assert!(z.covers(108, 12) && z.covers(122, 27) && !z.covers(108, 41));
        z.forget(149, 10);
        assert!(z.covers(122, 27), "a write just past it leaves it");
        z.clear();
        assert!(!z.covers(100, 1));
    }

    #[test]
    fn only_the_newest_ranges_are_remembered() {
        let mut z = Zeroed::default();
        for i in 0..20 {
            z.add(i * 1000, 10);
        }
        assert!(!z.covers(0, 10) && z.covers(19_000, 10));
    }
}
