//! Issue 11: trace context across the async hop, against real RabbitMQ and the real binary. A
//! message's `traceparent` is continued (same trace, new span) into every webhook call and
//! command, across retries, and kept on the copies; a message without one starts a new trace;
//! with an OTLP endpoint set, the delivery's spans are exported in that same trace.

use crate::support;

use std::time::Duration;

use prost::Message as _;
use serde_json::json;
use sluice::broker::{HeaderValue, Headers, Outgoing, Publish};
use sluice::envelope::Envelope;
use sluice::trace::TraceContext;
use support::*;

const DEADLINE: Duration = Duration::from_secs(30);

/// What the producer sent.
const PUBLISHED: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

fn published() -> TraceContext {
    TraceContext::parse(PUBLISHED).expect("a valid traceparent")
}

fn traceparent(text: &str) -> Headers {
    Headers::from([("traceparent".to_string(), HeaderValue::Str(text.into()))])
}

/// The context a request carried; fails the test when it carried none, or an invalid one.
fn carried(hit: &Hit) -> TraceContext {
    let text = hit.header("traceparent").unwrap_or_else(|| panic!("no traceparent on {}", hit.target));
    TraceContext::parse(text).unwrap_or_else(|| panic!("invalid traceparent {text:?}"))
}

/// Publishes an envelope (with its id as `message_id`, as `sluice publish` does) and headers.
async fn publish_with(broker: &impl Publish, key: &str, headers: Headers) -> Envelope<'static> {
    let envelope = Envelope::new("test.event", &json!({"key": key}), Some(key.to_string()));
    let message =
        Outgoing { body: envelope.encode(), message_id: Some(envelope.id.clone()), headers, ..Default::default() };
    broker.publish("ev", "x", message).await.expect("publish confirmed");
    envelope
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_is_continued_across_retries_and_kept_on_the_copies() {
    let vhost = Vhost::new();
    // "retried" fails once then succeeds; "doomed" fails both of its attempts.
    let receiver =
        Receiver::start(
            |hit, earlier| if hit.key() == "doomed" || earlier == 0 { Reply::status(503) } else { Reply::ok() },
        )
        .await;
    let dir = webhook_pipeline(&receiver, "    retry: {max_attempts: 2, initial: 100ms, max: 200ms}\n");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let _sluice = Sluice::run(dir.path(), &vhost.url(), &[]);
    let doomed_trace = "00-11111111111111111111111111111111-2222222222222222-00";
    publish_with(&broker, "retried", traceparent(PUBLISHED)).await;
    publish_with(&broker, "doomed", traceparent(doomed_trace)).await;

    wait_until(DEADLINE, "the retried message handled", || async { receiver.hits_for("retried").len() == 2 }).await;
    wait_until(DEADLINE, "the doomed message dead-lettered", || async {
        vhost.drain_queue("work.dlq").await.len() == 1
    })
    .await;
    let retried = receiver.hits_for("retried");
    assert_eq!(retried.iter().map(|h| h.status).collect::<Vec<_>>(), [503, 200]);
    let spans: Vec<_> = retried.iter().map(carried).collect();
    for span in &spans {
        assert_eq!(span.trace_id, published().trace_id, "the producer's trace, on every attempt");
        assert_eq!(span.flags, published().flags);
        assert_ne!(span.span_id, published().span_id, "a span of sluice's own");
    }
    assert_ne!(spans[0].span_id, spans[1].span_id, "one span per attempt");

    let doomed = receiver.hits_for("doomed");
    assert_eq!(doomed.len(), 2);
    for hit in &doomed {
        assert_eq!(carried(hit).trace_id, TraceContext::parse(doomed_trace).expect("valid").trace_id);
        assert_eq!(carried(hit).flags, 0, "an unsampled trace stays unsampled");
    }
    let dead = vhost.drain_queue("work.dlq").await;
    assert_eq!(header_str(&dead[0].1, "traceparent"), Some(doomed_trace), "the dead-letter copy keeps the original");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_a_valid_traceparent_starts_a_new_trace() {
    let vhost = Vhost::new();
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let _sluice = Sluice::run(dir.path(), &vhost.url(), &[]);
    let hostile = ["", "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01", &"f".repeat(10_000)];
    publish_with(&broker, "none", Headers::new()).await;
    for (i, text) in hostile.iter().enumerate() {
        publish_with(&broker, &format!("hostile-{i}"), traceparent(text)).await;
    }

    let hits = receiver.wait_for(4, DEADLINE).await;
    let mut traces: Vec<_> = hits.iter().map(|hit| carried(hit).trace_id).collect();
    traces.sort();
    traces.dedup();
    assert_eq!(traces.len(), 4, "a trace of its own for each message");
}

/// Writes `$TRACEPARENT` into `$1`.
const RECORD_TRACEPARENT: &str = r#"printf '%s' "$TRACEPARENT" > "$1""#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_gets_the_trace_as_traceparent() {
    let vhost = Vhost::new();
    let out = tempfile::tempdir().expect("tempdir");
    let file = out.path().join("traceparent");
    let dir = work_pipeline(&format!(
        "    handler:\n      command: {{program: ./record.sh, args: [\"{}\"]}}\n",
        file.display()
    ));
    script(dir.path(), "record.sh", RECORD_TRACEPARENT);
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let _sluice = Sluice::run(dir.path(), &vhost.url(), &[]);
    publish_with(&broker, "cmd", traceparent(PUBLISHED)).await;

    wait_until(DEADLINE, "the command ran", || async { file.exists() }).await;
    let text = std::fs::read_to_string(&file).expect("read");
    let seen = TraceContext::parse(&text).unwrap_or_else(|| panic!("invalid TRACEPARENT {text:?}"));
    assert_eq!(seen.trace_id, published().trace_id);
    assert_ne!(seen.span_id, published().span_id);
}

