//! The JSON API under `/api/v1/` that the console reads and writes (described in
//! `openapi.json` beside this file, served at `/api/v1/openapi.json`): the queues at a glance,
//! one queue's handler and recent attempts, its dead letters (list, show, redrive, purge),
//! pause and resume, and the topology with its drift on the broker.
//!
//! The work is `ops`'s (`ops::status`, `ops::dlq`), as for the CLI; this only gathers what
//! this runner knows beside it (its attempts, its breakers, the last reload) and answers in
//! JSON. Writes are guarded by `admin` (the token, no foreign origin) before they get here;
//! each logs once what it did, naming the remote address. Secrets never leave: a handler is
//! shown as its file writes it (`${VAR}` and `{{env.X}}` as written, never their values), URL
//! passwords and query values masked, so are header, variable and flag values whose names look
//! secret; signing says only on or off.
//!
//! The data path comes first: what reads cost is bounded (and how many start a second is,
//! by `admin`). The runner's own state is read as values (`runtime::attempts::Live`, the
//! pauses), never by rendering its `/metrics`; the overview is built at most once per
//! [`SNAPSHOT_TTL`], however many ask for it meanwhile (they wait for the one build and share
//! it); reads that read the broker or copy the attempts take turns, [`READS_AT_ONCE`] at a
//! time, and each turn rests [`REST`] times as long as its read took before the next reader
//! has it, so that they take a small share of the time however many ask.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{ConnectInfo, FromRequestParts, Path, Query, State};
use axum::http::{Method, StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::broker::{BrokerError, Operate};
use crate::config::{Backoff, Config, Handler, Queue};
use crate::ops::dlq::{self, Action, Filter};
use crate::ops::status;
use crate::reload::loader::Current;
use crate::runtime::attempts::Attempts;
use crate::runtime::gate::Pauses;
use crate::secret::MASK;

/// The OpenAPI document of every route below.
pub const OPENAPI: &str = include_str!("openapi.json");

/// How long an overview, once built, answers every request for it.
pub const SNAPSHOT_TTL: Duration = Duration::from_millis(300);

/// Reads that read the broker or copy the attempts running at once.
pub const READS_AT_ONCE: usize = 2;

/// How many times as long as a read took its turn rests before the next reader has it: such
/// reads take at most a tenth of the time per turn.
pub const REST: u32 = 9;

/// The longest a turn rests (after a read that waited long on the broker).
const MAX_REST: Duration = Duration::from_secs(5);

/// Opens a broker session for the API.
pub type Connect<B> = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<B, BrokerError>> + Send>> + Send + Sync>;

/// Which runner this is, for the overview: other runners have consoles of their own.
#[derive(Debug, Clone, Serialize)]
pub struct Runner {
    pub host: String,
    pub pid: u32,
    pub version: &'static str,
}

impl Runner {
    /// This process.
    pub fn this(version: &'static str) -> Runner {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
        Runner { host, pid: std::process::id(), version }
    }
}

/// What the API reads and acts on.
pub struct Api<B: Operate> {
    pub runner: Runner,
    pub current: Current,
    pub attempts: Attempts,
    pub pauses: Pauses,
    pub connect: Connect<B>,
    /// A session kept for the frequent reads (status, drift); replaced once it is lost.
    session: tokio::sync::Mutex<Option<B>>,
    /// The last overview built, and when; locked while one is built.
    overview: tokio::sync::Mutex<Option<(tokio::time::Instant, axum::body::Bytes)>>,
    /// Overviews built so far.
    built: AtomicU64,
    /// Turns of the reads that cost ([`READS_AT_ONCE`]), in the order asked.
    turns: Arc<tokio::sync::Semaphore>,
}

impl<B: Operate> Api<B> {
    pub fn new(runner: Runner, current: Current, attempts: Attempts, pauses: Pauses, connect: Connect<B>) -> Api<B> {
        Api {
            runner,
            current,
            attempts,
            pauses,
            connect,
            session: tokio::sync::Mutex::new(None),
            overview: tokio::sync::Mutex::new(None),
            built: AtomicU64::new(0),
            turns: Arc::new(tokio::sync::Semaphore::new(READS_AT_ONCE)),
        }
    }

    /// How many overviews were built so far.
    pub fn overviews_built(&self) -> u64 {
        self.built.load(Ordering::Relaxed)
    }

    /// A turn among the reads that cost: waits while [`READS_AT_ONCE`] run or rest.
    async fn turn(&self) -> Turn {
        // Never closed: the semaphore lives as long as the API.
        let permit = self.turns.clone().acquire_owned().await;
        let permit = permit.unwrap_or_else(|_| unreachable!("the API's semaphore is never closed"));
        Turn { permit: Some(permit), began: tokio::time::Instant::now() }
    }

    /// The kept session, or a new one.
    async fn session(&self) -> Result<B, BrokerError> {
        let mut kept = self.session.lock().await;
        if let Some(session) = kept.as_ref().filter(|s| s.is_connected()) {
            return Ok(session.clone());
        }
        let session = (self.connect)().await?;
        *kept = Some(session.clone());
        Ok(session)
    }

    /// What this runner is doing with `queue` (held deliveries, breaker, pause, limit).
    fn held(&self, queue: &str) -> status::Held {
        let live = self.attempts.get(queue).map(|log| log.live().clone()).unwrap_or_default();
        status::Held {
            in_flight: live.in_flight(),
            circuit: live.circuit(),
            paused: self.pauses.is_paused(queue),
            concurrency_limit: live.concurrency_limit(),
        }
    }
}

/// A read's turn: once dropped, it rests [`REST`] times as long as it was held, then passes.
struct Turn {
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    began: tokio::time::Instant,
}

impl Drop for Turn {
    fn drop(&mut self) {
        let rest = self.began.elapsed().saturating_mul(REST).min(MAX_REST);
        if let Some(permit) = self.permit.take() {
            tokio::spawn(async move {
                tokio::time::sleep(rest).await;
                drop(permit);
            });
        }
    }
}

/// The routes of the API, each also named in [`Routes::names`] (which the OpenAPI test reads).
pub struct Routes<B: Operate> {
    router: Router<Arc<Api<B>>>,
    names: Vec<(Method, &'static str)>,
}

impl<B: Operate> Routes<B> {
    fn route(mut self, method: Method, path: &'static str, handler: MethodRouter<Arc<Api<B>>>) -> Self {
        self.names.push((method, path));
        self.router = self.router.route(path, handler);
        self
    }

    /// Every route, as `(method, path)` with `{name}` placeholders.
    pub fn names(&self) -> &[(Method, &'static str)] {
        &self.names
    }

    /// The router, with its state.
    pub fn router(self, api: Arc<Api<B>>) -> Router {
        self.router.with_state(api)
    }
}

/// Every route of the API.
pub fn routes<B: Operate>() -> Routes<B> {
    Routes { router: Router::new(), names: Vec::new() }
        .route(Method::GET, "/api/v1/openapi.json", get(openapi))
        .route(Method::GET, "/api/v1/queues", get(queues::<B>))
        .route(Method::GET, "/api/v1/queues/{name}", get(queue::<B>))
        .route(Method::GET, "/api/v1/queues/{name}/attempts", get(attempts::<B>))
        .route(Method::GET, "/api/v1/queues/{name}/dead-letters", get(dead_letters::<B>))
        .route(Method::GET, "/api/v1/queues/{name}/dead-letters/{id}", get(dead_letter::<B>))
        .route(Method::POST, "/api/v1/queues/{name}/dead-letters/redrive", post(redrive::<B>))
        .route(Method::POST, "/api/v1/queues/{name}/dead-letters/purge", post(purge::<B>))
        .route(Method::POST, "/api/v1/queues/{name}/pause", post(pause::<B>))
        .route(Method::POST, "/api/v1/queues/{name}/resume", post(resume::<B>))
        .route(Method::GET, "/api/v1/topology", get(topology::<B>))
}

/// An error answer: `{"error": "..."}` with its status.
struct Failure(StatusCode, String);

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<BrokerError> for Failure {
    fn from(e: BrokerError) -> Failure {
        Failure(StatusCode::BAD_GATEWAY, format!("the broker: {e}"))
    }
}

type Answer<T> = Result<Json<T>, Failure>;

/// The query, refused as every error here is: in JSON.
struct Queried<T>(T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Queried<T> {
    type Rejection = Failure;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Failure> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(value)) => Ok(Queried(value)),
            Err(e) => Err(Failure(e.status(), e.body_text())),
        }
    }
}

/// The path's parameters, refused (not UTF-8 once decoded) in JSON too.
struct Named<T>(T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for Named<T> {
    type Rejection = Failure;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Failure> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(value)) => Ok(Named(value)),
            Err(e) => Err(Failure(e.status(), e.body_text())),
        }
    }
}

