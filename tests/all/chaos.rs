//! The adversarial fuzzer for the host: the `chaos` policy, whose every decision comes from
//! a seeded stream, in random chains under the random client of [`super::fuzz`], which
//! asserts the host's invariants after every operation. Freed host memory is quarantined
//! and poisoned, so a use after free also shows as poisoned bytes. Every kind of memory
//! is granted, so its regions meet every path of `memory` (pinned and device memory on a
//! stand-in GPU); a third of the streams observe (0.2.0 `observer`), and a quarter serve
//! a GPU's memory (a device handler).
//!
//! CI runs `ALLOCBOX_CHAOS_STREAMS` streams (default below); a long run:
//! `ALLOCBOX_CHAOS_STREAMS=200000 cargo test --release --test all chaos -- --nocapture`.
//! A failing stream prints its seed; `ALLOCBOX_CHAOS_SEED=S` runs that stream alone.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use allocbox::gpu::{Gpu, StandIn};

use allocbox::mapped::{KindGrant, KindGrants};
use allocbox::{Adversary, Grants, HandlerBuilder, Limits, Runtime};

use super::fuzz::{Rng, drive};
use super::support::*;

const DEFAULT_STREAMS: u64 = 3000;
const OPS_PER_STREAM: usize = 96;
const CALL_TIME: Duration = Duration::from_millis(25);

/// One stream: a chain with chaos in it, driven by a random client. `Ok` names how the
/// chain ended (`alive`, or the kind of failure that stopped it); `Err` says which
/// invariant broke and where.
fn stream(seed: u64) -> Result<String, String> {
    let mut rng = Rng(seed ^ 0xA110_C0B0);
    let chaos = load(&allocbox_artifacts::CHAOS);
    let system = load(&allocbox_artifacts::SYSTEM);
    // Per mille of the policy's decisions that are hostile: low values let a stream live
    // long enough to reach deep states before one hostile act stops it.
    let hostility = [1, 3, 10, 30, 100, 300][rng.below(6) as usize].to_string();
    let seed_text = seed.to_string();
    let chaos_config = [
        ("seed", seed_text.as_str()),
        ("hostility", hostility.as_str()),
    ];
    let mut builder = HandlerBuilder::new(Runtime::shared())
        .limits(Limits {
            call_time: CALL_TIME,
            memory: 16 << 20,
            batch: 256,
            overhead: super::fuzz::OVERHEAD,
            grants: Grants {
                memory: KindGrant::ALL
                    .into_iter()
                    .fold(KindGrants::default(), |mut all, kind| {
                        all.grant(kind);
                        all
                    }),
                gpu: stand_in_gpu(),
                ..Grants::default()
            },
            ..Limits::default()
        })
        .quarantine(4 << 20)
        .magazines(rng.below(2) == 0);
    // Half the streams run on the checker's adversarial upstream, refusing on a plan,
    // so hostile acts meet out-of-memory paths and unusual addresses too. Its own
    // generator keeps every other choice of a seed's stream as it was.
    let mut upstream_rng = Rng(seed ^ 0x0DD0_0DD0);
    if upstream_rng.below(2) == 0 {
        let adversary = Adversary::new(seed);
        match upstream_rng.below(3) {
            0 => adversary.refuse_every(2 + upstream_rng.below(15) as u32),
            1 => adversary.refuse_above(1 << (4 + upstream_rng.below(16))),
            _ => {}
        }
        builder = builder.checked(true).adversary(adversary);
    }
    let links = match rng.below(4) {
        0 => {
            builder = builder
                .link_with(&chaos, &chaos_config)
                .link_with(&chaos, &chaos_config);
            2
        }
        1 => {
            builder = builder.link_with(&chaos, &chaos_config).link(&system);
            2
        }
        2 => {
            builder = builder.link(&system).link_with(&chaos, &chaos_config);
            2
        }
        _ => {
            builder = builder.link_with(&chaos, &chaos_config);
            1
        }
    };
    let fallback = (rng.below(2) == 0).then(|| Arc::new(handler(&allocbox_artifacts::SYSTEM, &[])));
    if let Some(f) = &fallback {
        builder = builder.fallback(f.clone());
    }
    // A generator of its own, so every other choice of a seed's stream stays as it was.
    let on_device = Rng(seed ^ 0x6E0_D0E5).below(4) == 0;
    let built = match on_device {
        true => builder.build_device(0).map(Started::Device),
        false => builder.build().map(Started::Host),
    };
    let started = match built {
        Ok(h) => h,
        // A policy may trap or loop in `init` too; that is a clean refusal.
        Err(allocbox::LoadError::Start(_)) => return Ok("refused at start".into()),
        Err(e) => return Err(format!("start: {e}")),
    };
    let h = match &started {
        Started::Host(h) => h,
        Started::Device(d) => d.handler(),
    };
    let outcome = drive(h, &mut rng, OPS_PER_STREAM, CALL_TIME, links)?;
    if let Some(f) = fallback
        && f.stats().unwrap().live_blocks != 0
    {
        return Err(format!(
            "the fallback still lends {} blocks",
            f.stats().unwrap().live_blocks
        ));
    }
    Ok(outcome)
}

/// A stream's handler: of host memory, or of the stand-in GPU's.
enum Started {
    Host(allocbox::Handler),
    Device(allocbox::DeviceHandler),
}

/// The stand-in GPU every stream's pinned and device memory comes from (host memory,
/// which the random client fills and checks as it does host blocks).
fn stand_in_gpu() -> Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| Gpu::stand_in(Arc::new(StandIn::new(1, 1 << 32))))
        .clone()
}

fn run(seeds: impl Iterator<Item = u64>) {
    let mut failures = Vec::new();
    let mut endings = std::collections::BTreeMap::<String, u64>::new();
    for seed in seeds {
        let outcome = std::panic::catch_unwind(|| stream(seed))
            .unwrap_or_else(|p| Err(format!("host panicked: {p:?}")));
        match outcome {
            Ok(ending) => *endings.entry(ending).or_default() += 1,
            Err(e) => {
                eprintln!("chaos stream {seed}: {e}");
                failures.push(seed);
            }
        }
    }
    // What the policy's hostility ran into: every kind of refusal should show up here.
    eprintln!("chaos endings: {endings:?}");
    assert!(
        failures.is_empty(),
        "chaos streams broke a host invariant; rerun one with ALLOCBOX_CHAOS_SEED=S: {failures:?}"
    );
}

#[test]
fn no_chaos_stream_breaks_a_host_invariant() {
    if let Ok(seed) = std::env::var("ALLOCBOX_CHAOS_SEED") {
        return run(std::iter::once(seed.parse().expect("a u64 seed")));
    }
    let streams = std::env::var("ALLOCBOX_CHAOS_STREAMS")
        .map_or(DEFAULT_STREAMS, |s| s.parse().expect("a number of streams"));
    let start = Instant::now();
    run(0..streams);
    eprintln!("chaos: {streams} streams in {:?}", start.elapsed());
}

/// Found by this fuzzer: in a chain whose lower link failed, the healthy top link kept
/// upstream memory after its client had freed everything, so the host held memory no
/// request could ever use again (until the handler was dropped). A failed chain now
/// stops every link, and each gives its memory back once its client lets go.
#[test]
fn a_failed_chain_gives_back_what_its_healthy_links_held() {
    run([357, 602].into_iter());
}
