//! The Redis broker: the [`Broker`] trait on Redis 7.0 streams, for teams that run Redis and
//! no RabbitMQ. Many processes on many hosts share one deployment (a key prefix on one server).
//!
//! - The topology (exchanges, queues with their settings, bindings) lives in Redis, so any
//!   process can publish; sluice routes at publish time with [`route`](super::route), as the
//!   embedded broker does, and writes the copy of every queue reached in one script, or none
//!   (a queue at its `max_length` refuses: reject-publish, a nack). A script checks that the
//!   topology is the one routed on (a version bumped by every declare and unbind).
//! - A queue is a stream with one consumer group; a message is one entry whose fields hold the
//!   body and properties. Consumers read new entries with `XREADGROUP` up to their prefetch
//!   and [`CLAIM_BYTES`] of bodies unread; an ack removes the entry (`XACK` + `XDEL`, only
//!   while it is still this consumer's). A redrive moves an entry: its copy written and the
//!   original removed in one script.
//! - Leases are the pending list's idle time: a live consumer renews its entries every third of
//!   the lease; a killed one's are taken back (`XCLAIM`) by the next live consumer once idle
//!   past the lease (default 30 s, `?lease=` in the URL). Closing a consumer hands its
//!   unsettled entries back at once, to be delivered first, in stream order.
//! - A delayed copy waits in a sorted set scored by its due time; consumers move what came
//!   due into the stream (whatever its `max_length`, as RabbitMQ does: see the claim script),
//!   and wait no longer than the earliest due time: delays are exact, with no head-of-line
//!   blocking. Writes wake consumers through a pub/sub channel; a consumer also looks every
//!   [`POLL`] in case a wake-up was lost with a connection.
//! - A single-active-consumer queue delivers only to the holder of a lease key (`SET NX PX`,
//!   renewed by each of its claims, at least every third of the lease). Its close hands the
//!   key over at once; a killed holder's runs out with the lease, and the next consumer takes
//!   it and the entries left.
//!
//! Durability is the server's: Redis answers before it writes to disk unless it runs with
//! `appendonly yes` and `appendfsync always` (see [`Persistence`]); replicas are asynchronous.
//! A session opens only on a server that suits its purpose ([`server`]: the password, a
//! standalone primary, a policy that never evicts, every command it runs); a runner's session
//! watches its server while it lives.
//!
//! URL: `redis://[user:password@]host:port[/db][?prefix=P&lease=DUR]` or `rediss://` (TLS);
//! `prefix` (default `sluice:`) keeps deployments and tests on one server apart. Through
//! Sentinels: `redis+sentinel://[user:password@]s1:26379,s2:26379/MASTER_NAME[/db][?prefix=…]`,
//! the user and password the data nodes' (the sentinels are asked without); the primary they
//! name is checked with `ROLE` and found again after any loss ([`link`]). On a Redis Cluster,
//! `redis+cluster://[user:password@]n1:7000,n2:7000[?prefix=…]`, each queue's keys carry one
//! hash tag (`PREFIX` + `s:{TAG}`: its name, or its name and `~N` where that spreads queues
//! more evenly over the primaries, kept with the topology), so every script on one queue runs
//! on one node; the topology's keys share the tag `{topology}`.
//! What spans queues is done queue by queue there: a fan-out writes each copy apart (a publish
//! refused midway may have reached some queues; its retry reaches them again), a redrive
//! writes the copy, then removes the original.

pub mod link;
mod scripts;
pub(crate) mod server;

pub use server::{Checks, Purpose};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt as _;
use redis::Value;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::link::{Link, Timeouts};
use self::scripts::Scripts;
use super::declaration::{self, unsupported};
use super::kit::claim::{self, Ask, Claimed, Claimer, Holder};
use super::kit::kept::{self, CLAIM_BYTES};
use super::kit::lease::Renewal;
use super::kit::topology::{self, Cache, QueueRule, binding_from, binding_text};
use super::kit::{headers, lock};
use super::render::Picture;
use super::{
    BodyLimits, Broker, BrokerError, Cause, Consumer, Credit, Drift, Edits, Headers, Kept, KeptDeliveries, Operate,
    Outgoing, Properties, Publish, QueueStats, Route, Target,
};
use crate::topology::{BindingDecl, Plan};

/// How long a delivered entry stays leased to its consumer without a renewal, unless the URL
/// says otherwise (`?lease=`).
pub const LEASE: Duration = Duration::from_secs(30);

/// The longest a consumer waits without looking (for a wake-up lost with a connection, and to
/// take back what a closed consumer handed back or a dead one left).
pub const POLL: Duration = Duration::from_secs(1);

/// How long a consumer counts as live after its last claim (it claims at least every [`POLL`]).
const REGISTRATION: Duration = Duration::from_secs(3);

/// This broker, as a refused declaration names it.
const BROKER: &str = "the Redis broker";

/// Where this broker looks for declarations, as a refusal on an empty one says.
const PLACE: &str = "under this prefix";

/// The value of an idempotency key recorded done.
pub const DONE: &str = "done";

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "sluice:";

/// Where a deployment is: the server's URL (without sluice's own parameters), the key prefix
/// and the lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub url: String,
    pub prefix: String,
    pub lease: Duration,
    /// How many replicas must have a publish, a copy or an ack before it counts as done
    /// (`?wait=N`, `WAIT`); 0: none (replication is asynchronous).
    pub wait: u32,
    /// A Redis Cluster (`redis+cluster://`): each queue's keys carry its name as their hash
    /// tag, so that they share a slot (a script touches one node) and queues spread over the
    /// primaries.
    pub cluster: bool,
}

/// How long a write waits for the replicas `?wait=` asks for before it fails.
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(5);

impl Location {
    /// Parses `redis://…`, `rediss://…` or `redis+sentinel://…`, taking `prefix`, `lease` and
    /// `wait` out of the query.
    pub fn parse(url: &str) -> Result<Location, BrokerError> {
        let bad = |reason: String| BrokerError::Connect { url: super::amqp::redact(url), reason: reason.into() };
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let (mut prefix, mut lease, mut wait, mut rest) = (DEFAULT_PREFIX.to_string(), LEASE, 0, Vec::new());
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("prefix", value)) if !value.is_empty() => prefix = value.to_string(),
                Some(("lease", value)) => {
                    lease =
                        crate::vocab::parse_duration(value).filter(|d| *d >= Duration::from_millis(300)).ok_or_else(
                            || bad(format!("lease={value}: expected a duration of at least 300ms, e.g. 30s")),
                        )?;
                }
                Some(("wait", value)) => {
                    wait = value.parse().map_err(|_| {
                        bad(format!("wait={value}: expected how many replicas must have a write, e.g. 1"))
                    })?;
                }
                Some(("prefix", _)) => return Err(bad("prefix= is empty".into())),
                _ => rest.push(pair),
            }
        }
        let url = if rest.is_empty() { base.to_string() } else { format!("{base}?{}", rest.join("&")) };
        let cluster = url.starts_with(link::CLUSTER);
        if cluster && prefix.contains(['{', '}']) {
            return Err(bad(format!(
                "prefix={prefix}: on a Redis Cluster the prefix may not hold {{ or }} (sluice puts each queue's hash tag in braces)"
            )));
        }
        Ok(Location { url, prefix, lease, wait, cluster })
    }

    /// A key of the topology (`v`, `x`, `q`, `limits`, `b`): `PREFIX` + `what`; on a cluster
    /// all in the slot of the hash tag `{topology}`, read and written together.
    pub fn topology_key(&self, what: &str) -> String {
        if self.cluster { format!("{}{{topology}}:{what}", self.prefix) } else { format!("{}{what}", self.prefix) }
    }

    /// A key of a queue's (`kind` `s` its stream, `d` its delayed copies, `c` its consumers,
    /// `sac` its single-active lease), `queue` its name, or on a cluster its hash tag:
    /// `PREFIX` + `kind:queue`, on a cluster `PREFIX` + `kind:{tag}`.
    pub fn queue_key(&self, kind: &str, queue: &str) -> String {
        if self.cluster {
            format!("{}{kind}:{{{queue}}}", self.prefix)
        } else {
            format!("{}{kind}:{queue}", self.prefix)
        }
    }

    /// An idempotency key's name (`key` is `QUEUE\0KEY`, as `crate::dedup` names it, the queue
    /// given by its hash tag on a cluster): the store's keys beside the broker's, which the
    /// broker's acks can record done; `PREFIX` + `dedup:` + `key`, on a cluster in the queue's
    /// slot (`PREFIX` + `dedup:{TAG}\0KEY`): a queue's messages wait on no other node.
    pub fn idempotency_key(&self, key: &str) -> String {
        match key.split_once('\0') {
            Some((queue, key)) if self.cluster => format!("{}dedup:{{{queue}}}\0{key}", self.prefix),
            _ => format!("{}dedup:{key}", self.prefix),
        }
    }

    /// What a delayed copy's key (its fields) starts with, its id following: `PREFIX` + `m:`;
    /// on a cluster in its queue's slot, `PREFIX` + `m:{queue}:`.
    fn delayed_prefix(&self, queue: &str) -> String {
        if self.cluster { format!("{}m:{{{queue}}}:", self.prefix) } else { format!("{}m:", self.prefix) }
    }
}

