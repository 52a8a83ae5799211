//! The admin HTTP endpoint: `/metrics` (Prometheus text format), `/healthz` (the process is
//! alive), `/readyz` (connected to the broker and consuming, and no queue's acks failing; else
//! 503 saying which), `POST /queues/{name}/pause` and `/resume` (what `sluice pause|resume`
//! call), the operator console at `/` ([`console`]) and the JSON API it uses under `/api/v1/`
//! ([`api`]).
//!
//! Reads (GET, HEAD) are open to whoever reaches the port. Every other request is a write: it
//! needs `Authorization: Bearer` with the runner's [`token`], and is refused when it carries an
//! `Origin` other than the port's own (a page of another site in the operator's browser). A
//! write route logs what it did once, naming the remote address; a refused one is logged here.
//! No cookie is ever set or read, so a browser adds no credentials of its own.
//!
//! The port must never cost the data path its file descriptors or its time, and idle or slow
//! clients must never keep a scrape out: it holds at most [`MAX_CONNECTIONS`] connections, at
//! most [`PER_PEER`] from one address. A new connection past either bound takes the place of
//! the longest-held idle one (no request under way: a slowloris one sending its head a byte at
//! a time, a keep-alive one waiting), of that address when it is the address's bound; when all
//! are busy, the new one is closed. A connection that sends no complete request head within
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
const CROWDED_EVERY: Duration = Duration::from_secs(60);

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

/// Why a write was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
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
            Refusal::ForeignOrigin => StatusCode::FORBIDDEN,
            Refusal::NoToken | Refusal::WrongToken => StatusCode::UNAUTHORIZED,
        }
    }

    fn why(self) -> &'static str {
        match self {
            Refusal::ForeignOrigin => "writes are not taken from a page of another origin",
            Refusal::NoToken => "writes need Authorization: Bearer with the runner's admin token",
            Refusal::WrongToken => "that is not the runner's admin token",
        }
    }
}

/// Whether a write with these headers may go ahead: from no page or a page of the port's own
/// origin (`http://` and the `Host` asked for), with the runner's token.
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

/// Lets reads through, and writes that pass [`check`]; answers and logs the others.
async fn guard_writes(
    State(token): State<Token>,
    ConnectInfo(remote): ConnectInfo<SocketAddr>,
    request: Request,
    next: Next,
) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD) {
        return next.run(request).await;
    }
    let Err(refusal) = check(&token, request.headers()) else {
        return next.run(request).await;
    };
    let (method, path) = (request.method(), request.uri().path());
    tracing::warn!(%remote, %method, path, reason = refusal.why(), "admin write refused");
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

/// The routes, `more` (the console and its API, paced) among them, writes guarded, every
/// answer with the console's security headers.
fn routes(metrics: PrometheusHandle, readiness: Readiness, pauses: Pauses, token: Token, more: Router) -> Router {
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
        .layer(axum::middleware::from_fn_with_state(token, guard_writes))
        .layer(axum::middleware::map_response(console::secure))
}

/// Serves the admin endpoints, and `more` (the console and its API), on `listener` until
/// `shutdown`; writes need `token` (from `source`, named in the log).
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: PrometheusHandle,
    readiness: Readiness,
    pauses: Pauses,
    (token, source): (Token, Source),
    more: Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = routes(metrics, readiness, pauses, token, more);
    let addr = listener.local_addr()?;
    tracing::info!(
        %addr,
        token = %source,
        console = %format_args!("http://{addr}/"),
        "admin endpoint listening (the console at /, /api/v1/, /metrics, /healthz, /readyz, /queues/NAME/pause|resume); writes need the token"
    );
    if !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "the admin endpoint is open to the network: whoever reaches it reads the metrics, health, queues, recent attempts and dead-lettered messages (writes still need the token)"
        );
    }
    let held = Held::default();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(HEAD_TIMEOUT);
    let (mut crowded, mut warned) = (Crowded::default(), None::<Instant>);
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
        // Dropping the stream closes it.
        let Some(slot) = admitted else { continue };
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
}
