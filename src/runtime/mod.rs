//! `sluice run`: a running topology (vector's design). Each running queue owns its consumer,
//! its delivery tasks, its stop token and its ack loop, so one queue can be drained and
//! replaced without touching the others. One apply path, `apply(diff(old, new))`, serves
//! start-up (old = empty), reconnect (a new session starts from empty again) and reload.
//!
//! A reload drains a queue it changes or removes within the grace (an `order_by` queue, before
//! or after, whole: see [`RunningQueue::drain_whole`]); a worker whose calls
//! outlive it is retired, not cut off: its calls run on, holding their deliveries (nothing
//! goes back to the broker to be delivered again beside them) and their slots (the queue's
//! next worker counts them against its concurrency), and it closes its consumer once they
//! have ended and been settled. Shutdown and a lost session release what is still held once
//! the grace is over.
//!
//! The supervisor opens sessions through a [`Failover`]: a lost session is followed at once by
//! one with the next node of a cluster, with backoff only after every node failed.
//!
//! Generic over [`Broker`]: nothing here knows RabbitMQ. It runs no handler itself: it is
//! given what runs the calls ([`Execute`]: the real handlers in a runner, a script in its
//! tests), and it reads time only through tokio's clock (`clock` for the wall clock), so
//! that its tests run on paused time.

mod aimd;
pub mod attempts;
mod breaker;
mod clock;
mod events;
pub mod filter;
pub mod gate;
pub mod outcome;
pub mod worker;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::broker::failover::Failover;
use crate::broker::{Broker, BrokerError, Cause};
use crate::call::Execute;
use crate::config::Config;
use crate::dedup::Store;
use crate::topology::{self, Diff};
use attempts::Attempts;
use events::Activity;
use gate::{Gate, Pauses, Slots};
use worker::Worker;

/// Whether the runner is ready: connected to the broker and consuming, with every queue able to
/// settle (ack) what it handled. Set by the runtime, read by `/readyz`.
#[derive(Debug, Clone, Default)]
pub struct Readiness(Arc<Mutex<Ready>>);

#[derive(Debug, Default)]
struct Ready {
    connected: bool,
    /// Why the last attempt at a session failed, while not connected.
    failed: Option<String>,
    /// Per queue, its batches whose acks are failing ([`AcksFailing`] guards alive).
    acks_failing: BTreeMap<String, usize>,
}

impl Readiness {
    fn lock(&self) -> MutexGuard<'_, Ready> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Connected and consuming, or not (set by the runtime per session, and by a worker
    /// ending its session).
    pub fn set(&self, connected: bool) {
        let mut ready = self.lock();
        ready.connected = connected;
        if connected {
            ready.failed = None;
        }
    }

    /// Not connected: a session failed to open, or to declare, for `why` (what `/readyz` says).
    pub fn failed(&self, why: &impl std::fmt::Display) {
        let mut ready = self.lock();
        ready.connected = false;
        ready.failed = Some(why.to_string());
    }

    /// Reports `queue` unable to settle what it handled until the guard is dropped.
    pub fn acks_failing(&self, queue: &str) -> AcksFailing {
        *self.lock().acks_failing.entry(queue.to_string()).or_default() += 1;
        AcksFailing { readiness: self.clone(), queue: queue.to_string() }
    }

    /// Whether the runner is ready.
    pub fn get(&self) -> bool {
        self.why_not().is_none()
    }

    /// Why the runner is not ready; `None` when it is.
    pub fn why_not(&self) -> Option<String> {
        let ready = self.lock();
        if !ready.connected {
            return Some(match &ready.failed {
                Some(why) => format!("not connected to the broker: {why}"),
                None => "not connected to the broker".into(),
            });
        }
        let failing: Vec<String> = ready.acks_failing.keys().map(|q| format!("\"{q}\"")).collect();
        (!failing.is_empty())
            .then(|| format!("acks failing on {}: messages handled but not settled (retrying)", failing.join(", ")))
    }
}

