//! The dead-letter tooling against the in-memory broker: what is selected, what moves, and
//! that nothing else moves or changes place.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use super::*;
use crate::broker::memory::Memory;
use crate::broker::{HeaderValue, Outgoing};
use crate::config::{ExchangeKind, QueueKind};
use crate::topology::{ExchangeDecl, Plan, QueueDecl, Role};

fn queue(name: &str, role: Role) -> QueueDecl {
    QueueDecl {
        name: name.into(),
        role,
        kind: QueueKind::Quorum,
        dead_letter: None,
        max_length: None,
        single_active_consumer: false,
    }
}

async fn broker() -> Memory {
    let broker = Memory::new();
    let plan = Plan {
        exchanges: vec![ExchangeDecl { name: "x".into(), kind: ExchangeKind::Topic }],
        queues: vec![queue("work", Role::Work), queue("work.dlq", Role::DeadLetter)],
        bindings: vec![],
    };
    broker.declare(&plan).await.expect("declare");
    broker
}

/// A dead-letter copy as the runner makes it: failed `ago` before now for `reason`.
async fn dead(broker: &Memory, n: usize, reason: &str, ago: Duration) {
    let failed_at = humantime::format_rfc3339_seconds(SystemTime::now() - ago).to_string();
    let id = format!("m{n}");
    let body = format!(r#"{{"id":"{id}","type":"t","idempotency_key":"k{n}","payload":{{}}}}"#);
    let headers = BTreeMap::from([
        (envelope::REASON_HEADER.to_string(), HeaderValue::Str(reason.into())),
        (envelope::ERROR_HEADER.to_string(), HeaderValue::Str("HTTP 503".into())),
        (envelope::ATTEMPTS_HEADER.to_string(), HeaderValue::Int(5)),
        (envelope::FAILED_AT_HEADER.to_string(), HeaderValue::Str(failed_at)),
        (envelope::SOURCE_QUEUE_HEADER.to_string(), HeaderValue::Str("work".into())),
        (envelope::ATTEMPT_HEADER.to_string(), HeaderValue::Int(5)),
    ]);
    let message = Outgoing { body: body.into_bytes(), message_id: Some(id), headers, ..Default::default() };
    broker.publish("", "work.dlq", message).await.expect("publish");
}

fn ids(broker: &Memory, queue: &str) -> Vec<String> {
    broker.messages(queue).into_iter().filter_map(|m| m.message_id).collect()
}

fn no_progress(_: &Tally) {}

#[tokio::test]
async fn listing_reads_every_field_and_leaves_the_queue_as_it_was() {
    let broker = broker().await;
    dead(&broker, 1, "exhausted", Duration::from_secs(120)).await;
    dead(&broker, 2, "permanent", Duration::from_secs(10)).await;
    let (entries, tally) = list(&broker, "work.dlq", &Filter::default()).await.expect("list");
    assert_eq!((tally.read, tally.selected, tally.unread), (2, 2, 0));
    let first = &entries[0];
    assert_eq!(first.id.as_deref(), Some("m1"));
    assert_eq!(first.kind.as_deref(), Some("t"));
    assert_eq!(first.reason.as_deref(), Some("exhausted"));
    assert_eq!(first.error.as_deref(), Some("HTTP 503"));
    assert_eq!(first.attempts, Some(5));
    assert_eq!(first.idempotency_key.as_deref(), Some("k1"));
    assert!(first.age_seconds.is_some_and(|a| (119..=125).contains(&a)), "{first:?}");
    assert_eq!(ids(&broker, "work.dlq"), ["m1", "m2"], "nothing taken, order kept");
    assert_eq!(broker.unacked("work.dlq"), 0);
}

#[tokio::test]
async fn filters_select_by_reason_age_id_and_count() {
    let broker = broker().await;
    for n in 0..6 {
        let reason = if n % 2 == 0 { "exhausted" } else { "permanent" };
        dead(&broker, n, reason, Duration::from_secs(if n < 3 { 7200 } else { 60 })).await;
    }
    let listed = |filter: Filter| {
        let broker = broker.clone();
        async move {
            let (entries, _) = list(&broker, "work.dlq", &filter).await.expect("list");
            entries.into_iter().filter_map(|e| e.id).collect::<Vec<_>>()
        }
    };
    assert_eq!(listed(Filter { reason: Some("exhausted".into()), ..Filter::default() }).await, ["m0", "m2", "m4"]);
    assert_eq!(listed(Filter { since: Some(Duration::from_secs(600)), ..Filter::default() }).await, ["m3", "m4", "m5"]);
    assert_eq!(listed(Filter { ids: vec!["m5".into(), "m1".into()], ..Filter::default() }).await, ["m1", "m5"]);
    assert_eq!(listed(Filter { limit: Some(2), ..Filter::default() }).await, ["m0", "m1"]);
    let both = Filter { reason: Some("permanent".into()), since: Some(Duration::from_secs(600)), ..Filter::default() };
    assert_eq!(listed(both).await, ["m3", "m5"]);
}

#[tokio::test]
async fn redrive_moves_the_selected_as_first_attempts_and_keeps_the_rest_in_order() {
    let broker = broker().await;
    for n in 0..5 {
        dead(&broker, n, if n == 2 { "permanent" } else { "exhausted" }, Duration::from_secs(5)).await;
    }
    let filter = Filter { reason: Some("exhausted".into()), limit: Some(3), ..Filter::default() };
    let job = |dry_run| Job {
        queue: "work",
        dlq: "work.dlq",
        action: Action::Redrive,
        filter: filter.clone(),
        dry_run,
        rate: None,
    };
    let dry = apply(&broker, &job(true), &no_progress).await;
    let dry = dry.expect("dry run");
    assert_eq!((dry.queued, dry.read, dry.selected, dry.done), (5, 4, 3, 0), "read until the third selected");
    assert_eq!(ids(&broker, "work.dlq").len(), 5, "a dry run moves nothing");

    let tally = apply(&broker, &job(false), &no_progress).await;
    assert_eq!(tally.expect("redrive").done, 3);
    assert_eq!(ids(&broker, "work"), ["m0", "m1", "m3"]);
    assert_eq!(ids(&broker, "work.dlq"), ["m2", "m4"]);
    for m in broker.messages("work") {
        assert_eq!(m.header(envelope::ATTEMPT_HEADER).as_deref(), Some("1"));
        for name in envelope::FAILURE_HEADERS {
            assert_eq!(m.header(name), None, "{name} dropped");
        }
    }
}

#[tokio::test]
async fn purge_removes_only_the_selected() {
    let broker = broker().await;
    for n in 0..4 {
        dead(&broker, n, "exhausted", Duration::from_secs(5)).await;
    }
    let filter = Filter { ids: vec!["m1".into(), "m2".into()], ..Filter::default() };
    let job = Job { queue: "work", dlq: "work.dlq", action: Action::Purge, filter, dry_run: false, rate: None };
    let tally = apply(&broker, &job, &no_progress).await;
    assert_eq!(tally.expect("purge").done, 2);
    assert_eq!(ids(&broker, "work.dlq"), ["m0", "m3"]);
    assert!(ids(&broker, "work").is_empty());
}
