//! Issue 19's footguns, each once silent: an empty idempotency key taken for a duplicate,
//! operator commands that made an empty broker where they were pointed, a malformed signing
//! secret that dead-lettered every message, escape sequences from messages and test files on
//! the operator's terminal, and headers a payload could choose.

use crate::support;

use std::time::Duration;

use serde_json::json;
use sluice::broker::{Broker as _, HeaderValue, Headers, Outgoing, Publish as _};
use sluice::envelope;
use support::{EmbeddedDir, Finished, Place, Receiver, Sluice};

const DEADLINE: Duration = Duration::from_secs(60);

/// Runs `sluice ARGS` with extra environment variables, off the async runtime (a receiver
/// keeps serving meanwhile).
async fn cli(args: &[&str], env: &[(&str, &str)]) -> Finished {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        support::sluice_cli(&args, &env, DEADLINE)
    })
    .await
    .expect("cli task")
}

fn path(p: &std::path::Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// An exchange `orders` feeding the queue `charge`, whose handler is never called.
const ORDERS: &str = r##"version: 1
exchanges:
  orders: {type: topic}
queues:
  charge:
    bind: [{exchange: orders, routing_key: "#"}]
    handler: {webhook: {url: "http://127.0.0.1:9/charge"}}
"##;

/// Two queues on every message: `work` keyed by the envelope's key (the default), `keyed` by
/// a template reading the payload.
const TWO_KEYS: &str = r##"version: 1
exchanges:
  ev: {type: topic}
queues:
  work:
    bind: [{exchange: ev, routing_key: "#"}]
    handler: {webhook: {url: "RECEIVER/work"}}
  keyed:
    bind: [{exchange: ev, routing_key: "#"}]
    handler: {webhook: {url: "RECEIVER/keyed"}}
    idempotency: {key: "{{payload.k}}"}
"##;

/// Issue 19: an empty or blank idempotency key, sent by the producer or rendered by the
/// queue's key template, falls back to the message id. Every message runs its handler once;
/// none is acked as a duplicate of the first message with the same empty key.
async fn messages_with_an_empty_idempotency_key_each_run_their_handler<P: Place>(place: P) {
    let receiver = Receiver::ok().await;
    let dir = support::pipeline(&TWO_KEYS.replace("RECEIVER", receiver.uri()));
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    let mut ids = Vec::new();
    for key in ["", "", "  ", ""] {
        let id = uuid::Uuid::now_v7().to_string();
        let body = json!({"id": id, "type": "t", "idempotency_key": key, "payload": {"k": key}});
        support::publish_raw(&broker, "ev", "x", body.to_string().into_bytes(), Headers::new()).await;
        ids.push(id);
    }
    broker.close().await;
    let mut run = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(run.wait(DEADLINE), Some(0), "{}", run.log());
    ids.sort();
    for queue in ["work", "keyed"] {
        let target = format!("/{queue}");
        let mut keys: Vec<String> =
            receiver.hits().iter().filter(|h| h.target == target).map(|h| h.key().to_string()).collect();
        keys.sort();
        assert_eq!(keys, ids, "queue {queue}: one call per message, keyed by its id\n{}", run.log());
    }
    assert!(place.drain_queue("work.dlq").await.is_empty(), "nothing dead-lettered");
}

on_every_broker!(messages_with_an_empty_idempotency_key_each_run_their_handler);

/// Issue 19: `publish --idempotency-key ''` (an empty shell variable) is a usage error that
/// names the fix; before, every message after the first was skipped as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_refuses_an_empty_idempotency_key() {
    let place = EmbeddedDir::new();
    let dir = support::pipeline(ORDERS);
    support::declare(dir.path(), &place.connect().await).await;
    let url = place.url();
    for key in ["", "   "] {
        let args = ["publish", "--broker", &url, "--exchange", "orders", "--type", "t", "--payload", "{}"];
        let out = cli(&[&args[..], &["--idempotency-key", key]].concat(), &[]).await;
        assert_eq!(out.code, Some(2), "{key:?}: {out:?}");
        assert!(out.stderr.contains("--idempotency-key") && out.stderr.contains("id"), "{}", out.stderr);
    }
    assert_eq!(place.depth("charge").await, 0, "nothing published");
}

