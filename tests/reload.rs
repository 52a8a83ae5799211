//! Hot reload (issue 10) against real RabbitMQ and the real binary: `sluice run` watches its
//! pipeline files and applies a valid edit without losing or repeating a message, rejects an
//! invalid one (or one the broker refuses) and keeps the running config, leaves a removed queue
//! and its messages on the broker, and reloads on SIGHUP with `--no-watch`. Whether a reload
//! happened is read from `sluice_config_reloads_total{result}` on the admin endpoint; what it
//! did is read from the receivers (calls by `Idempotency-Key`) and the broker's queues.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use sluice::broker::amqp::Amqp;
use sluice::broker::{BrokerError, Outgoing, Publish as _};
use sluice::envelope::Envelope;
use support::*;

/// How long any one condition may take before the test fails (nothing here hangs).
const DEADLINE: Duration = Duration::from_secs(20);

/// The admin endpoint of one runner, on a port of its own.
struct Admin {
    addr: String,
    client: reqwest::Client,
}

impl Admin {
    fn new() -> Admin {
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        sluice::install_tls_provider();
        let client = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().expect("http client");
        Admin { addr: format!("127.0.0.1:{port}"), client }
    }

    async fn get(&self, path: &str) -> Option<(u16, String)> {
        let response = self.client.get(format!("http://{}{path}", self.addr)).send().await.ok()?;
        let status = response.status().as_u16();
        Some((status, response.text().await.ok()?))
    }

    /// `sluice_config_reloads_total{result="<result>"}`: 0 while the counter has not been
    /// registered yet, None while the endpoint does not answer.
    async fn reloads(&self, result: &str) -> Option<u64> {
        let (200, text) = self.get("/metrics").await? else { return None };
        let label = format!("result=\"{result}\"");
        let value = text
            .lines()
            .filter(|l| l.starts_with("sluice_config_reloads_total{") && l.contains(&label))
            .find_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
        Some(value.map_or(0, |v| v as u64))
    }

    async fn applied(&self) -> u64 {
        self.reloads("applied").await.expect("the admin endpoint answers")
    }

    async fn rejected(&self) -> u64 {
        self.reloads("rejected").await.expect("the admin endpoint answers")
    }
}

/// The last lines of a runner's log, for failure messages (the whole log can be long).
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Polls `check` until it holds; fails at the deadline, or at once if the runner exited.
async fn wait_for<F, Fut>(sluice: &mut Sluice, deadline: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return;
        }
        assert!(sluice.is_running(), "sluice exited while waiting for: {what}; log:\n{}", tail(&sluice.log()));
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for: {what}; log tail:\n{}",
            tail(&sluice.log())
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A pipeline directory of its own (`pipelines/`) beside the runner's state (its log and
/// idempotency store), as deployments lay it out: the watch on the directory then sees only
/// the edits a test makes.
struct Files {
    root: tempfile::TempDir,
}

impl Files {
    fn new(files: &[(&str, &str)]) -> Files {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(root.path().join("pipelines")).expect("pipelines dir");
        let this = Files { root };
        for (name, text) in files {
            this.save(name, text);
        }
        this
    }

    fn dir(&self) -> PathBuf {
        self.root.path().join("pipelines")
    }

    /// A plain overwrite (or a new file), as `echo ... > file` does.
    fn save(&self, name: &str, text: &str) {
        std::fs::write(self.dir().join(name), text).unwrap_or_else(|e| panic!("write {name}: {e}"));
    }

    /// A whole new file renamed over the old one, as editors save: never seen half-written.
    fn replace(&self, name: &str, text: &str) {
        let tmp = self.root.path().join(format!("{name}.tmp"));
        std::fs::write(&tmp, text).unwrap_or_else(|e| panic!("write {name}.tmp: {e}"));
        std::fs::rename(&tmp, self.dir().join(name)).unwrap_or_else(|e| panic!("rename over {name}: {e}"));
    }
}

/// Starts `sluice run PIPELINES --admin ADDR [extra]` with its log and idempotency store in
/// `state`, and waits until it is consuming.
async fn start_in(pipelines: &Path, state: &Path, vhost: &Vhost, admin: &Admin, extra: &[&str]) -> Sluice {
    start_logging(pipelines, state, vhost, admin, extra, Some("info")).await
}

