//! GPU memory on the stand-in GPU: device handlers (blocks only in device memory of
//! their GPU, whose bytes the host never touches), stream-ordered frees, pinned regions,
//! the grants and the shares.

use std::sync::Arc;

use allocbox::gpu::{Gpu, GpuError, StandIn};
use allocbox::mapped::{KindGrant, KindGrants};
use allocbox::{DeviceHandler, Error, Grants, Handler, HandlerBuilder, Limits, Rule, Runtime};
use allocbox_artifacts::Guest;

use super::support::*;

fn limits(gpu: &Gpu, grants: KindGrants) -> Limits {
    Limits {
        grants: Grants {
            memory: grants,
            gpu: gpu.clone(),
            ..Grants::default()
        },
        ..Limits::default()
    }
}

fn device_grant() -> KindGrants {
    KindGrants::from_iter([KindGrant::Device])
}

fn stand_in(devices: u32, memory: u64) -> (Arc<StandIn>, Gpu) {
    let stand_in = Arc::new(StandIn::new(devices, memory));
    (stand_in.clone(), Gpu::stand_in(stand_in))
}

fn pool_on(gpu: &Gpu, device: u32, config: &[(&str, &str)]) -> DeviceHandler {
    HandlerBuilder::new(Runtime::shared())
        .link_with(&load(&allocbox_artifacts::GPU_POOL), config)
        .limits(limits(gpu, device_grant()))
        .build_device(device)
        .unwrap()
}

fn pinned_grant() -> KindGrants {
    KindGrants::from_iter([KindGrant::Pinned])
}

/// A handler of host memory of `guest`, granted `grants` of `gpu`.
fn host_on(gpu: &Gpu, guest: &Guest, config: &[(&str, &str)], grants: KindGrants) -> Handler {
    HandlerBuilder::new(Runtime::shared())
        .link_with(&load(guest), config)
        .limits(limits(gpu, grants))
        .build()
        .unwrap()
}

fn probe_on(gpu: &Gpu, config: &[(&str, &str)], grants: KindGrants) -> DeviceHandler {
    HandlerBuilder::new(Runtime::shared())
        .link_with(&load(&allocbox_artifacts::KINDS_PROBE), config)
        .limits(limits(gpu, grants))
        .build_device(0)
        .unwrap()
}

fn rule(err: Error) -> Rule {
    match err {
        Error::Violation(v) => v.rule,
        other => panic!("not a violation: {other}"),
    }
}

#[test]
fn the_gpu_pool_places_blocks_in_device_regions_and_gives_every_region_back() {
    let (stand_in, gpu) = stand_in(1, 1 << 30);
    let pool = pool_on(&gpu, 0, &[("region-size", "8388608")]);
    let mut blocks = Vec::new();
    for size in [1u64, 256, 1000, 65_536, 3 << 20, 9 << 20] {
        let block = pool.malloc(size).unwrap().expect("memory");
        assert_eq!(block % 256, 0, "{size}");
        blocks.push((block, size));
    }
    assert!(stand_in.allocated(0) >= (8 << 20) + (9 << 20));
    for (block, size) in blocks {
        pool.free(block, Some(size), &[]).unwrap();
    }
    pool.trim().unwrap();
    pool.leak_check().unwrap();
    drop(pool);
    assert_eq!(stand_in.allocated(0), 0);
}

