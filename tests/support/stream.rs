//! A steady confirmed stream of envelopes through a broker that may lose its nodes, and what a
//! fault cost downstream counted by idempotency key: what `redis_ha.rs` and `nats_cluster.rs`
//! measure failovers with.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use sluice::broker::{BrokerError, Publish};

use super::{Receiver, counts, wait_until};

/// Publishes envelopes keyed `{prefix}-{n}` to `ev` at about `per_second` through a session of
/// its own (a new one after a failure), until stopped; each key is published until confirmed.
/// The confirmed keys are what must reach the receiver.
pub struct Stream {
    stop: Arc<AtomicBool>,
    confirmed: Arc<Mutex<BTreeMap<String, Instant>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Stream {
    /// Starts publishing to what `connect(url)` opens.
    pub fn start<B, C, F>(connect: C, url: String, prefix: &str, per_second: u32) -> Stream
    where
        B: Publish,
        C: Fn(String) -> F + Send + 'static,
        F: Future<Output = Result<B, BrokerError>> + Send,
    {
        Stream::start_to(connect, url, (prefix, "k"), per_second)
    }

    /// [`Stream::start`] with the routing key `routing_key`.
    pub fn start_to<B, C, F>(connect: C, url: String, (prefix, routing_key): (&str, &str), per_second: u32) -> Stream
    where
        B: Publish,
        C: Fn(String) -> F + Send + 'static,
        F: Future<Output = Result<B, BrokerError>> + Send,
    {
        let routing_key = routing_key.to_string();
        let (stop, confirmed) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(BTreeMap::new())));
        let (flag, done, prefix) = (stop.clone(), confirmed.clone(), prefix.to_string());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1) / per_second);
            let mut n = 0u64;
            let mut session: Option<B> = None;
            while !flag.load(Ordering::SeqCst) {
                tick.tick().await;
                let key = format!("{prefix}-{n}");
                let broker = match &session {
                    Some(b) => b.clone(),
                    None => match connect(url.clone()).await {
                        Ok(b) => session.insert(b).clone(),
                        Err(_) => continue,
                    },
                };
                let envelope = sluice::envelope::Envelope::new("test.event", &json!({"n": n}), Some(key.clone()));
                let message = sluice::broker::Outgoing { body: envelope.encode(), ..Default::default() };
                match broker.publish("ev", &routing_key, message).await {
                    Ok(()) => {
                        done.lock().expect("lock").insert(key, Instant::now());
                        n += 1;
                    }
                    Err(_) => {
                        broker.close().await;
                        session = None;
                    }
                }
            }
            if let Some(b) = session {
                b.close().await;
            }
        });
        Stream { stop, confirmed, task }
    }

    /// Waits until `n` keys were confirmed since `since` (a minute at most).
    pub async fn confirmed_after(&self, since: Instant, n: usize) {
        wait_until(Duration::from_secs(60), &format!("{n} publishes confirmed"), || async {
            self.confirmed.lock().expect("lock").values().filter(|at| **at >= since).count() >= n
        })
        .await;
    }

    /// Each confirmed key and when it was confirmed.
    pub async fn stop(self) -> BTreeMap<String, Instant> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.expect("publisher task");
        self.confirmed.lock().expect("lock").clone()
    }
}

/// What a fault cost downstream.
#[derive(Debug)]
pub struct Outcome {
    pub confirmed: usize,
    /// Confirmed, and not handled when counted.
    pub lost: usize,
    /// Keys with more than one successful webhook call.
    pub twice: usize,
    /// The longest pause between two webhook calls from the last one before the fault on.
    pub pause: Duration,
    /// The longest pause between two confirmed publishes from the fault on: the receiver
    /// cannot be called for what was not published.
    pub publishing: Duration,
}

impl Outcome {
    /// Counts, now, what `receiver` got of the `confirmed` keys, the fault having come at `from`.
    pub fn count(receiver: &Receiver, confirmed: &BTreeMap<String, Instant>, from: Instant) -> Outcome {
        let handled = receiver.succeeded_keys();
        let hits = receiver.hits();
        let twice = counts(hits.iter().filter(|h| h.succeeded()).map(|h| h.key().to_string()))
            .into_values()
            .filter(|n| *n > 1)
            .count();
        let lost = confirmed.keys().filter(|k| !handled.contains(*k)).count();
        let pause = longest_pause(hits.iter().map(|h| h.at), from);
        let publishing = longest_pause(confirmed.values().copied(), from);
        Outcome { confirmed: confirmed.len(), lost, twice, pause, publishing }
    }
}

/// The longest time between two of `times` that ends at or after `from`.
pub fn longest_pause(times: impl Iterator<Item = Instant>, from: Instant) -> Duration {
    let mut times: Vec<Instant> = times.collect();
    times.sort();
    times.windows(2).filter(|w| w[1] >= from).map(|w| w[1] - w[0]).max().unwrap_or_default()
}
