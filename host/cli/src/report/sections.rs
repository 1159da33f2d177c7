//! The page's sections below its charts: the peak and the test it fell in, the phases
//! with the most bytes and overhead, where each handler's held bytes went by size class,
//! and what the trace left live.

use std::fmt::Write as _;

use allocbox::trace::Mark;
use allocbox::trace::timeline::{Holdings, Phase, Timeline};

use super::summary::ratio_text;
use super::{bytes, escape_html, short_label};

/// Where and when each handler's client held the most, in which test, and what the
/// handler held then.
pub(super) fn peak_section(timelines: &[Timeline], marks: &[Mark]) -> String {
    let mut html = String::from(
        "<h2>Peak</h2>\n<p class=\"explain\"><i>Held/live</i> is the bytes a handler holds \
         from the host for each byte its client holds: 1x is no overhead, 2x means half of \
         what it holds is not in use by the client (kept for reuse, rounded up, or \
         fragmented). Where the client holds little, a small cache makes it large, so the \
         ratio that matters is the one at the peak.</p>\n<ul class=\"peaks\">\n",
    );
    for sentence in super::summary::comparisons(timelines) {
        let _ = writeln!(html, "<li>{}</li>", escape_html(&sentence));
    }
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
pub(super) fn phases_section(timelines: &[Timeline]) -> String {
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
pub(super) fn holdings_section(timelines: &[Timeline]) -> String {
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
pub(super) fn left_section(timelines: &[Timeline]) -> String {
    let Some(first) = timelines.first() else {
        return String::new();
    };
    let (blocks, total): (u64, u64) = first
        .left_live
        .iter()
        .fold((0, 0), |(b, s), l| (b + l.0, s + l.1));
    let mut html = format!(
        "<h2>Left at the end</h2>\n<p class=\"explain\">Blocks the trace never freed: {blocks} \
         blocks, {} (what was live when the recording ended: a program's globals and caches \
         still alive at its exit, its leaks, or the blocks of a recording cut short). \
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
