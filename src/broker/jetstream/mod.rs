//! The NATS JetStream broker: the [`Broker`] trait on JetStream (nats-server 2.9 and later),
//! for teams that run NATS. Many processes on many hosts share one deployment (a name prefix
//! on one server or cluster).
//!
//! - The topology (exchanges, queues with their settings, bindings) is one JSON document in
//!   the key-value bucket `PREFIX_topology`, updated by compare-and-set, so any process can
//!   publish. sluice routes on publish with the kit's [`Topology`](super::kit::topology) (AMQP's
//!   direct, fanout, topic and headers semantics exactly: no mapping onto NATS wildcards), and
//!   writes one copy into the stream of each queue reached.
//! - A session routes on the copy of the topology it last read or wrote, kept current by a
//!   watch of the bucket from its first publish on: a publish does not wait on the bucket,
//!   whose stream may be between leaders (a node lost) while the queues' streams take writes.
//!   A declare is routed on by the session that made it as soon as it returns, and by others
//!   as soon as the watch brings it; a route the copy does not know is read again.
//! - A queue is a stream `PREFIX_q_HEX` (the queue's name in hex) on the subject
//!   `PREFIX.q.HEX`, with work-queue retention and file storage: a message stays until a
//!   consumer acks it, whatever other queues did with their copies. `max_length` is the
//!   stream's `max_msgs` with discard-new: a full queue refuses the publish.
//! - Every sluice consumer of a queue pulls from one durable consumer `sluice` with explicit
//!   acks; its `ack_wait` is the lease (default 30 s, `?lease=`), renewed every third of it
//!   with in-progress acks for what a consumer holds. A killed process's deliveries come back
//!   when the lease runs out; closing a consumer hands its deliveries back at once (a NAK each,
//!   in queue order: the server redelivers them before anything newer). Credit is sluice's own:
//!   a pull asks for no more than the consumer has room for.
//! - A publish carries a `Nats-Msg-Id`, the same on each try: a publish retried after a
//!   timeout is taken once (the server's duplicate window, 2 minutes by default).
//! - A node's loss leaves its streams and consumers between leaders for seconds: writes, reads
//!   of the topology and pulls wait for the new leader (15 s at most) instead of failing, and
//!   what waits for a server's answer (an ack, a registration) gives up in time not to hold a
//!   consumer's credit.
//! - A delayed copy is written into its queue's stream with its due time; a consumer that
//!   pulls it before then NAKs it with the time left, and the server redelivers it when due
//!   (exact, and nothing waits behind it).
//! - A consumer registers in the bucket `PREFIX_consumers` (entries expire after
//!   [`REGISTRATION`]) with how many deliveries it holds, for statistics: ready is what a
//!   queue's stream holds less what live consumers hold.
//!
//! URL: `nats://[user:password@]host:port[,nats://host2:port...][?prefix=P&lease=DUR&creds=PATH&replicas=N]`
//! or `tls://`; `replicas` defaults to 1 on one server, 3 when several are given.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, consumer::pull, kv, stream};
use bytes::Bytes;
use futures_util::StreamExt as _;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::declaration::{self, unsupported};
use super::kit::carried::Carried;
use super::kit::claim::{self, Ask, Claimed, Claimer, Holder};
use super::kit::kept;
use super::kit::lease::Renewal;
use super::kit::lock;
use super::kit::topology::{self, Cache, QueueRule, binding_from, binding_text};
use super::render::Picture;
use super::{
    BodyLimits, Broker, BrokerError, Cause, Consumer, Credit, Drift, Edits, Headers, Kept, KeptDeliveries, Operate,
    Outgoing, Publish, QueueStats, Target,
};
use crate::topology::{BindingDecl, Plan};

/// How long a delivery stays leased to its consumer without a renewal, unless the URL says
/// otherwise (`?lease=`).
pub const LEASE: Duration = Duration::from_secs(30);

/// The longest a consumer waits without pulling (for a wake-up lost, a lease run out, a
/// delayed copy come due).
pub const POLL: Duration = Duration::from_secs(1);

/// How long a pull waits for the server's answer before it is given up (a lost answer, when a
/// stream's leader changes, would otherwise hold the consumer for good).
const PULL_ANSWER: Duration = Duration::from_secs(5);

/// How often the client pings the server: a frozen server is noticed after two pings missed.
const PING: Duration = Duration::from_secs(2);

/// How long an ack, NAK or renewal waits for the server's answer (it comes in milliseconds):
/// one sent on a connection that died, or to a node frozen, is never answered, and a
/// delivery whose ack waits holds its consumer's credit. A settle given up is sent again
/// (the runtime acks again; a renewal is tried again soon).
const SETTLE_ANSWER: Duration = Duration::from_secs(2);

/// How long a consumer's registration (statistics) may hold up a pull or an ack: a write to
/// the bucket waits for its stream's leader, which a node lost takes seconds to replace.
/// One not written in time is written again at the next [`POLL`].
const REGISTER_ANSWER: Duration = Duration::from_millis(500);

/// How long a consumer's registration lasts without being written again (it writes it every
/// [`POLL`]).
pub const REGISTRATION: Duration = Duration::from_secs(3);

/// This broker, as a refused declaration names it.
const BROKER: &str = "the JetStream broker";

/// Where this broker looks for declarations, as a refusal on an empty one says.
const PLACE: &str = "under this prefix";

/// The default name prefix.
pub const DEFAULT_PREFIX: &str = "sluice";

/// The durable consumer every sluice consumer of a queue pulls from.
const DURABLE: &str = "sluice";

/// The header holding sluice's properties of a message (one JSON object).
const PROPERTIES: &str = "Sluice";

/// How many times a publish is tried after errors other than a stream's leader missing
/// (the same `Nats-Msg-Id` each time).
const TRIES: usize = 3;

/// How long a write waits for its queue's stream to take its subject again, and pulls may
/// fail before the session is given up: longer than the election of a new leader after a
/// node's loss (4 to 9 s measured on a 3-node cluster). A queue whose stream is gone is known
/// missing after it.
const LEADERLESS: Duration = Duration::from_secs(15);

/// How often a write waiting for its stream's new leader tries again.
const LEADERLESS_POLL: Duration = Duration::from_millis(250);

/// Where a deployment is: its servers, the name prefix, the lease, credentials and replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub servers: Vec<String>,
    pub prefix: String,
    pub lease: Duration,
    pub creds: Option<PathBuf>,
    pub replicas: usize,
}

