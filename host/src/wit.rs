//! The policy worlds as Rust types, generated from `wit/` by wasmtime's `bindgen!`: the
//! bottom of the host, which the links that serve a policy and the observation they
//! deliver both speak.
//!
//! The host serves two versions of the policy world side by side (`wit/policy.wit`,
//! `allocbox:policy@0.1.0`, and `wit/0.2.0/policy.wit`): a component is started as
//! the version of the `lifecycle` and `allocator` it exports, and may import only
//! that version's interfaces. 0.2.0 keeps 0.1.0's `allocator` and `bytes` unchanged
//! (the host serves both with the same checks, `link/mapped.rs` delegating to
//! `link/imports.rs`) and adds:
//!
//! - `memory`: regions of a kind (huge pages, NUMA placement, locked, guarded, and
//!   the GPU kinds of `map-gpu`, each a row of `kind.rs`) mapped by the host for the
//!   asking policy, **around** the links below it. A
//!   region goes on the asking link's own books (`link/mapped.rs`, beside the
//!   ledger of what its upstream lent it), never through the links below: a lower
//!   policy cannot grant a kind it does not have, its ledger stays exact, and the
//!   kind reaches the host from any link of a chain. Every check that asks "which
//!   memory the policy holds contains this range" (admitting an answer, `bytes`,
//!   the audit, the leak check) asks both books; a region counts every page it maps
//!   against the overhead budget; it is unmapped with the sized-free rule, held
//!   back under a block in transit like upstream memory, and released with a
//!   stopped link. The OS calls are in `mapped.rs`, with the process-wide registry
//!   of guard pages that an embedder's fault handler reads
//!   (`mapped::guard_page_at`).
//!
//! - `diagnostics.client-misuse`: the host keeps the last reports per link
//!   (`LinkStats::recent_misuse`), counts them, and hands new ones to the embedder
//!   (`Handler::take_client_misuse`); the NumPy bridge turns them into
//!   `allocbox.ClientMisuseWarning`s naming the Python line that allocated the
//!   array.
//!
//! - `lifecycle.report`: the policy's counters, asked for by `Handler::link_stats`.
//!
//! - The limits (`batch`, `memory`, `overhead`) told at `init`.
//!
//! - `observer`: batched observation with leases. A 0.2.0 policy answers `observes`
//!   once after `init`; `none` keeps it asked on every call (or batched, as its
//!   `info` says). With terms, the host serves the top policy's client from the
//!   magazines, and `observe.rs` (below both the handler and the link, which
//!   deliver it) keeps what it served without asking (events) and the lease (bytes
//!   it may lend without asking). Events are delivered at the policy's batch size,
//!   before any call the policy serves (`Link::enter`), at `trim` and when
//!   statistics are read, in the detail the policy chose: every event, sums, or
//!   `survivors` (the events of blocks that outlive their batch; a free is paired
//!   with the lend of its address in the same batch, which the ledger makes
//!   unambiguous, and the pair is summed, its peak kept). Every block lent takes
//!   its size from the lease and every block given back returns it, whichever way
//!   it went (`handler/chain.rs::Via`: a magazine, or the policy itself); when a
//!   request does not fit, the host delivers the events and asks `renew`. The lease
//!   stays exact under threads: the policy answers from what it has seen, and the
//!   host subtracts what it has not (reserved or given back, not yet delivered).
//!   Lock order: the chain, then the observations.

/// The 0.1.0 policy world.
pub(crate) mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "policy",
        imports: { default: trappable },
    });
}

/// The 0.2.0 policy world: 0.1.0's interfaces and memory kinds, client diagnostics,
/// counters and limits. Served beside 0.1.0 by the same links.
pub(crate) mod bindings_v2 {
    wasmtime::component::bindgen!({
        path: "../wit/0.2.0",
        world: "policy",
        imports: { default: trappable },
    });
}
