//! One event, one place: every log line about a delivery's fate and its metric are emitted
//! together here, with bounded labels (queue, outcome; never message ids).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use metrics::{counter, gauge, histogram};
use tracing::{debug, error, info, warn};

use super::worker::Disposition;

/// A delivery arrived; `timestamp` is its AMQP timestamp (seconds since the epoch).
pub fn received(queue: &str, timestamp: Option<u64>) {
    gauge!("sluice_in_flight", "queue" => queue.to_string()).increment(1.0);
    if let Some(ts) = timestamp {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default();
        gauge!("sluice_consumer_lag_seconds", "queue" => queue.to_string()).set((now - ts as f64).max(0.0));
    }
}

/// A delivery is settled (acked, or left to the broker to redeliver).
pub fn settled(queue: &str) {
    gauge!("sluice_in_flight", "queue" => queue.to_string()).decrement(1.0);
}

/// The handler ran for `elapsed`.
pub fn handler_ran(queue: &str, elapsed: Duration) {
    histogram!("sluice_handler_duration_seconds", "queue" => queue.to_string()).record(elapsed.as_secs_f64());
}

/// A delivery's disposition is durable (its copy confirmed) and it is about to be acked.
pub fn outcome(queue: &str, disposition: &Disposition) {
    let outcome = match disposition {
        Disposition::Ack => {
            debug!(queue, "handled");
            "success"
        }
        Disposition::Duplicate => {
            info!(queue, "duplicate of a message already handled; acked without running the handler");
            "duplicate"
        }
        Disposition::Retry { next, after, error } => {
            warn!(queue, attempt = next - 1, retry_in = ?after, error, "handler failed; retrying");
            counter!("sluice_retries_total", "queue" => queue.to_string()).increment(1);
            "retry"
        }
        Disposition::Wait { attempt, after, why } => {
            warn!(queue, attempt, retry_in = ?after, why, "not handled yet; will try again without spending an attempt");
            return;
        }
        Disposition::DeadLetter { reason, error, attempts } => {
            warn!(queue, reason = reason.as_str(), attempts, error, "dead-lettered");
            "dead_lettered"
        }
    };
    counter!("sluice_messages_total", "queue" => queue.to_string(), "outcome" => outcome).increment(1);
}

/// The broker refused a retry or dead-letter copy; the message is held.
pub fn copy_refused(queue: &str, failures: u32, error: &dyn std::fmt::Display) {
    error!(queue, failures, %error, "the broker refused a retry or dead-letter copy; holding the message and retrying");
}

/// The copy was not confirmed and the delivery's channel is gone: the broker redelivers it.
pub fn copy_abandoned(queue: &str, error: &dyn std::fmt::Display) {
    warn!(queue, %error, "retry or dead-letter copy not confirmed and the channel is gone; the broker will redeliver");
}

/// Depth of a queue and of its dead-letter queue, from a poll.
pub fn depths(queue: &str, depth: u32, dlq: &str, dlq_depth: u32) {
    gauge!("sluice_queue_depth", "queue" => queue.to_string()).set(f64::from(depth));
    gauge!("sluice_dlq_depth", "queue" => queue.to_string()).set(f64::from(dlq_depth));
    if dlq_depth > 0 {
        warn!(queue, dead_letter_queue = dlq, messages = dlq_depth, "dead-letter queue is not empty");
    }
}
