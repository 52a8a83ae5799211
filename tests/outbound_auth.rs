//! Issue 24, outbound auth: OAuth 2.0 client-credentials tokens against a token endpoint of the
//! test (fetched once and shared, fetched again at expiry and once on a 401, a failing endpoint
//! is "receiver unwell" and never permanent), and mutual TLS against an HTTPS receiver of the
//! test that requires a client certificate from a private CA (certificates made with the
//! `openssl` CLI, which `.ci/run` installs).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use reqwest::Method;
use sluice::handler::auth::{OAuth2, SecretSource};
use sluice::handler::rules::Rules;
use sluice::handler::webhook::{self, Request};
use sluice::handler::{HandlerError, Observed};
use wiremock::matchers::{header, method, path};
use wiremock::{Mock, MockServer, Request as Seen, Respond, ResponseTemplate};

/// [`webhook::call_authorized`], what the handler answered left unlooked at.
async fn call_authorized(
    client: &reqwest::Client,
    request: Request,
    oauth2: &OAuth2,
    timeout: Duration,
    rules: &Rules,
) -> Result<(), HandlerError> {
    webhook::call_authorized(client, request, oauth2, timeout, rules, &mut Observed::default()).await
}

const TIMEOUT: Duration = Duration::from_secs(10);
const SECRET: &str = "s3cr&t=value";

/// A token endpoint answering `tok-1`, `tok-2`, ... living `expires_in` (seconds, written as
/// given: a number, a string, out of range).
struct Tokens {
    issued: AtomicUsize,
    expires_in: serde_json::Value,
}

impl Respond for Tokens {
    fn respond(&self, _: &Seen) -> ResponseTemplate {
        let n = self.issued.fetch_add(1, Ordering::SeqCst) + 1;
        ResponseTemplate::new(200).set_body_json(serde_json::json!({
            "access_token": format!("tok-{n}"),
            "token_type": "Bearer",
            "expires_in": self.expires_in,
        }))
    }
}

/// A token endpoint of tokens living `expires_in` seconds, at `/token`.
async fn token_endpoint(expires_in: impl Into<serde_json::Value>) -> MockServer {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/token"))
        .respond_with(Tokens { issued: AtomicUsize::new(0), expires_in: expires_in.into() })
        .mount(&server)
        .await;
    server
}

/// Client credentials for `endpoint`, the secret in a file (with the trailing newline an
/// editor leaves) in `dir`.
fn credentials(endpoint: &str, dir: &Path) -> OAuth2 {
    let secret = dir.join("client-secret");
    std::fs::write(&secret, format!("{SECRET}\n")).expect("write secret");
    OAuth2::new(
        format!("{endpoint}/token").parse().expect("url"),
        "sluice-test".into(),
        SecretSource::File(secret),
        vec!["orders:write".into(), "audit".into()],
        Some("https://receiver.example/".into()),
    )
}

fn post(url: String) -> Request {
    Request {
        method: Method::POST,
        url: url.parse().expect("a valid URL"),
        headers: vec![("authorization".into(), "Basic not-this".into())],
        body: bytes::Bytes::from_static(b"{}"),
    }
}

/// The `Authorization` header of each request `server` received, in order.
async fn authorizations(server: &MockServer) -> Vec<String> {
    let seen = server.received_requests().await.unwrap_or_default();
    seen.iter()
        .map(|r| r.headers.get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("").to_string())
        .collect()
}

async fn requests(server: &MockServer) -> usize {
    server.received_requests().await.unwrap_or_default().len()
}

#[tokio::test]
async fn a_token_is_fetched_once_and_shared_by_concurrent_calls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = token_endpoint(3600).await;
    let receiver = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(200)).mount(&receiver).await;
    let oauth2 = credentials(&tokens.uri(), dir.path());
    let client = webhook::client().expect("client");
    let rules = Rules::default();
    let calls = (0..8).map(|_| call_authorized(&client, post(receiver.uri()), &oauth2, TIMEOUT, &rules));
    for result in futures_util::future::join_all(calls).await {
        assert_eq!(result, Ok(()));
    }
    assert_eq!(authorizations(&receiver).await, vec!["Bearer tok-1"; 8], "the token replaces a templated one");
    let fetches = tokens.received_requests().await.unwrap_or_default();
    assert_eq!(fetches.len(), 1, "one fetch for eight concurrent calls");
    let form = String::from_utf8(fetches[0].body.clone()).expect("UTF-8");
    assert_eq!(
        form,
        "grant_type=client%5Fcredentials&client_id=sluice%2Dtest&client_secret=s3cr%26t%3Dvalue\
         &scope=orders%3Awrite%20audit&audience=https%3A%2F%2Freceiver%2Eexample%2F",
        "the secret file's trailing newline is trimmed"
    );
    let content_type = fetches[0].headers.get("content-type").and_then(|v| v.to_str().ok());
    assert_eq!(content_type, Some("application/x-www-form-urlencoded"));
}