#[test]
fn a_freed_block_waits_for_the_work_queued_on_its_streams_before_its_policy_gets_it_back() {
    let (stand_in, gpu) = stand_in(1, 1 << 30);
    // No magazines: every block goes to the policy, which reuses a freed one at once.
    let pool = HandlerBuilder::new(Runtime::shared())
        .link(&load(&allocbox_artifacts::GPU_POOL))
        .limits(limits(&gpu, device_grant()))
        .magazines(false)
        .build_device(0)
        .unwrap();
    let first = pool.malloc(4096).unwrap().unwrap();
    // A kernel reading `first` is queued on streams 7 and 9, then the block is freed.
    stand_in.queue(0, 7);
    stand_in.queue(0, 9);
    pool.free(first, Some(4096), &[7, 9]).unwrap();
    assert_eq!(pool.pending_frees().blocks, 1);
    let second = pool.malloc(4096).unwrap().unwrap();
    assert_ne!(
        second, first,
        "reused while a stream's work may still read it"
    );
    stand_in.finish(0, 7);
    let third = pool.malloc(4096).unwrap().unwrap();
    assert_ne!(
        third, first,
        "reused while stream 9's work may still read it"
    );
    stand_in.finish(0, 9);
    // The next call gives it back, and the policy reuses it.
    let fourth = pool.malloc(4096).unwrap().unwrap();
    assert_eq!(fourth, first);
    assert_eq!(pool.pending_frees().blocks, 0);
    for block in [second, third, fourth] {
        pool.free(block, Some(4096), &[]).unwrap();
    }
    pool.leak_check().unwrap();
}

#[test]
fn a_deferral_keeps_even_finished_frees_from_the_policy_until_it_ends() {
    let (_, gpu) = stand_in(1, 1 << 30);
    let pool = pool_on(&gpu, 0, &[]);
    let block = pool.malloc(1 << 20).unwrap().unwrap();
    {
        let _deferred = pool.defer();
        pool.free(block, Some(1 << 20), &[]).unwrap();
        assert_eq!(pool.pending_frees().blocks, 1);
        let other = pool.malloc(1 << 20).unwrap().unwrap();
        assert_ne!(other, block);
        pool.free(other, Some(1 << 20), &[]).unwrap();
    }
    pool.trim().unwrap();
    assert_eq!(pool.pending_frees(), Default::default());
    pool.leak_check().unwrap();
}

#[test]
fn a_second_free_of_a_block_waiting_for_its_stream_is_refused_at_once() {
    let (stand_in, gpu) = stand_in(1, 1 << 30);
    let pool = pool_on(&gpu, 0, &[]);
    let block = pool.malloc(100).unwrap().unwrap();
    stand_in.queue(0, 3);
    pool.free(block, Some(100), &[3]).unwrap();
    let again = pool.free(block, Some(100), &[3]).unwrap_err();
    assert!(again.to_string().contains("double free"), "{again}");
    let unknown = pool.free(block + 4096 * 1024, Some(100), &[]).unwrap_err();
    assert!(unknown.to_string().contains("never lent"), "{unknown}");
    stand_in.finish(0, 3);
    pool.leak_check().unwrap();
}

#[test]
fn the_policy_is_told_the_recorded_size_when_a_gpu_client_says_another() {
    let (_, gpu) = stand_in(1, 1 << 30);
    let pool = pool_on(&gpu, 0, &[]);
    let block = pool.malloc(1 << 20).unwrap().unwrap();
    pool.free(block, Some(12), &[]).unwrap();
    assert_eq!(pool.stats().unwrap().size_corrections, 1);
    pool.leak_check().unwrap();
}

#[test]
fn a_policy_that_touches_the_bytes_of_device_memory_is_stopped_and_named() {
    let (_, gpu) = stand_in(1, 1 << 30);
    let probe = probe_on(
        &gpu,
        &[("kind", "device"), ("abuse", "read-region")],
        device_grant(),
    );
    let err = probe.malloc(100).unwrap_err();
    assert!(err.to_string().contains("kinds-probe"), "{err}");
    assert_eq!(rule(err), Rule::DeviceBytes { device: 0 });
    assert!(probe.failure().is_some());
}

