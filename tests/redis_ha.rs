//! Issue 37: sluice on a Redis Sentinel set and on a Redis Cluster of the test's own
//! (tests/support/redis_ha.rs): a real `sluice run` under a steady confirmed stream, the
//! primary (of the queue's slot, on a cluster) killed with `kill -9`. Each
//! scenario counts, by idempotency key, what reached the receiver: no key handled twice, the
//! confirmed messages lost (replication is asynchronous: a write the dead primary confirmed
//! before a replica had it is gone; none with `?wait=1`), and the longest pause between two
//! webhook calls, printed (never asserted: timings are the machine's).
//!
//! A binary of its own (`cargo test --test redis_ha`), which `.ci/run` runs beside the suite:
//! it waits on failovers, not on the cores.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[macro_use]
mod support;

use crate::support::redis_ha::{RedisCluster, SentinelSet, Server};
use crate::support::stream::{Outcome, Stream, longest_pause};
use crate::support::*;
use sluice::broker::redis::Redis;
use sluice::broker::{Broker as _, Publish as _};

/// Waits until every confirmed key was handled, or the runner handled nothing new for 15 s
/// with the queue empty (what is still missing then is lost); counts what it finds.
async fn outcome(
    receiver: &Receiver,
    confirmed: &BTreeMap<String, Instant>,
    from: Instant,
    url: &str,
    sluice: &Sluice,
) -> Outcome {
    let (mut last, mut seen) = (Instant::now(), 0);
    let start = Instant::now();
    loop {
        let handled = receiver.succeeded_keys();
        let missing = confirmed.keys().filter(|k| !handled.contains(*k)).count();
        if missing == 0 {
            break;
        }
        if handled.len() != seen {
            (last, seen) = (Instant::now(), handled.len());
        } else if last.elapsed() > Duration::from_secs(15) {
            let broker = Redis::connect(url).await.expect("connect to the deployment");
            let stats = broker.stats("work").await.expect("stats");
            broker.close().await;
            if stats.ready == 0 {
                break;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "{missing} confirmed key(s) never handled; log:\n{}",
            sluice.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Outcome::count(receiver, confirmed, from)
}

/// A deployment whose primary a test kills.
trait Primaries {
    /// What `--broker` takes, without sluice's parameters.
    fn url(&self) -> String;
    /// The primary that holds the queue `work` (prefix `t:`), once the deployment agrees on a
    /// live one.
    fn primary(&self) -> u16;
    fn node(&mut self, port: u16) -> &mut Server;
}

impl Primaries for SentinelSet {
    fn url(&self) -> String {
        SentinelSet::url(self)
    }

    fn primary(&self) -> u16 {
        SentinelSet::primary(self)
    }

    fn node(&mut self, port: u16) -> &mut Server {
        SentinelSet::node(self, port)
    }
}

impl Primaries for RedisCluster {
    fn url(&self) -> String {
        RedisCluster::url(self)
    }

    fn primary(&self) -> u16 {
        self.wait_ready();
        self.primary_of("t:s:{work}")
    }

    fn node(&mut self, port: u16) -> &mut Server {
        RedisCluster::node(self, port)
    }
}

/// A runner on `deployment` (`params` added to its URL), a steady stream of 100/s, and the
/// queue's primary killed with `kill -9` once the runner consumes: a replica is promoted (by
/// the sentinels, or the cluster), the runner and the publisher find it, and never run a script
/// on the old primary started again (empty: through Sentinels a standalone primary for a
/// while; in a cluster, a replica of the new one).
async fn kill_the_primary(mut deployment: impl Primaries, params: &str) -> Outcome {
    let url = format!("{}?prefix=t:&lease=5s{params}", deployment.url());
    let receiver = Receiver::ok().await;
    let dir = idempotent_pipeline(&receiver, 8);
    let broker = Redis::connect(&url).await.expect("connect to the deployment");
    declare(dir.path(), &broker).await;
    broker.close().await;
    let sluice = Sluice::run(dir.path(), &url, &[]);
    let stream = Stream::start(|u| async move { Redis::connect(&u).await }, url.clone(), "k", 100);
    let start = Instant::now();
    while receiver.succeeded_keys().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(60), "nothing handled; log:\n{}", sluice.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let primary = tokio::task::block_in_place(|| deployment.primary());
    let killed_at = Instant::now();
    deployment.node(primary).kill();
    let promoted = tokio::task::block_in_place(|| deployment.primary());
    let failover = killed_at.elapsed();
    assert_ne!(promoted, primary, "the killed primary is still named");
    // The old primary comes back empty (a replica again for `?wait=1`); the stream goes on.
    tokio::task::block_in_place(|| deployment.node(primary).restart());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stats = deployment.node(primary).info("commandstats");
    let ran = stats.get("cmdstat_evalsha").is_some_and(|s| !s.starts_with("calls=0,"));
    assert!(!ran, "sluice ran scripts on the restarted old primary ({stats:?}); log:\n{}", sluice.log());
    stream.confirmed_after(Instant::now(), 100).await;
    let confirmed = stream.stop().await;
    let outcome = outcome(&receiver, &confirmed, killed_at, &url, &sluice).await;
    let Outcome { confirmed, lost, twice, pause, .. } = &outcome;
    eprintln!(
        "kill -9 of the primary {primary} ({params:?}): {promoted} took over after {failover:?}; {confirmed} confirmed, {lost} lost, {twice} handled twice, longest pause between webhook calls {pause:?}"
    );
    assert_eq!(outcome.twice, 0, "keys handled twice; log:\n{}", sluice.log());
    outcome
}

/// Without `?wait=`: the failover is followed; what the dead primary confirmed and no replica
/// had is lost, counted and printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_under_a_steady_stream() {
    kill_the_primary(tokio::task::block_in_place(SentinelSet::start), "").await;
}

/// With `?wait=1`, a publish and an ack count as done once a replica has them: nothing
/// confirmed is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_with_wait_loses_nothing() {
    let outcome = kill_the_primary(tokio::task::block_in_place(SentinelSet::start), "&wait=1").await;
    assert_eq!(outcome.lost, 0, "{outcome:?}");
}

/// `?wait=1` on a server with no replica: a publish fails (to be retried) after the wait, saying
/// why, and is not counted done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_without_a_replica_fails_the_publish() {
    let place = RedisPrefix::with("&wait=1");
    let dir = work_pipeline("    handler: {command: {program: /bin/true}}\n");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let message = sluice::broker::Outgoing { body: b"{}".to_vec(), ..Default::default() };
    let refused = broker.publish("ev", "k", message).await.expect_err("no replica has it");
    assert!(refused.is_session_loss(), "retried as a lost session: {refused:?}");
    assert!(refused.to_string().contains("0 replica(s) had a write"), "{refused}");
    broker.close().await;
}