impl Location {
    /// Parses `nats://…` or `tls://…` (several comma-separated), taking sluice's parameters
    /// out of the query.
    pub fn parse(url: &str) -> Result<Location, BrokerError> {
        let bad = |reason: String| BrokerError::Connect { url: super::amqp::redact(url), reason: reason.into() };
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let servers: Vec<String> =
            base.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect();
        if servers.is_empty() || !servers.iter().all(|s| s.starts_with("nats://") || s.starts_with("tls://")) {
            return Err(bad("expected nats://HOST:PORT or tls://HOST:PORT, comma-separated".into()));
        }
        let mut location = Location {
            replicas: if servers.len() > 1 { 3 } else { 1 },
            servers,
            prefix: DEFAULT_PREFIX.into(),
            lease: LEASE,
            creds: None,
        };
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("prefix", value))
                    if !value.is_empty()
                        && value.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') =>
                {
                    location.prefix = value.to_string();
                }
                Some(("prefix", value)) => {
                    return Err(bad(format!("prefix={value}: expected letters, digits, _ or -")));
                }
                Some(("lease", value)) => {
                    location.lease =
                        crate::vocab::parse_duration(value).filter(|d| *d >= Duration::from_millis(300)).ok_or_else(
                            || bad(format!("lease={value}: expected a duration of at least 300ms, e.g. 30s")),
                        )?;
                }
                Some(("creds", value)) if !value.is_empty() => location.creds = Some(PathBuf::from(value)),
                Some(("replicas", value)) => {
                    location.replicas = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=5).contains(n))
                        .ok_or_else(|| bad(format!("replicas={value}: expected 1 to 5")))?;
                }
                _ => return Err(bad(format!("unknown parameter {pair:?}: expected prefix, lease, creds or replicas"))),
            }
        }
        Ok(location)
    }

    /// A queue's name as it appears in stream and subject names: hex, so any name fits.
    fn hex(queue: &str) -> String {
        queue.bytes().map(|b| format!("{b:02x}")).collect()
    }

    fn stream(&self, queue: &str) -> String {
        format!("{}_q_{}", self.prefix, Location::hex(queue))
    }

    fn subject(&self, queue: &str) -> String {
        format!("{}.q.{}", self.prefix, Location::hex(queue))
    }

    fn wake_subject(&self, queue: &str) -> String {
        format!("{}.wake.{}", self.prefix, Location::hex(queue))
    }
}

/// What `sluice plan --broker nats://…` shows: the plan as this broker keeps it, with each
/// queue's stream.
pub fn picture(plan: &Plan, location: &Location) -> Picture {
    let prefix = &location.prefix;
    let title = format!(
        "the JetStream broker, names under {prefix:?} (a work-queue stream and a durable pull consumer \"{DURABLE}\" for each queue; topology in the bucket {prefix}_topology; {} replica(s))",
        location.replicas
    );
    let delays = "delays: a retry waits in its queue's stream, NAKed with the time left until it is due (exact: no delay queues)".to_string();
    declaration::picture(plan, BROKER, title, delays, |q| {
        Some(("stream", format!("{:?} on {:?}", location.stream(q), location.subject(q))))
    })
}

/// The topology as stored in the bucket: exchanges' kinds, queues' declarations (their JSON),
/// their body limits, and the bindings (their JSON).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Stored {
    exchanges: BTreeMap<String, String>,
    queues: BTreeMap<String, String>,
    limits: BTreeMap<String, u64>,
    bindings: Vec<String>,
}

/// The topology as last read; its version is the bucket entry's revision (0: none).
type Topology = topology::Topology<u64>;

impl Stored {
    fn topology(&self, version: u64) -> Topology {
        let exchanges = self
            .exchanges
            .iter()
            .filter_map(|(name, kind)| Some((name.clone(), topology::exchange_kind(kind)?)))
            .collect();
        let queues = self
            .queues
            .iter()
            .map(|(name, declaration)| {
                let d: serde_json::Value = serde_json::from_str(declaration).unwrap_or_default();
                let rule = QueueRule {
                    max_length: d.get("max_length").and_then(serde_json::Value::as_u64),
                    single_active: false,
                    max_body: self.limits.get(name).copied(),
                    dead_letter: None,
                };
                (name.clone(), rule)
            })
            .collect();
        let bindings = self.bindings.iter().filter_map(|b| binding_from(b)).collect();
        Topology { version, exchanges, queues, bindings }
    }
}

/// A NATS error as the broker's: the session may be retried.
fn lost(context: &str, e: impl std::fmt::Display) -> BrokerError {
    BrokerError::Lost(format!("nats: {context}: {e}").into())
}

/// The key-value bucket `PREFIX_NAME`, made if missing. Its stream is made here as a bucket's
/// would be (one value a key): the client's own bucket creation first reads the account's
/// limits in a form nats-server 2.9 does not answer.
async fn bucket(
    js: &jetstream::Context,
    location: &Location,
    name: &str,
    max_age: Duration,
) -> Result<kv::Store, Cause> {
    let bucket = format!("{}_{name}", location.prefix);
    if let Ok(store) = js.get_key_value(&bucket).await {
        return Ok(store);
    }
    let config = stream::Config {
        name: format!("KV_{bucket}"),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: 1,
        max_age,
        storage: stream::StorageType::File,
        num_replicas: location.replicas,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: stream::DiscardPolicy::New,
        ..stream::Config::default()
    };
    // Another process making it at the same time may win: then it is there to open.
    let made = js.get_or_create_stream(config).await;
    match js.get_key_value(&bucket).await {
        Ok(store) => Ok(store),
        Err(e) => Err(Cause::from(match made {
            Err(made) => format!("the bucket {bucket}: {made}"),
            Ok(_) => format!("the bucket {bucket}: {e}"),
        })),
    }
}

/// The topology an entry of the bucket holds, with its revision (a deleted one: none).
fn stored_in(entry: &kv::Entry) -> Result<(Stored, u64), BrokerError> {
    if entry.operation != kv::Operation::Put {
        return Ok((Stored::default(), entry.revision));
    }
    let stored = serde_json::from_slice(&entry.value)
        .map_err(|e| BrokerError::Damaged(Cause::from_error(e).within("the topology in the bucket is not sluice's")))?;
    Ok((stored, entry.revision))
}

/// Keeps `known` current until `stop`: each revision of the topology the bucket's watch brings,
/// from the one stored when it starts. The client's watch follows the bucket's stream through
/// a change of leader; one that ends is started again after [`POLL`].
fn watch(bucket: kv::Store, known: Arc<Cache<u64>>, stop: CancellationToken) {
    tokio::spawn(async move {
        loop {
            match bucket.watch_with_history("plan").await {
                Ok(mut entries) => loop {
                    let entry = tokio::select! {
                        () = stop.cancelled() => return,
                        entry = entries.next() => entry,
                    };
                    match entry.map(|e| e.map_err(|e| lost("watching the topology", e)).and_then(|e| stored_in(&e))) {
                        Some(Ok((stored, revision))) => {
                            known.keep_newer(stored.topology(revision));
                        }
                        Some(Err(e)) => {
                            tracing::debug!(error = %e, "jetstream broker: the topology's watch; it goes on")
                        }
                        None => break,
                    }
                },
                Err(e) => tracing::debug!(error = %e, "jetstream broker: cannot watch the topology; trying again"),
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(POLL) => {}
            }
        }
    });
}

