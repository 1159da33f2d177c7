//! How a command ends and what it prints: shared by every command.

/// A failed check exits 1; input that cannot be used exits 2.
pub(crate) enum Outcome {
    Held,
    Broken,
}

/// Print to stdout; a reader that went away (`| head`) is not an error.
pub(crate) fn print_report(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}