/// A queue's acks are failing while this lives (see [`Readiness::acks_failing`]).
#[derive(Debug)]
pub struct AcksFailing {
    readiness: Readiness,
    queue: String,
}

impl Drop for AcksFailing {
    fn drop(&mut self) {
        let mut ready = self.readiness.lock();
        if let Some(n) = ready.acks_failing.get_mut(&self.queue) {
            *n -= 1;
            if *n == 0 {
                ready.acks_failing.remove(&self.queue);
            }
        }
    }
}

/// How `run` behaves beyond the config.
#[derive(Debug, Clone)]
pub struct Options {
    /// How long in-flight handlers may take to finish when their queue stops (shutdown, reload).
    pub shutdown_grace: Duration,
    /// Exit once every queue (and every pending retry) is empty and nothing is in flight.
    pub exit_when_idle: bool,
    /// Set while connected and consuming and no queue's acks fail (`/readyz`).
    pub readiness: Readiness,
    /// The queues paused by hand (through the admin endpoint); kept across reloads.
    pub pauses: Pauses,
    /// Each queue's recent attempts, for the console; kept across reloads.
    pub attempts: Attempts,
}

/// Why `run` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

/// A new config to apply while running, and where to say how that went: the diff applied,
/// or why the broker refused it (the old config then keeps running).
pub struct Reload {
    pub config: Arc<Config>,
    pub applied: oneshot::Sender<Result<Diff, BrokerError>>,
}

/// What every running queue shares.
struct Shared {
    /// What runs the handlers' calls.
    handlers: Arc<dyn Execute>,
    activity: Arc<Activity>,
    store: Option<Store>,
    grace: Duration,
    pauses: Pauses,
    /// Every queue's calls running, across its workers.
    slots: Slots,
    readiness: Readiness,
}

/// A queue being consumed: its worker, its task and the tokens that stop it.
struct RunningQueue {
    name: String,
    worker: Arc<Worker>,
    /// Stops consuming; what was delivered is finished.
    stop: CancellationToken,
    /// Hands back to the broker whatever is still unsettled.
    release: CancellationToken,
    task: JoinHandle<()>,
}

impl RunningQueue {
    /// Stops consuming and waits up to `grace` for the worker to drain. A worker still
    /// running then (its calls outlived the grace) is retired and returned.
    async fn drain(mut self, grace: Duration) -> Option<RunningQueue> {
        self.stop.cancel();
        if tokio::time::timeout(grace, &mut self.task).await.is_ok() {
            return None;
        }
        self.worker.retire();
        Some(self)
    }

    /// Stops consuming and waits for the worker to end, however long its calls take (their
    /// timeout bounds them): an `order_by` queue's next worker must not run a key's message
    /// beside its previous one. Its lanes hand back at once what has not started.
    async fn drain_whole(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }

    /// Hands back what the worker still holds and waits for it to end.
    async fn release(self) {
        self.release.cancel();
        let _ = self.task.await;
    }
}

/// The queues of one broker session and the config they run.
struct Running<B: Broker> {
    broker: B,
    config: Arc<Config>,
    queues: BTreeMap<String, RunningQueue>,
    /// Workers a reload replaced or removed whose calls outlived the grace: they settle
    /// those calls as they end, then stop.
    retiring: Vec<RunningQueue>,
    shared: Arc<Shared>,
    /// A worker whose session failed says so here.
    lost: mpsc::UnboundedSender<BrokerError>,
}

impl<B: Broker> Running<B> {
    /// Nothing running yet on `broker`; the receiver hears of a worker's lost session.
    fn new(broker: B, shared: Arc<Shared>) -> (Running<B>, mpsc::UnboundedReceiver<BrokerError>) {
        let (lost, lost_rx) = mpsc::unbounded_channel();
        let config = Arc::new(Config::default());
        (Running { broker, config, queues: BTreeMap::new(), retiring: Vec::new(), shared, lost }, lost_rx)
    }

