//! Running one test: the message is routed over the topology plan as the broker would route
//! it, then each queue routed to applies its binding filters (a queue they refuse is not
//! reached: its outcome is `filtered`), and each queue reached decodes, checks and renders it with the runtime's own code
//! (`runtime::outcome`), its handler's answer is simulated and classified by the handler's own
//! code, and what happened is compared with what the test expects, field by field.
//!
//! Nothing is sent and no command runs: a simulated answer stands in for every handler call.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt as _;
use std::process::ExitStatus;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};

use super::file::{self, HeaderArg, Request, Response, Test};
use crate::broker::{Delivery as _, HeaderValue, Headers, Kept, Properties, Route};
use crate::call::Call;
use crate::config::source::escape_token;
use crate::config::{Config, Queue};
use crate::handler::command::{self, Stdin};
use crate::handler::{HandlerError, webhook};
use crate::runtime::outcome;
use crate::runtime::outcome::Disposition;
use crate::topology::route;
use crate::topology::{self, Plan};
use crate::vocab::format::Format;

/// One difference between what a test expects and what happened.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Mismatch {
    /// The JSON pointer of the expectation in the test file.
    pub pointer: String,
    /// What differs, as `outcomes.orders.charge` or `requests.orders.charge.url`.
    pub field: String,
    pub expected: String,
    pub actual: String,
}

/// A config ready to test: its topology plan, and its webhook URLs resolved as `run` resolves
/// them (a queue whose URL cannot be resolved here is one `run` would refuse to start with).
pub struct Suite {
    config: Config,
    plan: Plan,
    refused: BTreeMap<String, String>,
}

/// What happened on one queue a message reached.
struct Reached {
    /// The rendered call; `None` when the message never got as far as the handler.
    call: Option<Call>,
    /// `success`, `retry` or `dead_letter:<reason>`, and what the error said.
    outcome: String,
    error: Option<String>,
}

impl Suite {
    /// Plans the config's topology and resolves its webhook URLs.
    pub fn new(mut config: Config) -> Suite {
        let mut refused = BTreeMap::new();
        for queue in config.queues_mut() {
            if let Err(e) = queue.resolve_webhook_url() {
                refused.insert(queue.name.clone(), e.to_string());
            }
        }
        let plan = topology::plan(&config);
        Suite { config, plan, refused }
    }

    /// Runs test `index` (0-based, in its file) and returns every difference from what it expects.
    pub fn run(&self, index: usize, test: &Test) -> Vec<Mismatch> {
        let base = format!("/tests/{index}");
        let m = &test.message;
        let headers: Headers = m
            .headers
            .iter()
            .map(|(k, v)| {
                let value = match v {
                    HeaderArg::Int(i) => HeaderValue::Int(*i),
                    HeaderArg::Str(s) => HeaderValue::Str(s.clone()),
                };
                (k.clone(), value)
            })
            .collect();
        let mut out = Vec::new();
        let Some(targets) = route::plan_targets(&self.plan, &m.exchange, &m.routing_key, &headers) else {
            out.push(Mismatch {
                pointer: format!("{base}/message/exchange"),
                field: "message.exchange".into(),
                expected: "an exchange of the pipeline files".into(),
                actual: format!("no exchange \"{}\"", m.exchange),
            });
            return out;
        };
        let attempt = m.attempt.unwrap_or(1);
        let route = Route { exchange: m.exchange.clone(), routing_key: m.routing_key.clone() };
        let reached: BTreeMap<&str, Reached> = targets
            .iter()
            .filter_map(|name| self.config.queues.get(name))
            .map(|q| {
                let delivery = delivery(q.format, m, index, &route, &headers);
                (q.name.as_str(), self.handle(q, &delivery, attempt, test.responses.get(&q.name)))
            })
            .collect();
        // A queue whose binding filters refuse the message is routed to, but not reached.
        let taken: Vec<String> =
            targets.iter().filter(|q| reached.get(q.as_str()).is_none_or(|r| r.outcome != FILTERED)).cloned().collect();

        if let Some(expected) = &test.expect.queues {
            let mut expected = expected.clone();
            expected.sort();
            expected.dedup();
            if expected != taken {
                out.push(Mismatch {
                    pointer: format!("{base}/expect/queues"),
                    field: "queues".into(),
                    expected: list(&expected),
                    actual: list(&taken),
                });
            }
        }
        for (name, want) in &test.expect.outcomes {
            let pointer = format!("{base}/expect/outcomes/{}", escape_token(name));
            let actual = match reached.get(name.as_str()) {
                None => NOT_REACHED.to_string(),
                Some(r) if r.outcome == *want => continue,
                Some(r) => match &r.error {
                    Some(error) => format!("{} ({error})", r.outcome),
                    None => r.outcome.clone(),
                },
            };
            out.push(Mismatch { pointer, field: format!("outcomes.{name}"), expected: want.clone(), actual });
        }
        for (name, want) in &test.expect.requests {
            let pointer = format!("{base}/expect/requests/{}", escape_token(name));
            let field = format!("requests.{name}");
            match reached.get(name.as_str()) {
                None => out.push(Mismatch { pointer, field, expected: "a call".into(), actual: NOT_REACHED.into() }),
                Some(Reached { call: None, outcome, error }) => out.push(Mismatch {
                    pointer,
                    field,
                    expected: "a call".into(),
                    actual: format!("no call: {outcome} ({})", error.as_deref().unwrap_or_default()),
                }),
                Some(Reached { call: Some(call), .. }) => {
                    let queue = &self.config.queues[name];
                    compare_call(&mut out, &pointer, &field, want, call, queue);
                }
            }
        }
        out
    }

