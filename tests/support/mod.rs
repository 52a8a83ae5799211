//! Helpers for tests against the real RabbitMQ and the real `sluice` binary: a vhost per test
//! (deleted on drop), a pipeline directory, the binary as a child process, publishing and
//! reading queues through the library, and waiting on conditions with a deadline.
#![allow(dead_code)] // each test crate uses a different subset

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice::broker::amqp::Amqp;
use sluice::broker::{Broker, HeaderValue, Headers, Operate, Outgoing, Publish};
use sluice::envelope::Envelope;

pub mod cluster;
pub mod moto;
pub mod nats_cluster;
pub mod redis_ha;
pub mod stream;

pub const RABBIT_HOST: &str = "127.0.0.1:5672";

/// Fails (never skips) when RabbitMQ is down, saying how to start it.
pub fn require_rabbitmq() {
    if TcpStream::connect_timeout(&RABBIT_HOST.parse().expect("address"), Duration::from_secs(2)).is_err() {
        panic!(
            "RabbitMQ is not reachable at {RABBIT_HOST}. Start it with `rabbitmq-server -detached && rabbitmqctl await_startup` (or run .ci/run, which does)."
        );
    }
}

/// RabbitMQ's management API (the `rabbitmq_management` plugin), where tests make and delete
/// their vhosts: a request costs a millisecond, where each `rabbitmqctl` call boots an Erlang VM.
const MANAGEMENT: &str = "127.0.0.1:15672";

/// `method path` with `body` (JSON) to the management API as guest; the status code and the
/// answer's body, or why there is none (saying how to enable the API).
fn management(method: &str, path: &str, body: &str) -> Result<(u16, String), String> {
    use std::io::{Read, Write};
    let how = "enable RabbitMQ's management API: `rabbitmq-plugins enable rabbitmq_management` (.ci/run does)";
    let address = MANAGEMENT.parse().expect("address");
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5))
        .map_err(|e| format!("RabbitMQ's management API is not reachable at {MANAGEMENT} ({e}): {how}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(60))).map_err(|e| e.to_string())?;
    // guest:guest
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {MANAGEMENT}\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut response = String::new();
    stream
        .write_all(request.as_bytes())
        .and_then(|()| stream.read_to_string(&mut response))
        .map_err(|e| format!("{method} {path} on {MANAGEMENT}: {e}"))?;
    let code = response.split_whitespace().nth(1).and_then(|code| code.parse().ok());
    let body = response.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default();
    code.map(|code| (code, body)).ok_or_else(|| format!("not an HTTP answer from {MANAGEMENT}: {response:.200}"))
}

/// A name of this test process's own for what it makes on a shared server (a vhost, a Redis
/// key prefix): `sluice-test-PID-START-UUID`, so that a later run can tell what a killed one
/// left behind ([`left_by_a_dead_run`]).
pub fn owned_name() -> String {
    let process = sluice::broker::embedded::this_process().replace(':', "-");
    format!("sluice-test-{process}-{}", uuid::Uuid::now_v7())
}

/// Whether `name` is an [`owned_name`] whose process no longer runs: a run killed before it
/// could remove what it made (its `Drop`s never ran).
pub fn left_by_a_dead_run(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("sluice-test-") else { return false };
    let mut parts = rest.splitn(4, '-');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(pid), Some(start), Some(namespace)) => {
            !sluice::broker::embedded::process_alive(&format!("{pid}:{start}:{namespace}"))
        }
        _ => false,
    }
}

/// Deletes the vhosts killed runs left on the shared RabbitMQ ([`Vhost::new`] does, once per
/// test process).
pub fn delete_vhosts_of_dead_runs() {
    let Ok((200, list)) = management("GET", "/api/vhosts?columns=name", "") else { return };
    for name in list.split("\"name\":\"").skip(1).filter_map(|rest| rest.split('"').next()) {
        if left_by_a_dead_run(name) {
            let _ = management("DELETE", &format!("/api/vhosts/{name}"), "");
        }
    }
}

/// Whether a vhost named `name` exists.
pub fn vhost_exists(name: &str) -> bool {
    management("GET", &format!("/api/vhosts/{name}"), "").is_ok_and(|(code, _)| code == 200)
}

/// The broker a test runs `sluice` against, of its own so tests run in parallel and
/// repeatedly: RabbitMQ in a vhost ([`Vhost`]) or the embedded broker in a directory
/// ([`EmbeddedDir`]). One test body, generic over it, checks each (see [`on_every_broker`]).
pub trait Place: Send + Sync {
    type Broker: Operate;

    /// What `sluice --broker` takes.
    fn url(&self) -> String;

    /// A new session of the test's own.
    fn connect(&self) -> impl std::future::Future<Output = Self::Broker> + Send;

    /// Messages ready in `queue`, read through a fresh session.
    fn depth(&self, queue: &str) -> impl std::future::Future<Output = u32> + Send {
        async move {
            let broker = self.connect().await;
            let depth = broker.depth(queue).await.unwrap_or_else(|e| panic!("depth of {queue}: {e}"));
            broker.close().await;
            depth
        }
    }

    /// Delayed copies not yet due.
    fn delayed(&self) -> impl std::future::Future<Output = u32> + Send {
        async move {
            let broker = self.connect().await;
            let delayed = broker.delayed().await.unwrap_or_else(|e| panic!("delayed copies: {e}"));
            broker.close().await;
            delayed
        }
    }

