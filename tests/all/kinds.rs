//! Contract 0.2.0 beside 0.1.0: memory kinds (nothing without a grant, a guard page the
//! host never touches, budgets kept), client diagnostics, a policy's counters and the
//! limits it is told.

use allocbox::mapped::{KindGrant, KindGrants, Maps};
use allocbox::{Error, Grants, HandlerBuilder, Limits, Rule, Runtime};

use super::support::*;

fn probe(kind: &str, abuse: &str, grants: KindGrants, overhead: u64) -> allocbox::Handler {
    probe_with(&[("kind", kind), ("abuse", abuse)], grants, overhead)
}

fn probe_with(config: &[(&str, &str)], grants: KindGrants, overhead: u64) -> allocbox::Handler {
    let limits = Limits {
        overhead,
        grants: Grants {
            memory: grants,
            ..Grants::default()
        },
        ..Limits::default()
    };
    HandlerBuilder::new(Runtime::shared())
        .link_with(&load(&allocbox_artifacts::KINDS_PROBE), config)
        .limits(limits)
        .build()
        .unwrap()
}

/// The probe's counter `name` after its calls so far.
fn counter(h: &allocbox::Handler, name: &str) -> u64 {
    let top = h.link_stats().unwrap().remove(0);
    top.counters
        .iter()
        .find(|(n, _)| n == name)
        .map_or_else(|| panic!("no counter {name}: {:?}", top.counters), |c| c.1)
}

const KINDS: [(&str, KindGrant); 7] = [
    ("transparent-huge", KindGrant::HugePages),
    ("hugetlb", KindGrant::HugePages),
    ("numa-bind", KindGrant::Numa),
    ("numa-interleave", KindGrant::Numa),
    ("numa-preferred", KindGrant::Numa),
    ("locked", KindGrant::Locked),
    ("guard-after", KindGrant::Guarded),
];

#[test]
fn no_kind_of_memory_is_mapped_without_its_grant_and_each_grant_allows_only_its_own() {
    for (kind, grant) in KINDS {
        let h = probe(kind, "none", KindGrants::default(), 256 << 20);
        assert_eq!(h.malloc(100).unwrap(), None, "{kind} without a grant");
        assert_eq!(counter(&h, "not-granted"), 1, "{kind}");
        // Every other grant but the one it needs: still refused.
        let mut others = KindGrants::default();
        KindGrant::ALL
            .into_iter()
            .filter(|&g| g != grant)
            .for_each(|g| others.grant(g));
        let h = probe(kind, "none", others, 256 << 20);
        assert_eq!(
            h.malloc(100).unwrap(),
            None,
            "{kind} with every other grant"
        );
        // Its own grant: mapped, or refused by the machine (no reserved huge pages, no
        // such node), never for want of a grant.
        let mut own = KindGrants::default();
        own.grant(grant);
        let h = probe(kind, "none", own, 256 << 20);
        match h.malloc(100).unwrap() {
            Some(block) => {
                fill(block, 100, 0x5a);
                assert!(holds(block, 100, 0x5a));
                assert_eq!(h.link_stats().unwrap()[0].mapped_regions, 1);
                h.free(Some(block), 100).unwrap();
                assert_eq!(counter(&h, "mapped"), 1);
            }
            None => assert_eq!(counter(&h, "not-granted"), 0, "{kind} with its grant"),
        }
        h.leak_check().unwrap();
    }
}

#[test]
fn normal_memory_needs_no_grant_and_a_mapped_region_left_mapped_is_a_leak() {
    let h = probe("normal", "none", KindGrants::default(), 256 << 20);
    let block = h.malloc(5000).unwrap().expect("mapped");
    assert_eq!(h.held_from_host().unwrap(), (1, 8192));
    let err = h.leak_check().unwrap_err();
    // A region is named as one, not as an upstream block.
    assert!(
        err.to_string()
            .contains("leaks: 1 mapped region (8192 bytes) still held"),
        "{err}"
    );
    h.free(Some(block), 5000).unwrap();
    h.leak_check().unwrap();
}

