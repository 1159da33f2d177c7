//! How well `allocbox check` finds the bugs allocator authors really make, at the
//! settings a user gets by default (`allocbox check P`: a 3 s budget): for each bug
//! planted in the `broken` policy, whether it was found, how long the first failing case
//! took to come up, and the length of the shrunk script against the shortest script
//! that shows the bug (how many operations more).
//!
//! Run: `cargo bench -p allocbox-check --bench planted` (after `--`: `--time SECS`).

use std::time::Duration;

use allocbox::Runtime;
use allocbox_check::{CheckOptions, check};

/// Each planted bug: the `broken` fault, what it is, and the fewest operations that show
/// it (the script's own operations; the checker frees what is live at the end, then
/// trims). The contract's plain breaks first, then the bugs allocator authors make.
const PLANTED: &[(&str, &str, usize)] = &[
    ("outside", "malloc answers past its block", 1),
    ("overlap", "small mallocs share one block", 2),
    ("misaligned", "malloc answers upstream + 8", 1),
    ("off-by-one", "malloc(n) gets n - 1", 1),
    ("wrong-size-free", "frees upstream with size + 1", 1),
    ("double-free", "frees upstream twice", 1),
    ("foreign-free", "frees an address never lent", 1),
    ("calloc-dirty", "calloc not zeroed", 1),
    ("realloc-loses", "realloc copies half", 2),
    ("realloc-outside", "realloc answers past its block", 2),
    ("leak", "frees of 64+ bytes dropped", 1),
    ("scribble", "malloc writes into the last block", 2),
    ("free-other", "free gives back another lent block", 2),
    ("trap-malloc", "malloc traps", 1),
    ("trap-calloc", "calloc traps", 1),
    ("trap-realloc", "realloc traps", 1),
    ("trap-free", "free traps", 1),
    // The checker's own trim at the end meets it.
    ("trap-trim", "trim traps", 0),
    ("trap-malloc-many", "malloc-many traps", 1),
    ("trap-free-many", "free-many traps", 1),
    ("loop-malloc", "malloc(13) never returns", 1),
    ("grow-memory", "malloc grows guest memory for ever", 1),
    // What the kind upstream of the C allocator hid: over-alignment, zeroed fresh memory
    // and a batch that never comes back short.
    (
        "trusts-alignment",
        "declares 64, page blocks from upstream",
        1,
    ),
    ("assumes-zero", "large calloc from unzeroed malloc", 1),
    // `oom every 2`, one malloc; the checker's trim gives the padded list back.
    (
        "oom-corrupts-list",
        "short batch padded with its last block",
        2,
    ),
    (
        "oom-leaks-batch",
        "short batch dropped, never given back",
        2,
    ),
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
    // A policy that batches: bugs on the path the host's magazines bypass (its own
    // `calloc` of small blocks) or only they reach (refills and flushes).
    (
        "small-calloc-recycled",
        "per-call calloc of a recycled block dirty",
        3,
    ),
    (
        "calloc-forgets-header",
        "per-call calloc forgets the block header",
        1,
    ),
    ("batch-drops-on-oom", "batch refused part way dropped", 3),
    // Four sizes: the checker's own trim at the end gives back four magazines.
    ("free-many-leaks", "every 4th free-many keeps a block", 4),
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
        "fault", "bug", "found", "rule", "first s", "shrunk", "min", "+ min"
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
        let over = script.len() as i64 - minimal as i64;
        println!(
            "{fault:<22} {bug:<42} {:>5} {:<22} {first:>8.3} {shrunk:>7} {minimal:>5} {over:>+6}",
            "yes", finding.rule
        );
    }
    println!(
        "found {found} of {} (* shrinking stopped at its time limit)",
        PLANTED.len()
    );
}
