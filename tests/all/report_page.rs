//! `allocbox report`'s page as headless Chromium lays it out: NumPy's shared trace
//! through three handlers, and a trace recorded with times and sites.

use std::sync::atomic::AtomicU64;

use allocbox::trace::Mark;
use allocbox::trace::parse_trace_marked;
use allocbox::trace::timeline::{Replayed, chain_held, native_held, timeline, timeline_counted};
use allocbox::{MemHandler, NumpyDefault};
use allocbox_cli::report::render_html;

use super::support::*;

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
        timeline_counted(
            label,
            handler,
            held,
            Replayed::held(events, &marks),
            &AtomicU64::new(0),
        )
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
    let times = allocbox_cli::report::TimeAxis::of(&trace.times);
    let recorded = allocbox_cli::report::Recorded {
        times: Some(&times),
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
