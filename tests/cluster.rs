//! Issue 20: sluice on a three-node RabbitMQ cluster of the test's own (scripts/rabbitmq-cluster.sh),
//! real `sluice` processes given every node's address, nodes killed and frozen under a steady
//! stream. Each scenario counts what reached the receiver by idempotency key: every confirmed
//! message handled, none handled twice, and the longest pause between two webhook calls
//! bounded as the issue asks.
//!
//! One test runs the scenarios in turn on one cluster: starting a cluster costs about 15 s.
//! A binary of its own (`cargo test --test cluster`), which `.ci/run` runs beside the suite:
//! it waits on its nodes and its stream, not on the cores (its pauses stayed well inside
//! their bounds with the suite running beside it).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[macro_use]
mod support;

use crate::support::cluster::Cluster;
use crate::support::*;
use futures_util::StreamExt as _;
use serde_json::json;
use sluice::broker::amqp::{Amqp, Timeouts};
use sluice::broker::{Broker as _, Credit, Operate as _, Publish as _};

/// A quorum queue `work` bound to `ev`, calling the receiver, idempotency on.
fn cluster_pipeline(receiver: &Receiver) -> tempfile::TempDir {
    webhook_pipeline(receiver, "    concurrency: 8\n")
}

/// Publishes envelopes keyed `{prefix}-{n}` to `ev` at about `per_second`, through whichever of
/// `urls` answers (the next one after a failure), until stopped; each key is published until
/// confirmed. The confirmed keys are what must reach the receiver.
struct Stream {
    stop: Arc<AtomicBool>,
    confirmed: Arc<Mutex<BTreeMap<String, Instant>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Stream {
    fn start(urls: Vec<String>, prefix: &str, per_second: u32) -> Stream {
        let (stop, confirmed) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(BTreeMap::new())));
        let (flag, done, prefix) = (stop.clone(), confirmed.clone(), prefix.to_string());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1) / per_second);
            let (mut node, mut n) = (0, 0u64);
            let mut session: Option<Amqp> = None;
            while !flag.load(Ordering::SeqCst) {
                tick.tick().await;
                let key = format!("{prefix}-{n}");
                let broker = match &session {
                    Some(b) => b.clone(),
                    None => match Amqp::connect(&urls[node % urls.len()], Timeouts::default()).await {
                        Ok(b) => session.insert(b).clone(),
                        Err(_) => {
                            node += 1;
                            continue;
                        }
                    },
                };
                let envelope = sluice::envelope::Envelope::new("test.event", &json!({"n": n}), Some(key.clone()));
                let message = sluice::broker::Outgoing { body: envelope.encode(), ..Default::default() };
                match broker.publish("ev", "k", message).await {
                    Ok(()) => {
                        done.lock().expect("lock").insert(key, Instant::now());
                        n += 1;
                    }
                    Err(_) => {
                        broker.close().await;
                        session = None;
                        node += 1;
                    }
                }
            }
            if let Some(b) = session {
                b.close().await;
            }
        });
        Stream { stop, confirmed, task }
    }

    /// Each confirmed key and when it was confirmed.
    async fn stop(self) -> BTreeMap<String, Instant> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.expect("publisher task");
        self.confirmed.lock().expect("lock").clone()
    }
}

/// What a node loss cost downstream.
#[derive(Debug, Clone, Copy)]
struct Recovery {
    /// The longest pause between two webhook calls after the event.
    pause: Duration,
    /// From the end of that pause until every message confirmed before its end was handled.
    drain: Duration,
    messages: usize,
}