/// The spans of every export request an OTLP receiver got, with the resource's service name.
async fn exported_spans(server: &wiremock::MockServer) -> Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)> {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    let mut spans = Vec::new();
    for request in server.received_requests().await.unwrap_or_default() {
        assert_eq!(request.url.path(), "/v1/traces");
        let export = ExportTraceServiceRequest::decode(request.body.as_slice()).expect("an OTLP protobuf export");
        for resource in export.resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            spans.extend(resource.scope_spans.into_iter().flat_map(|s| s.spans).map(|s| (service.clone(), s)));
        }
    }
    spans
}

fn attribute(span: &opentelemetry_proto::tonic::trace::v1::Span, key: &str) -> Option<String> {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    span.attributes.iter().find(|a| a.key == key).and_then(|a| match a.value.as_ref()?.value.as_ref()? {
        Value::StringValue(s) => Some(s.clone()),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_otlp_endpoint_the_delivery_spans_are_exported_in_the_messages_trace() {
    use wiremock::matchers::{method, path};
    let collector = wiremock::MockServer::start().await;
    wiremock::Mock::given(method("POST"))
        .and(path("/v1/traces"))
        .respond_with(wiremock::ResponseTemplate::new(200))
        .mount(&collector)
        .await;
    let vhost = Vhost::new();
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let endpoint = collector.uri();
    let mut sluice = Sluice::run_with_env(
        dir.path(),
        &vhost.url(),
        &[],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()), ("OTEL_SERVICE_NAME", "")],
    );
    let envelope = publish_with(&broker, "exported", traceparent(PUBLISHED)).await;
    let hit = receiver.wait_for(1, DEADLINE).await.remove(0);
    // Stopped at once, well within the exporter's 5 s batch delay: the spans arrive because
    // the runner flushes them at exit.
    assert_eq!(sluice.stop(DEADLINE), Some(0), "log:\n{}", sluice.log());

    let spans = exported_spans(&collector).await;
    let find =
        |name: &str| {
            spans.iter().find(|(_, s)| s.name == name).map(|(service, s)| (service.clone(), s.clone())).unwrap_or_else(
                || panic!("no {name} span in {:?}", spans.iter().map(|(_, s)| &s.name).collect::<Vec<_>>()),
            )
        };
    let ((service, receive), (_, handle), (_, settle)) = (find("receive"), find("handle"), find("settle"));
    assert_eq!(service, "sluice");
    let published = published();
    for span in [&receive, &handle, &settle] {
        assert_eq!(span.trace_id, published.trace_id, "{}: the message's trace", span.name);
    }
    assert_eq!(receive.parent_span_id, published.span_id, "receive continues the producer's span");
    assert_eq!(handle.parent_span_id, receive.span_id);
    assert_eq!(settle.parent_span_id, receive.span_id);
    assert_eq!(attribute(&receive, "message_id").as_deref(), Some(envelope.id.as_str()));
    assert_eq!(attribute(&receive, "queue").as_deref(), Some("work"));
    let sent = carried(&hit);
    assert_eq!(
        (sent.trace_id.to_vec(), sent.span_id.to_vec()),
        (handle.trace_id, handle.span_id),
        "the webhook's parent is the handle span"
    );
}
