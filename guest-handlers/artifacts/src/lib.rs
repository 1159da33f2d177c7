//! The guest policies of `guest-handlers/`, built by this crate's build script.
//!
//! Tests name a policy by its constant (`allocbox_artifacts::SYSTEM.path()`), never by a
//! hand-written path; `foreach_good_policy!` generates one test module per good policy.

/// A guest policy built (or, for WAT, found) by the build script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guest {
    pub name: &'static str,
    /// The language it is written in.
    pub language: &'static str,
    path: &'static str,
    /// Why it could not be built, naming the fix (e.g. a toolchain's install command).
    error: Option<&'static str>,
}

impl Guest {
    /// The component, core module or WAT source. Panics, naming the fix, when the guest
    /// could not be built (e.g. the wasm32-wasip2 target or its language's toolchain is
    /// missing).
    pub fn path(&self) -> &'static str {
        if let Some(err) = self.error {
            panic!("the `{}` guest is not available: {err}", self.name);
        }
        self.path
    }

    /// The component's path, or why it could not be built: for a build script that
    /// must carry on without it.
    pub fn built(&self) -> Result<&'static str, &'static str> {
        match self.error {
            Some(err) => Err(err),
            None => Ok(self.path),
        }
    }

    /// The file's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let path = self.path();
        std::fs::read(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
    }
}

pub mod hostile;

include!(concat!(env!("OUT_DIR"), "/artifacts.rs"));
