//! The contract checker: it passes every good policy, catches every broken one with the
//! right rule, shrinks to a short script, and replays it exactly.

use std::time::Duration;

use allocbox::mapped::KindGrant;
use allocbox::{Limits, Runtime};
use allocbox_check::{self as check, CallPath, CheckOptions, Script};

use super::support::*;

/// Small enough for CI, large enough that each fault shows up; bounded by counts, not
/// time: shrinking stops after its step count alone, and the call limit (there to end
/// the looping fault) is far above what any good policy's call takes on a busy machine.
fn options() -> CheckOptions {
    CheckOptions {
        cases: 48,
        shrink_time: None,
        limits: Limits {
            call_time: Duration::from_secs(2),
            memory: 32 << 20,
            ..Limits::default()
        },
        ..CheckOptions::default()
    }
}

macro_rules! passes_check {
    ($name:ident, $guest:path) => {
        #[test]
        fn $name() {
            let policy = load(&$guest);
            let report = check::check(Runtime::shared(), &policy, &[], &options()).unwrap();
            if let Some((finding, script)) = &report.failure {
                panic!("{finding}\n{script}");
            }
            assert!(report.ops > 1000, "ran {} operations", report.ops);
        }
    };
}

mod every_good_policy_passes_check {
    use super::*;
    allocbox_artifacts::foreach_good_policy!(passes_check);
}

/// Issue 60: a policy that keeps its free list inside the blocks it is given back passes
/// on the SDK's default `realloc`, which frees the old block once the call has
/// returned; the same policy freeing it inside its own `realloc` is stopped by a rule
/// that says why the block could not be written and what to do instead.
#[test]
fn an_intrusive_free_list_passes_on_the_sdk_realloc_and_is_told_why_when_its_own_frees_early() {
    let policy = load(&allocbox_artifacts::FREELIST);
    let report = check::check(Runtime::shared(), &policy, &[], &options()).unwrap();
    if let Some((finding, script)) = &report.failure {
        panic!("{finding}\n{script}");
    }
    let early = [("free-in-realloc", "true")];
    let report = check::check(Runtime::shared(), &policy, &early, &options()).unwrap();
    let (finding, script) = report
        .failure
        .expect("a write into the block being resized");
    assert_eq!(finding.rule, "resized-block-written", "{finding}");
    assert!(
        finding.message.contains("free_after_this_call"),
        "{finding}"
    );
    assert!(script.to_string().contains("realloc"), "{script}");
}

#[test]
fn size_classes_with_its_large_block_cache_passes_check() {
    let policy = load(&allocbox_artifacts::SIZE_CLASSES);
    let config = [("large-cache", "4"), ("bucket-depth", "3")];
    let report = check::check(Runtime::shared(), &policy, &config, &options()).unwrap();
    assert!(report.passed(), "{:?}", report.failure);
}

/// Each `broken` fault, the rule the checker must name, and the shortest script.
const CORPUS: &[(&str, &str)] = &[
    ("outside", "outside-owned"),
    ("overlap", "overlap"),
    ("misaligned", "misaligned"),
    ("off-by-one", "outside-owned"),
    ("wrong-size-free", "wrong-size-free"),
    ("double-free", "double-free"),
    ("foreign-free", "unknown-free"),
    ("calloc-dirty", "calloc-not-zeroed"),
    ("realloc-loses", "realloc-lost-bytes"),
    ("realloc-outside", "outside-owned"),
    ("leak", "leak"),
    ("scribble", "bytes-out-of-bounds"),
    ("free-other", "gave-back-lent-memory"),
    ("trap-malloc", "trap"),
    ("trap-calloc", "trap"),
    ("trap-realloc", "trap"),
    ("trap-free", "trap"),
    ("trap-trim", "trap"),
    ("trap-malloc-many", "trap"),
    ("trap-free-many", "trap"),
    ("loop-malloc", "timeout"),
    ("grow-memory", "memory-limit"),
    // Shows only with a trim while a freed block sits on the free list: that trim gives
    // it back, and the next trim (or malloc) uses it again. The checker's own trim
    // after free-all comes too late to see it.
    ("stale-after-trim", "double-free"),
    ("class-rounding", "outside-owned"),
    // Issue 60: sizes within 15 bytes of 2^32, which the checker never drew.
    ("u32-rounding", "outside-owned"),
    ("page-off-by-one", "outside-owned"),
    ("grow-into-slack", "outside-owned"),
    ("shrink-wrong-size", "wrong-size-free"),
    ("recycled-calloc-dirty", "calloc-not-zeroed"),
    ("duplicate-slot", "double-free"),
    // The checker's upstream is no kinder than the contract: blocks aligned to 16 and to
    // more only by chance, fresh memory that is not zero, and requests refused on
    // purpose, single ones and in the middle of a batch.
    ("trusts-alignment", "misaligned"),
    ("assumes-zero", "calloc-not-zeroed"),
    ("oom-corrupts-list", "double-free"),
    ("oom-leaks-batch", "leak"),
];

/// `script`, printed and parsed back, is the same script, and replaying it breaks `rule`.
fn assert_replays_to(
    policy: &allocbox::Policy,
    config: &[(&str, &str)],
    script: &Script,
    limits: &Limits,
    rule: &str,
) {
    let replayed = Script::parse(&script.to_string()).unwrap();
    assert_eq!(&replayed, script);
    let again = check::replay(Runtime::shared(), policy, config, &replayed, limits)
        .unwrap()
        .unwrap_or_else(|| panic!("{config:?}: the replay of\n{script}\npassed"));
    assert_eq!(again.rule, rule, "{config:?} replay: {again}");
}

