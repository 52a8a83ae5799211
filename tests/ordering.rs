//! Issue 34 part 2, per-key ordering end to end on every broker (SQS's FIFO queues in
//! `sqs_broker.rs`): an `order_by` queue hands the
//! receiver each key's messages in publish order, a failed first attempt retried before the
//! key's next message, while keys run in parallel; a poison message releases its key, or
//! holds it until it is redriven; on RabbitMQ, a standby runner takes over a killed one in key
//! order.

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sluice::broker::Broker as _;
use support::{Place, Receiver, Reply, Sluice, broker_cli};

/// A queue `work` ordered by the payload's `k`, calling `receiver`, with `extra` YAML.
fn pipeline(receiver: &Receiver, extra: &str) -> tempfile::TempDir {
    support::webhook_pipeline(
        receiver,
        &format!(
            "    order_by: \"{{{{payload.k}}}}\"\n    retry: {{max_attempts: 5, initial: 50ms, max: 200ms}}\n    circuit_breaker: {{enabled: false}}\n{extra}"
        ),
    )
}

/// The key and number of a hit, from its idempotency key `k-n`.
fn key_and_n(hit: &support::Hit) -> (String, usize) {
    let (k, n) = hit.key().rsplit_once('-').unwrap_or_else(|| panic!("a key k-n: {}", hit.key()));
    (k.to_string(), n.parse().unwrap_or_else(|_| panic!("a number: {n}")))
}

async fn keys_in_publish_order_under_retries<P: Place>(place: P) {
    keys_in_publish_order_under_retries_on(place, 20, 1).await;
}

/// 20 keys of `each` messages, published before `runners` runners start (concurrency 8
/// each), a receiver failing one first attempt in five: per key, every call in publish order.
pub async fn keys_in_publish_order_under_retries_on<P: Place>(place: P, each: usize, runners: usize) {
    const KEYS: usize = 20;
    // One message in five fails its first attempt.
    let receiver = Receiver::start(|hit, earlier| {
        let (_, n) = key_and_n(hit);
        match n % 5 == 2 && earlier == 0 {
            true => Reply::status(503),
            false => Reply::ok().after(Duration::from_millis(5)),
        }
    })
    .await;
    let dir = pipeline(&receiver, "    concurrency: 8\n");
    if support::refused_without_single_active_consumer(&place, dir.path(), "order_by").await {
        return;
    }
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    for n in 0..each {
        for k in 0..KEYS {
            support::publish(&broker, "ev", "order", &format!("c{k}-{n}"), serde_json::json!({"k": k})).await;
        }
    }
    let mut started: Vec<Sluice> = (0..runners).map(|_| Sluice::run(dir.path(), &place.url(), &[])).collect();
    let total = KEYS * each;
    support::wait_until(Duration::from_secs(120), "every message handled", || async {
        receiver.succeeded_keys().len() == total
    })
    .await;
    // Per key, every call (retries included) in publish order: no message started before the
    // one before it was settled.
    let mut calls = BTreeMap::<String, Vec<usize>>::new();
    for hit in receiver.hits() {
        let (k, n) = key_and_n(&hit);
        calls.entry(k).or_default().push(n);
    }
    for (k, ns) in &calls {
        assert!(ns.is_sorted(), "{k}'s calls out of order: {ns:?}");
        let mut firsts = ns.clone();
        firsts.dedup();
        assert_eq!(firsts, (0..each).collect::<Vec<_>>(), "{k}'s successes");
    }
    assert_eq!(calls.len(), KEYS, "every key called");
    let failed = KEYS * (0..each).filter(|n| n % 5 == 2).count();
    assert_eq!(receiver.hits().len(), total + failed, "each failed first attempt retried once");
    assert!(receiver.max_in_flight() > 1, "the keys never ran in parallel");
    let most = 8 * runners;
    assert!(receiver.max_in_flight() <= most, "over the concurrency: {}", receiver.max_in_flight());
    for runner in &mut started {
        assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
    }
    assert_eq!((place.depth("work").await, place.depth("work.dlq").await), (0, 0));
    broker.close().await;
}

on_every_broker!(keys_in_publish_order_under_retries);