/// A session with a JetStream deployment. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct JetStream {
    inner: Arc<Inner>,
}

struct Inner {
    client: async_nats::Client,
    js: jetstream::Context,
    location: Location,
    topology: kv::Store,
    /// The topology as last read or written; see [`JetStream::topology`].
    known: Arc<Cache<u64>>,
    /// Whether the watch that keeps `known` current was started.
    watching: AtomicBool,
    consumers: kv::Store,
    /// Per queue: poked when its stream may have something new (the wake subject).
    wakers: Mutex<HashMap<String, Arc<Notify>>>,
    connected: AtomicBool,
    stop: CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl JetStream {
    /// Connects to the deployment `url` names, making its buckets if missing.
    pub async fn connect(url: &str) -> Result<JetStream, BrokerError> {
        let location = Location::parse(url)?;
        let shown = super::amqp::redact(url);
        let failed = |reason: Cause| BrokerError::Connect { url: shown.clone(), reason };
        let mut options = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .request_timeout(Some(Duration::from_secs(10)))
            .ping_interval(PING)
            .name("sluice");
        if let Some(creds) = &location.creds {
            options = options
                .credentials_file(creds)
                .await
                .map_err(|e| failed(Cause::from_error(e).within(format!("creds file {}", creds.display()))))?;
        }
        let servers: Vec<async_nats::ServerAddr> = location
            .servers
            .iter()
            .map(|s| s.parse().map_err(|e| failed(Cause::from_error(e))))
            .collect::<Result<_, _>>()?;
        let client = options.connect(servers).await.map_err(|e| failed(Cause::from_error(e)))?;
        let js = jetstream::new(client.clone());
        let topology = bucket(&js, &location, "topology", Duration::ZERO).await.map_err(failed)?;
        let consumers = bucket(&js, &location, "consumers", REGISTRATION).await.map_err(failed)?;
        let inner = Arc::new(Inner {
            client,
            js,
            location,
            topology,
            known: Arc::new(Cache::default()),
            watching: AtomicBool::new(false),
            consumers,
            wakers: Mutex::new(HashMap::new()),
            connected: AtomicBool::new(true),
            stop: CancellationToken::new(),
        });
        Ok(JetStream { inner })
    }

    /// The name prefix of this deployment.
    pub fn prefix(&self) -> &str {
        &self.inner.location.prefix
    }

    /// Removes every stream and bucket of this deployment (tests clean up so).
    pub async fn destroy(&self) -> Result<(), BrokerError> {
        let (stored, _) = self.stored().await?;
        for queue in stored.queues.keys() {
            let _ = self.inner.js.delete_stream(self.inner.location.stream(queue)).await;
        }
        let prefix = &self.inner.location.prefix;
        for bucket in [format!("{prefix}_topology"), format!("{prefix}_consumers")] {
            self.inner.js.delete_key_value(bucket).await.map_err(|e| lost("deleting a bucket", e))?;
        }
        Ok(())
    }

    /// Messages in `queue`'s stream, delivered or not (held, handed back, delayed copies).
    pub async fn messages(&self, queue: &str) -> Result<u32, BrokerError> {
        let (messages, _) = self.counts(queue).await?;
        Ok(u32::try_from(messages).unwrap_or(u32::MAX))
    }

    /// The topology as stored, with its revision (0: none stored); kept as the session's copy.
    async fn stored(&self) -> Result<(Stored, u64), BrokerError> {
        let started = tokio::time::Instant::now();
        let entry = loop {
            match self.inner.topology.entry("plan").await {
                Ok(entry) => break entry,
                // Nobody answers for the bucket's stream: it is between leaders (a node lost,
                // or the stream just made on a cluster) for a few seconds.
                Err(e) if e.to_string().contains("no responders") && started.elapsed() < LEADERLESS => {
                    tokio::time::sleep(LEADERLESS_POLL).await;
                }
                Err(e) => return Err(lost("reading the topology", e)),
            }
        };
        let (stored, revision) = match entry {
            Some(entry) => stored_in(&entry)?,
            None => (Stored::default(), 0),
        };
        self.inner.known.keep_newer(stored.topology(revision));
        Ok((stored, revision))
    }

    /// Writes `stored` over revision `revision` and keeps it as the session's copy; false when
    /// another process wrote first.
    async fn store(&self, stored: &Stored, revision: u64) -> Result<bool, BrokerError> {
        let value: Bytes = serde_json::to_vec(stored).map_err(|e| lost("writing the topology", e))?.into();
        let written = if revision == 0 {
            self.inner.topology.create("plan", value).await.map_err(|e| e.to_string())
        } else {
            self.inner.topology.update("plan", value, revision).await.map_err(|e| e.to_string())
        };
        match written {
            Ok(revision) => {
                self.inner.known.keep_newer(stored.topology(revision));
                Ok(true)
            }
            Err(e) if e.contains("wrong last sequence") || e.contains("exists") => Ok(false),
            Err(e) => Err(BrokerError::Lost(format!("nats: writing the topology: {e}").into())),
        }
    }

    /// The topology: the session's copy unless `fresh` (or none is held), else the one read
    /// now. The first call starts the watch that keeps the copy current.
    async fn topology(&self, fresh: bool) -> Result<Arc<Topology>, BrokerError> {
        if !self.inner.watching.swap(true, Ordering::SeqCst) {
            watch(self.inner.topology.clone(), self.inner.known.clone(), self.inner.stop.clone());
        }
        match self.inner.known.get() {
            Some(t) if !fresh => Ok(t),
            _ => {
                let (stored, revision) = self.stored().await?;
                Ok(Arc::new(stored.topology(revision)))
            }
        }
    }

    /// The queues a message reaches: on the session's copy of the topology, read again when
    /// the copy knows no such route (it may have been declared since).
    async fn route(&self, exchange: &str, routing_key: &str, headers: &Headers) -> Result<Vec<String>, BrokerError> {
        match self.topology(false).await?.route(exchange, routing_key, headers, PLACE) {
            Ok(targets) => Ok(targets),
            Err(_) => self.topology(true).await?.route(exchange, routing_key, headers, PLACE),
        }
    }

    /// The stream of a declared queue, or what is missing.
    async fn queue_stream(&self, queue: &str) -> Result<stream::Stream, BrokerError> {
        match self.inner.js.get_stream(self.inner.location.stream(queue)).await {
            Ok(s) => Ok(s),
            Err(e) if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(_)) => {
                Err(self.topology(true).await?.missing("queue", queue, PLACE))
            }
            Err(e) => Err(lost("reading a stream", e)),
        }
    }

