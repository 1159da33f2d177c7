//! Embedding allocbox: load policies, stack them into a checked chain, allocate.
//!
//! Run: `cargo run -p allocbox --example embed [POLICY.wasm|.wat]...` (top of the chain
//! first; with no argument, the built-in default policy).

use allocbox::{HandlerBuilder, Runtime};

fn main() -> anyhow::Result<()> {
    let runtime = Runtime::shared();
    let paths: Vec<String> = std::env::args().skip(1).collect();
    let mut builder = HandlerBuilder::new(runtime);
    if paths.is_empty() {
        builder = builder.link(&runtime.load(allocbox::DEFAULT_POLICY_WAT.as_bytes())?);
    }
    for path in &paths {
        builder = builder.link(&runtime.load_file(path)?);
    }
    let handler = builder.build()?;
    println!("chain: {}", handler.policy_names().join(" > "));

    let mut blocks = Vec::new();
    for size in [8, 100, 4096, 1 << 20] {
        let block = handler.malloc(size)?.expect("not out of memory");
        // SAFETY: `block` is a live block of `size` bytes lent by `handler`.
        unsafe { block.as_ptr().write_bytes(0xAB, size) };
        blocks.push((block, size));
    }
    for (block, size) in blocks {
        handler.free(Some(block), size)?;
    }
    handler.leak_check()?;
    println!("{:#?}", handler.stats().unwrap());
    for link in handler.link_stats().unwrap() {
        println!(
            "{}: {} mallocs, peak {} bytes",
            link.name, link.mallocs, link.peak_bytes
        );
    }
    Ok(())
}
