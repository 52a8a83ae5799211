//! The AWS request layer under the SQS broker: one action of SQS's JSON protocol per call
//! (`POST /`, `X-Amz-Target: AmazonSQS.ACTION`), signed with SigV4 by `aws-sigv4` and sent with
//! the crate's reqwest (rustls on ring), and the credentials the AWS SDKs find, in their order:
//! the environment, the shared files' profile (static keys, `credential_process`, web identity),
//! web identity (Kubernetes IRSA), the ECS (or EKS Pod Identity) agent, EC2 instance metadata.
//!
//! A call is tried again only when SQS certainly did not apply it (throttled, or never sent
//! because no connection opened): anything else, a timeout above all, goes back to the caller,
//! who alone knows whether doing it twice is harmless. The chain is read at the first call
//! and kept; credentials that expire are fetched again 5 minutes before, by one call at a
//! time, the others using the ones still valid meanwhile.
//!
//! It knows nothing of queues, messages or sluice's names: that is the broker's (`super`). No
//! secret (secret key, session token, web identity or container token) ever reaches an error,
//! a log line or `Debug`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
use aws_sigv4::sign::v4;
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::Url;
use serde_json::Value;

use crate::broker::kit::lock;
use crate::terminal::visible;

/// How long opening a connection to SQS may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one request may take, answer included: above ReceiveMessage's longest poll (20 s).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Tries of one call, when the earlier ones were certainly not applied.
const TRIES: u32 = 3;
/// The longest wait between two tries (full jitter below it).
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// The most of an answer read: ten messages of 256 KiB with their attributes fit many times.
const MAX_ANSWER_BYTES: usize = 16 << 20;
/// The most of a credential endpoint's answer read.
const MAX_CREDENTIALS_ANSWER_BYTES: usize = 64 << 10;
/// The most of a shared config or credentials file read.
const MAX_PROFILE_FILE_BYTES: u64 = 1 << 20;
/// Credentials are fetched again this long before they expire.
const REFRESH_BEFORE: Duration = Duration::from_secs(5 * 60);
/// Each request to EC2's instance metadata: a machine off EC2 gives up fast.
const INSTANCE_TIMEOUT: Duration = Duration::from_secs(1);
/// Each request to the ECS (or EKS Pod Identity) agent.
const CONTAINER_TIMEOUT: Duration = Duration::from_secs(5);
/// An STS request.
const STS_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a `credential_process` may run.
const PROCESS_TIMEOUT: Duration = Duration::from_secs(60);
/// The ECS agent, for `AWS_CONTAINER_CREDENTIALS_RELATIVE_URI`.
const ECS_AGENT: &str = "http://169.254.170.2";
/// EC2's instance metadata service.
const INSTANCE_METADATA: &str = "http://169.254.169.254";
/// The session name of a role assumed with a web identity, unless `AWS_ROLE_SESSION_NAME` says.
const SESSION_NAME: &str = "sluice";
/// Throttling error codes: SQS refused the request before doing anything.
const THROTTLED: &[&str] = &[
    "ThrottlingException",
    "Throttling",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "SlowDown",
    "KmsThrottled",
];

/// What a form value or a path segment may hold unescaped: RFC 3986's unreserved characters.
const UNRESERVED: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// How the credential chain reads the environment: the process's in [`Aws::new`], a map in
/// tests (which run in parallel and must not change the process's), or the process's with
/// values of a `--broker-file` laid over it.
pub type Env = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// A signed JSON-protocol client of one AWS service endpoint (SQS here).
#[derive(Clone)]
pub struct Aws {
    inner: Arc<Inner>,
}

struct Inner {
    region: String,
    endpoint: Url,
    http: reqwest::Client,
    chain: Chain,
}

impl fmt::Debug for Aws {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Aws")
            .field("region", &self.inner.region)
            .field("endpoint", &self.inner.endpoint.as_str())
            .finish_non_exhaustive()
    }
}

/// A call that failed.
#[derive(Debug)]
pub enum AwsError {
    /// The service answered with an error: its code (short form, e.g. "QueueDoesNotExist",
    /// whether it came as the JSON `__type` or the `x-amzn-query-error` header), its message
    /// and the HTTP status.
    Service { action: String, code: String, message: String, status: u16 },
    /// No answer (connection refused, timeout, reset) or one that cannot be read: the request
    /// may or may not have been applied.
    Transport(String),
    /// No credentials found, or they could not be fetched: says what was tried, in order, and
    /// why each failed.
    Credentials(String),
    /// The region or endpoint given cannot be used (or no HTTP client could be built).
    Config(String),
}

impl fmt::Display for AwsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AwsError::Service { action, code, message, status } => {
                write!(f, "SQS {action} failed: {} (HTTP {status})", visible(code))?;
                match message.is_empty() {
                    true => Ok(()),
                    false => write!(f, ": {}", visible(message)),
                }
            }
            AwsError::Transport(why) | AwsError::Credentials(why) | AwsError::Config(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for AwsError {}

impl AwsError {
    /// Whether the service refused the request for its rate: it did nothing.
    fn throttled(&self) -> bool {
        match self {
            AwsError::Service { code, status, .. } => *status == 429 || THROTTLED.contains(&code.as_str()),
            _ => false,
        }
    }
}

/// A call that failed, and whether it certainly was not applied (so trying again is safe).
struct Failed {
    error: AwsError,
    unapplied: bool,
}

impl From<AwsError> for Failed {
    fn from(error: AwsError) -> Failed {
        Failed { unapplied: error.throttled(), error }
    }
}

impl Aws {
    /// A client of SQS in `region` (e.g. "us-east-1"); `endpoint` overrides
    /// `https://sqs.{region}.amazonaws.com` (an emulator, a VPC endpoint), as do
    /// `AWS_ENDPOINT_URL_SQS` and `AWS_ENDPOINT_URL` when it is not given. Credentials come
    /// from the process's environment and files, read at the first call.
    pub fn new(region: &str, endpoint: Option<&str>) -> Result<Aws, AwsError> {
        Aws::with_env(region, endpoint, Arc::new(|name: &str| std::env::var(name).ok()))
    }

    /// [`Aws::new`] with the environment read through `env`.
    pub fn with_env(region: &str, endpoint: Option<&str>, env: Env) -> Result<Aws, AwsError> {
        if region.is_empty() || !region.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-') {
            return Err(AwsError::Config(format!(
                "\"{}\" is not an AWS region: lower-case letters, digits and dashes, like us-east-1",
                visible(region)
            )));
        }
        let configured = endpoint
            .map(str::to_string)
            .or_else(|| var(&env, "AWS_ENDPOINT_URL_SQS"))
            .or_else(|| var(&env, "AWS_ENDPOINT_URL"));
        let endpoint = match configured {
            Some(endpoint) => parse_endpoint(&endpoint)?,
            None => parse_endpoint(&service_url("sqs", region))?,
        };
        let client = |builder: reqwest::ClientBuilder| {
            builder
                .build()
                .map_err(|e| AwsError::Config(format!("cannot build the HTTP client for SQS: {}", causes(&e))))
        };
        let http = client(http_client().timeout(REQUEST_TIMEOUT))?;
        // The metadata services are link-local: never through a proxy.
        let metadata = client(http_client().connect_timeout(INSTANCE_TIMEOUT).no_proxy())?;
        let chain = Chain {
            env,
            region: region.to_string(),
            http: http.clone(),
            metadata,
            current: Mutex::new(None),
            source: tokio::sync::Mutex::new(None),
        };
        Ok(Aws { inner: Arc::new(Inner { region: region.to_string(), endpoint, http, chain }) })
    }

    /// The endpoint requests go to.
    pub fn endpoint(&self) -> &str {
        self.inner.endpoint.as_str()
    }

    /// Calls `action` (e.g. "SendMessageBatch") of the SQS JSON protocol with `input`, signed
    /// with SigV4 (service "sqs"), and returns the answer's JSON (`{}` for an empty one). Tried
    /// up to 3 times, with full-jitter backoff, only while SQS certainly did not apply it.
    pub async fn call(&self, action: &str, input: &Value) -> Result<Value, AwsError> {
        let body = input.to_string().into_bytes();
        let mut tries = 0;
        loop {
            tries += 1;
            match self.once(action, &body).await {
                Ok(answer) => return Ok(answer),
                Err(Failed { error, unapplied: true }) if tries < TRIES => {
                    tracing::debug!(action, tries, %error, "SQS did not apply the request; trying again");
                    let wait = crate::broker::failover::reconnect_delay(tries + 2, MAX_BACKOFF, &mut rand::rng());
                    tokio::time::sleep(wait).await;
                }
                Err(Failed { error, .. }) => return Err(error),
            }
        }
    }

    /// One try of `action`.
    async fn once(&self, action: &str, body: &[u8]) -> Result<Value, Failed> {
        let inner = &*self.inner;
        let credentials =
            inner.chain.credentials().await.map_err(|why| AwsError::Credentials(format!("SQS {action}: {why}")))?;
        let target = format!("AmazonSQS.{action}");
        let headers = [("content-type", "application/x-amz-json-1.0"), ("x-amz-target", target.as_str())];
        let signed = sign_request(&credentials, &inner.region, inner.endpoint.as_str(), &headers, body)
            .map_err(|why| AwsError::Credentials(format!("SQS {action}: cannot sign the request: {why}")))?;
        let mut request = inner.http.post(inner.endpoint.clone()).body(body.to_vec());
        for (name, value) in headers.iter().copied().chain(signed.iter().map(|(n, v)| (n.as_str(), v.as_str()))) {
            request = request.header(name, value);
        }
        let endpoint = inner.endpoint.as_str();
        let response = request.send().await.map_err(|e| Failed {
            unapplied: e.is_connect(),
            error: AwsError::Transport(match e.is_connect() {
                true => format!("SQS {action}: cannot connect to {endpoint}: {} (not sent)", causes(&e)),
                false => no_answer(action, endpoint, &causes(&e)),
            }),
        })?;
        let status = response.status().as_u16();
        let query_error =
            response.headers().get("x-amzn-query-error").and_then(|v| v.to_str().ok()).map(str::to_string);
        let answer = read_answer(response, MAX_ANSWER_BYTES)
            .await
            .map_err(|why| AwsError::Transport(no_answer(action, endpoint, &why)))?;
        if (200..300).contains(&status) {
            if answer.iter().all(u8::is_ascii_whitespace) {
                return Ok(Value::Object(Default::default()));
            }
            return serde_json::from_slice(&answer).map_err(|e| {
                Failed::from(AwsError::Transport(format!(
                    "SQS {action}: {endpoint} answered HTTP {status} with what is not JSON ({e}): {}",
                    excerpt(&answer)
                )))
            });
        }
        let (code, message) = service_error(&answer, query_error.as_deref());
        Err(Failed::from(AwsError::Service { action: action.to_string(), code, message, status }))
    }
}

