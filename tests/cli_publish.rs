//! The one-shot commands as a user runs them: `sluice publish` against real RabbitMQ (what
//! lands, and every way it refuses) and `sluice render` (the request or command a message
//! makes, secrets masked).

use crate::support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use sluice::envelope::Envelope;
use support::*;

/// Longer than a refused publish takes to give up (about 30 s of retries, see `Refusals`).
const DEADLINE: Duration = Duration::from_secs(90);

/// An exchange `ev` with queue `inbox` bound to `order.*`, and a direct exchange `tiny`
/// feeding `small`, which holds one message.
const PUBLISH_PIPELINE: &str = r##"version: 1
exchanges:
  ev: {type: topic}
  tiny: {type: direct}
queues:
  inbox:
    bind: [{exchange: ev, routing_key: "order.*"}]
    handler: {command: {program: /bin/true}}
  small:
    max_length: 1
    bind: [{exchange: tiny, routing_key: small}]
    handler: {command: {program: /bin/true}}
"##;

/// A vhost with [`PUBLISH_PIPELINE`] declared (and nobody consuming).
async fn publish_vhost() -> Vhost {
    let vhost = Vhost::new();
    let dir = pipeline(PUBLISH_PIPELINE);
    declare(dir.path(), &vhost.connect().await).await;
    vhost
}

