//! The policies of every language side by side, in one run: file size, load time with an
//! empty compile cache and from it, `check` throughput at default settings, and ns per
//! malloc+free pair through the policy (per operation) and, for policies that allow
//! batching, through the host's magazines.
//!
//! Run: `cargo bench -p allocbox-check --bench languages` (`-- --quick` for a short run).

use std::hint::black_box;
use std::time::{Duration, Instant};

use allocbox::{HandlerBuilder, Policy, Runtime};
use allocbox_artifacts::Guest;
use allocbox_check::{CheckOptions, check};

/// NumPy's most common request size.
const SIZE: usize = 16;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Seconds to load `guest` in a new runtime (a new engine: nothing compiled in memory).
fn load_in_new_runtime(guest: &Guest) -> f64 {
    let runtime = Runtime::new().unwrap();
    let start = Instant::now();
    runtime.load_file(guest.path()).unwrap();
    start.elapsed().as_secs_f64()
}

/// Median ns per malloc+free pair of `SIZE` bytes.
fn pair_ns(policy: &Policy, magazines: bool, rounds: usize, iters: usize) -> f64 {
    let handler = HandlerBuilder::new(Runtime::shared())
        .magazines(magazines)
        .link(policy)
        .build()
        .unwrap();
    let pair = || {
        let p = handler.malloc(black_box(SIZE)).unwrap();
        handler.free(black_box(p), SIZE).unwrap();
    };
    for _ in 0..iters / 10 {
        pair();
    }
    median(
        (0..rounds)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..iters {
                    pair();
                }
                start.elapsed().as_nanos() as f64 / iters as f64
            })
            .collect(),
    )
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (rounds, iters, check_time) = if quick {
        (3, 2_000, Duration::from_millis(500))
    } else {
        (9, 20_000, Duration::from_secs(3))
    };
    // An empty compile cache of this run's own: the first load compiles, the second
    // (in another new engine) reads the machine code back.
    let cache = std::env::temp_dir().join(format!("allocbox-bench-cache-{}", std::process::id()));
    // SAFETY: set before any thread of this process starts (no runtime exists yet).
    unsafe { std::env::set_var(allocbox::COMPILE_CACHE_ENV, &cache) };

    println!(
        "{:<14}{:<16}{:>12}{:>12}{:>12}{:>14}{:>12}{:>12}",
        "policy", "language", "bytes", "cold load", "cached", "check ops/s", "per-op", "magazine"
    );
    for guest in allocbox_artifacts::GOOD {
        let size = std::fs::metadata(guest.path()).unwrap().len();
        let cold = load_in_new_runtime(guest);
        let cached = load_in_new_runtime(guest);
        let policy = Runtime::shared().load_file(guest.path()).unwrap();
        let options = CheckOptions {
            time: Some(check_time),
            ..CheckOptions::default()
        };
        let report = check(Runtime::shared(), &policy, &[], &options).unwrap();
        assert!(report.passed(), "{}: {:?}", guest.name, report.failure);
        let batch = HandlerBuilder::new(Runtime::shared())
            .link(&policy)
            .build()
            .unwrap()
            .info()
            .batch;
        let per_op = pair_ns(&policy, false, rounds, iters);
        let magazine = if batch {
            format!("{:.1} ns", pair_ns(&policy, true, rounds, iters))
        } else {
            "-".to_string()
        };
        println!(
            "{:<14}{:<16}{:>12}{:>10.3} s{:>10.3} s{:>14.0}{:>9.0} ns{:>12}",
            guest.name,
            guest.language,
            size,
            cold,
            cached,
            report.ops_per_second(),
            per_op,
            magazine
        );
    }
    let _ = std::fs::remove_dir_all(&cache);
}