    /// Makes `queue`'s stream and durable consumer, or checks they stand.
    async fn make_queue(&self, queue: &crate::topology::QueueDecl) -> Result<(), BrokerError> {
        let l = &self.inner.location;
        let config = stream::Config {
            name: l.stream(&queue.name),
            subjects: vec![l.subject(&queue.name)],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            num_replicas: l.replicas,
            max_messages: queue.max_length.and_then(|m| i64::try_from(m).ok()).unwrap_or(-1),
            discard: stream::DiscardPolicy::New,
            ..stream::Config::default()
        };
        let made = self
            .inner
            .js
            .get_or_create_stream(config)
            .await
            .map_err(|e| lost(&format!("making the stream of queue \"{}\"", queue.name), e))?;
        let consumer = pull::Config {
            durable_name: Some(DURABLE.into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: l.lease,
            max_deliver: -1,
            max_ack_pending: -1,
            num_replicas: 0,
            ..pull::Config::default()
        };
        made.get_or_create_consumer(DURABLE, consumer)
            .await
            .map_err(|e| lost(&format!("making the consumer of queue \"{}\"", queue.name), e))?;
        Ok(())
    }

    /// Writes one copy of `message` into `queue`'s stream, due at `due` (ms since the epoch)
    /// when given; `exchange` names where a full queue refused it.
    async fn write(&self, queue: &str, exchange: &str, message: &Carried, id: &str) -> Result<(), BrokerError> {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        headers.insert(PROPERTIES, message.properties_json().as_str());
        let subject = self.inner.location.subject(queue);
        let (started, mut tries) = (tokio::time::Instant::now(), 0);
        loop {
            let sent = self.inner.js.publish_with_headers(subject.clone(), headers.clone(), message.body.clone()).await;
            let acked = match sent {
                Ok(ack) => ack.await,
                Err(e) => Err(e),
            };
            match acked {
                Ok(_) => {
                    self.inner.client.publish(self.inner.location.wake_subject(queue), Bytes::new()).await.ok();
                    return Ok(());
                }
                Err(e) => {
                    let text = e.to_string();
                    if text.contains("maximum messages exceeded") {
                        tracing::debug!(queue = %queue, "jetstream broker: queue full, publish refused");
                        return Err(BrokerError::Rejected {
                            exchange: exchange.into(),
                            reason: format!("queue \"{queue}\" is full"),
                        });
                    }
                    // Nobody takes the stream's subject (the stream is gone, or it is between
                    // leaders, a node lost, for a few seconds), or no answer came (its leader
                    // lost or frozen): tried again until a new leader is surely elected.
                    match e.kind() {
                        PublishErrorKind::StreamNotFound if started.elapsed() >= LEADERLESS => {
                            return Err(BrokerError::NotFound(format!("queue \"{queue}\"").into()));
                        }
                        PublishErrorKind::StreamNotFound => {
                            tokio::time::sleep(LEADERLESS_POLL).await;
                            continue;
                        }
                        PublishErrorKind::TimedOut if started.elapsed() < LEADERLESS => continue,
                        PublishErrorKind::TimedOut => return Err(lost(&format!("writing to queue \"{queue}\""), e)),
                        _ => {}
                    }
                    tries += 1;
                    if tries >= TRIES {
                        return Err(lost(&format!("writing to queue \"{queue}\""), e));
                    }
                }
            }
        }
    }

    /// The notifier of `queue`'s consumers in this session, listening on its wake subject
    /// from the first.
    async fn waker(&self, queue: &str) -> Result<Arc<Notify>, BrokerError> {
        let subject = self.inner.location.wake_subject(queue);
        let (notify, new) = {
            let mut wakers = lock(&self.inner.wakers);
            match wakers.get(&subject) {
                Some(n) => (n.clone(), false),
                None => {
                    let n = Arc::new(Notify::new());
                    wakers.insert(subject.clone(), n.clone());
                    (n, true)
                }
            }
        };
        if new {
            let mut subscription =
                self.inner.client.subscribe(subject).await.map_err(|e| lost("subscribing to wake-ups", e))?;
            let (notify, stop) = (notify.clone(), self.inner.stop.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => return,
                        m = subscription.next() => match m {
                            Some(_) => notify.notify_waiters(),
                            None => return,
                        },
                    }
                }
            });
        }
        Ok(notify)
    }

    async fn open_consumer(&self, queue: &str, prefetch: u16) -> Result<(JsDeliveries, JsConsumer), BrokerError> {
        let stream = self.queue_stream(queue).await?;
        let pull: jetstream::consumer::PullConsumer =
            stream.get_consumer(DURABLE).await.map_err(|e| lost("reading a queue's consumer", e))?;
        let member = Member {
            name: uuid::Uuid::now_v7().simple().to_string(),
            replies: Mutex::new(HashMap::new()),
            handing_back: tokio::sync::Mutex::new(()),
        };
        let state = Arc::new(Holder::new(queue, prefetch, member));
        self.answer_while_alive(&state).await?;
        self.register(&state).await;
        let claimer = JsClaimer {
            broker: self.clone(),
            pull,
            wake: self.waker(queue).await?,
            renewal: Renewal::new(self.inner.location.lease),
            registered: tokio::time::Instant::now(),
            due: None,
            waiting: Vec::new(),
            failing: None,
        };
        let deliveries = claim::start(claimer, &state);
        Ok((deliveries, JsConsumer { broker: self.clone(), state }))
    }

    /// The subject a consumer answers on while it lives: statistics ask it, and a killed
    /// process's consumer has no one to answer (the server says so at once).
    fn alive_subject(&self, name: &str) -> String {
        format!("{}.alive.{name}", self.inner.location.prefix)
    }

    /// Answers on the consumer's alive subject until it closes or is gone.
    async fn answer_while_alive(&self, s: &Arc<ConsumerState>) -> Result<(), BrokerError> {
        let mut asks = self
            .inner
            .client
            .subscribe(self.alive_subject(&s.own.name))
            .await
            .map_err(|e| lost("subscribing to liveness asks", e))?;
        let (client, state, stop) = (self.inner.client.clone(), Arc::downgrade(s), self.inner.stop.clone());
        tokio::spawn(async move {
            loop {
                let ask = tokio::select! {
                    () = stop.cancelled() => return,
                    ask = asks.next() => ask,
                };
                let Some(ask) = ask else { return };
                if !state.upgrade().is_some_and(|s| s.is_live()) {
                    return;
                }
                if let Some(reply) = ask.reply {
                    client.publish(reply, Bytes::new()).await.ok();
                }
            }
        });
        Ok(())
    }

    /// Whether the consumer named `name` answers: a dead one's process has no subscription.
    async fn answers(&self, name: &str) -> bool {
        let asked = self.inner.client.request(self.alive_subject(name), Bytes::new());
        match tokio::time::timeout(Duration::from_secs(2), asked).await {
            Ok(Ok(_)) | Err(_) => true,
            Ok(Err(e)) => e.kind() != async_nats::RequestErrorKind::NoResponders,
        }
    }

    /// The key of a consumer's registration.
    fn registration(&self, s: &ConsumerState) -> String {
        format!("{}.{}", Location::hex(&s.queue), s.own.name)
    }

    /// Writes a consumer's registration: how many deliveries it holds; given up after
    /// [`REGISTER_ANSWER`].
    async fn register(&self, s: &ConsumerState) {
        let held = lock(&s.own.replies).len();
        let put = self.inner.consumers.put(self.registration(s), held.to_string().into());
        match tokio::time::timeout(REGISTER_ANSWER, put).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::debug!(queue = %s.queue, error = %e, "jetstream broker: cannot register a consumer"),
            Err(_) => {
                tracing::debug!(queue = %s.queue, "jetstream broker: a consumer's registration not answered in time")
            }
        }
    }

    /// Live consumers of `queue` and how many deliveries they hold in all.
    async fn live(&self, queue: &str) -> Result<(u32, u64), BrokerError> {
        // The bucket's subjects, read from its stream's state: the client's key listing waits
        // for entries counted when it starts, which one expiring meanwhile never sends.
        let bucket = &self.inner.consumers;
        let filter = format!("{}{}.>", bucket.prefix, Location::hex(queue));
        let mut subjects = bucket.stream.info_with_subjects(&filter).await.map_err(|e| lost("reading consumers", e))?;
        let mut keys = Vec::new();
        while let Some(subject) = subjects.next().await {
            let (subject, _) = subject.map_err(|e| lost("reading consumers", e))?;
            keys.extend(subject.strip_prefix(bucket.prefix.as_str()).map(str::to_string));
        }
        let (mut consumers, mut held) = (0u32, 0u64);
        for key in keys {
            let entry = self.inner.consumers.entry(&key).await.map_err(|e| lost("reading consumers", e))?;
            // A registration not written again for REGISTRATION is a dead consumer's (a killed
            // process), even before the bucket expires it.
            let fresh = |e: &kv::Entry| {
                let age = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos())
                    .saturating_sub(u128::try_from(e.created.unix_timestamp_nanos()).unwrap_or(0));
                age < REGISTRATION.as_nanos()
            };
            let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put && fresh(e)) else { continue };
            let name = key.rsplit('.').next().unwrap_or_default();
            if self.answers(name).await {
                consumers += 1;
                held += String::from_utf8_lossy(&entry.value).parse::<u64>().unwrap_or(0);
            }
        }
        Ok((consumers, held))
    }

    /// Messages in `queue`'s stream, and those delivered and not acked.
    async fn counts(&self, queue: &str) -> Result<(u64, u64), BrokerError> {
        let mut stream = self.queue_stream(queue).await?;
        let messages = stream.info().await.map_err(|e| lost("reading a stream", e))?.state.messages;
        let mut pull: jetstream::consumer::PullConsumer =
            stream.get_consumer(DURABLE).await.map_err(|e| lost("reading a queue's consumer", e))?;
        let pending = pull.info().await.map_err(|e| lost("reading a queue's consumer", e))?.num_ack_pending;
        Ok((messages, pending as u64))
    }

    /// Whether message `sequence` has left `queue`'s stream (a work queue: it was acked, by
    /// this consumer or another after its lease, or purged), as the stream's leader answers
    /// within [`SETTLE_ANSWER`]. A consumer's new leader never answers an ack of what its old
    /// leader had acked (the answer lost with the old one): the stream tells.
    async fn gone(&self, queue: &str, sequence: u64) -> bool {
        let Ok(stream) = self.inner.js.get_stream_no_info(self.inner.location.stream(queue)).await else {
            return false;
        };
        let found = tokio::time::timeout(SETTLE_ANSWER, stream.get_raw_message(sequence)).await;
        matches!(found, Ok(Err(e)) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound)
    }

    /// Sends `kind` for a delivery (by its reply subject) and waits for the server's answer,
    /// [`SETTLE_ANSWER`] at most.
    async fn settle(&self, reply: &str, kind: jetstream::AckKind) -> Result<(), BrokerError> {
        let request = self.inner.client.request(reply.to_string(), kind.into());
        match tokio::time::timeout(SETTLE_ANSWER, request).await {
            Ok(answer) => answer.map(|_| ()).map_err(|e| lost("settling a delivery", e)),
            Err(_) => Err(lost("settling a delivery", format!("no answer within {SETTLE_ANSWER:?}"))),
        }
    }
}

