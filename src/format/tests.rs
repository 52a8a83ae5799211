use bytes::Bytes;
use serde_json::json;

use super::*;
use crate::broker::{HeaderValue, Headers, Kept, Properties, Route};

fn delivery(body: &[u8], properties: Properties) -> Kept<()> {
    Kept::standalone(Bytes::copy_from_slice(body), properties)
}

fn routed(headers: Headers) -> Properties {
    Properties {
        headers,
        route: Some(Route { exchange: "events".into(), routing_key: "order.created".into() }),
        ..Properties::default()
    }
}

fn headers(pairs: &[(&str, &str)]) -> Headers {
    pairs.iter().map(|(k, v)| (k.to_string(), HeaderValue::Str(v.to_string()))).collect()
}

/// Issue 34: a plain JSON producer sets properties only (as pika does), or nothing at all.
#[test]
fn json_takes_id_type_and_time_from_the_broker() {
    let body = br#"{"order_id":7}"#;
    let full = Properties {
        message_id: Some("m-1".into()),
        kind: Some("order.created".into()),
        timestamp: Some(1_798_135_200),
        ..routed(Headers::new())
    };
    let d = delivery(body, full);
    let m = Message::decode(Format::Json, &d).expect("JSON");
    assert_eq!((m.envelope.id.as_str(), m.envelope.kind.as_str()), ("m-1", "order.created"));
    assert_eq!(m.envelope.occurred_at.as_deref(), Some("2026-12-24T18:00:00Z"));
    assert_eq!(m.envelope.idempotency_key(), "m-1");
    assert_eq!(m.envelope.payload_value().expect("payload"), json!({"order_id": 7}));
    assert_eq!(m.payload_bytes(), body);
    assert_eq!(m.forwarded(), ("application/json".to_string(), Vec::new()));

    // No id: the body's hash, the same for every copy of it; the type from a header, else the
    // routing key.
    let d = delivery(body, routed(headers(&[("type", "from.header")])));
    let m = Message::decode(Format::Json, &d).expect("JSON");
    assert_eq!(m.envelope.id, sha256_id(body));
    assert!(m.envelope.id.starts_with("sha256:") && m.envelope.id.len() == 71);
    assert_eq!((m.envelope.kind.as_str(), m.envelope.occurred_at.as_deref()), ("from.header", None));
    let d = delivery(body, Properties { message_id: Some("  ".into()), ..routed(Headers::new()) });
    let m = Message::decode(Format::Json, &d).expect("JSON");
    assert_eq!((m.envelope.id.clone(), m.envelope.kind.as_str()), (sha256_id(body), "order.created"));
    let fields = m.fields(true).expect("fields");
    assert_eq!(fields["routing_key"], json!("order.created"));
    assert_eq!(fields["exchange"], json!("events"));
    assert_eq!(fields["payload"], json!({"order_id": 7}));
    assert!(!fields.contains_key("version") && !fields.contains_key("body"));
}

/// Issue 34: a body that is not what the format says is unreadable, with a clear error, never
/// a panic: invalid JSON, bytes that are not UTF-8, nesting past the parser's limit.
#[test]
fn hostile_bodies_are_unreadable_not_a_panic() {
    let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
    let cases: &[(Format, &[u8], &str)] = &[
        (Format::Json, b"{\"a\":", "not a JSON document (format: json)"),
        (Format::Json, b"", "not a JSON document (format: json)"),
        (Format::Json, b"\xff\xfe{}", "not a JSON document (format: json)"),
        (Format::Json, b"{\"n\":1e400}", "not a JSON document (format: json)"),
        (Format::Json, deep.as_bytes(), "not a JSON document (format: json)"),
        (Format::CloudEvents, b"\xff", "not a CloudEvent: no cloudEvents:* or ce-* attribute headers"),
        (Format::CloudEvents, b"{\"specversion\":\"1.0\"}", "the required attribute \"id\" is missing"),
        (Format::Envelope, b"{}", "not a sluice envelope"),
    ];
    for (format, body, error) in cases {
        let d = delivery(body, Properties::default());
        let got = Message::decode(*format, &d).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(got.contains(error), "{format} {:?}: {got}", String::from_utf8_lossy(&body[..body.len().min(20)]));
    }
    // Bytes take anything; their text is there only when it is UTF-8.
    let d = delivery(b"\x00\xff\x10binary", Properties::default());
    let m = Message::decode(Format::Bytes, &d).expect("any body");
    assert_eq!(m.text(), None);
    assert!(!m.fields(true).expect("fields").contains_key("body"), "no body as text: a template reading it fails");
    assert_eq!(m.payload_bytes(), b"\x00\xff\x10binary");
}