/// `sluice plan --broker redis+sentinel://…` (given as `--broker` splits it, at its commas)
/// reads the primary the sentinels name, and says that replication is asynchronous; with
/// `?wait=1`, that writes wait for a replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_through_the_sentinels_says_how_writes_are_replicated() {
    let set = tokio::task::block_in_place(SentinelSet::start);
    let dir = work_pipeline("    handler: {command: {program: /bin/true}}\n");
    let dir_arg = dir.path().to_str().expect("utf-8");
    for (params, says) in [("", "replication asynchronous"), ("&wait=1", "wait for 1 replica(s)")] {
        let url = format!("{}?prefix=p:{params}", set.url());
        let done = broker_cli(&["plan", dir_arg], &url).await;
        assert_eq!(done.code, Some(0), "{}", done.stderr);
        assert!(done.stdout.contains("stream = \"p:s:work\""), "{}", done.stdout);
        assert!(done.stdout.contains(says), "{params}: {}", done.stdout);
    }
}

/// A first sentinel that takes connections and never answers (a hung host) holds no session
/// back for good: the attempt gives up, and the next one starts with the next sentinel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_that_never_answers_is_passed_over() {
    let set = tokio::task::block_in_place(SentinelSet::start);
    let hung = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = hung.local_addr().expect("addr").port();
    let url = set.url().replacen("redis+sentinel://", &format!("redis+sentinel://127.0.0.1:{port},"), 1);
    let start = Instant::now();
    let broker = Redis::connect(&format!("{url}?prefix=h:")).await.expect("a session through the next sentinel");
    eprintln!("a session through the second sentinel after {:?}", start.elapsed());
    broker.close().await;
}

