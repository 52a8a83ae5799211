//! What decides whether one queue consumes, and how many of its deliveries run at once: the
//! hand-set pause ([`Pauses`], kept by the runner across reloads), the circuit breaker
//! ([`breaker`](super::breaker)) and the in-flight limit, fixed or adaptive
//! ([`aimd`](super::aimd)), counted over every call of the queue running in the runner
//! ([`Slots`], kept across reloads and reconnects too): calls a replaced worker left running
//! take slots of its successor.
//!
//! The worker asks [`Gate::mode`] whether to consume (and with what prefetch) and waits on
//! [`Gate::changes`]; each delivery asks [`Gate::admit`] before its handler runs and reports
//! how the call went through its [`Permit`]. A delivery refused here is handed back
//! unattempted (the worker publishes it again for later, same attempt): a paused or open
//! queue spends no attempts and dead-letters nothing, and a retired gate (its worker replaced)
//! starts no call. The gate holds no messages itself.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use metrics::{Gauge, gauge};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::{info, warn};

use super::aimd::Aimd;
use super::attempts::Live;
use super::breaker::{Admit, Breaker, State, Verdict};
use crate::config::Queue;

/// The queues a runner has paused by hand. Lives as long as the runner: reloads and
/// reconnects replace workers, not this, and a queue a reload removes while paused is paused
/// again if a later reload brings it back. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Pauses(Arc<Mutex<Flags>>);

#[derive(Debug, Default)]
struct Flags {
    /// One per queue of the running config.
    running: BTreeMap<String, watch::Sender<bool>>,
    /// Queues a reload removed while they were paused.
    removed: BTreeSet<String>,
}

/// A pause or resume named a queue the runner does not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no queue \"{0}\" is running here")]
pub struct UnknownQueue(pub String);

impl Pauses {
    /// Pauses (`true`) or resumes a running queue; whether that changed anything. Logged by
    /// the caller, who knows who asked.
    pub fn set(&self, queue: &str, paused: bool) -> Result<bool, UnknownQueue> {
        let flags = self.lock();
        let flag = flags.running.get(queue).ok_or_else(|| UnknownQueue(queue.to_string()))?;
        let changed = flag.send_if_modified(|p| std::mem::replace(p, paused) != paused);
        if changed {
            gauge!("sluice_paused", "queue" => queue.to_string()).set(if paused { 1.0 } else { 0.0 });
        }
        Ok(changed)
    }

    /// The queues of a new config: flags of queues it keeps stay as they are, new ones start
    /// unpaused unless they were paused when a reload removed them; the flags of queues it
    /// removes go, and their pauses are remembered.
    pub(crate) fn keep<'a>(&self, queues: impl Iterator<Item = &'a String>) {
        let mut flags = self.lock();
        let mut kept = BTreeMap::new();
        for name in queues {
            let flag = flags.running.remove(name).unwrap_or_else(|| flags.returning(name));
            kept.insert(name.clone(), flag);
        }
        for (name, flag) in std::mem::replace(&mut flags.running, kept) {
            if *flag.borrow() {
                flags.removed.insert(name);
            }
        }
    }

    /// Whether `queue` runs here paused.
    pub fn is_paused(&self, queue: &str) -> bool {
        self.lock().running.get(queue).is_some_and(|flag| *flag.borrow())
    }

    fn subscribe(&self, queue: &str) -> watch::Receiver<bool> {
        let mut flags = self.lock();
        if let Some(flag) = flags.running.get(queue) {
            return flag.subscribe();
        }
        let flag = flags.returning(queue);
        let receiver = flag.subscribe();
        flags.running.insert(queue.to_string(), flag);
        receiver
    }

    fn lock(&self) -> MutexGuard<'_, Flags> {
        // Nothing panics while holding it; poisoned flags are still valid flags.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Flags {
    /// The flag of a queue that starts running: paused if it was when a reload removed it
    /// (and its gauge saying so either way).
    fn returning(&mut self, queue: &str) -> watch::Sender<bool> {
        let paused = self.removed.remove(queue);
        if paused {
            info!(queue, command = %format_args!("sluice resume {queue}"), "back in the pipeline files, and paused as it was when removed");
        }
        gauge!("sluice_paused", "queue" => queue.to_string()).set(if paused { 1.0 } else { 0.0 });
        watch::Sender::new(paused)
    }
}

