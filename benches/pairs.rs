//! ns per malloc+free pair, in one run: glibc, the bare component-call floor, and
//! allocbox handlers. Prints a table of medians and ratios.
//!
//! Run: `cargo bench -p allocbox --bench pairs` (`-- --quick` for a short run;
//! `-- --threads 1,4,16` for the thread counts of the throughput table, 1 and 2 by
//! default, each cell `16: 475.5 (14.11x)`: pairs per µs, and the ratio to 1 thread;
//! the counts take turns round by round, and the ratio is the median of each round's
//! against one thread's round beside it; `-- --only TEXT` for the throughput rows of
//! the cases whose name holds TEXT alone, as `--only "system, per op"`). The `per thread` rows are the same policy per
//! op with an instance per thread (`HandlerBuilder::build_sharded`, one per core).
//!
//! Instructions rather than time, on this noisy machine: `-- --profile` runs only
//! 100,000 `system` per-op pairs and as many glibc-upstream floor pairs, each loop in a
//! function of its own, for callgrind to count one at a time:
//! `valgrind --tool=callgrind --collect-atstart=no --toggle-collect='pairs::profiled_*'
//! target/release/deps/pairs-* --profile` (then `callgrind_annotate --inclusive=yes`).
//!
//! The floor is the `system` policy instantiated with plain wasmtime and an upstream that
//! does nothing: the same two calls and two imports per pair that allocbox's `system`
//! makes, without the ledger, the checks or the lock. The difference is the host's work.
//! A second floor's upstream allocates for real (glibc, as allocbox's host memory does),
//! so the difference from it is what allocbox's ledger, checks and lock cost alone. The
//! `host work` line measures that difference for `system` per op with both sides timed
//! in turn, round by round: two medians taken seconds apart on a shared machine differ
//! by more than it.

use std::hint::black_box;
use std::time::Instant;

use allocbox::{Handler, HandlerBuilder, MemHandler, Runtime};
use wasmtime::component::{HasSelf, Linker, ResourceTable};
use wasmtime::{Config, Engine, Store};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

mod raw {
    wasmtime::component::bindgen!({ path: "../wit/0.2.0", world: "policy" });
}

/// NumPy's most common request size (72% of its mallocs are 8-15 bytes).
const SIZE: usize = 16;
/// A mid-size array's data (8192 float64s), the largest size magazines serve.
const MID_SIZE: usize = 64 << 10;

struct RawHost {
    wasi: WasiCtx,
    table: ResourceTable,
    /// The upstream allocates and frees with glibc rather than answering one address.
    real_memory: bool,
}

fn raw_layout(size: u64) -> std::alloc::Layout {
    std::alloc::Layout::from_size_align(size.max(1) as usize, 16).unwrap()
}