fn publish(vhost: &Vhost, args: &[&str]) -> Finished {
    let url = vhost.url();
    let all: Vec<&str> = ["publish", "--broker", url.as_str()].iter().copied().chain(args.iter().copied()).collect();
    sluice_cli(&all, &[], DEADLINE)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_lands_an_envelope_with_amqp_properties() {
    let vhost = publish_vhost().await;
    let before = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs();
    let run = publish(
        &vhost,
        &[
            "--exchange",
            "ev",
            "--routing-key",
            "order.created",
            "--type",
            "order.created",
            "--idempotency-key",
            "order:1234",
            "--payload",
            r#"{"order_id": 1234}"#,
        ],
    );
    assert_eq!(run.code, Some(0), "{run:?}");

    let messages = drain_messages(&vhost.url(), "inbox").await;
    assert_eq!(messages.len(), 1);
    let m = &messages[0];
    let envelope = Envelope::decode(&m.body).expect("an envelope");
    assert!(!envelope.id.is_empty());
    assert_eq!(envelope.kind, "order.created");
    assert_eq!(envelope.payload_value().expect("JSON"), json!({"order_id": 1234}));
    assert_eq!(envelope.idempotency_key.as_deref(), Some("order:1234"));
    let p = &m.properties;
    assert_eq!(p.message_id().as_ref().map(|s| s.as_str()), Some(envelope.id.as_str()));
    assert_eq!(p.kind().as_ref().map(|s| s.as_str()), Some("order.created"));
    assert_eq!(p.content_type().as_ref().map(|s| s.as_str()), Some("application/json"));
    assert_eq!(*p.delivery_mode(), Some(2), "persistent");
    let timestamp = p.timestamp().expect("timestamp");
    assert!((before.saturating_sub(5)..=before + 60).contains(&timestamp), "timestamp {timestamp}, now {before}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_to_a_missing_exchange_fails_clearly() {
    let vhost = publish_vhost().await;
    let run = publish(&vhost, &["--exchange", "nope", "--type", "t", "--payload", "{}"]);
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(run.stderr.contains("error:") && run.stderr.contains("'nope'"), "{}", run.stderr);
    assert!(run.stderr.contains("not found") || run.stderr.contains("NOT_FOUND"), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_unroutable_fails() {
    let vhost = publish_vhost().await;
    let run = publish(&vhost, &["--exchange", "ev", "--routing-key", "invoice.paid", "--type", "t", "--payload", "{}"]);
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(run.stderr.contains("unroutable") && run.stderr.contains("invoice.paid"), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_nacked_by_a_full_queue_fails() {
    let vhost = publish_vhost().await;
    let args = ["--exchange", "tiny", "--routing-key", "small", "--type", "t", "--payload", "{}"];
    let first = publish(&vhost, &args);
    assert_eq!(first.code, Some(0), "{first:?}");
    // max_length 1 with overflow reject-publish: once the queue is full the broker nacks.
    // A quorum queue on RabbitMQ 3.10 checks the limit only after it is exceeded, so it
    // admits one message past it: the second or the third publish is the one refused.
    let mut accepted = 1;
    let refused = loop {
        let run = publish(&vhost, &args);
        if run.code != Some(0) || accepted == 3 {
            break run;
        }
        accepted += 1;
    };
    assert_eq!(refused.code, Some(1), "{accepted} publishes into a queue of max_length 1 confirmed: {refused:?}");
    assert!(refused.stderr.contains("nack") && refused.stderr.contains("\"tiny\""), "{}", refused.stderr);
    assert_eq!(vhost.drain_queue("small").await.len(), accepted, "the confirmed messages, and only them");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_jsonl_publishes_one_message_per_line() {
    let vhost = publish_vhost().await;
    let file = tempfile::NamedTempFile::new().expect("tempfile");
    let lines: String = (0..100).map(|i| format!("{{\"n\": {i}}}\n")).collect();
    std::fs::write(file.path(), lines).expect("write jsonl");
    let path = file.path().to_str().expect("utf-8 path");
    let run = publish(&vhost, &["--exchange", "ev", "--routing-key", "order.bulk", "--type", "t", "--jsonl", path]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let mut seen: Vec<i64> = drain_messages(&vhost.url(), "inbox")
        .await
        .iter()
        .map(|m| Envelope::decode(&m.body).expect("envelope").payload_value().expect("JSON")["n"].as_i64().expect("n"))
        .collect();
    seen.sort();
    assert_eq!(seen, (0..100).collect::<Vec<_>>());
}

/// Issue 11: every message `sluice publish` sends starts a trace of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_starts_a_new_trace_per_message() {
    let vhost = publish_vhost().await;
    let file = tempfile::NamedTempFile::new().expect("tempfile");
    std::fs::write(file.path(), "{}\n{}\n{}\n").expect("write jsonl");
    let path = file.path().to_str().expect("utf-8 path");
    let run = publish(&vhost, &["--exchange", "ev", "--routing-key", "order.bulk", "--type", "t", "--jsonl", path]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let mut traces: Vec<[u8; 16]> = drain_messages(&vhost.url(), "inbox")
        .await
        .iter()
        .map(|m| {
            let text = header_str(&m.headers, "traceparent").expect("a traceparent header");
            sluice::trace::TraceContext::parse(text).unwrap_or_else(|| panic!("invalid traceparent {text:?}")).trace_id
        })
        .collect();
    traces.sort();
    traces.dedup();
    assert_eq!(traces.len(), 3);
}

#[test]
fn publish_rejects_a_payload_that_is_not_json() {
    // The payload is checked before connecting: no broker needed.
    let run = sluice_cli(
        &["publish", "--broker", "amqp://127.0.0.1:1", "--exchange", "ev", "--type", "t", "--payload", "{oops"],
        &[],
        DEADLINE,
    );
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(run.stderr.contains("--payload is not JSON"), "{}", run.stderr);
}

/// Issue 19 (a footgun): `--broker 127.0.0.1:5672` (or `SLUICE_BROKER=rabbitmq:5672`) ran a
/// private embedded broker in a directory of that name, and said nothing.
#[test]
fn a_broker_that_looks_like_host_port_is_refused_naming_the_fix() {
    for (value, from_env) in [("127.0.0.1:5672", false), ("rabbitmq:5672", true), ("[::1]:5672", false)] {
        let run = if from_env {
            let args = ["publish", "--exchange", "ev", "--type", "t", "--payload", "{}"];
            sluice_cli(&args, &[("SLUICE_BROKER", value)], DEADLINE)
        } else {
            let args = ["publish", "--broker", value, "--exchange", "ev", "--type", "t", "--payload", "{}"];
            sluice_cli(&args, &[], DEADLINE)
        };
        assert_eq!(run.code, Some(1), "{value}: {run:?}");
        let fix = format!("looks like HOST:PORT; for RabbitMQ write amqp://USER:PASSWORD@{value}/%2f");
        assert!(run.stderr.contains(&fix), "{value}: {}", run.stderr);
        assert!(!std::path::Path::new(value).exists(), "{value}: a directory was made");
    }
    // Several values are the nodes of one cluster: a directory among them is refused too.
    let run = sluice_cli(&["status", "--broker", "amqp://127.0.0.1:1,some-dir", "tests/fixtures/valid"], &[], DEADLINE);
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(run.stderr.contains("--broker mixes amqp:// URLs and directories"), "{}", run.stderr);
}

#[test]
fn publish_without_type_is_a_usage_error() {
    let run = sluice_cli(&["publish", "--exchange", "ev", "--payload", "{}"], &[], DEADLINE);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("--type"), "{}", run.stderr);
}

/// Writes `pipeline` and a message, then runs `sluice render` on queue `q` with `env`.
fn render(pipeline_yaml: &str, message: &serde_json::Value, env: &[(&str, &str)]) -> Finished {
    let dir = pipeline(pipeline_yaml);
    let message_file = dir.path().join("message.json");
    std::fs::write(&message_file, message.to_string()).expect("write message");
    let (dir_arg, message_arg) = (dir.path().to_str().expect("utf-8"), message_file.to_str().expect("utf-8"));
    sluice_cli(&["render", dir_arg, "--queue", "q", "--message", message_arg], env, DEADLINE)
}

#[test]
fn render_prints_the_webhook_request_with_secrets_masked() {
    let message = json!({
        "id": "msg-1", "type": "order.created", "idempotency_key": "order:1234",
        "payload": {"order_id": 1234, "note": "a \"b\"/c"}
    });
    let run = render(
        r#"version: 1
queues:
  q:
    handler:
      webhook:
        url: "https://payments.example/charge/{{payload.order_id}}?token={{env.SLUICE_RENDER_TOKEN}}"
        method: PUT
        headers: {Authorization: "Bearer {{env.SLUICE_RENDER_TOKEN}}"}
        body: '{"order": {{payload.order_id}}, "note": "{{payload.note}}"}'
"#,
        &message,
        &[("SLUICE_RENDER_TOKEN", "s3cr3t-value")],
    );
    assert_eq!(run.code, Some(0), "{run:?}");
    let out = &run.stdout;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "PUT https://payments.example/charge/1234?token=%2A%2A%2A", "{out}");
    for header in [
        "idempotency-key: order:1234",
        "x-sluice-message-id: msg-1",
        "x-sluice-attempt: 1",
        "content-type: application/json",
        "Authorization: Bearer ***",
    ] {
        assert!(lines.contains(&header), "no line {header:?} in:\n{out}");
    }
    assert!(lines.contains(&r#"{"order": 1234, "note": "a \"b\"/c"}"#), "no body line in:\n{out}");
    assert!(!out.contains("s3cr3t") && !run.stderr.contains("s3cr3t"), "a secret was printed:\n{out}{}", run.stderr);
}

#[test]
fn render_prints_the_command_argv_env_and_stdin_with_secrets_masked() {
    let message = json!({"id": "msg-2", "type": "image.resize", "payload": {"image_id": "img 7", "size": 640}});
    let yaml = |stdin: &str| {
        format!(
            r#"version: 1
queues:
  q:
    handler:
      command:
        program: /bin/echo
        args: ["{{{{payload.image_id}}}}", "--size", "{{{{payload.size}}}}"]
        env: {{BUCKET: "{{{{env.SLUICE_RENDER_BUCKET}}}}", TOKEN: "t-{{{{env.SLUICE_RENDER_TOKEN}}}}"}}
        pass_env: [SLUICE_RENDER_PASSED, SLUICE_RENDER_UNSET]
        stdin: {stdin}
"#
        )
    };
    let env = [
        ("SLUICE_RENDER_BUCKET", "my-bucket"),
        ("SLUICE_RENDER_TOKEN", "s3cr3t-value"),
        ("SLUICE_RENDER_PASSED", "p4ssed-value"),
        ("SLUICE_RENDER_NOT_PASSED", "n0t-passed"),
        ("TZ", "Europe/Paris"),
    ];
    let run = render(&yaml("payload"), &message, &env);
    assert_eq!(run.code, Some(0), "{run:?}");
    let out = &run.stdout;
    let lines: Vec<&str> = out.lines().collect();
    for line in [
        r#"argv: ["/bin/echo","img 7","--size","640"]"#,
        "env: SLUICE_IDEMPOTENCY_KEY=msg-2",
        "env: SLUICE_MESSAGE_ID=msg-2",
        "env: SLUICE_ATTEMPT=1",
        "env: BUCKET=***",
        "env: TOKEN=t-***",
        // Issue 9: the whole environment the program gets, secrets masked: the allowlist from
        // the runner, pass_env (an unset one left out), sluice's own, env.
        "env: SLUICE_RENDER_PASSED=***",
        "env: TZ=Europe/Paris",
        r#"stdin: {"image_id":"img 7","size":640}"#,
    ] {
        assert!(lines.contains(&line), "no line {line:?} in:\n{out}");
    }
    assert!(!out.contains("s3cr3t") && !out.contains("my-bucket"), "an env value was printed:\n{out}");
    assert!(!out.contains("p4ssed") && !out.contains("SLUICE_RENDER_UNSET"), "{out}");
    assert!(!out.contains("SLUICE_RENDER_NOT_PASSED") && !out.contains("SLUICE_RENDER_TOKEN="), "{out}");

    let none = render(&yaml("none"), &message, &env);
    assert!(none.stdout.lines().any(|l| l == "stdin: (none)"), "{}", none.stdout);
    let envelope = render(&yaml("envelope"), &message, &env);
    let stdin_line = envelope.stdout.lines().find_map(|l| l.strip_prefix("stdin: ")).expect("a stdin line");
    assert_eq!(serde_json::from_str::<serde_json::Value>(stdin_line).expect("JSON"), message);
}
