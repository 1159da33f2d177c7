//! A hasher for addresses and block ids on hot paths: one multiply and a fold, where
//! SipHash would cost more than the lookup it serves. Not for untrusted keys chosen to
//! collide — ours come from the host's own allocator or a trace's sequential ids.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

#[derive(Default)]
pub(crate) struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, key: u64) {
        // Addresses are 16-aligned: folding the high half of the product down gives the
        // table's low index bits entropy.
        let x = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = x ^ (x >> 32);
    }
}

/// A `HashMap` keyed by addresses or ids.
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<AddrHasher>>;
