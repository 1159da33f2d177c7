//! Failing seeds kept between runs, so that a later check of the same policy tries them
//! first: one seed a line in `<dir>/<name>.seeds`, the name the policy's and a digest of
//! its binary and configuration (`CheckReport::regression_name`).
//!
//! proptest's own file persistence prints advice meant for proptest's users ("If this
//! test was run on a CI system...", `cc` lines) into the checker's output and writes
//! Rust `Debug` values beside the seeds; this keeps only the seeds and says nothing. The
//! script a user replays is written by the command line, beside this file.

use std::any::Any;
use std::fmt;
use std::path::PathBuf;

use proptest::test_runner::{FailurePersistence, PersistedSeed};

/// The seeds of one policy's failures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SeedFile {
    path: PathBuf,
}

impl SeedFile {
    pub(super) fn new(dir: &std::path::Path, policy: &str) -> SeedFile {
        SeedFile {
            path: dir.join(format!("{policy}.seeds")),
        }
    }

    fn seeds(&self) -> Vec<String> {
        std::fs::read_to_string(&self.path)
            .map(|text| text.lines().map(str::to_string).collect())
            .unwrap_or_default()
    }
}

impl FailurePersistence for SeedFile {
    fn load_persisted_failures2(&self, _source_file: Option<&'static str>) -> Vec<PersistedSeed> {
        // A line that is not a seed (edited by hand, or from another version) is skipped:
        // the seeds only make a check find a known failure sooner.
        self.seeds()
            .iter()
            .filter_map(|line| line.parse().ok())
            .collect()
    }

    fn save_persisted_failure2(
        &mut self,
        _source_file: Option<&'static str>,
        seed: PersistedSeed,
        _shrunken_value: &dyn fmt::Debug,
    ) {
        let line = seed.to_string();
        let mut seeds = self.seeds();
        if seeds.contains(&line) {
            return;
        }
        seeds.push(line);
        // A seed that cannot be kept costs a later run some time, nothing else; the
        // script the report names is written, and its failure reported, elsewhere.
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = allocbox::output::write_whole(&self.path, (seeds.join("\n") + "\n").as_bytes());
    }

    fn box_clone(&self) -> Box<dyn FailurePersistence> {
        Box::new(self.clone())
    }

    fn eq(&self, other: &dyn FailurePersistence) -> bool {
        other
            .as_any()
            .downcast_ref::<SeedFile>()
            .is_some_and(|other| other == self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_kept_once_each_and_read_back() {
        let dir = std::env::temp_dir().join(format!("allocbox-seeds-{}", std::process::id()));
        let mut file = SeedFile::new(&dir, "policy");
        assert!(file.load_persisted_failures2(None).is_empty());
        let seed: PersistedSeed = "xs 1 2 3 4".parse().expect("a seed");
        file.save_persisted_failure2(None, seed.clone(), &());
        file.save_persisted_failure2(None, seed.clone(), &());
        let loaded = file.load_persisted_failures2(None);
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0].to_string(), seed.to_string());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
