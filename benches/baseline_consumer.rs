//! The consumer sluice is measured against: what one would write by hand with lapin and
//! reqwest. Prefetch N, one task per delivery, one `basic.ack` per message (`multiple =
//! false`) after a 2xx, a nack with requeue otherwise. No envelope decoding, templating,
//! retry policy or dead-lettering — that is what the comparison prices.
//!
//! With `--batched-acks` it acks the way sluice's runtime does instead (`ack_loop` in
//! `src/runtime/worker.rs`): one `multiple` ack over the contiguous finished range, settled
//! deliveries behind a gap acked one by one once more than PREFETCH/2 wait. The drain
//! benchmark runs both modes, which splits sluice's difference from the baseline into what
//! the ack strategy does and what sluice's per-message work costs.
//!
//! `scripts/bench.sh` builds and drives it; by hand:
//!
//! ```text
//! cargo bench --no-run --bench baseline_consumer   # prints the executable's path
//! baseline_consumer AMQP_URL QUEUE PREFETCH COUNT (--webhook URL | --command PROGRAM) [--batched-acks]
//! ```
//!
//! It exits after acking COUNT messages and prints one JSON line: how many it handled and
//! the wall-clock time (Unix seconds) of the first and the last.

#[path = "common/baseline.rs"]
mod baseline;

use std::collections::BTreeMap;
use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use tokio::sync::{Notify, mpsc};

enum Handler {
    Webhook(String),
    Command(String),
}

struct Args {
    broker: String,
    queue: String,
    prefetch: u16,
    count: u64,
    handler: Handler,
    batched_acks: bool,
}

fn parse_args() -> Option<Args> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let batched_acks = args.last().is_some_and(|a| a == "--batched-acks");
    if batched_acks {
        args.pop();
    }
    let [broker, queue, prefetch, count, kind, target] = <[String; 6]>::try_from(args).ok()?;
    let handler = match kind.as_str() {
        "--webhook" => Handler::Webhook(target),
        "--command" => Handler::Command(target),
        _ => return None,
    };
    Some(Args { broker, queue, prefetch: prefetch.parse().ok()?, count: count.parse().ok()?, handler, batched_acks })
}

#[tokio::main]
async fn main() -> ExitCode {
    baseline::main(
        "baseline_consumer is driven by scripts/bench.sh (see BENCHMARKS.md)",
        "usage: baseline_consumer AMQP_URL QUEUE PREFETCH COUNT (--webhook URL | --command PROGRAM) [--batched-acks]",
        parse_args,
        consume,
    )
    .await
}

async fn consume(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let connection = Connection::connect(&args.broker, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel.basic_qos(args.prefetch, BasicQosOptions::default()).await?;
    let mut consumer = channel
        .basic_consume(
            args.queue.as_str().into(),
            "baseline".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    sluice::install_tls_provider();
    let client = reqwest::Client::new();
    let handler = Arc::new(args.handler);
    let progress = Arc::new(Mutex::new(baseline::Progress::default()));
    let done = Arc::new(Notify::new());
    let count = args.count;
    let (acks, ack_events) = mpsc::unbounded_channel();
    let acker = args.batched_acks.then(|| tokio::spawn(ack_loop(ack_events, usize::from(args.prefetch) / 2)));
    loop {
        let delivery = tokio::select! {
            _ = done.notified() => break,
            d = consumer.next() => match d {
                Some(d) => d?,
                None => break,
            },
        };
        let batched = acker.is_some().then(|| acks.clone());
        if let Some(acks) = &batched {
            let _ = acks.send(AckEvent::Received(delivery.delivery_tag));
        }
        let (client, handler, progress, done) = (client.clone(), handler.clone(), progress.clone(), done.clone());
        tokio::spawn(async move {
            let ok = match handler.as_ref() {
                Handler::Webhook(url) => {
                    let response = client.post(url).body(delivery.data.clone()).send().await;
                    response.is_ok_and(|r| r.status().is_success())
                }
                Handler::Command(program) => tokio::process::Command::new(program)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .await
                    .is_ok_and(|s| s.success()),
            };
            if !ok {
                let _ = delivery.nack(BasicNackOptions { requeue: true, ..Default::default() }).await;
                if let Some(acks) = batched {
                    let _ = acks.send(AckEvent::Nacked(delivery.delivery_tag));
                }
                return;
            }
            match batched {
                Some(acks) => {
                    let _ = acks.send(AckEvent::Finished(delivery));
                }
                None => {
                    if delivery.ack(BasicAckOptions { multiple: false }).await.is_err() {
                        return;
                    }
                }
            }
            if progress.lock().expect("progress lock").handled() == count {
                done.notify_one();
            }
        });
    }
    drop(acks);
    if let Some(acker) = acker {
        // Every delivery has finished; let the last acks out before closing.
        let _ = acker.await;
    }
    let _ = connection.close(200, "done".into()).await;
    progress.lock().expect("progress lock").print();
    Ok(())
}

// Moved by value, as sluice's runtime moves its deliveries: no allocation per message.
#[allow(clippy::large_enum_variant)]
enum AckEvent {
    Received(u64),
    Finished(Delivery),
    /// Settled by a nack: no longer a gap.
    Nacked(u64),
}

/// Sluice's ack strategy, restated: the contiguous finished range from the oldest unsettled
/// delivery in one `multiple` ack; beyond a gap, finished deliveries wait unless more than
/// `hold` of them do.
async fn ack_loop(mut events: mpsc::UnboundedReceiver<AckEvent>, hold: usize) {
    let mut outstanding: BTreeMap<u64, Option<Delivery>> = BTreeMap::new();
    let mut batch = Vec::new();
    while events.recv_many(&mut batch, 1024).await > 0 {
        for event in batch.drain(..) {
            match event {
                AckEvent::Received(tag) => outstanding.insert(tag, None),
                AckEvent::Finished(d) => outstanding.insert(d.delivery_tag, Some(d)),
                AckEvent::Nacked(tag) => outstanding.remove(&tag),
            };
        }
        let mut last = None;
        while let Some(entry) = outstanding.first_entry() {
            if entry.get().is_none() {
                break;
            }
            last = entry.remove();
        }
        if let Some(d) = last {
            let _ = d.ack(BasicAckOptions { multiple: true }).await;
        }
        if outstanding.values().filter(|d| d.is_some()).count() > hold {
            let settled: Vec<u64> = outstanding.iter().filter(|(_, d)| d.is_some()).map(|(t, _)| *t).collect();
            for tag in settled {
                if let Some(Some(d)) = outstanding.remove(&tag) {
                    let _ = d.ack(BasicAckOptions { multiple: false }).await;
                }
            }
        }
    }
}
