//! Issue 34 part 1, message formats, end to end on every broker: what producers already send
//! (a plain JSON producer setting AMQP properties only, as pika does; CloudEvents in binary and
//! in structured mode; bytes of a binary content type) is handled, retried, dead-lettered with
//! its body and properties kept and sluice's headers beside them, and redriven as it was sent;
//! a second copy is a duplicate by each format's default key. `validate` refuses templates and
//! filters that read a field the queue's format lacks.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt as _;
use serde_json::{Value, json};
use sluice::broker::{
    Broker as _, Consumer as _, Credit, Delivery as _, HeaderValue, Headers, Operate, Outgoing, Publish,
};
use sluice::envelope;
use sluice::format::sha256_id;
use support::{Place, Receiver, Reply, Sluice, broker_cli};

/// One message as a producer sends it, and the key sluice must hand the receiver for it.
struct Sent {
    queue: &'static str,
    routing_key: &'static str,
    message: Outgoing,
    key: String,
    /// The content type the receiver must get with the body, unchanged.
    content_type: &'static str,
}

fn props(body: &[u8], id: Option<&str>, kind: Option<&str>, content_type: Option<&str>, headers: Headers) -> Outgoing {
    Outgoing {
        body: body.to_vec(),
        message_id: id.map(str::to_string),
        kind: kind.map(str::to_string),
        content_type: content_type.map(str::to_string),
        timestamp: Some(1_798_135_200),
        headers,
        ..Outgoing::default()
    }
}

fn attributes(prefix: &str, id: &str, source: &str) -> Headers {
    [("specversion", "1.0"), ("id", id), ("source", source), ("type", "order.created"), ("tenant", "acme")]
        .into_iter()
        .map(|(name, value)| (format!("{prefix}{name}"), HeaderValue::Str(value.into())))
        .collect()
}

/// The messages: those to succeed, and (`poison` in the body) those the receiver refuses
/// until it is mended.
fn messages() -> Vec<Sent> {
    let structured = json!({
        "specversion": "1.0", "id": "B-2", "source": "https://shop/orders", "type": "order.paid",
        "time": "2026-12-24T18:00:00Z", "data": {"amount": 12}
    })
    .to_string();
    let raw: &[u8] = b"\x00\x9f\x92\x96\xffraw";
    let plain = br#"{"order":2}"#;
    vec![
        // pika: `basic_publish(properties=BasicProperties(message_id=..., type=..., content_type=...))`.
        Sent {
            queue: "plain",
            routing_key: "json.order",
            message: props(
                br#"{"order":1}"#,
                Some("j-1"),
                Some("order.created"),
                Some("application/json"),
                Headers::new(),
            ),
            key: "j-1".into(),
            content_type: "application/json",
        },
        // No properties at all: keyed by the body's hash.
        Sent {
            queue: "plain",
            routing_key: "json.order",
            message: Outgoing { body: plain.to_vec(), ..Outgoing::default() },
            key: sha256_id(plain),
            content_type: "application/json",
        },
        Sent {
            queue: "plain",
            routing_key: "json.order",
            message: props(
                br#"{"poison":1}"#,
                Some("j-p"),
                Some("order.created"),
                Some("application/json"),
                [("x-tenant".to_string(), HeaderValue::Str("acme".into()))].into(),
            ),
            key: "j-p".into(),
            content_type: "application/json",
        },
        Sent {
            queue: "events",
            routing_key: "ce.order",
            message: props(
                br#"{"n":1}"#,
                None,
                None,
                Some("application/json"),
                attributes("cloudEvents:", "A-1", "/orders"),
            ),
            key: "/orders A-1".into(),
            content_type: "application/json",
        },
        Sent {
            queue: "events",
            routing_key: "ce.order",
            message: props(structured.as_bytes(), None, None, Some("application/cloudevents+json"), Headers::new()),
            key: "https://shop/orders B-2".into(),
            content_type: "application/cloudevents+json",
        },
        Sent {
            queue: "events",
            routing_key: "ce.order",
            message: props(
                br#"{"poison":1}"#,
                None,
                None,
                Some("application/json"),
                attributes("ce-", "P-1", "/orders"),
            ),
            key: "/orders P-1".into(),
            content_type: "application/json",
        },
        Sent {
            queue: "opaque",
            routing_key: "bytes.blob",
            message: props(raw, Some("b-1"), None, Some("application/octet-stream"), Headers::new()),
            key: "b-1".into(),
            content_type: "application/octet-stream",
        },
        Sent {
            queue: "opaque",
            routing_key: "bytes.blob",
            message: props(b"\x08\x96\x01poison\xff", None, None, Some("application/x-protobuf"), Headers::new()),
            key: sha256_id(b"\x08\x96\x01poison\xff"),
            content_type: "application/x-protobuf",
        },
    ]
}

