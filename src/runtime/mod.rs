//! `sluice run`: supervises a broker session (connect with backoff, declare, one worker per
//! queue, reconnect when the session is lost) and drains on shutdown.
//!
//! Generic over [`Broker`]: nothing here knows RabbitMQ.

pub mod backoff;
mod events;
pub mod worker;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::admin::Readiness;
use crate::broker::{Broker, BrokerError};
use crate::config::Config;
use crate::dedup::Store;
use crate::topology::{self, Plan, Role};
use worker::{Activity, Worker};

/// How `run` behaves beyond the config.
#[derive(Debug, Clone)]
pub struct Options {
    /// How long in-flight handlers may take to finish on shutdown.
    pub shutdown_grace: Duration,
    /// Exit once every queue (and every pending retry) is empty and nothing is in flight.
    pub exit_when_idle: bool,
    /// Set while connected and consuming (`/readyz`).
    pub readiness: Readiness,
}

/// Why `run` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

/// Runs the pipeline until `shutdown` is cancelled (or, with `exit_when_idle`, until idle).
/// `connect` opens a new broker session; it is called again after a session is lost.
pub async fn run<B, C, F>(
    config: Arc<Config>,
    connect: C,
    store: Option<Store>,
    options: Options,
    shutdown: CancellationToken,
) -> Result<(), RunError>
where
    B: Broker,
    C: Fn() -> F,
    F: Future<Output = Result<B, BrokerError>>,
{
    let plan = topology::plan(&config);
    let client = crate::handler::webhook::client().map_err(|e| RunError::Client(e.to_string()))?;
    let activity = Arc::new(Activity::default());
    let tracker = TaskTracker::new();
    let workers: Vec<Arc<Worker>> = config
        .queues
        .keys()
        .map(|name| Arc::new(Worker::new(config.clone(), name, client.clone(), activity.clone(), store.clone())))
        .collect();
    // Sessions that fail in a row; reset only by a session that lived STABLE_SESSION, so a
    // broker that accepts and then drops every session is not hammered.
    let mut failures = 0u32;
    let mut declared_once = false;
    loop {
        if failures > 0 {
            let delay = backoff::reconnect_delay(failures, RECONNECT_CAP, &mut rand::rng());
            info!(retry_in = ?delay, failures, "reconnecting to the broker after a pause");
            if sleep_or_shutdown(delay, &shutdown).await {
                break;
            }
        }
        let session = tokio::select! {
            _ = shutdown.cancelled() => break,
            s = connect() => s,
        };
        let broker = match session {
            Ok(b) => b,
            Err(e) if e.is_fatal() && !declared_once => return Err(e.into()),
            Err(e) => {
                failures += 1;
                warn!(error = %e, "broker unreachable");
                continue;
            }
        };
        match broker.declare(&plan).await {
            Ok(()) => {}
            Err(e) if e.is_fatal() => {
                broker.close().await;
                return Err(e.into());
            }
            Err(e) => {
                failures += 1;
                warn!(error = %e, "declaring the topology failed");
                broker.close().await;
                continue;
            }
        }
        info!(queues = workers.len(), reconnect = declared_once, "topology declared; starting workers");
        declared_once = true;
        let session_started = Instant::now();
        let stop = shutdown.child_token();
        let mut running = JoinSet::new();
        for w in &workers {
            running.spawn(w.clone().run(broker.clone(), stop.clone(), tracker.clone()));
        }
        {
            let (broker, config, stop) = (broker.clone(), config.clone(), stop.clone());
            running.spawn(async move {
                poll_depths(&broker, &config, &stop).await;
                Ok(())
            });
        }
        options.readiness.set(true);
        if options.exit_when_idle {
            let (broker, plan, activity, stop) = (broker.clone(), plan.clone(), activity.clone(), stop.clone());
            running.spawn(async move {
                watch_idle(&broker, &plan, &activity, &stop).await;
                Ok(())
            });
        }
        let mut lost = None;
        // Workers return only once their deliveries are settled, so the grace, counted from
        // shutdown, bounds waiting for them as well as for the delivery tasks.
        let mut deadline = None;
        loop {
            let result = tokio::select! {
                result = running.join_next() => match result {
                    Some(result) => result,
                    None => break,
                },
                () = shutdown.cancelled(), if deadline.is_none() => {
                    deadline = Some(Instant::now() + options.shutdown_grace);
                    continue;
                }
                () = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => break,
            };
            match result {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    lost.get_or_insert(e);
                    stop.cancel();
                }
                Err(e) => {
                    error!(error = %e, "worker task failed");
                    stop.cancel();
                }
            }
        }
        options.readiness.set(false);
        match lost {
            Some(e) if !shutdown.is_cancelled() => {
                error!(error = %e, "broker session lost; reconnecting");
                broker.close().await;
                if session_started.elapsed() >= STABLE_SESSION {
                    failures = 0;
                }
                failures += 1;
            }
            _ => {
                let deadline = deadline.unwrap_or_else(|| Instant::now() + options.shutdown_grace);
                drain(&tracker, deadline, options.shutdown_grace, &activity.in_flight).await;
                broker.close().await;
                return Ok(());
            }
        }
    }
    drain(&tracker, Instant::now() + options.shutdown_grace, options.shutdown_grace, &activity.in_flight).await;
    Ok(())
}

