//! Any text as a replay script (`allocbox replay SCRIPT`): parsed, and a script that
//! parses prints as text that parses back to itself.
#![no_main]

use allocbox_check::Script;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(script) = Script::parse(text) {
        let again = Script::parse(&script.to_string()).expect("a printed script parses");
        assert_eq!(again.len(), script.len());
    }
});
