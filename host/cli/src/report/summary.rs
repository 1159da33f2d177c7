//! The plain-text and JSON summaries `allocbox report` prints beside its page: one row
//! (or object) per handler.

use std::fmt::Write as _;

use allocbox::trace::timeline::Timeline;

use super::short_label;

/// What the summary's ratio columns mean, printed under the table.
pub const RATIO_NOTE: &str = "held/live: bytes the handler held from the host for each byte \
the trace held (1.00x: nothing beyond the arrays themselves), when the trace held the \
most and after its last event.";

/// [`RATIO_NOTE`] for a GPU's memory.
pub const GPU_RATIO_NOTE: &str = "held/live: bytes the policy held in the regions it mapped \
of the GPU's memory for each byte the trace held there, when the trace held the most and \
after its last event.";

/// Below this, on either side, a change of held bytes is said in bytes, not as a
/// percentage: 21 KiB against 1 MiB is no "4550% more".
const PERCENT_FLOOR: u64 = 1 << 20;

/// Why small arrays look alike under every policy, said where the numbers are.
pub const MAGAZINE_NOTE: &str = "Requests of up to 64 KiB to a policy that batches are \
served from the host's per-thread magazines of blocks the policy placed, so such policies \
differ little in time or bytes on a trace of small arrays: the magazines, not the policy, \
answer most of those requests.";

/// Below this many events a replay's times say little (a handful of slow first calls
/// decide them): the headline compares no times.
pub const TIMED_EVENTS: u64 = 10_000;

/// How each handler after the first compares with the first on this trace, as
/// sentences, in what a user decides on: the bytes held when the client held the most
/// and at the end, and, on a trace long enough to time, the median time an event, each
/// with its absolute figures ("`arena` would have held 18% less than `default` when the
/// client held the most (1.2 MiB against 1.5 MiB) and the same as it at the end (0 B);
/// a median 41 ns an event against 52 ns"). A handler whose replay failed (stopped, or
/// out of memory where the program was not) compares with nothing, and says so first.
pub fn comparisons(timelines: &[Timeline]) -> Vec<String> {
    let Some((base, others)) = timelines.split_first() else {
        return Vec::new();
    };
    let base_name = short_label(&base.label);
    if base.replay.failure.is_some() {
        return Vec::new();
    }
    if let Some(ran_out) = base.ran_out_text() {
        return vec![format!(
            "`{base_name}` {ran_out}, so nothing compares with it"
        )];
    }
    others
        .iter()
        .map(|t| {
            let name = short_label(&t.label);
            if let Some((event, _)) = &t.replay.failure {
                return format!("`{name}` failed at {event}, so it compares with nothing");
            }
            if let Some(ran_out) = t.ran_out_text() {
                return format!("`{name}` {ran_out}, so it compares with nothing");
            }
            let figures = |held: u64, was: u64| match held == was {
                true => format!("({})", bytes(held)),
                false => format!("({} against {})", bytes(held), bytes(was)),
            };
            let (peak, was_peak) = (t.held_at_peak_live, base.held_at_peak_live);
            let (end, was_end) = (t.final_held, base.final_held);
            let times = match t.replay.events.min(base.replay.events) {
                n if n < TIMED_EVENTS => format!(
                    "too few events ({n}) to compare times: a replay of at least {TIMED_EVENTS} \
                     does"
                ),
                _ => format!(
                    "a median {} ns an event against {} ns",
                    t.ns_median, base.ns_median
                ),
            };
            format!(
                "on this trace, `{name}` would have held {} `{base_name}` when the client held \
                 the most {} and {} it at the end {}; {times}",
                held_change(peak, was_peak),
                figures(peak, was_peak),
                held_change(end, was_end),
                figures(end, was_end),
            )
        })
        .collect()
}

