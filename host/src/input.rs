//! Files the host reads whole (a policy, a hook, a replay script) are input: each is
//! judged by its size before it is read, so a file far past its bound costs a `stat`,
//! not its size in memory.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Open `path` for reading without waiting at the open: a FIFO with no writer would
/// hold the command there for good, where its read now finds the end at once. The file
/// is then read as any, blocking.
fn open_to_read(path: &Path) -> std::io::Result<std::fs::File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is the descriptor `file` owns, open for the whole call; F_GETFL and
    // F_SETFL read and set its status flags and touch no memory.
    let cleared = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// Why a file was not read: the OS said no, or it has more than the bound (`len`: its
/// size, or for what has no size, such as a pipe, the bound and one byte).
#[derive(Debug)]
pub enum TooLong {
    Io(std::io::Error),
    Bytes { len: u64, limit: u64 },
}

/// The bytes of the file at `path`, at most `limit` of them: refused by the file's
/// size before it is read, and for what has no size (a pipe, a file that grows) after
/// one byte more than the bound at most. A folder is refused as the OS names it. The
/// file is noted as this command's input (`output::note_input`).
pub fn read_at_most(path: &Path, limit: u64) -> Result<Vec<u8>, TooLong> {
    let file = open_to_read(path).map_err(TooLong::Io)?;
    let known = file.metadata().map_err(TooLong::Io)?;
    if known.is_dir() {
        return Err(TooLong::Io(std::io::ErrorKind::IsADirectory.into()));
    }
    crate::output::note_open_input(&file, path);
    if known.is_file() && known.len() > limit {
        return Err(TooLong::Bytes {
            len: known.len(),
            limit,
        });
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(TooLong::Io)?;
    match bytes.len() as u64 {
        len if len > limit => Err(TooLong::Bytes { len, limit }),
        _ => Ok(bytes),
    }
}
