//! `allocbox report`: the timelines of several handlers through one trace (collected by
//! [`allocbox::trace::timeline`]) drawn side by side on one self-contained HTML page,
//! and the plain-text and JSON summaries printed beside it.
//!
//! The page's charts are in [`charts`]; its style sheet is `report/style.css`.

mod charts;

use std::fmt::Write as _;

use allocbox::trace::Mark;
use allocbox::trace::timeline::{Holdings, Phase, SIZE_BUCKETS, Sample, Timeline};
use plotters::style::RGBColor;

use charts::*;

/// The plain-text summary: one row per handler.
pub fn summary_table(timelines: &[Timeline]) -> String {
    let mut rows = vec![[
        "handler".to_string(),
        "events".to_string(),
        "ns/event p50".to_string(),
        "p99".to_string(),
        "peak live".to_string(),
        "peak held".to_string(),
        "peak ratio".to_string(),
        "final ratio".to_string(),
        "failure".to_string(),
    ]];
    for t in timelines {
        rows.push([
            t.label.clone(),
            t.replay.events.to_string(),
            t.ns_median.to_string(),
            t.ns_p99.to_string(),
            bytes(t.peak_live),
            bytes(t.peak_held),
            ratio_text(t.peak_ratio),
            ratio_text(t.final_ratio()),
            t.failure_text().unwrap_or_else(|| "none".to_string()),
        ]);
    }
    let mut widths = [0; 9];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let mut line = String::new();
        for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
            match i {
                0 | 8 => write!(line, "{cell:<w$}  "),
                _ => write!(line, "{cell:>w$}  "),
            }
            .expect("writing to a String");
        }
        out += line.trim_end();
        out.push('\n');
    }
    out
}

fn ratio_text(r: Option<f64>) -> String {
    r.map_or("-".to_string(), |r| format!("{r:.2}x"))
}

/// `bytes` in binary units: `512 B`, `1.5 KiB`, `12.0 MiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if v < 10.0 {
        format!("{v:.1} {}", UNITS[unit])
    } else {
        format!("{v:.0} {}", UNITS[unit])
    }
}

/// A timeline's summary as JSON (what `allocbox report --json` prints, one per
/// handler).
pub fn timeline_json(timeline: &Timeline) -> serde_json::Value {
    let failure = timeline.replay.failure.as_ref().map(|(event, error)| {
        serde_json::json!({
            "line": event.line,
            "event": event.to_string(),
            "error": error.to_string(),
        })
    });
    serde_json::json!({
        "label": timeline.label,
        "handler": timeline.handler,
        "events": timeline.replay.events,
        "seconds": timeline.replay.elapsed.as_secs_f64(),
        "ns_per_event_median": timeline.ns_median,
        "ns_per_event_p99": timeline.ns_p99,
        "ns_per_event_max": timeline.ns_max,
        "peak_live_bytes": timeline.peak_live,
        "peak_held_bytes": timeline.peak_held,
        "held_at_peak_live_bytes": timeline.held_at_peak_live,
        "ratio_at_peak_live": timeline.ratio_at_peak_live(),
        "peak_ratio": timeline.peak_ratio,
        "final_live_bytes": timeline.final_live,
        "final_held_bytes": timeline.final_held,
        "final_ratio": timeline.final_ratio(),
        "out_of_memory": timeline.replay.out_of_memory,
        "unknown_ids": timeline.replay.unknown_ids,
        "failure": failure,
        "leak": timeline.replay.leak.as_ref().map(ToString::to_string),
    })
}

