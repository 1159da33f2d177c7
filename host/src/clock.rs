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
