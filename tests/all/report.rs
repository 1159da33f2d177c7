//! `allocbox report`: the timelines it collects, the page it writes, the CLI.

use std::sync::atomic::AtomicU64;

use allocbox::trace::timeline::{
    HeldBy, MAX_POINTS, Replayed, Timeline, chain_held, holdings_at, native_held, size_bucket,
    timeline, timeline_counted,
};
use allocbox::trace::{Mark, parse_trace, parse_trace_marked};
use allocbox::{HandlerBuilder, Runtime};
use allocbox::{MemHandler, NumpyDefault};
use allocbox_cli::report::render_html;

use super::support::*;

/// Live bytes after each event: 100, 1100, 6000, 5000, 5010, 10, 0.
const SMALL: &str = "m 1 100\nm 2 1000\nr 1 5000\nf 2 1000\nc 3 10\nf 1 5000\nf 3 10\n";

fn small_timelines() -> Vec<Timeline> {
    let events = parse_trace(SMALL.as_bytes()).unwrap();
    let native = NumpyDefault::new();
    let chain = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    vec![
        timeline("default", &native, native_held(&native), &events),
        timeline("size-classes.wasm", &chain, chain_held(&chain), &events),
    ]
}

#[test]
fn a_report_follows_live_bytes_sizes_and_held_memory_event_by_event() {
    for t in small_timelines() {
        let label = &t.label;
        assert!(
            t.replay.failure.is_none(),
            "{label}: {:?}",
            t.replay.failure
        );
        assert_eq!((t.replay.events, t.every), (7, 1), "{label}");
        let live: Vec<u64> = t.samples.iter().map(|s| s.live).collect();
        assert_eq!(live, [100, 1100, 6000, 5000, 5010, 10, 0], "{label}");
        assert_eq!((t.peak_live, t.final_live), (6000, 0), "{label}");
        assert_eq!(t.final_ratio(), None, "{label}: nothing live at the end");
        for s in &t.samples {
            assert!(
                s.held >= s.live,
                "{label}: held {} < live {}",
                s.held,
                s.live
            );
        }
        assert!(
            t.peak_held >= 6000 && t.held_at_peak_live >= 6000,
            "{label}"
        );
        assert!(t.peak_ratio.unwrap() >= 1.0, "{label}");
        let mut sizes = [0u64; allocbox::trace::timeline::SIZE_BUCKETS];
        for size in [100, 1000, 5000, 10] {
            sizes[size_bucket(size)] += 1;
        }
        assert_eq!(t.sizes, sizes, "{label}: frees are not requests");
        assert_eq!((size_bucket(0), size_bucket(1), size_bucket(64)), (0, 1, 7));
        assert!(t.ns_median <= t.ns_p99 && t.ns_p99 <= t.ns_max, "{label}");
        for s in &t.samples {
            // One event per window: its mean is its median.
            assert!(s.ns_per_event > 0.0, "{label}");
            assert_eq!(s.ns_per_event, f64::from(s.ns_median), "{label}");
        }
    }
    let page = render_html("small.txt", &small_timelines(), &[]);
    assert_eq!(
        page.matches("<svg").count(),
        7,
        "three charts per handler, and the trace's request sizes once"
    );
    assert!(page.contains("size-classes.wasm") && page.contains("default_allocator"));
    // The request sizes are the trace's: captioned as every handler's, not the first's.
    let sizes = page.split("<h2>Request sizes").nth(1).unwrap();
    assert!(
        sizes.contains("<figcaption title=\"every handler\">"),
        "{sizes}"
    );
    // Held/live never goes under 1x: neither does its axis.
    let overhead = page
        .split("<h2>Overhead")
        .nth(1)
        .unwrap()
        .split("<h2>")
        .next()
        .unwrap();
    let under: Vec<&str> = overhead
        .split(">\n")
        .filter_map(|t| t.split('\n').next())
        .filter(|t| {
            t.strip_suffix('x')
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|v| v < 1.0)
        })
        .collect();
    assert!(under.is_empty(), "labels under 1x: {under:?}");
}

