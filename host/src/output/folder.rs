//! A folder of new files (`allocbox new`'s project), made so that nothing else is
//! touched: the folder's parent is opened as the user named it, and from there on every
//! folder and file is created beneath an open folder by name, no symbolic link followed
//! (`O_NOFOLLOW`, files `O_EXCL`), so a link at the project's name or planted inside it
//! is refused, never written through. Dropped before [`NewFolder::commit`] (a write
//! failed: a full disk, a file that appeared meanwhile), everything it made is removed
//! and the user's folder is as it was.

use std::ffi::OsString;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, CWD, Mode, OFlags};

use super::{OutputError, OutputFault};

/// A folder being filled; see the module's docs.
#[derive(Debug)]
pub struct NewFolder {
    path: PathBuf,
    /// The folder's parent and the folder's own name in it.
    parent: OwnedFd,
    name: OsString,
    /// Whether the folder itself was made here (else it was there, empty).
    made_root: bool,
    /// The folders open beneath it by their path inside it (`""`: the folder itself).
    folders: Vec<(PathBuf, OwnedFd)>,
    /// What was made inside it, in order: each path inside it, and whether a folder.
    made: Vec<(PathBuf, bool)>,
    committed: bool,
}

fn fail(path: &Path, fault: OutputFault) -> OutputError {
    OutputError {
        path: path.to_owned(),
        fault,
    }
}

fn io_fault(error: rustix::io::Errno) -> OutputFault {
    OutputFault::Io(error.into())
}

const DIRECTORY: OFlags = OFlags::DIRECTORY
    .union(OFlags::NOFOLLOW)
    .union(OFlags::RDONLY)
    .union(OFlags::CLOEXEC);

impl NewFolder {
    /// The folder at `path`, made now, or taken if it is there and empty; a symbolic
    /// link, a file, or a folder with anything in it is refused.
    pub fn create(path: &Path) -> Result<NewFolder, OutputError> {
        let name = match path.components().next_back() {
            Some(Component::Normal(name)) => name.to_owned(),
            _ => return Err(fail(path, OutputFault::Folder)),
        };
        let parent_path = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        let parent =
            rustix::fs::openat(CWD, parent_path, DIRECTORY, Mode::empty()).map_err(|error| {
                match error {
                    rustix::io::Errno::NOENT => {
                        fail(path, OutputFault::NoFolder(parent_path.to_owned()))
                    }
                    other => fail(path, io_fault(other)),
                }
            })?;
        let made_root = match rustix::fs::mkdirat(&parent, &name, Mode::from_raw_mode(0o777)) {
            Ok(()) => true,
            Err(rustix::io::Errno::EXIST) => false,
            Err(error) => return Err(fail(path, io_fault(error))),
        };
        let mut folder = NewFolder {
            path: path.to_owned(),
            parent,
            name,
            made_root,
            folders: Vec::new(),
            made: Vec::new(),
            committed: false,
        };
        let root = folder.open_beneath(&folder.parent, &folder.name.clone())?;
        if !folder.made_root {
            let mut entries =
                rustix::fs::Dir::read_from(&root).map_err(|error| fail(path, io_fault(error)))?;
            let listed = entries.any(|entry| {
                entry.is_ok_and(|e| !matches!(e.file_name().to_bytes(), b"." | b".."))
            });
            if listed {
                return Err(fail(path, OutputFault::NotEmpty));
            }
        }
        folder.folders.push((PathBuf::new(), root));
        Ok(folder)
    }

    /// The folder `name` in `parent`, opened with no link followed: a link, or a file,
    /// refused by what it is.
    fn open_beneath(
        &self,
        parent: &OwnedFd,
        name: &std::ffi::OsStr,
    ) -> Result<OwnedFd, OutputError> {
        rustix::fs::openat(parent, name, DIRECTORY, Mode::empty()).map_err(|error| {
            let fault = match error {
                // With `O_DIRECTORY`, a link is refused as no folder: which it is, said.
                rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => {
                    match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
                        Ok(stat)
                            if rustix::fs::FileType::from_raw_mode(stat.st_mode)
                                == rustix::fs::FileType::Symlink =>
                        {
                            OutputFault::Link
                        }
                        _ => OutputFault::NotAFolder,
                    }
                }
                other => io_fault(other),
            };
            fail(&self.path, fault)
        })
    }

    /// Write `bytes` as the new file `inside` the folder (a relative path; folders on
    /// the way are made), with `mode` (less the umask, as any file a command creates).
    pub fn write(&mut self, inside: &Path, bytes: &[u8], mode: u32) -> Result<(), OutputError> {
        let target = self.path.join(inside);
        let mut names: Vec<&std::ffi::OsStr> = Vec::new();
        for component in inside.components() {
            match component {
                Component::Normal(name) => names.push(name),
                _ => return Err(fail(&target, OutputFault::Folder)),
            }
        }
        let Some((file_name, folders)) = names.split_last() else {
            return Err(fail(&target, OutputFault::Folder));
        };
        let mut at = PathBuf::new();
        for name in folders {
            let parent_at = at.clone();
            at.push(name);
            if self.folders.iter().any(|(known, _)| *known == at) {
                continue;
            }
            let parent = self.folder(&parent_at);
            match rustix::fs::mkdirat(parent, *name, Mode::from_raw_mode(0o777)) {
                Ok(()) => self.made.push((at.clone(), true)),
                Err(rustix::io::Errno::EXIST) => {}
                Err(error) => return Err(fail(&target, io_fault(error))),
            }
            let opened = self.open_beneath(self.folder(&parent_at), name)?;
            self.folders.push((at.clone(), opened));
        }
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let file = rustix::fs::openat(
            self.folder(&at),
            *file_name,
            flags,
            Mode::from_raw_mode(mode),
        )
        .map_err(|error| fail(&target, io_fault(error)))?;
        self.made.push((inside.to_owned(), false));
        let mut file = std::fs::File::from(file);
        file.write_all(bytes)
            .and_then(|()| file.sync_all())
            .map_err(|error| fail(&target, OutputFault::Io(error)))
    }

    /// The open folder at `inside`, one this folder opened.
    fn folder(&self, inside: &Path) -> &OwnedFd {
        &self
            .folders
            .iter()
            .find(|(known, _)| known == inside)
            .expect("a folder on the way is opened before what is beneath it")
            .1
    }

    /// Keep what was written.
    pub fn commit(mut self) {
        self.committed = true;
    }
}

