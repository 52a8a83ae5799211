//! The broker side of a trial: a fresh vhost (made and removed with rabbitmqctl, as the
//! integration tests do), the pipeline's topology declared through sluice's own plan, and a
//! backlog published with confirms before any consumer starts.

use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, bail};
use futures_util::{StreamExt as _, TryStreamExt as _, stream};
use sluice::broker::amqp::Amqp;
use sluice::broker::{Broker as _, Outgoing};
use sluice::envelope::Envelope;

/// Publishes awaiting their confirm at once, as `sluice publish --jsonl` does.
const IN_FLIGHT: usize = 256;

fn rabbitmqctl(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("rabbitmqctl").args(args).output().context("cannot run rabbitmqctl")?;
    if !out.status.success() {
        bail!("rabbitmqctl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// A vhost of its own for one trial; deleted on drop unless kept.
pub struct Vhost {
    pub name: String,
    kept: bool,
}

impl Vhost {
    pub fn new() -> anyhow::Result<Vhost> {
        let name = format!("sluice-bench-{}", uuid::Uuid::now_v7());
        rabbitmqctl(&["add_vhost", &name])?;
        let vhost = Vhost { name, kept: false };
        rabbitmqctl(&["set_permissions", "-p", &vhost.name, "guest", ".*", ".*", ".*"])?;
        Ok(vhost)
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:5672/{}", self.name)
    }

    /// Leaves the vhost on the broker, for looking into a failed trial.
    pub fn keep(&mut self) {
        self.kept = true;
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        if !self.kept {
            let _ = rabbitmqctl(&["delete_vhost", &self.name]);
        }
    }
}

/// Declares the topology of the pipeline in `dir` exactly as `sluice run` will.
pub async fn declare(dir: &Path, url: &str) -> anyhow::Result<()> {
    let validation = sluice::config::load(&[dir.to_path_buf()]);
    let Some(config) = validation.config else {
        bail!("bench pipeline is invalid: {:?}", validation.diagnostics);
    };
    let broker = Amqp::connect(url, sluice::broker::amqp::CONNECT_TIMEOUT).await?;
    broker.declare(&sluice::topology::plan(&config)).await?;
    broker.close().await;
    Ok(())
}

/// Publishes `count` envelopes to `exchange`/`routing_key`, each confirmed.
pub async fn preload(url: &str, exchange: &str, routing_key: &str, count: u64) -> anyhow::Result<()> {
    let broker = Amqp::connect(url, sluice::broker::amqp::CONNECT_TIMEOUT).await?;
    let result = stream::iter(0..count)
        .map(|i| {
            let payload = serde_json::json!({"order_id": i, "amount_cents": 1999, "email": "bench@example.com"});
            let envelope = Envelope::new("order.created", &payload, None);
            let message = Outgoing {
                body: envelope.encode(),
                message_id: Some(envelope.id.clone()),
                kind: Some(envelope.kind.clone()),
                timestamp: None,
                headers: Default::default(),
            };
            let broker = &broker;
            async move { broker.publish(exchange, routing_key, message).await }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await;
    broker.close().await;
    result?;
    Ok(())
}
