//! Test files as serde types, and the checks of a test file against the pipeline it tests
//! (exchanges and queues it names, responses and requests of the right handler kind), each
//! reported at its node like a pipeline's diagnostics.
//!
//! No checks live in the types beyond what serde enforces; the test schema has already run.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use crate::config::source::{SourceFile, escape_token};
use crate::config::{Config, Diagnostic, ExchangeKind, Handler, Severity, suggest};

/// One test file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    /// The schema has checked that it is 1.
    #[serde(rename = "version")]
    _version: serde::de::IgnoredAny,
    pub tests: Vec<Test>,
}

/// One message, how the handlers answer it, and what is expected.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Test {
    pub name: String,
    pub message: Message,
    #[serde(default)]
    pub responses: BTreeMap<String, Response>,
    pub expect: Expect,
}

/// A message as a producer publishes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub exchange: String,
    #[serde(default)]
    pub routing_key: String,
    #[serde(default)]
    pub headers: BTreeMap<String, HeaderArg>,
    #[serde(default = "empty_object")]
    pub payload: Value,
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub version: Option<u32>,
    pub occurred_at: Option<String>,
    pub idempotency_key: Option<String>,
    pub not_before: Option<String>,
    pub attempt: Option<u32>,
    /// A CloudEvent's source and subject (format `cloudevents`).
    pub source: Option<String>,
    pub subject: Option<String>,
    /// The body as text (format `bytes`), and its content type (any format but `envelope`).
    pub body: Option<String>,
    pub content_type: Option<String>,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// An AMQP header value a test can set.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum HeaderArg {
    Int(i64),
    Str(String),
}

/// How a handler answers, simulated.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Response {
    pub status: Option<u16>,
    pub body: Option<String>,
    pub retry_after: Option<u64>,
    pub exit: Option<i32>,
    pub stderr: Option<String>,
    #[serde(default)]
    pub timeout: bool,
}

/// What the test expects; anything left out is not checked.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    pub queues: Option<Vec<String>>,
    #[serde(default)]
    pub requests: BTreeMap<String, Request>,
    #[serde(default)]
    pub outcomes: BTreeMap<String, String>,
}

/// The parts of a rendered call a test expects.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub method: Option<String>,
    pub url: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    pub body: Option<Value>,
    pub argv: Option<Vec<String>>,
    pub stdin: Option<Value>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// The keys of a response and of a request that belong to each handler kind.
const WEBHOOK_RESPONSE: &[&str] = &["status", "body", "retry_after", "timeout"];
const COMMAND_RESPONSE: &[&str] = &["exit", "stderr", "timeout"];
const WEBHOOK_REQUEST: &[&str] = &["method", "url", "headers", "body"];
const COMMAND_REQUEST: &[&str] = &["argv", "stdin", "env"];
/// Outcomes name no keys of a handler kind.
const ANY: &[&str] = &[];

/// Every mistake of a test file against the pipeline it tests: names that do not exist,
/// responses and requests that do not fit the queue's handler.
pub fn check<'a>(
    source: &SourceFile,
    tests: impl IntoIterator<Item = (usize, &'a Test)>,
    config: &Config,
    exchanges: &[&str],
) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    let queues: Vec<&str> = config.queues.keys().map(String::as_str).collect();
    for (i, test) in tests {
        let base = format!("/tests/{i}");
        let exchange = &test.message.exchange;
        if !exchange.is_empty() && !exchanges.contains(&exchange.as_str()) && ExchangeKind::builtin(exchange).is_none()
        {
            let message = not_found("exchange", exchange, exchanges);
            out.push(source.diag(Severity::Error, &format!("{base}/message/exchange"), message));
        }
        for (j, name) in test.expect.queues.iter().flatten().enumerate() {
            if !config.queues.contains_key(name) {
                let message = not_found("queue", name, &queues);
                out.push(source.diag(Severity::Error, &format!("{base}/expect/queues/{j}"), message));
            }
        }
        let sections = [
            ("responses", test.responses.keys().collect::<Vec<_>>(), WEBHOOK_RESPONSE, COMMAND_RESPONSE),
            ("expect/requests", test.expect.requests.keys().collect(), WEBHOOK_REQUEST, COMMAND_REQUEST),
            ("expect/outcomes", test.expect.outcomes.keys().collect(), ANY, ANY),
        ];
        for (section, names, webhook_keys, command_keys) in sections {
            for name in names {
                let pointer = format!("{base}/{section}/{}", escape_token(name));
                let Some(queue) = config.queues.get(name) else {
                    let message = not_found("queue", name, &queues);
                    out.push(source.diag_at(source.key_pos(&pointer), Severity::Error, &pointer, message));
                    continue;
                };
                if section == "expect/outcomes" {
                    continue;
                }
                let (kind, allowed) = match &queue.handler {
                    Handler::Webhook(_) => ("a webhook", webhook_keys),
                    Handler::Command(_) => ("a command", command_keys),
                };
                let what = if section == "responses" { "a response" } else { "a request" };
                let written = source.value.pointer(&pointer).and_then(Value::as_object);
                for key in written.into_iter().flat_map(|m| m.keys()).filter(|k| !allowed.contains(&k.as_str())) {
                    let at = format!("{pointer}/{}", escape_token(key));
                    let message = format!(
                        "queue \"{name}\" runs {kind}: {what} has no \"{key}\" here, only {}",
                        allowed.join(", ")
                    );
                    out.push(source.diag_at(source.key_pos(&at), Severity::Error, &at, message));
                }
                let response = test.responses.get(name).filter(|_| section == "responses");
                if response.is_some_and(|r| !r.timeout && r.status.is_none() && r.exit.is_none()) {
                    let needed = if kind == "a webhook" { "\"status\"" } else { "\"exit\"" };
                    let message = format!("a response of {kind} says how it ended: {needed} or \"timeout: true\"");
                    out.push(source.diag(Severity::Error, &pointer, message));
                }
            }
        }
    }
    out
}

/// The tests of a file the schema refused that are whole nonetheless (no violation inside
/// them), with their indices: their own mistakes are still worth reporting.
pub fn whole_tests(source: &SourceFile, violations: &[Diagnostic]) -> Vec<(usize, Test)> {
    let file_wide = violations.iter().any(|d| d.pointer.is_empty() || d.pointer == "/tests");
    let items = source.value.get("tests").and_then(Value::as_array).filter(|_| !file_wide);
    items
        .into_iter()
        .flatten()
        .enumerate()
        .filter(|(i, _)| {
            let at = format!("/tests/{i}");
            !violations.iter().any(|d| d.pointer == at || d.pointer.starts_with(&format!("{at}/")))
        })
        .filter_map(|(i, value)| Some((i, serde_json::from_value(value.clone()).ok()?)))
        .collect()
}

/// `no queue "x" in the pipeline files; did you mean "y"?`
fn not_found(what: &str, name: &str, known: &[&str]) -> String {
    format!("no {what} \"{name}\" in the pipeline files{}", suggest::did_you_mean(name, known.iter().copied()))
}
