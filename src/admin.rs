//! The admin HTTP endpoint: `/metrics` (Prometheus text format), `/healthz` (the process is
//! alive), `/readyz` (connected to the broker and consuming, and no queue's acks failing; else
//! 503 saying which), `POST /queues/{name}/pause` and `/resume` (what `sluice pause|resume`
//! call), the operator console at `/` ([`console`]) and the JSON API it uses under `/api/v1/`
//! ([`api`]).
//!
//! `/metrics`, `/healthz` and `/readyz` are open to whoever reaches the port, for scrapers and
//! probes. Every other request must be addressed to a host the port answers for (an IP address,
//! `localhost`, the name `--admin` gave, or one of `--admin-allowed-hosts`): a page whose name
//! was rebound to this address (DNS rebinding) is refused. Then the console's own files and the
//! OpenAPI document, which hold no data, are open; every other read needs `Authorization:
//! Bearer` with the runner's [`token`] unless `--admin-open-reads`, and every write needs it
//! always, and is refused when it carries an `Origin` other than the port's own (a page of
//! another site in the operator's browser). A write route logs what it did once, naming the
//! remote address; refused requests are logged here, one line per [`REFUSED_EVERY`] with how
//! many more there were. No cookie is ever set or read, so a browser adds no credentials of its
//! own.
//!
//! The port must never cost the data path its file descriptors or its time, and idle or slow
//! clients must never keep a scrape out: it holds at most [`MAX_CONNECTIONS`] connections, at
//! most [`PER_PEER`] from one address. A new connection past either bound takes the place of
//! the longest-held idle one (no request under way: a slowloris one sending its head a byte at
//! a time, a keep-alive one waiting), of that address when it is the address's bound; when all
//! are busy, the new one is closed, after [`REFUSED_HOLD`] unread (at most [`REFUSED_HELD`] so
//! held, the rest at once): a client that connects again at once then costs the port an accept
//! a second, not a loop of them (20 connections from one address cut webhook calls to 0.88×). A connection that sends no complete request head within
//! [`HEAD_TIMEOUT`] (idle ones included) is closed, and none lasts more than [`LIFETIME`].
//! Requests of the console and its API start at most [`PACE`] a second (bursts of as many
//! after a quiet second), in the order they came; the others wait their turn (what each costs
//! is [`api`]'s to bound). `/metrics`, `/healthz` and `/readyz` are never held back.
//!
//! It only reports and describes the metrics (their `# HELP` lines); they are recorded where
//! the events happen (`runtime::events`, `reload::loader`).