/// Text for HTML, escaped: everything a policy names itself or says in an error comes
/// from the guest, which may be hostile.
pub fn escape_html(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The last part of a path (a policy file's name), or the whole label.
fn short_label(label: &str) -> &str {
    label
        .rsplit(['/', '\\'])
        .next()
        .filter(|s| !s.is_empty())
        .unwrap_or(label)
}

/// One self-contained HTML page comparing `timelines` (the same trace through several
/// handlers): a summary table, the failures, the peak and the phases (the trace's
/// `marks`, its tests) that reached the most bytes or overhead, what the trace left
/// live at its end, and per metric one chart per handler side by side with the same
/// axes. Every text that comes from outside is escaped.
pub fn render_html(trace_name: &str, timelines: &[Timeline], marks: &[Mark]) -> String {
    let x_max = timelines
        .iter()
        .filter_map(|t| t.samples.last())
        .map(|s| s.end as f64)
        .fold(1.0, f64::max);
    let samples = || timelines.iter().flat_map(|t| &t.samples);
    let bytes_top = samples().flat_map(|s| [s.live, s.held]).max().unwrap_or(0) as f64;
    let mark_ticks: Vec<u64> = marks.iter().map(|m| m.at).collect();
    // Held/live from the lowest seen (at most 1x); 0 (nothing live) is drawn there.
    let ratios = || samples().map(|s| s.ratio).filter(|&r| r > 0.0);
    let ratio_lo = ratios().fold(1.0, f64::min);
    let (top, ratio_clipped) = robust_top(ratios());
    let top = top.max(ratio_lo + 0.05);
    // A margin below the lowest, so that a line at 1x is not hidden in the axis.
    let ratio_axis = YAxis::new(
        ratio_lo - (top - ratio_lo) * 0.05,
        top + (top - ratio_lo) * 0.02,
        &decimal_steps(),
        &|y: &f64| format!("{}x", trim_float(*y)),
    );
    let ratio_lo = ratio_axis.range.start;
    let (top, time_clipped) = robust_top(samples().map(|s| f64::from(s.ns_median)));
    let time_axis = YAxis::new(0.0, top.max(1.0) * 1.05, &decimal_steps(), &|y: &f64| {
        count(*y)
    });
    let used: Vec<usize> = (0..SIZE_BUCKETS)
        .filter(|&b| timelines.iter().any(|t| t.sizes[b] > 0))
        .collect();
    let buckets = match (used.first(), used.last()) {
        (Some(&lo), Some(&hi)) => (lo, hi + 1),
        _ => (0, 1),
    };
    let size_max = timelines.iter().flat_map(|t| t.sizes).max().unwrap_or(1);
    let failed_at = |t: &Timeline| t.replay.failure.as_ref().map(|_| t.replay.events as f64);
    let series = |t: &Timeline, f: &dyn Fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        let start = t.samples.first().map_or(0.0, f);
        let mut points = vec![(0.0, start)];
        points.extend(t.samples.iter().map(|s| (s.end as f64, f(s))));
        points
    };

    let mut html = String::new();
    let title = format!("allocbox report: {}", escape_html(trace_name));
    let _ = write!(
        html,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>{title}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<h1>{title}</h1>\n"
    );
    let events = timelines.iter().map(|t| t.replay.events).max().unwrap_or(0);
    let _ = writeln!(
        html,
        "<p class=\"lead\">The trace replayed event by event on one thread, in trace order \
         (recorded threads ignored), through {} handler{}, each a policy alone over the \
         host's memory: up to {events} events. <i>Live</i> is what the client holds (the \
         sizes it asked for); <i>held</i> is what the handler holds from the host (for \
         the native default: the C library's usable sizes of its live blocks). Charts \
         show windows of events (the most bytes within each); charts of a row share \
         their axes.</p>",
        timelines.len(),
        if timelines.len() == 1 { "" } else { "s" },
    );

    html += "<h2>Summary</h2>\n<table class=\"summary\">\n<thead><tr><th>handler</th>\
             <th>policy</th><th>events</th><th>ns/event<br>median</th><th>ns/event<br>p99</th>\
             <th>peak<br>live</th><th>peak<br>held</th><th>held/live<br>at peak live</th>\
             <th>peak<br>held/live</th><th>final<br>live</th><th>final<br>held</th>\
             <th>final<br>held/live</th><th>failure</th></tr></thead>\n<tbody>\n";
    for t in timelines {
        let failed = t.replay.failure.is_some();
        let _ = writeln!(
            html,
            "<tr><td class=\"name\" title=\"{}\">{}</td><td class=\"name\">{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td class=\"{}\">{}</td></tr>",
            escape_html(&t.label),
            escape_html(short_label(&t.label)),
            escape_html(&t.handler),
            t.replay.events,
            t.ns_median,
            t.ns_p99,
            bytes(t.peak_live),
            bytes(t.peak_held),
            ratio_text(t.ratio_at_peak_live()),
            ratio_text(t.peak_ratio),
            bytes(t.final_live),
            bytes(t.final_held),
            ratio_text(t.final_ratio()),
            if failed { "failed" } else { "ok" },
            if failed {
                format!(
                    "line {}",
                    t.replay.failure.as_ref().map_or(0, |(e, _)| e.line)
                )
            } else {
                "none".to_string()
            },
        );
    }
    html += "</tbody>\n</table>\n";

    html += "<h2>First failure</h2>\n<ul class=\"failures\">\n";
    for t in timelines {
        let _ = match &t.replay.failure {
            None if t.replay.leak.is_some() => writeln!(
                html,
                "<li class=\"failed\"><b>{}</b>: a leak, after the last event:<br><code>{}</code></li>",
                escape_html(&t.label),
                escape_html(&t.failure_text().unwrap_or_default()),
            ),
            None => writeln!(html, "<li><b>{}</b>: none</li>", escape_html(&t.label)),
            Some((event, error)) => writeln!(
                html,
                "<li class=\"failed\"><b>{}</b>: at event {} of the replay, trace {}:<br>\
                 <code>{}</code></li>",
                escape_html(&t.label),
                t.replay.events,
                escape_html(&event.to_string()),
                escape_html(&error.to_string()),
            ),
        };
    }
    html += "</ul>\n";
    if timelines.iter().any(|t| t.replay.failure.is_some()) {
        html += "<p class=\"note\">A handler's replay stops at its first failure; a red \
                 vertical line marks it in the handler's charts.</p>\n";
    }

    type Chart<'a> = &'a dyn Fn(&Timeline) -> String;
    /// A row of charts: heading, whether spikes are cut, legend, one chart's drawing.
    type Row<'a> = ((&'a str, bool), Vec<(RGBColor, &'a str)>, Chart<'a>);
    let rows: [Row<'_>; 4] = [
        (
            ("Bytes over time (log scale)", false),
            vec![
                (LIVE_COLOR, "live (client)"),
                (HELD_COLOR, "held from host (under live where equal)"),
                (MARK_COLOR, "a test starts"),
            ],
            &|t| {
                bytes_chart(
                    x_max,
                    bytes_top,
                    // Held first: where the two are equal, live is drawn on top.
                    &[
                        (HELD_COLOR, series(t, &|s| s.held as f64)),
                        (LIVE_COLOR, series(t, &|s| s.live as f64)),
                    ],
                    &mark_ticks,
                    (t.peak_live_at as f64, t.peak_live as f64),
                    failed_at(t),
                )
            },
        ),
        (
            ("Overhead: held / live", ratio_clipped),
            vec![(RATIO_COLOR, "highest held / live in the window")],
            &|t| {
                line_chart(
                    x_max,
                    &ratio_axis,
                    &[(RATIO_COLOR, series(t, &|s| s.ratio.max(ratio_lo)))],
                    failed_at(t),
                )
            },
        ),
        (
            ("Time per event", time_clipped),
            vec![(TIME_COLOR, "median ns per event in the window")],
            &|t| {
                line_chart(
                    x_max,
                    &time_axis,
                    &[(TIME_COLOR, series(t, &|s| f64::from(s.ns_median)))],
                    failed_at(t),
                )
            },
        ),
        (
            ("Request sizes", false),
            vec![(
                SIZE_COLOR,
                "the trace's malloc, calloc and realloc requests per log2 size bucket \
                 (the same for every handler)",
            )],
            &|t| size_chart(t, buckets, size_max),
        ),
    ];
    let columns = timelines.len().max(1);
    let size_row = rows.len() - 1;
    for (row, ((heading, clipped), entries, chart)) in rows.into_iter().enumerate() {
        // Every handler replays the same requests: their sizes are drawn once.
        let (shown, columns) = match row == size_row {
            true => (&timelines[..timelines.len().min(1)], 1),
            false => (timelines, columns),
        };
        let note = match clipped {
            true => {
                " <span class=\"note\">(spikes above the axis are cut; the peaks are in the summary)</span>"
            }
            false => "",
        };
        let _ = writeln!(
            html,
            "<h2>{heading} {}{note}</h2>\n<div class=\"row\" style=\"grid-template-columns: \
             repeat({columns}, minmax(0, {}))\">",
            legend(&entries),
            if columns == 1 && timelines.len() > 1 {
                "32em"
            } else {
                "1fr"
            },
        );
        let colors: Vec<String> = entries.iter().map(|(c, _)| hex(*c)).collect();
        for t in shown {
            let _ = writeln!(
                html,
                "<figure data-series=\"{}\"><figcaption title=\"{}\">{} <span>{}</span>{}\
                 </figcaption>\n{}\n</figure>",
                colors.join(" "),
                escape_html(&t.label),
                escape_html(short_label(&t.label)),
                escape_html(&t.handler),
                match failed_at(t) {
                    Some(at) => format!(" <span class=\"failed\">failed at event {at}</span>"),
                    None => String::new(),
                },
                chart(t)
            );
        }
        html += "</div>\n";
        if row == 0 {
            // Right under the chart of bytes: where its peak and its phases are.
            html += &peak_section(timelines, marks);
            html += &phases_section(timelines);
            html += &holdings_section(timelines);
            html += &left_section(timelines);
        }
    }
    html += "</body>\n</html>\n";
    html
}

