//! Reading a file that sluice is pointed at (a pipeline file, a payload schema, a PEM, a
//! secret): only a regular file, and never past a limit. And making the directories that hold
//! its state, which are their owner's alone.

use std::path::Path;

/// Why a file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("not a regular file ({0})")]
    NotRegular(&'static str),
    #[error("larger than {}, the most sluice reads", size(*.0))]
    TooLarge(u64),
    #[error("not UTF-8 text")]
    NotUtf8,
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Creates `dir` and the parents it lacks, each mode 0700 whatever the umask: a state
/// directory holds the broker's messages and the admin token, which no other user may read or
/// replace. A directory already there is left as it is.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

/// Reads a regular file of at most `limit` bytes as UTF-8 text.
///
/// A FIFO would block the open and the read forever and a device may never end, so the file
/// is opened without blocking and checked through the opened handle (the path could be
/// swapped in between), then read no further than `limit`: `/proc` files say they are empty.
pub fn read_regular(path: &Path, limit: u64) -> Result<String, ReadError> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;

    // Refuse before opening when we can: opening some devices has side effects.
    kind_check(&std::fs::metadata(path)?)?;
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path)?;
    let meta = file.metadata()?;
    kind_check(&meta)?;
    if meta.len() > limit {
        return Err(ReadError::TooLarge(limit));
    }
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(ReadError::TooLarge(limit));
    }
    String::from_utf8(bytes).map_err(|_| ReadError::NotUtf8)
}

/// `1 MiB`, `64 KiB` or `100 bytes`: a limit as people write it.
fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} bytes"),
    }
}

fn kind_check(meta: &std::fs::Metadata) -> Result<(), ReadError> {
    use std::os::unix::fs::FileTypeExt as _;
    let kind = meta.file_type();
    let what = if kind.is_file() {
        return Ok(());
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else {
        "an unknown kind"
    };
    Err(ReadError::NotRegular(what))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    // Issue 9: a FIFO blocked, /dev/zero never ended, /proc files say they are empty.
    #[test]
    fn only_regular_files_are_read_and_never_past_the_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = |name: &str| dir.path().join(name);
        std::fs::write(path("small.yaml"), "version: 1\n").expect("write");
        std::fs::write(path("big.yaml"), vec![b'#'; 2048]).expect("write");
        std::fs::write(path("latin1.yaml"), b"caf\xe9\n").expect("write");
        let fifo = std::ffi::CString::new(path("fifo.yaml").into_os_string().into_encoded_bytes()).expect("path");
        // SAFETY: mkfifo with a NUL-terminated path we own.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0, "mkfifo");
        let cases: Vec<(PathBuf, &str)> = vec![
            (path("small.yaml"), "ok"),
            (path("big.yaml"), "larger than 1 KiB, the most sluice reads"),
            (path("latin1.yaml"), "not UTF-8 text"),
            (path("fifo.yaml"), "not a regular file (a FIFO)"),
            (dir.path().to_path_buf(), "not a regular file (a directory)"),
            (PathBuf::from("/dev/zero"), "not a regular file (a device)"),
            (PathBuf::from("/proc/self/status"), "larger than 1 KiB, the most sluice reads"),
            (path("missing.yaml"), "No such file or directory"),
        ];
        for (path, want) in cases {
            let got = match read_regular(&path, 1024) {
                Ok(_) => "ok".to_string(),
                Err(e) => e.to_string(),
            };
            assert!(got.contains(want), "{}: {got}", path.display());
        }
    }
}
