//! What a policy tells the host about itself: [`Info`], its answer to `init`.

/// What a policy tells the host about itself in its answer to `init`.
///
/// `Info::new()` is the promise of a policy that hands out whole upstream blocks:
/// 16-byte alignment (the host's own upstream aligns every block to 16) and batching
/// allowed. The name and version are the SDK's to fill in (the name
/// [`export_policy!`](crate::export_policy!) was given, contract version 1);
/// [`Info::name`] and [`Info::version`] replace them only for a test fixture that lies
/// about itself, to check that the host refuses the lie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Info {
    /// Every block the policy returns is aligned to this power of two. Default 16.
    pub alignment: u64,
    /// The host may fetch blocks ahead with `malloc_many` and return frees late with
    /// `free_many`. A policy that must see every call one by one says false. Default true.
    pub batch: bool,
    /// The name the host is told, if not the one
    /// [`export_policy!`](crate::export_policy!) was given (which still prefixes `init`
    /// errors). Default `None`.
    pub name: Option<&'static str>,
    /// The handler contract version the policy speaks. Default [`Info::VERSION`], the
    /// only one the host accepts.
    pub version: u8,
    /// The policy checks how its client uses blocks and reports misuse through
    /// [`diagnostics`](crate::diagnostics): the embedder records where each block was
    /// allocated, at a cost on every allocation. Default false.
    pub diagnoses: bool,
    /// The policy's state is its instance's alone (no count that must see every
    /// thread's blocks): the host may start one instance per thread, each with its own
    /// upstream and a share of the limits (`sharding` in `wit/policy.wit`). Default false.
    pub shardable: bool,
}

impl Info {
    /// The handler contract version this SDK implements (`wit/policy.wit`).
    pub const VERSION: u8 = 1;

    /// 16-byte alignment, batching allowed, the exported name, contract version 1.
    pub const fn new() -> Info {
        Info {
            alignment: 16,
            batch: true,
            name: None,
            version: Info::VERSION,
            diagnoses: false,
            shardable: false,
        }
    }

    /// Say that the policy's state is per instance (true), so that the host may give
    /// each thread an instance of its own.
    pub const fn shardable(self, shardable: bool) -> Info {
        Info { shardable, ..self }
    }

    /// Say that the policy reports its client's misuse (true), so that the embedder
    /// records allocation sites to name the blocks in reports.
    pub const fn diagnoses(self, diagnoses: bool) -> Info {
        Info { diagnoses, ..self }
    }

    /// Promise that every block is aligned to `alignment` (a power of two).
    pub const fn alignment(self, alignment: u64) -> Info {
        Info { alignment, ..self }
    }

    /// Allow (true) or forbid (false) the host's batching.
    pub const fn batch(self, batch: bool) -> Info {
        Info { batch, ..self }
    }

    /// Tell the host `name` instead of the exported name. The host refuses a name that is
    /// not 1..=127 bytes: this is for fixtures that test that it does.
    pub const fn name(self, name: &'static str) -> Info {
        Info {
            name: Some(name),
            ..self
        }
    }

    /// Claim contract `version` instead of [`Info::VERSION`]. The host refuses any other:
    /// this is for fixtures that test that it does.
    pub const fn version(self, version: u8) -> Info {
        Info { version, ..self }
    }
}

impl Default for Info {
    fn default() -> Info {
        Info::new()
    }
}
