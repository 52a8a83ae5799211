//! One event, one place: every log line about a delivery's fate and its metric are emitted
//! together here, with bounded labels (queue, outcome; never message ids). Which message a
//! line is about travels in the delivery's span ([`message_span`]), not in the metrics.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::{Span, debug, error, info, warn};

use super::attempts::{Attempt, Attempts, QueueLog};
use super::clock::{self, now_ms};
use super::outcome::Disposition;
use crate::envelope::Envelope;
use crate::handler::Observed;

/// The span a delivery is handled in: every line logged while handling it carries its
/// `message_id`, and once the envelope is decoded ([`decoded`]) its `idempotency_key` and
/// `type`. At WARN, so that the retry and dead-letter warnings carry them at the levels a runner
/// usually logs at; with everything below ERROR filtered out it is never built.
pub fn message_span(message_id: Option<&str>) -> Span {
    tracing::warn_span!("message", message_id, idempotency_key = Empty, r#type = Empty)
}

/// Records what the envelope says about the delivery in its [`message_span`]; the envelope's
/// id stands in for a missing `message_id` property.
pub fn decoded(span: &Span, envelope: &Envelope<'_>, has_message_id: bool) {
    if !has_message_id {
        span.record("message_id", envelope.id.as_str());
    }
    span.record("idempotency_key", envelope.idempotency_key());
    span.record("type", envelope.kind.as_str());
}

/// Which broker node the runner is connected to: `sluice_broker_connected{node}` is 1 for the
/// node in use and 0 for the others (all 0 between sessions).
pub fn broker_node(nodes: &[String], connected: Option<usize>) {
    for (i, node) in nodes.iter().enumerate() {
        gauge!("sluice_broker_connected", "node" => node.clone()).set(if connected == Some(i) { 1.0 } else { 0.0 });
    }
}

/// Messages settled since the runner started, by outcome, for the line that ends the run.
#[derive(Debug, Default)]
pub struct Totals {
    handled: AtomicU64,
    duplicates: AtomicU64,
    filtered: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
}

/// The run ended (shutdown or `--exit-when-idle`).
pub fn stopped(totals: &Totals) {
    let count = |n: &AtomicU64| n.load(Ordering::Relaxed);
    info!(
        handled = count(&totals.handled),
        duplicates = count(&totals.duplicates),
        filtered = count(&totals.filtered),
        retried = count(&totals.retried),
        dead_lettered = count(&totals.dead_lettered),
        "stopped"
    );
}

/// What a runner has under way, for telling when it is idle, and what it has done.
#[derive(Debug, Default)]
pub struct Activity {
    /// Deliveries received and not yet settled.
    pub in_flight: AtomicUsize,
    /// When the last delayed copy this runner published is due back (ms since the epoch).
    /// Queue depths alone miss copies the broker has expired but not yet dead-lettered on.
    pub delayed_due_ms: AtomicU64,
    /// Messages settled so far, by outcome.
    pub totals: Totals,
    /// Each queue's recent attempts, for the console.
    pub attempts: Attempts,
}

impl Activity {
    pub fn delayed_until(&self, after: Duration) {
        let due = now_ms().saturating_add(u64::try_from(after.as_millis()).unwrap_or(u64::MAX));
        self.delayed_due_ms.fetch_max(due, Ordering::SeqCst);
    }

    /// Nothing in flight, and every delayed copy due back at least `slack` ago.
    pub fn is_quiet(&self, slack: Duration) -> bool {
        let slack = u64::try_from(slack.as_millis()).unwrap_or(u64::MAX);
        self.in_flight.load(Ordering::SeqCst) == 0
            && self.delayed_due_ms.load(Ordering::SeqCst).saturating_add(slack) <= now_ms()
    }
}

/// What a delivery showed on its way to its disposition, for the console's attempt log.
#[derive(Debug, Default)]
pub struct Seen {
    pub message_id: Option<String>,
    pub idempotency_key: Option<String>,
    pub attempt: u32,
    pub trace_id: Option<String>,
    /// What the handler showed and how long it ran, when it ran.
    pub handler: Option<(Observed, Duration)>,
}

/// A queue's delivery events. The metric handles are registered once, not per message: the
/// label strings would otherwise be built on every delivery.
pub struct QueueEvents {
    queue: String,
    activity: Arc<Activity>,
    in_flight: Gauge,
    /// An `order_by` queue's keys with messages waiting behind them, or held.
    keys_blocked: Gauge,
    lag: Gauge,
    duration: Histogram,
    success: Counter,
    duplicate: Counter,
    filtered: Counter,
    retry: Counter,
    dead_lettered: Counter,
    retries: Counter,
    /// The queue's recent attempts, for the console.
    log: Arc<QueueLog>,
}

impl QueueEvents {
    pub fn new(queue: &str, activity: Arc<Activity>, log: Arc<QueueLog>) -> QueueEvents {
        let outcome = |o: &'static str| counter!("sluice_messages_total", "queue" => queue.to_string(), "outcome" => o);
        QueueEvents {
            queue: queue.to_string(),
            activity,
            in_flight: gauge!("sluice_in_flight", "queue" => queue.to_string()),
            keys_blocked: gauge!("sluice_keys_blocked", "queue" => queue.to_string()),
            lag: gauge!("sluice_consumer_lag_seconds", "queue" => queue.to_string()),
            duration: histogram!("sluice_handler_duration_seconds", "queue" => queue.to_string()),
            success: outcome("success"),
            duplicate: outcome("duplicate"),
            filtered: outcome("filtered"),
            retry: outcome("retry"),
            dead_lettered: outcome("dead_lettered"),
            retries: counter!("sluice_retries_total", "queue" => queue.to_string()),
            log,
        }
    }

    /// A delivery arrived; `timestamp` is its AMQP timestamp (seconds since the epoch).
    pub fn received(&self, timestamp: Option<u64>) {
        self.in_flight.increment(1.0);
        self.log.live().in_flight_by(1);
        if let Some(ts) = timestamp {
            self.lag.set((clock::now_secs() - ts as f64).max(0.0));
        }
    }

    /// A delivery is settled (acked, or left to the broker to redeliver).
    /// How many of an `order_by` queue's keys have messages waiting behind them, or are held.
    pub fn keys_blocked(&self, keys: usize) {
        self.keys_blocked.set(keys as f64);
    }

    pub fn settled(&self) {
        self.in_flight.decrement(1.0);
        self.log.live().in_flight_by(-1);
    }

    /// The handler ran for `elapsed`.
    pub fn handler_ran(&self, elapsed: Duration) {
        self.duration.record(elapsed.as_secs_f64());
    }

    /// Whether the attempt log keeps what a delivery showed ([`Seen`]'s texts): else they
    /// need not be gathered.
    pub fn keeps_attempts(&self) -> bool {
        self.log.keeps()
    }

    /// A delivery's disposition is durable (its copy confirmed) and it is about to be acked;
    /// `seen` is what it showed on the way, for the attempt log.
    pub fn outcome(&self, disposition: &Disposition, seen: Seen) {
        self.log.record(attempt(disposition, seen));
        let queue = self.queue.as_str();
        let totals = &self.activity.totals;
        match disposition {
            Disposition::Ack | Disposition::Completed { .. } => {
                debug!(queue, "handled");
                self.success.increment(1);
                totals.handled.fetch_add(1, Ordering::Relaxed);
            }
            Disposition::Duplicate => {
                info!(queue, "duplicate of a message already handled; acked without running the handler");
                self.duplicate.increment(1);
                totals.duplicates.fetch_add(1, Ordering::Relaxed);
            }
            Disposition::Filtered => {
                debug!(queue, "refused by the queue's binding filters; acked without running the handler");
                self.filtered.increment(1);
                totals.filtered.fetch_add(1, Ordering::Relaxed);
            }
            Disposition::Retry { next, after, error } => {
                warn!(queue, attempt = next - 1, retry_in = ?after, error, "handler failed; retrying");
                self.retry.increment(1);
                self.retries.increment(1);
                totals.retried.fetch_add(1, Ordering::Relaxed);
            }
            Disposition::Scheduled { attempt, after } => {
                debug!(queue, attempt, due_in = ?after, "scheduled for later (not_before, or a delay longer than the broker holds, served in hops); handed back until then");
            }
            Disposition::Wait { attempt, after, why } => {
                warn!(queue, attempt, retry_in = ?after, why, "not handled yet; will try again without spending an attempt");
            }
            Disposition::DeadLetter { reason, error, attempts } => {
                warn!(queue, reason = reason.as_str(), attempts, error, "dead-lettered");
                self.dead_lettered.increment(1);
                totals.dead_lettered.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Handling a delivery panicked: a bug in sluice, which dead-letters that delivery alone.
    pub fn internal_error(&self, message_id: Option<&str>, error: &str) {
        let queue = self.queue.as_str();
        error!(
            queue,
            message_id, error, "internal error while handling a message; dead-lettering it (reason internal)"
        );
    }

    /// The broker refused a retry or dead-letter copy; the message is held.
    pub fn copy_refused(&self, failures: u32, error: &dyn std::fmt::Display) {
        let queue = self.queue.as_str();
        error!(queue, failures, %error, "the broker refused a retry or dead-letter copy; holding the message and retrying");
    }

    /// An ack failed while its deliveries are still the consumer's: they are held and acked again.
    pub fn ack_failed(&self, failures: u32, error: &dyn std::fmt::Display) {
        let queue = self.queue.as_str();
        error!(queue, failures, %error, "ack failed; holding the handled messages and acking them again (not ready meanwhile)");
    }

    /// Acks went through after failing.
    pub fn acked_after(&self, failures: u32) {
        let queue = self.queue.as_str();
        info!(queue, failures, "acks go through again");
    }

    /// An ack failed and its consumer is closed: the broker delivers those messages again.
    pub fn ack_abandoned(&self, error: &dyn std::fmt::Display) {
        let queue = self.queue.as_str();
        warn!(queue, %error, "ack failed after the consumer closed; the broker delivers these messages again");
    }

    /// Acks kept failing: the session ends, and the broker delivers those messages again.
    pub fn acks_given_up(&self, failures: u32, retried_for: Duration, error: &dyn std::fmt::Display) {
        let queue = self.queue.as_str();
        error!(
            queue,
            failures,
            ?retried_for,
            %error,
            "acks kept failing; ending the broker session, so that the broker delivers these messages again"
        );
    }

    /// The copy was not confirmed and the delivery's channel is gone: the broker redelivers it.
    pub fn copy_abandoned(&self, error: &dyn std::fmt::Display) {
        let queue = self.queue.as_str();
        warn!(queue, %error, "retry or dead-letter copy not confirmed and the channel is gone; the broker will redeliver");
    }
}

/// The attempt log's entry for a delivery settled with `disposition`.
fn attempt(disposition: &Disposition, seen: Seen) -> Attempt {
    let (outcome, reason, error) = match disposition {
        Disposition::Ack | Disposition::Completed { .. } => ("success", None, None),
        Disposition::Duplicate => ("duplicate", None, None),
        Disposition::Filtered => ("filtered", None, None),
        Disposition::Retry { error, .. } => ("retry", None, Some(error.clone())),
        Disposition::Wait { why, .. } => ("wait", None, Some(why.clone())),
        Disposition::Scheduled { .. } => ("scheduled", None, None),
        Disposition::DeadLetter { reason, error, .. } => ("dead_lettered", Some(reason.as_str()), Some(error.clone())),
    };
    let (observed, latency) = seen.handler.unzip();
    let observed = observed.unwrap_or_default();
    Attempt {
        seq: 0,
        at_ms: 0,
        message_id: seen.message_id,
        idempotency_key: seen.idempotency_key,
        attempt: seen.attempt,
        outcome,
        reason,
        http_status: observed.http_status,
        exit_code: observed.exit_code,
        latency_ms: latency.map(|l| l.as_secs_f64() * 1000.0),
        error,
        excerpt: (!observed.excerpt.is_empty()).then(|| String::from_utf8_lossy(&observed.excerpt).into_owned()),
        trace_id: seen.trace_id,
    }
}

/// Every gauge of a queue but `sluice_in_flight`, all idle at 0: no messages, no consumers,
/// no lag, circuit closed, no handler allowed, not paused.
const QUEUE_GAUGES: [&str; 8] = [
    "sluice_queue_depth",
    "sluice_keys_blocked",
    "sluice_dlq_depth",
    "sluice_queue_consumers",
    "sluice_consumer_lag_seconds",
    "sluice_circuit_state",
    "sluice_concurrency_limit",
    "sluice_paused",
];

/// How often a dead-letter queue that keeps changing is warned about at most.
pub const DLQ_WARN_INTERVAL: Duration = Duration::from_secs(5 * 60);

/// Depth polls of queues and their dead-letter queues: the gauges, and a warning when a
/// dead-letter queue's depth changed, at most once per interval while it stays non-empty (a
/// poll every few seconds must not repeat the same warning forever).
pub struct DepthEvents {
    interval: Duration,
    /// Per queue, the dead-letter depth last warned about and when.
    warned: HashMap<String, (u32, Instant)>,
}

impl DepthEvents {
    /// Warns about a changed dead-letter queue at most every `interval`.
    pub fn new(interval: Duration) -> DepthEvents {
        DepthEvents { interval, warned: HashMap::new() }
    }

    /// Depth of `queue` and of its dead-letter queue `dlq`, polled at `now`.
    pub fn depths(&mut self, queue: &str, depth: u32, dlq: &str, dlq_depth: u32, now: Instant) {
        gauge!("sluice_queue_depth", "queue" => queue.to_string()).set(f64::from(depth));
        gauge!("sluice_dlq_depth", "queue" => queue.to_string()).set(f64::from(dlq_depth));
        if self.should_warn(queue, dlq_depth, now) {
            warn!(
                queue,
                dead_letter_queue = dlq,
                messages = dlq_depth,
                command = %format_args!("sluice dlq list {queue}"),
                "dead-letter queue holds messages"
            );
        }
    }

    /// A reload removed `queue`: every gauge of it goes to its idle value, since the exporter
    /// cannot drop a series (metrics-exporter-prometheus has no removal; its idle timeout
    /// would also drop the gauges of running queues that do not change). Only `in_flight` is
    /// left alone: deliveries outliving the grace still settle it back to 0. Its dead-letter
    /// warning is forgotten, so a queue brought back is warned about afresh.
    pub fn removed(&mut self, queue: &str) {
        self.warned.remove(queue);
        for name in QUEUE_GAUGES {
            gauge!(name, "queue" => queue.to_string()).set(0.0);
        }
    }

    /// A non-empty dead-letter queue is warned about at once when it was empty (or unseen),
    /// and then only when its depth differs from the last warning's, `interval` after it.
    fn should_warn(&mut self, queue: &str, dlq_depth: u32, now: Instant) -> bool {
        if dlq_depth == 0 {
            self.warned.remove(queue);
            return false;
        }
        let due = match self.warned.get(queue) {
            None => true,
            Some(&(depth, at)) => depth != dlq_depth && now.saturating_duration_since(at) >= self.interval,
        };
        if due {
            self.warned.insert(queue.to_string(), (dlq_depth, now));
        }
        due
    }
}

/// Consumers attached to a queue (all runners'), from a poll: 0 with messages waiting is an alert.
pub fn consumers(queue: &str, consumers: u32) {
    gauge!("sluice_queue_consumers", "queue" => queue.to_string()).set(f64::from(consumers));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 11: a dead-letter queue is warned about when its depth changes, at most every
    /// interval while it stays non-empty, and never again for the same depth.
    #[test]
    fn dead_letter_warnings_follow_changes_at_most_once_per_interval() {
        let interval = Duration::from_secs(300);
        let start = Instant::now();
        let at = |secs| start + Duration::from_secs(secs);
        // (seconds since start, DLQ depth, warned)
        let polls = [
            (0, 0, false),
            (5, 2, true),     // was empty: at once
            (10, 2, false),   // unchanged
            (15, 3, false),   // changed, but within the interval of the last warning
            (300, 3, false),  // 295 s after it
            (305, 3, true),   // the interval is over and 3 was never warned about
            (900, 3, false),  // unchanged ever since
            (905, 0, false),  // drained
            (910, 1, true),   // non-empty again: at once
            (1210, 1, false), // the same depth, however long
        ];
        let mut events = DepthEvents::new(interval);
        for (secs, depth, warned) in polls {
            assert_eq!(events.should_warn("work", depth, at(secs)), warned, "poll at {secs}s, depth {depth}");
        }
        // Each queue on its own.
        assert!(events.should_warn("other", 4, at(1215)));
    }
}
