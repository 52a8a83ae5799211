//! The connection a session's commands go through: to one server (a [`ConnectionManager`],
//! which reconnects to that address by itself), to the primary a set of Sentinels names
//! (`redis+sentinel://`), which is never a fixed address, or to a Redis Cluster
//! (`redis+cluster://`), whose client sends each command to the primary of its key's slot and
//! follows a slot that moves (`MOVED`, `ASK`) or a primary that fails over.
//!
//! Through Sentinels, every sentinel is asked for the primary (`SENTINEL MASTER`) and the one
//! with the newest configuration (the highest `config-epoch`) is believed: a sentinel that has
//! not yet heard of a failover names the old primary. The node named must answer `ROLE` as a
//! primary, with the run id the sentinels know (an old primary restarted has another), before
//! any command goes to it. A connection that breaks, times out, or answers `READONLY`
//! (a primary demoted to a replica) or `MASTERDOWN` is dropped: the next command asks the
//! sentinels again, never the old address (a restarted old primary is a standalone primary for
//! a few seconds, until the sentinels make it a replica). Asking again waits a backoff (100 ms,
//! doubling to 2 s) after a failed attempt: a primary that cannot be found is never asked for
//! in a loop.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection, PubSub};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{AsyncConnectionConfig, Client, Cmd, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, Value};
use tokio::time::Instant;

use crate::broker::kit::lock;

/// The URL scheme of a deployment reached through Sentinels.
pub const SENTINEL: &str = "redis+sentinel://";

/// The URL scheme of a Redis Cluster.
pub const CLUSTER: &str = "redis+cluster://";

/// How long to wait for a connection, and for an answer.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub connect: Duration,
    pub response: Duration,
}

/// The first wait before asking the sentinels again after a failed attempt, and the longest.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));

/// Where the data is, as a URL without sluice's own parameters names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `redis://` or `rediss://`: one server.
    Server(String),
    /// `redis+sentinel://[USER:PASSWORD@]S1:PORT,S2:PORT/MASTER[/DB]`: the primary the
    /// sentinels name `master`; the user and password are the data nodes' (the sentinels are
    /// asked without).
    Sentinels { sentinels: Vec<String>, master: String, node: String },
    /// `redis+cluster://[USER:PASSWORD@]N1:PORT,N2:PORT`: the nodes to learn the cluster from
    /// (`redis://` URLs, the user and password in each).
    Cluster { seeds: Vec<String> },
}

impl Target {
    /// Reads a URL (its query already taken apart by `Location::parse`).
    pub fn parse(url: &str) -> Result<Target, String> {
        if let Some(rest) = url.strip_prefix(CLUSTER) {
            return Target::cluster(rest);
        }
        let Some(rest) = url.strip_prefix(SENTINEL) else { return Ok(Target::Server(url.to_string())) };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        if !query.is_empty() {
            return Err(format!("{SENTINEL} takes no parameter {query:?} (only prefix=, lease= and wait=)"));
        }
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (user, hosts) = match authority.rsplit_once('@') {
            Some((user, hosts)) => (format!("{user}@"), hosts),
            None => (String::new(), authority),
        };
        let sentinels: Vec<String> =
            hosts.split(',').map(str::trim).filter(|h| !h.is_empty()).map(|h| format!("redis://{h}")).collect();
        let (master, db) = path.split_once('/').unwrap_or((path, ""));
        if sentinels.is_empty() || master.is_empty() {
            return Err(format!(
                "expected {SENTINEL}[USER:PASSWORD@]SENTINEL:PORT[,SENTINEL:PORT...]/MASTER_NAME[/DB]"
            ));
        }
        if !db.is_empty() && db.parse::<u16>().is_err() {
            return Err(format!("the database {db:?} is not a number"));
        }
        // The data nodes' user, password and database, read as a `redis://` URL reads them.
        let node = format!("redis://{user}sentinel-named-primary/{db}");
        Ok(Target::Sentinels { sentinels, master: master.to_string(), node })
    }

