//! How handlers serve a trace over time: [`timeline`] replays a trace through one
//! handler on one thread in trace order, timing every event and sampling the bytes the
//! client holds and the bytes the handler holds from the host; [`render_html`] draws
//! the timelines of several handlers side by side on one self-contained HTML page
//! (`allocbox report`).
//!
//! Unlike [`crate::trace::replay_trace`] (the benchmark), a timeline ignores the
//! recorded threads: a report is about the trace's timeline, so its events run one
//! after another, each timed on its own.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use plotters::coord::Shift;
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;

use crate::fasthash::FastMap;
use crate::handler::Handler;
use crate::memhandler::{MemHandler, Stats};
use crate::trace::{Event, EventOp, Held, ReplayReport};

/// The most samples a timeline keeps per series: events are sampled in windows of
/// `ceil(events / MAX_POINTS)`.
pub const MAX_POINTS: usize = 2000;

/// Request-size buckets: bucket 0 is size 0, bucket `b` is `2^(b-1) ..= 2^b - 1`.
pub const SIZE_BUCKETS: usize = 65;

/// One window of events of a [`Timeline`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Events replayed up to the end of the window (the x of every chart).
    pub end: u64,
    /// The most bytes the client held at once during the window (the sizes it asked
    /// for, summed over its live blocks).
    pub live: u64,
    /// The most bytes the handler held from the host at once during the window.
    pub held: u64,
    /// The highest `held / live` after an event of the window (`0` while the client
    /// holds nothing).
    pub ratio: f64,
    /// Mean nanoseconds per event in the window.
    pub ns_per_event: f64,
    /// Median nanoseconds per event in the window: unlike the mean, not moved by the
    /// odd event that waited for the OS.
    pub ns_median: u32,
}

/// One handler's run through a trace, as a report shows it.
#[derive(Debug)]
pub struct Timeline {
    /// What the handler was called on the command line (a policy file, `default`).
    pub label: String,
    /// The handler's own name (a chain's: its top policy's).
    pub handler: String,
    /// Counts, corrections, the handler's statistics and the first failure; `elapsed`
    /// is the sum of the events' own times.
    pub replay: ReplayReport,
    /// Events per sample.
    pub every: u64,
    pub samples: Vec<Sample>,
    /// Allocation requests (malloc, calloc, realloc) per size bucket ([`SIZE_BUCKETS`]).
    pub sizes: [u64; SIZE_BUCKETS],
    pub peak_live: u64,
    pub peak_held: u64,
    /// What the handler held from the host when the client held the most.
    pub held_at_peak_live: u64,
    /// The most held/live seen after any event, `None` if the client never held a
    /// byte.
    pub peak_ratio: Option<f64>,
    /// Bytes live and held after the last replayed event (before the replay frees
    /// what the trace left live).
    pub final_live: u64,
    pub final_held: u64,
    /// Per-event time: median, 99th percentile and most, in nanoseconds.
    pub ns_median: u64,
    pub ns_p99: u64,
    pub ns_max: u64,
}

impl Timeline {
    /// Held/live at the end of the trace; `None` when the client held nothing then.
    pub fn final_ratio(&self) -> Option<f64> {
        ratio(self.final_held, self.final_live)
    }

    /// Held/live when the client held the most.
    pub fn ratio_at_peak_live(&self) -> Option<f64> {
        ratio(self.held_at_peak_live, self.peak_live)
    }

    /// The first failure, as the report words it: `line N: `op id size`: error`.
    pub fn failure_text(&self) -> Option<String> {
        self.replay
            .failure
            .as_ref()
            .map(|(event, error)| format!("{event}: {error}"))
    }

    /// The summary as JSON (what `allocbox report --json` prints, one per handler).
    pub fn to_json(&self) -> serde_json::Value {
        let failure = self.replay.failure.as_ref().map(|(event, error)| {
            serde_json::json!({
                "line": event.line,
                "event": event.to_string(),
                "error": error.to_string(),
            })
        });
        serde_json::json!({
            "label": self.label,
            "handler": self.handler,
            "events": self.replay.events,
            "seconds": self.replay.elapsed.as_secs_f64(),
            "ns_per_event_median": self.ns_median,
            "ns_per_event_p99": self.ns_p99,
            "ns_per_event_max": self.ns_max,
            "peak_live_bytes": self.peak_live,
            "peak_held_bytes": self.peak_held,
            "held_at_peak_live_bytes": self.held_at_peak_live,
            "ratio_at_peak_live": self.ratio_at_peak_live(),
            "peak_ratio": self.peak_ratio,
            "final_live_bytes": self.final_live,
            "final_held_bytes": self.final_held,
            "final_ratio": self.final_ratio(),
            "out_of_memory": self.replay.out_of_memory,
            "unknown_ids": self.replay.unknown_ids,
            "failure": failure,
        })
    }
}

