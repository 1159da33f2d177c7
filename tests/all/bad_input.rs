//! Bad input to the `allocbox` command: each kind is refused with exit 2 and a sentence
//! that names the input and what to do, and nothing runs on it.

use proptest::prelude::*;

use super::support::*;

/// Run the command in a fresh directory of its own; its exit code and everything it said.
fn run(name: &str, args: &[&str]) -> (i32, String, std::path::PathBuf) {
    let dir = tempdir(name);
    let (code, out) = allocbox_cli(args, &dir);
    (code, out, dir)
}

#[test]
fn counts_of_zero_and_too_many_threads_are_refused() {
    for (flag, value, says) in [
        ("--cases", "0", "at least 1"),
        ("--rounds", "0", "at least 1"),
        ("--call-work", "0", "at least 1"),
        ("--max-ops", "0", "from 1 to 100000"),
        ("--threads", "0", "from 1 to 256"),
        ("--threads", "1000", "from 1 to 256"),
        ("--call-time-ms", "0", "from 1 to 3600000"),
        ("--batch-limit", "0", "from 1 to 1048576"),
    ] {
        let (code, out, _) = run("zero-counts", &["check", flag, value]);
        assert_eq!(code, 2, "{flag} {value}: {out}");
        assert!(
            out.contains(says) && out.contains(value),
            "{flag} {value}: {out}"
        );
    }
}

/// Found in issue 52's class of numeric options: values past what the host can hold
/// (a deadline of 2^64 ms, a batch of 2^32 blocks, a memory past what wasm addresses)
/// are each one line naming the range, exit 2, never a panic.
#[test]
fn numbers_past_what_the_host_can_hold_name_their_range_and_exit_2() {
    for (flag, value, says) in [
        (
            "--call-time-ms",
            "18446744073709551615",
            "from 1 to 3600000",
        ),
        ("--batch-limit", "4294967295", "from 1 to 1048576"),
        ("--max-ops", "18446744073709551615", "from 1 to 100000"),
        ("--guest-memory", "1TiB", "at most 4 GiB"),
        ("--overhead", "8192 TiB", "at most 1 PiB"),
        (
            "--overhead",
            "16777216 TiB",
            "more bytes than can be counted",
        ),
        ("--overhead", "99999999999999999999", "at least 1 byte"),
        ("--seed", "-1", "-1"),
    ] {
        let (code, out, _) = run("too-large", &["check", flag, value]);
        assert_eq!(code, 2, "{flag} {value}: {out}");
        assert!(out.contains(says), "{flag} {value}: {out}");
        assert!(!out.contains("panicked"), "{flag} {value}: {out}");
    }
}

/// A file of `len` bytes that takes no disk (and would take `len` to read).
fn sparse_file(path: &std::path::Path, len: u64) {
    std::fs::File::create(path).unwrap().set_len(len).unwrap();
}

/// Found in issue 52: a 2 GB (sparse) file given as a policy took +2 GB resident and
/// 7-10 s before the refusal: the file is now judged by its size, before it is read.
#[test]
fn a_policy_file_past_the_file_bound_is_refused_by_its_size_before_it_is_read() {
    let dir = tempdir("huge-policy");
    sparse_file(&dir.join("huge.wasm"), 2 << 30);
    let (code, out, peak) = allocbox_cli_peak_rss(&["check", "huge.wasm"], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("huge.wasm")
            && out.contains("2147483648 bytes in its file")
            && out.contains("file-bytes"),
        "{out}"
    );
    assert!(peak < 512 << 10, "refusing it took {peak} KiB resident");
}

/// Found in issue 52: a script of more than a script can be is refused by its size.
#[test]
fn a_replay_script_past_its_bound_is_refused_by_its_size() {
    let dir = tempdir("huge-script");
    sparse_file(&dir.join("huge.script"), 1 << 30);
    let (code, out) = allocbox_cli(&["replay", "huge.script", "builtin"], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("huge.script") && out.contains("more than 67108864 bytes"),
        "{out}"
    );
}

#[test]
fn a_check_time_that_is_no_time_or_past_a_week_is_refused_not_a_panic_or_an_empty_pass() {
    // `inf`, `1e20` and 2^64 made the host panic (a Duration overflow); `0`, `-1` and
    // `NaN` ran no case and said "every rule held" (issue 52).
    for bad in [
        "inf",
        "1e20",
        "18446744073709551616",
        "0",
        "-1",
        "NaN",
        "soon",
    ] {
        let (code, out, _) = run("check-time", &["check", "--time", bad]);
        assert_eq!(code, 2, "{bad}: {out}");
        assert!(out.contains(bad) && out.contains("a week"), "{bad}: {out}");
        assert!(
            !out.contains("panicked") && !out.contains("every rule held"),
            "{bad}: {out}"
        );
    }
}