/// Waits until `deadline` for the delivery tasks; what is still unfinished then goes back to
/// the broker when the session closes.
async fn drain(tracker: &TaskTracker, deadline: Instant, grace: Duration, in_flight: &AtomicUsize) {
    tracker.close();
    if tokio::time::timeout_at(deadline, tracker.wait()).await.is_err() {
        warn!(
            in_flight = in_flight.load(Ordering::SeqCst),
            ?grace,
            "shutdown grace expired; unfinished messages go back to the broker"
        );
    }
}

/// The longest pause between two attempts to reach the broker.
const RECONNECT_CAP: Duration = Duration::from_secs(30);

/// A session that lived this long was a success: the next failure starts the backoff afresh.
const STABLE_SESSION: Duration = Duration::from_secs(30);

/// How long after its due time a delayed copy may still be on its way back through the broker's
/// dead-lettering before `--exit-when-idle` stops waiting for it.
const DELAY_SLACK: Duration = Duration::from_secs(2);

/// How often queue and dead-letter depths are read for the metrics.
const DEPTH_POLL: Duration = Duration::from_secs(5);

/// Reads every queue's depth and its dead-letter queue's (passive declares, no management
/// plugin needed) into the metrics until `stop`.
async fn poll_depths<B: Broker>(broker: &B, config: &Config, stop: &CancellationToken) {
    loop {
        for q in config.queues.values() {
            if let (Ok(depth), Ok(dlq)) = (broker.depth(&q.name).await, broker.depth(&q.dead_letter).await) {
                events::depths(&q.name, depth, &q.dead_letter, dlq);
            }
        }
        if sleep_or_shutdown(DEPTH_POLL, stop).await {
            return;
        }
    }
}

/// Sleeps; true if shutdown came first.
async fn sleep_or_shutdown(delay: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(delay) => false,
    }
}

/// Cancels `stop` once every work and delay queue is empty and nothing is in flight, twice in
/// a row (a message between two hops of the cascade must not look like idleness).
async fn watch_idle<B: Broker>(broker: &B, plan: &Plan, activity: &Activity, stop: &CancellationToken) {
    let queues: Vec<&str> =
        plan.queues.iter().filter(|q| q.role != Role::DeadLetter).map(|q| q.name.as_str()).collect();
    let mut idle_polls = 0;
    while !stop.is_cancelled() {
        if sleep_or_shutdown(Duration::from_millis(250), stop).await {
            return;
        }
        let mut idle = activity.is_quiet(DELAY_SLACK);
        for q in &queues {
            if !idle {
                break;
            }
            idle = matches!(broker.depth(q).await, Ok(0));
        }
        idle_polls = if idle && activity.is_quiet(DELAY_SLACK) { idle_polls + 1 } else { 0 };
        if idle_polls >= 3 {
            info!("every queue is drained; exiting (--exit-when-idle)");
            stop.cancel();
        }
    }
}
