//! The command handler with real subprocesses. `/bin/sh -c` is only the program under
//! test here; the handler itself never goes through a shell.

use crate::support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sluice::handler::HandlerError;
use sluice::handler::command::{self, CAPTURE_BYTES, Invocation, Output, Stdin};
use sluice::handler::rules::{Action, Key, Rules};
use support::{is_running, read_pid};

/// `/bin/sh -c script`, with `args` as `$0 $1 ...`.
fn sh(script: &str, args: &[&str]) -> Invocation {
    Invocation {
        program: PathBuf::from("/bin/sh"),
        args: ["-c", script].iter().chain(args).map(|arg| (*arg).to_owned()).collect(),
        env: Vec::new(),
        stdin: Stdin::Null,
        timeout: Duration::from_secs(30),
        permanent_exit_codes: vec![65],
        on_exit: Default::default(),
    }
}

async fn run_ok(invocation: &Invocation) -> Output {
    match command::run(invocation, &mut Default::default()).await {
        Ok(output) => output,
        Err(error) => panic!("expected success, got {error:?}"),
    }
}

/// Polls `condition` until it holds, failing the test after `deadline`.
async fn wait_until(deadline: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn exit_codes_map_to_outcomes() {
    let cases = [
        ("exit 0", Ok(())),
        (
            "echo 'order 1234: amount is negative' >&2; exit 65",
            Err(HandlerError::permanent("exit 65: order 1234: amount is negative")),
        ),
        ("exit 3", Err(HandlerError::transient("exit 3"))),
        ("echo 'database is down' >&2; exit 1", Err(HandlerError::transient("exit 1: database is down"))),
        ("kill -9 $$", Err(HandlerError::transient("killed by signal 9"))),
    ];
    for (script, expected) in cases {
        let result = command::run(&sh(script, &[]), &mut Default::default()).await.map(|_| ());
        assert_eq!(result, expected, "script {script:?}");
    }
}

/// Issue 13: `on_exit` rules decide over the defaults and over `permanent_exit_codes`, and a
/// rule's verdict names the rule.
#[tokio::test]
async fn on_exit_rules_decide_each_action() {
    let rules = Rules::new(
        [(75, Action::Retry), (66, Action::DeadLetter), (3, Action::Success), (0, Action::Retry)]
            .into_iter()
            .map(|(code, action)| (Key::Code(code), action))
            .collect(),
    );
    let cases = [
        ("exit 3", Ok(())),
        (
            "echo 'come back later' >&2; exit 75",
            Err(HandlerError::transient("exit 75 (on_exit \"75\": retry): come back later")),
        ),
        ("echo 'row 7' >&2; exit 66", Err(HandlerError::permanent("exit 66 (on_exit \"66\": dead_letter): row 7"))),
        ("exit 0", Err(HandlerError::transient("exit 0 (on_exit \"0\": retry)"))),
        // No rule: permanent_exit_codes, then the defaults.
        ("exit 65", Err(HandlerError::permanent("exit 65"))),
        ("exit 1", Err(HandlerError::transient("exit 1"))),
        ("kill -9 $$", Err(HandlerError::transient("killed by signal 9"))),
    ];
    for (script, expected) in cases {
        let invocation = Invocation { on_exit: rules.clone().into(), ..sh(script, &[]) };
        let result = command::run(&invocation, &mut Default::default()).await.map(|_| ());
        assert_eq!(result, expected, "script {script:?}");
    }
}

#[tokio::test]
async fn the_error_quotes_the_end_of_stderr() {
    let script = "for i in $(seq 1 500); do echo \"progress $i\" >&2; done; \
                  echo 'fatal: bad payload' >&2; exit 65";
    let Err(HandlerError::Permanent { error }) = command::run(&sh(script, &[]), &mut Default::default()).await else {
        panic!("expected a permanent failure");
    };
    assert!(error.starts_with("exit 65: …"), "{error}");
    assert!(error.ends_with("progress 500 fatal: bad payload"), "{error}");
    assert!(error.len() < 300, "{error}");
}

#[tokio::test]
async fn a_timeout_kills_the_whole_process_group() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pidfile = dir.path().join("grandchild.pid");
    let mut invocation = sh("sleep 30 & echo $! > \"$1\"; wait", &["sh", pidfile.to_str().expect("utf-8 path")]);
    invocation.timeout = Duration::from_millis(500);

    let started = Instant::now();
    let result = command::run(&invocation, &mut Default::default()).await;

    assert_eq!(result, Err(HandlerError::unwell("timeout after 500ms", None)));
    assert!(started.elapsed() < Duration::from_secs(10), "run ended late");
    let pid = read_pid(&pidfile).expect("the script wrote the grandchild's pid");
    wait_until(Duration::from_secs(5), "the grandchild is gone", || !is_running(pid)).await;
}