#[test]
fn byte_sizes_take_the_units_the_help_shows_and_refuse_others() {
    let (code, out, _) = run(
        "byte-units",
        &[
            "check",
            "--rounds",
            "1",
            "--cases",
            "2",
            "--guest-memory",
            "128MiB",
            "--overhead",
            "64 MiB",
        ],
    );
    assert_eq!(code, 0, "{out}");
    for bad in ["12XB", "MiB", "0", "-5"] {
        let (code, out, _) = run("byte-units-bad", &["check", "--guest-memory", bad]);
        assert_eq!(code, 2, "{bad}: {out}");
        assert!(out.contains(bad), "{bad}: {out}");
    }
}

#[test]
fn replay_with_its_arguments_swapped_says_which_comes_first() {
    let policy = allocbox_artifacts::SYSTEM.path();
    let (code, out, dir) = run("swapped", &["replay", policy]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("the script comes first"), "{out}");
    let script = dir.join("script.txt");
    std::fs::write(&script, "b0 = malloc 8\n").unwrap();
    let (code, out) = allocbox_cli(&["replay", policy, script.to_str().unwrap()], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("the script comes first"), "{out}");
}

#[test]
fn replay_refuses_a_script_that_frees_a_block_never_made_or_freed_twice_or_makes_a_live_one_again()
{
    let dir = tempdir("undefined-block");
    for (text, says) in [
        ("b0 = malloc 8\nfree b1\n", "line 2"),
        ("b0 = malloc 8\nfree b0\nfree b0\n", "freed on line 2"),
        // Accepted before (issue 52): the first b0 could then never be freed by name.
        (
            "b0 = malloc 8\nb0 = calloc 2 4\n",
            "line 2: `b0 = calloc 2 4`: b0 is still live, made on line 1",
        ),
        (
            "b0 = malloc 8\nfree b0\nb0 = malloc 16\nrealloc b0 32\n",
            "",
        ),
    ] {
        let script = dir.join("script.txt");
        std::fs::write(&script, text).unwrap();
        let (code, out) = allocbox_cli(&["replay", script.to_str().unwrap()], &dir);
        if says.is_empty() {
            // A name made again once its block was freed is a new block, as in checks.
            assert_eq!(code, 0, "{out}");
            continue;
        }
        assert_eq!(code, 2, "{out}");
        assert!(out.contains(says) && out.contains("script.txt"), "{out}");
    }
}

#[test]
fn a_missing_trace_is_named_once_and_a_bad_line_names_its_word() {
    let (code, out, dir) = run("no-trace", &["replay-trace", "nope.trace"]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("nope.trace"), "{out}");
    assert_eq!(out.matches("No such file").count(), 1, "{out}");
    let trace = dir.join("bad.trace");
    std::fs::write(&trace, "m 1 8\nb0 1 8\n").unwrap();
    let (code, out) = allocbox_cli(&["replay-trace", trace.to_str().unwrap()], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("line 2") && out.contains("`b0` is not an operation"),
        "{out}"
    );
}

