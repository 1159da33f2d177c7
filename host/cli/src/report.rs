//! `allocbox report`: the timelines of several handlers through one trace (collected by
//! [`allocbox::trace::timeline`]) drawn side by side on one self-contained HTML page,
//! and the plain-text and JSON summaries printed beside it.
//!
//! The page's charts are in [`charts`], the sections below them in [`sections`], its
//! style sheet is `report/style.css`; the summaries are in [`summary`].

mod charts;
mod lines;
mod sections;
mod summary;
mod times;

use std::fmt::Write as _;

use std::collections::HashMap;

use allocbox::trace::by_site::BySite;
use allocbox::trace::timeline::{SIZE_BUCKETS, Sample, Timeline};
use allocbox::trace::{Mark, Site};

use plotters::style::RGBColor;

use charts::*;
use lines::lines_section;
use sections::{holdings_section, left_section, peak_section, phases_section};
use summary::ratio_text;
pub use summary::{MAGAZINE_NOTE, RATIO_NOTE, bytes, comparisons, summary_table, timeline_json};
pub use times::TimeAxis;

/// The most ticks a chart draws for the marks: about one a pixel column. A trace of a
/// million tests draws a tick where any of them starts, not a million.
const MAX_MARK_TICKS: usize = 1000;

/// The marks' positions on an axis of `max`, one for each of [`MAX_MARK_TICKS`]
/// columns that holds any.
fn mark_ticks(at: impl Iterator<Item = f64>, max: f64) -> Vec<f64> {
    let columns = MAX_MARK_TICKS as f64;
    let column = |x: f64| (x / max.max(f64::MIN_POSITIVE) * columns).clamp(0.0, columns) as usize;
    let mut seen = std::collections::HashSet::new();
    at.filter(|&x| seen.insert(column(x))).collect()
}

#[cfg(test)]
#[test]
fn a_million_marks_draw_at_most_a_tick_a_column() {
    let ticks = mark_ticks((0..1_000_000).map(f64::from), 1_000_000.0);
    assert!(ticks.len() <= MAX_MARK_TICKS + 1, "{}", ticks.len());
    assert_eq!(mark_ticks([5.0, 500.0].into_iter(), 1000.0), [5.0, 500.0]);
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
pub(super) fn short_label(label: &str) -> &str {
    label
        .rsplit(['/', '\\'])
        .next()
        .filter(|s| !s.is_empty())
        .unwrap_or(label)
}

/// What a recording adds to a trace, for the page: each event's time, and the
/// program's lines behind its blocks.
#[derive(Debug, Default)]
pub struct Recorded<'a> {
    /// Nanoseconds since the recording started, through the trace; with them the
    /// charts' x axis is time.
    pub times: Option<&'a TimeAxis>,
    /// The trace's live bytes by line (`by_site`) and the sites it names.
    pub lines: Option<(&'a BySite, &'a HashMap<u32, Site>)>,
}

/// Whose memory a part of the page shows: its lead paragraph and its charts' legend
/// say so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// The host's, through host policies (or NumPy's native default).
    Host,
    /// GPU n's, through device policies on a stand-in GPU.
    Gpu(u16),
}

impl Memory {
    /// What the handlers of the part are, and what their "held" is.
    fn handlers_and_held(self) -> (String, &'static str) {
        match self {
            Memory::Host => (
                "each a policy alone over the host's memory".into(),
                "what the handler holds from the host (for the native default: the C \
                 library's usable sizes of its live blocks)",
            ),
            Memory::Gpu(gpu) => (
                format!(
                    "each a device policy alone over GPU {gpu}'s memory, on a stand-in GPU \
                     (host memory the host treats as the GPU's: no GPU is needed)"
                ),
                "what the policy holds in the regions of the GPU's memory it mapped",
            ),
        }
    }

    fn held_legend(self) -> &'static str {
        match self {
            Memory::Host => "held from host (under live where equal)",
            Memory::Gpu(_) => "held in the GPU's regions (under live where equal)",
        }
    }
}

/// [`render_page`] of a trace without times or sites.
pub fn render_html(trace_name: &str, timelines: &[Timeline], marks: &[Mark]) -> String {
    render_page(trace_name, timelines, marks, &Recorded::default())
}

