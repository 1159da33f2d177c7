//! `gpu-pool`: the pool RAPIDS' RMM gives GPU programs, in a sandbox. Blocks of up to
//! 4 MiB come from size classes (powers of two from 256 bytes) carved out of large
//! regions (`region-size`, default 64 MiB) and kept on a free list per class when
//! freed; larger blocks are regions of their own, kept when freed (up to
//! `large-cache` bytes, by default half the overhead budget the host allows) for a
//! later block of at least half their size. `trim` gives back every region nothing is
//! lent from.
//!
//! `memory=device` (the default) places a device handler's blocks in memory of its GPU
//! (the `device` grant): PyTorch's tensors, CuPy's arrays, Numba's device arrays. The
//! host gives a freed block back only once the work queued on its streams has finished,
//! so reusing it at once is safe. `memory=pinned` places a host handler's blocks in
//! pinned host memory (the `pinned` grant): NumPy arrays that copies to a GPU read at
//! full speed.

use std::cell::RefCell;
use std::collections::BTreeMap;

use allocbox_policy::memory::{self, GpuKind};
use allocbox_policy::{Config, Info, Policy, export_policy};

/// Every block starts on this many bytes (what CUDA's own allocator promises).
const ALIGNMENT: u64 = 256;
/// The size classes: 256 bytes, 512, ... 4 MiB.
const CLASSES: usize = 15;
const LARGEST_CLASS: u64 = ALIGNMENT << (CLASSES - 1);

struct Region {
    /// The size the region was asked with: the one to unmap it with.
    asked: u64,
    /// Blocks lent from it and not given back.
    live: u64,
    /// One block of its own (a large one), not carved into classes.
    whole: bool,
}

#[derive(Default)]
struct State {
    regions: BTreeMap<u64, Region>,
    /// The region blocks are being carved from: its start, where the next block goes,
    /// and its end.
    carving: Option<(u64, u64, u64)>,
    free: [Vec<u64>; CLASSES],
    /// Large regions nothing is lent from, kept for reuse: `(start, asked)`.
    idle_large: Vec<(u64, u64)>,
    idle_large_bytes: u64,
    counters: Counters,
}

#[derive(Default)]
struct Counters {
    regions_mapped: u64,
    regions_unmapped: u64,
    region_bytes: u64,
    peak_region_bytes: u64,
    refused: u64,
    large_reused: u64,
}

struct Pool {
    source: GpuKind,
    region_size: u64,
    large_cache: u64,
    state: RefCell<State>,
}

/// The class of a block of `size` bytes (at most [`LARGEST_CLASS`]).
fn class(size: u64) -> usize {
    let units = size.max(1).div_ceil(ALIGNMENT);
    units.next_power_of_two().trailing_zeros() as usize
}

fn class_size(class: usize) -> u64 {
    ALIGNMENT << class
}

impl Pool {
    fn map(&self, state: &mut State, size: u64, whole: bool) -> Option<u64> {
        match memory::map_gpu(size, self.source) {
            Ok(start) => {
                let c = &mut state.counters;
                c.regions_mapped += 1;
                c.region_bytes += size;
                c.peak_region_bytes = c.peak_region_bytes.max(c.region_bytes);
                state.regions.insert(
                    start,
                    Region {
                        asked: size,
                        live: 0,
                        whole,
                    },
                );
                Some(start)
            }
            Err(_) => {
                state.counters.refused += 1;
                None
            }
        }
    }

    fn unmap(state: &mut State, start: u64) {
        if let Some(region) = state.regions.remove(&start) {
            memory::unmap(start, region.asked);
            state.counters.regions_unmapped += 1;
            state.counters.region_bytes -= region.asked;
        }
    }

    /// A block of `size` bytes (more than [`LARGEST_CLASS`]): a kept region that holds it
    /// and is at most twice as large (the smallest such), or a new one.
    fn large(&self, state: &mut State, size: u64) -> Option<u64> {
        let fit = state
            .idle_large
            .iter()
            .enumerate()
            .filter(|(_, (_, asked))| *asked >= size && *asked / 2 <= size)
            .min_by_key(|(_, (_, asked))| *asked)
            .map(|(at, _)| at);
        if let Some(at) = fit {
            let (start, asked) = state.idle_large.swap_remove(at);
            state.idle_large_bytes -= asked;
            state.counters.large_reused += 1;
            return Some(start);
        }
        self.map(state, size, true)
    }

    /// The start of the region `addr` lies in.
    fn region_of(state: &State, addr: u64) -> Option<u64> {
        state
            .regions
            .range(..=addr)
            .next_back()
            .map(|(&start, _)| start)
    }

