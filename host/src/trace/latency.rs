//! Each event's time in a replay, counted in memory that does not grow with the trace:
//! exact up to 65,535 ns (nearly every event of every policy), and within 1/128 of the
//! value above, where an event waited for the OS.

/// Times below this many nanoseconds are counted exactly.
const EXACT: u32 = 1 << 16;
/// Buckets per power of two above [`EXACT`].
const PER_OCTAVE: u32 = 128;

/// A histogram of per-event nanoseconds.
#[derive(Debug, Clone)]
pub(crate) struct Latencies {
    exact: Vec<u64>,
    /// From [`EXACT`] up, [`PER_OCTAVE`] buckets per power of two.
    coarse: Vec<u64>,
    count: u64,
    sum: u64,
    most: u32,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies {
            exact: vec![0; EXACT as usize],
            coarse: vec![0; ((u32::BITS - EXACT.trailing_zeros()) * PER_OCTAVE) as usize],
            count: 0,
            sum: 0,
            most: 0,
        }
    }
}

impl Latencies {
    pub(crate) fn add(&mut self, ns: u32) {
        self.count += 1;
        self.sum += u64::from(ns);
        self.most = self.most.max(ns);
        match ns < EXACT {
            true => self.exact[ns as usize] += 1,
            false => self.coarse[coarse_bucket(ns)] += 1,
        }
    }

    /// The sum of every time counted.
    pub(crate) fn sum(&self) -> u64 {
        self.sum
    }

    /// The most.
    pub(crate) fn most(&self) -> u64 {
        u64::from(self.most)
    }

    /// The value at quantile `q` (the one a sorted list has at `round((n - 1) q)`); a
    /// value above [`EXACT`] is its bucket's least. 0 when nothing was counted.
    pub(crate) fn quantile(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((self.count - 1) as f64 * q).round() as u64;
        let mut seen = 0;
        for (ns, &n) in self.exact.iter().enumerate() {
            seen += n;
            if seen > rank {
                return ns as u64;
            }
        }
        for (bucket, &n) in self.coarse.iter().enumerate() {
            seen += n;
            if seen > rank {
                return coarse_least(bucket).min(self.most());
            }
        }
        self.most()
    }
}

/// The bucket of `ns` ≥ [`EXACT`]: its power of two and its next 7 bits.
fn coarse_bucket(ns: u32) -> usize {
    let octave = u32::BITS - 1 - ns.leading_zeros();
    let fraction = (ns >> (octave - PER_OCTAVE.trailing_zeros())) & (PER_OCTAVE - 1);
    ((octave - EXACT.trailing_zeros()) * PER_OCTAVE + fraction) as usize
}

/// The least value of a coarse bucket.
fn coarse_least(bucket: usize) -> u64 {
    let octave = bucket as u32 / PER_OCTAVE + EXACT.trailing_zeros();
    let fraction = u64::from(bucket as u32 % PER_OCTAVE);
    (1u64 << octave) + (fraction << (octave - PER_OCTAVE.trailing_zeros()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_quantile_is_the_sorted_list_s_value_exactly_below_65536_and_within_1_128_above(
            times in proptest::collection::vec(prop_oneof![0u32..2000, any::<u32>()], 1..400),
            q in 0.0f64..=1.0,
        ) {
            let mut latencies = Latencies::default();
            for &t in &times {
                latencies.add(t);
            }
            let mut sorted = times.clone();
            sorted.sort_unstable();
            let exact = u64::from(sorted[((sorted.len() - 1) as f64 * q).round() as usize]);
            let got = latencies.quantile(q);
            match exact < u64::from(EXACT) {
                true => prop_assert_eq!(got, exact),
                false => prop_assert!(got <= exact && exact - got <= exact / 128, "{got} for {exact}"),
            }
            prop_assert_eq!(latencies.most(), u64::from(*sorted.last().unwrap()));
            prop_assert_eq!(latencies.sum(), times.iter().map(|&t| u64::from(t)).sum::<u64>());
        }
    }
}
