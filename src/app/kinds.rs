//! What the assembly point knows of each kind of broker, one [`Kind`] each: its capabilities,
//! its picture for `plan`, where its runner keeps state, and how its sessions are opened. A new
//! broker is one impl here, beside its variant of [`super::Endpoint`].

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{DEFAULT_BROKER, Dial, Opener, Sessions};
use crate::admin::api::Connect;
use crate::broker::amqp::{self, Amqp};
use crate::broker::embedded::{self, Embedded};
use crate::broker::failover::Failover;
use crate::broker::jetstream::{self, JetStream};
use crate::broker::redis::{self, Redis};
use crate::broker::render::Picture;
use crate::broker::sqs::{self, Sqs};
use crate::broker::{Broker as _, BrokerError, Capabilities, Operate, capabilities};
use crate::topology::Plan;

/// One kind of broker, as `--broker` named it.
pub trait Kind {
    /// Its sessions.
    type Broker: Operate;

    /// What it can honour, known from its kind alone.
    const CAPABILITIES: Capabilities;

    /// What it can honour.
    fn capabilities(&self) -> Capabilities {
        Self::CAPABILITIES
    }

    /// The broker for logs and messages, passwords masked.
    fn display(&self) -> String;

    /// The plan in its terms, as `plan` prints it.
    fn picture(&self, plan: &Plan) -> anyhow::Result<Picture>;

    /// How many addresses it has: more than one is a cluster.
    fn nodes(&self) -> usize {
        1
    }

    /// Where a runner keeps its state (the admin token it generates, idempotency keys by
    /// default).
    fn state_dir(&self) -> PathBuf {
        PathBuf::from(DEFAULT_BROKER)
    }

    /// Whether it is there to be read (an embedded broker is not until `run` creates it).
    fn exists(&self) -> bool {
        true
    }

    /// What it says of its persistence, as `plan` shows it, and a warning when a restart
    /// would lose messages; `None` for a broker that keeps what it confirms.
    fn persistence(&self) -> impl Future<Output = Option<(String, Option<String>)>> {
        std::future::ready(None)
    }

    /// Which node holds each queue of `plan`, as `plan` shows it, where the broker spreads
    /// queues over nodes (a Redis Cluster); `None` elsewhere.
    fn placement(&self, _plan: &Plan) -> impl Future<Output = Option<Vec<(String, String)>>> {
        std::future::ready(None)
    }

    /// Sessions with its nodes as `dial` says, and how the admin API opens its own.
    fn sessions<'a>(&'a self, dial: &Dial<'a>) -> (Sessions<'a, Self::Broker>, Connect<Self::Broker>);
}

/// The nodes of one RabbitMQ cluster (or the one node), in the order this process tries them.
pub struct Rabbitmq<'a>(pub Vec<&'a str>);

impl Kind for Rabbitmq<'_> {
    type Broker = Amqp;
    const CAPABILITIES: Capabilities = capabilities::RABBITMQ;

    fn display(&self) -> String {
        self.0.iter().map(|u| amqp::redact(u)).collect::<Vec<_>>().join(",")
    }

    fn picture(&self, plan: &Plan) -> anyhow::Result<Picture> {
        Ok(amqp::declarations(plan).picture())
    }

    fn nodes(&self) -> usize {
        self.0.len()
    }

    fn sessions<'a>(&'a self, dial: &Dial<'a>) -> (Sessions<'a, Amqp>, Connect<Amqp>) {
        let (urls, timeouts) = (&self.0, dial.timeouts);
        let names = urls.iter().map(|u| amqp::node_name(u)).collect();
        let open: Opener<'_, Amqp> = Box::new(move |node| Box::pin(Amqp::connect(urls[node], timeouts)));
        let nodes: Arc<[String]> = urls.iter().map(|u| u.to_string()).collect();
        let reconnect: Connect<Amqp> = Arc::new(move || {
            let nodes = nodes.clone();
            Box::pin(async move { first_node(&nodes, timeouts).await })
        });
        (dial.limit(Failover::new(names, open), 3), reconnect)
    }
}

/// A session with the first of `nodes` that takes one.
async fn first_node(nodes: &[String], timeouts: amqp::Timeouts) -> Result<Amqp, BrokerError> {
    let mut last = BrokerError::Lost("no broker node given".into());
    for node in nodes {
        match Amqp::connect(node, timeouts).await {
            Ok(session) => return Ok(session),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// A Redis deployment: one server, or the primary a set of Sentinels names (and the key
/// prefix in its URL).
pub struct RedisServer<'a>(pub std::borrow::Cow<'a, str>);

impl Kind for RedisServer<'_> {
    type Broker = Redis;
    const CAPABILITIES: Capabilities = capabilities::REDIS;

    fn display(&self) -> String {
        amqp::redact(&self.0)
    }

    fn picture(&self, plan: &Plan) -> anyhow::Result<Picture> {
        Ok(redis::picture(plan, &redis::Location::parse(&self.0)?))
    }

    async fn persistence(&self) -> Option<(String, Option<String>)> {
        let persistence = match Redis::connect(&self.0).await {
            Ok(session) => {
                let p = session.persistence().await;
                session.close().await;
                p
            }
            Err(_) => None,
        };
        Some(persistence_line(persistence))
    }

    async fn placement(&self, plan: &Plan) -> Option<Vec<(String, String)>> {
        if !redis::Location::parse(&self.0).ok()?.cluster {
            return None;
        }
        let session = Redis::connect(&self.0).await.ok()?;
        let mut placed = Vec::new();
        for q in &plan.queues {
            let node = match session.holder(&q.name).await {
                Ok((stream, node)) => format!("{node}, stream {stream:?}"),
                Err(e) => format!("unknown ({e})"),
            };
            placed.push((q.name.clone(), node));
        }
        session.close().await;
        Some(placed)
    }

    fn sessions<'a>(&'a self, dial: &Dial<'a>) -> (Sessions<'a, Redis>, Connect<Redis>) {
        let (url, checks, readiness) = (&*self.0, dial.redis, dial.readiness);
        let open: Opener<'_, Redis> = Box::new(move |_| {
            Box::pin(async move {
                Redis::open(url, checks).await.inspect_err(|e| {
                    if let Some(readiness) = readiness {
                        readiness.failed(e);
                    }
                })
            })
        });
        let owned = url.to_string();
        let reconnect: Connect<Redis> = Arc::new(move || {
            let url = owned.clone();
            Box::pin(async move { Redis::connect(&url).await })
        });
        (dial.limit(Failover::new(vec![amqp::redact(url)], open), 3), reconnect)
    }
}

