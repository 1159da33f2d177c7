//! `allocbox inspect`: what a policy is, as the host sees it once it has started.

use std::path::PathBuf;

use allocbox::{HandlerBuilder, Runtime};
use anyhow::Result;

use crate::named::load;
use crate::outcome::print_report;

pub(crate) fn inspect(policy: Option<PathBuf>, config: Vec<(String, String)>) -> Result<()> {
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
    let yes_no = |yes: bool, what: &str| match yes {
        true => format!("yes ({what})"),
        false => "no".to_string(),
    };
    let report = format!(
        "policy     {name}\nsource     {source}\nlanguage   {language}\n\
         contract   {world_version} (world {package}/policy@{world_version})\n\
         handler    NEP 49 version {version}\nalignment  {alignment}\nbatch      {batch}\n\
         shardable  {shardable}\ndiagnoses  {diagnoses}\n\
         size       {size} bytes\nimports    {imports}\nexports    {exports}\n",
        name = info.name,
        language = loaded.language().unwrap_or("not stated by its toolchain"),
        version = info.version,
        alignment = info.alignment,
        package = allocbox::WORLD_PACKAGE,
        world_version = loaded.world_version(),
        shardable = yes_no(
            info.shardable,
            "an instance per thread: `per_thread=True`, `check --threads N`"
        ),
        diagnoses = yes_no(
            info.diagnoses,
            "it reports its client's misuse; allocation sites are recorded"
        ),
        size = loaded.size(),
        imports = loaded.imports().join("\n           "),
        exports = loaded.exports().join("\n           "),
    );
    print_report(&report);
    Ok(())
}
