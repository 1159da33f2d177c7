//! `guard`: catches a client writing past the end of its blocks, in the spirit of
//! GWP-ASan, for NumPy array data.
//!
//! - One allocation in `sample` (default 1000; `sample=1` guards all) is placed in a
//!   region of its own, mapped with a guard page right after it (`memory`, kind
//!   `guarded`), so that the block ends where the guard page starts: a write one byte
//!   past its end faults in the client at that write, and the embedder names the block.
//!   Without the `guarded` grant the region is refused and the block gets a canary
//!   instead (`guard-refused` counts them). So does a block past the policy's share of
//!   guarded memory: at most half of the overhead budget the host told at `init`, so that
//!   canaries and the host's records of many small blocks fit in the rest and the
//!   policy serves on rather than failing (`guard-budget` counts those).
//! - Every other block carries [`CANARY`] bytes after its end, written when it is
//!   lent and compared when it is freed; an overwritten canary is reported to the host as
//!   the client's misuse (`diagnostics`), with the offset of the first byte changed,
//!   and the program goes on.
//!
//! A block is aligned to the largest power of two that divides its size, up to 16 (a
//! guarded block must end exactly at the guard page): every element of an array of
//! any dtype stays aligned to its size. The policy therefore promises alignment 1.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use allocbox_policy::memory::{self, Guard, Kind};
use allocbox_policy::{Config, Info, Policy, bytes, diagnostics, export_policy, upstream};

/// Bytes of canary after every unguarded block.
const CANARY: u64 = 16;
/// The most any block is aligned to.
const MAX_ALIGNMENT: u64 = 16;

struct Guarded {
    /// Every `sample`-th allocation is guarded.
    sample: u64,
    allocations: Cell<u64>,
    /// Guarded blocks: block address -> (region start, region size asked).
    regions: RefCell<HashMap<u64, (u64, u64)>>,
    /// What the live guarded regions take of the host's memory (every page mapped, the
    /// guard page included), and the most they may.
    guarded_bytes: Cell<u64>,
    guarded_share: u64,
    counters: RefCell<Counters>,
}

#[derive(Default)]
struct Counters {
    guarded: u64,
    guard_refused: u64,
    guard_budget: u64,
    canaries_checked: u64,
    overruns: u64,
}

/// The canary of the block at `block`: it depends on the address, so a canary copied
/// from another block does not pass.
fn canary(block: u64) -> [u8; CANARY as usize] {
    let seed = (block >> 4) as u8;
    std::array::from_fn(|i| seed ^ 0xA5 ^ (i as u8).wrapping_mul(29))
}

/// The alignment of a block of `size` bytes that ends at a page boundary.
fn natural_alignment(size: u64) -> u64 {
    (1 << size.trailing_zeros().min(63)).min(MAX_ALIGNMENT)
}

impl Guarded {
    fn sampled(&self) -> bool {
        let n = self.allocations.get();
        self.allocations.set(n.wrapping_add(1));
        n.is_multiple_of(self.sample)
    }

    /// A block of `size` bytes ending at a guard page, or `None` when the region is
    /// refused (not granted, over the budget).
    fn guarded(&self, size: u64) -> Option<u64> {
        let kind = Kind {
            guard: Guard::After,
            ..Kind::NORMAL
        };
        let cost = memory::region_size(size, kind.pages) + memory::page_size(kind.pages);
        let after = self.guarded_bytes.get().saturating_add(cost);
        if after > self.guarded_share {
            self.counters.borrow_mut().guard_budget += 1;
            return None;
        }
        let region = match memory::map(size, kind) {
            Ok(region) => region,
            Err(_) => {
                self.counters.borrow_mut().guard_refused += 1;
                return None;
            }
        };
        let end = region + memory::region_size(size, kind.pages);
        let block = (end - size) & !(natural_alignment(size) - 1);
        self.regions.borrow_mut().insert(block, (region, size));
        self.guarded_bytes.set(after);
        self.counters.borrow_mut().guarded += 1;
        Some(block)
    }

    /// A block of `size` bytes with a canary after it, from upstream memory got with
    /// `get` (malloc or calloc of the padded size).
    fn with_canary(&self, size: u64, get: impl FnOnce(u64) -> u64) -> u64 {
        let Some(padded) = size.checked_add(CANARY) else {
            return 0;
        };
        let block = get(padded);
        if block != 0 {
            bytes::write(block + size, &canary(block));
        }
        block
    }

    /// Compare the canary of the block at `block` of `size` bytes, reporting the first
    /// byte the client changed.
    fn check_canary(&self, block: u64, size: u64) {
        let found = bytes::read(block + size, CANARY as u32);
        let mut counters = self.counters.borrow_mut();
        counters.canaries_checked += 1;
        let expected = canary(block);
        let Some(first) = found.iter().zip(expected).position(|(a, b)| *a != b) else {
            return;
        };
        let last = found
            .iter()
            .zip(expected)
            .rposition(|(a, b)| *a != b)
            .unwrap_or(first);
        counters.overruns += 1;
        let written = last - first + 1;
        diagnostics::client_misuse(
            block,
            size,
            size + first as u64,
            &format!(
                "the client wrote past the end of the block: {written} byte{} of the canary after it changed, the first at offset {}",
                if written == 1 { "" } else { "s" },
                size + first as u64
            ),
        );
    }
}

impl Policy for Guarded {
    fn init(config: &mut Config) -> Result<Self, String> {
        let sample = config.get_in("sample", 1..=u64::MAX, 1000)?;
        Ok(Guarded {
            sample,
            allocations: Cell::new(0),
            regions: RefCell::new(HashMap::new()),
            guarded_bytes: Cell::new(0),
            guarded_share: config.limits().overhead / 2,
            counters: RefCell::new(Counters::default()),
        })
    }

    fn info(&self) -> Info {
        // Guarded blocks end at a page boundary; canaries are reported at free, so the
        // host must pass each free on (no batching).
        Info::new().alignment(1).batch(false).diagnoses(true)
    }

    fn malloc(&self, size: u64) -> u64 {
        if self.sampled()
            && let Some(block) = self.guarded(size)
        {
            return block;
        }
        self.with_canary(size, upstream::malloc)
    }

    fn calloc(&self, nelem: u64, elsize: u64) -> u64 {
        let Some(size) = nelem.checked_mul(elsize) else {
            return 0;
        };
        // A mapped region is zero-filled already.
        if self.sampled()
            && let Some(block) = self.guarded(size)
        {
            return block;
        }
        self.with_canary(size, |padded| upstream::calloc(1, padded))
    }

    fn free(&self, ptr: u64, size: u64) {
        let guarded = self.regions.borrow_mut().remove(&ptr);
        match guarded {
            Some((region, asked)) => {
                let pages = Kind::NORMAL.pages;
                let cost = memory::region_size(asked, pages) + memory::page_size(pages);
                self.guarded_bytes.set(self.guarded_bytes.get() - cost);
                memory::unmap(region, asked)
            }
            None => {
                self.check_canary(ptr, size);
                upstream::free(ptr, size + CANARY);
            }
        }
    }

    fn report(&self) -> Vec<(String, u64)> {
        let c = self.counters.borrow();
        [
            ("guarded", c.guarded),
            ("guard-refused", c.guard_refused),
            ("guard-budget", c.guard_budget),
            ("canaries-checked", c.canaries_checked),
            ("overruns", c.overruns),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .collect()
    }
}

export_policy!(Guarded, name = "guard");
