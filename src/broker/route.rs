//! How an exchange picks the queues of a message, as RabbitMQ does: direct (the routing key
//! equals the binding's), fanout (every binding), topic (`*` is one word, `#` zero or more)
//! and headers (`x-match` `all` or `any` over the binding's arguments).
//!
//! Pure matching of one binding; the brokers that route themselves (embedded, in-memory) own
//! their bindings and the default exchange.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{HeaderValue, Headers};
use crate::config::ExchangeKind;

/// Whether a binding of an exchange of `kind` (its key and arguments) takes a message
/// published with `routing_key` and `headers`.
pub fn routes(
    kind: ExchangeKind,
    binding_key: &str,
    arguments: &BTreeMap<String, Value>,
    routing_key: &str,
    headers: &Headers,
) -> bool {
    match kind {
        ExchangeKind::Direct => binding_key == routing_key,
        ExchangeKind::Fanout => true,
        ExchangeKind::Topic => topic_match(binding_key, routing_key),
        ExchangeKind::Headers => headers_match(arguments, headers),
    }
}

/// AMQP topic matching: `*` is one word, `#` zero or more. An empty key has no words (so `#`
/// and the empty pattern match it, `*` does not), as in RabbitMQ.
pub fn topic_match(pattern: &str, key: &str) -> bool {
    fn go(p: &[&str], k: &[&str]) -> bool {
        match (p.first(), k.first()) {
            (None, None) => true,
            (Some(&"#"), _) => go(&p[1..], k) || (!k.is_empty() && go(p, &k[1..])),
            (Some(&"*"), Some(_)) => go(&p[1..], &k[1..]),
            (Some(a), Some(b)) if a == b => go(&p[1..], &k[1..]),
            _ => false,
        }
    }
    fn words(s: &str) -> Vec<&str> {
        if s.is_empty() { Vec::new() } else { s.split('.').collect() }
    }
    go(&words(pattern), &words(key))
}

/// RabbitMQ's headers matching: `x-match` is `all` (the default) or `any`, and
/// `all-with-x`/`any-with-x` also match the binding's `x-` arguments, which are otherwise
/// skipped. A null argument asks only that the header be present. `all` of nothing matches;
/// `any` of nothing does not.
pub fn headers_match(arguments: &BTreeMap<String, Value>, headers: &Headers) -> bool {
    let mode = arguments.get("x-match").and_then(Value::as_str).unwrap_or("all");
    let with_x = mode.ends_with("-with-x");
    let mut pairs = arguments.iter().filter(|(k, _)| *k != "x-match" && (with_x || !k.starts_with("x-")));
    let matches = |(name, wanted): (&String, &Value)| match (headers.get(name), wanted) {
        (None, _) => false,
        (Some(_), Value::Null) => true,
        (Some(HeaderValue::Str(s)), Value::String(w)) => s == w,
        (Some(HeaderValue::Int(i)), Value::Number(w)) => w.as_i64() == Some(*i),
        (Some(_), _) => false,
    };
    if mode.starts_with("any") { pairs.any(matches) } else { pairs.all(matches) }
}