/// Where and when each handler's client held the most, in which test, and what the
/// handler held then.
fn peak_section(timelines: &[Timeline], marks: &[Mark]) -> String {
    let mut html = String::from(
        "<h2>Peak</h2>\n<p class=\"explain\"><i>Held/live</i> is the bytes a handler holds \
         from the host for each byte its client holds: 1x is no overhead, 2x means half of \
         what it holds is not in use by the client (kept for reuse, rounded up, or \
         fragmented). Where the client holds little, a small cache makes it large, so the \
         ratio that matters is the one at the peak.</p>\n<ul class=\"peaks\">\n",
    );
    for t in timelines {
        // The phase is the last mark at or before the peak's event.
        let test = marks
            .partition_point(|m| m.at < t.peak_live_at)
            .checked_sub(1)
            .map(|i| marks[i].text.as_str());
        let _ = writeln!(
            html,
            "<li><b>{}</b>: the client held the most, {}, after event {}{}; the handler then \
             held {} from the host ({} the client's bytes).</li>",
            escape_html(short_label(&t.label)),
            bytes(t.peak_live),
            t.peak_live_at,
            test.map_or(String::new(), |name| format!(
                ", in <code>{}</code>",
                escape_html(name)
            )),
            bytes(t.held_at_peak_live),
            ratio_text(t.ratio_at_peak_live()),
        );
    }
    html + "</ul>\n"
}