#[tokio::test]
async fn a_cancelled_run_kills_the_whole_process_group() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pidfile = dir.path().join("grandchild.pid");
    let invocation = sh("sleep 30 & echo $! > \"$1\"; wait", &["sh", pidfile.to_str().expect("utf-8 path")]);
    let pid = std::cell::Cell::new(None);
    let mut observed = Default::default();

    // The caller gives up (as a drain deadline would) once the grandchild is running.
    tokio::select! {
        result = command::run(&invocation, &mut observed) => panic!("run ended on its own: {result:?}"),
        () = wait_until(Duration::from_secs(5), "the grandchild is started", || {
            pid.set(read_pid(&pidfile));
            pid.get().is_some()
        }) => {}
    }

    let pid = pid.get().expect("grandchild pid");
    wait_until(Duration::from_secs(5), "the grandchild is gone", || !is_running(pid)).await;
}

#[tokio::test]
async fn stdin_bytes_reach_the_program() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("stdin");
    let input = b"{\"id\": \"0193\"}\n\x00binary\xff".to_vec();
    let mut invocation = sh("cat > \"$1\"", &["sh", file.to_str().expect("utf-8 path")]);
    invocation.stdin = Stdin::Bytes(input.clone().into());

    run_ok(&invocation).await;

    assert_eq!(std::fs::read(&file).expect("file written"), input);
}

#[tokio::test]
async fn null_stdin_reads_as_empty() {
    let output = run_ok(&sh("wc -c", &[])).await;
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "0");
}

#[tokio::test]
async fn large_output_is_drained_and_only_its_tail_kept() {
    // 5 MB of numbered lines, so the tail shows which bytes were kept.
    let output = run_ok(&sh("seq 1 700000; echo done >&2", &[])).await;

    assert_eq!(output.stdout.len(), CAPTURE_BYTES);
    assert!(output.stdout.ends_with(b"699999\n700000\n"));
    assert_eq!(output.stderr, b"done\n");
}

#[tokio::test]
async fn a_program_that_writes_before_reading_stdin_does_not_deadlock() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("stdin");
    // More output than a pipe buffer holds, before the program reads any input.
    let mut invocation = sh("head -c 1000000 /dev/zero; cat > \"$1\"", &["sh", file.to_str().expect("utf-8 path")]);
    invocation.stdin = Stdin::Bytes(vec![b'x'; 1_000_000].into());

    let output = run_ok(&invocation).await;

    assert_eq!(output.stdout.len(), CAPTURE_BYTES);
    assert_eq!(std::fs::metadata(&file).expect("file written").len(), 1_000_000);
}

#[tokio::test]
async fn a_program_that_ignores_stdin_still_completes() {
    let mut invocation = sh("echo ignored", &[]);
    invocation.stdin = Stdin::Bytes(vec![b'x'; 1_000_000].into());

    let output = run_ok(&invocation).await;

    assert_eq!(output.stdout, b"ignored\n");
}

/// Issue 9: a handler must not inherit the runner's environment (`SLUICE_BROKER` with its
/// password, tokens): the child gets the invocation's variables and nothing else.
#[tokio::test]
async fn the_environment_is_exactly_the_invocations() {
    // `env` itself, not a shell, which would add PWD.
    let given = [("PATH", "/usr/bin:/bin"), ("SLUICE_MESSAGE_ID", "0193 abc"), ("SLUICE_ATTEMPT", "2"), ("EMPTY", "")];
    let invocation = Invocation {
        program: PathBuf::from("/usr/bin/env"),
        args: vec!["-0".to_owned()],
        env: given.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())).collect(),
        ..sh("", &[])
    };
    // Inheriting shows only if this process has a variable the invocation does not set.
    let set_here = std::env::vars_os().filter(|(name, _)| given.iter().all(|(given, _)| name != given)).count();
    assert!(set_here > 0, "the test needs an environment of its own to prove anything");

    let output = run_ok(&invocation).await;

    let mut seen: Vec<String> = output
        .stdout
        .split(|b| *b == 0)
        .filter(|entry| !entry.is_empty())
        .map(|entry| String::from_utf8_lossy(entry).into_owned())
        .collect();
    seen.sort();
    let mut expected: Vec<String> = given.iter().map(|(name, value)| format!("{name}={value}")).collect();
    expected.sort();
    assert_eq!(seen, expected);
}

