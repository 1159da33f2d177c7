//! `allocbox-policy`: write an allocbox allocation policy as one [`Policy`]
//! implementation and one [`export_policy!`] line.
//!
//! ```
//! use allocbox_policy::{Config, Policy, export_policy, upstream};
//!
//! struct Passthrough;
//!
//! impl Policy for Passthrough {
//!     fn init(_config: &mut Config) -> Result<Self, String> {
//!         Ok(Passthrough)
//!     }
//!     fn malloc(&self, size: u64) -> u64 {
//!         upstream::malloc(size)
//!     }
//!     fn free(&self, ptr: u64, size: u64) {
//!         upstream::free(ptr, size)
//!     }
//! }
//!
//! export_policy!(Passthrough);
//! ```
//!
//! The crate runs `wit_bindgen::generate!` for the `allocbox:policy/policy` world once
//! (in [`bindings`]); a policy crate needs no bindings and no `unsafe` of its own.
//!
//! - [`Policy`] is what a policy implements. The host calls a policy on one thread, so its
//!   methods take `&self` and keep mutable state in `Cell`/`RefCell` fields; the one
//!   instance is made by [`Policy::init`] and kept by the code [`export_policy!`] writes.
//! - [`Config`] reads typed `init` settings; keys the policy did not read are rejected
//!   for it, with an error naming them. An `init` error reaches the embedder prefixed
//!   with the policy's name.
//! - [`upstream`] is the allocator below this policy; [`bytes`] reads and writes the bytes
//!   of blocks the policy holds and has not lent (headers, free lists).
//! - [`memory`] maps memory of kinds the embedder granted (huge pages, NUMA placement,
//!   locked, guarded, pinned, a GPU's); [`diagnostics`] reports a client's misuse the policy found;
//!   [`Policy::report`] answers the policy's own counters; [`Config::limits`] are the
//!   bounds the host enforces (contract 0.2.0, `wit/policy.wit` here).
//! - [`Info`] is what the policy promises: alignment and whether the host may batch.
//!   Its name is the policy crate's package name unless `export_policy!` is given one.
//!
//! Test fixtures that break the contract on purpose, so that the host's tests see it
//! caught, find their levers here too: [`Info::name`] and [`Info::version`] to describe
//! themselves wrongly, [`Config::refuse_verbatim`] for an `init` error read by a program,
//! and [`bindings`] for raw imports.

pub mod bytes;
mod config;
mod deferred;
pub mod diagnostics;
mod info;
pub mod memory;
pub mod upstream;

/// What an observing policy hears of ([`Policy::observes`]).
pub use bindings::exports::allocbox::policy::observer::{Detail, Observing, Op, Totals};

/// One thing the host served an observing policy's client without asking it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub op: Op,
    pub addr: u64,
    /// The block's size as allocated.
    pub size: u64,
}

/// What a policy observing [`Detail::Survivors`] hears of a batch: the events of blocks
/// that outlive it, and sums of the blocks that came and went within it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Survivors {
    /// Oldest first, each with its place among all of the batch's events (from 0).
    pub events: Vec<(u32, Event)>,
    /// The batch's events, listed or not.
    pub count: u32,
    /// Blocks lent and given back within the batch, and their bytes.
    pub transient_blocks: u64,
    pub transient_bytes: u64,
    /// How far the bytes, and the blocks, lent at once rose above their level at the
    /// batch's start at most (0 when they never did).
    pub peak_bytes_rise: u64,
    pub peak_blocks_rise: u64,
}
pub use config::{Config, Limits};
pub use deferred::free_after_this_call;
pub use info::Info;

/// The raw wit-bindgen bindings of the `policy` world, for what this crate does not wrap.
/// Generated with a public export macro so that [`export_policy!`] can export from the
/// policy's own crate.
pub mod bindings {
    wit_bindgen::generate!({
        path: "wit",
        world: "sharding-policy",
        pub_export_macro: true,
    });
}

