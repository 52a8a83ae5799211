//! Webhook handler: sends one rendered HTTP request, classifies the response by DESIGN's
//! Outcomes table and the queue's `on_status` rules, and signs bodies with Standard Webhooks
//! signatures.
//!
//! It must not follow redirects (a 3xx is a permanent failure), buffer an unbounded
//! response body, or put URLs, header values or signing secrets into error texts: rendered
//! URLs and headers may carry tokens.

use std::time::{Duration, SystemTime};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac as _};
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use reqwest::{Method, Url};
use sha2::Sha256;
use tokio::time::{Instant, timeout_at};

use super::auth::OAuth2;
use super::http::{cause, read_bounded, send_error, tls_error};
use super::rules::{Action, Rules, Verdict};
use super::{HandlerError, Observed, head_excerpt};

/// How long establishing a TCP (and TLS) connection may take before it counts as a connect error.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an unused keep-alive connection stays in the pool.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Idle connections kept per host: enough to serve a queue's full concurrency without reconnecting.
const POOL_MAX_IDLE_PER_HOST: usize = 64;
/// The most of a response body ever read: enough to quote an error, small enough to ignore abuse.
const MAX_BODY_BYTES: usize = 4 * 1024;

/// The shared HTTP client could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot build the HTTP client (TLS backend initialisation failed)")]
pub struct ClientError(#[source] reqwest::Error);

/// Builds the HTTP client all webhooks share, so connections stay warm across messages.
pub fn client() -> Result<reqwest::Client, ClientError> {
    builder().build().map_err(ClientError)
}

/// The certificates a webhook's own client presents and trusts, as PEM (`tls:`).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct TlsPem {
    /// The client certificate chain and its private key, for mutual TLS.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// Certificate authorities trusted beside the system's (a private CA).
    pub ca: Option<Vec<u8>>,
}

impl std::fmt::Debug for TlsPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsPem").field("identity", &self.identity.is_some()).field("ca", &self.ca.is_some()).finish()
    }
}

/// Why a webhook's TLS settings cannot make a client; never quotes the files.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("client_cert_file and client_key_file make no client identity: {0}")]
    Identity(String),
    /// The client certificate is one receivers refuse (what is wrong and how to fix it).
    #[error("{0}")]
    Certificate(String),
    /// The client key is not the client certificate's.
    #[error("{0}")]
    Key(String),
    #[error("ca_file: {0}")]
    Ca(String),
    #[error("{0}")]
    Client(String),
}

/// A client of its own for a webhook with `tls:` settings: the shared client's behaviour, plus
/// the client certificate it presents and the CAs it trusts.
pub fn tls_client(pem: &TlsPem) -> Result<reqwest::Client, TlsError> {
    let mut builder = builder();
    if let Some((cert, key)) = &pem.identity {
        check_client_certificate(cert)?;
        let mut both = cert.clone();
        both.push(b'\n');
        both.extend_from_slice(key);
        let identity = reqwest::Identity::from_pem(&both).map_err(|e| TlsError::Identity(cause(&e)))?;
        builder = builder.identity(identity);
    }
    if let Some(ca) = &pem.ca {
        let certs = reqwest::Certificate::from_pem_bundle(ca).map_err(|e| TlsError::Ca(cause(&e)))?;
        if certs.is_empty() {
            return Err(TlsError::Ca("no PEM certificate in it".into()));
        }
        builder = builder.tls_certs_merge(certs);
    }
    builder.build().map_err(|e| match tls_error(&e) {
        Some(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => TlsError::Key(
            "the key is not the one of the certificate in client_cert_file (its public key does not match): \
             give the private key the certificate was issued for"
                .into(),
        ),
        _ => TlsError::Client(cause(&e)),
    })
}

/// Refuses a client certificate that receivers refuse, saying how to issue one they take: rustls
/// (and so sluice itself) takes only X.509 version 3, and a receiver checks that an
/// `extendedKeyUsage`, when there is one, allows client authentication. What cannot be read is
/// left to the PEM and rustls checks that follow, which say so.
fn check_client_certificate(pem: &[u8]) -> Result<(), TlsError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let Some(Ok(leaf)) = CertificateDer::pem_slice_iter(pem).next() else { return Ok(()) };
    let Ok((_, certificate)) = x509_parser::parse_x509_certificate(&leaf) else { return Ok(()) };
    let version = certificate.version();
    if version != x509_parser::x509::X509Version::V3 {
        return Err(TlsError::Certificate(format!(
            "the client certificate is X.509 version {}; receivers refuse it: issue a version 3 certificate \
             with extendedKeyUsage=clientAuth (openssl x509 -req ... -extfile with the line \"extendedKeyUsage=clientAuth\")",
            version.0.saturating_add(1)
        )));
    }
    match certificate.extended_key_usage() {
        Ok(Some(usage)) if !usage.value.client_auth => Err(TlsError::Certificate(
            "the client certificate's extendedKeyUsage does not allow client authentication (clientAuth); \
             receivers refuse it: issue it with extendedKeyUsage=clientAuth"
                .into(),
        )),
        _ => Ok(()),
    }
}