    /// A block of class `class`, carved from the current region or a new one.
    fn carve(&self, state: &mut State, class: usize) -> Option<u64> {
        let size = class_size(class);
        let room = state.carving.filter(|&(_, next, end)| end - next >= size);
        let (start, next, end) = match room {
            Some(carving) => carving,
            None => {
                let len = self.region_size.max(size);
                let start = self.map(state, len, false)?;
                (start, start, start + len)
            }
        };
        state.carving = Some((start, next + size, end));
        Some(next)
    }
}

impl Policy for Pool {
    fn init(config: &mut Config) -> Result<Self, String> {
        let source = match config.get_str("memory")?.as_deref() {
            None | Some("device") => GpuKind::Device,
            Some("pinned") => GpuKind::Pinned,
            Some(other) => {
                return Err(format!(
                    "bad value `{other}` for `memory`: use `device` or `pinned`"
                ));
            }
        };
        let region_size: u64 = config.get_or("region-size", 64 << 20)?;
        let large_cache: u64 = config.get_or("large-cache", config.limits().overhead / 2)?;
        if region_size < LARGEST_CLASS {
            return Err(format!(
                "`region-size` is {region_size}: it must hold the largest class, {LARGEST_CLASS} bytes"
            ));
        }
        Ok(Pool {
            source,
            region_size,
            large_cache,
            state: RefCell::default(),
        })
    }

    fn info(&self) -> Info {
        Info::new().alignment(ALIGNMENT)
    }

    fn malloc(&self, size: u64) -> u64 {
        let state = &mut *self.state.borrow_mut();
        let block = if size > LARGEST_CLASS {
            self.large(state, size)
        } else {
            let class = class(size);
            state.free[class].pop().or_else(|| self.carve(state, class))
        };
        let Some(block) = block else {
            return 0;
        };
        let region = Pool::region_of(state, block).expect("every block lies in a region");
        state.regions.get_mut(&region).expect("found").live += 1;
        block
    }

    fn free(&self, ptr: u64, size: u64) {
        let state = &mut *self.state.borrow_mut();
        let Some(start) = Pool::region_of(state, ptr) else {
            return;
        };
        let region = state.regions.get_mut(&start).expect("found");
        region.live -= 1;
        if region.whole {
            let asked = region.asked;
            if state.idle_large_bytes + asked <= self.large_cache {
                state.idle_large.push((start, asked));
                state.idle_large_bytes += asked;
            } else {
                Pool::unmap(state, start);
            }
        } else {
            state.free[class(size)].push(ptr);
        }
    }

    fn trim(&self) {
        let state = &mut *self.state.borrow_mut();
        for (start, _) in std::mem::take(&mut state.idle_large) {
            Pool::unmap(state, start);
        }
        state.idle_large_bytes = 0;
        let idle: Vec<u64> = state
            .regions
            .iter()
            .filter(|(_, r)| r.live == 0 && !r.whole)
            .map(|(&start, _)| start)
            .collect();
        for start in idle {
            let end = start + state.regions[&start].asked;
            for list in &mut state.free {
                list.retain(|&b| b < start || b >= end);
            }
            if state.carving.is_some_and(|(s, _, _)| s == start) {
                state.carving = None;
            }
            Pool::unmap(state, start);
        }
    }

    fn report(&self) -> Vec<(String, u64)> {
        let state = self.state.borrow();
        let c = &state.counters;
        let cached: u64 = (0..CLASSES)
            .map(|k| state.free[k].len() as u64 * class_size(k))
            .sum();
        vec![
            ("regions".to_string(), state.regions.len() as u64),
            ("region-bytes".to_string(), c.region_bytes),
            ("peak-region-bytes".to_string(), c.peak_region_bytes),
            ("cached-bytes".to_string(), cached + state.idle_large_bytes),
            ("large-reused".to_string(), c.large_reused),
            ("regions-mapped".to_string(), c.regions_mapped),
            ("regions-unmapped".to_string(), c.regions_unmapped),
            ("refused".to_string(), c.refused),
        ]
    }
}

export_policy!(Pool, name = "gpu-pool");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_powers_of_two_from_256_bytes_and_hold_their_sizes() {
        assert_eq!(class(1), 0);
        assert_eq!(class(256), 0);
        assert_eq!(class(257), 1);
        assert_eq!(class(LARGEST_CLASS), CLASSES - 1);
        for size in [1, 255, 256, 1000, 4096, 65_537, LARGEST_CLASS] {
            assert!(class_size(class(size)) >= size, "{size}");
        }
    }
}
