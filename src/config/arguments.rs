//! A queue's `arguments:`, the `x-` arguments RabbitMQ takes beyond what sluice declares from
//! the pipeline itself. Each is checked against the arguments RabbitMQ 3.10 knows: its type,
//! the queue types that take it, and whether sluice already sets it from a key of its own
//! (then that key is named). An argument not known here is passed through with a warning:
//! RabbitMQ ignores what it does not know, so a typo would otherwise go unnoticed.

use serde_json::Value;

use super::QueueKind;

/// What an argument's value must be.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// A whole number at least this.
    Integer(u64),
    /// One of these strings.
    OneOf(&'static [&'static str]),
    /// One of these numbers.
    Version(&'static [u64]),
}

/// How sluice treats an argument it knows.
#[derive(Debug, Clone, Copy)]
enum Known {
    /// Passed through when its value has this kind and the queue this type (`None`: any).
    Takes(Kind, Option<QueueKind>),
    /// Declared by sluice from the pipeline: set it through this key instead.
    Managed(&'static str),
    /// Never: it would lose messages.
    Refused(&'static str),
}

fn known(name: &str) -> Option<Known> {
    use Known::{Managed, Refused, Takes};
    Some(match name {
        "x-max-length-bytes" => Takes(Kind::Integer(0), None),
        "x-queue-mode" => Takes(Kind::OneOf(&["default", "lazy"]), Some(QueueKind::Classic)),
        "x-queue-version" => Takes(Kind::Version(&[1, 2]), Some(QueueKind::Classic)),
        "x-queue-master-locator" => {
            Takes(Kind::OneOf(&["client-local", "min-masters", "random"]), Some(QueueKind::Classic))
        }
        "x-queue-leader-locator" => Takes(Kind::OneOf(&["client-local", "balanced"]), Some(QueueKind::Quorum)),
        "x-quorum-initial-group-size" => Takes(Kind::Integer(1), Some(QueueKind::Quorum)),
        "x-max-in-memory-length" | "x-max-in-memory-bytes" => Takes(Kind::Integer(0), Some(QueueKind::Quorum)),
        "x-queue-type" => Managed("type"),
        "x-dead-letter-exchange" | "x-dead-letter-routing-key" => Managed("dead_letter.queue"),
        "x-dead-letter-strategy" => Managed("type (quorum queues dead-letter at least once)"),
        "x-overflow" => Managed("max_length (sluice's queues refuse publishes when full)"),
        "x-delivery-limit" => Managed("retry (sluice sets a quorum queue's delivery limit itself)"),
        "x-max-length" => Managed("max_length"),
        "x-single-active-consumer" => Managed("ordered"),
        "x-message-ttl" => Managed("message_ttl"),
        "x-max-priority" => Managed("priority"),
        "x-expires" => Refused("it deletes the queue, and every message in it, once the queue goes unused"),
        _ => return None,
    })
}

/// How a finding about one argument is reported.
#[derive(Debug, PartialEq, Eq)]
pub enum Finding {
    /// The argument's name is wrong (said at the key).
    Name(String),
    /// Its value is wrong (said at the value).
    Value(String),
    /// Passed through, unchecked (said at the key).
    Unknown(String),
}

/// What is wrong with argument `name` = `value` on a queue of type `kind`, if anything.
pub fn check(name: &str, value: &Value, kind: QueueKind) -> Option<Finding> {
    if !name.starts_with("x-") {
        return Some(Finding::Name(format!("queue argument \"{name}\": RabbitMQ's queue arguments start with x-")));
    }
    let (shape, only) = match known(name) {
        None => {
            return Some(Finding::Unknown(format!(
                "queue argument \"{name}\" is not one sluice knows; it is passed to RabbitMQ as written, which ignores arguments it does not know"
            )));
        }
        Some(Known::Managed(key)) => {
            return Some(Finding::Name(format!("queue argument \"{name}\" is set by sluice: use {key}")));
        }
        Some(Known::Refused(why)) => {
            return Some(Finding::Name(format!("queue argument \"{name}\" is refused: {why}")));
        }
        Some(Known::Takes(shape, only)) => (shape, only),
    };
    if let Some(only) = only.filter(|only| *only != kind) {
        let (only, kind) = (kind_name(only), kind_name(kind));
        return Some(Finding::Name(format!(
            "queue argument \"{name}\" is for {only} queues; this queue is {kind} (type: {only} to use it)"
        )));
    }
    let fits = match shape {
        Kind::Integer(min) => value.as_u64().is_some_and(|n| n >= min),
        Kind::OneOf(choices) => value.as_str().is_some_and(|s| choices.contains(&s)),
        Kind::Version(choices) => value.as_u64().is_some_and(|n| choices.contains(&n)),
    };
    (!fits).then(|| {
        let wanted = match shape {
            Kind::Integer(min) => format!("a whole number of at least {min}"),
            Kind::OneOf(choices) => format!("one of {}", choices.join(", ")),
            Kind::Version(choices) => {
                format!("one of {}", choices.iter().map(u64::to_string).collect::<Vec<_>>().join(", "))
            }
        };
        Finding::Value(format!("queue argument \"{name}\" must be {wanted}, not {value}"))
    })
}

fn kind_name(kind: QueueKind) -> &'static str {
    match kind {
        QueueKind::Quorum => "quorum",
        QueueKind::Classic => "classic",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn arguments_are_checked_by_name_type_and_queue_type() {
        let ok = |name: &str, value: Value, kind| assert_eq!(check(name, &value, kind), None, "{name}");
        ok("x-max-length-bytes", json!(1_000_000), QueueKind::Quorum);
        ok("x-queue-mode", json!("lazy"), QueueKind::Classic);
        ok("x-queue-version", json!(2), QueueKind::Classic);
        ok("x-quorum-initial-group-size", json!(3), QueueKind::Quorum);

        let finding = |name: &str, value: Value, kind| check(name, &value, kind).expect(name);
        assert!(
            matches!(finding("max-length-bytes", json!(1), QueueKind::Quorum), Finding::Name(m) if m.contains("start with x-"))
        );
        assert!(
            matches!(finding("x-max-length", json!(1), QueueKind::Quorum), Finding::Name(m) if m.contains("use max_length"))
        );
        assert!(
            matches!(finding("x-message-ttl", json!(1), QueueKind::Quorum), Finding::Name(m) if m.contains("use message_ttl"))
        );
        assert!(
            matches!(finding("x-expires", json!(1), QueueKind::Quorum), Finding::Name(m) if m.contains("every message"))
        );
        assert!(
            matches!(finding("x-queue-mode", json!("lazy"), QueueKind::Quorum), Finding::Name(m) if m.contains("for classic queues"))
        );
        assert!(
            matches!(finding("x-queue-mode", json!("eager"), QueueKind::Classic), Finding::Value(m) if m.contains("one of default, lazy"))
        );
        assert!(matches!(finding("x-max-length-bytes", json!("1MB"), QueueKind::Quorum), Finding::Value(_)));
        assert!(matches!(finding("x-max-length-bytes", json!(-1), QueueKind::Quorum), Finding::Value(_)));
        assert!(matches!(finding("x-max-length-bytes", json!(1.5), QueueKind::Quorum), Finding::Value(_)));
        assert!(
            matches!(finding("x-queue-version", json!(3), QueueKind::Classic), Finding::Value(m) if m.contains("one of 1, 2"))
        );
        assert!(matches!(finding("x-made-up", json!(1), QueueKind::Quorum), Finding::Unknown(_)));
    }
}