    /// Reads what follows `redis+cluster://`: a cluster has one database, so no path.
    fn cluster(rest: &str) -> Result<Target, String> {
        let expected = format!("expected {CLUSTER}[USER:PASSWORD@]NODE:PORT[,NODE:PORT...]");
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        if !query.is_empty() {
            return Err(format!("{CLUSTER} takes no parameter {query:?} (only prefix=, lease= and wait=)"));
        }
        let authority = match rest.split_once('/') {
            None => rest,
            Some((authority, "")) => authority,
            Some((_, path)) => {
                return Err(format!("a Redis Cluster has one database (0): {path:?} after the nodes; {expected}"));
            }
        };
        let (user, hosts) = match authority.rsplit_once('@') {
            Some((user, hosts)) => (format!("{user}@"), hosts),
            None => (String::new(), authority),
        };
        let seeds: Vec<String> =
            hosts.split(',').map(str::trim).filter(|h| !h.is_empty()).map(|h| format!("redis://{user}{h}")).collect();
        if seeds.is_empty() {
            return Err(expected);
        }
        Ok(Target::Cluster { seeds })
    }
}

/// A session's connection to its data. Cheap to clone; clones share it.
#[derive(Clone)]
pub enum Link {
    /// One server: the manager (cheap to clone) and the client subscriptions open from.
    Server(Arc<(ConnectionManager, Client)>),
    Sentinel(Arc<Primary>),
    /// One connection to the primary, kept for commands that must follow each other on it
    /// (`WAIT` counts the replicas that have this connection's writes).
    Pinned(Arc<Primary>, Box<Current>),
    /// A Redis Cluster: each command goes to the primary of its first key's slot.
    Cluster(Arc<Cluster>),
    /// One node of a cluster, by address, on the cluster's connections: every command goes to it.
    Node(Arc<Cluster>, String, u16),
}

/// A session's connection to a Redis Cluster.
pub struct Cluster {
    connection: ClusterConnection,
    /// The nodes' user and password (every node is reached alike).
    settings: redis::RedisConnectionInfo,
}

