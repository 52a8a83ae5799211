//! The consumer sluice on JetStream is measured against: what one would write by hand with
//! async-nats and reqwest. It pulls from an existing durable pull consumer (explicit acks) in
//! batches of CONCURRENCY, runs at most CONCURRENCY deliveries at once (one task each), and
//! acks each after a 2xx, NAKs it otherwise. No envelope decoding, templating, retry policy,
//! dead-lettering, lease renewal or statistics — that is what the comparison prices.
//!
//! By default an ack is fire-and-forget, as `Message::ack` sends it; with `--double-ack` each
//! waits for the server's answer, as sluice's acks do (`settle` in
//! `src/broker/jetstream/mod.rs`), which splits sluice's difference from the baseline into
//! what confirmed acks cost and what the rest of sluice does.
//!
//! `scripts/bench-ab.sh` drives it (a side written `BINARY@baseline`); by hand:
//!
//! ```text
//! cargo bench --no-run --bench baseline_nats_consumer   # prints the executable's path
//! baseline_nats_consumer NATS_URL STREAM CONSUMER CONCURRENCY COUNT --webhook URL [--double-ack]
//! ```
//!
//! It exits after acking COUNT messages and prints one JSON line: how many it handled and
//! the wall-clock time (Unix seconds) of the first and the last.

#[path = "common/baseline.rs"]
mod baseline;

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use futures_util::StreamExt;
use tokio::sync::{Notify, Semaphore};

struct Args {
    server: String,
    stream: String,
    consumer: String,
    concurrency: usize,
    count: u64,
    webhook: String,
    double_ack: bool,
}

fn parse_args() -> Option<Args> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let double_ack = args.last().is_some_and(|a| a == "--double-ack");
    if double_ack {
        args.pop();
    }
    let [server, stream, consumer, concurrency, count, kind, webhook] = <[String; 7]>::try_from(args).ok()?;
    if kind != "--webhook" {
        return None;
    }
    Some(Args {
        server,
        stream,
        consumer,
        concurrency: concurrency.parse().ok().filter(|c| *c > 0)?,
        count: count.parse().ok()?,
        webhook,
        double_ack,
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    baseline::main(
        "baseline_nats_consumer is driven by scripts/bench-ab.sh (see BENCHMARKS.md)",
        "usage: baseline_nats_consumer NATS_URL STREAM CONSUMER CONCURRENCY COUNT --webhook URL [--double-ack]",
        parse_args,
        consume,
    )
    .await
}

async fn consume(args: Args) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let client = async_nats::connect(&args.server).await?;
    let js = jetstream::new(client.clone());
    let consumer: PullConsumer = js.get_stream(&args.stream).await?.get_consumer(&args.consumer).await?;
    let mut messages = consumer.stream().max_messages_per_batch(args.concurrency).messages().await?;
    sluice::install_tls_provider();
    let http = reqwest::Client::new();
    let webhook = Arc::new(args.webhook);
    let running = Arc::new(Semaphore::new(args.concurrency));
    let progress = Arc::new(Mutex::new(baseline::Progress::default()));
    let done = Arc::new(Notify::new());
    let (count, double_ack) = (args.count, args.double_ack);
    loop {
        // A free slot first: no more than CONCURRENCY deliveries run at once.
        let slot = running.clone().acquire_owned().await?;
        let message = tokio::select! {
            _ = done.notified() => break,
            m = messages.next() => match m {
                Some(m) => m?,
                None => break,
            },
        };
        let (http, webhook, progress, done) = (http.clone(), webhook.clone(), progress.clone(), done.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let response = http.post(webhook.as_str()).body(message.payload.clone()).send().await;
            if !response.is_ok_and(|r| r.status().is_success()) {
                let _ = message.ack_with(AckKind::Nak(None)).await;
                return;
            }
            let acked = if double_ack { message.double_ack().await } else { message.ack().await };
            if acked.is_err() {
                return;
            }
            if progress.lock().expect("progress lock").handled() == count {
                done.notify_one();
            }
        });
    }
    // Fire-and-forget acks still buffered in the client go out before it closes.
    client.flush().await?;
    progress.lock().expect("progress lock").print();
    Ok(())
}