/// Bodies a json queue cannot read: not JSON, and not UTF-8.
const MALFORMED: [&[u8]; 2] = [b"{not json", b"\xff\xfe\x00"];

fn is_poison(body: &[u8]) -> bool {
    body.windows(6).any(|w| w == b"poison")
}

/// Every message of `queue`, left in place: body, message id, type, content type, timestamp
/// and headers, as the broker keeps them.
async fn browse<B: Operate>(broker: &B, queue: &str) -> Vec<(Vec<u8>, Outgoing, BTreeMap<String, Value>)> {
    let depth = broker.depth(queue).await.expect("depth");
    let (mut deliveries, consumer) = broker.browse(queue, Credit::at_most(100)).await.expect("browse");
    let mut out = Vec::new();
    while out.len() < depth as usize {
        let next = tokio::time::timeout(Duration::from_secs(10), deliveries.next()).await;
        let d = next.expect("the queue's messages arrive").expect("stream open").expect("delivery");
        let properties = Outgoing {
            message_id: d.message_id().map(str::to_string),
            kind: d.kind().map(str::to_string),
            content_type: d.content_type().map(str::to_string),
            timestamp: d.timestamp(),
            ..Outgoing::default()
        };
        out.push((d.body().to_vec(), properties, d.headers()));
    }
    consumer.close().await;
    out
}

fn pipeline(receiver: &Receiver) -> tempfile::TempDir {
    let queue = |name: &str, format: &str, key: &str| {
        format!(
            "  {name}:\n    format: {format}\n    bind: [{{exchange: ev, routing_key: \"{key}\"}}]\n    retry: {{max_attempts: 2, initial: 100ms, max: 200ms}}\n    circuit_breaker: {{enabled: false}}\n    handler: {{webhook: {{url: \"{}/{name}\"}}}}\n",
            receiver.uri()
        )
    };
    support::pipeline(&format!(
        "version: 1\nexchanges:\n  ev: {{type: topic}}\nqueues:\n{}{}{}",
        queue("plain", "json", "json.#"),
        queue("events", "cloudevents", "ce.#"),
        queue("opaque", "bytes", "bytes.#"),
    ))
}