/// Issue 64: a device policy that gave a region back with the wrong size during its
/// client's free was reported to the client, but `failure` stayed `None` and it went on
/// serving. A violation in any call stops the policy and names it, as for host policies.
#[test]
fn a_device_policy_that_unmaps_wrongly_in_a_free_is_stopped_and_named() {
    for (abuse, rule_name) in [
        ("unmap-wrong-size", "wrong-size-free"),
        ("unmap-twice", "unknown-free"),
        ("unmap-unmapped", "unknown-free"),
    ] {
        let (stand_in, gpu) = stand_in(1, 1 << 30);
        let probe = probe_on(
            &gpu,
            &[("kind", "device"), ("abuse", abuse)],
            device_grant(),
        );
        let block = probe.malloc(4096).unwrap().unwrap();
        // Freed on a stream with work queued: the policy gets the block back once that
        // work is done, in a later call of the client's.
        stand_in.queue(0, 7);
        probe.free(block, Some(4096), &[7]).unwrap();
        stand_in.finish(0, 7);
        let err = probe.synchronize().unwrap_err();
        assert!(err.to_string().contains("kinds-probe"), "{abuse}: {err}");
        assert_eq!(err.kind(), rule_name, "{abuse}: {err}");
        let failure = probe.failure().expect("the policy is stopped");
        assert!(failure.to_string().contains("kinds-probe"), "{failure}");
        assert!(
            probe.malloc(4096).is_err(),
            "{abuse}: a stopped policy serves no more"
        );
    }
}

#[test]
fn host_memory_answered_for_a_gpu_client_is_a_violation() {
    let (_, gpu) = stand_in(1, 1 << 30);
    let probe = probe_on(&gpu, &[("abuse", "answer-upstream")], device_grant());
    let err = probe.malloc(100).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("host memory, where its client needs memory of GPU 0"),
        "{message}"
    );
    assert!(matches!(rule(err), Rule::WrongMemory { .. }));
}

#[test]
fn device_memory_needs_the_device_grant_and_a_device_handler() {
    let (stand_in, gpu) = stand_in(1, 1 << 30);
    let probe = probe_on(&gpu, &[("kind", "device")], KindGrants::default());
    assert_eq!(probe.malloc(100).unwrap(), None);
    let counters = &probe.link_stats().unwrap()[0].counters;
    assert!(
        counters.contains(&("not-granted".to_string(), 1)),
        "{counters:?}"
    );
    // A host handler's client reads and writes its blocks: no device memory at all.
    let probe = &allocbox_artifacts::KINDS_PROBE;
    let host = host_on(&gpu, probe, &[("kind", "device")], device_grant());
    assert_eq!(host.malloc(100).unwrap(), None);
    let counters = &host.link_stats().unwrap()[0].counters;
    assert!(
        counters.contains(&("unavailable".to_string(), 1)),
        "{counters:?}"
    );
    assert_eq!(stand_in.allocated(0), 0);
}

#[test]
fn pinned_regions_are_host_memory_registered_while_they_live() {
    let (stand_in, gpu) = stand_in(1, 1 << 30);
    let probe = &allocbox_artifacts::KINDS_PROBE;
    let h = host_on(&gpu, probe, &[("kind", "pinned")], pinned_grant());
    let block = h.malloc(10_000).unwrap().expect("pinned memory");
    fill(block, 10_000, 0x42);
    assert!(holds(block, 10_000, 0x42));
    assert!(stand_in.registered() >= 10_000);
    h.free(Some(block), 10_000).unwrap();
    assert_eq!(stand_in.registered(), 0);
    // Without the grant: refused, and counted.
    let refused = host_on(&gpu, probe, &[("kind", "pinned")], KindGrants::default());
    assert_eq!(refused.malloc(100).unwrap(), None);
}

/// `map-pinned` and `map-device`, the shorthands policies built before `map-gpu` call,
/// map what `map-gpu` maps, under the same grants.
#[test]
fn the_shorthands_before_map_gpu_map_the_same_kinds_under_the_same_grants() {
    let (stand_in, gpu) = stand_in(1, 1 << 30);
    let probe = &allocbox_artifacts::KINDS_PROBE;
    let h = host_on(&gpu, probe, &[("kind", "map-pinned")], pinned_grant());
    let block = h.malloc(10_000).unwrap().expect("pinned memory");
    assert!(stand_in.registered() >= 10_000);
    h.free(Some(block), 10_000).unwrap();
    assert_eq!(stand_in.registered(), 0);
    let refused = host_on(
        &gpu,
        probe,
        &[("kind", "map-pinned")],
        KindGrants::default(),
    );
    assert_eq!(refused.malloc(100).unwrap(), None);

    let h = probe_on(&gpu, &[("kind", "map-device")], device_grant());
    let block = h.malloc(1000).unwrap().expect("device memory");
    assert_eq!(stand_in.allocated(0), 1024);
    h.free(block, Some(1000), &[]).unwrap();
    assert_eq!(stand_in.allocated(0), 0);
    let refused = probe_on(&gpu, &[("kind", "map-device")], KindGrants::default());
    assert_eq!(refused.malloc(100).unwrap(), None);
}

