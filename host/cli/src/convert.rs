//! `allocbox trace-convert`: a trace from one form to the other (the binary form
//! recordings write, the text form people read and write by hand).

use std::io::Write;
use std::path::{Path, PathBuf};

use allocbox::trace::{read_trace_marked, write_binary, write_text};
use anyhow::{Context, Result, bail};

use crate::Outcome;

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
    if same_file(input, output) {
        bail!(
            "{} is both the trace to convert and the output: name another output file",
            input.display()
        );
    }
    let trace = read_trace_marked(input).with_context(|| format!("{}", input.display()))?;
    if trace.cut_short {
        eprintln!(
            "allocbox: {} ends early (its process was killed?): converted up to its last whole event",
            input.display()
        );
    }
    // Written beside the output and renamed over it once whole: an existing file is
    // never left half-written.
    let partial = partial_name(output);
    let written = (|| -> std::io::Result<()> {
        let file = std::io::BufWriter::new(std::fs::File::create(&partial)?);
        match to {
            Form::Binary => write_binary(&trace, file),
            Form::Text if output.extension().is_some_and(|e| e == "gz") => {
                let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::default());
                write_text(&trace, &mut gz)?;
                gz.finish()?.flush()
            }
            Form::Text => write_text(&trace, file),
        }?;
        std::fs::rename(&partial, output)
    })();
    if let Err(error) = written {
        let _ = std::fs::remove_file(&partial);
        return Err(error).with_context(|| format!("cannot write {}", output.display()));
    }
    crate::print_report(&format!(
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

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// `output` with `.partial` after its name.
fn partial_name(output: &Path) -> PathBuf {
    let mut name = output.file_name().unwrap_or_default().to_owned();
    name.push(".partial");
    output.with_file_name(name)
}