/// [`start_in`] with `RUST_LOG=filter` (None: unset, sluice's default filter).
async fn start_logging(
    pipelines: &Path,
    state: &Path,
    vhost: &Vhost,
    admin: &Admin,
    extra: &[&str],
    filter: Option<&str>,
) -> Sluice {
    let log = state.join(format!("sluice-{}.log", uuid::Uuid::now_v7()));
    let file = std::fs::File::create(&log).expect("log file");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    match filter {
        Some(filter) => command.env("RUST_LOG", filter),
        None => command.env_remove("RUST_LOG"),
    };
    let child = command
        .arg("run")
        .arg(pipelines)
        .args(["--broker", &vhost.url(), "--admin", &admin.addr])
        .args(extra)
        .env("NO_COLOR", "1")
        .env("SLUICE_DEDUP", state)
        .stdout(std::process::Stdio::null())
        .stderr(file)
        .spawn()
        .expect("spawn sluice");
    let mut sluice = Sluice { child, log };
    wait_for(&mut sluice, DEADLINE, "/readyz to answer 200", || async {
        matches!(admin.get("/readyz").await, Some((200, _)))
    })
    .await;
    sluice
}

/// [`start_in`] for a [`Files`] layout.
async fn start(files: &Files, vhost: &Vhost, admin: &Admin, extra: &[&str]) -> Sluice {
    start_in(&files.dir(), files.root.path(), vhost, admin, extra).await
}

/// Waits until the counter of reloads with `result` reaches `n`.
async fn wait_reloads(sluice: &mut Sluice, admin: &Admin, result: &str, n: u64) {
    let what = format!("sluice_config_reloads_total{{result=\"{result}\"}} >= {n}");
    wait_for(sluice, DEADLINE, &what, || async { admin.reloads(result).await.is_some_and(|v| v >= n) }).await;
}

/// Waits until `receiver` has answered a call for `key`.
async fn wait_handled(sluice: &mut Sluice, receiver: &Receiver, key: &str, name: &str) {
    let what = format!("a call for {key:?} at receiver {name}");
    wait_for(sluice, DEADLINE, &what, || async { receiver.hits_for(key).iter().any(Hit::succeeded) }).await;
}

/// Publishes `{prefix}-N` to `ev` every `every` until `total` has passed; each key with the
/// instant its publish was confirmed, in order.
fn spawn_publisher(
    broker: Amqp,
    prefix: &'static str,
    every: Duration,
    total: Duration,
) -> tokio::task::JoinHandle<Vec<(String, Instant)>> {
    tokio::spawn(async move {
        let start = Instant::now();
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sent = Vec::new();
        while start.elapsed() < total {
            tick.tick().await;
            let key = format!("{prefix}-{}", sent.len());
            publish(&broker, "ev", "load", &key, json!({"n": sent.len()})).await;
            sent.push((key, Instant::now()));
        }
        sent
    })
}

/// Waits until every key in `keys` got a 2xx from one of `receivers`.
async fn wait_all_handled(sluice: &mut Sluice, keys: &BTreeSet<String>, receivers: &[&Receiver]) {
    let what = format!("all {} published keys handled", keys.len());
    wait_for(sluice, Duration::from_secs(40), &what, || async {
        let done: BTreeSet<String> = receivers.iter().flat_map(|r| r.succeeded_keys()).collect();
        keys.is_subset(&done)
    })
    .await;
}

/// The ledger's verdict, once the runner has stopped (so no call can still arrive): every
/// published key reached the receivers exactly once, and nothing else did.
fn assert_each_handled_once(published: &BTreeSet<String>, receivers: &[&Receiver]) {
    let calls = counts(receivers.iter().flat_map(|r| r.hits()).map(|h| h.key().to_string()));
    let lost: Vec<&String> = published.iter().filter(|k| !calls.contains_key(*k)).collect();
    let repeated: BTreeMap<&String, &usize> = calls.iter().filter(|(_, n)| **n > 1).collect();
    let unknown: Vec<&String> = calls.keys().filter(|k| !published.contains(*k)).collect();
    assert!(lost.is_empty(), "{} published keys never reached a receiver: {lost:?}", lost.len());
    assert!(repeated.is_empty(), "keys called more than once (key: calls): {repeated:?}");
    assert!(unknown.is_empty(), "calls for keys never published: {unknown:?}");
    for receiver in receivers {
        assert!(receiver.hits().iter().all(Hit::succeeded), "every call was answered 2xx");
    }
}