/// The handler calls running in a runner, per queue, whichever worker started them. Lives as
/// long as the runner, as [`Pauses`] does: a worker replaced (by a reload, or after a lost
/// session) while its calls outlive the grace leaves them running beside its successor, whose
/// gate counts them against the queue's limit (the new one, if a reload changed it). Cheap to
/// clone.
#[derive(Debug, Clone, Default)]
pub struct Slots(Arc<Mutex<BTreeMap<String, Weak<Taken>>>>);

/// One queue's calls running, and what wakes the deliveries waiting for one to end.
#[derive(Debug, Default)]
struct Taken {
    running: Mutex<usize>,
    freed: Notify,
}

impl Slots {
    /// The slots of `queue`: those its gates alive share, or new ones.
    fn of(&self, queue: &str) -> Arc<Taken> {
        let mut queues = self.lock();
        if let Some(taken) = queues.get(queue).and_then(Weak::upgrade) {
            return taken;
        }
        let taken = Arc::new(Taken::default());
        queues.insert(queue.to_string(), Arc::downgrade(&taken));
        taken
    }

    /// Forgets the queues no gate uses any more.
    pub(super) fn prune(&self) {
        self.lock().retain(|_, taken| taken.strong_count() > 0);
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Weak<Taken>>> {
        // Nothing panics while holding it; the map stays valid.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Taken {
    fn running(&self) -> MutexGuard<'_, usize> {
        // Nothing panics while holding it; the count stays valid.
        self.running.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A call ended: its slot is free.
    fn free(&self) {
        let mut running = self.running();
        *running = running.saturating_sub(1);
    }
}

/// Whether the worker should be consuming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Consume {
        prefetch: u16,
    },
    /// Not consuming; `until` the breaker's opening ends (None: until resumed).
    Idle {
        until: Option<Instant>,
    },
}

/// What a delivery may do now.
pub enum Admission<'a> {
    Run(Permit<'a>),
    /// Hand it back unattempted, to come again after `after`.
    HandBack {
        after: Duration,
        why: &'static str,
    },
}

/// How a paused queue's handed-back deliveries wait before they are back in the queue (where
/// they then stay until it is resumed).
const PAUSED_HANDBACK: Duration = Duration::from_secs(1);

/// The in-flight limit.
#[derive(Debug)]
enum Limit {
    Fixed(usize),
    Adaptive(Aimd),
}

impl Limit {
    fn get(&self) -> usize {
        match self {
            Limit::Fixed(n) => *n,
            Limit::Adaptive(aimd) => aimd.limit(),
        }
    }
}

#[derive(Debug)]
struct Inner {
    breaker: Option<Breaker>,
    limit: Limit,
    /// Its worker was replaced: no more calls start here.
    retired: bool,
}

/// How a retired gate's deliveries wait before they are back in the queue, for the worker
/// that replaced it.
const RETIRED_HANDBACK: Duration = Duration::ZERO;

/// One queue's gate.
pub struct Gate {
    queue: String,
    prefetch: u16,
    inner: Mutex<Inner>,
    /// The queue's calls running, whichever gate admitted them; its `freed` wakes deliveries
    /// waiting for a slot or for the probe's verdict.
    slots: Arc<Taken>,
    paused: watch::Receiver<bool>,
    /// Bumped on every breaker transition.
    transitions: watch::Sender<()>,
    circuit: Gauge,
    limit_gauge: Gauge,
    /// What the gauges say, as values for the admin port.
    live: Arc<Live>,
}

