//! `allocbox report`: the timelines it collects, the page it writes, the CLI.

use std::sync::atomic::AtomicU64;

use allocbox::trace::timeline::{
    HeldBy, MAX_POINTS, Timeline, chain_held, holdings_at, native_held, size_bucket, timeline,
    timeline_counted,
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
        &trace.events,
        &trace.marks,
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
    let holdings = holdings_at(HeldBy::Chain(&fresh), &trace.events, t.peak_held_at);
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

/// The page for NumPy's trace through three handlers, looked at in headless Chromium:
/// every chart is laid out with a non-zero size and shows its series, no text of a chart
/// overlaps another or leaves its chart, and the page logs no error. Leaves
/// `report.html` and a screenshot, `report.png`, in `target/tmp/report-page/`.
#[test]
fn the_report_page_renders_in_chromium() {
    let Some(chromium) = chromium_or_skip() else {
        return;
    };
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/traces/numpy-core-sample.txt.gz"
    );
    let trace = allocbox::trace::read_trace_marked(path).unwrap_or_else(|e| {
        panic!("{path}: {e}: the NumPy trace lives in shared/ beside the repository")
    });
    // A prefix: the test binary is not optimised; the page looks the same with more.
    let events = &trace.events[..trace.events.len().min(1_000_000)];
    let marks: Vec<Mark> = trace
        .marks
        .into_iter()
        .take_while(|m| m.at < events.len() as u64)
        .collect();
    let timeline = |label: &str, handler: &dyn MemHandler, held: &mut dyn FnMut() -> u64| {
        timeline_counted(label, handler, held, events, &marks, &AtomicU64::new(0))
    };
    let native = NumpyDefault::new();
    let size_classes = handler(&allocbox_artifacts::SIZE_CLASSES, &[]);
    let system = handler(&allocbox_artifacts::SYSTEM, &[]);
    let timelines = [
        timeline("default", &native, &mut native_held(&native)),
        timeline(
            allocbox_artifacts::SIZE_CLASSES.path(),
            &size_classes,
            &mut chain_held(&size_classes),
        ),
        timeline(
            allocbox_artifacts::SYSTEM.path(),
            &system,
            &mut chain_held(&system),
        ),
    ];
    for t in &timelines {
        assert!(
            t.replay.failure.is_none(),
            "{}: {:?}",
            t.label,
            t.replay.failure
        );
    }
    let page = render_html("numpy-core-sample.txt.gz", &timelines, &marks);
    assert!(
        page.len() < 2 << 20,
        "the page stays small: {} bytes",
        page.len()
    );
    for section in [
        "<h2>Peak</h2>",
        "<h2>Phases</h2>",
        "<h2>Left at the end</h2>",
    ] {
        assert!(page.contains(section), "{section}");
    }
    assert!(
        page.contains(", in <code>tests/"),
        "the peak names its test"
    );

    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("report-page");
    std::fs::create_dir_all(&dir).unwrap();
    let report = dir.join("report.html");
    std::fs::write(&report, &page).unwrap();
    // The probe: a copy of the page with a script that measures what Chromium laid out.
    let probe = dir.join("probe.html");
    std::fs::write(
        &probe,
        page.replacen("<head>", &format!("<head>{PROBE}"), 1),
    )
    .unwrap();

    let (verdict, stderr) = probe_in_chromium(&chromium, &dir, &probe);
    // The page has no script and the probe logs nothing: any console line (Chromium
    // writes them as `INFO:CONSOLE(..)] "message", source: ...`) is an error.
    for line in stderr.lines() {
        let page_error = line.contains("Uncaught") || line.contains(":CONSOLE");
        assert!(!page_error, "the page logged: {line}");
    }
    assert_eq!(verdict["errors"], serde_json::json!([]), "script errors");
    let charts = verdict["charts"].as_array().unwrap();
    assert_eq!(charts.len(), 3 * timelines.len() + 1, "{verdict}");
    for chart in charts {
        let name = &chart["caption"];
        assert!(
            chart["width"].as_f64().unwrap() > 200.0 && chart["height"].as_f64().unwrap() > 100.0,
            "{name}: laid out at {}x{}",
            chart["width"],
            chart["height"]
        );
        for drawn in chart["drawn"].as_array().unwrap() {
            assert!(
                drawn.as_u64().unwrap() > 0,
                "{name}: a series not drawn: {chart}"
            );
        }
        assert!(
            chart["texts"].as_u64().unwrap() >= 5,
            "{name}: axis labels: {chart}"
        );
        assert_eq!(
            chart["overlaps"],
            serde_json::json!([]),
            "{name}: text overlaps"
        );
        assert_eq!(
            chart["outside"],
            serde_json::json!([]),
            "{name}: text clipped"
        );
    }
    assert!(verdict["tableRows"].as_u64().unwrap() == timelines.len() as u64);

    let shot = dir.join("report.png");
    let _ = std::fs::remove_file(&shot);
    run_browser(
        &chromium,
        &headless(
            &dir,
            &[
                format!("--screenshot={}", shot.display()),
                "--window-size=1400,2000".to_string(),
                "--hide-scrollbars".to_string(),
                format!("file://{}", report.display()),
            ],
        ),
    );
    let png = std::fs::read(&shot).expect("chromium wrote the screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 50_000,
        "{} bytes",
        png.len()
    );
}