/// The phases (tests) to look at first: the most live bytes, and the most overhead at
/// their own peak.
fn phases_section(timelines: &[Timeline]) -> String {
    const SHOWN: usize = 10;
    const RATIO_FLOOR: u64 = 1 << 20;
    let Some(first) = timelines.first() else {
        return String::new();
    };
    let named = first.phases.iter().filter(|p| !p.name.is_empty()).count();
    if named == 0 {
        return String::new();
    }
    let trace_peak = first.peak_live.max(1);
    let by = |key: &dyn Fn(&Phase) -> f64, floor: u64| -> Vec<usize> {
        let mut order: Vec<usize> = (0..first.phases.len())
            .filter(|&i| first.phases[i].peak_live >= floor)
            .collect();
        order.sort_by(|&a, &b| {
            let best = |i: usize| {
                timelines
                    .iter()
                    .filter_map(|t| phase_of(t, i))
                    .map(key)
                    .fold(0.0, f64::max)
            };
            best(b).total_cmp(&best(a))
        });
        order.truncate(SHOWN);
        order
    };
    let by_peak = by(&|p| p.peak_live as f64, 1);
    // Overhead matters where there are bytes to waste: a tiny phase's ratio is noise.
    let by_ratio = by(
        &|p| p.ratio_at_peak_live().unwrap_or(0.0),
        RATIO_FLOOR.min(trace_peak),
    );
    let mut html = format!(
        "<h2>Phases</h2>\n<p class=\"explain\">The trace's comment lines divide it into {named} \
         phases (the tests that made its events). Each cell: the phase's peak live bytes, \
         and the handler's held/live at that peak.</p>\n"
    );
    for (title, order) in [
        ("By peak live bytes", &by_peak),
        (
            "By held/live at their peak (phases whose peak live is at least 1 MiB, or the \
             trace's peak if less)",
            &by_ratio,
        ),
    ] {
        let _ = write!(
            html,
            "<h3>{title}</h3>\n<table class=\"summary phases\">\n<thead><tr><th>test</th><th>events</th>"
        );
        for t in timelines {
            let _ = write!(html, "<th>{}</th>", escape_html(short_label(&t.label)));
        }
        html += "</tr></thead>\n<tbody>\n";
        for &i in order {
            let p = &first.phases[i];
            let name = if p.name.is_empty() {
                "(before the first test)"
            } else {
                &p.name
            };
            let _ = write!(
                html,
                "<tr><td class=\"name\">{}</td><td>{}&ndash;{}</td>",
                escape_html(name),
                p.start,
                p.end
            );
            for t in timelines {
                let _ = match phase_of(t, i) {
                    Some(p) => write!(
                        html,
                        "<td>{} &middot; {}</td>",
                        bytes(p.peak_live),
                        ratio_text(p.ratio_at_peak_live())
                    ),
                    None => write!(html, "<td>not reached</td>"),
                };
            }
            html += "</tr>\n";
        }
        html += "</tbody>\n</table>\n";
    }
    html
}