fn ratio(held: u64, live: u64) -> Option<f64> {
    (live > 0).then(|| held as f64 / live as f64)
}

/// `handler`'s statistics, for a replay in this process: a handler whose calls all came
/// from this process's live threads is always reachable.
pub(crate) fn stats_of(handler: &dyn MemHandler) -> Stats {
    handler
        .stats()
        .expect("a handler this process's live threads called is reachable")
}

fn held_from_host(handler: &Handler) -> (usize, u64) {
    handler
        .held_from_host()
        .expect("a handler this process's live threads called is reachable")
}

/// What a wasm chain holds from the host's memory, for [`timeline`].
pub fn chain_held(handler: &Handler) -> impl FnMut() -> u64 + '_ {
    move || held_from_host(handler).1
}

/// What a native handler ([`crate::NumpyDefault`]) holds from the C library, for
/// [`timeline`]: its live bytes, which it counts as the C library's usable sizes (the
/// blocks in its small-block cache are not counted).
pub fn native_held(handler: &dyn MemHandler) -> impl FnMut() -> u64 + '_ {
    move || stats_of(handler).live_bytes
}

/// Replay `events` through `handler` on this thread, in trace order (the recorded
/// threads are ignored), timing every event and reading `held_from_host` after each.
/// Stops at the first failing event, as [`crate::trace::replay_trace`] does; every
/// block still live at the end is freed, so the handler is left empty.
pub fn timeline(
    label: &str,
    handler: &dyn MemHandler,
    held_from_host: impl FnMut() -> u64,
    events: &[Event],
) -> Timeline {
    timeline_counted(label, handler, held_from_host, events, &AtomicU64::new(0))
}

/// [`timeline`], storing the events replayed so far in `done` after every sample window,
/// so another thread can show progress.
pub fn timeline_counted(
    label: &str,
    handler: &dyn MemHandler,
    mut held_from_host: impl FnMut() -> u64,
    events: &[Event],
    done: &AtomicU64,
) -> Timeline {
    let every = events.len().div_ceil(MAX_POINTS).max(1) as u64;
    let mut live: FastMap<u64, Held> = FastMap::default();
    let mut replay = ReplayReport::default();
    let mut sizes = [0u64; SIZE_BUCKETS];
    let mut times: Vec<u32> = Vec::with_capacity(events.len());
    let mut samples = Vec::with_capacity(MAX_POINTS + 1);
    let mut window = Sample {
        end: 0,
        live: 0,
        held: 0,
        ratio: 0.0,
        ns_per_event: 0.0,
        ns_median: 0,
    };
    let mut window_ns = 0u64;
    let (mut live_bytes, mut held) = (0u64, held_from_host());
    let (mut peak_live, mut peak_held, mut held_at_peak_live) = (0, held, held);
    let mut peak_ratio: Option<f64> = None;
    for (i, event) in events.iter().enumerate() {
        if event.op != EventOp::Free {
            sizes[size_bucket(event.size)] += 1;
        }
        let before = live.get(&event.id).copied();
        let start = Instant::now();
        let after = replay.apply(handler, event, before);
        let ns = start.elapsed().as_nanos().min(u32::MAX as u128) as u32;
        match after {
            Some(block) => drop(live.insert(event.id, block)),
            None => drop(live.remove(&event.id)),
        }
        times.push(ns);
        window_ns += u64::from(ns);
        live_bytes =
            live_bytes - before.map_or(0, |(_, s)| s as u64) + after.map_or(0, |(_, s)| s as u64);
        held = held_from_host();
        if live_bytes > peak_live {
            (peak_live, held_at_peak_live) = (live_bytes, held);
        }
        peak_held = peak_held.max(held);
        window.live = window.live.max(live_bytes);
        window.held = window.held.max(held);
        if let Some(r) = ratio(held, live_bytes) {
            window.ratio = window.ratio.max(r);
            peak_ratio = Some(peak_ratio.map_or(r, |p| p.max(r)));
        }
        let replayed = i as u64 + 1;
        if replayed.is_multiple_of(every)
            || replayed == events.len() as u64
            || replay.failure.is_some()
        {
            done.store(replayed, Ordering::Relaxed);
            let n = replayed - window.end;
            samples.push(Sample {
                end: replayed,
                ns_per_event: window_ns as f64 / n as f64,
                ..window
            });
            window = Sample {
                end: replayed,
                live: 0,
                held: 0,
                ratio: 0.0,
                ns_per_event: 0.0,
                ns_median: 0,
            };
            window_ns = 0;
        }
        if replay.failure.is_some() {
            break;
        }
    }
    replay.elapsed = Duration::from_nanos(times.iter().map(|&t| u64::from(t)).sum());
    let mut start = 0;
    for sample in &mut samples {
        let window = &mut times[start..sample.end as usize];
        sample.ns_median = *window.select_nth_unstable(window.len() / 2).1;
        start = sample.end as usize;
    }
    let (ns_median, ns_p99, ns_max) = quantiles(&mut times);
    drop(times);
    for (_, (p, size)) in live.drain() {
        let _ = handler.free(Some(p), size);
    }
    replay.stats = stats_of(handler);
    Timeline {
        label: label.to_string(),
        handler: handler.name().to_string(),
        replay,
        every,
        samples,
        sizes,
        peak_live,
        peak_held,
        held_at_peak_live,
        peak_ratio,
        final_live: live_bytes,
        final_held: held,
        ns_median,
        ns_p99,
        ns_max,
    }
}