impl WasiView for RawHost {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl raw::allocbox::policy::allocator::Host for RawHost {
    fn malloc(&mut self, size: u64) -> u64 {
        if !self.real_memory {
            return 4096;
        }
        // SAFETY: a non-zero layout; the policy frees it with the size it asked.
        unsafe { std::alloc::alloc(raw_layout(size)) as u64 }
    }
    fn calloc(&mut self, _n: u64, _e: u64) -> u64 {
        4096
    }
    fn realloc(&mut self, _p: u64, _o: u64, _n: u64) -> u64 {
        4096
    }
    fn free(&mut self, p: u64, s: u64) {
        if self.real_memory {
            // SAFETY: `system` frees each block it took from `malloc` once, with its size.
            unsafe { std::alloc::dealloc(p as *mut u8, raw_layout(s)) };
        }
    }
    fn malloc_many(&mut self, _s: u64, _c: u32) -> Vec<u64> {
        Vec::new()
    }
    fn free_many(&mut self, _p: Vec<u64>, _s: u64) {}
}

impl raw::allocbox::policy::bytes::Host for RawHost {
    fn read(&mut self, _at: u64, len: u32) -> Vec<u8> {
        vec![0; len as usize]
    }
    fn write(&mut self, _at: u64, _data: Vec<u8>) {}
    fn fill(&mut self, _at: u64, _len: u64, _byte: u8) {}
    fn copy(&mut self, _dst: u64, _src: u64, _len: u64) {}
    fn read_u64(&mut self, _at: u64) -> u64 {
        0
    }
    fn write_u64(&mut self, _at: u64, _value: u64) {}
}

// `system` imports neither; the world needs them served.
impl raw::allocbox::policy::memory::Host for RawHost {
    fn map_region(
        &mut self,
        _size: u64,
        _kind: raw::allocbox::policy::memory::Kind,
    ) -> Result<u64, raw::allocbox::policy::memory::Refusal> {
        Err(raw::allocbox::policy::memory::Refusal::NotGranted)
    }
    fn unmap_region(&mut self, _addr: u64, _size: u64) {}
    fn page_size(&mut self, _pages: raw::allocbox::policy::memory::Pages) -> u64 {
        4096
    }
    fn map_gpu(
        &mut self,
        _size: u64,
        _kind: raw::allocbox::policy::memory::GpuKind,
    ) -> Result<u64, raw::allocbox::policy::memory::Refusal> {
        Err(raw::allocbox::policy::memory::Refusal::NotGranted)
    }
    fn map_pinned(&mut self, _size: u64) -> Result<u64, raw::allocbox::policy::memory::Refusal> {
        Err(raw::allocbox::policy::memory::Refusal::NotGranted)
    }
    fn map_device(&mut self, _size: u64) -> Result<u64, raw::allocbox::policy::memory::Refusal> {
        Err(raw::allocbox::policy::memory::Refusal::NotGranted)
    }
}

impl raw::allocbox::policy::diagnostics::Host for RawHost {
    fn client_misuse(&mut self, _block: u64, _size: u64, _offset: u64, _message: String) {}
}

fn raw_system(real_memory: bool) -> (Store<RawHost>, raw::Policy) {
    let mut config = Config::new();
    config.concurrency_support(false);
    let engine = Engine::new(&config).unwrap();
    let mut linker = Linker::new(&engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker).unwrap();
    raw::Policy::add_to_linker::<RawHost, HasSelf<RawHost>>(&mut linker, |s| s).unwrap();
    let component =
        wasmtime::component::Component::from_file(&engine, allocbox_artifacts::SYSTEM.path())
            .unwrap();
    let mut store = Store::new(
        &engine,
        RawHost {
            wasi: WasiCtx::builder().build(),
            table: ResourceTable::new(),
            real_memory,
        },
    );
    let policy = raw::Policy::instantiate(&mut store, &component, &linker).unwrap();
    let limits = raw::exports::allocbox::policy::lifecycle::Limits {
        batch: 4096,
        memory: 128 << 20,
        overhead: 256 << 20,
    };
    policy
        .allocbox_policy_lifecycle()
        .call_init(&mut store, &[], limits)
        .unwrap()
        .unwrap();
    (store, policy)
}

/// The middle sample (the upper one of an even count).
fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Ns per iteration of `f` over `iters` iterations.
fn ns_per_iter(iters: usize, f: &mut impl FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed().as_nanos() as f64 / iters as f64
}

/// Median ns per iteration of `f` over `rounds` rounds of `iters` iterations.
fn median_ns(rounds: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    ns_per_iter(iters / 10, &mut f);
    let samples: Vec<f64> = (0..rounds).map(|_| ns_per_iter(iters, &mut f)).collect();
    median(samples)
}

/// Median over `rounds` of the ns per iteration that `case` takes beyond `base`, each
/// round timing `iters` iterations of both back to back (in turn first), so that both
/// sides of a difference see the same machine: on a shared machine whose speed drifts
/// between seconds, two medians taken apart differ by more than the difference measured.
fn median_difference_ns(
    rounds: usize,
    iters: usize,
    mut base: impl FnMut(),
    mut case: impl FnMut(),
) -> f64 {
    ns_per_iter(iters / 10, &mut base);
    ns_per_iter(iters / 10, &mut case);
    let samples: Vec<f64> = (0..rounds)
        .map(|round| {
            if round % 2 == 0 {
                let base_ns = ns_per_iter(iters, &mut base);
                ns_per_iter(iters, &mut case) - base_ns
            } else {
                let case_ns = ns_per_iter(iters, &mut case);
                case_ns - ns_per_iter(iters, &mut base)
            }
        })
        .collect();
    median(samples)
}

/// Pairs per microsecond of `threads` threads each running `iters` calls of `f` at
/// once, for one round after a warm-up round. The same threads run both (so thread
/// start-up and each thread's first-use set-up are not timed) and start each round
/// together at a barrier. The workers time themselves: a round lasts from the first
/// worker's start to the last one's end (the main thread may not get a core then).
fn round_throughput(threads: usize, iters: usize, f: &(dyn Fn() + Sync)) -> f64 {
    let barrier = std::sync::Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    (0..2)
                        .map(|_| {
                            barrier.wait();
                            let start = Instant::now();
                            for _ in 0..iters {
                                f();
                            }
                            (start, Instant::now())
                        })
                        .last()
                        .unwrap()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let start = spans.iter().map(|w| w.0).min().unwrap();
    let end = spans.iter().map(|w| w.1).max().unwrap();
    (threads * iters) as f64 / (end - start).as_nanos() as f64 * 1000.0
}

/// For each thread count: the median pairs per microsecond over `rounds` rounds, and
/// the median ratio to one thread. The counts take turns within each round, one
/// thread's among them, so each ratio compares rounds run moments apart: this machine
/// changes speed by about 2x from one moment to the next.
fn throughput_by_threads(
    counts: &[usize],
    rounds: usize,
    iters: usize,
    f: &(dyn Fn() + Sync),
) -> Vec<(f64, f64)> {
    let mut rates = vec![Vec::with_capacity(rounds); counts.len()];
    let mut ratios = vec![Vec::with_capacity(rounds); counts.len()];
    for _ in 0..rounds {
        let one = round_throughput(1, iters, f);
        for (i, &n) in counts.iter().enumerate() {
            let rate = match n {
                1 => one,
                n => round_throughput(n, iters, f),
            };
            rates[i].push(rate);
            ratios[i].push(rate / one);
        }
    }
    rates
        .into_iter()
        .zip(ratios)
        .map(|(rates, ratios)| (median(rates), median(ratios)))
        .collect()
}

fn handler(links: &[(&allocbox_artifacts::Guest, &[(&str, &str)])], magazines: bool) -> Handler {
    let runtime = Runtime::shared();
    let mut builder = HandlerBuilder::new(runtime).magazines(magazines);
    for (guest, config) in links {
        builder = builder.link_with(&runtime.load_file(guest.path()).unwrap(), config);
    }
    builder.build().unwrap()
}

/// The same chain as [`handler`], per call, one chain per thread up to one per core
/// (its policies are shardable).
fn sharded(links: &[(&allocbox_artifacts::Guest, &[(&str, &str)])]) -> Box<dyn MemHandler> {
    let runtime = Runtime::shared();
    let mut builder = HandlerBuilder::new(runtime);
    for (guest, config) in links {
        builder = builder.link_with(&runtime.load_file(guest.path()).unwrap(), config);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let h = builder.build_sharded(cores).unwrap();
    assert_eq!(
        h.shard_count(),
        cores,
        "the policies say they are shardable"
    );
    Box::new(h)
}

fn pair(h: &dyn MemHandler, size: usize) {
    let p = h.malloc(black_box(size)).unwrap();
    h.free(black_box(p), size).unwrap();
}

/// A pair straight through plain wasmtime, as allocbox's `system` per op makes it.
fn raw_pair(store: &mut Store<RawHost>, raw: &raw::Policy) {
    let a = raw.allocbox_policy_allocator();
    let p = a.call_malloc(&mut *store, black_box(SIZE as u64)).unwrap();
    a.call_free(&mut *store, p, SIZE as u64).unwrap();
}

fn glibc_pair(size: usize) {
    let layout = std::alloc::Layout::from_size_align(size, 16).unwrap();
    // SAFETY: a non-zero layout, freed right away with the same layout.
    unsafe { std::alloc::dealloc(black_box(std::alloc::alloc(layout)), layout) };
}

/// The pairs callgrind counts (see the top of the file): the host's work per pair is
/// the difference between the two.
const PROFILED_PAIRS: usize = 100_000;

#[inline(never)]
fn profiled_system_per_op(h: &Handler) {
    for _ in 0..PROFILED_PAIRS {
        pair(h, SIZE);
    }
}

#[inline(never)]
fn profiled_magazine_hits(h: &Handler) {
    for _ in 0..PROFILED_PAIRS {
        pair(h, SIZE);
    }
}

#[inline(never)]
fn profiled_glibc() {
    for _ in 0..PROFILED_PAIRS {
        glibc_pair(SIZE);
    }
}

#[inline(never)]
fn profiled_floor(store: &mut Store<RawHost>, raw: &raw::Policy) {
    for _ in 0..PROFILED_PAIRS {
        raw_pair(store, raw);
    }
}

/// The text of `--only TEXT`: only the throughput rows whose case names hold it.
fn only() -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let at = args.iter().position(|a| a == "--only")?;
    match args.get(at + 1) {
        Some(text) => Some(text.clone()),
        None => {
            eprintln!("--only: give the text a case's name holds, as --only \"system, per op\"");
            std::process::exit(2);
        }
    }
}

/// The thread counts of `--threads LIST` (`1,4,16`); 1 and 2 by default.
fn thread_counts() -> Vec<usize> {
    let args: Vec<String> = std::env::args().collect();
    let Some(at) = args.iter().position(|a| a == "--threads") else {
        return vec![1, 2];
    };
    let list = args.get(at + 1).map_or("", String::as_str);
    let counts: Option<Vec<usize>> = list
        .split(',')
        .map(|n| n.trim().parse().ok().filter(|n| (1..=256).contains(n)))
        .collect();
    match counts {
        Some(counts) if !counts.is_empty() => counts,
        _ => {
            eprintln!("--threads {list}: give thread counts from 1 to 256, as 1,4,16");
            std::process::exit(2);
        }
    }
}

fn main() {
    // `--profile-magazine`: only magazine hits of `size-classes`, for `perf record` and
    // `valgrind --tool=callgrind` (the issue 63 profile), beside glibc's pairs.
    if std::env::args().any(|a| a == "--profile-magazine") {
        let h = handler(&[(&SIZE_CLASSES, &[])], true);
        pair(&h, SIZE);
        profiled_magazine_hits(&h);
        profiled_glibc();
        return;
    }
    if std::env::args().any(|a| a == "--profile") {
        let h = handler(&[(&SYSTEM, &[])], false);
        let (mut store, raw) = raw_system(true);
        // Warm: the first calls compile lazily-initialised paths and fill caches.
        pair(&h, SIZE);
        profiled_system_per_op(&h);
        profiled_floor(&mut store, &raw);
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let threads = thread_counts();
    let only = only();
    let (rounds, iters) = if quick { (5, 20_000) } else { (15, 200_000) };

    use allocbox_artifacts::{QUOTA, SIZE_CLASSES, SYSTEM};
    let boxed = |h: Handler| Box::new(h) as Box<dyn MemHandler>;
    let cases: Vec<(&str, Box<dyn MemHandler>)> = vec![
        (
            "allocbox system, per op",
            boxed(handler(&[(&SYSTEM, &[])], false)),
        ),
        (
            "allocbox system, per op, per thread",
            sharded(&[(&SYSTEM, &[])]),
        ),
        (
            "allocbox system, magazines",
            boxed(handler(&[(&SYSTEM, &[])], true)),
        ),
        (
            "allocbox size-classes, per op",
            boxed(handler(&[(&SIZE_CLASSES, &[])], false)),
        ),
        (
            "allocbox size-classes, per op, per thread",
            sharded(&[(&SIZE_CLASSES, &[])]),
        ),
        (
            "allocbox size-classes, magazines",
            boxed(handler(&[(&SIZE_CLASSES, &[])], true)),
        ),
        (
            "allocbox size-classes > system, per op",
            boxed(handler(&[(&SIZE_CLASSES, &[]), (&SYSTEM, &[])], false)),
        ),
        // An observing policy: each pair served from the magazines, told in batches,
        // its lease taken and given back under the observations' lock.
        (
            "allocbox quota observing, magazines",
            boxed(handler(
                &[(
                    &QUOTA,
                    &[("observe", "true"), ("max-bytes", "1099511627776")],
                )],
                true,
            )),
        ),
    ];

    // The latency tables are left out of a run for some throughput rows.
    if only.is_none() {
        let glibc = median_ns(rounds, iters, || glibc_pair(SIZE));

        let (mut store, raw) = raw_system(false);
        let empty_call = median_ns(rounds, iters, || {
            raw.allocbox_policy_lifecycle()
                .call_trim(&mut store)
                .unwrap();
        });
        let floor = median_ns(rounds, iters, || raw_pair(&mut store, &raw));
        let (mut real_store, real) = raw_system(true);
        let floor_with_memory = median_ns(rounds, iters, || raw_pair(&mut real_store, &real));

        println!("ns per malloc({SIZE})+free pair, median of {rounds} rounds x {iters} pairs");
        println!(
            "{:<42} {:>9} {:>9} {:>9}",
            "case", "ns/pair", "x glibc", "x floor"
        );
        let row = |name: &str, ns: f64| {
            println!(
                "{name:<42} {ns:>9.1} {:>9.1} {:>9.2}",
                ns / glibc,
                ns / floor
            );
        };
        row("glibc malloc+free", glibc);
        row("empty component call (one)", empty_call);
        row("floor: raw wasmtime system (2 calls+2 imports)", floor);
        row("floor, upstream allocating with glibc", floor_with_memory);
        for (name, h) in &cases {
            row(name, median_ns(rounds, iters, || pair(&**h, SIZE)));
        }
        let (_, system_per_op) = cases
            .iter()
            .find(|(name, _)| *name == "allocbox system, per op")
            .expect("the cases include system per op");
        let host_work = median_difference_ns(
            rounds,
            iters,
            || raw_pair(&mut real_store, &real),
            || pair(&**system_per_op, SIZE),
        );
        println!(
            "host work: system per op less the glibc-upstream floor, rounds in turn: {host_work:.1} ns"
        );
    }

    // Threads: the same handler shared by each count of threads, against 1 thread, in
    // pairs per microsecond (throughput, not latency).
    println!(
        "\nmalloc({SIZE})+free pairs per µs, threads sharing one handler (x: median ratio to 1 thread in the same round), same run"
    );
    let thread_row = |name: &str, f: &(dyn Fn() + Sync)| {
        // A round of about 20 ms for one thread, whatever a pair costs: a per-call
        // policy shared by 16 threads may serve a hundred times fewer pairs than glibc.
        let ns = median_ns(3, iters / 10, f);
        let per_thread = ((20e6 / ns) as usize).clamp(1_000, 10 * iters);
        let cells: Vec<String> = threads
            .iter()
            .zip(throughput_by_threads(&threads, rounds, per_thread, f))
            .map(|(n, (at, ratio))| format!("{n}: {at:.1} ({ratio:.2}x)"))
            .collect();
        println!("{name:<42} {}", cells.join("  "));
    };
    let wanted = |name: &str| only.as_deref().is_none_or(|text| name.contains(text));
    if wanted("glibc malloc+free") {
        thread_row("glibc malloc+free", &|| glibc_pair(SIZE));
    }
    for (name, h) in cases.iter().filter(|(name, _)| wanted(name)) {
        thread_row(name, &|| pair(&**h, SIZE));
    }

    if only.is_none() {
        println!("\nns per malloc({MID_SIZE})+free pair, same run");
        let glibc_mid = median_ns(rounds, iters, || glibc_pair(MID_SIZE));
        println!("{:<42} {:>9} {:>9}", "case", "ns/pair", "x glibc");
        let mid_row =
            |name: &str, ns: f64| println!("{name:<42} {ns:>9.1} {:>9.1}", ns / glibc_mid);
        mid_row("glibc malloc+free", glibc_mid);
        for (name, h) in &cases {
            mid_row(name, median_ns(rounds, iters, || pair(&**h, MID_SIZE)));
        }
    }
}