#[tokio::test]
async fn a_token_is_fetched_again_before_it_expires() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Two seconds: fetched again after 1.8 s, a tenth of its life early.
    let tokens = token_endpoint(2).await;
    let receiver = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(200)).mount(&receiver).await;
    let oauth2 = credentials(&tokens.uri(), dir.path());
    let client = webhook::client().expect("client");
    let rules = Rules::default();
    let call = || call_authorized(&client, post(receiver.uri()), &oauth2, TIMEOUT, &rules);
    assert_eq!(call().await, Ok(()));
    assert_eq!(call().await, Ok(()));
    assert_eq!(requests(&tokens).await, 1, "a live token is reused");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while requests(&tokens).await < 2 {
        assert!(tokio::time::Instant::now() < deadline, "the token was never fetched again");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(call().await, Ok(()));
    }
    let seen = authorizations(&receiver).await;
    assert_eq!(seen.last().map(String::as_str), Some("Bearer tok-2"), "{seen:?}");
    assert!(seen.iter().all(|a| a == "Bearer tok-1" || a == "Bearer tok-2"), "{seen:?}");
}

#[tokio::test]
async fn a_401_fetches_a_new_token_once_and_sends_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = token_endpoint(3600).await;
    let receiver = MockServer::start().await;
    // The receiver has revoked tok-1 (a rotated key) and takes tok-2.
    Mock::given(header("authorization", "Bearer tok-2"))
        .respond_with(ResponseTemplate::new(200))
        .mount(&receiver)
        .await;
    Mock::given(header("authorization", "Bearer tok-1"))
        .respond_with(ResponseTemplate::new(401))
        .mount(&receiver)
        .await;
    let oauth2 = credentials(&tokens.uri(), dir.path());
    let client = webhook::client().expect("client");
    let result = call_authorized(&client, post(receiver.uri()), &oauth2, TIMEOUT, &Rules::default()).await;
    assert_eq!(result, Ok(()));
    assert_eq!(authorizations(&receiver).await, ["Bearer tok-1", "Bearer tok-2"]);
    assert_eq!(requests(&tokens).await, 2);

    // A receiver that refuses every token: one new token and one more try, then the 401
    // stands (dead-lettered as any 401 is).
    let refusing = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(401)).mount(&refusing).await;
    let result = call_authorized(&client, post(refusing.uri()), &oauth2, TIMEOUT, &Rules::default()).await;
    assert_eq!(result, Err(HandlerError::permanent("HTTP 401")));
    assert_eq!(authorizations(&refusing).await, ["Bearer tok-2", "Bearer tok-3"]);
    assert_eq!(requests(&tokens).await, 3);
}

/// Issue 31 item 15: a token of no lifetime left (`expires_in: 0`) is fetched once for the
/// calls waiting together, not once by each in turn; the next call fetches again.
#[tokio::test]
async fn concurrent_calls_share_one_fetch_of_a_token_of_no_lifetime() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = token_endpoint(0).await;
    let receiver = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(200)).mount(&receiver).await;
    let oauth2 = credentials(&tokens.uri(), dir.path());
    let client = webhook::client().expect("client");
    let rules = Rules::default();
    let calls = (0..8).map(|_| call_authorized(&client, post(receiver.uri()), &oauth2, TIMEOUT, &rules));
    for result in futures_util::future::join_all(calls).await {
        assert_eq!(result, Ok(()));
    }
    assert_eq!(requests(&tokens).await, 1, "one fetch for eight concurrent calls");
    assert_eq!(authorizations(&receiver).await, vec!["Bearer tok-1"; 8]);
    assert_eq!(call_authorized(&client, post(receiver.uri()), &oauth2, TIMEOUT, &rules).await, Ok(()));
    assert_eq!(requests(&tokens).await, 2, "a later call finds it expired");
}