/// The queue `name` of the running config.
fn find<'a>(config: &'a Config, name: &str) -> Result<&'a Queue, Failure> {
    config
        .queues
        .get(name)
        .map(|q| &**q)
        .ok_or_else(|| Failure(StatusCode::NOT_FOUND, format!("no queue \"{name}\" runs here")))
}

async fn openapi() -> impl IntoResponse {
    ([(axum::http::header::CONTENT_TYPE, "application/json")], OPENAPI)
}

/// One queue on the overview.
#[derive(Serialize)]
struct QueueView {
    name: String,
    /// The broker's counts; None while the broker cannot be read.
    status: Option<status::Row>,
    paused: bool,
    circuit: &'static str,
    concurrency_limit: f64,
    in_flight: u64,
    #[serde(flatten)]
    summary: crate::runtime::attempts::Summary,
}

#[derive(Serialize)]
struct Overview {
    runner: Runner,
    queues: Vec<QueueView>,
    retries_waiting: Option<u32>,
    broker_error: Option<String>,
    last_reload: Option<crate::reload::loader::LastReload>,
}

/// The overview, as last built unless that was [`SNAPSHOT_TTL`] ago or more.
async fn queues<B: Operate>(State(api): State<Arc<Api<B>>>) -> Response {
    let mut kept = api.overview.lock().await;
    let body = match kept.as_ref().filter(|(at, _)| at.elapsed() < SNAPSHOT_TTL) {
        Some((_, body)) => body.clone(),
        None => {
            let body = {
                let _turn = api.turn().await;
                api.built.fetch_add(1, Ordering::Relaxed);
                // An overview always serializes: strings, numbers and options of them.
                serde_json::to_vec(&overview(&api).await).unwrap_or_default()
            };
            let body = axum::body::Bytes::from(body);
            *kept = Some((tokio::time::Instant::now(), body.clone()));
            body
        }
    };
    drop(kept);
    ([(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn overview<B: Operate>(api: &Api<B>) -> Overview {
    let running = api.current.get();
    let held: BTreeMap<String, status::Held> = running.config.queues.keys().map(|q| (q.clone(), api.held(q))).collect();
    let read = async {
        let session = api.session().await?;
        status::read(&mut status::Session(&session), &running.config, Some(&held)).await
    }
    .await;
    let (mut rows, retries_waiting, broker_error) = match read {
        Ok(status) => {
            (status.queues.into_iter().map(|r| (r.queue.clone(), r)).collect(), Some(status.retries_waiting), None)
        }
        Err(e) => (BTreeMap::new(), None, Some(e.to_string())),
    };
    let queues = running
        .config
        .queues
        .keys()
        .map(|name| {
            let h = held.get(name).copied().unwrap_or_default();
            QueueView {
                name: name.clone(),
                status: rows.remove(name),
                paused: h.paused,
                circuit: h.circuit_name(),
                concurrency_limit: h.concurrency_limit,
                in_flight: h.in_flight,
                summary: api.attempts.of(name).summary(),
            }
        })
        .collect();
    Overview { runner: api.runner.clone(), queues, retries_waiting, broker_error, last_reload: running.last_reload }
}

/// Header, variable and flag names whose values are never shown.
fn secret_name(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [
        "authorization",
        "signature",
        "secret",
        "token",
        "pass",
        "cookie",
        "key",
        "credential",
        "auth",
        "private",
        "session",
    ]
    .iter()
    .any(|word| name.contains(word))
}

/// What the queue's file writes at `pointer` below the queue (before `${VAR}` substitution).
fn written<'a>(q: &'a Queue, pointer: &str) -> Option<&'a Value> {
    q.written.pointer(pointer)
}

/// A written scalar as text: a string as it is, anything else as JSON.
fn text(value: &Value) -> String {
    value.as_str().map_or_else(|| value.to_string(), str::to_string)
}

/// The written text at `pointer`, URL credentials masked.
fn shown(q: &Queue, pointer: &str) -> Option<String> {
    written(q, pointer).map(|v| crate::secret::mask_urls(&text(v)))
}

/// The written webhook URL, its credentials masked.
fn shown_url(q: &Queue) -> Option<String> {
    written(q, "/handler/webhook/url").map(|v| crate::secret::mask_url(&text(v)))
}

/// The written `name: value` map at `pointer` (headers, a command's env) as pairs: the value of
/// a secret-looking name masked whole, URL credentials masked in the others.
fn shown_pairs(q: &Queue, pointer: &str) -> Vec<(String, String)> {
    let pairs = written(q, pointer).and_then(Value::as_object).into_iter().flatten();
    pairs
        .map(|(name, value)| {
            let value = if secret_name(name) { MASK.to_string() } else { crate::secret::mask_urls(&text(value)) };
            (name.clone(), value)
        })
        .collect()
}

/// A command's written arguments, masked: URL credentials, the value of `--name=value` when the
/// name looks secret, and the argument after a secret-looking flag written alone
/// (`--password VALUE`).
fn shown_args(q: &Queue) -> Vec<String> {
    let args = written(q, "/handler/command/args").and_then(Value::as_array).into_iter().flatten();
    let mut after_flag = false;
    args.map(|arg| {
        let arg = text(arg);
        let flag = arg.starts_with('-') && secret_name(&arg);
        let shown = match arg.split_once('=') {
            _ if after_flag => MASK.to_string(),
            Some((name, _)) if secret_name(name) => format!("{name}={MASK}"),
            _ => crate::secret::mask_urls(&arg),
        };
        after_flag = flag && !arg.contains('=');
        shown
    })
    .collect()
}

/// The handler as its file writes it, without a secret: templates and `${VAR}`s as written
/// (never what the environment fills in), URL credentials and secret-looking values masked.
fn handler_view(q: &Queue) -> Value {
    let rules = |pointer: &str| written(q, pointer).cloned().unwrap_or(Value::Null);
    match &q.handler {
        Handler::Webhook(w) => json!({
            "kind": "webhook",
            "method": w.method,
            "url": shown_url(q),
            "headers": shown_pairs(q, "/handler/webhook/headers"),
            "body": shown(q, "/handler/webhook/body"),
            "timeout_ms": w.timeout.as_millis() as u64,
            "signing": w.signing.is_some(),
            "on_status": rules("/on_status"),
        }),
        Handler::Command(c) => json!({
            "kind": "command",
            "program": written(q, "/handler/command/program").map(text),
            "args": shown_args(q),
            "env": shown_pairs(q, "/handler/command/env"),
            "pass_env": c.pass_env,
            "stdin": format!("{:?}", c.stdin).to_lowercase(),
            "timeout_ms": c.timeout.as_millis() as u64,
            "permanent_exit_codes": c.permanent_exit_codes,
            "on_exit": rules("/handler/command/on_exit"),
            "signing": false,
        }),
    }
}

fn retry_view(q: &Queue) -> Value {
    let r = &q.retry;
    let backoff = match &r.backoff {
        Backoff::Exponential => "exponential",
        Backoff::Fixed => "fixed",
        Backoff::Schedule(_) => "schedule",
    };
    json!({
        "max_attempts": r.max_attempts.get(),
        "backoff": backoff,
        "jitter": format!("{:?}", r.jitter).to_lowercase(),
        // The delay before each retry (attempt 2, 3, ...) before jitter.
        "delays_ms": (2..=r.max_attempts.get()).map(|next| r.ceiling(next).as_millis() as u64).collect::<Vec<_>>(),
    })
}

async fn queue<B: Operate>(State(api): State<Arc<Api<B>>>, Named(name): Named<String>) -> Answer<Value> {
    let running = api.current.get();
    let q = find(&running.config, &name)?;
    let held = api.held(&name);
    Ok(Json(json!({
        "runner": api.runner,
        "name": q.name,
        "paused": held.paused,
        "circuit": held.circuit_name(),
        "file": q.file.display().to_string(),
        "dead_letter_queue": q.dead_letter,
        "concurrency": q.concurrency.get(),
        "adaptive": q.adaptive,
        "ordered": q.ordered,
        "rate_limit": written(q, "/rate_limit").cloned(),
        "idempotency": q.idempotency.as_ref().map(|i| json!({ "ttl_ms": i.ttl.as_millis() as u64 })),
        "handler": handler_view(q),
        "retry": retry_view(q),
    })))
}

async fn attempts<B: Operate>(State(api): State<Arc<Api<B>>>, Named(name): Named<String>) -> Answer<Value> {
    find(&api.current.get().config, &name)?;
    let log = api.attempts.of(&name);
    let _turn = api.turn().await;
    Ok(Json(json!({ "capacity": log.capacity(), "attempts": log.recent() })))
}

/// The dead-letter filters, as query parameters or in a write's body. As the OpenAPI document
/// has them: a field may be absent, never null.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Filters {
    #[serde(default, deserialize_with = "given")]
    reason: Option<String>,
    /// A duration such as `1h`.
    #[serde(default, deserialize_with = "given")]
    since: Option<String>,
    /// Message ids, comma-separated in a query.
    #[serde(default, deserialize_with = "ids")]
    id: Vec<String>,
    #[serde(default, deserialize_with = "count")]
    limit: Option<usize>,
}

/// A field that is there, not null (absent is the field's default).
fn given<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// A count of messages: a whole number, 0 or more, as JSON Schema's `integer` has it (`230.0`
/// is one) and as text in a query. Past what fits, as many as there can be.
fn count<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Number {
        Whole(u64),
        Real(f64),
        Text(String),
    }
    let real = match Number::deserialize(d)? {
        Number::Whole(n) => return Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
        Number::Real(r) => Some(r),
        Number::Text(text) => match text.trim().parse::<u64>() {
            Ok(n) => return Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
            Err(_) => text.trim().parse::<f64>().ok(),
        },
    };
    match real {
        // A float past usize's range saturates in the cast: as many as there can be.
        Some(r) if r.is_finite() && r >= 0.0 && r.fract() == 0.0 => Ok(Some(r as usize)),
        _ => Err(serde::de::Error::custom("expected a whole number of messages, 0 or more")),
    }
}