/// A trace's comment lines divide it into phases (the tests that made its events): the
/// page names the test of the peak, ranks the phases, and shows what the trace left
/// live at its end by size.
#[test]
fn a_report_names_the_peak_s_test_its_phases_and_what_the_trace_left_live() {
    let text = "# the header\nm 1 100\n# test_a\nm 2 5000\nf 2 5000\n# test_b\n\
                m 3 300000\nf 3 300000\nm 4 64\n";
    let trace = parse_trace_marked(text.as_bytes()).unwrap();
    let mark = |at, text: &str| Mark {
        at,
        text: text.to_string(),
    };
    assert_eq!(trace.marks, [mark(1, "test_a"), mark(3, "test_b")]);
    let chain = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    let t = timeline_counted(
        "size-classes",
        &chain,
        chain_held(&chain),
        Replayed::held(&trace.events, &trace.marks),
        &AtomicU64::new(0),
    );
    let phases: Vec<(&str, u64, u64, u64)> = t
        .phases
        .iter()
        .map(|p| (p.name.as_str(), p.start, p.end, p.peak_live))
        .collect();
    assert_eq!(
        phases,
        [
            ("", 0, 1, 100),
            ("test_a", 1, 3, 5100),
            ("test_b", 3, 6, 300100)
        ]
    );
    assert_eq!((t.peak_live, t.peak_live_at), (300100, 4));
    assert_eq!(t.left_live[size_bucket(100)], (2, 164), "blocks 1 and 4");
    // Where the most it held went, from a second replay on a fresh handler up to then.
    let fresh = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    let holdings = holdings_at(
        HeldBy::Chain(&fresh),
        trace.events.iter().copied(),
        t.peak_held_at,
    );
    let held: u64 = holdings.classes.iter().map(|c| c.2).sum::<u64>() + holdings.idle.1;
    assert_eq!(
        held, t.peak_held,
        "the breakdown adds up to the most it held"
    );
    let live: u64 = holdings.classes.iter().map(|c| c.1).sum();
    assert!(live <= held && live > 0, "{holdings:?}");
    assert_eq!(fresh.live_blocks().unwrap(), [], "every block freed");
    let mut t = t;
    t.holdings = Some(holdings);
    let page = render_html("t.trace", &[t], &trace.marks);
    assert!(
        page.contains("after event 4, in <code>test_b</code>"),
        "{page}"
    );
    assert!(page.contains("2 blocks, 164 B"), "{page}");
    assert!(
        page.contains("<h2>Held and wasted, by size class</h2>"),
        "{page}"
    );
    let by_peak = page.split("<h3>").nth(1).unwrap();
    assert!(
        by_peak.find("test_b").unwrap() < by_peak.find("test_a").unwrap(),
        "{by_peak}"
    );
}

#[test]
fn a_long_trace_is_sampled_without_losing_its_peak() {
    // 6000 blocks of 8 bytes, then all freed: the peak (48000) lies inside a window.
    let mut text = String::new();
    for id in 1..=6000 {
        text += &format!("m {id} 8\n");
    }
    for id in 1..=6000 {
        text += &format!("f {id} 8\n");
    }
    let events = parse_trace(text.as_bytes()).unwrap();
    let native = NumpyDefault::new();
    let t = timeline("default", &native, native_held(&native), &events);
    assert_eq!(t.every, 6);
    assert!(t.samples.len() <= MAX_POINTS);
    assert_eq!(t.samples.last().unwrap().end, 12_000);
    assert_eq!(t.peak_live, 48_000);
    assert_eq!(t.samples.iter().map(|s| s.live).max(), Some(48_000));
    assert_eq!(
        t.samples.last().unwrap().live,
        40,
        "the last window's most: 5 blocks"
    );
    assert_eq!(t.final_live, 0);
    assert_eq!(t.sizes[size_bucket(8)], 6000);
    assert_eq!(
        native.stats().unwrap().live_blocks,
        0,
        "the handler is left empty"
    );
}