/// Issue 19: operator commands pointed at a directory that holds no broker (a typo, or another
/// working directory than `run`'s) create nothing there and say where they looked; `plan`
/// compares the files with an empty broker; a broker file with nothing declared is called empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_never_create_a_broker() {
    let dir = support::pipeline(ORDERS);
    let d = path(dir.path());
    let missing = dir.path().join("typo");
    let m = path(&missing);
    let publish = ["publish", "--broker", m, "--exchange", "orders", "--type", "t", "--payload", "{}"];
    let commands: [&[&str]; 6] = [
        &publish,
        &["status", d, "--broker", m],
        &["dlq", "list", "charge", "--pipelines", d, "--broker", m],
        &["dlq", "show", "charge", "some-id", "--pipelines", d, "--broker", m],
        &["dlq", "redrive", "charge", "--pipelines", d, "--broker", m],
        &["dlq", "purge", "charge", "--yes", "--pipelines", d, "--broker", m],
    ];
    for args in commands {
        let out = cli(args, &[]).await;
        assert_eq!(out.code, Some(1), "{args:?}: {out:?}");
        assert!(out.stderr.contains(m) && out.stderr.contains("does not exist"), "{args:?}: {}", out.stderr);
        assert!(!missing.exists(), "{args:?} created {m}");
    }
    let plan = cli(&["plan", d, "--broker", m], &[]).await;
    assert_eq!(plan.code, Some(0), "{plan:?}");
    assert!(plan.stdout.contains(&format!("broker embedded in {m} (does not exist")), "{}", plan.stdout);
    assert!(plan.stdout.contains("missing exchange \"orders\""), "{}", plan.stdout);
    assert!(!missing.exists(), "plan created {m}");
    // An existing directory without the broker's file is no broker either.
    std::fs::create_dir(&missing).expect("mkdir");
    let out = cli(&publish, &[]).await;
    assert_eq!(out.code, Some(1), "{out:?}");
    assert_eq!(std::fs::read_dir(&missing).expect("read dir").count(), 0, "nothing created in {m}");
    // A broker file with nothing declared in it (as older versions of these commands left).
    sluice::broker::embedded::Embedded::open_dir(&missing).expect("open").close().await;
    let out = cli(&publish, &[]).await;
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains(m) && out.stderr.contains("empty"), "{}", out.stderr);
}

/// Issue 19: a misspelt exchange or queue is reported with the broker it was looked for on
/// (its directory, or its URL with the password masked) and the closest name the broker or
/// the pipeline files know.
async fn a_misspelt_name_is_reported_with_the_broker_and_the_closest_name<P: Place>(place: P) {
    let dir = support::pipeline(ORDERS);
    support::declare(dir.path(), &place.connect().await).await;
    let url = place.url();
    let shown = sluice::broker::amqp::redact(&url);
    let publish =
        cli(&["publish", "--broker", &url, "--exchange", "ordres", "--type", "t", "--payload", "{}"], &[]).await;
    assert_eq!(publish.code, Some(1), "{publish:?}");
    assert!(publish.stderr.contains(&shown), "names the broker {shown}: {}", publish.stderr);
    if !url.starts_with("amqp") {
        // RabbitMQ lists its exchanges only through the management plugin.
        assert!(publish.stderr.contains("did you mean \"orders\""), "{}", publish.stderr);
    }
    let list = cli(&["dlq", "list", "chrage", "--pipelines", path(dir.path()), "--broker", &url], &[]).await;
    assert_eq!(list.code, Some(1), "{list:?}");
    assert!(list.stderr.contains("did you mean \"charge\""), "{}", list.stderr);
}

on_every_broker!(a_misspelt_name_is_reported_with_the_broker_and_the_closest_name);

/// A webhook queue `work` on exchange `ev`, signed with the secret in `$FOOTGUN_SECRET`.
fn signed_pipeline(receiver: &str) -> tempfile::TempDir {
    support::work_pipeline(&format!(
        "    handler:\n      webhook:\n        url: \"{receiver}/hook\"\n        signing: {{secret_env: FOOTGUN_SECRET}}\n"
    ))
}

/// Issue 19: a signing secret that is set but is not a Standard Webhooks secret stops `run` at
/// start-up, naming the variable and the form expected (never the secret), before any message
/// is taken; it used to dead-letter every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_refuses_a_malformed_signing_secret_at_start_up() {
    let receiver = Receiver::ok().await;
    let dir = signed_pipeline(receiver.uri());
    let place = EmbeddedDir::new();
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    support::publish(&broker, "ev", "x", "k-1", json!({})).await;
    broker.close().await;
    for secret in ["not-a-secret", "whsec_not base64!", "whsec_"] {
        let mut run =
            Sluice::run_with_env(dir.path(), &place.url(), &["--exit-when-idle"], &[("FOOTGUN_SECRET", secret)]);
        let code = run.wait(DEADLINE);
        let log = run.log();
        assert_eq!(code, Some(1), "{secret:?}: {log}");
        assert!(log.contains("FOOTGUN_SECRET") && log.contains("whsec_"), "{log}");
        assert!(!log.contains("not-a-secret") && !log.contains("not base64!"), "the secret is quoted: {log}");
    }
    assert_eq!(place.depth("work").await, 1, "the message waits for a runner with a usable secret");
    assert!(place.drain_queue("work.dlq").await.is_empty(), "nothing dead-lettered");
    assert!(receiver.hits().is_empty());
}