/// Ids as a list, or as one comma-separated string.
fn ids<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Ids {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Ids::deserialize(d)? {
        Ids::One(text) => text.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect(),
        Ids::Many(ids) => ids,
    })
}

/// Whether `text` is a duration by the OpenAPI document's pattern, too long to be held: any
/// age, then.
fn too_long(text: &str) -> bool {
    let digits = ["ms", "s", "m", "h", "d"].iter().find_map(|unit| text.strip_suffix(unit));
    digits.is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

impl Filters {
    fn filter(self) -> Result<Filter, Failure> {
        let since = match self.since.as_deref().filter(|s| !s.is_empty()) {
            None => None,
            Some(text) => Some(
                crate::config::parse_duration(text)
                    .or_else(|| too_long(text).then_some(Duration::MAX))
                    .ok_or_else(|| Failure(StatusCode::BAD_REQUEST, crate::config::duration_problem(text)))?,
            ),
        };
        let reason = self.reason.filter(|r| !r.is_empty());
        Ok(Filter { reason, since, ids: self.id, limit: self.limit })
    }
}

/// Dead letters a page holds unless the query's `limit` says otherwise.
pub const PAGE: usize = 100;

/// The most a page holds: what a browser shows at once, in an answer of a few hundred KiB.
pub const MAX_PAGE: usize = 1000;

/// A listing's query: the filters, `limit` the page's size, and where the page begins.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Listing {
    #[serde(flatten)]
    filters: Filters,
    /// A page's `next_cursor`.
    cursor: Option<String>,
}