/// The text of a request that got no (readable) answer.
fn no_answer(action: &str, endpoint: &str, why: &str) -> String {
    format!("SQS {action}: no answer from {endpoint}: {why}; the request may or may not have been applied")
}

/// The settings of every HTTP client here.
fn http_client() -> reqwest::ClientBuilder {
    crate::install_tls_provider();
    reqwest::Client::builder()
        .tls_backend_rustls()
        .user_agent(concat!("sluice/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .redirect(reqwest::redirect::Policy::none())
}

/// `https://SERVICE.REGION.amazonaws.com` (`.com.cn` in the China regions).
fn service_url(service: &str, region: &str) -> String {
    let domain = if region.starts_with("cn-") { "amazonaws.com.cn" } else { "amazonaws.com" };
    format!("https://{service}.{region}.{domain}")
}

/// An endpoint: an `http` or `https` URL with a host and no credentials, query or fragment.
fn parse_endpoint(text: &str) -> Result<Url, AwsError> {
    let bad = |why: &str| AwsError::Config(format!("endpoint \"{}\": {why}", visible(text)));
    let url = Url::parse(text).map_err(|e| bad(&format!("not a URL ({e})")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad("not an http:// or https:// URL"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    if !url.username().is_empty() || url.password().is_some() || url.query().is_some() || url.fragment().is_some() {
        return Err(bad("a user, a query or a fragment has no place in it"));
    }
    Ok(url)
}

/// The SigV4 headers (`authorization`, `x-amz-date`, and `x-amz-security-token` with a
/// session token) of a POST of `body` to `url` with `headers`.
fn sign_request(
    credentials: &Credentials,
    region: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Vec<(String, String)>, String> {
    let identity = aws_credential_types::Credentials::new(
        &credentials.access_key_id,
        &credentials.secret_access_key,
        credentials.session_token.clone(),
        credentials.expires,
        "sluice",
    )
    .into();
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name("sqs")
        .time(SystemTime::now())
        .settings(SigningSettings::default())
        .build()
        .map_err(|e| e.to_string())?
        .into();
    let request = SignableRequest::new("POST", url, headers.iter().copied(), SignableBody::Bytes(body))
        .map_err(|e| e.to_string())?;
    let (instructions, _signature) = sign(request, &params).map_err(|e| e.to_string())?.into_parts();
    Ok(instructions.headers().map(|(name, value)| (name.to_string(), value.to_string())).collect())
}

/// The code and message of an error answer: the code from the JSON `__type`
/// ("com.amazonaws.sqs#QueueDoesNotExist"), else from the `x-amzn-query-error` header
/// ("AWS.SimpleQueueService.NonExistentQueue;Sender"), in the short form of the JSON protocol.
fn service_error(answer: &[u8], query_error: Option<&str>) -> (String, String) {
    let json: Option<Value> = serde_json::from_slice(answer).ok();
    let field = |name: &str| json.as_ref().and_then(|j| j.get(name)).and_then(Value::as_str);
    let from_type = field("__type").or_else(|| field("code")).map(|t| {
        // "namespace#Code:extra" (the extra is a redirect's URL, which smithy says to drop).
        let code = t.rsplit('#').next().unwrap_or(t);
        code.split(':').next().unwrap_or(code).to_string()
    });
    let from_header = query_error.and_then(|h| h.split(';').next()).map(str::trim).filter(|c| !c.is_empty());
    let code =
        from_type.filter(|c| !c.is_empty()).or_else(|| from_header.map(short_code)).unwrap_or_else(|| "Unknown".into());
    let message = match field("message").or_else(|| field("Message")) {
        Some(message) => message.to_string(),
        None if json.is_some() => String::new(),
        None => excerpt(answer),
    };
    (code, message)
}

/// The JSON protocol's name of an error code of SQS's query protocol.
fn short_code(code: &str) -> String {
    let code = code.strip_prefix("AWS.SimpleQueueService.").unwrap_or(code);
    match code {
        "NonExistentQueue" => "QueueDoesNotExist",
        "QueueAlreadyExists" => "QueueNameExists",
        other => other,
    }
    .to_string()
}

/// The start of `bytes` as one short line, safe for a terminal.
fn excerpt(bytes: &[u8]) -> String {
    const MOST: usize = 200;
    let text = String::from_utf8_lossy(bytes).split_whitespace().collect::<Vec<_>>().join(" ");
    let cut = match text.len() > MOST {
        true => format!("{}…", &text[..text.floor_char_boundary(MOST)]),
        false => text,
    };
    visible(&cut).into_owned()
}

/// What went wrong under a reqwest error, innermost last ("client error (Connect): tcp connect
/// error: Connection refused (os error 111)"), without its URL.
fn causes(error: &reqwest::Error) -> String {
    let mut parts = Vec::new();
    let mut next = std::error::Error::source(error);
    while let Some(source) = next {
        parts.push(source.to_string());
        next = source.source();
    }
    match parts.is_empty() {
        true if error.is_timeout() => "timed out".into(),
        true => error.to_string(),
        false => parts.join(": "),
    }
}

/// The whole body of `response`, at most `limit` bytes.
async fn read_answer(mut response: reqwest::Response, limit: usize) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| causes(&e))? {
        if body.len() + chunk.len() > limit {
            return Err(format!("the answer is longer than {limit} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// A set of AWS credentials; `Debug` shows the access key id only.
#[derive(Clone, PartialEq)]
struct Credentials {
    access_key_id: String,
    secret_access_key: String,
    session_token: Option<String>,
    /// None: they never expire (keys given outright).
    expires: Option<SystemTime>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"** redacted **")
            .field("session_token", &self.session_token.as_ref().map(|_| "** redacted **"))
            .field("expires", &self.expires.map(humantime::format_rfc3339_seconds))
            .finish()
    }
}

impl Credentials {
    /// Whether they are to be fetched again: they expire within [`REFRESH_BEFORE`].
    fn due(&self, now: SystemTime) -> bool {
        self.expires.is_some_and(|at| at <= now + REFRESH_BEFORE)
    }

    /// Whether they can no longer be used.
    fn expired(&self, now: SystemTime) -> bool {
        self.expires.is_some_and(|at| at <= now)
    }
}

/// Where the chain found credentials: the first of its sources that is configured.
#[derive(Debug, Clone, PartialEq)]
enum Source {
    /// Keys given outright: in the environment, or in a profile.
    Static { origin: String, credentials: Credentials },
    /// A profile's `credential_process`: a program that prints them.
    Process { profile: String, command: String },
    /// A role assumed with a web identity token (a Kubernetes service account's, IRSA), by
    /// STS `AssumeRoleWithWebIdentity`; the token file is read again at each refresh.
    WebIdentity { origin: String, token_file: PathBuf, role_arn: String, session_name: String },
    /// The ECS agent (or EKS Pod Identity's), at `url`.
    Container { url: String, token: Option<ContainerToken> },
    /// EC2's instance metadata service (IMDSv2).
    Instance { endpoint: String },
}

/// The `Authorization` a container agent wants.
#[derive(Clone, PartialEq)]
enum ContainerToken {
    /// `AWS_CONTAINER_AUTHORIZATION_TOKEN`.
    Value(String),
    /// `AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`, read at each fetch (it is rotated).
    File(PathBuf),
}

impl fmt::Debug for ContainerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ContainerToken::Value(_) => f.write_str("Value(** redacted **)"),
            ContainerToken::File(path) => f.debug_tuple("File").field(path).finish(),
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Static { origin, .. } => f.write_str(origin),
            Source::Process { profile, .. } => write!(f, "the credential_process of profile '{profile}'"),
            Source::WebIdentity { origin, role_arn, .. } => write!(f, "web identity ({origin}, role {role_arn})"),
            Source::Container { url, .. } => write!(f, "the container credentials at {url}"),
            Source::Instance { endpoint } => write!(f, "EC2 instance metadata at {endpoint}"),
        }
    }
}

/// A source found, and what the chain passed over before it (for the error when even the
/// last resort, the instance metadata, has nothing).
struct Found {
    source: Source,
    passed: Vec<String>,
}

/// Credentials in use, numbered by the refresh that fetched them.
struct Current {
    credentials: Credentials,
    refresh: u64,
}

/// The credential chain: found once, its credentials kept and fetched again before expiry.
struct Chain {
    env: Env,
    region: String,
    /// For STS (through a proxy where one is set).
    http: reqwest::Client,
    /// For the link-local metadata services.
    metadata: reqwest::Client,
    /// The credentials in use, read without waiting on a refresh.
    current: Mutex<Option<Current>>,
    /// The source found (kept once found), held by the one refresh under way.
    source: tokio::sync::Mutex<Option<Found>>,
}

impl Chain {
    /// Credentials for a request: the ones in use while they are not due; else fetched again
    /// by this call, or by the one already fetching (which this call waits for only when the
    /// ones in use have expired).
    async fn credentials(&self) -> Result<Credentials, String> {
        let now = SystemTime::now();
        let (seen, valid) = match &*lock(&self.current) {
            Some(current) if !current.credentials.due(now) => return Ok(current.credentials.clone()),
            Some(current) => {
                (current.refresh, (!current.credentials.expired(now)).then(|| current.credentials.clone()))
            }
            None => (0, None),
        };
        let mut found = match (self.source.try_lock(), &valid) {
            (Ok(found), _) => found,
            (Err(_), Some(valid)) => return Ok(valid.clone()),
            (Err(_), None) => self.source.lock().await,
        };
        if let Some(current) = &*lock(&self.current)
            && current.refresh != seen
            && !current.credentials.expired(SystemTime::now())
        {
            // Fetched by the call this one waited for.
            return Ok(current.credentials.clone());
        }
        match self.refresh(&mut found).await {
            Ok(fresh) => {
                let mut current = lock(&self.current);
                let refresh = current.as_ref().map_or(0, |c| c.refresh) + 1;
                *current = Some(Current { credentials: fresh.clone(), refresh });
                Ok(fresh)
            }
            Err(why) => match valid {
                Some(valid) => {
                    tracing::warn!(error = %why, "could not fetch new AWS credentials; using the current ones until they expire");
                    Ok(valid)
                }
                None => Err(why),
            },
        }
    }

    /// Finds the source (the first time) and fetches credentials from it.
    async fn refresh(&self, found: &mut Option<Found>) -> Result<Credentials, String> {
        let found = match found {
            Some(found) => found,
            None => found.insert(resolve(&self.env).map_err(|why| format!("AWS credentials: {why}"))?),
        };
        self.fetch(&found.source).await.map_err(|why| match found.source {
            Source::Instance { .. } => {
                let mut tried = found.passed.clone();
                tried.push(format!("{}: {why}", found.source));
                nothing_found(&tried)
            }
            _ => format!("AWS credentials from {}: {why}", found.source),
        })
    }

    async fn fetch(&self, source: &Source) -> Result<Credentials, String> {
        match source {
            Source::Static { credentials, .. } => Ok(credentials.clone()),
            Source::Process { command, .. } => process_credentials(command).await,
            Source::WebIdentity { token_file, role_arn, session_name, .. } => {
                self.web_identity(token_file, role_arn, session_name).await
            }
            Source::Container { url, token } => self.container(url, token.as_ref()).await,
            Source::Instance { endpoint } => self.instance(endpoint).await,
        }
    }

    /// STS `AssumeRoleWithWebIdentity` (query protocol, unsigned: the token is the proof).
    async fn web_identity(&self, token_file: &Path, role_arn: &str, session_name: &str) -> Result<Credentials, String> {
        let token = crate::secret::read_secret_file(token_file).map_err(|e| e.to_string())?;
        let endpoint = var(&self.env, "AWS_ENDPOINT_URL_STS")
            .or_else(|| var(&self.env, "AWS_ENDPOINT_URL"))
            .unwrap_or_else(|| service_url("sts", &self.region));
        let form: Vec<String> = [
            ("Action", "AssumeRoleWithWebIdentity"),
            ("Version", "2011-06-15"),
            ("RoleArn", role_arn),
            ("RoleSessionName", session_name),
            ("WebIdentityToken", &token),
        ]
        .iter()
        .map(|(name, value)| format!("{name}={}", utf8_percent_encode(value, UNRESERVED)))
        .collect();
        let response = self
            .http
            .post(&endpoint)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form.join("&"))
            .timeout(STS_TIMEOUT)
            .send()
            .await
            .map_err(|e| format!("no answer from STS at {endpoint}: {}", causes(&e)))?;
        let status = response.status().as_u16();
        let answer = read_answer(response, MAX_CREDENTIALS_ANSWER_BYTES)
            .await
            .map_err(|why| format!("no answer from STS at {endpoint}: {why}"))?;
        let xml = String::from_utf8_lossy(&answer);
        if !(200..300).contains(&status) {
            let code = xml_tag(&xml, "Code").unwrap_or_else(|| "Unknown".into());
            let message = xml_tag(&xml, "Message").unwrap_or_else(|| excerpt(&answer));
            return Err(format!(
                "STS AssumeRoleWithWebIdentity at {endpoint} refused: {} (HTTP {status}): {}",
                visible(&code),
                visible(&message)
            ));
        }
        let credentials = xml_section(&xml, "Credentials")
            .ok_or_else(|| format!("STS at {endpoint} answered without <Credentials>: {}", excerpt(&answer)))?;
        let field = |name: &str| {
            xml_tag(credentials, name).ok_or_else(|| format!("STS at {endpoint} answered credentials without <{name}>"))
        };
        let expiration = field("Expiration")?;
        Ok(Credentials {
            access_key_id: field("AccessKeyId")?,
            secret_access_key: field("SecretAccessKey")?,
            session_token: Some(field("SessionToken")?),
            expires: Some(parse_time(&expiration).ok_or_else(|| {
                format!("STS at {endpoint} answered an Expiration that is no time: \"{}\"", visible(&expiration))
            })?),
        })
    }

    /// The ECS (or EKS Pod Identity) agent's credentials.
    async fn container(&self, url: &str, token: Option<&ContainerToken>) -> Result<Credentials, String> {
        let mut request = self.metadata.get(url).timeout(CONTAINER_TIMEOUT);
        match token {
            Some(ContainerToken::Value(token)) => request = request.header("authorization", token),
            Some(ContainerToken::File(path)) => {
                let token = crate::secret::read_secret_file(path).map_err(|e| e.to_string())?;
                request = request.header("authorization", token);
            }
            None => {}
        }
        let answer = metadata_answer(request).await?;
        served_credentials(&answer)
    }

    /// EC2's instance metadata (IMDSv2): a session token, the instance profile's role, its
    /// credentials.
    async fn instance(&self, endpoint: &str) -> Result<Credentials, String> {
        let base = endpoint.trim_end_matches('/');
        let token = self
            .metadata
            .put(format!("{base}/latest/api/token"))
            .header("x-aws-ec2-metadata-token-ttl-seconds", "21600")
            .timeout(INSTANCE_TIMEOUT);
        let token = String::from_utf8(metadata_answer(token).await?)
            .map_err(|_| "the metadata session token is not text".to_string())?;
        let get = |path: String| {
            self.metadata
                .get(format!("{base}{path}"))
                .header("x-aws-ec2-metadata-token", token.trim())
                .timeout(INSTANCE_TIMEOUT)
        };
        let roles = metadata_answer(get("/latest/meta-data/iam/security-credentials/".into()))
            .await
            .map_err(|why| format!("no IAM role (instance profile) is attached to this instance? {why}"))?;
        let roles = String::from_utf8_lossy(&roles);
        let role = roles
            .lines()
            .map(str::trim)
            .find(|line| !line.is_empty())
            .ok_or("no IAM role (instance profile) is attached to this instance")?;
        let path = format!("/latest/meta-data/iam/security-credentials/{}", utf8_percent_encode(role, UNRESERVED));
        served_credentials(&metadata_answer(get(path)).await?)
    }
}

/// The body of a metadata service's successful answer, or why there is none.
async fn metadata_answer(request: reqwest::RequestBuilder) -> Result<Vec<u8>, String> {
    let response = request.send().await.map_err(|e| format!("no answer: {}", causes(&e)))?;
    let status = response.status().as_u16();
    let answer =
        read_answer(response, MAX_CREDENTIALS_ANSWER_BYTES).await.map_err(|why| format!("no answer: {why}"))?;
    match status {
        200..300 => Ok(answer),
        _ => Err(format!("HTTP {status}: {}", excerpt(&answer))),
    }
}

/// Credentials in the JSON the container agents, the instance metadata and credential
/// processes print (`AccessKeyId`, `SecretAccessKey`, `Token` or `SessionToken`,
/// `Expiration`). Read field by field, so no error ever quotes a value.
fn served_credentials(answer: &[u8]) -> Result<Credentials, String> {
    let json: Value = serde_json::from_slice(answer).map_err(|_| "the answer is not JSON".to_string())?;
    let field = |name: &str| json.get(name).and_then(Value::as_str).filter(|v| !v.is_empty()).map(str::to_string);
    if let Some(code) = field("Code").filter(|code| code != "Success") {
        let message = field("Message").or_else(|| field("message")).unwrap_or_default();
        return Err(format!("the answer says {}: {}", visible(&code), visible(&message)));
    }
    let required = |name: &str| field(name).ok_or_else(|| format!("the answer has no {name}"));
    let expires = match field("Expiration") {
        Some(text) => Some(parse_time(&text).ok_or_else(|| format!("Expiration \"{}\" is no time", visible(&text)))?),
        None => None,
    };
    Ok(Credentials {
        access_key_id: required("AccessKeyId")?,
        secret_access_key: required("SecretAccessKey")?,
        session_token: field("Token").or_else(|| field("SessionToken")),
        expires,
    })
}

/// Runs a profile's `credential_process` (split into words as the AWS CLI does, quotes kept
/// together; never through a shell) in the runner's environment, and reads what it prints.
async fn process_credentials(command: &str) -> Result<Credentials, String> {
    use crate::handler::command::{Invocation, Stdin, run};
    let mut words = split_command(command)?.into_iter();
    let program = words.next().ok_or("credential_process is empty")?;
    let invocation = Invocation {
        program: PathBuf::from(program),
        args: words.collect(),
        // The runner's whole environment, as the SDKs give it (a helper may need its own variables).
        env: std::env::vars_os()
            .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
            .collect(),
        stdin: Stdin::Null,
        timeout: PROCESS_TIMEOUT,
        permanent_exit_codes: Vec::new(),
        on_exit: Default::default(),
    };
    let output = run(&invocation, &mut Default::default()).await.map_err(|e| format!("the program failed: {e}"))?;
    let json: Value =
        serde_json::from_slice(&output.stdout).map_err(|_| "the program did not print a JSON object".to_string())?;
    match json.get("Version").and_then(Value::as_u64) {
        Some(1) => served_credentials(&output.stdout),
        _ => Err("the program printed no \"Version\": 1, the only version there is".into()),
    }
}

/// `command` as words: split at whitespace, except inside double or single quotes.
fn split_command(command: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quote = None;
    for c in command.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.get_or_insert_default().push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                word.get_or_insert_default();
            }
            (None, c) if c.is_whitespace() => words.extend(word.take()),
            (None, c) => word.get_or_insert_default().push(c),
        }
    }
    if quote.is_some() {
        return Err("credential_process has a quote that is not closed".into());
    }
    words.extend(word);
    Ok(words)
}

