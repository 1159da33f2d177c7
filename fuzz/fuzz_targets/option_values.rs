//! Any value of every option of every subcommand, parsed by the command line's grammar
//! (nothing runs): accepted, or refused in one line (exit 2), never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

/// Each subcommand with an option that takes a value, and the arguments it needs.
const OPTIONS: &[(&str, &str, &[&str])] = &[
    ("check", "--time", &[]),
    ("check", "--cases", &[]),
    ("check", "--seed", &[]),
    ("check", "--max-ops", &[]),
    ("check", "--threads", &[]),
    ("check", "--config", &[]),
    ("check", "--call-time-ms", &[]),
    ("check", "--guest-memory", &[]),
    ("check", "--batch-limit", &[]),
    ("check", "--overhead", &[]),
    ("check", "--grant", &[]),
    ("check", "--compile-bound", &[]),
    ("report", "--device-memory", &["t.trace", "-p", "default", "-o", "p.html"]),
    ("report", "--config", &["t.trace", "-p", "default", "-o", "p.html"]),
    ("trace-convert", "--to", &["in.txt", "out.txt"]),
    ("new", "--lang", &["demo"]),
];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, value)) = data.split_first() else {
        return;
    };
    let Ok(value) = std::str::from_utf8(value) else {
        return;
    };
    let (command, option, rest) = OPTIONS[usize::from(pick) % OPTIONS.len()];
    let option = format!("{option}={value}");
    let mut args = vec!["allocbox", command, &option];
    args.extend(rest);
    if let Err(said) = allocbox_cli::parse_only(args) {
        assert!(!said.contains('\n'), "a usage error is one line: {said}");
    }
});
