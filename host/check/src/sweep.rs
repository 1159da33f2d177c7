//! Configurations the check draws beside the one it was given. A bug that shows only
//! under one configuration (a block split at 16 bytes from a policy asked for 64-byte
//! alignment) survives millions of operations at the default; the check tries the
//! standard keys it knows, at each value the policy accepts, so nobody has to sweep them
//! by hand.

/// The values the check tries for `alignment`: each power of two above the contract's
/// 16, up to a page.
const ALIGNMENTS: [u64; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];

/// Every standard `(key, value)` the check may draw, for the keys the given
/// configuration leaves unset: a key the caller set is the caller's choice.
pub(super) fn candidates(given: &[(&str, &str)]) -> Vec<(&'static str, String)> {
    if given.iter().any(|(key, _)| *key == "alignment") {
        return Vec::new();
    }
    ALIGNMENTS
        .iter()
        .map(|a| ("alignment", a.to_string()))
        .collect()
}

/// Whether round `round` draws a configuration: every third, from the third on, so
/// that most rounds (and the first, which a one-round check runs) stay at the one
/// given, and both short and long-lived rounds are drawn.
pub(super) fn draws(round: u64) -> bool {
    round % 3 == 2
}

/// The configuration a drawing round adds to the one given: for each key among
/// `accepted` (the candidates the policy started with), one of its values, picked by
/// the round's `seed`.
pub(super) fn drawn(accepted: &[(&'static str, String)], seed: u64) -> Vec<(String, String)> {
    let mut keys: Vec<&str> = accepted.iter().map(|(key, _)| *key).collect();
    keys.dedup();
    keys.iter()
        .enumerate()
        .map(|(i, key)| {
            let values: Vec<&String> = accepted
                .iter()
                .filter(|(k, _)| k == key)
                .map(|(_, v)| v)
                .collect();
            // A different part of the seed for each key.
            let pick = (seed.rotate_right(17 + 7 * i as u32) % values.len() as u64) as usize;
            (key.to_string(), values[pick].clone())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_the_caller_set_is_never_drawn() {
        assert!(candidates(&[("alignment", "16")]).is_empty());
        assert_eq!(candidates(&[("fault", "none")]).len(), ALIGNMENTS.len());
    }

    #[test]
    fn a_drawing_round_picks_one_accepted_value_per_key_and_over_seeds_reaches_each() {
        let accepted = candidates(&[]);
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..256u64 {
            let config = drawn(&accepted, seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            assert_eq!(config.len(), 1);
            assert_eq!(config[0].0, "alignment");
            seen.insert(config[0].1.clone());
        }
        assert_eq!(seen.len(), ALIGNMENTS.len(), "{seen:?}");
        assert!(drawn(&[], 7).is_empty());
    }

    #[test]
    fn every_third_round_draws_and_the_first_never() {
        let drawing: Vec<u64> = (0..24).filter(|&r| draws(r)).collect();
        assert_eq!(drawing, [2, 5, 8, 11, 14, 17, 20, 23]);
    }
}