#[test]
fn the_built_in_policy_is_named_builtin_when_it_refuses_its_configuration() {
    let (code, out, _) = run("builtin-config", &["inspect", "-c", "foo=bar"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("policy `builtin` refused its configuration"),
        "{out}"
    );
    assert!(!out.contains("<bytes>"), "{out}");
}

/// A policy that keeps blocks it was given back holds host memory after every block of
/// the trace was freed and it was trimmed: `replay-trace` and `report` fail on it.
#[test]
fn replay_trace_and_report_fail_a_policy_that_leaks() {
    let dir = tempdir("leak");
    let trace = dir.join("leak.trace");
    std::fs::write(&trace, "m 1 100\nf 1 100\nm 2 8\nf 2 8\n").unwrap();
    let broken = allocbox_artifacts::BROKEN.path();
    let trace = trace.to_str().unwrap();
    let (code, out) = allocbox_cli(
        &["replay-trace", trace, "-p", broken, "-c", "fault=leak"],
        &dir,
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAILED     after the last event") && out.contains("leak"),
        "{out}"
    );
    let page = dir.join("leak.html");
    let (code, out) = allocbox_cli(
        &[
            "report",
            trace,
            "-p",
            broken,
            "-c",
            "fault=leak",
            "-o",
            page.to_str().unwrap(),
        ],
        &dir,
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("after the last event"), "{out}");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        html.contains("a leak, after the last event"),
        "the page shows it"
    );
    // A policy that gives everything back passes both.
    let (code, out) = allocbox_cli(
        &[
            "replay-trace",
            trace,
            "-p",
            allocbox_artifacts::SYSTEM.path(),
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
}

/// Python's names for the shipped policies work on the command line too, wherever a
/// policy is named; a name that is neither a file nor shipped lists what is.
#[test]
fn a_shipped_name_works_wherever_a_policy_is_named_and_an_unknown_one_lists_them() {
    let dir = tempdir("shipped-names");
    let (code, out) = allocbox_cli(
        &["check", "size-classes", "--rounds", "1", "--cases", "4"],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("size-classes: every rule held"), "{out}");
    let (code, out) = allocbox_cli(&["inspect", "arena"], &dir);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("language   Rust"), "{out}");
    let script = dir.join("script.txt");
    std::fs::write(&script, "b0 = malloc 8\nfree b0\n").unwrap();
    let (code, out) = allocbox_cli(&["replay", script.to_str().unwrap(), "system"], &dir);
    assert_eq!(code, 0, "{out}");
    let trace = dir.join("small.trace");
    std::fs::write(&trace, "m 1 8\nf 1 8\n").unwrap();
    let trace = trace.to_str().unwrap();
    let (code, out) = allocbox_cli(&["replay-trace", trace, "-p", "aligned"], &dir);
    assert_eq!(code, 0, "{out}");
    let page = dir.join("r.html");
    let (code, out) = allocbox_cli(
        &[
            "report",
            trace,
            "-p",
            "size-classes",
            "-p",
            "builtin",
            "-o",
            page.to_str().unwrap(),
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    let (code, out) = allocbox_cli(&["check", "sise-classes"], &dir);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("no file or shipped policy is called `sise-classes`")
            && out.contains("size-classes")
            && out.contains("builtin (the `passthrough` policy)"),
        "{out}"
    );
    // The built-in policy answers to the name it gives itself, as handler names show it.
    let (code, out) = allocbox_cli(
        &["check", "passthrough", "--rounds", "1", "--cases", "4"],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("passthrough: every rule held"), "{out}");
}

/// Lines of a replay script: operations (on blocks that exist and not, of any size and
/// thread), directives, comments and noise.
fn script_lines() -> impl Strategy<Value = String> {
    let block = prop_oneof![0u32..4, Just(u32::MAX), any::<u32>()];
    let size = prop_oneof![0u64..5000, Just(u64::MAX), any::<u64>()];
    let line = prop_oneof![
        (block.clone(), size.clone()).prop_map(|(b, s)| format!("b{b} = malloc {s}")),
        (block.clone(), size.clone(), 0u64..9)
            .prop_map(|(b, n, e)| format!("b{b} = calloc {n} {e}")),
        (block.clone(), size.clone()).prop_map(|(b, s)| format!("b{b} = realloc - {s}")),
        (block.clone(), size.clone()).prop_map(|(b, s)| format!("realloc b{b} {s}")),
        block.clone().prop_map(|b| format!("free b{b}")),
        Just("trim".to_string()),
        size.clone().prop_map(|n| format!("oom after {n}")),
        size.clone().prop_map(|n| format!("oom every {n}")),
        size.clone().prop_map(|n| format!("oom above {n}")),
        Just("oom next".to_string()),
        any::<u64>().prop_map(|n| format!("upstream seed {n}")),
        prop_oneof![Just("magazines"), Just("per-call"), Just("thread")].prop_map(String::from),
        (0u32..300, block, size).prop_map(|(t, b, s)| format!("t{t} b{b} = malloc {s}")),
        any::<String>(),
    ];
    proptest::collection::vec(line, 0..24).prop_map(|lines| lines.join("\n"))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 24,
        failure_persistence: None,
        ..Default::default()
    })]

    /// Issue 52's fuzzing of the tools: any script `replay` is given ends in a verdict
    /// (0 or 1) or one line naming its fault (2), never a panic, within a bounded memory.
    #[test]
    fn any_replay_script_ends_in_a_verdict_or_one_line_naming_its_fault(text in script_lines()) {
        let dir = tempdir("random-script");
        std::fs::write(dir.join("s.script"), &text).unwrap();
        let (code, out, peak) = allocbox_cli_peak_rss(&["replay", "s.script", "builtin"], &dir);
        prop_assert!(matches!(code, 0..=2), "exit {code}: {out}\n{text}");
        prop_assert!(!out.contains("panicked"), "{out}\n{text}");
        if code == 2 {
            prop_assert_eq!(out.trim().lines().count(), 1, "{}\n{}", out, text);
        }
        prop_assert!(peak < 1 << 20, "{peak} KiB resident\n{text}");
    }

    /// The same for `check`'s options: any value of each numeric option is a check that
    /// runs (0, or 1 where a policy cannot start in so little memory) or one line naming
    /// the range, exit 2. (`--time` and `--cases` are left to the tests above: a value
    /// they take runs the check that long.)
    #[test]
    fn any_value_of_a_check_option_runs_or_is_one_line_naming_its_range(
        flag in proptest::sample::select(vec![
            "--max-ops", "--threads", "--seed", "--call-time-ms",
            "--batch-limit", "--guest-memory", "--overhead",
        ]),
        value in prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            any::<u64>().prop_map(|n| n.to_string()),
            any::<f64>().prop_map(|n| n.to_string()),
            "[0-9]{1,30}( ?[KMGT]i?B?)?",
            any::<String>(),
        ],
    ) {
        let dir = tempdir("random-option");
        // A check kept short whatever the option: one case of few operations.
        let mut args = vec!["check", "builtin", "--rounds", "1", "--cases", "1"];
        if flag != "--max-ops" {
            args.extend(["--max-ops", "4"]);
        }
        let option = format!("{flag}={value}");
        args.push(&option);
        let (code, out) = allocbox_cli(&args, &dir);
        prop_assert!(matches!(code, 0..=2), "{option}: exit {code}: {out}");
        prop_assert!(!out.contains("panicked"), "{option}: {out}");
        if code == 2 {
            prop_assert!(out.trim().lines().count() <= 3, "{option}: {out}");
        }
    }
}