async fn dead_letters<B: Operate>(
    State(api): State<Arc<Api<B>>>,
    Named(name): Named<String>,
    Queried(listing): Queried<Listing>,
) -> Answer<Value> {
    let running = api.current.get();
    let q = find(&running.config, &name)?;
    let mut filter = listing.filters.filter()?;
    let size = filter.limit.unwrap_or(PAGE);
    if !(1..=MAX_PAGE).contains(&size) {
        return Err(Failure(StatusCode::BAD_REQUEST, format!("limit: a page holds 1 to {MAX_PAGE}, not {size}")));
    }
    filter.limit = Some(size);
    let after = match listing.cursor.as_deref().filter(|c| !c.is_empty()) {
        None => None,
        Some(text) => Some(dlq::Cursor::parse(text).ok_or_else(|| {
            Failure(StatusCode::BAD_REQUEST, format!("cursor: expected a page's next_cursor, found \"{text}\""))
        })?),
    };
    let _turn = api.turn().await;
    let broker = (api.connect)().await?;
    let page = dlq::page(&broker, &q.dead_letter, &filter, after.as_ref()).await;
    broker.close().await;
    let page = page?;
    Ok(Json(json!({
        "dead_letter_queue": q.dead_letter,
        "entries": page.entries,
        "tally": page.tally,
        "next_cursor": page.next.map(|c| c.to_string()),
    })))
}

