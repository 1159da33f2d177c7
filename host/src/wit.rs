//! The policy worlds as Rust types, generated from `wit/` by wasmtime's `bindgen!`: the
//! bottom of the host, which the links that serve a policy and the observation they
//! deliver both speak.

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