    /// Every message in `queue`, in order, left in place: body and headers.
    fn drain_queue(
        &self,
        queue: &str,
    ) -> impl std::future::Future<Output = Vec<(Vec<u8>, std::collections::BTreeMap<String, HeaderValue>)>> + Send {
        async move {
            use futures_util::StreamExt as _;
            use sluice::broker::{Consumer as _, Delivery as _};
            let broker = self.connect().await;
            let depth = broker.depth(queue).await.unwrap_or_else(|e| panic!("depth of {queue}: {e}"));
            let (mut deliveries, consumer) =
                broker.browse(queue, sluice::broker::Credit::at_most(u16::MAX)).await.expect("browse");
            let mut out = Vec::new();
            while out.len() < depth as usize {
                let next = tokio::time::timeout(Duration::from_secs(10), deliveries.next()).await;
                let delivery = next.expect("the queue's messages arrive").expect("stream open").expect("delivery");
                let headers = delivery
                    .headers()
                    .into_iter()
                    .filter_map(|(k, v)| match v {
                        serde_json::Value::String(s) => Some((k, HeaderValue::Str(s))),
                        serde_json::Value::Number(n) => Some((k, HeaderValue::Int(n.as_i64()?))),
                        _ => None,
                    })
                    .collect();
                out.push((delivery.body().to_vec(), headers));
            }
            consumer.close().await;
            broker.close().await;
            out
        }
    }
}

/// A directory of its own holding an embedded broker.
pub struct EmbeddedDir {
    pub dir: tempfile::TempDir,
}

impl EmbeddedDir {
    pub fn new() -> EmbeddedDir {
        EmbeddedDir { dir: tempfile::tempdir().expect("tempdir") }
    }
}

impl EmbeddedDir {
    /// Counts rows of the broker's `messages` table matching `condition` (SQL with `?1` the
    /// queue), read from the file directly.
    pub fn count(&self, queue: &str, condition: &str) -> u32 {
        let path = Path::new(&self.url()).join(sluice::broker::embedded::FILE);
        let db = rusqlite::Connection::open(&path).expect("open the broker's file");
        let sql = format!("SELECT count(*) FROM messages WHERE queue = ?1 AND ({condition})");
        db.query_row(&sql, [queue], |r| r.get(0)).unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Messages of `queue` delivered and not acked, whether their consumer lives or not.
    pub fn leased(&self, queue: &str) -> u32 {
        self.count(queue, "lease_owner IS NOT NULL")
    }
}

impl Place for EmbeddedDir {
    type Broker = sluice::broker::embedded::Embedded;

    fn url(&self) -> String {
        self.dir.path().join("broker").display().to_string()
    }

    async fn connect(&self) -> Self::Broker {
        sluice::broker::embedded::Embedded::open_dir(Path::new(&self.url())).expect("open the embedded broker")
    }

    /// Ready or leased: a killed runner's deliveries count until they are acked, as on
    /// RabbitMQ, where they are ready again once its connection is gone. (Delayed copies not
    /// yet due do not count, there as here.)
    async fn depth(&self, queue: &str) -> u32 {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis();
        self.count(queue, &format!("lease_owner IS NOT NULL OR visible_at <= {now}"))
    }
}

impl Place for Vhost {
    type Broker = Amqp;

    fn url(&self) -> String {
        Vhost::url(self)
    }