async fn dead_letter<B: Operate>(
    State(api): State<Arc<Api<B>>>,
    Named((name, id)): Named<(String, String)>,
) -> Answer<dlq::Shown> {
    let running = api.current.get();
    let q = find(&running.config, &name)?;
    let _turn = api.turn().await;
    let broker = (api.connect)().await?;
    let shown = dlq::show(&broker, &q.dead_letter, &id).await;
    broker.close().await;
    let mut shown = shown?
        .ok_or_else(|| Failure(StatusCode::NOT_FOUND, format!("no message with id \"{id}\" in {}", q.dead_letter)))?;
    // A producer's credentials in a message's headers are not for whoever reads the port.
    for (_, value) in shown.headers.iter_mut().filter(|(name, _)| secret_name(name)) {
        *value = Value::from(MASK);
    }
    Ok(Json(shown))
}

/// A redrive or purge: which messages (ids or filters), whether only to count them, and for a
/// purge the queue's name typed again.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Act {
    #[serde(flatten)]
    filters: Filters,
    #[serde(default)]
    dry_run: bool,
    /// A purge that is not a dry run needs the queue's name here.
    #[serde(default, deserialize_with = "given")]
    confirm: Option<String>,
}

async fn act<B: Operate>(api: &Api<B>, name: &str, remote: SocketAddr, action: Action, act: Act) -> Answer<dlq::Tally> {
    let running = api.current.get();
    let q = find(&running.config, name)?;
    if action == Action::Purge && !act.dry_run && act.confirm.as_deref() != Some(name) {
        return Err(Failure(
            StatusCode::BAD_REQUEST,
            format!("a purge deletes messages for good: give \"confirm\": \"{name}\" (or \"dry_run\": true)"),
        ));
    }
    let job = dlq::Job {
        queue: &q.name,
        dlq: &q.dead_letter,
        action,
        filter: act.filters.filter()?,
        dry_run: act.dry_run,
        rate: None,
    };
    let broker = (api.connect)().await?;
    let applied = dlq::apply(&broker, &job, &|_| {}).await;
    broker.close().await;
    let what = match action {
        Action::Redrive => "redrive",
        Action::Purge => "purge",
    };
    match &applied {
        Ok(tally) => tracing::info!(
            %remote,
            queue = name,
            action = what,
            dry_run = act.dry_run,
            selected = tally.selected,
            messages = tally.done,
            "dead letters acted on from the admin port"
        ),
        Err(e) => {
            tracing::warn!(%remote, queue = name, action = what, error = %e, "dead letters not acted on from the admin port")
        }
    }
    Ok(Json(applied?))
}