async fn each_format_is_handled_retried_dead_lettered_and_redriven_as_sent<P: Place>(place: P) {
    // Every first attempt fails (a retry), a poisoned body fails for good until mended.
    let mended = Arc::new(AtomicBool::new(false));
    let flag = mended.clone();
    let receiver = Receiver::start(move |hit, _| match (hit.header("x-sluice-attempt"), flag.load(Ordering::SeqCst)) {
        (_, true) => Reply::ok(),
        (Some("1"), false) => Reply::status(503),
        _ if is_poison(&hit.body) => Reply::status(400),
        _ => Reply::ok(),
    })
    .await;
    let dir = pipeline(&receiver);
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    let sent = messages();
    for s in &sent {
        broker.publish("ev", s.routing_key, s.message.clone()).await.expect("publish confirmed");
    }
    // Hostile input: not JSON, or not even UTF-8, for a json queue; a CloudEvent whose id is
    // too long to be a key: each dead-lettered as malformed, never handled, nothing lost.
    for body in MALFORMED {
        broker
            .publish("ev", "json.bad", Outgoing { body: body.to_vec(), ..Outgoing::default() })
            .await
            .expect("publish");
    }
    let long_id = "i".repeat(10_000);
    let hostile = props(br#"{"n":1}"#, None, None, None, attributes("ce-", &long_id, "/orders"));
    broker.publish("ev", "ce.bad", hostile).await.expect("publish");
    let mut runner = Sluice::run(dir.path(), &place.url(), &[]);
    let good: BTreeSet<String> = sent.iter().filter(|s| !is_poison(&s.message.body)).map(|s| s.key.clone()).collect();
    support::wait_until(Duration::from_secs(60), "every good message handled and the rest dead-lettered", || async {
        receiver.succeeded_keys() == good
            && place.depth("plain.dlq").await == 3
            && place.depth("events.dlq").await == 2
            && place.depth("opaque.dlq").await == 1
    })
    .await;

    // Each was retried once, then handled: its body unchanged, with its content type, under
    // its format's key (the CloudEvent's source and id; the message id; the body's hash).
    for s in sent.iter().filter(|s| !is_poison(&s.message.body)) {
        let hits = receiver.hits_for(&s.key);
        assert_eq!(hits.len(), 2, "{}: a failed first attempt and a retry", s.key);
        for hit in &hits {
            assert_eq!(hit.target, format!("/{}", s.queue));
            assert_eq!(hit.body, s.message.body, "{}: the body as sent", s.key);
            assert_eq!(hit.header("content-type"), Some(s.content_type), "{}", s.key);
        }
    }
    let binary = receiver.hits_for("/orders A-1");
    assert_eq!((binary[1].header("ce-id"), binary[1].header("ce-tenant")), (Some("A-1"), Some("acme")));

    // The dead-letter copies keep the body and properties as sent, sluice's headers beside the
    // producer's own. (Each queue browsed once: RabbitMQ readies what a browse handed back only
    // after its channel is closed.)
    let mut dead = BTreeMap::new();
    for queue in ["plain.dlq", "events.dlq", "opaque.dlq"] {
        dead.insert(queue.to_string(), browse(&broker, queue).await);
    }
    let plain = &dead["plain.dlq"];
    let reasons: BTreeSet<String> = plain.iter().map(|(_, _, h)| h[envelope::REASON_HEADER].to_string()).collect();
    assert_eq!(reasons, BTreeSet::from(["\"malformed\"".to_string(), "\"permanent\"".to_string()]));
    for bad in MALFORMED {
        let malformed = plain.iter().find(|(body, _, _)| body == bad).expect("the malformed body, kept");
        let error = malformed.2[envelope::ERROR_HEADER].as_str().unwrap_or_default().to_string();
        assert!(error.contains("not a JSON document (format: json)"), "{error}");
    }
    let too_long = dead["events.dlq"].iter().find(|(_, _, h)| h[envelope::REASON_HEADER] == "malformed");
    let error = too_long.and_then(|(_, _, h)| h[envelope::ERROR_HEADER].as_str()).unwrap_or_default();
    assert!(error.contains("\"id\" is 10000 bytes, over the 4096"), "{error}");
    for s in sent.iter().filter(|s| is_poison(&s.message.body)) {
        let queue = format!("{}.dlq", s.queue);
        let (body, properties, headers) = dead[&queue]
            .iter()
            .find(|(body, _, _)| *body == s.message.body)
            .unwrap_or_else(|| panic!("{} in {queue}", s.key));
        assert_eq!(body, &s.message.body);
        let kept = (&properties.message_id, &properties.kind, &properties.content_type, properties.timestamp);
        let sent_properties = (&s.message.message_id, &s.message.kind, &s.message.content_type, s.message.timestamp);
        assert_eq!(kept, sent_properties, "{}: the properties as sent", s.key);
        for (name, value) in &s.message.headers {
            assert_eq!(headers.get(name), Some(&value.to_json()), "{}: header {name} kept", s.key);
        }
        assert_eq!(headers.get(envelope::REASON_HEADER), Some(&json!("permanent")), "{}", s.key);
        assert_eq!(headers.get(envelope::SOURCE_QUEUE_HEADER), Some(&json!(s.queue)), "{}", s.key);
    }

    // Mended, the receiver takes the redriven messages: each arrives as it was first sent.
    mended.store(true, Ordering::SeqCst);
    let d = dir.path().to_str().expect("utf-8 path");
    for queue in ["plain", "events", "opaque"] {
        let redriven =
            broker_cli(&["dlq", "redrive", queue, "--pipelines", d, "--reason", "permanent"], &place.url()).await;
        assert_eq!(redriven.code, Some(0), "{}", redriven.stderr);
    }
    let poisoned: Vec<&Sent> = sent.iter().filter(|s| is_poison(&s.message.body)).collect();
    support::wait_until(Duration::from_secs(60), "every redriven message handled", || async {
        poisoned.iter().all(|s| receiver.hits_for(&s.key).iter().any(|h| h.succeeded()))
    })
    .await;
    for s in &poisoned {
        let hit = receiver.hits_for(&s.key).into_iter().find(|h| h.succeeded()).expect("handled");
        assert_eq!(hit.body, s.message.body, "{}: redriven byte for byte", s.key);
        assert_eq!(hit.header("content-type"), Some(s.content_type), "{}", s.key);
        if let Some(id) = &s.message.message_id {
            assert_eq!(hit.header("x-sluice-message-id"), Some(id.as_str()), "{}", s.key);
        }
        assert_eq!(hit.header("x-sluice-attempt"), Some("1"), "a redriven copy is a first attempt");
    }

    // The same messages again: duplicates by each format's default key, never handled.
    let before = receiver.hits().len();
    for s in &sent {
        broker.publish("ev", s.routing_key, s.message.clone()).await.expect("publish confirmed");
    }
    support::wait_until(Duration::from_secs(60), "the copies settled", || async {
        place.depth("plain").await == 0 && place.depth("events").await == 0 && place.depth("opaque").await == 0
    })
    .await;
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
    assert_eq!(receiver.hits().len(), before, "every copy was a duplicate");
    let left = (place.depth("plain.dlq").await, place.depth("events.dlq").await, place.depth("opaque.dlq").await);
    assert_eq!(left, (2, 1, 0), "only the malformed bodies are left");
    broker.close().await;
}

on_every_broker!(each_format_is_handled_retried_dead_lettered_and_redriven_as_sent);

/// Issue 34: a template or a filter that reads a field the queue's format does not have is an
/// error at its place in the file.
#[test]
fn validate_names_fields_a_format_lacks() {
    let path = "tests/fixtures/invalid/format-field-missing.yaml";
    let out = support::sluice_cli(&["validate", path], &[], Duration::from_secs(30));
    assert_eq!(out.code, Some(1), "{}", out.stdout);
    let text = format!("{}{}", out.stdout, out.stderr);
    for expected in [
        ":9:",
        "\"source\" is not a field of a message of format json",
        ":12:",
        "a message of format json has no version",
        ":18:",
        "a message of format bytes has no payload (its body is {{body}}, as text)",
        ":24:",
        "\"payload.amount\" is not a field of a message of format cloudevents",
        // A CloudEvent's data is checked against the payload schema.
        ":35:",
        "data.order_idd cannot be in a payload of this queue: the schema allows no field \"order_idd\" in data",
        ":38:",
        "data.nope cannot be in a payload of this queue",
    ] {
        assert!(text.contains(expected), "{expected:?} not in:\n{text}");
    }
    assert!(
        !text.contains("has no data") && !text.contains("has no source"),
        "cloudevents has data and source:\n{text}"
    );
}

/// Issue 34: `sluice publish --format ... --header K=V` writes each format as its queue reads
/// it; the metadata reaches templates.
async fn the_cli_publishes_each_format<P: Place>(place: P) {
    let receiver = Receiver::ok().await;
    let queue = |name: &str, format: &str, key: &str| {
        format!(
            "  {name}:\n    format: {format}\n    bind: [{{exchange: ev, routing_key: \"{key}\"}}]\n    handler:\n      webhook:\n        url: \"{}/{name}\"\n        headers: {{X-Tenant: \"{{{{headers.x-tenant}}}}\", X-Route: \"{{{{exchange}}}}/{{{{routing_key}}}}\"}}\n",
            receiver.uri()
        )
    };
    let dir = support::pipeline(&format!(
        "version: 1\nexchanges:\n  ev: {{type: topic}}\nqueues:\n{}{}{}",
        queue("plain", "json", "json.#"),
        queue("events", "cloudevents", "ce.#"),
        queue("opaque", "bytes", "bytes.#"),
    ));
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    broker.close().await;
    let blob = dir.path().join("blob.bin");
    std::fs::write(&blob, b"\x08\x96\x01\xff\x00").expect("write");
    let blob = blob.to_str().expect("utf-8 path");
    let common = ["publish", "--exchange", "ev", "--header", "x-tenant=acme"];
    let runs: [&[&str]; 4] = [
        &[
            "--format",
            "json",
            "--routing-key",
            "json.order",
            "--type",
            "order.created",
            "--payload",
            r#"{"order":1}"#,
            "--idempotency-key",
            "j-9",
        ],
        &[
            "--format",
            "cloudevents",
            "--source",
            "/cli",
            "--routing-key",
            "ce.a",
            "--type",
            "order.paid",
            "--payload",
            r#"{"n":2}"#,
            "--idempotency-key",
            "c-1",
        ],
        &[
            "--format",
            "cloudevents",
            "--structured",
            "--source",
            "/cli",
            "--routing-key",
            "ce.b",
            "--type",
            "order.paid",
            "--payload",
            r#"{"n":3}"#,
            "--idempotency-key",
            "c-2",
        ],
        &[
            "--format",
            "bytes",
            "--routing-key",
            "bytes.z",
            "--type",
            "blob",
            "--payload-file",
            blob,
            "--content-type",
            "application/x-protobuf",
            "--idempotency-key",
            "b-9",
        ],
    ];
    for args in runs {
        let all: Vec<&str> = common.iter().chain(args).copied().collect();
        let out = broker_cli(&all, &place.url()).await;
        assert_eq!(out.code, Some(0), "{all:?}: {}", out.stderr);
    }
    let mut runner = Sluice::run(dir.path(), &place.url(), &[]);
    let want: BTreeSet<String> = ["j-9", "/cli c-1", "/cli c-2", "b-9"].map(str::to_string).into();
    support::wait_until(Duration::from_secs(60), "every published message handled", || async {
        receiver.succeeded_keys() == want
    })
    .await;
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
    let hit = |key: &str| receiver.hits_for(key).into_iter().next().unwrap_or_else(|| panic!("{key} handled"));
    let rows = [
        ("j-9", "/plain", "application/json", "ev/json.order"),
        ("/cli c-1", "/events", "application/json", "ev/ce.a"),
        ("/cli c-2", "/events", "application/cloudevents+json", "ev/ce.b"),
        ("b-9", "/opaque", "application/x-protobuf", "ev/bytes.z"),
    ];
    for (key, target, content_type, route) in rows {
        let hit = hit(key);
        assert_eq!(hit.target, target, "{key}");
        assert_eq!(hit.header("content-type"), Some(content_type), "{key}");
        assert_eq!((hit.header("x-tenant"), hit.header("x-route")), (Some("acme"), Some(route)), "{key}");
    }
    assert_eq!(hit("j-9").body, br#"{"order":1}"#);
    assert_eq!(hit("/cli c-1").body, br#"{"n":2}"#);
    assert_eq!(
        (hit("/cli c-1").header("ce-source"), hit("/cli c-1").header("ce-type")),
        (Some("/cli"), Some("order.paid"))
    );
    let structured = hit("/cli c-2").json();
    assert_eq!(
        (&structured["id"], &structured["source"], &structured["data"]),
        (&json!("c-2"), &json!("/cli"), &json!({"n": 3}))
    );
    assert_eq!(hit("b-9").body, b"\x08\x96\x01\xff\x00");

    // What a format cannot carry is refused before anything is sent.
    for (args, error) in [
        (&["--format", "json", "--delay", "10s"][..], "a message of format json has none"),
        (&["--structured"][..], "add --format cloudevents"),
        (&["--format", "cloudevents"][..], "--source"),
    ] {
        let all: Vec<&str> =
            ["publish", "--exchange", "ev", "--type", "t", "--payload", "{}"].iter().chain(args).copied().collect();
        let out = broker_cli(&all, &place.url()).await;
        assert_ne!(out.code, Some(0), "{all:?}");
        assert!(out.stderr.contains(error), "{all:?}: {}", out.stderr);
    }
}

on_every_broker!(the_cli_publishes_each_format);

/// Issue 34: `sluice test` gives each queue the message in its format: a `json` body with the
/// id as its message id, a structured CloudEvent, bytes from `body`; the filters and templates
/// read the metadata, and the default webhook body is the message as sent.
#[test]
fn sluice_test_gives_messages_in_each_format() {
    let pipeline = r#"version: 1
exchanges:
  ev: {type: topic}
queues:
  plain:
    format: json
    bind:
      - exchange: ev
        routing_key: "json.#"
        filter: {field: headers.x-tenant, eq: acme}
    handler:
      webhook: {url: "http://127.0.0.1:9/{{routing_key}}/{{payload.n}}", headers: {X-Type: "{{type}}"}}
  events:
    format: cloudevents
    bind: [{exchange: ev, routing_key: "ce.#"}]
    handler:
      webhook: {url: "http://127.0.0.1:9/{{urlencode source}}/{{subject}}", headers: {X-Data: "{{json data}}"}}
  opaque:
    format: bytes
    bind: [{exchange: ev, routing_key: "bytes.#"}]
    handler:
      webhook: {url: "http://127.0.0.1:9/bytes", headers: {X-Body: "{{body}}"}}
  enveloped:
    bind: [{exchange: ev, routing_key: "env.#", filter: {field: routing_key, prefix: env.keep}}]
    handler:
      webhook: {url: "http://127.0.0.1:9/{{exchange}}/{{routing_key}}/{{headers.x-tenant}}/{{payload.n}}"}
"#;
    let tests = r#"version: 1
tests:
  - name: plain JSON from acme
    message: {exchange: ev, routing_key: json.order, id: j-1, type: order.created, headers: {x-tenant: acme}, payload: {n: 5}}
    expect:
      queues: [plain]
      requests:
        plain:
          url: "http://127.0.0.1:9/json.order/5"
          headers: {idempotency-key: j-1, x-type: order.created, content-type: application/json}
          body: {n: 5}
  - name: plain JSON from elsewhere
    message: {exchange: ev, routing_key: json.order, headers: {x-tenant: other}, payload: {n: 5}}
    expect: {queues: [], outcomes: {plain: filtered}}
  - name: a CloudEvent
    message: {exchange: ev, routing_key: ce.paid, id: c-1, source: /shop, subject: o-7, payload: {amount: 3}}
    expect:
      requests:
        events:
          url: "http://127.0.0.1:9/%2Fshop/o-7"
          headers: {idempotency-key: /shop c-1, x-data: '{"amount":3}', content-type: application/cloudevents+json}
  - name: bytes
    message: {exchange: ev, routing_key: bytes.x, id: b-1, body: "raw text", content_type: text/plain}
    expect:
      requests:
        opaque:
          headers: {x-body: raw text, content-type: text/plain, idempotency-key: b-1}
  - name: an envelope reads the metadata too
    message: {exchange: ev, routing_key: env.keep, headers: {x-tenant: acme}, payload: {n: 1}}
    expect:
      requests: {enveloped: {url: "http://127.0.0.1:9/ev/env.keep/acme/1"}}
  - name: an envelope filtered by its routing key
    message: {exchange: ev, routing_key: env.drop, payload: {n: 1}}
    expect: {queues: [], outcomes: {enveloped: filtered}}
"#;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("p.yaml"), pipeline).expect("write");
    std::fs::write(dir.path().join("p.test.yaml"), tests).expect("write");
    let out = support::sluice_cli(&["test", dir.path().to_str().expect("utf-8")], &[], Duration::from_secs(30));
    assert!(out.stdout.ends_with("test result: ok. 6 passed; 0 failed\n"), "{}\n{}", out.stdout, out.stderr);
}