#[test]
fn check_catches_every_broken_policy_names_the_rule_and_shrinks_it() {
    let policy = load(&allocbox_artifacts::BROKEN);
    for (fault, rule) in CORPUS {
        let config = [("fault", *fault)];
        let mut options = options();
        if *rule == "timeout" {
            // Every case that reaches the loop waits out the limit, while shrinking too.
            options.limits.call_time = Duration::from_millis(50);
        }
        let report = check::check(Runtime::shared(), &policy, &config, &options).unwrap();
        let (finding, script) = report
            .failure
            .unwrap_or_else(|| panic!("`{fault}` passed the check"));
        assert_eq!(finding.rule, *rule, "`{fault}`: {finding}\n{script}");
        assert!(
            script.len() <= 5,
            "`{fault}` shrank only to {} operations:\n{script}",
            script.len()
        );
        // The printed script replays to the same broken rule.
        assert_replays_to(&policy, &config, &script, &options.limits, rule);
    }
}

/// Bugs on one path of a policy that batches: its own `calloc` of small blocks, which the
/// magazines serve otherwise (a recycled block not zeroed; a header it forgets), and a
/// `malloc-many` that drops what it took when its upstream refuses part way, which only
/// a magazine's refill reaches. The name, the path the script says, and the fewest
/// operations that show it.
const ONE_PATH: &[(&str, &str, CallPath, usize)] = &[
    (
        "small-calloc-recycled",
        "calloc-not-zeroed",
        CallPath::PerCall,
        3,
    ),
    (
        "calloc-forgets-header",
        "wrong-size-free",
        CallPath::PerCall,
        1,
    ),
    ("batch-drops-on-oom", "leak", CallPath::Magazines, 3),
];

/// Issue 60: a policy whose `malloc-many` begins a batch from its own lists, runs out
/// upstream part way and drops the blocks it took from them escaped `check` at default
/// settings: production's magazines give blocks back only past 64 frees of one size, so
/// its lists were never part full when a batch came. Shallow magazines (8 or 16
/// blocks) and runs of two near sizes filled and drained in turn find it within what a
/// default check runs (3 s: 16 to 20 rounds of 64 cases here; 9 seeds in 10 found it
/// with `allocbox check --seed N`), and the script says the magazines' depth, so it
/// replays.
#[test]
fn a_batch_that_drops_what_its_lists_began_it_with_on_an_oom_part_way_is_found() {
    let policy = load(&allocbox_artifacts::BROKEN);
    let config = [("fault", "batch-drops-listed-on-oom")];
    // Seed 3 is the one in ten whose default budget misses it.
    for seed in [1, 2, 4] {
        let options = CheckOptions {
            seed: Some(seed),
            cases: 64,
            rounds: Some(16),
            ..options()
        };
        let report = check::check(Runtime::shared(), &policy, &config, &options).unwrap();
        let (finding, script) = report
            .failure
            .unwrap_or_else(|| panic!("passed the check with seed {seed}"));
        assert_eq!(finding.rule, "leak", "{finding}\n{script}");
        assert!(finding.message.contains("refused on purpose"), "{finding}");
        assert_eq!(script.path, CallPath::Magazines, "{script}");
        assert!(script.magazine_depth.is_some(), "{script}");
        assert!(script.to_string().contains("\nmagazines "), "{script}");
        // Fill past a shallow magazine, drain it, run out, fill again: about 20.
        assert!(
            script.len() <= 40,
            "shrank only to {}:\n{script}",
            script.len()
        );
        assert_replays_to(&policy, &config, &script, &options.limits, "leak");
    }
}

#[test]
fn bugs_on_one_path_of_a_batching_policy_are_found_on_that_path_and_replay_on_it() {
    let policy = load(&allocbox_artifacts::BROKEN);
    for &(fault, rule, path, fewest) in ONE_PATH {
        let config = [("fault", fault)];
        for seed in 1..=3 {
            // A default `check` runs hundreds of cases in its 3 s; a bug on one path is
            // found within that many, not always within the corpus's 48.
            let options = CheckOptions {
                seed: Some(seed),
                cases: 400,
                ..options()
            };
            let report = check::check(Runtime::shared(), &policy, &config, &options).unwrap();
            let (finding, script) = report
                .failure
                .unwrap_or_else(|| panic!("`{fault}` passed the check with seed {seed}"));
            assert_eq!(finding.rule, rule, "`{fault}`: {finding}\n{script}");
            assert_eq!(script.path, path, "`{fault}`:\n{script}");
            assert!(
                script.len() <= fewest + 2,
                "`{fault}` shrank only to {} operations:\n{script}",
                script.len()
            );
            assert_replays_to(&policy, &config, &script, &options.limits, rule);
        }
    }
}

/// A bug that depends on how many batches the magazines gave back (every 4th
/// `free-many` keeps a block): the thread cache's refills and flushes are fixed by the
/// script, so its printed script fails the same way every time it is replayed.
#[test]
fn a_flush_counting_bug_s_script_fails_on_every_replay() {
    let policy = load(&allocbox_artifacts::BROKEN);
    let config = [("fault", "free-many-leaks")];
    let report = check::check(Runtime::shared(), &policy, &config, &options()).unwrap();
    let (finding, script) = report.failure.expect("free-many-leaks is found");
    assert_eq!(finding.rule, "leak", "{finding}\n{script}");
    assert!(script.len() <= 8, "{} operations:\n{script}", script.len());
    for _ in 0..20 {
        assert_replays_to(&policy, &config, &script, &options().limits, "leak");
    }
}

