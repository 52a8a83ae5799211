//! A three-node RabbitMQ cluster of a test's own, run by `scripts/rabbitmq-cluster.sh` in a
//! fresh temporary directory (nodes `c1-<hash>@localhost` .. `c3-<hash>@localhost`, beside the
//! machine's own `rabbit@localhost`) and taken down on drop. Starting it takes about 15 s on a
//! two-core machine; nodes are numbered 1 to 3.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Three clustered RabbitMQ nodes, each on an AMQP port of its own; `down` runs on drop, after
/// a panic too.
pub struct Cluster {
    /// Owns the cluster's directory, `dir/cluster`.
    dir: tempfile::TempDir,
    ports: [u16; 3],
}

/// The script, from the crate's root.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/rabbitmq-cluster.sh")
}

/// Runs the script on `dir` with `args`: its stdout on success, everything it said otherwise.
fn run(dir: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new("bash")
        .arg(script())
        .arg(dir)
        .args(args)
        .output()
        .map_err(|e| format!("could not run bash {}: {e}", script().display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "{} {args:?} exited with {}:\n{stdout}{}",
            script().display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

impl Cluster {
    /// Starts the three nodes and waits until they run as one cluster. Panics with the
    /// script's output (the failing node's log included) if they do not.
    pub fn up() -> Cluster {
        take_down_clusters_of_dead_runs();
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(OWNER), sluice::broker::embedded::this_process()).expect("write the owner");
        let path = dir.path().join("cluster");
        if let Err(report) = run(&path, &["up"]) {
            let _ = run(&path, &["down"]);
            panic!(
                "a 3-node RabbitMQ cluster did not start (and was taken down).\n{report}\nIt runs Debian's \
                 RabbitMQ scripts from /usr/lib/rabbitmq/bin (apt-get install rabbitmq-server) and needs epmd on \
                 PATH; see scripts/rabbitmq-cluster.sh. SLUICE_CLUSTER_WAIT_SECS lengthens its waits."
            );
        }
        let ports = run(&path, &["ports"]).unwrap_or_else(|e| panic!("{e}"));
        let ports: Vec<u16> = ports.lines().map(|l| l.trim().parse().expect("a port a line")).collect();
        let ports = ports.try_into().unwrap_or_else(|p| panic!("three ports, not {p:?}"));
        Cluster { dir, ports }
    }

    /// The cluster's directory (nodes' logs in `n<N>/log`).
    pub fn dir(&self) -> PathBuf {
        self.dir.path().join("cluster")
    }

    /// Runs a command of the script on node `n`, panicking with its report if it fails.
    fn node_command(&self, command: &str, n: usize) {
        assert!((1..=3).contains(&n), "nodes are 1 to 3, not {n}");
        if let Err(report) = run(&self.dir(), &[command, &n.to_string()]) {
            panic!("{report}");
        }
    }

    /// Node `n`'s AMQP port.
    pub fn port(&self, n: usize) -> u16 {
        assert!((1..=3).contains(&n), "nodes are 1 to 3, not {n}");
        self.ports[n - 1]
    }

    /// Node `n`'s AMQP URL, as guest on the default vhost.
    pub fn url(&self, n: usize) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port(n))
    }

    /// The three nodes' URLs, node 1 first.
    pub fn urls(&self) -> Vec<String> {
        (1..=3).map(|n| self.url(n)).collect()
    }

    /// The node listening on AMQP `port`, if any.
    pub fn node_of_port(&self, port: u16) -> Option<usize> {
        self.ports.iter().position(|&p| p == port).map(|i| i + 1)
    }

    /// kill -9 node `n`'s VM and waits until it is gone.
    pub fn kill(&self, n: usize) {
        self.node_command("kill", n);
    }

    /// SIGSTOPs node `n`'s VM: its sockets stay open and nothing answers.
    pub fn freeze(&self, n: usize) {
        self.node_command("freeze", n);
    }

    /// SIGCONTs node `n`'s VM. A freeze longer than the net tick time (10 s) leaves node `n`
    /// partitioned from the others; `rejoin` brings it back.
    pub fn thaw(&self, n: usize) {
        self.node_command("thaw", n);
    }

    /// Starts node `n` again on its data after `kill` or `stop`; waits until it and the other
    /// nodes up (all three, usually) see each other running.
    pub fn start(&self, n: usize) {
        self.node_command("start", n);
    }

    /// Restarts RabbitMQ inside node `n`'s running VM, which brings a node that the others
    /// declared down back into their cluster; waits as `start` does.
    pub fn rejoin(&self, n: usize) {
        self.node_command("rejoin", n);
    }

    /// Stops node `n` cleanly.
    pub fn stop(&self, n: usize) {
        self.node_command("stop", n);
    }

    /// Raises (`true`) or clears a disk alarm, which blocks every publisher of the cluster.
    pub fn disk_alarm(&self, on: bool) {
        if let Err(report) = run(&self.dir(), &["alarm", if on { "on" } else { "off" }]) {
            panic!("{report}");
        }
    }

    /// The node leading quorum queue `queue`.
    pub fn leader(&self, queue: &str) -> usize {
        let out = run(&self.dir(), &["leader", queue]).unwrap_or_else(|e| panic!("{e}"));
        out.trim().parse().unwrap_or_else(|_| panic!("a node number, not {out:?}"))
    }

    /// The node process `pid` has an established TCP connection to (its first one found).
    pub fn connected_node(&self, pid: u32) -> Option<usize> {
        self.connection(pid).map(|(node, _)| node)
    }

    /// The node process `pid` has an established TCP connection to (its first one found),
    /// and the connection's local port (a new connection has another).
    pub fn connection(&self, pid: u32) -> Option<(usize, u16)> {
        super::connections(pid).into_iter().find_map(|(local, remote)| Some((self.node_of_port(remote)?, local)))
    }
}

/// The file beside `cluster/` naming the test process that started it.
const OWNER: &str = "sluice-cluster-owner";

/// Takes down (and removes) the clusters that test processes killed before their `Drop` ran
/// left in the temporary directory: their nodes would run on, holding ports and memory.
fn take_down_clusters_of_dead_runs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for dir in entries.flatten().map(|e| e.path()) {
        let Ok(owner) = std::fs::read_to_string(dir.join(OWNER)) else { continue };
        if !sluice::broker::embedded::process_alive(owner.trim()) {
            match run(&dir.join("cluster"), &["down"]) {
                Ok(_) => drop(std::fs::remove_dir_all(&dir)),
                Err(report) => eprintln!("taking down a cluster a killed run left failed: {report}"),
            }
        }
    }
}

impl Drop for Cluster {
    /// Takes the cluster down (kill -9, thawing first); reports, never panics, if that fails.
    fn drop(&mut self) {
        if let Err(report) = run(&self.dir(), &["down"]) {
            eprintln!("taking the RabbitMQ cluster down failed: {report}");
        }
    }
}
