//! Command handler: runs one rendered program invocation as a subprocess in its own
//! process group, feeds it stdin, keeps bounded tails of its output, and classifies how it
//! exited.
//!
//! It must never go through a shell (arguments are argv, verbatim), never let the program
//! inherit the runner's environment (it gets [`Invocation::env`] and nothing else), never
//! buffer unbounded output, and never leave the process group behind: a timeout or a
//! cancelled run kills the whole group, grandchildren included.

use std::io;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::{ChildStdin, Command};

use super::{HandlerError, tail_excerpt, with_excerpt};

/// How much of stdout and of stderr is kept, each; older bytes are dropped.
pub const CAPTURE_BYTES: usize = 64 * 1024;

/// What the program reads on standard input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stdin {
    /// Nothing: stdin is `/dev/null`.
    Null,
    /// These bytes, then end of file.
    Bytes(Vec<u8>),
}

/// A fully rendered program invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// The program to execute; a bare name is looked up in the `PATH` of `env`.
    pub program: PathBuf,
    /// Arguments, passed as argv without any shell interpretation.
    pub args: Vec<String>,
    /// The program's whole environment: nothing is inherited from the runner.
    pub env: Vec<(String, String)>,
    /// What the program reads on standard input.
    pub stdin: Stdin,
    /// How long the program may run before its process group is killed.
    pub timeout: Duration,
    /// Exit codes that mean "retrying cannot help" (e.g. 65, `EX_DATAERR`).
    pub permanent_exit_codes: Vec<i32>,
}

/// What a successful run printed: the last [`CAPTURE_BYTES`] of each stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Output {
    /// Tail of standard output.
    pub stdout: Vec<u8>,
    /// Tail of standard error.
    pub stderr: Vec<u8>,
}

