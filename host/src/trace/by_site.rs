//! A trace's live bytes by the line of the program that asked for them (its sites,
//! `allocbox run --sites`): which lines held the most when the program held the most,
//! and which lines' blocks the trace never freed. This is the client's own view (the
//! sizes it asked for), the same through every handler, so it needs no replay.

use std::collections::HashMap;

use super::{Event, EventOp, UNKNOWN_ID};

/// The blocks of one site live at a moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiteBytes {
    /// The site's number in the trace (`Trace::site_table`); 0 for events without one.
    pub site: u32,
    pub blocks: u64,
    pub bytes: u64,
    /// The events replayed when the earliest and the latest of these blocks were made
    /// (so `at` and `at + 1` bracket the event in the trace's own count).
    pub first_at: u64,
    pub last_at: u64,
}

/// What [`by_site`] finds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BySite {
    /// The events replayed when the client first held the most bytes.
    pub peak_at: u64,
    pub peak_bytes: u64,
    /// The sites of the blocks live at the peak, most bytes first.
    pub at_peak: Vec<SiteBytes>,
    /// The sites of the blocks the trace never freed, most bytes first.
    pub never_freed: Vec<SiteBytes>,
}

/// Live blocks by id: size, site, and the events replayed when it was made.
type Live = crate::fasthash::FastMap<u64, (u64, u32, u64)>;

/// Apply `event` (the `at`-th, from 1) to `live`; returns the change in live bytes.
fn apply(live: &mut Live, event: &Event, site: u32, at: u64) -> i64 {
    if event.id == 0 || event.id == UNKNOWN_ID {
        return 0;
    }
    match event.op {
        EventOp::Malloc | EventOp::Calloc => {
            let old = live.insert(event.id, (event.size, site, at));
            event.size as i64 - old.map_or(0, |(size, ..)| size as i64)
        }
        EventOp::Realloc => {
            // A resized block belongs to the line that resized it, when the trace says.
            let old = live.get(&event.id).copied();
            let site = if site != 0 {
                site
            } else {
                old.map_or(0, |(_, s, _)| s)
            };
            live.insert(event.id, (event.size, site, at));
            event.size as i64 - old.map_or(0, |(size, ..)| size as i64)
        }
        EventOp::Free => live
            .remove(&event.id)
            .map_or(0, |(size, ..)| -(size as i64)),
    }
}

/// `live` grouped by site, most bytes first.
fn group(live: &Live) -> Vec<SiteBytes> {
    let mut by: HashMap<u32, SiteBytes> = HashMap::new();
    for &(size, site, at) in live.values() {
        let row = by.entry(site).or_insert(SiteBytes {
            site,
            blocks: 0,
            bytes: 0,
            first_at: at,
            last_at: at,
        });
        row.blocks += 1;
        row.bytes += size;
        row.first_at = row.first_at.min(at);
        row.last_at = row.last_at.max(at);
    }
    let mut rows: Vec<SiteBytes> = by.into_values().collect();
    rows.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.site.cmp(&b.site)));
    rows
}

/// The trace's live bytes by site at its peak and at its end. `sites` holds one site
/// per event (`Trace::sites`; missing ones count as 0).
pub fn by_site(events: &[Event], sites: &[u32]) -> BySite {
    let with_sites = || {
        let site_of = |i: usize| sites.get(i).copied().unwrap_or(0);
        events
            .iter()
            .enumerate()
            .map(move |(i, &e)| (e, site_of(i)))
    };
    let mut first = BySitePass::default();
    for (event, site) in with_sites() {
        first.add(&event, site);
    }
    first.finish(with_sites())
}

/// [`by_site`] of a trace read event by event: a first pass through [`BySitePass::add`]
/// finds the peak and the blocks never freed, holding the live blocks only; a second,
/// up to the peak, finds the blocks live then ([`BySitePass::finish`]).
#[derive(Debug, Default)]
pub struct BySitePass {
    live: Live,
    bytes: i64,
    peak_bytes: i64,
    peak_at: u64,
    events: u64,
}