impl Gate {
    /// The gate of `queue`, paused as `pauses` says, its calls counted in `slots` with those
    /// of the queue's other gates, its breaker and limit shown in `live` as in their gauges.
    pub fn new(queue: &Queue, pauses: &Pauses, slots: &Slots, live: Arc<Live>) -> Gate {
        let prefetch = queue.concurrency.get();
        let limit = if queue.adaptive {
            Limit::Adaptive(Aimd::new(prefetch, Instant::now()))
        } else {
            Limit::Fixed(usize::from(prefetch))
        };
        let circuit = gauge!("sluice_circuit_state", "queue" => queue.name.clone());
        circuit.set(State::Closed.gauge());
        live.set_circuit(State::Closed.gauge());
        let limit_gauge = gauge!("sluice_concurrency_limit", "queue" => queue.name.clone());
        limit_gauge.set(limit.get() as f64);
        live.set_concurrency_limit(limit.get() as f64);
        Gate {
            queue: queue.name.clone(),
            prefetch,
            inner: Mutex::new(Inner { breaker: queue.circuit_breaker.map(Breaker::new), limit, retired: false }),
            slots: slots.of(&queue.name),
            paused: pauses.subscribe(&queue.name),
            transitions: watch::Sender::new(()),
            circuit,
            limit_gauge,
            live,
        }
    }

    /// Whether to consume now, and with what prefetch: none while paused or open, one message
    /// while half-open (its probe), the queue's concurrency otherwise.
    pub fn mode(&self) -> Mode {
        let state = self.lock().breaker.as_ref().map_or(State::Closed, Breaker::state);
        let until = match state {
            State::Open { until } => Some(until),
            _ => None,
        };
        match (*self.paused.borrow(), state) {
            (true, _) | (false, State::Open { .. }) => Mode::Idle { until },
            (false, State::HalfOpen) => Mode::Consume { prefetch: 1 },
            (false, State::Closed) => Mode::Consume { prefetch: self.prefetch },
        }
    }

    /// What may change [`Gate::mode`]: a pause or resume, a breaker transition.
    pub fn changes(&self) -> Changes {
        Changes { paused: self.paused.clone(), transitions: self.transitions.subscribe() }
    }

    /// Ends an opening that is over (half-open: probing starts).
    pub fn tick(&self) {
        let mut inner = self.lock();
        let now = Instant::now();
        if let Some(state) = inner.breaker.as_mut().and_then(|b| b.tick(now)) {
            drop(inner);
            self.transition(state, now);
        }
    }

    /// Retires the gate: its worker is replaced while calls it admitted still run. They keep
    /// their slots until they end; no call starts here any more, and the deliveries waiting
    /// here are handed back for the new worker.
    pub fn retire(&self) {
        self.lock().retired = true;
        self.slots.freed.notify_waiters();
    }

