//! The report page's charts: SVG drawn with plotters, one chart per handler and metric,
//! sharing axes so that handlers compare at a glance.

use std::fmt::Write as _;

use plotters::coord::Shift;
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use allocbox::trace::timeline::Timeline;

use super::TimeAxis;
use super::escape_html;

pub(super) const CHART_SIZE: (u32, u32) = (480, 300);
pub(super) const FONT: (&str, u32) = ("sans-serif", 15);
pub(super) const LIVE_COLOR: RGBColor = RGBColor(31, 119, 180);
pub(super) const HELD_COLOR: RGBColor = RGBColor(214, 39, 40);
pub(super) const RATIO_COLOR: RGBColor = RGBColor(148, 103, 189);
pub(super) const TIME_COLOR: RGBColor = RGBColor(44, 160, 44);
pub(super) const SIZE_COLOR: RGBColor = RGBColor(255, 127, 14);
pub(super) const FAIL_COLOR: RGBColor = RGBColor(176, 0, 32);
pub(super) const MARK_COLOR: RGBColor = RGBColor(150, 150, 150);

/// `#RRGGBB`, as plotters writes colors into SVG.
pub(super) fn hex(c: RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

type ChartResult = Result<(), Box<dyn std::error::Error>>;

/// Draw into an SVG string; a drawing error becomes an (escaped) note in its place.
pub(super) fn svg(draw: impl FnOnce(&DrawingArea<SVGBackend<'_>, Shift>) -> ChartResult) -> String {
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
pub(super) fn robust_top(values: impl Iterator<Item = f64>) -> (f64, bool) {
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

/// The x axis every chart over the trace shares: events replayed, or where the trace
/// has times, seconds since its recording started.
pub(super) struct XAxis<'a> {
    /// The trace's times; none: the axis is events.
    times: Option<&'a TimeAxis>,
    pub(super) max: f64,
}

impl<'a> XAxis<'a> {
    /// An axis up to `events` replayed, in seconds when `times` has them.
    pub(super) fn new(times: Option<&'a TimeAxis>, events: u64) -> Self {
        let times = times.filter(|t| !t.is_empty());
        let mut axis = XAxis { times, max: 1.0 };
        axis.max = axis.at(events).max(f64::EPSILON);
        axis
    }

    /// Where the moment `events` replayed falls on the axis.
    pub(super) fn at(&self, events: u64) -> f64 {
        match self.times.and_then(|t| t.at(events)) {
            None => events as f64,
            Some(ns) => ns as f64 / 1e9,
        }
    }

    pub(super) fn in_seconds(&self) -> bool {
        self.times.is_some()
    }

    fn desc(&self) -> &'static str {
        match self.in_seconds() {
            true => "seconds since the recording started",
            false => "events",
        }
    }

    fn label(&self, x: f64) -> String {
        match self.in_seconds() {
            true => trim_float(x),
            false => count(x),
        }
    }
}

/// The y axis of a line chart.
pub(super) struct YAxis<'a> {
    pub(super) range: std::ops::Range<f64>,
    /// Ticks wanted: plotters puts them at the multiples of the step.
    pub(super) ticks: usize,
    pub(super) label: &'a dyn Fn(&f64) -> String,
}

impl<'a> YAxis<'a> {
    /// An axis over `lo..hi`, widened to whole multiples of the smallest of `steps` that
    /// makes at most six intervals, with a labelled tick at each multiple.
    pub(super) fn new(lo: f64, hi: f64, steps: &[f64], label: &'a dyn Fn(&f64) -> String) -> Self {
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

    /// [`Self::new`], never below `lo`: for a quantity that cannot go under it.
    pub(super) fn from_floor(
        lo: f64,
        hi: f64,
        steps: &[f64],
        label: &'a dyn Fn(&f64) -> String,
    ) -> Self {
        let mut axis = Self::new(lo, hi, steps, label);
        axis.range.start = axis.range.start.max(lo);
        axis
    }
}

/// Steps for a linear axis: 1, 2 and 5 times a power of ten.
pub(super) fn decimal_steps() -> Vec<f64> {
    (-3..15)
        .flat_map(|e| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e)))
        .collect()
}

