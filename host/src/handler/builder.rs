//! Building a handler: the chain of policies, its limits, and what it falls back to.

use std::collections::HashSet;
use std::sync::Arc;

use super::{Chain, DeviceHandler, Handler, Observations};
use crate::clock::{CallTicks, Deadline};
use crate::error::LoadError;
use crate::gpu::Placement;
use crate::link::{Limits, LinkStart, Upstream};
use crate::memhandler::Stats;
use crate::runtime::{Policy, Runtime};
use crate::system::{Adversary, SystemMemory};
use allocbox_ledger::cache::{Caches, MAGAZINE_DEPTH};

/// Builds a [`Handler`] from policies, top of the chain first.
#[derive(Debug, Clone)]
pub struct HandlerBuilder {
    runtime: Runtime,
    links: Vec<(Policy, Vec<(String, String)>)>,
    pub(super) limits: Limits,
    pub(super) host_memory_limit: u64,
    quarantine: u64,
    magazines: bool,
    magazine_depth: usize,
    checked: bool,
    adversary: Option<Arc<Adversary>>,
    fallback: Option<Arc<Handler>>,
}

impl HandlerBuilder {
    /// How long a fork waits for calls in other threads to end: they end within the
    /// call limit, and the time past it that the host needs to stop them.
    pub(super) fn fork_patience(&self) -> std::time::Duration {
        self.limits.call_time + std::time::Duration::from_secs(1)
    }

    /// An empty chain on `runtime`.
    pub fn new(runtime: &Runtime) -> Self {
        HandlerBuilder {
            runtime: runtime.clone(),
            links: Vec::new(),
            limits: Limits::default(),
            host_memory_limit: u64::MAX,
            quarantine: 0,
            magazines: true,
            magazine_depth: MAGAZINE_DEPTH,
            checked: false,
            adversary: None,
            fallback: None,
        }
    }

    /// Add `policy` below the links added so far, with no configuration.
    pub fn link(self, policy: &Policy) -> Self {
        self.link_with(policy, &[])
    }

    /// Add `policy` below the links added so far, configured with key/value pairs.
    pub fn link_with(mut self, policy: &Policy, config: &[(&str, &str)]) -> Self {
        let config = config
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.links.push((policy.clone(), config));
        self
    }

    /// Bounds for every policy instance in the chain. Default: [`Limits::default`].
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Most bytes the host lends the bottom of the chain at once; past it requests are
    /// "none". Default: unlimited.
    pub fn host_memory_limit(mut self, bytes: u64) -> Self {
        self.host_memory_limit = bytes;
        self
    }

    /// Keep up to `bytes` of host memory given back by the chain poisoned (every byte
    /// [`crate::QUARANTINE_POISON`]) and unreleased, oldest released first, so that a use
    /// after free shows as poisoned bytes and [`Handler::audit`] can name a client block
    /// in released memory. For tests and fuzzing: it costs that much memory. Default: 0.
    pub fn quarantine(mut self, bytes: u64) -> Self {
        self.quarantine = bytes;
        self
    }

    /// Keep per-thread, per-size magazines of blocks for a top policy that declares
    /// `batch`. Default: true.
    pub fn magazines(mut self, on: bool) -> Self {
        self.magazines = on;
        self
    }

    /// The most blocks one magazine holds: [`MAGAZINE_DEPTH`] unless the contract
    /// checker asks for shallower ones, whose smaller, more frequent batches (refills
    /// of 1, 2, then 2 or 4 blocks; 4 or 8 given back at once) leave a policy's own
    /// lists part full when the next batch comes.
    pub fn magazine_depth(mut self, most: usize) -> Self {
        self.magazine_depth = most.clamp(1, MAGAZINE_DEPTH);
        self
    }

    /// Deep checks, for the contract checker: a `calloc` answer that is not zero is a
    /// violation of C3 that stops the policy, where the production path zeroes it
    /// (memory the policy got zeroed from upstream in the same call is not rescanned);
    /// fresh host memory holds [`crate::FRESH_MEMORY`], a byte no client pattern holds,
    /// so that a block answered without the client's bytes shows; and the bottom of the
    /// chain is the checker's own upstream, no kinder than the contract (see
    /// [`HandlerBuilder::adversary`]; seed 0 unless one is given). Default: false.
    pub fn checked(mut self, on: bool) -> Self {
        self.checked = on;
        self
    }

    /// In checked mode, the checker's upstream that `adversary` controls: blocks aligned
    /// to 16 bytes and to more only by chance, addresses and in-place growth drawn from
    /// its seed (the same requests get the same addresses in every process, so a failure
    /// replays), and requests refused when it says so.
    pub fn adversary(mut self, adversary: Arc<Adversary>) -> Self {
        self.adversary = Some(adversary);
        self
    }

    /// Where new requests go once this handler's chain has failed. Default: none (they
    /// fail with [`crate::Error::Poisoned`]).
    pub fn fallback(mut self, handler: Arc<Handler>) -> Self {
        self.fallback = Some(handler);
        self
    }