    /// Waits until the delivery may run (a free slot; half-open: the probe's turn), or says to
    /// hand it back (retired, paused, open).
    pub async fn admit(&self) -> Admission<'_> {
        loop {
            let notified = self.slots.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut guard = self.lock();
                let inner = &mut *guard;
                if inner.retired {
                    return Admission::HandBack { after: RETIRED_HANDBACK, why: "the queue's worker was replaced" };
                }
                if *self.paused.borrow() {
                    return Admission::HandBack { after: PAUSED_HANDBACK, why: "the queue is paused" };
                }
                // Locked after the gate's own state, as everywhere.
                let mut running = self.slots.running();
                let limit = inner.limit.get();
                let full = *running >= limit;
                if let Limit::Adaptive(aimd) = &mut inner.limit
                    && *running + 1 >= limit
                {
                    aimd.saturated();
                }
                let admit = match &mut inner.breaker {
                    Some(breaker) if !full => breaker.admit(),
                    Some(breaker) => match breaker.state() {
                        State::Open { until } => Admit::Refuse { until },
                        _ => Admit::Wait,
                    },
                    None if full => Admit::Wait,
                    None => Admit::Run { probe: false },
                };
                match admit {
                    Admit::Run { probe } => {
                        *running += 1;
                        return Admission::Run(Permit { gate: self, probe, done: false });
                    }
                    Admit::Refuse { until } => {
                        let left = until.saturating_duration_since(Instant::now());
                        let after = left.max(Duration::from_millis(100));
                        return Admission::HandBack { after, why: "the circuit breaker is open" };
                    }
                    Admit::Wait => {}
                }
            }
            notified.await;
        }
    }

    /// A breaker transition: its one log line, its gauge, and whoever waits on it.
    fn transition(&self, state: State, now: Instant) {
        self.circuit.set(state.gauge());
        self.live.set_circuit(state.gauge());
        let queue = self.queue.as_str();
        match state {
            State::Open { until } => {
                let open_for = until.saturating_duration_since(now);
                warn!(
                    queue,
                    state = state.as_str(),
                    ?open_for,
                    "circuit breaker opened: the receiver is unwell; consuming stops, no attempts are spent"
                );
            }
            State::HalfOpen => {
                info!(queue, state = state.as_str(), "circuit breaker half-open: probing with one message")
            }
            State::Closed => {
                info!(queue, state = state.as_str(), "circuit breaker closed: the receiver answers; consuming again")
            }
        }
        self.transitions.send_replace(());
        self.slots.freed.notify_waiters();
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing panics while holding it; the counts stay valid.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// What may change a gate's mode, to wait on.
pub struct Changes {
    paused: watch::Receiver<bool>,
    transitions: watch::Receiver<()>,
}

impl Changes {
    /// Returns at the next change.
    pub async fn next(&mut self) {
        let changed = tokio::select! {
            r = self.paused.changed() => r.is_ok(),
            r = self.transitions.changed() => r.is_ok(),
        };
        if !changed {
            // The runner dropped the queue's flag: its worker is being stopped anyway.
            std::future::pending::<()>().await;
        }
    }
}

/// A delivery's slot while its handler runs. Reported with [`Permit::finish`]; dropped
/// unreported (a duplicate, a busy key, a panic), it only frees the slot, as a report to a
/// retired gate does (the breaker and the limit of the worker that replaced it are its own).
pub struct Permit<'a> {
    gate: &'a Gate,
    probe: bool,
    done: bool,
}

