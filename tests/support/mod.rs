//! Helpers for tests against the real RabbitMQ and the real `sluice` binary: a vhost per test
//! (deleted on drop), a pipeline directory, the binary as a child process, publishing and
//! reading queues through the library, and waiting on conditions with a deadline.
#![allow(dead_code)] // each test crate uses a different subset

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sluice::broker::amqp::Amqp;
use sluice::broker::{Broker, HeaderValue, Headers, Outgoing};
use sluice::envelope::Envelope;

pub const RABBIT_HOST: &str = "127.0.0.1:5672";

/// Fails (never skips) when RabbitMQ is down, saying how to start it.
pub fn require_rabbitmq() {
    if TcpStream::connect_timeout(&RABBIT_HOST.parse().expect("address"), Duration::from_secs(2)).is_err() {
        panic!(
            "RabbitMQ is not reachable at {RABBIT_HOST}. Start it with `rabbitmq-server -detached && rabbitmqctl await_startup` (or run .ci/run, which does)."
        );
    }
}

fn rabbitmqctl(args: &[&str]) {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl runs (tests run where RabbitMQ is installed)");
    assert!(out.status.success(), "rabbitmqctl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// A vhost of its own for one test, so tests run in parallel and repeatedly.
pub struct Vhost {
    pub name: String,
}

impl Vhost {
    pub fn new() -> Vhost {
        require_rabbitmq();
        let name = format!("sluice-test-{}", uuid::Uuid::now_v7());
        rabbitmqctl(&["add_vhost", &name]);
        rabbitmqctl(&["set_permissions", "-p", &name, "guest", ".*", ".*", ".*"]);
        Vhost { name }
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@{RABBIT_HOST}/{}", self.name)
    }

    pub async fn connect(&self) -> Amqp {
        Amqp::connect(&self.url()).await.expect("connect to the test vhost")
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl").args(["delete_vhost", &self.name]).output();
    }
}

/// A directory with one pipeline file.
pub fn pipeline(yaml: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("pipeline.yaml"), yaml).expect("write pipeline");
    dir
}

/// A running `sluice run` process; killed on drop.
pub struct Sluice {
    pub child: Child,
    pub log: PathBuf,
}

impl Sluice {
    /// Starts `sluice run DIR --broker URL` with extra args; stderr goes to a log file in DIR.
    pub fn run(dir: &Path, url: &str, extra: &[&str]) -> Sluice {
        let log = dir.join(format!("sluice-{}.log", uuid::Uuid::now_v7()));
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("run")
            .arg(dir)
            .args(["--broker", url])
            .args(extra)
            .env("RUST_LOG", "info")
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
pub async fn publish(
    broker: &Amqp,
    exchange: &str,
    routing_key: &str,
    key: &str,
    payload: serde_json::Value,
) -> Envelope {
    let envelope = Envelope::new("test.event", payload, Some(key.to_string()));
    publish_raw(broker, exchange, routing_key, envelope.encode(), Headers::new()).await;
    envelope
}

/// Publishes any body (e.g. a malformed one) with headers.
pub async fn publish_raw(broker: &Amqp, exchange: &str, routing_key: &str, body: Vec<u8>, headers: Headers) {
    let message = Outgoing { body, message_id: None, kind: None, timestamp: None, headers };
    broker.publish(exchange, routing_key, message).await.expect("publish confirmed");
}

/// Reads every message in `queue` (without removing them for good: they are nacked back).
pub async fn drain_queue(url: &str, queue: &str) -> Vec<(Vec<u8>, std::collections::BTreeMap<String, HeaderValue>)> {
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
        out.push((msg.delivery.data.clone(), headers));
        held.push(msg);
    }
    for msg in held {
        let _ = msg.delivery.acker.nack(BasicNackOptions { requeue: true, ..Default::default() }).await;
    }
    let _ = conn.close(200, "done".into()).await;
    out
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
pub async fn declare(dir: &Path, broker: &Amqp) {
    let validation = sluice::config::load(&[dir.to_path_buf()]);
    let config = validation.config.unwrap_or_else(|| panic!("test pipeline invalid: {:?}", validation.diagnostics));
    broker.declare(&sluice::topology::plan(&config)).await.expect("declare topology");
}
