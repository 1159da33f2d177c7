//! Files the host reads whole (a policy, a hook, a replay script) are input: each is
//! judged by its size before it is read, so a file far past its bound costs a `stat`,
//! not its size in memory.

use std::io::Read;
use std::path::Path;

/// Why a file was not read: the OS said no, or it has more than the bound (`len`: its
/// size, or for what has no size, such as a pipe, the bound and one byte).
#[derive(Debug)]
pub enum TooLong {
    Io(std::io::Error),
    Bytes { len: u64, limit: u64 },
}

/// The bytes of the file at `path`, at most `limit` of them: refused by the file's
/// size before it is read, and for what has no size (a pipe, a file that grows) after
/// one byte more than the bound at most. A folder is refused as the OS names it.
pub fn read_at_most(path: &Path, limit: u64) -> Result<Vec<u8>, TooLong> {
    let file = std::fs::File::open(path).map_err(TooLong::Io)?;
    let known = file.metadata().map_err(TooLong::Io)?;
    if known.is_dir() {
        return Err(TooLong::Io(std::io::ErrorKind::IsADirectory.into()));
    }
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