pub mod api;
pub mod console;
pub mod token;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{ConnectInfo, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use axum::routing::{get, post};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics::{describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use crate::runtime::Readiness;
use crate::runtime::gate::Pauses;
use token::{Source, Token};

/// At most this many admin connections are open at once.
pub const MAX_CONNECTIONS: usize = 64;

/// At most this many of them from one address: below [`MAX_CONNECTIONS`], so that one client
/// holding its share busy leaves room for the others.
pub const PER_PEER: usize = 16;

/// How long a connection may take to send a request's head, and may stay idle before one.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a connection may last at all, whatever it does (a body sent or an answer read
/// slowly): every answer here is small and immediate.
pub const LIFETIME: Duration = Duration::from_secs(30);

/// Requests of the console and its API that start a second at most.
pub const PACE: u32 = 50;

/// How often a full admin port says so in the log.
/// How long a connection refused for want of room is held, unread, before it is closed.
pub const REFUSED_HOLD: Duration = Duration::from_secs(1);

/// How many refused connections are held at once (their file descriptors included); past it,
/// one is closed at once.
pub const REFUSED_HELD: usize = 16;

const CROWDED_EVERY: Duration = Duration::from_secs(60);

/// How often refused requests are logged: one line, then the count of those in between.
pub const REFUSED_EVERY: Duration = Duration::from_secs(10);

/// What scrapers and probes read: open to anyone, for any host.
const PROBES: [&str; 3] = ["/metrics", "/healthz", "/readyz"];

/// Reads that hold no data (the console's files, the API's description): no token needed.
const PUBLIC: [&str; 4] = ["/", "/console.js", "/console.css", "/api/v1/openapi.json"];

/// Installs the global Prometheus recorder and describes every metric sluice records (the
/// `# HELP` lines).
pub fn install_recorder() -> Result<PrometheusHandle, String> {
    let buckets = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(metrics_exporter_prometheus::Matcher::Suffix("duration_seconds".into()), &buckets)
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())?;
    describe_metrics();
    Ok(handle)
}

/// One line of help per metric, in one place; the metrics themselves are recorded where their
/// events happen.
fn describe_metrics() {
    describe_counter!(
        "sluice_messages_total",
        "Messages settled, by queue and outcome (success, retry, dead_lettered, duplicate, filtered)."
    );
    describe_histogram!("sluice_handler_duration_seconds", "How long handler calls took, by queue.");
    describe_gauge!(
        "sluice_consumer_lag_seconds",
        "Now minus the timestamp of the newest message delivered, by queue."
    );
    describe_gauge!("sluice_queue_depth", "Messages ready in the queue, as last polled.");
    describe_gauge!("sluice_dlq_depth", "Messages in the queue's dead-letter queue, as last polled.");
    describe_gauge!("sluice_queue_consumers", "Consumers attached to the queue (every runner's), as last polled.");
    describe_gauge!("sluice_in_flight", "Deliveries being handled, by queue.");
    describe_gauge!(
        "sluice_keys_blocked",
        "An order_by queue's keys with messages waiting behind a busy or held one, by queue."
    );
    describe_counter!("sluice_retries_total", "Retry copies scheduled, by queue.");
    describe_counter!("sluice_config_reloads_total", "Reloads of the pipeline files, by result (applied, rejected).");
    describe_gauge!("sluice_circuit_state", "The queue's circuit breaker: 0 closed, 1 half-open, 2 open.");
    describe_gauge!(
        "sluice_concurrency_limit",
        "How many handlers of the queue may run at once (adaptive: the current limit)."
    );
    describe_gauge!(
        "sluice_broker_connected",
        "1 for the broker node the runner's session is with, 0 for the other nodes it was given."
    );
    describe_gauge!("sluice_paused", "1 while the queue is paused by hand (sluice pause), else 0.");
}

/// Pauses or resumes a queue for `remote`: 200 with what happened, 404 for a queue not running
/// here. Logged once, whatever happened.
fn set_paused(pauses: &Pauses, queue: &str, paused: bool, remote: SocketAddr) -> (StatusCode, String) {
    let verb = if paused { "paused" } else { "resumed" };
    match pauses.set(queue, paused) {
        Ok(true) => {
            if paused {
                let command = format!("sluice resume {queue}");
                tracing::info!(queue, %remote, command, "paused by hand: consuming stops, in-flight messages finish");
            } else {
                tracing::info!(queue, %remote, "resumed by hand: consuming again");
            }
            (StatusCode::OK, format!("{verb} \"{queue}\"\n"))
        }
        Ok(false) => {
            tracing::info!(queue, %remote, "{verb} by hand, as it already was");
            (StatusCode::OK, format!("\"{queue}\" was already {verb}\n"))
        }
        Err(e) => {
            // The name is the request's, escapes and all: `?` writes it escaped.
            tracing::info!(queue = ?queue, %remote, "asked to be {verb}, but not running here");
            (StatusCode::NOT_FOUND, format!("{}\n", crate::terminal::visible(&e.to_string())))
        }
    }
}

/// What the operator chose about who may use the port, beside the token.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Reads need no token (`--admin-open-reads`).
    pub open_reads: bool,
    /// Host names, beside IP addresses and `localhost`, that requests may be addressed to:
    /// the one `--admin` names and those of `--admin-allowed-hosts`, as [`host_name`] reads them.
    hosts: Vec<String>,
}

