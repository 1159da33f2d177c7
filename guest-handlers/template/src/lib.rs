//! `template`: the smallest useful policy, to copy when writing a new one.
//!
//! It counts the blocks it has lent out and otherwise forwards every call upstream.
//! Rename the crate and the `name` in `init`, then replace the bodies.
//!
//! The rules the host enforces (it stops the guest at the first break):
//! - every address you return lies inside a block you got from upstream and have not
//!   freed, overlaps no other block you have lent out, and is aligned to the
//!   `alignment` you declare in `init`;
//! - give blocks back upstream with exactly the size you got them with;
//! - touch bytes only through the `bytes` import, and only of blocks you hold and have
//!   not lent out (plus, during `realloc`, the block being resized);
//! - `trim` gives back everything you cache: the contract checker calls it last and
//!   counts whatever is still held upstream as a leak.
//!
//! Check it against the whole handler contract before anyone uses it:
//!
//! ```text
//! cargo build --release --target wasm32-wasip2
//! allocbox check target/wasm32-wasip2/release/my_policy.wasm --cases 1000
//! ```
//!
//! or from a host-side `#[test]` of your own (dev-dependency on `allocbox`):
//!
//! ```text
//! #[test]
//! fn my_policy_keeps_the_handler_contract() {
//!     allocbox::check::assert_contract("target/wasm32-wasip2/release/my_policy.wasm", &[]);
//! }
//! ```

// Generates `allocbox::policy::{allocator, bytes}` (the imports: upstream and byte
// access) and `exports::allocbox::policy::{allocator, lifecycle}` (what we implement).
wit_bindgen::generate!({ path: "../../wit", world: "policy" });

use std::cell::Cell;

use allocbox::policy::allocator as upstream;
use exports::allocbox::policy::allocator::Guest as Allocator;
use exports::allocbox::policy::lifecycle::{Guest as Lifecycle, Info};

thread_local! {
    // A guest runs on one thread, so a thread-local is a plain static without `unsafe`.
    static LENT: Cell<u64> = const { Cell::new(0) };
}

/// Counts a block handed to the client (`ptr` 0 means the allocation failed).
fn lent(ptr: u64) -> u64 {
    if ptr != 0 {
        LENT.with(|n| n.set(n.get() + 1));
    }
    ptr
}

fn returned(count: u64) {
    LENT.with(|n| n.set(n.get() - count));
}

struct Template;

impl Allocator for Template {
    fn malloc(size: u64) -> u64 {
        lent(upstream::malloc(size))
    }

    fn calloc(nelem: u64, elsize: u64) -> u64 {
        lent(upstream::calloc(nelem, elsize))
    }

    fn realloc(ptr: u64, old_size: u64, new_size: u64) -> u64 {
        let new = upstream::realloc(ptr, old_size, new_size);
        // Only `realloc(0, ..)` lends a new block; otherwise the count is unchanged.
        if ptr == 0 { lent(new) } else { new }
    }

    fn free(ptr: u64, size: u64) {
        returned(1);
        upstream::free(ptr, size);
    }

    fn malloc_many(size: u64, count: u32) -> Vec<u64> {
        let ptrs = upstream::malloc_many(size, count);
        LENT.with(|n| n.set(n.get() + ptrs.len() as u64));
        ptrs
    }

    fn free_many(ptrs: Vec<u64>, size: u64) {
        returned(ptrs.len() as u64);
        upstream::free_many(&ptrs, size);
    }
}

impl Lifecycle for Template {
    fn init(config: Vec<(String, String)>) -> Result<Info, String> {
        // Reject what you do not understand, saying which key and value.
        if let Some((key, value)) = config.first() {
            return Err(format!(
                "template: unknown config key `{key}` (value `{value}`)"
            ));
        }
        Ok(Info {
            name: "template".into(),
            version: 1,
            // Upstream blocks are 16-aligned; a pass-through can promise no more.
            alignment: 16,
            // True lets the host fetch blocks ahead with `malloc-many`.
            batch: true,
        })
    }

    // Nothing cached, so nothing to give back.
    fn trim() {}
}

export!(Template);
