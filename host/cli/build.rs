//! Embeds the shipped policies (the guest crates marked `ship = true`, the same ones the
//! Python wheel carries) in the `allocbox` command, so that `allocbox check
//! size-classes` works wherever the binary is. A build without the wasm32-wasip2 target
//! embeds none and says why when one is asked for.

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut code = String::from(
        "/// `(name, description, component)` of each policy this build ships.\n\
         pub(crate) const SHIPPED: &[(&str, &str, &[u8])] = &[\n",
    );
    let mut missing = None;
    for (name, description, guest) in allocbox_artifacts::SHIPPED {
        match guest.built() {
            Ok(path) => {
                println!("cargo:rerun-if-changed={path}");
                let copy = out.join(format!("{name}.wasm"));
                std::fs::copy(path, &copy).expect("copying a built guest");
                writeln!(
                    code,
                    "    ({name:?}, {description:?}, include_bytes!({:?})),",
                    copy.display().to_string()
                )
                .expect("writing to a String");
            }
            Err(why) => missing = Some(why),
        }
    }
    code += "];\n/// Why this build ships no policy, when it ships none.\n";
    writeln!(
        code,
        "pub(crate) const SHIPPED_MISSING: Option<&str> = {missing:?};"
    )
    .expect("writing to a String");
    std::fs::write(out.join("shipped.rs"), code).expect("writing shipped.rs");
}