    /// What one queue does with the message: the runtime's checks and rendering, then the
    /// simulated answer classified as the handler classifies a real one.
    fn handle(&self, q: &Queue, delivery: &Kept<()>, attempt: u32, response: Option<&Response>) -> Reached {
        if let Some(reason) = self.refused.get(&q.name) {
            return Reached { call: None, outcome: "not run".into(), error: Some(reason.clone()) };
        }
        let ended = |disposition: Disposition, call| {
            let (outcome, error) = describe(disposition);
            Reached { call, outcome, error }
        };
        let message = match outcome::decode(q, delivery, attempt) {
            Ok(message) => message,
            Err(disposition) => return ended(disposition, None),
        };
        let headers = crate::runtime::filter::headers(q, |name| delivery.header(name));
        if let Err(disposition) = outcome::filter(q, &message, delivery.route(), &headers, attempt) {
            return ended(disposition, None);
        }
        // No trace context: a traceparent is random per delivery, so a test could not expect it.
        let (_key, call) = match outcome::prepare(q, &message, attempt, None) {
            Ok(prepared) => prepared,
            Err(disposition) => return ended(disposition, None),
        };
        let result = simulate(&call, response.unwrap_or(&Response::default()));
        ended(outcome::disposition(q, result, attempt), Some(call))
    }
}

/// Test `index`'s message as a delivery to a queue of `format`: an envelope; the payload as
/// a `json` body; a structured CloudEvent (its `source` and `subject` from the test); the
/// test's `body` (else the payload's text) as `bytes`. The id and type are the broker's
/// message id and type, outside an envelope.
fn delivery(format: Format, m: &file::Message, index: usize, route: &Route, headers: &Headers) -> Kept<()> {
    let id = m.id.clone().unwrap_or_else(|| format!("test-{}", index + 1));
    let kind =
        m.kind.clone().unwrap_or_else(|| if m.routing_key.is_empty() { "test".into() } else { m.routing_key.clone() });
    let mut properties = Properties {
        headers: headers.clone(),
        message_id: Some(id.clone()),
        kind: Some(kind.clone()),
        content_type: m.content_type.clone(),
        route: Some(route.clone()),
        ..Properties::default()
    };
    let body = match format {
        Format::Envelope => {
            let mut envelope = json!({"id": id, "type": kind, "payload": m.payload});
            // A `not_before` is checked like any field, and the test runs as at that time.
            let fields = [
                ("occurred_at", &m.occurred_at),
                ("idempotency_key", &m.idempotency_key),
                ("not_before", &m.not_before),
            ];
            for (key, value) in fields {
                if let Some(value) = value {
                    envelope[key] = Value::from(value.as_str());
                }
            }
            if let Some(version) = m.version {
                envelope["version"] = Value::from(version);
            }
            envelope.to_string().into_bytes()
        }
        Format::Json => m.payload.to_string().into_bytes(),
        Format::CloudEvents => {
            let source = m.source.clone().unwrap_or_else(|| "sluice-test".into());
            let mut event = json!({"specversion": "1.0", "id": id, "source": source, "type": kind, "data": m.payload});
            for (key, value) in [("subject", &m.subject), ("time", &m.occurred_at)] {
                if let Some(value) = value {
                    event[key] = Value::from(value.as_str());
                }
            }
            properties.content_type.get_or_insert_with(|| "application/cloudevents+json".into());
            event.to_string().into_bytes()
        }
        Format::Bytes => match (&m.body, &m.payload) {
            (Some(body), _) => body.clone().into_bytes(),
            (None, Value::String(text)) => text.clone().into_bytes(),
            (None, payload) => payload.to_string().into_bytes(),
        },
    };
    Kept::standalone(Bytes::from(body), properties)
}