impl Policy {
    /// The policy of a port bound as `addr` (`--admin`), with the `allowed` hosts.
    pub fn new(addr: &str, open_reads: bool, allowed: &[String]) -> Policy {
        let hosts = std::iter::once(addr).chain(allowed.iter().map(String::as_str)).filter_map(host_name).collect();
        Policy { open_reads, hosts }
    }

    /// Whether a request with this `Host` is addressed to this port: an IP address (which no
    /// page can rebind), `localhost`, or an allowed name. No `Host` at all is refused.
    fn answers_for(&self, host: Option<&HeaderValue>) -> bool {
        let Some(name) = host.and_then(|h| h.to_str().ok()).and_then(host_name) else { return false };
        name.parse::<IpAddr>().is_ok() || name == "localhost" || self.hosts.contains(&name)
    }
}

/// The host of a `Host` value or a `HOST:PORT` (port optional, IPv6 in brackets): lower case,
/// without the port, the brackets or a final dot; `None` when empty.
fn host_name(value: &str) -> Option<String> {
    let value = value.trim();
    let host = match value.strip_prefix('[') {
        Some(bracketed) => bracketed.split_once(']')?.0,
        None => match value.rsplit_once(':') {
            Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
            _ => value,
        },
    };
    let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    (!host.is_empty()).then_some(host)
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// A `Host` the port does not answer for: a page whose name was rebound to this address.
    ForeignHost,
    /// An `Origin` other than the port's own: a page of another site.
    ForeignOrigin,
    /// No `Authorization: Bearer`.
    NoToken,
    /// A bearer token that is not the runner's.
    WrongToken,
}

impl Refusal {
    fn status(self) -> StatusCode {
        match self {
            Refusal::ForeignHost => StatusCode::MISDIRECTED_REQUEST,
            Refusal::ForeignOrigin => StatusCode::FORBIDDEN,
            Refusal::NoToken | Refusal::WrongToken => StatusCode::UNAUTHORIZED,
        }
    }

    fn why(self) -> &'static str {
        match self {
            Refusal::ForeignHost => {
                "this port does not answer for that host: address it by IP address or as localhost, or name the host with --admin-allowed-hosts"
            }
            Refusal::ForeignOrigin => "writes are not taken from a page of another origin",
            Refusal::NoToken => {
                "this needs Authorization: Bearer with the runner's admin token (reads too, unless the runner has --admin-open-reads)"
            }
            Refusal::WrongToken => "that is not the runner's admin token",
        }
    }
}

/// Whether a request that needs the token, with these headers, may go ahead: from no page or a
/// page of the port's own origin (`http://` and the `Host` asked for), with the runner's token.
fn check(token: &Token, headers: &HeaderMap) -> Result<(), Refusal> {
    if let Some(origin) = headers.get(header::ORIGIN) {
        let own = headers.get(header::HOST).map(|host| [b"http://", host.as_bytes()].concat());
        if own.is_none_or(|own| !origin.as_bytes().eq_ignore_ascii_case(&own)) {
            return Err(Refusal::ForeignOrigin);
        }
    }
    let value = headers.get(header::AUTHORIZATION).ok_or(Refusal::NoToken)?.as_bytes();
    let (scheme, presented) = value.split_at(value.iter().position(|b| *b == b' ').unwrap_or(value.len()));
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return Err(Refusal::NoToken);
    }
    if token.matches(presented.trim_ascii()) { Ok(()) } else { Err(Refusal::WrongToken) }
}

/// Lets one log line through per `every`, counting the others.
#[derive(Debug)]
struct Throttle {
    every: Duration,
    /// When a line was last let through, and how many were held back since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    fn new(every: Duration) -> Throttle {
        Throttle { every, state: Mutex::new((None, 0)) }
    }

    /// At `now`: how many lines were held back since the last one, when this one may be
    /// logged; `None` (and counted) when it may not.
    fn admit(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match state.0 {
            Some(last) if now.saturating_duration_since(last) < self.every => {
                state.1 = state.1.saturating_add(1);
                None
            }
            _ => {
                let held = std::mem::take(&mut state.1);
                state.0 = Some(now);
                Some(held)
            }
        }
    }
}