impl Link {
    /// Connects to what `url` names (`ConnectionManager` retries `retries` times on one server).
    pub async fn open(url: &str, timeouts: Timeouts, retries: usize) -> Result<Link, RedisError> {
        let invalid = |why: String| RedisError::from((redis::ErrorKind::InvalidClientConfig, "invalid URL", why));
        match Target::parse(url).map_err(invalid)? {
            Target::Server(url) => {
                let client = Client::open(url.as_str())?;
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeouts.connect))
                    .set_response_timeout(Some(timeouts.response))
                    .set_number_of_retries(retries);
                let connection = ConnectionManager::new_with_config(client.clone(), config).await?;
                Ok(Link::Server(Arc::new((connection, client))))
            }
            Target::Sentinels { sentinels, master, node } => {
                let settings = node.as_str().into_connection_info()?.redis_settings().clone();
                let primary = Primary {
                    settings: settings.clone(),
                    found: std::sync::atomic::AtomicU64::new(0),
                    sentinel: tokio::sync::Mutex::new(Asking { sentinels, next: Instant::now(), backoff: BACKOFF.0 }),
                    master,
                    config: AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(timeouts.connect))
                        .set_response_timeout(Some(timeouts.response)),
                    timeouts,
                    current: Mutex::new(None),
                };
                let link = Link::Sentinel(Arc::new(primary));
                if let Link::Sentinel(p) = &link {
                    p.connection().await?;
                }
                Ok(link)
            }
            Target::Cluster { seeds } => {
                let seed = seeds.first().map(String::as_str).unwrap_or_default();
                let settings = seed.into_connection_info()?.redis_settings().clone();
                let client = redis::cluster::ClusterClient::builder(seeds)
                    .connection_timeout(timeouts.connect)
                    .response_timeout(timeouts.response)
                    .retries(u32::try_from(retries).unwrap_or(u32::MAX).max(1))
                    .build()?;
                let connection = client.get_async_connection().await?;
                Ok(Link::Cluster(Arc::new(Cluster { connection, settings })))
            }
        }
    }

    /// The primaries of the data: this link (one server, the sentinels' primary), or each
    /// primary of a cluster as its slots say now (`CLUSTER SLOTS`), for what is asked of every
    /// node (its policy, the user's commands).
    pub async fn primaries(&self) -> Result<Vec<Link>, RedisError> {
        let Link::Cluster(cluster) = self else { return Ok(vec![self.clone()]) };
        let mut c = cluster.connection.clone();
        let slots = c.route_command(redis::cmd("CLUSTER").arg("SLOTS").clone(), RANDOM).await?;
        let mut primaries = std::collections::BTreeSet::new();
        if let Value::Array(ranges) = slots {
            for range in ranges {
                // [first slot, last slot, [host, port, id, ...], replicas...]
                if let Value::Array(fields) = range
                    && let Some(Value::Array(primary)) = fields.get(2)
                    && let [Value::BulkString(host), Value::Int(port), ..] = primary.as_slice()
                {
                    let port = u16::try_from(*port).unwrap_or_default();
                    primaries.insert((String::from_utf8_lossy(host).into_owned(), port));
                }
            }
        }
        Ok(primaries.into_iter().map(|(host, port)| Link::Node(cluster.clone(), host, port)).collect())
    }

    /// Whether this is a cluster or one of its nodes.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Link::Cluster(_) | Link::Node(..))
    }

    /// The node this link reaches, for messages (`HOST:PORT`), when it is one node of a cluster.
    pub fn node(&self) -> Option<String> {
        match self {
            Link::Node(_, host, port) => Some(format!("{host}:{port}")),
            _ => None,
        }
    }

    /// The primary that holds `key`'s slot (`HOST:PORT`), on a cluster.
    pub async fn holder(&self, key: &str) -> Result<Option<String>, RedisError> {
        let Link::Cluster(cluster) = self else { return Ok(None) };
        let route = primary_of(key);
        let mut c = cluster.connection.clone();
        // The node that runs a command for the key says who it is.
        let id: String =
            redis::from_redis_value(c.route_command(redis::cmd("CLUSTER").arg("MYID").clone(), route.clone()).await?)?;
        let nodes: String =
            redis::from_redis_value(c.route_command(redis::cmd("CLUSTER").arg("NODES").clone(), route).await?)?;
        Ok(nodes
            .lines()
            .find(|l| l.starts_with(id.trim()))
            .and_then(|l| l.split_whitespace().nth(1))
            .map(|address| address.split('@').next().unwrap_or(address).to_string()))
    }

    /// `WAIT replicas timeout` on the connection that wrote `key` last (on a cluster, the
    /// primary of its slot; elsewhere, this link, which must be pinned): how many replicas have
    /// that connection's writes.
    pub async fn wait(&mut self, key: &str, replicas: u32, timeout: Duration) -> Result<u32, RedisError> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas).arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
        match self {
            Link::Cluster(cluster) => {
                Ok(redis::from_redis_value(cluster.connection.clone().route_command(wait, primary_of(key)).await?)?)
            }
            other => wait.query_async(other).await,
        }
    }

    /// This link, its commands all on one connection from now on (one server's manager
    /// reconnects to the same address; through Sentinels, a failed command does not move it).
    pub async fn pinned(&self) -> Result<Link, RedisError> {
        match self {
            Link::Sentinel(p) => Ok(Link::Pinned(p.clone(), Box::new(p.connection().await?))),
            other => Ok(other.clone()),
        }
    }

    /// The user the data nodes are reached as.
    pub fn user(&self) -> String {
        let settings = match self {
            Link::Server(server) => server.1.get_connection_info().redis_settings().clone(),
            Link::Sentinel(p) | Link::Pinned(p, _) => p.settings.clone(),
            Link::Cluster(c) | Link::Node(c, ..) => c.settings.clone(),
        };
        settings.username().unwrap_or("default").to_string()
    }

    /// Whether the primary is found anew after a loss (through Sentinels), so that finding a
    /// replica means a failover, not a wrong URL.
    pub fn follows_primary(&self) -> bool {
        matches!(self, Link::Sentinel(_) | Link::Pinned(..))
    }

    /// Drops the connection to the primary, which turned out not to be one any longer: the
    /// next command asks the sentinels.
    pub fn forget(&self) {
        if let Link::Sentinel(p) | Link::Pinned(p, _) = self {
            *lock(&p.current) = None;
        }
    }

    /// A subscription connection to the primary (found anew through Sentinels); on a cluster,
    /// to one of its primaries (a publish reaches every node's subscribers).
    pub async fn pubsub(&self) -> Result<PubSub, RedisError> {
        match self {
            Link::Server(server) => server.1.get_async_pubsub().await,
            Link::Sentinel(p) | Link::Pinned(p, _) => p.connection().await?.client.get_async_pubsub().await,
            Link::Cluster(cluster) | Link::Node(cluster, ..) => {
                let mut last = RedisError::from((redis::ErrorKind::Io, "the cluster has no primary"));
                for node in self.primaries().await? {
                    let Link::Node(_, host, port) = node else { continue };
                    match cluster.node_client(&host, port)?.get_async_pubsub().await {
                        Ok(pubsub) => return Ok(pubsub),
                        Err(e) => last = e,
                    }
                }
                Err(last)
            }
        }
    }
}