/// The text of the first `<name>…</name>`, its XML escapes decoded.
fn xml_tag(xml: &str, name: &str) -> Option<String> {
    xml_section(xml, name).map(|text| {
        text.trim()
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&amp;", "&")
    })
}

/// What stands between the first `<name>` and the `</name>` after it.
fn xml_section<'a>(xml: &'a str, name: &str) -> Option<&'a str> {
    let open = format!("<{name}>");
    let start = xml.find(&open)? + open.len();
    let end = xml[start..].find(&format!("</{name}>"))?;
    Some(&xml[start..start + end])
}

/// An RFC 3339 time: UTC (`Z`, or no zone) or with an offset (`+01:00`).
fn parse_time(text: &str) -> Option<SystemTime> {
    let text = text.trim();
    let zoned = text.len().checked_sub(6).and_then(|at| text.get(at..).map(|zone| (&text[..at], zone)));
    let offset = zoned.and_then(|(time, zone)| {
        let sign = match zone.as_bytes() {
            [b'+', _, _, b':', _, _] => 1,
            [b'-', _, _, b':', _, _] => -1,
            _ => return None,
        };
        let seconds = zone[1..3].parse::<u64>().ok()? * 3600 + zone[4..].parse::<u64>().ok()? * 60;
        Some((time, sign, Duration::from_secs(seconds)))
    });
    match offset {
        // Local time = UTC + offset.
        Some((time, 1, offset)) => humantime::parse_rfc3339_weak(time).ok()?.checked_sub(offset),
        Some((time, _, offset)) => humantime::parse_rfc3339_weak(time).ok()?.checked_add(offset),
        None => humantime::parse_rfc3339_weak(text.trim_end_matches(['Z', 'z'])).ok(),
    }
}