/// Milliseconds since the epoch now.
fn now_ms() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(now.as_millis()).unwrap_or(u64::MAX)
}

/// How long after a delayed copy put back is due back its consumer pulls often: the server
/// makes a NAKed message deliverable up to about a second after its delay, not at once.
const DUE_SLACK: Duration = Duration::from_secs(2);

/// How long before its due time a delayed copy comes back from the server, to be held by its
/// consumer for the rest: delays stay exact whatever the server's lateness.
const EARLY: Duration = Duration::from_secs(2);

/// How often a consumer pulls once a delayed copy is due.
const DUE_POLL: Duration = Duration::from_millis(50);

/// How long to wait before pulling for a copy due at `due`: until then, or a little once due.
fn soon(due: tokio::time::Instant, now: tokio::time::Instant) -> Duration {
    match due.checked_duration_since(now) {
        Some(left) if !left.is_zero() => left,
        _ => DUE_POLL,
    }
}

/// A consumer as this broker keeps it.
type ConsumerState = Holder<u64, Member>;

/// What this broker keeps of a consumer besides what it holds.
struct Member {
    /// Its name in the registrations.
    name: String,
    /// The reply subject of each delivery it holds, by stream sequence: to renew and hand back.
    replies: Mutex<HashMap<u64, String>>,
    /// Held by its close while it hands back what it held: what a claim on its way took is
    /// handed back after, so that all of it comes again in queue order.
    handing_back: tokio::sync::Mutex<()>,
}