const NOT_REACHED: &str = "not reached";

/// The outcome of a queue whose binding filters refuse the message.
const FILTERED: &str = "filtered";

/// A disposition as a test names it, and the error it carries.
fn describe(disposition: Disposition) -> (String, Option<String>) {
    match disposition {
        Disposition::Ack | Disposition::Completed { .. } => ("success".into(), None),
        Disposition::Duplicate => ("duplicate".into(), None),
        Disposition::Filtered => (FILTERED.into(), None),
        Disposition::Wait { why, .. } => ("wait".into(), Some(why)),
        Disposition::Scheduled { .. } => ("scheduled".into(), None),
        Disposition::Retry { error, .. } => ("retry".into(), Some(error)),
        Disposition::DeadLetter { reason, error, .. } => (format!("dead_letter:{}", reason.as_str()), Some(error)),
    }
}

/// The handler's answer, as the handler would classify it had it really called.
fn simulate(call: &Call, response: &Response) -> Result<(), HandlerError> {
    match call {
        Call::Webhook { timeout, .. } if response.timeout => Err(HandlerError::timeout(*timeout)),
        Call::Command(invocation) if response.timeout => Err(HandlerError::timeout(invocation.timeout)),
        Call::Webhook { on_status, .. } => {
            let status = reqwest::StatusCode::from_u16(response.status.unwrap_or(200))
                .map_err(|e| HandlerError::permanent(format!("simulated status: {e}")))?;
            let body = response.body.as_deref().unwrap_or_default().as_bytes();
            webhook::outcome(status.as_u16(), on_status, response.retry_after.map(Duration::from_secs), body)
        }
        Call::Command(invocation) => {
            // A wait status: the exit code in the second byte.
            let status = ExitStatus::from_raw((response.exit.unwrap_or(0) & 0xff) << 8);
            let stderr = response.stderr.as_deref().unwrap_or_default().as_bytes();
            command::exit_result(status, stderr, invocation)
        }
    }
}

/// Compares a rendered call with the parts of it a test expects.
fn compare_call(out: &mut Vec<Mismatch>, pointer: &str, field: &str, want: &Request, call: &Call, queue: &Queue) {
    let mut differ = |key: &str, expected: String, actual: String| {
        if expected != actual {
            let (at, name) = (format!("{pointer}/{key}"), format!("{field}.{}", key.replace('/', ".")));
            out.push(Mismatch { pointer: at, field: name, expected, actual });
        }
    };
    match call {
        Call::Webhook { request, .. } => {
            if let Some(method) = &want.method {
                differ("method", method.clone(), request.method.to_string());
            }
            if let Some(url) = &want.url {
                differ("url", url.clone(), request.url.to_string());
            }
            for (name, value) in &want.headers {
                // A header set twice is sent twice; the pipeline's own value is the last.
                let actual = request.headers.iter().rev().find(|(n, _)| n.eq_ignore_ascii_case(name));
                let actual = actual.map_or_else(|| "(no such header)".to_string(), |(_, v)| v.clone());
                differ(&format!("headers/{}", escape_token(name)), value.clone(), actual);
            }
            if let Some(body) = &want.body {
                let (expected, actual) = shown(body, &request.body);
                differ("body", expected, actual);
            }
        }
        Call::Command(invocation) => {
            if let Some(argv) = &want.argv {
                // The program as the pipeline writes it, not as resolved against its file.
                let written = queue.source.pointer("/definition/handler/command/program").and_then(Value::as_str);
                let program = written.map_or_else(|| invocation.program.display().to_string(), str::to_string);
                let actual: Vec<String> = std::iter::once(program).chain(invocation.args.iter().cloned()).collect();
                differ("argv", list(argv), list(&actual));
            }
            if let Some(stdin) = &want.stdin {
                let bytes = match &invocation.stdin {
                    Stdin::Null => Bytes::new(),
                    Stdin::Bytes(b) => b.clone(),
                };
                let (expected, actual) = shown(stdin, &bytes);
                differ("stdin", expected, actual);
            }
            for (name, value) in &want.env {
                let actual = invocation.env.iter().find(|(n, _)| n == name);
                let actual = actual.map_or_else(|| "(not set)".to_string(), |(_, v)| v.clone());
                differ(&format!("env/{}", escape_token(name)), value.clone(), actual);
            }
        }
    }
}