#[test]
fn the_gpu_pool_serves_numpy_sized_blocks_from_pinned_memory_with_calloc_and_realloc() {
    let (stand_in, gpu) = stand_in(1, 1 << 30);
    let pool = &allocbox_artifacts::GPU_POOL;
    let h = host_on(&gpu, pool, &[("memory", "pinned")], pinned_grant());
    let a = h.calloc(100, 8).unwrap().unwrap();
    assert!(holds(a, 800, 0));
    fill(a, 800, 7);
    let a = h.realloc(Some(a), 100_000).unwrap().unwrap();
    assert!(holds(a, 800, 7));
    assert!(stand_in.registered() >= 64 << 20);
    h.free(Some(a), 100_000).unwrap();
    h.trim().unwrap();
    h.leak_check().unwrap();
    assert_eq!(stand_in.registered(), 0);
}

#[test]
fn a_policy_past_its_share_of_a_gpu_is_over_limit_and_the_program_keeps_the_rest() {
    // Device 3 of this stand-in is no other test's: its share is 3/4 of 64 MiB.
    let (stand_in, gpu) = stand_in(4, 64 << 20);
    let probe = HandlerBuilder::new(Runtime::shared())
        .link_with(
            &load(&allocbox_artifacts::KINDS_PROBE),
            &[("kind", "device")],
        )
        .limits(Limits {
            overhead: 1 << 40,
            ..limits(&gpu, device_grant())
        })
        .build_device(3)
        .unwrap();
    assert_eq!(probe.malloc(60 << 20).unwrap(), None);
    let counters = &probe.link_stats().unwrap()[0].counters;
    assert!(
        counters.contains(&("over-limit".to_string(), 1)),
        "{counters:?}"
    );
    let block = probe.malloc(40 << 20).unwrap().expect("within the share");
    assert_eq!(stand_in.allocated(3), 40 << 20);
    probe.free(block, Some(40 << 20), &[]).unwrap();
}

#[test]
fn a_device_the_gpu_lacks_is_unavailable_in_one_sentence() {
    let (_, gpu) = stand_in(1, 1 << 30);
    let err = gpu.memory(5).unwrap_err();
    assert!(matches!(err, GpuError::Unavailable(_)));
    assert_eq!(err.to_string(), "the stand-in GPU has no device 5 (1 made)");
    let pool = pool_on(&gpu, 5, &[]);
    assert_eq!(pool.malloc(100).unwrap(), None);
}

#[test]
fn without_a_cuda_driver_gpu_memory_is_unavailable_with_the_reason() {
    let cuda = Gpu::cuda();
    match cuda.memory(0) {
        // A machine with a GPU: nothing to check here (python/gpu_check.py is for it).
        Ok(_) => {}
        Err(e) => {
            let text = e.to_string();
            assert!(
                text.contains("CUDA driver") && !text.contains('\n'),
                "{text}"
            );
        }
    }
}

