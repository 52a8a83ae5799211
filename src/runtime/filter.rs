//! Binding filters at delivery: whether a queue takes a message, from the filters of the
//! bindings it came through. The runner is not told which binding routed a message, so it
//! routes again: the bindings of the queue that take the message's exchange and routing key
//! (and headers) are the candidates; the message is taken when any candidate has no filter or
//! a filter that holds. A delivery whose route matches none of the queue's bindings (a copy the
//! broker's delay queues or a redrive brought, or a publish straight to the queue) has every
//! binding as candidate: a message that passed once passes again.
//!
//! Pure: no IO, no broker. The worker and `sluice test` both decide through
//! `outcome::filter`, which calls [`admits`].

use std::cmp::Ordering;

use serde_json::{Number, Value};

use crate::broker::{HeaderValue, Headers, Route};
use crate::config::filter::{Field, Op, Root};
use crate::config::{Binding, Filter, Queue};
use crate::format;
use crate::topology::route;

/// What a filter reads of a message: the message as decoded, and its payload parsed when a
/// filter of the queue reads the payload.
pub struct Message<'a> {
    pub message: &'a format::Message<'a>,
    pub payload: Option<&'a Value>,
}

/// Whether `q` takes the message published with `route` (when known) and `headers`.
pub fn admits(q: &Queue, route: Option<&Route>, headers: &Headers, message: &Message<'_>) -> bool {
    let routed = |b: &Binding| {
        let Some(route) = route else { return false };
        b.exchange == route.exchange
            && b.exchange_kind
                .is_some_and(|kind| route::routes(kind, &b.routing_key, &b.arguments, &route.routing_key, headers))
    };
    let passes = |b: &Binding| b.filter.as_ref().is_none_or(|f| matches(f, message));
    // Routing again costs more than most filters: only when the bindings disagree does it
    // matter which of them routed the message.
    let (mut any, mut all) = (false, true);
    for b in &q.bindings {
        let p = passes(b);
        (any, all) = (any || p, all && p);
    }
    if all || !any {
        return any;
    }
    q.bindings.iter().any(|b| routed(b) && passes(b)) || !q.bindings.iter().any(routed)
}

/// The headers a headers exchange's bindings of `q` match on, from the delivery's `header`:
/// only those are read.
pub fn headers(q: &Queue, header: impl Fn(&str) -> Option<HeaderValue>) -> Headers {
    if q.bindings.iter().all(|b| b.filter.is_none()) {
        return Headers::new();
    }
    let names = q.bindings.iter().flat_map(|b| b.arguments.keys()).filter(|name| !name.starts_with("x-"));
    names.filter_map(|name| Some((name.clone(), header(name)?))).collect()
}

/// Whether any binding of `q` has a filter that reads the payload (which must then be parsed).
pub fn reads_payload(q: &Queue) -> bool {
    fn reads(f: &Filter) -> bool {
        match f {
            Filter::All(fs) | Filter::Any(fs) => fs.iter().any(reads),
            Filter::Not(f) => reads(f),
            Filter::Test { field, .. } => field.root == Root::Payload,
        }
    }
    q.bindings.iter().filter_map(|b| b.filter.as_ref()).any(reads)
}

/// Whether `filter` holds for `message`.
pub fn matches(filter: &Filter, message: &Message<'_>) -> bool {
    match filter {
        Filter::All(fs) => fs.iter().all(|f| matches(f, message)),
        Filter::Any(fs) => fs.iter().any(|f| matches(f, message)),
        Filter::Not(f) => !matches(f, message),
        Filter::Test { field, op } => test(op, lookup(field, message)),
    }
}

/// A field's value as found in a message, borrowed where it can be.
enum Found<'v> {
    Str(&'v str),
    /// A header's text.
    Owned(String),
    Num(Number),
    Json(&'v Value),
}

impl Found<'_> {
    fn text(&self) -> Option<&str> {
        match self {
            Found::Str(s) => Some(s),
            Found::Owned(s) => Some(s),
            Found::Json(Value::String(s)) => Some(s),
            _ => None,
        }
    }

    fn number(&self) -> Option<&Number> {
        match self {
            Found::Num(n) | Found::Json(Value::Number(n)) => Some(n),
            _ => None,
        }
    }

    fn equals(&self, want: &Value) -> bool {
        match (self, want) {
            (Found::Json(value), want) => equal(value, want),
            (Found::Str(s), Value::String(w)) => s == w,
            (Found::Owned(s), Value::String(w)) => s == w,
            (Found::Num(n), Value::Number(w)) => compare(n, w) == Some(Ordering::Equal),
            _ => false,
        }
    }
}

