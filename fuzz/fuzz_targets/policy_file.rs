//! Any bytes as a policy file (a component, a core module, WAT text of either) loaded
//! as `allocbox check FILE` loads one: judged by the compile bounds before Cranelift
//! runs, refused in one line or compiled. A finding is a panic, or a load past the time
//! and memory `.ci/fuzz` gives it.
#![no_main]

use allocbox::{CompileBounds, Runtime};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(error) = Runtime::shared().load_bounded(data, &CompileBounds::default()) {
        let said = error.to_string();
        assert!(!said.contains('\n'), "a refusal is one line: {said}");
    }
});