/// The seed servers of one NATS deployment, comma-separated, with sluice's parameters.
pub struct NatsServers(pub String);

impl Kind for NatsServers {
    type Broker = JetStream;
    const CAPABILITIES: Capabilities = capabilities::JETSTREAM;

    fn display(&self) -> String {
        self.0.split(',').map(amqp::redact).collect::<Vec<_>>().join(",")
    }

    fn picture(&self, plan: &Plan) -> anyhow::Result<Picture> {
        Ok(jetstream::picture(plan, &jetstream::Location::parse(&self.0)?))
    }

    fn nodes(&self) -> usize {
        jetstream::Location::parse(&self.0).map_or(1, |l| l.servers.len())
    }

    fn sessions<'a>(&'a self, dial: &Dial<'a>) -> (Sessions<'a, JetStream>, Connect<JetStream>) {
        let url = self.0.as_str();
        let open: Opener<'_, JetStream> = Box::new(move |_| Box::pin(JetStream::connect(url)));
        let owned = url.to_string();
        let reconnect: Connect<JetStream> = Arc::new(move || {
            let url = owned.clone();
            Box::pin(async move { JetStream::connect(&url).await })
        });
        (dial.limit(Failover::new(vec![self.display()], open), 3), reconnect)
    }
}

/// An SQS deployment: its region, prefix and endpoint, as one `sqs://` URL.
pub struct SqsQueues<'a>(pub &'a str);

impl Kind for SqsQueues<'_> {
    type Broker = Sqs;
    const CAPABILITIES: Capabilities = capabilities::SQS;

    /// With the longest queue name this deployment's prefix leaves.
    fn capabilities(&self) -> Capabilities {
        let prefix = sqs::Location::parse(self.0).map_or(sqs::DEFAULT_PREFIX.len(), |l| l.prefix.len());
        let longest = sqs::LONGEST_NAME.saturating_sub(prefix + 1);
        let names = capabilities::QueueNames { longest, ordered_suffix: sqs::FIFO.len() };
        Capabilities { queue_names: Some(names), ..Self::CAPABILITIES }
    }

    fn display(&self) -> String {
        self.0.to_string()
    }

    fn picture(&self, plan: &Plan) -> anyhow::Result<Picture> {
        Ok(sqs::picture(plan, &sqs::Location::parse(self.0)?))
    }

    fn sessions<'a>(&'a self, dial: &Dial<'a>) -> (Sessions<'a, Sqs>, Connect<Sqs>) {
        let url = self.0;
        let open: Opener<'_, Sqs> = Box::new(move |_| Box::pin(Sqs::connect(url)));
        let owned = url.to_string();
        let reconnect: Connect<Sqs> = Arc::new(move || {
            let url = owned.clone();
            Box::pin(async move { Sqs::connect(&url).await })
        });
        (dial.limit(Failover::new(vec![self.display()], open), 3), reconnect)
    }
}

/// Persistence as the start line and `plan` show it, and a warning when a restart would lose
/// messages (or when it cannot be told).
pub(super) fn persistence_line(persistence: Option<redis::Persistence>) -> (String, Option<String>) {
    match persistence {
        Some(p) => (p.to_string(), p.warning()),
        None => (
            "unknown".into(),
            Some("cannot read Redis's persistence settings (CONFIG GET refused): make sure it runs with appendonly yes and appendfsync always, or a restart loses messages".into()),
        ),
    }
}

/// The embedded broker's directory.
pub struct Directory<'a>(pub &'a Path);

impl Kind for Directory<'_> {
    type Broker = Embedded;
    const CAPABILITIES: Capabilities = capabilities::EMBEDDED;

    fn display(&self) -> String {
        format!("embedded in {}", self.0.display())
    }

    fn picture(&self, plan: &Plan) -> anyhow::Result<Picture> {
        Ok(embedded::picture(plan, self.0))
    }

    fn state_dir(&self) -> PathBuf {
        self.0.to_path_buf()
    }

    fn exists(&self) -> bool {
        self.0.join(embedded::FILE).exists()
    }

    fn sessions<'a>(&'a self, dial: &Dial<'a>) -> (Sessions<'a, Embedded>, Connect<Embedded>) {
        let (file, owned) = (dial.embedded.cloned(), self.0.to_path_buf());
        let session = move || match &file {
            Some(file) => Ok(file.session()),
            None => Embedded::open_existing_dir(&owned),
        };
        let reconnect: Connect<Embedded> = {
            let session = session.clone();
            Arc::new(move || Box::pin(std::future::ready(session())))
        };
        let open: Opener<'_, Embedded> = Box::new(move |_| Box::pin(std::future::ready(session())));
        (dial.limit(Failover::new(vec![self.0.display().to_string()], open), 1), reconnect)
    }
}
