//! The one assembly point: which broker `--broker` names ([`Endpoint`]), what is known of it
//! from its kind alone (its [`Capabilities`], its picture for `plan`), and the one place that
//! turns it into sessions with failover ([`assemble`]), for the runner ([`run`]) and the
//! operator's commands alike. `cli` parses arguments and prints; it names no broker type.
//!
//! A command's work is a [`Job`]: written once, generic over `B: Operate`, handed the sessions
//! of whichever broker. [`assemble`] is compiled once for each broker, as the macros it replaced
//! were, and nothing dispatches on the broker once a session is open: an `AnyBroker` enum would
//! match on every call of the contract's members (the runner's hot path) and need enums of
//! deliveries and consumers too. Only the function that opens a session is boxed: it runs once
//! a session.
//!
//! Adding a broker: its folder under `broker/`, and here a variant of [`Endpoint`], its scheme in
//! [`Endpoint::parse`], and its arm in each match of this file (capabilities, picture,
//! sessions). Nothing here parses arguments, prints, or knows how a broker works inside.

pub mod run;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use crate::admin::api::Connect;
use crate::broker::amqp::{self, Amqp};
use crate::broker::embedded::{self, Embedded, ReadOnly};
use crate::broker::failover::Failover;
use crate::broker::redis::{self, Checks as RedisChecks, Redis};
use crate::broker::render::Picture;
use crate::broker::{Broker, BrokerError, Capabilities, Operate, capabilities};
use crate::runtime::Readiness;
use crate::topology::Plan;

/// The embedded broker's directory when `--broker` is not given, beside the idempotency
/// store's, and the state directory of runners on other brokers.
pub const DEFAULT_BROKER: &str = ".sluice";

