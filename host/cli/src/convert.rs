//! `allocbox trace-convert`: a trace from one form to the other (the binary form
//! recordings write, the text form people read and write by hand).

use std::io::Write;
use std::path::Path;

use allocbox::output::Output;
use allocbox::trace::{write_binary, write_text};
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
    let to = match to {
        Some(to) => to,
        None if is_binary(input)? => Form::Text,
        None => Form::Binary,
    };
    // Judged before the trace is read: a target that cannot be written costs no reading.
    let mut out = Output::create(output, &[input])?;
    let trace = crate::trace_command::read_trace(input)?;
    let file = std::io::BufWriter::new(out.file());
    match to {
        Form::Binary => write_binary(&trace, file),
        Form::Text if output.extension().is_some_and(|e| e == "gz") => {
            let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::default());
            write_text(&trace, &mut gz).and_then(|()| gz.finish()?.flush())
        }
        Form::Text => write_text(&trace, file),
    }
    .with_context(|| format!("cannot write `{}`", output.display()))?;
    out.commit()?;
    print_report(&format!(
        "{} ({} events) -> {} ({})\n",
        input.display(),
        trace.events.len(),
        output.display(),
        match to {
            Form::Text => "text",
            Form::Binary => "binary",
        }
    ));
    Ok(Outcome::Held)
}

/// Whether the file at `path` is a binary trace (it must be readable at all).
fn is_binary(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut start = Vec::new();
    std::fs::File::open(path)
        .and_then(|file| {
            file.take(allocbox::trace::BINARY_MAGIC.len() as u64)
                .read_to_end(&mut start)
        })
        .with_context(|| format!("cannot read the trace {}", path.display()))?;
    Ok(start == allocbox::trace::BINARY_MAGIC)
}