/// The environment variable `name`, unless unset or empty (which the SDKs take as unset).
fn var(env: &Env, name: &str) -> Option<String> {
    env(name).filter(|value| !value.is_empty())
}

/// The error when no source had credentials: what each said, in order.
fn nothing_found(tried: &[String]) -> String {
    let listed: Vec<String> = tried.iter().enumerate().map(|(i, note)| format!("{}) {note}", i + 1)).collect();
    format!("no AWS credentials found; tried, in order: {}", listed.join("; "))
}

/// The first source of the chain that is configured, in the SDKs' order. Reads the shared
/// files, nothing else: what the source gives is fetched later.
fn resolve(env: &Env) -> Result<Found, String> {
    let mut passed = Vec::new();
    let found = |source, passed| Ok(Found { source, passed });

    // 1. The environment.
    match (var(env, "AWS_ACCESS_KEY_ID"), var(env, "AWS_SECRET_ACCESS_KEY")) {
        (Some(access_key_id), Some(secret_access_key)) => {
            let credentials = Credentials {
                access_key_id,
                secret_access_key,
                session_token: var(env, "AWS_SESSION_TOKEN"),
                expires: None,
            };
            return found(Source::Static { origin: "the environment (AWS_ACCESS_KEY_ID)".into(), credentials }, passed);
        }
        (Some(_), None) => return Err("AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not".into()),
        (None, Some(_)) => return Err("AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not".into()),
        (None, None) => passed.push("the environment: AWS_ACCESS_KEY_ID is not set".into()),
    }

    // 2. The shared files' profile.
    let files = SharedFiles::read(env)?;
    let explicit = var(env, "AWS_PROFILE");
    let name = explicit.clone().unwrap_or_else(|| "default".into());
    match files.profile(&name) {
        None if explicit.is_some() => {
            return Err(format!("AWS_PROFILE names profile '{name}', which is in neither {}", files.describe()));
        }
        None => passed.push(format!("the shared files: no profile '{name}' in {}", files.describe())),
        Some(settings) => match profile_source(&name, &settings)? {
            Some(source) => return found(source, passed),
            None => passed.push(format!("the shared files: profile '{name}' has no credentials")),
        },
    }

    // 3. Web identity (Kubernetes IRSA).
    match (var(env, "AWS_WEB_IDENTITY_TOKEN_FILE"), var(env, "AWS_ROLE_ARN")) {
        (Some(token_file), Some(role_arn)) => {
            let source = Source::WebIdentity {
                origin: "AWS_WEB_IDENTITY_TOKEN_FILE".into(),
                token_file: token_file.into(),
                role_arn,
                session_name: var(env, "AWS_ROLE_SESSION_NAME").unwrap_or_else(|| SESSION_NAME.into()),
            };
            return found(source, passed);
        }
        (Some(_), None) => return Err("AWS_WEB_IDENTITY_TOKEN_FILE is set but AWS_ROLE_ARN is not".into()),
        (None, _) => passed.push("web identity: AWS_WEB_IDENTITY_TOKEN_FILE is not set".into()),
    }

    // 4. The ECS (or EKS Pod Identity) agent.
    let url = match (var(env, "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"), var(env, "AWS_CONTAINER_CREDENTIALS_FULL_URI"))
    {
        (Some(relative), _) => Some(format!("{ECS_AGENT}{relative}")),
        (None, Some(full)) => Some(container_url(&full)?),
        (None, None) => None,
    };
    match url {
        Some(url) => {
            let token = match (var(env, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"), var(env, "AWS_CONTAINER_AUTHORIZATION_TOKEN")) {
                (Some(file), _) => Some(ContainerToken::File(file.into())),
                (None, Some(token)) => Some(ContainerToken::Value(token)),
                (None, None) => None,
            };
            return found(Source::Container { url, token }, passed);
        }
        None => passed.push(
            "container credentials: AWS_CONTAINER_CREDENTIALS_RELATIVE_URI and AWS_CONTAINER_CREDENTIALS_FULL_URI are not set"
                .into(),
        ),
    }

    // 5. EC2 instance metadata.
    if var(env, "AWS_EC2_METADATA_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        passed.push("EC2 instance metadata: disabled by AWS_EC2_METADATA_DISABLED".into());
        return Err(nothing_found(&passed));
    }
    let endpoint = var(env, "AWS_EC2_METADATA_SERVICE_ENDPOINT").unwrap_or_else(|| INSTANCE_METADATA.into());
    found(Source::Instance { endpoint }, passed)
}

/// `AWS_CONTAINER_CREDENTIALS_FULL_URI`, if the SDKs would send a token there: `https`, or
/// `http` to the loopback or the ECS or EKS agents' link-local addresses.
fn container_url(full: &str) -> Result<String, String> {
    let url = Url::parse(full)
        .map_err(|e| format!("AWS_CONTAINER_CREDENTIALS_FULL_URI \"{}\" is not a URL ({e})", visible(full)))?;
    let host = url.host_str().unwrap_or_default();
    let loopback_or_agent = match host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() {
        Ok(ip) => {
            ip.is_loopback() || ["169.254.170.2", "169.254.170.23", "fd00:ec2::23"].iter().any(|a| a.parse() == Ok(ip))
        }
        Err(_) => host == "localhost",
    };
    let allowed = match url.scheme() {
        "https" => !host.is_empty(),
        "http" => loopback_or_agent,
        _ => false,
    };
    match allowed {
        true => Ok(full.to_string()),
        false => Err(format!(
            "AWS_CONTAINER_CREDENTIALS_FULL_URI \"{}\" must be https://, or http:// to the loopback, 169.254.170.2, \
             169.254.170.23 or fd00:ec2::23",
            visible(full)
        )),
    }
}

/// What a profile's settings say to use: a role with a web identity, a `credential_process`
/// or keys; None when they hold no credentials; an error for what sluice does not support.
fn profile_source(name: &str, settings: &BTreeMap<String, String>) -> Result<Option<Source>, String> {
    let get = |key: &str| settings.get(key).filter(|v| !v.is_empty()).cloned();
    if let Some(role_arn) = get("role_arn") {
        let Some(token_file) = get("web_identity_token_file") else {
            return Err(format!(
                "profile '{name}' sets role_arn (with source_profile or credential_source: STS AssumeRole), which \
                 sluice does not support; give it the role's credentials another way: a credential_process such as \
                 `aws configure export-credentials --profile {name} --format process`, or the environment"
            ));
        };
        return Ok(Some(Source::WebIdentity {
            origin: format!("profile '{name}'"),
            token_file: token_file.into(),
            role_arn,
            session_name: get("role_session_name").unwrap_or_else(|| SESSION_NAME.into()),
        }));
    }
    if get("sso_session").is_some() || get("sso_start_url").is_some() {
        return Err(format!(
            "profile '{name}' uses IAM Identity Center (sso_session or sso_start_url), which sluice does not support; \
             set credential_process = aws configure export-credentials --profile {name} --format process \
             in a profile of its own and name that one"
        ));
    }
    if let Some(command) = get("credential_process") {
        return Ok(Some(Source::Process { profile: name.to_string(), command }));
    }
    match (get("aws_access_key_id"), get("aws_secret_access_key")) {
        (Some(access_key_id), Some(secret_access_key)) => Ok(Some(Source::Static {
            origin: format!("profile '{name}' of the shared files"),
            credentials: Credentials {
                access_key_id,
                secret_access_key,
                session_token: get("aws_session_token"),
                expires: None,
            },
        })),
        (Some(_), None) => Err(format!("profile '{name}' sets aws_access_key_id but not aws_secret_access_key")),
        (None, Some(_)) => Err(format!("profile '{name}' sets aws_secret_access_key but not aws_access_key_id")),
        (None, None) => Ok(None),
    }
}

/// Settings by profile name.
type Profiles = BTreeMap<String, BTreeMap<String, String>>;

/// The shared credentials and config files, read.
struct SharedFiles {
    credentials: (Option<PathBuf>, Option<Profiles>),
    config: (Option<PathBuf>, Option<Profiles>),
}

impl SharedFiles {
    /// `AWS_SHARED_CREDENTIALS_FILE` (default `~/.aws/credentials`) and `AWS_CONFIG_FILE`
    /// (`~/.aws/config`); a file that does not exist holds no profile.
    fn read(env: &Env) -> Result<SharedFiles, String> {
        let home = var(env, "HOME");
        let path = |variable: &str, default: &str| {
            let path = var(env, variable).or_else(|| home.as_ref().map(|_| format!("~/.aws/{default}")))?;
            Some(match (path.strip_prefix("~/"), &home) {
                (Some(rest), Some(home)) => Path::new(home).join(rest),
                _ => PathBuf::from(path),
            })
        };
        let credentials = path("AWS_SHARED_CREDENTIALS_FILE", "credentials");
        let config = path("AWS_CONFIG_FILE", "config");
        let load = |path: &Option<PathBuf>, config: bool| -> Result<Option<Profiles>, String> {
            let Some(path) = path else { return Ok(None) };
            match crate::file::read_regular(path, MAX_PROFILE_FILE_BYTES) {
                Ok(text) => Ok(Some(parse_profiles(&text, config))),
                Err(crate::file::ReadError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(format!("cannot read {}: {e}", path.display())),
            }
        };
        Ok(SharedFiles {
            credentials: (credentials.clone(), load(&credentials, false)?),
            config: (config.clone(), load(&config, true)?),
        })
    }

    /// Profile `name`'s settings: the config file's, the credentials file's over them.
    fn profile(&self, name: &str) -> Option<BTreeMap<String, String>> {
        let from = |file: &(Option<PathBuf>, Option<Profiles>)| file.1.as_ref().and_then(|p| p.get(name)).cloned();
        match (from(&self.config), from(&self.credentials)) {
            (None, None) => None,
            (config, credentials) => {
                let mut settings = config.unwrap_or_default();
                settings.extend(credentials.unwrap_or_default());
                Some(settings)
            }
        }
    }

    /// "PATH (no such file) nor PATH", for errors.
    fn describe(&self) -> String {
        let one = |file: &(Option<PathBuf>, Option<Profiles>), what: &str| match file {
            (None, _) => format!("the {what} file (HOME is not set)"),
            (Some(path), None) => format!("{} (no such file)", path.display()),
            (Some(path), Some(_)) => path.display().to_string(),
        };
        format!("{} nor {}", one(&self.credentials, "credentials"), one(&self.config, "config"))
    }
}

/// The profiles of one shared file: `[NAME]` sections in the credentials file, `[profile
/// NAME]` and `[default]` in the config file (other sections there, `[sso-session x]`,
/// `[services x]`, are no profiles). Keys are lower-cased; lines starting with `#` or `;`, and
/// what follows a `#` or `;` after a space, are comments; an indented line continues the
/// setting above it (`s3 =` and its sub-settings) and is skipped. A section given twice is
/// merged, the later value winning.
fn parse_profiles(text: &str, config: bool) -> Profiles {
    let mut profiles = Profiles::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with(['#', ';']) {
            continue;
        }
        if trimmed.starts_with('[') {
            let header = strip_comment(trimmed);
            current = header
                .strip_prefix('[')
                .and_then(|h| h.strip_suffix(']'))
                .map(str::trim)
                .and_then(|inner| section_profile(inner, config));
            if let Some(name) = &current {
                profiles.entry(name.clone()).or_default();
            }
            continue;
        }
        if line.starts_with([' ', '\t']) {
            continue;
        }
        let (Some(name), Some((key, value))) = (&current, trimmed.split_once('=')) else { continue };
        if let Some(settings) = profiles.get_mut(name) {
            settings.insert(key.trim().to_ascii_lowercase(), strip_comment(value).trim().to_string());
        }
    }
    profiles
}

/// The profile a section header (its text between the brackets) opens, if any.
fn section_profile(inner: &str, config: bool) -> Option<String> {
    if inner.is_empty() {
        return None;
    }
    if !config || inner == "default" {
        return Some(inner.to_string());
    }
    let name = inner.strip_prefix("profile").filter(|rest| rest.starts_with([' ', '\t']))?.trim();
    (!name.is_empty()).then(|| name.to_string())
}

/// `text` without a comment after it: from a `#` or `;` that follows whitespace.
fn strip_comment(text: &str) -> &str {
    let mut previous = None;
    for (at, c) in text.char_indices() {
        if matches!(c, '#' | ';') && previous.is_some_and(char::is_whitespace) {
            return text[..at].trim_end();
        }
        previous = Some(c);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use wiremock::matchers::{body_string_contains, header, method, path};
    use wiremock::{Mock, MockServer, ResponseTemplate};

    /// An environment of `pairs` only: no HOME, so no shared files unless named.
    fn env(pairs: &[(&str, &str)]) -> Env {
        let map: BTreeMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Arc::new(move |name: &str| map.get(name).cloned())
    }

    /// A client of an endpoint nobody serves, with the environment `pairs`.
    fn aws(pairs: &[(&str, &str)]) -> Aws {
        Aws::with_env("us-east-1", Some("http://127.0.0.1:9"), env(pairs)).expect("a client")
    }

    fn keys(id: &str, secret: &str, token: Option<&str>) -> Credentials {
        Credentials {
            access_key_id: id.into(),
            secret_access_key: secret.into(),
            session_token: token.map(Into::into),
            expires: None,
        }
    }

    /// A time `from_now` away, as the metadata services write it.
    fn rfc3339(from_now: Duration) -> String {
        humantime::format_rfc3339_seconds(SystemTime::now() + from_now).to_string()
    }

    const CREDENTIALS_FILE: &str = "\
# a comment
; another
[default]
aws_access_key_id = AKIDDEFAULT
aws_secret_access_key=secret-default   ; a comment after a space

[ work ]
aws_access_key_id   =   AKIDWORK
aws_secret_access_key = sec/ret#work+x
[profile literal]
aws_access_key_id = LITERAL
";

    const CONFIG_FILE: &str = "\
[default]
region = us-east-1
[profile work]
region = eu-west-1
aws_access_key_id = FROMCONFIG
s3 =
  max_concurrent_requests = 10
  aws_access_key_id = NESTED
[profile  spaced ]  # a comment
credential_process = \"/opt/my tool\" --flag 'two words'
[sso-session corp]
sso_start_url = https://example.com
[work]
aws_access_key_id = NOT-A-PROFILE
[profile]
aws_access_key_id = NO-NAME
";

    #[test]
    fn profile_files_parse_as_the_cli_reads_them() {
        let credentials = parse_profiles(CREDENTIALS_FILE, false);
        assert_eq!(credentials.keys().collect::<Vec<_>>(), ["default", "profile literal", "work"]);
        assert_eq!(credentials["default"]["aws_secret_access_key"], "secret-default");
        assert_eq!(credentials["work"]["aws_access_key_id"], "AKIDWORK");
        // A `#` inside a value is part of it; only one after whitespace starts a comment.
        assert_eq!(credentials["work"]["aws_secret_access_key"], "sec/ret#work+x");

        let config = parse_profiles(CONFIG_FILE, true);
        assert_eq!(config.keys().collect::<Vec<_>>(), ["default", "spaced", "work"]);
        assert_eq!(config["work"]["aws_access_key_id"], "FROMCONFIG", "neither [work] nor the nested setting");
        assert_eq!(config["work"]["region"], "eu-west-1");
        assert_eq!(config["spaced"]["credential_process"], "\"/opt/my tool\" --flag 'two words'");

        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("credentials"), CREDENTIALS_FILE).expect("write");
        std::fs::write(dir.path().join("config"), CONFIG_FILE).expect("write");
        let home = dir.path().to_str().expect("utf-8");
        // Missing files are no error; `~/` is the home directory.
        std::fs::create_dir(dir.path().join(".aws")).expect("mkdir");
        let files = SharedFiles::read(&env(&[
            ("HOME", home),
            ("AWS_SHARED_CREDENTIALS_FILE", "~/credentials"),
            ("AWS_CONFIG_FILE", &format!("{home}/config")),
        ]))
        .expect("read");
        // The credentials file's settings win over the config file's.
        let work = files.profile("work").expect("profile work");
        assert_eq!((work["aws_access_key_id"].as_str(), work["region"].as_str()), ("AKIDWORK", "eu-west-1"));
        assert!(files.profile("spaced").is_some() && files.profile("corp").is_none());
        let none = SharedFiles::read(&env(&[("HOME", home)])).expect("read");
        assert!(none.profile("default").is_none());
        assert_eq!(
            none.describe(),
            format!("{home}/.aws/credentials (no such file) nor {home}/.aws/config (no such file)")
        );
    }

    #[test]
    fn credential_process_splits_into_words_without_a_shell() {
        let words = split_command("\"/opt/my tool\" --flag 'two words' a\"b c\"d  $HOME").expect("words");
        assert_eq!(words, ["/opt/my tool", "--flag", "two words", "ab cd", "$HOME"]);
        assert_eq!(split_command("''").expect("words"), [""]);
        assert!(split_command("tool 'open").is_err());
    }

    /// The source each environment resolves to, by the SDKs' order: the first configured wins.
    #[test]
    fn the_chain_takes_the_first_source_configured() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = dir.path().to_str().expect("utf-8");
        std::fs::write(dir.path().join("credentials"), CREDENTIALS_FILE).expect("write");
        std::fs::write(dir.path().join("config"), CONFIG_FILE).expect("write");
        std::fs::write(dir.path().join("empty"), "[default]\nregion = us-east-1\n").expect("write");
        let credentials_file = format!("{files}/credentials");
        let config_file = format!("{files}/config");
        let empty = format!("{files}/empty");
        let env_keys: &[(&str, &str)] = &[("AWS_ACCESS_KEY_ID", "AKIDENV"), ("AWS_SECRET_ACCESS_KEY", "s")];
        let profile: &[(&str, &str)] =
            &[("AWS_SHARED_CREDENTIALS_FILE", &credentials_file), ("AWS_CONFIG_FILE", &config_file)];
        let web: &[(&str, &str)] =
            &[("AWS_WEB_IDENTITY_TOKEN_FILE", "/token"), ("AWS_ROLE_ARN", "arn:aws:iam::1:role/r")];
        let ecs: &[(&str, &str)] = &[("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2/credentials/x")];
        let all = |from: usize| [env_keys, profile, web, ecs][from..].concat();
        let source = |pairs: &[(&str, &str)]| resolve(&env(pairs)).map(|found| found.source);

        assert_eq!(
            source(&all(0)),
            Ok(Source::Static {
                origin: "the environment (AWS_ACCESS_KEY_ID)".into(),
                credentials: keys("AKIDENV", "s", None)
            })
        );
        assert_eq!(
            source(&all(1)),
            Ok(Source::Static {
                origin: "profile 'default' of the shared files".into(),
                credentials: keys("AKIDDEFAULT", "secret-default", None)
            })
        );
        let named = [profile, &[("AWS_PROFILE", "spaced")]].concat();
        assert_eq!(
            source(&named),
            Ok(Source::Process { profile: "spaced".into(), command: "\"/opt/my tool\" --flag 'two words'".into() })
        );
        assert_eq!(
            source(&all(2)),
            Ok(Source::WebIdentity {
                origin: "AWS_WEB_IDENTITY_TOKEN_FILE".into(),
                token_file: "/token".into(),
                role_arn: "arn:aws:iam::1:role/r".into(),
                session_name: "sluice".into()
            })
        );
        assert_eq!(
            source(&all(3)),
            Ok(Source::Container { url: "http://169.254.170.2/v2/credentials/x".into(), token: None })
        );
        assert_eq!(source(&[]), Ok(Source::Instance { endpoint: "http://169.254.169.254".into() }));

        // A profile with settings but no credentials is passed over, as the SDKs do.
        let found =
            resolve(&env(&[("AWS_CONFIG_FILE", &empty), ("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://[::1]:9")]))
                .expect("found");
        assert_eq!(found.source, Source::Instance { endpoint: "http://[::1]:9".into() });
        assert_eq!(found.passed[1], "the shared files: profile 'default' has no credentials");

        // Configured but wrong: an error, never the next source.
        let error = |pairs: &[(&str, &str)]| resolve(&env(pairs)).err().expect("an error");
        assert_eq!(error(&[("AWS_ACCESS_KEY_ID", "A")]), "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not");
        assert!(
            error(&[&all(1)[..], &[("AWS_PROFILE", "nope")]].concat())
                .starts_with("AWS_PROFILE names profile 'nope', which is in neither ")
        );
        assert_eq!(
            error(&[("AWS_WEB_IDENTITY_TOKEN_FILE", "/t")]),
            "AWS_WEB_IDENTITY_TOKEN_FILE is set but AWS_ROLE_ARN is not"
        );
        assert!(error(&[("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://10.0.0.1/creds")]).contains("must be https://"));
        std::fs::write(
            dir.path().join("role"),
            "[profile r]\nrole_arn = arn:aws:iam::1:role/r\nsource_profile = default\n",
        )
        .expect("write");
        let role = format!("{files}/role");
        assert!(error(&[("AWS_CONFIG_FILE", &role), ("AWS_PROFILE", "r")]).contains("sets role_arn"));

        // Nothing anywhere: every source named, in order.
        let nothing = error(&[("AWS_EC2_METADATA_DISABLED", "true")]);
        assert_eq!(
            nothing,
            "no AWS credentials found; tried, in order: 1) the environment: AWS_ACCESS_KEY_ID is not set; \
             2) the shared files: no profile 'default' in the credentials file (HOME is not set) nor the config file \
             (HOME is not set); 3) web identity: AWS_WEB_IDENTITY_TOKEN_FILE is not set; 4) container credentials: \
             AWS_CONTAINER_CREDENTIALS_RELATIVE_URI and AWS_CONTAINER_CREDENTIALS_FULL_URI are not set; \
             5) EC2 instance metadata: disabled by AWS_EC2_METADATA_DISABLED"
        );
    }

    #[test]
    fn error_codes_come_short_from_the_type_or_the_query_header() {
        let cases: &[(&str, Option<&str>, &str, &str)] = &[
            (
                r#"{"__type": "com.amazonaws.sqs#QueueDoesNotExist", "message": "The specified queue does not exist."}"#,
                Some("AWS.SimpleQueueService.NonExistentQueue;Sender"),
                "QueueDoesNotExist",
                "The specified queue does not exist.",
            ),
            (
                r#"{"Message": "gone"}"#,
                Some("AWS.SimpleQueueService.NonExistentQueue;Sender"),
                "QueueDoesNotExist",
                "gone",
            ),
            ("", Some("QueueAlreadyExists;Sender"), "QueueNameExists", ""),
            (r#"{"__type": "ThrottlingException"}"#, None, "ThrottlingException", ""),
            (r#"{"__type": "aws.protocoltests#Redirect:http://internal.amazon.com/coral/x/"}"#, None, "Redirect", ""),
            ("<html>Bad Gateway</html>", None, "Unknown", "<html>Bad Gateway</html>"),
        ];
        for (body, header, code, message) in cases {
            assert_eq!(service_error(body.as_bytes(), *header), (code.to_string(), message.to_string()), "{body}");
        }
        let error = AwsError::Service {
            action: "GetQueueUrl".into(),
            code: "QueueDoesNotExist".into(),
            message: "The specified queue does not exist.\x1b[2J".into(),
            status: 400,
        };
        assert_eq!(
            error.to_string(),
            "SQS GetQueueUrl failed: QueueDoesNotExist (HTTP 400): The specified queue does not exist.\\x1b[2J"
        );
        assert!(!error.throttled());
    }

    #[test]
    fn times_are_read_in_utc_or_with_an_offset() {
        let utc = humantime::parse_rfc3339("2026-12-07T21:05:00Z").expect("a time");
        for text in
            ["2026-12-07T21:05:00Z", "2026-12-07T21:05:00", "2026-12-07T22:05:00+01:00", "2026-12-07T16:35:00-04:30"]
        {
            assert_eq!(parse_time(text), Some(utc), "{text}");
        }
        assert!(parse_time("2026-12-07T21:05:00.123Z").is_some());
        assert_eq!(parse_time("tomorrow"), None);
    }

    #[test]
    fn no_secret_shows_in_debug_or_errors() {
        let source =
            Source::Static { origin: "o".into(), credentials: keys("AKIDSHOWN", "SECRET-KEY", Some("SESSION-TOKEN")) };
        let container = Source::Container {
            url: "http://127.0.0.1/x".into(),
            token: Some(ContainerToken::Value("BEARER-TOKEN".into())),
        };
        let text = format!("{source:?} {source} {container:?} {container}");
        assert!(text.contains("AKIDSHOWN"), "{text}");
        for secret in ["SECRET-KEY", "SESSION-TOKEN", "BEARER-TOKEN"] {
            assert!(!text.contains(secret), "{text}");
        }
        // What a source answered is read field by field: an answer missing a field is named,
        // never quoted.
        let answer = br#"{"AccessKeyId": "A", "SecretAccessKey": "SECRET-KEY", "Expiration": "SESSION-TOKEN"}"#;
        let error = served_credentials(answer).expect_err("no time");
        assert!(!error.contains("SECRET-KEY"), "{error}");
        let error = served_credentials(br#"{"AccessKeyId": "A", "Token": "SESSION-TOKEN"}"#).expect_err("no secret");
        assert_eq!(error, "the answer has no SecretAccessKey");
    }

    #[tokio::test]
    async fn credential_process_output_is_read() {
        let command = r#"printf '{"Version": 1, "AccessKeyId": "AKIDPROC", "SecretAccessKey": "s", "SessionToken": "t", "Expiration": "2099-01-01T00:00:00Z"}'"#;
        let credentials = process_credentials(command).await.expect("credentials");
        assert_eq!(credentials.access_key_id, "AKIDPROC");
        assert_eq!(credentials.session_token.as_deref(), Some("t"));
        assert_eq!(credentials.expires, humantime::parse_rfc3339("2099-01-01T00:00:00Z").ok());
        let wrong = process_credentials(r#"printf '{"Version": 2}'"#).await.expect_err("version 2");
        assert!(wrong.contains("\"Version\": 1"), "{wrong}");
        let failed = process_credentials("sh -c 'echo no session >&2; exit 3'").await.expect_err("exit 3");
        assert!(failed.contains("exit 3") && failed.contains("no session"), "{failed}");
    }

    /// What the instance metadata serves: a session token, then the role, then its credentials.
    #[tokio::test]
    async fn instance_metadata_v2_token_role_then_credentials() {
        let server = MockServer::start().await;
        Mock::given(method("PUT"))
            .and(path("/latest/api/token"))
            .and(header("x-aws-ec2-metadata-token-ttl-seconds", "21600"))
            .respond_with(ResponseTemplate::new(200).set_body_string("IMDS-TOKEN"))
            .expect(1)
            .mount(&server)
            .await;
        Mock::given(method("GET"))
            .and(path("/latest/meta-data/iam/security-credentials/"))
            .and(header("x-aws-ec2-metadata-token", "IMDS-TOKEN"))
            .respond_with(ResponseTemplate::new(200).set_body_string("web-role\n"))
            .expect(1)
            .mount(&server)
            .await;
        let served = serde_json::json!({
            "Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": "ASIAIMDS", "SecretAccessKey": "s",
            "Token": "t", "Expiration": rfc3339(Duration::from_secs(6 * 3600)),
        });
        Mock::given(method("GET"))
            .and(path("/latest/meta-data/iam/security-credentials/web-role"))
            .and(header("x-aws-ec2-metadata-token", "IMDS-TOKEN"))
            .respond_with(ResponseTemplate::new(200).set_body_json(served))
            .expect(1)
            .mount(&server)
            .await;
        let aws = aws(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &server.uri())]);
        let credentials = aws.inner.chain.credentials().await.expect("credentials");
        assert_eq!((credentials.access_key_id.as_str(), credentials.session_token.as_deref()), ("ASIAIMDS", Some("t")));
        // Kept until 5 minutes before they expire: no second fetch (`expect(1)` above).
        assert_eq!(aws.inner.chain.credentials().await.expect("credentials"), credentials);
    }

    /// Off EC2 the last resort fails fast, and the error lists every source tried.
    #[tokio::test]
    async fn off_ec2_the_error_lists_every_source() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
        let aws = aws(&[("AWS_EC2_METADATA_SERVICE_ENDPOINT", &format!("http://{closed}"))]);
        let error = aws.call("ListQueues", &serde_json::json!({})).await.expect_err("no credentials");
        assert!(matches!(error, AwsError::Credentials(_)), "{error:?}");
        let text = error.to_string();
        assert!(
            text.starts_with("SQS ListQueues: no AWS credentials found; tried, in order: 1) the environment"),
            "{text}"
        );
        assert!(text.contains(&format!("5) EC2 instance metadata at http://{closed}: no answer")), "{text}");
    }

    #[tokio::test]
    async fn container_credentials_with_an_authorization_token_file() {
        let server = MockServer::start().await;
        let served = serde_json::json!({
            "AccessKeyId": "ASIAECS", "SecretAccessKey": "s", "Token": "t",
            "Expiration": rfc3339(Duration::from_secs(3600)),
        });
        Mock::given(method("GET"))
            .and(path("/v1/credentials"))
            .and(header("authorization", "POD-TOKEN"))
            .respond_with(ResponseTemplate::new(200).set_body_json(served))
            .expect(1)
            .mount(&server)
            .await;
        let dir = tempfile::tempdir().expect("tempdir");
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, "POD-TOKEN\n").expect("write");
        let aws = aws(&[
            ("AWS_CONTAINER_CREDENTIALS_FULL_URI", &format!("{}/v1/credentials", server.uri())),
            ("AWS_CONTAINER_AUTHORIZATION_TOKEN", "NOT-THIS-ONE"),
            ("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", token_file.to_str().expect("utf-8")),
        ]);
        assert_eq!(aws.inner.chain.credentials().await.expect("credentials").access_key_id, "ASIAECS");

        // A refusal is named with the source.
        let refused = MockServer::start().await;
        Mock::given(method("GET"))
            .respond_with(ResponseTemplate::new(401).set_body_string("{\"code\":\"Unauthorized\"}"))
            .mount(&refused)
            .await;
        let aws = super::Aws::with_env(
            "us-east-1",
            Some("http://127.0.0.1:9"),
            env(&[("AWS_CONTAINER_CREDENTIALS_FULL_URI", &format!("{}/v1/credentials", refused.uri()))]),
        )
        .expect("a client");
        let error = aws.inner.chain.credentials().await.expect_err("refused");
        assert_eq!(
            error,
            format!(
                "AWS credentials from the container credentials at {}/v1/credentials: HTTP 401: {{\"code\":\"Unauthorized\"}}",
                refused.uri()
            )
        );
    }

    /// STS's answer to AssumeRoleWithWebIdentity, its credentials expiring `in`.
    fn sts_answer(key: &str, expires_in: Duration) -> ResponseTemplate {
        let xml = format!(
            "<AssumeRoleWithWebIdentityResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\">\n\
             <AssumeRoleWithWebIdentityResult>\n\
             <SubjectFromWebIdentityToken>system:serviceaccount:shop:sluice</SubjectFromWebIdentityToken>\n\
             <Credentials>\n  <SessionToken>TOKEN-{key}</SessionToken>\n  <SecretAccessKey>SECRET-{key}</SecretAccessKey>\n\
             <Expiration>{}</Expiration>\n  <AccessKeyId>{key}</AccessKeyId>\n</Credentials>\n\
             </AssumeRoleWithWebIdentityResult>\n</AssumeRoleWithWebIdentityResponse>",
            rfc3339(expires_in)
        );
        ResponseTemplate::new(200).set_body_string(xml)
    }

    /// A web identity chain against `sts`, with its token file (holding "jwt-one").
    fn web_identity(sts: &MockServer) -> (Aws, tempfile::TempDir) {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("token"), "jwt-one").expect("write");
        let token_file = dir.path().join("token").to_str().expect("utf-8").to_string();
        let aws = aws(&[
            ("AWS_WEB_IDENTITY_TOKEN_FILE", &token_file),
            ("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/sluice"),
            ("AWS_ENDPOINT_URL_STS", &sts.uri()),
        ]);
        (aws, dir)
    }

    /// Credentials about to expire are fetched again, with the token file read again.
    #[tokio::test]
    async fn web_identity_is_refreshed_when_near_expiry_with_the_token_read_again() {
        let sts = MockServer::start().await;
        Mock::given(method("POST"))
            .and(body_string_contains("Action=AssumeRoleWithWebIdentity"))
            .and(body_string_contains("RoleArn=arn%3Aaws%3Aiam%3A%3A123456789012%3Arole%2Fsluice"))
            .and(body_string_contains("RoleSessionName=sluice"))
            .and(body_string_contains("WebIdentityToken=jwt-one"))
            .respond_with(sts_answer("ASIAONE", Duration::from_secs(120)))
            .expect(1)
            .mount(&sts)
            .await;
        Mock::given(method("POST"))
            .and(body_string_contains("WebIdentityToken=jwt-two"))
            .respond_with(sts_answer("ASIATWO", Duration::from_secs(3600)))
            .expect(1)
            .mount(&sts)
            .await;
        let (aws, dir) = web_identity(&sts);
        let first = aws.inner.chain.credentials().await.expect("credentials");
        assert_eq!((first.access_key_id.as_str(), first.secret_access_key.as_str()), ("ASIAONE", "SECRET-ASIAONE"));
        assert_eq!(first.session_token.as_deref(), Some("TOKEN-ASIAONE"));
        // The kubelet rotates the token; the credentials expire within 5 minutes.
        std::fs::write(dir.path().join("token"), "jwt-two").expect("write");
        assert_eq!(aws.inner.chain.credentials().await.expect("credentials").access_key_id, "ASIATWO");
        assert_eq!(aws.inner.chain.credentials().await.expect("credentials").access_key_id, "ASIATWO");
    }

    /// Many calls finding no credentials fetch them once; a failed refresh keeps the valid ones.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_refresh_at_a_time_and_a_failed_one_keeps_valid_credentials() {
        let sts = MockServer::start().await;
        Mock::given(method("POST"))
            .respond_with(sts_answer("ASIANEAR", Duration::from_secs(120)).set_delay(Duration::from_millis(200)))
            .up_to_n_times(1)
            .expect(1)
            .mount(&sts)
            .await;
        let refused = "<ErrorResponse><Error><Type>Sender</Type><Code>InvalidIdentityToken</Code>\
                       <Message>Token &lt;expired&gt;</Message></Error></ErrorResponse>";
        Mock::given(method("POST"))
            .respond_with(ResponseTemplate::new(400).set_body_string(refused))
            .expect(2)
            .mount(&sts)
            .await;
        let (aws, _dir) = web_identity(&sts);
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let aws = aws.clone();
                tokio::spawn(async move { aws.inner.chain.credentials().await })
            })
            .collect();
        for call in calls {
            assert_eq!(call.await.expect("joined").expect("credentials").access_key_id, "ASIANEAR");
        }
        // Due for a refresh, which STS refuses: the current ones serve until they expire.
        assert_eq!(aws.inner.chain.credentials().await.expect("credentials").access_key_id, "ASIANEAR");

        // With none valid, the refusal is the error, in words.
        let (fresh, _dir) = web_identity(&sts);
        let error = fresh.inner.chain.credentials().await.expect_err("refused");
        assert!(
            error.ends_with(&format!(
                "AssumeRoleWithWebIdentity at {} refused: InvalidIdentityToken (HTTP 400): Token <expired>",
                sts.uri()
            )),
            "{error}"
        );
    }

    /// Throttled calls are tried again (moto never throttles, hence a stand-in); other errors
    /// are not. Every request is signed for SQS with the session token.
    #[tokio::test]
    async fn throttled_calls_are_tried_again_and_every_request_is_signed() {
        let sqs = MockServer::start().await;
        let throttled = r#"{"__type": "com.amazonaws.sqs#RequestThrottled", "message": "slow down"}"#;
        Mock::given(method("POST"))
            .and(path("/"))
            .and(header("x-amz-target", "AmazonSQS.ListQueues"))
            .and(header("content-type", "application/x-amz-json-1.0"))
            .respond_with(ResponseTemplate::new(400).set_body_string(throttled))
            .up_to_n_times(2)
            .expect(2)
            .mount(&sqs)
            .await;
        Mock::given(method("POST"))
            .and(header("x-amz-target", "AmazonSQS.ListQueues"))
            .respond_with(ResponseTemplate::new(200).set_body_string(r#"{"QueueUrls": []}"#))
            .expect(1)
            .mount(&sqs)
            .await;
        Mock::given(method("POST"))
            .and(header("x-amz-target", "AmazonSQS.SendMessage"))
            .respond_with(ResponseTemplate::new(500).set_body_string(r#"{"__type": "InternalError"}"#))
            .expect(1)
            .mount(&sqs)
            .await;
        let pairs =
            [("AWS_ACCESS_KEY_ID", "AKIDTEST"), ("AWS_SECRET_ACCESS_KEY", "s"), ("AWS_SESSION_TOKEN", "SESSION")];
        let aws = Aws::with_env("eu-west-1", Some(&sqs.uri()), env(&pairs)).expect("a client");
        assert_eq!(
            aws.call("ListQueues", &serde_json::json!({})).await.expect("listed"),
            serde_json::json!({"QueueUrls": []})
        );
        let error = aws.call("SendMessage", &serde_json::json!({})).await.expect_err("an internal error");
        assert!(matches!(&error, AwsError::Service { code, status: 500, .. } if code == "InternalError"), "{error:?}");

        for request in sqs.received_requests().await.expect("recorded") {
            let authorization = request.headers.get("authorization").and_then(|v| v.to_str().ok()).expect("signed");
            assert!(authorization.starts_with("AWS4-HMAC-SHA256 Credential=AKIDTEST/"), "{authorization}");
            assert!(authorization.contains("/eu-west-1/sqs/aws4_request, SignedHeaders="), "{authorization}");
            assert!(
                authorization.contains("content-type;host;x-amz-date;x-amz-security-token;x-amz-target"),
                "{authorization}"
            );
            assert_eq!(request.headers.get("x-amz-security-token").and_then(|v| v.to_str().ok()), Some("SESSION"));
        }
    }

    #[tokio::test]
    async fn no_connection_is_a_transport_error_saying_nothing_was_sent() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
        let pairs = [("AWS_ACCESS_KEY_ID", "A"), ("AWS_SECRET_ACCESS_KEY", "s")];
        let aws = Aws::with_env("us-east-1", Some(&format!("http://{closed}")), env(&pairs)).expect("a client");
        let error = aws.call("SendMessage", &serde_json::json!({})).await.expect_err("refused");
        let text = error.to_string();
        assert!(matches!(error, AwsError::Transport(_)), "{error:?}");
        assert!(text.starts_with(&format!("SQS SendMessage: cannot connect to http://{closed}/: ")), "{text}");
        assert!(text.ends_with("(not sent)"), "{text}");
    }

    #[test]
    fn regions_and_endpoints_are_checked() {
        let pairs = [("AWS_ENDPOINT_URL", "http://127.0.0.1:4566")];
        assert_eq!(
            Aws::with_env("us-east-1", None, env(&[])).expect("a client").endpoint(),
            "https://sqs.us-east-1.amazonaws.com/"
        );
        assert_eq!(
            Aws::with_env("cn-north-1", None, env(&[])).expect("a client").endpoint(),
            "https://sqs.cn-north-1.amazonaws.com.cn/"
        );
        assert_eq!(
            Aws::with_env("us-east-1", None, env(&pairs)).expect("a client").endpoint(),
            "http://127.0.0.1:4566/"
        );
        let error = |region: &str, endpoint: &str| {
            Aws::with_env(region, Some(endpoint), env(&[])).expect_err("refused").to_string()
        };
        assert!(error("US East", "http://h").starts_with("\"US East\" is not an AWS region"));
        assert_eq!(error("us-east-1", "ftp://h"), "endpoint \"ftp://h\": not an http:// or https:// URL");
        assert_eq!(
            error("us-east-1", "http://k:s@h"),
            "endpoint \"http://k:s@h\": a user, a query or a fragment has no place in it"
        );
    }
}
