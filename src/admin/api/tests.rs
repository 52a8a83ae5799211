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
    app_with(Memory::new(), local())
}

/// The port's policy as `run --admin 127.0.0.1:9464` has it.
fn local() -> crate::admin::Policy {
    crate::admin::Policy::new("127.0.0.1:9464", false, &[])
}

/// [`app`] over `broker` (on which nothing is declared), with `policy`.
fn app_with(broker: Memory, policy: crate::admin::Policy) -> (Router, Pauses) {
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = "version: 1\nqueues:\n  work:\n    handler: {webhook: {url: \"http://127.0.0.1:9/x\", headers: \
                {Authorization: \"Bearer literal-secret\", X-Tenant: t1}}}\n    on_status: {\"404\": dead_letter}\n  \
                job:\n    handler: {command: {program: /bin/true, args: [\"{{payload.x}}\"], env: {API_TOKEN: s3, \
                BUCKET: b}, on_exit: {\"75\": retry}}}\n";
    std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
    let config = crate::config::load(&[dir.path().to_path_buf()]).config.expect("valid");
    let connect: Connect<Memory> = Arc::new(move || Box::pin(std::future::ready(Ok(broker.clone()))));
    let pauses = Pauses::default();
    pauses.keep(config.queues.keys());
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder().handle();
    let runner = Runner::this("test");
    let current = Current::new(Arc::new(config));
    let api = Api::new(runner, current, Attempts::default(), pauses.clone(), connect);
    let more = routes::<Memory>().router(Arc::new(api)).merge(super::super::console::routes());
    let token = crate::admin::token::Given { file: None, env: Some("s3cret".into()) }
        .for_runner(std::path::Path::new("/nonexistent"))
        .expect("token")
        .0;
    (super::super::routes(metrics, Default::default(), pauses.clone(), (token, policy), more), pauses)
}

/// What a read sends (issue 31 item 2: reads need the token).
const READER: [(&str, &str); 1] = [("authorization", "Bearer s3cret")];

/// Sends a request for host `127.0.0.1:9464` unless `headers` name another.
async fn send(app: &Router, method: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let (status, _, body) = exchange(app, method, path, headers, "").await;
    (status, body)
}

/// [`send`] with a body; the status, the content type and the body.
async fn exchange(
    app: &Router,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    let mut request = Request::builder().method(method).uri(path).body(Body::from(body.to_string())).expect("request");
    request.headers_mut().insert("host", axum::http::HeaderValue::from_static("127.0.0.1:9464"));
    for (name, value) in headers {
        let name = axum::http::HeaderName::from_bytes(name.as_bytes()).expect("a header name");
        request.headers_mut().insert(name, axum::http::HeaderValue::from_str(value).expect("a header value"));
    }
    request.extensions_mut().insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 50000))));
    let response = app.clone().oneshot(request).await.expect("answered");
    let status = response.status().as_u16();
    let header = |name| response.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let (csp, content_type) = (header("content-security-policy"), header("content-type"));
    assert!(csp.contains("script-src 'self'"), "{method} {path} carries the policy: {csp:?}");
    let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("body");
    (status, content_type, String::from_utf8_lossy(&body).into_owned())
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
    let (app, _) = app_with(Memory::new(), crate::admin::Policy::new("127.0.0.1:9464", true, &[]));
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

/// Issue 31 (low): schemathesis found the API and its OpenAPI document apart. A query the API
/// refuses is answered in JSON as documented (it was text/plain); `limit` is JSON Schema's
/// `integer`, which `230.0` is (it was refused); a field the document types as a string or a
/// number is refused as null (`"confirm": null` was taken as no confirm); `since` is a duration
/// by the document's pattern, however long. Each query parameter's schema takes exactly what the
/// API takes.
#[tokio::test]
async fn refusals_are_json_and_the_api_takes_what_its_document_says() {
    let (app, _) = app();
    let list = "/api/v1/queues/work/dead-letters";
    let token = [("authorization", "Bearer s3cret")];
    for query in ["bogus=1", "limit=abc", "limit=1.5", "limit=0", "limit=29790531.0", "since=soon", "cursor=x"] {
        let (status, content_type, body) = exchange(&app, "GET", &format!("{list}?{query}"), &token, "").await;
        assert_eq!((status, content_type.as_str()), (400, "application/json"), "{query}: {body}");
        let error: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{query}: {e}: {body}"));
        assert!(error["error"].is_string(), "{query}: {body}");
    }
    let purge = "/api/v1/queues/work/dead-letters/purge";
    for refused in [
        r#"{"confirm": null}"#,
        r#"{"confirm": null, "dry_run": true}"#,
        r#"{"reason": null, "dry_run": true}"#,
        r#"{"since": null, "dry_run": true}"#,
        r#"{"limit": null, "dry_run": true}"#,
        r#"{"limit": 2.5, "dry_run": true}"#,
        r#"{"limit": -1, "dry_run": true}"#,
    ] {
        let (status, content_type, body) = exchange(&app, "POST", purge, &token, refused).await;
        assert_eq!((status, content_type.as_str()), (400, "application/json"), "{refused}: {body}");
    }
    for taken in [
        r#"{"limit": 230.0, "dry_run": true}"#,
        r#"{"limit": 29790531.0, "dry_run": true}"#,
        r#"{"limit": 1e30, "dry_run": true}"#,
        r#"{"confirm": "work"}"#,
        r#"{"since": "", "dry_run": true}"#,
    ] {
        // Taken: 502 past the body, the in-memory broker having no dead-letter queue.
        let (status, _, body) = exchange(&app, "POST", purge, &token, taken).await;
        assert_ne!(status, 400, "{taken}: {body}");
    }

    // The document's schema of each query parameter takes what the API takes (past the
    // query, 502: the in-memory broker has no dead-letter queue).
    let doc: Value = serde_json::from_str(OPENAPI).expect("JSON");
    let parameters =
        doc["paths"]["/api/v1/queues/{name}/dead-letters"]["get"]["parameters"].as_array().expect("parameters");
    let schema = |name: &str| &parameters.iter().find(|p| p["name"] == name).expect("documented")["schema"];
    assert_eq!(schema("since"), &doc["components"]["schemas"]["Act"]["properties"]["since"], "one since for both");
    let samples: [(&str, &[&str]); 3] = [
        ("since", &["", "0s", "250ms", "90m", "7d", "99999999999999999999999d", "5", "1.5h", "1w", "h", " 1h", "1h "]),
        ("limit", &["1", "100", "1000", "100.0", "1e3", "0", "1001", "-1", "1.5", "inf", "NaN", "x", "29790531.0"]),
        ("cursor", &["", "0", "12", "12:m-1", "3:a:b", "99999999999999999999:x", "x", ":m", "-1", " 3"]),
    ];
    for (name, texts) in samples {
        let validator = jsonschema::validator_for(schema(name)).expect("a schema");
        for text in texts {
            let encoded = percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC);
            let (status, _, body) = exchange(&app, "GET", &format!("{list}?{name}={encoded}"), &READER, "").await;
            // A query value is text: the document's integer is the text of one.
            let value =
                if name == "limit" { text.parse::<f64>().map_or(json!(text), |n| json!(n)) } else { json!(text) };
            assert_eq!(validator.is_valid(&value), status != 400, "{name}={text:?}: {status} {body}");
        }
    }
}