/// A poison message `a-0` (refused with 400 until mended) before `a-1`, and key `b`'s
/// messages after them: with `release`, `a-1` runs; with `hold` it waits until `a-0` is
/// redriven, then runs after it.
async fn a_poison_message_releases_or_holds_its_key<P: Place>(place: P, hold: bool) {
    let mended = Arc::new(AtomicBool::new(false));
    let flag = mended.clone();
    let receiver = Receiver::start(move |hit, _| match hit.key() == "a-0" && !flag.load(Ordering::SeqCst) {
        true => Reply::status(400),
        false => Reply::ok(),
    })
    .await;
    let extra = if hold { "    on_dead_letter: hold\n" } else { "" };
    let dir = pipeline(&receiver, extra);
    if support::refused_without_single_active_consumer(&place, dir.path(), "order_by").await {
        return;
    }
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    for (key, k) in [("a-0", "a"), ("a-1", "a"), ("b-0", "b"), ("b-1", "b"), ("b-2", "b")] {
        support::publish(&broker, "ev", "order", key, serde_json::json!({"k": k})).await;
    }
    let (mut runner, admin) = support::run_with_admin(dir.path(), &place.url(), "work").await;
    support::wait_until(Duration::from_secs(60), "the poison dead-lettered and b handled", || async {
        place.depth("work.dlq").await == 1
            && ["b-0", "b-1", "b-2"].iter().all(|k| receiver.succeeded_keys().contains(*k))
    })
    .await;
    if !hold {
        support::wait_until(Duration::from_secs(60), "a's next message handled", || async {
            receiver.succeeded_keys().contains("a-1")
        })
        .await;
    } else {
        // b's messages came after a's: a-1 was delivered before them, and held.
        assert!(receiver.hits_for("a-1").is_empty(), "a-1 ran while its key was held");
        support::wait_until(Duration::from_secs(30), "the held key counted as blocked", || async {
            support::gauge(&admin, "sluice_keys_blocked", "work").await == Some(1.0)
        })
        .await;
        mended.store(true, Ordering::SeqCst);
        let d = dir.path().to_str().expect("utf-8 path");
        let redriven = broker_cli(&["dlq", "redrive", "work", "--pipelines", d], &place.url()).await;
        assert_eq!(redriven.code, Some(0), "{}", redriven.stderr);
        support::wait_until(Duration::from_secs(60), "the redriven a-0, then a-1", || async {
            receiver.succeeded_keys().contains("a-1")
        })
        .await;
        let a: Vec<String> =
            receiver.hits().iter().filter(|h| h.key().starts_with("a-")).map(|h| h.key().to_string()).collect();
        assert_eq!(a, ["a-0", "a-0", "a-1"], "the redriven poison before a's next");
        assert_eq!(support::gauge(&admin, "sluice_keys_blocked", "work").await, Some(0.0), "no key blocked any more");
    }
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
    assert_eq!(place.depth("work").await, 0);
    broker.close().await;
}

pub async fn a_poison_message_releases_its_key<P: Place>(place: P) {
    a_poison_message_releases_or_holds_its_key(place, false).await;
}

pub async fn a_poison_message_holds_its_key_until_redriven<P: Place>(place: P) {
    a_poison_message_releases_or_holds_its_key(place, true).await;
}

on_every_broker!(a_poison_message_releases_its_key, a_poison_message_holds_its_key_until_redriven);

/// Issue 34: two runners on RabbitMQ, the active one killed (`kill -9`) mid-stream: the
/// standby takes over, and for every key the receiver still sees its messages' first
/// successes in publish order. The two runners share the idempotency store: the killed one,
/// not yet reaped by the test (a zombie), holds none of its keys (the standby found them busy
/// for over a minute before zombies counted as ended).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_over_a_killed_runner_in_key_order() {
    const KEYS: usize = 10;
    const EACH: usize = 20;
    let place = support::Vhost::new();
    let receiver = Receiver::start(|hit, earlier| {
        let (_, n) = key_and_n(hit);
        match n % 5 == 2 && earlier == 0 {
            true => Reply::status(503),
            false => Reply::ok().after(Duration::from_millis(20)),
        }
    })
    .await;
    let dir = pipeline(&receiver, "    concurrency: 4\n");
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    for n in 0..EACH {
        for k in 0..KEYS {
            support::publish(&broker, "ev", "order", &format!("c{k}-{n}"), serde_json::json!({"k": k})).await;
        }
    }
    let active = Sluice::run(dir.path(), &place.url(), &[]);
    support::wait_until(Duration::from_secs(60), "the first runner consuming", || async {
        !receiver.succeeded_keys().is_empty()
    })
    .await;
    let mut standby = Sluice::run(dir.path(), &place.url(), &[]);
    support::wait_until(Duration::from_secs(60), "the standby attached", || async {
        standby.log().contains("consuming")
    })
    .await;
    support::wait_until(Duration::from_secs(60), "a third handled", || async {
        receiver.succeeded_keys().len() >= KEYS * EACH / 3
    })
    .await;
    assert!(receiver.succeeded_keys().len() < KEYS * EACH, "all handled before the kill");
    active.signal(libc::SIGKILL);
    support::wait_until(Duration::from_secs(120), "every message handled by the standby", || async {
        receiver.succeeded_keys().len() == KEYS * EACH
    })
    .await;
    let mut firsts = BTreeMap::<String, Vec<usize>>::new();
    for hit in receiver.hits().iter().filter(|h| h.succeeded()) {
        let (k, n) = key_and_n(hit);
        let seen = firsts.entry(k).or_default();
        if !seen.contains(&n) {
            seen.push(n);
        }
    }
    for (k, ns) in &firsts {
        assert_eq!(ns, &(0..EACH).collect::<Vec<_>>(), "{k}'s first successes");
    }
    assert_eq!(standby.stop(Duration::from_secs(30)), Some(0), "{}", standby.log());
    broker.close().await;
}