/// Without `?wait=`: the slot's new primary is followed; what the dead primary confirmed and
/// its replica did not have is lost, counted and printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_under_a_steady_stream() {
    kill_the_primary(tokio::task::block_in_place(RedisCluster::start), "").await;
}

/// With `?wait=1`: nothing confirmed is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_with_wait_loses_nothing() {
    let outcome = kill_the_primary(tokio::task::block_in_place(RedisCluster::start), "&wait=1").await;
    assert_eq!(outcome.lost, 0, "{outcome:?}");
}

/// Three queues (spread with their dead-letter queues over the three primaries), each with a
/// stream of its own; the primary of one alone on it killed: its queue waits for the failover,
/// and the other two are handled all along (each handles messages published after the kill
/// before the slot has its new primary).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_lost_pauses_only_its_own_queues() {
    let mut cluster = tokio::task::block_in_place(RedisCluster::start);
    let url = format!("{}?prefix=t:&lease=5s", cluster.url());
    let receiver = Receiver::ok().await;
    let queues: String = ["q0", "q1", "q2"]
        .iter()
        .map(|q| {
            format!(
                "  {q}:\n    bind: [{{exchange: ev, routing_key: {q}}}]\n    concurrency: 4\n    idempotency: {{ttl: 1h}}\n    handler:\n      webhook: {{url: \"{}/{q}\"}}\n",
                receiver.uri()
            )
        })
        .collect();
    let dir = pipeline(&format!("version: 1\nexchanges:\n  ev: {{type: direct}}\nqueues:\n{queues}"));
    let broker = Redis::connect(&url).await.expect("connect to the cluster");
    declare(dir.path(), &broker).await;
    broker.close().await;
    let plan = broker_cli(&["plan", dir.path().to_str().expect("utf-8")], &url).await;
    // The victim: a queue alone on its primary among the three (the six queues with their
    // dead-letter queues go two to a primary).
    let placed = placements(&plan.stdout);
    let mut names: Vec<(String, (u16, String))> =
        ["q0", "q1", "q2"].iter().map(|q| (q.to_string(), placed[*q].clone())).collect();
    let alone = |(_, (port, _)): &(String, (u16, String)), all: &[(String, (u16, String))]| {
        all.iter().filter(|(_, (p, _))| p == port).count() == 1
    };
    let victim_at = names.iter().position(|n| alone(n, &names)).expect("a queue alone on its primary");
    names.swap(0, victim_at);
    let sluice = Sluice::run(dir.path(), &url, &[]);
    let streams: Vec<Stream> = names
        .iter()
        .map(|(q, _)| Stream::start_to(|u| async move { Redis::connect(&u).await }, url.clone(), (q, q), 50))
        .collect();
    let handled = |q: &str, after: Instant| {
        receiver.hits().iter().filter(|h| h.target == format!("/{q}") && h.succeeded() && h.at > after).count()
    };
    wait_until(Duration::from_secs(60), "every queue handles messages", || async {
        names.iter().all(|(q, _)| handled(q, Instant::now() - Duration::from_secs(60)) > 0)
    })
    .await;
    let (victim, (primary, stream)) = names[0].clone();
    let killed_at = Instant::now();
    cluster.node(primary).kill();
    // While the slot has no primary, the other queues are handled.
    let mut promoted = None;
    while promoted.is_none() {
        let now = tokio::task::block_in_place(|| cluster.primary_of(&stream));
        promoted = (now != primary).then_some(now);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let failover = killed_at.elapsed();
    for (q, _) in &names[1..] {
        let during = handled(q, killed_at);
        assert!(during > 0, "{q} handled nothing during the failover of {victim}'s primary; log:\n{}", sluice.log());
    }
    tokio::task::block_in_place(|| cluster.wait_ready());
    for s in &streams {
        s.confirmed_after(Instant::now(), 50).await;
    }
    let mut confirmed = BTreeMap::new();
    for s in streams {
        confirmed.extend(s.stop().await);
    }
    wait_until(Duration::from_secs(120), "every confirmed key handled", || async {
        let handled = receiver.succeeded_keys();
        confirmed.keys().all(|k| handled.contains(k))
    })
    .await;
    let hits = receiver.hits();
    let pauses: Vec<(String, Duration)> = names
        .iter()
        .map(|(q, _)| {
            let at = hits.iter().filter(|h| h.target == format!("/{q}")).map(|h| h.at);
            (q.clone(), longest_pause(at, killed_at))
        })
        .collect();
    let twice = Outcome::count(&receiver, &confirmed, killed_at).twice;
    eprintln!(
        "kill -9 of {victim}'s primary {primary}: a new primary after {failover:?}; longest pause between webhook calls per queue: {pauses:?}; {twice} handled twice"
    );
    assert_eq!(twice, 0, "keys handled twice; log:\n{}", sluice.log());
}

