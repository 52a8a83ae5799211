//! Writing a command's output. A reader that goes away early (`sluice plan | head`) is the
//! normal end of a pipeline, not an error: the rest of the output is dropped and the command
//! ends with its own exit code, without a word. `print!` would panic instead (exit 101).
//!
//! Rust ignores SIGPIPE, so a closed pipe shows up here as a `BrokenPipe` error to map.

use std::io::{self, Write as _};

/// Writes `text` to stdout. A closed stdout is not an error (see the module doc); any other
/// failure (a full disk behind `>`) is.
pub fn stdout(text: &str) -> io::Result<()> {
    stdout_bytes(text.as_bytes())
}

/// Writes `bytes` (roff, a completion script) to stdout, as [`stdout`] does.
pub fn stdout_bytes(bytes: &[u8]) -> io::Result<()> {
    let mut out = io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// Writes `text` to stderr. A failure there has nowhere left to be reported, so it is ignored.
pub fn stderr(text: &str) {
    let _ = io::stderr().lock().write_all(text.as_bytes());
}