/// What `sluice plan --broker redis://…` shows: the plan as this broker keeps it under the
/// location's prefix, with each queue's stream.
pub fn picture(plan: &Plan, location: &Location) -> Picture {
    let prefix = &location.prefix;
    if location.cluster {
        let title = format!(
            "the Redis broker on a Redis Cluster, keys under {prefix:?} (a stream and a consumer group for each queue; a queue's keys in one slot, its hash tag its name, or its name and ~N where that spreads the queues evenly: `plan --broker` names each queue's stream and node)"
        );
        let delays =
            "delays: a retry waits in a sorted set of its queue's until it is due (exact: no delay queues)".to_string();
        return declaration::picture(plan, BROKER, title, delays, |_| None);
    }
    let title = format!("the Redis broker, keys under {prefix:?} (a stream and a consumer group for each queue)");
    let delays = format!(
        "delays: a retry waits in the sorted set {} until it is due (exact: no delay queues)",
        location.queue_key("d", "QUEUE")
    );
    declaration::picture(plan, BROKER, title, delays, |q| Some(("stream", format!("{:?}", location.queue_key("s", q)))))
}

/// What the server says of its persistence (`CONFIG GET`), for the start line and `plan`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Persistence {
    pub appendonly: String,
    pub appendfsync: String,
    pub save: String,
    /// The replicas a write waits for (`?wait=`): 0, replication is asynchronous.
    pub wait: u32,
}

impl Persistence {
    /// Whether a restart of the server would lose queued messages: without the append-only
    /// file, everything since the last snapshot (or everything, with no snapshots).
    pub fn loses_on_restart(&self) -> bool {
        self.appendonly != "yes"
    }

    /// A warning to show, when the server's persistence loses messages.
    pub fn warning(&self) -> Option<String> {
        if self.loses_on_restart() {
            Some(format!(
                "Redis runs with appendonly no (save \"{}\"): a restart loses the messages queued since the last snapshot; set appendonly yes and appendfsync always to lose nothing confirmed",
                self.save
            ))
        } else if self.appendfsync != "always" {
            Some(format!(
                "Redis runs with appendfsync {}: a machine crash (not a restart) may lose about a second of confirmed messages; appendfsync always loses none",
                self.appendfsync
            ))
        } else {
            None
        }
    }
}

impl std::fmt::Display for Persistence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "appendonly {}, appendfsync {}, save \"{}\"", self.appendonly, self.appendfsync, self.save)?;
        match self.wait {
            0 => write!(
                f,
                "; replication asynchronous: a confirmed publish or ack can be lost when the primary dies before a replica has it (?wait=1 waits for one)"
            ),
            n => write!(f, "; a publish, a copy and an ack wait for {n} replica(s) (?wait={n})"),
        }
    }
}

/// The topology as Redis keeps it: the version (empty when none), exchanges' kinds, queues'
/// declarations, their body limits, the bindings (their JSON), and on a cluster each queue's
/// hash tag.
struct Stored {
    version: String,
    exchanges: HashMap<String, String>,
    queues: HashMap<String, String>,
    limits: HashMap<String, String>,
    bindings: Vec<String>,
    tags: HashMap<String, String>,
}

/// What the read script answers: the version, then the flat lists of exchanges, queues,
/// limits, bindings and tags.
type Read = (String, Vec<String>, Vec<String>, Vec<String>, Vec<String>, Vec<String>);

/// The topology as last read (its version is the `v` key's value, empty when none).
type Topology = topology::Topology<String>;

/// `queue`'s maximum length as the scripts take it (empty: none).
fn max_length(t: &Topology, queue: &str) -> String {
    t.queues.get(queue).and_then(|r| r.max_length).map(|m| m.to_string()).unwrap_or_default()
}

/// A session with a Redis deployment. Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct Redis {
    inner: Arc<Inner>,
}

struct Inner {
    connection: Link,
    location: Location,
    /// The URL without its password, for messages.
    shown: String,
    scripts: Scripts,
    topology: Cache<String>,
    /// On a cluster, each queue's hash tag as the topology last read said ([`Redis::tag`]).
    tags: Mutex<HashMap<String, String>>,
    /// Per queue: poked when its stream may have something new (the wake channel).
    wakers: Mutex<HashMap<String, Arc<Notify>>>,
    listening: AtomicBool,
    connected: AtomicBool,
    stop: CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A Redis error as the broker's: a lost connection can be retried on another session. A
/// refusal for the server's memory says so.
fn lost(e: redis::RedisError) -> BrokerError {
    let context = match e.code() {
        Some("OOM") => {
            "redis: the server is over its maxmemory and refuses what would grow it (maxmemory-policy noeviction) until consumers drain it or maxmemory is raised"
        }
        _ => "redis",
    };
    BrokerError::Lost(Cause::from_error(e).within(context))
}

impl Redis {
    /// Connects to the deployment `url` names, for an operator's command (the password and a
    /// standalone primary are checked).
    pub async fn connect(url: &str) -> Result<Redis, BrokerError> {
        Redis::open(url, &Checks::default()).await
    }

    /// Connects to the deployment `url` names once the server passes `checks` (refused with
    /// what is wrong otherwise); a runner's session watches the server from then on.
    pub async fn open(url: &str, checks: &Checks) -> Result<Redis, BrokerError> {
        let location = Location::parse(url)?;
        let shown = super::amqp::redact(url);
        let timeouts = Timeouts { connect: Duration::from_secs(5), response: Duration::from_secs(15) };
        let mut connection =
            Link::open(&location.url, timeouts, 2).await.map_err(|e| server::opening_error(&shown, e))?;
        let user = connection.user();
        server::check(&mut connection, &location, &user, &shown, checks).await?;
        let inner = Arc::new(Inner {
            connection,
            location,
            shown,
            scripts: Scripts::new(),
            topology: Cache::default(),
            wakers: Mutex::new(HashMap::new()),
            tags: Mutex::new(HashMap::new()),
            listening: AtomicBool::new(false),
            connected: AtomicBool::new(true),
            stop: CancellationToken::new(),
        });
        if checks.purpose() == Purpose::Run {
            server::describe();
            tokio::spawn(watch(Arc::downgrade(&inner), checks.clone(), inner.stop.clone()));
        }
        Ok(Redis { inner })
    }

    /// The key prefix of this deployment.
    pub fn prefix(&self) -> &str {
        &self.inner.location.prefix
    }

