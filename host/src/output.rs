//! Files the tools write (a report's page, a converted trace, a recording, a check's
//! regressions, a new policy's project) are written one way, so that none harms what is
//! there: the bytes go into a file created beside the target under a name nobody can
//! plant (`tempfile`: a random name, opened `O_EXCL`, so no link is followed), which is
//! renamed over the target once whole. Before anything is written the target is judged:
//! a folder, a device, a FIFO, a socket, a symbolic link, a read-only file, or a file
//! the command reads (by identity, through any link) is refused in one sentence. Only
//! the file this module created is ever removed.
//!
//! What a command reads is one registry for the whole process ([`note_input`]): every
//! reader notes the file it opens (policies, hooks and scripts through
//! `input::read_at_most`, traces through their reader), and a command notes up front
//! what it will read later (`allocbox run` its program, the files its arguments name,
//! its policies), so whichever command writes, no output replaces an input.

use std::fs::{File, Metadata, Permissions};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

mod folder;
pub use folder::NewFolder;

/// The files this process reads, by identity (`(dev, ino)`), each with the path it was
/// first named by: one entry per distinct file, however often it is read.
static INPUTS: Mutex<Vec<((u64, u64), PathBuf)>> = Mutex::new(Vec::new());

/// Note that this process reads the file at `path` (through any link): no output may
/// replace it from now on. A path that names nothing yet, or no regular file, is
/// nothing an output could replace and is not noted.
pub fn note_input(path: &Path) {
    if let Ok(meta) = std::fs::metadata(path)
        && meta.is_file()
    {
        note_identity(&meta, path);
    }
}

/// [`note_input`] for a file already open: its identity from the descriptor, whatever
/// its name names by now.
pub fn note_open_input(file: &File, path: &Path) {
    if let Ok(meta) = file.metadata()
        && meta.is_file()
    {
        note_identity(&meta, path);
    }
}

fn note_identity(meta: &Metadata, path: &Path) {
    let identity = (meta.dev(), meta.ino());
    let mut inputs = INPUTS.lock();
    if !inputs.iter().any(|(known, _)| *known == identity) {
        inputs.push((identity, path.to_owned()));
    }
}

/// The path an input of this process was noted by, if `meta` is one.
fn noted_input(meta: &Metadata) -> Option<PathBuf> {
    let identity = (meta.dev(), meta.ino());
    INPUTS
        .lock()
        .iter()
        .find(|(known, _)| *known == identity)
        .map(|(_, path)| path.clone())
}

/// Why an output was not written: the target named and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("cannot write `{}`: {fault}", path.display())]
pub struct OutputError {
    pub path: PathBuf,
    pub fault: OutputFault,
}

/// What is wrong with an output's target, each with what to do instead.
#[derive(Debug, thiserror::Error)]
pub enum OutputFault {
    #[error("it is a folder; name a file (in it, or elsewhere)")]
    Folder,
    #[error("it is {0}, not a regular file; name a regular file")]
    NotAFile(&'static str),
    #[error(
        "it is a symbolic link; name the file it points to, or remove the link first (a link is not written through)"
    )]
    Link,
    #[error("it is read-only; make it writable (`chmod u+w`) or name another file")]
    ReadOnly,
    #[error("it is `{}`, which this command reads; name another file", .0.display())]
    IsInput(PathBuf),
    #[error(
        "its folder `{}` does not exist; create it, or name a file in a folder that does",
        .0.display()
    )]
    NoFolder(PathBuf),
    #[error("it is a file, not a folder; name a folder that does not exist or is empty")]
    NotAFolder,
    #[error("it is a folder with files in it; name a folder that does not exist or is empty")]
    NotEmpty,
    /// The OS error is the message itself, not a cause printed after it again.
    #[error("{0}")]
    Io(std::io::Error),
}

/// An output being written: [`Output::file`] takes the bytes, [`Output::commit`] puts
/// them in place. Dropped uncommitted (the command stopped, or failed), the target is
/// as it was and the file beside it is gone.
#[derive(Debug)]
pub struct Output {
    path: PathBuf,
    beside: tempfile::NamedTempFile,
}

impl Output {
    /// Judge `path` as an output (never a file this process reads: [`note_input`]), and
    /// create the file beside it that will take its place: before any other work, so
    /// that a target that cannot be written is said before the work is done.
    pub fn create(path: &Path) -> Result<Output, OutputError> {
        let fail = |fault| OutputError {
            path: path.to_owned(),
            fault,
        };
        let (existing, folder) = check(path)?;
        let name = path.file_name().ok_or_else(|| fail(OutputFault::Folder))?;
        // A file that replaces another keeps its permissions; a new one gets the
        // umask's, as any file a command creates.
        let mode = existing.map_or(0o666, |m| m.permissions().mode() & 0o7777);
        let mut prefix = std::ffi::OsString::from(".");
        prefix.push(name);
        prefix.push(".");
        let beside = tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(".partial")
            .permissions(Permissions::from_mode(mode))
            .tempfile_in(folder)
            .map_err(|error| fail(OutputFault::Io(error)))?;
        Ok(Output {
            path: path.to_owned(),
            beside,
        })
    }

