//! The `allocbox` command line.
//!
//! Exit status: 0 success, 2 unusable input (a file that is not a policy, a bad
//! configuration).

use std::path::PathBuf;
use std::process::ExitCode;

use allocbox::{HandlerBuilder, Policy, Runtime};
use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(version, about = "Sandboxed, checkable NEP 49 allocation policies")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show what a policy is: name, version, alignment, world, imports, exports, size.
    /// With no file, the built-in default policy.
    Inspect {
        /// A policy component (.wasm) or WAT source (.wat).
        policy: Option<PathBuf>,
        /// Configuration passed to the policy's `init`, as KEY=VALUE (repeatable).
        #[arg(long = "config", short = 'c', value_parser = parse_key_value)]
        config: Vec<(String, String)>,
    },
}

fn parse_key_value(s: &str) -> Result<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => bail!("expected KEY=VALUE, got `{s}`"),
    }
}

fn load(runtime: &Runtime, path: Option<&PathBuf>) -> Result<Policy> {
    Ok(match path {
        Some(path) => runtime.load_file(path)?,
        None => runtime
            .load(allocbox::DEFAULT_POLICY_WAT.as_bytes())
            .context("the built-in default policy")?,
    })
}

fn inspect(policy: Option<PathBuf>, config: Vec<(String, String)>) -> Result<()> {
    let runtime = Runtime::shared();
    let loaded = load(runtime, policy.as_ref())?;
    let config: Vec<(&str, &str)> = config
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let handler = HandlerBuilder::new(runtime)
        .link_with(&loaded, &config)
        .build()?;
    let info = handler.info();
    let source = policy.map_or("built-in default".to_string(), |p| p.display().to_string());
    let batch = if info.batch {
        "yes (host magazines allowed)"
    } else {
        "no"
    };
    let report = format!(
        "policy     {name}\nsource     {source}\nversion    {version}\nalignment  {alignment}\n\
         batch      {batch}\nworld      {package}/policy@{world_version}\nsize       {size} bytes\n\
         imports    {imports}\nexports    {exports}\n",
        name = info.name,
        version = info.version,
        alignment = info.alignment,
        package = allocbox::WORLD_PACKAGE,
        world_version = allocbox::WORLD_VERSION,
        size = loaded.size(),
        imports = loaded.imports().join("\n           "),
        exports = loaded.exports().join("\n           "),
    );
    print_report(&report);
    Ok(())
}

/// Print to stdout; a reader that went away (`| head`) is not an error.
fn print_report(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect { policy, config } => inspect(policy, config),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("allocbox: {e:#}");
            ExitCode::from(2)
        }
    }
}