    /// The server's persistence settings, when `CONFIG GET` is allowed (managed services
    /// often refuse it); on a cluster, the weakest of its primaries'.
    pub async fn persistence(&self) -> Option<Persistence> {
        let mut weakest: Option<Persistence> = None;
        for mut node in self.conn().primaries().await.ok()? {
            let get = |name: &'static str| {
                let mut cmd = redis::cmd("CONFIG");
                cmd.arg("GET").arg(name);
                cmd
            };
            let mut pipe = redis::pipe();
            pipe.add_command(get("appendonly")).add_command(get("appendfsync")).add_command(get("save"));
            let answers: Vec<Vec<String>> = pipe.query_async(&mut node).await.ok()?;
            let value = |i: usize| answers.get(i).and_then(|a| a.get(1)).cloned();
            let found = Persistence {
                appendonly: value(0)?,
                appendfsync: value(1)?,
                save: value(2)?,
                wait: self.inner.location.wait,
            };
            let rank = |p: &Persistence| (p.loses_on_restart(), p.appendfsync != "always");
            if weakest.as_ref().is_none_or(|w| rank(&found) > rank(w)) {
                weakest = Some(found);
            }
        }
        weakest
    }

    /// On a cluster, brings each queue's own copy of the topology's version (`PREFIX` +
    /// `v:{queue}`, in its slot) up to `version`: a publish's script checks the copy of each
    /// queue it writes, so that no copy is written on a route older than a declare that
    /// ended, and a publish never waits on the node that holds the topology. Never lowers a
    /// copy (declares may race).
    async fn spread_version(&self, queues: &[String], version: &str) -> Result<(), BrokerError> {
        if !self.inner.location.cluster {
            return Ok(());
        }
        let each = queues.iter().map(|q| async move {
            let mut c = self.conn();
            self.inner.scripts.version.key(self.queue_key("v", q)).arg(version).invoke_async::<()>(&mut c).await
        });
        futures_util::future::try_join_all(each).await.map(|_| ()).map_err(lost)
    }

    /// On a cluster, gives each queue of `plan` that has none a hash tag that puts it on a
    /// primary holding the fewest of the deployment's queues: its name when that is one of
    /// them, else its name and `~N`, the first N that is. The tags are kept with the topology
    /// (`tags`), so that every process names a queue's keys alike, and never change (a queue's
    /// keys stay where they are; a slot an operator moves takes them along).
    async fn spread(&self, plan: &Plan, mut tags: HashMap<String, String>) -> Result<(), BrokerError> {
        let untagged: Vec<&String> = plan.queues.iter().map(|q| &q.name).filter(|q| !tags.contains_key(*q)).collect();
        if untagged.is_empty() {
            // Every queue has its tag (a runner starting again): nothing to ask the nodes.
            *lock(&self.inner.tags) = tags;
            return Ok(());
        }
        let location = &self.inner.location;
        let conn = self.conn();
        let holder = |tag: String| {
            let conn = conn.clone();
            async move { conn.holder(&location.queue_key("s", &tag)).await.map(Option::unwrap_or_default).map_err(lost) }
        };
        let mut load: HashMap<String, usize> =
            conn.primaries().await.map_err(lost)?.iter().filter_map(|p| Some((p.node()?, 0))).collect();
        for tag in tags.values() {
            *load.entry(holder(tag.clone()).await?).or_default() += 1;
        }
        for q in untagged {
            let least = load.values().min().copied().unwrap_or(0);
            let mut chosen = (q.clone(), holder(q.clone()).await?);
            for n in 1..64 {
                if load.get(&chosen.1).copied().unwrap_or(0) <= least {
                    break;
                }
                let tag = format!("{q}~{n}");
                chosen = (tag.clone(), holder(tag).await?);
            }
            redis::cmd("HSETNX")
                .arg(self.key("tags"))
                .arg(q)
                .arg(&chosen.0)
                .query_async::<()>(&mut self.conn())
                .await
                .map_err(lost)?;
            *load.entry(chosen.1).or_default() += 1;
            tags.insert(q.clone(), chosen.0);
        }
        // Another process's declare may have tagged a queue first: its tag stands.
        let stored: HashMap<String, String> =
            redis::cmd("HGETALL").arg(self.key("tags")).query_async(&mut self.conn()).await.map_err(lost)?;
        *lock(&self.inner.tags) = stored;
        Ok(())
    }

    /// Where `queue` is: its stream's key and the node (`HOST:PORT`) that holds it.
    pub async fn holder(&self, queue: &str) -> Result<(String, String), BrokerError> {
        self.tags_known(&[queue]).await?;
        let stream = self.stream(queue);
        let node = self.conn().holder(&stream).await.map_err(lost)?;
        Ok((stream, node.unwrap_or_else(|| self.inner.shown.clone())))
    }

    fn conn(&self) -> Link {
        self.inner.connection.clone()
    }

    fn key(&self, what: &str) -> String {
        self.inner.location.topology_key(what)
    }

    fn queue_key(&self, kind: &str, queue: &str) -> String {
        self.inner.location.queue_key(kind, &self.tag(queue))
    }

    /// `queue`'s hash tag on a cluster: the one declared for it (its name, or its name and
    /// `~N` where that spreads the queues more evenly over the primaries: [`Redis::spread`]),
    /// known once the topology is read; its name elsewhere.
    fn tag(&self, queue: &str) -> String {
        lock(&self.inner.tags).get(queue).cloned().unwrap_or_else(|| queue.to_string())
    }

    /// Reads the topology when `queues` are not all known to it, on a cluster: their keys are
    /// named by their hash tags.
    async fn tags_known(&self, queues: &[&str]) -> Result<(), BrokerError> {
        if self.inner.location.cluster && queues.iter().any(|q| !lock(&self.inner.tags).contains_key(*q)) {
            self.topology(true).await?;
        }
        Ok(())
    }

    /// An idempotency key's name (`key` is `QUEUE\0KEY`), in its queue's slot on a cluster.
    fn idempotency_key(&self, key: &str) -> String {
        match key.split_once('\0') {
            Some((queue, key)) => self.inner.location.idempotency_key(&format!("{}\0{key}", self.tag(queue))),
            None => self.inner.location.idempotency_key(key),
        }
    }

    fn stream(&self, queue: &str) -> String {
        self.queue_key("s", queue)
    }

    fn wake_channel(&self) -> String {
        format!("{}wake", self.inner.location.prefix)
    }

    /// The topology, read again when `stale` or never read.
    async fn topology(&self, stale: bool) -> Result<Arc<Topology>, BrokerError> {
        if !stale && let Some(t) = self.inner.topology.get() {
            return Ok(t);
        }
        let Stored { version, exchanges, queues, limits, bindings, tags } = self.stored().await?;
        *lock(&self.inner.tags) = tags;
        let exchanges =
            exchanges.into_iter().filter_map(|(name, kind)| Some((name, topology::exchange_kind(&kind)?))).collect();
        let queues = queues
            .into_iter()
            .map(|(name, declaration)| {
                let d: serde_json::Value = serde_json::from_str(&declaration).unwrap_or_default();
                let rule = QueueRule {
                    max_length: d.get("max_length").and_then(serde_json::Value::as_u64),
                    single_active: d.get("single_active_consumer").and_then(serde_json::Value::as_bool) == Some(true),
                    max_body: limits.get(&name).and_then(|m| m.parse().ok()),
                    dead_letter: None,
                };
                (name, rule)
            })
            .collect();
        let bindings = bindings.iter().filter_map(|b| binding_from(b)).collect();
        Ok(self.inner.topology.keep(Topology { version, exchanges, queues, bindings }))
    }

    /// The topology as stored, read at once without writing (on a full server too).
    async fn stored(&self) -> Result<Stored, BrokerError> {
        let (version, exchanges, queues, limits, bindings, tags): Read = self
            .inner
            .scripts
            .read
            .key(self.key("v"))
            .key(self.key("x"))
            .key(self.key("q"))
            .key(self.key("limits"))
            .key(self.key("b"))
            .key(self.key("tags"))
            .invoke_async(&mut self.conn())
            .await
            .map_err(lost)?;
        let pairs = |flat: Vec<String>| -> HashMap<String, String> {
            let mut flat = flat.into_iter();
            std::iter::from_fn(|| Some((flat.next()?, flat.next()?))).collect()
        };
        Ok(Stored {
            version,
            exchanges: pairs(exchanges),
            queues: pairs(queues),
            limits: pairs(limits),
            bindings,
            tags: pairs(tags),
        })
    }

