//! Command handler: runs one rendered program invocation as a subprocess in its own
//! process group, feeds it stdin, keeps bounded tails of its output, and classifies how it
//! exited (by `permanent_exit_codes` and the `on_exit` rules). The tails' ends are logged at debug.
//!
//! It must never go through a shell (arguments are argv, verbatim), never let the program
//! inherit the runner's environment (it gets [`Invocation::env`] and nothing else), never
//! buffer unbounded output, and never leave the process group behind: however a run ends
//! (success, failure, timeout, cancellation) the whole group is killed, grandchildren
//! included. A process that leaves the group (`setsid`) escapes that; a cgroup is the tool
//! for those.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::{ChildStdin, Command};

use super::rules::{Action, Rules, Verdict};
use super::template::{Escape, Template};
use super::{HandlerError, Observed, tail_excerpt, with_excerpt};

/// How much of stdout and of stderr is kept, each; older bytes are dropped.
pub const CAPTURE_BYTES: usize = 64 * 1024;

/// How long the output pipes are still read once the program has exited and its group is
/// killed. What it wrote before exiting is in the pipes already; only a process that left the
/// group can hold them open now, and it is not waited for.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);

/// How often the program's exit is checked for without a SIGCHLD: a backstop only, SIGCHLD
/// normally wakes the check at once.
const EXIT_POLL: Duration = Duration::from_millis(250);

/// What the program reads on standard input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stdin {
    /// Nothing: stdin is `/dev/null`.
    Null,
    /// These bytes, then end of file.
    Bytes(bytes::Bytes),
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
    /// The queue's `on_exit` rules (shared, not copied per message).
    pub on_exit: Arc<Rules>,
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
/// The run ends when the program exits, and its exit status alone decides the outcome: a
/// background process that keeps stdout open neither holds the run up nor survives it, since
/// the process group is killed then. Output written before the exit is kept.
/// The exit code and the start of the stderr captured go into `observed`.
pub async fn run(invocation: &Invocation, observed: &mut Observed) -> Result<Output, HandlerError> {
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
    let Some(pid) = child.id().and_then(|id| libc::pid_t::try_from(id).ok()) else {
        // Only a reaped child has no id, and nothing has reaped this one.
        return Err(HandlerError::transient("the program started without a process id"));
    };
    let mut group = ProcessGroup { pgid: Some(pid) };

    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let input = match &invocation.stdin {
        Stdin::Null => &[][..],
        Stdin::Bytes(bytes) => bytes.as_ref(),
    };
    let mut stdout_tail = Tail::new(CAPTURE_BYTES);
    let mut stderr_tail = Tail::new(CAPTURE_BYTES);
    let (ended, pipes) = {
        // All pipes at once: a child that fills one pipe before reading another must not
        // wait on us while we wait on it.
        let pipes = async {
            tokio::join!(feed(stdin, input), read_into(stdout, &mut stdout_tail), read_into(stderr, &mut stderr_tail))
        };
        let mut pipes = std::pin::pin!(pipes);
        let mut drained = None;
        let ended = tokio::time::timeout(invocation.timeout, async {
            // The pipes are read while we wait for the exit, so a chatty program never blocks
            // on a full pipe; their end is not the end of the run.
            tokio::select! {
                done = &mut pipes => {
                    drained = Some(done);
                    exited(pid).await
                }
                ended = exited(pid) => ended,
            }
        })
        .await;
        match ended {
            // The program has exited (or is still running, on a timeout) and is not reaped: its
            // pid cannot be reused yet, so neither can the group id, and signalling the group
            // reaches only what the program started. A failed wait tells us nothing of the
            // sort, so the group is left alone.
            Ok(Ok(())) | Err(_) => group.kill(),
            Ok(Err(_)) => group.forget(),
        }
        if matches!(ended, Ok(Ok(()))) && drained.is_none() {
            drained = tokio::time::timeout(DRAIN_AFTER_EXIT, &mut pipes).await.ok();
        }
        (ended, drained)
    };
    let reaped = match ended {
        Ok(Ok(())) => child.wait().await,
        Err(_) => {
            // Reap the killed child now rather than leave that to tokio's orphan queue.
            let _ = child.wait().await;
            group.forget();
            return Err(HandlerError::timeout(invocation.timeout));
        }
        // Only a child that is no longer ours to wait for fails waitid: nothing to reap.
        Ok(Err(error)) => return Err(io_error("waiting for the program", &error)),
    };
    // The child is reaped, so its pid, and with it the group id, may be reused: the group
    // must never be signalled from here on.
    group.forget();
    let status = reaped.map_err(|error| io_error("waiting for the program", &error))?;
    // Pipes still open after the drain (held by a process outside the group) end the reading
    // without an error: the exit status decides.
    let (fed, stdout_read, stderr_read) = pipes.unwrap_or((Ok(()), Ok(()), Ok(())));
    stdout_read.map_err(|error| io_error("reading stdout", &error))?;
    stderr_read.map_err(|error| io_error("reading stderr", &error))?;
    let output = Output { stdout: stdout_tail.into_bytes(), stderr: stderr_tail.into_bytes() };
    tracing::debug!(
        %status,
        stdout = %tail_excerpt(&output.stdout),
        stderr = %tail_excerpt(&output.stderr),
        "command exited"
    );
    observed.exit_code = status.code();
    observed.keep(&output.stderr);
    exit_result(status, &output.stderr, invocation)?;
    fed.map_err(|error| io_error("writing stdin", &error))?;
    Ok(output)
}