#[test]
fn many_random_gpu_frees_on_several_streams_all_reach_their_policy_and_nothing_leaks() {
    let (stand_in, gpu) = stand_in(1, 1 << 30);
    let pool = pool_on(&gpu, 0, &[("region-size", "4194304")]);
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut live: Vec<(u64, u64)> = Vec::new();
    for _ in 0..3000 {
        match next() % 5 {
            0 | 1 => {
                let size = 1 + next() % (1 << (8 + next() % 15));
                if let Some(block) = pool.malloc(size).unwrap() {
                    assert!(
                        live.iter()
                            .all(|&(b, s)| block + size <= b || b + s <= block)
                    );
                    live.push((block, size));
                }
            }
            2 | 3 if !live.is_empty() => {
                let (block, size) = live.swap_remove((next() % live.len() as u64) as usize);
                let stream = next() % 4;
                stand_in.queue(0, stream);
                pool.free(block, Some(size), &[stream]).unwrap();
            }
            _ => stand_in.finish(0, next() % 4),
        }
    }
    for (block, size) in live {
        pool.free(block, Some(size), &[]).unwrap();
    }
    for stream in 0..4 {
        stand_in.finish(0, stream);
    }
    pool.trim().unwrap();
    pool.leak_check().unwrap();
    assert!(pool.failure().is_none());
}

#[test]
fn check_grant_device_checks_a_device_policy_on_the_stand_in_gpu() {
    let dir = tempdir("gpu-check");
    let regressions = dir.join("regressions");
    let pool = allocbox_artifacts::GPU_POOL.path();
    let args = [
        "check",
        pool,
        "--rounds",
        "1",
        "--cases",
        "24",
        "--grant",
        "device",
        "-c",
        "region-size=4194304",
    ];
    let (code, out) = allocbox_cli(&args, &dir);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("regions-mapped"), "{out}");
    assert!(!out.contains("regions-mapped 0,"), "{out}");
    // A policy that reads the device memory it lends from is named for it.
    let probe = allocbox_artifacts::KINDS_PROBE.path();
    let args = [
        "check",
        probe,
        "--rounds",
        "1",
        "--cases",
        "8",
        "--grant",
        "device",
        "-c",
        "kind=device",
        "-c",
        "abuse=read-region",
        // Its failing seed is kept here, not in the user's cache.
        "--regressions",
        regressions.to_str().unwrap(),
    ];
    let (code, out) = allocbox_cli(&args, &dir);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("device-bytes"), "{out}");
}

#[test]
fn a_device_policy_stopped_while_its_client_holds_blocks_keeps_them_until_they_are_freed() {
    let (stand_in, gpu) = stand_in(1, 1 << 30);
    let config = [
        ("kind", "device"),
        ("abuse", "read-region"),
        ("abuse-after", "1"),
    ];
    let probe = probe_on(&gpu, &config, device_grant());
    let held = probe
        .malloc(1 << 20)
        .unwrap()
        .expect("the honest first malloc");
    let err = probe.malloc(100).unwrap_err();
    assert_eq!(rule(err), Rule::DeviceBytes { device: 0 });
    // Stopped: new requests are refused, the client's block stays in device memory.
    assert!(probe.malloc(100).is_err());
    // The region of the failed request is given back at the stop: only the client's is
    // kept.
    assert_eq!(stand_in.allocated(0), 1 << 20);
    // Its free waits for the stream's work, then the region goes back to the driver.
    stand_in.queue(0, 2);
    probe.free(held, Some(1 << 20), &[2]).unwrap();
    assert_eq!(stand_in.allocated(0), 1 << 20);
    stand_in.finish(0, 2);
    probe.trim().ok();
    assert_eq!(probe.pending_frees(), Default::default());
    assert_eq!(stand_in.allocated(0), 0);
}

/// `numa` as built at e37674a, against 0.2.0's `memory` interface before `map-pinned`
/// and `map-device` were added to it.
const NUMA_BEFORE_GPU_KINDS: &[u8] = include_bytes!("../fixtures/numa-built-before-gpu-kinds.wasm");

#[test]
fn a_policy_built_before_the_gpu_kinds_were_added_still_loads_and_maps_memory() {
    let policy = Runtime::shared().load(NUMA_BEFORE_GPU_KINDS).unwrap();
    let grants = KindGrants::from_iter([KindGrant::Numa]);
    let (_, gpu) = stand_in(1, 1 << 30);
    let h = HandlerBuilder::new(Runtime::shared())
        .link_with(&policy, &[("min-size", "4096")])
        .limits(limits(&gpu, grants))
        .build()
        .unwrap();
    let block = h.malloc(1 << 20).unwrap().expect("memory");
    fill(block, 1 << 20, 9);
    assert!(holds(block, 1 << 20, 9));
    let top = &h.link_stats().unwrap()[0];
    assert!(
        top.counters.contains(&("placed".to_string(), 1)),
        "{:?}",
        top.counters
    );
    h.free(Some(block), 1 << 20).unwrap();
    h.leak_check().unwrap();
}