    /// Writes `message` into every queue of `targets` or none, under topology version
    /// `version` (`*`: any), refused by a full queue as a nack on `exchange`; by `script`, the
    /// publish script or its copy's. On a cluster, where a script touches one slot, each
    /// queue's copy is written apart, the version checked against the queue's own copy of it
    /// ([`Redis::spread_version`]), and a refusal can come after some queues have theirs.
    async fn write(
        &self,
        t: &Topology,
        (version, script): (&str, &redis::Script),
        targets: &[String],
        exchange: &str,
        message: &Message,
    ) -> Result<Written, BrokerError> {
        let fields = message.fields();
        let invoke = |version_key: String, version: &str, queues: &[String]| {
            let mut invocation = script.prepare_invoke();
            invocation.key(version_key).arg(version);
            for q in queues {
                invocation.key(self.stream(q)).arg(max_length(t, q));
            }
            invocation.arg(self.wake_channel());
            for (name, value) in &fields {
                invocation.arg(*name).arg(value.as_slice());
            }
            invocation
        };
        if !self.inner.location.cluster {
            let invocation = invoke(self.key("v"), version, targets);
            let answer: String = self.durable(&self.key("v"), &invocation).await?;
            return answer_of(&answer, targets, exchange);
        }
        for (i, q) in targets.iter().enumerate() {
            // The queue's own copy of the version, in its slot.
            let invocation = invoke(self.queue_key("v", q), version, std::slice::from_ref(q));
            let answer: String = self.durable(&self.stream(q), &invocation).await?;
            match answer_of(&answer, std::slice::from_ref(q), exchange)? {
                Written::Ok => {}
                refused => {
                    if i > 0 {
                        tracing::debug!(queue = %q, "redis cluster: a fan-out refused after {i} queue(s) had their copy");
                    }
                    return Ok(refused);
                }
            }
        }
        Ok(Written::Ok)
    }

    /// Runs a script that writes what must not be lost, `key` its first key: with `?wait=N`,
    /// done only once `N` replicas have it (`WAIT`, on the connection the script ran on: on a
    /// cluster, the one to `key`'s primary), and failed (to be retried) when they do not
    /// within [`WAIT_TIMEOUT`].
    async fn durable<T: redis::FromRedisValue>(
        &self,
        key: &str,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, BrokerError> {
        let wait = self.inner.location.wait;
        if wait == 0 {
            return invocation.invoke_async(&mut self.conn()).await.map_err(lost);
        }
        let mut c = self.conn().pinned().await.map_err(lost)?;
        let answer = invocation.invoke_async(&mut c).await.map_err(lost)?;
        self.waited(&mut c, key).await?;
        Ok(answer)
    }

    /// Waits for the replicas `?wait=` asks for to have what `c` wrote to `key`'s node.
    async fn waited(&self, c: &mut Link, key: &str) -> Result<(), BrokerError> {
        let wait = self.inner.location.wait;
        let replicas = c.wait(key, wait, WAIT_TIMEOUT).await.map_err(lost)?;
        if replicas < wait {
            return Err(BrokerError::Lost(
                format!(
                    "redis: {replicas} replica(s) had a write within {WAIT_TIMEOUT:?}, and ?wait={wait} asks for {wait}: not counted done"
                )
                .into(),
            ));
        }
        Ok(())
    }

    /// Writes a copy into `queue` alone (delayed when `delay` is not zero).
    async fn send_copy(&self, queue: &str, delay: Duration, message: &Message) -> Result<(), BrokerError> {
        let targets = [queue.to_string()];
        if delay.is_zero() {
            let copy = ("*", &self.inner.scripts.copy);
            let t = self.topology(false).await?;
            let written = match self.write(&t, copy, &targets, "", message).await? {
                Written::Missing(_) => {
                    let t = self.topology(true).await?;
                    self.write(&t, copy, &targets, "", message).await?
                }
                w => w,
            };
            return written.done(queue);
        }
        self.tags_known(&[queue]).await?;
        let id = uuid::Uuid::now_v7().to_string();
        let mut invocation = self.inner.scripts.delay.prepare_invoke();
        invocation
            .key(self.queue_key("d", queue))
            .key(format!("{}{id}", self.inner.location.delayed_prefix(&self.tag(queue))))
            .key(self.stream(queue))
            .arg(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX))
            .arg(&id)
            .arg(self.wake_channel());
        for (name, value) in message.fields() {
            invocation.arg(name).arg(value);
        }
        let answer: String = self.durable(&self.queue_key("d", queue), &invocation).await?;
        answer_of(&answer, &targets, "")?.done(queue)
    }

    /// Writes `message` into `queue` and removes entry `id` of consumer `s` in one script,
    /// while the entry is still the consumer's. On a cluster two queues are in two slots
    /// (mostly): the copy is written, then the entry removed, so that a move whose answer was
    /// lost between the two leaves the message in both queues (its copy keeps its id: an
    /// idempotency key stops a second side effect), never in neither.
    async fn move_copy(&self, queue: &str, s: &ConsumerState, id: &str, message: &Message) -> Result<(), BrokerError> {
        self.tags_known(&[&s.queue, queue]).await?;
        let (from, to) = (self.stream(&s.queue), self.stream(queue));
        if self.inner.location.cluster && !link::same_slot(&from, &to) {
            let pending: Vec<Value> = redis::cmd("XPENDING")
                .arg(&from)
                .arg("g")
                .arg(id)
                .arg(id)
                .arg(1)
                .arg(&s.own.name)
                .query_async(&mut self.conn())
                .await
                .map_err(lost)?;
            if pending.is_empty() {
                return Err(gone(&s.queue));
            }
            self.send_copy(queue, Duration::ZERO, message).await?;
            let removed = self.ack_entries(s, [id]).await?;
            if removed == 0 {
                tracing::warn!(queue = %s.queue, to = %queue, "redis cluster: a message moved was taken by another consumer before its removal: it is in both queues");
            }
            return Ok(());
        }
        let targets = [queue.to_string()];
        let mut stale = false;
        loop {
            let t = self.topology(stale).await?;
            let mut invocation = self.inner.scripts.move_entry.prepare_invoke();
            invocation.key(&from).key(&to).arg(&s.own.name).arg(id).arg(max_length(&t, queue)).arg(self.wake_channel());
            for (name, value) in message.fields() {
                invocation.arg(name).arg(value);
            }
            let answer: String = self.durable(&from, &invocation).await?;
            if answer == "GONE" {
                return Err(gone(&s.queue));
            }
            match answer_of(&answer, &targets, "")? {
                Written::Missing(_) if !stale => stale = true,
                written => return written.done(queue),
            }
        }
    }