impl BySitePass {
    /// The next event, made at `site` (0 for none).
    pub fn add(&mut self, event: &Event, site: u32) {
        self.events += 1;
        self.bytes += apply(&mut self.live, event, site, self.events);
        if self.bytes > self.peak_bytes {
            (self.peak_bytes, self.peak_at) = (self.bytes, self.events);
        }
    }

    /// The events before the client first held the most: what the second pass reads.
    pub fn peak_at(&self) -> u64 {
        self.peak_at
    }

    /// What was found, given the trace's events with their sites again (those past
    /// [`Self::peak_at`] are not read).
    pub fn finish(self, again: impl IntoIterator<Item = (Event, u32)>) -> BySite {
        let mut at_peak = self.second_pass();
        for (event, site) in again.into_iter().take(at_peak.peak_at as usize) {
            at_peak.add(&event, site);
        }
        at_peak.finish()
    }

    /// The second pass: the blocks live at the peak, from the trace's events again.
    pub fn second_pass(self) -> AtPeak {
        AtPeak {
            never_freed: group(&self.live),
            peak_at: self.peak_at,
            peak_bytes: self.peak_bytes as u64,
            live: Live::default(),
            events: 0,
        }
    }
}

/// [`by_site`]'s second pass ([`BySitePass::second_pass`]): events from the trace's
/// start, up to the peak.
#[derive(Debug)]
pub struct AtPeak {
    never_freed: Vec<SiteBytes>,
    peak_at: u64,
    peak_bytes: u64,
    live: Live,
    events: u64,
}

impl AtPeak {
    /// The next event, made at `site`; those past the peak change nothing.
    pub fn add(&mut self, event: &Event, site: u32) {
        if self.events < self.peak_at {
            self.events += 1;
            apply(&mut self.live, event, site, self.events);
        }
    }

    /// Whether every event up to the peak was added.
    pub fn done(&self) -> bool {
        self.events >= self.peak_at
    }

    pub fn finish(self) -> BySite {
        BySite {
            peak_at: self.peak_at,
            peak_bytes: self.peak_bytes,
            at_peak: group(&self.live),
            never_freed: self.never_freed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::parse_trace_marked;

    #[test]
    fn the_lines_holding_the_most_at_the_peak_and_those_never_freed_are_found() {
        let trace = parse_trace_marked(
            "#@site 1 10 setup a.py\n#@site 2 20 build b.py\n#@site 3 30 keep c.py\n\
             m 1 100 1 s=1\nm 2 5000 1 s=2\nm 3 3000 1 s=2\nm 4 7 1 s=3\n\
             f 2 5000 1\nf 3 3000 1\nr 1 200 1 s=3\nm 5 64 1\nf 5 64 1\n"
                .as_bytes(),
        )
        .unwrap();
        let found = by_site(&trace.events, &trace.sites);
        assert_eq!((found.peak_at, found.peak_bytes), (4, 8107));
        let rows: Vec<(u32, u64, u64)> = found
            .at_peak
            .iter()
            .map(|r| (r.site, r.blocks, r.bytes))
            .collect();
        assert_eq!(rows, [(2, 2, 8000), (1, 1, 100), (3, 1, 7)]);
        assert_eq!(
            (found.at_peak[0].first_at, found.at_peak[0].last_at),
            (2, 3)
        );
        let left: Vec<(u32, u64, u64)> = found
            .never_freed
            .iter()
            .map(|r| (r.site, r.blocks, r.bytes))
            .collect();
        assert_eq!(
            left,
            [(3, 2, 207)],
            "the resized block moved to the line that resized it"
        );
    }

    #[test]
    fn a_trace_without_sites_groups_everything_under_site_0() {
        let trace = parse_trace_marked("m 1 10\nm 2 20\nf 1 10\n".as_bytes()).unwrap();
        let found = by_site(&trace.events, &trace.sites);
        assert_eq!(found.at_peak.len(), 1);
        assert_eq!((found.at_peak[0].site, found.at_peak[0].bytes), (0, 30));
        assert_eq!(found.never_freed[0].bytes, 20);
    }
}