/// One self-contained HTML page of several traces' parts ([`render_part`]), in order:
/// a program's trace and its child processes' (`allocbox run` names a child's trace
/// `TRACE.PID`). One part is [`render_page`]'s page.
pub fn render_parts(parts: &[(String, String)]) -> String {
    let title = match parts {
        [(name, _)] => format!("allocbox report: {}", escape_html(name)),
        [(name, _), rest @ ..] => format!(
            "allocbox report: {} and {} more trace{}",
            escape_html(name),
            rest.len(),
            if rest.len() == 1 { "" } else { "s" }
        ),
        [] => "allocbox report".to_string(),
    };
    let mut html = format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>{title}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
    );
    if parts.len() > 1 {
        let _ = writeln!(
            html,
            "<p class=\"lead\">{} parts, in order: each trace given (`allocbox run` writes \
             a program's, and its child processes' beside it, each named after the \
             program's with the child's process id), each followed by a part for each GPU \
             whose memory it holds. Each part is replayed on its own, as each process had \
             a policy of its own.</p>\n<ol class=\"traces\">",
            parts.len()
        );
        for (i, (name, _)) in parts.iter().enumerate() {
            let _ = writeln!(
                html,
                "<li><a href=\"#trace-{i}\">{}</a></li>",
                escape_html(name)
            );
        }
        html += "</ol>\n";
    }
    for (i, (_, part)) in parts.iter().enumerate() {
        let _ = writeln!(html, "<section id=\"trace-{i}\">\n{part}</section>");
    }
    html += "</body>\n</html>\n";
    html
}

/// One self-contained HTML page of one trace: [`render_part`] alone.
pub fn render_page(
    trace_name: &str,
    timelines: &[Timeline],
    marks: &[Mark],
    recorded: &Recorded<'_>,
) -> String {
    let part = render_part(trace_name, timelines, marks, recorded, Memory::Host);
    render_parts(&[(trace_name.to_string(), part)])
}