impl Permit<'_> {
    /// The handler call took `rtt`; `unwell` when its failure said the receiver is unwell.
    pub fn finish(mut self, rtt: Duration, unwell: bool) {
        self.done = true;
        let now = Instant::now();
        let verdict = if unwell { Verdict::Unwell } else { Verdict::Answered };
        let mut inner = self.gate.lock();
        self.gate.slots.free();
        if inner.retired {
            drop(inner);
            self.gate.slots.freed.notify_waiters();
            return;
        }
        let transition = inner.breaker.as_mut().and_then(|b| b.record(now, self.probe, verdict));
        let limit = match &mut inner.limit {
            Limit::Adaptive(aimd) => aimd.record(now, rtt, unwell),
            Limit::Fixed(_) => None,
        };
        drop(inner);
        if let Some(limit) = limit {
            self.gate.limit_gauge.set(limit as f64);
            self.gate.live.set_concurrency_limit(limit as f64);
        }
        match transition {
            Some(state) => self.gate.transition(state, now),
            None => self.gate.slots.freed.notify_waiters(),
        }
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut inner = self.gate.lock();
        self.gate.slots.free();
        if let Some(breaker) = &mut inner.breaker {
            breaker.withdraw(self.probe);
        }
        drop(inner);
        self.gate.slots.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    //! Scenario tables on paused time (as vector tests its adaptive concurrency): each step
    //! drives the gate as a worker would, and says what the gate then shows.

    use futures_util::FutureExt as _;

    use super::*;
    use crate::config::Config;

    /// A one-queue config, `work`, with `extra` YAML (each line indented by four spaces).
    fn config(extra: &str) -> Config {
        let dir = tempfile::tempdir().expect("tempdir");
        let yaml = format!(
            "version: 1\nqueues:\n  work:\n{extra}    handler: {{webhook: {{url: \"http://127.0.0.1:9/x\"}}}}\n"
        );
        std::fs::write(dir.path().join("p.yaml"), &yaml).expect("write");
        let loaded = crate::config::load(&[dir.path().to_path_buf()]);
        loaded.config.unwrap_or_else(|| panic!("invalid: {:?}\n{yaml}", loaded.diagnostics))
    }

    /// What a step does.
    #[derive(Debug, Clone, Copy)]
    enum Step {
        /// Pauses (true) or resumes the queue by hand.
        Pause(bool),
        /// One call from admission to its end, `ms` long; `unwell` when the receiver said so.
        Call { ms: u64, unwell: bool },
        /// Tokio's clock moves on this many seconds; the worker's timer ticks the gate.
        Wait(u64),
    }

    /// What the gate shows after a step: its mode, and what a delivery asking now is told.
    fn shows(gate: &Gate) -> String {
        let mode = match gate.mode() {
            Mode::Consume { prefetch } => format!("consume {prefetch}"),
            Mode::Idle { until: None } => "idle".to_string(),
            Mode::Idle { until: Some(at) } => {
                format!("idle {}s", at.saturating_duration_since(Instant::now()).as_secs())
            }
        };
        let admit = match gate.admit().now_or_never() {
            None => "wait".to_string(),
            Some(Admission::Run(permit)) if permit.probe => "probe".to_string(),
            Some(Admission::Run(_)) => "run".to_string(),
            Some(Admission::HandBack { after, why }) => format!("hand back {}s: {why}", after.as_secs()),
        };
        format!("{mode}; {admit}")
    }

    async fn step(gate: &Gate, pauses: &Pauses, step: Step) {
        match step {
            Step::Pause(paused) => {
                pauses.set("work", paused).expect("a running queue");
            }
            Step::Call { ms, unwell } => {
                let Admission::Run(permit) = gate.admit().await else { panic!("not admitted") };
                let rtt = Duration::from_millis(ms);
                tokio::time::advance(rtt).await;
                permit.finish(rtt, unwell);
            }
            Step::Wait(secs) => {
                tokio::time::advance(Duration::from_secs(secs)).await;
                gate.tick();
            }
        }
    }

    /// Runs `steps` on a gate of `extra`'s queue, checking what it shows after each.
    async fn scenario(extra: &str, steps: &[(Step, &str)]) {
        let config = config(extra);
        let pauses = Pauses::default();
        pauses.keep(config.queues.keys());
        let gate = Gate::new(&config.queues["work"], &pauses, &Slots::default(), Arc::default());
        for (i, (s, expected)) in steps.iter().enumerate() {
            step(&gate, &pauses, *s).await;
            assert_eq!(shows(&gate), *expected, "after step {i}: {s:?}");
        }
    }

    const OK: Step = Step::Call { ms: 10, unwell: false };
    const UNWELL: Step = Step::Call { ms: 10, unwell: true };

    /// Issue 32: a hand-set pause stops consuming and hands deliveries back unattempted;
    /// a resume starts again; pausing twice changes nothing.
    #[tokio::test(start_paused = true)]
    async fn pause_and_resume() {
        scenario(
            "    concurrency: 4\n",
            &[
                (OK, "consume 4; run"),
                (Step::Pause(true), "idle; hand back 1s: the queue is paused"),
                (Step::Pause(true), "idle; hand back 1s: the queue is paused"),
                (Step::Wait(60), "idle; hand back 1s: the queue is paused"),
                (Step::Pause(false), "consume 4; run"),
            ],
        )
        .await;
    }

    /// Issue 32: the breaker opens on its share of unwell calls, half-opens once the opening
    /// is over (one probe at a time), opens again for twice as long on a failed probe, and
    /// closes on an answered one; a pause during an opening outlasts it.
    #[tokio::test(start_paused = true)]
    async fn breaker_opens_half_opens_and_closes() {
        let breaker =
            "    concurrency: 4\n    circuit_breaker: {failure_rate: 50%, min_calls: 4, window: 60s, open_for: 5s}\n";
        scenario(
            breaker,
            &[
                (OK, "consume 4; run"),
                (UNWELL, "consume 4; run"),
                (OK, "consume 4; run"),
                // 2 of 4 unwell: open for 5 s.
                (UNWELL, "idle 5s; hand back 5s: the circuit breaker is open"),
                (Step::Wait(4), "idle 1s; hand back 1s: the circuit breaker is open"),
                (Step::Wait(1), "consume 1; probe"),
                // The probe finds the receiver unwell: open for 10 s.
                (UNWELL, "idle 10s; hand back 10s: the circuit breaker is open"),
                (Step::Wait(10), "consume 1; probe"),
                (OK, "consume 4; run"),
                // The window restarted when it closed.
                (UNWELL, "consume 4; run"),
                (UNWELL, "consume 4; run"),
                (UNWELL, "consume 4; run"),
                (UNWELL, "idle 5s; hand back 5s: the circuit breaker is open"),
                // Paused while open: idle until resumed, whatever the breaker does.
                (Step::Pause(true), "idle 5s; hand back 1s: the queue is paused"),
                (Step::Wait(5), "idle; hand back 1s: the queue is paused"),
                (Step::Pause(false), "consume 1; probe"),
            ],
        )
        .await;
    }

    /// A downstream simulated in steps: `limit` calls admitted at once (every slot used),
    /// each answered after `ms`; those beyond `capacity` at once are told it is unwell (a 503).
    #[derive(Debug, Clone, Copy)]
    struct Phase {
        steps: usize,
        ms: u64,
        capacity: usize,
    }

    /// Runs `phases` through the gate of an adaptive queue of at most `max`; the limit after
    /// each phase.
    async fn adaptive(max: u16, phases: &[Phase]) -> Vec<usize> {
        let config = config(&format!("    concurrency: {{max: {max}, adaptive: true}}\n"));
        let live = Arc::<Live>::default();
        let gate = Gate::new(&config.queues["work"], &Pauses::default(), &Slots::default(), live.clone());
        let mut limits = Vec::new();
        for phase in phases {
            for _ in 0..phase.steps {
                let mut permits = Vec::new();
                while let Some(Admission::Run(permit)) = gate.admit().now_or_never() {
                    permits.push(permit);
                }
                let rtt = Duration::from_millis(phase.ms);
                tokio::time::advance(rtt).await;
                for (i, permit) in permits.into_iter().enumerate() {
                    permit.finish(rtt, i >= phase.capacity);
                }
            }
            limits.push(live.concurrency_limit() as usize);
        }
        limits
    }

    /// Issue 32: adaptive concurrency against scripted downstreams, per phase: the limit it
    /// ends at, within bounds.
    #[tokio::test(start_paused = true)]
    async fn adaptive_concurrency_follows_the_downstream() {
        let fast = |steps| Phase { steps, ms: 20, capacity: usize::MAX };
        let capped = |steps, capacity| Phase { steps, ms: 20, capacity };
        let slower = |steps| Phase { steps, ms: 60, capacity: usize::MAX };
        // (what, max, phases, per phase the lowest and highest limit it may end at)
        type Row<'a> = (&'a str, u16, &'a [Phase], &'a [(usize, usize)]);
        let rows: &[Row] = &[
            ("a receiver with room: slow start to max", 32, &[fast(10)], &[(32, 32)]),
            ("a receiver serving 10 at once: settles near 10", 64, &[capped(300, 10)], &[(8, 11)]),
            (
                "capacity drops from 20 to 5, then comes back",
                64,
                &[capped(300, 20), capped(300, 5), fast(300)],
                &[(17, 21), (4, 6), (64, 64)],
            ),
            // Latency alone: three times slower for good is cut at once, then relearnt.
            ("a receiver slower for good", 64, &[fast(20), slower(10), slower(1500)], &[(64, 64), (1, 40), (32, 64)]),
        ];
        for (what, max, phases, bounds) in rows {
            let limits = adaptive(*max, phases).await;
            for (limit, (low, high)) in limits.iter().zip(bounds.iter()) {
                assert!((low..=high).contains(&limit), "{what}: limits {limits:?}, expected within {bounds:?}");
            }
        }
    }
}