/// A consumer's pulls: what fits its room, without waiting (`no_wait`: nothing is ever
/// delivered to a pull request nobody reads), when woken (a publish to its queue, an ack, a
/// read that makes room) or at the latest after [`POLL`]. Each pull also renews the leases it
/// holds every third of the lease, and its registration.
struct JsClaimer {
    broker: JetStream,
    pull: jetstream::consumer::PullConsumer,
    wake: Arc<Notify>,
    renewal: Renewal,
    registered: tokio::time::Instant,
    /// When the earliest delayed copy this consumer put back comes back: it pulls often then.
    due: Option<tokio::time::Instant>,
    /// Delayed copies pulled shortly before they are due, held here (leased, renewed) until
    /// then: not yet the consumer's deliveries.
    waiting: Vec<(tokio::time::Instant, JsDelivery)>,
    /// Since when pulls have failed in a row.
    failing: Option<tokio::time::Instant>,
}

impl JsClaimer {
    /// Renews the leases of what the consumer holds.
    async fn renew(&mut self, s: &ConsumerState) {
        let mut replies: Vec<String> = {
            let replies = lock(&s.own.replies);
            s.held().iter().filter_map(|id| replies.get(id).cloned()).collect()
        };
        replies.extend(self.waiting.iter().map(|(_, d)| d.tag.reply.clone()));
        let renewals = replies.iter().map(|reply| self.broker.settle(reply, jetstream::AckKind::Progress));
        let failed = futures_util::future::join_all(renewals).await.into_iter().find_map(Result::err);
        match failed {
            None => self.renewal.renewed(),
            Some(e) => {
                tracing::warn!(queue = %s.queue, error = %e, "jetstream broker: cannot renew leases; trying again");
                self.renewal.failed(Duration::from_millis(200));
            }
        }
    }
}

impl Claimer for JsClaimer {
    type Id = u64;
    type Tag = Tag;
    type Own = Member;

    fn id(tag: &Tag) -> u64 {
        tag.sequence
    }

    fn wake(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    async fn claim(&mut self, s: &ConsumerState, ask: Ask) -> Claimed<Tag> {
        if self.renewal.is_due() {
            self.renew(s).await;
        }
        if self.registered.elapsed() >= POLL {
            self.broker.register(s).await;
            self.registered = tokio::time::Instant::now();
        }
        let now = tokio::time::Instant::now();
        self.due = self.due.filter(|due| now < *due + DUE_SLACK);
        // Copies held here that came due go first, as the room allows.
        let mut deliveries = Vec::new();
        self.waiting.sort_by_key(|(due, _)| *due);
        while deliveries.len() < ask.room && self.waiting.first().is_some_and(|(due, _)| *due <= now) {
            let (_, d) = self.waiting.remove(0);
            lock(&s.own.replies).insert(d.tag.sequence, d.tag.reply.clone());
            deliveries.push(d);
        }
        let room = ask.room - deliveries.len();
        let mut taken = 0;
        if room > 0 {
            // A pull whose answer is lost (its stream's leader changing) is given up at its
            // deadline: what it would have delivered comes back when its lease runs out.
            let deadline = tokio::time::Instant::now() + PULL_ANSWER;
            let fetched = tokio::time::timeout_at(deadline, self.pull.fetch().max_messages(room).messages()).await;
            let mut messages = match fetched {
                Ok(Ok(messages)) => messages,
                Ok(Err(e)) => return self.failed(s, lost("pulling", e)),
                Err(_) => return self.failed(s, lost("pulling", format!("no answer within {PULL_ANSWER:?}"))),
            };
            let now = now_ms();
            loop {
                let m = match tokio::time::timeout_at(deadline, messages.next()).await {
                    Ok(Some(Ok(m))) => m,
                    Ok(None) => break,
                    Ok(Some(Err(e))) => return self.failed(s, lost("pulling", e)),
                    Err(_) => {
                        tracing::warn!(queue = %s.queue, "jetstream broker: a pull's answer stopped coming; pulling again");
                        break;
                    }
                };
                taken += 1;
                let (Some(reply), Ok(info)) = (m.reply.clone(), m.info()) else { continue };
                let sequence = info.stream_sequence;
                let header = m.headers.as_ref().and_then(|h| h.get(PROPERTIES)).map(|v| v.as_str().to_string());
                let Carried { body, properties, due } = Carried::read(m.payload.clone(), header.as_deref());
                let kept = Kept::whole(Tag { sequence, reply: reply.to_string() }, body, properties, s.live.clone());
                match due.filter(|due| *due > now) {
                    None => {
                        lock(&s.own.replies).insert(sequence, reply.to_string());
                        deliveries.push(kept);
                    }
                    Some(due) => self.not_yet(s, kept, Duration::from_millis(due - now)).await,
                }
            }
        }
        self.failing = None;
        if !deliveries.is_empty() {
            // Registered as held before the stream hands them out: statistics see them held.
            self.broker.register(s).await;
            self.registered = tokio::time::Instant::now();
        }
        let more = room > 0 && taken >= room;
        Claimed { deliveries, more, within: Some(self.wait()), failed: None }
    }

    /// NAKs what a claim took after the close, in queue order, to be delivered first.
    async fn hand_back(&mut self, s: &ConsumerState, ids: Vec<u64>) {
        let _after_the_close = s.own.handing_back.lock().await;
        hand_back(&self.broker, s, ids).await;
    }

    /// Copies held until due go back to the server with the time they have left.
    async fn end(&mut self, s: &ConsumerState) {
        let now = tokio::time::Instant::now();
        for (due, d) in std::mem::take(&mut self.waiting) {
            let left = due.saturating_duration_since(now);
            if let Err(e) = self.broker.settle(&d.tag.reply, jetstream::AckKind::Nak(Some(left))).await {
                tracing::debug!(queue = %s.queue, error = %e, "jetstream broker: cannot put a delayed copy back; it comes back when its lease runs out");
            }
        }
        let _ = self.broker.inner.consumers.purge(self.broker.registration(s)).await;
    }
}

impl JsClaimer {
    /// A pull that failed: the stream ends with it once pulls have failed for [`LEADERLESS`]
    /// (the queue's consumer answers none while it is between leaders, a node lost).
    fn failed(&mut self, s: &ConsumerState, e: BrokerError) -> Claimed<Tag> {
        let now = tokio::time::Instant::now();
        let since = *self.failing.get_or_insert(now);
        if since == now {
            tracing::warn!(queue = %s.queue, error = %e, "jetstream broker: cannot pull messages; trying again");
        } else {
            tracing::debug!(queue = %s.queue, error = %e, "jetstream broker: cannot pull messages; trying again");
        }
        let failed = (now - since >= LEADERLESS).then_some(e);
        Claimed { within: Some(self.wait()), failed, ..Claimed::default() }
    }