/// What the guard needs: the token, the policy, and the log's throttle.
#[derive(Debug, Clone)]
struct Access {
    token: Token,
    policy: Arc<Policy>,
    refused: Arc<Throttle>,
}

impl Access {
    /// Whether this request may go ahead.
    fn check(&self, request: &Request) -> Result<(), Refusal> {
        let read = matches!(*request.method(), Method::GET | Method::HEAD);
        let path = request.uri().path();
        if read && PROBES.contains(&path) {
            return Ok(());
        }
        if !self.policy.answers_for(request.headers().get(header::HOST)) {
            return Err(Refusal::ForeignHost);
        }
        if read && (self.policy.open_reads || PUBLIC.contains(&path)) {
            return Ok(());
        }
        check(&self.token, request.headers())
    }
}

/// Lets through what [`Access::check`] allows; answers the rest, and logs them (throttled).
async fn guard(
    State(access): State<Access>,
    ConnectInfo(remote): ConnectInfo<SocketAddr>,
    request: Request,
    next: Next,
) -> Response {
    let Err(refusal) = access.check(&request) else {
        return next.run(request).await;
    };
    if let Some(held) = access.refused.admit(Instant::now()) {
        let (method, path) = (request.method(), request.uri().path());
        let host = request.headers().get(header::HOST).map(|h| String::from_utf8_lossy(h.as_bytes()));
        tracing::warn!(
            %remote,
            %method,
            path,
            host = host.as_deref().unwrap_or(""),
            reason = refusal.why(),
            refused_since_last_line = held,
            "admin request refused"
        );
    }
    let mut response = (refusal.status(), format!("{}\n", refusal.why())).into_response();
    if refusal.status() == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    response
}

/// When the next request of the console or its API may start; locked by the one waiting for
/// its turn, so that they start in the order they came.
#[derive(Clone)]
struct Pace(Arc<tokio::sync::Mutex<tokio::time::Instant>>);

impl Default for Pace {
    fn default() -> Pace {
        Pace(Arc::new(tokio::sync::Mutex::new(Pace::a_second_ago())))
    }
}

impl Pace {
    /// Now less a second: turns not taken while quiet are kept, a second's worth at most.
    fn a_second_ago() -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        now.checked_sub(Duration::from_secs(1)).unwrap_or(now)
    }

    /// When a request starts, `next_at` being when the next may and `earliest` a second ago;
    /// moves `next_at` on.
    fn take<I: Copy + Ord + std::ops::Add<Duration, Output = I>>(next_at: &mut I, earliest: I) -> I {
        let at = (*next_at).max(earliest);
        *next_at = at + Duration::from_secs(1) / PACE;
        at
    }
}

/// Starts `request` in its turn: [`PACE`] a second at most, a quiet second's worth at once.
async fn paced(State(pace): State<Pace>, request: Request, next: Next) -> Response {
    {
        let mut next_at = pace.0.lock().await;
        let at = Pace::take(&mut *next_at, Pace::a_second_ago());
        tokio::time::sleep_until(at).await;
    }
    next.run(request).await
}

/// The routes, `more` (the console and its API, paced) among them, guarded, every answer with
/// the console's security headers.
fn routes(
    metrics: PrometheusHandle,
    readiness: Readiness,
    pauses: Pauses,
    (token, policy): (Token, Policy),
    more: Router,
) -> Router {
    let access = Access { token, policy: Arc::new(policy), refused: Arc::new(Throttle::new(REFUSED_EVERY)) };
    let resumes = pauses.clone();
    Router::new()
        .route("/metrics", get(move || std::future::ready(metrics.render())))
        .route("/healthz", get(|| std::future::ready("ok\n")))
        .route(
            "/readyz",
            get(move || {
                std::future::ready(match readiness.why_not() {
                    None => (StatusCode::OK, "ready\n".to_string()),
                    Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
                })
            }),
        )
        .route(
            "/queues/{name}/pause",
            post(move |ConnectInfo(remote), Path(name): Path<String>| {
                std::future::ready(set_paused(&pauses, &name, true, remote))
            }),
        )
        .route(
            "/queues/{name}/resume",
            post(move |ConnectInfo(remote), Path(name): Path<String>| {
                std::future::ready(set_paused(&resumes, &name, false, remote))
            }),
        )
        .merge(more.layer(axum::middleware::from_fn_with_state(Pace::default(), paced)))
        .layer(axum::middleware::from_fn_with_state(access, guard))
        .layer(axum::middleware::map_response(console::secure))
}