/// Stops the runner (SIGTERM) and requires a clean exit; the tail of its log, for the
/// assertions that follow.
fn stop(sluice: &mut Sluice) -> String {
    assert_eq!(sluice.stop(Duration::from_secs(30)), Some(0), "clean exit; log tail:\n{}", tail(&sluice.log()));
    tail(&sluice.log())
}

/// Publishes `key` to `ev` with `routing_key`; false if no queue is bound to take it yet (the
/// broker returns an unroutable mandatory message: nothing was enqueued).
async fn publish_if_routable(broker: &Amqp, routing_key: &str, key: &str) -> bool {
    let envelope = Envelope::new("test.event", &json!({}), Some(key.to_string()));
    let message = Outgoing { body: envelope.encode(), ..Outgoing::default() };
    match broker.publish("ev", routing_key, message).await {
        Ok(()) => true,
        Err(BrokerError::Unroutable { .. }) => false,
        Err(e) => panic!("publish {key:?}: {e}"),
    }
}

/// Messages ready in `queue` and its consumers, or None if the queue does not exist (a passive
/// declare on a connection of its own, since a failed one closes the channel).
async fn queue_state(url: &str, queue: &str) -> Option<(u32, u32)> {
    use lapin::options::QueueDeclareOptions;
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await.expect("connect");
    let channel = conn.create_channel().await.expect("channel");
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    let state = channel
        .queue_declare(queue.into(), passive, lapin::types::FieldTable::default())
        .await
        .ok()
        .map(|q| (q.message_count(), q.consumer_count()));
    let _ = conn.close(200, "done".into()).await;
    state
}

/// Issue 10: a reload under a steady stream of messages loses none and repeats none; the old
/// receiver stops getting calls shortly after the save.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_loses_and_repeats_nothing() {
    let vhost = Vhost::new();
    let (a, b) = (Receiver::ok().await, Receiver::ok().await);
    let files = Files::new(&[("pipeline.yaml", &webhook_yaml(&a, "    concurrency: 4\n"))]);
    let broker = vhost.connect().await;
    declare(&files.dir(), &broker).await;
    let admin = Admin::new();
    let mut sluice = start(&files, &vhost, &admin, &[]).await;

    let publisher = spawn_publisher(broker.clone(), "load", Duration::from_millis(20), Duration::from_secs(8));
    tokio::time::sleep(Duration::from_secs(2)).await;
    files.save("pipeline.yaml", &webhook_yaml(&b, "    concurrency: 8\n"));
    let saved = Instant::now();
    wait_reloads(&mut sluice, &admin, "applied", 1).await;
    let applied = Instant::now();

    let sent = publisher.await.expect("publisher");
    let published: BTreeSet<String> = sent.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(published.len(), sent.len());
    wait_all_handled(&mut sluice, &published, &[&a, &b]).await;
    let rejected = admin.rejected().await;
    let log = stop(&mut sluice);

    assert_each_handled_once(&published, &[&a, &b]);
    // The watcher applies a save within about a second (it waits for 250 ms of quiet, at most
    // 1 s), more on a loaded machine; the old receiver stops getting calls as it is applied
    // (1 s: the polls that saw it applied).
    assert!(applied - saved < Duration::from_secs(10), "the save was applied {:?} after it", applied - saved);
    let late: Vec<(String, Duration)> = a
        .hits()
        .iter()
        .filter(|h| h.at > applied + Duration::from_secs(1))
        .map(|h| (h.key().to_string(), h.at - saved))
        .collect();
    assert!(
        late.is_empty(),
        "receiver A was called more than 1 s after the reload was seen applied ({:?} after the save): {late:?}",
        applied - saved
    );
    assert!(!a.hits().is_empty() && !b.hits().is_empty(), "both receivers had their share");
    assert_eq!(rejected, 0, "a valid save is never rejected (a half-written file read?); log tail:\n{log}");
    assert_eq!(vhost.depth("work").await, 0, "nothing left in the queue");
    assert_eq!(vhost.depth("work.dlq").await, 0, "nothing dead-lettered");
}

