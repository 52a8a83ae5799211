//! What a delivery's outcome is, decided without a broker: the checks before a handler runs
//! (size, the message in its queue's format, binding filters, payload schema, templates), the
//! disposition a handler's result leads to, and what settling a disposition does
//! ([`Effect`]). The worker runs these around the real handler; `sluice test` runs them around
//! a simulated one, so both classify every message the same way.
//!
//! No IO here: no broker, no idempotency store, no handler call.

use std::time::Duration;

use super::filter;
use crate::backoff;
use crate::broker::{Delivery, HeaderValue, Headers, Route};
use crate::call::{Call, PrepareError, Renderer};
use crate::config::Queue;
use crate::envelope::{self, Reason, dead_letter_headers};
use crate::format::Message;
use crate::handler::HandlerError;

/// How a delivery ends. Every delivery gets exactly one.
#[derive(Debug, Clone, PartialEq)]
pub enum Disposition {
    /// Done: ack.
    Ack,
    /// Done under an idempotency claim: the key is recorded done, then ack.
    Completed { key: String },
    /// Already done before (its idempotency key is complete): ack without running the handler.
    Duplicate,
    /// The queue's binding filters refuse it: ack without running the handler.
    Filtered,
    /// Not now (the key is busy elsewhere, or the store is unreachable): a copy with the same
    /// attempt reaches the queue after `after`, then ack.
    Wait { attempt: u32, after: Duration, why: String },
    /// Not yet (the envelope's `not_before` is ahead): a copy with the same attempt reaches the
    /// queue after `after`, then ack.
    Scheduled { attempt: u32, after: Duration },
    /// Try again: a copy with attempt `next` reaches the queue after `after`, then ack.
    Retry { next: u32, after: Duration, error: String },
    /// Give up: a copy goes to the dead-letter queue with the reason, then ack.
    DeadLetter { reason: Reason, error: String, attempts: u32 },
}

/// What settling a disposition does on the broker before the ack.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Nothing: ack at once.
    Ack,
    /// A copy with these headers back into the queue after `after`, confirmed, then ack.
    Delayed { after: Duration, headers: Headers },
    /// A copy with these headers into the dead-letter queue, confirmed, then ack.
    DeadLetter { headers: Headers },
}

impl Disposition {
    /// What settling it does, for a delivery of `queue`: the one place a disposition becomes
    /// an effect.
    pub fn effect(&self, queue: &str) -> Effect {
        let delayed = |attempt: u32, after: Duration| Effect::Delayed { after, headers: attempt_header(attempt) };
        match self {
            Disposition::Ack | Disposition::Completed { .. } | Disposition::Duplicate | Disposition::Filtered => {
                Effect::Ack
            }
            Disposition::Retry { next, after, .. } => delayed(*next, *after),
            Disposition::Wait { attempt, after, .. } | Disposition::Scheduled { attempt, after } => {
                delayed(*attempt, *after)
            }
            Disposition::DeadLetter { reason, error, attempts } => {
                Effect::DeadLetter { headers: dead_letter_headers(*reason, error, *attempts, queue) }
            }
        }
    }
}

/// The header a delayed copy carries: the attempt it comes back as.
fn attempt_header(attempt: u32) -> Headers {
    Headers::from([(envelope::ATTEMPT_HEADER.to_string(), HeaderValue::Int(i64::from(attempt)))])
}

/// Decodes a delivery in the queue's format (a body over the queue's limit may not have been
/// read: then it is empty); a body too large or not a message of the format is dead-lettered.
pub fn decode<'a>(q: &Queue, delivery: &'a dyn Delivery, attempt: u32) -> Result<Message<'a>, Disposition> {
    let dead = |reason, error: String| Disposition::DeadLetter { reason, error, attempts: attempt };
    let size = delivery.size();
    if size > q.max_message_bytes {
        let error = format!("{size} bytes is over the queue's max_message_bytes of {}", q.max_message_bytes);
        return Err(dead(Reason::TooLarge, error));
    }
    Message::decode(q.format, delivery).map_err(|e| dead(Reason::Malformed, e.to_string()))
}

/// Whether `q` takes the message through one of its bindings' filters ([`filter::admits`]):
/// one refused is acked as `Filtered`, before the payload schema, the idempotency claim and
/// the handler (what the queue does not take is none of its business). `route` and `headers`
/// are what the message was published with, as far as known.
pub fn filter(
    q: &Queue,
    message: &Message<'_>,
    route: Option<&Route>,
    headers: &Headers,
    attempt: u32,
) -> Result<(), Disposition> {
    if q.bindings.iter().all(|b| b.filter.is_none()) {
        return Ok(());
    }
    let payload = if filter::reads_payload(q) && message.has_payload {
        let parsed = message.envelope.payload_value().map_err(|e| Disposition::DeadLetter {
            reason: Reason::Malformed,
            error: e.to_string(),
            attempts: attempt,
        })?;
        Some(parsed)
    } else {
        None
    };
    let message = filter::Message { message, payload: payload.as_ref() };
    if filter::admits(q, route, headers, &message) { Ok(()) } else { Err(Disposition::Filtered) }
}