/// The settings every webhook client has.
fn builder() -> reqwest::ClientBuilder {
    crate::install_tls_provider();
    reqwest::Client::builder()
        .tls_backend_rustls()
        .user_agent(concat!("sluice/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(CONNECT_TIMEOUT)
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_max_idle_per_host(POOL_MAX_IDLE_PER_HOST)
        .tcp_nodelay(true)
        .redirect(reqwest::redirect::Policy::none())
}

/// A fully rendered HTTP request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// HTTP method.
    pub method: Method,
    /// Absolute `http` or `https` URL.
    pub url: Url,
    /// Header names and values, sent in this order; a repeated name is sent repeatedly.
    pub headers: Vec<(String, String)>,
    /// Request body, sent as is (often the delivery's own bytes, shared rather than copied).
    pub body: bytes::Bytes,
}

/// Sends `request` and classifies the response by `on_status`; `timeout` bounds the whole
/// exchange. Failures without a response (connect errors, timeouts) are always retried. The
/// response's status and the start of its body go into `observed`.
pub async fn call(
    client: &reqwest::Client,
    request: Request,
    timeout: Duration,
    on_status: &Rules,
    observed: &mut Observed,
) -> Result<(), HandlerError> {
    let deadline = Instant::now() + timeout;
    exchange(client, request, None, deadline, timeout).await?.outcome(on_status, observed)
}

/// [`call`] with an OAuth 2.0 bearer token: the queue's cached one, or one fetched first. A 401
/// answer fetches a new token once and sends the request again; `timeout` bounds it all.
pub async fn call_authorized(
    client: &reqwest::Client,
    request: Request,
    oauth2: &OAuth2,
    timeout: Duration,
    on_status: &Rules,
    observed: &mut Observed,
) -> Result<(), HandlerError> {
    let deadline = Instant::now() + timeout;
    let in_time = |result: Result<Result<HeaderValue, HandlerError>, _>| match result {
        Err(_elapsed) => Err(HandlerError::timeout(timeout)),
        Ok(token) => token,
    };
    let token = in_time(timeout_at(deadline, oauth2.bearer(client)).await)?;
    let answer = exchange(client, request.clone(), Some(&token), deadline, timeout).await?;
    if answer.status != 401 {
        return answer.outcome(on_status, observed);
    }
    let token = in_time(timeout_at(deadline, oauth2.refresh(client, &token)).await)?;
    exchange(client, request, Some(&token), deadline, timeout).await?.outcome(on_status, observed)
}

/// What came back for a request.
struct Answer {
    status: u16,
    retry_after: Option<Duration>,
    /// The start of the body, for quoting.
    body: Vec<u8>,
}

impl Answer {
    /// The call's verdict; the status and the start of the body go into `observed`.
    fn outcome(self, on_status: &Rules, observed: &mut Observed) -> Result<(), HandlerError> {
        observed.http_status = Some(self.status);
        observed.keep(&self.body);
        outcome(self.status, on_status, self.retry_after, &self.body)
    }
}

/// Sends `request` (with `authorization`, when given) and reads the answer before `deadline`.
async fn exchange(
    client: &reqwest::Client,
    request: Request,
    authorization: Option<&HeaderValue>,
    deadline: Instant,
    timeout: Duration,
) -> Result<Answer, HandlerError> {
    let request = build(client, request, authorization)?;
    let mut response = match timeout_at(deadline, client.execute(request)).await {
        Err(_elapsed) => return Err(HandlerError::timeout(timeout)),
        Ok(Err(error)) => return Err(send_error(&error)),
        Ok(Ok(response)) => response,
    };
    let status = response.status();
    let retry_after = response
        .headers()
        .get(RETRY_AFTER)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| parse_retry_after(value, SystemTime::now()));

    // Reading the body even on success lets a small response finish, so the connection
    // goes back to the pool; a timeout or error here cannot change the status's verdict.
    let mut body = Vec::new();
    let _ = timeout_at(deadline, read_bounded(&mut response, &mut body, MAX_BODY_BYTES)).await;
    drop(response);
    Ok(Answer { status: status.as_u16(), retry_after, body })
}