/// Any node of a cluster.
const RANDOM: RoutingInfo = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);

/// The node of a cluster at `host:port`.
fn by_address(host: &str, port: u16) -> RoutingInfo {
    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host: host.to_string(), port })
}

/// The primary of `key`'s slot.
fn primary_of(key: &str) -> RoutingInfo {
    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::with_key(key, SlotAddr::Master)))
}

/// Whether two keys are in one slot of a cluster (one script may touch both).
pub fn same_slot(a: &str, b: &str) -> bool {
    redis::cluster_routing::Slot::for_key(a) == redis::cluster_routing::Slot::for_key(b)
}

impl Cluster {
    /// A client of the node at `host:port`, with the cluster's user and password.
    fn node_client(&self, host: &str, port: u16) -> Result<Client, RedisError> {
        let info = format!("redis://{host}:{port}").as_str().into_connection_info()?;
        Client::open(info.set_redis_settings(self.settings.clone()))
    }
}

/// The primary a set of Sentinels names, as last found.
pub struct Primary {
    sentinel: tokio::sync::Mutex<Asking>,
    master: String,
    /// The data nodes' user, password and database.
    settings: redis::RedisConnectionInfo,
    config: AsyncConnectionConfig,
    timeouts: Timeouts,
    current: Mutex<Option<Current>>,
    /// How many primaries were found: each connection's number.
    found: std::sync::atomic::AtomicU64,
}

/// The sentinels, and when they may be asked again.
struct Asking {
    /// Their addresses, all asked at once (the newest configuration is believed).
    sentinels: Vec<String>,
    next: Instant,
    backoff: Duration,
}

/// A connection to a node found a primary.
#[derive(Clone)]
pub struct Current {
    /// Which connection this is (clones of one have the same).
    number: u64,
    connection: MultiplexedConnection,
    client: Client,
}

impl Primary {
    /// The connection to the primary, found through the sentinels when there is none.
    async fn connection(&self) -> Result<Current, RedisError> {
        if let Some(current) = lock(&self.current).clone() {
            return Ok(current);
        }
        let mut asking = self.sentinel.lock().await;
        // Another command may have found it while this one waited.
        if let Some(current) = lock(&self.current).clone() {
            return Ok(current);
        }
        tokio::time::sleep_until(asking.next).await;
        // A sentinel that takes no connection and refuses none (a host gone from the
        // network) must not hold every attempt: it has its time, and the others are asked
        // beside it.
        // The sentinels, then the primary they name.
        let within = (self.timeouts.connect + self.timeouts.response) * 2;
        let found = tokio::time::timeout(within, self.find(&asking.sentinels)).await.unwrap_or_else(|_| {
            Err(RedisError::from((
                redis::ErrorKind::Io,
                "no answer",
                format!("the sentinels did not name a primary within {within:?}"),
            )))
        });
        match found {
            Ok(found) => {
                asking.backoff = BACKOFF.0;
                *lock(&self.current) = Some(found.clone());
                Ok(found)
            }
            Err(e) => {
                asking.next = Instant::now() + asking.backoff;
                asking.backoff = (asking.backoff * 2).min(BACKOFF.1);
                tracing::debug!(master = %self.master, error = %e, "redis: no primary found through the sentinels");
                Err(e)
            }
        }
    }