#[test]
fn a_failing_handler_s_first_failing_event_is_named_in_the_report() {
    let events = parse_trace("m 1 8\nm 2 8\nf 2 8\nm 3 8\n".as_bytes()).unwrap();
    let h = broken("double-free");
    let t = timeline("broken.wasm", &h, chain_held(&h), &events);
    let (event, error) = t.replay.failure.as_ref().expect("the free breaks a rule");
    assert_eq!(event.line, 3);
    assert_eq!(error.rule().map(|r| r.name()), Some("double-free"));
    let error = error.to_string();
    assert_eq!(t.replay.events, 3, "the replay stops at the failure");
    assert_eq!(t.samples.last().unwrap().end, 3);
    let page = render_html("t.txt", &[t], &[]);
    assert!(
        page.contains("line 3: `f 2 8`"),
        "the event, by its Display"
    );
    assert!(page.contains(&allocbox_cli::report::escape_html(&error)));
    assert!(page.contains("double free"));
    assert_eq!(
        page.matches("failed at event 3<").count(),
        4,
        "each chart's caption"
    );
}

#[test]
fn the_report_command_writes_the_page_and_exits_1_when_a_handler_fails() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("report-cli");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("t.txt"), "m 1 8\nm 2 8\nf 2 8\nf 1 8\n").unwrap();
    let page = dir.join("out.html");
    let _ = std::fs::remove_file(&page);
    let broken = allocbox_artifacts::BROKEN.path();
    let (code, out) = allocbox_cli(
        &[
            "report",
            "t.txt",
            "-p",
            "default",
            "-p",
            broken,
            "-c",
            "fault=double-free",
            "-o",
            "out.html",
        ],
        &dir,
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("line 3: `f 2 8`") && out.contains("none"),
        "{out}"
    );
    assert!(
        out.contains("failed at line 3: `f 2 8`, so it compares with nothing"),
        "{out}"
    );
    let html = std::fs::read_to_string(&page).expect("the page is written anyway");
    assert!(html.contains("line 3: `f 2 8`"));

    let (code, out) = allocbox_cli(
        &[
            "report", "t.txt", "-p", "builtin", "-o", "out.html", "--json",
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(json[0]["label"], "builtin");
    assert_eq!(json[0]["events"], 4);
    assert_eq!(json[0]["peak_live_bytes"], 16);
    assert!(json[0]["failure"].is_null());

    let (code, out) = allocbox_cli(&["report", "missing.txt", "-p", "default", "-o", "x"], &dir);
    assert_eq!(code, 2, "{out}");
    let (code, out) = allocbox_cli(&["report", "t.txt", "-o", "x"], &dir);
    assert_eq!(code, 2, "at least one -p: {out}");
}

#[test]
fn several_traces_make_one_page_a_part_each_in_the_order_given() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("report-parts");
    std::fs::create_dir_all(&dir).unwrap();
    // A program's trace and a child's, as `allocbox run` names them.
    std::fs::write(dir.join("run.trace"), "m 1 8\nf 1 8\n").unwrap();
    std::fs::write(dir.join("run.trace.4242"), "m 1 4096\nm 2 4096\n").unwrap();
    let traces = ["run.trace", "run.trace.4242"];
    let (code, out) = allocbox_cli(
        &[
            "report", traces[0], traces[1], "-p", "default", "-o", "out.html",
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    let (program, child) = (out.find("run.trace:\n"), out.find("run.trace.4242:\n"));
    assert!(
        matches!((program, child), (Some(p), Some(c)) if p < c),
        "a summary per trace, each under its name: {out}"
    );
    let html = std::fs::read_to_string(dir.join("out.html")).unwrap();
    assert!(html.contains("<title>allocbox report: run.trace and 1 more trace</title>"));
    let parts: Vec<_> = traces
        .iter()
        .map(|t| html.find(&format!("<h1>allocbox report: {t}</h1>")))
        .collect();
    assert!(
        matches!(parts[..], [Some(p), Some(c)] if p < c),
        "a part per trace, in order"
    );

    let (code, out) = allocbox_cli(
        &[
            "report", traces[0], traces[1], "-p", "default", "-o", "out.html", "--json",
        ],
        &dir,
    );
    assert_eq!(code, 0, "{out}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    let per_trace: Vec<_> = json
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["trace"].as_str().unwrap(),
                t["peak_live_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(per_trace, [("run.trace", 8), ("run.trace.4242", 8192)]);

    let (code, out) = allocbox_cli(
        &[
            "report",
            traces[0],
            "missing.trace",
            "-p",
            "default",
            "-o",
            "out.html",
        ],
        &dir,
    );
    assert_eq!(code, 2, "a trace that cannot be read is said: {out}");
    assert!(out.contains("missing.trace"), "{out}");
}

/// A policy that calls itself `<script>…` and breaks the contract on its first malloc,
/// so its name reaches the page both as a name and inside an error message.
fn hostile_policy() -> allocbox::Handler {
    const NAME: &str = "<script>alert(1)</script>";
    let wat = allocbox::DEFAULT_POLICY_WAT
        .replace(
            "(data (i32.const 64) \"passthrough\")",
            &format!("(data (i32.const 64) \"{NAME}\")"),
        )
        .replace(
            "(i32.store (i32.const 12) (i32.const 11))",
            &format!("(i32.store (i32.const 12) (i32.const {}))", NAME.len()),
        )
        .replace(
            // No batches: every malloc reaches the policy.
            "(i32.store8 (i32.const 32) (i32.const 1))",
            "(i32.store8 (i32.const 32) (i32.const 0))",
        )
        .replace(
            "#malloc\") (param $size i64) (result i64)\n    (call $count (call $up_malloc (local.get $size))))",
            "#malloc\") (param $size i64) (result i64)\n    (i64.const 4096))",
        );
    assert_eq!(wat.matches(NAME).count(), 1);
    assert!(wat.contains("(i64.const 4096))"));
    let policy = Runtime::shared().load(wat.as_bytes()).unwrap();
    HandlerBuilder::new(Runtime::shared())
        .link_with(&policy, &[])
        .build()
        .unwrap()
}

#[test]
fn names_and_errors_from_policies_are_escaped_on_the_page() {
    let h = hostile_policy();
    assert_eq!(h.name(), "<script>alert(1)</script>");
    let events = parse_trace("m 1 8\n".as_bytes()).unwrap();
    let label = "<script>alert('label')</script>\"&";
    let t = timeline(label, &h, chain_held(&h), &events);
    let error = t
        .replay
        .failure
        .as_ref()
        .expect("malloc answers 4096")
        .1
        .to_string();
    assert!(
        error.contains("<script>"),
        "the message names the policy: {error}"
    );
    let page = render_html("<script>trace</script>", &[t], &[]);
    assert!(!page.contains("<script"), "raw <script> in the page");
    assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(page.contains("&lt;script&gt;alert(&#39;label&#39;)&lt;/script&gt;&quot;&amp;"));
    assert!(page.contains("&lt;script&gt;trace&lt;/script&gt;"));
}

/// A page that cannot be written is said before any replay (the missing folder is named
/// ahead of the missing trace), and a report that stops leaves an older page as it was,
/// with nothing half-written beside it.
#[test]
fn the_report_checks_its_page_before_the_work_and_never_leaves_half_a_page() {
    let dir = tempdir("page");
    let args = [
        "report",
        "missing.txt",
        "-p",
        "default",
        "-o",
        "nodir/r.html",
    ];
    let (code, out) = allocbox_cli(&args, &dir);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("its folder `nodir` does not exist") && !out.contains("missing.txt"),
        "{out}"
    );

    std::fs::write(dir.join("old.html"), "the page from before").unwrap();
    std::fs::write(dir.join("bad.txt"), "m 1 16 1\nnot an event\n").unwrap();
    let (code, out) = allocbox_cli(
        &["report", "bad.txt", "-p", "default", "-o", "old.html"],
        &dir,
    );
    assert_eq!(code, 2, "{out}");
    let kept = std::fs::read_to_string(dir.join("old.html")).unwrap();
    assert_eq!(kept, "the page from before");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["bad.txt", "old.html"],
        "nothing left beside the page"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn each_config_goes_to_the_policy_named_before_it_and_the_summary_explains_its_ratios() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("report-per-policy");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("t.txt"), "m 1 800\nm 2 8\nf 2 8\nf 1 800\n").unwrap();
    let (code, out) = allocbox_cli(
        &[
            "report",
            "t.txt",
            "-p",
            "size-classes",
            "-c",
            "bucket-depth=7",
            "-p",
            "arena",
            "-o",
            "out.html",
        ],
        &dir,
    );
    assert_eq!(code, 0, "`arena` is not given size-classes' setting: {out}");
    assert!(
        out.contains("held/live at peak") && out.contains(allocbox_cli::report::RATIO_NOTE),
        "{out}"
    );
    assert!(!out.contains("peak ratio"), "{out}");
    assert!(
        out.contains("on this trace, `arena` would have held")
            && out.contains("when the client held the most (")
            && out.contains("at the end (")
            && out.contains("too few events (")
            && out.contains(allocbox_cli::report::MAGAZINE_NOTE),
        "{out}"
    );

    let (code, out) = allocbox_cli(
        &[
            "report",
            "t.txt",
            "-c",
            "bucket-depth=7",
            "-p",
            "size-classes",
            "-o",
            "out.html",
        ],
        &dir,
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("-c bucket-depth=7 comes before any -p"),
        "{out}"
    );

    let (code, out) = allocbox_cli(
        &[
            "replay-trace",
            "t.txt",
            "-p",
            "aligned",
            "-c",
            "alignment=128",
            "-p",
            "size-classes",
            "-c",
            "bucket-depth=7",
        ],
        &dir,
    );
    assert_eq!(
        code, 0,
        "each link of the chain gets its own setting: {out}"
    );
}

/// Issue 61: the magazines note was printed on every page and summary, even for a trace
/// of one 719 MiB block, which no magazine serves.
#[test]
fn the_magazines_note_is_shown_only_for_a_trace_of_requests_magazines_serve() {
    let dir = tempdir("magazine-note");
    std::fs::write(dir.join("big.trace"), "m 1 753926144 1\nf 1 753926144 1\n").unwrap();
    std::fs::write(dir.join("small.trace"), "m 1 64 1\nf 1 64 1\n").unwrap();
    let note = allocbox_cli::report::MAGAZINE_NOTE;
    for (trace, shown) in [("big.trace", false), ("small.trace", true)] {
        let (code, out) = allocbox_cli(&["report", trace, "-p", "default", "-o", "r.html"], &dir);
        assert_eq!(code, 0, "{out}");
        let page = std::fs::read_to_string(dir.join("r.html")).unwrap();
        assert_eq!(out.contains(note), shown, "{trace}: {out}");
        assert_eq!(page.contains("per-thread magazines"), shown, "{trace}");
    }
}

/// Issue 61: a report compares chains too, written `top>next`, each link configured by
/// `-c LINK:KEY=VALUE`; a setting for a link the chain lacks is one line, exit 2.
#[test]
fn a_report_replays_a_chain_with_each_link_s_settings() {
    let dir = tempdir("report-chain");
    std::fs::write(dir.join("t.trace"), "m 1 100 1\nm 2 3000 1\nf 1 100 1\n").unwrap();
    let chain = [
        "report",
        "t.trace",
        "-p",
        "default",
        "-p",
        "aligned>size-classes",
        "-c",
        "aligned:alignment=128",
        "-c",
        "size-classes:bucket-depth=7",
        "-o",
        "r.html",
    ];
    let (code, out) = allocbox_cli(&chain, &dir);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("\naligned>size-classes "), "{out}");
    let (code, out) = allocbox_cli(
        &[
            "report",
            "t.trace",
            "-p",
            "aligned>size-classes",
            "-c",
            "arena:x=1",
            "-o",
            "r.html",
        ],
        &dir,
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("`arena` is no link of the chain `aligned>size-classes`"),
        "{out}"
    );
}