/// Issue 9: whatever a run ends in, nothing it started outlives it, and a background child
/// that keeps stdout open does not turn a successful exit into a timeout (which ran the script
/// again and dead-lettered it): success is the exit status, not the end of the output.
#[tokio::test]
async fn background_children_die_when_the_run_ends_and_do_not_delay_it() {
    let cases = [
        // Holds stdout and stderr open.
        ("sleep 1000 & echo $! > \"$1\"; echo done; exit 0", Ok("done\n")),
        // Lets go of the pipes: the run ends at once, but the child used to live on.
        ("sleep 1000 >/dev/null 2>&1 & echo $! > \"$1\"; echo done; exit 0", Ok("done\n")),
        ("sleep 1000 & echo $! > \"$1\"; echo 'db down' >&2; exit 3", Err(HandlerError::transient("exit 3: db down"))),
        ("sleep 1000 & echo $! > \"$1\"; exit 65", Err(HandlerError::permanent("exit 65"))),
    ];
    for (script, expected) in cases {
        let dir = tempfile::tempdir().expect("temp dir");
        let pidfile = dir.path().join("background.pid");
        let mut invocation = sh(script, &["sh", pidfile.to_str().expect("utf-8 path")]);
        invocation.timeout = Duration::from_secs(20);

        let started = Instant::now();
        let result = command::run(&invocation, &mut Default::default()).await;

        let elapsed = started.elapsed();
        assert!(elapsed < Duration::from_secs(5), "{script:?}: the run took {elapsed:?}");
        match (&result, &expected) {
            (Ok(output), Ok(stdout)) => assert_eq!(String::from_utf8_lossy(&output.stdout), *stdout, "{script:?}"),
            (Err(error), Err(want)) => assert_eq!(error, want, "{script:?}"),
            _ => panic!("{script:?}: expected {expected:?}, got {result:?}"),
        }
        let pid = read_pid(&pidfile).expect("the script wrote the background child's pid");
        wait_until(Duration::from_secs(5), "the background child is gone", || !is_running(pid)).await;
    }
}

#[tokio::test]
async fn args_arrive_verbatim() {
    let args = ["two words", "it's \"quoted\"", "$(touch /tmp/sluice-pwned)", "`id`", "$HOME; rm -rf /", "*", ""];
    // printf, not sh: the arguments go straight into argv.
    let invocation = Invocation {
        program: PathBuf::from("printf"),
        args: std::iter::once("%s\\n").chain(args).map(str::to_owned).collect(),
        ..sh("", &[])
    };

    let output = run_ok(&invocation).await;

    let expected: String = args.iter().map(|arg| format!("{arg}\n")).collect();
    assert_eq!(String::from_utf8_lossy(&output.stdout), expected);
    assert!(!Path::new("/tmp/sluice-pwned").exists());
}

#[tokio::test]
async fn a_missing_program_is_permanent_and_named() {
    let invocation = Invocation { program: PathBuf::from("/nonexistent/resize.sh"), ..sh("", &[]) };

    let result = command::run(&invocation, &mut Default::default()).await;

    let Err(HandlerError::Permanent { error }) = result else {
        panic!("expected permanent, got {result:?}");
    };
    assert!(error.contains("\"/nonexistent/resize.sh\""), "{error}");
}

#[tokio::test]
async fn a_file_that_is_not_executable_is_permanent() {
    let dir = tempfile::tempdir().expect("temp dir");
    let script = dir.path().join("script.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").expect("write script");
    let invocation = Invocation { program: script, ..sh("", &[]) };

    let result = command::run(&invocation, &mut Default::default()).await;

    assert!(matches!(&result, Err(HandlerError::Permanent { error }) if error.contains("script.sh")), "{result:?}");
}