/// An allocation policy: NumPy's `PyDataMem_Handler` (NEP 49) for the allocbox host.
///
/// Addresses are opaque `u64`s; 0 means "none" (out of memory). Sizes are never 0. The
/// host checks every answer against the rules of `wit/policy.wit` and stops the policy at
/// the first break:
/// - a returned block lies inside a block got from [`upstream`] and not freed, overlaps
///   no other lent block, and is aligned to [`Info::alignment`];
/// - `free`/`realloc` get exactly the size the block was last (re)allocated with, and a
///   policy gives blocks back upstream with exactly the size it got them with;
/// - bytes are touched only through [`bytes`], only in blocks held and not lent.
///
/// Only `init`, `malloc` and `free` are required; the other methods have correct
/// defaults built on them.
pub trait Policy: Sized + 'static {
    /// Make the policy from the embedder's configuration. Read settings with
    /// [`Config::get`] and friends; keys not read are rejected after `init` returns. An
    /// `Err` is shown to the embedder prefixed with the policy's name.
    fn init(config: &mut Config) -> Result<Self, String>;

    /// What the policy promises; called once, right after `init`. Default [`Info::new`].
    fn info(&self) -> Info {
        Info::new()
    }

    /// A block of at least `size` bytes, or 0.
    fn malloc(&self, size: u64) -> u64;

    /// A zero-filled block of `nelem * elsize` bytes, or 0 (also when the product
    /// overflows). Default: `malloc` then [`bytes::zeroed`]; forward to
    /// [`upstream::calloc`] instead where you can, fresh pages are zero already.
    fn calloc(&self, nelem: u64, elsize: u64) -> u64 {
        let Some(size) = nelem.checked_mul(elsize) else {
            return 0;
        };
        bytes::zeroed(self.malloc(size), size)
    }

    /// Resize the block at `ptr` (of `old_size` bytes) to `new_size`, keeping its first
    /// `min(old_size, new_size)` bytes; `ptr` 0 is `malloc(new_size)`. On 0 the old block
    /// must still be live and unchanged, so during this call the host lets the policy
    /// read the old block, never write it: a `free` that writes into the blocks it is
    /// given (an intrusive free list) is called for the old block through
    /// [`free_after_this_call`]. Default: `malloc`, [`bytes::copy`], and the old block
    /// to `free` so ([`realloc_by_copy`]).
    fn realloc(&self, ptr: u64, old_size: u64, new_size: u64) -> u64 {
        realloc_by_copy(self, ptr, old_size, new_size)
    }

    /// Give back the block at `ptr`; `size` is exactly its (re)allocated size.
    fn free(&self, ptr: u64, size: u64);

    /// Up to `count` blocks of `size` bytes. Fewer (even none) is allowed when memory
    /// runs out. Default: `malloc` in a loop, stopping at the first 0.
    fn malloc_many(&self, size: u64, count: u32) -> Vec<u64> {
        let mut ptrs = Vec::with_capacity(count as usize);
        for _ in 0..count {
            match self.malloc(size) {
                0 => break,
                ptr => ptrs.push(ptr),
            }
        }
        ptrs
    }

    /// Give back several blocks of the same `size`. Default: `free` each.
    fn free_many(&self, ptrs: Vec<u64>, size: u64) {
        for ptr in ptrs {
            self.free(ptr, size);
        }
    }

    /// Give back upstream everything cached and not lent out. The contract checker calls
    /// it after the client freed everything and counts what is still held upstream as a
    /// leak. Default: nothing (right for a policy that caches nothing).
    fn trim(&self) {}

    /// The policy's own counters, by name (lowercase words joined by `-`), in the order
    /// to show them: `allocbox check`, `stats()` and `link_stats()` show them. Default:
    /// none.
    fn report(&self) -> Vec<(String, u64)> {
        Vec::new()
    }

    /// Whether the policy observes rather than being asked on every call: `Some`
    /// terms let the host serve its client from magazines of blocks it placed (as for
    /// [`Info::batch`]) and tell it what it served through [`Policy::observe`], in
    /// batches of at most `batch` events; a `lease` of bytes bounds what the host may
    /// lend meanwhile, renewed through [`Policy::renew`]. Called once, after `init`.
    /// Default: `None`, asked on every call (or batched, as [`Info::batch`] says).
    fn observes(&self) -> Option<Observing> {
        None
    }

    /// What the host served without asking, in order: mallocs and callocs lent from a
    /// magazine, frees kept in one ([`Detail::Events`]). Default: nothing.
    fn observe(&self, events: Vec<Event>) {
        let _ = events;
    }

    /// The sums of what the host served without asking ([`Detail::Totals`]). Default:
    /// nothing.
    fn observe_totals(&self, totals: Totals) {
        let _ = totals;
    }

    /// What the host served without asking, as [`Detail::Survivors`] tells it: the
    /// events of blocks that outlive the batch, the others summed. Default: nothing.
    fn observe_survivors(&self, survivors: Survivors) {
        let _ = survivors;
    }

    /// The lease does not cover a request of `size` bytes (every event before it was
    /// observed): the new lease, the bytes the host may lend from now on without asking.
    /// Less than `size` refuses the request. Default: 0.
    fn renew(&self, size: u64) -> u64 {
        let _ = size;
        0
    }
}

