//! What the brokers that keep their own declarations (embedded, Redis, in-memory) share about
//! them: the settings of a queue they cannot honour, how two stored declarations differ, and
//! how what they hold differs from a plan, and how `sluice plan` shows what they create. No IO:
//! each broker looks its declarations up.

use super::Drift;
use super::render::{Bound, Picture, Shown};
use crate::topology::{BindingDecl, Plan, QueueDecl, Role};

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

/// How what a broker holds differs from `plan`: `exchange` gives the type of a declared
/// exchange (`direct`, ...), `queue` a declared queue's declaration as stored (JSON), `bound`
/// whether a binding is declared. `broker` names a broker that cannot honour every setting
/// ([`unsupported`]); `None`, one that can.
pub(crate) fn drift<E>(
    plan: &Plan,
    broker: Option<&str>,
    mut exchange: impl FnMut(&str) -> Result<Option<String>, E>,
    mut queue: impl FnMut(&str) -> Result<Option<String>, E>,
    mut bound: impl FnMut(&BindingDecl) -> Result<bool, E>,
) -> Result<Vec<Drift>, E> {
    let mut drift = Vec::new();
    for x in &plan.exchanges {
        match exchange(&x.name)? {
            None => drift.push(Drift::MissingExchange { name: x.name.clone() }),
            Some(kind) if kind != x.kind.as_str() => drift.push(Drift::Conflict {
                what: "exchange".into(),
                name: x.name.clone(),
                detail: format!("type: declared {} but current is {kind}", x.kind.as_str()),
            }),
            Some(_) => {}
        }
    }
    for q in &plan.queues {
        if let Some(detail) = broker.and_then(|broker| unsupported(q, broker)) {
            drift.push(Drift::Conflict { what: "queue".into(), name: q.name.clone(), detail });
            continue;
        }
        let declared = serde_json::to_string(q).unwrap_or_default();
        match queue(&q.name)? {
            None => drift.push(Drift::MissingQueue { name: q.name.clone() }),
            Some(existing) if existing != declared => drift.push(Drift::Conflict {
                what: "queue".into(),
                name: q.name.clone(),
                detail: settings_differing(&declared, &existing),
            }),
            Some(_) => {}
        }
    }
    for b in &plan.bindings {
        if !bound(b)? {
            drift.push(Drift::MissingBinding {
                exchange: b.exchange.clone(),
                queue: b.queue.clone(),
                routing_key: b.routing_key.clone(),
            });
        }
    }
    Ok(drift)
}

/// What `sluice plan` shows for a broker that keeps its own declarations: under `title`, the
/// exchanges, the queues with the settings `broker` keeps (and refuses), `storage` naming
/// where a queue's messages live when that helps, and `delays` saying where a retry waits.
pub(crate) fn picture(
    plan: &Plan,
    broker: &str,
    title: String,
    delays: String,
    storage: impl Fn(&str) -> Option<(&'static str, String)>,
) -> Picture {
    let queues = plan
        .queues
        .iter()
        .map(|q| {
            let mut settings: Vec<(String, String)> =
                storage(&q.name).into_iter().map(|(k, v)| (k.into(), v)).collect();
            if let Some(dlq) = &q.dead_letter {
                settings.push(("dead_letter".into(), format!("{dlq:?}")));
            }
            if let Some(max) = q.max_length {
                settings.push(("max_length".into(), max.to_string()));
            }
            if q.single_active_consumer {
                settings.push(("single_active_consumer".into(), "true".into()));
            }
            if let Some(refused) = unsupported(q, broker) {
                settings.push(("refused".into(), refused));
            }
            Shown {
                name: q.name.clone(),
                dead_letter_queue: q.role == Role::DeadLetter,
                dead_letter: q.dead_letter.clone(),
                settings,
            }
        })
        .collect();
    Picture {
        json: serde_json::json!({
            "exchanges": plan.exchanges,
            "queues": plan.queues,
            "bindings": plan.bindings,
            "delays": delays,
        }),
        title: Some(title),
        exchanges: plan.exchanges.iter().map(|e| (e.name.clone(), e.kind.as_str().into())).collect(),
        queues,
        bindings: plan
            .bindings
            .iter()
            .map(|b| Bound {
                exchange: b.exchange.clone(),
                queue: b.queue.clone(),
                routing_key: b.routing_key.clone(),
                arguments: b.arguments.clone(),
            })
            .collect(),
        delays,
        delay_node: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::render::{PlanFormat, render};

    #[test]
    fn a_picture_shows_the_settings_kept_and_those_refused() {
        let plan = Plan {
            queues: vec![
                QueueDecl {
                    dead_letter: Some("w.dlq".into()),
                    max_length: Some(10),
                    single_active_consumer: true,
                    message_ttl_ms: Some(1000),
                    ..QueueDecl::new("w", Role::Work)
                },
                QueueDecl::new("w.dlq", Role::DeadLetter),
            ],
            ..Plan::default()
        };
        let picture = picture(&plan, "the test broker", "title".into(), "delays: here".into(), |q| {
            Some(("stream", format!("s:{q}")))
        });
        let text = render(&picture, PlanFormat::Text);
        let expected = "title\nexchanges:\nqueues:\n  w\n    stream = s:w\n    dead_letter = \"w.dlq\"\n    \
                        max_length = 10\n    single_active_consumer = true\n    refused = message_ttl: the test broker \
                        cannot honour it; remove it or run on RabbitMQ (--broker amqp://...)\n  w.dlq [dead-letter]\n    \
                        stream = s:w.dlq\ndelays: here\n";
        assert_eq!(text, expected);
        let dot = render(&picture, PlanFormat::Dot);
        assert!(dot.contains("q_w -> q_w_dlq [label=\"dead-letter\", style=dashed]"), "{dot}");
        assert!(dot.contains("q_w -> q_w [label=\"retry after delay\", style=dashed]"), "{dot}");
        assert!(!dot.contains("cascade"), "{dot}");
    }
}
