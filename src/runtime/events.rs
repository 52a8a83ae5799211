//! One event, one place: every log line about a delivery's fate and its metric are emitted
//! together here, with bounded labels (queue, outcome; never message ids).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};
use tracing::{debug, error, info, warn};

use super::worker::Disposition;

/// A queue's delivery events. The metric handles are registered once, not per message: the
/// label strings would otherwise be built on every delivery.
pub struct QueueEvents {
    queue: String,
    in_flight: Gauge,
    lag: Gauge,
    duration: Histogram,
    success: Counter,
    duplicate: Counter,
    retry: Counter,
    dead_lettered: Counter,
    retries: Counter,
}

impl QueueEvents {
    pub fn new(queue: &str) -> QueueEvents {
        let outcome = |o: &'static str| counter!("sluice_messages_total", "queue" => queue.to_string(), "outcome" => o);
        QueueEvents {
            queue: queue.to_string(),
            in_flight: gauge!("sluice_in_flight", "queue" => queue.to_string()),
            lag: gauge!("sluice_consumer_lag_seconds", "queue" => queue.to_string()),
            duration: histogram!("sluice_handler_duration_seconds", "queue" => queue.to_string()),
            success: outcome("success"),
            duplicate: outcome("duplicate"),
            retry: outcome("retry"),
            dead_lettered: outcome("dead_lettered"),
            retries: counter!("sluice_retries_total", "queue" => queue.to_string()),
        }
    }

    /// A delivery arrived; `timestamp` is its AMQP timestamp (seconds since the epoch).
    pub fn received(&self, timestamp: Option<u64>) {
        self.in_flight.increment(1.0);
        if let Some(ts) = timestamp {
            let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default();
            self.lag.set((now - ts as f64).max(0.0));
        }
    }

    /// A delivery is settled (acked, or left to the broker to redeliver).
    pub fn settled(&self) {
        self.in_flight.decrement(1.0);
    }

    /// The handler ran for `elapsed`.
    pub fn handler_ran(&self, elapsed: Duration) {
        self.duration.record(elapsed.as_secs_f64());
    }

    /// A delivery's disposition is durable (its copy confirmed) and it is about to be acked.
    pub fn outcome(&self, disposition: &Disposition) {
        let queue = self.queue.as_str();
        match disposition {
            Disposition::Ack | Disposition::Completed { .. } => {
                debug!(queue, "handled");
                self.success.increment(1);
            }
            Disposition::Duplicate => {
                info!(queue, "duplicate of a message already handled; acked without running the handler");
                self.duplicate.increment(1);
            }
            Disposition::Retry { next, after, error } => {
                warn!(queue, attempt = next - 1, retry_in = ?after, error, "handler failed; retrying");
                self.retry.increment(1);
                self.retries.increment(1);
            }
            Disposition::Wait { attempt, after, why } => {
                warn!(queue, attempt, retry_in = ?after, why, "not handled yet; will try again without spending an attempt");
            }
            Disposition::DeadLetter { reason, error, attempts } => {
                warn!(queue, reason = reason.as_str(), attempts, error, "dead-lettered");
                self.dead_lettered.increment(1);
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

    /// The copy was not confirmed and the delivery's channel is gone: the broker redelivers it.
    pub fn copy_abandoned(&self, error: &dyn std::fmt::Display) {
        let queue = self.queue.as_str();
        warn!(queue, %error, "retry or dead-letter copy not confirmed and the channel is gone; the broker will redeliver");
    }
}

/// Depth of a queue and of its dead-letter queue, from a poll.
pub fn depths(queue: &str, depth: u32, dlq: &str, dlq_depth: u32) {
    gauge!("sluice_queue_depth", "queue" => queue.to_string()).set(f64::from(depth));
    gauge!("sluice_dlq_depth", "queue" => queue.to_string()).set(f64::from(dlq_depth));
    if dlq_depth > 0 {
        warn!(queue, dead_letter_queue = dlq, messages = dlq_depth, "dead-letter queue is not empty");
    }
}

/// Consumers attached to a queue (all runners'), from a poll: 0 with messages waiting is an alert.
pub fn consumers(queue: &str, consumers: u32) {
    gauge!("sluice_queue_consumers", "queue" => queue.to_string()).set(f64::from(consumers));
}
