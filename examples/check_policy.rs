//! Fuzzing a policy's handler contract from Rust, as a policy author would in a test:
//! `allocbox_check::assert_contract(path, config)` in a `#[test]` is the one-liner; this
//! shows the report behind it.
//!
//! Run: `cargo run -p allocbox-check --example check_policy POLICY.wasm [KEY=VALUE]...`

use allocbox::Runtime;
use allocbox_check::{CheckOptions, check};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: check_policy POLICY [KEY=VALUE]..."))?;
    let pairs: Vec<(String, String)> = args
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect::<Option<_>>()
        .ok_or_else(|| anyhow::anyhow!("configuration is KEY=VALUE"))?;
    let config: Vec<(&str, &str)> = pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();

    let runtime = Runtime::shared();
    let policy = runtime.load_file(&path)?;
    let options = CheckOptions {
        cases: 256,
        ..CheckOptions::default()
    };
    let report = check(runtime, &policy, &config, &options)?;
    match &report.failure {
        None => println!(
            "{}: every rule held over {} operations ({:.0} ops/s)",
            report.policy,
            report.ops,
            report.ops_per_second()
        ),
        Some((finding, script)) => {
            println!("{}: {finding}\nshrunk script:\n{script}", report.policy);
            std::process::exit(1);
        }
    }
    Ok(())
}
