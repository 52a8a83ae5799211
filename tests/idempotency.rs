//! Effectively-once: duplicates, crashes and many runners, counted at the receiver by
//! idempotency key. Real RabbitMQ, real Redis (a private server where a test stops it), real
//! `sluice` processes.

use crate::support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::*;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

/// A webhook to a wiremock server at `url`, with a 2 s timeout and quick retries.
fn mock_webhook_pipeline(url: &str, concurrency: u32) -> tempfile::TempDir {
    work_pipeline(&format!(
        r##"    concurrency: {concurrency}
    handler:
      webhook: {{url: "{url}/hook", timeout: 2s}}
    retry: {{max_attempts: 3, initial: 200ms, max: 1s}}
"##
    ))
}

fn dedup_file(dir: &Path) -> String {
    format!("file:{}", dir.join("state").display())
}

async fn duplicate_sent_twice_in_a_row_is_handled_once<P: Place>(place: P) {
    let server = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(200)).mount(&server).await;
    let dir = mock_webhook_pipeline(&server.uri(), 1);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let dedup = dedup_file(dir.path());
    let _sluice = Sluice::run(dir.path(), &place.url(), &["--dedup", &dedup]);
    publish(&broker, "ev", "a", "order-1", serde_json::json!({"n": 1})).await;
    wait_until(Duration::from_secs(20), "the first call", || async { keys_received(&server).await.len() == 1 }).await;
    // Same key, new envelope id; then a sentinel behind it on this one-at-a-time queue.
    publish(&broker, "ev", "a", "order-1", serde_json::json!({"n": 1})).await;
    publish(&broker, "ev", "a", "sentinel", serde_json::json!({"n": 2})).await;
    wait_until(Duration::from_secs(20), "the sentinel", || async {
        keys_received(&server).await.contains(&"sentinel".to_string())
    })
    .await;
    assert_eq!(keys_received(&server).await, ["order-1", "sentinel"], "the duplicate never reached the webhook");
    assert!(place.drain_queue("work.dlq").await.is_empty(), "nothing dead-lettered");
}

/// A webhook server that answers 200 after 800 ms: slow enough that copies of one key are in
/// flight in two runners at once.
async fn slow_server() -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_delay(Duration::from_millis(800)))
        .mount(&server)
        .await;
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_racing_on_two_runners_sharing_redis_are_handled_once() {
    let vhost = Vhost::new();
    let server = slow_server().await;
    let dir = mock_webhook_pipeline(&server.uri(), 4);
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    // Redis is shared by every test: a key of this test's own.
    let key = format!("dup-{}", vhost.name);
    for _ in 0..4 {
        publish(&broker, "ev", "a", &key, serde_json::json!({})).await;
    }
    let mut a = Sluice::run(dir.path(), &vhost.url(), &["--dedup", "redis://127.0.0.1:6379", "--exit-when-idle"]);
    // The second runner also covers the multi-threaded runtime.
    let mut b = Sluice::run(
        dir.path(),
        &vhost.url(),
        &["--dedup", "redis://127.0.0.1:6379", "--exit-when-idle", "--threads", "2"],
    );
    assert_eq!(a.wait(Duration::from_secs(60)), Some(0), "{}", a.log());
    assert_eq!(b.wait(Duration::from_secs(60)), Some(0), "{}", b.log());
    assert!(vhost.drain_queue("work.dlq").await.is_empty(), "nothing dead-lettered");
    assert_eq!(keys_received(&server).await, [key], "four copies, two runners, one call\n{}\n{}", a.log(), b.log());
}

async fn duplicates_racing_on_two_runners_sharing_a_state_directory_are_handled_once<P: Place>(place: P) {
    let server = slow_server().await;
    let dir = mock_webhook_pipeline(&server.uri(), 4);
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let keys: Vec<String> = (0..5).map(|n| format!("shared-{n}")).collect();
    for key in &keys {
        for _ in 0..4 {
            publish(&broker, "ev", "a", key, serde_json::json!({})).await;
        }
    }
    // Beside RabbitMQ both name one state directory; with the embedded broker both use its
    // directory, the default, where the keys ride on the acks.
    let state = dedup_file(dir.path());
    let shared: &[&str] = if place.url().starts_with("amqp") { &["--dedup", &state] } else { &[] };
    let runner =
        |extra: &[&str]| Sluice::run(dir.path(), &place.url(), &[shared, &["--exit-when-idle"], extra].concat());
    let (mut a, mut b) = (runner(&[]), runner(&["--threads", "2"]));
    assert_eq!(a.wait(Duration::from_secs(60)), Some(0), "{}", a.log());
    assert_eq!(b.wait(Duration::from_secs(60)), Some(0), "{}", b.log());
    assert!(place.drain_queue("work.dlq").await.is_empty(), "nothing dead-lettered");
    let mut received = keys_received(&server).await;
    received.sort();
    assert_eq!(received, keys, "four copies of each key, two runners, one call each\n{}\n{}", a.log(), b.log());
}

