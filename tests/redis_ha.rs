//! Issue 37: sluice on a Redis Sentinel set of the test's own (tests/support/redis_ha.rs): a
//! real `sluice run` under a steady confirmed stream, the primary killed with `kill -9`. Each
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

use crate::support::redis_ha::SentinelSet;
use crate::support::stream::{Outcome, Stream};
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
            let broker = Redis::connect(url).await.expect("connect through the sentinels");
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

/// A runner on a Sentinel set (`params` added to its URL), a steady stream of 100/s, and the
/// primary killed with `kill -9` once the runner consumes: the sentinels promote a replica, the
/// runner and the publisher find it through them, and never run a script on the old primary
/// started again (empty, a standalone primary for a while).
async fn kill_the_primary(params: &str) -> Outcome {
    let mut set = tokio::task::block_in_place(SentinelSet::start);
    let url = format!("{}?prefix=t:&lease=5s{params}", set.url());
    let receiver = Receiver::ok().await;
    let dir = idempotent_pipeline(&receiver, 8);
    let broker = Redis::connect(&url).await.expect("connect through the sentinels");
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
    let primary = tokio::task::block_in_place(|| set.primary());
    let killed_at = Instant::now();
    set.node(primary).kill();
    let promoted = tokio::task::block_in_place(|| set.primary());
    let failover = killed_at.elapsed();
    assert_ne!(promoted, primary, "the sentinels still name the killed primary");
    // The old primary comes back empty, a standalone primary until the sentinels make it a
    // replica of the new one; the stream goes on for a while.
    tokio::task::block_in_place(|| set.node(primary).restart());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ran = set.node(primary).info("commandstats").into_keys().filter(|k| k.starts_with("cmdstat_evalsha")).count();
    assert_eq!(ran, 0, "sluice ran scripts on the restarted old primary; log:\n{}", sluice.log());
    let confirmed = stream.stop().await;
    let outcome = outcome(&receiver, &confirmed, killed_at, &url, &sluice).await;
    let Outcome { confirmed, lost, twice, pause, .. } = &outcome;
    eprintln!(
        "kill -9 of the primary {primary} ({params:?}): the sentinels named {promoted} after {failover:?}; {confirmed} confirmed, {lost} lost, {twice} handled twice, longest pause between webhook calls {pause:?}"
    );
    assert_eq!(outcome.twice, 0, "keys handled twice; log:\n{}", sluice.log());
    outcome
}

/// Without `?wait=`: the failover is followed; what the dead primary confirmed and no replica
/// had is lost, counted and printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_under_a_steady_stream() {
    kill_the_primary("").await;
}

/// With `?wait=1`, a publish and an ack count as done once a replica has them: nothing
/// confirmed is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_with_wait_loses_nothing() {
    let outcome = kill_the_primary("&wait=1").await;
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
