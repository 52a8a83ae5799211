//! The NATS JetStream broker (issue 35) on the machine's nats-server: `plan --broker nats://…`,
//! several seed servers in one `--broker` value, a fan-out with one queue's runner down for a
//! minute, and a publish retried after a timeout. The trait's rules are checked by the
//! conformance matrix, real processes killed and sharing a deployment by `leased`, and the
//! shared end-to-end bodies run on it through `on_every_broker!`.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use sluice::broker::Broker as _;
use support::*;

/// `sluice plan --broker nats://…` shows each queue's stream and what the broker refuses.
#[test]
fn plan_shows_the_streams() {
    let place = NatsPrefix::new();
    let dir = pipeline(
        "version: 1\nexchanges: {ev: {type: topic}}\nqueues:\n  a: {handler: {command: {program: /bin/true}}, bind: [{exchange: ev, routing_key: \"a.#\"}], max_length: 2}\n",
    );
    let dir_arg = dir.path().to_str().expect("utf-8");
    let done = sluice_cli(&["plan", dir_arg, "--broker", &place.url()], &[], Duration::from_secs(30));
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    let prefix = &place.prefix;
    assert!(done.stdout.starts_with(&format!("the JetStream broker, names under \"{prefix}\"")), "{}", done.stdout);
    let a = format!("  a\n    stream = \"{prefix}_q_61\" on \"{prefix}.q.61\"\n");
    assert!(done.stdout.contains(&a), "{}", done.stdout);
    assert!(done.stdout.contains("max_length = 2"), "{}", done.stdout);
}

/// Several seed servers in one `--broker` value (which the command line splits at the commas):
/// one refusing connections, the machine's server beside it. The publish reaches the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_seed_servers_in_one_broker_value() {
    let place = NatsPrefix::new();
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let seeds = format!("nats://127.0.0.1:1,{}", place.url());
    let published =
        broker_cli(&["publish", "--exchange", "ev", "--routing-key", "x", "--type", "t", "--payload", "{}"], &seeds)
            .await;
    assert_eq!(published.code, Some(0), "{published:?}");
    assert_eq!(place.depth("work").await, 1, "the message reached the queue");
    broker.close().await;
}

/// How long the stopped queue's runner stays down, as the issue says.
const DOWN: Duration = Duration::from_secs(60);

/// A fan-out exchange `ev` and the queue `queue` bound to it, calling `receiver`: one runner
/// per queue, each in a process of its own.
fn fan_out_queue(queue: &str, receiver: &Receiver) -> tempfile::TempDir {
    pipeline(&format!(
        "version: 1\nexchanges:\n  ev: {{type: fanout}}\nqueues:\n  {queue}:\n    bind: [{{exchange: ev}}]\n    handler:\n      webhook: {{url: \"{}/hook\"}}\n    idempotency: {{ttl: 1h}}\n",
        receiver.uri()
    ))
}

/// Issue 35: a fan-out to queues `a` and `b`, each with a `sluice run` of its own; `b`'s runner
/// stopped for a minute while the publishes go on (10 a second). `a` keeps flowing (everything
/// published while `b` is down is handled by `a` before `b` comes back), `b`'s stream keeps
/// every copy, and `b`'s runner started again handles each of them once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_with_one_queues_runner_down_for_a_minute() {
    let place = NatsPrefix::new();
    let (to_a, to_b) = (Receiver::ok().await, Receiver::ok().await);
    let (dir_a, dir_b) = (fan_out_queue("a", &to_a), fan_out_queue("b", &to_b));
    let broker = place.connect().await;
    declare(dir_a.path(), &broker).await;
    declare(dir_b.path(), &broker).await;
    let _a = Sluice::run(dir_a.path(), &place.url(), &[]);
    let mut b = Sluice::run(dir_b.path(), &place.url(), &[]);
    let mut keys = Vec::new();
    let mut published = |n: usize| {
        let key = format!("k{n}");
        keys.push(key.clone());
        key
    };
    let first = published(0);
    publish(&broker, "ev", "", &first, serde_json::json!({})).await;
    for receiver in [&to_a, &to_b] {
        wait_until(Duration::from_secs(60), "the first message handled by both queues", || async {
            receiver.succeeded_keys().contains(&first)
        })
        .await;
    }
    assert_eq!(b.stop(Duration::from_secs(30)), Some(0), "b's runner stops cleanly; log:\n{}", b.log());
    let down = std::time::Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut n = 1;
    while down.elapsed() < DOWN {
        tick.tick().await;
        let key = published(n);
        publish(&broker, "ev", "", &key, serde_json::json!({})).await;
        n += 1;
    }
    let while_down = keys.len() - 1;
    wait_until(Duration::from_secs(60), "a handled everything published while b was down", || async {
        keys.iter().all(|k| to_a.succeeded_keys().contains(k))
    })
    .await;
    let mut calls: Vec<std::time::Instant> = to_a.hits().iter().map(|h| h.at).filter(|at| *at >= down).collect();
    calls.sort();
    let pause = calls.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default();
    assert_eq!(to_b.succeeded_keys().len(), 1, "b handled nothing while its runner was down");
    assert_eq!(place.depth("b").await as usize, while_down, "b's stream kept every copy");
    let _b = Sluice::run(dir_b.path(), &place.url(), &[]);
    let back = std::time::Instant::now();
    wait_until(Duration::from_secs(120), "b handled every message once back", || async {
        keys.iter().all(|k| to_b.succeeded_keys().contains(k))
    })
    .await;
    eprintln!(
        "b's runner down {:.1?}; {while_down} published meanwhile, all handled by a (its longest pause between webhook calls {pause:.1?}); b handled them {:.1?} after it started again",
        back - down,
        back.elapsed()
    );
    for receiver in [&to_a, &to_b] {
        let twice = counts(receiver.hits().iter().filter(|h| h.succeeded()).map(|h| h.key().to_string()));
        assert!(twice.values().all(|n| *n == 1), "a key handled twice: {twice:?}");
    }
    wait_until(Duration::from_secs(30), "b's stream emptied by its acks", || async { place.depth("b").await == 0 })
        .await;
    broker.close().await;
}