    /// Applies `new`: declares it whole first (a refusal changes nothing), removes the
    /// bindings it dropped, drains the changed and removed queues, then starts the changed and
    /// added ones. On a session that follows a lost one (`again`), what was declared before is
    /// only checked.
    async fn apply(&mut self, new: Arc<Config>, again: bool) -> Result<Diff, BrokerError> {
        let diff = topology::diff(&self.config, &new);
        let plan = topology::plan(&new);
        match again {
            true => self.broker.redeclare(&plan).await?,
            false => self.broker.declare(&plan).await?,
        }
        // Before the drain, which may last the whole grace: whatever a removed queue's
        // bindings route to it meanwhile would wait there unconsumed (and run a second time
        // should a later reload bring the queue back). Some may be gone when this fails, so
        // the failure ends the session, never counts as a refusal that leaves it running:
        // the next session declares the old config afresh, bindings and all.
        if !diff.unbound.is_empty() {
            self.broker.unbind(&diff.unbound).await.map_err(|e| match e {
                BrokerError::Lost(_) => e,
                other => BrokerError::Lost(Cause::from_error(other)),
            })?;
        }
        let stopping: Vec<RunningQueue> = diff.to_stop().filter_map(|name| self.queues.remove(name)).collect();
        // A queue ordered by key, before or after, is drained whole before its next worker
        // starts; the others within the grace.
        let (keyed, stopping): (Vec<_>, Vec<_>) = stopping.into_iter().partition(|q| {
            q.worker.queue().order_by.is_some() || new.queues.get(&q.name).is_some_and(|n| n.order_by.is_some())
        });
        let keyed = futures_util::future::join_all(keyed.into_iter().map(RunningQueue::drain_whole));
        futures_util::future::join(self.drain(stopping), keyed).await;
        // Pauses and slots outlive the workers: a reload keeps a paused queue paused, and
        // the calls still running count against the new worker's limit.
        self.shared.pauses.keep(new.queues.keys());
        self.shared.slots.prune();
        for name in diff.to_start() {
            let queue = self.start(&new, name);
            self.queues.insert(name.clone(), queue);
        }
        self.config = new;
        Ok(diff)
    }

    /// Drains `stopping` within the grace; those whose calls outlive it retire.
    async fn drain(&mut self, stopping: Vec<RunningQueue>) {
        let grace = self.shared.grace;
        let retired = futures_util::future::join_all(stopping.into_iter().map(|q| q.drain(grace))).await;
        self.retiring.retain(|q| !q.task.is_finished());
        for queue in retired.into_iter().flatten() {
            warn!(
                queue = %queue.name,
                ?grace,
                "grace expired with handlers still running; they go on, holding their messages, and count against the queue's concurrency until they end"
            );
            self.retiring.push(queue);
        }
    }

    /// Starts the worker of queue `name` of `config`.
    fn start(&self, config: &Arc<Config>, name: &str) -> RunningQueue {
        let shared = &self.shared;
        // Diffs only name queues of their configs.
        let live = shared.activity.attempts.of(name).live().clone();
        let queue = config.queues[name].clone();
        let gate = Gate::new(&queue, &shared.pauses, &shared.slots, live);
        let worker = Arc::new(Worker::new(
            queue,
            gate,
            shared.handlers.clone(),
            shared.activity.clone(),
            shared.store.clone(),
            shared.readiness.clone(),
        ));
        let (stop, release) = (CancellationToken::new(), CancellationToken::new());
        let task = {
            let (broker, lost, worker) = (self.broker.clone(), self.lost.clone(), worker.clone());
            let (stop, release) = (stop.clone(), release.clone());
            tokio::spawn(async move {
                if let Err(e) = worker.run(broker, stop, release).await {
                    let _ = lost.send(e);
                }
            })
        };
        RunningQueue { name: name.to_string(), worker, stop, release, task }
    }

    /// Drains every queue and every retiring worker within the grace, then hands back to the
    /// broker what they still hold.
    async fn stop_all(&mut self) {
        let all = std::mem::take(&mut self.queues).into_values().chain(std::mem::take(&mut self.retiring));
        let grace = self.shared.grace;
        let unfinished = futures_util::future::join_all(all.map(|q| q.drain(grace))).await;
        futures_util::future::join_all(unfinished.into_iter().flatten().map(RunningQueue::release)).await;
    }

