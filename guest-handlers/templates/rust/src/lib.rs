//! A policy template: the smallest useful allocbox policy, to start a new one from
//! (`allocbox new NAME --lang rust` writes a project around this file).
//!
//! It counts the blocks it has lent out and otherwise forwards every call upstream. It
//! is named after its package (`Cargo.toml`'s `name`); replace the bodies below, and
//! read settings in `init` with `config.get_or("key", default)?` (keys you do not read
//! are rejected for you, with an error naming them).
//!
//! The rules the host enforces (it stops the policy at the first break):
//! - every address you return lies inside a block you got from `upstream` and have not
//!   freed, overlaps no other block you have lent out, and is aligned to the
//!   `alignment` you promise in `info` (16 unless you say otherwise);
//! - give blocks back upstream with exactly the size you got them with;
//! - touch bytes only through `allocbox_policy::bytes`, and only of blocks you hold and
//!   have not lent out (plus, during `realloc`, the block being resized, to read only:
//!   free it with `allocbox_policy::free_after_this_call`, as the default `realloc`
//!   does, when your `free` writes into the blocks it is given);
//! - `trim` gives back everything you cache: the contract checker calls it last and
//!   counts whatever is still held upstream as a leak.
//!
//! The host calls a policy on one thread: keep state in `Cell`/`RefCell` fields.
//! `calloc`, `realloc`, `malloc_many`, `free_many` and `trim` have correct defaults
//! built on `malloc` and `free`; this template forwards them upstream, which is faster.
//!
//! Contract 0.2.0 (what this SDK speaks) gives a policy four more things:
//! - `report`: its own counters, shown by `allocbox check` and Python's `stats()` (this
//!   template reports the blocks it has lent);
//! - `allocbox_policy::memory::map(size, Kind { pages: Pages::TransparentHuge,
//!   ..Kind::NORMAL })`: memory of a kind the embedder granted (`--grant huge-pages`,
//!   `grant=["huge-pages"]`), or the refusal when it did not; give it back with
//!   `memory::unmap`;
//! - `allocbox_policy::diagnostics::client_misuse(block, size, offset, "what happened")`:
//!   a misuse of a block by the client that the policy found (an overwritten canary),
//!   shown to the embedder as a warning;
//! - `observes`: observe rather than be asked on every call. The host serves the client
//!   from magazines and tells the policy in batches: every event (`observe`), sums
//!   (`observe_totals`), or the events of blocks that outlive their batch
//!   (`observe_survivors`); a lease of bytes, renewed through `renew`, bounds what it
//!   lends meanwhile.
//!
//! Check it against the whole handler contract before anyone uses it:
//!
//! ```text
//! cargo build --release --target wasm32-wasip2
//! allocbox check target/wasm32-wasip2/release/<package_name>.wasm --rounds 100
//! ```

use std::cell::Cell;

use allocbox_policy::{Config, Info, Policy, export_policy, upstream};

/// A pass-through that counts the blocks it has lent out.
struct Template {
    lent: Cell<u64>,
}

impl Template {
    /// Counts a block handed to the client (`ptr` 0 means the allocation failed).
    fn lend(&self, ptr: u64) -> u64 {
        if ptr != 0 {
            self.lent.set(self.lent.get() + 1);
        }
        ptr
    }

    fn returned(&self, count: u64) {
        self.lent.set(self.lent.get() - count);
    }
}

impl Policy for Template {
    fn init(_config: &mut Config) -> Result<Self, String> {
        Ok(Template { lent: Cell::new(0) })
    }

    fn info(&self) -> Info {
        // Upstream blocks are 16-aligned, so a pass-through can promise no more; batch
        // lets the host fetch blocks ahead with `malloc_many`.
        Info::new().alignment(16).batch(true)
    }

    fn malloc(&self, size: u64) -> u64 {
        self.lend(upstream::malloc(size))
    }

    fn calloc(&self, nelem: u64, elsize: u64) -> u64 {
        self.lend(upstream::calloc(nelem, elsize))
    }

    fn realloc(&self, ptr: u64, old_size: u64, new_size: u64) -> u64 {
        let new = upstream::realloc(ptr, old_size, new_size);
        // Only `realloc(0, ..)` lends a new block; otherwise the count is unchanged.
        if ptr == 0 { self.lend(new) } else { new }
    }

    fn free(&self, ptr: u64, size: u64) {
        self.returned(1);
        upstream::free(ptr, size);
    }

    fn malloc_many(&self, size: u64, count: u32) -> Vec<u64> {
        let ptrs = upstream::malloc_many(size, count);
        self.lent.set(self.lent.get() + ptrs.len() as u64);
        ptrs
    }

    fn free_many(&self, ptrs: Vec<u64>, size: u64) {
        self.returned(ptrs.len() as u64);
        upstream::free_many(&ptrs, size);
    }

    // Nothing cached, so nothing to give back.
    fn trim(&self) {}

    fn report(&self) -> Vec<(String, u64)> {
        vec![("lent-blocks".to_string(), self.lent.get())]
    }
}

export_policy!(Template);