/// What a runner asks of its server, it asks of every primary of a cluster: one primary whose
/// policy evicts is refused, named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_primary_that_evicts_is_refused_by_name() {
    let cluster = tokio::task::block_in_place(RedisCluster::start);
    let evicting = cluster.primaries()[1];
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query(&mut cluster.nodes.iter().find(|n| n.port == evicting).expect("the primary").raw())
        .expect("CONFIG SET");
    let url = format!("{}?prefix=e:", cluster.url());
    let checks = sluice::broker::redis::Checks::new(sluice::broker::redis::Purpose::Run, false);
    let refused = Redis::open(&url, &checks).await.err().expect("an evicting primary is refused");
    let said = refused.to_string();
    assert!(said.contains("maxmemory-policy allkeys-lru"), "{said}");
    assert!(said.contains(&format!("node 127.0.0.1:{evicting}")), "names the node: {said}");
}

/// The queue's slot moved to another primary while a steady stream runs (`CLUSTER SETSLOT`
/// IMPORTING and MIGRATING, its keys moved with `MIGRATE`, then the slot given to the new
/// node), as `redis-cli --cluster reshard` does: the runner and the publisher follow it
/// (`ASK`, then `MOVED`); nothing confirmed is lost, nothing handled twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_whose_slot_moves_is_followed() {
    let cluster = tokio::task::block_in_place(RedisCluster::start);
    let url = format!("{}?prefix=t:&lease=5s", cluster.url());
    let receiver = Receiver::ok().await;
    let dir = idempotent_pipeline(&receiver, 8);
    let broker = Redis::connect(&url).await.expect("connect to the cluster");
    declare(dir.path(), &broker).await;
    broker.close().await;
    let sluice = Sluice::run(dir.path(), &url, &[]);
    let stream = Stream::start(|u| async move { Redis::connect(&u).await }, url.clone(), "k", 100);
    wait_until(Duration::from_secs(60), "messages handled", || async { !receiver.succeeded_keys().is_empty() }).await;
    let from = cluster.primary_of("t:s:{work}");
    let to = *cluster.primaries().iter().find(|p| **p != from).expect("another primary");
    let moved_at = Instant::now();
    tokio::task::block_in_place(|| {
        let node = |port: u16| cluster.nodes.iter().find(|n| n.port == port).expect("a node").raw();
        let id = |port: u16| -> String { redis::cmd("CLUSTER").arg("MYID").query(&mut node(port)).expect("MYID") };
        let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg("t:s:{work}").query(&mut node(from)).expect("KEYSLOT");
        let (from_id, to_id) = (id(from), id(to));
        let setslot = |port: u16, how: &[&str]| {
            let _: () =
                redis::cmd("CLUSTER").arg("SETSLOT").arg(slot).arg(how).query(&mut node(port)).expect("SETSLOT");
        };
        setslot(to, &["IMPORTING", &from_id]);
        setslot(from, &["MIGRATING", &to_id]);
        loop {
            let keys: Vec<String> =
                redis::cmd("CLUSTER").arg("GETKEYSINSLOT").arg(slot).arg(100).query(&mut node(from)).expect("keys");
            if keys.is_empty() {
                break;
            }
            let _: () = redis::cmd("MIGRATE")
                .arg(&["127.0.0.1", &to.to_string(), "", "0", "5000", "KEYS"][..])
                .arg(&keys)
                .query(&mut node(from))
                .expect("MIGRATE");
        }
        for port in cluster.primaries() {
            setslot(port, &["NODE", &to_id]);
        }
    });
    let moved = moved_at.elapsed();
    assert_eq!(cluster.primary_of("t:s:{work}"), to, "the slot is on its new primary");
    stream.confirmed_after(Instant::now(), 200).await;
    let confirmed = stream.stop().await;
    let outcome = outcome(&receiver, &confirmed, moved_at, &url, &sluice).await;
    let Outcome { confirmed, lost, twice, pause, .. } = &outcome;
    eprintln!(
        "the queue's slot moved from {from} to {to} in {moved:?}; {confirmed} confirmed, {lost} lost, {twice} handled twice, longest pause between webhook calls {pause:?}"
    );
    assert_eq!((outcome.lost, outcome.twice), (0, 0), "{outcome:?}; log:\n{}", sluice.log());
}

