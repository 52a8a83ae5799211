//! The webhook handler against a real HTTP server (wiremock): classification, Retry-After,
//! timeouts, connection failures and bounded response reading.

use std::time::{Duration, SystemTime};

use reqwest::Method;
use sluice::handler::HandlerError;
use sluice::handler::rules::{Action, Key, Rules};
use sluice::handler::webhook::{self, Request};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use wiremock::matchers::{any, body_bytes, header, method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

const TIMEOUT: Duration = Duration::from_secs(10);

fn post(url: String) -> Request {
    Request {
        method: Method::POST,
        url: url.parse().expect("a valid URL"),
        headers: Vec::new(),
        body: bytes::Bytes::from_static(b"{}"),
    }
}

/// Serves `response` to any request and calls it once.
async fn call_with(response: ResponseTemplate) -> Result<(), HandlerError> {
    let server = MockServer::start().await;
    Mock::given(any()).respond_with(response).mount(&server).await;
    let client = webhook::client().expect("client builds");
    webhook::call(&client, post(server.uri()), TIMEOUT, &Rules::default(), &mut Default::default()).await
}

fn assert_transient(result: &Result<(), HandlerError>, expected_text: &str) {
    match result {
        Err(HandlerError::Transient { error, .. }) if error.contains(expected_text) => {}
        other => panic!("expected transient {expected_text:?}, got {other:?}"),
    }
}

fn assert_permanent(result: &Result<(), HandlerError>, expected_text: &str) {
    match result {
        Err(HandlerError::Permanent { error }) if error.contains(expected_text) => {}
        other => panic!("expected permanent {expected_text:?}, got {other:?}"),
    }
}

#[tokio::test]
async fn statuses_map_to_outcomes() {
    enum Expected {
        Success,
        Transient,
        Permanent,
    }
    let cases = [
        (200, Expected::Success),
        (201, Expected::Success),
        (204, Expected::Success),
        (400, Expected::Permanent),
        (404, Expected::Permanent),
        (408, Expected::Transient),
        (422, Expected::Permanent),
        (425, Expected::Transient),
        (429, Expected::Transient),
        (500, Expected::Transient),
        (503, Expected::Transient),
    ];
    for (status, expected) in cases {
        let result = call_with(ResponseTemplate::new(status)).await;
        let text = format!("HTTP {status}");
        match expected {
            Expected::Success => assert_eq!(result, Ok(()), "status {status}"),
            Expected::Transient => assert_transient(&result, &text),
            Expected::Permanent => assert_permanent(&result, &text),
        }
    }
}

/// Issue 13: `on_status` rules decide over the Outcomes table, an exact code before its class,
/// and a rule's verdict names the rule.
#[tokio::test]
async fn on_status_rules_decide_by_code_then_class() {
    let rules = Rules::new(
        [
            (Key::Code(409), Action::Success),
            (Key::Class(3), Action::Success),
            (Key::Code(202), Action::Retry),
            (Key::Class(4), Action::Retry),
            (Key::Code(404), Action::DeadLetter),
            (Key::Class(5), Action::DeadLetter),
            (Key::Code(503), Action::Retry),
        ]
        .into_iter()
        .collect(),
    );
    let server = MockServer::start().await;
    for status in [409, 302, 202, 422, 404, 500, 503, 200] {
        Mock::given(path(format!("/{status}")))
            .respond_with(ResponseTemplate::new(status).insert_header("Retry-After", "7").set_body_string("no"))
            .mount(&server)
            .await;
    }
    let client = webhook::client().expect("client builds");
    // A retried 503 still says the receiver is unwell (issue 13's breaker counts it); a 4xx
    // retried by a rule does not.
    let retry = |error: &str, unwell: bool| {
        Err(HandlerError::Transient { error: error.into(), retry_after: Some(Duration::from_secs(7)), unwell })
    };
    let dead = |error: &str| Err(HandlerError::permanent(error));
    let cases = [
        (409, Ok(())),
        (302, Ok(())),
        (202, retry("HTTP 202 (on_status \"202\": retry): no", false)),
        (422, retry("HTTP 422 (on_status \"4xx\": retry): no", false)),
        (404, dead("HTTP 404 (on_status \"404\": dead_letter): no")),
        (500, dead("HTTP 500 (on_status \"5xx\": dead_letter): no")),
        (503, retry("HTTP 503 (on_status \"503\": retry): no", true)),
        (200, Ok(())),
    ];
    for (status, expected) in cases {
        let url = format!("{}/{status}", server.uri());
        assert_eq!(
            webhook::call(&client, post(url), TIMEOUT, &rules, &mut Default::default()).await,
            expected,
            "status {status}"
        );
    }
}

#[tokio::test]
async fn error_text_quotes_the_start_of_the_body_on_one_line() {
    let body = format!("{{\"error\":\n  \"amount must be positive\"}}{}", "x".repeat(1000));
    let result = call_with(ResponseTemplate::new(422).set_body_string(body)).await;
    let Err(HandlerError::Permanent { error }) = result else {
        panic!("expected permanent, got {result:?}");
    };
    assert!(error.starts_with(r#"HTTP 422: {"error": "amount must be positive"}xxx"#), "{error}");
    assert!(error.len() < 300, "{error}");
}

#[tokio::test]
async fn redirects_are_permanent_and_not_followed() {
    let server = MockServer::start().await;
    Mock::given(path("/old"))
        .respond_with(ResponseTemplate::new(301).insert_header("Location", format!("{}/new", server.uri())))
        .mount(&server)
        .await;
    Mock::given(path("/new")).respond_with(ResponseTemplate::new(200)).expect(0).mount(&server).await;
    let client = webhook::client().expect("client builds");

    let result = webhook::call(
        &client,
        post(format!("{}/old", server.uri())),
        TIMEOUT,
        &Rules::default(),
        &mut Default::default(),
    )
    .await;

    assert_permanent(&result, "HTTP 301");
    server.verify().await;
}

#[tokio::test]
async fn retry_after_in_seconds_is_passed_on() {
    let result = call_with(ResponseTemplate::new(429).insert_header("Retry-After", "7")).await;
    assert_eq!(
        result,
        Err(HandlerError::Transient {
            error: "HTTP 429".to_owned(),
            retry_after: Some(Duration::from_secs(7)),
            unwell: true
        })
    );
}

#[tokio::test]
async fn retry_after_as_a_date_is_passed_on_as_the_time_left() {
    let at = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
    let result = call_with(ResponseTemplate::new(503).insert_header("Retry-After", at)).await;
    let Err(HandlerError::Transient { retry_after: Some(retry_after), .. }) = result else {
        panic!("expected transient with retry_after, got {result:?}");
    };
    // HTTP-dates have one-second resolution, and the call itself takes a little time.
    assert!((Duration::from_secs(110)..=Duration::from_secs(120)).contains(&retry_after), "{retry_after:?}");
}

#[tokio::test]
async fn unusable_retry_after_is_ignored() {
    let past = httpdate::fmt_http_date(SystemTime::now() - Duration::from_secs(60));
    for value in [past.as_str(), "soon", "-1"] {
        let result = call_with(ResponseTemplate::new(503).insert_header("Retry-After", value)).await;
        assert_eq!(
            result,
            Err(HandlerError::Transient { error: "HTTP 503".to_owned(), retry_after: None, unwell: true }),
            "Retry-After {value:?}"
        );
    }
}

#[tokio::test]
async fn a_slow_server_is_a_transient_timeout() {
    let server = MockServer::start().await;
    Mock::given(any()).respond_with(ResponseTemplate::new(200).set_delay(Duration::from_secs(30))).mount(&server).await;
    let client = webhook::client().expect("client builds");

    let result = tokio::time::timeout(
        Duration::from_secs(5),
        webhook::call(
            &client,
            post(server.uri()),
            Duration::from_millis(200),
            &Rules::default(),
            &mut Default::default(),
        ),
    )
    .await
    .expect("call honours its own timeout");

    assert_eq!(result, Err(HandlerError::unwell("timeout after 200ms", None)), "{result:?}");
}

#[tokio::test]
async fn connection_refused_is_a_transient_connect_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let address = listener.local_addr().expect("local address");
    drop(listener);
    let client = webhook::client().expect("client builds");

    let result =
        webhook::call(&client, post(format!("http://{address}/")), TIMEOUT, &Rules::default(), &mut Default::default())
            .await;

    assert_transient(&result, "connect error: ");
    let Err(error) = result else { unreachable!() };
    assert!(!error.to_string().contains(&address.to_string()), "the URL stays out of the error text: {error}");
}

#[tokio::test]
async fn method_headers_and_body_arrive_as_given() {
    let server = MockServer::start().await;
    let body = br#"{"order_id": 1234, "note": "caf\u00e9"}"#.to_vec();
    Mock::given(method("PUT"))
        .and(path("/charge/1234"))
        .and(header("idempotency-key", "order:1234:charge"))
        .and(header("x-sluice-attempt", "2"))
        .and(header("content-type", "application/json"))
        .and(body_bytes(body.clone()))
        .respond_with(ResponseTemplate::new(204))
        .expect(1)
        .mount(&server)
        .await;
    let client = webhook::client().expect("client builds");
    let request = Request {
        method: Method::PUT,
        url: format!("{}/charge/1234", server.uri()).parse().expect("a valid URL"),
        headers: vec![
            ("Idempotency-Key".to_owned(), "order:1234:charge".to_owned()),
            ("X-Sluice-Attempt".to_owned(), "2".to_owned()),
            ("Content-Type".to_owned(), "application/json".to_owned()),
        ],
        body: body.into(),
    };

    assert_eq!(webhook::call(&client, request, TIMEOUT, &Rules::default(), &mut Default::default()).await, Ok(()));
    server.verify().await;
}

#[tokio::test]
async fn signed_requests_carry_the_standard_webhooks_headers() {
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let body = br#"{"test": 2432232314}"#.to_vec();
    let server = MockServer::start().await;
    Mock::given(any()).respond_with(ResponseTemplate::new(200)).expect(1).mount(&server).await;
    let key = webhook::SigningKey::parse(secret).expect("valid secret");
    let headers = webhook::signature_headers(&[key], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1_614_265_330, &body);
    let request = Request {
        headers: headers.into_iter().map(|(name, value)| (name.to_owned(), value)).collect(),
        body: body.into(),
        ..post(server.uri())
    };
    let client = webhook::client().expect("client builds");

    assert_eq!(webhook::call(&client, request, TIMEOUT, &Rules::default(), &mut Default::default()).await, Ok(()));
    // Read back raw: wiremock's header matcher would split the signature at its comma.
    let received = server.received_requests().await.expect("recording is on");
    let [received] = received.as_slice() else {
        panic!("expected one request, got {}", received.len());
    };
    let header = |name: &str| received.headers.get(name).and_then(|v| v.to_str().ok());
    assert_eq!(header("webhook-id"), Some("msg_p5jXN8AQM9LWM0D4loKWxJek"));
    assert_eq!(header("webhook-timestamp"), Some("1614265330"));
    assert_eq!(header("webhook-signature"), Some("v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="));
}

#[tokio::test]
async fn malformed_requests_are_permanent_and_keep_values_private() {
    let server = MockServer::start().await;
    let client = webhook::client().expect("client builds");
    let with_header =
        |name: &str, value: &str| Request { headers: vec![(name.to_owned(), value.to_owned())], ..post(server.uri()) };
    let cases = [
        (post("ftp://example.com/x".to_owned()), "invalid URL"),
        (with_header("bad name", "x"), "invalid header name \"bad name\""),
        (with_header("Authorization", "Bearer s3cret\r\nX-Evil: 1"), "invalid value for header \"Authorization\""),
    ];
    for (request, expected) in cases {
        let result = webhook::call(&client, request, TIMEOUT, &Rules::default(), &mut Default::default()).await;
        assert_permanent(&result, expected);
        let Err(error) = result else { unreachable!() };
        assert!(!error.to_string().contains("s3cret"), "{error}");
    }
    assert!(server.received_requests().await.is_none_or(|requests| requests.is_empty()), "nothing was sent");
}

#[tokio::test]
async fn a_huge_error_body_is_not_read_whole() {
    // The server promises 10 MB, sends 64 KiB and then stalls: a client that buffered the
    // whole body would sit there until its timeout.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a free port");
    let address = listener.local_addr().expect("local address");
    let server = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("accept");
        let mut request = vec![0; 4096];
        let _ = stream.read(&mut request).await.expect("read request");
        let head = "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 10485760\r\n\r\n";
        stream.write_all(head.as_bytes()).await.expect("write head");
        stream.write_all(&[b'a'; 64 * 1024]).await.expect("write body");
        std::future::pending::<()>().await;
    });
    let client = webhook::client().expect("client builds");

    let result = tokio::time::timeout(
        Duration::from_secs(5),
        webhook::call(
            &client,
            post(format!("http://{address}/")),
            Duration::from_secs(60),
            &Rules::default(),
            &mut Default::default(),
        ),
    )
    .await
    .expect("call returns without waiting for the rest of the body");

    server.abort();
    assert_transient(&result, "HTTP 500: aaaa");
    let Err(error) = result else { unreachable!() };
    assert!(error.to_string().len() < 300, "{error}");
}