    /// Asks every sentinel for the primary and believes the one whose configuration is newest
    /// (the highest `config-epoch`): a sentinel that has not yet heard of a failover still
    /// names the old primary, which, restarted, would answer as a primary of its own. Then
    /// has the node named say `ROLE` itself on the connection that will carry the commands.
    async fn find(&self, sentinels: &[String]) -> Result<Current, RedisError> {
        // A sentinel that never answers has its time, as each does.
        let each = self.timeouts.connect + self.timeouts.response;
        let ask = |s: &str| {
            let s = s.to_string();
            async move {
                tokio::time::timeout(each, self.named_by(&s)).await.unwrap_or_else(|_| {
                    Err(RedisError::from((redis::ErrorKind::Io, "no answer", format!("sentinel {s} did not answer"))))
                })
            }
        };
        let asked = futures_util::future::join_all(sentinels.iter().map(|s| ask(s))).await;
        let mut last = None;
        let mut newest: Option<(u64, String, u16, String)> = None;
        for answer in asked {
            match answer {
                Ok(named) if newest.as_ref().is_none_or(|n| named.0 > n.0) => newest = Some(named),
                Ok(_) => {}
                Err(e) => last = Some(e),
            }
        }
        let Some((_, host, port, run_id)) = newest else {
            return Err(last.unwrap_or_else(|| RedisError::from((redis::ErrorKind::Io, "no sentinel answered"))));
        };
        let info =
            format!("redis://{host}:{port}").as_str().into_connection_info()?.set_redis_settings(self.settings.clone());
        let client = Client::open(info)?;
        let mut connection = client.get_multiplexed_async_connection_with_config(&self.config).await?;
        let role: Vec<Value> = redis::cmd("ROLE").query_async(&mut connection).await?;
        // The process the sentinels know: an old primary restarted (empty, a primary of its
        // own until they notice) has another run id.
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut connection).await?;
        let running = info.lines().find_map(|l| l.strip_prefix("run_id:")).unwrap_or_default().trim().to_string();
        match role.first() {
            Some(Value::BulkString(r)) if r == b"master" && (run_id.is_empty() || run_id == running) => {
                let number = self.found.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                Ok(Current { number, connection, client })
            }
            Some(Value::BulkString(r)) if r == b"master" => Err(RedisError::from((
                redis::ErrorKind::Io,
                "not the primary the sentinels know",
                format!("{host}:{port} runs as {running}, the sentinels know {run_id} there (restarted?)"),
            ))),
            _ => Err(RedisError::from((
                redis::ErrorKind::Io,
                "not a primary",
                format!("the sentinels named {host}:{port} for \"{}\", which is no primary now", self.master),
            ))),
        }
    }

    /// What the sentinel at `url` names the primary: its configuration epoch, address and run id.
    async fn named_by(&self, url: &str) -> Result<(u64, String, u16, String), RedisError> {
        let mut connection = Client::open(url)?.get_multiplexed_async_connection_with_config(&self.config).await?;
        let master: std::collections::HashMap<String, String> =
            redis::cmd("SENTINEL").arg("MASTER").arg(&self.master).query_async(&mut connection).await?;
        let field = |name: &str| master.get(name).cloned().unwrap_or_default();
        let port = field("port").parse().map_err(|_| RedisError::from((redis::ErrorKind::Parse, "no port")))?;
        Ok((field("config-epoch").parse().unwrap_or(0), field("ip"), port, field("runid")))
    }

    /// Drops connection number `used` after `e`, when `e` says it is not the primary's any longer.
    fn judge(&self, used: u64, e: &RedisError) {
        let gone = e.is_io_error()
            || e.is_connection_dropped()
            || e.is_timeout()
            || e.is_connection_refusal()
            || matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"));
        if gone {
            let mut current = lock(&self.current);
            // Only the one used: a newer connection found meanwhile stays.
            if current.as_ref().is_some_and(|c| c.number == used) {
                tracing::info!(master = %self.master, error = %e, "redis: lost the primary; asking the sentinels again");
                *current = None;
            }
        }
    }
}