#[test]
fn a_bug_that_needs_hundreds_of_operations_in_one_instance_is_found_by_a_long_lived_round() {
    let policy = load(&allocbox_artifacts::BROKEN);
    let config = [("fault", "misaligned-after-300")];
    let short = check::check(Runtime::shared(), &policy, &config, &options()).unwrap();
    assert!(
        short.passed(),
        "48 sequences of 128 operations cannot reach it"
    );
    // The fourth round is the long-lived one.
    let rounds = CheckOptions {
        rounds: Some(4),
        ..options()
    };
    let report = check::check(Runtime::shared(), &policy, &config, &rounds).unwrap();
    let (finding, script) = report.failure.expect("a long-lived round reaches it");
    assert_eq!(finding.rule, "misaligned", "{finding}");
    let mallocs = script.threads[0]
        .iter()
        .filter(|op| !matches!(op, check::Op::Free { .. } | check::Op::Trim))
        .count();
    assert!(mallocs >= 301, "{mallocs} allocations cannot show it");
    // Chunk deletion brings it close to the 301 operations that show it; shrinking is
    // bounded by its counted trials and operations, not time, so the result is the same
    // on a busy machine. Narrowing every number of 300 operations takes more trials than
    // the budget holds, and the report says so (it said nothing before issue 73: only
    // a time bound was reported).
    assert!(report.shrink_stopped_early);
    assert!(
        script.len() <= 331,
        "shrank only to {} operations",
        script.len(),
    );
    let again = check::replay(Runtime::shared(), &policy, &config, &script, &rounds.limits)
        .unwrap()
        .expect("the script replays to the same failure");
    assert_eq!(again.rule, "misaligned");
}

#[test]
fn a_check_of_several_rounds_runs_each_every_fourth_long_lived() {
    let policy = load(&allocbox_artifacts::SYSTEM);
    let rounds = CheckOptions {
        rounds: Some(5),
        cases: 6,
        ..options()
    };
    let report = check::check(Runtime::shared(), &policy, &[], &rounds).unwrap();
    assert!(report.passed(), "{:?}", report.failure);
    assert_eq!(report.cases, 4 * 6 + check::LONG_CASES);
}

#[test]
fn a_timed_check_runs_rounds_until_its_time_is_spent() {
    let policy = load(&allocbox_artifacts::SYSTEM);
    let timed = CheckOptions {
        time: Some(Duration::from_millis(200)),
        cases: 6,
        ..options()
    };
    let report = check::check(Runtime::shared(), &policy, &[], &timed).unwrap();
    assert!(report.passed(), "{:?}", report.failure);
    assert!(
        report.elapsed >= Duration::from_millis(200),
        "stopped before its time"
    );
}

#[test]
fn an_operation_on_a_block_that_is_not_live_is_skipped_so_any_deletion_leaves_a_valid_script() {
    let policy = load(&allocbox_artifacts::SYSTEM);
    // b1 was never made (its malloc was shrunk away), b0 is freed twice: the operations
    // on blocks that are not live are skipped, not sent to the handler.
    // What shrinking makes by deleting operations; a script a user writes with such
    // lines is refused when it is read (see `scripts_refuse_blocks_not_made_or_freed`).
    use check::Op::{Free, Malloc, Realloc};
    let script = Script {
        threads: vec![vec![
            Malloc { block: 0, size: 64 },
            Realloc { block: 1, size: 10 },
            Free { block: 0 },
            Free { block: 0 },
            Free { block: 1 },
        ]],
        ..Script::default()
    };
    let finding =
        check::replay(Runtime::shared(), &policy, &[], &script, &options().limits).unwrap();
    assert!(finding.is_none(), "{finding:?}");
}

#[test]
fn several_client_threads_share_one_handler_under_check() {
    let policy = load(&allocbox_artifacts::SIZE_CLASSES);
    let opts = CheckOptions {
        threads: 4,
        cases: 16,
        ..options()
    };
    let report = check::check(Runtime::shared(), &policy, &[], &opts).unwrap();
    assert!(report.passed(), "{:?}", report.failure);
}

#[test]
fn a_shardable_policy_is_checked_with_an_instance_per_thread_and_frees_from_other_threads() {
    let policy = load(&allocbox_artifacts::SIZE_CLASSES);
    let opts = CheckOptions {
        threads: 3,
        cases: 24,
        ..options()
    };
    let report = check::check(Runtime::shared(), &policy, &[], &opts).unwrap();
    assert!(report.passed(), "{:?}", report.failure);
    assert!(
        report.cross_thread_frees > 0,
        "a third of the cases pass blocks on: {report:?}"
    );
    // A policy that does not say so is never run per thread.
    let quota = load(&allocbox_artifacts::QUOTA);
    let report = check::check(Runtime::shared(), &quota, &[], &opts).unwrap();
    assert_eq!(report.cross_thread_frees, 0);
}