/// The bucket of a request of `size` bytes: 0 for 0, else the bit length of `size`.
pub fn size_bucket(size: u64) -> usize {
    (u64::BITS - size.leading_zeros()) as usize
}

/// Median, 99th percentile and most of `times` (reordered).
fn quantiles(times: &mut [u32]) -> (u64, u64, u64) {
    if times.is_empty() {
        return (0, 0, 0);
    }
    let at = |times: &mut [u32], q: f64| {
        let i = ((times.len() - 1) as f64 * q).round() as usize;
        u64::from(*times.select_nth_unstable(i).1)
    };
    let median = at(times, 0.5);
    let p99 = at(times, 0.99);
    let max = u64::from(times.iter().copied().max().unwrap_or(0));
    (median, p99, max)
}

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

/// A count in short form: `950`, `12k`, `3.5M`.
fn count(n: f64) -> String {
    match n {
        n if n >= 1e6 => format!("{}M", trim_float(n / 1e6)),
        n if n >= 1e3 => format!("{}k", trim_float(n / 1e3)),
        n => trim_float(n),
    }
}

/// `v` with up to three decimals and no trailing zeros (axis ticks 0.01 apart stay
/// apart).
fn trim_float(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The label of a size bucket: its smallest size.
fn bucket_label(bucket: usize) -> String {
    match bucket {
        0 => "0".to_string(),
        b => {
            let low = 1u64 << (b - 1);
            match low {
                l if l >= 1 << 30 => format!("{}G", l >> 30),
                l if l >= 1 << 20 => format!("{}M", l >> 20),
                l if l >= 1 << 10 => format!("{}K", l >> 10),
                l => l.to_string(),
            }
        }
    }
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

const CHART_SIZE: (u32, u32) = (480, 300);
const FONT: (&str, u32) = ("sans-serif", 15);
const LIVE_COLOR: RGBColor = RGBColor(31, 119, 180);
const HELD_COLOR: RGBColor = RGBColor(214, 39, 40);
const RATIO_COLOR: RGBColor = RGBColor(148, 103, 189);
const TIME_COLOR: RGBColor = RGBColor(44, 160, 44);
const SIZE_COLOR: RGBColor = RGBColor(255, 127, 14);
const FAIL_COLOR: RGBColor = RGBColor(176, 0, 32);

/// `#RRGGBB`, as plotters writes colors into SVG.
fn hex(c: RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

type ChartResult = Result<(), Box<dyn std::error::Error>>;

/// Draw into an SVG string; a drawing error becomes an (escaped) note in its place.
fn svg(draw: impl FnOnce(&DrawingArea<SVGBackend<'_>, Shift>) -> ChartResult) -> String {
    let mut out = String::new();
    let result = {
        let root = SVGBackend::with_string(&mut out, CHART_SIZE).into_drawing_area();
        root.fill(&WHITE)
            .map_err(Into::into)
            .and_then(|()| draw(&root))
            .and_then(|()| root.present().map_err(Into::into))
    };
    match result {
        Ok(()) => out,
        Err(e) => format!(
            "<p class=\"error\">chart failed: {}</p>",
            escape_html(&e.to_string())
        ),
    }
}

/// A top for a y axis that a few spikes do not decide: the most of `values`, or when
/// that is far above the 99th percentile, a little above the percentile; and whether
/// it cuts the spikes.
fn robust_top(values: impl Iterator<Item = f64>) -> (f64, bool) {
    let mut values: Vec<f64> = values.filter(|v| v.is_finite()).collect();
    values.sort_by(f64::total_cmp);
    let Some(&max) = values.last() else {
        return (1.0, false);
    };
    let p99 = values[((values.len() - 1) as f64 * 0.99).round() as usize];
    match max <= p99 * 1.5 {
        true => (max, false),
        false => (p99 * 1.2, true),
    }
}

/// The y axis of a line chart.
struct YAxis<'a> {
    range: std::ops::Range<f64>,
    /// Ticks wanted: plotters puts them at the multiples of the step.
    ticks: usize,
    label: &'a dyn Fn(&f64) -> String,
}

impl<'a> YAxis<'a> {
    /// An axis over `lo..hi`, widened to whole multiples of the smallest of `steps` that
    /// makes at most six intervals, with a labelled tick at each multiple.
    fn new(lo: f64, hi: f64, steps: &[f64], label: &'a dyn Fn(&f64) -> String) -> Self {
        let hi = hi.max(lo + f64::EPSILON);
        let step = steps
            .iter()
            .copied()
            .find(|step| ((hi / step).ceil() - (lo / step).floor()) <= 6.0)
            .unwrap_or_else(|| (hi - lo) / 6.0);
        let (first, last) = ((lo / step).floor() as i64, (hi / step).ceil() as i64);
        YAxis {
            range: first as f64 * step..last as f64 * step,
            ticks: (last - first + 1) as usize,
            label,
        }
    }
}

/// Steps for a linear axis: 1, 2 and 5 times a power of ten.
fn decimal_steps() -> Vec<f64> {
    (-3..15)
        .flat_map(|e| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e)))
        .collect()
}

/// A line chart over the events, one line per series (points already in the y axis'
/// units), and a vertical line at the event that failed, if one did.
fn line_chart(
    x_max: f64,
    y: &YAxis<'_>,
    series: &[(RGBColor, Vec<(f64, f64)>)],
    failed_at: Option<f64>,
) -> String {
    let (bottom, top) = (y.range.start, y.range.end);
    svg(|root| {
        let mut chart = ChartBuilder::on(root)
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..x_max.max(1.0), y.range.clone())?;
        chart
            .configure_mesh()
            .x_labels(5)
            .y_labels(y.ticks)
            .x_desc("events")
            .x_label_formatter(&|x| count(*x))
            .y_label_formatter(y.label)
            .label_style(FONT)
            .axis_desc_style(FONT)
            .light_line_style(RGBColor(238, 238, 238))
            .bold_line_style(RGBColor(210, 210, 210))
            .draw()?;
        for (color, points) in series {
            chart.draw_series(LineSeries::new(
                points.iter().map(|&(x, y)| (x, y.clamp(bottom, top))),
                color.stroke_width(2),
            ))?;
        }
        if let Some(x) = failed_at {
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(x, bottom), (x, top)],
                FAIL_COLOR.stroke_width(2),
            )))?;
        }
        Ok(())
    })
}