/// A write's body: JSON, or none at all (then every message matches).
fn body(bytes: &[u8]) -> Result<Act, Failure> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Act::default());
    }
    serde_json::from_slice(bytes).map_err(|e| Failure(StatusCode::BAD_REQUEST, format!("the request body: {e}")))
}

async fn redrive<B: Operate>(
    State(api): State<Arc<Api<B>>>,
    ConnectInfo(remote): ConnectInfo<SocketAddr>,
    Named(name): Named<String>,
    bytes: axum::body::Bytes,
) -> Answer<dlq::Tally> {
    act(&api, &name, remote, Action::Redrive, body(&bytes)?).await
}

async fn purge<B: Operate>(
    State(api): State<Arc<Api<B>>>,
    ConnectInfo(remote): ConnectInfo<SocketAddr>,
    Named(name): Named<String>,
    bytes: axum::body::Bytes,
) -> Answer<dlq::Tally> {
    act(&api, &name, remote, Action::Purge, body(&bytes)?).await
}

async fn pause<B: Operate>(
    State(api): State<Arc<Api<B>>>,
    ConnectInfo(remote): ConnectInfo<SocketAddr>,
    Named(name): Named<String>,
) -> impl IntoResponse {
    super::set_paused(&api.pauses, &name, true, remote)
}

