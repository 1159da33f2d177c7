#![doc = include_str!("../../README.md")]

mod clock;
mod compile_bounds;
mod error;
mod fill;
pub mod gpu;
mod handler;
mod hook;
pub mod input;
mod kind;
mod link;
pub mod mapped;
mod memhandler;
mod native;
pub mod nep49;
mod observe;
pub mod output;
mod runtime;
pub mod shares;
mod system;
pub mod trace;
pub mod untrusted;
mod wasi;
mod wit;

pub use allocbox_ledger::ledger::LEDGER_ENTRY_COST;
use allocbox_ledger::{fasthash, ledger};
pub use compile_bounds::{CompileBound, CompileBounds};
pub use error::{
    Bound, Call, ClientError, Error, InvariantBroken, LoadError, Rule, TimeLimit, Violation,
};
pub use handler::{
    Deferral, DeviceHandler, Handler, HandlerBuilder, PendingFrees, PolicyHandler, ShardedHandler,
};
pub use hook::{MAX_REPORTED_NUMBERS, WasmHook};
pub use link::{
    BYTES_PER_WORK, ClientMisuse, DEFAULT_CALL_WORK, Grants, IMPORT_WORK, Limits, LinkStats,
    PolicyInfo,
};
pub use memhandler::{MemHandler, Stats};
pub use native::NumpyDefault;
pub use nep49::Buffer;
pub use runtime::{
    COMPILE_CACHE_ENV, DEFAULT_POLICY_WAT, POLICY_WIT, POLICY_WIT_2, Policy, Runtime,
    WORLD_PACKAGE, WORLD_VERSION, WORLD_VERSION_2, cache_dir, compile_cache_dir, read_policy_file,
};
pub use system::{Adversary, FRESH_MEMORY, Injected, QUARANTINE_POISON, Refusal, SYSTEM_ALIGNMENT};
