//! `sluice run`: a running topology (vector's design). Each running queue owns its consumer,
//! its delivery tasks, its stop token and its ack loop, so one queue can be drained and
//! replaced without touching the others. One apply path, `apply(diff(old, new))`, serves
//! start-up (old = empty), reconnect (a new session starts from empty again) and reload.
//! The supervisor opens sessions with backoff and reopens them when one is lost.
//!
//! Generic over [`Broker`]: nothing here knows RabbitMQ.

mod aimd;
pub mod backoff;
mod breaker;
mod events;
pub mod gate;
pub mod outcome;
pub mod worker;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::admin::Readiness;
use crate::broker::{Broker, BrokerError};
use crate::config::Config;
use crate::dedup::Store;
use crate::topology::{self, Diff};
use gate::Pauses;
use worker::{Activity, Worker};

/// How `run` behaves beyond the config.
#[derive(Debug, Clone)]
pub struct Options {
    /// How long in-flight handlers may take to finish when their queue stops (shutdown, reload).
    pub shutdown_grace: Duration,
    /// Exit once every queue (and every pending retry) is empty and nothing is in flight.
    pub exit_when_idle: bool,
    /// Set while connected and consuming (`/readyz`).
    pub readiness: Readiness,
    /// The queues paused by hand (through the admin endpoint); kept across reloads.
    pub pauses: Pauses,
}

/// Why `run` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

/// A new config to apply while running, and where to say how that went: the diff applied,
/// or why the broker refused it (the old config then keeps running).
pub struct Reload {
    pub config: Arc<Config>,
    pub applied: oneshot::Sender<Result<Diff, BrokerError>>,
}

/// What every running queue shares.
struct Shared {
    client: reqwest::Client,
    activity: Arc<Activity>,
    store: Option<Store>,
    grace: Duration,
    pauses: Pauses,
}