/// Issue 10: an invalid edit is rejected and the running config keeps handling messages; the
/// next valid edit is applied; no message is lost or repeated across both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_edit_keeps_the_running_config_until_a_valid_one() {
    let vhost = Vhost::new();
    let (a, b) = (Receiver::ok().await, Receiver::ok().await);
    let files = Files::new(&[("pipeline.yaml", &webhook_yaml(&a, "    concurrency: 4\n"))]);
    let broker = vhost.connect().await;
    declare(&files.dir(), &broker).await;
    let admin = Admin::new();
    let mut sluice = start(&files, &vhost, &admin, &[]).await;

    let publisher = spawn_publisher(broker.clone(), "load", Duration::from_millis(20), Duration::from_secs(8));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Pointed at B, but invalid: none of it may be applied.
    files.save("pipeline.yaml", &webhook_yaml(&b, "    concurrency: 0\n"));
    wait_reloads(&mut sluice, &admin, "rejected", 1).await;
    let rejected_at = Instant::now();
    assert_eq!(admin.applied().await, 0, "the invalid edit was not applied; log tail:\n{}", tail(&sluice.log()));
    // Messages keep flowing to A: keys handled there that were published after the rejection.
    wait_for(&mut sluice, DEADLINE, "5 calls at A after the rejection", || async {
        a.hits().iter().filter(|h| h.at > rejected_at).count() >= 5
    })
    .await;
    assert!(b.hits().is_empty(), "the rejected config (pointing at B) never ran: {:?}", b.succeeded_keys());

    files.save("pipeline.yaml", &webhook_yaml(&b, "    concurrency: 8\n"));
    wait_reloads(&mut sluice, &admin, "applied", 1).await;
    let applied_at = Instant::now();

    let sent = publisher.await.expect("publisher");
    let published: BTreeSet<String> = sent.iter().map(|(k, _)| k.clone()).collect();
    wait_all_handled(&mut sluice, &published, &[&a, &b]).await;
    let (applied, rejected) = (admin.applied().await, admin.rejected().await);
    let log = stop(&mut sluice);

    assert_each_handled_once(&published, &[&a, &b]);
    let after: Vec<&String> =
        sent.iter().filter(|(_, at)| *at > applied_at + Duration::from_secs(1)).map(|(k, _)| k).collect();
    assert!(!after.is_empty(), "the publisher outlived the valid edit by more than a second");
    let b_keys = b.succeeded_keys();
    let not_at_b: Vec<&&String> = after.iter().filter(|k| !b_keys.contains(**k)).collect();
    assert!(not_at_b.is_empty(), "published a second after the valid edit, yet not handled by B: {not_at_b:?}");
    assert_eq!((applied, rejected), (1, 1), "(applied, rejected): one of each edit; log tail:\n{log}");
    assert_eq!(vhost.depth("work.dlq").await, 0, "nothing dead-lettered");
}

