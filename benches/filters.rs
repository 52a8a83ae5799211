//! The per-message cost of binding filters (issue 24): `outcome::filter`, the check the worker
//! and `sluice test` run on every delivery, timed in a loop on a queue without filters, with a
//! filter on envelope fields only, and with the README's filter on the payload (which parses the
//! payload first), for a message the filter takes and one it refuses (where the bindings
//! disagree and the message is routed again); and, on a payload already parsed, the decision
//! alone and the filter's evaluation alone.
//!
//! A timing loop, not a criterion harness: it prints nanoseconds per call (the median of 9
//! rounds of 100,000 calls) for BENCHMARKS.md, and asserts nothing.
//!
//! ```text
//! cargo bench --bench filters
//! ```

use std::hint::black_box;
use std::time::Instant;

use serde_json::json;
use sluice::broker::{Headers, Kept, Properties, Route};
use sluice::config::{Config, Queue};
use sluice::envelope::Envelope;
use sluice::format::Message;
use sluice::runtime::{filter, outcome};
use sluice::vocab::format::Format;

const ROUNDS: usize = 9;
const CALLS: usize = 100_000;

const PIPELINE: &str = r#"version: 1
exchanges:
  orders: {type: topic}
queues:
  plain:
    bind: [{exchange: orders, routing_key: order.created}]
    handler: {webhook: {url: "http://127.0.0.1:9/x"}}
  by_type:
    bind:
      - exchange: orders
        routing_key: order.created
        filter: {field: type, in: [order.created, order.imported]}
    handler: {webhook: {url: "http://127.0.0.1:9/x"}}
  by_payload:
    bind:
      - exchange: orders
        routing_key: order.created
        filter:
          all:
            - {field: payload.amount_cents, gte: 10000}
            - {field: payload.currency, in: [EUR, USD]}
            - not: {field: payload.test, exists: true}
      - exchange: orders
        routing_key: refund.#
    handler: {webhook: {url: "http://127.0.0.1:9/x"}}
"#;

/// Nanoseconds per call of `f`: the median round.
fn time(mut f: impl FnMut() -> bool) -> f64 {
    let mut rounds: Vec<f64> = (0..ROUNDS)
        .map(|_| {
            let started = Instant::now();
            for _ in 0..CALLS {
                black_box(f());
            }
            started.elapsed().as_nanos() as f64 / CALLS as f64
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    rounds[ROUNDS / 2]
}

fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("p.yaml"), PIPELINE).expect("write");
    let validation = sluice::config::load(&[dir.path().to_path_buf()]);
    let config: Config = validation.config.unwrap_or_else(|| panic!("{:?}", validation.diagnostics));
    // A payload of a usual size (about 400 bytes), the fields the filter reads among others.
    let payload = json!({
        "order_id": 1234, "amount_cents": 25000, "currency": "EUR",
        "customer": {"id": "c-981", "email": "a@example.com", "country": "FR", "tier": "gold"},
        "lines": [{"sku": "A-1", "qty": 2, "price_cents": 5000}, {"sku": "B-7", "qty": 1, "price_cents": 15000}],
        "shipping": {"method": "express", "address": {"city": "Lyon", "postcode": "69001"}},
        "created_by": "checkout-service", "note": "leave at the door"
    });
    let body = Envelope::new("order.created", &payload, Some("order:1234".into())).encode();
    let delivery = Kept::standalone(body.clone().into(), Properties::default());
    let decoded = Message::decode(Format::Envelope, &delivery).expect("an envelope");
    let envelope = &decoded.envelope;
    let route = Route { exchange: "orders".into(), routing_key: "order.created".into() };
    let headers = Headers::new();
    let queue = |name: &str| -> &Queue { &config.queues[name] };

    println!(
        "binding filters, ns per message (median of {ROUNDS} rounds of {CALLS} calls), payload {} bytes",
        body.len()
    );
    for name in ["plain", "by_type", "by_payload"] {
        let q = queue(name);
        let ns = time(|| outcome::filter(q, &decoded, Some(&route), &headers, 1).is_ok());
        println!("  outcome::filter, queue {name:<10} {ns:>8.1}");
    }
    // Refused by the first binding's filter, let in by the second's lack of one: the bindings
    // disagree, so the message is routed again to tell which of them took it.
    let small = Envelope::new("order.created", &json!({"amount_cents": 500, "currency": "EUR"}), None).encode();
    let small = Kept::standalone(small.into(), Properties::default());
    let small = Message::decode(Format::Envelope, &small).expect("an envelope");
    let ns = time(|| outcome::filter(queue("by_payload"), &small, Some(&route), &headers, 1).is_ok());
    println!("  outcome::filter, by_payload, refused  {ns:>8.1}");
    let parsed = envelope.payload_value().expect("a payload");
    let message = filter::Message { message: &decoded, payload: Some(&parsed) };
    let q = queue("by_payload");
    let ns = time(|| filter::admits(q, Some(&route), &headers, &message));
    println!("  filter::admits alone, payload parsed    {ns:>8.1}");
    let parsed_small = small.envelope.payload_value().expect("a payload");
    let refused = filter::Message { message: &small, payload: Some(&parsed_small) };
    let ns = time(|| filter::admits(q, Some(&route), &headers, &refused));
    println!("  filter::admits alone, refused (routing) {ns:>8.1}");
    let first = q.bindings[0].filter.as_ref().expect("by_payload's first binding has a filter");
    let ns = time(|| filter::matches(first, &message));
    println!("  filter::matches alone (no routing)      {ns:>8.1}");
    let ns = time(|| envelope.payload_value().is_ok());
    println!("  parsing the payload alone              {ns:>8.1}");
}