impl Link {
    /// The primary and the connection a command goes on (Sentinels only).
    async fn current(&self) -> Result<(&Primary, Current), RedisError> {
        match self {
            Link::Sentinel(p) => Ok((p, p.connection().await?)),
            Link::Pinned(p, current) => Ok((p, (**current).clone())),
            Link::Server(_) | Link::Cluster(_) | Link::Node(..) => {
                Err(RedisError::from((redis::ErrorKind::Client, "not through Sentinels")))
            }
        }
    }
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Link::Server(server) => {
                let mut connection = server.0.clone();
                Box::pin(async move { connection.req_packed_command(cmd).await })
            }
            Link::Sentinel(_) | Link::Pinned(..) => Box::pin(async move {
                let (p, Current { number, mut connection, .. }) = self.current().await?;
                let answer = connection.req_packed_command(cmd).await;
                if let Err(e) = &answer {
                    p.judge(number, e);
                }
                answer
            }),
            Link::Cluster(cluster) => {
                let mut connection = cluster.connection.clone();
                Box::pin(async move { connection.req_packed_command(cmd).await })
            }
            Link::Node(cluster, host, port) => {
                let (mut connection, route) = (cluster.connection.clone(), by_address(host, *port));
                Box::pin(async move { connection.route_command(cmd.clone(), route).await })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Link::Server(server) => {
                let mut connection = server.0.clone();
                Box::pin(async move { connection.req_packed_commands(pipeline, offset, count).await })
            }
            Link::Sentinel(_) | Link::Pinned(..) => Box::pin(async move {
                let (p, Current { number, mut connection, .. }) = self.current().await?;
                let answer = connection.req_packed_commands(pipeline, offset, count).await;
                if let Err(e) = &answer {
                    p.judge(number, e);
                }
                answer
            }),
            Link::Cluster(cluster) => {
                let mut connection = cluster.connection.clone();
                Box::pin(async move { connection.req_packed_commands(pipeline, offset, count).await })
            }
            Link::Node(cluster, host, port) => {
                let mut connection = cluster.connection.clone();
                let route = SingleNodeRoutingInfo::ByAddress { host: host.clone(), port: *port };
                Box::pin(async move { connection.route_pipeline(pipeline.clone(), offset, count, route).await })
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Server(server) => server.0.get_db(),
            Link::Sentinel(p) | Link::Pinned(p, _) => p.settings.db(),
            Link::Cluster(_) | Link::Node(..) => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sentinel_url_names_the_sentinels_the_master_and_the_data_nodes_settings() {
        let t = Target::parse("redis+sentinel://u:p%40w@s1:26379,s2:26380/mymaster/3").expect("parse");
        let Target::Sentinels { sentinels, master, node } = t else { panic!("not sentinels") };
        assert_eq!(sentinels, ["redis://s1:26379", "redis://s2:26380"]);
        assert_eq!(master, "mymaster");
        let settings = node.as_str().into_connection_info().expect("node").redis_settings().clone();
        assert_eq!((settings.username(), settings.password(), settings.db()), (Some("u"), Some("p@w"), 3));
        assert_eq!(Target::parse("redis://h:1/2").ok(), Some(Target::Server("redis://h:1/2".into())));
        for bad in [
            "redis+sentinel://s1:26379",
            "redis+sentinel:///m",
            "redis+sentinel://s:1/m/x",
            "redis+sentinel://s:1/m?x=1",
        ] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_cluster_url_names_its_seed_nodes_with_their_user_and_no_database() {
        let t = Target::parse("redis+cluster://u:p%40w@n1:7000, n2:7001/").expect("parse");
        assert_eq!(
            t,
            Target::Cluster { seeds: vec!["redis://u:p%40w@n1:7000".into(), "redis://u:p%40w@n2:7001".into()] }
        );
        for bad in ["redis+cluster://", "redis+cluster://n1:7000/3", "redis+cluster://n1:7000?x=1"] {
            assert!(Target::parse(bad).is_err(), "{bad}");
        }
    }
}
