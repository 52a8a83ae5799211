//! What sluice needs of a Redis server, checked whenever a session opens (at the start and on
//! every reconnect), and for a runner every [`WATCH`] while it lives, so that a wrong server is
//! refused with one line naming what is wrong and how to fix it, before anything is written:
//!
//! - the password (`NOAUTH`, `WRONGPASS`);
//! - a standalone primary: a replica is read-only (and its copy asynchronous), a cluster node
//!   moves keys away. Through Sentinels these apply to the primary found, and a replica found
//!   by a runner's watch is a failover: the link asks the sentinels again;
//! - a `maxmemory-policy` that never evicts (`noeviction`): any other lets a full server drop a
//!   queue's stream or the idempotency keys without a word. `--allow-evicting-redis` runs on
//!   one anyway, with a warning at every session. A policy that cannot be read (`INFO` and
//!   `CONFIG GET` both refused, as managed services may) is refused too, unless given the flag:
//!   the line says how to look;
//! - every command the session will run, as the user's ACL allows it (keys under the prefix,
//!   the wake channel): `redis.acl_check_cmd` in a read-only script, which runs nothing.
//!
//! It also reports what a runner should know: a full server (publishes are refused until
//! consumers drain it: what they run is allowed past `maxmemory`, as acks free memory), and a
//! server that restarted empty (its run id changed and the deployment's topology is gone: what
//! it held, messages included, may be lost), counted in `sluice_redis_empty_restarts_total`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::Location;
use super::link::Link;
use crate::broker::{BrokerError, Cause};

/// How often a runner's session looks at its server (restarts, policy, role, memory).
pub const WATCH: Duration = Duration::from_secs(2);

/// What a session is for, which decides what is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Purpose {
    /// `status`, `dlq`, the console: the password and a standalone primary.
    #[default]
    Operate,
    /// `plan --broker`: and a policy that never evicts, and the reads of the topology.
    Plan,
    /// `publish`: and what a publish runs.
    Publish,
    /// `run`: and everything a runner runs; the session is watched while it lives.
    Run,
    /// The idempotency store (`--dedup redis://`): its commands and a policy that never evicts.
    Dedup,
}

/// What to check of the server, shared by the sessions of one process.
#[derive(Debug, Clone, Default)]
pub struct Checks {
    purpose: Purpose,
    allow_evicting: bool,
    /// The run id of the server as the last session found it: another one is a restart.
    seen: Arc<Mutex<Option<String>>>,
}

impl Checks {
    /// The checks for `purpose`; `allow_evicting` runs on a server whose policy can evict.
    pub fn new(purpose: Purpose, allow_evicting: bool) -> Checks {
        Checks { purpose, allow_evicting, seen: Arc::default() }
    }

    pub fn purpose(&self) -> Purpose {
        self.purpose
    }
}

/// What `INFO` says of the server (`None` when this user may not run it).
#[derive(Debug, Clone, Default)]
pub struct Info(HashMap<String, String>);