fn guarded() -> KindGrants {
    let mut grants = KindGrants::default();
    grants.grant(KindGrant::Guarded);
    grants
}

#[test]
fn a_block_running_into_its_guard_page_is_refused_as_outside_owned_memory() {
    let h = probe("guard-after", "answer-guard", guarded(), 256 << 20);
    match h.malloc(100) {
        Err(Error::Violation(v)) => assert_eq!(v.rule, Rule::OutsideOwned, "{v}"),
        other => panic!("{other:?}"),
    }
    h.leak_check().unwrap();
}

#[test]
fn a_policy_cannot_make_the_host_read_a_guard_page_after_or_before_its_region() {
    for (kind, abuse) in [
        ("guard-after", "read-guard"),
        ("guard-before", "read-before"),
    ] {
        let h = probe(kind, abuse, guarded(), 256 << 20);
        match h.malloc(100) {
            Err(Error::Violation(v)) => assert!(
                matches!(v.rule, Rule::BytesOutOfBounds { lent: None }),
                "{kind}: {v}"
            ),
            other => panic!("{kind}: {other:?}"),
        }
    }
}

#[test]
fn locked_memory_past_the_overhead_budget_is_over_limit_not_a_crash() {
    let mut grants = KindGrants::default();
    grants.grant(KindGrant::Locked);
    // A 64 MiB locked region for a 100-byte request, with 1 MiB of overhead allowed:
    // refused before anything is mapped or locked. (Past RLIMIT_MEMLOCK, `mlock`'s own
    // refusal is the same answer; a root process, as in CI, has no such limit.)
    let region = (64u64 << 20).to_string();
    let config = [("kind", "locked"), ("region", region.as_str())];
    let h = probe_with(&config, grants, 1 << 20);
    assert_eq!(h.malloc(100).unwrap(), None);
    assert_eq!(counter(&h, "over-limit"), 1);
    assert_eq!(counter(&h, "mapped"), 0);
    assert!(h.failure().is_none());
    // Within the budget, the same kind is mapped.
    let h = probe_with(&[("kind", "locked")], grants, 1 << 20);
    if let Some(block) = h.malloc(100).unwrap() {
        h.free(Some(block), 100).unwrap();
    }
    assert_eq!(counter(&h, "over-limit"), 0);
}

#[test]
fn a_canary_overrun_is_reported_as_client_misuse_and_the_policy_goes_on() {
    let h = handler(&allocbox_artifacts::GUARD, &[("sample", "1000000")]);
    // The first allocation is the sampled one; without the grant it gets a canary too.
    let first = h.malloc(16).unwrap().unwrap();
    let block = h.malloc(1000).unwrap().unwrap();
    // SAFETY: the byte just past the block lies in the upstream block the policy holds
    // for it (its canary): host memory, written here as a buggy client would.
    unsafe { block.as_ptr().add(1000).write(0) };
    h.free(Some(block), 1000).unwrap();
    let [misuse] = &h.take_client_misuse().unwrap()[..] else {
        panic!("one report expected");
    };
    assert_eq!(
        (misuse.block, misuse.size, misuse.offset),
        (block.as_ptr() as u64, 1000, 1000)
    );
    assert_eq!(&*misuse.policy, "guard");
    assert!(
        misuse.message.contains("past the end"),
        "{}",
        misuse.message
    );
    assert!(h.take_client_misuse().unwrap().is_empty(), "taken once");
    let stats = &h.link_stats().unwrap()[0];
    assert_eq!(stats.client_misuse, 1);
    assert_eq!(stats.recent_misuse.len(), 1);
    assert!(stats.counters.contains(&("overruns".to_string(), 1)));
    // Not a violation of the policy: it goes on serving.
    assert!(h.failure().is_none());
    h.free(Some(first), 16).unwrap();
    h.leak_check().unwrap();
}