/// The request sizes, one bar per log2 bucket, counts on a log scale.
fn size_chart(t: &Timeline, buckets: (usize, usize), y_max: u64) -> String {
    svg(|root| {
        let (lo, hi) = buckets;
        let mut chart = ChartBuilder::on(root)
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(
                (lo..hi).into_segmented(),
                (0.5f64..y_max.max(1) as f64 * 2.0).log_scale(),
            )?;
        let step = (hi - lo).div_ceil(8).max(1);
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(hi - lo + 1)
            .y_labels(6)
            .x_desc("bytes asked (bucket's smallest size)")
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(b) if (b - lo) % step == 0 => bucket_label(*b),
                _ => String::new(),
            })
            .y_label_formatter(&|y| match *y {
                y if y >= 1.0 => count(y),
                _ => String::new(),
            })
            .label_style(FONT)
            .axis_desc_style(FONT)
            .light_line_style(RGBColor(238, 238, 238))
            .bold_line_style(RGBColor(210, 210, 210))
            .draw()?;
        chart.draw_series(
            Histogram::vertical(&chart)
                .style(SIZE_COLOR.filled())
                .margin(1)
                .baseline(0.5)
                .data(
                    (lo..hi)
                        .filter(|&b| t.sizes[b] > 0)
                        .map(|b| (b, t.sizes[b] as f64)),
                ),
        )?;
        Ok(())
    })
}