/// Serves the admin endpoints, and `more` (the console and its API), on `listener` until
/// `shutdown`; what is not open needs `token` (from `source`, named in the log), as `policy`
/// says.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: PrometheusHandle,
    readiness: Readiness,
    pauses: Pauses,
    (token, source, policy): (Token, Source, Policy),
    more: Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let open_reads = policy.open_reads;
    let app = routes(metrics, readiness, pauses, (token, policy), more);
    let addr = listener.local_addr()?;
    tracing::info!(
        %addr,
        token = %source,
        console = %format_args!("http://{addr}/"),
        open_reads,
        "admin endpoint listening (the console at /, /api/v1/, /metrics, /healthz, /readyz, /queues/NAME/pause|resume); all but the metrics, health and the console's files need the token"
    );
    if !addr.ip().is_loopback() {
        if open_reads {
            tracing::warn!(
                %addr,
                "the admin endpoint is open to the network with --admin-open-reads: whoever reaches it reads the queues, recent attempts and dead-lettered messages (writes still need the token)"
            );
        } else {
            tracing::info!(%addr, "the admin endpoint is open to the network: its metrics and health are open, the rest needs the token");
        }
    }
    let held = Held::default();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(HEAD_TIMEOUT);
    let (mut crowded, mut warned) = (Crowded::default(), None::<Instant>);
    let refused_held = Arc::new(AtomicUsize::new(0));
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.cancelled() => return Ok(()),
        };
        let (stream, remote) = match accepted {
            Ok(accepted) => accepted,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // Out of file descriptors, most likely: wait for some to be closed.
                tracing::warn!(error = %e, "admin endpoint cannot accept a connection");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    () = shutdown.cancelled() => return Ok(()),
                }
            }
        };
        let admitted = held.admit(remote.ip(), &mut crowded);
        if crowded.any() && warned.is_none_or(|at| at.elapsed() >= CROWDED_EVERY) {
            tracing::warn!(
                limit = MAX_CONNECTIONS,
                per_address = PER_PEER,
                idle_closed = crowded.evicted,
                refused = crowded.refused,
                "admin endpoint full: closing the longest-held idle connections for new ones, and new ones while all are busy"
            );
            (crowded, warned) = (Crowded::default(), Some(Instant::now()));
        }
        let Some(slot) = admitted else {
            hold_refused(stream, &refused_held);
            continue;
        };
        let app = app.clone();
        let busy = slot.busy.clone();
        let service = hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
            request.extensions_mut().insert(ConnectInfo(remote));
            let under_way = Busy::enter(&busy);
            let response = app.clone().oneshot(request.map(axum::body::Body::new));
            async move {
                let response = response.await?;
                // Busy until the answer is written (or the connection dropped).
                Ok::<_, std::convert::Infallible>(response.map(|body| Answer { body, _busy: under_way }))
            }
        });
        let connection = http.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            // Ended by the client, a timeout, its lifetime, or a new connection that took its
            // place: nothing to report.
            tokio::select! {
                _ = tokio::time::timeout(LIFETIME, connection) => {}
                () = slot.evicted.cancelled() => {}
            }
            drop(slot);
        });
        // The connection's turn to read what it sent (busy once its head is in) before the
        // next is accepted: in a flood of connections, one that sent a request at once is then
        // never the longest-held idle one.
        tokio::task::yield_now().await;
    }
}