/// Issue 10: deleting a pipeline file stops its queue's consumer but leaves the queue and its
/// messages on the broker; a new file's queue is declared and consumed. Issue 19: the removed
/// queue is unbound, so it takes no new messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_and_removing_files_adds_and_removes_queues() {
    let vhost = Vhost::new();
    let receiver = Receiver::ok().await;
    let queue = |name: &str, key: &str| {
        format!(
            "version: 1\nqueues:\n  {name}:\n    bind: [{{exchange: ev, routing_key: {key}}}]\n    handler: {{webhook: {{url: \"{}/{name}\"}}}}\n",
            receiver.uri()
        )
    };
    let files = Files::new(&[
        ("a.yaml", &format!("{}exchanges:\n  ev: {{type: topic}}\n", queue("qa", "a"))),
        ("b.yaml", &queue("qb", "b")),
    ]);
    let broker = vhost.connect().await;
    declare(&files.dir(), &broker).await;
    let admin = Admin::new();
    let mut sluice = start(&files, &vhost, &admin, &[]).await;
    let at = |path: &'static str| {
        let receiver = &receiver;
        move || receiver.hits().iter().filter(|h| h.target == path).map(|h| h.key().to_string()).collect::<Vec<_>>()
    };

    publish(&broker, "ev", "a", "a-1", json!({})).await;
    publish(&broker, "ev", "b", "b-1", json!({})).await;
    wait_handled(&mut sluice, &receiver, "a-1", "qa").await;
    wait_handled(&mut sluice, &receiver, "b-1", "qb").await;
    // Paused, qb keeps what arrives next: the messages a removed queue holds.
    let paused = sluice_cli(&["pause", "qb", "--admin", &admin.addr], &[], DEADLINE);
    assert_eq!(paused.code, Some(0), "{paused:?}");
    let url = vhost.url();
    wait_for(&mut sluice, DEADLINE, "qb without consumers", || async {
        queue_state(&url, "qb").await.is_some_and(|(_, consumers)| consumers == 0)
    })
    .await;
    publish(&broker, "ev", "b", "b-2", json!({})).await;
    publish(&broker, "ev", "b", "b-3", json!({})).await;
    wait_for(&mut sluice, DEADLINE, "2 messages waiting in qb", || async {
        queue_state(&url, "qb").await == Some((2, 0))
    })
    .await;

    std::fs::remove_file(files.dir().join("b.yaml")).expect("delete b.yaml");
    files.save("c.yaml", &queue("qc", "c"));
    wait_reloads(&mut sluice, &admin, "applied", 1).await;
    // Should the two edits come as two reloads, qc is bound by the second.
    wait_for(&mut sluice, DEADLINE, "a message to key c routed", || publish_if_routable(&broker, "c", "c-1")).await;
    wait_handled(&mut sluice, &receiver, "c-1", "qc").await;
    wait_for(&mut sluice, DEADLINE, "key b unroutable: qb unbound", || async {
        !publish_if_routable(&broker, "b", "b-4").await
    })
    .await;
    // The runner is alive and consuming its other queues.
    publish(&broker, "ev", "a", "a-2", json!({})).await;
    publish(&broker, "ev", "c", "c-2", json!({})).await;
    wait_handled(&mut sluice, &receiver, "a-2", "qa").await;
    wait_handled(&mut sluice, &receiver, "c-2", "qc").await;
    let rejected = admin.rejected().await;
    let log = stop(&mut sluice);

    assert_eq!(at("/qa")(), ["a-1", "a-2"]);
    assert_eq!(at("/qb")(), ["b-1"], "the removed queue's messages never reached the receiver");
    assert_eq!(at("/qc")(), ["c-1", "c-2"]);
    assert_eq!(queue_state(&url, "qb").await, Some((2, 0)), "qb and its messages stay on the broker");
    assert_eq!(rejected, 0, "no edit was rejected; log tail:\n{log}");
}

/// Issue 10: a reload the broker refuses (a classic queue redeclared as quorum) is rejected,
/// and the running config keeps consuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_refused_by_the_broker_keeps_the_running_config() {
    let vhost = Vhost::new();
    let (a, b) = (Receiver::ok().await, Receiver::ok().await);
    let files = Files::new(&[("pipeline.yaml", &webhook_yaml(&a, "    type: classic\n"))]);
    let broker = vhost.connect().await;
    declare(&files.dir(), &broker).await;
    let admin = Admin::new();
    let mut sluice = start(&files, &vhost, &admin, &[]).await;
    publish(&broker, "ev", "x", "before", json!({})).await;
    wait_handled(&mut sluice, &a, "before", "A").await;

    // Valid on disk, refused by RabbitMQ (PRECONDITION_FAILED on x-queue-type).
    files.save("pipeline.yaml", &webhook_yaml(&b, "    type: quorum\n"));
    wait_reloads(&mut sluice, &admin, "rejected", 1).await;
    publish(&broker, "ev", "x", "after", json!({})).await;
    wait_handled(&mut sluice, &a, "after", "A").await;
    let applied = admin.applied().await;
    let log = stop(&mut sluice);

    assert_eq!(applied, 0, "the refused config was not counted as applied; log tail:\n{log}");
    assert!(b.hits().is_empty(), "the refused config (pointing at B) never ran: {:?}", b.succeeded_keys());
    let published = BTreeSet::from(["before".to_string(), "after".to_string()]);
    assert_each_handled_once(&published, &[&a, &b]);
    // The queue is still the classic one: a classic redeclaration is still accepted.
    let probe = pipeline(&webhook_yaml(&a, "    type: classic\n"));
    declare(probe.path(), &broker).await;
}