/// Checks the payload against the queue's schema and renders the idempotency key and the
/// handler's call; a message that fails either is dead-lettered.
pub fn prepare(
    q: &Queue,
    message: &Message<'_>,
    attempt: u32,
    traceparent: Option<&str>,
) -> Result<(String, Call), Disposition> {
    let dead = |reason, error: String| Disposition::DeadLetter { reason, error, attempts: attempt };
    if let Some(schema) = &q.payload_schema {
        let name = q.format.payload().unwrap_or("payload");
        if !message.has_payload {
            return Err(dead(Reason::Schema, format!("the message has no JSON {name} for the payload schema")));
        }
        let payload = message.envelope.payload_value().map_err(|e| dead(Reason::Malformed, e.to_string()))?;
        if let Some(e) = schema.validator.iter_errors(&payload).next() {
            return Err(dead(Reason::Schema, format!("{name}{}: {e}", e.instance_path().as_str())));
        }
    }
    let unprepared = |e: PrepareError| {
        let reason = match e {
            PrepareError::Render { .. } => Reason::Template,
            PrepareError::Signing(_) => Reason::Signing,
            PrepareError::Payload(_) => Reason::Malformed,
        };
        dead(reason, e.to_string())
    };
    let renderer = Renderer::new(q, message, attempt, false).map_err(unprepared)?;
    let key = renderer.key().map_err(unprepared)?;
    let call = renderer.call(&key, traceparent).map_err(unprepared)?;
    Ok((key, call))
}

/// The disposition of a handler run that ended with `result` at `attempt`: success acks,
/// permanent failures and the last attempt's transient one dead-letter, others retry later.
pub fn disposition(q: &Queue, result: Result<(), HandlerError>, attempt: u32) -> Disposition {
    match result {
        Ok(()) => Disposition::Ack,
        Err(HandlerError::Permanent { error }) => {
            Disposition::DeadLetter { reason: Reason::Permanent, error, attempts: attempt }
        }
        Err(HandlerError::Transient { error, .. }) if attempt >= q.retry.max_attempts.get() => {
            Disposition::DeadLetter { reason: Reason::Exhausted, error, attempts: attempt }
        }
        Err(HandlerError::Transient { error, retry_after, .. }) => {
            let after = backoff::retry_delay(&q.retry, attempt + 1, retry_after, &mut rand::rng());
            Disposition::Retry { next: attempt + 1, after, error }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// Queue `work`: three attempts, retries 1 s then 2 s (no jitter), at most 10 s.
    fn config() -> Config {
        let dir = tempfile::tempdir().expect("tempdir");
        let yaml = "version: 1\nqueues:\n  work:\n    retry: {max_attempts: 3, initial: 1s, max: 10s, jitter: none}\n    handler: {webhook: {url: \"http://127.0.0.1:9/x\"}}\n";
        std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
        let loaded = crate::config::load(&[dir.path().to_path_buf()]);
        loaded.config.unwrap_or_else(|| panic!("invalid: {:?}", loaded.diagnostics))
    }

    const S: Duration = Duration::from_secs(1);

    /// Issue 32: each handler result, at each attempt, and the disposition it leads to.
    #[test]
    fn each_handler_result_has_its_disposition() {
        let config = config();
        let q = &config.queues["work"];
        let retry = |next, after: Duration| Disposition::Retry { next, after, error: "e".into() };
        let dead = |reason, attempts| Disposition::DeadLetter { reason, error: "e".into(), attempts };
        let rows: [(&str, Result<(), HandlerError>, u32, Disposition); 9] = [
            ("success", Ok(()), 1, Disposition::Ack),
            ("success at the last attempt", Ok(()), 3, Disposition::Ack),
            ("permanent", Err(HandlerError::permanent("e")), 1, dead(Reason::Permanent, 1)),
            ("permanent at the last attempt", Err(HandlerError::permanent("e")), 3, dead(Reason::Permanent, 3)),
            ("transient: the first retry", Err(HandlerError::transient("e")), 1, retry(2, S)),
            ("transient: the second retry, twice as late", Err(HandlerError::transient("e")), 2, retry(3, 2 * S)),
            ("transient at the last attempt", Err(HandlerError::transient("e")), 3, dead(Reason::Exhausted, 3)),
            ("the server's Retry-After, when later", Err(HandlerError::unwell("e", Some(5 * S))), 1, retry(2, 5 * S)),
            ("a Retry-After past the maximum", Err(HandlerError::unwell("e", Some(60 * S))), 1, retry(2, 10 * S)),
        ];
        for (what, result, attempt, expected) in rows {
            assert_eq!(disposition(q, result, attempt), expected, "{what}");
        }
    }

    /// Issue 32: each disposition and what settling it does on the broker.
    #[test]
    fn each_disposition_has_one_effect() {
        let delayed = |attempt: i64, after| Effect::Delayed {
            after,
            headers: Headers::from([(envelope::ATTEMPT_HEADER.to_string(), HeaderValue::Int(attempt))]),
        };
        let rows = [
            ("ack", Disposition::Ack, Effect::Ack),
            ("completed", Disposition::Completed { key: "k".into() }, Effect::Ack),
            ("duplicate", Disposition::Duplicate, Effect::Ack),
            ("filtered", Disposition::Filtered, Effect::Ack),
            ("retry: the next attempt", Disposition::Retry { next: 3, after: S, error: "e".into() }, delayed(3, S)),
            ("wait: the same attempt", Disposition::Wait { attempt: 2, after: S, why: "busy".into() }, delayed(2, S)),
            ("scheduled: the same attempt", Disposition::Scheduled { attempt: 1, after: 9 * S }, delayed(1, 9 * S)),
        ];
        for (what, disposition, expected) in rows {
            assert_eq!(disposition.effect("work"), expected, "{what}");
        }
        let dead = Disposition::DeadLetter { reason: Reason::Exhausted, error: "e".into(), attempts: 3 };
        let Effect::DeadLetter { headers } = dead.effect("work") else { panic!("not dead-lettered") };
        let text = |name: &str| headers.get(name).map(HeaderValue::to_text);
        let found =
            [envelope::REASON_HEADER, envelope::ERROR_HEADER, envelope::ATTEMPTS_HEADER, envelope::SOURCE_QUEUE_HEADER]
                .map(text);
        assert_eq!(found, ["exhausted", "e", "3", "work"].map(|v| Some(v.to_string())));
    }
}