impl Info {
    fn parse(text: &str) -> Info {
        Info(
            text.lines()
                .filter_map(|l| l.trim().split_once(':'))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    fn number(&self, name: &str) -> Option<u64> {
        self.get(name)?.parse().ok()
    }

    /// Used memory and `maxmemory`, in bytes, when the server has reached it.
    pub fn full(&self) -> Option<(u64, u64)> {
        let (used, max) = (self.number("used_memory")?, self.number("maxmemory")?);
        (max > 0 && used >= max).then_some((used, max))
    }
}

/// Says that the server filled up (`used` bytes of `max`), or (`None`) has room again.
pub fn log_memory(full: Option<(u64, u64)>) {
    match full {
        Some((used, max)) => tracing::warn!(
            used_memory = %mib(used),
            maxmemory = %mib(max),
            "Redis is full: it refuses publishes until consumers drain it (acks free memory) or maxmemory is raised"
        ),
        None => tracing::info!("Redis has room again (under its maxmemory): publishes go through"),
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

/// What a refused password or user name says.
const WRONGPASS: &str = "the server refused the user name or password in the URL (WRONGPASS): check them (redis://USER:PASSWORD@HOST:PORT; the user is \"default\" when none is given)";

/// A refusal of the server at `shown` (its URL, without password) for `reason`.
fn refuse(shown: &str, reason: impl Into<String>) -> BrokerError {
    BrokerError::Refused { url: shown.to_string(), reason: Cause::from(reason.into()) }
}

/// What an error from the server means for a session opening: a refusal when no retry helps.
pub fn opening_error(shown: &str, e: redis::RedisError) -> BrokerError {
    match e.code() {
        Some("NOAUTH") => refuse(
            shown,
            "the server wants a password (NOAUTH): give it in the URL, redis://:PASSWORD@HOST:PORT, or redis://USER:PASSWORD@HOST:PORT for an ACL user",
        ),
        Some("WRONGPASS") => refuse(shown, WRONGPASS),
        _ if matches!(e.kind(), redis::ErrorKind::AuthenticationFailed) => refuse(shown, WRONGPASS),
        _ if e.to_string().contains("without any password configured") => {
            refuse(shown, format!("the URL has a password and the server wants none: {e}"))
        }
        _ => BrokerError::Connect { url: shown.to_string(), reason: Cause::from_error(e) },
    }
}

/// The server, as a session found it.
#[derive(Debug, Clone, Default)]
pub struct Server {
    pub info: Option<Info>,
    /// It restarted since the last look, without the deployment's topology.
    pub came_back_empty: bool,
}

/// Everything `checks` asks of the server behind `c` (with `user`, for `location`), for a
/// session opening: the password, the role, the policy, the commands; reports a restart.
pub async fn check(
    c: &mut Link,
    location: &Location,
    user: &str,
    shown: &str,
    checks: &Checks,
) -> Result<Server, BrokerError> {
    redis::cmd("PING").query_async::<()>(c).await.map_err(|e| opening_error(shown, e))?;
    let server = inspect(c, location, shown, checks, true).await?;
    if checks.purpose != Purpose::Operate {
        for mut node in primaries(c, shown).await? {
            let named = node.node().map(|n| format!("{shown} (node {n})"));
            permissions(&mut node, location, user, named.as_deref().unwrap_or(shown), checks.purpose).await?;
        }
    }
    Ok(server)
}

/// The primaries behind `c` (each of a cluster's), to check one by one.
async fn primaries(c: &Link, shown: &str) -> Result<Vec<Link>, BrokerError> {
    c.primaries().await.map_err(|e| opening_error(shown, e))
}

/// `INFO` (server, replication, memory, cluster), or `None` when this user may not run it.
async fn info(c: &mut Link, shown: &str) -> Result<Option<Info>, BrokerError> {
    let read: Result<String, _> =
        redis::cmd("INFO").arg("server").arg("replication").arg("memory").arg("cluster").query_async(c).await;
    match read {
        Ok(text) => Ok(Some(Info::parse(&text))),
        Err(e) if e.code() == Some("NOPERM") => Ok(None),
        Err(e) => Err(opening_error(shown, e)),
    }
}

/// The checks `INFO` answers (role, cluster, policy) and a restart, for a session opening
/// (which warns of an evicting policy allowed) or its watch; on a cluster, of every primary.
pub async fn inspect(
    c: &mut Link,
    location: &Location,
    shown: &str,
    checks: &Checks,
    opening: bool,
) -> Result<Server, BrokerError> {
    let mut found: Option<Info> = None;
    for mut node in primaries(c, shown).await? {
        let named = node.node().map(|n| format!("{shown} (node {n})"));
        let shown = named.as_deref().unwrap_or(shown);
        let info = info(&mut node, shown).await?;
        if let Some(info) = &info {
            role(c, info, node.node().as_deref(), shown)?;
        }
        if checks.purpose != Purpose::Operate {
            policy(&mut node, info.as_ref(), shown, checks, opening).await?;
        }
        if opening && checks.purpose == Purpose::Run && c.is_cluster() {
            coverage(&mut node).await;
        }
        // The one that says most: a full node's, or the first.
        if found.is_none() || info.as_ref().is_some_and(|i| i.full().is_some()) {
            found = info.or(found);
        }
    }
    let another = if c.is_cluster() {
        emptied(c, location, checks).await
    } else {
        match found.as_ref().and_then(|i| i.get("run_id")) {
            Some(id) if checks.purpose == Purpose::Run => restarted(c, location, checks, id).await,
            _ => None,
        }
    };
    if another.is_some() && c.follows_primary() && !opening {
        // A failover's new primary: what the session runs is asked of it too.
        permissions(c, location, &c.user(), shown, checks.purpose).await?;
    }
    Ok(Server { info: found, came_back_empty: another == Some(true) })
}

/// Refuses a node whose role sluice cannot use: a replica (unless a failover made it one,
/// which the link follows), a cluster node reached as a standalone server (or a standalone
/// server as a cluster). `node` names a cluster's node.
fn role(c: &Link, info: &Info, node: Option<&str>, shown: &str) -> Result<(), BrokerError> {
    if info.get("role") == Some("slave") && (c.follows_primary() || c.is_cluster()) {
        // A failover made it a replica: the next command asks the sentinels (a cluster's
        // client follows the slots by itself).
        c.forget();
        return Err(BrokerError::Lost(
            format!("redis: the primary {} became a replica (a failover)", node.unwrap_or_default()).into(),
        ));
    }
    if info.get("role") == Some("slave") {
        let primary = format!("{}:{}", info.get("master_host").unwrap_or("?"), info.get("master_port").unwrap_or("?"));
        return Err(refuse(
            shown,
            format!(
                "the server is a replica of {primary}: replicas are read-only and copy asynchronously; point the URL at the primary"
            ),
        ));
    }
    match (info.get("cluster_enabled") == Some("1"), c.is_cluster()) {
        (true, false) => Err(refuse(
            shown,
            format!(
                "the server is a Redis Cluster node (cluster-enabled yes): give its nodes as {}HOST:PORT,HOST:PORT (sluice needs to know it is a cluster)",
                super::link::CLUSTER
            ),
        )),
        (false, true) => Err(refuse(
            shown,
            format!(
                "the node {} is no Redis Cluster node (cluster-enabled no): use redis://HOST:PORT for one server",
                node.unwrap_or_default()
            ),
        )),
        _ => Ok(()),
    }
}

/// Warns when a cluster node stops serving every slot while any is without a primary
/// (`cluster-require-full-coverage yes`, Redis's default): one primary lost then pauses every
/// queue until its replica takes over, not only the queues on it.
async fn coverage(node: &mut Link) {
    let answer: Result<Vec<String>, _> =
        redis::cmd("CONFIG").arg("GET").arg("cluster-require-full-coverage").query_async(node).await;
    if answer.ok().and_then(|a| a.get(1).cloned()).as_deref() == Some("yes") {
        tracing::warn!(
            node = %node.node().unwrap_or_default(),
            "the Redis Cluster node runs with cluster-require-full-coverage yes: while one primary is lost, every queue waits, not only its own; set cluster-require-full-coverage no"
        );
    }
}

/// On a cluster, whether the topology's marker (the version key) is gone since the last look
/// saw it: a node restarted empty without a replica to take over (`None` when it was never
/// seen, as before a first declare). Reported as [`restarted`] reports an empty server.
async fn emptied(c: &mut Link, location: &Location, checks: &Checks) -> Option<bool> {
    if checks.purpose != Purpose::Run {
        return None;
    }
    let marker = location.topology_key("v");
    let exists: bool = redis::cmd("EXISTS").arg(&marker).query_async(c).await.ok()?;
    let before = checks.seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).replace(exists.to_string());
    if exists || before.as_deref() != Some("true") {
        return None;
    }
    metrics::counter!("sluice_redis_empty_restarts_total").increment(1);
    tracing::error!(
        prefix = %location.prefix,
        "the Redis Cluster lost the deployment's topology (a node restarted empty, with no replica to take over): the messages queued, retries waiting, dead letters and idempotency keys it held may be lost (do the nodes run with appendonly yes, and with replicas?); declaring the topology again"
    );
    Some(true)
}

/// Refuses a `maxmemory-policy` that can evict (or one that cannot be read) unless allowed.
async fn policy(
    c: &mut Link,
    info: Option<&Info>,
    shown: &str,
    checks: &Checks,
    opening: bool,
) -> Result<(), BrokerError> {
    let read = match info.and_then(|i| i.get("maxmemory_policy")) {
        Some(policy) => Some(policy.to_string()),
        None => {
            let answer: Result<Vec<String>, _> =
                redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy").query_async(c).await;
            answer.ok().and_then(|a| a.get(1).cloned())
        }
    };
    let problem = match read.as_deref() {
        Some("noeviction") => return Ok(()),
        Some(policy) => format!(
            "the server runs with maxmemory-policy {policy}: once full it evicts keys, queued messages and idempotency keys among them, without a word; set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, and in redis.conf)"
        ),
        None => "cannot read the server's maxmemory-policy (INFO and CONFIG GET are refused to this user): any policy but noeviction loses messages when the server fills; look it up (redis-cli INFO memory, maxmemory_policy, or your provider's settings)".to_string(),
    };
    if !checks.allow_evicting {
        return Err(refuse(
            shown,
            format!("{problem}, or give --allow-evicting-redis for a server used for nothing else"),
        ));
    }
    if opening {
        tracing::warn!(
            %problem,
            "running on a Redis that can evict keys (--allow-evicting-redis): a full server drops messages and idempotency keys"
        );
    }
    Ok(())
}

/// Reports a restart of the server (its run id is `id` now): at ERROR, and counted, when it
/// came back without the deployment's topology (its marker, the version key): `None` when the
/// server is the one seen last, else whether it came back empty.
async fn restarted(c: &mut Link, location: &Location, checks: &Checks, id: &str) -> Option<bool> {
    let before = {
        let mut seen = checks.seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        seen.replace(id.to_string())
    };
    let before = before.filter(|b| b != id)?;
    let marker = location.topology_key("v");
    let exists: Result<bool, _> = redis::cmd("EXISTS").arg(&marker).query_async(c).await;
    let empty = exists == Ok(false);
    if empty {
        metrics::counter!("sluice_redis_empty_restarts_total").increment(1);
        tracing::error!(
            prefix = %location.prefix,
            run_id_before = %before,
            run_id = %id,
            "the Redis server restarted and came back empty (no topology under the prefix): the messages queued, retries waiting, dead letters and idempotency keys it held may be lost (does it run with appendonly yes?); declaring the topology again"
        );
    } else if c.follows_primary() {
        tracing::info!(run_id_before = %before, run_id = %id, "another Redis primary (a failover), with the deployment's keys");
    } else {
        tracing::info!(run_id_before = %before, run_id = %id, "the Redis server restarted, with the deployment's keys");
    }
    Some(empty)
}

/// Registers the counter of empty restarts at 0, with its help: a runner on Redis shows it
/// from the start.
pub fn describe() {
    metrics::describe_counter!(
        "sluice_redis_empty_restarts_total",
        "Times the Redis server was found restarted without the deployment's keys (what it held may be lost)."
    );
    metrics::counter!("sluice_redis_empty_restarts_total").increment(0);
}

/// The commands a session for `purpose` runs, each as it is run (`{s}` a stream key, `{k}`
/// another key, `{c}` the wake channel, all of the deployment).
fn wanted(purpose: Purpose) -> Vec<&'static str> {
    // Every script is sent by hash, and loaded when the server does not have it.
    const SCRIPTS: &[&str] = &["EVALSHA 0000000000000000000000000000000000000000 0", "SCRIPT LOAD x"];
    const TOPOLOGY: &[&str] = &["GET {k}", "HGETALL {k}", "SMEMBERS {k}"];
    const PUBLISH: &[&str] = &["EXISTS {s}", "XPENDING {s} g", "XLEN {s}", "XADD {s} * b x", "PUBLISH {c} {s}"];
    const RUN: &[&str] = &[
        "HSETNX {k} f v",
        "HSET {k} f v",
        "HDEL {k} f",
        "SADD {k} m",
        "SREM {k} m",
        "INCR {k}",
        "XGROUP CREATE {s} g 0 MKSTREAM",
        "XINFO GROUPS {s}",
        "XINFO CONSUMERS {s} g",
        "XGROUP DELCONSUMER {s} g c",
        "XREADGROUP GROUP g c COUNT 1 STREAMS {s} >",
        "XCLAIM {s} g c 0 0-1",
        "XACK {s} g 0-1",
        "XDEL {s} 0-1",
        "TIME",
        "SET {k} v NX PX 1",
        "DEL {k}",
        "ZADD {k} 0 m",
        "ZREM {k} m",
        "ZRANGE {k} 0 0",
        "ZRANGEBYSCORE {k} 0 1",
        "ZREMRANGEBYSCORE {k} 0 1",
        "ZCOUNT {k} 0 1",
        "ZCARD {k}",
        "SUBSCRIBE {c}",
    ];
    const DEDUP: &[&str] = &["SET {k} v NX PX 1", "GET {k}", "DEL {k}"];
    match purpose {
        Purpose::Operate => Vec::new(),
        Purpose::Plan => [SCRIPTS, TOPOLOGY].concat(),
        Purpose::Publish => [SCRIPTS, TOPOLOGY, PUBLISH].concat(),
        Purpose::Run => [SCRIPTS, TOPOLOGY, PUBLISH, RUN].concat(),
        Purpose::Dedup => [SCRIPTS, DEDUP].concat(),
    }
}

/// Refuses a user whose ACL would refuse a command the session runs (nothing is run: the
/// scripts' `redis.acl_check_cmd` asks), or the scripts themselves.
async fn permissions(
    c: &mut Link,
    location: &Location,
    user: &str,
    shown: &str,
    purpose: Purpose,
) -> Result<(), BrokerError> {
    let prefix = &location.prefix;
    let (stream, key, channel) = (location.queue_key("s", "q"), location.topology_key("x"), format!("{prefix}wake"));
    let script = redis::Script::new(super::scripts::PROBE);
    let mut invocation = script.prepare_invoke();
    invocation.arg(&stream).arg(&key).arg(&channel);
    for line in wanted(purpose) {
        invocation.arg(line);
    }
    let answer: Result<Vec<String>, _> = invocation.invoke_async(c).await;
    let refused = match answer {
        Ok(refused) => refused,
        Err(e) if e.code() == Some("NOPERM") => {
            // The scripts themselves: the message names the command ('evalsha', 'script|load').
            let named = e.to_string();
            let command = named.split('\'').nth(1).unwrap_or("EVALSHA").replace('|', " ").to_uppercase();
            vec![command]
        }
        Err(e) => return Err(opening_error(shown, e)),
    };
    if refused.is_empty() {
        return Ok(());
    }
    let grants: Vec<String> = refused.iter().map(|c| format!("+{}", c.to_lowercase().replace(' ', "|"))).collect();
    Err(refuse(
        shown,
        format!(
            "the Redis user \"{user}\" may not run {} (on keys under \"{prefix}\", channel \"{channel}\"), which sluice needs; grant them: ACL SETUSER {user} {} ~{prefix}* &{prefix}*",
            refused.join(", "),
            grants.join(" ")
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// INFO's sections read as fields; full once the used memory reaches a maxmemory set.
    #[test]
    fn info_says_the_role_the_policy_and_whether_the_server_is_full() {
        let text = "# Server\r\nrun_id:abc\r\n# Replication\r\nrole:master\r\n# Memory\r\nused_memory:2048\r\nmaxmemory:1024\r\nmaxmemory_policy:noeviction\r\n";
        let info = Info::parse(text);
        assert_eq!((info.get("run_id"), info.get("role")), (Some("abc"), Some("master")));
        assert_eq!(info.get("maxmemory_policy"), Some("noeviction"));
        assert_eq!(info.full(), Some((2048, 1024)));
        assert_eq!(Info::parse("used_memory:2048\nmaxmemory:0\n").full(), None, "no maxmemory: never full");
        assert_eq!(mib(3 << 20), "3.0 MiB");
    }
}
