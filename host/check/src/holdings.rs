//! What a policy held from the host against what its client held, over a check: sampled
//! just before each trim and at each case's end (where a policy's holdings peak, as a
//! trim gives them back), in the cases of one client thread. No rule is about it: a
//! policy may cache what it likes and give it back when trimmed. But one that reuses
//! none of the blocks freed between trims grows without bound in a program that never
//! trims, and its author wants to know.

/// Bytes the client must have asked for, and freed, since the last trim for a stretch to
/// say whether the policy reused what was freed in it.
pub const REUSE_SPAN: u64 = 1 << 20;

/// Stretches of at least [`REUSE_SPAN`] without reuse, every one of them, past which
/// a check warns that the policy grows between trims.
const WARN_AFTER: u64 = 4;

/// A check's account of what the policy held beside its client's bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Holdings {
    /// Moments sampled.
    pub samples: u64,
    /// At the moment the policy held the most beyond its client's bytes: `(held from
    /// the host, the client's bytes)`.
    pub most_beyond: Option<(u64, u64)>,
    /// Stretches between trims in which the client asked for [`REUSE_SPAN`] or more and
    /// freed as much.
    pub stretches: u64,
    /// Of those, the ones at whose end the policy held, beyond its client's bytes, 90%
    /// or more of what was freed in the stretch: it reused (next to) none of it.
    pub without_reuse: u64,
}

impl Holdings {
    /// A moment: the policy holds `held` from the host, the client `live`, and the
    /// client asked for `asked` and freed `freed` since the last trim.
    pub(crate) fn sample(&mut self, held: u64, live: u64, asked: u64, freed: u64) {
        self.samples += 1;
        let beyond = held.saturating_sub(live);
        if self
            .most_beyond
            .is_none_or(|(h, l)| beyond > h.saturating_sub(l))
        {
            self.most_beyond = Some((held, live));
        }
        if asked >= REUSE_SPAN && freed >= REUSE_SPAN {
            self.stretches += 1;
            if beyond >= freed / 10 * 9 {
                self.without_reuse += 1;
            }
        }
    }

    pub(crate) fn merge(&mut self, other: Holdings) {
        self.samples += other.samples;
        self.stretches += other.stretches;
        self.without_reuse += other.without_reuse;
        if let Some((held, live)) = other.most_beyond
            && self
                .most_beyond
                .is_none_or(|(h, l)| held.saturating_sub(live) > h.saturating_sub(l))
        {
            self.most_beyond = Some((held, live));
        }
    }

    /// Whether every stretch long enough to tell, and enough of them, ended with the
    /// policy holding what was asked in it: memory that grows without bound until trim.
    pub fn grows_between_trims(&self) -> bool {
        self.stretches >= WARN_AFTER && self.without_reuse == self.stretches
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_holding_all_it_was_asked_between_trims_grows_and_one_reusing_does_not() {
        let mut hoarding = Holdings::default();
        let mut reusing = Holdings::default();
        for _ in 0..WARN_AFTER {
            hoarding.sample(
                3 * REUSE_SPAN,
                REUSE_SPAN / 2,
                2 * REUSE_SPAN,
                2 * REUSE_SPAN,
            );
            reusing.sample(REUSE_SPAN, REUSE_SPAN / 2, 2 * REUSE_SPAN, 2 * REUSE_SPAN);
        }
        assert!(hoarding.grows_between_trims());
        assert!(!reusing.grows_between_trims());
        assert_eq!(reusing.most_beyond, Some((REUSE_SPAN, REUSE_SPAN / 2)));
        let mut both = hoarding;
        both.merge(reusing);
        assert!(
            !both.grows_between_trims(),
            "one stretch with reuse says it reuses"
        );
        assert_eq!(both.most_beyond, Some((3 * REUSE_SPAN, REUSE_SPAN / 2)));
        let mut short = Holdings::default();
        short.sample(REUSE_SPAN, 0, 2 * REUSE_SPAN, REUSE_SPAN - 1);
        assert_eq!(short.stretches, 0, "too little asked to tell");
    }
}