    /// Acks and removes the entries `ids` of consumer `s` that are still its own: how many.
    async fn ack_entries<'a>(
        &self,
        s: &ConsumerState,
        ids: impl IntoIterator<Item = &'a str>,
    ) -> Result<i64, BrokerError> {
        let stream = self.stream(&s.queue);
        let mut invocation = self.inner.scripts.ack.key(&stream);
        invocation.arg(&s.own.name);
        for id in ids {
            invocation.arg(id);
        }
        self.durable(&stream, &invocation).await
    }

    /// The notifier of `queue`'s consumers in this session, listening on the wake channel
    /// from the first.
    fn waker(&self, queue: &str) -> Arc<Notify> {
        if !self.inner.listening.swap(true, Ordering::SeqCst) {
            tokio::spawn(listen(Arc::downgrade(&self.inner), self.wake_channel(), self.inner.stop.clone()));
        }
        lock(&self.inner.wakers).entry(self.stream(queue)).or_default().clone()
    }

    async fn open_consumer(&self, queue: &str, prefetch: u16) -> Result<(RedisDeliveries, RedisConsumer), BrokerError> {
        let t = self.topology(false).await?;
        let t = if t.queues.contains_key(queue) { t } else { self.topology(true).await? };
        let rule = t.queues.get(queue).ok_or_else(|| t.missing("queue", queue, PLACE))?;
        let member = Member { name: uuid::Uuid::now_v7().to_string(), single_active: rule.single_active };
        let state = Arc::new(Holder::new(queue, prefetch, member));
        if rule.single_active {
            // As on RabbitMQ, the first consumer to attach is the active one: it takes the
            // lease now, not when its task first runs (a later consumer's task may run first).
            let _: Option<String> = self
                .inner
                .scripts
                .lease
                .key(self.queue_key("sac", queue))
                .arg(&state.own.name)
                .arg(u64::try_from(self.inner.location.lease.as_millis()).unwrap_or(u64::MAX))
                .invoke_async(&mut self.conn())
                .await
                .map_err(lost)?;
        }
        let renewal = Renewal::new(self.inner.location.lease);
        let wake = self.waker(queue);
        let claimer = RedisClaimer { broker: self.clone(), wake, renewal, last_reclaim: None, failures: 0 };
        let deliveries = claim::start(claimer, &state);
        Ok((deliveries, RedisConsumer { broker: self.clone(), state }))
    }

    /// What `queue`'s stream holds: ready, live consumers, leased, delayed.
    async fn counts(&self, queue: &str) -> Result<[u32; 4], BrokerError> {
        let t = self.topology(false).await?;
        let t = if t.queues.contains_key(queue) { t } else { self.topology(true).await? };
        if !t.queues.contains_key(queue) {
            return Err(t.missing("queue", queue, PLACE));
        }
        let counts: Vec<i64> = self
            .inner
            .scripts
            .counts
            .key(self.stream(queue))
            .key(self.queue_key("c", queue))
            .key(self.queue_key("d", queue))
            .arg(u64::try_from(self.inner.location.lease.as_millis()).unwrap_or(u64::MAX))
            .invoke_async(&mut self.conn())
            .await
            .map_err(lost)?;
        let at = |i: usize| u32::try_from(counts.get(i).copied().unwrap_or(0).max(0)).unwrap_or(u32::MAX);
        Ok([at(0), at(1), at(2), at(3)])
    }
}

/// A message of `queue` no longer the consumer's.
fn gone(queue: &str) -> BrokerError {
    BrokerError::Lost(
        format!("a message of \"{queue}\" is no longer this consumer's (its lease ran out, or the consumer closed)")
            .into(),
    )
}

/// The outcome of a write script.
enum Written {
    Ok,
    Stale,
    /// The queue (by name) has no stream: undeclared.
    Missing(String),
}

impl Written {
    fn done(self, queue: &str) -> Result<(), BrokerError> {
        match self {
            Written::Ok => Ok(()),
            Written::Stale => Err(BrokerError::Lost("the topology kept changing during a publish".into())),
            Written::Missing(q) => {
                Err(BrokerError::NotFound(format!("queue \"{}\"", if q.is_empty() { queue } else { &q }).into()))
            }
        }
    }
}

/// Reads a write script's answer; a full queue refuses the message (`exchange` names it).
fn answer_of(answer: &str, targets: &[String], exchange: &str) -> Result<Written, BrokerError> {
    let nth =
        |i: &str| i.parse::<usize>().ok().and_then(|i| targets.get(i.wrapping_sub(1))).cloned().unwrap_or_default();
    match answer.split_once(':') {
        None if answer == "OK" => Ok(Written::Ok),
        None if answer == "STALE" => Ok(Written::Stale),
        Some(("MISSING", i)) => Ok(Written::Missing(nth(i))),
        Some(("FULL", i)) => {
            let queue = nth(i);
            tracing::debug!(queue = %queue, "redis broker: queue full, publish refused (reject-publish)");
            Err(BrokerError::Rejected { exchange: exchange.into(), reason: format!("queue \"{queue}\" is full") })
        }
        _ => Err(BrokerError::Lost(format!("redis: unexpected answer from a script: {answer}").into())),
    }
}