    /// Where the bytes go.
    pub fn file(&mut self) -> &mut File {
        self.beside.as_file_mut()
    }

    /// Put the written file in place of the target, whole: synced, the target judged
    /// again (it may have changed while the work was done), then renamed over it.
    pub fn commit(self) -> Result<(), OutputError> {
        self.place().map(drop)
    }

    /// Put the file in place now and go on writing it: for a recording, whose trace
    /// must be at its name while the program runs (a program killed part way leaves
    /// the trace up to there, which the reader reads as cut short).
    pub fn stream(self) -> Result<File, OutputError> {
        self.place()
    }

    fn place(self) -> Result<File, OutputError> {
        let fail = |fault| OutputError {
            path: self.path.clone(),
            fault,
        };
        self.beside
            .as_file()
            .sync_all()
            .map_err(|error| fail(OutputFault::Io(error)))?;
        judge(&self.path).map_err(fail)?;
        let path = self.path.clone();
        self.beside.persist(&path).map_err(|error| OutputError {
            path,
            fault: OutputFault::Io(error.error),
        })
    }
}

/// Whether [`Output::create`] would take `path` as an output, judged without creating
/// anything: for a caller that must say so before it starts (the pytest plugin, before
/// the session; `allocbox run`, before the program). Gives the target's metadata, if
/// it exists, and its folder.
pub fn check(path: &Path) -> Result<(Option<Metadata>, &Path), OutputError> {
    let fail = |fault| OutputError {
        path: path.to_owned(),
        fault,
    };
    let existing = judge(path).map_err(fail)?;
    let folder = match path.parent() {
        Some(folder) if !folder.as_os_str().is_empty() => folder,
        _ => Path::new("."),
    };
    if !folder.is_dir() {
        return Err(fail(OutputFault::NoFolder(folder.to_owned())));
    }
    Ok((existing, folder))
}

/// Write `bytes` as the whole of the file at `path` (see [`Output`]).
pub fn write_whole(path: &Path, bytes: &[u8]) -> Result<(), OutputError> {
    use std::io::Write;
    let mut output = Output::create(path)?;
    output
        .file()
        .write_all(bytes)
        .map_err(|error| OutputError {
            path: path.to_owned(),
            fault: OutputFault::Io(error),
        })?;
    output.commit()
}

