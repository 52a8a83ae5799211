//! `sluice run` put together, once its pipeline files are loaded: the broker opened (the
//! embedded broker's file once, for its sessions and its idempotency keys alike), the
//! idempotency store, the admin port, signals, reloads, and the runtime on the sessions
//! [`super::assemble`] makes. Nothing here parses arguments or loads the files.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use super::kinds::{Directory, RedisServer, persistence_line};
use super::{Dial, Endpoint, Job, Sessions};
use crate::admin::api::Connect;
use crate::admin::token;
use crate::broker::embedded::Embedded;
use crate::broker::redis::{Checks as RedisChecks, Purpose, Redis};
use crate::broker::{Broker as _, Operate, amqp};
use crate::call;
use crate::config::Config;
use crate::dedup::{self, Location, Store};
use crate::reload::{self, Reloads};
use crate::runtime;

/// What `run` was given, its pipeline files loaded and ready to run.
pub struct Runner<'a> {
    pub paths: Vec<PathBuf>,
    pub config: Config,
    /// The reload requests, listened for since before the files were loaded.
    pub requests: Reloads,
    pub endpoint: Endpoint<'a>,
    /// The broker as logs and messages name it.
    pub broker: String,
    pub timeouts: amqp::Timeouts,
    /// `--dedup`, when given.
    pub dedup: Option<Location>,
    pub allow_evicting_redis: bool,
    /// The admin port's address, the token the operator gave, and who may read.
    pub admin: Option<(String, token::Given, crate::admin::Policy)>,
    pub options: runtime::Options,
    /// The version the admin API and the start line report.
    pub version: &'static str,
}

/// Runs until shut down (or idle, with `--exit-when-idle`).
pub async fn run(runner: Runner<'_>) -> anyhow::Result<()> {
    let Runner {
        paths,
        config,
        requests,
        endpoint,
        broker,
        timeouts,
        dedup,
        allow_evicting_redis,
        admin,
        options,
        version,
    } = runner;
    // One writer for the runner's sessions with the embedded broker and its idempotency keys.
    let file = match &endpoint {
        Endpoint::Embedded(Directory(dir)) => {
            Some(Embedded::open_dir(dir).with_context(|| format!("broker {broker}"))?)
        }
        _ => None,
    };
    // A Redis that cannot serve is refused first, in its own words (a wrong password is no
    // fault of the idempotency store beside it), and reconnects check it again.
    let redis = RedisChecks::new(Purpose::Run, allow_evicting_redis);
    let persistence = match &endpoint {
        Endpoint::Redis(RedisServer(url)) => {
            let session = Redis::open(url, &redis).await?;
            let persistence = session.persistence().await;
            session.close().await;
            Some(persistence_line(persistence))
        }
        _ => None,
    };
    // Beside a Redis broker, its keys live in the same deployment (prefix included).
    let dedup = match (dedup, &endpoint) {
        (Some(location), _) => location,
        (None, Endpoint::Redis(RedisServer(url))) => Location::Redis(url.to_string()),
        (None, _) => Location::File(endpoint.state_dir()),
    };
    if let Location::File(dir) = &dedup {
        if dedup::is_old_store(dir) {
            anyhow::bail!("{}", dedup::old_store_advice(dir));
        }
        if dedup::is_old_store(&dir.join("dedup")) {
            tracing::warn!("{}", dedup::old_store_advice(&dir.join("dedup")));
        }
    }
    // Commands and future reloads may name queues idempotency is off for today.
    let store = if config.queues.values().any(|q| q.idempotency.is_some()) {
        Some(match (&file, &endpoint, &dedup) {
            (Some(file), Endpoint::Embedded(Directory(broker_dir)), Location::File(dir))
                if same_dir(broker_dir, dir) =>
            {
                Store::in_broker(file)
            }
            (_, Endpoint::Redis(RedisServer(broker)), Location::Redis(keys)) if same_deployment(broker, keys) => {
                open_store(&dedup, allow_evicting_redis).await?.riding_redis_acks()
            }
            _ => open_store(&dedup, allow_evicting_redis).await?,
        })
    } else {
        None
    };
    let shutdown = CancellationToken::new();
    let forced = CancellationToken::new();
    tokio::spawn(signals(shutdown.clone(), forced.clone()));
    let admin = match admin {
        Some((addr, token, policy)) => {
            let (token, source) = token.for_runner(&endpoint.state_dir())?;
            let metrics = crate::admin::install_recorder().map_err(anyhow::Error::msg)?;
            let listener = tokio::net::TcpListener::bind(addr.as_str())
                .await
                .with_context(|| format!("cannot listen on {addr} for the admin endpoint"))?;
            Some(AdminPort { listener, metrics, access: (token, source, policy) })
        }
        None => None,
    };
    let queues: Vec<&str> = config.queues.keys().map(String::as_str).collect();
    let dedup = match (&store, &dedup) {
        (None, _) => "none".to_string(),
        (Some(_), Location::File(dir)) => dir.display().to_string(),
        (Some(_), Location::Redis(url)) => amqp::redact(url),
    };
    tracing::info!(
        version,
        broker = %broker,
        queues = %queues.join(", "),
        dedup = %dedup,
        persistence = persistence.as_ref().map(|(text, _)| text.as_str()),
        "starting"
    );
    if let Some((_, Some(warning))) = &persistence {
        tracing::warn!("{warning}");
    }
    let (reload, reloads) = tokio::sync::mpsc::unbounded_channel();
    let mut requests = requests;
    requests.set_paths(reload::loader::watched(&paths, &config));
    let config = Arc::new(config);
    let current = reload::loader::Current::new(config.clone());
    let capabilities = endpoint.capabilities();
    tokio::spawn(reload::loader::serve(paths, capabilities, requests, reload, current.clone(), shutdown.clone()));
    // `/readyz` says why a session does not open (a Redis server refused).
    let readiness = options.readiness.clone();
    let dial = Dial { timeouts, redis: &redis, embedded: file.as_ref(), readiness: Some(&readiness), give_up: false };
    let handlers: Arc<dyn call::Execute> = Arc::new(call::Handlers::new()?);
    let running = Running { config, handlers, store, options, reloads, shutdown, admin, current, version };
    tokio::select! {
        result = super::assemble(&endpoint, &dial, running) => result,
        // Returning drops the handlers under way, killing their process groups; the broker
        // gets their messages back when the connection goes.
        () = forced.cancelled() => anyhow::bail!(
            "a second signal during the graceful shutdown: stopped at once; messages in flight go back to the broker"
        ),
    }
}

