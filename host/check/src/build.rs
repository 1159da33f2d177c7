//! Building a policy author's crate for the checker: what their `cargo test` runs before
//! [`crate::assert_contract`], so that the test checks the source it sits beside, not
//! whatever `.wasm` an earlier build left.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A policy crate that did not build.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("cannot run cargo ({cargo}) to build the policy: {error}")]
    Cargo {
        cargo: String,
        error: std::io::Error,
    },
    /// Cargo's own output says why.
    #[error("the policy in {} did not build for wasm32-wasip2:\n{output}", dir.display())]
    Failed { dir: PathBuf, output: String },
    #[error("the build of {} made no {}", dir.display(), wasm.display())]
    Missing { dir: PathBuf, wasm: PathBuf },
}

/// Build the policy crate in `dir` (a `cdylib` named `package`) for `wasm32-wasip2` in
/// release, into a target folder of its own (`target/contract`, so that a `cargo test`
/// already holding `target`'s lock does not wait for itself), and give the component's
/// path. A test calls it with `env!("CARGO_MANIFEST_DIR")` and `env!("CARGO_PKG_NAME")`;
/// the cargo running the test builds it, with the toolchain the crate pins.
pub fn build_policy(dir: impl AsRef<Path>, package: &str) -> Result<PathBuf, BuildError> {
    let dir = dir.as_ref();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = dir.join("target").join("contract");
    let output = Command::new(&cargo)
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--manifest-path",
        ])
        .arg(dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .output()
        .map_err(|error| BuildError::Cargo {
            cargo: cargo.clone(),
            error,
        })?;
    if !output.status.success() {
        return Err(BuildError::Failed {
            dir: dir.to_owned(),
            output: String::from_utf8_lossy(&output.stderr)
                .trim_end()
                .to_owned(),
        });
    }
    let wasm = target
        .join("wasm32-wasip2")
        .join("release")
        .join(format!("{}.wasm", package.replace('-', "_")));
    match wasm.is_file() {
        true => Ok(wasm),
        false => Err(BuildError::Missing {
            dir: dir.to_owned(),
            wasm,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_that_is_no_policy_crate_is_said_with_cargo_s_own_reason() {
        let dir = std::env::temp_dir().join(format!("allocbox-no-crate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let error = build_policy(&dir, "nothing");
        std::fs::remove_dir_all(&dir).unwrap();
        let text = error.unwrap_err().to_string();
        assert!(text.starts_with("the policy in "), "{text}");
        assert!(
            text.contains("Cargo.toml"),
            "cargo says what it lacks: {text}"
        );
    }
}