/// Whether `path` may be replaced: the target's metadata if it exists.
fn judge(path: &Path) -> Result<Option<Metadata>, OutputFault> {
    let existing = match std::fs::symlink_metadata(path) {
        Ok(existing) => existing,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(OutputFault::Io(error)),
    };
    let kind = existing.file_type();
    if kind.is_symlink() {
        return Err(OutputFault::Link);
    }
    if kind.is_dir() {
        return Err(OutputFault::Folder);
    }
    if !kind.is_file() {
        return Err(OutputFault::NotAFile(if kind.is_char_device() {
            "a character device"
        } else if kind.is_block_device() {
            "a block device"
        } else if kind.is_fifo() {
            "a FIFO (a named pipe)"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "not a file"
        }));
    }
    // By the mode bits, not by `access`: root may write anything, and `cp` still
    // refuses a read-only target unless told to force it.
    if existing.permissions().readonly() {
        return Err(OutputFault::ReadOnly);
    }
    if let Some(input) = noted_input(&existing) {
        return Err(OutputFault::IsInput(input));
    }
    Ok(Some(existing))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("allocbox-output-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_new_file_appears_whole_and_nothing_else_is_left_beside_it() {
        let dir = folder("new");
        let path = dir.join("out.txt");
        write_whole(&path, b"whole").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"whole");
        assert_eq!(names(&dir), ["out.txt"]);
    }

    #[test]
    fn an_output_dropped_uncommitted_leaves_the_target_as_it_was_and_no_file_beside_it() {
        let dir = folder("dropped");
        let path = dir.join("page.html");
        std::fs::write(&path, "older page").unwrap();
        let mut output = Output::create(&path).unwrap();
        std::io::Write::write_all(output.file(), b"half").unwrap();
        drop(output);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "older page");
        assert_eq!(names(&dir), ["page.html"]);
    }

    #[test]
    fn a_replaced_file_keeps_its_permissions() {
        let dir = folder("mode");
        let path = dir.join("trace.txt");
        std::fs::write(&path, "old").unwrap();
        std::fs::set_permissions(&path, Permissions::from_mode(0o640)).unwrap();
        write_whole(&path, b"new").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
    }

    /// Issue 64: a planted `out.txt.partial` link made `trace-convert` overwrite the
    /// file the link names. The file beside is created anew under a random name.
    #[test]
    fn a_planted_link_beside_the_target_is_neither_followed_nor_removed() {
        let dir = folder("planted");
        let victim = dir.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        for planted in ["out.txt.partial", ".out.txt.partial"] {
            std::os::unix::fs::symlink(&victim, dir.join(planted)).unwrap();
        }
        write_whole(&dir.join("out.txt"), b"converted").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(
            names(&dir),
            [".out.txt.partial", "out.txt", "out.txt.partial", "victim"]
        );
    }

    /// Issue 64: `trace-convert t.bin .` deleted the folder's own `.partial` file.
    #[test]
    fn a_folder_is_refused_and_its_files_are_left_alone() {
        let dir = folder("folder");
        std::fs::write(dir.join(".partial"), "the user's").unwrap();
        for target in [dir.clone(), dir.join("."), dir.join("..")] {
            let error = write_whole(&target, b"x").unwrap_err();
            assert!(matches!(error.fault, OutputFault::Folder), "{error}");
        }
        assert_eq!(
            std::fs::read_to_string(dir.join(".partial")).unwrap(),
            "the user's"
        );
    }

    /// Issue 64: an output that was a device node was replaced by a regular file. A
    /// FIFO stands in for a device here (making one needs no privilege).
    #[test]
    fn a_fifo_is_refused_and_stays_a_fifo() {
        let dir = folder("fifo");
        let fifo = dir.join("out.fifo");
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `name` is a NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o644) }, 0);
        let error = write_whole(&fifo, b"x").unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "cannot write `{}`: it is a FIFO (a named pipe), not a regular file; name a regular file",
                fifo.display()
            )
        );
        let kind = std::fs::symlink_metadata(&fifo).unwrap().file_type();
        assert!(kind.is_fifo());
        let error = write_whole(Path::new("/dev/null"), b"x").unwrap_err();
        assert!(
            matches!(error.fault, OutputFault::NotAFile("a character device")),
            "{error}"
        );
    }

    #[test]
    fn a_read_only_target_is_refused_and_unchanged() {
        let dir = folder("read-only");
        let path = dir.join("kept.trace");
        std::fs::write(&path, "kept").unwrap();
        std::fs::set_permissions(&path, Permissions::from_mode(0o444)).unwrap();
        let error = write_whole(&path, b"x").unwrap_err();
        assert!(matches!(error.fault, OutputFault::ReadOnly), "{error}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "kept");
    }

    #[test]
    fn a_link_is_refused_and_the_file_it_names_is_unchanged() {
        let dir = folder("link");
        std::fs::write(dir.join("real"), "real").unwrap();
        std::os::unix::fs::symlink(dir.join("real"), dir.join("link")).unwrap();
        let error = write_whole(&dir.join("link"), b"x").unwrap_err();
        assert!(matches!(error.fault, OutputFault::Link), "{error}");
        assert_eq!(std::fs::read_to_string(dir.join("real")).unwrap(), "real");
    }

    #[test]
    fn the_input_is_refused_as_output_through_a_link_or_a_hard_link() {
        let dir = folder("input");
        let input = dir.join("t.trace");
        std::fs::write(&input, "m 1 8\n").unwrap();
        std::os::unix::fs::symlink(&input, dir.join("alias")).unwrap();
        std::fs::hard_link(&input, dir.join("same")).unwrap();
        note_input(&dir.join("alias"));
        for output in [dir.join("t.trace"), dir.join("./t.trace"), dir.join("same")] {
            let error = Output::create(&output).unwrap_err();
            assert!(matches!(error.fault, OutputFault::IsInput(_)), "{error}");
        }
        assert_eq!(std::fs::read_to_string(&input).unwrap(), "m 1 8\n");
    }

    #[test]
    fn a_missing_folder_is_named() {
        let dir = folder("missing");
        let error = write_whole(&dir.join("no/such/page.html"), b"x").unwrap_err();
        assert!(
            error.to_string().ends_with(&format!(
                "its folder `{}` does not exist; create it, or name a file in a folder that does",
                dir.join("no/such").display()
            )),
            "{error}"
        );
    }

    #[test]
    fn a_stream_is_at_its_name_before_it_is_written() {
        let dir = folder("stream");
        let path = dir.join("rec.trace");
        std::fs::write(&path, "an older recording").unwrap();
        let mut file = Output::create(&path).unwrap().stream().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"");
        std::io::Write::write_all(&mut file, b"events").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"events");
        assert_eq!(names(&dir), ["rec.trace"]);
    }
}