    /// Start every policy, bottom first, and initialise it.
    pub fn build(self) -> Result<Handler, LoadError> {
        self.build_for(Placement::Host)
    }

    /// A handler of memory on GPU `device` of the `Limits::grants` GPU: every block a
    /// policy of it answers must lie in device memory it mapped with `memory.map-gpu` (or a
    /// block of the link below); the host never reads, writes, zeroes or copies one.
    /// Its policies need the `device` grant.
    /// It has no fallback: another handler's memory is not this GPU's.
    pub fn build_device(mut self, device: u32) -> Result<DeviceHandler, LoadError> {
        self.fallback = None;
        let maps = |policy: &Policy| {
            (policy.imports().iter()).any(|name| name.starts_with("allocbox:policy/memory@"))
        };
        if !self.links.is_empty() && !self.links.iter().any(|(policy, _)| maps(policy)) {
            let names: Vec<&str> = self.links.iter().map(|(p, _)| p.source()).collect();
            return Err(LoadError::NotADevicePolicy {
                chain: crate::untrusted::escape(&names.join(">")),
            });
        }
        let gpu = self.limits.grants.gpu.clone();
        let handler = self.build_for(Placement::Device(device))?;
        Ok(DeviceHandler::new(handler, gpu, device))
    }

    /// How each link of the chain starts: over `upstream`, within the builder's limits
    /// and grants, checked or not, serving `placement`.
    fn link_start(&self, upstream: Upstream, placement: Placement) -> LinkStart<'_> {
        LinkStart {
            upstream,
            limits: &self.limits,
            checked: self.checked,
            place: placement,
        }
    }

    fn build_for(self, placement: Placement) -> Result<Handler, LoadError> {
        let Some(((top, top_config), below)) = self.links.split_first() else {
            return Err(LoadError::EmptyChain);
        };
        let fork_patience = self.fork_patience();
        let mut host_memory = SystemMemory::new(self.host_memory_limit, self.quarantine);
        if self.checked {
            host_memory.fill_fresh_with(crate::system::FRESH_MEMORY);
            let adversary = self.adversary.clone().unwrap_or_else(|| Adversary::new(0));
            if !host_memory.serve_adversarially(adversary) {
                return Err(LoadError::CheckerMemory {
                    detail: std::io::Error::last_os_error().to_string(),
                });
            }
        }
        let mut upstream = Upstream::System(Box::new(host_memory));
        let mut names = Vec::new();
        for (policy, config) in below.iter().rev() {
            let link = self
                .runtime
                .start(policy, config, self.link_start(upstream, placement))?;
            names.push(link.name().clone());
            upstream = Upstream::Policy(Box::new(link));
        }
        let mut head = self
            .runtime
            .start(top, top_config, self.link_start(upstream, placement))?;
        // The top policy alone is served without being asked: its client is the host's.
        // Asking the top policy how it observes is part of loading it.
        let starting = &mut Deadline::for_client_call(
            self.runtime.clock(),
            CallTicks::of(self.limits.call_time),
        );
        let observed = match head.observes(starting) {
            Ok(None) => None,
            Ok(Some((batch, lease, detail))) => {
                let obs = Observations::new(batch, lease, detail, fork_patience);
                head.observe_with(Arc::clone(&obs));
                Some(obs)
            }
            Err(e) => return Err(LoadError::Start(Box::new(e))),
        };
        names.push(head.name().clone());
        names.reverse();
        let info = head.info.clone();
        let mut diagnoses = head.info.diagnoses;
        let mut shardable = head.info.shardable;
        let mut below = match head.upstream() {
            Upstream::Policy(next) => Some(&**next),
            Upstream::System(_) => None,
        };
        while let Some(link) = below {
            diagnoses |= link.info.diagnoses;
            shardable &= link.info.shardable;
            below = match link.upstream() {
                Upstream::Policy(next) => Some(&**next),
                Upstream::System(_) => None,
            };
        }
        let handler = Handler {
            caches: Caches::new(
                Chain {
                    head,
                    stats: Stats::default(),
                    counts: Default::default(),
                    failure: None,
                    rerouted: HashSet::new(),
                },
                (self.magazines && (info.batch || observed.is_some()))
                    .then_some(self.magazine_depth),
                fork_patience,
            ),
            info,
            name: names.join(">").into(),
            names,
            fallback: self.fallback,
            diagnoses,
            shardable,
            observed,
            clock: self.runtime.clock().clone(),
            call_ticks: CallTicks::of(self.limits.call_time),
            call_time: self.limits.call_time,
            placement,
        };
        // Prepared for a fork after the caches, whose books' lock comes first in the
        // lock order (a thread holding the books may wait for the observations').
        if let Some(obs) = &handler.observed {
            obs.take_part_in_forks();
        }
        Ok(handler)
    }
}
