//! `allocbox trace-convert`: a trace from one form to the other (the binary form
//! recordings write, the text form people read and write by hand).

use std::io::Write;
use std::path::Path;

use allocbox::output::Output;
use allocbox::trace::{BinarySink, CopyError, TextSink, TraceFile, copy_trace};
use anyhow::{Context, Result};

use crate::outcome::{Outcome, print_report};

/// The form `trace-convert` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Form {
    /// `op id size thread` lines (gzip-compressed when the output's name ends in `.gz`).
    Text,
    /// The compact form recordings write.
    Binary,
}

pub(crate) fn run_trace_convert(input: &Path, output: &Path, to: Option<Form>) -> Result<Outcome> {
    let trace = TraceFile::open(input).with_context(|| input.display().to_string())?;
    // The form asked for; else the one the output's name says (`.txt`, `.txt.gz`: a
    // PyTorch snapshot converted to `S.txt.gz` was written binary); else the input's
    // other form.
    let named_text = output
        .file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| name.ends_with(".txt") || name.ends_with(".txt.gz"));
    let to = match to {
        Some(to) => to,
        None if named_text => Form::Text,
        None if trace
            .starts_with(&allocbox::trace::BINARY_MAGIC)
            .with_context(|| input.display().to_string())? =>
        {
            Form::Text
        }
        None => Form::Binary,
    };
    // Judged before the trace is read: a target that cannot be written costs no reading.
    let mut out = Output::create(output)?;
    // A first pass says whether the events have times and sites, which a binary
    // trace's header says first.
    let found = crate::survey::survey_of(std::sync::Arc::new(trace))?;
    let (times, sites) = found
        .placements
        .values()
        .fold((false, false), |(times, sites), p| {
            (times || !p.times.is_empty(), sites || p.has_sites())
        });
    let reader = found.reader()?;
    let file = std::io::BufWriter::new(out.file());
    let copied = match to {
        Form::Binary => BinarySink::new(file, times, sites)
            .map_err(CopyError::Write)
            .and_then(|sink| copy_trace(reader, sink))
            .map(|(events, _)| events),
        Form::Text if output.extension().is_some_and(|e| e == "gz") => {
            let gz = flate2::write::GzEncoder::new(file, flate2::Compression::default());
            TextSink::new(gz)
                .map_err(CopyError::Write)
                .and_then(|sink| copy_trace(reader, sink))
                .and_then(|(events, gz)| Ok((events, gz.finish()?.flush()?)))
                .map(|(events, ())| events)
        }
        Form::Text => TextSink::new(file)
            .map_err(CopyError::Write)
            .and_then(|sink| copy_trace(reader, sink))
            .map(|(events, _)| events),
    };
    let events = match copied {
        Ok(events) => events,
        Err(CopyError::Read(error)) => {
            return Err(anyhow::Error::new(error).context(input.display().to_string()));
        }
        Err(CopyError::Write(error)) => {
            return Err(
                anyhow::Error::new(error).context(format!("cannot write `{}`", output.display()))
            );
        }
    };
    out.commit()?;
    print_report(&format!(
        "{} ({} events) -> {} ({})\n",
        input.display(),
        events,
        output.display(),
        match to {
            Form::Text => "text",
            Form::Binary => "binary",
        }
    ));
    Ok(Outcome::Held)
}