#[test]
fn a_guarded_block_ends_at_its_guard_page_and_is_registered_for_fault_handlers() {
    let h = HandlerBuilder::new(Runtime::shared())
        .link_with(&load(&allocbox_artifacts::GUARD), &[("sample", "1")])
        .limits(Limits {
            grants: Grants {
                memory: guarded(),
                ..Grants::default()
            },
            ..Limits::default()
        })
        .build()
        .unwrap();
    assert!(h.diagnoses());
    let block = h.malloc(1000).unwrap().unwrap().as_ptr() as u64;
    let (guard, page) = allocbox::mapped::guard_page_at(block + 1000).expect("a guard page");
    assert_eq!(guard, block + 1000);
    assert_eq!(&*page.policy, "guard");
    assert!(allocbox::mapped::guard_page_at(block + 999).is_none());
    h.free(std::ptr::NonNull::new(block as *mut u8), 1000)
        .unwrap();
    assert!(allocbox::mapped::guard_page_at(block + 1000).is_none());
    h.leak_check().unwrap();
}

#[test]
fn policies_of_both_contract_versions_load_and_only_0_2_0_ones_report_counters() {
    let rust = load(&allocbox_artifacts::SYSTEM);
    assert!(
        rust.exports()
            .iter()
            .any(|e| e == "allocbox:policy/lifecycle@0.2.0")
    );
    let wat = Runtime::shared()
        .load(allocbox::DEFAULT_POLICY_WAT.as_bytes())
        .unwrap();
    assert!(
        wat.exports()
            .iter()
            .any(|e| e == "allocbox:policy/lifecycle@0.1.0")
    );
    for policy in [&rust, &wat] {
        let h = HandlerBuilder::new(Runtime::shared())
            .link_with(policy, &[])
            .build()
            .unwrap();
        let p = h.malloc(10).unwrap().unwrap();
        h.free(Some(p), 10).unwrap();
        assert!(h.link_stats().unwrap()[0].counters.is_empty());
        assert!(!h.diagnoses(), "only a policy that says so diagnoses");
    }
    assert!(handler(&allocbox_artifacts::GUARD, &[]).diagnoses());
}

#[test]
fn check_prints_a_policy_s_counters_and_grants_kinds_by_name() {
    let dir = tempdir("kinds-check");
    let guard = allocbox_artifacts::GUARD.path();
    let (code, out) = allocbox_cli(&["check", guard, "--rounds", "1", "--cases", "16"], &dir);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("its counters, summed over the cases (a `peak-` one: its largest): guarded 0, guard-refused "),
        "{out}"
    );
    let args = [
        "check", guard, "--rounds", "1", "--cases", "16", "--grant", "guarded", "-c", "sample=1",
    ];
    let (code, out) = allocbox_cli(&args, &dir);
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("guarded 0,"), "{out}");
    let (code, out) = allocbox_cli(&["check", guard, "--grant", "numa,gpu"], &dir);
    assert_eq!(code, 2, "{out}");
    let refused = format!(
        "`gpu` is not a kind of memory allocbox can grant: use {}",
        allocbox::mapped::kind_list()
    );
    assert!(out.contains(&refused), "{out}");
}

#[test]
fn an_unmap_with_another_size_is_a_named_wrong_size_free_and_the_region_comes_back() {
    let h = probe(
        "normal",
        "unmap-wrong-size",
        KindGrants::default(),
        256 << 20,
    );
    let block = h.malloc(100).unwrap().expect("mapped");
    let err = h.free(Some(block), 100).unwrap_err();
    match err {
        Error::Violation(v) => {
            assert_eq!(v.rule, Rule::WrongSizeFree { recorded: 100 }, "{v}");
            assert_eq!(v.call, allocbox::Call::MemoryUnmap);
            assert_eq!(&*v.policy, "kinds-probe");
        }
        other => panic!("{other}"),
    }
    // The stopped policy's region goes back once its client holds nothing.
    assert_eq!(h.held_from_host().unwrap(), (0, 0));
}