/// Runs `invocation` to completion and classifies its exit.
///
/// A run ends when the program has exited and both output pipes are closed, so a
/// background process that keeps stdout open keeps the run going until the timeout.
pub async fn run(invocation: &Invocation) -> Result<Output, HandlerError> {
    let mut command = Command::new(&invocation.program);
    command
        .args(&invocation.args)
        // The runner's environment holds its broker URL and tokens: nothing is inherited.
        .env_clear()
        .envs(invocation.env.iter().map(|(name, value)| (name, value)))
        .stdin(match invocation.stdin {
            Stdin::Null => Stdio::null(),
            Stdin::Bytes(_) => Stdio::piped(),
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        // A group of its own, led by the child, so one signal reaches everything it starts.
        .process_group(0);
    let mut child = command.spawn().map_err(|error| spawn_error(&invocation.program, &error))?;
    let group = ProcessGroup { pgid: child.id().and_then(|id| libc::pid_t::try_from(id).ok()) };

    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let input = match &invocation.stdin {
        Stdin::Null => &[][..],
        Stdin::Bytes(bytes) => bytes.as_slice(),
    };
    let finished = tokio::time::timeout(invocation.timeout, async {
        // All pipes at once: a child that fills one pipe before reading another must not
        // wait on us while we wait on it.
        let pipes = tokio::join!(feed(stdin, input), read_tail(stdout), read_tail(stderr));
        // Reaping comes last and completes the run in the same poll, so a timeout always
        // finds the child unreaped and its group id still ours to signal.
        (pipes, child.wait().await)
    })
    .await;
    let Ok(((fed, stdout, stderr), status)) = finished else {
        drop(group);
        // Reap the killed child now rather than leave that to tokio's orphan queue.
        let _ = child.wait().await;
        return Err(HandlerError::timeout(invocation.timeout));
    };
    // The child is reaped, so its pid, and with it the group id, may be reused: the group
    // must never be signalled from here on.
    group.forget();

    let status = status.map_err(|error| io_error("waiting for the program", &error))?;
    let output = Output {
        stdout: stdout.map_err(|error| io_error("reading stdout", &error))?,
        stderr: stderr.map_err(|error| io_error("reading stderr", &error))?,
    };
    classify(status, &output.stderr, &invocation.permanent_exit_codes)?;
    fed.map_err(|error| io_error("writing stdin", &error))?;
    Ok(output)
}

/// Classifies a program that could not even be started.
fn spawn_error(program: &std::path::Path, error: &io::Error) -> HandlerError {
    let text = format!("cannot run \"{}\": {error}", program.display());
    let broken_config = matches!(
        error.kind(),
        io::ErrorKind::NotFound
            | io::ErrorKind::PermissionDenied
            | io::ErrorKind::NotADirectory
            | io::ErrorKind::ArgumentListTooLong
    ) || error.raw_os_error() == Some(libc::ENOEXEC);
    if broken_config {
        HandlerError::permanent(text)
    } else {
        // Resource exhaustion (EAGAIN, EMFILE, ENOMEM) passes.
        HandlerError::transient(text)
    }
}

fn io_error(doing: &str, error: &io::Error) -> HandlerError {
    HandlerError::transient(format!("{doing}: {error}"))
}

/// Exit 0 is success; anything else fails, permanently only when configured so.
fn classify(status: ExitStatus, stderr: &[u8], permanent_exit_codes: &[i32]) -> Result<(), HandlerError> {
    use std::os::unix::process::ExitStatusExt as _;

    let (prefix, permanent) = match (status.code(), status.signal()) {
        (Some(0), _) => return Ok(()),
        (Some(code), _) => (format!("exit {code}"), permanent_exit_codes.contains(&code)),
        (None, Some(signal)) => (format!("killed by signal {signal}"), false),
        (None, None) => (format!("ended without an exit code ({status})"), false),
    };
    let error = with_excerpt(prefix, tail_excerpt(stderr));
    Err(if permanent { HandlerError::permanent(error) } else { HandlerError::transient(error) })
}

/// Writes `input` to the child and closes its stdin.
async fn feed(stdin: Option<ChildStdin>, input: &[u8]) -> io::Result<()> {
    let Some(mut stdin) = stdin else {
        return Ok(());
    };
    match stdin.write_all(input).await {
        // The program may exit, or close stdin, without reading it all: its exit says
        // whether that was fine.
        Err(error) if error.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        result => result,
    }
}

/// Reads `pipe` to the end, keeping only the last [`CAPTURE_BYTES`].
async fn read_tail(pipe: Option<impl AsyncRead + Unpin>) -> io::Result<Vec<u8>> {
    let mut tail = Tail::new(CAPTURE_BYTES);
    let Some(mut pipe) = pipe else {
        return Ok(tail.into_bytes());
    };
    let mut chunk = vec![0; 16 * 1024];
    loop {
        match pipe.read(&mut chunk).await? {
            0 => return Ok(tail.into_bytes()),
            n => tail.push(&chunk[..n]),
        }
    }
}

/// The last `limit` bytes of a stream of any length.
struct Tail {
    bytes: Vec<u8>,
    limit: usize,
}

impl Tail {
    fn new(limit: usize) -> Self {
        Self { bytes: Vec::new(), limit }
    }

    fn push(&mut self, chunk: &[u8]) {
        self.bytes.extend_from_slice(chunk);
        // Trimming only past twice the limit keeps the copying amortised.
        if self.bytes.len() > 2 * self.limit {
            self.trim();
        }
    }

    fn into_bytes(mut self) -> Vec<u8> {
        self.trim();
        self.bytes
    }

    fn trim(&mut self) {
        let excess = self.bytes.len().saturating_sub(self.limit);
        self.bytes.drain(..excess);
    }
}

/// The child's process group, killed on drop so that neither a timeout nor a cancelled
/// run (the caller dropped the future) leaves grandchildren running.
struct ProcessGroup {
    pgid: Option<libc::pid_t>,
}

impl ProcessGroup {
    /// Gives up on killing the group, once the child has been reaped.
    fn forget(mut self) {
        self.pgid = None;
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        if let Some(pgid) = self.pgid {
            kill_group(pgid);
        }
    }
}

/// Sends SIGKILL to every process in group `pgid`; a group already gone is fine.
fn kill_group(pgid: libc::pid_t) {
    // SAFETY: killpg only sends a signal; it touches no memory of ours. `pgid` is the id
    // of a child we spawned with `process_group(0)` and have not reaped yet, so the group
    // id cannot have been reused by an unrelated group.
    unsafe {
        libc::killpg(pgid, libc::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt as _;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn tail_keeps_exactly_the_last_bytes(
            chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 0..20),
            limit in 1usize..64,
        ) {
            let mut tail = Tail::new(limit);
            for chunk in &chunks {
                tail.push(chunk);
            }
            let all = chunks.concat();
            let expected = &all[all.len().saturating_sub(limit)..];
            prop_assert_eq!(tail.into_bytes(), expected);
        }
    }

    #[test]
    fn exits_are_classified_as_designed() {
        let permanent = [65, 78];
        let transient = |error: &str| Err(HandlerError::transient(error));
        let cases = [
            (ExitStatus::from_raw(0), &b"noise"[..], Ok(())),
            (ExitStatus::from_raw(65 << 8), b"bad payload\n", Err(HandlerError::permanent("exit 65: bad payload"))),
            (ExitStatus::from_raw(3 << 8), b"", transient("exit 3")),
            (ExitStatus::from_raw(1 << 8), b"  try\nagain  ", transient("exit 1: try again")),
            (ExitStatus::from_raw(libc::SIGKILL), b"", transient("killed by signal 9")),
            (ExitStatus::from_raw(libc::SIGSEGV), b"oops", transient("killed by signal 11: oops")),
        ];
        for (status, stderr, expected) in cases {
            assert_eq!(classify(status, stderr, &permanent), expected, "{status}");
        }
    }

    #[test]
    fn spawn_errors_blame_the_config_only_when_it_is_at_fault() {
        let program = std::path::Path::new("./scripts/resize.sh");
        let cases = [
            (io::Error::from(io::ErrorKind::NotFound), true),
            (io::Error::from(io::ErrorKind::PermissionDenied), true),
            (io::Error::from_raw_os_error(libc::ENOEXEC), true),
            (io::Error::from_raw_os_error(libc::EAGAIN), false),
            (io::Error::from_raw_os_error(libc::EMFILE), false),
        ];
        for (error, permanent) in cases {
            let classified = spawn_error(program, &error);
            assert_eq!(matches!(classified, HandlerError::Permanent { .. }), permanent, "{error}");
            assert!(classified.to_string().starts_with("cannot run \"./scripts/resize.sh\": "), "{classified}");
        }
    }
}