/// How a response ends a call: by its status, through the queue's `on_status` rules or
/// DESIGN's Outcomes table; a failure quotes the start of `body`. `sluice test` classifies its
/// simulated responses here too.
pub(crate) fn outcome(
    status: u16,
    on_status: &Rules,
    retry_after: Option<Duration>,
    body: &[u8],
) -> Result<(), HandlerError> {
    classify(status, on_status)
        .result(format!("HTTP {status}"), "on_status", || head_excerpt(body), retry_after)
        .map_err(|e| e.with_unwell(says_unwell(status)))
}

/// Turns the rendered parts into a request, rejecting what no retry could fix.
fn build(
    client: &reqwest::Client,
    request: Request,
    authorization: Option<&HeaderValue>,
) -> Result<reqwest::Request, HandlerError> {
    let url = request.url;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(HandlerError::permanent(format!("invalid URL: scheme \"{}\" is not http or https", url.scheme())));
    }
    let mut headers = HeaderMap::with_capacity(request.headers.len());
    for (name, value) in &request.headers {
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| HandlerError::permanent(format!("invalid header name \"{name}\"")))?;
        // The value may be a credential, so the error names only the header.
        let value = HeaderValue::from_bytes(value.as_bytes())
            .map_err(|_| HandlerError::permanent(format!("invalid value for header \"{name}\"")))?;
        headers.append(header, value);
    }
    if let Some(value) = authorization {
        headers.insert(AUTHORIZATION, value.clone());
    }
    client
        .request(request.method, url)
        .headers(headers)
        .body(request.body)
        .build()
        .map_err(|error| HandlerError::permanent(format!("invalid request: {}", cause(&error))))
}

/// What a response status means: the `on_status` rule for it (its own, else its class's),
/// else DESIGN's Outcomes table. The one place statuses are classified, for `run` and
/// `sluice test` alike.
pub(crate) fn classify(status: u16, on_status: &Rules) -> Verdict {
    if let Some((key, action)) = on_status.find(status) {
        return Verdict { action, rule: Some(key) };
    }
    Verdict::default_is(match status {
        200..=299 => Action::Success,
        408 | 425 | 429 | 500..=599 => Action::Retry,
        // Other 4xx and 3xx, and 1xx, which reqwest never returns as a final response.
        _ => Action::DeadLetter,
    })
}

/// Statuses that say the receiver (or what stands in front of it) is overloaded or down,
/// rather than that this one request failed.
fn says_unwell(status: u16) -> bool {
    matches!(status, 429 | 502 | 503 | 504)
}

/// Parses `Retry-After` (delta-seconds or an HTTP-date); a date already past is no hint.
fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    at.duration_since(now).ok()
}

/// A Standard Webhooks secret could not be used; messages never quote the secret itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SigningError {
    /// The secret lacks the `whsec_` prefix.
    #[error("webhook signing secret does not start with \"whsec_\"")]
    MissingPrefix,
    /// What follows `whsec_` is not standard base64.
    #[error("webhook signing secret is not valid base64 after \"whsec_\"")]
    InvalidBase64,
    /// What follows `whsec_` decodes to no key at all.
    #[error("webhook signing secret has an empty key after \"whsec_\"")]
    EmptyKey,
}

/// The HMAC key of a Standard Webhooks secret. Its `Debug` shows no byte of it.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningKey(Vec<u8>);

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningKey(***)")
    }
}