/// A queue being consumed: its worker task and the token that stops it.
struct RunningQueue {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl RunningQueue {
    /// Stops consuming and waits for the worker to drain (bounded by its grace).
    async fn drain(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// The queues of one broker session and the config they run.
struct Running<B: Broker> {
    broker: B,
    config: Arc<Config>,
    queues: BTreeMap<String, RunningQueue>,
    shared: Arc<Shared>,
    /// A worker whose session failed says so here.
    lost: mpsc::UnboundedSender<BrokerError>,
}

impl<B: Broker> Running<B> {
    /// Applies `new`: declares it whole first (a refusal changes nothing), drains the changed
    /// and removed queues, then starts the changed and added ones.
    async fn apply(&mut self, new: Arc<Config>) -> Result<Diff, BrokerError> {
        let diff = topology::diff(&self.config, &new);
        self.broker.declare(&topology::plan(&new)).await?;
        let stopping: Vec<RunningQueue> = diff.to_stop().filter_map(|name| self.queues.remove(name)).collect();
        futures_util::future::join_all(stopping.into_iter().map(RunningQueue::drain)).await;
        // Pauses outlive the workers: a reload keeps a paused queue paused.
        self.shared.pauses.keep(new.queues.keys());
        for name in diff.to_start() {
            let worker = Arc::new(Worker::new(
                new.clone(),
                name,
                self.shared.client.clone(),
                self.shared.activity.clone(),
                self.shared.store.clone(),
                &self.shared.pauses,
            ));
            let stop = CancellationToken::new();
            let (broker, lost, token, grace) =
                (self.broker.clone(), self.lost.clone(), stop.clone(), self.shared.grace);
            let task = tokio::spawn(async move {
                if let Err(e) = worker.run(broker, token, grace).await {
                    let _ = lost.send(e);
                }
            });
            self.queues.insert(name.clone(), RunningQueue { stop, task });
        }
        self.config = new;
        Ok(diff)
    }

    /// Drains every queue (as a reload to the empty config would).
    async fn stop_all(&mut self) {
        let all = std::mem::take(&mut self.queues);
        futures_util::future::join_all(all.into_values().map(RunningQueue::drain)).await;
    }
}

/// The longest pause between two attempts to reach the broker.
const RECONNECT_CAP: Duration = Duration::from_secs(30);

/// A session that lived this long was a success: the next failure starts the backoff afresh.
const STABLE_SESSION: Duration = Duration::from_secs(30);

/// Runs the pipeline until `shutdown` is cancelled (or, with `exit_when_idle`, until idle),
/// applying each config that arrives on `reloads`. `connect` opens a new broker session; it
/// is called again after a session is lost.
pub async fn run<B, C, F>(
    config: Arc<Config>,
    connect: C,
    store: Option<Store>,
    options: Options,
    mut reloads: mpsc::UnboundedReceiver<Reload>,
    shutdown: CancellationToken,
) -> Result<(), RunError>
where
    B: Broker,
    C: Fn() -> F,
    F: Future<Output = Result<B, BrokerError>>,
{
    let client = crate::handler::webhook::client().map_err(|e| RunError::Client(e.to_string()))?;
    let activity = Arc::new(Activity::default());
    let shared = Arc::new(Shared {
        client,
        activity: activity.clone(),
        store,
        grace: options.shutdown_grace,
        pauses: options.pauses.clone(),
    });
    let (current, _) = watch::channel(config);
    // Across sessions, so that a reconnect does not repeat the warning about a dead-letter queue.
    let depth_events = Arc::new(std::sync::Mutex::new(events::DepthEvents::new(events::DLQ_WARN_INTERVAL)));
    // Sessions that fail in a row; reset only by a session that lived STABLE_SESSION, so a
    // broker that accepts and then drops every session is not hammered.
    let mut failures = 0u32;
    let mut started = false;
    loop {
        if failures > 0 {
            let delay = backoff::reconnect_delay(failures, RECONNECT_CAP, &mut rand::rng());
            info!(retry_in = ?delay, failures, "reconnecting to the broker after a pause");
            if sleep_or_shutdown(delay, &shutdown).await {
                events::stopped(&activity.totals);
                return Ok(());
            }
        }
        let session = tokio::select! {
            _ = shutdown.cancelled() => {
                events::stopped(&activity.totals);
                return Ok(());
            }
            s = connect() => s,
        };
        let broker = match session {
            Ok(b) => b,
            Err(e) if e.is_fatal() && !started => return Err(e.into()),
            Err(e) => {
                failures += 1;
                warn!(error = %e, "broker unreachable");
                continue;
            }
        };
        let (lost_tx, mut lost) = mpsc::unbounded_channel();
        let mut running = Running {
            broker: broker.clone(),
            config: Arc::new(Config::default()),
            queues: BTreeMap::new(),
            shared: shared.clone(),
            lost: lost_tx,
        };
        let config = current.borrow().clone();
        match running.apply(config).await {
            Ok(_) => {}
            Err(e) if e.is_fatal() => {
                running.stop_all().await;
                broker.close().await;
                return Err(e.into());
            }
            Err(e) => {
                failures += 1;
                warn!(error = %e, "declaring the topology failed");
                running.stop_all().await;
                broker.close().await;
                continue;
            }
        }
        info!(queues = running.queues.len(), reconnect = started, "topology declared; consuming");
        started = true;
        let session_started = Instant::now();
        let stop = CancellationToken::new();
        let pollers = {
            let (broker, watched, stop, events) =
                (broker.clone(), current.subscribe(), stop.clone(), depth_events.clone());
            tokio::spawn(async move { poll_depths(&broker, watched, &events, &stop).await })
        };
        let idle = CancellationToken::new();
        if options.exit_when_idle {
            let (broker, watched, activity, idle) =
                (broker.clone(), current.subscribe(), activity.clone(), idle.clone());
            let stop = stop.clone();
            tokio::spawn(async move { watch_idle(&broker, watched, &activity, &stop, &idle).await });
        }
        options.readiness.set(true);
        let ended = loop {
            tokio::select! {
                _ = shutdown.cancelled() => break None,
                _ = idle.cancelled() => {
                    info!("every queue is drained; exiting (--exit-when-idle)");
                    break None;
                }
                Some(e) = lost.recv() => break Some(e),
                Some(reload) = reloads.recv() => {
                    let result = running.apply(reload.config.clone()).await;
                    let lost = match &result {
                        Ok(_) => {
                            current.send_replace(reload.config);
                            None
                        }
                        // Refused as declared: the old config keeps running as it was.
                        Err(e) if e.is_fatal() => None,
                        Err(e) => Some(e.clone()),
                    };
                    let _ = reload.applied.send(result);
                    if let Some(e) = lost {
                        break Some(e);
                    }
                }
            }
        };
        options.readiness.set(false);
        stop.cancel();
        let _ = pollers.await;
        match ended {
            Some(e) if !shutdown.is_cancelled() => {
                error!(error = %e, "broker session lost; reconnecting");
                // The connection is gone or going: the workers end, their unsettled messages
                // go back to the broker with it.
                running.stop_all().await;
                broker.close().await;
                if session_started.elapsed() >= STABLE_SESSION {
                    failures = 0;
                }
                failures += 1;
            }
            _ => {
                if shutdown.is_cancelled() {
                    info!(grace = ?options.shutdown_grace, "draining: no new messages, finishing in-flight ones");
                }
                running.stop_all().await;
                let unfinished = activity.in_flight.load(Ordering::SeqCst);
                if unfinished > 0 {
                    warn!(in_flight = unfinished, "shutdown grace expired; unfinished messages go back to the broker");
                }
                broker.close().await;
                events::stopped(&activity.totals);
                return Ok(());
            }
        }
    }
}

/// How long after its due time a delayed copy may still be on its way back through the broker
/// before `--exit-when-idle` stops waiting for it.
const DELAY_SLACK: Duration = Duration::from_secs(2);

/// How often queue and dead-letter depths are read for the metrics.
const DEPTH_POLL: Duration = Duration::from_secs(5);

/// Reads every queue's depth and consumers and its dead-letter queue's depth (no management
/// plugin needed) into `events` and the metrics until `stop`, for the config running at each poll.
async fn poll_depths<B: Broker>(
    broker: &B,
    config: watch::Receiver<Arc<Config>>,
    events: &std::sync::Mutex<events::DepthEvents>,
    stop: &CancellationToken,
) {
    loop {
        let current = config.borrow().clone();
        for q in current.queues.values() {
            if let (Ok(stats), Ok(dlq)) = (broker.stats(&q.name).await, broker.depth(&q.dead_letter).await) {
                events::consumers(&q.name, stats.consumers);
                // Only this task locks it, and never across an await.
                if let Ok(mut events) = events.lock() {
                    events.depths(&q.name, stats.ready, &q.dead_letter, dlq, std::time::Instant::now());
                }
            }
        }
        if sleep_or_shutdown(DEPTH_POLL, stop).await {
            return;
        }
    }
}

/// Sleeps; true if `stop` came first.
async fn sleep_or_shutdown(delay: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        _ = stop.cancelled() => true,
        _ = tokio::time::sleep(delay) => false,
    }
}

/// Cancels `idle` once every queue of the running config is empty, no delayed copy is pending
/// and nothing is in flight, three polls in a row (a message between two hops of a delay
/// must not look like idleness).
async fn watch_idle<B: Broker>(
    broker: &B,
    config: watch::Receiver<Arc<Config>>,
    activity: &Activity,
    stop: &CancellationToken,
    idle: &CancellationToken,
) {
    let mut idle_polls = 0;
    while !sleep_or_shutdown(Duration::from_millis(250), stop).await {
        let current = config.borrow().clone();
        let mut quiet = activity.is_quiet(DELAY_SLACK) && matches!(broker.delayed().await, Ok(0));
        for q in current.queues.values() {
            if !quiet {
                break;
            }
            quiet = matches!(broker.depth(&q.name).await, Ok(0));
        }
        idle_polls = if quiet && activity.is_quiet(DELAY_SLACK) { idle_polls + 1 } else { 0 };
        if idle_polls >= 3 {
            idle.cancel();
            return;
        }
    }
}

#[cfg(test)]
mod tests;