/// Issue 10: with `--no-watch` an edit on disk changes nothing until SIGHUP, which reloads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_when_the_watcher_is_off() {
    let vhost = Vhost::new();
    let (a, b) = (Receiver::ok().await, Receiver::ok().await);
    let files = Files::new(&[("pipeline.yaml", &webhook_yaml(&a, ""))]);
    let broker = vhost.connect().await;
    declare(&files.dir(), &broker).await;
    let admin = Admin::new();
    let mut sluice = start(&files, &vhost, &admin, &["--no-watch"]).await;
    publish(&broker, "ev", "x", "k-1", json!({})).await;
    wait_handled(&mut sluice, &a, "k-1", "A").await;

    files.save("pipeline.yaml", &webhook_yaml(&b, ""));
    // Proving that nothing happens takes a window: eight times the watcher's debounce.
    tokio::time::sleep(Duration::from_secs(2)).await;
    publish(&broker, "ev", "x", "k-2", json!({})).await;
    wait_handled(&mut sluice, &a, "k-2", "A").await;
    assert_eq!(admin.applied().await, 0, "no reload without the watcher; log tail:\n{}", tail(&sluice.log()));

    sluice.signal(libc::SIGHUP);
    wait_reloads(&mut sluice, &admin, "applied", 1).await;
    publish(&broker, "ev", "x", "k-3", json!({})).await;
    wait_handled(&mut sluice, &b, "k-3", "B").await;
    let (applied, rejected) = (admin.applied().await, admin.rejected().await);
    let log = stop(&mut sluice);

    assert_eq!((applied, rejected), (1, 0), "(applied, rejected): the one SIGHUP; log tail:\n{log}");
    assert_eq!(a.succeeded_keys(), BTreeSet::from(["k-1".to_string(), "k-2".to_string()]));
    assert_eq!(b.succeeded_keys(), BTreeSet::from(["k-3".to_string()]));
    let published = ["k-1", "k-2", "k-3"].map(String::from).into();
    assert_each_handled_once(&published, &[&a, &b]);
}

/// Issue 10: a burst of saves is debounced into one reload (two at most) of the final content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_saves_is_debounced() {
    let vhost = Vhost::new();
    let (a, b) = (Receiver::ok().await, Receiver::ok().await);
    let files = Files::new(&[("pipeline.yaml", &webhook_yaml(&a, "    concurrency: 4\n"))]);
    let broker = vhost.connect().await;
    declare(&files.dir(), &broker).await;
    let admin = Admin::new();
    let mut sluice = start(&files, &vhost, &admin, &[]).await;
    publish(&broker, "ev", "x", "k-1", json!({})).await;
    wait_handled(&mut sluice, &a, "k-1", "A").await;

    // Ten saves in under a second, 100 ms apart; only the last points at B. Each replaces the
    // file whole, as editors do: a plain overwrite can be caught half-written by the reload a
    // burst still gets after a second (on a busy machine the burst outlasts it), and rejected.
    for concurrency in 1..=10 {
        let receiver = if concurrency == 10 { &b } else { &a };
        files.replace("pipeline.yaml", &webhook_yaml(receiver, &format!("    concurrency: {concurrency}\n")));
        if concurrency < 10 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let last_save = Instant::now();
    wait_reloads(&mut sluice, &admin, "applied", 1).await;
    // Proving that no more reloads follow takes a window.
    tokio::time::sleep((last_save + Duration::from_secs(3)).saturating_duration_since(Instant::now())).await;
    let (applied, rejected) = (admin.applied().await, admin.rejected().await);
    let log = tail(&sluice.log());
    assert!(
        (1..=2).contains(&applied),
        "10 saves in a second applied {applied} times, not 1 (2 at most); log tail:\n{log}"
    );
    assert_eq!(rejected, 0, "no save was rejected; log tail:\n{log}");

    publish(&broker, "ev", "x", "k-2", json!({})).await;
    wait_handled(&mut sluice, &b, "k-2", "B").await;
    stop(&mut sluice);
    assert_eq!(b.succeeded_keys(), BTreeSet::from(["k-2".to_string()]), "the final content is the one running");
    let published = ["k-1", "k-2"].map(String::from).into();
    assert_each_handled_once(&published, &[&a, &b]);
}