    /// Stops everything within the grace and closes the session.
    async fn end(mut self) {
        self.stop_all().await;
        self.broker.close().await;
    }
}

/// How often the supervisor checks that the session still lives: a session given up (a
/// confirm that never came) or closed while no queue consumes is noticed within this.
const SESSION_CHECK: Duration = Duration::from_secs(1);

/// Runs the pipeline until `shutdown` is cancelled (or, with `exit_when_idle`, until idle),
/// applying each config that arrives on `reloads`. `sessions` opens broker sessions, with the
/// next node of a cluster after a session is lost; `handlers` runs the handlers' calls.
/// Each session is opened (`connect`), run (`session`) and ended (`end`) in turn.
pub async fn run<B, C, F>(
    config: Arc<Config>,
    mut sessions: Failover<C>,
    handlers: Arc<dyn Execute>,
    store: Option<Store>,
    options: Options,
    mut reloads: mpsc::UnboundedReceiver<Reload>,
    shutdown: CancellationToken,
) -> Result<(), RunError>
where
    B: Broker,
    C: Fn(usize) -> F,
    F: Future<Output = Result<B, BrokerError>>,
{
    let mut supervisor = Supervisor::new(config, sessions.names().to_vec(), handlers, store, options);
    events::broker_node(&supervisor.nodes, None);
    let result = loop {
        let mut session = match supervisor.connect(&mut sessions, &shutdown).await {
            Ok(Some(session)) => session,
            Ok(None) => break Ok(()),
            // Before any session ran: nothing to stop, no totals to tell.
            Err(e) => return Err(e),
        };
        let ended = supervisor.session(&mut session, &mut reloads, &shutdown).await;
        if let Some(result) = supervisor.end(session, ended, &mut sessions, &shutdown).await {
            break result;
        }
    };
    events::stopped(&supervisor.shared.activity.totals);
    result
}

/// A session running the config on one node.
struct Session<B: Broker> {
    running: Running<B>,
    /// A worker whose session failed says so here.
    lost: mpsc::UnboundedReceiver<BrokerError>,
    node: usize,
}

/// What `run` keeps across sessions.
struct Supervisor {
    shared: Arc<Shared>,
    options: Options,
    /// The config running, as the pollers read it.
    current: watch::Sender<Arc<Config>>,
    /// Across sessions, so that a reconnect does not repeat the warning about a dead-letter
    /// queue.
    depth_events: Arc<std::sync::Mutex<events::DepthEvents>>,
    nodes: Vec<String>,
    /// Whether a session consumed before.
    started: bool,
    /// Whether the running config stands declared whole on the broker, so that a new session
    /// need only check it: not after a reload that ended its session half applied.
    declared: bool,
}

impl Supervisor {
    fn new(
        config: Arc<Config>,
        nodes: Vec<String>,
        handlers: Arc<dyn Execute>,
        store: Option<Store>,
        options: Options,
    ) -> Supervisor {
        let activity = Arc::new(Activity { attempts: options.attempts.clone(), ..Activity::default() });
        let shared = Arc::new(Shared {
            handlers,
            activity,
            store,
            grace: options.shutdown_grace,
            pauses: options.pauses.clone(),
            slots: Slots::default(),
            readiness: options.readiness.clone(),
        });
        Supervisor {
            shared,
            options,
            current: watch::Sender::new(config),
            depth_events: Arc::new(std::sync::Mutex::new(events::DepthEvents::new(events::DLQ_WARN_INTERVAL))),
            nodes,
            started: false,
            declared: false,
        }
    }