/// Which broker `--broker` names.
pub enum Endpoint<'a> {
    /// The nodes of one RabbitMQ cluster (or the one node), in the order this process tries them.
    Amqp(Vec<&'a str>),
    /// A Redis server (and the deployment's key prefix).
    Redis(&'a str),
    /// The embedded broker's directory.
    Embedded(&'a Path),
}

/// What a `--broker` value is, or why it is none.
fn classify(value: &str) -> anyhow::Result<Option<&str>> {
    if ["amqp://", "amqps://", "redis://", "rediss://"].iter().any(|scheme| value.starts_with(scheme)) {
        return Ok(Some(value));
    }
    if let Some((scheme, _)) = value.split_once("://") {
        anyhow::bail!(
            "--broker {}: \"{scheme}://\" is not a broker; use amqp:// or amqps:// for RabbitMQ, redis:// or rediss:// for Redis, or a directory for the embedded broker",
            amqp::redact(value)
        );
    }
    // `127.0.0.1:5672` or `rabbitmq:5672` would otherwise quietly become a directory of that
    // name holding a private embedded broker that no publisher ever reaches.
    if let Some((host, port)) = value.rsplit_once(':')
        && !host.is_empty()
        && !host.contains('/')
        && port.parse::<u16>().is_ok()
    {
        anyhow::bail!(
            "--broker {value}: looks like HOST:PORT; for RabbitMQ write amqp://USER:PASSWORD@{value}/%2f (the embedded broker takes a directory, and a directory of that name is not what you meant)"
        );
    }
    Ok(None)
}

/// How many RabbitMQ nodes `--broker` values name (a cluster when more than one), counted
/// without judging the rest: `validate` and `plan` say what they find in the files first.
pub fn nodes(values: &[String]) -> usize {
    values.iter().filter(|v| v.trim().starts_with("amqp://") || v.trim().starts_with("amqps://")).count()
}

/// The broker for logs and messages: the URLs as given with their passwords masked, or the
/// directory.
pub fn display(values: &[String]) -> String {
    match Endpoint::parse(values) {
        Ok(Endpoint::Embedded(dir)) => format!("embedded in {}", dir.display()),
        _ => values.iter().map(|u| amqp::redact(u)).collect::<Vec<_>>().join(","),
    }
}

/// The plan as `sluice plan` prints it: in the terms of the broker `--broker` names; without
/// one, as RabbitMQ declares it (README's `plan` section says so, and scripts read its `x-`
/// arguments).
pub fn picture(plan: &Plan, endpoint: Option<&Endpoint<'_>>) -> anyhow::Result<Picture> {
    Ok(match endpoint {
        None | Some(Endpoint::Amqp(_)) => amqp::declarations(plan).picture(),
        Some(Endpoint::Redis(url)) => redis::picture(plan, &redis::Location::parse(url)?),
        Some(Endpoint::Embedded(dir)) => embedded::picture(plan, dir),
    })
}

impl<'a> Endpoint<'a> {
    /// The broker `--broker` values name. The nodes of a cluster are shuffled: each process
    /// takes them in its own order, so runners spread over them.
    pub fn parse(values: &'a [String]) -> anyhow::Result<Endpoint<'a>> {
        let values: Vec<&str> = values.iter().map(|u| u.trim()).filter(|u| !u.is_empty()).collect();
        let mut urls = Vec::new();
        for value in &values {
            if let Some(url) = classify(value)? {
                urls.push(url);
            }
        }
        match (urls.len(), values.as_slice()) {
            (0, [dir]) => Ok(Endpoint::Embedded(Path::new(*dir))),
            (1, [url]) if url.starts_with("redis://") || url.starts_with("rediss://") => Ok(Endpoint::Redis(url)),
            (_, _) if urls.iter().any(|u| u.starts_with("redis")) => {
                anyhow::bail!("--broker names a Redis server and something else; give one redis:// URL")
            }
            (0, []) => anyhow::bail!("--broker is empty: give amqp:// URLs or the embedded broker's directory"),
            (0, _) => anyhow::bail!("--broker names {} directories; the embedded broker takes one", values.len()),
            (n, _) if n < values.len() => {
                anyhow::bail!(
                    "--broker mixes amqp:// URLs and directories; give the nodes of one RabbitMQ cluster, or one directory"
                )
            }
            _ => {
                rand::seq::SliceRandom::shuffle(urls.as_mut_slice(), &mut rand::rng());
                Ok(Endpoint::Amqp(urls))
            }
        }
    }

    /// What the broker can honour, known from its kind alone.
    pub fn capabilities(&self) -> Capabilities {
        match self {
            Endpoint::Amqp(_) => capabilities::RABBITMQ,
            Endpoint::Redis(_) => capabilities::REDIS,
            Endpoint::Embedded(_) => capabilities::EMBEDDED,
        }
    }

    /// How many addresses the broker has: more than one is a cluster.
    pub fn nodes(&self) -> usize {
        match self {
            Endpoint::Amqp(urls) => urls.len(),
            _ => 1,
        }
    }

    /// Where a runner keeps its state (the admin token it generates, idempotency keys by
    /// default): the embedded broker's directory, else [`DEFAULT_BROKER`] in the working
    /// directory.
    pub fn state_dir(&self) -> PathBuf {
        match self {
            Endpoint::Embedded(dir) => dir.to_path_buf(),
            _ => PathBuf::from(DEFAULT_BROKER),
        }
    }

    /// Whether the broker is there to be read: an embedded broker is not until `run` creates
    /// its file (the operator's commands never do).
    pub fn exists(&self) -> bool {
        match self {
            Endpoint::Embedded(dir) => dir.join(embedded::FILE).exists(),
            _ => true,
        }
    }
}

/// What a Redis broker says of its persistence, as `plan` and `run`'s start line show it, and
/// a warning when a restart would lose messages (or when it cannot be told); `None` for a
/// broker that keeps what it confirms.
pub async fn persistence(endpoint: &Endpoint<'_>) -> Option<(String, Option<String>)> {
    let Endpoint::Redis(url) = endpoint else { return None };
    let persistence = match Redis::connect(url).await {
        Ok(session) => {
            let p = session.persistence().await;
            session.close().await;
            p
        }
        Err(_) => None,
    };
    Some(persistence_line(persistence))
}

/// Persistence as the start line and `plan` show it, and a warning when a restart would lose
/// messages (or when it cannot be told).
fn persistence_line(persistence: Option<redis::Persistence>) -> (String, Option<String>) {
    match persistence {
        Some(p) => (p.to_string(), p.warning()),
        None => (
            "unknown".into(),
            Some("cannot read Redis's persistence settings (CONFIG GET refused): make sure it runs with appendonly yes and appendfsync always, or a restart loses messages".into()),
        ),
    }
}

/// Opens a session with one node of a broker, by the node's index.
pub type Opener<'a, B> =
    Box<dyn Fn(usize) -> Pin<Box<dyn Future<Output = Result<B, BrokerError>> + Send + 'a>> + Send + Sync + 'a>;

/// Sessions with the nodes of one broker, whichever it is.
pub type Sessions<'a, B> = Failover<Opener<'a, B>>;

/// How sessions are opened, and for whom.
pub struct Dial<'a> {
    pub timeouts: amqp::Timeouts,
    /// What a Redis server must offer (checked on every session).
    pub redis: &'a RedisChecks,
    /// For the runner: the embedded broker's file it opened once (its idempotency keys share
    /// the writer). Without it, each session opens the file, which must exist already (only
    /// `run` creates one).
    pub embedded: Option<&'a Embedded>,
    /// For the runner: where `/readyz` says why a Redis session does not open.
    pub readiness: Option<&'a Readiness>,
    /// For a command a person waits on: give up after three rounds of failures over every node
    /// (one, on the embedded broker). The runner never gives up.
    pub give_up: bool,
}

/// What a command does with the sessions of whichever broker: written once, run on each.
pub trait Job {
    type Output;

    /// Does the work with `sessions`; `reconnect` opens further sessions on its own (the
    /// admin API's), for as long as the process runs.
    fn run<B: Operate>(
        self,
        sessions: Sessions<'_, B>,
        reconnect: Connect<B>,
    ) -> impl Future<Output = anyhow::Result<Self::Output>>;
}

/// Runs `job` with the sessions of the broker `endpoint` names: the one place a broker is put
/// together.
pub async fn assemble<J: Job>(endpoint: &Endpoint<'_>, dial: &Dial<'_>, job: J) -> anyhow::Result<J::Output> {
    match endpoint {
        Endpoint::Amqp(urls) => {
            let timeouts = dial.timeouts;
            let names = urls.iter().map(|u| amqp::node_name(u)).collect();
            let open: Opener<'_, Amqp> = Box::new(move |node| Box::pin(Amqp::connect(urls[node], timeouts)));
            let nodes: Arc<[String]> = urls.iter().map(|u| u.to_string()).collect();
            let reconnect: Connect<Amqp> = Arc::new(move || {
                let nodes = nodes.clone();
                Box::pin(async move { first_node(&nodes, timeouts).await })
            });
            job.run(give_up(Failover::new(names, open), dial, 3), reconnect).await
        }
        Endpoint::Redis(url) => {
            let (checks, readiness) = (dial.redis, dial.readiness);
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
            job.run(give_up(Failover::new(vec![amqp::redact(url)], open), dial, 3), reconnect).await
        }
        Endpoint::Embedded(dir) => {
            let (file, owned) = (dial.embedded.cloned(), dir.to_path_buf());
            let session = move || match &file {
                Some(file) => Ok(file.session()),
                None => Embedded::open_existing_dir(&owned),
            };
            let reconnect: Connect<Embedded> = {
                let session = session.clone();
                Arc::new(move || Box::pin(std::future::ready(session())))
            };
            let open: Opener<'_, Embedded> = Box::new(move |_| Box::pin(std::future::ready(session())));
            let names = vec![dir.display().to_string()];
            job.run(give_up(Failover::new(names, open), dial, 1), reconnect).await
        }
    }
}

/// `sessions` as `dial` says: giving up after `rounds` for a command.
fn give_up<'a, B: Broker>(sessions: Sessions<'a, B>, dial: &Dial<'_>, rounds: u32) -> Sessions<'a, B> {
    if dial.give_up { sessions.give_up_after(rounds) } else { sessions }
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

/// Runs `read` on the embedded broker's file opened read-only, when `endpoint` names its
/// directory (None for the others): the commands that only read never write to the file, so
/// they work on one this user may not write, and take no lease on a live runner's.
pub async fn read_only<T>(
    endpoint: &Endpoint<'_>,
    read: impl AsyncFnOnce(&mut ReadOnly) -> Result<T, BrokerError>,
) -> Result<Option<T>, BrokerError> {
    let Endpoint::Embedded(dir) = endpoint else { return Ok(None) };
    read(&mut ReadOnly::open_dir(dir)?).await.map(Some)
}

/// Opens a session, runs `work` on it, and closes it: a command's one read or write.
pub async fn once<B: Broker, T>(
    mut sessions: Sessions<'_, B>,
    work: impl AsyncFnOnce(&B) -> Result<T, BrokerError>,
) -> anyhow::Result<T> {
    let (broker, _) = sessions.open().await?;
    let done = work(&broker).await;
    broker.close().await;
    Ok(done?)
}

#[cfg(test)]
mod tests {
    use super::Endpoint;

    /// What the `--broker` values name, in short, or the start of why they name nothing.
    fn named(values: &[&str]) -> String {
        let values: Vec<String> = values.iter().map(ToString::to_string).collect();
        match Endpoint::parse(&values) {
            Ok(Endpoint::Amqp(urls)) => format!("rabbitmq, {} node(s)", urls.len()),
            Ok(Endpoint::Redis(url)) => format!("redis {url}"),
            Ok(Endpoint::Embedded(dir)) => format!("embedded in {}", dir.display()),
            Err(e) => format!("error: {}", e.to_string().split(';').next().unwrap_or_default()),
        }
    }

    #[test]
    fn broker_values_name_one_broker() {
        let cases: &[(&[&str], &str)] = &[
            (&["amqp://h/%2f"], "rabbitmq, 1 node(s)"),
            (&["amqps://a/v", " amqp://b/v ", ""], "rabbitmq, 2 node(s)"),
            (&["redis://h:6379"], "redis redis://h:6379"),
            (&["state"], "embedded in state"),
            (&["http://h"], "error: --broker http://h: \"http://\" is not a broker"),
            (&["rabbitmq:5672"], "error: --broker rabbitmq:5672: looks like HOST:PORT"),
            (&["redis://h", "amqp://h/v"], "error: --broker names a Redis server and something else"),
            (&["a", "b"], "error: --broker names 2 directories"),
            (&["amqp://h/v", "dir"], "error: --broker mixes amqp:// URLs and directories"),
            (&[], "error: --broker is empty: give amqp:// URLs or the embedded broker's directory"),
        ];
        for (values, want) in cases {
            assert_eq!(named(values), *want, "{values:?}");
        }
    }

    /// Every retry delay `validate` allows fits in RabbitMQ's delay cascade, level by level.
    #[test]
    fn the_delay_cascade_holds_the_longest_retry() {
        let cascade = crate::broker::amqp::MAX_DELAY;
        assert!(cascade >= crate::config::MAX_RETRY_DELAY, "{cascade:?}");
    }
}
