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
    let report = format!(
        "policy     {name}\nsource     {source}\nlanguage   {language}\nversion    {version}\n\
         alignment  {alignment}\nbatch      {batch}\nworld      {package}/policy@{world_version}\n\
         size       {size} bytes\nimports    {imports}\nexports    {exports}\n",
        name = info.name,
        language = loaded.language().unwrap_or("not stated by its toolchain"),
        version = info.version,
        alignment = info.alignment,
        package = allocbox::WORLD_PACKAGE,
        world_version = loaded.world_version(),
        size = loaded.size(),
        imports = loaded.imports().join("\n           "),
        exports = loaded.exports().join("\n           "),
    );
    print_report(&report);
    Ok(())
}