async fn resume<B: Operate>(
    State(api): State<Arc<Api<B>>>,
    ConnectInfo(remote): ConnectInfo<SocketAddr>,
    Named(name): Named<String>,
) -> impl IntoResponse {
    super::set_paused(&api.pauses, &name, false, remote)
}

/// How long a drift check may take before the topology is shown without it.
const DRIFT_TIMEOUT: Duration = Duration::from_secs(10);

async fn topology<B: Operate>(State(api): State<Arc<Api<B>>>) -> Answer<Value> {
    let config = api.current.get().config;
    let plan = crate::topology::plan(&config);
    let turn = api.turn().await;
    let drift = tokio::time::timeout(DRIFT_TIMEOUT, async { api.session().await?.drift(&plan).await }).await;
    let (drift, drift_error) = match drift {
        Ok(Ok(drift)) => (Some(drift), None),
        Ok(Err(e)) => (None, Some(e.to_string())),
        Err(_) => (None, Some(format!("the broker did not answer within {DRIFT_TIMEOUT:?}"))),
    };
    drop(turn);
    let handlers: BTreeMap<&String, Value> = config
        .queues
        .iter()
        .map(|(name, q)| {
            let target = match &q.handler {
                Handler::Webhook(w) => {
                    json!({ "kind": "webhook", "method": w.method, "url": shown_url(q) })
                }
                Handler::Command(_) => {
                    json!({ "kind": "command", "program": written(q, "/handler/command/program").map(text) })
                }
            };
            (name, target)
        })
        .collect();
    Ok(Json(
        json!({ "runner": api.runner, "plan": plan, "handlers": handlers, "drift": drift, "drift_error": drift_error }),
    ))
}

#[cfg(test)]
mod tests;