async fn an_earlier_sluices_idempotency_store_is_named_with_what_to_do<P: Place>(place: P) {
    let dir = work_pipeline("    handler:\n      command: {program: /bin/true}\n");
    // What sluice 0.1 left in its state directory: a fjall store.
    let old = dir.path().join("state/dedup");
    std::fs::create_dir_all(old.join("keyspaces")).expect("mkdir");
    std::fs::write(old.join("version"), b"\x03").expect("write");
    let pipelines = dir.path().to_str().expect("utf-8");
    let named = sluice_cli(
        &["run", pipelines, "--broker", &place.url(), "--dedup", old.to_str().expect("utf-8"), "--exit-when-idle"],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(named.code, Some(1), "{}", named.stderr);
    assert!(named.stderr.contains("idempotency store of an earlier sluice"), "{}", named.stderr);
    assert!(named.stderr.contains("Delete"), "says what to do: {}", named.stderr);
    let state = dir.path().join("state");
    let beside = sluice_cli(
        &["run", pipelines, "--broker", &place.url(), "--dedup", state.to_str().expect("utf-8"), "--exit-when-idle"],
        &[],
        Duration::from_secs(30),
    );
    assert_eq!(beside.code, Some(0), "runs, and warns: {}", beside.stderr);
    assert!(beside.stderr.contains(&format!("{} is the idempotency store of an earlier sluice", old.display())));
}

/// A command handler that records `start KEY`, works for a while, records `end KEY`.
fn recording_pipeline(out: &Path, concurrency: u32, work: &str) -> tempfile::TempDir {
    work_pipeline(&format!(
        r##"    concurrency: {concurrency}
    handler:
      command:
        program: /bin/sh
        args: ["-c", "echo \"start $SLUICE_IDEMPOTENCY_KEY\" >> {out}; sleep {work}; echo \"end $SLUICE_IDEMPOTENCY_KEY\" >> {out}"]
        stdin: none
        timeout: 3s
    retry: {{max_attempts: 5, initial: 200ms, max: 1s}}
"##,
        out = out.display()
    ))
}

async fn kill_9_mid_run_then_restart_loses_nothing_and_repeats_only_in_flight_work<P: Place>(place: P) {
    let out_dir = tempfile::tempdir().expect("tempdir");
    let out = out_dir.path().join("effects.log");
    let concurrency = 4;
    let dir = recording_pipeline(&out, concurrency, "0.3");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let keys: Vec<String> = (0..40).map(|i| format!("k{i:02}")).collect();
    for k in &keys {
        publish(&broker, "ev", "a", k, serde_json::json!({})).await;
    }
    let dedup = dedup_file(dir.path());
    let first = Sluice::run(dir.path(), &place.url(), &["--dedup", &dedup]);
    wait_until(Duration::from_secs(30), "some work done", || async { lines_with(&out, "end ").len() >= 10 }).await;
    first.signal(libc::SIGKILL);
    let mut first = first;
    assert_eq!(first.wait(Duration::from_secs(10)), None, "killed by a signal");
    let ended_before_kill = lines_with(&out, "end ").len();

    let mut second = Sluice::run(dir.path(), &place.url(), &["--dedup", &dedup, "--exit-when-idle"]);
    assert_eq!(second.wait(Duration::from_secs(90)), Some(0), "{}", second.log());

    let ends = counts(lines_with(&out, "end "));
    for k in &keys {
        assert!(ends.get(k).copied().unwrap_or(0) >= 1, "{k} was never handled: nothing may be lost");
    }
    let repeated: Vec<(&String, &usize)> = ends.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        repeated.len() <= concurrency as usize && repeated.iter().all(|(_, n)| **n == 2),
        "only the in-flight messages at the kill may run twice: {repeated:?} (ended before the kill: {ended_before_kill})"
    );
    assert_eq!(place.depth("work").await, 0);
    assert!(place.drain_queue("work.dlq").await.is_empty(), "nothing dead-lettered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_runners_on_redis_one_killed_every_key_handled_in_flight_only_repeats() {
    let vhost = Vhost::new();
    let out_dir = tempfile::tempdir().expect("tempdir");
    let out = out_dir.path().join("effects.log");
    let concurrency = 3;
    let dir = recording_pipeline(&out, concurrency, "0.2");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let run_id = &vhost.name;
    let keys: Vec<String> = (0..60).map(|i| format!("{run_id}-{i:02}")).collect();
    for k in &keys {
        publish(&broker, "ev", "a", k, serde_json::json!({})).await;
    }
    // One survivor runs the multi-threaded runtime.
    let mut runners: Vec<Sluice> = ["1", "1", "2"]
        .into_iter()
        .map(|threads| {
            let args = ["--dedup", "redis://127.0.0.1:6379", "--exit-when-idle", "--threads", threads];
            Sluice::run(dir.path(), &vhost.url(), &args)
        })
        .collect();
    wait_until(Duration::from_secs(30), "work under way", || async { lines_with(&out, "end ").len() >= 10 }).await;
    runners[0].signal(libc::SIGKILL);
    assert_eq!(runners[0].wait(Duration::from_secs(10)), None);
    for r in &mut runners[1..] {
        assert_eq!(r.wait(Duration::from_secs(90)), Some(0), "{}", r.log());
    }
    let ends = counts(lines_with(&out, "end "));
    for k in &keys {
        assert!(ends.contains_key(k), "{k} was never handled");
    }
    let repeated: Vec<_> = ends.iter().filter(|(_, n)| **n > 1).collect();
    assert!(repeated.len() <= concurrency as usize, "only the killed runner's in-flight work may repeat: {repeated:?}");
    assert!(vhost.drain_queue("work.dlq").await.is_empty(), "nothing dead-lettered");
}

async fn a_key_can_run_again_after_its_ttl<P: Place>(place: P) {
    let server = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(200)).mount(&server).await;
    let dir = work_pipeline(&format!(
        r##"    handler:
      webhook: {{url: "{}/hook", timeout: 500ms}}
    retry: {{max_attempts: 1}}
    idempotency: {{ttl: 2s}}
"##,
        server.uri()
    ));
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let dedup = dedup_file(dir.path());
    let _sluice = Sluice::run(dir.path(), &place.url(), &["--dedup", &dedup]);
    publish(&broker, "ev", "a", "again", serde_json::json!({})).await;
    wait_until(Duration::from_secs(20), "first call", || async { keys_received(&server).await.len() == 1 }).await;
    publish(&broker, "ev", "a", "again", serde_json::json!({})).await;
    publish(&broker, "ev", "a", "sentinel-1", serde_json::json!({})).await;
    wait_until(Duration::from_secs(20), "sentinel", || async { keys_received(&server).await.len() == 2 }).await;
    // Concurrency 4: the sentinel may overtake the duplicate, so wait for it to be acked.
    wait_until(Duration::from_secs(20), "queue drained", || async { place.drain_queue("work").await.is_empty() }).await;
    assert_eq!(counts(keys_received(&server).await)["again"], 1, "within the TTL: a duplicate");
    // The key's 2 s TTL must run out: time passing is this test's point, and nothing shows it.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    publish(&broker, "ev", "a", "again", serde_json::json!({})).await;
    wait_until(Duration::from_secs(20), "the key handled again", || async {
        counts(keys_received(&server).await)["again"] == 2
    })
    .await;
}