/// Issue 31 items 5 and 15: `expires_in` as endpoints in the wild write it: a string (Azure
/// AD v1), a fraction, 2^63 − 1 (which panicked adding it to the clock), beyond any integer.
/// Each gives a token that serves the next call too.
#[tokio::test]
async fn expires_in_as_endpoints_write_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let receiver = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(200)).mount(&receiver).await;
    let client = webhook::client().expect("client");
    let rules = Rules::default();
    let forms = [
        serde_json::json!("3600"),
        serde_json::json!(3599.5),
        serde_json::json!(i64::MAX),
        serde_json::json!(u64::MAX),
        serde_json::json!(1e300),
    ];
    for expires_in in forms {
        let tokens = token_endpoint(expires_in.clone()).await;
        let oauth2 = credentials(&tokens.uri(), dir.path());
        for _ in 0..2 {
            let result = call_authorized(&client, post(receiver.uri()), &oauth2, TIMEOUT, &rules).await;
            assert_eq!(result, Ok(()), "expires_in {expires_in}");
        }
        assert_eq!(requests(&tokens).await, 1, "expires_in {expires_in}: the token is reused");
    }
}

/// Issue 31 item 15: a token past the old 64 KiB cap (a JWT with many claims) is taken and
/// sent whole; an answer over 1 MiB is refused as such.
#[tokio::test]
async fn large_tokens_are_taken_up_to_a_mebibyte() {
    let dir = tempfile::tempdir().expect("tempdir");
    let receiver = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(200)).mount(&receiver).await;
    let client = webhook::client().expect("client");
    let answer = |token: String| {
        ResponseTemplate::new(200).set_body_json(serde_json::json!({
            "access_token": token, "token_type": "Bearer", "expires_in": 3600,
        }))
    };
    let large = "a".repeat(100 * 1024);
    let tokens = MockServer::start().await;
    Mock::given(path("/token")).respond_with(answer(large.clone())).mount(&tokens).await;
    let oauth2 = credentials(&tokens.uri(), dir.path());
    let result = call_authorized(&client, post(receiver.uri()), &oauth2, TIMEOUT, &Rules::default()).await;
    assert_eq!(result, Ok(()));
    assert_eq!(authorizations(&receiver).await, [format!("Bearer {large}")]);

    let huge = MockServer::start().await;
    Mock::given(path("/token")).respond_with(answer("a".repeat(1024 * 1024))).mount(&huge).await;
    let oauth2 = credentials(&huge.uri(), dir.path());
    let result = call_authorized(&client, post(receiver.uri()), &oauth2, TIMEOUT, &Rules::default()).await;
    assert_eq!(
        result,
        Err(HandlerError::unwell(
            "OAuth2 token endpoint: HTTP 200: the answer is over 1 MiB, longer than any token",
            None
        ))
    );
}

/// Issue 31 item 5: a token endpoint answering `expires_in` 2^63 − 1 dead-lettered every
/// message of the queue (a panic adding it to the clock, reported as `internal`). On a real
/// runner, 200 messages are all handled with one token, none dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_expires_in_dead_letters_nothing() {
    use crate::support::{self, Place as _};
    let tokens = token_endpoint(i64::MAX).await;
    let receiver = support::Receiver::ok().await;
    let yaml = format!(
        "version: 1\nexchanges:\n  ev: {{type: topic}}\nqueues:\n  work:\n    bind: [{{exchange: ev, routing_key: \"#\"}}]\n    \
         handler:\n      webhook:\n        url: \"{}/hook\"\n        auth:\n          oauth2: {{token_url: \"{}/token\", \
         client_id: sluice-test, client_secret_env: IDP_SECRET}}\n",
        receiver.uri(),
        tokens.uri()
    );
    let dir = support::pipeline(&yaml);
    let place = support::EmbeddedDir::new();
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    for i in 0..200 {
        support::publish(&broker, "ev", "x", &format!("k{i}"), serde_json::json!({ "i": i })).await;
    }
    let _run = support::Sluice::run_with_env(dir.path(), &place.url(), &[], &[("IDP_SECRET", SECRET)]);
    let deadline = Duration::from_secs(60);
    support::wait_until(deadline, "200 messages handled or dead-lettered", || async {
        receiver.succeeded_keys().len() + place.depth("work.dlq").await as usize >= 200
    })
    .await;
    assert_eq!(place.depth("work.dlq").await, 0, "nothing dead-lettered");
    assert_eq!(receiver.succeeded_keys().len(), 200, "every message handled");
    assert!(receiver.hits().iter().all(|hit| hit.header("authorization") == Some("Bearer tok-1")));
    assert_eq!(requests(&tokens).await, 1, "one token for them all");
}