#[test]
fn a_page_of_a_trace_with_times_and_sites_has_a_time_axis_and_tables_by_line_in_chromium() {
    let Some(chromium) = chromium_or_skip() else {
        return;
    };
    // Three lines of a program: one makes small arrays, one the peak, one keeps a few.
    let mut text = String::from(
        "#@site 1 5 small job.py\n#@site 2 9 build_peak job.py\n#@site 3 14 keep job.py\n",
    );
    let mut id = 0;
    let mut t = 0u64;
    for round in 0..200u64 {
        id += 1;
        t += 1_000_000;
        text += &format!("m {id} 800 1 s=1 t={t}\nf {id} 800 1 t={}\n", t + 500);
        if round == 120 {
            for big in 0..4 {
                text += &format!("m {} 8000000 1 s=2 t={}\n", 10_000 + big, t + 600 + big);
            }
            for big in 0..4 {
                text += &format!("f {} 8000000 1 t={}\n", 10_000 + big, t + 900);
            }
        }
        if round % 50 == 0 {
            text += &format!("m {} 4096 1 s=3 t={}\n", 20_000 + round, t + 700);
        }
    }
    let trace = parse_trace_marked(text.as_bytes()).unwrap();
    let found = allocbox::trace::by_site::by_site(&trace.events, &trace.sites);
    assert_eq!(found.at_peak[0].site, 2);
    assert_eq!(
        (found.never_freed[0].site, found.never_freed[0].blocks),
        (3, 4)
    );
    let native = NumpyDefault::new();
    let system = handler(&allocbox_artifacts::SYSTEM, &[]);
    let timelines = [
        timeline("default", &native, native_held(&native), &trace.events),
        timeline("system", &system, chain_held(&system), &trace.events),
    ];
    let recorded = allocbox_cli::report::Recorded {
        times: &trace.times,
        lines: Some((&found, &trace.site_table)),
    };
    let page = allocbox_cli::report::render_page("job.trace", &timelines, &[], &recorded);

    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("report-lines");
    std::fs::create_dir_all(&dir).unwrap();
    let probe = dir.join("probe.html");
    std::fs::write(
        &probe,
        page.replacen("<head>", &format!("<head>{LINES_PROBE}"), 1),
    )
    .unwrap();
    let (verdict, _) = probe_in_chromium(&chromium, &dir, &probe);
    let first: Vec<&str> = verdict["first"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(first[..2], ["job.py:9", "build_peak"], "{verdict}");
    let bars: Vec<f64> = verdict["bars"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_f64().unwrap())
        .collect();
    // At the peak: the four large arrays, and the three small ones kept so far.
    assert!(
        bars.len() == 2 && bars[0] > 50.0 && bars[0] > bars[1],
        "a bar per line, to scale: {verdict}"
    );
    assert_eq!(verdict["leaked"], 1, "{verdict}");
    assert_eq!(
        verdict["timeAxes"], 6,
        "every chart over the trace is over time (3 per handler): {verdict}"
    );
    assert_eq!(
        verdict["links"], verdict["rows"],
        "each row links to the timeline: {verdict}"
    );
}

/// The tables by line and the x axes, as Chromium laid them out.
const LINES_PROBE: &str = r#"<script>
window.addEventListener("load", () => {
  const rows = [...document.querySelectorAll("table.at-peak tbody tr")];
  const verdict = {
    rows: rows.length,
    first: [...rows[0].querySelectorAll("td")].slice(0, 2).map((td) => td.textContent),
    bars: rows.map((r) => r.querySelector("td.bar span").getBoundingClientRect().width),
    links: rows.filter((r) => r.querySelector("a[href='#timeline']")).length,
    leaked: document.querySelectorAll("table.never-freed tbody tr").length,
    timeAxes: [...document.querySelectorAll("svg text")]
      .filter((t) => t.textContent.trim() === "seconds since the recording started").length,
  };
  const pre = document.createElement("pre");
  pre.id = "verdict";
  pre.textContent = JSON.stringify(verdict);
  document.body.appendChild(pre);
});
</script>"#;

/// Measures every chart on load and writes a JSON verdict into the DOM: each chart's
/// size, per expected series (the colors in `data-series`) how many drawn elements have
/// that color and a non-zero extent, texts that overlap or stick out of their chart,
/// and every error the page raised.
const PROBE: &str = r#"<script>
window.__errors = [];
window.addEventListener("error", (e) => window.__errors.push(String(e.message)));
const consoleError = console.error;
console.error = (...args) => { window.__errors.push(args.join(" ")); consoleError(...args); };
window.addEventListener("load", () => {
  const sized = (b) => b.width > 0 || b.height > 0;
  const charts = [...document.querySelectorAll("figure")].map((figure) => {
    const svg = figure.querySelector("svg");
    const box = svg ? svg.getBoundingClientRect() : { width: 0, height: 0 };
    const shapes = svg ? [...svg.querySelectorAll("polyline, rect, path")] : [];
    const drawn = (figure.dataset.series || "").split(" ").filter(Boolean).map((color) =>
      shapes.filter((s) => (s.getAttribute("stroke") === color || s.getAttribute("fill") === color)
        && sized(s.getBoundingClientRect())).length);
    const texts = svg ? [...svg.querySelectorAll("text")].filter((t) => t.textContent.trim()) : [];
    const boxes = texts.map((t) => [t.textContent, t.getBoundingClientRect()]);
    const overlaps = [];
    for (let i = 0; i < boxes.length; i++) {
      for (let j = i + 1; j < boxes.length; j++) {
        const [a, p] = boxes[i], [b, q] = boxes[j];
        const w = Math.min(p.right, q.right) - Math.max(p.left, q.left);
        const h = Math.min(p.bottom, q.bottom) - Math.max(p.top, q.top);
        if (w > 0.5 && h > 0.5) overlaps.push(a + " / " + b);
      }
    }
    const outside = boxes.filter(([_, b]) => b.left < box.left - 0.5 || b.right > box.right + 0.5
      || b.top < box.top - 0.5 || b.bottom > box.bottom + 0.5).map(([t]) => t);
    return { caption: figure.querySelector("figcaption").textContent, width: box.width,
             height: box.height, drawn, texts: texts.length, overlaps, outside };
  });
  const verdict = document.createElement("pre");
  verdict.id = "verdict";
  verdict.textContent = JSON.stringify({ charts, errors: window.__errors,
    tableRows: document.querySelector("table.summary").querySelectorAll("tbody tr").length });
  document.body.appendChild(verdict);
});
</script>"#;

/// Chromium, or `None` where it is not installed and this is not CI (the test is then
/// skipped, and says so on stderr).
fn chromium_or_skip() -> Option<std::path::PathBuf> {
    let found = find_chromium();
    if found.is_none() {
        let fix = "chromium is not installed: `apt-get install chromium` (Debian) so that \
                   the report page can be checked in a browser";
        if std::env::var_os("CI").is_some() {
            panic!("{fix}");
        }
        eprintln!("skipped: {fix}");
    }
    found
}

/// Headless Chromium's arguments, with a profile of its own in `dir`, and `extra`.
fn headless(dir: &std::path::Path, extra: &[String]) -> Vec<String> {
    let mut args = vec![
        "--headless".to_string(),
        "--no-sandbox".to_string(),
        "--disable-gpu".to_string(),
        "--no-first-run".to_string(),
        format!("--user-data-dir={}", dir.join("profile").display()),
    ];
    args.extend_from_slice(extra);
    args
}

/// Load `probe` (a page with a script that writes a JSON verdict into
/// `<pre id="verdict">`) in headless Chromium: the verdict, and Chromium's log.
fn probe_in_chromium(
    chromium: &std::path::Path,
    dir: &std::path::Path,
    probe: &std::path::Path,
) -> (serde_json::Value, String) {
    let (stdout, stderr) = run_browser(
        chromium,
        &headless(
            dir,
            &[
                "--enable-logging=stderr".to_string(),
                "--v=0".to_string(),
                "--virtual-time-budget=5000".to_string(),
                "--window-size=1400,2000".to_string(),
                "--dump-dom".to_string(),
                format!("file://{}", probe.display()),
            ],
        ),
    );
    let verdict = stdout
        .split_once("<pre id=\"verdict\">")
        .and_then(|(_, rest)| rest.split_once("</pre>"))
        .map(|(json, _)| unescape(json))
        .unwrap_or_else(|| panic!("no verdict in the DOM:\n{stdout}\n{stderr}"));
    (serde_json::from_str(&verdict).unwrap(), stderr)
}

fn find_chromium() -> Option<std::path::PathBuf> {
    let names = [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ];
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| names.iter().map(move |n| dir.join(n)))
        .find(|p| p.is_file())
}

/// Run the browser to its end (30 s at most); its stdout and stderr.
fn run_browser(chromium: &std::path::Path, args: &[String]) -> (String, String) {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let mut child = Command::new(chromium)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", chromium.display()));
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let (send, receive) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        let _ = send.send(s);
    });
    let stdout = match receive.recv_timeout(std::time::Duration::from_secs(30)) {
        Ok(s) => s,
        Err(_) => {
            let _ = child.kill();
            panic!("chromium did not finish in 30 s");
        }
    };
    let status = child.wait().unwrap();
    let stderr = reader.join().unwrap();
    assert!(status.success(), "chromium failed ({status}):\n{stderr}");
    (stdout, stderr)
}

/// Undo the escaping of a text node in serialized HTML.
fn unescape(text: &str) -> String {
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
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
        out.contains("the folder `nodir` does not exist") && !out.contains("missing.txt"),
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
    assert!(!dir.join(".old.html.partial").exists());
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
            && out.contains("at the peak (")
            && out.contains("x its time")
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