/// Issue 19: a webhook that cannot be signed is dead-lettered for a reason of its own,
/// `signing` (it was `template`, which sent operators to the templates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_cannot_be_signed_is_dead_lettered_as_signing() {
    let dir = signed_pipeline("http://127.0.0.1:9");
    let tests = "version: 1\ntests:\n  - name: unsigned\n    message: {exchange: ev, routing_key: x, payload: {}}\n    expect:\n      outcomes: {work: \"dead_letter:signing\"}\n";
    std::fs::write(dir.path().join("t.test.yaml"), tests).expect("write tests");
    // `sluice test` needs no secret, so it shows what happens where the secret is unusable.
    let out = cli(&["test", path(dir.path())], &[("FOOTGUN_SECRET", "whsec_")]).await;
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("1 passed; 0 failed"), "{}", out.stdout);
}

/// What a terminal would act on: escape sequences, bell, carriage return.
fn has_raw_controls(text: &str) -> bool {
    text.contains(['\u{1b}', '\u{7}', '\r', '\u{9b}'])
}

/// Issue 19 (4): what a dead-lettered message carries (id, type, idempotency key, header names,
/// the receiver's error) reaches the terminal through `dlq list` and `dlq show` with its
/// control characters escaped: `\x1b` as four characters, a line break as `\n`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_and_show_escape_control_characters() {
    let place = EmbeddedDir::new();
    let dir = support::pipeline(ORDERS);
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    let (id, kind, key) = ("id-\u{1b}[2J", "type-\u{1b}]0;pwned\u{7}", "key\nFAKE ROW");
    let body = json!({"id": id, "type": kind, "idempotency_key": key, "payload": {}});
    let failed_at = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let headers = Headers::from([
        (envelope::REASON_HEADER.to_string(), HeaderValue::Str("permanent".into())),
        (envelope::ERROR_HEADER.to_string(), HeaderValue::Str("HTTP 422: \u{1b}[31mred\r\nmore\u{9b}2J".into())),
        (envelope::ATTEMPTS_HEADER.to_string(), HeaderValue::Int(1)),
        (envelope::FAILED_AT_HEADER.to_string(), HeaderValue::Str(failed_at)),
        (envelope::SOURCE_QUEUE_HEADER.to_string(), HeaderValue::Str("charge".into())),
        ("x-\u{1b}[1mbold".to_string(), HeaderValue::Str("v".into())),
    ]);
    let message = Outgoing {
        body: body.to_string().into_bytes(),
        message_id: Some(id.into()),
        kind: Some(kind.into()),
        headers,
        ..Default::default()
    };
    broker.publish("", "charge.dlq", message).await.expect("plant");
    broker.close().await;
    let (url, d) = (place.url(), path(dir.path()));

    let list = cli(&["dlq", "list", "charge", "--pipelines", d, "--broker", &url], &[]).await;
    assert_eq!(list.code, Some(0), "{list:?}");
    assert!(!has_raw_controls(&list.stdout), "{:?}", list.stdout);
    assert_eq!(list.stdout.lines().count(), 2, "a header and one row: {}", list.stdout);
    for shown in [r"id-\x1b[2J", r"type-\x1b]0;pwned\x07", r"key\nFAKE ROW", r"\x1b[31mred\r\nmore\u{9b}2J"] {
        assert!(list.stdout.contains(shown), "{shown} in {}", list.stdout);
    }

    let show = cli(&["dlq", "show", "charge", id, "--pipelines", d, "--broker", &url], &[]).await;
    assert_eq!(show.code, Some(0), "{show:?}");
    assert!(!has_raw_controls(&show.stdout), "{:?}", show.stdout);
    assert!(show.stdout.contains(r"x-\x1b[1mbold: "), "{}", show.stdout);
}

/// Issue 19 (4): a test named with escape sequences (a test file in a pull request) cannot
/// rewrite `sluice test`'s verdicts on the terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sluice_test_escapes_control_characters_in_test_names() {
    let dir = support::pipeline(ORDERS);
    let tests = "version: 1\ntests:\n  - name: \"\\e[2K\\rok   all fine\\a\"\n    message: {exchange: orders, routing_key: x, payload: {}}\n    expect: {queues: []}\n";
    std::fs::write(dir.path().join("t.test.yaml"), tests).expect("write tests");
    let out = cli(&["test", path(dir.path())], &[]).await;
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(!has_raw_controls(&out.stdout), "{:?}", out.stdout);
    assert!(out.stdout.contains(r"FAIL ") && out.stdout.contains(r"\x1b[2K\rok   all fine\x07"), "{}", out.stdout);
}