impl SigningKey {
    /// The key of a Standard Webhooks secret: `whsec_` + base64 of a non-empty key.
    pub fn parse(secret: &str) -> Result<SigningKey, SigningError> {
        let encoded = secret.strip_prefix("whsec_").ok_or(SigningError::MissingPrefix)?;
        // The decode error is dropped on purpose: it quotes the offending byte of the secret.
        let key = BASE64.decode(encoded).map_err(|_| SigningError::InvalidBase64)?;
        if key.is_empty() {
            return Err(SigningError::EmptyKey);
        }
        Ok(SigningKey(key))
    }

    /// The key's raw bytes, for telling whether a reload changed it (never for printing).
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// The secrets of a secrets file, with their 1-based line numbers: one a line, surrounding
/// white space trimmed, blank lines and lines starting with `#` skipped.
pub fn secrets_in(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, line)| (i + 1, line.trim()))
        .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'))
}

/// Signs a webhook the Standard Webhooks way: `v1,` + base64 HMAC-SHA256 of `id.timestamp.body`.
pub fn sign(key: &SigningKey, msg_id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(&key.0).expect("HMAC accepts keys of any length");
    mac.update(msg_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
}

/// The three Standard Webhooks headers: `webhook-id`, `webhook-timestamp`, and
/// `webhook-signature` with one signature per key, space-separated, so that a receiver
/// holding any one of the keys verifies (a secret rotated with no window of failures).
pub fn signature_headers(
    keys: &[SigningKey],
    msg_id: &str,
    timestamp: i64,
    body: &[u8],
) -> [(&'static str, String); 3] {
    let signatures: Vec<String> = keys.iter().map(|key| sign(key, msg_id, timestamp, body)).collect();
    [
        ("webhook-id", msg_id.to_owned()),
        ("webhook-timestamp", timestamp.to_string()),
        ("webhook-signature", signatures.join(" ")),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const MSG_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TIMESTAMP: i64 = 1_614_265_330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;

    /// With ring the one crypto provider (built alone, installed by `client`), an https call
    /// reaches a TLS handshake: against a server that answers in plain HTTP it fails as a
    /// connection error, where a missing provider would panic.
    #[tokio::test]
    async fn https_calls_reach_a_tls_handshake() {
        use tokio::io::AsyncWriteExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("address").port();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
            }
        });
        let client = client().expect("client");
        let error = client.get(format!("https://127.0.0.1:{port}/")).send().await.expect_err("not TLS");
        assert!(error.is_connect(), "{error:?}");
    }

    fn key(secret: &str) -> SigningKey {
        SigningKey::parse(secret).expect("valid secret")
    }

    #[test]
    fn signature_matches_the_standard_webhooks_test_vector() {
        assert_eq!(sign(&key(SECRET), MSG_ID, TIMESTAMP, BODY), "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn signature_headers_carry_id_timestamp_and_signature() {
        let headers = signature_headers(&[key(SECRET)], MSG_ID, TIMESTAMP, BODY);
        assert_eq!(
            headers,
            [
                ("webhook-id", MSG_ID.to_owned()),
                ("webhook-timestamp", "1614265330".to_owned()),
                ("webhook-signature", "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=".to_owned()),
            ]
        );
    }

    #[test]
    fn bad_secrets_are_named_but_never_quoted() {
        let cases = [
            ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", SigningError::MissingPrefix),
            ("whsec_not-base64!", SigningError::InvalidBase64),
            ("whsec_", SigningError::EmptyKey),
        ];
        for (secret, expected) in cases {
            let error = SigningKey::parse(secret).expect_err(secret);
            assert_eq!(error, expected, "secret {secret:?}");
            let key = secret.trim_start_matches("whsec_");
            if !key.is_empty() {
                assert!(!error.to_string().contains(key), "{error}");
            }
        }
    }

    /// Issue 24: one signature per secret, space-separated, in the order the secrets are
    /// given, so that a receiver holding either the old or the new secret verifies.
    #[test]
    fn several_secrets_sign_once_each() {
        let other = "whsec_c2Vjb25kIHNlY3JldCBmb3Igcm90YXRpb24=";
        let [_, _, (_, signature)] = signature_headers(&[key(SECRET), key(other)], MSG_ID, TIMESTAMP, BODY);
        let expected =
            format!("{} {}", sign(&key(SECRET), MSG_ID, TIMESTAMP, BODY), sign(&key(other), MSG_ID, TIMESTAMP, BODY));
        assert_eq!(signature, expected);
        assert!(signature.starts_with("v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE= v1,"), "{signature}");
    }

    #[test]
    fn secrets_files_hold_one_secret_a_line() {
        let text = "# rotated 2026-12-01\n  whsec_b2xk  \n\n\twhsec_bmV3\n";
        assert_eq!(secrets_in(text).collect::<Vec<_>>(), [(2, "whsec_b2xk"), (4, "whsec_bmV3")]);
        assert_eq!(format!("{:?}", key("whsec_bmV3")), "SigningKey(***)");
    }

    #[test]
    fn statuses_are_classified_as_designed() {
        use Action::{DeadLetter, Retry, Success};
        let cases = [
            (100, DeadLetter),
            (200, Success),
            (201, Success),
            (204, Success),
            (301, DeadLetter),
            (304, DeadLetter),
            (400, DeadLetter),
            (404, DeadLetter),
            (408, Retry),
            (409, DeadLetter),
            (422, DeadLetter),
            (425, Retry),
            (429, Retry),
            (500, Retry),
            (503, Retry),
            (599, Retry),
        ];
        for (status, action) in cases {
            assert_eq!(classify(status, &Rules::default()), Verdict::default_is(action), "status {status}");
        }
    }

    #[test]
    fn on_status_rules_override_the_table_exact_codes_first() {
        use super::super::rules::Key::{Class, Code};
        use Action::{DeadLetter, Retry, Success};
        let rules = Rules::new(std::collections::BTreeMap::from([
            (Code(404), DeadLetter),
            (Code(409), Success),
            (Class(4), Retry),
            (Class(3), Success),
            (Class(5), DeadLetter),
            (Code(503), Retry),
            (Code(202), Retry),
        ]));
        let ruled = |action, key| Verdict { action, rule: Some(key) };
        let cases = [
            // An exact code beats its class, whichever way.
            (404, ruled(DeadLetter, Code(404))),
            (503, ruled(Retry, Code(503))),
            // Exact codes and classes against the defaults.
            (409, ruled(Success, Code(409))),
            (202, ruled(Retry, Code(202))),
            (422, ruled(Retry, Class(4))),
            (429, ruled(Retry, Class(4))),
            (302, ruled(Success, Class(3))),
            (500, ruled(DeadLetter, Class(5))),
            // No rule: the table.
            (200, Verdict::default_is(Success)),
            (101, Verdict::default_is(DeadLetter)),
        ];
        for (status, expected) in cases {
            assert_eq!(classify(status, &rules), expected, "status {status}");
        }
    }

    /// Issue 13: only statuses that say the receiver is unwell feed the circuit breaker; a
    /// 4xx for one bad message, or a 500 from one that crashed its handler, does not.
    #[test]
    fn unwell_statuses_are_overload_and_gateway_failures() {
        for code in [200, 400, 404, 408, 422, 425, 500, 501, 505, 599] {
            assert!(!says_unwell(code), "status {code}");
        }
        for code in [429, 502, 503, 504] {
            assert!(says_unwell(code), "status {code}");
        }
    }

    #[test]
    fn retry_after_accepts_seconds_and_future_dates_only() {
        let now = httpdate::parse_http_date("Sun, 29 Nov 2026 12:00:00 GMT").expect("valid date");
        let cases = [
            ("7", Some(Duration::from_secs(7))),
            (" 120 ", Some(Duration::from_secs(120))),
            ("0", Some(Duration::ZERO)),
            ("Sun, 29 Nov 2026 12:01:30 GMT", Some(Duration::from_secs(90))),
            ("Sun, 29 Nov 2026 11:59:00 GMT", None),
            ("-5", None),
            ("1.5", None),
            ("soon", None),
            ("", None),
        ];
        for (value, expected) in cases {
            assert_eq!(parse_retry_after(value, now), expected, "value {value:?}");
        }
    }
}
