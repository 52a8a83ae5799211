//! How an exchange picks the queues of a message, as RabbitMQ does: direct (the routing key
//! equals the binding's), fanout (every binding), topic (`*` is one word, `#` zero or more)
//! and headers (`x-match` `all` or `any` over the binding's arguments).
//!
//! [`targets`] routes over a topology's exchanges, queues and bindings: the one routing of
//! every broker that routes in sluice (embedded, Redis, in-memory) and of `sluice test`, which
//! has no broker ([`plan_targets`]). RabbitMQ routes itself.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{BindingDecl, Plan};
use crate::envelope::{HeaderValue, Headers};
use crate::vocab::ExchangeKind;

/// The queues a message published to `exchange` with `routing_key` and `headers` reaches
/// under `plan`, as [`targets`] routes.
pub fn plan_targets(plan: &Plan, exchange: &str, routing_key: &str, headers: &Headers) -> Option<Vec<String>> {
    let kind = plan.exchanges.iter().find(|e| e.name == exchange).map(|e| e.kind);
    targets(exchange, routing_key, headers, kind, |q| plan.queue(q).is_some(), &plan.bindings)
}

/// The queues a message published to `exchange` with `routing_key` and `headers` reaches, over
/// a topology whose exchange is of `declared` kind (`None`: not declared), whose queues are
/// those `is_queue` knows, and whose bindings are `bindings`: sorted, each once however many of
/// its bindings match; empty when it is unroutable. The default exchange (`""`) routes to the
/// queue the routing key names; `amq.*` exchanges are built into every broker, as on
/// RabbitMQ. `None` when there is no such exchange.
pub fn targets(
    exchange: &str,
    routing_key: &str,
    headers: &Headers,
    declared: Option<ExchangeKind>,
    is_queue: impl Fn(&str) -> bool,
    bindings: &[BindingDecl],
) -> Option<Vec<String>> {
    if exchange.is_empty() {
        return Some(if is_queue(routing_key) { vec![routing_key.to_string()] } else { Vec::new() });
    }
    let kind = declared.or(ExchangeKind::builtin(exchange))?;
    let mut queues: Vec<String> = bindings
        .iter()
        .filter(|b| b.exchange == exchange && routes(kind, &b.routing_key, &b.arguments, routing_key, headers))
        .map(|b| b.queue.clone())
        .collect();
    queues.sort();
    queues.dedup();
    Some(queues)
}

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
///
/// Runs the pattern as an automaton over the key's words, tracking every pattern position
/// reachable at once: O(words × segments), where trying each split of the words per `#`
/// (backtracking) is exponential in the number of `#`.
pub fn topic_match(pattern: &str, key: &str) -> bool {
    let pattern = words(pattern);
    // reached[i]: the words read so far can be matched by the first i segments.
    let mut reached = vec![false; pattern.len() + 1];
    reached[0] = true;
    skip_hashes(&pattern, &mut reached);
    for word in words(key) {
        // Back to front, so that reached[i - 1] is still the state before this word.
        for i in (0..reached.len()).rev() {
            let hash_takes_it = reached[i] && pattern.get(i) == Some(&"#");
            let segment_takes_it = i > 0
                && reached[i - 1]
                && match pattern[i - 1] {
                    "#" => false,
                    "*" => true,
                    segment => segment == word,
                };
            reached[i] = hash_takes_it || segment_takes_it;
        }
        if !reached.contains(&true) {
            return false;
        }
        skip_hashes(&pattern, &mut reached);
    }
    reached[pattern.len()]
}

/// A `#` may match no word: wherever one is reached, so is the segment after it.
fn skip_hashes(pattern: &[&str], reached: &mut [bool]) {
    for (i, segment) in pattern.iter().enumerate() {
        if reached[i] && *segment == "#" {
            reached[i + 1] = true;
        }
    }
}