/// Export a [`Policy`] type as this crate's component: `export_policy!(MyPolicy);` once,
/// at the crate root of a `cdylib`.
///
/// The policy is named after the crate's package (`CARGO_PKG_NAME`);
/// `export_policy!(MyPolicy, name = "my-name")` names it otherwise (1..=127 bytes):
///
/// ```standalone_crate
/// use allocbox_policy::{Config, Policy, export_policy, upstream};
///
/// struct Counted;
///
/// impl Policy for Counted {
///     fn init(_config: &mut Config) -> Result<Self, String> {
///         Ok(Counted)
///     }
///     fn malloc(&self, size: u64) -> u64 {
///         upstream::malloc(size)
///     }
///     fn free(&self, ptr: u64, size: u64) {
///         upstream::free(ptr, size)
///     }
/// }
///
/// export_policy!(Counted, name = "counted");
/// ```
#[macro_export]
macro_rules! export_policy {
    ($policy:ty) => {
        $crate::export_policy!($policy, name = ::core::env!("CARGO_PKG_NAME"));
    };
    ($policy:ty, name = $name:expr $(,)?) => {
        const _: () = {
            struct AllocboxPolicyInstance;

            impl $crate::__private::Instance for AllocboxPolicyInstance {
                type Policy = $policy;
                const NAME: &'static str = $name;

                fn with<R>(f: impl FnOnce(&$crate::__private::Slot<$policy>) -> R) -> R {
                    ::std::thread_local! {
                        static POLICY: $crate::__private::Slot<$policy> =
                            const { $crate::__private::Slot::new() };
                    }
                    POLICY.with(f)
                }
            }

            type AllocboxPolicyExport = $crate::__private::Export<AllocboxPolicyInstance>;
    $crate::bindings::export!(AllocboxPolicyExport with_types_in $crate::bindings);
        };
    };
}

/// [`Policy::realloc`]'s default, for a policy whose own `realloc` falls back to it: a
/// new block from `policy`'s `malloc`, the old bytes copied, and the old block given to
/// its `free` once the call has returned ([`free_after_this_call`]).
pub fn realloc_by_copy<P: Policy>(policy: &P, ptr: u64, old_size: u64, new_size: u64) -> u64 {
    if ptr == 0 {
        return policy.malloc(new_size);
    }
    let new = policy.malloc(new_size);
    if new != 0 {
        bytes::copy(new, ptr, old_size.min(new_size));
        free_after_this_call(ptr, old_size);
    }
    new
}

/// What [`export_policy!`] expands to; not part of the API.
#[doc(hidden)]
pub mod __private {
    use std::marker::PhantomData;

    use crate::bindings::exports::allocbox::policy::{allocator, lifecycle, observer, sharding};
    use crate::{Config, Policy};

    /// Holds the one instance, from `init` on.
    pub type Slot<P> = std::cell::OnceCell<P>;