/// Listens on the wake channel, poking the consumers of the stream each message names;
/// reconnects after a loss (consumers look every [`POLL`] meanwhile). Ends with the session.
async fn listen(inner: Weak<Inner>, channel: String, stop: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(link) = inner.upgrade().map(|i| i.connection.clone()) else { return };
        let subscribed = async {
            let mut pubsub = link.pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        let pubsub = tokio::select! {
            () = stop.cancelled() => return,
            p = subscribed => p,
        };
        if let Ok(mut pubsub) = pubsub {
            backoff = Duration::from_millis(100);
            let mut messages = pubsub.on_message();
            loop {
                let message = tokio::select! {
                    () = stop.cancelled() => return,
                    m = messages.next() => m,
                };
                let Some(message) = message else { break };
                let Some(inner) = inner.upgrade() else { return };
                let stream: String = message.get_payload().unwrap_or_default();
                if let Some(notify) = lock(&inner.wakers).get(&stream) {
                    notify.notify_waiters();
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// A message's body and properties, as a stream entry's fields hold them.
#[derive(Debug, Clone, Default)]
struct Message {
    body: Bytes,
    properties: Properties,
}

impl Message {
    /// The entry's fields: body `b`, then the properties present.
    fn fields(&self) -> Vec<(&'static str, Vec<u8>)> {
        let mut fields = vec![("b", self.body.to_vec())];
        let p = &self.properties;
        if let Some(id) = &p.message_id {
            fields.push(("i", id.clone().into_bytes()));
        }
        if let Some(kind) = &p.kind {
            fields.push(("k", kind.clone().into_bytes()));
        }
        if let Some(content_type) = &p.content_type {
            fields.push(("c", content_type.clone().into_bytes()));
        }
        if let Some(ts) = p.timestamp {
            fields.push(("t", ts.to_string().into_bytes()));
        }
        if !p.headers.is_empty() {
            fields.push(("h", headers::encode(&p.headers).into_bytes()));
        }
        if let Some(route) = &p.route {
            fields.push(("x", route.exchange.clone().into_bytes()));
            fields.push(("r", route.routing_key.clone().into_bytes()));
        }
        fields
    }

    /// Reads an entry's fields (name, value, name, value, ...).
    fn from_fields(fields: &[Value]) -> Message {
        let mut m = Message::default();
        let (mut exchange, mut routing_key) = (None, None);
        for pair in fields.chunks(2) {
            let [Value::BulkString(name), Value::BulkString(value)] = pair else { continue };
            let text = || String::from_utf8_lossy(value).into_owned();
            match name.as_slice() {
                b"b" => m.body = Bytes::copy_from_slice(value),
                b"i" => m.properties.message_id = Some(text()),
                b"k" => m.properties.kind = Some(text()),
                b"c" => m.properties.content_type = Some(text()),
                b"t" => m.properties.timestamp = text().parse().ok(),
                b"h" => m.properties.headers = headers::decode_lossy(value),
                b"x" => exchange = Some(text()),
                b"r" => routing_key = Some(text()),
                _ => {}
            }
        }
        if let (Some(exchange), Some(routing_key)) = (exchange, routing_key) {
            m.properties.route = Some(Route { exchange, routing_key });
        }
        m
    }
}

/// A consumer as the Redis broker keeps it.
type ConsumerState = Holder<String, Member>;

/// What the Redis broker keeps of a consumer besides what it holds.
struct Member {
    /// Its name in the consumer group.
    name: String,
    single_active: bool,
}

/// A consumer's claims: what fits its prefetch, while its stream holds less than
/// [`CLAIM_BYTES`] unread, when woken (a write to its stream, an ack, a read that makes room)
/// or at the latest after [`POLL`] or when the earliest delayed copy comes due. Each claim is
/// one script that also registers the consumer, moves what came due into the stream, takes
/// back what a dead consumer left (at most every [`POLL`]) and renews its leases every third
/// of the lease.
struct RedisClaimer {
    broker: Redis,
    wake: Arc<Notify>,
    renewal: Renewal,
    last_reclaim: Option<Instant>,
    /// Claims failed in a row.
    failures: u32,
}

impl Claimer for RedisClaimer {
    type Id = String;
    type Tag = Entry;
    type Own = Member;

    fn id(entry: &Entry) -> String {
        entry.id.clone()
    }

    fn wake(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    async fn claim(&mut self, s: &ConsumerState, ask: Ask) -> Claimed<Entry> {
        let broker = &self.broker;
        let lease = broker.inner.location.lease;
        let renew = self.renewal.is_due();
        let reclaim = ask.delivering && self.last_reclaim.is_none_or(|at| at.elapsed() >= POLL);
        // Only what this consumer knows it holds is renewed: an entry a claim took whose answer
        // was lost (a connection that broke, a server restarted) goes idle, and comes back.
        let held: Vec<String> = if renew { s.held() } else { Vec::new() };
        let claimed: Result<Vec<Value>, _> = broker
            .inner
            .scripts
            .claim
            .key(broker.stream(&s.queue))
            .key(broker.queue_key("d", &s.queue))
            .key(broker.queue_key("sac", &s.queue))
            .key(broker.queue_key("c", &s.queue))
            .arg(&s.own.name)
            .arg(ask.room)
            .arg(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX))
            .arg(u8::from(reclaim))
            .arg(broker.inner.location.delayed_prefix(&broker.tag(&s.queue)))
            .arg(u8::from(renew))
            .arg(u8::from(s.own.single_active))
            .arg(u64::try_from(REGISTRATION.as_millis()).unwrap_or(u64::MAX))
            .arg(CLAIM_BYTES)
            .arg(held)
            .invoke_async(&mut broker.conn())
            .await;
        // A short lease (`?lease=`) is renewed in time too.
        let mut wait = POLL.min(self.renewal.every());
        let answer = match claimed {
            Ok(answer) => answer,
            Err(e) => {
                self.failures += 1;
                tracing::warn!(queue = %s.queue, error = %e, "redis broker: cannot claim messages; trying again");
                // A consumer that cannot reach Redis for a lease's time has lost its leases:
                // its stream ends, and the runtime reconnects.
                let failed = (self.failures >= 5).then(|| lost(e));
                return Claimed { within: Some(wait), failed, ..Claimed::default() };
            }
        };
        self.failures = 0;
        if renew {
            self.renewal.renewed();
        }
        if reclaim {
            self.last_reclaim = Some(Instant::now());
        }
        if let Some(Value::Int(ms)) = answer.first()
            && *ms >= 0
        {
            wait = wait.min(Duration::from_millis(u64::try_from(*ms).unwrap_or(0)));
        }
        let deliveries: Vec<RedisDelivery> = answer[1.min(answer.len())..]
            .chunks(2)
            .filter_map(|pair| match pair {
                [Value::BulkString(id), Value::Array(fields)] => {
                    let id = String::from_utf8_lossy(id).into_owned();
                    let Message { body, properties } = Message::from_fields(fields);
                    Some(Kept::whole(Entry { id }, body, properties, s.live.clone()))
                }
                _ => None,
            })
            .collect();
        let more = ask.room > 0 && deliveries.len() >= ask.room;
        Claimed { deliveries, more, within: Some(wait), failed: None }
    }

    /// Hands back everything the consumer holds: all a closed consumer holds goes back.
    async fn hand_back(&mut self, s: &ConsumerState, _ids: Vec<String>) {
        hand_back(&self.broker, s).await;
    }

    /// The close may have come while a claim was on its way, which may have registered the
    /// consumer again or taken a single-active lease: all of it goes back once more.
    async fn end(&mut self, s: &ConsumerState) {
        hand_back(&self.broker, s).await;
    }
}

/// Hands back every entry the consumer holds and forgets it.
async fn hand_back(broker: &Redis, s: &ConsumerState) {
    let idle = broker.inner.location.lease.saturating_mul(4);
    let handed: Result<i64, _> = broker
        .inner
        .scripts
        .hand_back
        .key(broker.stream(&s.queue))
        .key(broker.queue_key("c", &s.queue))
        .key(broker.queue_key("sac", &s.queue))
        .arg(&s.own.name)
        .arg(u64::try_from(idle.as_millis()).unwrap_or(u64::MAX))
        .arg(broker.wake_channel())
        .invoke_async(&mut broker.conn())
        .await;
    if let Err(e) = handed {
        tracing::warn!(queue = %s.queue, error = %e, "redis broker: cannot hand deliveries back; they come back when their lease runs out");
    }
}

/// What the Redis broker keeps of a delivery to settle and copy it: its entry's id.
pub struct Entry {
    id: String,
}

/// A delivery from the Redis broker.
pub type RedisDelivery = Kept<Entry>;

/// A copy of a delivered message with its headers edited.
fn edited(original: &RedisDelivery, edits: &Edits) -> Message {
    Message { body: original.body.clone(), properties: original.copied_properties(edits) }
}

/// The deliveries of one consumer.
pub type RedisDeliveries = KeptDeliveries<Entry>;

/// A consumer of the Redis broker. Cheap to clone; clones share the consumer.
#[derive(Clone)]
pub struct RedisConsumer {
    broker: Redis,
    state: Arc<ConsumerState>,
}

impl Consumer for RedisConsumer {
    type Delivery = RedisDelivery;

    /// A failed ack changes nothing: the entries stay pending for this consumer, renewed, to
    /// be acked again. An entry whose lease ran out and that another consumer took is left to it.
    async fn ack(&self, settled: &[RedisDelivery]) -> Result<(), BrokerError> {
        let s = &self.state;
        s.still_open()?;
        if settled.is_empty() {
            return Ok(());
        }
        let _removed = self.broker.ack_entries(s, settled.iter().map(|d| d.tag.id.as_str())).await?;
        s.settled(settled.iter().map(|d| d.tag.id.as_str()));
        Ok(())
    }

    /// [`RedisConsumer::ack`] with the keys set done in the same script: one round trip, and
    /// on a server that syncs every write (`appendfsync always`) one sync fewer per batch (on
    /// a cluster, the keys are in the queue's slot).
    async fn ack_recording(
        &self,
        settled: &[RedisDelivery],
        keys: &[String],
        ttl: Duration,
    ) -> Result<(), BrokerError> {
        let s = &self.state;
        s.still_open()?;
        let ttl = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let stream = self.broker.stream(&s.queue);
        let mut invocation = self.broker.inner.scripts.ack_recording.key(&stream);
        for key in keys {
            invocation.key(self.broker.idempotency_key(key));
        }
        invocation.arg(&s.own.name).arg(DONE).arg(ttl);
        for d in settled {
            invocation.arg(&d.tag.id);
        }
        let _removed: i64 = self.broker.durable(&stream, &invocation).await?;
        s.settled(settled.iter().map(|d| d.tag.id.as_str()));
        Ok(())
    }

    async fn cancel(&self) -> Result<(), BrokerError> {
        self.state.cancel();
        Ok(())
    }

    async fn close(&self) {
        let s = &self.state;
        // Everything the consumer holds goes back, not only what it knew it held.
        let _held = s.close();
        hand_back(&self.broker, s).await;
    }
}

impl Broker for Redis {
    type Delivery = RedisDelivery;
    type Deliveries = RedisDeliveries;
    type Consumer = RedisConsumer;

    /// Checks everything first (a conflict changes nothing), then writes what is missing and
    /// makes each queue's stream and consumer group that is missing. What stands already is not
    /// written again: a runner declares on a full server, which refuses writes that grow it.
    async fn declare(&self, plan: &Plan) -> Result<(), BrokerError> {
        if let Some((q, detail)) = plan.queues.iter().find_map(|q| Some((q, unsupported(q, BROKER)?))) {
            return Err(BrokerError::Conflict(format!("queue \"{}\": {detail}", q.name).into()));
        }
        let stored = self.stored().await?;
        if let Some(Drift::Conflict { what, name, detail }) =
            drift_from(plan, &stored)?.into_iter().find(|d| matches!(d, Drift::Conflict { .. }))
        {
            return Err(BrokerError::Conflict(
                format!("{what} \"{name}\" conflicts with what exists: {detail}").into(),
            ));
        }
        let mut pipe = redis::pipe();
        let mut changes = 0;
        for x in plan.exchanges.iter().filter(|x| !stored.exchanges.contains_key(&x.name)) {
            pipe.hset_nx(self.key("x"), &x.name, x.kind.as_str()).ignore();
            changes += 1;
        }
        for q in &plan.queues {
            if !stored.queues.contains_key(&q.name) {
                let declared = serde_json::to_string(q).map_err(|e| {
                    BrokerError::Conflict(Cause::from_error(e).within(format_args!("queue \"{}\"", q.name)))
                })?;
                pipe.hset_nx(self.key("q"), &q.name, declared).ignore();
                changes += 1;
            }
            let limit = q.max_message_bytes.map(|max| max.to_string());
            if limit.as_ref() != stored.limits.get(&q.name) {
                match limit {
                    Some(max) => pipe.hset(self.key("limits"), &q.name, max).ignore(),
                    None => pipe.hdel(self.key("limits"), &q.name).ignore(),
                };
                changes += 1;
            }
        }
        let bound: std::collections::HashSet<&String> = stored.bindings.iter().collect();
        for text in plan.bindings.iter().map(binding_text).filter(|text| !bound.contains(text)) {
            pipe.sadd(self.key("b"), text).ignore();
            changes += 1;
        }
        // The version is the topology's marker too: a server that lost it came back empty.
        if changes > 0 || stored.version.is_empty() {
            pipe.incr(self.key("v"), 1).ignore();
            pipe.query_async::<()>(&mut self.conn()).await.map_err(lost)?;
        }
        if self.inner.location.cluster {
            self.spread(plan, stored.tags).await?;
        }
        // On a cluster, each stream is asked in its own slot.
        let asked: Vec<&[crate::topology::QueueDecl]> =
            if self.inner.location.cluster { plan.queues.chunks(1).collect() } else { vec![plan.queues.as_slice()] };
        let mut missing = Vec::new();
        for queues in asked {
            let mut groups = self.inner.scripts.groups.prepare_invoke();
            for q in queues {
                groups.key(self.stream(&q.name));
            }
            let places: Vec<usize> = groups.invoke_async(&mut self.conn()).await.map_err(lost)?;
            missing.extend(places.into_iter().filter_map(|i| queues.get(i.wrapping_sub(1))));
        }
        for q in missing {
            let made: Result<(), redis::RedisError> = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(self.stream(&q.name))
                .arg("g")
                .arg("0")
                .arg("MKSTREAM")
                .query_async(&mut self.conn())
                .await;
            match made {
                Err(e) if e.code() != Some("BUSYGROUP") => return Err(lost(e)),
                _ => {}
            }
        }
        let t = self.topology(true).await?;
        self.spread_version(&t.queues.keys().cloned().collect::<Vec<_>>(), &t.version).await
    }

    async fn unbind(&self, bindings: &[BindingDecl]) -> Result<(), BrokerError> {
        let mut pipe = redis::pipe();
        for b in bindings {
            pipe.srem(self.key("b"), binding_text(b)).ignore();
        }
        pipe.incr(self.key("v"), 1).ignore();
        pipe.query_async::<()>(&mut self.conn()).await.map_err(lost)?;
        let t = self.topology(true).await?;
        self.spread_version(&t.queues.keys().cloned().collect::<Vec<_>>(), &t.version).await
    }

    async fn copy(&self, original: &RedisDelivery, target: Target<'_>, edits: &Edits) -> Result<(), BrokerError> {
        let delay = match target {
            Target::Later { delay, .. } => delay,
            Target::Queue(_) | Target::DeadLetter(_) => Duration::ZERO,
        };
        self.send_copy(target.queue(), delay, &edited(original, edits)).await
    }

    async fn consume(&self, queue: &str, credit: Credit) -> Result<(RedisDeliveries, RedisConsumer), BrokerError> {
        self.open_consumer(queue, credit.get()).await
    }

    /// Ready: entries in the stream not delivered to a consumer, handed back, or whose lease ran
    /// out with their consumer's life (not those delivered and unacked under a running lease,
    /// nor delayed copies); consumers: those a live process renews.
    async fn stats(&self, queue: &str) -> Result<QueueStats, BrokerError> {
        let [ready, consumers, _, _] = self.counts(queue).await?;
        Ok(QueueStats { ready, consumers })
    }

    /// Delayed copies not yet due, and deliveries under a running lease (as the embedded
    /// broker counts them: a killed runner's are held until theirs runs out, so `run
    /// --exit-when-idle` waits for them), in every declared queue.
    async fn delayed(&self) -> Result<u32, BrokerError> {
        let t = self.topology(true).await?;
        let mut total = 0u32;
        for queue in t.queues.keys() {
            let [_, _, held, delayed] = self.counts(queue).await?;
            total = total.saturating_add(held).saturating_add(delayed);
        }
        Ok(total)
    }

    /// A delayed copy is scored by its due time in milliseconds: any delay fits.
    fn capabilities(&self) -> crate::broker::Capabilities {
        crate::broker::capabilities::REDIS
    }

    fn is_connected(&self) -> bool {
        self.inner.connected.load(Ordering::SeqCst)
    }

    async fn close(&self) {
        self.inner.connected.store(false, Ordering::SeqCst);
    }
}

impl Publish for Redis {
    async fn publish(&self, exchange: &str, routing_key: &str, message: Outgoing) -> Result<(), BrokerError> {
        let (body, properties) = kept::published(BROKER, exchange, routing_key, message)?;
        let message = Message { body, properties };
        let mut stale = false;
        // On a cluster, the queues that have their copy: a topology changed meanwhile adds
        // the queues it routes to as well, not the same copies again.
        let mut written: Vec<String> = Vec::new();
        for _ in 0..5 {
            let t = self.topology(stale).await?;
            // An exchange or route unknown to a cached topology may have been declared since.
            let targets = match t.route(exchange, routing_key, &message.properties.headers, PLACE) {
                Ok(targets) => targets,
                Err(e) if stale => return Err(e),
                Err(_) => {
                    stale = true;
                    continue;
                }
            };
            if !self.inner.location.cluster {
                match self.write(&t, (&t.version, &self.inner.scripts.publish), &targets, exchange, &message).await? {
                    Written::Ok => return Ok(()),
                    Written::Stale | Written::Missing(_) => stale = true,
                }
                continue;
            }
            for q in &targets {
                if written.contains(q) {
                    continue;
                }
                let one = std::slice::from_ref(q);
                match self.write(&t, (&t.version, &self.inner.scripts.publish), one, exchange, &message).await? {
                    Written::Ok => written.push(q.clone()),
                    Written::Missing(_) => stale = true,
                    Written::Stale => {
                        // A declare since the route, or the queue's copy of the version behind
                        // the topology (a declare still spreading it, or one that ended first):
                        // the topology is read again and the copy brought up to it.
                        let fresh = self.topology(true).await?;
                        self.spread_version(one, &fresh.version).await?;
                        stale = true;
                    }
                }
            }
            if !stale {
                return Ok(());
            }
        }
        Err(BrokerError::Lost("the topology kept changing during a publish".into()))
    }

    async fn body_limits(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &Headers,
    ) -> Result<Option<BodyLimits>, BrokerError> {
        Ok(Some(self.topology(true).await?.body_limits(exchange, routing_key, headers, PLACE)?))
    }
}

impl Operate for Redis {
    async fn browse(&self, queue: &str, window: Credit) -> Result<(RedisDeliveries, RedisConsumer), BrokerError> {
        self.open_consumer(queue, window.get()).await
    }

    /// One script writes the copy and removes the original: a move whose answer was lost (a
    /// timeout, a lost connection) happened whole or not at all, so a pass after a lost
    /// session finds the message moved, or still there to move once.
    async fn copy_and_remove(
        &self,
        queue: &str,
        consumer: &RedisConsumer,
        original: &RedisDelivery,
        edits: &Edits,
    ) -> Result<bool, BrokerError> {
        let s = &consumer.state;
        s.still_open()?;
        self.move_copy(queue, s, &original.tag.id, &edited(original, edits)).await?;
        s.settled([original.tag.id.as_str()]);
        Ok(true)
    }

    /// The entries of the pending list whose lease runs; when the last one ends is not kept
    /// (only each entry's idle time), so it is given as at most one lease from now.
    async fn leased(&self, queue: &str) -> Result<Option<super::Leased>, BrokerError> {
        let [_, _, held, _] = self.counts(queue).await?;
        let until = std::time::SystemTime::now() + self.inner.location.lease;
        let until = until.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Ok((held > 0).then_some(super::Leased { count: held, until }))
    }

    async fn drift(&self, plan: &Plan) -> Result<Vec<Drift>, BrokerError> {
        drift_from(plan, &self.stored().await?)
    }

    /// The stream's first entry (`XRANGE`), delivered or not: it is still in the queue.
    async fn oldest(&self, queue: &str) -> Result<Option<Option<RedisDelivery>>, BrokerError> {
        self.tags_known(&[queue]).await?;
        let entries: Vec<Value> = redis::cmd("XRANGE")
            .arg(self.stream(queue))
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut self.conn())
            .await
            .map_err(lost)?;
        let first = entries.first().and_then(|entry| match entry {
            Value::Array(pair) => match pair.as_slice() {
                [Value::BulkString(id), Value::Array(fields)] => {
                    Some((String::from_utf8_lossy(id).into_owned(), Message::from_fields(fields)))
                }
                _ => None,
            },
            _ => None,
        });
        Ok(Some(first.map(|(id, Message { body, properties })| {
            // Read, not delivered: nothing to settle.
            Kept::whole(Entry { id }, body, properties, Arc::new(AtomicBool::new(false)))
        })))
    }
}

/// How `stored` differs from `plan`: what is missing, what conflicts, and the bindings into the
/// plan's queues that the plan does not declare (another set of pipeline files on the same
/// prefix, whose messages these queues would take too).
fn drift_from(plan: &Plan, stored: &Stored) -> Result<Vec<Drift>, BrokerError> {
    let bound: std::collections::HashSet<&String> = stored.bindings.iter().collect();
    let mut drift = declaration::drift(
        plan,
        Some(BROKER),
        |name| Ok::<_, BrokerError>(stored.exchanges.get(name).cloned()),
        |name| Ok(stored.queues.get(name).cloned()),
        |b| Ok(bound.contains(&binding_text(b))),
    )?;
    let declared: std::collections::HashSet<String> = plan.bindings.iter().map(binding_text).collect();
    let mut extra: Vec<BindingDecl> = stored
        .bindings
        .iter()
        .filter(|text| !declared.contains(*text))
        .filter_map(|text| binding_from(text))
        .filter(|b| plan.queues.iter().any(|q| q.name == b.queue))
        .collect();
    extra.sort_by(|a, b| (&a.queue, &a.exchange, &a.routing_key).cmp(&(&b.queue, &b.exchange, &b.routing_key)));
    drift.extend(extra.into_iter().map(|b| Drift::ExtraBinding {
        exchange: b.exchange,
        queue: b.queue,
        routing_key: b.routing_key,
    }));
    Ok(drift)
}

/// Looks at the server every [`server::WATCH`] while the session lives. Ends the session (its
/// runner reconnects, and checks everything again) when the server can no longer be used (a
/// policy that evicts now, a replica now) or came back empty (the topology is declared again);
/// says when the server fills up and when it has room again.
async fn watch(inner: Weak<Inner>, checks: Checks, stop: CancellationToken) {
    let mut full = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(server::WATCH) => {}
        }
        let Some(inner) = inner.upgrade() else { return };
        let mut c = inner.connection.clone();
        let found = server::inspect(&mut c, &inner.location, &inner.shown, &checks, false).await;
        match found {
            Ok(found) => {
                if found.came_back_empty {
                    inner.connected.store(false, Ordering::SeqCst);
                    return;
                }
                let now = found.info.as_ref().and_then(server::Info::full);
                if now.is_some() != full.is_some() {
                    server::log_memory(now);
                }
                full = now;
            }
            Err(e) if e.is_fatal() => {
                tracing::error!(error = %e, "the Redis server can no longer be used: ending the session");
                inner.connected.store(false, Ordering::SeqCst);
                return;
            }
            // Unreachable now: the session's own calls say so, and end it if it lasts.
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::HeaderValue;

    #[test]
    fn a_url_gives_its_prefix_and_lease_and_keeps_the_rest() {
        let cases = [
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379", DEFAULT_PREFIX, LEASE),
            ("redis://h:1/2?prefix=t1:", "redis://h:1/2", "t1:", LEASE),
            (
                "rediss://u:p@h:1?lease=2s&protocol=resp3",
                "rediss://u:p@h:1?protocol=resp3",
                DEFAULT_PREFIX,
                Duration::from_secs(2),
            ),
        ];
        for (url, base, prefix, lease) in cases {
            let l = Location::parse(url).expect(url);
            assert_eq!((l.url.as_str(), l.prefix.as_str(), l.lease), (base, prefix, lease), "{url}");
        }
        assert!(Location::parse("redis://h?lease=1ms").is_err());
        assert!(Location::parse("redis://h?prefix=").is_err());
        assert_eq!(Location::parse("redis://h?wait=1").map(|l| (l.wait, l.url)).ok(), Some((1, "redis://h".into())));
        assert!(Location::parse("redis://h?wait=one").is_err());
        assert!(Location::parse("redis+cluster://h:1?prefix=a{b}:").is_err(), "a hash tag in a cluster's prefix");
    }

    /// A cluster's keys carry the queue's name as their hash tag (its idempotency keys too); one
    /// server's keep the names they always had.
    #[test]
    fn a_cluster_puts_each_queue_in_a_slot_of_its_own() {
        let one = Location::parse("redis://h?prefix=p:").expect("one server");
        let cluster = Location::parse("redis+cluster://h:1?prefix=p:").expect("a cluster");
        assert_eq!((one.queue_key("s", "a.b"), one.topology_key("v")), ("p:s:a.b".into(), "p:v".into()));
        assert_eq!(cluster.queue_key("s", "a.b"), "p:s:{a.b}");
        assert_eq!(cluster.topology_key("v"), "p:{topology}:v");
        assert_eq!(one.idempotency_key("a.b\0k"), "p:dedup:a.b\0k");
        assert_eq!(cluster.idempotency_key("a.b\0k"), "p:dedup:{a.b}\0k");
        assert!(link::same_slot(&cluster.queue_key("s", "a.b"), &cluster.idempotency_key("a.b\0k")));
        assert!(link::same_slot(&cluster.queue_key("d", "a.b"), &format!("{}1", cluster.delayed_prefix("a.b"))));
    }

    /// A Redis error is kept as the source of the lost session it ends.
    #[test]
    fn a_redis_error_is_the_source() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset");
        let lost = lost(redis::RedisError::from(io));
        assert!(lost.is_session_loss(), "{lost:?}");
        assert!(lost.to_string().starts_with("broker connection lost: redis: "), "{lost}");
        let source = std::error::Error::source(&lost).and_then(|e| e.downcast_ref::<redis::RedisError>());
        assert!(source.is_some_and(redis::RedisError::is_io_error), "{lost:?}");
    }

    #[test]
    fn message_fields_round_trip() {
        let m = Message {
            body: Bytes::from_static(b"{\"a\":1}\x00\xff"),
            properties: Properties {
                message_id: Some("m1".into()),
                kind: Some("t".into()),
                content_type: Some("application/octet-stream".into()),
                timestamp: Some(42),
                headers: [("s".to_string(), HeaderValue::Str("v".into())), ("n".to_string(), HeaderValue::Int(-3))]
                    .into(),
                route: Some(Route { exchange: "ev".into(), routing_key: "a.b".into() }),
            },
        };
        let values: Vec<Value> = m
            .fields()
            .into_iter()
            .flat_map(|(k, v)| [Value::BulkString(k.as_bytes().to_vec()), Value::BulkString(v)])
            .collect();
        let back = Message::from_fields(&values);
        assert_eq!(back.body, m.body);
        assert_eq!(back.properties, m.properties);
    }
}
