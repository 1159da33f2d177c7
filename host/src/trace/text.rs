//! The text form written: what `trace-convert` makes of a binary trace, line for line as
//! the reader in `trace.rs` reads it back.

use std::collections::HashSet;
use std::io::{self, Write};

use super::{EventOp, Site, Trace, site_name};

/// The first line of a trace written in the text form.
const HEADER: &str = "# op(m=malloc,c=calloc,r=realloc,f=free) ptr-id size thread; \
                      free(NULL)->id 0; unknown ptr->id 18446744073709551615\n";

/// `trace` in the text form: the header, then each event with its marks before it and
/// its site's `#@site` (and `#@via`) record before the first event made there. An
/// event's line is the one a binary trace's reader gave it.
pub fn write_text(trace: &Trace, out: impl Write) -> io::Result<()> {
    let mut out = io::BufWriter::new(out);
    out.write_all(HEADER.as_bytes())?;
    let mut marks = trace.marks.iter().peekable();
    let mut named = HashSet::new();
    for (at, event) in trace.events.iter().enumerate() {
        while let Some(mark) = marks.next_if(|m| m.at <= at as u64) {
            writeln!(out, "# {}", mark.text)?;
        }
        let site = trace.sites.get(at).copied().unwrap_or(0);
        if site != 0
            && named.insert(site)
            && let Some(place) = trace.site_table.get(&site)
        {
            out.write_all(site_record("site", site, place).as_bytes())?;
            if let Some(via) = &place.via {
                out.write_all(site_record("via", site, via).as_bytes())?;
            }
        }
        let op = match event.op {
            EventOp::Malloc => 'm',
            EventOp::Calloc => 'c',
            EventOp::Realloc => 'r',
            EventOp::Free => 'f',
        };
        write!(out, "{op} {} {} {}", event.id, event.size, event.thread)?;
        if site != 0 {
            write!(out, " s={site}")?;
        }
        if let Some(time) = trace.times.get(at) {
            write!(out, " t={time}")?;
        }
        out.write_all(b"\n")?;
    }
    for mark in marks {
        writeln!(out, "# {}", mark.text)?;
    }
    out.flush()
}

/// A `#@site` (or `#@via`) record: `#@KIND NUMBER LINE FUNCTION FILE`.
fn site_record(kind: &str, number: u32, site: &Site) -> String {
    format!(
        "#@{kind} {number} {} {} {}\n",
        site.line,
        site_name(&site.function),
        site_name(&site.file)
    )
}
