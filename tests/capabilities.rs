//! Issue 32 item 1: `validate --broker` and `run` refuse, at file:line:column, what the chosen
//! broker cannot honour, naming the capability and the broker; the broker's kind alone says
//! what it can, so nothing is connected to. One test per capability refused, on Redis, on
//! the embedded broker and on JetStream; and a pipeline every broker honours passes on each
//! (on JetStream, without what it lacks: `ordered`, bodies past 64 MiB).

use std::time::Duration;

use crate::support::{self, sluice_cli};

/// A Redis URL validate must not need a server behind: nothing listens on a port just freed.
fn redis_nowhere() -> String {
    format!("redis://127.0.0.1:{}/5", support::free_port())
}

/// The brokers that refuse RabbitMQ's queue settings, as `--broker` values and as named in
/// messages. `dir` is the embedded broker's directory (never created by validate).
fn brokers(dir: &std::path::Path) -> Vec<(String, &'static str)> {
    vec![
        ("redis://127.0.0.1:6379/5".to_string(), "the Redis broker"),
        (redis_nowhere(), "the Redis broker"),
        (dir.join("broker").to_str().expect("utf-8").to_string(), "the embedded broker"),
        (format!("nats://127.0.0.1:{}", support::free_port()), "the JetStream broker"),
    ]
}

/// `queue` (YAML lines indented by four spaces, on line 6 of the file) validated against each
/// broker: exit 1 with exactly `error` at `line:column` (`{broker}` stands for its name).
fn refused(queue: &str, line: usize, column: usize, error: &str) {
    let dir = support::pipeline(&format!(
        "version: 1\nexchanges:\n  ev: {{type: topic}}\nqueues:\n  work:\n{queue}    bind: [{{exchange: ev, routing_key: \"#\"}}]\n    handler: {{command: {{program: /bin/true}}}}\n"
    ));
    let file = dir.path().join("pipeline.yaml");
    let path = dir.path().to_str().expect("utf-8");
    for (broker, name) in brokers(dir.path()) {
        let out = sluice_cli(&["validate", path, "--broker", &broker], &[], Duration::from_secs(20));
        let expected = format!("{}:{line}:{column}: error: {}", file.display(), error.replace("{broker}", name));
        let headlines: Vec<&str> = out.stdout.lines().filter(|l| l.contains(": error: ")).collect();
        assert_eq!((out.code, headlines), (Some(1), vec![expected.as_str()]), "--broker {broker}: {out:?}");
    }
    assert!(!dir.path().join("broker").exists(), "validate created the embedded broker's directory");
}

// Issue 32 item 1: priorities.
#[test]
fn priorities_are_refused_where_the_broker_has_none() {
    refused(
        "    type: classic\n    priority: 5\n",
        7,
        15,
        "/queues/work/priority: {broker} does not support priorities",
    );
}

// Issue 32 item 1: per-queue message TTL.
#[test]
fn a_message_ttl_is_refused_where_the_broker_expires_nothing() {
    refused(
        "    message_ttl: 10m\n",
        6,
        18,
        "/queues/work/message_ttl: {broker} does not support a message TTL (message_ttl)",
    );
}

// Issue 32 item 1: broker-side `arguments:` pass through only to RabbitMQ.
#[test]
fn broker_arguments_are_refused_where_they_do_not_pass_through() {
    refused(
        "    arguments: {x-max-length-bytes: 1000}\n",
        6,
        37,
        "/queues/work/arguments/x-max-length-bytes: {broker} does not support broker arguments (arguments:); they are RabbitMQ's",
    );
}

/// What every broker honours: each exchange kind, both queue types, a bound, an ordered queue,
/// the largest body sluice takes.
const EVERYWHERE: &str = "version: 1
exchanges:
  d: {type: direct}
  f: {type: fanout}
  t: {type: topic}
  h: {type: headers}
queues:
  work:
    type: classic
    max_length: 100
    ordered: true
    max_message_bytes: 512MiB
    bind:
      - {exchange: d, routing_key: a}
      - {exchange: f, routing_key: \"\"}
      - {exchange: t, routing_key: \"#\"}
      - {exchange: h, routing_key: \"\", arguments: {x-match: all, kind: a}}
    handler: {command: {program: /bin/true}}
  other:
    type: quorum
    handler: {command: {program: /bin/true}}
";

// Issue 32 item 1: a pipeline every broker honours passes with each.
#[test]
fn a_pipeline_every_broker_honours_passes_on_each() {
    let dir = support::pipeline(EVERYWHERE);
    let path = dir.path().to_str().expect("utf-8");
    let jetstream = support::pipeline(
        &EVERYWHERE.replace("    ordered: true\n", "").replace("max_message_bytes: 512MiB", "max_message_bytes: 64MiB"),
    );
    let mut all = brokers(dir.path());
    all.push(("amqp://guest:guest@127.0.0.1:5672/%2f".to_string(), "RabbitMQ"));
    for (broker, name) in all {
        let path = match name {
            "the JetStream broker" => jetstream.path().to_str().expect("utf-8"),
            _ => path,
        };
        let out = sluice_cli(&["validate", path, "--broker", &broker], &[], Duration::from_secs(20));
        assert_eq!(out.code, Some(0), "--broker {broker}: {out:?}");
    }
}

// Issue 35: JetStream (nats-server 2.9) has no single active consumer; `ordered` is refused.
#[test]
fn ordered_is_refused_on_jetstream() {
    let dir = support::pipeline(EVERYWHERE);
    let path = dir.path().to_str().expect("utf-8");
    let nats = format!("nats://127.0.0.1:{}", support::free_port());
    let out = sluice_cli(&["validate", path, "--broker", &nats], &[], Duration::from_secs(20));
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stdout.contains("/queues/work/ordered: the JetStream broker"), "{}", out.stdout);
}

// Issue 32 item 1: `run` refuses the same, before it connects (nothing listens at the URL).
#[test]
fn run_refuses_what_the_broker_cannot_honour_before_connecting() {
    let dir =
        support::work_pipeline("    priority: 3\n    type: classic\n    handler: {command: {program: /bin/true}}\n");
    let path = dir.path().to_str().expect("utf-8");
    let out = sluice_cli(&["run", path, "--broker", &redis_nowhere(), "--no-watch"], &[], Duration::from_secs(20));
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stderr.contains("/queues/work/priority: the Redis broker does not support priorities"),
        "{}",
        out.stderr
    );
}