    /// A copy pulled `left` before it is due: held here when that is at most [`EARLY`]; else
    /// NAKed to come back [`EARLY`] before its time (the server redelivers a NAKed message
    /// up to about a second after its delay), and pulled for often from then.
    async fn not_yet(&mut self, s: &ConsumerState, kept: JsDelivery, left: Duration) {
        let now = tokio::time::Instant::now();
        if left <= EARLY {
            self.waiting.push((now + left, kept));
            return;
        }
        let back = left - EARLY;
        self.due = Some(self.due.map_or(now + back, |due| due.min(now + back)));
        if let Err(e) = self.broker.settle(&kept.tag.reply, jetstream::AckKind::Nak(Some(back))).await {
            tracing::debug!(queue = %s.queue, error = %e, "jetstream broker: cannot put a delayed copy back; it comes back when its lease runs out");
        }
    }

    /// How long to wait before pulling again: a poll, a third of the lease (to renew), when a
    /// copy held here comes due, or soon once one put back is due back.
    fn wait(&self) -> Duration {
        let now = tokio::time::Instant::now();
        let mut wait = POLL.min(self.renewal.every());
        if let Some(due) = self.due {
            wait = wait.min(soon(due, now));
        }
        if let Some(due) = self.waiting.iter().map(|(due, _)| *due).min() {
            wait = wait.min(due.saturating_duration_since(now));
        }
        wait
    }
}

/// NAKs deliveries in queue order (the server redelivers them so, before anything newer).
async fn hand_back(broker: &JetStream, s: &ConsumerState, mut ids: Vec<u64>) {
    ids.sort_unstable();
    let replies: Vec<String> = {
        let mut replies = lock(&s.own.replies);
        ids.iter().filter_map(|id| replies.remove(id)).collect()
    };
    for reply in replies {
        if let Err(e) = broker.settle(&reply, jetstream::AckKind::Nak(None)).await {
            tracing::warn!(queue = %s.queue, error = %e, "jetstream broker: cannot hand a delivery back; it comes back when its lease runs out");
        }
    }
}

/// What this broker keeps of a delivery to settle and copy it.
pub struct Tag {
    sequence: u64,
    reply: String,
}

/// A delivery from the JetStream broker.
pub type JsDelivery = Kept<Tag>;

/// The deliveries of one consumer.
pub type JsDeliveries = KeptDeliveries<Tag>;

/// A copy of a delivered message with its headers edited.
fn edited(original: &JsDelivery, edits: &Edits, due: Option<u64>) -> Carried {
    Carried { body: original.body.clone(), properties: original.copied_properties(edits), due }
}

/// A consumer of the JetStream broker. Cheap to clone; clones share the consumer.
#[derive(Clone)]
pub struct JsConsumer {
    broker: JetStream,
    state: Arc<ConsumerState>,
}

impl Consumer for JsConsumer {
    type Delivery = JsDelivery;

    /// Each ack is confirmed by the server; a failed one leaves the delivery held, renewed, to
    /// be acked again.
    async fn ack(&self, settled: &[JsDelivery]) -> Result<(), BrokerError> {
        let s = &self.state;
        s.still_open()?;
        let acks = settled.iter().map(|d| async {
            let acked = self.broker.settle(&d.tag.reply, jetstream::AckKind::Ack).await;
            match acked {
                Err(_) if self.broker.gone(&s.queue, d.tag.sequence).await => Ok(()),
                acked => acked,
            }
        });
        let results = futures_util::future::join_all(acks).await;
        let acked: Vec<u64> =
            settled.iter().zip(&results).filter(|(_, r)| r.is_ok()).map(|(d, _)| d.tag.sequence).collect();
        {
            let mut replies = lock(&s.own.replies);
            for id in &acked {
                replies.remove(id);
            }
        }
        s.settled(acked.iter());
        self.broker.register(s).await;
        results.into_iter().find_map(Result::err).map_or(Ok(()), Err)
    }

    async fn cancel(&self) -> Result<(), BrokerError> {
        self.state.cancel();
        Ok(())
    }

    async fn close(&self) {
        let s = &self.state;
        let handing_back = s.own.handing_back.lock().await;
        let held = s.close();
        hand_back(&self.broker, s, held).await;
        drop(handing_back);
        let _ = self.broker.inner.consumers.purge(self.broker.registration(s)).await;
    }
}

impl Broker for JetStream {
    type Delivery = JsDelivery;
    type Deliveries = JsDeliveries;
    type Consumer = JsConsumer;

    /// Checks everything first (a conflict changes nothing), writes what is missing into the
    /// topology (compare-and-set: a concurrent declare is read again), then makes each
    /// queue's stream and consumer.
    async fn declare(&self, plan: &Plan) -> Result<(), BrokerError> {
        if let Some((q, detail)) = plan.queues.iter().find_map(|q| Some((q, refused(q)?))) {
            return Err(BrokerError::Conflict(format!("queue \"{}\": {detail}", q.name).into()));
        }
        for q in &plan.queues {
            self.make_queue(q).await?;
        }
        loop {
            let (mut stored, revision) = self.stored().await?;
            if let Some(Drift::Conflict { what, name, detail }) =
                drift_from(plan, &stored)?.into_iter().find(|d| matches!(d, Drift::Conflict { .. }))
            {
                return Err(BrokerError::Conflict(
                    format!("{what} \"{name}\" conflicts with what exists: {detail}").into(),
                ));
            }
            let before = serde_json::to_string(&stored).unwrap_or_default();
            for x in &plan.exchanges {
                stored.exchanges.entry(x.name.clone()).or_insert_with(|| x.kind.as_str().to_string());
            }
            for q in &plan.queues {
                if !stored.queues.contains_key(&q.name) {
                    let declared = serde_json::to_string(q).map_err(|e| {
                        BrokerError::Conflict(Cause::from_error(e).within(format_args!("queue \"{}\"", q.name)))
                    })?;
                    stored.queues.insert(q.name.clone(), declared);
                }
                match q.max_message_bytes {
                    Some(max) => stored.limits.insert(q.name.clone(), max as u64),
                    None => stored.limits.remove(&q.name),
                };
            }
            for text in plan.bindings.iter().map(binding_text) {
                if !stored.bindings.contains(&text) {
                    stored.bindings.push(text);
                }
            }
            if revision != 0 && serde_json::to_string(&stored).unwrap_or_default() == before {
                return Ok(());
            }
            if self.store(&stored, revision).await? {
                return Ok(());
            }
        }
    }

    async fn unbind(&self, bindings: &[BindingDecl]) -> Result<(), BrokerError> {
        loop {
            let (mut stored, revision) = self.stored().await?;
            let gone: Vec<String> = bindings.iter().map(binding_text).collect();
            let before = stored.bindings.len();
            stored.bindings.retain(|b| !gone.contains(b));
            if stored.bindings.len() == before || self.store(&stored, revision).await? {
                return Ok(());
            }
        }
    }

