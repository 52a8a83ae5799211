//! Issue 13, "Protect the downstream", against a real RabbitMQ and the real binary: the circuit
//! breaker stops consuming while the receiver is down and loses, dead-letters or repeats
//! nothing; one bad message does not open it; `sluice pause|resume` stop and restart
//! consuming. Adaptive concurrency, whose test needs the machine to itself, is in
//! `adaptive.rs` (the `alone` binary).
//!
//! Timings are never asserted as such: counts and shares, with generous windows.

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use support::*;

/// How many requests each key's successful calls number (every key should have exactly one).
/// Publishes `n` messages keyed `m-0`, `m-1`, ... to `ev`, one every `every`, on a task.
async fn publish_steadily(vhost: &Vhost, n: usize, every: Duration) -> tokio::task::JoinHandle<()> {
    let broker = vhost.connect().await;
    tokio::spawn(async move {
        for i in 0..n {
            publish(&broker, "ev", "x", &format!("m-{i}"), serde_json::json!({"i": i})).await;
            tokio::time::sleep(every).await;
        }
    })
}

fn successes_per_key(receiver: &Receiver) -> BTreeMap<String, usize> {
    counts(receiver.hits().iter().filter(|h| h.succeeded()).map(|h| h.key().to_string()))
}

/// Issue 13: a receiver down (503) for 20 s under a steady stream of 500 messages. The breaker
/// opens; while it is open the receiver sees only probes, one at a time; nothing is
/// dead-lettered; after recovery every message succeeds exactly once and the breaker closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_opens_the_breaker_and_loses_nothing() {
    let vhost = Vhost::new();
    let down = Arc::new(AtomicBool::new(false));
    let receiver = {
        let down = down.clone();
        Receiver::start(move |_, _| if down.load(Ordering::SeqCst) { Reply::status(503) } else { Reply::ok() }).await
    };
    let dir = webhook_pipeline(
        &receiver,
        "    concurrency: 4\n    retry: {max_attempts: 10, initial: 200ms, max: 2s}\n    \
         circuit_breaker: {min_calls: 10, window: 2s, open_for: 1s}\n",
    );
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let (sluice, admin) = run_with_admin(dir.path(), &vhost.url(), "work").await;

    // 500 messages, one every 50 ms (25 s); the receiver is down from 2 s to 22 s.
    let publisher = publish_steadily(&vhost, 500, Duration::from_millis(50)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    down.store(true, Ordering::SeqCst);
    let outage = Instant::now();
    let mut opened_at = None;
    while outage.elapsed() < Duration::from_secs(20) {
        if opened_at.is_none() && gauge(&admin, "sluice_circuit_state", "work").await == Some(2.0) {
            opened_at = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    down.store(false, Ordering::SeqCst);
    let recovered = Instant::now();
    let opened_at = opened_at.expect("the breaker opened during the outage");

    let during: Vec<Instant> = receiver.hits().iter().filter(|h| h.status == 503).map(|h| h.at).collect();
    // Before it opened: as many failures as the successes still in the 2 s window, at least
    // min_calls, and what was in flight with them (concurrency 4).
    let before_open = during.iter().filter(|at| **at < opened_at).count();
    assert!((10..=50).contains(&before_open), "{before_open} calls failed before the breaker opened");
    // While open: only probes, one at a time (each at least open_for after the last verdict).
    let probes: Vec<Instant> =
        during.iter().copied().filter(|at| *at > opened_at + Duration::from_millis(200) && *at < recovered).collect();
    assert!(probes.len() <= 8, "{} calls while the breaker was open", probes.len());
    for pair in probes.windows(2) {
        assert!(pair[1] - pair[0] >= Duration::from_millis(500), "probes closer than open_for: {probes:?}");
    }

    publisher.await.expect("publisher");
    wait_until(Duration::from_secs(120), "all 500 messages handled after the recovery", || async {
        receiver.succeeded_keys().len() == 500
    })
    .await;
    let per_key = successes_per_key(&receiver);
    assert!(per_key.values().all(|n| *n == 1), "a message succeeded twice: {per_key:?}");
    wait_until(Duration::from_secs(30), "the breaker closed", || async {
        gauge(&admin, "sluice_circuit_state", "work").await == Some(0.0)
    })
    .await;
    assert_eq!(vhost.depth("work.dlq").await, 0, "dead-lettered during the outage");
    let log = sluice.log();
    assert!(log.contains("circuit breaker opened"), "{log}");
    assert!(log.contains("circuit breaker closed"), "{log}");
    assert!(!log.contains("dead-lettered"), "{log}");
}

/// Issue 13: a 4xx for one bad message says nothing about the receiver. Even a breaker that
/// opens on the first unwell call stays closed; the message is dead-lettered alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bad_message_does_not_open_the_breaker() {
    let vhost = Vhost::new();
    let receiver = Receiver::start(|hit, _| Reply::status(if hit.key() == "bad" { 422 } else { 200 })).await;
    let dir = webhook_pipeline(&receiver, "    circuit_breaker: {failure_rate: 1%, min_calls: 1}\n");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let (sluice, admin) = run_with_admin(dir.path(), &vhost.url(), "work").await;
    for i in 0..20 {
        let key = if i == 10 { "bad".to_string() } else { format!("good-{i}") };
        publish(&broker, "ev", "x", &key, serde_json::json!({})).await;
    }
    let states = std::sync::Mutex::new(Vec::new());
    wait_until(Duration::from_secs(30), "19 successes and the bad message dead-lettered", || async {
        let state = gauge(&admin, "sluice_circuit_state", "work").await;
        states.lock().expect("states").push(state);
        receiver.succeeded_keys().len() == 19 && vhost.depth("work.dlq").await == 1
    })
    .await;
    let states = states.into_inner().expect("states");
    assert!(states.iter().all(|s| *s == Some(0.0)), "{states:?}");
    assert_eq!(receiver.hits_for("bad").len(), 1);
    assert!(!sluice.log().contains("circuit breaker opened"), "{}", sluice.log());
}

/// Issue 13: `sluice pause` while messages flow stops consumption (a reload meanwhile keeps it
/// paused, and status says so); `sluice resume` handles everything, each message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_by_cli_while_messages_flow() {
    let vhost = Vhost::new();
    let receiver = Receiver::start(|_, _| Reply::ok().after(Duration::from_millis(10))).await;
    let dir = webhook_pipeline(&receiver, "    concurrency: 4\n");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let (sluice, admin) = run_with_admin(dir.path(), &vhost.url(), "work").await;
    let publisher = publish_steadily(&vhost, 300, Duration::from_millis(20)).await;
    receiver.wait_for(50, Duration::from_secs(30)).await;
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(0.0));
    let paused = sluice_cli(&["pause", "work", "--admin", &admin], &[], Duration::from_secs(30));
    assert_eq!(paused.code, Some(0), "{paused:?}");
    assert!(paused.stdout.contains("paused \"work\""), "{paused:?}");

    // In-flight calls finish; then nothing, through a reload that restarts the queue's worker
    // (its concurrency changed) too.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let seen = receiver.hits().len();
    let file = dir.path().join("pipeline.yaml");
    let changed = std::fs::read_to_string(&file).expect("read pipeline").replace("concurrency: 4", "concurrency: 5");
    std::fs::write(&file, changed).expect("write pipeline");
    sluice.signal(libc::SIGHUP);
    wait_until(Duration::from_secs(30), "the reload applied, work changed", || async {
        sluice.log().contains("changed=work")
    })
    .await;
    let dir_arg = dir.path().to_str().expect("utf-8 path");
    let url = vhost.url();
    let status = sluice_cli(
        &["status", dir_arg, "--broker", &url, "--admin", &admin, "--format", "json"],
        &[],
        Duration::from_secs(30),
    );
    let json: serde_json::Value = serde_json::from_str(&status.stdout).unwrap_or_else(|e| panic!("{e}: {status:?}"));
    assert_eq!(json["queues"][0]["paused"], true, "{json}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(receiver.hits().len(), seen, "requests while paused");
    assert!(vhost.depth("work").await > 0, "messages wait on the broker");
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(1.0));

    let unknown = sluice_cli(&["pause", "nope", "--admin", &admin], &[], Duration::from_secs(30));
    assert_eq!(unknown.code, Some(1), "{unknown:?}");
    assert!(unknown.stderr.contains("no queue \"nope\" is running here"), "{unknown:?}");

    let resumed = sluice_cli(&["resume", "work", "--admin", &admin], &[], Duration::from_secs(30));
    assert_eq!(resumed.code, Some(0), "{resumed:?}");
    publisher.await.expect("publisher");
    wait_until(Duration::from_secs(60), "all 300 handled after resume", || async {
        receiver.succeeded_keys().len() == 300
    })
    .await;
    let per_key = successes_per_key(&receiver);
    assert!(per_key.values().all(|n| *n == 1), "a message handled twice: {per_key:?}");
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(0.0));
    assert_eq!(vhost.depth("work.dlq").await, 0);
}