/// Issue 10: an editor's save (write a temporary file, rename it over the original) is seen,
/// and so is the next one: the watch survives the original file's inode being replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn editor_style_rename_over_the_file_is_reloaded() {
    let vhost = Vhost::new();
    let (a, b, c) = (Receiver::ok().await, Receiver::ok().await, Receiver::ok().await);
    let files = Files::new(&[("pipeline.yaml", &webhook_yaml(&a, ""))]);
    let broker = vhost.connect().await;
    declare(&files.dir(), &broker).await;
    let admin = Admin::new();
    let mut sluice = start(&files, &vhost, &admin, &[]).await;
    publish(&broker, "ev", "x", "k-1", json!({})).await;
    wait_handled(&mut sluice, &a, "k-1", "A").await;

    let replace = |receiver: &Receiver| {
        let tmp = files.dir().join("pipeline.yaml.tmp");
        std::fs::write(&tmp, webhook_yaml(receiver, "")).expect("write the temporary file");
        std::fs::rename(&tmp, files.dir().join("pipeline.yaml")).expect("rename over pipeline.yaml");
    };
    replace(&b);
    wait_reloads(&mut sluice, &admin, "applied", 1).await;
    publish(&broker, "ev", "x", "k-2", json!({})).await;
    wait_handled(&mut sluice, &b, "k-2", "B").await;
    assert_eq!(admin.applied().await, 1, "one save, one reload; log tail:\n{}", tail(&sluice.log()));

    replace(&c);
    wait_reloads(&mut sluice, &admin, "applied", 2).await;
    publish(&broker, "ev", "x", "k-3", json!({})).await;
    wait_handled(&mut sluice, &c, "k-3", "C").await;
    let (applied, rejected) = (admin.applied().await, admin.rejected().await);
    let log = stop(&mut sluice);

    assert_eq!((applied, rejected), (2, 0), "(applied, rejected): two saves; log tail:\n{log}");
    assert_eq!(a.succeeded_keys(), BTreeSet::from(["k-1".to_string()]));
    assert_eq!(b.succeeded_keys(), BTreeSet::from(["k-2".to_string()]));
    assert_eq!(c.succeeded_keys(), BTreeSet::from(["k-3".to_string()]));
    let published = ["k-1", "k-2", "k-3"].map(String::from).into();
    assert_each_handled_once(&published, &[&a, &b, &c]);
}

/// Issue 10: what the runner itself writes inside the watched directory is no pipeline file
/// and triggers no reload: `sluice run .` keeps its idempotency keys in `./.sluice/broker.db`
/// (the default), so the store's file and its write-ahead log change below the pipeline
/// directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runners_own_files_in_the_pipeline_directory_trigger_no_reload() {
    let vhost = Vhost::new();
    let receiver = Receiver::ok().await;
    let dir = pipeline(&webhook_yaml(&receiver, ""));
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let admin = Admin::new();
    let state = dir.path().join(".sluice");
    std::fs::create_dir(&state).expect("create .sluice");
    let mut sluice = start_in(dir.path(), &state, &vhost, &admin, &[]).await;
    let mut published = BTreeSet::new();
    for i in 0..50 {
        let key = format!("k-{i}");
        publish(&broker, "ev", "x", &key, json!({})).await;
        published.insert(key);
    }
    wait_all_handled(&mut sluice, &published, &[&receiver]).await;
    // Proving that no reload follows takes a window: eight times the watcher's debounce.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (applied, rejected) = (admin.applied().await, admin.rejected().await);
    let log = stop(&mut sluice);

    assert_eq!((applied, rejected), (0, 0), "(applied, rejected): nothing was edited; log tail:\n{log}");
    assert_each_handled_once(&published, &[&receiver]);
}