/// Waits until the receiver has answered every confirmed key with a 2xx; checks that no key
/// got two successful calls; measures the longest pause between two calls from `from` on, and
/// how long the backlog built meanwhile took to drain.
async fn handled_once(
    receiver: &Receiver,
    confirmed: &BTreeMap<String, Instant>,
    from: Instant,
    sluices: &[&Sluice],
) -> Recovery {
    let deadline = Duration::from_secs(120);
    let logs = || sluices.iter().map(|s| s.log()).collect::<Vec<_>>().join("\n----\n");
    let start = Instant::now();
    loop {
        let handled = receiver.succeeded_keys();
        let missing = confirmed.keys().filter(|k| !handled.contains(*k)).count();
        if missing == 0 {
            break;
        }
        assert!(start.elapsed() < deadline, "{missing} confirmed key(s) never handled; logs:\n{}", logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let hits = receiver.hits();
    let per_key = counts(hits.iter().filter(|h| h.succeeded()).map(|h| h.key().to_string()));
    let twice: BTreeMap<&String, &usize> = per_key.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "keys handled more than once: {twice:?}");
    let mut times: Vec<Instant> = hits.iter().map(|h| h.at).filter(|at| *at >= from).collect();
    times.sort();
    let (pause, resumed) = times.windows(2).map(|w| (w[1] - w[0], w[1])).max().unwrap_or((Duration::ZERO, from));
    let handled: BTreeMap<&str, Instant> = hits.iter().filter(|h| h.succeeded()).map(|h| (h.key(), h.at)).collect();
    let drained = confirmed
        .iter()
        .filter(|(_, at)| **at < resumed)
        .filter_map(|(key, _)| handled.get(key.as_str()))
        .max()
        .copied()
        .unwrap_or(resumed);
    Recovery { pause, drain: drained.saturating_duration_since(resumed), messages: confirmed.len() }
}

/// Starts `sluice run` on every node of the cluster with an admin port; waits until it consumes.
fn run_on_cluster(dir: &std::path::Path, cluster: &Cluster, extra: &[&str]) -> Sluice {
    let urls = cluster.urls().join(",");
    let admin = format!("127.0.0.1:{}", free_port());
    let args: Vec<&str> = ["--admin", admin.as_str()].into_iter().chain(extra.iter().copied()).collect();
    Sluice::run(dir, &urls, &args)
}

/// The node the runner's AMQP session is with, once it has one.
async fn node_of(cluster: &Cluster, sluice: &Sluice) -> usize {
    let start = Instant::now();
    loop {
        if let Some(n) = cluster.connected_node(sluice.child.id()) {
            return n;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "sluice never connected; log:\n{}", sluice.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the runner has handled at least one message of the stream: it consumes.
async fn consuming(receiver: &Receiver, sluice: &Sluice) {
    let start = Instant::now();
    while receiver.succeeded_keys().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(60), "nothing handled; log:\n{}", sluice.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs a blocking step (the cluster script) without stalling the runtime's other tasks.
fn blocking<T>(step: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(step)
}

fn other_urls(cluster: &Cluster, not: usize) -> Vec<String> {
    (1..=3).filter(|n| *n != not).map(|n| cluster.url(n)).collect()
}

/// How long the stream runs between the runner's first handled message and the loss: about
/// 100 messages at 100/s, so deliveries are in flight (prefetched, in the handler, being
/// acked) when the node goes.
const BEFORE_THE_LOSS: Duration = Duration::from_secs(1);

/// How long the queue's leader's node stays down in the scenarios where sluice is not on it
/// (before `start`, which boots it again for a few seconds more): several times the election
/// that follows a kill (under a second here, BENCHMARKS.md), so a new leader is elected and
/// work goes on under it while the node is still away.
const LEADER_OUTAGE: Duration = Duration::from_secs(5);

/// Sluice given every node, a steady stream published through the other nodes; then `lose`
/// done to sluice's node, `restore` after `outage`: every confirmed message handled once, and
/// the longest pause between two webhook calls under `bound`. The outage must be longer than
/// the bound: a sluice that waited for its node to come back, instead of moving on, then fails.
async fn lose_its_node(cluster: &Cluster, event: &str, outage: Duration, bound: Duration) -> Recovery {
    assert!(outage > bound, "an outage of {outage:?} cannot tell a runner that moved on from one that waited");
    let receiver = Receiver::ok().await;
    let dir = cluster_pipeline(&receiver);
    declare(dir.path(), &Amqp::connect(&cluster.url(1), Timeouts::default()).await.expect("node 1")).await;
    let sluice = run_on_cluster(dir.path(), cluster, &[]);
    let node = node_of(cluster, &sluice).await;
    let stream = Stream::start(other_urls(cluster, node), &unique(event), 100);
    consuming(&receiver, &sluice).await;
    tokio::time::sleep(BEFORE_THE_LOSS).await;
    let lost_at = Instant::now();
    blocking(|| if event == "kill" { cluster.kill(node) } else { cluster.freeze(node) });
    tokio::time::sleep(outage).await;
    blocking(|| if event == "kill" { cluster.start(node) } else { cluster.thaw(node) });
    // The stream goes on for a while after the node is back, so that a pause its return
    // causes counts: a restarted node taking its place in the queue again (`start` returns
    // once it has rejoined: 3 s), or a thawed one waking up to sluice's old session and to a
    // leadership taken over meanwhile, which it learns as its own timers fire (5 s).
    tokio::time::sleep(Duration::from_secs(if event == "kill" { 3 } else { 5 })).await;
    let confirmed = stream.stop().await;
    let recovery = handled_once(&receiver, &confirmed, lost_at, &[&sluice]).await;
    eprintln!("{event} of sluice's node {node}: {recovery:?}");
    let pause = recovery.pause;
    assert!(pause < bound, "longest pause between webhook calls {pause:?}; log:\n{}", sluice.log());
    assert_ne!(cluster.connected_node(sluice.child.id()), Some(node), "still on the lost node?");
    if event == "freeze" {
        // The thawed node stays out of the cluster that declared it down: the next scenario
        // starts whole.
        blocking(|| cluster.rejoin(node));
    }
    recovery
}

/// kill -9 of the node sluice is connected to, restarted 8 s later: sluice moves to the next
/// node at once (under a second here), well within 5 s; one that waited for its node would
/// pause the 8 s and the restart.
async fn kill_of_its_node(cluster: &Cluster) -> Recovery {
    lose_its_node(cluster, "kill", Duration::from_secs(8), Duration::from_secs(5)).await
}

/// SIGSTOP of sluice's node for 24 s, then SIGCONT: the heartbeat notices it, sluice moves on,
/// and the thawed node's return costs no second pause. The bound, 20 s, is the heartbeat's
/// 2 × 2 s and the net tick's 7.5–12.5 s (which must pass before a queue whose leader the node
/// held takes a consumer elsewhere) with room: 6–7 s here, about 12 s when the node led the
/// queue, timers rather than CPU, so a busy machine does not move it much. 24 s is 4 s above the bound, so a sluice that waited
/// for the thaw fails, and well past the net tick, so the cluster declares the node down.
async fn freeze_of_its_node(cluster: &Cluster) -> Recovery {
    lose_its_node(cluster, "freeze", Duration::from_secs(24), Duration::from_secs(20)).await
}

/// The node leading the queue killed while sluice is on another node: the queue elects a new
/// leader, and sluice's session carries on untouched (the same connection throughout).
async fn kill_of_the_leaders_node(cluster: &Cluster) -> Recovery {
    let receiver = Receiver::ok().await;
    let dir = cluster_pipeline(&receiver);
    declare(dir.path(), &Amqp::connect(&cluster.url(1), Timeouts::default()).await.expect("node 1")).await;
    let leader = blocking(|| cluster.leader("work"));
    let sluice = run_on(cluster, dir.path(), &[], |node| node != leader).await;
    let connection = cluster.connection(sluice.child.id()).expect("connected to the cluster");
    let stream = Stream::start(other_urls(cluster, leader), &unique("leader"), 100);
    consuming(&receiver, &sluice).await;
    tokio::time::sleep(BEFORE_THE_LOSS).await;
    let killed_at = Instant::now();
    blocking(|| cluster.kill(leader));
    tokio::time::sleep(LEADER_OUTAGE).await;
    blocking(|| cluster.start(leader));
    let confirmed = stream.stop().await;
    let recovery = handled_once(&receiver, &confirmed, killed_at, &[&sluice]).await;
    eprintln!("kill of the leader's node {leader}: {recovery:?}");
    assert_eq!(cluster.connection(sluice.child.id()), Some(connection), "sluice reconnected; log:\n{}", sluice.log());
    recovery
}

/// Three runners, one per node, sharing a Redis idempotency store; one node killed: its
/// runner moves on, nothing is lost, no key runs twice.
async fn three_runners_and_a_node_killed(cluster: &Cluster) {
    let receiver = Receiver::ok().await;
    let dir = cluster_pipeline(&receiver);
    declare(dir.path(), &Amqp::connect(&cluster.url(1), Timeouts::default()).await.expect("node 1")).await;
    let dedup = ["--dedup", "redis://127.0.0.1:6379/"];
    let mut runners = Vec::new();
    for node in 1..=3 {
        runners.push(run_on(cluster, dir.path(), &dedup, |n| n == node).await);
    }
    let stream = Stream::start(other_urls(cluster, 1), &unique("three"), 100);
    consuming(&receiver, &runners[0]).await;
    tokio::time::sleep(BEFORE_THE_LOSS).await;
    let killed_at = Instant::now();
    blocking(|| cluster.kill(1));
    // Node 1 may hold the queue's leader too: down as long as in the leader's scenario.
    tokio::time::sleep(LEADER_OUTAGE).await;
    blocking(|| cluster.start(1));
    let confirmed = stream.stop().await;
    let all: Vec<&Sluice> = runners.iter().collect();
    let recovery = handled_once(&receiver, &confirmed, killed_at, &all).await;
    eprintln!("three runners, node 1 killed: {recovery:?}");
    assert_ne!(cluster.connected_node(runners[0].child.id()), Some(1), "runner 1 still on the killed node?");
}

/// `sluice publish --jsonl` given every node, its node killed mid-run (and started again): it
/// carries on with another, exits 0, and every message it confirmed is in the queue.
async fn publish_survives_the_loss_of_its_node(cluster: &Cluster) {
    let dir = pipeline(
        "version: 1\nexchanges:\n  ev: {type: topic}\nqueues:\n  inbox:\n    bind: [{exchange: ev, routing_key: \"#\"}]\n    handler: {command: {program: /bin/true}}\n",
    );
    let session = Amqp::connect(&cluster.url(1), Timeouts::default()).await.expect("node 1");
    declare(dir.path(), &session).await;
    session.close().await;
    let total = 20_000;
    let jsonl = dir.path().join("payloads.jsonl");
    let lines: Vec<String> = (0..total).map(|n| format!("{{\"n\": {n}}}")).collect();
    std::fs::write(&jsonl, lines.join("\n")).expect("write payloads");
    let urls = cluster.urls().join(",");
    let args = ["publish", "--broker", &urls, "--exchange", "ev", "--routing-key", "k", "--type", "t"];
    let mut publish = Child::spawn(&args, &["--jsonl", jsonl.to_str().expect("utf-8")]);
    let (node, depth) = wait_for_progress(cluster, &mut publish, "inbox", 1_000).await;
    blocking(|| cluster.kill(node));
    // On a busy machine RabbitMQ 3.10 has refused (nacked) every publish to the queue for 30 s
    // and more after the kill, though two of its three members ran; the node comes back after 2
    // s here, within the ~30 s that publish tries refusals again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    blocking(|| cluster.start(node));
    let code = publish.wait(Duration::from_secs(120));
    assert_eq!(code, Some(0), "publish failed: {}", publish.stderr());
    let ids = ids_in(&cluster.url(node % 3 + 1), "inbox").await;
    let distinct: BTreeSet<&String> = ids.iter().collect();
    eprintln!(
        "publish, node {node} killed at depth {depth}: {} distinct of {total}, {} copies",
        distinct.len(),
        ids.len()
    );
    assert_eq!(distinct.len(), total, "confirmed messages missing from the queue");
}

/// A broker that takes a publish and never confirms it (a disk alarm blocks publishers; a
/// frozen node or a quorum queue without its majority do the same): each wait ends after
/// `--confirm-timeout` as a lost session, and `publish` gives up after three rounds over its
/// nodes with the reason, instead of hanging.
async fn a_confirm_that_never_comes_is_bounded(cluster: &Cluster) {
    let dir = pipeline(
        "version: 1\nexchanges:\n  ev: {type: topic}\nqueues:\n  blocked:\n    bind: [{exchange: ev, routing_key: \"#\"}]\n    handler: {command: {program: /bin/true}}\n",
    );
    let session = Amqp::connect(&cluster.url(1), Timeouts::default()).await.expect("node 1");
    declare(dir.path(), &session).await;
    session.close().await;
    blocking(|| cluster.disk_alarm(true));
    let (url, started) = (cluster.url(2), Instant::now());
    let args =
        ["publish", "--broker", &url, "--confirm-timeout", "1s", "--exchange", "ev", "--type", "t", "--payload", "{}"];
    let publish = sluice_cli(&args, &[], Duration::from_secs(60));
    let gave_up_after = started.elapsed();
    blocking(|| cluster.disk_alarm(false));
    eprintln!("publish under a disk alarm gave up after {gave_up_after:?}");
    assert_eq!(publish.code, Some(1), "{publish:?}");
    assert!(publish.stderr.contains("no confirm from the broker within 1s"), "{}", publish.stderr);
    // Three sessions of 1 s each and their connects (about 3.5 s here), not also a wait for
    // each session's close, which a blocked node never answers (3 × 6 s and more before).
    assert!(gave_up_after < Duration::from_secs(15), "publish gave up after {gave_up_after:?}: {}", publish.stderr);
}

/// `sluice dlq redrive` given every node, its node killed mid-run: it carries on, exits 0,
/// the dead-letter queue is empty and every message is back in the queue. The last scenario:
/// the killed node stays down (its queues have their majority); returns its number.
async fn redrive_survives_the_loss_of_its_node(cluster: &Cluster) -> usize {
    let dir = pipeline("version: 1\nqueues:\n  redo:\n    handler: {command: {program: /bin/true}}\n");
    let session = Amqp::connect(&cluster.url(1), Timeouts::default()).await.expect("node 1");
    declare(dir.path(), &session).await;
    let total = 3_000;
    // A hundred awaiting their confirms at once: one by one took 6 s.
    futures_util::stream::iter(0..total)
        .for_each_concurrent(100, |n| {
            let session = &session;
            async move {
                publish(session, "", "redo.dlq", &format!("redo-{n}"), json!({"n": n})).await;
            }
        })
        .await;
    session.close().await;
    let urls = cluster.urls().join(",");
    let pipelines = dir.path().to_str().expect("utf-8");
    let args = ["dlq", "redrive", "redo", "--pipelines", pipelines, "--broker", &urls];
    let mut redrive = Child::spawn(&args, &["--rate", "500/s"]);
    let (node, depth) = wait_for_progress(cluster, &mut redrive, "redo", 300).await;
    blocking(|| cluster.kill(node));
    let code = redrive.wait(Duration::from_secs(120));
    assert_eq!(code, Some(0), "redrive failed: {}", redrive.stderr());
    let other = cluster.url(node % 3 + 1);
    let left = ids_in(&other, "redo.dlq").await;
    let ids = ids_in(&other, "redo").await;
    let distinct: BTreeSet<&String> = ids.iter().collect();
    eprintln!(
        "redrive, node {node} killed at depth {depth}: {} distinct of {total}, {} copies, {} left",
        distinct.len(),
        ids.len(),
        left.len()
    );
    assert_eq!((distinct.len(), left.len()), (total, 0), "{}", redrive.stderr());
    node
}

/// A one-shot `sluice` command running in the background.
struct Child {
    child: std::process::Child,
    stderr: tempfile::NamedTempFile,
}

impl Child {
    fn spawn(args: &[&str], more: &[&str]) -> Child {
        let stderr = tempfile::NamedTempFile::new().expect("stderr file");
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(args)
            .args(more)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(stderr.reopen().expect("reopen"))
            .spawn()
            .expect("spawn sluice");
        Child { child, stderr }
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    fn wait(&mut self, deadline: Duration) -> Option<i32> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code();
            }
            assert!(start.elapsed() < deadline, "sluice did not exit within {deadline:?}: {}", self.stderr());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.stderr.path()).unwrap_or_default()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until the command is connected and `queue` holds at least `depth` messages, the
/// command still running; the command's node and the depth seen.
async fn wait_for_progress(cluster: &Cluster, command: &mut Child, queue: &str, depth: u32) -> (usize, u32) {
    let start = Instant::now();
    loop {
        assert!(command.running(), "it ended before its node could be killed: {}", command.stderr());
        assert!(start.elapsed() < Duration::from_secs(60), "no progress: {}", command.stderr());
        if let Some(node) = cluster.connected_node(command.child.id()) {
            let other = Amqp::connect(&cluster.url(node % 3 + 1), Timeouts::default()).await.expect("another node");
            let seen = other.depth(queue).await.expect("depth");
            other.close().await;
            if seen >= depth {
                return (node, seen);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The message id of every message in `queue`, copies included, left in place.
async fn ids_in(url: &str, queue: &str) -> Vec<String> {
    use sluice::broker::{Consumer as _, Delivery as _};
    let session = Amqp::connect(url, Timeouts::default()).await.expect("connect");
    let depth = session.depth(queue).await.expect("depth");
    let (mut deliveries, consumer) = session.browse(queue, Credit::at_most(u16::MAX)).await.expect("browse");
    let mut ids = Vec::new();
    while ids.len() < depth as usize {
        let next = tokio::time::timeout(Duration::from_secs(10), deliveries.next()).await;
        let delivery = next.expect("a delivery within 10 s").expect("stream open").expect("a delivery");
        let envelope: serde_json::Value = serde_json::from_slice(delivery.body()).expect("an envelope");
        ids.push(envelope["id"].as_str().expect("an id").to_string());
    }
    consumer.close().await;
    session.close().await;
    ids
}

/// A prefix no earlier run used: keys in the shared Redis store outlive the test.
fn unique(what: &str) -> String {
    format!("{what}-{}", uuid::Uuid::now_v7())
}

/// Starts runners on every node until one's session is with a node `wanted` accepts (each
/// runner takes the nodes in an order of its own).
async fn run_on(cluster: &Cluster, dir: &std::path::Path, extra: &[&str], wanted: impl Fn(usize) -> bool) -> Sluice {
    for _ in 0..30 {
        let sluice = run_on_cluster(dir, cluster, extra);
        if wanted(node_of(cluster, &sluice).await) {
            return sluice;
        }
    }
    panic!("30 runners in a row chose nodes the test did not want");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_carries_on_when_a_cluster_node_is_lost() {
    require_rabbitmq();
    let cluster = blocking(Cluster::up);
    // SLUICE_CLUSTER_RUNS=N repeats the timed scenarios and compares throughput with a single
    // node (BENCHMARKS.md, "Node loss"); the test runs each once.
    let runs: usize = std::env::var("SLUICE_CLUSTER_RUNS").ok().and_then(|n| n.parse().ok()).unwrap_or(1);
    let mut figures: BTreeMap<&str, Vec<Recovery>> = BTreeMap::new();
    for _ in 0..runs {
        figures.entry("kill -9 of sluice's node").or_default().push(kill_of_its_node(&cluster).await);
        figures.entry("freeze of sluice's node (24 s)").or_default().push(freeze_of_its_node(&cluster).await);
        figures.entry("kill -9 of the leader's node").or_default().push(kill_of_the_leaders_node(&cluster).await);
    }
    three_runners_and_a_node_killed(&cluster).await;
    publish_survives_the_loss_of_its_node(&cluster).await;
    a_confirm_that_never_comes_is_bounded(&cluster).await;
    let down = redrive_survives_the_loss_of_its_node(&cluster).await;
    if runs > 1 {
        // The throughput is that of the whole cluster.
        blocking(|| cluster.start(down));
        report(&figures);
        throughput(&cluster, runs).await;
    }
}

/// Median and worst of each scenario's figures, as BENCHMARKS.md quotes them.
fn report(figures: &BTreeMap<&str, Vec<Recovery>>) {
    let median = |mut v: Vec<Duration>| {
        v.sort();
        (v[v.len() / 2], v[v.len() - 1])
    };
    eprintln!("| event | runs | longest pause, median | worst | backlog drained, median | worst | messages |");
    for (event, runs) in figures {
        let (pause, worst_pause) = median(runs.iter().map(|r| r.pause).collect());
        let (drain, worst_drain) = median(runs.iter().map(|r| r.drain).collect());
        let messages: usize = runs.iter().map(|r| r.messages).sum();
        eprintln!(
            "| {event} | {} | {pause:.2?} | {worst_pause:.2?} | {drain:.2?} | {worst_drain:.2?} | {messages} |",
            runs.len()
        );
    }
}

/// One runner draining a backlog on the cluster (all three addresses) and on the machine's
/// single node (a vhost of its own), in turn; the messages per second of each.
async fn throughput(cluster: &Cluster, runs: usize) {
    let total = 5_000;
    let mut pairs = Vec::new();
    for _ in 0..runs {
        let single = Vhost::new();
        let on_cluster = drain_rate(&cluster.urls().join(","), total).await;
        let on_single = drain_rate(&single.url(), total).await;
        eprintln!("throughput: cluster {on_cluster:.0} msg/s, single node {on_single:.0} msg/s");
        pairs.push((on_cluster, on_single));
    }
    let mut ratios: Vec<f64> = pairs.iter().map(|(c, s)| c / s).collect();
    ratios.sort_by(f64::total_cmp);
    let mut cluster: Vec<f64> = pairs.iter().map(|(c, _)| *c).collect();
    let mut single: Vec<f64> = pairs.iter().map(|(_, s)| *s).collect();
    cluster.sort_by(f64::total_cmp);
    single.sort_by(f64::total_cmp);
    let mid = runs / 2;
    eprintln!(
        "throughput, median of {runs}: cluster {:.0} msg/s, single node {:.0} msg/s, cluster / single {:.2} (min {:.2}, max {:.2})",
        cluster[mid],
        single[mid],
        ratios[mid],
        ratios[0],
        ratios[runs - 1]
    );
}

/// Loads `total` messages with `sluice publish`, then times `sluice run --exit-when-idle`
/// calling a receiver until they are all handled.
async fn drain_rate(broker: &str, total: usize) -> f64 {
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "    concurrency: 50\n    idempotency: {enabled: false}\n");
    let name = unique("drain");
    let yaml = std::fs::read_to_string(dir.path().join("pipeline.yaml")).expect("pipeline");
    std::fs::write(dir.path().join("pipeline.yaml"), yaml.replace("work:", &format!("{name}:"))).expect("pipeline");
    let jsonl = dir.path().join("payloads.jsonl");
    std::fs::write(&jsonl, (0..total).map(|n| format!("{{\"n\": {n}}}\n")).collect::<String>()).expect("payloads");
    let mut declare = Sluice::run(dir.path(), broker, &["--exit-when-idle"]);
    assert_eq!(declare.wait(Duration::from_secs(60)), Some(0), "{}", declare.log());
    let args = ["publish", "--broker", broker, "--exchange", "ev", "--routing-key", "k", "--type", "t"];
    let mut publish = Child::spawn(&args, &["--jsonl", jsonl.to_str().expect("utf-8")]);
    assert_eq!(publish.wait(Duration::from_secs(120)), Some(0), "{}", publish.stderr());
    let started = Instant::now();
    let mut sluice = Sluice::run(dir.path(), broker, &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(300)), Some(0), "{}", sluice.log());
    let elapsed = started.elapsed();
    assert_eq!(receiver.hits().len(), total, "{}", sluice.log());
    total as f64 / elapsed.as_secs_f64()
}
