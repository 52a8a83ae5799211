//! Issue 19 (item 5): the admin port. Writes need the runner's token and are refused from a
//! page of another origin, and a refused write changes nothing; the probes stay open (the
//! other reads need the token too: `admin_exposure.rs`); `sluice pause|resume` find the token
//! the runner generated; idle and half-sent connections cannot take the file descriptors
//! webhook calls need, nor keep a fresh request from an answer.

use crate::support;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;
use support::*;
use tokio::io::AsyncWriteExt as _;

const DEADLINE: Duration = Duration::from_secs(60);

/// Where the runner writes the token it generates: its state directory, here the embedded
/// broker's.
fn generated_token_file(place: &EmbeddedDir) -> PathBuf {
    Path::new(&place.url()).join("admin-token")
}

/// POSTs `path` on the admin port with `headers`; the status.
async fn post(admin: &str, path: &str, headers: &[(&str, &str)]) -> u16 {
    let mut request = reqwest::Client::new().post(format!("http://{admin}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.expect("the admin port answers").status().as_u16()
}

/// GETs `path` on the admin port on a connection of its own; the status, or None when no
/// answer came within 5 s.
async fn get_status(admin: &str, path: &str) -> Option<u16> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().expect("client");
    Some(client.get(format!("http://{admin}{path}")).send().await.ok()?.status().as_u16())
}

/// `sluice ARGS` to completion.
fn cli(args: &[&str], env: &[(&str, &str)]) -> Finished {
    sluice_cli(args, env, DEADLINE)
}

/// An embedded broker of its own with the queue `work` declared, calling a receiver that
/// answers 200.
struct Work {
    place: EmbeddedDir,
    receiver: Receiver,
    dir: tempfile::TempDir,
    broker: sluice::broker::embedded::Embedded,
}

impl Work {
    async fn new() -> Work {
        let place = EmbeddedDir::new();
        let receiver = Receiver::ok().await;
        let dir = webhook_pipeline(&receiver, "");
        let broker = place.connect().await;
        declare(dir.path(), &broker).await;
        Work { place, receiver, dir, broker }
    }
}

async fn wait_handled(receiver: &Receiver, key: &str) {
    wait_until(DEADLINE, &format!("{key} handled"), || async { receiver.succeeded_keys().contains(key) }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_without_the_token_or_from_another_origin_change_nothing() {
    let Work { place, receiver, dir, broker } = Work::new().await;
    let (_sluice, admin) = run_with_admin(dir.path(), &place.url(), "work").await;
    let token = std::fs::read_to_string(generated_token_file(&place)).expect("the generated token");
    let bearer = format!("Bearer {}", token.trim());
    let refused: [(&[(&str, &str)], u16); 7] = [
        (&[], 401),
        (&[("authorization", "Bearer wrong")], 401),
        (&[("authorization", "Bearer ")], 401),
        (&[("authorization", token.trim())], 401),
        (&[("cookie", &format!("token={}", token.trim()))], 401),
        (&[("authorization", &bearer), ("origin", "http://evil.example")], 403),
        (&[("authorization", &bearer), ("origin", "null")], 403),
    ];
    for (headers, status) in refused {
        assert_eq!(post(&admin, "/queues/work/pause", headers).await, status, "pause with {headers:?}");
        assert_eq!(post(&admin, "/queues/work/resume", headers).await, status, "resume with {headers:?}");
    }
    // Nothing changed: not paused, and still consuming.
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(0.0));
    publish(&broker, "ev", "x", "after-refusals", json!({})).await;
    wait_handled(&receiver, "after-refusals").await;
    // The probes need nothing.
    for path in ["/metrics", "/healthz", "/readyz"] {
        assert_eq!(get_status(&admin, path).await, Some(200), "GET {path}");
    }

    // With the token, from no page or from the admin's own origin: done.
    assert_eq!(post(&admin, "/queues/work/pause", &[("authorization", &bearer)]).await, 200);
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(1.0));
    let own = format!("http://{admin}");
    assert_eq!(post(&admin, "/queues/work/resume", &[("authorization", &bearer), ("origin", &own)]).await, 200);
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(0.0));
    publish(&broker, "ev", "x", "after-resume", json!({})).await;
    wait_handled(&receiver, "after-resume").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_pause_finds_the_token_the_runner_generated() {
    let Work { place, receiver, dir, broker } = Work::new().await;
    let (_sluice, admin) = run_with_admin(dir.path(), &place.url(), "work").await;
    let file = generated_token_file(&place);
    let mode = std::fs::metadata(&file).expect("the generated token file").permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "{}", file.display());

    let url = place.url();
    let paused = cli(&["pause", "work", "--admin", &admin, "--broker", &url], &[]);
    assert_eq!(paused.code, Some(0), "{paused:?}");
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(1.0));

    // A wrong token (the environment's beats the file) is refused and changes nothing.
    let wrong = cli(&["resume", "work", "--admin", &admin, "--broker", &url], &[("SLUICE_ADMIN_TOKEN", "wrong")]);
    assert_eq!(wrong.code, Some(1), "{wrong:?}");
    assert!(wrong.stderr.contains("$SLUICE_ADMIN_TOKEN"), "names where the token came from: {wrong:?}");
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(1.0));

    // The broker's directory from $SLUICE_BROKER, as `run` takes it.
    let resumed = cli(&["resume", "work", "--admin", &admin], &[("SLUICE_BROKER", &url)]);
    assert_eq!(resumed.code, Some(0), "{resumed:?}");
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(0.0));
    publish(&broker, "ev", "x", "after-resume", json!({})).await;
    wait_handled(&receiver, "after-resume").await;
}