/// Issue 34: many large headers are read, whole, without a panic; an attribute too large to be
/// a key or an HTTP header makes a CloudEvent unreadable.
#[test]
fn huge_headers() {
    let big = "h".repeat(1 << 20);
    let many: Headers = (0..2000).map(|i| (format!("x-{i}"), HeaderValue::Str(big[..1000].to_string()))).collect();
    let d = delivery(b"{}", routed(many));
    let m = Message::decode(Format::Json, &d).expect("JSON");
    assert_eq!(m.fields(true).expect("fields")["headers"].as_object().map(|h| h.len()), Some(2000));
    let d = delivery(
        b"{}",
        routed(headers(&[("cloudEvents:id", &big), ("cloudEvents:source", "/s"), ("cloudEvents:type", "t")])),
    );
    let error = Message::decode(Format::CloudEvents, &d).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(error.contains("\"id\" is 1048576 bytes, over the 4096"), "{error}");
}

/// Issue 34: binary mode, as the CloudEvents AMQP binding has it (`cloudEvents:` application
/// properties, the body is the data) or with `ce-` headers; keyed by source and id.
#[test]
fn cloudevents_in_binary_mode() {
    for prefix in ["cloudEvents:", "cloudEvents_", "ce-", "ce_"] {
        let name = |a: &str| format!("{prefix}{a}");
        let mut h = headers(&[]);
        for (a, v) in [("specversion", "1.0"), ("id", "A-1"), ("source", "/orders"), ("type", "order.created")] {
            h.insert(name(a), HeaderValue::Str(v.into()));
        }
        h.insert(name("subject"), HeaderValue::Str("o-7".into()));
        h.insert(name("tenant"), HeaderValue::Str("acme ü".into()));
        h.insert(name("time"), HeaderValue::Int(1_798_135_200));
        // Not an attribute name: not read, never sent on as a header.
        h.insert(name("bad\r\nname"), HeaderValue::Str("x".into()));
        let properties = Properties { content_type: Some("application/json".into()), ..routed(h) };
        let d = delivery(br#"{"order_id":7}"#, properties);
        let m = Message::decode(Format::CloudEvents, &d).expect("a CloudEvent");
        assert_eq!((m.envelope.id.as_str(), m.envelope.kind.as_str()), ("A-1", "order.created"), "{prefix}");
        assert_eq!(m.envelope.idempotency_key(), "/orders A-1");
        assert_eq!(m.envelope.occurred_at.as_deref(), Some("2026-12-24T18:00:00Z"));
        let fields = m.fields(true).expect("fields");
        assert_eq!(fields["data"], json!({"order_id": 7}));
        assert_eq!((&fields["source"], &fields["subject"]), (&json!("/orders"), &json!("o-7")));
        assert_eq!(fields["datacontenttype"], json!("application/json"));
        let (content_type, forwarded) = m.forwarded();
        assert_eq!(content_type, "application/json");
        assert!(forwarded.contains(&("ce-id".to_string(), "A-1".to_string())), "{forwarded:?}");
        assert!(forwarded.contains(&("ce-tenant".to_string(), "acme %C3%BC".to_string())), "{forwarded:?}");
        assert!(forwarded.iter().all(|(name, _)| !name.contains("bad")), "{forwarded:?}");
        assert_eq!(m.payload_bytes(), br#"{"order_id":7}"#);
    }
    // Data of another type: no `data` for templates; declared JSON that is not: unreadable.
    let attributes = headers(&[("ce-id", "1"), ("ce-source", "/s"), ("ce-type", "t")]);
    let d = delivery(b"\x89PNG", Properties { content_type: Some("image/png".into()), ..routed(attributes.clone()) });
    let m = Message::decode(Format::CloudEvents, &d).expect("a CloudEvent");
    assert!(!m.has_payload && !m.fields(true).expect("fields").contains_key("data"));
    assert_eq!(m.forwarded().0, "image/png");
    let d = delivery(b"nope", Properties { content_type: Some("application/json".into()), ..routed(attributes) });
    let error = Message::decode(Format::CloudEvents, &d).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(error.contains("data is not JSON though its content type is \"application/json\""), "{error}");
    let d = delivery(b"{}", routed(headers(&[("ce-id", "1"), ("ce-type", "t")])));
    let error = Message::decode(Format::CloudEvents, &d).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(error.contains("binary mode): the required attribute \"source\" is missing"), "{error}");
}

/// Issue 34: structured mode, the whole event as JSON, with or without its content type.
#[test]
fn cloudevents_in_structured_mode() {
    let event = json!({
        "specversion": "1.0", "id": "B-2", "source": "https://shop/orders", "type": "order.paid",
        "subject": "o-9", "time": "2026-12-24T18:00:00Z", "datacontenttype": "application/json",
        "data": {"amount": 12}
    })
    .to_string();
    for content_type in [Some("application/cloudevents+json; charset=utf-8"), None] {
        let properties = Properties { content_type: content_type.map(str::to_string), ..routed(Headers::new()) };
        let d = delivery(event.as_bytes(), properties);
        let m = Message::decode(Format::CloudEvents, &d).expect("a CloudEvent");
        assert_eq!(m.envelope.idempotency_key(), "https://shop/orders B-2");
        assert_eq!(m.envelope.occurred_at.as_deref(), Some("2026-12-24T18:00:00Z"));
        assert_eq!(m.fields(true).expect("fields")["data"], json!({"amount": 12}));
        assert_eq!(m.payload_bytes(), br#"{"amount":12}"#);
        let (forwarded_type, headers) = m.forwarded();
        assert_eq!(forwarded_type, content_type.unwrap_or("application/cloudevents+json"));
        assert!(headers.is_empty());
    }
    let missing = json!({"specversion": "1.0", "id": "B-2", "type": "t"}).to_string();
    let d = delivery(missing.as_bytes(), Properties::default());
    let error = Message::decode(Format::CloudEvents, &d).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(error.contains("structured mode): the required attribute \"source\""), "{error}");
}

#[test]
fn bytes_are_opaque() {
    let properties = Properties {
        message_id: Some("b-1".into()),
        content_type: Some("application/x-protobuf".into()),
        ..routed(Headers::new())
    };
    let d = delivery(b"\x08\x96\x01", properties);
    let m = Message::decode(Format::Bytes, &d).expect("any body");
    assert_eq!((m.envelope.id.as_str(), m.envelope.kind.as_str()), ("b-1", "order.created"));
    assert_eq!(m.forwarded(), ("application/x-protobuf".to_string(), Vec::new()));
    let hostile = Properties { content_type: Some("text/plain\r\nx-evil: 1".into()), ..Properties::default() };
    let d = delivery(b"x", hostile);
    let m = Message::decode(Format::Bytes, &d).expect("any body");
    assert_eq!(m.forwarded().0, "application/octet-stream", "a content type no header can carry is none");
    let d = delivery(b"plain text", Properties::default());
    let m = Message::decode(Format::Bytes, &d).expect("any body");
    assert_eq!(m.fields(true).expect("fields")["body"], json!("plain text"));
    assert_eq!(m.forwarded().0, "application/octet-stream");
    assert_eq!(m.envelope.id, sha256_id(b"plain text"));
}

#[test]
fn each_format_names_its_fields() {
    let cases = [
        (Format::Envelope, "payload", true),
        (Format::Envelope, "version", true),
        (Format::Envelope, "headers", true),
        (Format::Json, "payload", true),
        (Format::Json, "version", false),
        (Format::Json, "source", false),
        (Format::CloudEvents, "data", true),
        (Format::CloudEvents, "source", true),
        (Format::CloudEvents, "payload", false),
        (Format::Bytes, "body", true),
        (Format::Bytes, "payload", false),
        (Format::Bytes, "routing_key", true),
    ];
    for (format, field, has) in cases {
        assert_eq!(format.has(field), has, "{format} {field}");
    }
    for format in Format::ALL {
        assert_eq!(Format::parse(format.name()), Some(format));
    }
    assert_eq!(Format::parse("xml"), None);
}