/// Where what each handler held went when it held the most, by the size class of the
/// client's blocks: held, live and wasted bytes, side by side.
fn holdings_section(timelines: &[Timeline]) -> String {
    let shown: Vec<(&Timeline, &Holdings)> = timelines
        .iter()
        .filter_map(|t| Some((t, t.holdings.as_ref()?)))
        .collect();
    if shown.is_empty() {
        return String::new();
    }
    let mut html = String::from(
        "<h2>Held and wasted, by size class</h2>\n<p class=\"explain\">When each handler \
         held the most from the host, where those bytes went: each block it held is shared \
         among the client's blocks inside it, in proportion to their sizes. <i>Wasted</i> \
         is held less live: headers, rounding up and room kept inside blocks; <i>idle</i> \
         blocks hold no client block at all (caches, free room).</p>\n\
         <div class=\"row holdings\">\n",
    );
    for (t, holdings) in shown {
        let _ = write!(
            html,
            "<figure><figcaption>{} <span>after event {}</span></figcaption>\n\
             <table class=\"summary\"><thead><tr><th>size</th><th>blocks</th><th>live</th>\
             <th>held</th><th>wasted</th><th>held/live</th></tr></thead>\n<tbody>\n",
            escape_html(short_label(&t.label)),
            holdings.at,
        );
        for (bucket, &(blocks, live, held)) in holdings.classes.iter().enumerate() {
            if blocks == 0 {
                continue;
            }
            let _ = writeln!(
                html,
                "<tr><td>from {}</td><td>{blocks}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td>{}</td></tr>",
                bucket_floor(bucket),
                bytes(live),
                bytes(held),
                bytes(held.saturating_sub(live)),
                ratio_text((live > 0).then(|| held as f64 / live as f64)),
            );
        }
        let (idle_blocks, idle) = holdings.idle;
        let _ = writeln!(
            html,
            "<tr><td>idle</td><td>{idle_blocks}</td><td>0 B</td><td>{}</td><td>{}</td>\
             <td>-</td></tr>\n</tbody>\n</table>\n</figure>",
            bytes(idle),
            bytes(idle)
        );
    }
    html + "</div>\n"
}

/// The smallest size in a size bucket, in bytes: `0 B`, `64 B`, `1.0 KiB`.
fn bucket_floor(bucket: usize) -> String {
    match bucket {
        0 => bytes(0),
        b => bytes(1 << (b - 1)),
    }
}

/// Phase `i` of a handler's replay: every handler replays the same phases, but one that
/// stopped at a failure has fewer.
fn phase_of(t: &Timeline, i: usize) -> Option<&Phase> {
    t.phases.get(i).filter(|p| p.end > p.start)
}

/// What the trace left live at its end, by size, and what each handler held then.
fn left_section(timelines: &[Timeline]) -> String {
    let Some(first) = timelines.first() else {
        return String::new();
    };
    let (blocks, total): (u64, u64) = first
        .left_live
        .iter()
        .fold((0, 0), |(b, s), l| (b + l.0, s + l.1));
    let mut html = format!(
        "<h2>Left at the end</h2>\n<p class=\"explain\">Blocks the trace never freed: {blocks} \
         blocks, {} (the client's leaks, or blocks of a recording that stopped mid-way). \
         The replay frees them after the last event and trims; a handler that still holds \
         host memory then has leaked it, and fails.</p>\n",
        bytes(total)
    );
    if blocks > 0 {
        html += "<table class=\"summary\">\n<thead><tr><th>size</th><th>blocks</th><th>bytes</th></tr></thead>\n<tbody>\n";
        for (bucket, &(n, size)) in first.left_live.iter().enumerate().filter(|(_, l)| l.0 > 0) {
            let _ = writeln!(
                html,
                "<tr><td>from {}</td><td>{n}</td><td>{}</td></tr>",
                bucket_floor(bucket),
                bytes(size)
            );
        }
        html += "</tbody>\n</table>\n";
    }
    html += "<ul class=\"peaks\">\n";
    for t in timelines {
        let _ = writeln!(
            html,
            "<li><b>{}</b>: held {} from the host after the last event ({} the bytes left \
             live); after freeing them and trimming: {}.</li>",
            escape_html(short_label(&t.label)),
            bytes(t.final_held),
            ratio_text(t.final_ratio()),
            match &t.replay.leak {
                Some(leak) => format!(
                    "<span class=\"failed\">{}</span>",
                    escape_html(&leak.to_string())
                ),
                None if t.replay.failure.is_some() => "not reached (the replay failed)".to_string(),
                None => "nothing held".to_string(),
            }
        );
    }
    html + "</ul>\n"
}

const STYLE: &str = include_str!("report/style.css");
