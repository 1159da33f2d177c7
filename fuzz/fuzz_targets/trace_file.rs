//! Any bytes as a trace file, read as every command reads one: the form found from its
//! first bytes (text, gzip text, an RMM log, a binary recording with its read-ahead
//! decoders, a PyTorch snapshot's pickle), every event to the end, then its marks and
//! sites. A finding is a panic, or a read past the bounds `.ci/fuzz` runs it under: the
//! memory a reader documents (chunks held and decoders, 388 MiB; a pickle's decode, 48
//! times the file) and time linear in what the bytes hold.
#![no_main]

use allocbox::trace::{TraceFile, TraceReader};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // A file, as a command gets it: the binary form's decoders read it by position.
    let path = std::env::temp_dir().join(format!("allocbox-fuzz-trace-{}", std::process::id()));
    std::fs::write(&path, data).expect("the scratch file is written");
    let Ok(file) = TraceFile::open(&path) else {
        return;
    };
    let Ok(mut reader) = TraceReader::of(&file) else {
        return;
    };
    while let Ok(Some(_)) = reader.next_event() {}
    let _ = reader.finish();
});
