use std::collections::BTreeSet;

use axum::body::Body;
use axum::http::Request;
use tower::ServiceExt as _;

use super::*;
use crate::broker::memory::Memory;

/// Every `(method, path)` the OpenAPI document describes, methods in upper case.
fn documented() -> BTreeSet<(String, String)> {
    let doc: Value = serde_json::from_str(OPENAPI).expect("openapi.json is JSON");
    let paths = doc["paths"].as_object().expect("paths");
    paths
        .iter()
        .flat_map(|(path, item)| {
            let methods = item.as_object().expect("path item").keys();
            methods.map(move |m| (m.to_uppercase(), path.clone()))
        })
        .collect()
}

/// Issue 22: the OpenAPI document names exactly the API's routes: a route added without it
/// (or described and not served) fails here.
#[test]
fn the_openapi_document_matches_the_routes() {
    let served: BTreeSet<(String, String)> =
        routes::<Memory>().names().iter().map(|(m, p)| (m.to_string(), (*p).to_string())).collect();
    assert_eq!(served, documented());
    let doc: Value = serde_json::from_str(OPENAPI).expect("JSON");
    assert_eq!(doc["openapi"], "3.1.0");
    // Every route but this document says it needs the token (issue 31 item 2: reads too),
    // and every one that a host the port does not answer for is refused.
    for (method, path) in documented() {
        let op = &doc["paths"][&path][method.to_lowercase()];
        assert!(op["responses"].get("421").is_some(), "{method} {path} documents the host's refusal");
        if path == "/api/v1/openapi.json" {
            assert_eq!(op.get("security"), None, "{method} {path} is open");
            continue;
        }
        assert_eq!(op["security"], json!([{ "bearer": [] }]), "{method} {path}");
        assert!(op["responses"].get("401").is_some(), "{method} {path} documents its refusal");
    }
}

/// A runner's port over the in-memory broker, one queue `work` running, with token `s3cret`.
fn app() -> (Router, Pauses) {
    app_with(crate::admin::Policy::new("127.0.0.1:9464", false, &[]))
}

/// [`app`], with `policy`.
fn app_with(policy: crate::admin::Policy) -> (Router, Pauses) {
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = "version: 1\nqueues:\n  work:\n    handler: {webhook: {url: \"http://127.0.0.1:9/x\", headers: \
                {Authorization: \"Bearer literal-secret\", X-Tenant: t1}}}\n    on_status: {\"404\": dead_letter}\n  \
                job:\n    handler: {command: {program: /bin/true, args: [\"{{payload.x}}\"], env: {API_TOKEN: s3, \
                BUCKET: b}, on_exit: {\"75\": retry}}}\n";
    std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
    let config = crate::config::load(&[dir.path().to_path_buf()]).config.expect("valid");
    let broker = Memory::new();
    let connect: Connect<Memory> = Arc::new(move || Box::pin(std::future::ready(Ok(broker.clone()))));
    let pauses = Pauses::default();
    pauses.keep(config.queues.keys());
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder().handle();
    let runner = Runner::this("test");
    let current = Current::new(Arc::new(config));
    let api = Api::new(runner, current, Attempts::default(), pauses.clone(), metrics.clone(), connect);
    let more = routes::<Memory>().router(Arc::new(api)).merge(super::super::console::routes());
    let token = crate::admin::token::Given { file: None, env: Some("s3cret".into()) }
        .for_runner(std::path::Path::new("/nonexistent"))
        .expect("token")
        .0;
    (super::super::routes(metrics, Default::default(), pauses.clone(), (token, policy), more), pauses)
}

