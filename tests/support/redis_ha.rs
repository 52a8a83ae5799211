//! Redis deployments of a test's own, from the `redis-server` binary on free ports in a
//! temporary directory, killed on drop: a Sentinel set ([`SentinelSet`]: a primary, two
//! replicas, three sentinels) and a Redis Cluster ([`RedisCluster`]: three primaries with a
//! replica each). Replicas sync without a disk (`repl-diskless-sync-delay 0`), and a set or
//! cluster is handed over only once every replica finished its first sync (and every sentinel
//! knows the replicas and the other sentinels): a replica that never synced is never promoted.
//!
//! Each server is started with `PR_SET_PDEATHSIG`: it dies with the thread that started it,
//! so a test process killed before its drops ran leaves no server behind. [`shared_sentinels`]
//! starts its set from a thread that lives as long as the process.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use super::{free_port, wait_blocking as wait};

/// The name the sentinels know the primary by.
pub const MASTER: &str = "sluice";

/// One `redis-server` process (a data node or a sentinel).
pub struct Server {
    pub port: u16,
    child: Option<Child>,
    /// How it was started, for [`Server::restart`].
    dir: std::path::PathBuf,
    args: Vec<String>,
}

impl Server {
    /// Starts `redis-server` with `args`, its log in `dir`; dies with the calling thread.
    fn start(dir: &Path, port: u16, args: &[String]) -> Server {
        use std::os::unix::process::CommandExt as _;
        let mut command = Command::new("redis-server");
        command.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        command.arg("--logfile").arg(dir.join(format!("redis-{port}.log")));
        // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command.spawn().unwrap_or_else(|e| {
            panic!("cannot start redis-server ({e}): install it (apt-get install redis-server) to run these tests")
        });
        let server = Server { port, child: Some(child), dir: dir.to_path_buf(), args: args.to_vec() };
        wait(Duration::from_secs(10), &format!("redis-server on port {port} answers"), || server.ping());
        server
    }

    /// A plain connection.
    pub fn raw(&self) -> redis::Connection {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", self.port)).expect("url");
        client.get_connection_with_timeout(Duration::from_secs(2)).expect("connect to a test's redis-server")
    }

    fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{}", self.port)) else { return false };
        let Ok(mut c) = client.get_connection_with_timeout(Duration::from_millis(500)) else { return false };
        redis::cmd("PING").query::<String>(&mut c).is_ok()
    }

    /// `INFO section` as fields.
    pub fn info(&self, section: &str) -> std::collections::HashMap<String, String> {
        let text: String = redis::cmd("INFO").arg(section).query(&mut self.raw()).unwrap_or_default();
        text.lines().filter_map(|l| l.trim().split_once(':')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// kill -9.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again as it was first started (a data node comes back empty: nothing on
    /// disk); dies with the calling thread.
    pub fn restart(&mut self) {
        self.kill();
        *self = Server::start(&self.dir.clone(), self.port, &self.args.clone());
    }

    pub fn is_alive(&self) -> bool {
        self.child.is_some()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The arguments of a data node on `port` in `dir`: nothing on disk, no sync delay.
fn data_node(dir: &Path, port: u16) -> Vec<String> {
    let node = dir.join(port.to_string());
    std::fs::create_dir_all(&node).expect("node dir");
    [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--dir",
        node.to_str().expect("utf-8"),
        "--save",
        "",
        "--appendonly",
        "no",
        "--repl-diskless-sync",
        "yes",
        "--repl-diskless-sync-delay",
        "0",
        "--maxmemory-policy",
        "noeviction",
    ]
    .iter()
    .map(ToString::to_string)
    .collect()
}

/// A primary, two replicas and three sentinels (quorum 2, a primary down after 1 s).
pub struct SentinelSet {
    /// The data nodes; the first was the primary at the start.
    pub nodes: Vec<Server>,
    pub sentinels: Vec<Server>,
    dir: tempfile::TempDir,
}

impl SentinelSet {
    /// Starts the set and waits until it can fail over.
    pub fn start() -> SentinelSet {
        let dir = tempfile::tempdir().expect("tempdir");
        let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let mut nodes = vec![Server::start(dir.path(), ports[0], &data_node(dir.path(), ports[0]))];
        for port in &ports[1..] {
            let mut args = data_node(dir.path(), *port);
            args.extend(["--replicaof".to_string(), "127.0.0.1".to_string(), ports[0].to_string()]);
            nodes.push(Server::start(dir.path(), *port, &args));
        }
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            let port = free_port();
            let conf = dir.path().join(format!("sentinel-{port}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {MASTER} 127.0.0.1 {} 2\nsentinel down-after-milliseconds {MASTER} 1000\nsentinel failover-timeout {MASTER} 5000\nsentinel parallel-syncs {MASTER} 2\n",
                    dir.path().display(),
                    ports[0]
                ),
            )
            .expect("sentinel.conf");
            let args = [conf.to_str().expect("utf-8").to_string(), "--sentinel".to_string()];
            sentinels.push(Server::start(dir.path(), port, &args));
        }
        let set = SentinelSet { nodes, sentinels, dir };
        set.wait_ready();
        set
    }

    /// What `sluice --broker` takes (without sluice's parameters).
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.sentinels.iter().map(|s| format!("127.0.0.1:{}", s.port)).collect();
        format!("redis+sentinel://{}/{MASTER}", hosts.join(","))
    }

    /// The port of the primary the live sentinels agree on, once they agree and it answers as one.
    pub fn primary(&self) -> u16 {
        let mut found = 0;
        wait(Duration::from_secs(30), "the sentinels agree on a live primary", || {
            let named: Vec<Option<u16>> = self
                .sentinels
                .iter()
                .filter(|s| s.is_alive())
                .map(|s| {
                    let addr: Option<Vec<String>> =
                        redis::cmd("SENTINEL").arg("get-master-addr-by-name").arg(MASTER).query(&mut s.raw()).ok();
                    addr.and_then(|a| a.get(1)?.parse().ok())
                })
                .collect();
            let Some(Some(port)) = named.first().copied() else { return false };
            let primary = self.nodes.iter().find(|n| n.port == port && n.is_alive());
            found = port;
            named.iter().all(|n| *n == Some(port))
                && primary.is_some_and(|n| n.info("replication").get("role").map(String::as_str) == Some("master"))
        });
        found
    }

    /// The data node on `port`.
    pub fn node(&mut self, port: u16) -> &mut Server {
        self.nodes.iter_mut().find(|n| n.port == port).expect("a data node of the set")
    }

    /// Waits until every live replica of the primary finished its first sync, the primary sees
    /// them, and every sentinel knows them and the other sentinels.
    pub fn wait_ready(&self) {
        let primary = self.primary();
        let replicas: Vec<&Server> = self.nodes.iter().filter(|n| n.is_alive() && n.port != primary).collect();
        wait(Duration::from_secs(30), "every replica synced with the primary", || {
            let synced = replicas.iter().all(|r| {
                let info = r.info("replication");
                info.get("master_link_status").map(String::as_str) == Some("up")
                    && info.get("master_port").and_then(|p| p.parse().ok()) == Some(primary)
            });
            let seen = self.nodes.iter().find(|n| n.port == primary).is_some_and(|p| {
                p.info("replication").get("connected_slaves").and_then(|n| n.parse::<usize>().ok())
                    == Some(replicas.len())
            });
            synced && seen
        });
        let live = self.sentinels.iter().filter(|s| s.is_alive()).count();
        wait(Duration::from_secs(30), "every sentinel knows the replicas and the other sentinels", || {
            self.sentinels.iter().filter(|s| s.is_alive()).all(|s| {
                let mut c = s.raw();
                let known: Vec<redis::Value> =
                    redis::cmd("SENTINEL").arg("replicas").arg(MASTER).query(&mut c).unwrap_or_default();
                let others: Vec<redis::Value> =
                    redis::cmd("SENTINEL").arg("sentinels").arg(MASTER).query(&mut c).unwrap_or_default();
                known.len() >= replicas.len() && others.len() + 1 >= live
            })
        });
    }

    /// The directory the servers keep their logs in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// A Redis Cluster: three primaries with a replica each, a node failed after 1 s
/// (`cluster-node-timeout 1000`), the slots of the others served while one has no primary
/// (`cluster-require-full-coverage no`).
pub struct RedisCluster {
    /// The data nodes, primaries and replicas as `redis-cli --cluster create` made them.
    pub nodes: Vec<Server>,
    dir: tempfile::TempDir,
}

impl RedisCluster {
    /// Starts the nodes, makes them a cluster, and waits until every slot is served and every
    /// replica finished its first sync.
    pub fn start() -> RedisCluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let nodes: Vec<Server> = (0..6)
            .map(|_| {
                let port = free_port();
                let mut args = data_node(dir.path(), port);
                // The bus port is given: the default, the port + 10000, may be taken or past 65535.
                args.extend(["--cluster-port".to_string(), free_port().to_string()]);
                args.extend(
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-node-timeout",
                        "1000",
                        "--cluster-require-full-coverage",
                        "no",
                        "--cluster-config-file",
                    ]
                    .map(String::from),
                );
                args.push(format!("nodes-{port}.conf"));
                Server::start(dir.path(), port, &args)
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        create.args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)));
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let made = create.stdin(Stdio::null()).output().unwrap_or_else(|e| {
            panic!("cannot run redis-cli ({e}): install it (apt-get install redis-tools) to run these tests")
        });
        assert!(made.status.success(), "redis-cli --cluster create: {}", String::from_utf8_lossy(&made.stdout));
        let cluster = RedisCluster { nodes, dir };
        cluster.wait_ready();
        cluster
    }

    /// What `sluice --broker` takes (without sluice's parameters): the primaries as started.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// The live nodes' `redis://` URLs.
    pub fn node_urls(&self) -> Vec<String> {
        self.nodes.iter().filter(|n| n.is_alive()).map(|n| format!("redis://127.0.0.1:{}", n.port)).collect()
    }

    /// The port of the primary that serves `key`'s slot now.
    pub fn primary_of(&self, key: &str) -> u16 {
        let node = self.nodes.iter().find(|n| n.is_alive()).expect("a live node");
        let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut node.raw()).expect("KEYSLOT");
        let ranges: Vec<redis::Value> = redis::cmd("CLUSTER").arg("SLOTS").query(&mut node.raw()).expect("SLOTS");
        ranges
            .iter()
            .find_map(|range| {
                let redis::Value::Array(fields) = range else { return None };
                let [redis::Value::Int(first), redis::Value::Int(last), redis::Value::Array(primary), ..] =
                    fields.as_slice()
                else {
                    return None;
                };
                let redis::Value::Int(port) = primary.get(1)? else { return None };
                (*first..=*last).contains(&slot).then(|| u16::try_from(*port).ok()).flatten()
            })
            .expect("a primary serves the slot")
    }

    /// The ports of the nodes that are primaries now.
    pub fn primaries(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.is_alive() && n.info("replication").get("role").map(String::as_str) == Some("master"))
            .map(|n| n.port)
            .collect()
    }

    /// The data node on `port`.
    pub fn node(&mut self, port: u16) -> &mut Server {
        self.nodes.iter_mut().find(|n| n.port == port).expect("a node of the cluster")
    }

    /// Waits until every live node says every slot is served (`cluster_state:ok`) and every
    /// live replica finished its first sync with a live primary.
    pub fn wait_ready(&self) {
        wait(Duration::from_secs(60), "the cluster serves every slot and every replica synced", || {
            self.nodes.iter().filter(|n| n.is_alive()).all(|n| {
                let replication = n.info("replication");
                let synced = match replication.get("role").map(String::as_str) {
                    Some("slave") => replication.get("master_link_status").map(String::as_str) == Some("up"),
                    _ => true,
                };
                synced && Self::serves_every_slot(n)
            })
        });
    }

    /// Whether `n` says the cluster is up with three primaries serving all 16384 slots.
    fn serves_every_slot(n: &Server) -> bool {
        let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut n.raw()).unwrap_or_default();
        ["cluster_state:ok", "cluster_slots_ok:16384", "cluster_size:3"]
            .iter()
            .all(|want| info.lines().any(|l| l.trim() == *want))
    }

    /// The directory the servers keep their logs in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

/// Starts `start` from a thread that lives as long as the process, once: a deployment shared by
/// the whole test process (the conformance matrix's), never failed over.
fn shared<T: Send + Sync + 'static>(cell: &'static OnceLock<T>, start: fn() -> T) -> &'static T {
    cell.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(start());
            loop {
                std::thread::park();
            }
        });
        rx.recv().expect("the shared Redis deployment started")
    })
}

/// One Sentinel set for the whole test process.
pub fn shared_sentinels() -> &'static SentinelSet {
    static SET: OnceLock<SentinelSet> = OnceLock::new();
    shared(&SET, SentinelSet::start)
}

/// One Redis Cluster for the whole test process.
pub fn shared_cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    shared(&CLUSTER, RedisCluster::start)
}
