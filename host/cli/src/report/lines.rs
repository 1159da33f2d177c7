//! The page's tables by line of the program (a trace recorded with sites): the lines
//! whose blocks made the peak, with a bar for each one's share and a link to the
//! timeline where its blocks were made, and the lines whose blocks were never freed.

use std::collections::HashMap;
use std::fmt::Write as _;

use allocbox::trace::Site;
use allocbox::trace::by_site::{BySite, SiteBytes};

use super::charts::XAxis;
use super::{bytes, escape_html};

/// Rows shown in each table; the rest are summed in a last row.
const ROWS: usize = 20;

/// The most characters of a line's place or function a row shows: a trace may name a
/// file in 16 KiB (and its escapes more), and a page stays readable and its size bounded
/// whatever its sites' names.
const SHOWN_CHARS: usize = 240;

fn place(sites: &HashMap<u32, Site>, number: u32) -> (String, String) {
    match sites.get(&number) {
        Some(site) => (shown(site.place()), shown(site.functions())),
        None => ("(no line recorded)".into(), String::new()),
    }
}

/// `text`, cut to [`SHOWN_CHARS`] with `…` where it was cut.
fn shown(text: String) -> String {
    match text.char_indices().nth(SHOWN_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

#[test]
fn a_long_name_is_shown_cut() {
    assert_eq!(shown("a.py:3".into()), "a.py:3");
    let long = shown("é".repeat(5000));
    assert_eq!(long.chars().count(), SHOWN_CHARS + 1);
    assert!(long.ends_with('…'));
}

/// When the blocks of a row were made, on the page's x axis.
fn made(row: &SiteBytes, x: &XAxis<'_>) -> String {
    let (first, last) = (x.at(row.first_at), x.at(row.last_at));
    let unit = match x.in_seconds() {
        true => " s",
        false => "",
    };
    let at = |v: f64| match x.in_seconds() {
        true => format!("{v:.3}"),
        false => format!("event {v}"),
    };
    let (first, last) = (at(first), at(last));
    match first == last {
        true => format!("{first}{unit}"),
        false => format!("{first} to {last}{unit}"),
    }
}

fn table(
    rows: &[SiteBytes],
    total: u64,
    sites: &HashMap<u32, Site>,
    x: &XAxis<'_>,
    class: &str,
) -> String {
    let mut html = format!(
        "<table class=\"{class}\">\n<thead><tr><th>line</th><th>function</th><th>bytes</th>\
         <th>share</th><th class=\"bar\"></th><th>blocks</th><th>made</th></tr></thead>\n<tbody>\n"
    );
    for row in rows.iter().take(ROWS) {
        let (line, function) = place(sites, row.site);
        let share = 100.0 * row.bytes as f64 / total.max(1) as f64;
        let _ = writeln!(
            html,
            "<tr><td class=\"name\"><code>{}</code></td><td><code>{}</code></td><td>{}</td>\
             <td>{share:.0}%</td><td class=\"bar\"><span style=\"width: {share:.1}%\"></span></td>\
             <td>{}</td><td><a href=\"#timeline\">{}</a></td></tr>",
            escape_html(&line),
            escape_html(&function),
            bytes(row.bytes),
            row.blocks,
            made(row, x),
        );
    }
    if rows.len() > ROWS {
        let rest = &rows[ROWS..];
        let _ = writeln!(
            html,
            "<tr><td class=\"name\">{} more lines</td><td></td><td>{}</td><td></td><td></td>\
             <td>{}</td><td></td></tr>",
            rest.len(),
            bytes(rest.iter().map(|r| r.bytes).sum()),
            rest.iter().map(|r| r.blocks).sum::<u64>(),
        );
    }
    html + "</tbody>\n</table>\n"
}

/// The two tables, or a note that the trace has no sites.
pub(super) fn lines_section(found: &BySite, sites: &HashMap<u32, Site>, x: &XAxis<'_>) -> String {
    let when = match x.in_seconds() {
        true => format!("{:.3} s into the recording", x.at(found.peak_at)),
        false => format!("after event {}", found.peak_at),
    };
    let mut html = format!(
        "<h2 id=\"lines-at-peak\">Lines behind the peak</h2>\n<p>When the program held the \
         most ({}, {when}), these lines of its own code had made what it held (its own \
         sizes, the same under every handler). <i>Made</i>: when the earliest and the \
         latest of those blocks were made; it links to the timeline.</p>\n",
        bytes(found.peak_bytes)
    );
    html += &table(&found.at_peak, found.peak_bytes, sites, x, "lines at-peak");
    let leaked: u64 = found.never_freed.iter().map(|r| r.bytes).sum();
    let _ = writeln!(
        html,
        "<h2 id=\"lines-never-freed\">Lines whose blocks were never freed</h2>\n<p>{} in {} \
         blocks were still live where the recording ended.</p>",
        bytes(leaked),
        found.never_freed.iter().map(|r| r.blocks).sum::<u64>(),
    );
    if !found.never_freed.is_empty() {
        html += &table(&found.never_freed, leaked, sites, x, "lines never-freed");
    }
    html
}