/// The field's value in the message; `None` when absent.
fn lookup<'v>(field: &Field, message: &Message<'v>) -> Option<Found<'v>> {
    let m = message.message;
    let e = &m.envelope;
    let delivery = m.delivery;
    let event = m.event.as_ref();
    match field.root {
        Root::Id => Some(Found::Str(&e.id)),
        Root::Type => Some(Found::Str(&e.kind)),
        Root::Version => Some(Found::Num(Number::from(e.version))),
        Root::OccurredAt => e.occurred_at.as_deref().map(Found::Str),
        // Absent when the producer set none, as the envelope says; the id stands in only for dedup.
        Root::IdempotencyKey => e.idempotency_key.as_deref().map(Found::Str),
        Root::Payload => {
            let value = field.path.iter().try_fold(message.payload?, |node, step| node.as_object()?.get(step))?;
            Some(Found::Json(value))
        }
        Root::Header => match delivery.header(field.path.first()?)? {
            HeaderValue::Str(s) => Some(Found::Owned(s)),
            HeaderValue::Int(i) => Some(Found::Num(Number::from(i))),
        },
        Root::RoutingKey => delivery.route().map(|r| Found::Str(&r.routing_key)),
        Root::Exchange => delivery.route().map(|r| Found::Str(&r.exchange)),
        Root::ContentType => delivery.content_type().map(Found::Str),
        Root::Source => event.map(|e| Found::Str(&e.source)),
        Root::Subject => event?.subject.as_deref().map(Found::Str),
        Root::Time => event?.time.as_deref().map(Found::Str),
        Root::SpecVersion => event.map(|e| Found::Str(&e.specversion)),
        Root::DataContentType => event?.datacontenttype.as_deref().map(Found::Str),
        Root::Body => m.text().map(Found::Str),
    }
}

fn test(op: &Op, found: Option<Found<'_>>) -> bool {
    let Some(found) = found else { return *op == Op::Exists(false) };
    let number = |bound: &Number, wanted: &[Ordering]| {
        found.number().and_then(|n| compare(n, bound)).is_some_and(|o| wanted.contains(&o))
    };
    match op {
        Op::Eq(want) => found.equals(want),
        Op::In(wanted) => match &found {
            Found::Str(s) => wanted.contains_str(s),
            Found::Owned(s) => wanted.contains_str(s),
            Found::Num(n) => wanted.contains_number(n),
            Found::Json(value) => wanted.contains(value),
        },
        Op::Gt(b) => number(b, &[Ordering::Greater]),
        Op::Gte(b) => number(b, &[Ordering::Greater, Ordering::Equal]),
        Op::Lt(b) => number(b, &[Ordering::Less]),
        Op::Lte(b) => number(b, &[Ordering::Less, Ordering::Equal]),
        Op::Exists(present) => *present,
        Op::Prefix(p) => found.text().is_some_and(|s| s.starts_with(p.as_str())),
    }
}

/// JSON equality, with numbers equal by value (`1` and `1.0`).
fn equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => compare(x, y) == Some(Ordering::Equal),
        _ => a == b,
    }
}

/// Numbers by value, exactly: an integer against a float is not rounded to the float first
/// (`9007199254740993` is greater than `9007199254740992.0`).
fn compare(a: &Number, b: &Number) -> Option<Ordering> {
    let int = |n: &Number| n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from));
    match (int(a), int(b)) {
        (Some(x), Some(y)) => Some(x.cmp(&y)),
        (Some(x), None) => int_to_float(x, b.as_f64()?),
        (None, Some(y)) => int_to_float(y, a.as_f64()?).map(Ordering::reverse),
        (None, None) => a.as_f64()?.partial_cmp(&b.as_f64()?),
    }
}

