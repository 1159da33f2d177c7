//! Replay NumPy's recorded allocation trace through the native default handler and wasm
//! policies, in one run: ns per event and the ratio to the native default.
//!
//! Run: `cargo bench -p allocbox --bench replay` (a trace path may follow `--`; default
//! `../shared/traces/numpy-core-sample.txt.gz`).

use std::sync::Arc;

use allocbox::nep49::{MemHandler, default_handler};
use allocbox::trace::{read_trace, replay_trace};
use allocbox::{HandlerBuilder, Runtime};

fn wasm(guest: &allocbox_artifacts::Guest) -> Arc<dyn MemHandler> {
    let runtime = Runtime::shared();
    let policy = runtime.load_file(guest.path()).unwrap();
    Arc::new(HandlerBuilder::new(runtime).link(&policy).build().unwrap())
}

fn main() {
    let path = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| {
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../shared/traces/numpy-core-sample.txt.gz"
            )
            .into()
        });
    let events = read_trace(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    use allocbox_artifacts::{ALIGNED, ARENA, LIMIT, SIZE_CLASSES, SYSTEM, TRACKER};
    let handlers: Vec<(&str, Arc<dyn MemHandler>)> = vec![
        ("native NumPy default", default_handler()),
        ("system", wasm(&SYSTEM)),
        ("size-classes", wasm(&SIZE_CLASSES)),
        ("arena", wasm(&ARENA)),
        // NEP 49's example, batched: its header survives in the magazines.
        ("aligned", wasm(&ALIGNED)),
        // Observing (contract 0.2.0): told of every event in batches, in sums (`limit`,
        // Python) or one by one (`tracker`, JavaScript).
        ("limit (observing)", wasm(&LIMIT)),
        ("tracker (observing)", wasm(&TRACKER)),
    ];
    println!(
        "{} events from {path}; median of 3 replays each",
        events.len()
    );
    println!(
        "{:<22} {:>10} {:>10} {:>12} {:>9}",
        "handler", "ns/event", "x native", "violations", "failures"
    );
    let mut native = 0.0;
    for (name, handler) in &handlers {
        let mut runs: Vec<_> = (0..3).map(|_| replay_trace(&**handler, &events)).collect();
        runs.sort_by_key(|r| r.elapsed);
        let report = &runs[1];
        let ns = report.ns_per_event();
        if native == 0.0 {
            native = ns;
        }
        let failed = runs.iter().filter(|r| r.failure.is_some()).count();
        let violations = runs
            .iter()
            .filter(|r| matches!(r.failure, Some((_, allocbox::Error::Violation(_)))))
            .count();
        println!(
            "{name:<22} {ns:>10.1} {:>10.2} {violations:>12} {failed:>9}",
            ns / native
        );
    }
}
