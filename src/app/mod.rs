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
//! Adding a broker: its folder under `broker/`, its [`kinds::Kind`], and here its variant of
//! [`Endpoint`], its scheme in [`Endpoint::parse`] and its line in [`by_kind!`], the one match
//! on the broker. Nothing here parses arguments, prints, or knows how a broker works inside.

pub mod kinds;
pub mod run;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use crate::admin::api::Connect;
use crate::broker::amqp;
use crate::broker::embedded::{Embedded, ReadOnly};
use crate::broker::failover::Failover;
use crate::broker::redis::Checks as RedisChecks;
use crate::broker::render::Picture;
use crate::broker::{Broker, BrokerError, Capabilities, Operate};
use crate::runtime::Readiness;
use crate::topology::Plan;
use kinds::{Directory, Kind, NatsServers, Rabbitmq, RedisServer, SqsQueues};

/// The embedded broker's directory when `--broker` is not given, beside the idempotency
/// store's, and the state directory of runners on other brokers.
pub const DEFAULT_BROKER: &str = ".sluice";

/// Which broker `--broker` names.
pub enum Endpoint<'a> {
    Amqp(Rabbitmq<'a>),
    Redis(RedisServer<'a>),
    JetStream(NatsServers),
    Sqs(SqsQueues<'a>),
    Embedded(Directory<'a>),
}

/// `$body` with `$kind` bound to the [`Kind`] `$endpoint` names: the one match on the broker,
/// expanded for each (so `$body` may be generic over the kind's broker).
macro_rules! by_kind {
    ($endpoint:expr, $kind:ident => $body:expr) => {
        match $endpoint {
            Endpoint::Amqp($kind) => $body,
            Endpoint::Redis($kind) => $body,
            Endpoint::JetStream($kind) => $body,
            Endpoint::Sqs($kind) => $body,
            Endpoint::Embedded($kind) => $body,
        }
    };
}

/// What a `--broker` value is, or why it is none.
fn classify(value: &str) -> anyhow::Result<Option<&str>> {
    if [
        "amqp://",
        "amqps://",
        "redis://",
        "rediss://",
        crate::broker::redis::link::SENTINEL,
        crate::broker::redis::link::CLUSTER,
        "nats://",
        "tls://",
        "sqs://",
    ]
    .iter()
    .any(|scheme| value.starts_with(scheme))
    {
        return Ok(Some(value));
    }
    if let Some((scheme, _)) = value.split_once("://") {
        anyhow::bail!(
            "--broker {}: \"{scheme}://\" is not a broker; use amqp:// or amqps:// for RabbitMQ, redis://, rediss://, redis+sentinel:// or redis+cluster:// for Redis, nats:// or tls:// for NATS JetStream, sqs:// for Amazon SQS, or a directory for the embedded broker",
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

/// Whether a `--broker` URL names a NATS server.
fn is_nats(url: &str) -> bool {
    url.starts_with("nats://") || url.starts_with("tls://")
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
        Ok(endpoint) => by_kind!(&endpoint, kind => kind.display()),
        Err(_) => values.iter().map(|u| amqp::redact(u)).collect::<Vec<_>>().join(","),
    }
}

/// The plan as `sluice plan` prints it: in the terms of the broker `--broker` names; without
/// one, as RabbitMQ declares it (README's `plan` section says so, and scripts read its `x-`
/// arguments).
pub fn picture(plan: &Plan, endpoint: Option<&Endpoint<'_>>) -> anyhow::Result<Picture> {
    match endpoint {
        None => Rabbitmq(Vec::new()).picture(plan),
        Some(endpoint) => by_kind!(endpoint, kind => kind.picture(plan)),
    }
}

impl<'a> Endpoint<'a> {
    /// The broker `--broker` values name. The nodes of a cluster are shuffled: each process
    /// takes them in its own order, so runners spread over them.
    pub fn parse(values: &'a [String]) -> anyhow::Result<Endpoint<'a>> {
        let values: Vec<&str> = values.iter().map(|u| u.trim()).filter(|u| !u.is_empty()).collect();
        // The sentinels or cluster nodes of one Redis deployment, however `--broker` split them.
        if let [first, ..] = values.as_slice()
            && [crate::broker::redis::link::SENTINEL, crate::broker::redis::link::CLUSTER]
                .iter()
                .any(|scheme| first.starts_with(scheme))
        {
            return Ok(Endpoint::Redis(RedisServer(values.join(",").into())));
        }
        let mut urls = Vec::new();
        for value in &values {
            if let Some(url) = classify(value)? {
                urls.push(url);
            }
        }
        match (urls.len(), values.as_slice()) {
            (0, [dir]) => Ok(Endpoint::Embedded(Directory(Path::new(*dir)))),
            (1, [url]) if url.starts_with("redis://") || url.starts_with("rediss://") => {
                Ok(Endpoint::Redis(RedisServer((*url).into())))
            }
            (1, [url]) if url.starts_with("sqs://") => Ok(Endpoint::Sqs(SqsQueues(url))),
            (_, _) if urls.iter().any(|u| u.starts_with("sqs://")) => {
                anyhow::bail!("--broker names an SQS deployment and something else; give one sqs:// URL")
            }
            // The seed servers of one NATS cluster, however `--broker` split them.
            (n, _) if n > 0 && n == values.len() && urls.iter().all(|u| is_nats(u)) => {
                Ok(Endpoint::JetStream(NatsServers(urls.join(","))))
            }
            (_, _) if urls.iter().any(|u| is_nats(u)) => {
                anyhow::bail!(
                    "--broker names NATS servers and something else; give only nats:// or tls:// URLs, the servers of one cluster (nats://a:4222,nats://b:4222)"
                )
            }
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
                Ok(Endpoint::Amqp(Rabbitmq(urls)))
            }
        }
    }

    /// What the broker can honour, known from its kind alone.
    pub fn capabilities(&self) -> Capabilities {
        by_kind!(self, kind => kind.capabilities())
    }

    /// How many addresses the broker has: more than one is a cluster.
    pub fn nodes(&self) -> usize {
        by_kind!(self, kind => kind.nodes())
    }

    /// Where a runner keeps its state (the admin token it generates, idempotency keys by
    /// default): the embedded broker's directory, else [`DEFAULT_BROKER`] in the working
    /// directory.
    pub fn state_dir(&self) -> PathBuf {
        by_kind!(self, kind => kind.state_dir())
    }

    /// Whether the broker is there to be read: an embedded broker is not until `run` creates
    /// its file (the operator's commands never do).
    pub fn exists(&self) -> bool {
        by_kind!(self, kind => kind.exists())
    }

    /// What the broker says of its persistence, as `plan` shows it, and a warning when a
    /// restart would lose messages (or when it cannot be told); `None` for a broker that keeps
    /// what it confirms.
    pub async fn persistence(&self) -> Option<(String, Option<String>)> {
        by_kind!(self, kind => kind.persistence().await)
    }

    /// Which node holds each queue of `plan`, where the broker spreads queues over nodes.
    pub async fn placement(&self, plan: &Plan) -> Option<Vec<(String, String)>> {
        by_kind!(self, kind => kind.placement(plan).await)
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

impl Dial<'_> {
    /// `sessions` as this says: giving up after `rounds` for a command.
    fn limit<'a, B: Broker>(&self, sessions: Sessions<'a, B>, rounds: u32) -> Sessions<'a, B> {
        if self.give_up { sessions.give_up_after(rounds) } else { sessions }
    }
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
    by_kind!(endpoint, kind => {
        let (sessions, reconnect) = kind.sessions(dial);
        job.run(sessions, reconnect).await
    })
}

/// Runs `read` on the embedded broker's file opened read-only, when `endpoint` names its
/// directory (None for the others): the commands that only read never write to the file, so
/// they work on one this user may not write, and take no lease on a live runner's.
pub async fn read_only<T>(
    endpoint: &Endpoint<'_>,
    read: impl AsyncFnOnce(&mut ReadOnly) -> Result<T, BrokerError>,
) -> Result<Option<T>, BrokerError> {
    let Endpoint::Embedded(Directory(dir)) = endpoint else { return Ok(None) };
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
    use super::{Endpoint, kinds};

    /// What the `--broker` values name, in short, or the start of why they name nothing.
    fn named(values: &[&str]) -> String {
        let values: Vec<String> = values.iter().map(ToString::to_string).collect();
        match Endpoint::parse(&values) {
            Ok(Endpoint::Amqp(kinds::Rabbitmq(urls))) => format!("rabbitmq, {} node(s)", urls.len()),
            Ok(Endpoint::Redis(kinds::RedisServer(url))) => format!("redis {url}"),
            Ok(Endpoint::JetStream(kinds::NatsServers(url))) => format!("nats {url}"),
            Ok(Endpoint::Sqs(kinds::SqsQueues(url))) => format!("sqs {url}"),
            Ok(Endpoint::Embedded(kinds::Directory(dir))) => format!("embedded in {}", dir.display()),
            Err(e) => format!("error: {}", e.to_string().split(';').next().unwrap_or_default()),
        }
    }

    #[test]
    fn broker_values_name_one_broker() {
        let cases: &[(&[&str], &str)] = &[
            (&["amqp://h/%2f"], "rabbitmq, 1 node(s)"),
            (&["amqps://a/v", " amqp://b/v ", ""], "rabbitmq, 2 node(s)"),
            (&["redis://h:6379"], "redis redis://h:6379"),
            (&["redis+sentinel://a:26379", "b:26379/m?prefix=p"], "redis redis+sentinel://a:26379,b:26379/m?prefix=p"),
            (&["redis+cluster://a:7000", "b:7000?prefix=p"], "redis redis+cluster://a:7000,b:7000?prefix=p"),
            (&["state"], "embedded in state"),
            (&["nats://a:4222,tls://b:4222"], "nats nats://a:4222,tls://b:4222"),
            (&["nats://a:4222", "nats://b:4222"], "nats nats://a:4222,nats://b:4222"),
            (&["nats://a:4222", "amqp://b/v"], "error: --broker names NATS servers and something else"),
            (&["sqs://us-east-1/shop?endpoint=http://h:5000"], "sqs sqs://us-east-1/shop?endpoint=http://h:5000"),
            (&["sqs://us-east-1", "amqp://b/v"], "error: --broker names an SQS deployment and something else"),
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
