//! `system`: the identity policy. Every call goes to the upstream unchanged, so a chain
//! with `system` in it behaves exactly like the chain without it; it is the baseline for
//! measuring what the component boundary itself costs.

use allocbox_policy::{Config, Info, Policy, export_policy, upstream};

struct System;

impl Policy for System {
    // No keys: the SDK refuses anything given, as a mistake the embedder should hear about.
    fn init(_config: &mut Config) -> Result<Self, String> {
        Ok(System)
    }

    /// The default alignment holds (the host's own upstream aligns every block to 16),
    /// nothing here needs to see calls one by one, and it keeps no state: an instance
    /// per thread serves the same as one for all.
    fn info(&self) -> Info {
        Info::new().shardable(true)
    }

    fn malloc(&self, size: u64) -> u64 {
        upstream::malloc(size)
    }

    fn calloc(&self, nelem: u64, elsize: u64) -> u64 {
        upstream::calloc(nelem, elsize)
    }

    fn realloc(&self, ptr: u64, old_size: u64, new_size: u64) -> u64 {
        upstream::realloc(ptr, old_size, new_size)
    }

    fn free(&self, ptr: u64, size: u64) {
        upstream::free(ptr, size)
    }

    fn malloc_many(&self, size: u64, count: u32) -> Vec<u64> {
        upstream::malloc_many(size, count)
    }

    fn free_many(&self, ptrs: Vec<u64>, size: u64) {
        upstream::free_many(&ptrs, size)
    }

    // Nothing cached: the default `trim` does nothing.
}

export_policy!(System, name = "system");