/// Issue 64: `check size-classes --threads 128` called the shipped policy broken for
/// the checker's own split of its guest memory. The threads share as many instances as
/// the budget starts, and the report says so.
#[test]
fn many_client_threads_share_the_instances_the_budget_allows_and_the_policy_holds() {
    let policy = load(&allocbox_artifacts::SIZE_CLASSES);
    let opts = CheckOptions {
        threads: 128,
        cases: 6,
        max_ops: 512,
        ..options()
    };
    let report = check::check(Runtime::shared(), &policy, &[], &opts).unwrap();
    assert!(report.passed(), "{:?}", report.failure);
    let shared = report
        .instances_shared
        .expect("fewer instances than threads");
    assert!((1..128).contains(&shared), "{shared}");
    let opts = CheckOptions {
        threads: 3,
        cases: 24,
        ..options()
    };
    let report = check::check(Runtime::shared(), &policy, &[], &opts).unwrap();
    assert_eq!(
        report.instances_shared, None,
        "three instances fit the budget"
    );
}

#[test]
fn a_per_thread_script_passes_blocks_to_the_next_thread_and_replays() {
    let text = "per-thread\nt0 b0 = malloc 24\nt1 b0 = malloc 4000\nt0 pass b0\nt1 pass b0\nt1 b1 = calloc 3 8\nt0 b1 = malloc 16\nt0 pass b1\n";
    let script = Script::parse(text).unwrap();
    assert_eq!(script.path, CallPath::PerThread);
    assert_eq!(script.threads[0][1], check::Op::Pass { block: 0 });
    assert_eq!(Script::parse(&script.to_string()).unwrap(), script);
    let err = Script::parse("b0 = malloc 8\npass b0\nfree b0\n").unwrap_err();
    assert!(
        err.contains("line 3") && err.contains("freed on line 2"),
        "{err}"
    );
    let policy = load(&allocbox_artifacts::SIZE_CLASSES);
    let finding =
        check::replay(Runtime::shared(), &policy, &[], &script, &options().limits).unwrap();
    assert!(finding.is_none(), "{finding:?}");
}

#[test]
fn a_failure_found_with_several_threads_replays_on_one_handler_in_the_recorded_order() {
    let policy = load(&allocbox_artifacts::BROKEN);
    let config = [("fault", "double-free")];
    let opts = CheckOptions {
        threads: 3,
        ..options()
    };
    let report = check::check(Runtime::shared(), &policy, &config, &opts).unwrap();
    let (finding, script) = report.failure.expect("double-free is found");
    let text = script.to_string();
    if script.threads.len() > 1 {
        // Every operation carries its thread; the upstream's seed heads the script.
        let mut lines = text.lines().skip_while(|l| !l.starts_with('t'));
        assert!(lines.all(|l| l.starts_with('t')), "{text}");
    }
    let replayed = Script::parse(&text).unwrap();
    assert_eq!(replayed, script);
    let again = check::replay(Runtime::shared(), &policy, &config, &replayed, &opts.limits)
        .unwrap()
        .expect("the replay fails the same way");
    assert_eq!(again.rule, finding.rule);
}

#[test]
fn interleaved_and_sectioned_thread_forms_do_not_mix() {
    let err = Script::parse("t0 b0 = malloc 8\nfree b0\n").unwrap_err();
    assert!(err.contains("line 2") && err.contains("mix"), "{err}");
    let err = Script::parse("b0 = malloc 8\nt1 free b0\n").unwrap_err();
    assert!(err.contains("line 2") && err.contains("mix"), "{err}");
    let err = Script::parse("t9999 trim\n").unwrap_err();
    assert!(err.contains("at most"), "{err}");
    let two = Script::parse("t1 b0 = malloc 8\nt0 trim\nt1 free b0\n").unwrap();
    assert_eq!(two.order, [1, 0, 1]);
    assert_eq!(two.threads[1].len(), 2);
}

#[test]
fn scripts_parse_and_print_one_operation_a_line() {
    let text = "# a comment\nb0 = malloc 16\nb1 = calloc 4 8\nrealloc b0 100\nb2 = realloc - 7\nfree b1\ntrim\nthread\nb0 = malloc 1\n";
    let script = Script::parse(text).unwrap();
    assert_eq!(script.threads.len(), 2);
    assert_eq!(script.len(), 7);
    assert_eq!(script.threads[0][5], check::Op::Trim);
    assert_eq!(Script::parse(&script.to_string()).unwrap(), script);
    let err = Script::parse("b0 = malloc sixteen").unwrap_err();
    assert!(err.contains("line 1"), "{err}");
    let err = Script::parse("b0 = malloc 8\nfree #0").unwrap_err();
    assert!(err.contains("line 2") && err.contains("bN"), "{err}");
}

