//! A pipeline checked against what its broker can honour (issue 32 item 1): each setting the
//! broker's [`Capabilities`] rule out is an error at its file:line:column, naming the
//! capability and the broker. The values are the brokers' own; this reads them, never a broker.

use std::path::PathBuf;
use std::sync::Arc;

use super::source::escape_token;
use super::{Config, Validation};
use crate::vocab::capabilities::{Capabilities, QueueNames};

/// One setting of a pipeline the broker cannot honour.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Refusal {
    /// The file that holds it, where the config knows it (queues; exchanges are found by
    /// their pointer).
    pub file: Option<PathBuf>,
    /// The setting's JSON pointer in its file.
    pub pointer: String,
    pub message: String,
}

impl Validation {
    /// Adds an error, at its place, for each setting of the config that a broker with
    /// `capabilities` cannot honour (the config is then none): what `validate --broker`, `run`
    /// and a reload check before anything is declared.
    pub fn check_capabilities(&mut self, capabilities: &Capabilities) {
        self.fit_default_body_limits(capabilities.largest_body);
        if let Some(config) = &self.config {
            let refusals: Vec<_> =
                refusals(capabilities, config).into_iter().map(|r| (r.file, r.pointer, r.message)).collect();
            self.refuse(refusals);
        }
    }
}

impl Validation {
    /// Lowers to `largest` the body limit of each queue that left `max_message_bytes` to its
    /// default (16 MiB) on a broker that keeps no body that large (SQS: 256 KiB); a limit the
    /// file gives is checked, and refused past `largest`, as it is.
    fn fit_default_body_limits(&mut self, largest: usize) {
        let Some(config) = &self.config else { return };
        let defaulted: Vec<String> = config
            .queues
            .values()
            .filter(|q| q.max_message_bytes > largest)
            .filter(|q| {
                let pointer = format!("/queues/{}/max_message_bytes", escape_token(&q.name));
                let given = self.sources.get(&q.file).and_then(|text| super::source::parse(&q.file, text.clone()).ok());
                given.is_none_or(|file| file.value.pointer(&pointer).is_none())
            })
            .map(|q| q.name.clone())
            .collect();
        let Some(config) = &mut self.config else { return };
        for name in defaulted {
            // Checked as loaded, before anything shares the queue.
            if let Some(q) = config.queues.get_mut(&name).and_then(Arc::get_mut) {
                q.max_message_bytes = largest;
            }
        }
    }
}