/// The words of a topic pattern or key; an empty one has none.
fn words(s: &str) -> Vec<&str> {
    if s.is_empty() { Vec::new() } else { s.split('.').collect() }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_words_as_rabbitmq_splits_them() {
        let cases = [
            ("#", "", true),
            ("#", "a.b.c", true),
            ("*", "", false),
            ("*", "a", true),
            ("*", "a.b", false),
            ("", "", true),
            ("a.#", "a", true),
            ("a.#.b", "a.b", true),
            ("a.#.b", "a.x.y.b", true),
            ("a.#.b", "a.x.y.c", false),
            ("a.*.b", "a.b", false),
            ("a.*.b", "a.x.b", true),
            ("#.b", "b", true),
            ("a.*", "a.", true),
            ("a", "a.b", false),
        ];
        for (pattern, key, expected) in cases {
            assert_eq!(topic_match(pattern, key), expected, "pattern {pattern:?} key {key:?}");
        }
    }

    /// Issue 19: a binding with five `#` and a 127-word routing key that it does not match
    /// took 6.9 s per publish (each `#` tried every split of the words). Matching is now
    /// O(words × segments); were it exponential again, the ten-`#` case would not finish.
    #[test]
    fn many_hashes_and_a_long_key_match_without_backtracking() {
        let key = ["w"; 127].join(".");
        assert!(!topic_match("#.#.#.#.#.end", &key));
        assert!(!topic_match(&format!("{}.end", ["#"; 10].join(".")), &key));
        assert!(topic_match("#.#.#.#.#.w", &key));
        assert!(topic_match("w.#.#.*.#.#.w.#", &key));
    }

    /// The plain recursive matcher (exponential in the number of `#`): the reference that
    /// [`topic_match`] is checked against on short patterns and keys.
    fn reference_match(pattern: &str, key: &str) -> bool {
        fn go(p: &[&str], k: &[&str]) -> bool {
            match (p.first(), k.first()) {
                (None, None) => true,
                (Some(&"#"), _) => go(&p[1..], k) || (!k.is_empty() && go(p, &k[1..])),
                (Some(&"*"), Some(_)) => go(&p[1..], &k[1..]),
                (Some(a), Some(b)) if a == b => go(&p[1..], &k[1..]),
                _ => false,
            }
        }
        go(&words(pattern), &words(key))
    }

    proptest::proptest! {
        #[test]
        fn topic_match_agrees_with_the_recursive_reference(
            pattern in proptest::collection::vec(proptest::sample::select(&["a", "b", "", "*", "#"][..]), 0..7),
            key in proptest::collection::vec(proptest::sample::select(&["a", "b", "", "*", "#"][..]), 0..9),
        ) {
            let (pattern, key) = (pattern.join("."), key.join("."));
            proptest::prop_assert_eq!(topic_match(&pattern, &key), reference_match(&pattern, &key), "pattern {:?} key {:?}", pattern, key);
        }
    }

    #[test]
    fn headers_match_as_rabbitmq_does() {
        let args = |pairs: &[(&str, Value)]| -> BTreeMap<String, Value> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
        };
        let headers: Headers = [
            ("region".to_string(), HeaderValue::Str("eu".into())),
            ("priority".to_string(), HeaderValue::Int(3)),
            ("x-tenant".to_string(), HeaderValue::Str("t1".into())),
        ]
        .into();
        let cases = [
            (args(&[]), true),
            (args(&[("x-match", "any".into())]), false),
            (args(&[("region", "eu".into()), ("priority", 3.into())]), true),
            (args(&[("region", "eu".into()), ("priority", 4.into())]), false),
            (args(&[("x-match", "any".into()), ("region", "us".into()), ("priority", 3.into())]), true),
            (args(&[("x-match", "any".into()), ("region", "us".into())]), false),
            (args(&[("region", Value::Null)]), true),
            (args(&[("missing", Value::Null)]), false),
            (args(&[("priority", "3".into())]), false),
            // x- arguments are skipped unless the mode says -with-x.
            (args(&[("x-tenant", "other".into())]), true),
            (args(&[("x-match", "all-with-x".into()), ("x-tenant", "other".into())]), false),
            (args(&[("x-match", "any-with-x".into()), ("x-tenant", "t1".into())]), true),
        ];
        for (arguments, expected) in cases {
            assert_eq!(headers_match(&arguments, &headers), expected, "{arguments:?}");
        }
    }

    /// The plan of a pipeline with one exchange of each type and three queues.
    fn plan() -> Plan {
        let text = r##"version: 1
exchanges: {d: {type: direct}, f: {type: fanout}, t: {type: topic}, h: {type: headers}}
x-handler: &handler {command: {program: /bin/true}}
queues:
  a:
    handler: *handler
    bind:
      - {exchange: d, routing_key: k}
      - {exchange: f, routing_key: ignored}
      - {exchange: t, routing_key: "#"}
      - {exchange: h, arguments: {x-match: any, k: v, n: 1}}
  b:
    handler: *handler
    bind: [{exchange: d}, {exchange: f}, {exchange: t, routing_key: "*"}]
  c:
    handler: *handler
    # Two bindings to one queue: one copy.
    bind: [{exchange: t, routing_key: "x.#"}, {exchange: t, routing_key: "x.*"}, {exchange: amq.topic, routing_key: "y.*"}]
"##;
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("p.yaml"), text).expect("write");
        let loaded = crate::config::load(&[dir.path().to_path_buf()]);
        crate::topology::plan(loaded.config.as_ref().expect("valid"))
    }

    #[test]
    fn a_plan_routes_through_every_exchange_type() {
        let plan = plan();
        let v: Headers = [("k".to_string(), HeaderValue::Str("v".into()))].into();
        let none = Headers::new();
        let cases: &[(&str, &str, &Headers, Option<&[&str]>)] = &[
            ("d", "k", &none, Some(&["a"])),
            ("d", "", &none, Some(&["b"])),
            ("d", "K", &none, Some(&[])),
            ("f", "anything", &none, Some(&["a", "b"])),
            // `#` matches zero words, `*` exactly one; an empty key has no words.
            ("t", "", &none, Some(&["a"])),
            ("t", "x", &none, Some(&["a", "b", "c"])),
            ("t", "x.y", &none, Some(&["a", "c"])),
            ("t", "x.y.z", &none, Some(&["a", "c"])),
            ("h", "", &v, Some(&["a"])),
            ("h", "", &none, Some(&[])),
            ("amq.topic", "y.z", &none, Some(&["c"])),
            ("amq.direct", "a", &none, Some(&[])),
            // The default exchange: the queue the key names, if any.
            ("", "b", &none, Some(&["b"])),
            // Dead-letter queues are queues too.
            ("", "a.dlq", &none, Some(&["a.dlq"])),
            ("", "nope", &none, Some(&[])),
            ("missing", "k", &none, None),
        ];
        for (exchange, key, headers, expected) in cases {
            let expected = expected.map(|q| q.iter().map(|s| s.to_string()).collect::<Vec<_>>());
            assert_eq!(plan_targets(&plan, exchange, key, headers), expected, "{exchange} {key:?}");
        }
    }
}