    /// Opens sessions until one runs the current config; `None` at shutdown. A session whose
    /// declaration fails counts as a failure of its node; only a refusal no node would change
    /// is an error.
    async fn connect<B, C, F>(
        &mut self,
        sessions: &mut Failover<C>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Session<B>>, RunError>
    where
        B: Broker,
        C: Fn(usize) -> F,
        F: Future<Output = Result<B, BrokerError>>,
    {
        loop {
            let opened = tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                s = sessions.open() => s,
            };
            // Only a refusal no node would change comes back, and only before the first session.
            let (broker, node) = opened?;
            let (mut running, lost) = Running::new(broker, self.shared.clone());
            let config = self.current.borrow().clone();
            let Err(e) = running.apply(config, self.declared).await else {
                events::broker_node(&self.nodes, Some(node));
                let (queues, reconnect) = (running.queues.len(), self.started);
                info!(node = %self.nodes[node], queues, reconnect, "topology declared; consuming");
                (self.started, self.declared) = (true, true);
                return Ok(Some(Session { running, lost, node }));
            };
            if e.is_fatal() || e.is_damaged() {
                running.end().await;
                return Err(e.into());
            }
            warn!(node = %self.nodes[node], error = %e, "declaring the topology failed");
            self.options.readiness.failed(&e);
            // A session of no use counts as a failure of its node (never gives up: only a
            // command does).
            let _ = sessions.lost(e);
            running.end().await;
        }
    }

    /// Runs a session until shutdown or idleness (`None`) or until it is lost (the error),
    /// applying the reloads that come meanwhile; the depth poller and the idle watcher run
    /// beside it.
    async fn session<B: Broker>(
        &mut self,
        session: &mut Session<B>,
        reloads: &mut mpsc::UnboundedReceiver<Reload>,
        shutdown: &CancellationToken,
    ) -> Option<BrokerError> {
        let (stop, idle) = (CancellationToken::new(), CancellationToken::new());
        let pollers = self.watch(&session.running.broker, &stop, &idle);
        self.options.readiness.set(true);
        let mut check = tokio::time::interval(SESSION_CHECK);
        let ended = loop {
            tokio::select! {
                _ = shutdown.cancelled() => break None,
                _ = idle.cancelled() => {
                    info!("every queue is drained; exiting (--exit-when-idle)");
                    break None;
                }
                Some(e) = session.lost.recv() => break Some(e),
                _ = check.tick() => if !session.running.broker.is_connected() {
                    break Some(BrokerError::Lost("the connection closed".into()));
                },
                Some(reload) = reloads.recv() => if let Some(e) = self.reload(&mut session.running, reload).await {
                    break Some(e);
                },
            }
        };
        self.options.readiness.set(false);
        stop.cancel();
        let _ = pollers.await;
        ended
    }

    /// Starts the depth poller, and with `--exit-when-idle` the idle watcher (which cancels
    /// `idle`), until `stop`; returns the poller's task.
    fn watch<B: Broker>(&self, broker: &B, stop: &CancellationToken, idle: &CancellationToken) -> JoinHandle<()> {
        if self.options.exit_when_idle {
            let (broker, watched, activity) = (broker.clone(), self.current.subscribe(), self.shared.activity.clone());
            let (stop, idle) = (stop.clone(), idle.clone());
            tokio::spawn(async move { watch_idle(&broker, watched, &activity, &stop, &idle).await });
        }
        let (broker, watched, stop, events) =
            (broker.clone(), self.current.subscribe(), stop.clone(), self.depth_events.clone());
        tokio::spawn(async move { poll_depths(&broker, watched, &events, &stop).await })
    }

    /// Applies a reload and says how it went; the error when it ended the session (a refusal
    /// as declared leaves the old config running).
    async fn reload<B: Broker>(&mut self, running: &mut Running<B>, reload: Reload) -> Option<BrokerError> {
        let result = running.apply(reload.config.clone(), false).await;
        let lost = match &result {
            Ok(diff) => {
                self.current.send_replace(reload.config);
                // Once the poller reads the new config (it checks under this lock), so that no
                // poll sets a removed queue's gauges again.
                if let Ok(mut events) = self.depth_events.lock() {
                    diff.removed.iter().for_each(|queue| events.removed(queue));
                }
                None
            }
            // Refused as declared: the old config keeps running as it was.
            Err(e) if e.is_fatal() => None,
            Err(e) => Some(e.clone()),
        };
        let _ = reload.applied.send(result);
        if lost.is_some() {
            self.declared = false;
        }
        lost
    }