/// Issue 65: the hand-written lists of memory kinds went stale (`--grant`'s help named
/// four of six). Every subcommand that grants says every kind, from the one list.
#[test]
fn every_grant_option_names_every_kind_of_memory() {
    let dir = tempdir("grant-help");
    for command in ["check", "replay", "replay-trace", "report", "run"] {
        let (code, out) = allocbox_cli(&[command, "--help"], &dir);
        assert_eq!(code, 0, "{out}");
        // Its line, and in the long help the paragraph under it.
        let at = out
            .find("--grant")
            .unwrap_or_else(|| panic!("{command} --help has --grant: {out}"));
        let grant = &out[at..at + out[at..].find("\n\n").unwrap_or(out.len() - at)];
        for kind in allocbox::mapped::KindGrant::ALL {
            assert!(grant.contains(kind.name()), "{command}: {grant}");
        }
    }
}

/// Issue 72: clap's usage errors were four lines, and the user's own U+202E was echoed
/// raw (reordering the terminal's line). Each is one line, the text escaped.
#[test]
fn a_usage_error_is_one_line_with_the_user_s_text_escaped() {
    for (args, says) in [
        (
            &["check", "--frobnicate\u{202e}"][..],
            "allocbox check: unexpected argument '--frobnicate\\u{202e}' found",
        ),
        (
            &["--bogus"],
            "allocbox: unexpected argument '--bogus' found",
        ),
        (
            &["report", "t.trace", "-o", "p.html"],
            "allocbox report: the following required arguments were not provided",
        ),
    ] {
        let (code, out, _) = run("usage-one-line", args);
        assert_eq!(code, 2, "{args:?}: {out}");
        let lines: Vec<&str> = out.trim().lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: {out}");
        assert!(lines[0].starts_with(says), "{args:?}: {out}");
        assert!(lines[0].ends_with("--help` says how it is used"), "{out}");
        assert!(
            !out.contains('\u{202e}') && !out.contains('\u{1b}'),
            "{out}"
        );
    }
    let (code, out, _) = run(
        "path-escaped",
        &["trace-convert", "a\u{202e}b.trace", "o.txt"],
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("a\\u{202e}b.trace") && !out.contains('\u{202e}'),
        "{out}"
    );
}