#[tokio::test]
async fn a_failing_token_endpoint_says_unwell_and_the_receiver_is_not_called() {
    let dir = tempfile::tempdir().expect("tempdir");
    let receiver = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(200)).mount(&receiver).await;
    let client = webhook::client().expect("client");
    let failing = |status: u16, body: &str| ResponseTemplate::new(status).set_body_string(body.to_string());
    let cases = [
        (Some(failing(500, "down")), "OAuth2 token endpoint: HTTP 500: down"),
        (
            Some(failing(400, r#"{"error":"invalid_client"}"#)),
            r#"OAuth2 token endpoint: HTTP 400: {"error":"invalid_client"}"#,
        ),
        (Some(failing(200, "<html>")), "OAuth2 token endpoint: HTTP 200: the answer is not a token response"),
        (None, "OAuth2 token endpoint: connect error: "),
    ];
    for (answer, expected) in cases {
        let endpoint = match answer {
            Some(answer) => {
                let server = MockServer::start().await;
                Mock::given(path("/token")).respond_with(answer).mount(&server).await;
                server.uri()
            }
            // Port 9 (discard) refuses connections.
            None => "http://127.0.0.1:9".to_string(),
        };
        let oauth2 = credentials(&endpoint, dir.path());
        let result = call_authorized(&client, post(receiver.uri()), &oauth2, TIMEOUT, &Rules::default()).await;
        match &result {
            Err(e @ HandlerError::Transient { error, .. }) if e.is_unwell() && error.starts_with(expected) => {
                assert!(!error.contains("s3cr"), "{error}");
            }
            other => panic!("expected unwell {expected:?}, got {other:?}"),
        }
    }
    assert_eq!(requests(&receiver).await, 0);
}

/// Certificates made by `openssl`: a private CA, a server certificate for 127.0.0.1 and a
/// client certificate, both signed by it; and a client certificate signed by another CA.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let pki = Pki { dir };
        for ca in ["ca", "other-ca"] {
            pki.openssl(&[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN=sluice test {ca}"),
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.pem"),
            ]);
        }
        pki.issue("server", "ca", Some("subjectAltName=IP:127.0.0.1"));
        pki.issue("client", "ca", Some("extendedKeyUsage=clientAuth"));
        pki.issue("stranger", "other-ca", Some("extendedKeyUsage=clientAuth"));
        pki
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn openssl(&self, args: &[&str]) {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .expect("openssl runs (.ci/run installs it)");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// `name.pem` and `name.key` (PKCS#8), signed by `ca`, with extension `ext`; without one,
    /// `openssl x509 -req` makes an X.509 v1 certificate.
    fn issue(&self, name: &str, ca: &str, ext: Option<&str>) {
        let (key, csr, pem) = (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"));
        self.openssl(&["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", &key]);
        self.openssl(&["req", "-new", "-key", &key, "-subj", &format!("/CN={name}"), "-out", &csr]);
        let (ca_pem, ca_key, extfile) = (format!("{ca}.pem"), format!("{ca}.key"), format!("{name}.ext"));
        let mut args =
            vec!["x509", "-req", "-in", &csr, "-CA", &ca_pem, "-CAkey", &ca_key, "-CAcreateserial", "-days", "2"];
        if let Some(ext) = ext {
            std::fs::write(self.path(&extfile), format!("{ext}\n")).expect("write ext");
            args.extend(["-extfile", &extfile]);
        }
        args.extend(["-out", &pem]);
        self.openssl(&args);
    }
}

/// An HTTPS receiver presenting the certificate `server` (`server.pem`, `server.key`), that
/// requires a client certificate issued by `ca`, answers 200 to every request, and counts the
/// requests it answered.
async fn mtls_receiver(pki: &Pki, server: &str) -> (String, Arc<AtomicUsize>) {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    sluice::install_tls_provider();
    let ca = CertificateDer::from_pem_file(pki.path("ca.pem")).expect("CA");
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).expect("root");
    let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots)).build().expect("verifier");
    let chain = vec![CertificateDer::from_pem_file(pki.path(&format!("{server}.pem"))).expect("server cert")];
    let key = PrivateKeyDer::from_pem_file(pki.path(&format!("{server}.key"))).expect("server key");
    let config = rustls::ServerConfig::builder()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("https://127.0.0.1:{}/hook", listener.local_addr().expect("address").port());
    let answered = Arc::new(AtomicUsize::new(0));
    let count = answered.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, count) = (acceptor.clone(), count.clone());
            tokio::spawn(async move {
                // A refused handshake ends here: the client sees its error.
                let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                count.fetch_add(1, Ordering::SeqCst);
                let _ = tls.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await;
                let _ = tls.shutdown().await;
            });
        }
    });
    (url, answered)
}