/// Sends a request for host `127.0.0.1:9464` unless `headers` name another.
async fn send(app: &Router, method: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut request = Request::builder().method(method).uri(path).body(Body::empty()).expect("request");
    request.headers_mut().insert("host", axum::http::HeaderValue::from_static("127.0.0.1:9464"));
    for (name, value) in headers {
        let name = axum::http::HeaderName::from_bytes(name.as_bytes()).expect("a header name");
        request.headers_mut().insert(name, axum::http::HeaderValue::from_str(value).expect("a header value"));
    }
    request.extensions_mut().insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 50000))));
    let response = app.clone().oneshot(request).await.expect("answered");
    let status = response.status().as_u16();
    let csp = response.headers().get("content-security-policy").and_then(|v| v.to_str().ok()).unwrap_or("");
    assert!(csp.contains("script-src 'self'"), "{method} {path} carries the policy: {csp:?}");
    let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("body");
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Every documented route is served (not the router's empty 404 or a 405); every read but the
/// OpenAPI document (issue 31 item 2) and every write is refused without the token or with a
/// wrong one, every write from another origin too, and a refused write changes nothing.
#[tokio::test]
async fn every_documented_route_answers_and_every_write_needs_the_token() {
    let (app, pauses) = app();
    // Whether `work` is paused, as the writes with the token leave it.
    let mut paused = false;
    for (method, path) in documented() {
        let path = path.replace("{name}", "work").replace("{id}", "none");
        if method == "GET" {
            let needed = if path == "/api/v1/openapi.json" { 200 } else { 401 };
            assert_eq!(send(&app, &method, &path, &[]).await.0, needed, "{method} {path} without the token");
            let wrong = send(&app, &method, &path, &[("authorization", "Bearer wrong")]).await.0;
            assert_eq!(wrong, needed, "{method} {path} with a wrong token");
            let (status, body) = send(&app, &method, &path, &[("authorization", "Bearer s3cret")]).await;
            assert!(
                status != 405 && status != 401 && !(status == 404 && body.is_empty()),
                "{method} {path}: {status} {body}"
            );
            continue;
        }
        let refused: [(&[(&str, &str)], u16); 4] = [
            (&[], 401),
            (&[("authorization", "Bearer wrong")], 401),
            (&[("authorization", "Bearer s3cret"), ("origin", "http://evil.example")], 403),
            (&[("origin", "http://evil.example")], 403),
        ];
        for (headers, expected) in refused {
            assert_eq!(send(&app, &method, &path, headers).await.0, expected, "{method} {path} with {headers:?}");
        }
        // Setting it as it was changes nothing: the refused writes did not either.
        assert_eq!(pauses.set("work", paused), Ok(false), "{method} {path} refused changed nothing");
        let (status, body) = send(&app, &method, &path, &[("authorization", "Bearer s3cret")]).await;
        paused = if path.ends_with("/pause") { true } else { paused && !path.ends_with("/resume") };
        assert!(
            status != 405 && status != 401 && !(status == 404 && body.is_empty()),
            "{method} {path}: {status} {body}"
        );
    }
}

#[tokio::test]
async fn a_purge_needs_the_queue_name_typed_again() {
    let (app, _) = app();
    let token = [("authorization", "Bearer s3cret")];
    let (status, body) = send(&app, "POST", "/api/v1/queues/work/dead-letters/purge", &token).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("confirm"), "{body}");
}

/// The handler as compiled: its rules, and its headers with secret values masked.
#[tokio::test]
async fn a_queue_shows_its_handler_without_secrets() {
    let (app, _) = app();
    let token = [("authorization", "Bearer s3cret")];
    let (status, body) = send(&app, "GET", "/api/v1/queues/work", &token).await;
    assert_eq!(status, 200, "{body}");
    assert!(!body.contains("literal-secret"), "{body}");
    let queue: Value = serde_json::from_str(&body).expect("JSON");
    let handler = &queue["handler"];
    assert_eq!(handler["headers"], json!([["Authorization", "***"], ["X-Tenant", "t1"]]));
    assert_eq!(handler["on_status"], json!({ "404": "dead_letter" }));
    assert_eq!((handler["kind"].as_str(), handler["signing"].as_bool()), (Some("webhook"), Some(false)));
    assert_eq!(queue["retry"]["delays_ms"].as_array().map(Vec::len), Some(4), "{}", queue["retry"]);

    let (status, body) = send(&app, "GET", "/api/v1/queues/job", &token).await;
    assert_eq!(status, 200, "{body}");
    let handler = &serde_json::from_str::<Value>(&body).expect("JSON")["handler"];
    assert_eq!(handler["program"], "/bin/true");
    assert_eq!(handler["args"], json!(["{{payload.x}}"]));
    assert_eq!(handler["env"], json!([["API_TOKEN", "***"], ["BUCKET", "b"]]));
    assert_eq!(handler["on_exit"], json!({ "75": "retry" }));
    assert_eq!(handler["stdin"], "envelope");
}

#[test]
fn secret_looking_names_are_masked() {
    for (name, secret) in [
        ("Authorization", true),
        ("X-Api-Key", true),
        ("webhook-signature", true),
        ("X-Auth-Token", true),
        ("STRIPE_SECRET", true),
        ("Content-Type", false),
        ("X-Tenant", false),
        ("BUCKET", false),
    ] {
        assert_eq!(secret_name(name), secret, "{name}");
    }
}

/// Issue 31 item 2: with `--admin-open-reads` every read is open and every write still needs
/// the token; a request for another host is refused either way, the probes excepted.
#[tokio::test]
async fn open_reads_leave_writes_and_hosts_guarded() {
    let (app, _) = app_with(crate::admin::Policy::new("127.0.0.1:9464", true, &[]));
    for (method, path) in documented() {
        let path = path.replace("{name}", "work").replace("{id}", "none");
        let (status, body) = send(&app, &method, &path, &[]).await;
        if method == "GET" {
            assert!(status != 401 && !(status == 404 && body.is_empty()), "{method} {path}: {status} {body}");
        } else {
            assert_eq!(status, 401, "{method} {path}: {body}");
        }
        let foreign = send(&app, &method, &path, &[("host", "attacker.example:9464")]).await.0;
        assert_eq!(foreign, 421, "{method} {path} for another host");
    }
    // Open, for any host (readiness answers 503 here: nothing runs).
    for (path, status) in [("/metrics", 200), ("/healthz", 200), ("/readyz", 503)] {
        assert_eq!(send(&app, "GET", path, &[("host", "attacker.example")]).await.0, status, "{path}");
    }
}