/// A legend in HTML: a swatch and a name per series.
fn legend(entries: &[(RGBColor, &str)]) -> String {
    let mut out = String::from("<span class=\"legend\">");
    for (color, name) in entries {
        let _ = write!(
            out,
            "<span><i style=\"background:{}\"></i>{}</span>",
            hex(*color),
            escape_html(name)
        );
    }
    out + "</span>"
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
/// handlers): a summary table, the failures, and per metric one chart per handler side
/// by side with the same axes. Every text that comes from outside is escaped.
pub fn render_html(trace_name: &str, timelines: &[Timeline]) -> String {
    let x_max = timelines
        .iter()
        .filter_map(|t| t.samples.last())
        .map(|s| s.end as f64)
        .fold(1.0, f64::max);
    let samples = || timelines.iter().flat_map(|t| &t.samples);
    // Bytes in the unit of the axis' top, so that plotters' decimal ticks are round.
    let (top, bytes_clipped) =
        robust_top(samples().flat_map(|s| [s.live, s.held]).map(|b| b as f64));
    let (unit, unit_name) = [(1u64 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")]
        .into_iter()
        .find(|&(unit, _)| top >= unit as f64)
        .unwrap_or((1, "B"));
    let unit = unit as f64;
    let bytes_label = move |y: &f64| format!("{} {unit_name}", trim_float(*y));
    let bytes_axis = YAxis::new(0.0, top / unit * 1.05, &decimal_steps(), &bytes_label);
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
            ("Bytes over time", bytes_clipped),
            vec![
                (LIVE_COLOR, "live (client)"),
                (HELD_COLOR, "held from host (under live where equal)"),
            ],
            &|t| {
                line_chart(
                    x_max,
                    &bytes_axis,
                    // Held first: where the two are equal, live is drawn on top.
                    &[
                        (HELD_COLOR, series(t, &|s| s.held as f64 / unit)),
                        (LIVE_COLOR, series(t, &|s| s.live as f64 / unit)),
                    ],
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
                "malloc, calloc and realloc requests per log2 size bucket",
            )],
            &|t| size_chart(t, buckets, size_max),
        ),
    ];
    let columns = timelines.len().max(1);
    for ((heading, clipped), entries, chart) in rows {
        let note = match clipped {
            true => {
                " <span class=\"note\">(spikes above the axis are cut; the peaks are in the summary)</span>"
            }
            false => "",
        };
        let _ = writeln!(
            html,
            "<h2>{heading} {}{note}</h2>\n<div class=\"row\" style=\"grid-template-columns: \
             repeat({columns}, minmax(0, 1fr))\">",
            legend(&entries),
        );
        let colors: Vec<String> = entries.iter().map(|(c, _)| hex(*c)).collect();
        for t in timelines {
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
    }
    html += "</body>\n</html>\n";
    html
}

const STYLE: &str = "
body { font-family: sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.5em; margin: 0 0 0.3em; overflow-wrap: anywhere; }
h2 { font-size: 1.15em; margin: 1.4em 0 0.5em; }
p.lead { color: #555; max-width: 75em; }
code { overflow-wrap: anywhere; }
table.summary { border-collapse: collapse; font-size: 0.9em; }
table.summary th, table.summary td { border: 1px solid #ccc; padding: 0.25em 0.6em; }
table.summary th { background: #f3f3f3; text-align: center; }
table.summary td { text-align: right; white-space: nowrap; }
table.summary td.name { text-align: left; }
table.summary td:last-child { text-align: left; }
td.failed, li.failed { color: #b00020; }
ul.failures li { margin: 0.3em 0; overflow-wrap: anywhere; }
.note { font-size: 0.75em; font-weight: normal; color: #777; }
.legend { font-size: 0.8em; font-weight: normal; color: #444; margin-left: 1em; }
.legend span { margin-right: 1.2em; white-space: nowrap; }
.legend i { display: inline-block; width: 1.6em; height: 0.35em; vertical-align: middle; margin-right: 0.4em; }
div.row { display: grid; gap: 1em; }
figure { margin: 0; min-width: 0; }
figcaption { font-weight: bold; font-size: 0.9em; margin-bottom: 0.2em; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
figcaption span { font-weight: normal; color: #666; }
figcaption span.failed { color: #b00020; }
figure svg { width: 100%; height: auto; display: block; border: 1px solid #e4e4e4; }
p.error { color: #b00020; }
";