/// A private Redis on a free port, so stopping it disturbs no other test.
struct PrivateRedis {
    child: Child,
}

impl PrivateRedis {
    fn start(port: u16) -> PrivateRedis {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server is installed (see README)");
        let redis = PrivateRedis { child };
        let start = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(start.elapsed() < Duration::from_secs(10), "private redis did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        redis
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_means_no_handler_runs_and_nothing_is_lost() {
    let vhost = Vhost::new();
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_delay(Duration::from_millis(50)))
        .mount(&server)
        .await;
    let port = PrivateRedis::free_port();
    let redis = PrivateRedis::start(port);
    let dir = mock_webhook_pipeline(&server.uri(), 2);
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let url = format!("redis://127.0.0.1:{port}");
    let sluice = Sluice::run(dir.path(), &vhost.url(), &["--dedup", &url]);
    let keys: Vec<String> = (0..60).map(|i| format!("r{i:02}")).collect();
    for k in &keys[..20] {
        publish(&broker, "ev", "a", k, serde_json::json!({})).await;
    }
    wait_until(Duration::from_secs(20), "the first batch", || async { keys_received(&server).await.len() == 20 }).await;
    drop(redis);
    for k in &keys[20..] {
        publish(&broker, "ev", "a", k, serde_json::json!({})).await;
    }
    // While the store is down, no handler may run: each later message is turned back for want
    // of a claim, and nothing past the first batch arrives.
    wait_until(Duration::from_secs(30), "every later message turned back without a claim", || async {
        let log = sluice.log();
        let turned_back: Vec<&str> = log.lines().filter(|l| l.contains("no claim, so no handler run")).collect();
        keys[20..].iter().all(|k| turned_back.iter().any(|l| l.contains(&format!("idempotency_key=\"{k}\""))))
    })
    .await;
    assert_eq!(keys_received(&server).await.len(), 20, "a handler ran without a claim");
    let _redis = PrivateRedis::start(port);
    wait_until(Duration::from_secs(60), "every message after Redis came back", || async {
        let got = counts(keys_received(&server).await);
        keys.iter().all(|k| got.contains_key(k))
    })
    .await;
    let got = counts(keys_received(&server).await);
    assert!(got.values().all(|n| *n == 1), "each key once: {got:?}");
    assert!(vhost.drain_queue("work.dlq").await.is_empty(), "nothing dead-lettered while Redis was down");
}

on_every_broker!(
    duplicate_sent_twice_in_a_row_is_handled_once,
    duplicates_racing_on_two_runners_sharing_a_state_directory_are_handled_once,
    an_earlier_sluices_idempotency_store_is_named_with_what_to_do,
    kill_9_mid_run_then_restart_loses_nothing_and_repeats_only_in_flight_work,
    a_key_can_run_again_after_its_ttl,
);