/// A line chart over the events, one line per series (points already in the y axis'
/// units), and a vertical line at the event that failed, if one did.
pub(super) fn line_chart(
    x: &XAxis<'_>,
    y: &YAxis<'_>,
    series: &[(RGBColor, Vec<(f64, f64)>)],
    failed_at: Option<f64>,
) -> String {
    let (bottom, top) = (y.range.start, y.range.end);
    let x_axis = x;
    svg(|root| {
        let mut chart = ChartBuilder::on(root)
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..x_axis.max, y.range.clone())?;
        chart
            .configure_mesh()
            .x_labels(5)
            .y_labels(y.ticks)
            .x_desc(x_axis.desc())
            .x_label_formatter(&|x| x_axis.label(*x))
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

/// Bytes live and held over the events on a log scale, so that a peak thousands of
/// times the usual level stays on the chart with the rest: a tick along the bottom for
/// each mark of the trace (a test's start), the peak of live bytes ringed and labelled,
/// and a vertical line at the event that failed, if one did.
pub(super) fn bytes_chart(
    x_axis: &XAxis<'_>,
    top: f64,
    series: &[(RGBColor, Vec<(f64, f64)>)],
    marks: &[f64],
    peak: (f64, f64),
    failed_at: Option<f64>,
) -> String {
    // Decades from 1 kB: the axis' ticks fall on round decimal sizes.
    const BOTTOM: f64 = 1000.0;
    let top = top.max(BOTTOM * 4.0) * 4.0;
    let x_max = x_axis.max;
    svg(|root| {
        let mut chart = ChartBuilder::on(root)
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..x_max, (BOTTOM..top).log_scale())?;
        chart
            .configure_mesh()
            .x_labels(5)
            .y_labels(8)
            .x_desc(x_axis.desc())
            .x_label_formatter(&|x| x_axis.label(*x))
            .y_label_formatter(&|y| decimal_bytes(*y))
            .label_style(FONT)
            .axis_desc_style(FONT)
            .light_line_style(RGBColor(238, 238, 238))
            .bold_line_style(RGBColor(210, 210, 210))
            .draw()?;
        // A tick an eighth of the axis' decades high, at the bottom.
        let tick_top = BOTTOM * (top / BOTTOM).powf(0.04);
        chart.draw_series(marks.iter().map(|&at| {
            PathElement::new(
                vec![(at, BOTTOM), (at, tick_top)],
                MARK_COLOR.stroke_width(1),
            )
        }))?;
        for (color, points) in series {
            chart.draw_series(LineSeries::new(
                points.iter().map(|&(x, y)| (x, y.clamp(BOTTOM, top))),
                color.stroke_width(2),
            ))?;
        }
        let (x, y) = (peak.0, peak.1.max(BOTTOM));
        chart.draw_series(std::iter::once(Circle::new(
            (x, y),
            6,
            LIVE_COLOR.stroke_width(2),
        )))?;
        let anchor = match x > x_max * 0.6 {
            true => Pos::new(HPos::Right, VPos::Bottom),
            false => Pos::new(HPos::Left, VPos::Bottom),
        };
        chart.draw_series(std::iter::once(Text::new(
            format!("peak {}", super::bytes(peak.1 as u64)),
            (x, y * 1.25),
            FONT.into_font().color(&LIVE_COLOR).pos(anchor),
        )))?;
        if let Some(x) = failed_at {
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(x, BOTTOM), (x, top)],
                FAIL_COLOR.stroke_width(2),
            )))?;
        }
        Ok(())
    })
}

/// The request sizes, one bar per log2 bucket, counts on a log scale.
pub(super) fn size_chart(t: &Timeline, buckets: (usize, usize), y_max: u64) -> String {
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

/// Bytes in decimal units, for a log axis' decade ticks: `1 kB`, `10 MB`.
fn decimal_bytes(y: f64) -> String {
    let (scale, unit) = [(1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")]
        .into_iter()
        .find(|&(scale, _)| y >= scale * 0.999)
        .unwrap_or((1.0, "B"));
    format!(
        "{} {unit}",
        trim_float((y / scale * 1000.0).round() / 1000.0)
    )
}

/// A legend in HTML: a swatch and a name per series.
pub(super) fn legend(entries: &[(RGBColor, &str)]) -> String {
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

/// A count in short form: `950`, `12k`, `3.5M`.
pub(super) fn count(n: f64) -> String {
    match n {
        n if n >= 1e6 => format!("{}M", trim_float(n / 1e6)),
        n if n >= 1e3 => format!("{}k", trim_float(n / 1e3)),
        n => trim_float(n),
    }
}

/// `v` with up to three decimals and no trailing zeros (axis ticks 0.01 apart stay
/// apart).
pub(super) fn trim_float(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The label of a size bucket: its smallest size.
pub(super) fn bucket_label(bucket: usize) -> String {
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
