//! `numa`: places large arrays on NUMA nodes, as `npynuma` does for NumPy, but from a
//! sandbox and safe with threads (the host calls a policy on one thread at a time).
//!
//! Blocks of at least `min-size` bytes (default 1 MiB) are regions of their own mapped
//! by the host with the placement asked for (`memory`, which the embedder must grant as
//! `numa`): `node=N` binds them to node N, `preferred=N` puts them there while it has
//! free memory, `interleave=all` spreads their pages over every node. Smaller blocks,
//! and large ones whose placement the host refuses (no grant, no such node), come from
//! upstream. At most one of `node`, `preferred` and `interleave` is given; none is
//! `interleave=all`.

use std::cell::RefCell;
use std::collections::HashMap;

use allocbox_policy::memory::{self, Kind, Numa};
use allocbox_policy::{Config, Policy, export_policy, upstream};

struct Placed {
    numa: Numa,
    min_size: u64,
    /// Placed blocks (each the start of its region): the size their region was mapped
    /// with.
    regions: RefCell<HashMap<u64, u64>>,
    counters: RefCell<[u64; 3]>,
}

const PLACED: usize = 0;
const PLACED_BYTES: usize = 1;
const REFUSED: usize = 2;

impl Placed {
    /// A region of `size` bytes placed as configured, or 0 when refused.
    fn placed(&self, size: u64) -> u64 {
        let kind = Kind {
            numa: self.numa,
            ..Kind::NORMAL
        };
        let mut counters = self.counters.borrow_mut();
        match memory::map(size, kind) {
            Ok(region) => {
                counters[PLACED] += 1;
                counters[PLACED_BYTES] += size;
                self.regions.borrow_mut().insert(region, size);
                region
            }
            Err(_) => {
                counters[REFUSED] += 1;
                0
            }
        }
    }
}

impl Policy for Placed {
    fn init(config: &mut Config) -> Result<Self, String> {
        let node = config.get::<u32>("node")?;
        let preferred = config.get::<u32>("preferred")?;
        let interleave = config.get_str("interleave")?;
        let numa = match (node, preferred, interleave.as_deref()) {
            (Some(node), None, None) => Numa::Bind(node),
            (None, Some(node), None) => Numa::Preferred(node),
            (None, None, Some("all") | None) => Numa::Interleave,
            (None, None, Some(other)) => {
                return Err(format!(
                    "bad value `{other}` for `interleave`: the one value is `all`"
                ));
            }
            _ => {
                return Err(
                    "give one of `node=N`, `preferred=N` and `interleave=all`, not several".into(),
                );
            }
        };
        let min_size = config.get_or("min-size", 1u64 << 20)?;
        Ok(Placed {
            numa,
            min_size,
            regions: RefCell::new(HashMap::new()),
            counters: RefCell::new([0; 3]),
        })
    }

    fn malloc(&self, size: u64) -> u64 {
        if size >= self.min_size {
            match self.placed(size) {
                0 => {}
                block => return block,
            }
        }
        upstream::malloc(size)
    }

    fn calloc(&self, nelem: u64, elsize: u64) -> u64 {
        let Some(size) = nelem.checked_mul(elsize) else {
            return 0;
        };
        // A mapped region is zero-filled already.
        if size >= self.min_size {
            match self.placed(size) {
                0 => {}
                block => return block,
            }
        }
        upstream::calloc(nelem, elsize)
    }

    fn free(&self, ptr: u64, size: u64) {
        match self.regions.borrow_mut().remove(&ptr) {
            Some(asked) => memory::unmap(ptr, asked),
            None => upstream::free(ptr, size),
        }
    }

    fn report(&self) -> Vec<(String, u64)> {
        let c = self.counters.borrow();
        vec![
            ("placed".to_string(), c[PLACED]),
            ("placed-bytes".to_string(), c[PLACED_BYTES]),
            ("refused".to_string(), c[REFUSED]),
        ]
    }
}

export_policy!(Placed, name = "numa");
