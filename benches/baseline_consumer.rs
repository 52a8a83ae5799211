//! The consumer sluice is measured against: what one would write by hand with lapin and
//! reqwest. Prefetch N, one task per delivery, one `basic.ack` per message (`multiple =
//! false`) after a 2xx, a nack with requeue otherwise. No envelope decoding, templating,
//! retry policy or dead-lettering — that is what the comparison prices.
//!
//! `scripts/bench.sh` builds and drives it; by hand:
//!
//! ```text
//! cargo bench --no-run --bench baseline_consumer   # prints the executable's path
//! baseline_consumer AMQP_URL QUEUE PREFETCH COUNT (--webhook URL | --command PROGRAM)
//! ```
//!
//! It exits after acking COUNT messages and prints one JSON line: how many it handled and
//! the wall-clock time (Unix seconds) of the first and the last.

use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use tokio::sync::Notify;

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
}

fn parse_args() -> Option<Args> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [broker, queue, prefetch, count, kind, target] = <[String; 6]>::try_from(args).ok()?;
    let handler = match kind.as_str() {
        "--webhook" => Handler::Webhook(target),
        "--command" => Handler::Command(target),
        _ => return None,
    };
    Some(Args { broker, queue, prefetch: prefetch.parse().ok()?, count: count.parse().ok()?, handler })
}

/// Handled count and first/last completion, for the summary line.
#[derive(Default)]
struct Progress {
    handled: u64,
    first: Option<f64>,
    last: Option<f64>,
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default()
}

#[tokio::main]
async fn main() -> ExitCode {
    // Run bare (by `cargo bench` or `cargo test --all-targets`) there is nothing to consume.
    if std::env::args().skip(1).all(|a| a == "--bench") {
        eprintln!("baseline_consumer is driven by scripts/bench.sh (see BENCHMARKS.md)");
        return ExitCode::SUCCESS;
    }
    let Some(args) = parse_args() else {
        eprintln!("usage: baseline_consumer AMQP_URL QUEUE PREFETCH COUNT (--webhook URL | --command PROGRAM)");
        return ExitCode::from(2);
    };
    match consume(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
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
    let client = reqwest::Client::new();
    let handler = Arc::new(args.handler);
    let progress = Arc::new(Mutex::new(Progress::default()));
    let done = Arc::new(Notify::new());
    let count = args.count;
    loop {
        let delivery = tokio::select! {
            _ = done.notified() => break,
            d = consumer.next() => match d {
                Some(d) => d?,
                None => break,
            },
        };
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
                return;
            }
            if delivery.ack(BasicAckOptions { multiple: false }).await.is_err() {
                return;
            }
            let mut p = progress.lock().expect("progress lock");
            let t = now();
            p.first.get_or_insert(t);
            p.last = Some(t);
            p.handled += 1;
            if p.handled == count {
                done.notify_one();
            }
        });
    }
    let _ = connection.close(200, "done".into()).await;
    let p = progress.lock().expect("progress lock");
    println!(r#"{{"handled": {}, "first": {}, "last": {}}}"#, p.handled, p.first.unwrap_or(0.0), p.last.unwrap_or(0.0));
    Ok(())
}