/// An expected body and the actual one, as they compare: a string as text, anything else as
/// JSON (so key order and spacing do not matter). Equal ones come back equal.
fn shown(expected: &Value, actual: &[u8]) -> (String, String) {
    let text = String::from_utf8_lossy(actual).into_owned();
    match expected {
        Value::String(want) => (want.clone(), text),
        want => match serde_json::from_slice::<Value>(actual) {
            Ok(got) if got == *want => (text.clone(), text),
            Ok(got) => (want.to_string(), got.to_string()),
            Err(_) => (want.to_string(), text),
        },
    }
}

/// A list of names as JSON: `["a","b"]`.
fn list(items: &[String]) -> String {
    serde_json::to_string(items).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::*;
    use crate::handler::rules::{Action, Key, Rules};

    #[test]
    fn bodies_compare_as_json_unless_expected_as_text() {
        let cases = [
            (json!({"a": 1, "b": [true]}), r#"{"b":[true],"a":1}"#, true),
            (json!({"a": 1}), r#"{"a":"1"}"#, false),
            (json!({"a": 1}), "not json", false),
            (json!("plain text"), "plain text", true),
            // A string expects text: the JSON string "x" is not the text x.
            (json!("x"), r#""x""#, false),
            (json!(null), "null", true),
        ];
        for (expected, actual, equal) in cases {
            let (e, a) = shown(&expected, actual.as_bytes());
            assert_eq!(e == a, equal, "{expected} vs {actual}: {e} / {a}");
        }
    }

    #[test]
    fn simulated_answers_are_classified_as_real_ones() {
        let webhook = |status: u16, timeout: bool| {
            let request = webhook::Request {
                method: reqwest::Method::POST,
                url: reqwest::Url::parse("http://h.example/x").expect("a URL"),
                headers: Vec::new(),
                body: Bytes::new(),
            };
            // One rule, to show a simulated answer goes through the queue's rules too.
            let on_status = Rules::new(BTreeMap::from([(Key::Code(409), Action::Success)]));
            let call = Call::Webhook {
                request,
                timeout: Duration::from_secs(3),
                on_status: Arc::new(on_status),
                oauth2: None,
                client: None,
            };
            simulate(&call, &Response { status: Some(status), timeout, ..Response::default() })
        };
        assert_eq!(webhook(204, false), Ok(()));
        assert_eq!(webhook(409, false), Ok(()), "by its on_status rule");
        assert!(matches!(webhook(503, false), Err(HandlerError::Transient { .. })));
        assert!(matches!(webhook(404, false), Err(HandlerError::Permanent { .. })));
        assert_eq!(webhook(200, true), Err(HandlerError::timeout(Duration::from_secs(3))));
        let command = |exit: i32| {
            let call = Call::Command(command::Invocation {
                program: "/bin/true".into(),
                args: Vec::new(),
                env: Vec::new(),
                stdin: Stdin::Null,
                timeout: Duration::from_secs(1),
                permanent_exit_codes: vec![65],
                on_exit: Arc::new(Rules::new(BTreeMap::from([(Key::Code(75), Action::DeadLetter)]))),
            });
            simulate(&call, &Response { exit: Some(exit), stderr: Some("why".into()), ..Response::default() })
        };
        assert_eq!(command(0), Ok(()));
        assert_eq!(command(65), Err(HandlerError::permanent("exit 65: why")));
        assert_eq!(command(1), Err(HandlerError::transient("exit 1: why")));
        assert!(matches!(command(75), Err(HandlerError::Permanent { .. })), "by its on_exit rule");
    }
}