#[test]
fn the_cli_exits_0_when_rules_hold_1_when_broken_2_on_bad_input() {
    let dir = std::env::temp_dir().join(format!("allocbox-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let (code, out) = allocbox_cli(&["check", "--rounds", "1", "--cases", "8"], &dir);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("passthrough") && out.contains("every rule held"),
        "{out}"
    );

    // A time budget stops the cases where it runs out: how many fit depends on the
    // machine's load (a loaded machine ran 55 of a round's 64), so only the report is
    // pinned here; round after round is pinned by the library's `rounds` tests, by count.
    let (code, out) = allocbox_cli(&["check", "--time", "0.3", "--json"], &dir);
    assert_eq!(code, 0, "{out}");
    let report: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert!(report["cases"].is_u64(), "{out}");

    let broken = allocbox_artifacts::BROKEN.path();
    let regressions = dir.join("regressions");
    let (code, out) = allocbox_cli(
        &[
            "check",
            broken,
            "-c",
            "fault=double-free",
            "--json",
            "--regressions",
            regressions.to_str().unwrap(),
        ],
        &dir,
    );
    assert_eq!(code, 1, "{out}");
    let report: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(report["rule"], "double-free");
    assert_eq!(report["passed"], false);

    // The saved script replays to the same rule.
    // Kept under the policy's name and a digest of its binary and configuration.
    let saved = std::path::PathBuf::from(report["script_file"].as_str().unwrap());
    let file = saved.file_name().unwrap().to_str().unwrap();
    assert!(
        saved.parent() == Some(regressions.as_path())
            && file.starts_with("broken-")
            && file.ends_with(".script"),
        "{out}"
    );
    let (code, out) = allocbox_cli(
        &[
            "replay",
            saved.to_str().unwrap(),
            broken,
            "-c",
            "fault=double-free",
        ],
        &dir,
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("double-free"), "{out}");

    let (code, out) = allocbox_cli(&["check", "/no/such.wasm"], &dir);
    assert_eq!(code, 2, "{out}");
    let (code, out) = allocbox_cli(&["check", broken, "-c", "fault=bad-name"], &dir);
    assert_eq!(code, 2, "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An author runs `check` in the policy's own folder: the failing seeds and the shrunk
/// script go to the user's cache directory, the report says where, and the folder gets
/// no new file.
#[test]
fn check_writes_nothing_into_the_folder_it_runs_in() {
    let dir = tempdir("check-leaves-no-file");
    let (folder, cache) = (dir.join("my-policy"), dir.join("cache"));
    std::fs::create_dir_all(&folder).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_allocbox"))
        .args([
            "check",
            allocbox_artifacts::BROKEN.path(),
            "-c",
            "fault=double-free",
        ])
        .current_dir(&folder)
        .env("XDG_CACHE_HOME", &cache)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let kept: Vec<_> = std::fs::read_dir(cache.join("allocbox/regressions"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "script"))
        .collect();
    let [saved] = &kept[..] else {
        panic!("one script kept: {kept:?}\n{text}")
    };
    assert!(
        text.contains(&format!("replay: allocbox replay {}", saved.display())),
        "{text}"
    );
    let left: Vec<_> = std::fs::read_dir(&folder).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `trusts-alignment` breaks the rule only where the upstream's block is not on a cache
/// line: the address layout decides. The checker's upstream lays blocks out by its seed,
/// so whatever the seed, the verdict names the rule, and the script it prints fails the
/// same way when replayed, never `flaky`.
#[test]
fn a_bug_the_address_layout_decides_gets_a_verdict_that_replays_whatever_the_seed() {
    let policy = load(&allocbox_artifacts::BROKEN);
    let config = [("fault", "trusts-alignment")];
    for seed in 1..=4 {
        let options = CheckOptions {
            seed: Some(seed),
            ..options()
        };
        let report = check::check(Runtime::shared(), &policy, &config, &options).unwrap();
        let (finding, script) = report.failure.expect("trusts-alignment is found");
        assert_eq!(
            finding.rule, "misaligned",
            "seed {seed}: {finding}\n{script}"
        );
        assert_replays_to(&policy, &config, &script, &options.limits, "misaligned");
    }
}

/// A script names a block by the operation that made it; a line that uses a block never
/// made, or one already freed, is a mistake in the script, refused with its line.
#[test]
fn scripts_refuse_blocks_not_made_or_freed() {
    let err = Script::parse("b0 = malloc 8\nfree b1\n").unwrap_err();
    assert!(
        err.contains("line 2") && err.contains("b1 was never made"),
        "{err}"
    );
    let err = Script::parse("b0 = malloc 8\nfree b0\nrealloc b0 16\n").unwrap_err();
    assert!(
        err.contains("line 3") && err.contains("freed on line 2"),
        "{err}"
    );
    let err = Script::parse("t0 b0 = malloc 8\nt1 free b0\n").unwrap_err();
    assert!(
        err.contains("line 2") && err.contains("b0 was never made"),
        "{err}"
    );
    Script::parse("b0 = malloc 8\nfree b0\nb0 = malloc 4\nfree b0\n").unwrap();
}

/// A policy that asks for a kind of memory the check did not grant is refused it and
/// goes on (the shipped `guard` falls back to canaries): every rule holds, and the
/// report says which kind went untested, how often it was asked for, and that the
/// paths using it ran only once it is granted.
#[test]
fn a_kind_the_check_did_not_grant_is_reported_as_untested() {
    let policy = load(&allocbox_artifacts::GUARD);
    let ungranted = check::check(Runtime::shared(), &policy, &[], &options()).unwrap();
    assert!(ungranted.passed(), "{:?}", ungranted.failure);
    assert!(
        matches!(ungranted.ungranted.as_slice(), [(KindGrant::Guarded, n)] if *n > 0),
        "{:?}",
        ungranted.ungranted
    );
    let mut granted = options();
    granted.limits.grants.memory.grant(KindGrant::Guarded);
    let granted = check::check(Runtime::shared(), &policy, &[], &granted).unwrap();
    assert!(granted.passed(), "{:?}", granted.failure);
    assert!(granted.ungranted.is_empty(), "{:?}", granted.ungranted);
}

#[test]
fn the_cli_tells_how_to_grant_the_kind_a_check_left_untested() {
    let dir = tempdir("ungranted");
    let (code, out) = allocbox_cli(&["check", "guard", "--rounds", "1", "--cases", "16"], &dir);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("not tested: the policy asked for `guarded` memory")
            && out.contains("`--grant guarded`"),
        "{out}"
    );
    let args = [
        "check", "guard", "--rounds", "1", "--cases", "16", "--grant", "guarded",
    ];
    let (code, out) = allocbox_cli(&args, &dir);
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("not tested"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `allocbox replay --help` and the README explain the same lines, and each line it
/// explains is one a script may hold.
#[test]
fn the_script_notation_is_explained_alike_in_the_help_and_the_readme() {
    let readme = include_str!("../../README.md");
    let heads: Vec<&str> = check::SCRIPT_NOTATION
        .lines()
        .filter_map(|line| line.strip_prefix("  "))
        .filter_map(|line| line.split("  ").next())
        .map(str::trim)
        .filter(|head| !head.is_empty())
        .collect();
    assert!(heads.len() >= 12, "{heads:?}");
    for head in &heads {
        let first = head.split(" | ").next().unwrap();
        assert!(
            readme.contains(&format!("`{first}")),
            "README lacks `{first}`"
        );
    }
    let example = "upstream seed 3\nper-call\nb0 = malloc 8\nb1 = calloc 2 4\n\
        b2 = realloc - 9\nrealloc b0 64\nfree b1\ntrim\noom next\noom after 2\n\
        oom every 3\noom above 4096\n";
    let script = Script::parse(example).unwrap();
    assert_eq!(script.path, CallPath::PerCall);
    assert_eq!(script.to_string(), example);
}

/// `default` names NumPy's own handler where handlers are compared (`report -p
/// default`); where a policy is wanted, the command says what `default` is and names
/// the built-in policy, rather than that nothing is called so.
#[test]
fn checking_default_says_it_is_numpy_s_own_handler_and_names_builtin() {
    let dir = tempdir("default");
    let (code, out) = allocbox_cli(&["check", "default", "--rounds", "1", "--cases", "1"], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("`default` is NumPy's own handler") && out.contains("`builtin`"),
        "{out}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Found in issue 52: `--time 3` with a policy that spends most of the call limit in
/// each call ran 9.1 s, as the budget was looked at between cases only. Now no
/// operation starts past it, and a case stopped so is not counted as held. Counted, not
/// timed: every operation here costs at least one 100 ms call of the policy, so 300 ms
/// hold a handful, where a whole case is up to 128.
#[test]
fn a_check_time_budget_stops_a_case_between_operations_and_judges_no_unfinished_case() {
    let options = CheckOptions {
        time: Some(Duration::from_millis(300)),
        cases: 1,
        max_ops: 128,
        limits: Limits {
            call_time: Duration::from_millis(200),
            grants: allocbox::Grants {
                clocks: true,
                ..Default::default()
            },
            ..Limits::default()
        },
        ..options()
    };
    let config = [("observe", "true"), ("batch", "1"), ("dawdle-ms", "100")];
    let policy = load(&allocbox_artifacts::QUOTA);
    let report = check::check(Runtime::shared(), &policy, &config, &options).unwrap();
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert!(
        report.ops <= 12,
        "{} operations ran past a 300 ms budget at 100 ms a call",
        report.ops
    );
}

/// Issue 60: failing scripts were kept under the policy's name alone, so two policies of
/// one name (two versions of a file, one policy under two configurations) overwrote each
/// other's; and every run drew the same cases. Now each run draws from a fresh seed it
/// prints, and a policy's regressions are kept under its name and its content.
#[test]
fn each_check_draws_a_fresh_seed_it_prints_and_keeps_regressions_per_policy_content() {
    let policy = load(&allocbox_artifacts::BROKEN);
    let name_under = |fault: &str| {
        let config = [("fault", fault)];
        let options = CheckOptions {
            cases: 1,
            ..options()
        };
        let report = check::check(Runtime::shared(), &policy, &config, &options).unwrap();
        assert_eq!(
            report.seed,
            check::DEFAULT_SEED,
            "a library check repeats itself"
        );
        report.regression_name
    };
    let (leak, scribble) = (name_under("leak"), name_under("scribble"));
    assert!(
        leak.starts_with("broken-") && scribble.starts_with("broken-"),
        "{leak}"
    );
    assert_ne!(
        leak, scribble,
        "one policy under two configurations keeps two"
    );
    assert_eq!(leak, name_under("leak"), "the same policy keeps one");

    let dir = tempdir("fresh-seeds");
    let seed_of = |args: &[&str]| {
        let mut all = vec![
            "check",
            "system",
            "--rounds",
            "1",
            "--cases",
            "2",
            "--regressions",
            ".",
        ];
        all.extend_from_slice(args);
        let (code, out) = allocbox_cli(&all, &dir);
        assert_eq!(code, 0, "{out}");
        let at = out.find("from seed ").unwrap_or_else(|| panic!("{out}")) + 10;
        out[at..].split_whitespace().next().unwrap().to_string()
    };
    assert_ne!(seed_of(&[]), seed_of(&[]), "each run its own seed");
    assert_eq!(seed_of(&["--seed", "7"]), "7");
}

/// Issue 60: with a small `--overhead`, refusals caused by what the policy's caches held
/// were reported as "for impossible sizes". Each refusal is now counted by its cause.
#[test]
fn overhead_refusals_are_counted_by_their_cause() {
    let policy = load(&allocbox_artifacts::SIZE_CLASSES);
    let mut tight = CheckOptions {
        cases: 200,
        ..options()
    };
    tight.limits.overhead = 4 << 10;
    let report = check::check(Runtime::shared(), &policy, &[], &tight).unwrap();
    assert!(report.passed(), "{:?}", report.failure);
    assert!(
        report.budget_refusals_held > 0 && report.budget_refusals_held < report.budget_refusals,
        "both causes: {} of {}",
        report.budget_refusals_held,
        report.budget_refusals
    );
    let roomy = check::check(Runtime::shared(), &policy, &[], &options()).unwrap();
    assert_eq!(
        roomy.budget_refusals_held, 0,
        "the default budget holds its caches"
    );
    assert!(
        roomy.budget_refusals > 0,
        "impossible sizes are still refused"
    );
}

/// Issue 60: `assert_contract` ran 64 cases from a fixed seed where a default `check`
/// runs about a thousand here. It runs as many now, counted, not timed.
#[test]
fn assert_contract_checks_as_deep_as_a_default_check_counted_in_cases() {
    let policy = load(&allocbox_artifacts::SIZE_CLASSES);
    let options = check::contract_options();
    assert_eq!(options.time, None, "counted, not timed");
    let report = check::check(Runtime::shared(), &policy, &[], &options).unwrap();
    assert!(report.passed(), "{:?}", report.failure);
    assert!(report.cases >= 1000, "{} cases", report.cases);
    allocbox_check::assert_contract(allocbox_artifacts::SIZE_CLASSES.path(), &[]);
}

/// Issue 60: a policy that lends no freed block again until a trim breaks no rule, but a
/// program that never trims grows without bound under it. `check` passes it and says
/// so, beside what it held against its client's bytes; a policy that reuses is not
/// warned of.
#[test]
fn a_policy_that_reuses_nothing_until_trimmed_passes_with_a_warning_that_it_grows() {
    let options = CheckOptions {
        cases: 64,
        rounds: Some(4),
        ..options()
    };
    let broken = load(&allocbox_artifacts::BROKEN);
    let hoarding = check::check(
        Runtime::shared(),
        &broken,
        &[("fault", "never-reuses")],
        &options,
    )
    .unwrap();
    assert!(hoarding.passed(), "{:?}", hoarding.failure);
    let held = hoarding.holdings;
    assert!(held.grows_between_trims(), "{held:?}");
    let (most, client) = held.most_beyond.expect("sampled");
    assert!(most > client, "{held:?}");
    let reusing = check::check(
        Runtime::shared(),
        &load(&allocbox_artifacts::SIZE_CLASSES),
        &[],
        &options,
    )
    .unwrap();
    assert!(reusing.passed());
    assert!(
        !reusing.holdings.grows_between_trims(),
        "{:?}",
        reusing.holdings
    );
    assert!(reusing.holdings.stretches > 0, "{:?}", reusing.holdings);
    // The command says both, beside its verdict.
    let dir = tempdir("never-reuses");
    let wasm = allocbox_artifacts::BROKEN.path().to_string();
    let (code, out) = allocbox_cli(
        &[
            "check",
            &wasm,
            "-c",
            "fault=never-reuses",
            "--rounds",
            "1",
            "--cases",
            "256",
            "--seed",
            "1",
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("  held: at most "), "{out}");
    assert!(
        out.contains("warning: between trims it kept nearly every byte its client freed"),
        "{out}"
    );
}

/// Issue 73: the replay line `check` printed for a failure found under `-c` answered
/// "every rule held" (0 of 103 reproduced): neither it nor the saved script kept the
/// configuration. Run as printed, from another folder, each planted fault's line breaks
/// the same rule; a timeout under `--call-work` too (the script keeps the bound, and
/// the counted clock decides it the same way each time).
#[test]
fn every_printed_replay_line_reproduces_its_rule_as_printed() {
    let dir = tempdir("replay-as-printed");
    let (here, elsewhere, cache) = (dir.join("here"), dir.join("elsewhere"), dir.join("cache"));
    for folder in [&here, &elsewhere] {
        std::fs::create_dir_all(folder).unwrap();
    }
    std::fs::copy(allocbox_artifacts::BROKEN.path(), here.join("mine.wasm")).unwrap();
    let run = |args: &[&str], folder: &std::path::Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_allocbox"))
            .args(args)
            .current_dir(folder)
            .env("XDG_CACHE_HOME", &cache)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
        )
    };
    let planted = [
        "overlap",
        "misaligned",
        "double-free",
        "calloc-dirty",
        "realloc-loses",
        "off-by-one",
        "scribble",
        "class-rounding",
        "trusts-alignment",
        "recycled-calloc-dirty",
    ];
    let one_round: &[&str] = &["--rounds", "1"];
    let counted: &[&str] = &["--rounds", "1", "--call-work", "2000000"];
    // Found only under an alignment the check draws (from its third round on).
    let drawn: &[&str] = &["--rounds", "3"];
    let runs = planted
        .iter()
        .map(|&fault| (fault, one_round))
        .chain([("loop-malloc", counted), ("over-aligned-split", drawn)]);
    for (fault, extra) in runs {
        let setting = format!("fault={fault}");
        let mut args = vec![
            "check",
            "mine.wasm",
            "-c",
            &setting,
            "--seed",
            "7",
            "--cases",
            "64",
        ];
        args.extend(extra);
        let (code, text) = run(&args, &here);
        assert_eq!(code, Some(1), "{fault}: {text}");
        let verdict = |text: &str| {
            let line = text.lines().find(|l| l.contains("BROKEN ["))?;
            let rule = line.split("BROKEN [").nth(1)?.split(']').next()?;
            Some(rule.to_string())
        };
        let rule = verdict(&text).unwrap_or_else(|| panic!("{fault}: {text}"));
        let line = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("replay: "))
            .unwrap_or_else(|| panic!("{fault}: no replay line\n{text}"));
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(words[..2], ["allocbox", "replay"], "{line}");
        assert_eq!(extra == counted, rule == "timeout", "{fault}: {text}");
        if extra == drawn {
            assert!(text.contains("found under `-c alignment="), "{text}");
        }
        let (code, again) = run(&words[1..], &elsewhere);
        assert_eq!(code, Some(1), "{fault}: `{line}` gave\n{again}");
        assert_eq!(
            verdict(&again).as_deref(),
            Some(rule.as_str()),
            "{fault}: {again}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 72: `--regressions FILE` silently saved nothing.
#[test]
fn regressions_naming_a_file_is_refused_before_any_case_runs() {
    let dir = tempdir("regressions-file");
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    let (code, out) = allocbox_cli(
        &[
            "check",
            allocbox_artifacts::BROKEN.path(),
            "-c",
            "fault=overlap",
            "--regressions",
            "notes.txt",
        ],
        &dir,
    );
    assert_eq!(code, 2, "{out}");
    assert_eq!(out.trim().lines().count(), 1, "{out}");
    assert!(
        out.contains("--regressions `notes.txt` is not a folder"),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "mine"
    );
}

/// Issue 72: `--cases 4294967295 --time 2` ran past 120 s: a round drew every case left
/// after the time was spent. The round ends there; the check ends with what it judged.
#[test]
fn check_time_ends_a_round_of_any_number_of_cases() {
    let dir = tempdir("check-time-ends");
    let (code, out) = allocbox_cli(
        &[
            "check",
            "builtin",
            "--rounds",
            "1",
            "--cases",
            "4294967295",
            "--time",
            "0.5",
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("every rule held"), "{out}");
}

/// Issue 73: a block split at 16 bytes from a policy asked for a larger alignment
/// survived 1.8 M operations at the default alignment, and was found 19 of 19 times
/// under `-c alignment=32/64/4096`, which nothing suggested. A default-depth check
/// draws the standard `alignment` (the policy accepts it) in every third round, finds
/// it there, names the configuration, and the script carries it into the replay.
#[test]
fn a_split_that_breaks_only_a_larger_alignment_is_found_at_the_default_depth() {
    let policy = load(&allocbox_artifacts::BROKEN);
    let config = [("fault", "over-aligned-split")];
    // At the alignment given (the default 16) it breaks no rule.
    let given_only = CheckOptions {
        rounds: Some(2),
        ..options()
    };
    let report = check::check(Runtime::shared(), &policy, &config, &given_only).unwrap();
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert_eq!(report.swept, ["alignment"]);
    for seed in 1..=3 {
        let options = CheckOptions {
            seed: Some(seed),
            ..check::contract_options()
        };
        let options = CheckOptions {
            regressions: None,
            ..options
        };
        let report = check::check(Runtime::shared(), &policy, &config, &options).unwrap();
        let (finding, script) = report
            .failure
            .unwrap_or_else(|| panic!("passed the check with seed {seed}"));
        assert_eq!(finding.rule, "misaligned", "{finding}\n{script}");
        let [(key, value)] = &report.drawn_config[..] else {
            panic!("drew {:?}", report.drawn_config);
        };
        assert_eq!(key, "alignment");
        assert!(value.parse::<u64>().unwrap() > 16, "{value}");
        assert!(script.len() <= 3, "shrank only to:\n{script}");
        let ran: Vec<(&str, &str)> = (script.ran.config.iter())
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(ran, [("fault", "over-aligned-split"), ("alignment", value)]);
        assert_replays_to(&policy, &ran, &script, &options.limits, "misaligned");
    }
}

/// A policy that refuses the standard keys is checked under its configuration alone;
/// one that accepts them (`aligned`) holds under every value drawn.
#[test]
fn only_the_standard_keys_a_policy_accepts_are_drawn() {
    let rounds = CheckOptions {
        rounds: Some(6),
        cases: 16,
        ..options()
    };
    let refusing = load(&allocbox_artifacts::SIZE_CLASSES);
    let report = check::check(Runtime::shared(), &refusing, &[], &rounds).unwrap();
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert!(report.swept.is_empty(), "{:?}", report.swept);
    let accepting = load(&allocbox_artifacts::ALIGNED);
    let report = check::check(Runtime::shared(), &accepting, &[], &rounds).unwrap();
    assert!(report.failure.is_none(), "{:?}", report.failure);
    assert_eq!(report.swept, ["alignment"]);
    // A key the caller set is the caller's.
    let set = [("alignment", "64")];
    let report = check::check(Runtime::shared(), &accepting, &set, &rounds).unwrap();
    assert!(report.swept.is_empty(), "{:?}", report.swept);
}
