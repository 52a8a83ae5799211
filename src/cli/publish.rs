//! `sluice publish`: builds envelopes from flags (or one per JSONL line), publishes each with
//! confirm and `mandatory`, and fails on the first nack, unroutable message or missing exchange.
//! Each message starts a new trace (its `traceparent` header).

use std::io::BufRead;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use futures_util::{StreamExt, TryStreamExt, stream};
use indicatif::ProgressBar;

use super::BrokerArg;
use crate::broker::{Broker, HeaderValue, Headers, Outgoing};
use crate::envelope::{Envelope, TRACEPARENT_HEADER};
use crate::trace::TraceContext;

/// Confirms awaited at once in bulk mode: enough to keep the channel busy.
const IN_FLIGHT: usize = 256;

#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["payload", "payload_file", "jsonl"]))]
pub struct Args {
    #[arg(long)]
    exchange: String,
    #[arg(long, default_value = "")]
    routing_key: String,
    /// The envelope's `type`.
    #[arg(long = "type")]
    kind: String,
    /// Default: the envelope's id.
    #[arg(long, conflicts_with = "jsonl")]
    idempotency_key: Option<String>,
    /// The payload as JSON text.
    #[arg(long)]
    payload: Option<String>,
    /// A file holding the payload as JSON.
    #[arg(long)]
    payload_file: Option<PathBuf>,
    /// A file with one payload (JSON) per line; each becomes its own message.
    #[arg(long)]
    jsonl: Option<PathBuf>,
    #[command(flatten)]
    broker: BrokerArg,
}

fn outgoing(envelope: &Envelope) -> Outgoing {
    let timestamp = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).ok();
    Outgoing {
        body: envelope.encode(),
        message_id: Some(envelope.id.clone()),
        kind: Some(envelope.kind.clone()),
        timestamp,
        headers: Headers::from([(
            TRACEPARENT_HEADER.to_string(),
            HeaderValue::Str(TraceContext::new_root().to_string()),
        )]),
    }
}

/// Runs `sluice publish`.
pub async fn publish(args: Args) -> anyhow::Result<()> {
    let payloads: Vec<serde_json::Value> = if let Some(text) = &args.payload {
        vec![serde_json::from_str(text).context("--payload is not JSON")?]
    } else if let Some(path) = &args.payload_file {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        vec![serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?]
    } else if let Some(path) = &args.jsonl {
        let file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
        let mut payloads = Vec::new();
        for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
            let line = line.with_context(|| format!("cannot read {}", path.display()))?;
            if line.trim().is_empty() {
                continue;
            }
            payloads
                .push(serde_json::from_str(&line).with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?);
        }
        payloads
    } else {
        bail!("one of --payload, --payload-file or --jsonl is required");
    };
    let total = payloads.len();
    super::with_broker!(&args.broker, |broker| {
        let sent = send(&broker, &args, payloads).await;
        broker.close().await;
        sent?
    });
    super::output::stderr(&format!("published {total} message(s) to exchange \"{}\"\n", args.exchange));
    Ok(())
}

/// Publishes each payload as a new envelope, [`IN_FLIGHT`] awaiting their confirms at once.
async fn send<B: Broker>(broker: &B, args: &Args, payloads: Vec<serde_json::Value>) -> anyhow::Result<()> {
    let progress = if payloads.len() > 1 { ProgressBar::new(payloads.len() as u64) } else { ProgressBar::hidden() };
    let result = stream::iter(payloads)
        .map(|payload| {
            let envelope = Envelope::new(&args.kind, &payload, args.idempotency_key.clone());
            let progress = &progress;
            let (exchange, key) = (&args.exchange, &args.routing_key);
            async move {
                broker.publish(exchange, key, outgoing(&envelope)).await?;
                progress.inc(1);
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await;
    progress.finish_and_clear();
    result.map(drop)
}
