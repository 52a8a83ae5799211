//! The connection a session's commands go through: to one server (a [`ConnectionManager`],
//! which reconnects to that address by itself), or to the primary a set of Sentinels names
//! (`redis+sentinel://`), which is never a fixed address.
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
use redis::{AsyncConnectionConfig, Client, Cmd, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, Value};
use tokio::time::Instant;

use crate::broker::kit::lock;

/// The URL scheme of a deployment reached through Sentinels.
pub const SENTINEL: &str = "redis+sentinel://";

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
}

impl Target {
    /// Reads a URL (its query already taken apart by `Location::parse`).
    pub fn parse(url: &str) -> Result<Target, String> {
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
        };
        settings.username().unwrap_or("default").to_string()
    }

    /// Whether the primary is found anew after a loss (through Sentinels), so that finding a
    /// replica means a failover, not a wrong URL.
    pub fn follows_primary(&self) -> bool {
        !matches!(self, Link::Server(_))
    }

    /// Drops the connection to the primary, which turned out not to be one any longer: the
    /// next command asks the sentinels.
    pub fn forget(&self) {
        if let Link::Sentinel(p) | Link::Pinned(p, _) = self {
            *lock(&p.current) = None;
        }
    }

    /// A subscription connection to the primary (found anew through Sentinels).
    pub async fn pubsub(&self) -> Result<PubSub, RedisError> {
        match self {
            Link::Server(server) => server.1.get_async_pubsub().await,
            Link::Sentinel(p) | Link::Pinned(p, _) => p.connection().await?.client.get_async_pubsub().await,
        }
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
            Link::Server(_) => Err(RedisError::from((redis::ErrorKind::Client, "not through Sentinels"))),
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
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Server(server) => server.0.get_db(),
            Link::Sentinel(p) | Link::Pinned(p, _) => p.settings.db(),
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
}
