//! A trace file opened once and read in passes through that one descriptor: a command
//! that reads a trace more than once (a survey, then a replay per policy) reads the same
//! bytes each time, whatever happens to the name meanwhile, and refuses a file that
//! changed between passes rather than compare two workloads as one.
//!
//! Only a regular file is a trace file: a FIFO, a socket or a device is refused by what
//! it is, after an open that cannot block (a FIFO with no writer would hold the command
//! for good), since its bytes could be read once only.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use super::TraceError;

/// A trace file, open, and what it was when opened.
#[derive(Debug)]
pub struct TraceFile {
    file: Arc<File>,
    path: PathBuf,
    /// Its size and time of change when opened: a pass that finds either different
    /// refuses the file.
    len: u64,
    modified: Option<SystemTime>,
}

impl TraceFile {
    /// Open the trace at `path` (noted as this command's input, so no output replaces
    /// it).
    pub fn open(path: impl AsRef<Path>) -> Result<TraceFile, TraceError> {
        let path = path.as_ref();
        // Non-blocking, so that a FIFO with no writer is refused rather than waited on;
        // the flag matters to nothing else read here, and a regular file ignores it.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)?;
        let meta = file.metadata()?;
        let kind = meta.file_type();
        if !kind.is_file() {
            return Err(TraceError::NotAFile(if kind.is_dir() {
                "a folder"
            } else if kind.is_fifo() {
                "a FIFO or a pipe"
            } else if kind.is_socket() {
                "a socket"
            } else if kind.is_char_device() || kind.is_block_device() {
                "a device"
            } else {
                "not a regular file"
            }));
        }
        crate::output::note_open_input(&file, path);
        Ok(TraceFile {
            file: Arc::new(file),
            path: path.to_owned(),
            len: meta.len(),
            modified: meta.modified().ok(),
        })
    }

    /// The path it was opened by.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its size when opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it was empty when opened.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether its first bytes are `magic` (a form's: [`super::BINARY_MAGIC`]).
    pub fn starts_with(&self, magic: &[u8]) -> Result<bool, TraceError> {
        let mut start = vec![0u8; magic.len()];
        let read = read_up_to(&mut self.bytes()?, &mut start)?;
        Ok(start[..read] == *magic)
    }

    /// The file's bytes from its start, once it is checked to be as it was opened.
    pub(crate) fn bytes(&self) -> Result<ReadAt, TraceError> {
        self.unchanged()?;
        Ok(ReadAt {
            file: self.file.clone(),
            offset: 0,
        })
    }

    /// The open file itself, once it is checked to be as it was opened.
    pub(crate) fn shared(&self) -> Result<Arc<File>, TraceError> {
        self.unchanged()?;
        Ok(self.file.clone())
    }

    fn unchanged(&self) -> Result<(), TraceError> {
        let now = self.file.metadata()?;
        if now.len() != self.len || now.modified().ok() != self.modified {
            return Err(TraceError::Changed {
                was: self.len,
                is: now.len(),
            });
        }
        Ok(())
    }
}

/// A file read from `offset` on, by position: every reader of one [`TraceFile`] reads
/// the one file opened, each from where it is.
#[derive(Debug)]
pub(crate) struct ReadAt {
    pub(crate) file: Arc<File>,
    pub(crate) offset: u64,
}

impl Read for ReadAt {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let read = self.file.read_at(buf, self.offset)?;
        self.offset += read as u64;
        Ok(read)
    }
}

/// As many bytes as `file` has, up to `buf`'s length.
pub(crate) fn read_up_to(file: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut read = 0;
    while read < buf.len() {
        match file.read(&mut buf[read..])? {
            0 => break,
            n => read += n,
        }
    }
    Ok(read)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("allocbox-file-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Issue 72: a FIFO with no writer held `report` for good; a pipe was refused as
    /// "Illegal seek (os error 29)".
    #[test]
    fn a_fifo_is_refused_at_once_by_what_it_is() {
        let dir = folder("fifo");
        let fifo = dir.join("t.fifo");
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `name` is a NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o644) }, 0);
        let error = TraceFile::open(&fifo).unwrap_err();
        assert_eq!(
            error.to_string(),
            "it is a FIFO or a pipe, not a file: allocbox reads a trace from a regular file \
             (it reads it more than once); save it to one and name that"
        );
    }

    /// Issue 72: a trace replaced between two passes was compared as two workloads.
    #[test]
    fn a_file_that_changed_since_it_was_opened_is_refused_at_the_next_pass() {
        let dir = folder("changed");
        let path = dir.join("t.txt");
        std::fs::write(&path, "m 1 8\nf 1 8\n").unwrap();
        let trace = TraceFile::open(&path).unwrap();
        let mut first = String::new();
        trace.bytes().unwrap().read_to_string(&mut first).unwrap();
        assert_eq!(first, "m 1 8\nf 1 8\n");
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| io::Write::write_all(&mut f, b"m 2 8\n"))
            .unwrap();
        let error = trace.bytes().unwrap_err().to_string();
        assert!(
            error.starts_with("the trace changed since it was first read"),
            "{error}"
        );
    }

    /// A file replaced by another of the same name is still the one opened.
    #[test]
    fn a_pass_reads_the_file_opened_whatever_its_name_names_now() {
        let dir = folder("renamed");
        let path = dir.join("t.txt");
        std::fs::write(&path, "m 1 8\n").unwrap();
        let trace = TraceFile::open(&path).unwrap();
        std::fs::write(dir.join("other"), "m 9 9\n").unwrap();
        std::fs::rename(dir.join("other"), &path).unwrap();
        let mut again = String::new();
        trace.bytes().unwrap().read_to_string(&mut again).unwrap();
        assert_eq!(again, "m 1 8\n");
    }
}