/// Six queues (and their dead-letter queues) declared on a cluster of three primaries go four
/// to each, whatever their names'
/// slots: a queue whose name's primary holds more than another gets a hash tag of its own
/// (`plan --broker` names each queue's node), and every process names its keys alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_spread_evenly_over_the_primaries() {
    let cluster = tokio::task::block_in_place(RedisCluster::start);
    let url = format!("{}?prefix=s:", cluster.url());
    let queues: String = (0..6)
        .map(|n| format!("  q{n}:\n    bind: [{{exchange: ev, routing_key: q{n}}}]\n    handler: {{command: {{program: /bin/true}}}}\n"))
        .collect();
    let dir = pipeline(&format!("version: 1\nexchanges:\n  ev: {{type: direct}}\nqueues:\n{queues}"));
    let broker = Redis::connect(&url).await.expect("connect to the cluster");
    declare(dir.path(), &broker).await;
    broker.close().await;
    let plan = broker_cli(&["plan", dir.path().to_str().expect("utf-8")], &url).await;
    let per_node = counts(placements(&plan.stdout).into_values().map(|(port, _)| port.to_string()));
    // Twelve queues: six and their dead-letter queues.
    assert_eq!(per_node.values().copied().collect::<Vec<_>>(), [4, 4, 4], "{per_node:?}; {}", plan.stdout);
    // Another process publishes to each queue by its tag: every message is where the runner looks.
    let dir_arg = dir.path().to_str().expect("utf-8");
    for n in 0..6 {
        let published = broker_cli(
            &["publish", "--exchange", "ev", "--routing-key", &format!("q{n}"), "--type", "t", "--payload", "{}"],
            &url,
        )
        .await;
        assert_eq!(published.code, Some(0), "{}", published.stderr);
    }
    let status = broker_cli(&["status", dir_arg], &url).await;
    assert_eq!(status.code, Some(0), "{}", status.stderr);
    for n in 0..6 {
        assert!(
            status.stdout.lines().any(|l| l.split_whitespace().take(2).eq([format!("q{n}").as_str(), "1"])),
            "q{n} holds its message: {}",
            status.stdout
        );
    }
}

/// What `plan --broker redis+cluster://…` says of each queue: the port of its node, and its
/// stream's key.
fn placements(plan: &str) -> BTreeMap<String, (u16, String)> {
    plan.lines()
        .skip_while(|l| !l.contains("each queue's node"))
        .skip(1)
        .map_while(|l| {
            // `    QUEUE: 127.0.0.1:PORT, stream "KEY"`
            let (queue, rest) = l.trim().split_once(": ")?;
            let (node, stream) = rest.split_once(", stream ")?;
            let port = node.rsplit_once(':')?.1.parse().ok()?;
            Some((queue.to_string(), (port, stream.trim_matches('"').to_string())))
        })
        .collect()
}