/// Closes a refused connection after [`REFUSED_HOLD`], or at once when [`REFUSED_HELD`] are
/// held already (dropping the stream closes it).
fn hold_refused(stream: tokio::net::TcpStream, held: &Arc<AtomicUsize>) {
    if held.fetch_add(1, Ordering::SeqCst) >= REFUSED_HELD {
        held.fetch_sub(1, Ordering::SeqCst);
        return;
    }
    let held = held.clone();
    tokio::spawn(async move {
        tokio::time::sleep(REFUSED_HOLD).await;
        drop(stream);
        held.fetch_sub(1, Ordering::SeqCst);
    });
}

/// The admin connections open, by the order they came in.
#[derive(Clone, Default)]
struct Held(Arc<Mutex<HeldInner>>);

#[derive(Default)]
struct HeldInner {
    next: u64,
    open: BTreeMap<u64, Open>,
}

/// An open connection as [`Held`] sees it.
struct Open {
    peer: IpAddr,
    /// Requests under way on it (their answers not yet written).
    busy: Arc<AtomicUsize>,
    /// Closes it, to make room.
    evict: CancellationToken,
}

/// A connection's place in [`Held`], given up when dropped.
struct Slot {
    held: Held,
    id: u64,
    busy: Arc<AtomicUsize>,
    evicted: CancellationToken,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.held.lock().open.remove(&self.id);
    }
}

/// What [`Held::admit`] did about a full port, counted until it is next logged.
#[derive(Debug, Default)]
struct Crowded {
    /// Idle connections closed for new ones.
    evicted: u64,
    /// New connections closed, all others busy.
    refused: u64,
}

impl Crowded {
    fn any(&self) -> bool {
        self.evicted + self.refused > 0
    }
}

impl Held {
    fn lock(&self) -> MutexGuard<'_, HeldInner> {
        // Nothing panics while holding it; the map stays valid.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for a new connection from `peer`: past a bound, the longest-held idle
    /// connection (of `peer`, when it is `peer`'s bound) is closed for it; None when all are
    /// busy.
    fn admit(&self, peer: IpAddr, crowded: &mut Crowded) -> Option<Slot> {
        let peer = peer.to_canonical();
        let mut inner = self.lock();
        let of_peer = inner.open.values().filter(|o| o.peer == peer).count();
        let full =
            if of_peer >= PER_PEER { Some(Some(peer)) } else { (inner.open.len() >= MAX_CONNECTIONS).then_some(None) };
        if let Some(among) = full {
            let idle = |o: &Open| among.is_none_or(|p| o.peer == p) && o.busy.load(Ordering::SeqCst) == 0;
            let Some(oldest) = inner.open.iter().find(|(_, o)| idle(o)).map(|(id, _)| *id) else {
                crowded.refused += 1;
                return None;
            };
            if let Some(open) = inner.open.remove(&oldest) {
                open.evict.cancel();
                crowded.evicted += 1;
            }
        }
        inner.next += 1;
        let (id, busy, evicted) = (inner.next, Arc::new(AtomicUsize::new(0)), CancellationToken::new());
        inner.open.insert(id, Open { peer, busy: busy.clone(), evict: evicted.clone() });
        Some(Slot { held: self.clone(), id, busy, evicted })
    }
}