/// Lets every task spawned on this thread run until it waits.
async fn settle() {
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
}

/// Issue 31 item 9: 20 connections pipelining `GET /api/v1/queues` cut webhook calls from ~340/s
/// to 200/s: each request read the broker and rendered and parsed the runner's own metrics.
/// Now the reads that come while the overview is built wait for that one build, and those
/// within [`SNAPSHOT_TTL`] of it share it: 50 reads at once read the broker once (once a build
/// here: its first read fails, nothing being declared), and the next read past the interval
/// builds it again.
#[tokio::test]
async fn concurrent_overview_reads_build_it_once_per_interval() {
    tokio::task::LocalSet::new().run_until(overview_reads()).await;
}

async fn overview_reads() {
    let broker = Memory::new();
    let (app, _) = app_with(broker.clone(), local());
    broker.stall_stats(true);
    let reads: Vec<_> = (0..50)
        .map(|_| {
            let app = app.clone();
            tokio::task::spawn_local(async move { send(&app, "GET", "/api/v1/queues", &READER).await })
        })
        .collect();
    settle().await;
    let released = std::time::Instant::now();
    broker.stall_stats(false);
    let answers = futures_util::future::join_all(reads).await;
    // A machine too loaded to answer the 50 within the interval may build once more per
    // interval: the bound, not a timing.
    let intervals = released.elapsed().as_nanos() / SNAPSHOT_TTL.as_nanos();
    let (asked, _) = broker.stats_asked();
    assert!(u128::from(asked) <= 1 + intervals, "50 reads at once read the broker {asked} times");
    let first = answers[0].as_ref().expect("answered");
    assert_eq!(first.0, 200, "{}", first.1);
    assert!(answers.iter().all(|a| a.as_ref().is_ok_and(|a| a == first)), "the same overview for all");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while broker.stats_asked().0 == asked {
        assert!(std::time::Instant::now() < deadline, "the overview not built again past the interval");
        tokio::time::sleep(SNAPSHOT_TTL / 10).await;
        assert_eq!(send(&app, "GET", "/api/v1/queues", &READER).await.0, 200);
    }
}

/// Issue 31 item 9: reads that read the broker take turns, [`READS_AT_ONCE`] at a time, the
/// others waiting (here behind a broker that does not answer until released); the probes and
/// reads of the config alone still answer meanwhile.
#[tokio::test]
async fn reads_of_the_broker_take_turns() {
    tokio::task::LocalSet::new().run_until(broker_reads()).await;
}

async fn broker_reads() {
    let broker = Memory::new();
    let (app, _) = app_with(broker.clone(), local());
    broker.stall_stats(true);
    let reads: Vec<_> = (0..10)
        .map(|_| {
            let app = app.clone();
            tokio::task::spawn_local(
                async move { send(&app, "GET", "/api/v1/queues/work/dead-letters", &READER).await },
            )
        })
        .collect();
    settle().await;
    assert_eq!(broker.stats_asked(), (READS_AT_ONCE as u64, READS_AT_ONCE as u64), "10 reads of the broker at once");
    assert_eq!(send(&app, "GET", "/healthz", &[]).await.0, 200);
    assert_eq!(send(&app, "GET", "/api/v1/queues/work", &READER).await.0, 200, "a read of the config alone");
    broker.stall_stats(false);
    for read in futures_util::future::join_all(reads).await {
        // Past the broker's turn: no dead-letter queue is declared.
        assert_eq!(read.expect("answered").0, 502);
    }
    assert_eq!(broker.stats_asked(), (10, READS_AT_ONCE as u64), "each in its turn");
}