    async fn copy(&self, original: &JsDelivery, target: Target<'_>, edits: &Edits) -> Result<(), BrokerError> {
        let due = match target {
            Target::Later { delay, .. } => {
                Some(now_ms().saturating_add(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX)))
            }
            Target::Queue(_) | Target::DeadLetter(_) => None,
        };
        let id = uuid::Uuid::now_v7().to_string();
        self.write(target.queue(), "", &edited(original, edits, due), &id).await
    }

    async fn consume(&self, queue: &str, credit: Credit) -> Result<(JsDeliveries, JsConsumer), BrokerError> {
        self.open_consumer(queue, credit.get()).await
    }

    /// Ready: what the stream holds (delayed copies not yet due among it) less what live
    /// consumers hold; consumers: those registered.
    async fn stats(&self, queue: &str) -> Result<QueueStats, BrokerError> {
        let (messages, _) = self.counts(queue).await?;
        let (consumers, held) = self.live(queue).await?;
        let ready = u32::try_from(messages.saturating_sub(held)).unwrap_or(u32::MAX);
        Ok(QueueStats { ready, consumers })
    }

    /// Deliveries not acked (held under a lease, delayed copies put back until due), in every
    /// declared work queue. Dead-letter queues take no delayed copies, and what a browse of
    /// one handed back counts as not acked until it is read again: they are left out.
    async fn delayed(&self) -> Result<u32, BrokerError> {
        let (stored, _) = self.stored().await?;
        let mut total = 0u64;
        for (queue, declaration) in &stored.queues {
            let role: serde_json::Value = serde_json::from_str(declaration).unwrap_or_default();
            if role.get("role").and_then(serde_json::Value::as_str) == Some("dead_letter") {
                continue;
            }
            total += self.counts(queue).await?.1;
        }
        Ok(u32::try_from(total).unwrap_or(u32::MAX))
    }

    fn capabilities(&self) -> crate::broker::Capabilities {
        crate::broker::capabilities::JETSTREAM
    }

    /// Until closed: the client connects again by itself, to another seed when its server is
    /// lost or frozen, and the session's consumers go on through it (pulls failing for
    /// [`LEADERLESS`] end the session). Ending the session at once made the runner hand its
    /// deliveries back and wait for their acks through a server that no longer answers.
    fn is_connected(&self) -> bool {
        self.inner.connected.load(Ordering::SeqCst)
    }

    async fn close(&self) {
        self.inner.connected.store(false, Ordering::SeqCst);
        self.inner.stop.cancel();
    }
}

/// Why this broker refuses a queue's declaration, if it does.
fn refused(q: &crate::topology::QueueDecl) -> Option<String> {
    if q.single_active_consumer {
        return Some(format!(
            "single_active_consumer: {BROKER} cannot honour it (nats-server 2.9 has no pinned consumers); remove ordered: or run on RabbitMQ"
        ));
    }
    unsupported(q, BROKER)
}

impl Publish for JetStream {
    async fn publish(&self, exchange: &str, routing_key: &str, message: Outgoing) -> Result<(), BrokerError> {
        let (body, properties) = kept::published(BROKER, exchange, routing_key, message)?;
        let mut targets = self.route(exchange, routing_key, &properties.headers).await?;
        let message = Carried { body, properties, due: None };
        // One id for every try and every queue: each stream dedups its own copy, and a queue
        // written before a retry below takes its copy once.
        let id = uuid::Uuid::now_v7().to_string();
        let mut fresh = false;
        loop {
            let mut written = Ok(());
            for queue in &targets {
                written = self.write(queue, exchange, &message, &id).await;
                if written.is_err() {
                    break;
                }
            }
            match written {
                // A queue gone since the session's copy was read, or full and unbound since
                // (a reload that removed it): route on the topology now.
                Err(BrokerError::NotFound(_) | BrokerError::Rejected { .. }) if !fresh => {
                    fresh = true;
                    targets =
                        self.topology(true).await?.route(exchange, routing_key, &message.properties.headers, PLACE)?;
                }
                written => return written,
            }
        }
    }

    async fn body_limits(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &Headers,
    ) -> Result<Option<BodyLimits>, BrokerError> {
        let limits = match self.topology(false).await?.body_limits(exchange, routing_key, headers, PLACE) {
            Ok(limits) => limits,
            Err(_) => self.topology(true).await?.body_limits(exchange, routing_key, headers, PLACE)?,
        };
        Ok(Some(limits))
    }
}

impl Operate for JetStream {
    async fn browse(&self, queue: &str, window: Credit) -> Result<(JsDeliveries, JsConsumer), BrokerError> {
        self.open_consumer(queue, window.get()).await
    }

    /// Deliveries of `queue` not acked, as the server counts them (held under a lease, or put
    /// back until due); when the last lease ends is not kept, so it is given as at most one
    /// lease from now.
    async fn leased(&self, queue: &str) -> Result<Option<super::Leased>, BrokerError> {
        let (_, pending) = self.counts(queue).await?;
        Ok(super::Leased::within(pending, self.inner.location.lease))
    }

    async fn drift(&self, plan: &Plan) -> Result<Vec<Drift>, BrokerError> {
        drift_from(plan, &self.stored().await?.0)
    }
}

/// How `stored` differs from `plan`.
fn drift_from(plan: &Plan, stored: &Stored) -> Result<Vec<Drift>, BrokerError> {
    declaration::drift(
        plan,
        Some(BROKER),
        |name| Ok::<_, BrokerError>(stored.exchanges.get(name).cloned()),
        |name| Ok(stored.queues.get(name).cloned()),
        |b| Ok(stored.bindings.contains(&binding_text(b))),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_gives_its_servers_and_parameters() {
        let l = Location::parse("nats://a:4222, tls://u:p@b:4222?prefix=t1&lease=2s&creds=/x.creds").expect("parse");
        assert_eq!(l.servers, ["nats://a:4222", "tls://u:p@b:4222"]);
        assert_eq!((l.prefix.as_str(), l.lease, l.replicas), ("t1", Duration::from_secs(2), 3));
        assert_eq!(l.creds, Some(PathBuf::from("/x.creds")));
        let one = Location::parse("nats://h:4222").expect("parse");
        assert_eq!((one.prefix.as_str(), one.lease, one.replicas), (DEFAULT_PREFIX, LEASE, 1));
        assert_eq!(Location::parse("nats://h?replicas=3").map(|l| l.replicas).ok(), Some(3));
        for bad in ["nats://h?prefix=a.b", "nats://h?lease=1ms", "nats://h?replicas=0", "nats://h?x=1", "http://h"] {
            assert!(Location::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(l.stream("a.b"), "t1_q_612e62");
        assert_eq!(l.subject("a.b"), "t1.q.612e62");
    }
}