/// Issue 62: a second device policy to compare with `gpu-pool`, in the shape of
/// PyTorch's caching allocator: a small block splits a 2 MiB segment, freed blocks merge
/// back into one, and when the GPU is full the idle segments go back and the request is
/// asked once more.
#[test]
fn torch_caching_splits_merges_and_gives_back_idle_segments_when_the_gpu_is_full() {
    // Device 2 of this stand-in is no other test's: its share is 3/4 of 64 MiB.
    let (stand_in, gpu) = stand_in(4, 64 << 20);
    // Asked on every call: the host's magazines would keep the small blocks freed here.
    let pool = HandlerBuilder::new(Runtime::shared())
        .link(&load(&allocbox_artifacts::TORCH_CACHING))
        .limits(limits(&gpu, device_grant()))
        .magazines(false)
        .build_device(2)
        .unwrap();
    let a = pool.malloc(1000).unwrap().unwrap();
    let b = pool.malloc(3000).unwrap().unwrap();
    assert_eq!(
        b,
        a + 1024,
        "split from one small segment, sizes rounded to 512"
    );
    assert_eq!(stand_in.allocated(2), 2 << 20);
    pool.free(a, Some(1000), &[]).unwrap();
    pool.free(b, Some(3000), &[]).unwrap();
    let whole = pool.malloc(2 << 20).unwrap().unwrap();
    assert_ne!(whole, a, "2 MiB is the large pool's");
    pool.free(whole, Some(2 << 20), &[]).unwrap();
    // 22 MiB cached (a small and a large segment); 40 MiB asked of a 48 MiB share fits
    // only once they go back.
    let big = pool
        .malloc(40 << 20)
        .unwrap()
        .expect("the cache given back to make room");
    let counters = &pool.link_stats().unwrap()[0].counters;
    assert!(
        counters.contains(&("released-to-retry".to_string(), 2)),
        "{counters:?}"
    );
    assert_eq!(stand_in.allocated(2), 40 << 20);
    pool.free(big, Some(40 << 20), &[]).unwrap();
    pool.trim().unwrap();
    pool.leak_check().unwrap();
    assert_eq!(stand_in.allocated(2), 0);
}

#[test]
fn torch_caching_passes_check_on_the_stand_in_gpu() {
    let dir = tempdir("torch-caching-check");
    let args = [
        "check",
        allocbox_artifacts::TORCH_CACHING.path(),
        "--rounds",
        "1",
        "--cases",
        "48",
        "--grant",
        "device",
        "--regressions",
        "regressions",
    ];
    let (code, out) = allocbox_cli(&args, &dir);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("every rule held") && !out.contains("splits 0,"),
        "{out}"
    );
}

/// Issue 62: a chain that maps no memory (no policy imports `memory`) could only answer
/// host memory to a GPU client: refused as it is built, naming what would do.
#[test]
fn a_device_handler_of_a_chain_that_maps_no_memory_is_refused_as_it_is_built() {
    let (_, gpu) = stand_in(1, 1 << 30);
    let built = HandlerBuilder::new(Runtime::shared())
        .link(&load(&allocbox_artifacts::SYSTEM))
        .limits(limits(&gpu, device_grant()))
        .build_device(0);
    let Err(error) = built else {
        panic!("a chain of `system` became a device handler");
    };
    assert!(
        matches!(error, allocbox::LoadError::NotADevicePolicy { .. }),
        "{error}"
    );
    assert!(
        error
            .to_string()
            .contains("such as `gpu-pool` or `torch-caching`"),
        "{error}"
    );
}
