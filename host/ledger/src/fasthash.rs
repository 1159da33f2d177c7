//! The hash map of the ledger's address index and other hot lookups.
//!
//! A link's ledger is keyed by addresses its policy chose, so the hash must not let a
//! policy pick keys that collide: foldhash seeds every map from a per-process random
//! seed, and a policy cannot observe it (its clocks are frozen unless granted, so it
//! cannot time the host's lookups). foldhash costs a folded multiply per `u64` key.

/// A `HashMap` keyed by addresses or ids, seeded per map.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
