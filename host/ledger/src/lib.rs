//! The host's books: what it has lent across each boundary of a chain (the [`ledger`]),
//! and the per-thread caches in front of a handler ([`cache`]): magazines of blocks a
//! policy placed ahead of demand, what each thread lent from them, and the protocol by
//! which one thread may reach another's cache.
//!
//! A crate of its own, without the WebAssembly runtime, so that the machines that check
//! lock-free code can run it: loom over the claim protocol (`--cfg allocbox_loom`, see
//! `cache/models.rs`), Miri over every structure (`cargo miri test`), and a thread
//! sanitizer over the threaded tests.
//!
//! Each module uses only those after it here (`tests/layers.rs`; the caches' own files
//! have an order of their own, in `cache/mod.rs`):
//!
//! Module order: `cache` > `ledger` > `published` > `by_thread` > `platform` > `sync` > `fasthash` > `counting_alloc`

// Under loom and Miri there is no fork (no `pthread_atfork`) and, under loom, no thread
// exit: the code for them is built but never reached.
#![cfg_attr(any(miri, allocbox_loom), allow(dead_code))]

pub mod by_thread;
pub mod cache;
#[cfg(test)]
mod counting_alloc;
pub mod fasthash;
pub mod ledger;
pub mod platform;
pub mod published;
mod sync;