    /// Where a policy crate keeps its instance: a thread-local made by the macro (the
    /// host calls a policy on one thread, so it is a plain static without `unsafe`).
    pub trait Instance: 'static {
        type Policy: Policy;
        const NAME: &'static str;
        fn with<R>(f: impl FnOnce(&Slot<Self::Policy>) -> R) -> R;
    }

    /// Implements the generated export traits by delegating to the instance. Every
    /// method is a static call into the policy's own (monomorphised) method: no boxing,
    /// no `dyn`, no allocation beyond what the policy's method makes.
    pub struct Export<I>(PhantomData<I>);

    fn policy<I: Instance, R>(f: impl FnOnce(&I::Policy) -> R) -> R {
        I::with(|slot| match slot.get() {
            Some(policy) => {
                // What the previous call freed of its own: the block is the policy's now.
                crate::deferred::flush(|ptr, size| policy.free(ptr, size));
                f(policy)
            }
            None => before_init(I::NAME),
        })
    }

    // Out of line and cold: the host always calls `init` first, so this is a host bug,
    // and the check on every call stays one load and one branch.
    #[cold]
    #[inline(never)]
    fn before_init(name: &str) -> ! {
        panic!("{name}: called before init")
    }

    /// The policy `P` made from `pairs`, and the record that answers the host's `init`;
    /// or the error that does, prefixed with `name` unless the policy refused verbatim.
    pub fn start<P: Policy>(
        name: &'static str,
        pairs: Vec<(String, String)>,
        limits: lifecycle::Limits,
    ) -> Result<(P, lifecycle::Info), String> {
        let limits = crate::Limits {
            batch: limits.batch,
            memory: limits.memory,
            overhead: limits.overhead,
        };
        let mut config = Config::with_limits(pairs, limits);
        let made = P::init(&mut config);
        if let Some(verbatim) = config.take_verbatim() {
            return Err(verbatim);
        }
        let policy = made
            .and_then(|p| config.finish().map(|()| p))
            .map_err(|e| format!("{name}: {e}"))?;
        let info = policy.info();
        let record = lifecycle::Info {
            name: info.name.unwrap_or(name).into(),
            version: info.version,
            alignment: info.alignment,
            batch: info.batch,
            diagnoses: info.diagnoses,
        };
        Ok((policy, record))
    }

    impl<I: Instance> allocator::Guest for Export<I> {
        fn malloc(size: u64) -> u64 {
            policy::<I, _>(|p| p.malloc(size))
        }

        fn calloc(nelem: u64, elsize: u64) -> u64 {
            policy::<I, _>(|p| p.calloc(nelem, elsize))
        }

        fn realloc(ptr: u64, old_size: u64, new_size: u64) -> u64 {
            policy::<I, _>(|p| p.realloc(ptr, old_size, new_size))
        }

        fn free(ptr: u64, size: u64) {
            policy::<I, _>(|p| p.free(ptr, size))
        }

        fn malloc_many(size: u64, count: u32) -> Vec<u64> {
            policy::<I, _>(|p| p.malloc_many(size, count))
        }

        fn free_many(ptrs: Vec<u64>, size: u64) {
            policy::<I, _>(|p| p.free_many(ptrs, size))
        }
    }

    impl<I: Instance> lifecycle::Guest for Export<I> {
        fn init(
            config: Vec<(String, String)>,
            limits: lifecycle::Limits,
        ) -> Result<lifecycle::Info, String> {
            let (policy, record) = start::<I::Policy>(I::NAME, config, limits)?;
            I::with(|slot| slot.set(policy))
                .map_err(|_| format!("{}: init called twice", I::NAME))?;
            Ok(record)
        }

        fn trim() {
            policy::<I, _>(|p| p.trim())
        }

        fn report() -> Vec<(String, u64)> {
            policy::<I, _>(|p| p.report())
        }
    }

    impl<I: Instance> sharding::Guest for Export<I> {
        fn shardable() -> bool {
            policy::<I, _>(|p| p.info().shardable)
        }
    }

    /// The little-endian u64s of a column of bytes.
    fn words(column: &[u8]) -> impl Iterator<Item = u64> + '_ {
        let (words, _) = column.as_chunks::<8>();
        words.iter().map(|&w| u64::from_le_bytes(w))
    }

    /// The events in `columns`, oldest first.
    fn unpack(columns: &observer::Events) -> impl Iterator<Item = crate::Event> + '_ {
        let ops = columns.ops.iter().map(|&op| match op {
            0 => observer::Op::Malloc,
            1 => observer::Op::Calloc,
            _ => observer::Op::Free,
        });
        ops.zip(words(&columns.addrs))
            .zip(words(&columns.sizes))
            .map(|((op, addr), size)| crate::Event { op, addr, size })
    }

    impl<I: Instance> observer::Guest for Export<I> {
        fn observes() -> Option<observer::Observing> {
            policy::<I, _>(|p| p.observes())
        }

        fn observe(observed: observer::Observation) {
            match observed {
                observer::Observation::Events(events) => {
                    policy::<I, _>(|p| p.observe(unpack(&events).collect()))
                }
                observer::Observation::Totals(totals) => {
                    policy::<I, _>(|p| p.observe_totals(totals))
                }
                observer::Observation::Survivors(s) => {
                    let (places, _) = s.places.as_chunks::<4>();
                    let places = places.iter().map(|&w| u32::from_le_bytes(w));
                    let survivors = crate::Survivors {
                        events: places.zip(unpack(&s.events)).collect(),
                        count: s.count,
                        transient_blocks: s.transient_blocks,
                        transient_bytes: s.transient_bytes,
                        peak_bytes_rise: s.peak_bytes_rise,
                        peak_blocks_rise: s.peak_blocks_rise,
                    };
                    policy::<I, _>(|p| p.observe_survivors(survivors))
                }
            }
        }

        fn renew(size: u64) -> u64 {
            policy::<I, _>(|p| p.renew(size))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::__private::start;
    use super::*;
    use bindings::exports::allocbox::policy::lifecycle;

    /// A policy that only answers `init`; its allocator is never called natively.
    struct Fixture {
        info: Info,
    }

    impl Policy for Fixture {
        fn init(config: &mut Config) -> Result<Self, String> {
            let info = Info::new().alignment(config.get_or("alignment", 16)?);
            match config.get_str("lie")?.as_deref() {
                None => Ok(Fixture { info }),
                Some("name") => Ok(Fixture {
                    info: info.name("another"),
                }),
                Some("version") => Ok(Fixture {
                    info: info.version(2),
                }),
                Some("verbatim") => Err(config.refuse_verbatim("report: as is")),
                Some(other) => Err(format!("no lie `{other}`")),
            }
        }
        fn info(&self) -> Info {
            self.info
        }
        fn malloc(&self, _size: u64) -> u64 {
            unreachable!("not called natively")
        }
        fn free(&self, _ptr: u64, _size: u64) {
            unreachable!("not called natively")
        }
    }

    fn start_with(pairs: &[(&str, &str)]) -> Result<lifecycle::Info, String> {
        let pairs = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let limits = lifecycle::Limits {
            batch: 64,
            memory: 1 << 20,
            overhead: 1 << 20,
        };
        start::<Fixture>("fixture", pairs, limits).map(|(_, record)| record)
    }

    #[test]
    fn the_record_names_the_export_and_contract_version_1() {
        let record = start_with(&[("alignment", "64")]).unwrap();
        assert_eq!(record.name, "fixture");
        assert_eq!(record.version, Info::VERSION);
        assert_eq!(record.alignment, 64);
        assert!(record.batch);
    }

    #[test]
    fn a_fixture_can_claim_another_name_or_version() {
        assert_eq!(start_with(&[("lie", "name")]).unwrap().name, "another");
        assert_eq!(start_with(&[("lie", "version")]).unwrap().version, 2);
    }

    #[test]
    fn errors_are_prefixed_with_the_name_unless_verbatim() {
        assert_eq!(
            start_with(&[("lie", "x")]).unwrap_err(),
            "fixture: no lie `x`"
        );
        assert_eq!(
            start_with(&[("colour", "red")]).unwrap_err(),
            "fixture: unknown config key `colour` (value `red`); known: alignment, lie"
        );
        // A verbatim refusal wins over keys left unread.
        assert_eq!(
            start_with(&[("lie", "verbatim"), ("colour", "red")]).unwrap_err(),
            "report: as is"
        );
    }
}