/// Found probing 0.2.0: granted `guarded`, a policy mapping one-page guarded regions
/// until refused took nearly every kernel mapping the process may have
/// (`vm.max_map_count`); the next thread to enter wasm could not protect its signal
/// stack, and the process aborted. The policies' regions now hold at most their share
/// of the mappings, refused past it: twenty times over, a second thread entering wasm
/// after the exhaustion is served, and the policy saw a typed refusal.
#[test]
fn a_policy_exhausting_mappings_is_refused_at_its_share_and_new_threads_still_enter_wasm() {
    let dir = tempdir("mapping-share");
    let trace = dir.join("two-threads.trace");
    std::fs::write(&trace, "m 1 64 1\nm 2 64 2\nm 3 64 3\nf 2 64 2\nf 3 64 3\n").unwrap();
    let probe = allocbox_artifacts::KINDS_PROBE.path();
    for run in 0..20 {
        let (code, out) = allocbox_cli(
            &[
                "replay-trace",
                trace.to_str().unwrap(),
                "-p",
                probe,
                "-c",
                "kind=guard-after",
                "-c",
                "abuse=exhaust-mappings",
                "--grant",
                "guarded",
            ],
            &dir,
        );
        // Every region it took is given back at the end: exit 0, or 1 for what the
        // exhausting first request left; never an abort.
        assert!(code == 0 || code == 1, "run {run}: {code}\n{out}");
        assert!(
            out.contains("over-limit ") && !out.contains("over-limit 0"),
            "run {run}: {out}"
        );
        let hoarded = out
            .split("hoarded ")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse::<u64>().ok())
            .expect("the hoard is counted");
        // Each guarded region is two mappings.
        assert!(
            hoarded * 2 <= allocbox::shares::mapping_share(),
            "run {run}: {hoarded}"
        );
        assert!(
            hoarded * 2 + 2 > allocbox::shares::mapping_share(),
            "{hoarded}"
        );
    }
}

/// Issue 65: the lists of kinds a person reads, outside what the code generates from
/// `KindGrant::ALL` (errors, `--grant`'s help), went stale when a kind was added. Each
/// list named here must name every kind.
#[test]
fn every_written_list_of_memory_kinds_names_every_kind() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // The file, and words that start its list (the list is the paragraph from there).
    let lists = [
        ("SECURITY.md", "ask the host to map memory of a kind"),
        (
            "guest-handlers/sdk/src/memory.rs",
            "Each kind must be granted",
        ),
        (
            "python/allocbox/__init__.py",
            "lists the kinds of memory the policy may ask",
        ),
        ("wit/0.2.0/policy.wit", "Each kind must be granted"),
    ];
    for (file, start) in lists {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let text = text
            .replace("///", " ")
            .replace("//!", " ")
            .replace('\n', " ");
        let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let at = text
            .find(start)
            .unwrap_or_else(|| panic!("{file} no longer says `{start}`"));
        let list = &text[at..];
        let list = &list[..list.find(". ").unwrap_or(list.len())];
        for kind in KindGrant::ALL {
            assert!(
                list.contains(kind.name()),
                "{file}'s list leaves out `{kind}`: {list}"
            );
        }
    }
}

/// A GPU kind is a row of the host's table and a case of the WIT's `gpu-kind`, by the
/// same name: a row with no case could never be asked for, a case with no row is refused
/// by the compiler (the host's match on the WIT's enum).
#[test]
fn the_wit_names_every_gpu_kind_of_the_host_s_table() {
    let wit = include_str!("../../wit/0.2.0/policy.wit");
    let mut resolve = wit_parser::Resolve::default();
    resolve.push_str("policy.wit", wit).unwrap();
    let (_, gpu_kind) = resolve
        .types
        .iter()
        .find(|(_, t)| t.name.as_deref() == Some("gpu-kind"))
        .expect("the WIT has a `gpu-kind`");
    let wit_parser::TypeDefKind::Enum(cases) = &gpu_kind.kind else {
        panic!("`gpu-kind` is an enum");
    };
    let in_wit: Vec<&str> = cases.cases.iter().map(|c| c.name.as_str()).collect();
    let in_table: Vec<&str> = KindGrant::ALL
        .into_iter()
        .filter(|kind| matches!(kind.row().maps, Maps::Gpu(_)))
        .map(KindGrant::name)
        .collect();
    assert_eq!(in_wit, in_table);
}
