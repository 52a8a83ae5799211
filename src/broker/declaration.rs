//! What the brokers that keep their own declarations (embedded, Redis) share about them: the
//! settings of a queue they cannot honour, and how two stored declarations differ. No IO.

use crate::topology::QueueDecl;

/// What of a queue's declaration `broker` (e.g. "the embedded broker") cannot honour, said as
/// a person can act on it.
pub(crate) fn unsupported(q: &QueueDecl, broker: &str) -> Option<String> {
    let mut settings = Vec::new();
    if q.message_ttl_ms.is_some() {
        settings.push("message_ttl".to_string());
    }
    if q.max_priority.is_some() {
        settings.push("priority".to_string());
    }
    settings.extend(q.arguments.keys().map(|name| format!("arguments.{name}")));
    (!settings.is_empty()).then(|| {
        format!(
            "{}: {broker} cannot honour {}; remove {} or run on RabbitMQ (--broker amqp://...)",
            settings.join(", "),
            if settings.len() == 1 { "it" } else { "them" },
            if settings.len() == 1 { "it" } else { "them" },
        )
    })
}

/// The settings two queue declarations (as stored, JSON objects) differ in, each with both
/// values: `max_length: declared 100 but current is 50`.
pub(crate) fn settings_differing(declared: &str, existing: &str) -> String {
    let object =
        |text: &str| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(text).unwrap_or_default();
    let (declared, existing) = (object(declared), object(existing));
    let names: std::collections::BTreeSet<&String> = declared.keys().chain(existing.keys()).collect();
    let none = serde_json::Value::Null;
    names
        .into_iter()
        .filter_map(|name| {
            let (d, e) = (declared.get(name).unwrap_or(&none), existing.get(name).unwrap_or(&none));
            (d != e).then(|| format!("{name}: declared {d} but current is {e}"))
        })
        .collect::<Vec<_>>()
        .join("; ")
}