    /// Ends a session as `ended` says: `None` to open the next one (it was lost, and no
    /// shutdown is under way), else how `run` ends.
    async fn end<B, C, F>(
        &mut self,
        session: Session<B>,
        ended: Option<BrokerError>,
        sessions: &mut Failover<C>,
        shutdown: &CancellationToken,
    ) -> Option<Result<(), RunError>>
    where
        B: Broker,
        C: Fn(usize) -> F,
        F: Future<Output = Result<B, BrokerError>>,
    {
        let node = &self.nodes[session.node];
        match ended {
            // No other session would find the store any better.
            Some(e) if e.is_damaged() => {
                error!(node = %node, error = %e, "the broker's store is damaged; stopping");
                events::broker_node(&self.nodes, None);
                session.running.end().await;
                Some(Err(e.into()))
            }
            Some(e) if !shutdown.is_cancelled() => {
                error!(node = %node, error = %e, "broker session lost; reconnecting");
                events::broker_node(&self.nodes, None);
                // Never gives up: only a command does.
                let _ = sessions.lost(e);
                // The connection is gone or going: the workers end, their unsettled messages
                // go back to the broker with it.
                session.running.end().await;
                None
            }
            _ => {
                if shutdown.is_cancelled() {
                    info!(grace = ?self.options.shutdown_grace, "draining: no new messages, finishing in-flight ones");
                }
                let mut running = session.running;
                running.stop_all().await;
                let unfinished = self.shared.activity.in_flight.load(Ordering::SeqCst);
                if unfinished > 0 {
                    warn!(in_flight = unfinished, "shutdown grace expired; unfinished messages go back to the broker");
                }
                running.broker.close().await;
                Some(Ok(()))
            }
        }
    }
}

/// How long after its due time a delayed copy may still be on its way back through the broker
/// before `--exit-when-idle` stops waiting for it.
const DELAY_SLACK: Duration = Duration::from_secs(2);

/// How often queue and dead-letter depths are read for the metrics.
const DEPTH_POLL: Duration = Duration::from_secs(5);

/// The least time per queue whose depths are read: the reads cost the same whatever the number
/// of queues (100 queues a second at most), and with more than 500 queues the gauges are
/// refreshed less often instead (every 50 s for 5,000).
const DEPTH_PACE: Duration = Duration::from_millis(10);

/// Queues read in one go between two pauses: a pause per queue woke two threads per read.
const DEPTH_BURST: u32 = 50;

/// Reads every queue's depth and consumers and its dead-letter queue's depth (no management
/// plugin needed) into `events` and the metrics until `stop`, for the config running at each
/// poll, paced by [`DEPTH_PACE`]. A pass is cut short by `stop`: shutdown never waits for one.
async fn poll_depths<B: Broker>(
    broker: &B,
    config: watch::Receiver<Arc<Config>>,
    events: &std::sync::Mutex<events::DepthEvents>,
    stop: &CancellationToken,
) {
    loop {
        let started = tokio::time::Instant::now();
        let current = config.borrow().clone();
        let pass = async {
            for (q, read) in current.queues.values().zip(1u32..) {
                if let (Ok(stats), Ok(dlq)) = (broker.stats(&q.name).await, broker.depth(&q.dead_letter).await) {
                    // Never held across an await. A reload may have removed the queue since
                    // `current` was read: its gauges are idle then, and stay so.
                    if let Ok(mut events) = events.lock()
                        && config.borrow().queues.contains_key(&q.name)
                    {
                        events::consumers(&q.name, stats.consumers);
                        events.depths(&q.name, stats.ready, &q.dead_letter, dlq, tokio::time::Instant::now());
                    }
                }
                if read % DEPTH_BURST == 0 {
                    tokio::time::sleep_until(started + DEPTH_PACE * read).await;
                }
            }
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            () = pass => {}
        }
        if sleep_or_shutdown(DEPTH_POLL.saturating_sub(started.elapsed()), stop).await {
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