/// How `held` compares with `was`: a percentage where both are at least
/// [`PERCENT_FLOOR`], else the difference in bytes.
fn held_change(held: u64, was: u64) -> String {
    if held.min(was) < PERCENT_FLOOR {
        return match held.cmp(&was) {
            std::cmp::Ordering::Equal => "the same as".to_string(),
            std::cmp::Ordering::Less => format!("{} less than", bytes(was - held)),
            std::cmp::Ordering::Greater => format!("{} more than", bytes(held - was)),
        };
    }
    let change = (held as f64 - was as f64) / was as f64 * 100.0;
    match change {
        c if c.abs() < 0.5 => "the same as".to_string(),
        c if c < 0.0 => format!("{:.0}% less than", -c),
        c => format!("{c:.0}% more than"),
    }
}

#[cfg(test)]
#[test]
fn a_change_between_small_amounts_is_said_in_bytes_not_a_percentage() {
    // Issue 49: "arena would have held 4550% more" when 21 KiB was live.
    assert_eq!(held_change(1 << 20, 22 << 10), "1002 KiB more than");
    assert_eq!(held_change(22 << 10, 22 << 10), "the same as");
    assert_eq!(held_change(12 << 20, 10 << 20), "20% more than");
    assert_eq!(held_change(9 << 20, 10 << 20), "10% less than");
}

/// The plain-text summary: one row per handler, and what its ratios mean.
pub fn summary_table(timelines: &[Timeline], memory: super::Memory) -> String {
    let mut rows = vec![[
        "handler".to_string(),
        "events".to_string(),
        "ns/event p50".to_string(),
        "p99".to_string(),
        "peak live".to_string(),
        "peak held".to_string(),
        "held/live at peak".to_string(),
        "at end".to_string(),
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
            ratio_text(t.ratio_at_peak_live()),
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
    for sentence in comparisons(timelines) {
        out += &sentence;
        out.push('\n');
    }
    match memory {
        super::Memory::Host if timelines.iter().any(has_small_requests) => {
            out + RATIO_NOTE + "\n" + MAGAZINE_NOTE + "\n"
        }
        super::Memory::Host => out + RATIO_NOTE + "\n",
        super::Memory::Gpu(_) => out + GPU_RATIO_NOTE + "\n",
    }
}

/// Does the trace ask for blocks the host's magazines serve (up to 64 KiB)? Only then
/// does [`MAGAZINE_NOTE`] apply.
pub(super) fn has_small_requests(timeline: &Timeline) -> bool {
    // Bucket b holds sizes 2^(b-1) ..= 2^b - 1: up to bucket 17, sizes below 128 KiB.
    timeline.sizes[..=17].iter().any(|&n| n > 0)
}

pub(super) fn ratio_text(r: Option<f64>) -> String {
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

/// Issue 61: "taken 4.24x its time" on a 109-event trace, where the same table showed
/// the other policy with the lower median. Times are compared on enough events only,
/// as medians with their figures, and bytes at the end beside the peak.
#[cfg(test)]
#[test]
fn the_headline_compares_medians_only_on_a_trace_long_enough_and_says_the_figures() {
    use allocbox::trace::timeline::timeline;
    use allocbox::trace::{Event, EventOp};
    let native = allocbox::NumpyDefault::new();
    let events = |n: u64| -> Vec<Event> {
        (1..=n)
            .flat_map(|id| {
                [EventOp::Malloc, EventOp::Free].map(|op| Event {
                    op,
                    id,
                    size: 64,
                    thread: 1,
                    line: 0,
                    device: None,
                })
            })
            .collect()
    };
    let run = |label: &str, n| {
        let held = allocbox::trace::timeline::native_held(&native);
        timeline(label, &native, held, &events(n))
    };
    let short = comparisons(&[run("default", 50), run("other", 50)]);
    assert!(
        short[0].contains("too few events (100) to compare times"),
        "{}",
        short[0]
    );
    assert!(!short[0].contains("x its time"), "{}", short[0]);
    let long = comparisons(&[run("default", 6000), run("other", 6000)]);
    assert!(
        long[0].contains("a median ") && long[0].contains(" ns an event against "),
        "{}",
        long[0]
    );
    assert!(long[0].contains("at the end ("), "{}", long[0]);
}
