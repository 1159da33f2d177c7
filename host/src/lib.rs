#![doc = include_str!("../../README.md")]

pub mod check;
mod error;
mod handler;
mod ledger;
mod link;
mod runtime;
mod system;

pub use error::{Call, ClientError, Error, LoadError, Rule, Violation};
pub use handler::{Handler, HandlerBuilder, Stats};
pub use link::{Limits, PolicyInfo};
pub use runtime::{DEFAULT_POLICY_WAT, POLICY_WIT, Policy, Runtime, WORLD_PACKAGE, WORLD_VERSION};
pub use system::SYSTEM_ALIGNMENT;
