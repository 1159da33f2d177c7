//! `system`: the identity policy. Every call goes to the upstream unchanged, so a chain
//! with `system` in it behaves exactly like the chain without it; it is the baseline for
//! measuring what the component boundary itself costs.

wit_bindgen::generate!({ path: "../../wit", world: "policy" });

use allocbox::policy::allocator as upstream;
use exports::allocbox::policy::allocator::Guest as Allocator;
use exports::allocbox::policy::lifecycle::{Guest as Lifecycle, Info};

struct System;

impl Allocator for System {
    fn malloc(size: u64) -> u64 {
        upstream::malloc(size)
    }

    fn calloc(nelem: u64, elsize: u64) -> u64 {
        upstream::calloc(nelem, elsize)
    }

    fn realloc(ptr: u64, old_size: u64, new_size: u64) -> u64 {
        upstream::realloc(ptr, old_size, new_size)
    }

    fn free(ptr: u64, size: u64) {
        upstream::free(ptr, size)
    }

    fn malloc_many(size: u64, count: u32) -> Vec<u64> {
        upstream::malloc_many(size, count)
    }

    fn free_many(ptrs: Vec<u64>, size: u64) {
        upstream::free_many(&ptrs, size)
    }
}

impl Lifecycle for System {
    fn init(config: Vec<(String, String)>) -> Result<Info, String> {
        // No keys: anything given is a mistake the embedder should hear about.
        if let Some((key, value)) = config.first() {
            return Err(format!(
                "system: unknown config key `{key}` (value `{value}`)"
            ));
        }
        Ok(Info {
            name: "system".into(),
            version: 1,
            // The host's own upstream aligns every block to 16.
            alignment: 16,
            batch: true,
        })
    }

    fn trim() {}
}

export!(System);
