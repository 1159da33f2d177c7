//! A compiled policy ([`Policy`]) and what the host reads from it before it runs: its
//! source language, and the checks on what it says about itself at `init`.

use std::sync::Arc;

use crate::error::LoadError;
use crate::link::LinkState;
use crate::link::PolicyInfo;
use crate::wit::{bindings, bindings_v2};

/// A policy ready to start, in the version of the world it was built against.
#[derive(Clone)]
pub(super) enum Pre {
    V1(bindings::PolicyPre<LinkState>),
    V2(bindings_v2::PolicyPre<LinkState>),
}

impl Pre {
    pub(super) fn engine(&self) -> &wasmtime::Engine {
        match self {
            Pre::V1(pre) => pre.instance_pre().engine(),
            Pre::V2(pre) => pre.instance_pre().engine(),
        }
    }
}

/// A compiled policy component, checked against the policy world. Cheap to clone;
/// start instances of it with [`crate::HandlerBuilder`].
#[derive(Clone)]
pub struct Policy {
    pub(super) pre: Pre,
    pub(super) meta: Arc<PolicyMeta>,
}

#[derive(Clone)]
pub(super) struct PolicyMeta {
    pub(super) source: String,
    /// The component binary, to compile the policy again for another runtime.
    pub(super) binary: Arc<[u8]>,
    pub(super) imports: Vec<String>,
    pub(super) exports: Vec<String>,
    pub(super) language: Option<String>,
}

/// The source language a policy's `producers` sections name, e.g. `Rust`, `C`: the
/// first its own top-level section names (a core module or component that says what it
/// was written in), else the first a core module inside names (a Rust component's main
/// module says `Rust`, then `C11` for the libc linked into it); none when the toolchain
/// says nothing.
pub(super) fn source_language(binary: &[u8]) -> Option<String> {
    use wasmparser::{KnownCustom, Parser, Payload};
    let (mut top, mut inner) = (Vec::new(), Vec::new());
    let mut depth = 0usize;
    for payload in Parser::new(0).parse_all(binary) {
        let section = match payload {
            Ok(Payload::Version { .. }) => {
                depth += 1;
                continue;
            }
            Ok(Payload::End(_)) => {
                depth = depth.saturating_sub(1);
                continue;
            }
            Ok(Payload::CustomSection(section)) => section,
            Ok(_) => continue,
            Err(_) => break,
        };
        let KnownCustom::Producers(fields) = section.as_known() else {
            continue;
        };
        let found = if depth <= 1 { &mut top } else { &mut inner };
        for field in fields.into_iter().flatten() {
            if field.name != "language" {
                continue;
            }
            found.extend(
                field
                    .values
                    .into_iter()
                    .flatten()
                    .map(|v| v.name.to_string()),
            );
        }
    }
    top.into_iter()
        .chain(inner)
        .next()
        .map(|language| crate::untrusted::escape(&language))
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("source", &self.meta.source)
            .field("size", &self.size())
            .field("imports", &self.meta.imports)
            .field("exports", &self.meta.exports)
            .finish()
    }
}

impl Policy {
    /// The same compiled policy, loaded from `source`.
    pub(super) fn named(self, source: &str) -> Policy {
        if self.meta.source == source {
            return self;
        }
        Policy {
            meta: Arc::new(PolicyMeta {
                source: source.to_string(),
                ..(*self.meta).clone()
            }),
            ..self
        }
    }

    /// Where it was loaded from.
    pub fn source(&self) -> &str {
        &self.meta.source
    }
    /// The SHA-256 of its binary: two files of the same policy are the same policy.
    pub fn digest(&self) -> [u8; 32] {
        use sha2::Digest;
        sha2::Sha256::digest(&self.meta.binary).into()
    }
    /// Size of the component binary in bytes.
    pub fn size(&self) -> usize {
        self.meta.binary.len()
    }
    /// The names the component imports.
    pub fn imports(&self) -> &[String] {
        &self.meta.imports
    }
    /// The names the component exports.
    pub fn exports(&self) -> &[String] {
        &self.meta.exports
    }
    /// The source language the component's toolchain recorded (`producers` sections),
    /// e.g. `Rust`; none when it recorded none.
    pub fn language(&self) -> Option<&str> {
        self.meta.language.as_deref()
    }
    /// The version of the policy world it was built against, and is started as:
    /// [`super::WORLD_VERSION`] or [`super::WORLD_VERSION_2`].
    pub fn world_version(&self) -> &'static str {
        match self.pre {
            Pre::V1(_) => super::WORLD_VERSION,
            Pre::V2(_) => super::WORLD_VERSION_2,
        }
    }
}

/// What a policy says about itself at `init`, in either version of the world (the
/// record is the same).
pub(super) struct Said {
    pub(super) name: String,
    pub(super) version: u8,
    pub(super) alignment: u64,
    pub(super) batch: bool,
    /// 0.2.0 only: false for 0.1.0.
    pub(super) diagnoses: bool,
}

impl From<bindings::exports::allocbox::policy::lifecycle::Info> for Said {
    fn from(i: bindings::exports::allocbox::policy::lifecycle::Info) -> Said {
        Said {
            name: i.name,
            version: i.version,
            alignment: i.alignment,
            batch: i.batch,
            diagnoses: false,
        }
    }
}

impl From<bindings_v2::exports::allocbox::policy::lifecycle::Info> for Said {
    fn from(i: bindings_v2::exports::allocbox::policy::lifecycle::Info) -> Said {
        Said {
            name: i.name,
            version: i.version,
            alignment: i.alignment,
            batch: i.batch,
            diagnoses: i.diagnoses,
        }
    }
}

/// Check what a policy says about itself (C1, C6).
pub(super) fn check_info(info: Said) -> Result<PolicyInfo, LoadError> {
    if info.name.is_empty() || info.name.len() > 127 {
        return Err(LoadError::BadName {
            len: info.name.len(),
        });
    }
    let name = crate::untrusted::escape(&info.name);
    if info.version != 1 {
        return Err(LoadError::BadVersion {
            policy: name,
            version: info.version,
        });
    }
    if !info.alignment.is_power_of_two() {
        return Err(LoadError::BadAlignment {
            policy: name,
            alignment: info.alignment,
        });
    }
    Ok(PolicyInfo {
        name: name.into(),
        version: info.version,
        alignment: info.alignment,
        batch: info.batch,
        diagnoses: info.diagnoses,
        shardable: false,
    })
}