/// One trace's part of a page comparing `timelines` (the trace through several
/// handlers): a heading naming the trace, a summary table, the failures, the peak and the phases (the trace's
/// `marks`, its tests) that reached the most bytes or overhead, what the trace left
/// live at its end, the lines behind the peak and behind what was never freed (when
/// `recorded` has them), and per metric one chart per handler side by side with the
/// same axes, over time when the trace has times. Every text that comes from outside
/// is escaped. `memory` says whose memory the handlers served.
pub fn render_part(
    trace_name: &str,
    timelines: &[Timeline],
    marks: &[Mark],
    recorded: &Recorded<'_>,
    memory: Memory,
) -> String {
    let events_max = timelines
        .iter()
        .filter_map(|t| t.samples.last())
        .map(|s| s.end)
        .max()
        .unwrap_or(1);
    let x = XAxis::new(recorded.times, events_max);
    let samples = || timelines.iter().flat_map(|t| &t.samples);
    let bytes_top = samples().flat_map(|s| [s.live, s.held]).max().unwrap_or(0) as f64;
    let mark_ticks = mark_ticks(marks.iter().map(|m| x.at(m.at)), x.max);
    // Held/live from 1x, which no handler goes under (it holds at least what it lent;
    // 0, nothing live, is drawn at 1x); a policy's line at 1x is drawn over the axis.
    let ratios = || samples().map(|s| s.ratio).filter(|&r| r > 0.0);
    let ratio_lo = ratios().fold(1.0, f64::min);
    let (top, ratio_clipped) = robust_top(ratios());
    let top = top.max(ratio_lo + 0.05);
    let ratio_axis = YAxis::from_floor(
        ratio_lo,
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
    let failed_at = |t: &Timeline| t.replay.failure.as_ref().map(|_| x.at(t.replay.events));
    let series = |t: &Timeline, f: &dyn Fn(&Sample) -> f64| -> Vec<(f64, f64)> {
        let start = t.samples.first().map_or(0.0, f);
        let mut points = vec![(0.0, start)];
        points.extend(t.samples.iter().map(|s| (x.at(s.end), f(s))));
        points
    };

    let mut html = format!("<h1>allocbox report: {}</h1>\n", escape_html(trace_name));
    let events = timelines.iter().map(|t| t.replay.events).max().unwrap_or(0);
    let (handlers, held) = memory.handlers_and_held();
    let _ = writeln!(
        html,
        "<p class=\"lead\">The trace replayed event by event on one thread, in trace order \
         (recorded threads ignored), through {} handler{}, {handlers}: up to {events} \
         events. <i>Live</i> is what the client holds (the sizes it asked for); \
         <i>held</i> is {held}. Charts \
         show windows of events (the most bytes within each); charts of a row share \
         their axes. Sizes in the tables are binary, as NumPy's messages give them \
         (1 KiB = 1024 bytes); the charts' log axes mark powers of ten (1 kB = 1000 \
         bytes).</p>",
        timelines.len(),
        if timelines.len() == 1 { "" } else { "s" },
    );
    if let Some(step) = recorded.times.and_then(TimeAxis::clock_step) {
        let _ = writeln!(
            html,
            "<p class=\"note\">The recording's times advance in steps of {:.1} ms (its \
             clock's resolution): events within one step share a time, and the charts \
             over time place them so.</p>",
            step as f64 / 1e6
        );
    }

    html += "<h2>Summary</h2>\n<table class=\"summary\">\n<thead><tr><th>handler</th>\
             <th>policy</th><th>events</th><th>ns/event<br>median</th><th>ns/event<br>p99</th>\
             <th>peak<br>live</th><th>peak<br>held</th><th>held/live<br>at peak live</th>\
             <th>final<br>live</th><th>final<br>held</th>\
             <th>final<br>held/live</th><th>failure</th></tr></thead>\n<tbody>\n";
    for t in timelines {
        let failed = t.replay.failure.is_some();
        let _ = writeln!(
            html,
            "<tr><td class=\"name\" title=\"{}\">{}</td><td class=\"name\">{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td class=\"{}\">{}</td></tr>",
            escape_html(&t.label),
            escape_html(short_label(&t.label)),
            escape_html(&t.handler),
            t.replay.events,
            t.ns_median,
            t.ns_p99,
            bytes(t.peak_live),
            bytes(t.peak_held),
            ratio_text(t.ratio_at_peak_live()),
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
    if memory == Memory::Host && timelines.iter().any(summary::has_small_requests) {
        let _ = writeln!(html, "<p class=\"note\">{}</p>", escape_html(MAGAZINE_NOTE));
    }

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
            [
                (LIVE_COLOR, "live (client)"),
                (HELD_COLOR, memory.held_legend()),
            ]
            .into_iter()
            // The marks' tick only where the trace has marks (a test suite's).
            .chain((!marks.is_empty()).then_some((MARK_COLOR, "a test starts")))
            .collect(),
            &|t| {
                bytes_chart(
                    &x,
                    bytes_top,
                    // Held first: where the two are equal, live is drawn on top.
                    &[
                        (HELD_COLOR, series(t, &|s| s.held as f64)),
                        (LIVE_COLOR, series(t, &|s| s.live as f64)),
                    ],
                    &mark_ticks,
                    (x.at(t.peak_live_at), t.peak_live as f64),
                    failed_at(t),
                )
            },
        ),
        (
            ("Overhead: held / live", ratio_clipped),
            vec![(RATIO_COLOR, "highest held / live in the window")],
            &|t| {
                line_chart(
                    &x,
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
                    &x,
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
        // The bytes over time are what the tables by line link to.
        let id = if row == 0 { " id=\"timeline\"" } else { "" };
        let _ = writeln!(
            html,
            "<h2{id}>{heading} {}{note}</h2>\n<div class=\"row\" style=\"grid-template-columns: \
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
            // The sizes are the trace's own, not one handler's.
            let (label, short, handler) = match row == size_row {
                true => ("every handler", "every handler", "the trace's requests"),
                false => (t.label.as_str(), short_label(&t.label), t.handler.as_str()),
            };
            let _ = writeln!(
                html,
                "<figure data-series=\"{}\"><figcaption title=\"{}\">{} <span>{}</span>{}\
                 </figcaption>\n{}\n</figure>",
                colors.join(" "),
                escape_html(label),
                escape_html(short),
                escape_html(handler),
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
            if let Some((by_site, sites)) = recorded.lines {
                html += &lines_section(by_site, sites, &x);
            }
            html += &phases_section(timelines);
            html += &holdings_section(timelines);
            html += &left_section(timelines);
        }
    }
    html
}

const STYLE: &str = include_str!("report/style.css");