    async fn connect(&self) -> Amqp {
        Vhost::connect(self).await
    }
}

/// For each `async fn NAME<P: Place>(place: P)` named, a module NAME with four tests:
/// `rabbitmq` (a vhost of its own), `embedded` (a directory of its own), `redis` (a key
/// prefix of its own on the shared server) and `jetstream` (a name prefix of its own on the
/// shared NATS server).
#[macro_export]
macro_rules! on_every_broker {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rabbitmq() {
                super::$name($crate::support::Vhost::new()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn embedded() {
                super::$name($crate::support::EmbeddedDir::new()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                super::$name($crate::support::RedisPrefix::new()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn jetstream() {
                super::$name($crate::support::NatsPrefix::new()).await
            }
        }
    )*};
}

pub const REDIS_HOST: &str = "127.0.0.1:6379";

/// Fails (never skips) when Redis is down, saying how to start it.
pub fn require_redis() {
    if TcpStream::connect_timeout(&REDIS_HOST.parse().expect("address"), Duration::from_secs(2)).is_err() {
        panic!("Redis is not reachable at {REDIS_HOST}. Start it with `redis-server --daemonize yes`.");
    }
}

/// A key prefix of its own on a Redis server (the shared one unless given), for one test:
/// every key under it is deleted on drop.
pub struct RedisPrefix {
    /// What `--broker` takes: a server, a Sentinel set or a cluster.
    pub server: String,
    /// The server that holds the data (`redis://host:port`), for looking at keys: one node of
    /// a cluster.
    pub data: String,
    /// Every node that holds the prefix's keys (a cluster's), each cleaned on drop.
    nodes: Vec<String>,
    /// A cluster (whose queues' keys are named by tags the broker chooses).
    cluster: bool,
    pub prefix: String,
    /// Extra URL parameters (`&lease=2s`).
    pub params: String,
}

impl RedisPrefix {
    /// A prefix on the shared server whose entries are leased for 5 s (renewed every 1.7 s),
    /// not the default 30 s: a killed runner's deliveries come back within seconds, which is
    /// what the tests that kill runners wait for.
    pub fn new() -> RedisPrefix {
        RedisPrefix::with("&lease=5s")
    }

    /// A prefix on the shared server, with extra URL parameters (`&lease=2s`).
    pub fn with(params: &str) -> RedisPrefix {
        require_redis();
        RedisPrefix::on(&format!("redis://{REDIS_HOST}"), params)
    }

    /// A prefix on the server at `server` (`redis://host:port`), with extra URL parameters.
    pub fn on(server: &str, params: &str) -> RedisPrefix {
        let prefix = RedisPrefix {
            server: server.to_string(),
            data: server.to_string(),
            nodes: vec![server.to_string()],
            cluster: false,
            prefix: format!("{}:", owned_name()),
            params: params.to_string(),
        };
        prefix.sweep();
        prefix
    }

    /// A prefix on the test process's Sentinel set ([`redis_ha::shared_sentinels`]), with extra
    /// URL parameters.
    pub fn on_sentinels(params: &str) -> RedisPrefix {
        let set = redis_ha::shared_sentinels();
        let mut prefix = RedisPrefix::on(&format!("redis://127.0.0.1:{}", set.primary()), params);
        prefix.server = set.url();
        prefix
    }

    /// A prefix on the test process's Redis Cluster ([`redis_ha::shared_cluster`]), with extra
    /// URL parameters.
    pub fn on_cluster(params: &str) -> RedisPrefix {
        let cluster = redis_ha::shared_cluster();
        let nodes = cluster.node_urls();
        let mut prefix = RedisPrefix::on(&nodes[0], params);
        (prefix.server, prefix.nodes, prefix.cluster) = (cluster.url(), nodes, true);
        prefix
    }

    /// Deletes, once per test process, the keys killed runs left under prefixes of their own on
    /// the shared server.
    fn sweep(&self) {
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(|| {
            let Ok(client) = redis::Client::open(self.data.as_str()) else { return };
            let Ok(mut c) = client.get_connection() else { return };
            let keys: Vec<String> = redis::cmd("KEYS").arg("sluice-test-*").query(&mut c).unwrap_or_default();
            let dead: Vec<&String> =
                keys.iter().filter(|k| k.split(':').next().is_some_and(left_by_a_dead_run)).collect();
            for chunk in dead.chunks(500) {
                let _: Result<(), _> = redis::cmd("DEL").arg(chunk).query(&mut c);
            }
        });
    }

    /// A plain connection to the server, for looking at keys.
    pub fn raw(&self) -> redis::Connection {
        let client = redis::Client::open(self.data.as_str()).expect("redis url");
        client.get_connection().expect("connect to redis")
    }
}

impl Drop for RedisPrefix {
    /// Each node's keys, one at a time (a cluster's are in many slots).
    fn drop(&mut self) {
        for node in &self.nodes {
            let Ok(client) = redis::Client::open(node.as_str()) else { continue };
            let Ok(mut c) = client.get_connection() else { continue };
            let keys: Vec<String> =
                redis::cmd("KEYS").arg(format!("{}*", self.prefix)).query(&mut c).unwrap_or_default();
            let mut pipe = redis::pipe();
            for key in &keys {
                pipe.cmd("DEL").arg(key).ignore();
            }
            let _: Result<(), _> = pipe.query(&mut c);
        }
    }
}

impl Place for RedisPrefix {
    type Broker = sluice::broker::redis::Redis;

    fn url(&self) -> String {
        format!("{}?prefix={}{}", self.server, self.prefix, self.params)
    }

    async fn connect(&self) -> Self::Broker {
        sluice::broker::redis::Redis::connect(&self.url()).await.expect("connect to redis")
    }

    /// Entries in the stream, delivered or not: a killed runner's deliveries count until
    /// they are acked, as on RabbitMQ. (Delayed copies not yet due do not count.)
    async fn depth(&self, queue: &str) -> u32 {
        assert!(!self.cluster, "depth is read on one server: a cluster's keys are named by the broker's hash tags");
        redis::cmd("XLEN").arg(format!("{}s:{queue}", self.prefix)).query(&mut self.raw()).expect("XLEN")
    }
}

pub const NATS_URL: &str = "nats://127.0.0.1:4222";

/// A name prefix of its own on the shared NATS server (JetStream), for one test: its streams
/// and buckets are removed on drop.
pub struct NatsPrefix {
    pub prefix: String,
    /// Extra URL parameters (`&lease=2s`).
    pub params: String,
}

impl NatsPrefix {
    /// A prefix whose deliveries are leased for 5 s, not the default 30 s (as `RedisPrefix`).
    pub fn new() -> NatsPrefix {
        NatsPrefix::with("&lease=5s")
    }

    /// A prefix with extra URL parameters (`&lease=2s`); fails (never skips) when NATS is down.
    pub fn with(params: &str) -> NatsPrefix {
        if TcpStream::connect_timeout(&"127.0.0.1:4222".parse().expect("address"), Duration::from_secs(2)).is_err() {
            panic!("NATS is not reachable at {NATS_URL}. Start it with `nats-server -js &`.");
        }
        NatsPrefix::sweep();
        NatsPrefix { prefix: owned_name(), params: params.to_string() }
    }

    /// Deletes, once per test process, the streams and buckets killed runs left under prefixes
    /// of their own on the shared server.
    fn sweep() {
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(|| {
            let sweep = std::thread::spawn(|| {
                use futures_util::StreamExt as _;
                let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
                runtime.block_on(async {
                    let Ok(client) = async_nats::connect("127.0.0.1:4222").await else { return };
                    let js = async_nats::jetstream::new(client);
                    let names: Vec<String> = js.stream_names().filter_map(|n| async { n.ok() }).collect().await;
                    for name in names {
                        let prefix = name.strip_prefix("KV_").unwrap_or(&name);
                        if prefix.split('_').next().is_some_and(left_by_a_dead_run) {
                            let _ = js.delete_stream(&name).await;
                        }
                    }
                });
            });
            let _ = sweep.join();
        });
    }
}

impl Drop for NatsPrefix {
    fn drop(&mut self) {
        let url = self.url();
        // Drop may run inside a test's runtime: the cleanup gets a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            runtime.block_on(async {
                if let Ok(broker) = sluice::broker::jetstream::JetStream::connect(&url).await {
                    let _ = broker.destroy().await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

impl Place for NatsPrefix {
    type Broker = sluice::broker::jetstream::JetStream;

    fn url(&self) -> String {
        format!("{NATS_URL}?prefix={}{}", self.prefix, self.params)
    }

    async fn connect(&self) -> Self::Broker {
        sluice::broker::jetstream::JetStream::connect(&self.url()).await.expect("connect to nats")
    }

    /// Messages in the queue's stream, delivered or not: a killed runner's deliveries count
    /// until they are acked, as on RabbitMQ. (Delayed copies count too.)
    async fn depth(&self, queue: &str) -> u32 {
        let broker = self.connect().await;
        let messages = broker.messages(queue).await.unwrap_or_else(|e| panic!("messages in {queue}: {e}"));
        broker.close().await;
        messages
    }
}

/// A name prefix of its own on the suite's SQS emulator (moto) or another, for one test: every
/// queue under it is deleted on drop.
pub struct SqsPrefix {
    pub prefix: String,
    /// Extra URL parameters (`&lease=3s`).
    pub params: String,
    /// The emulator's endpoint.
    pub endpoint: String,
}

impl SqsPrefix {
    /// A prefix whose deliveries are leased for 5 s, not the default 30 s (as `RedisPrefix`).
    pub fn new() -> SqsPrefix {
        SqsPrefix::with("&lease=5s")
    }

    /// A prefix with extra URL parameters; fails (never skips) when the emulator is down.
    pub fn with(params: &str) -> SqsPrefix {
        SqsPrefix::on(&moto::require_sqs(), params)
    }

    /// A prefix on the emulator at `endpoint` (one of the test's own), with extra URL
    /// parameters.
    pub fn on(endpoint: &str, params: &str) -> SqsPrefix {
        let id = uuid::Uuid::now_v7().simple().to_string();
        SqsPrefix {
            prefix: format!("t{}", &id[id.len() - 16..]),
            params: params.to_string(),
            endpoint: endpoint.into(),
        }
    }
}

impl Drop for SqsPrefix {
    fn drop(&mut self) {
        let url = self.url();
        // Drop may run inside a test's runtime: the cleanup gets a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            runtime.block_on(async {
                if let Ok(broker) = sluice::broker::sqs::Sqs::connect_with_env(&url, moto::credentials()).await {
                    let _ = broker.destroy().await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

impl Place for SqsPrefix {
    type Broker = sluice::broker::sqs::Sqs;

    fn url(&self) -> String {
        format!("sqs://us-east-1/{}?endpoint={}{}", self.prefix, self.endpoint, self.params)
    }

    async fn connect(&self) -> Self::Broker {
        sluice::broker::sqs::Sqs::connect_with_env(&self.url(), moto::credentials())
            .await
            .expect("connect to the SQS emulator")
    }

    /// Messages in the queue, visible or not: a killed runner's deliveries count until they
    /// are deleted, as on RabbitMQ. (Delayed copies count too.)
    async fn depth(&self, queue: &str) -> u32 {
        let broker = self.connect().await;
        let messages = broker.messages(queue).await.unwrap_or_else(|e| panic!("messages in {queue}: {e}"));
        broker.close().await;
        messages
    }
}

/// An HTTP client for the tests, with the TLS provider `sluice` installs. One per process:
/// each new client parses the system's root certificates (in a test build, about 3 % of the
/// suite's CPU, polls making one every 200 ms). It keeps no idle connection, which would
/// belong to the runtime of the test that opened it.
pub fn http() -> reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT
        .get_or_init(|| {
            sluice::install_tls_provider();
            reqwest::Client::builder().pool_max_idle_per_host(0).build().expect("an HTTP client")
        })
        .clone()
}

/// A vhost of its own for one test, so tests run in parallel and repeatedly.
pub struct Vhost {
    pub name: String,
}

impl Vhost {
    pub fn new() -> Vhost {
        require_rabbitmq();
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(delete_vhosts_of_dead_runs);
        let name = owned_name();
        let made = management("PUT", &format!("/api/vhosts/{name}"), "").map(|(code, _)| code);
        assert_eq!(made, Ok(201), "making vhost {name}");
        let permissions = r#"{"configure":".*","write":".*","read":".*"}"#;
        let granted = management("PUT", &format!("/api/permissions/{name}/guest"), permissions).map(|(code, _)| code);
        assert!(matches!(granted, Ok(201 | 204)), "guest's permissions on {name}: {granted:?}");
        Vhost { name }
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@{RABBIT_HOST}/{}", self.name)
    }

    pub async fn connect(&self) -> Amqp {
        Amqp::connect(&self.url(), sluice::broker::amqp::Timeouts::default()).await.expect("connect to the test vhost")
    }

    /// Has the broker close every connection of this vhost (ours and the runner's); how many.
    pub fn close_all_connections(&self) -> usize {
        let out = Command::new("rabbitmqctl")
            .args(["close_all_connections", "-p", &self.name, "test"])
            .output()
            .expect("rabbitmqctl runs");
        assert!(out.status.success(), "close_all_connections failed: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| l.strip_prefix("Closed ")?.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("unexpected rabbitmqctl output: {text}"))
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        // Nothing to be done here when it fails: the next run's sweep deletes it.
        let _ = management("DELETE", &format!("/api/vhosts/{}", self.name), "");
    }
}

/// A directory with one pipeline file.
pub fn pipeline(yaml: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("pipeline.yaml"), yaml).expect("write pipeline");
    dir
}

/// A topic exchange `ev` and a queue `work` bound to every routing key; `queue` is the rest of
/// the queue's definition (lines indented by four spaces: handler, retry, ...).
pub fn work_pipeline(queue: &str) -> tempfile::TempDir {
    pipeline(&format!(
        "version: 1\nexchanges:\n  ev: {{type: topic}}\nqueues:\n  work:\n    bind: [{{exchange: ev, routing_key: \"#\"}}]\n{queue}"
    ))
}

/// [`work_pipeline`] calling `{receiver}/hook`; `extra` is appended to the queue's definition.
pub fn webhook_pipeline(receiver: &Receiver, extra: &str) -> tempfile::TempDir {
    pipeline(&webhook_yaml(receiver, extra))
}

/// The text of a [`webhook_pipeline`].
pub fn webhook_yaml(receiver: &Receiver, extra: &str) -> String {
    format!(
        "version: 1\nexchanges:\n  ev: {{type: topic}}\nqueues:\n  work:\n    bind: [{{exchange: ev, routing_key: \"#\"}}]\n    handler:\n      webhook: {{url: \"{}/hook\"}}\n{extra}",
        receiver.uri()
    )
}

/// A running `sluice run` process; killed on drop.
pub struct Sluice {
    pub child: Child,
    pub log: PathBuf,
}

impl Sluice {
    /// Starts `sluice run DIR --broker URL` with extra args; stderr goes to a log file in DIR.
    /// Unless the args or `env` choose one, the idempotency store is the embedded broker's own
    /// file, or beside RabbitMQ, JetStream and SQS a state directory in DIR: the default there (`.sluice` in the
    /// working directory) would be shared by every test and every earlier run, so keys handled
    /// there would be skipped here as duplicates.
    pub fn run(dir: &Path, url: &str, extra: &[&str]) -> Sluice {
        Sluice::run_with_env(dir, url, extra, &[])
    }

    /// Like [`Sluice::run`], with extra environment variables for the process (secrets,
    /// values that `{{env.X}}` templates read).
    pub fn run_with_env(dir: &Path, url: &str, extra: &[&str], env: &[(&str, &str)]) -> Sluice {
        let log = dir.join(format!("sluice-{}.log", uuid::Uuid::now_v7()));
        let file = std::fs::File::create(&log).expect("log file");
        let mut command = Command::new(env!("CARGO_BIN_EXE_sluice"));
        if ["amqp", "nats", "sqs"].iter().any(|scheme| url.starts_with(scheme)) {
            command.env("SLUICE_DEDUP", dir.join(".sluice"));
        }
        command.envs(moto::CREDENTIALS.iter().copied());
        let child = command
            .arg("run")
            .arg(dir)
            .args(["--broker", url])
            .args(extra)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("spawn sluice");
        Sluice { child, log }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends a signal (e.g. libc::SIGTERM, libc::SIGKILL).
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) with the pid of a child we own; no memory is touched.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// SIGTERM, then waits for exit with a deadline; the exit code.
    pub fn stop(&mut self, deadline: Duration) -> Option<i32> {
        self.signal(libc::SIGTERM);
        self.wait(deadline)
    }

    /// Waits for exit with a deadline; the exit code, or None if killed by a signal.
    pub fn wait(&mut self, deadline: Duration) -> Option<i32> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code();
            }
            assert!(start.elapsed() < deadline, "sluice did not exit within {deadline:?}; log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Publishes an envelope with the given idempotency key and payload.
pub async fn publish<B: Publish>(
    broker: &B,
    exchange: &str,
    routing_key: &str,
    key: &str,
    payload: serde_json::Value,
) -> Envelope<'static> {
    let envelope = Envelope::new("test.event", &payload, Some(key.to_string()));
    publish_raw(broker, exchange, routing_key, envelope.encode(), Headers::new()).await;
    envelope
}

/// Publishes any body (e.g. a malformed one) with headers.
pub async fn publish_raw<B: Publish>(broker: &B, exchange: &str, routing_key: &str, body: Vec<u8>, headers: Headers) {
    let message = Outgoing { body, headers, ..Outgoing::default() };
    broker.publish(exchange, routing_key, message).await.expect("publish confirmed");
}

/// A message read from a queue: body, the headers sluice reads, and all AMQP properties.
pub struct Drained {
    pub body: Vec<u8>,
    pub headers: std::collections::BTreeMap<String, HeaderValue>,
    pub properties: lapin::BasicProperties,
}

/// Every message in `queue` with its AMQP properties, left in place (nacked back).
pub async fn drain_messages(url: &str, queue: &str) -> Vec<Drained> {
    use lapin::options::{BasicGetOptions, BasicNackOptions};
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await.expect("connect");
    let channel = conn.create_channel().await.expect("channel");
    let mut out = Vec::new();
    let mut held = Vec::new();
    while let Some(msg) = channel.basic_get(queue.into(), BasicGetOptions::default()).await.expect("basic_get") {
        let mut headers = std::collections::BTreeMap::new();
        if let Some(table) = msg.delivery.properties.headers() {
            for (k, v) in table.inner() {
                let value = match v {
                    lapin::types::AMQPValue::LongString(s) => {
                        HeaderValue::Str(String::from_utf8_lossy(s.as_bytes()).into_owned())
                    }
                    lapin::types::AMQPValue::LongLongInt(i) => HeaderValue::Int(*i),
                    lapin::types::AMQPValue::LongInt(i) => HeaderValue::Int(i64::from(*i)),
                    _ => continue,
                };
                headers.insert(k.as_str().to_string(), value);
            }
        }
        out.push(Drained { body: msg.delivery.data.clone(), headers, properties: msg.delivery.properties.clone() });
        held.push(msg);
    }
    for msg in held {
        let _ = msg.delivery.acker.nack(BasicNackOptions { requeue: true, ..Default::default() }).await;
    }
    let _ = conn.close(200, "done".into()).await;
    out
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// A runner's gauge `metric{queue="QUEUE"}` from its `/metrics` at `admin` (HOST:PORT); None
/// while the endpoint or the sample is not there.
pub async fn gauge(admin: &str, metric: &str, queue: &str) -> Option<f64> {
    sample(admin, &format!("{metric}{{queue=\"{queue}\"}}")).await
}

/// A runner's sample `series` (a metric name and its labels, as `/metrics` prints them, e.g.
/// `sluice_config_reloads_total{result="applied"}`) from its `/metrics` at `admin`; None while
/// the endpoint or the sample is not there.
pub async fn sample(admin: &str, series: &str) -> Option<f64> {
    let text = http().get(format!("http://{admin}/metrics")).send().await.ok()?.text().await.ok()?;
    let prefix = format!("{series} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
}

/// Starts `sluice run DIR --broker URL --admin ADDR` (as [`Sluice::run`]) on a free port and
/// waits until the worker of `queue` is up (its breaker gauge is there); the admin address.
pub async fn run_with_admin(dir: &Path, url: &str, queue: &str) -> (Sluice, String) {
    run_with_admin_and(dir, url, queue, &[]).await
}

/// [`run_with_admin`] with extra args.
pub async fn run_with_admin_and(dir: &Path, url: &str, queue: &str, extra: &[&str]) -> (Sluice, String) {
    run_with_admin_env(dir, url, queue, extra, &[]).await
}

/// [`run_with_admin_and`] with extra environment variables (as [`Sluice::run_with_env`]).
pub async fn run_with_admin_env(
    dir: &Path,
    url: &str,
    queue: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Sluice, String) {
    let admin = format!("127.0.0.1:{}", free_port());
    let args: Vec<&str> = ["--admin", admin.as_str()].into_iter().chain(extra.iter().copied()).collect();
    let sluice = Sluice::run_with_env(dir, url, &args, env);
    wait_until(Duration::from_secs(30), &format!("the breaker gauge of {queue}"), || async {
        gauge(&admin, "sluice_circuit_state", queue).await.is_some()
    })
    .await;
    (sluice, admin)
}

/// Rewrites the pipeline file of a [`pipeline`] directory (the watcher of the runner whose
/// admin endpoint is `admin` sees it) and waits until that runner has applied `n` reloads
/// (`sluice_config_reloads_total{result="applied"}`).
pub async fn reload_pipeline(dir: &Path, admin: &str, text: &str, n: u64) {
    std::fs::write(dir.join("pipeline.yaml"), text).expect("rewrite the pipeline");
    wait_until(Duration::from_secs(30), &format!("{n} reload(s) applied"), || async {
        sample(admin, "sluice_config_reloads_total{result=\"applied\"}").await.is_some_and(|v| v >= n as f64)
    })
    .await;
}

/// Polls `check` until it returns true or the deadline passes (then panics with `what`).
pub async fn wait_until<F, Fut>(deadline: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < deadline, "timed out after {deadline:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits, blocking the thread, until `ready` holds, or panics after `deadline` saying `what`
/// never happened (for servers a test starts itself; run from `block_in_place` in async tests).
pub fn wait_blocking(deadline: Duration, what: &str, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < deadline, "{what}: not after {deadline:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The Idempotency-Key of every request a wiremock server received, in arrival order.
pub async fn keys_received(server: &wiremock::MockServer) -> Vec<String> {
    server
        .received_requests()
        .await
        .unwrap_or_default()
        .iter()
        .filter_map(|r| r.headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_string))
        .collect()
}

/// Declares the pipeline's topology the way `sluice run` does (idempotent), so a test can
/// publish before the runner is up.
pub async fn declare<B: Broker>(dir: &Path, broker: &B) {
    let validation = sluice::config::load(&[dir.to_path_buf()]);
    let config = validation.config.unwrap_or_else(|| panic!("test pipeline invalid: {:?}", validation.diagnostics));
    broker.declare(&sluice::topology::plan(&config)).await.expect("declare topology");
}

/// How a one-shot `sluice` command ended.
#[derive(Debug)]
pub struct Finished {
    /// The exit code, or None if killed by a signal.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// The most memory the process had resident at once (peak RSS), in KiB: its `VmHWM`,
    /// read every 20 ms while it runs (a peak in its last 20 ms can be missed). Not rusage's
    /// figure, which counts the peak of this test process too (a child inherits it at exec).
    pub peak_rss_kib: u64,
}

/// A webhook pipeline with idempotency on (a 1 h ttl), calling `receiver`.
pub fn idempotent_pipeline(receiver: &Receiver, concurrency: u32) -> tempfile::TempDir {
    webhook_pipeline(receiver, &format!("    concurrency: {concurrency}\n    idempotency: {{ttl: 1h}}\n"))
}

/// Whether `place`'s broker keeps no order across runners (no single active consumer, no
/// order per key), in which case `validate --broker`
/// has been checked to refuse the pipeline in `dir` at `setting` (`ordered`, `order_by`)
/// before anything runs: a body that needs the capability ends there on such a broker.
pub async fn refused_without_single_active_consumer<P: Place>(place: &P, dir: &Path, setting: &str) -> bool {
    use sluice::broker::Broker as _;
    let broker = place.connect().await;
    let lacks = !broker.capabilities().orders();
    broker.close().await;
    if lacks {
        let path = dir.to_str().expect("utf-8");
        let refused = broker_cli(&["validate", path], &place.url()).await;
        assert_eq!(refused.code, Some(1), "{refused:?}");
        assert!(refused.stdout.contains(&format!("/{setting}: ")), "{}", refused.stdout);
    }
    lacks
}

/// Runs `sluice ARGS --broker URL` off the async runtime (a receiver in the test keeps
/// serving), within two minutes.
pub async fn broker_cli(args: &[&str], url: &str) -> Finished {
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.extend(["--broker".to_string(), url.to_string()]);
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        sluice_cli(&args, &[], Duration::from_secs(120))
    })
    .await
    .expect("cli task")
}

/// Runs `sluice ARGS` to completion with extra environment variables; killed (and the test
/// failed) if it takes longer than `deadline`.
pub fn sluice_cli(args: &[&str], env: &[(&str, &str)], deadline: Duration) -> Finished {
    // Files rather than pipes: nothing to drain while we poll for the exit.
    let out = tempfile::tempfile().expect("stdout file");
    let err = tempfile::tempfile().expect("stderr file");
    // The log filter is sluice's own default unless the test sets one in `env`.
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .env_remove("RUST_LOG")
        .envs(moto::CREDENTIALS.iter().copied())
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("dup"))
        .stderr(err.try_clone().expect("dup"))
        .spawn()
        .expect("spawn sluice");
    let start = Instant::now();
    let pid = child.id() as libc::pid_t;
    let mut peak_rss_kib = 0;
    let status = loop {
        peak_rss_kib = peak_rss_kib.max(vm_hwm_kib(pid).unwrap_or(0));
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sluice {args:?} did not exit within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let read = |mut file: std::fs::File| {
        use std::io::{Read, Seek};
        let mut text = String::new();
        file.rewind().expect("rewind");
        file.read_to_string(&mut text).expect("utf-8 output");
        text
    };
    Finished { code: status.code(), stdout: read(out), stderr: read(err), peak_rss_kib }
}

/// The peak resident memory of the running process `pid` so far (`VmHWM`), in KiB.
fn vm_hwm_kib(pid: libc::pid_t) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    line.trim().strip_suffix("kB")?.trim().parse().ok()
}

/// A header of a dead-lettered message as text, if present and a string.
pub fn header_str<'a>(headers: &'a std::collections::BTreeMap<String, HeaderValue>, name: &str) -> Option<&'a str> {
    match headers.get(name) {
        Some(HeaderValue::Str(s)) => Some(s),
        _ => None,
    }
}

/// Writes an executable `#!/bin/sh` script into `dir` (for command handlers).
pub fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write script");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod script");
    path
}

/// The lines of a file a handler appends to (none while it does not exist). A line still being
/// written (no newline yet) is left out.
pub fn lines(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete.lines().map(str::to_string).collect()
}

/// The lines of `path` (complete ones, as [`lines`] reads them) that start with `prefix`, without it.
pub fn lines_with(path: &Path, prefix: &str) -> Vec<String> {
    lines(path).iter().filter_map(|l| l.strip_prefix(prefix)).map(str::to_string).collect()
}

/// Whether `pid` is a running process. A killed process whose new parent (the container's
/// init) has not reaped it yet lingers as a zombie; it is dead all the same.
pub fn is_running(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 only checks that the process exists; nothing is delivered.
    let exists = unsafe { libc::kill(pid, 0) } == 0;
    exists
        && std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            // The state follows the parenthesised command name, which may contain spaces.
            stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z'))
        })
}

/// The established TCP connections of process `pid`, as (local port, remote port): its socket
/// inodes in `/proc/<pid>/fd` matched against `/proc/net/tcp{,6}`.
pub fn connections(pid: u32) -> Vec<(u16, u16)> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return Vec::new() };
    let inodes: std::collections::HashSet<String> = fds
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_str()?;
            Some(target.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    let port = |address: &str| u16::from_str_radix(address.rsplit(':').next()?, 16).ok();
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|table| {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            table
                .lines()
                .skip(1)
                .filter_map(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let (local, remote, state, inode) =
                        (fields.get(1)?, fields.get(2)?, fields.get(3)?, fields.get(9)?);
                    // ESTABLISHED, and the process's.
                    (*state == "01" && inodes.contains(*inode)).then(|| Some((port(local)?, port(remote)?)))?
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The pid a script wrote to `pidfile`, once it is completely written.
pub fn read_pid(pidfile: &Path) -> Option<libc::pid_t> {
    let text = std::fs::read_to_string(pidfile).ok()?;
    text.strip_suffix('\n')?.parse().ok()
}

/// How often each line occurs.
pub fn counts<I: IntoIterator<Item = S>, S: Into<String>>(items: I) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for item in items {
        *counts.entry(item.into()).or_insert(0) += 1;
    }
    counts
}

/// One request as the [`Receiver`] saw it, and how it was answered.
#[derive(Debug, Clone)]
pub struct Hit {
    /// When its head arrived.
    pub at: Instant,
    /// The same on the wall clock, which brokers keep due times on: what "not before it was
    /// due" is measured with (a wall clock being slewed runs at another rate than `at`'s).
    pub wall: std::time::SystemTime,
    pub method: String,
    /// Path and query exactly as sent (still percent-encoded).
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The status it was (or, while a delayed reply is pending, will be) answered with.
    pub status: u16,
    /// Requests in flight at the receiver when it arrived, itself included.
    pub in_flight: usize,
}

/// How long after `earlier` `later` arrived, on the wall clock (zero if it came first).
pub fn wall_gap(earlier: &Hit, later: &Hit) -> Duration {
    later.wall.duration_since(earlier.wall).unwrap_or_default()
}

/// How long since `since` on the wall clock, which brokers keep due times on.
pub fn wall_elapsed(since: std::time::SystemTime) -> Duration {
    since.elapsed().unwrap_or_default()
}

/// Whether `elapsed` (on the wall clock) is not before `delay`: brokers keep due times in
/// whole milliseconds (RabbitMQ's message TTL, Redis's `TIME` in the scripts), so a copy sent
/// in the middle of a millisecond may come back up to one millisecond short of its delay.
pub fn not_before(elapsed: Duration, delay: Duration) -> bool {
    elapsed + Duration::from_millis(1) >= delay
}

impl Hit {
    /// The first value of a header (names are case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The `Idempotency-Key` header ("" when absent).
    pub fn key(&self) -> &str {
        self.header("idempotency-key").unwrap_or_default()
    }

    /// The body parsed as JSON (panics if it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// Whether it was answered 2xx.
    pub fn succeeded(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// What the [`Receiver`] answers to one request.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// How long the request stays in flight before the answer (it is recorded when it arrives).
    pub delay: Duration,
    /// A gate the answer waits for after the delay.
    pub held: Option<Gate>,
}

/// Holds answers back until a test opens it, so that a fault can be injected while requests
/// are known to be in flight, however slowly the machine runs.
#[derive(Debug, Clone)]
pub struct Gate(Arc<tokio::sync::watch::Sender<bool>>);

impl Gate {
    pub fn closed() -> Gate {
        Gate(Arc::new(tokio::sync::watch::channel(false).0))
    }

    pub fn open(&self) {
        self.0.send_replace(true);
    }

    async fn passed(&self) {
        // The sender lives in `self`, so the wait ends only by the gate opening.
        let _ = self.0.subscribe().wait_for(|open| *open).await;
    }
}

impl Reply {
    pub fn status(status: u16) -> Reply {
        Reply { status, headers: Vec::new(), body: String::new(), delay: Duration::ZERO, held: None }
    }

    pub fn ok() -> Reply {
        Reply::status(200)
    }

    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    pub fn body(mut self, body: &str) -> Reply {
        self.body = body.to_string();
        self
    }

    pub fn after(mut self, delay: Duration) -> Reply {
        self.delay = delay;
        self
    }

    /// Answers only once `gate` is open.
    pub fn held_by(mut self, gate: &Gate) -> Reply {
        self.held = Some(gate.clone());
        self
    }
}

type Responder = dyn Fn(&Hit, usize) -> Reply + Send + Sync;

struct ReceiverState {
    hits: Mutex<Vec<Hit>>,
    /// Requests so far per `Idempotency-Key` (a scan of `hits` per request would make a long
    /// run quadratic).
    per_key: Mutex<std::collections::HashMap<String, usize>>,
    in_flight: std::sync::atomic::AtomicUsize,
    max_in_flight: std::sync::atomic::AtomicUsize,
    respond: Box<Responder>,
}

/// A webhook receiver that records every request (method, target, headers, body, arrival
/// time, the status it got) and how many requests were in flight at once — what wiremock does
/// not record. Side effects are counted by `Idempotency-Key`. Stops on drop.
pub struct Receiver {
    uri: String,
    state: Arc<ReceiverState>,
    server: tokio::task::JoinHandle<()>,
}

impl Receiver {
    /// Starts a receiver; `respond` gets each request and how many earlier requests carried the
    /// same `Idempotency-Key` (0 for the first call with a key; all requests without one count
    /// as one key).
    pub async fn start(respond: impl Fn(&Hit, usize) -> Reply + Send + Sync + 'static) -> Receiver {
        use hyper_util::rt::TokioIo;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
        let uri = format!("http://{}", listener.local_addr().expect("local addr"));
        let state = Arc::new(ReceiverState {
            hits: Default::default(),
            per_key: Default::default(),
            in_flight: Default::default(),
            max_in_flight: Default::default(),
            respond: Box::new(respond),
        });
        let shared = state.clone();
        let server = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let state = shared.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| state.clone().handle(request));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Receiver { uri, state, server }
    }

    /// A receiver that answers 200 at once to everything.
    pub async fn ok() -> Receiver {
        Receiver::start(|_, _| Reply::ok()).await
    }

    /// `http://127.0.0.1:PORT`, without a trailing slash.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// Every request so far, in arrival order.
    pub fn hits(&self) -> Vec<Hit> {
        self.state.hits.lock().expect("hits lock").clone()
    }

    /// The requests with this `Idempotency-Key`, in arrival order.
    pub fn hits_for(&self, key: &str) -> Vec<Hit> {
        self.hits().into_iter().filter(|h| h.key() == key).collect()
    }

    /// The distinct keys that got a 2xx answer.
    pub fn succeeded_keys(&self) -> std::collections::BTreeSet<String> {
        self.hits().iter().filter(|h| h.succeeded()).map(|h| h.key().to_string()).collect()
    }

    /// The most requests that were ever in flight at the same time.
    pub fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until at least `n` requests have arrived, then returns them all.
    pub async fn wait_for(&self, n: usize, deadline: Duration) -> Vec<Hit> {
        wait_until(deadline, &format!("{n} request(s) at the receiver"), || async { self.hits().len() >= n }).await;
        self.hits()
    }
}

impl ReceiverState {
    async fn handle(
        self: Arc<Self>,
        request: hyper::Request<hyper::body::Incoming>,
    ) -> Result<hyper::Response<http_body_util::Full<hyper::body::Bytes>>, std::convert::Infallible> {
        use http_body_util::BodyExt;
        use std::sync::atomic::Ordering;

        /// Leaves the in-flight count however the request ends.
        struct InFlight<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for InFlight<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }

        let at = Instant::now();
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        let _guard = InFlight(&self.in_flight);
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let (parts, body) = request.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes().to_vec()).unwrap_or_default();
        let mut hit = Hit {
            at,
            wall: std::time::SystemTime::now(),
            method: parts.method.to_string(),
            target: parts.uri.path_and_query().map(|p| p.as_str().to_string()).unwrap_or_default(),
            headers: parts
                .headers
                .iter()
                .map(|(n, v)| (n.as_str().to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
                .collect(),
            body,
            status: 0,
            in_flight: now,
        };
        let reply = {
            let mut hits = self.hits.lock().expect("hits lock");
            let earlier = {
                let mut per_key = self.per_key.lock().expect("per-key lock");
                let count = per_key.entry(hit.key().to_string()).or_default();
                *count += 1;
                *count - 1
            };
            let reply = (self.respond)(&hit, earlier);
            hit.status = reply.status;
            hits.push(hit);
            reply
        };
        if !reply.delay.is_zero() {
            tokio::time::sleep(reply.delay).await;
        }
        if let Some(gate) = &reply.held {
            gate.passed().await;
        }
        let mut response = hyper::Response::builder().status(reply.status);
        for (name, value) in &reply.headers {
            response = response.header(name, value);
        }
        let body = http_body_util::Full::new(hyper::body::Bytes::from(reply.body));
        Ok(response.body(body).expect("valid response"))
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}
