//! `sluice run` against real RabbitMQ: retries and dead-lettering, counted at the receiver.

mod support;

use std::time::Duration;

use sluice::broker::HeaderValue;
use support::*;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_exhaustion_calls_exactly_max_attempts_then_dead_letters() {
    let vhost = Vhost::new();
    let server = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(503)).mount(&server).await;
    let dir = pipeline(&format!(
        r##"version: 1
exchanges:
  ev: {{type: topic}}
queues:
  work:
    bind: [{{exchange: ev, routing_key: "#"}}]
    handler:
      webhook: {{url: "{}/hook"}}
    retry: {{max_attempts: 3, initial: 100ms, max: 300ms}}
"##,
        server.uri()
    ));
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let _sluice = Sluice::run(dir.path(), &vhost.url(), &[]);
    publish(&broker, "ev", "x", "key-1", serde_json::json!({"n": 1})).await;
    let url = vhost.url();
    wait_until(Duration::from_secs(30), "one message in work.dlq", || async {
        drain_queue(&url, "work.dlq").await.len() == 1
    })
    .await;
    let keys = keys_received(&server).await;
    assert_eq!(keys, ["key-1", "key-1", "key-1"], "exactly max_attempts calls");
    let dead = drain_queue(&url, "work.dlq").await;
    let headers = &dead[0].1;
    assert_eq!(headers.get("x-sluice-reason"), Some(&HeaderValue::Str("exhausted".into())));
    assert_eq!(headers.get("x-sluice-attempts"), Some(&HeaderValue::Int(3)));
    assert_eq!(headers.get("x-sluice-source-queue"), Some(&HeaderValue::Str("work".into())));
    assert!(matches!(headers.get("x-sluice-error"), Some(HeaderValue::Str(e)) if e.starts_with("HTTP 503")));
}