/// Waits until our child `pid` has exited, without reaping it.
///
/// Reaping is left to `Child::wait`, after the process group is killed: until then the pid
/// stays taken, so the group id (the same number) cannot name anybody else's group. Tokio
/// offers no wait without reaping, hence `waitid(WNOWAIT)`, checked whenever a SIGCHLD
/// arrives; never blocking, so that no thread is held per running program.
async fn exited(pid: libc::pid_t) -> io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};

    // Listening before the first check, so an exit between a check and the wait still wakes it.
    let mut sigchld = signal(SignalKind::child()).ok();
    loop {
        if has_exited(pid)? {
            return Ok(());
        }
        match &mut sigchld {
            // SIGCHLD is shared by all of the runner's children and may be coalesced; the poll
            // is a backstop.
            Some(signals) => {
                let _ = tokio::time::timeout(EXIT_POLL, signals.recv()).await;
            }
            None => tokio::time::sleep(EXIT_POLL).await,
        }
    }
}

/// Whether our child `pid` has exited, leaving it waitable (not reaped).
fn has_exited(pid: libc::pid_t) -> io::Result<bool> {
    let id = libc::id_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    loop {
        // SAFETY: an all-zero siginfo_t is a valid value (plain integers and unions of them);
        // it must be zeroed so that "no child has exited" reads as si_pid 0 (see waitid(2)).
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid writes only into `info`, which lives across the call. WNOWAIT leaves
        // the child waitable, WNOHANG makes the call return at once.
        let result = unsafe { libc::waitid(libc::P_PID, id, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT) };
        if result == 0 {
            // SAFETY: waitid filled in (or left zeroed) the fields of a child-state siginfo.
            return Ok(unsafe { info.si_pid() } != 0);
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Shells, by file name, that run the argument after `-c` as a script.
const SHELLS: &[&str] = &["sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "yash", "fish", "csh", "tcsh"];

/// The index of the script argument when `program` is a shell given `-c` and its script is a
/// template with expressions: a value the template substitutes would become shell code.
pub fn templated_shell_script(program: &str, args: &[String]) -> Option<usize> {
    let name = Path::new(program).file_name()?.to_str()?;
    if !SHELLS.contains(&name) {
        return None;
    }
    let mut command_string = false;
    let mut args = args.iter().enumerate();
    while let Some((i, arg)) = args.next() {
        match arg.as_bytes() {
            // Options end; the next argument is the first operand.
            b"--" => {
                let (i, arg) = args.next()?;
                return (command_string && is_templated(arg)).then_some(i);
            }
            // Long options (`--norc`) take no argument here.
            [b'-', b'-', ..] => {}
            [sign @ (b'-' | b'+'), letters @ ..] if !letters.is_empty() => {
                command_string |= *sign == b'-' && letters.contains(&b'c');
                // `-o pipefail`, `-O extglob`: the option's argument is no operand.
                if matches!(letters.last(), Some(b'o' | b'O')) {
                    args.next();
                }
            }
            // The first operand: the script, when `-c` came before it.
            _ => return (command_string && is_templated(arg)).then_some(i),
        }
    }
    None
}

/// Whether `arg` is a valid template that substitutes something.
fn is_templated(arg: &str) -> bool {
    Template::compile(arg, Escape::Plain).is_ok_and(|t| t.literal().is_none())
}

/// The warning for [`templated_shell_script`], showing the safe form.
pub fn templated_shell_script_warning(program: &str) -> String {
    let shell = Path::new(program).file_name().map_or(program.into(), |name| name.to_string_lossy());
    format!(
        "\"{shell} -c\" runs this template as a shell script, so a value it substitutes becomes shell code; \
         pass values as positional arguments instead, e.g. args: [\"-c\", \"resize \\\"$1\\\"\", \"{shell}\", \"{{{{payload.image_id}}}}\"]"
    )
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

/// What an exit code means: its `on_exit` rule, else dead-letter for `permanent_exit_codes`,
/// else success for 0 and retry for the rest. The one place exit codes are classified, for
/// `run` and `sluice test` alike (config rejects a code named in both lists).
pub(crate) fn classify(code: i32, permanent_exit_codes: &[i32], on_exit: &Rules) -> Verdict {
    if let Some((key, action)) = u16::try_from(code).ok().and_then(|code| on_exit.find(code)) {
        return Verdict { action, rule: Some(key) };
    }
    Verdict::default_is(match code {
        0 => Action::Success,
        code if permanent_exit_codes.contains(&code) => Action::DeadLetter,
        _ => Action::Retry,
    })
}

/// The result of a run that ended with `status`: by its exit code, or retried when a signal
/// ended it. `sluice test` classifies its simulated exits here too.
pub(crate) fn exit_result(status: ExitStatus, stderr: &[u8], invocation: &Invocation) -> Result<(), HandlerError> {
    use std::os::unix::process::ExitStatusExt as _;

    let prefix = match (status.code(), status.signal()) {
        (Some(code), _) => {
            let verdict = classify(code, &invocation.permanent_exit_codes, &invocation.on_exit);
            return verdict.result(format!("exit {code}"), "on_exit", || tail_excerpt(stderr), None);
        }
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => format!("ended without an exit code ({status})"),
    };
    Err(HandlerError::transient(with_excerpt(prefix, tail_excerpt(stderr))))
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

/// Reads `pipe` to the end into `tail`, which keeps only its last bytes.
async fn read_into(pipe: Option<impl AsyncRead + Unpin>, tail: &mut Tail) -> io::Result<()> {
    let Some(mut pipe) = pipe else {
        return Ok(());
    };
    let mut chunk = vec![0; 16 * 1024];
    loop {
        match pipe.read(&mut chunk).await? {
            0 => return Ok(()),
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
    /// Kills every process in the group now (and again on drop, until forgotten).
    fn kill(&self) {
        if let Some(pgid) = self.pgid {
            kill_group(pgid);
        }
    }

    /// Gives up on killing the group, once the child has been reaped.
    fn forget(&mut self) {
        self.pgid = None;
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.kill();
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

    use super::super::rules::Key;
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

    /// An invocation classified by these rules (the program is never run here).
    fn ruled_by(permanent_exit_codes: Vec<i32>, on_exit: Rules) -> Invocation {
        Invocation {
            program: PathBuf::from("/bin/true"),
            args: Vec::new(),
            env: Vec::new(),
            stdin: Stdin::Null,
            timeout: Duration::from_secs(1),
            permanent_exit_codes,
            on_exit: Arc::new(on_exit),
        }
    }

    #[test]
    fn exits_are_classified_as_designed() {
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
            assert_eq!(exit_result(status, stderr, &ruled_by(vec![65, 78], Rules::default())), expected, "{status}");
        }
    }

    #[test]
    fn on_exit_rules_override_the_defaults() {
        use Action::{DeadLetter, Retry, Success};
        let rules = Rules::new(std::collections::BTreeMap::from([
            (Key::Code(75), Retry),
            (Key::Code(65), DeadLetter),
            (Key::Code(3), Success),
            (Key::Code(0), Retry),
        ]));
        let permanent = [64];
        let ruled = |action, code| Verdict { action, rule: Some(Key::Code(code)) };
        let cases = [
            (75, ruled(Retry, 75)),
            (65, ruled(DeadLetter, 65)),
            (3, ruled(Success, 3)),
            (0, ruled(Retry, 0)),
            // No rule: permanent_exit_codes, then the defaults.
            (64, Verdict::default_is(DeadLetter)),
            (1, Verdict::default_is(Retry)),
            (255, Verdict::default_is(Retry)),
        ];
        for (code, expected) in cases {
            assert_eq!(classify(code, &permanent, &rules), expected, "exit {code}");
        }
        assert_eq!(classify(0, &[], &Rules::default()), Verdict::default_is(Success));
    }

    #[test]
    fn a_rule_driven_dead_letter_names_its_rule() {
        let rules = Rules::new(std::collections::BTreeMap::from([(Key::Code(65), Action::DeadLetter)]));
        let invocation = ruled_by(vec![64], rules);
        let cases = [
            (65, Err(HandlerError::permanent("exit 65 (on_exit \"65\": dead_letter): bad row 7"))),
            (64, Err(HandlerError::permanent("exit 64: bad row 7"))),
        ];
        for (code, expected) in cases {
            assert_eq!(exit_result(ExitStatus::from_raw(code << 8), b"bad row 7\n", &invocation), expected);
        }
    }

    /// Issue 9: `sh -c "resize {{payload.image_id}}"` runs a payload value as shell code.
    #[test]
    fn a_shell_running_a_templated_script_is_found() {
        let cases: &[(&str, &[&str], Option<usize>)] = &[
            ("/bin/sh", &["-c", "resize {{payload.image_id}}"], Some(1)),
            ("bash", &["-euo", "pipefail", "-c", "resize {{payload.id}}"], Some(3)),
            ("/usr/bin/zsh", &["-ec", "echo {{env.X}}"], Some(1)),
            ("dash", &["-c", "--", "x {{id}}"], Some(2)),
            ("ksh", &["--norc", "-c", "x {{id}}", "ksh"], Some(2)),
            ("bash", &["-O", "extglob", "-c", "x {{id}}"], Some(3)),
            // The safe form: the script is literal, values are positional arguments.
            ("/bin/sh", &["-c", "resize \"$1\"", "sh", "{{payload.image_id}}"], None),
            // A script file, not -c: its arguments are data.
            ("bash", &["./resize.sh", "{{payload.image_id}}"], None),
            ("bash", &["-e", "./resize.sh", "-c", "{{payload.image_id}}"], None),
            // Not a shell, or not a template.
            ("./resize.sh", &["-c", "{{payload.image_id}}"], None),
            ("python3", &["-c", "print({{payload.n}})"], None),
            ("sh", &["-c", "echo {{! a comment }} done"], None),
            ("sh", &["-c"], None),
        ];
        for (program, args, expected) in cases {
            let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
            assert_eq!(templated_shell_script(program, &args), *expected, "{program} {args:?}");
        }
        assert!(
            templated_shell_script_warning("/bin/sh")
                .ends_with(r#"e.g. args: ["-c", "resize \"$1\"", "sh", "{{payload.image_id}}"]"#)
        );
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