/// Waits until `path` has gone quiet (its writer is idle); fails at the deadline if it never
/// does.
async fn settled_size(sluice: &mut Sluice, path: &Path) {
    // Quiet but for the connection's heartbeat lines (two a second at `trace`, a hundred bytes
    // each): a log that feeds on itself grew by megabytes a second.
    const QUIET: u64 = 2048;
    let size = || std::fs::metadata(path).map_or(0, |m| m.len());
    let (mut from, mut since) = (size(), Instant::now());
    wait_for(sluice, DEADLINE, "the log to grow by under 1 KB a second for 2 s", || {
        let now = size();
        let quiet = since.elapsed() >= Duration::from_secs(2) && now.saturating_sub(from) < QUIET;
        if now.saturating_sub(from) >= QUIET {
            (from, since) = (now, Instant::now());
        }
        std::future::ready(quiet)
    })
    .await;
}

/// Issue 31 (low): with `RUST_LOG=trace` and the log file beside the pipeline directory (the
/// directory's parent is watched, to see it come back), the runner's own log lines are no
/// reason to work: the log goes quiet once the runner idles, but for the heartbeat's lines (it
/// grew at 8.6 MB/s, each line an event that notify logged in a line of its own), and writes to files other than the
/// pipelines' reload nothing, while an edit of a pipeline does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runners_log_beside_the_pipelines_is_no_reason_to_work() {
    let vhost = Vhost::new();
    let (a, b) = (Receiver::ok().await, Receiver::ok().await);
    let files = Files::new(&[("pipeline.yaml", &webhook_yaml(&a, ""))]);
    let broker = vhost.connect().await;
    declare(&files.dir(), &broker).await;
    let admin = Admin::new();
    let mut sluice = start_logging(&files.dir(), files.root.path(), &vhost, &admin, &[], Some("trace")).await;
    let log = sluice.log.clone();
    settled_size(&mut sluice, &log).await;

    // Other files beside the pipelines and among them: no reload.
    for i in 0..20 {
        std::fs::write(files.root.path().join("other.log"), format!("line {i}\n")).expect("write beside");
        std::fs::write(files.dir().join("notes.txt"), format!("note {i}\n")).expect("write among");
    }
    settled_size(&mut sluice, &log).await;
    assert_eq!((admin.applied().await, admin.rejected().await), (0, 0), "no pipeline was edited");

    // The control: an edit of the pipeline is applied.
    files.replace("pipeline.yaml", &webhook_yaml(&b, ""));
    wait_reloads(&mut sluice, &admin, "applied", 1).await;
    publish(&broker, "ev", "x", "k-1", json!({})).await;
    wait_handled(&mut sluice, &b, "k-1", "B").await;
    settled_size(&mut sluice, &log).await;
    stop(&mut sluice);
}

/// Issue 31 (low): the pipeline directory deleted under a running runner is said in sluice's
/// own words (the reload that finds no file, rejected; the running config stays), with no line
/// of notify's (its WARN about a watch the kernel had already dropped), whatever `RUST_LOG`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pipeline_directory_logs_no_line_of_notifys() {
    for filter in [None, Some("info"), Some("debug")] {
        let vhost = Vhost::new();
        let receiver = Receiver::ok().await;
        let files = Files::new(&[("pipeline.yaml", &webhook_yaml(&receiver, ""))]);
        declare(&files.dir(), &vhost.connect().await).await;
        let admin = Admin::new();
        let mut sluice = start_logging(&files.dir(), files.root.path(), &vhost, &admin, &[], filter).await;
        std::fs::remove_dir_all(files.dir()).expect("delete the pipeline directory");
        wait_reloads(&mut sluice, &admin, "rejected", 1).await;
        let log = stop(&mut sluice);
        let all = sluice.log();
        let notify: Vec<&str> = all.lines().filter(|l| l.contains("notify")).collect();
        assert!(notify.is_empty(), "RUST_LOG={filter:?}: notify's lines: {notify:?}\n{log}");
        assert!(all.contains("the running config stays"), "RUST_LOG={filter:?}: {log}");
    }
}
