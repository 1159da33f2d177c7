//! How well `allocbox check` finds the bugs allocator authors really make, at the
//! settings a user gets by default (`allocbox check P`: a 3 s budget): for each bug
//! planted in the `broken` policy, whether it was found, how long the first failing case
//! took to come up, and the length of the shrunk script against the shortest script
//! that shows the bug.
//!
//! Run: `cargo bench -p allocbox-check --bench planted` (after `--`: `--time SECS`).

use std::time::Duration;

use allocbox::Runtime;
use allocbox_check::{CheckOptions, check};

/// Each planted bug: the `broken` fault, what it is, and the fewest operations that show
/// it (the script's own operations; the checker frees what is live at the end).
const PLANTED: &[(&str, &str, usize)] = &[
    ("class-rounding", "malloc of 17-24 bytes gets 16", 1),
    ("page-off-by-one", "malloc(4096) gets 4095", 1),
    ("grow-into-slack", "realloc growing <= 16 bytes in place", 2),
    (
        "shrink-wrong-size",
        "in-place shrink, freed with the new size",
        2,
    ),
    (
        "recycled-calloc-dirty",
        "calloc of a recycled block not zeroed",
        3,
    ),
    ("stale-after-trim", "trim gives back a listed block", 3),
    // One malloc: the checker's own free at the end lists the block twice, and its trim
    // gives it back twice.
    (
        "duplicate-slot",
        "a freed block of 16n bytes listed twice",
        1,
    ),
    (
        "overlap-after-200",
        "the 201st malloc repeats the 200th",
        201,
    ),
    // 201 mallocs: the checker's own frees at the end reach the 201st free.
    ("leak-after-200", "frees after the 200th are dropped", 201),
    (
        "misaligned-after-300",
        "mallocs after the 300th misaligned",
        301,
    ),
];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let time = args
        .iter()
        .position(|a| a == "--time")
        .and_then(|i| args.get(i + 1))
        .map_or(3.0, |v| v.parse::<f64>().expect("--time SECS"));
    let runtime = Runtime::shared();
    let broken = runtime
        .load_file(allocbox_artifacts::BROKEN.path())
        .expect("the broken guest is built");
    let options = CheckOptions {
        time: Some(Duration::from_secs_f64(time)),
        ..CheckOptions::default()
    };
    println!("planted bugs, `allocbox check` defaults ({time} s budget), one run each");
    println!(
        "{:<22} {:<42} {:>5} {:<22} {:>8} {:>7} {:>5} {:>6}",
        "fault", "bug", "found", "rule", "first s", "shrunk", "min", "x min"
    );
    let mut found = 0;
    for &(fault, bug, minimal) in PLANTED {
        let config = [("fault", fault)];
        let report = check(runtime, &broken, &config, &options).expect("broken starts");
        let Some((finding, script)) = &report.failure else {
            println!("{fault:<22} {bug:<42} {:>5}", "no");
            continue;
        };
        found += 1;
        let first = report.time_to_failure.unwrap_or_default().as_secs_f64();
        let early = if report.shrink_stopped_early { "*" } else { "" };
        let shrunk = format!("{}{early}", script.len());
        let ratio = script.len() as f64 / minimal as f64;
        println!(
            "{fault:<22} {bug:<42} {:>5} {:<22} {first:>8.3} {shrunk:>7} {minimal:>5} {ratio:>6.2}",
            "yes", finding.rule
        );
    }
    println!(
        "found {found} of {} (* shrinking stopped at its time limit)",
        PLANTED.len()
    );
}