/// An integer (within 64 bits) against a float.
fn int_to_float(i: i128, f: f64) -> Option<Ordering> {
    if f.is_nan() {
        return None;
    }
    // Past ±2^64 the float is beyond every integer here; within, its integral part is exact.
    if f >= 18_446_744_073_709_551_616.0 {
        return Some(Ordering::Less);
    }
    if f < -18_446_744_073_709_551_616.0 {
        return Some(Ordering::Greater);
    }
    let whole = f.trunc();
    let by_fraction = whole.partial_cmp(&f)?;
    Some(i.cmp(&(whole as i128)).then(by_fraction))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::broker::{Kept, Properties};
    use crate::config::filter::Values;
    use crate::vocab::format::Format;

    fn n(v: Value) -> Number {
        match v {
            Value::Number(n) => n,
            other => panic!("not a number: {other}"),
        }
    }

    #[test]
    fn numbers_compare_exactly_across_integers_and_floats() {
        let cases = [
            (json!(1), json!(1.0), Some(Ordering::Equal)),
            (json!(5), json!(5.5), Some(Ordering::Less)),
            (json!(-5), json!(-5.5), Some(Ordering::Greater)),
            (json!(9007199254740993u64), json!(9007199254740992.0), Some(Ordering::Greater)),
            (json!(u64::MAX), json!(1.8446744073709552e19), Some(Ordering::Less)),
            (json!(i64::MIN), json!(-1e300), Some(Ordering::Greater)),
            (json!(2.5), json!(2), Some(Ordering::Greater)),
            (json!(0.1), json!(0.2), Some(Ordering::Less)),
            (json!(u64::MAX), json!(-1), Some(Ordering::Greater)),
        ];
        for (a, b, want) in cases {
            assert_eq!(compare(&n(a.clone()), &n(b.clone())), want, "{a} vs {b}");
        }
    }

    /// Issue 31 item 6: `in:` is a set; it must say what `eq` says of every value, numbers by
    /// value across integers and floats included.
    #[test]
    fn in_agrees_with_eq_for_every_pair() {
        let values = [
            json!(1),
            json!(1.0),
            json!(-1),
            json!(-0.0),
            json!(0),
            json!(2.5),
            json!(9007199254740993u64),
            json!(9007199254740992.0),
            json!(u64::MAX),
            json!(1.8446744073709552e19),
            json!(i64::MIN),
            json!(-9.223372036854776e18),
            json!(1e300),
            json!("1"),
            json!("a"),
            json!(true),
            json!(false),
            json!(null),
            json!([1]),
            json!({"a": 1}),
        ];
        // A filter lists scalars only (validation refuses lists and objects).
        for listed in values.iter().filter(|v| !v.is_array() && !v.is_object()) {
            let set = Values::new(vec![listed.clone()]);
            for found in &values {
                let by_eq = test(&Op::Eq(listed.clone()), Some(Found::Json(found)));
                let by_in = test(&Op::In(set.clone()), Some(Found::Json(found)));
                assert_eq!(by_in, by_eq, "{found} in [{listed}]");
                if let Value::Number(n) = found {
                    assert_eq!(test(&Op::In(set.clone()), Some(Found::Num(n.clone()))), by_eq, "{found} in [{listed}]");
                }
                if let Value::String(s) = found {
                    assert_eq!(test(&Op::In(set.clone()), Some(Found::Str(s))), by_eq, "{found} in [{listed}]");
                }
            }
        }
    }

    fn message_test(op: Op, payload: Value) -> bool {
        let body = json!({"id": "m-1", "type": "order.created", "payload": payload}).to_string();
        let delivery = Kept::standalone(body.into(), Properties::default());
        let decoded = format::Message::decode(Format::Envelope, &delivery).expect("an envelope");
        let payload = decoded.envelope.payload_value().expect("a payload");
        let field = Field { root: Root::Payload, path: vec!["x".into()] };
        let message = Message { message: &decoded, payload: Some(&payload) };
        matches(&Filter::Test { field, op }, &message)
    }

    #[test]
    fn operators_on_present_absent_and_mistyped_values() {
        let cases = [
            (Op::Eq(json!("a")), json!({"x": "a"}), true),
            (Op::Eq(json!(1)), json!({"x": 1.0}), true),
            (Op::Eq(json!(null)), json!({"x": null}), true),
            (Op::Eq(json!(null)), json!({}), false),
            (Op::In(Values::new(vec![json!("a"), json!(2)])), json!({"x": 2}), true),
            (Op::In(Values::new(vec![json!("a"), json!(2)])), json!({"x": "2"}), false),
            (Op::Gte(n(json!(100))), json!({"x": 100}), true),
            (Op::Gt(n(json!(100))), json!({"x": 100}), false),
            (Op::Lt(n(json!(100))), json!({"x": "50"}), false),
            (Op::Lte(n(json!(1.5))), json!({"x": 1}), true),
            (Op::Exists(true), json!({"x": null}), true),
            (Op::Exists(false), json!({"x": null}), false),
            (Op::Exists(false), json!({}), true),
            (Op::Exists(true), json!([1]), false),
            (Op::Prefix("eu-".into()), json!({"x": "eu-west"}), true),
            (Op::Prefix("eu-".into()), json!({"x": 7}), false),
        ];
        for (op, payload, want) in cases {
            assert_eq!(message_test(op.clone(), payload.clone()), want, "{op:?} on {payload}");
        }
    }

    #[test]
    fn envelope_fields_as_the_producer_sent_them() {
        let body = json!({"id": "m-1", "type": "order.created", "version": 2, "payload": {}}).to_string();
        let delivery = Kept::standalone(body.into(), Properties::default());
        let decoded = format::Message::decode(Format::Envelope, &delivery).expect("an envelope");
        let message = Message { message: &decoded, payload: None };
        let holds =
            |root: Root, op: Op| matches(&Filter::Test { field: Field { root, path: Vec::new() }, op }, &message);
        assert!(holds(Root::Type, Op::Prefix("order.".into())));
        assert!(holds(Root::Type, Op::In(Values::new(vec![json!("x"), json!("order.created")]))));
        assert!(holds(Root::Id, Op::Eq(json!("m-1"))));
        assert!(holds(Root::Version, Op::Gte(n(json!(2)))));
        assert!(holds(Root::Version, Op::Eq(json!(2.0))));
        assert!(!holds(Root::Version, Op::Eq(json!("2"))));
        // No key set: absent, though the id stands in for it in deduplication.
        assert!(holds(Root::IdempotencyKey, Op::Exists(false)));
        assert!(holds(Root::OccurredAt, Op::Exists(false)));
        assert!(!holds(Root::Payload, Op::Exists(true)), "no payload parsed: none read");
    }

    /// Issue 34: every format's metadata (headers, route, content type) and a CloudEvent's and
    /// bytes' own fields, as the message carries them; absent where it carries none.
    #[test]
    fn metadata_and_format_fields() {
        use crate::broker::{HeaderValue, Route};
        let headers = [
            ("x-tenant".to_string(), HeaderValue::Str("acme".into())),
            ("x-tier".to_string(), HeaderValue::Int(3)),
            ("ce-id".to_string(), HeaderValue::Str("A-1".into())),
            ("ce-source".to_string(), HeaderValue::Str("/orders".into())),
            ("ce-type".to_string(), HeaderValue::Str("order.created".into())),
            ("ce-subject".to_string(), HeaderValue::Str("o-7".into())),
        ];
        let properties = Properties {
            headers: headers.into(),
            content_type: Some("application/json".into()),
            route: Some(Route { exchange: "ev".into(), routing_key: "order.created".into() }),
            ..Properties::default()
        };
        let delivery = Kept::standalone(br#"{"n":1}"#.as_slice().into(), properties);
        let decoded = format::Message::decode(Format::CloudEvents, &delivery).expect("a CloudEvent");
        let message = Message { message: &decoded, payload: None };
        let holds = |root: Root, path: &[&str], op: Op| {
            let field = Field { root, path: path.iter().map(|s| s.to_string()).collect() };
            matches(&Filter::Test { field, op }, &message)
        };
        assert!(holds(Root::Header, &["x-tenant"], Op::Eq(json!("acme"))));
        assert!(holds(Root::Header, &["x-tenant"], Op::In(Values::new(vec![json!("acme")]))));
        assert!(holds(Root::Header, &["x-tier"], Op::Gte(n(json!(3)))));
        assert!(holds(Root::Header, &["x-absent"], Op::Exists(false)));
        assert!(holds(Root::RoutingKey, &[], Op::Prefix("order.".into())));
        assert!(holds(Root::Exchange, &[], Op::Eq(json!("ev"))));
        assert!(holds(Root::ContentType, &[], Op::Eq(json!("application/json"))));
        assert!(holds(Root::Source, &[], Op::Eq(json!("/orders"))));
        assert!(holds(Root::Subject, &[], Op::Eq(json!("o-7"))));
        assert!(holds(Root::SpecVersion, &[], Op::Eq(json!("1.0"))));
        assert!(holds(Root::Time, &[], Op::Exists(false)));
        assert!(holds(Root::IdempotencyKey, &[], Op::Eq(json!("/orders A-1"))));
        assert!(holds(Root::Body, &[], Op::Exists(false)), "a CloudEvent has no body field");
        let delivery = Kept::standalone(b"plain text".as_slice().into(), Properties::default());
        let decoded = format::Message::decode(Format::Bytes, &delivery).expect("bytes");
        let message = Message { message: &decoded, payload: None };
        let field = Field { root: Root::Body, path: Vec::new() };
        assert!(matches(&Filter::Test { field, op: Op::Prefix("plain".into()) }, &message));
        let field = Field { root: Root::RoutingKey, path: Vec::new() };
        assert!(matches(&Filter::Test { field, op: Op::Exists(false) }, &message), "no route: absent");
    }
}