/// Issue 9: `.` or `..` as a value in a webhook's path walked up the path after rendering
/// (the URL parser removes dot segments, and treats `%2E` as a dot too, so escaping cannot
/// help): `/api/users/{{payload.user}}/charge` with `..` called `/api/charge`. Rendering refuses
/// such a value, so nothing is sent; dots that form no dot segment arrive as written.
#[tokio::test]
async fn a_dot_segment_value_is_refused_before_the_call() {
    let server = MockServer::start().await;
    Mock::given(any()).respond_with(ResponseTemplate::new(200)).mount(&server).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let yaml = format!(
        "version: 1\nqueues:\n  q:\n    handler:\n      webhook: {{url: \"{}/api/users/{{{{payload.user}}}}/charge\"}}\n",
        server.uri()
    );
    std::fs::write(dir.path().join("pipeline.yaml"), yaml).expect("write pipeline");
    let validation = sluice::config::load(&[dir.path().to_path_buf()]);
    let config = validation.config.unwrap_or_else(|| panic!("{:?}", validation.diagnostics));
    let queue = &config.queues["q"];
    let client = webhook::client().expect("client builds");
    let cases = [
        ("..", None),
        (".", None),
        ("u7", Some("/api/users/u7/charge")),
        ("...", Some("/api/users/.../charge")),
        ("a..b", Some("/api/users/a..b/charge")),
        ("../admin", Some("/api/users/..%2Fadmin/charge")),
        ("%2E%2E", Some("/api/users/%252E%252E/charge")),
    ];
    for (user, expected) in cases {
        let envelope = sluice::envelope::Envelope::new("t", &serde_json::json!({"user": user}), None);
        let body = bytes::Bytes::from(envelope.encode());
        let delivery = sluice::broker::Kept::standalone(body, Default::default());
        let message = sluice::format::Message::decode(queue.format, &delivery).expect("an envelope");
        let renderer = sluice::call::Renderer::new(queue, &message, 1, false).expect("payload parses");
        let key = renderer.key().expect("key");
        let call = renderer.call(&key, None);
        match (call, expected) {
            (Ok(call), Some(_)) => {
                assert_eq!(sluice::call::execute(call, &client, &mut Default::default()).await, Ok(()), "{user:?}");
            }
            (Err(error), None) => {
                let text = error.to_string();
                assert!(text.starts_with("template url: ") && text.contains("path segment"), "{user:?}: {text}");
            }
            (call, expected) => panic!("{user:?}: expected {expected:?}, got {call:?}"),
        }
    }
    let received = server.received_requests().await.expect("recording is on");
    let paths: Vec<String> = received.iter().map(|r| r.url.path().to_string()).collect();
    let expected: Vec<&str> = cases.iter().filter_map(|(_, path)| *path).collect();
    assert_eq!(paths, expected);
}
