//! The runtime's clock: a thread of its own advances the engine's epoch, so that wasm
//! code that runs too long traps, and a tick count with it, so that host code inside
//! imports keeps the same time limits.
//!
//! A forked child has only the thread that forked: the first call into a guest there
//! starts the ticking thread again ([`Clock::now_ticking`]), so call limits hold in the
//! child as in its parent.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use allocbox_ledger::platform::fork;
use wasmtime::{Engine, EngineWeak};

/// How often the epoch advances; a call's time limit is rounded up to this.
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(5);

/// The tick by which one call of the embedder's must end, with every guest call it
/// causes: the policy's own answer, the refills and flushes of the magazines, the
/// deliveries of events and renewals of a lease, a report, and the calls of every link
/// below. It is made only where the embedder's call enters the host
/// ([`Deadline::for_client_call`]: a test lists the files that may) and passed as a
/// value to every guest call that call causes, so no later guest call can start a
/// clock of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Deadline(u64);

/// A call's time limit in ticks: rounded up to whole ticks, and one more for the tick
/// already begun. Worked out once, where the limit is set, off every call's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallTicks(u64);

impl CallTicks {
    pub(crate) fn of(limit: Duration) -> CallTicks {
        CallTicks(limit.as_nanos().div_ceil(EPOCH_TICK.as_nanos()) as u64 + 1)
    }

    #[cfg(test)]
    pub(crate) fn ticks(self) -> u64 {
        self.0
    }
}

impl Deadline {
    /// A deadline already passed: what a guest runs under before any call arms one,
    /// and what a give-back that calls no guest is made under.
    pub(crate) const fn passed() -> Deadline {
        Deadline(0)
    }

    /// The deadline of a call of the embedder's that begins now and may take `limit`. In a forked
    /// child whose clock does not tick yet, "now" is the tick it stopped at, where it
    /// goes on from once the first guest call starts it ([`Clock::now_ticking`]).
    #[inline]
    pub(crate) fn for_client_call(clock: &Clock, limit: CallTicks) -> Deadline {
        Deadline(clock.now().saturating_add(limit.0))
    }

    /// The tick it passes at.
    #[inline]
    pub(crate) fn tick(self) -> u64 {
        self.0
    }

    /// Move the deadline on by `ticks` of host work the client chose the length of.
    #[inline]
    pub(crate) fn excuse(&mut self, ticks: u64) {
        self.0 = self.0.saturating_add(ticks);
    }

    /// Take on the time a guest call under this deadline was excused: the deadline it
    /// ended with, if later.
    #[inline]
    pub(crate) fn extend_to(&mut self, ended_with: Deadline) {
        self.0 = self.0.max(ended_with.0);
    }
}

pub(crate) struct Clock {
    ticks: AtomicU64,
    /// The [`fork::generation`] the ticking thread runs in.
    ticking_in: AtomicU64,
    engine: EngineWeak,
}

impl Clock {
    /// A clock for `engine`, ticking from now until the engine is dropped.
    pub(crate) fn start(engine: &Engine) -> Arc<Clock> {
        let generation = fork::generation();
        let clock = Arc::new(Clock {
            ticks: AtomicU64::new(0),
            ticking_in: AtomicU64::new(generation),
            engine: engine.weak(),
        });
        clock.spawn_ticker();
        clock
    }

    /// Ticks since the clock started.
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        self.ticks.load(Ordering::Relaxed)
    }

    /// [`Clock::now`], first making sure the clock ticks in this process: call it when
    /// a guest call begins.
    #[inline]
    pub(crate) fn now_ticking(self: &Arc<Self>) -> u64 {
        let ticking_in = self.ticking_in.load(Ordering::Relaxed);
        let generation = fork::generation();
        if ticking_in != generation {
            self.start_again(ticking_in, generation);
        }
        self.now()
    }

    /// In a forked child: the parent's ticking thread is not here.
    #[cold]
    fn start_again(self: &Arc<Self>, ticking_in: u64, generation: u64) {
        // One thread of the child wins; the others find the clock ticking.
        if self
            .ticking_in
            .compare_exchange(ticking_in, generation, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.spawn_ticker();
        }
    }

    fn spawn_ticker(self: &Arc<Self>) {
        let clock = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("allocbox-epoch".into())
            .spawn(move || {
                while let Some(clock) = clock.upgrade()
                    && let Some(engine) = clock.engine.upgrade()
                {
                    engine.increment_epoch();
                    clock.ticks.fetch_add(1, Ordering::Relaxed);
                    drop((engine, clock));
                    std::thread::sleep(EPOCH_TICK);
                }
            })
            .expect("spawning the epoch thread");
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Where each way of making a [`super::Deadline`] may appear: where the embedder's
    /// calls enter the host. A guest call anywhere else runs under a deadline passed to
    /// it; this test fails when a new path starts a clock of its own.
    const MAKERS: [(&str, &[&str]); 2] = [
        (
            "Deadline::for_client_call(",
            &[
                // The definition, and its wrappers for the handler and for a link.
                "clock.rs",
                "handler.rs",
                "link.rs",
                // Loading a policy, asking how it observes, and a hook's event.
                "runtime.rs",
                "handler/builder.rs",
                "hook.rs",
            ],
        ),
        (
            ".client_call()",
            &[
                // The handler's entry points (a client's free among them), its counters
                // and a thread's end.
                "handler.rs",
                "handler/give_back.rs",
                "handler/inspect.rs",
                "handler/chain.rs",
                // A request of an observing policy's client, renewal and delivery
                // included.
                "handler/observed.rs",
                // A request served through the combining queue, and its client's time
                // in the queue.
                "handler/combined.rs",
            ],
        ),
    ];

    fn sources(dir: &Path, found: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, found);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push((
                    path.display().to_string(),
                    std::fs::read_to_string(&path).unwrap(),
                ));
            }
        }
    }

    #[test]
    fn a_deadline_is_made_only_where_an_embedder_s_call_enters() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&root, &mut files);
        assert!(files.len() > 20, "the sources were not found");
        let root = format!("{}/", root.display());
        for (path, text) in &files {
            let relative = path.strip_prefix(&root).unwrap_or(path);
            for (maker, allowed) in MAKERS {
                // The test itself names the makers.
                let uses = text
                    .lines()
                    .filter(|l| l.contains(maker) && !l.trim_start().starts_with('"'))
                    .count();
                assert!(
                    uses == 0 || allowed.contains(&relative),
                    "{relative} makes a deadline with `{maker}`: a guest call there must \
                     run under the deadline of the embedder's call that causes it"
                );
            }
        }
    }
}
