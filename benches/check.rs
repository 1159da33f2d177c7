//! Checked-mode throughput of the contract checker: client operations per second with
//! every check on, on the default size mix and sequence length (issue 3's target is
//! 200,000 ops/s). Policies take turns within each round, so drift in a noisy machine
//! spreads over all of them.
//!
//! Run: `cargo bench -p allocbox-check --bench check` (after `--`: `--cases N`, `--rounds R`).

use allocbox::Runtime;
use allocbox_artifacts::{ARENA, Guest, SIZE_CLASSES, SYSTEM, WAT_PASSTHROUGH};
use allocbox_check::{CheckOptions, check};

const TARGET_OPS_PER_SECOND: f64 = 200_000.0;

fn flag(name: &str, default: u32) -> u32 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| {
            v.parse().unwrap_or_else(|e| panic!("{name} {v}: {e}"))
        })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    let cases = flag("--cases", 1000);
    let rounds = flag("--rounds", 7) as usize;
    let guests: [&Guest; 4] = [&SYSTEM, &SIZE_CLASSES, &ARENA, &WAT_PASSTHROUGH];
    let runtime = Runtime::shared();
    let policies: Vec<_> = guests
        .iter()
        .map(|g| runtime.load_file(g.path()).unwrap())
        .collect();
    // The same seed every round: each round repeats the same sequences.
    let options = CheckOptions {
        cases,
        ..CheckOptions::default()
    };
    let mut ops_per_second = vec![Vec::new(); guests.len()];
    let mut us_per_case = vec![Vec::new(); guests.len()];
    let mut ops_per_case = vec![0.0; guests.len()];
    for _ in 0..rounds {
        for (i, policy) in policies.iter().enumerate() {
            let report = check(runtime, policy, &[], &options).unwrap();
            assert!(report.passed(), "{}: {:?}", guests[i].name, report.failure);
            ops_per_second[i].push(report.ops_per_second());
            us_per_case[i].push(report.elapsed.as_secs_f64() * 1e6 / f64::from(report.cases));
            ops_per_case[i] = report.ops as f64 / f64::from(report.cases);
        }
    }
    println!(
        "checked mode, {cases} cases of up to {} ops (default mix); median of {rounds} rounds",
        options.max_ops
    );
    println!(
        "{:<14} {:>12} {:>12} {:>12} {:>9} {:>10} {:>8}",
        "policy", "ops/s", "min", "max", "x target", "us/case", "ops/case"
    );
    for (i, guest) in guests.iter().enumerate() {
        let runs = &ops_per_second[i];
        let min = runs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = runs.iter().copied().fold(0.0, f64::max);
        let med = median(runs.clone());
        println!(
            "{:<14} {:>12.0} {:>12.0} {:>12.0} {:>9.2} {:>10.1} {:>8.1}",
            guest.name,
            med,
            min,
            max,
            med / TARGET_OPS_PER_SECOND,
            median(us_per_case[i].clone()),
            ops_per_case[i],
        );
    }
}