/// One request under way on a connection, from its head to the end of its answer.
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn enter(busy: &Arc<AtomicUsize>) -> Busy {
        busy.fetch_add(1, Ordering::SeqCst);
        Busy(busy.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An answer's body, its request [`Busy`] until it is written whole or dropped.
struct Answer {
    body: axum::body::Body,
    _busy: Busy,
}

impl hyper::body::Body for Answer {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// An accept error that concerns one connection only, not the listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request's headers, by name and value.
    type Headers = &'static [(&'static str, &'static str)];

    /// Issue 31 item 9: requests of the console and its API start at most [`PACE`] a second:
    /// after a quiet second, a second's worth at once, then one every 1/PACE s; a pause gives
    /// its turns back, a second's worth at most.
    #[test]
    fn requests_start_at_the_pace() {
        let spacing = Duration::from_secs(1) / PACE;
        // Durations since an origin stand for instants.
        let origin = Duration::from_secs(100);
        let mut next_at = origin - Duration::from_secs(1);
        let second = Duration::from_secs(1);
        let starts: Vec<Duration> = (0..PACE + 3).map(|_| Pace::take(&mut next_at, origin - second)).collect();
        assert!(starts[..PACE as usize].iter().all(|s| *s <= origin), "a quiet second's worth at once");
        assert_eq!(starts[PACE as usize..], [origin, origin + spacing, origin + spacing * 2]);
        // Quiet for a long time: a second's worth again, no more.
        let later = origin + Duration::from_secs(60);
        let starts: Vec<Duration> = (0..=PACE).map(|_| Pace::take(&mut next_at, later - second)).collect();
        assert_eq!(starts.iter().filter(|s| **s < later).count(), PACE as usize);
        assert_eq!(starts[PACE as usize], later);
    }

    /// Issue 31 item 10: past its bound, a peer's new connection takes the place of its own
    /// longest-held idle one, and past the port's bound, of the longest-held idle one of any
    /// peer; busy ones are never closed for it.
    #[test]
    fn a_new_connection_takes_the_place_of_the_longest_held_idle_one() {
        let held = Held::default();
        let mut crowded = Crowded::default();
        let peer = |n: u8| IpAddr::from([10, 0, 0, n]);
        let mut admit = |n: u8| held.admit(peer(n), &mut crowded);
        let first: Vec<Slot> = (0..PER_PEER).map(|_| admit(1).expect("room")).collect();
        first[0].busy.store(1, Ordering::SeqCst);
        let next = admit(1).expect("room made");
        assert!(!first[0].evicted.is_cancelled(), "busy: kept");
        assert!(first[1].evicted.is_cancelled(), "the longest-held idle one of the peer made room");
        assert!(first[2..].iter().all(|s| !s.evicted.is_cancelled()));
        for slot in first.iter().chain([&next]) {
            slot.busy.store(1, Ordering::SeqCst);
        }
        assert!(admit(1).is_none(), "all busy: the new one is refused");
        // Other peers fill the port; then a new one closes the longest-held idle one of any.
        let others: Vec<Slot> =
            (2..).take(3).flat_map(|n| (0..PER_PEER).map(move |_| n)).map(|n| admit(n).expect("room")).collect();
        assert_eq!(held.lock().open.len(), MAX_CONNECTIONS);
        let _late = admit(9).expect("room made");
        assert!(others[0].evicted.is_cancelled(), "the longest-held idle one made room");
        assert_eq!(held.lock().open.len(), MAX_CONNECTIONS);
        drop(next);
        assert_eq!(held.lock().open.len(), MAX_CONNECTIONS - 1, "a connection ended gives its place up");
        assert_eq!((crowded.evicted, crowded.refused), (2, 1));
    }

    #[test]
    fn writes_need_the_token_and_no_foreign_origin() {
        let token = token::Given { file: None, env: Some("s3cret".into()) }
            .for_runner(std::path::Path::new("/nonexistent"))
            .expect("token")
            .0;
        const HOST: (&str, &str) = ("host", "127.0.0.1:9464");
        let cases: &[(Headers, Result<(), Refusal>)] = &[
            (&[HOST], Err(Refusal::NoToken)),
            (&[HOST, ("authorization", "Bearer s3cret")], Ok(())),
            (&[HOST, ("authorization", "bearer   s3cret ")], Ok(())),
            (&[HOST, ("authorization", "Bearer s3cre")], Err(Refusal::WrongToken)),
            (&[HOST, ("authorization", "Bearer s3cret2")], Err(Refusal::WrongToken)),
            (&[HOST, ("authorization", "Bearer")], Err(Refusal::WrongToken)),
            (&[HOST, ("authorization", "s3cret")], Err(Refusal::NoToken)),
            (&[HOST, ("authorization", "Basic s3cret")], Err(Refusal::NoToken)),
            (&[HOST, ("cookie", "token=s3cret")], Err(Refusal::NoToken)),
            (&[HOST, ("authorization", "Bearer s3cret"), ("origin", "http://127.0.0.1:9464")], Ok(())),
            (&[HOST, ("authorization", "Bearer s3cret"), ("origin", "HTTP://127.0.0.1:9464")], Ok(())),
            (
                &[HOST, ("authorization", "Bearer s3cret"), ("origin", "http://evil.example")],
                Err(Refusal::ForeignOrigin),
            ),
            (
                &[HOST, ("authorization", "Bearer s3cret"), ("origin", "http://127.0.0.1:9465")],
                Err(Refusal::ForeignOrigin),
            ),
            (
                &[HOST, ("authorization", "Bearer s3cret"), ("origin", "https://127.0.0.1:9464")],
                Err(Refusal::ForeignOrigin),
            ),
            (&[HOST, ("authorization", "Bearer s3cret"), ("origin", "null")], Err(Refusal::ForeignOrigin)),
            (&[("authorization", "Bearer s3cret"), ("origin", "http://127.0.0.1:9464")], Err(Refusal::ForeignOrigin)),
            (&[HOST, ("origin", "http://evil.example")], Err(Refusal::ForeignOrigin)),
        ];
        for (headers, expected) in cases {
            let mut map = HeaderMap::new();
            for (name, value) in *headers {
                map.append(*name, HeaderValue::from_static(value));
            }
            assert_eq!(check(&token, &map), *expected, "{headers:?}");
        }
    }

    /// Issue 31 item 2: a request is answered when addressed to an IP address (no page can
    /// rebind one), `localhost`, the `--admin` name or an allowed one; not to another name
    /// (a DNS-rebinding page's), nor without a host.
    #[test]
    fn requests_are_answered_for_addresses_localhost_and_allowed_names_only() {
        let policy = Policy::new("sluice-host:9464", false, &["Ops.Example.".into(), "proxy.example:8443".into()]);
        let cases = [
            ("127.0.0.1:9464", true),
            ("10.1.2.3", true),
            ("[::1]:9464", true),
            ("[fe80::1]", true),
            ("localhost", true),
            ("LocalHost:9464", true),
            ("localhost.:9464", true),
            ("sluice-host:9464", true),
            ("ops.example", true),
            ("OPS.EXAMPLE:1", true),
            ("proxy.example", true),
            ("attacker.example", false),
            ("attacker.example:9464", false),
            ("localhost.attacker.example", false),
            ("127.0.0.1.attacker.example", false),
            ("sluice-host.attacker.example", false),
            ("", false),
            (":9464", false),
            ("[::1", false),
        ];
        for (host, answered) in cases {
            let value = HeaderValue::from_static(host);
            assert_eq!(policy.answers_for(Some(&value)), answered, "{host:?}");
        }
        assert!(!policy.answers_for(None), "no Host");
    }

    /// Issue 31 (low): refused requests log one line per interval, the next one counting those
    /// held back (5,000 refused writes once logged 5,000 lines).
    #[test]
    fn refusals_are_logged_once_per_interval_with_the_count_held_back() {
        let throttle = Throttle::new(Duration::from_secs(10));
        let start = Instant::now();
        assert_eq!(throttle.admit(start), Some(0));
        for ms in 1..5000 {
            assert_eq!(throttle.admit(start + Duration::from_millis(ms)), None);
        }
        assert_eq!(throttle.admit(start + Duration::from_secs(10)), Some(4999));
        assert_eq!(throttle.admit(start + Duration::from_secs(11)), None);
        assert_eq!(throttle.admit(start + Duration::from_secs(25)), Some(1));
        assert_eq!(throttle.admit(start + Duration::from_secs(40)), Some(0));
    }
}