/// The runtime on the broker's sessions, beside the admin port when there is one.
struct Running {
    config: Arc<Config>,
    handlers: Arc<dyn call::Execute>,
    store: Option<Store>,
    options: runtime::Options,
    reloads: tokio::sync::mpsc::UnboundedReceiver<runtime::Reload>,
    shutdown: CancellationToken,
    admin: Option<AdminPort>,
    current: reload::loader::Current,
    version: &'static str,
}

impl Job for Running {
    type Output = ();

    async fn run<B: Operate>(self, sessions: Sessions<'_, B>, reconnect: Connect<B>) -> anyhow::Result<()> {
        let Running { config, handlers, store, options, reloads, shutdown, admin, current, version } = self;
        if let Some(port) = admin {
            port.spawn(reconnect, &options, current, version, shutdown.clone());
        }
        Ok(runtime::run(config, sessions, handlers, store, options, reloads, shutdown).await?)
    }
}

async fn open_store(location: &Location, allow_evicting_redis: bool) -> anyhow::Result<Store> {
    Store::open(location, allow_evicting_redis).await.context("cannot open the idempotency store")
}

/// Whether two Redis URLs name one deployment: one server, one key prefix.
fn same_deployment(a: &str, b: &str) -> bool {
    use crate::broker::redis::Location;
    matches!((Location::parse(a), Location::parse(b)), (Ok(a), Ok(b)) if a.url == b.url && a.prefix == b.prefix)
}

/// Whether two paths name one directory (both exist).
fn same_dir(a: &Path, b: &Path) -> bool {
    matches!((std::fs::canonicalize(a), std::fs::canonicalize(b)), (Ok(a), Ok(b)) if a == b)
}

/// The admin port, bound, with its metrics, token and policy; served once the broker is known.
struct AdminPort {
    listener: tokio::net::TcpListener,
    metrics: metrics_exporter_prometheus::PrometheusHandle,
    access: (token::Token, token::Source, crate::admin::Policy),
}

impl AdminPort {
    /// Serves the admin endpoints and the console, whose API reaches the broker through `connect`.
    fn spawn<B: Operate>(
        self,
        connect: Connect<B>,
        options: &runtime::Options,
        current: reload::loader::Current,
        version: &'static str,
        shutdown: CancellationToken,
    ) {
        let api = crate::admin::api::Api::new(
            crate::admin::api::Runner::this(version),
            current,
            options.attempts.clone(),
            options.pauses.clone(),
            connect,
        );
        let more = crate::admin::api::routes::<B>().router(Arc::new(api)).merge(crate::admin::console::routes());
        let (readiness, pauses) = (options.readiness.clone(), options.pauses.clone());
        tokio::spawn(async move {
            let served =
                crate::admin::serve(self.listener, self.metrics, readiness, pauses, self.access, more, shutdown);
            if let Err(e) = served.await {
                tracing::error!(error = %e, "admin endpoint failed");
            }
        });
    }
}

/// Cancels `shutdown` on the first SIGTERM or SIGINT, and `forced` on the second.
async fn signals(shutdown: CancellationToken, forced: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(term), Ok(int)) => (term, int),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM and SIGINT");
            return;
        }
    };
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(
        signal = name,
        "shutting down: no new messages, finishing in-flight ones (a second signal stops at once)"
    );
    shutdown.cancel();
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    forced.cancel();
}