impl Drop for NewFolder {
    /// Uncommitted: remove what was made, the last first, each by name beneath the
    /// folder it was made in (never through a link), then the folder if it was made.
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        for (inside, is_folder) in self.made.iter().rev() {
            let (Some(parent), Some(name)) = (inside.parent(), inside.file_name()) else {
                continue;
            };
            let flags = if *is_folder {
                AtFlags::REMOVEDIR
            } else {
                AtFlags::empty()
            };
            if let Some((_, folder)) = self.folders.iter().find(|(known, _)| known == parent) {
                let _ = rustix::fs::unlinkat(folder, name, flags);
            }
        }
        if self.made_root {
            let _ = rustix::fs::unlinkat(&self.parent, &self.name, AtFlags::REMOVEDIR);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("allocbox-new-folder-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_project_is_written_beneath_a_folder_made_for_it() {
        let dir = scratch("made");
        let mut folder = NewFolder::create(&dir.join("proj")).unwrap();
        folder
            .write(Path::new("src/lib.rs"), b"fn x() {}", 0o666)
            .unwrap();
        folder
            .write(Path::new("build.sh"), b"#!/bin/sh", 0o777)
            .unwrap();
        folder.commit();
        assert_eq!(
            std::fs::read(dir.join("proj/src/lib.rs")).unwrap(),
            b"fn x() {}"
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("proj/build.sh"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o100, 0o100, "{mode:o}");
    }

    /// Issue 72: NAME or `--path` a link to an empty folder got the project written
    /// through it.
    #[test]
    fn a_link_at_the_project_s_name_is_refused_and_its_target_stays_empty() {
        let dir = scratch("link");
        std::fs::create_dir(dir.join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(dir.join("elsewhere"), dir.join("proj")).unwrap();
        let error = NewFolder::create(&dir.join("proj")).unwrap_err();
        assert!(matches!(error.fault, OutputFault::Link), "{error}");
        assert_eq!(std::fs::read_dir(dir.join("elsewhere")).unwrap().count(), 0);
    }

    #[test]
    fn a_link_planted_inside_is_not_written_through() {
        let dir = scratch("planted");
        std::fs::create_dir(dir.join("elsewhere")).unwrap();
        let mut folder = NewFolder::create(&dir.join("proj")).unwrap();
        std::os::unix::fs::symlink(dir.join("elsewhere"), dir.join("proj/src")).unwrap();
        let error = folder
            .write(Path::new("src/lib.rs"), b"x", 0o666)
            .unwrap_err();
        assert!(matches!(error.fault, OutputFault::Link), "{error}");
        assert_eq!(std::fs::read_dir(dir.join("elsewhere")).unwrap().count(), 0);
    }

    /// Issue 72: on a full disk a partial project was left behind. Any failed write
    /// leaves nothing: here a file that is there already.
    #[test]
    fn a_failed_write_removes_everything_made_and_leaves_a_given_folder_empty() {
        let dir = scratch("failed");
        let mut folder = NewFolder::create(&dir.join("proj")).unwrap();
        folder.write(Path::new("a/b/c.txt"), b"c", 0o666).unwrap();
        assert!(
            folder
                .write(Path::new("a/b/c.txt"), b"again", 0o666)
                .is_err()
        );
        drop(folder);
        assert!(!dir.join("proj").exists());
        std::fs::create_dir(dir.join("given")).unwrap();
        let mut folder = NewFolder::create(&dir.join("given")).unwrap();
        folder.write(Path::new("x/y.txt"), b"y", 0o666).unwrap();
        drop(folder);
        assert_eq!(std::fs::read_dir(dir.join("given")).unwrap().count(), 0);
    }

    #[test]
    fn a_folder_with_anything_in_it_or_a_file_is_refused() {
        let dir = scratch("full");
        std::fs::create_dir(dir.join("used")).unwrap();
        std::fs::write(dir.join("used/keep"), "mine").unwrap();
        let error = NewFolder::create(&dir.join("used")).unwrap_err();
        assert!(matches!(error.fault, OutputFault::NotEmpty), "{error}");
        std::fs::write(dir.join("file"), "mine").unwrap();
        assert!(NewFolder::create(&dir.join("file")).is_err());
        assert_eq!(
            std::fs::read_to_string(dir.join("used/keep")).unwrap(),
            "mine"
        );
        assert_eq!(std::fs::read_to_string(dir.join("file")).unwrap(), "mine");
    }
}