/// The webhook client a pipeline's `tls:` block makes, as `sluice run` builds it.
fn client_from_pipeline(pki: &Pki, tls: &str) -> reqwest::Client {
    let yaml = format!(
        "version: 1\nqueues:\n  work:\n    handler:\n      webhook:\n        url: https://127.0.0.1/hook\n        tls: {tls}\n"
    );
    std::fs::write(pki.path("p.yaml"), yaml).expect("write");
    let validation = sluice::config::load(&[pki.path("p.yaml")]);
    let config = validation.config.unwrap_or_else(|| panic!("{tls}: {:?}", validation.diagnostics));
    match &config.queues["work"].handler {
        sluice::config::Handler::Webhook(w) => w.tls.as_ref().and_then(|t| t.client.clone()).expect("a client"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn mutual_tls_with_a_private_ca() {
    let pki = Pki::new();
    let (url, answered) = mtls_receiver(&pki, "server").await;
    let call = |client: reqwest::Client| {
        let url = url.clone();
        async move {
            let request = Request {
                method: Method::POST,
                url: url.parse().expect("url"),
                headers: Vec::new(),
                body: bytes::Bytes::new(),
            };
            webhook::call(&client, request, TIMEOUT, &Rules::default(), &mut Observed::default()).await
        }
    };
    let ours =
        client_from_pipeline(&pki, "{client_cert_file: client.pem, client_key_file: client.key, ca_file: ca.pem}");
    assert_eq!(call(ours).await, Ok(()), "the right certificate is accepted");
    assert_eq!(answered.load(Ordering::SeqCst), 1);

    let unwell = |result: Result<(), HandlerError>, what: &str| match result {
        Err(e @ HandlerError::Transient { .. }) if e.is_unwell() => {}
        other => panic!("{what}: expected a refused connection, got {other:?}"),
    };
    let anonymous = client_from_pipeline(&pki, "{ca_file: ca.pem}");
    unwell(call(anonymous).await, "no client certificate");
    let stranger =
        client_from_pipeline(&pki, "{client_cert_file: stranger.pem, client_key_file: stranger.key, ca_file: ca.pem}");
    unwell(call(stranger).await, "a certificate of another CA");
    let shared = webhook::client().expect("client");
    unwell(call(shared).await, "the private CA is not trusted without ca_file");
    assert_eq!(answered.load(Ordering::SeqCst), 1, "only the right certificate got an answer");
}

/// The diagnostics of a pipeline whose webhook has the `tls:` block `tls`, as `validate` shows
/// them (pointer and message).
fn tls_diagnostics(pki: &Pki, tls: &str) -> Vec<String> {
    let yaml = format!(
        "version: 1\nqueues:\n  work:\n    handler:\n      webhook:\n        url: https://127.0.0.1/hook\n        tls: {tls}\n"
    );
    std::fs::write(pki.path("p.yaml"), yaml).expect("write");
    let validation = sluice::config::load(&[pki.path("p.yaml")]);
    validation
        .diagnostics
        .iter()
        .map(|d| format!("{} {}: {}", crate::util::severity_name(d.severity), d.pointer, d.message))
        .collect()
}

/// Issue 31 item 21: a client certificate the receiver will refuse, or a key that is not the
/// certificate's, is a `validate` error at its setting saying what is wrong and how to fix it,
/// in words, not in Rust's Debug form.
#[test]
fn tls_files_that_cannot_work_are_explained_at_validate() {
    let pki = Pki::new();
    pki.issue("old", "ca", None);
    pki.issue("server-only", "ca", Some("extendedKeyUsage=serverAuth"));
    let base = "/queues/work/handler/webhook/tls";
    let cases = [
        (
            "{client_cert_file: old.pem, client_key_file: old.key}",
            format!(
                "error {base}/client_cert_file: the client certificate is X.509 version 1; receivers refuse it: \
                 issue a version 3 certificate with extendedKeyUsage=clientAuth \
                 (openssl x509 -req ... -extfile with the line \"extendedKeyUsage=clientAuth\")"
            ),
        ),
        (
            "{client_cert_file: server-only.pem, client_key_file: server-only.key}",
            format!(
                "error {base}/client_cert_file: the client certificate's extendedKeyUsage does not allow client \
                 authentication (clientAuth); receivers refuse it: issue it with extendedKeyUsage=clientAuth"
            ),
        ),
        (
            "{client_cert_file: client.pem, client_key_file: stranger.key}",
            format!(
                "error {base}/client_key_file: the key is not the one of the certificate in client_cert_file \
                 (its public key does not match): give the private key the certificate was issued for"
            ),
        ),
    ];
    for (tls, expected) in cases {
        let shown = tls_diagnostics(&pki, tls);
        assert_eq!(shown, [expected], "{tls}");
        assert!(!shown.iter().any(|d| d.contains("Mismatch") || d.contains("Unsupported") || d.contains("(Other")));
    }
    assert_eq!(
        tls_diagnostics(&pki, "{client_cert_file: client.pem, client_key_file: client.key, ca_file: ca.pem}"),
        Vec::<String>::new()
    );
}

/// Issue 31 item 21: at call time a refused handshake says, in words, which side refused what
/// and how to fix it: a client certificate the receiver refused or that it requires, a
/// receiver's certificate of an unknown CA or of X.509 version 1.
#[tokio::test]
async fn tls_refusals_at_call_time_are_explained() {
    let pki = Pki::new();
    pki.issue("old-server", "ca", None);
    let (url, _) = mtls_receiver(&pki, "server").await;
    // rustls will not serve an X.509 v1 certificate; OpenSSL will.
    let port = crate::support::free_port();
    let _old_server = Killed(
        std::process::Command::new("openssl")
            .args(["s_server", "-quiet", "-www", "-accept", &format!("127.0.0.1:{port}"), "-cert", "old-server.pem"])
            .args(["-key", "old-server.key"])
            .current_dir(pki.dir.path())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("openssl s_server runs"),
    );
    let old_url = format!("https://127.0.0.1:{port}/hook");
    crate::support::wait_until(Duration::from_secs(10), "openssl s_server listening", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok()
    })
    .await;
    let call = |client: reqwest::Client, url: &str| {
        let request = Request {
            method: Method::POST,
            url: url.parse().expect("url"),
            headers: Vec::new(),
            body: bytes::Bytes::new(),
        };
        async move { webhook::call(&client, request, TIMEOUT, &Rules::default(), &mut Observed::default()).await }
    };
    let stranger = "{client_cert_file: stranger.pem, client_key_file: stranger.key, ca_file: ca.pem}";
    let cases = [
        (
            client_from_pipeline(&pki, stranger),
            &url,
            "TLS handshake: the receiver does not trust the CA that issued the client certificate \
             (TLS alert \"unknown CA\"): use one issued by a CA the receiver trusts",
        ),
        (
            client_from_pipeline(&pki, "{ca_file: ca.pem}"),
            &url,
            "TLS handshake: the receiver requires a client certificate (TLS alert \"certificate required\"): \
             set tls.client_cert_file and tls.client_key_file",
        ),
        (
            webhook::client().expect("client"),
            &url,
            "TLS handshake: the receiver's certificate is refused here: it is not issued by a CA trusted here; \
             for a private CA, give the CA's certificate in tls.ca_file",
        ),
        (
            client_from_pipeline(&pki, "{ca_file: ca.pem}"),
            &old_url,
            "TLS handshake: the receiver's certificate is refused here: it is X.509 version 1; the receiver \
             needs a version 3 certificate (with subjectAltName)",
        ),
    ];
    for (client, url, expected) in cases {
        match call(client, url).await {
            Err(e @ HandlerError::Transient { .. }) if e.is_unwell() => {
                assert_eq!(e, HandlerError::unwell(expected, None));
            }
            other => panic!("{expected}: expected a refused handshake, got {other:?}"),
        }
    }
}

/// A child process killed and reaped when dropped, however the test ends.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Extra environment variables of a command.
type Env<'a> = &'a [(&'a str, &'a str)];

/// `$SLUICE_BROKER_FILE` and `$SLUICE_DEDUP_FILE` hold URLs with passwords: the file's URL is
/// used (trailing newline trimmed; here two nodes, so `validate` speaks of a cluster), given
/// beside the flag or the variable it is a usage error, an unreadable file an error naming it,
/// and the password is printed nowhere (`--help` included).
#[test]
fn broker_and_dedup_urls_from_files() {
    use crate::support::sluice_cli;
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = "version: 1\nqueues:\n  jobs:\n    type: classic\n    handler: {command: {program: /bin/true}}\n";
    std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
    let pipelines = dir.path().to_str().expect("UTF-8 path");
    let broker_file = dir.path().join("broker-url");
    std::fs::write(&broker_file, "amqp://u:hunter2@rabbit-1:5672/%2f,amqp://u:hunter2@rabbit-2:5672/%2f\n")
        .expect("write");
    let dedup_file = dir.path().join("dedup-url");
    std::fs::write(&dedup_file, "redis://default:hunter2@127.0.0.1:1/0\n").expect("write");
    let (broker_file, dedup_file) = (broker_file.to_str().expect("UTF-8"), dedup_file.to_str().expect("UTF-8"));
    let deadline = Duration::from_secs(30);

    let used = sluice_cli(&["validate", pipelines], &[("SLUICE_BROKER_FILE", broker_file)], deadline);
    assert_eq!(used.code, Some(0), "{used:?}");
    assert!(used.stdout.contains("is a classic queue, which lives on one node of a cluster"), "{used:?}");

    // Arguments, environment, what the error says.
    let conflicts: [(&[&str], Env, &str); 3] = [
        (
            &["validate", "--broker", "amqp://rabbit:5672/%2f", pipelines],
            &[("SLUICE_BROKER_FILE", broker_file)],
            "--broker and $SLUICE_BROKER_FILE are both given",
        ),
        (
            &["validate", pipelines],
            &[("SLUICE_BROKER_FILE", broker_file), ("SLUICE_BROKER", "amqp://rabbit:5672/%2f")],
            "$SLUICE_BROKER_FILE and $SLUICE_BROKER are both set",
        ),
        (
            &["run", "--dedup", "redis://127.0.0.1:6379", pipelines],
            &[("SLUICE_DEDUP_FILE", dedup_file)],
            "--dedup and $SLUICE_DEDUP_FILE are both given",
        ),
    ];
    for (args, env, expected) in conflicts {
        let both = sluice_cli(args, env, deadline);
        assert_eq!(both.code, Some(2), "{args:?}: {both:?}");
        assert!(both.stderr.contains(expected), "{args:?}: {both:?}");
    }

    let missing = dir.path().join("absent");
    let unreadable =
        sluice_cli(&["validate", pipelines], &[("SLUICE_BROKER_FILE", missing.to_str().expect("UTF-8"))], deadline);
    assert_eq!(unreadable.code, Some(1), "{unreadable:?}");
    assert!(
        unreadable.stderr.contains(&format!("$SLUICE_BROKER_FILE: cannot read secret file {}", missing.display())),
        "{unreadable:?}"
    );

    // The dedup file's Redis refuses the connection: run stops, naming it without the password.
    let state = dir.path().join("state");
    let run = sluice_cli(
        &["run", "--broker", state.to_str().expect("UTF-8"), "--no-watch", pipelines],
        &[("SLUICE_DEDUP_FILE", dedup_file)],
        deadline,
    );
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(run.stderr.contains("idempotency store"), "{run:?}");
    let help = sluice_cli(
        &["run", "--help"],
        &[("SLUICE_DEDUP_FILE", dedup_file), ("SLUICE_BROKER_FILE", broker_file)],
        deadline,
    );
    for shown in [&used, &unreadable, &run, &help] {
        assert!(!format!("{}{}", shown.stdout, shown.stderr).contains("hunter2"), "{shown:?}");
    }
}