/// Every setting of `config` the broker cannot honour, each naming the capability.
fn refusals(capabilities: &Capabilities, config: &Config) -> Vec<Refusal> {
    let mut refusals = Vec::new();
    let mut refuse = |file: Option<&PathBuf>, pointer: String, what: String| {
        let message = format!("{} does not support {what}", capabilities.name);
        refusals.push(Refusal { file: file.cloned(), pointer, message });
    };
    for x in config.exchanges.values() {
        if !capabilities.exchange_kinds.contains(&x.kind) {
            let pointer = format!("/exchanges/{}/type", escape_token(&x.name));
            refuse(None, pointer, format!("{} exchanges", x.kind.as_str()));
        }
    }
    let mut written_as = std::collections::HashMap::new();
    for q in config.queues.values() {
        let base = format!("/queues/{}", escape_token(&q.name));
        let file = Some(&q.file);
        if !capabilities.queue_types.contains(&q.kind) {
            let kind = serde_json::to_value(q.kind).ok().and_then(|v| v.as_str().map(String::from));
            refuse(file, format!("{base}/type"), format!("{} queues", kind.unwrap_or_default()));
        }
        if q.priority.is_some() && !capabilities.priorities {
            refuse(file, format!("{base}/priority"), "priorities".into());
        }
        if q.message_ttl.is_some() && !capabilities.message_ttl {
            refuse(file, format!("{base}/message_ttl"), "a message TTL (message_ttl)".into());
        }
        if q.max_length.is_some() && !capabilities.max_length {
            refuse(file, format!("{base}/max_length"), "a queue bounded by max_length".into());
        }
        if q.ordered && !capabilities.orders() {
            refuse(file, format!("{base}/ordered"), "ordered queues (a single active consumer)".into());
        }
        if q.order_by.is_some() && !capabilities.orders() {
            refuse(
                file,
                format!("{base}/order_by"),
                "per-key ordering (order_by, over a single active consumer)".into(),
            );
        }
        if q.max_message_bytes > capabilities.largest_body {
            let what = format!(
                "bodies over {} bytes (max_message_bytes); keep a larger body elsewhere (object storage) and send a reference to it",
                capabilities.largest_body
            );
            refuse(file, format!("{base}/max_message_bytes"), what);
        }
        if let Some(names) = capabilities.queue_names {
            // At the queue's key: a dead-letter queue's name is often not written out.
            let longest = match q.ordered || q.order_by.is_some() {
                true => names.longest.saturating_sub(names.ordered_suffix),
                false => names.longest,
            };
            for name in [&q.name, &q.dead_letter] {
                let pointer = base.clone();
                let written = QueueNames::write(name);
                if written.chars().count() > longest {
                    let what = format!(
                        "queue name \"{name}\" ({} characters as \"{written}\"; at most {longest} here)",
                        written.chars().count(),
                    );
                    refuse(file, pointer.clone(), what);
                }
                match written_as.get(&written) {
                    Some(other) if other != name => refuse(
                        file,
                        pointer,
                        format!(
                            "both \"{other}\" and \"{name}\" as queue names: each is \"{written}\" there (rename one)"
                        ),
                    ),
                    _ => {
                        written_as.insert(written, name.clone());
                    }
                }
            }
        }
        if !capabilities.arguments {
            for name in q.arguments.keys() {
                let pointer = format!("{base}/arguments/{}", escape_token(name));
                refuse(file, pointer, "broker arguments (arguments:); they are RabbitMQ's".into());
            }
        }
    }
    refusals
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::capabilities::RABBITMQ;
    use crate::vocab::{ExchangeKind, QueueKind};

    /// A pipeline that asks for every capability, each of which RabbitMQ has.
    const PIPELINE: &str = r#"version: 1
exchanges:
  ev: {type: headers}
queues:
  q:
    type: classic
    priority: 5
    message_ttl: 1h
    max_length: 10
    ordered: true
    max_message_bytes: 2000000
    arguments: {x-queue-mode: lazy}
    bind: [{exchange: ev, arguments: {x-match: all, kind: a}}]
    handler: {command: {program: /bin/true}}
"#;

    fn config() -> Config {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.yaml");
        std::fs::write(&path, PIPELINE).expect("write");
        let validation = super::super::load(&[path]);
        validation.config.unwrap_or_else(|| panic!("the pipeline loads: {:?}", validation.diagnostics))
    }

    /// Issue 32: each capability a broker lacks refuses the one setting that needs it, at its
    /// pointer, naming the capability; with all of them, nothing is refused.
    #[test]
    fn each_capability_a_broker_lacks_refuses_its_setting() {
        let config = config();
        assert_eq!(refusals(&RABBITMQ, &config), Vec::new(), "RabbitMQ honours every setting");
        let lacking: [(&str, Capabilities, &str, &str); 8] = [
            (
                "exchange kinds",
                Capabilities { exchange_kinds: &[ExchangeKind::Topic], ..RABBITMQ },
                "/exchanges/ev/type",
                "headers exchanges",
            ),
            (
                "queue types",
                Capabilities { queue_types: &[QueueKind::Quorum], ..RABBITMQ },
                "/queues/q/type",
                "classic queues",
            ),
            ("priorities", Capabilities { priorities: false, ..RABBITMQ }, "/queues/q/priority", "priorities"),
            ("message TTL", Capabilities { message_ttl: false, ..RABBITMQ }, "/queues/q/message_ttl", "a message TTL"),
            ("max length", Capabilities { max_length: false, ..RABBITMQ }, "/queues/q/max_length", "max_length"),
            ("ordering", Capabilities { orderings: &[], ..RABBITMQ }, "/queues/q/ordered", "ordered queues"),
            (
                "body size",
                Capabilities { largest_body: 1_000_000, ..RABBITMQ },
                "/queues/q/max_message_bytes",
                "bodies over 1000000 bytes",
            ),
            (
                "arguments",
                Capabilities { arguments: false, ..RABBITMQ },
                "/queues/q/arguments/x-queue-mode",
                "broker arguments",
            ),
        ];
        for (what, capabilities, pointer, words) in lacking {
            let refused = refusals(&capabilities, &config);
            assert_eq!(refused.len(), 1, "{what}: {refused:?}");
            assert_eq!(refused[0].pointer, pointer, "{what}");
            assert!(refused[0].message.starts_with("RabbitMQ does not support "), "{what}: {}", refused[0].message);
            assert!(refused[0].message.contains(words), "{what}: {}", refused[0].message);
        }
    }

    /// Issue 36: on a broker that writes names its own way (SQS), two names written alike and
    /// a name past its longest are refused at the queue, naming both; a body limit left to its
    /// default takes the broker's largest body, one given past it is refused.
    #[test]
    fn names_that_would_meet_or_run_long_and_body_limits_on_a_narrower_broker() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.yaml");
        let pipeline = "version: 1\nqueues:\n  orders.email:\n    handler: {command: {program: /bin/true}}\n  orders-email:\n    handler: {command: {program: /bin/true}}\n  a-long-name-of-thirty-chars-xx:\n    max_message_bytes: 300000\n    handler: {command: {program: /bin/true}}\n";
        std::fs::write(&path, pipeline).expect("write");
        let sqs = Capabilities {
            largest_body: 262_144,
            queue_names: Some(QueueNames { longest: 30, ordered_suffix: 5 }),
            ..RABBITMQ
        };
        let mut validation = super::super::load(std::slice::from_ref(&path));
        validation.check_capabilities(&sqs);
        let messages: Vec<String> =
            validation.diagnostics.iter().map(|d| format!("{}: {}", d.pointer, d.message)).collect();
        let all = messages.join("\n");
        assert!(all.contains("both \"orders-email\" and \"orders.email\" as queue names"), "{all}");
        assert!(all.contains("queue name \"a-long-name-of-thirty-chars-xx.dlq\" (34 characters"), "{all}");
        assert!(!all.contains("queue name \"a-long-name-of-thirty-chars-xx\" "), "30 characters fit: {all}");
        assert!(
            all.contains("/queues/a-long-name-of-thirty-chars-xx/max_message_bytes"),
            "given past the largest: {all}"
        );
        assert!(!all.contains("/queues/orders.email/max_message_bytes"), "a default is lowered, not refused: {all}");
        assert!(all.contains("both \"orders-email.dlq\" and \"orders.email.dlq\""), "{all}");
        assert_eq!(messages.len(), 4, "{all}");
    }
    /// Issue 36: an ordered queue's name, and its dead-letter queue's, take the broker's
    /// suffix for ordered queues more (SQS's `.fifo`); a standard queue's do not.
    #[test]
    fn an_ordered_queues_names_count_the_suffix() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("p.yaml");
        let pipeline = "version: 1\nqueues:\n  twenty-six-characters-xxxx:\n    ordered: true\n    handler: {command: {program: /bin/true}}\n  twenty-six-characters-yyyy:\n    handler: {command: {program: /bin/true}}\n";
        std::fs::write(&path, pipeline).expect("write");
        let names = QueueNames { longest: 30, ordered_suffix: 5 };
        let sqs = Capabilities { queue_names: Some(names), ..RABBITMQ };
        let mut validation = super::super::load(std::slice::from_ref(&path));
        validation.check_capabilities(&sqs);
        let messages: Vec<String> = validation.diagnostics.iter().map(|d| d.message.clone()).collect();
        let all = messages.join("\n");
        assert!(all.contains("queue name \"twenty-six-characters-xxxx\" (26 characters"), "{all}");
        assert!(all.contains("queue name \"twenty-six-characters-xxxx.dlq\" (30 characters"), "{all}");
        assert!(all.contains("at most 25 here"), "{all}");
        assert!(!all.contains("yyyy"), "a standard queue's names fit: {all}");
        assert_eq!(messages.len(), 2, "{all}");
    }
}
