#![doc = include_str!("../../README.md")]

pub mod check;
mod error;
mod fasthash;
mod handler;
mod hook;
mod ledger;
mod link;
mod native;
pub mod nep49;
mod runtime;
mod system;
pub mod trace;

pub use error::{Call, ClientError, Error, LoadError, Rule, Violation};
pub use handler::{Handler, HandlerBuilder, Stats};
pub use hook::WasmHook;
pub use link::{Grants, Limits, LinkStats, PolicyInfo};
pub use native::NumpyDefault;
pub use nep49::{Buffer, MemHandler};
pub use runtime::{DEFAULT_POLICY_WAT, POLICY_WIT, Policy, Runtime, WORLD_PACKAGE, WORLD_VERSION};
pub use system::SYSTEM_ALIGNMENT;