/// How long [`AckHoldingProxy`] holds the server's side: past the client's wait for a publish's
/// acknowledgement (5 s, async-nats' default), short of its four missed pings (2 s apart).
const HOLD: Duration = Duration::from_secs(7);

/// A TCP proxy to the machine's nats-server that, once, holds what the server sends back for
/// [`HOLD`] from the first publish into `subject` it relays: that publish is stored and its
/// acknowledgement comes too late, so the client gives it up and publishes again. Counts the
/// publishes into `subject` it relayed.
struct AckHoldingProxy {
    port: u16,
    publishes: Arc<AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

impl AckHoldingProxy {
    async fn start(subject: &str) -> AckHoldingProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let publishes = Arc::new(AtomicUsize::new(0));
        let held = Arc::new(AtomicBool::new(false));
        let needle = format!("HPUB {subject} ").into_bytes();
        let counted = publishes.clone();
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                tokio::spawn(hold_once(inbound, needle.clone(), counted.clone(), held.clone()));
            }
        });
        AckHoldingProxy { port, publishes, accept }
    }

    fn publishes(&self) -> usize {
        self.publishes.load(Ordering::SeqCst)
    }
}

impl Drop for AckHoldingProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Relays one connection to the machine's nats-server, counting the client's publishes that
/// start with `needle`; the first of them (of every connection: `held`) holds the server's
/// side for [`HOLD`].
async fn hold_once(
    inbound: tokio::net::TcpStream,
    needle: Vec<u8>,
    publishes: Arc<AtomicUsize>,
    held: Arc<AtomicBool>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Ok(upstream) = tokio::net::TcpStream::connect("127.0.0.1:4222").await else { return };
    let (mut client_read, mut client_write) = inbound.into_split();
    let (mut server_read, mut server_write) = upstream.into_split();
    let (hold, mut until) = tokio::sync::watch::channel(None::<tokio::time::Instant>);
    let up = async {
        // What the last read ended with: a publish's first line split between two reads.
        let mut tail: Vec<u8> = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            tail.extend_from_slice(&buf[..n]);
            let found = tail.windows(needle.len()).filter(|w| *w == needle.as_slice()).count();
            tail.drain(..tail.len().saturating_sub(needle.len() - 1));
            if found > 0 {
                publishes.fetch_add(found, Ordering::SeqCst);
                if !held.swap(true, Ordering::SeqCst) {
                    hold.send_replace(Some(tokio::time::Instant::now() + HOLD));
                }
            }
            if server_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let down = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let until = *until.borrow_and_update();
            if let Some(until) = until {
                tokio::time::sleep_until(until).await;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

/// Issue 35: a publish whose acknowledgement comes after the client stopped waiting for it (a
/// proxy holds the server's answers) is published again with the same `Nats-Msg-Id`; the
/// queue's stream holds one copy, and the publish is confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_retried_after_a_timeout_is_stored_once() {
    let place = NatsPrefix::new();
    let dir = work_pipeline("    handler: {command: {program: /bin/true}}\n");
    let direct = place.connect().await;
    declare(dir.path(), &direct).await;
    // The queue `work`'s subject: `PREFIX.q.` and the name in hex.
    let proxy = AckHoldingProxy::start(&format!("{}.q.776f726b", place.prefix)).await;
    let url = format!("nats://127.0.0.1:{}?prefix={}{}", proxy.port, place.prefix, place.params);
    let broker = sluice::broker::jetstream::JetStream::connect(&url).await.expect("connect through the proxy");
    publish(&broker, "ev", "k", "once", serde_json::json!({})).await;
    assert!(proxy.publishes() >= 2, "the publish was tried again: {} tries seen", proxy.publishes());
    assert_eq!(place.depth("work").await, 1, "one copy in the stream");
    broker.close().await;
    direct.close().await;
}

/// A fan-out exchange `ev` and a queue `queue` bound to it whose handler does nothing.
fn bound_queue(queue: &str) -> tempfile::TempDir {
    pipeline(&format!(
        "version: 1\nexchanges:\n  ev: {{type: fanout}}\nqueues:\n  {queue}:\n    bind: [{{exchange: ev}}]\n    handler: {{command: {{program: /bin/true}}}}\n"
    ))
}

/// A session routes on its copy of the topology: a binding another process declares is routed
/// on once the bucket's watch brings it, one its own declare made as soon as the declare
/// returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_routes_on_bindings_declared_since() {
    let place = NatsPrefix::new();
    let publisher = place.connect().await;
    declare(bound_queue("a").path(), &publisher).await;
    publish(&publisher, "ev", "", "first", serde_json::json!({})).await;
    assert_eq!(place.depth("a").await, 1, "routed on the copy read");
    let other = place.connect().await;
    declare(bound_queue("b").path(), &other).await;
    other.close().await;
    let n = AtomicUsize::new(0);
    wait_until(Duration::from_secs(10), "a publish reaches b, declared by another session", || async {
        let key = format!("k{}", n.fetch_add(1, Ordering::SeqCst));
        publish(&publisher, "ev", "", &key, serde_json::json!({})).await;
        place.depth("b").await > 0
    })
    .await;
    declare(bound_queue("c").path(), &publisher).await;
    publish(&publisher, "ev", "", "last", serde_json::json!({})).await;
    assert_eq!(place.depth("c").await, 1, "the session's own declare is routed on at once");
    publisher.close().await;
}