/// A token the operator gives (`--admin-token-file` to the runner, `$SLUICE_ADMIN_TOKEN` to
/// the command): used, and none generated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_given_by_file_or_environment_is_the_one_needed() {
    let Work { place, dir, .. } = Work::new().await;
    let secret = dir.path().join("token");
    std::fs::write(&secret, "given-token-0123456789\n").expect("write the token file");
    let admin = format!("127.0.0.1:{}", free_port());
    let _sluice = Sluice::run(dir.path(), &place.url(), &["--admin", &admin, "--admin-token-file", path(&secret)]);
    wait_until(DEADLINE, "the breaker gauge of work", || async {
        gauge(&admin, "sluice_circuit_state", "work").await.is_some()
    })
    .await;
    assert!(!generated_token_file(&place).exists(), "a token was generated beside the one given");

    let url = place.url();
    let other = cli(&["pause", "work", "--admin", &admin, "--broker", &url], &[("SLUICE_ADMIN_TOKEN", "other")]);
    assert_eq!(other.code, Some(1), "{other:?}");
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(0.0));
    let env = [("SLUICE_ADMIN_TOKEN", "given-token-0123456789")];
    let paused = cli(&["pause", "work", "--admin", &admin], &env);
    assert_eq!(paused.code, Some(0), "{paused:?}");
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(1.0));
    let resumed = cli(&["resume", "work", "--admin", &admin, "--admin-token-file", path(&secret)], &[]);
    assert_eq!(resumed.code, Some(0), "{resumed:?}");
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(0.0));
}

/// Lowers the soft limit of open files of process `pid` to `limit`.
fn limit_open_files(pid: u32, limit: u64) {
    let pid = libc::pid_t::try_from(pid).expect("pid");
    // SAFETY: prlimit(2) on our own child, reading into and from the two locals only.
    unsafe {
        let mut old: libc::rlimit = std::mem::zeroed();
        assert_eq!(libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old), 0, "prlimit");
        let new = libc::rlimit { rlim_cur: limit, rlim_max: old.rlim_max };
        assert_eq!(libc::prlimit(pid, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()), 0, "prlimit");
    }
}

/// Issue 19: 366 idle connections to the admin port used up the runner's file descriptors and
/// every webhook call failed while they were held. Here the runner may open 100 files more
/// than it has open; 300 connections are opened and held, half of them idle, half having sent
/// part of a request head. A message published meanwhile is still handled, and a fresh GET
/// still gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_admin_connections_do_not_starve_webhook_calls() {
    let Work { place, receiver, dir, broker } = Work::new().await;
    let (sluice, admin) = run_with_admin(dir.path(), &place.url(), "work").await;
    let pid = sluice.child.id();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("the runner's open files").count();
    limit_open_files(pid, u64::try_from(open).expect("count") + 100);

    let mut held = Vec::new();
    for i in 0..300 {
        // A port that stopped accepting leaves connects hanging once its backlog is full.
        let connect = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(&admin)).await;
        let Ok(Ok(mut stream)) = connect else { break };
        if i % 2 == 1 {
            // Closed by the runner already, perhaps: the write may fail.
            let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").await;
        }
        held.push(stream);
    }
    publish(&broker, "ev", "x", "while-held", json!({})).await;
    wait_handled(&receiver, "while-held").await;
    wait_until(DEADLINE, "a fresh GET /healthz answered", || async {
        get_status(&admin, "/healthz").await == Some(200)
    })
    .await;
    assert_eq!(held.len(), 300, "connections the admin port took (accepted, or closed at once)");
}

fn path(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}
