//! The dead-letter tooling against the in-memory broker: what is selected, what moves, and
//! that nothing else moves or changes place.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use super::*;
use crate::broker::memory::Memory;
use crate::broker::{Broker as _, HeaderValue, Outgoing, Publish as _};
use crate::config::ExchangeKind;
use crate::topology::{ExchangeDecl, Plan, QueueDecl, Role};

async fn broker() -> Memory {
    let broker = Memory::new();
    let plan = Plan {
        exchanges: vec![ExchangeDecl { name: "x".into(), kind: ExchangeKind::Topic }],
        queues: vec![QueueDecl::new("work", Role::Work), QueueDecl::new("work.dlq", Role::DeadLetter)],
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
    broker.messages(queue).into_iter().filter_map(|m| m.properties.message_id).collect()
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

/// Issue 19: a browse waits out quiet spells and ends only once the broker has had nothing
/// ready for one more of them; then it says the rest is elsewhere. Here it is told of four
/// messages: another client holds one and hands it back after a pause (read); the fourth is
/// gone (not read).
#[tokio::test]
async fn a_browse_reads_what_comes_late_and_says_why_it_read_fewer() {
    let broker = broker().await;
    for n in 0..3 {
        dead(&broker, n, "exhausted", Duration::from_secs(5)).await;
    }
    let (_held, other) = broker.browse("work.dlq", Credit::at_most(1)).await.expect("another client");
    let mut browse = Browse::start(&broker, "work.dlq", 4, MAX_HELD).await.expect("browse");
    let mut read = Vec::new();
    for _ in 0..2 {
        read.push(browse.next().await.expect("read").expect("a message").message_id().map(String::from));
    }
    // Handed back after one quiet spell and a depth check that found nothing ready.
    let (late, ()) = tokio::join!(browse.next(), async {
        tokio::time::sleep(QUIET + QUIET / 2).await;
        other.close().await;
    });
    read.push(late.expect("read").expect("the late message").message_id().map(String::from));
    assert_eq!(read, [Some("m1".into()), Some("m2".into()), Some("m0".into())]);
    assert!(browse.next().await.expect("no error").is_none(), "the fourth is nowhere to be read");
    assert_eq!(browse.close().await, (1, Some(Unread::Elsewhere)));
}

/// Issue 19: a purge while another client (a redrive) holds every message of the queue reads
/// none, and says who holds them. (It said "0 read" and nothing else.)
#[tokio::test]
async fn a_pass_that_finds_every_message_held_says_so() {
    let broker = broker().await;
    for n in 0..2 {
        dead(&broker, n, "exhausted", Duration::from_secs(5)).await;
    }
    let (mut held, redrive) = broker.browse("work.dlq", Credit::at_most(2)).await.expect("the redrive's browse");
    for _ in 0..2 {
        held.next().await.expect("a delivery").expect("no error");
    }
    let job = Job {
        queue: "work",
        dlq: "work.dlq",
        action: Action::Purge,
        filter: Filter::default(),
        dry_run: false,
        rate: None,
    };
    let tally = apply(&broker, &job, &no_progress).await.expect("purge");
    assert_eq!((tally.read, tally.unread_because), (0, Some(Unread::Held { consumers: 1 })));
    redrive.close().await;
    let tally = apply(&broker, &job, &no_progress).await.expect("purge");
    assert_eq!((tally.done, tally.unread_because), (2, None), "read once handed back");
}

/// Issue 19: a browse that holds its whole window stops there and says so.
#[tokio::test]
async fn a_browse_that_fills_its_window_says_it_passed_over_the_rest() {
    let broker = broker().await;
    for n in 0..3 {
        dead(&broker, n, "exhausted", Duration::from_secs(5)).await;
    }
    let mut browse = Browse::start(&broker, "work.dlq", 3, 2).await.expect("browse");
    for _ in 0..2 {
        assert!(browse.next().await.expect("read").is_some());
    }
    assert!(browse.next().await.expect("no error").is_none());
    assert_eq!(browse.close().await, (1, Some(Unread::PassedOver)));
    assert_eq!(ids(&broker, "work.dlq"), ["m0", "m1", "m2"], "all handed back, in order");
}

/// A pass after a lost session waits until the messages that session held are ready again:
/// begun before, it read the few that were and ended (the cluster test's redrive left 2,613 of
/// 3,000). A hand-back that never comes is waited for only so long.
#[tokio::test]
async fn a_pass_after_a_lost_session_waits_for_what_it_held() {
    let broker = broker().await;
    for n in 0..3 {
        dead(&broker, n, "exhausted", Duration::from_secs(5)).await;
    }
    let (_held, lost) = broker.browse("work.dlq", Credit::at_most(2)).await.expect("the lost session's browse");
    let within = Duration::from_secs(60);
    let (waited, closed) = tokio::join!(
        async {
            handed_back(&broker, "work.dlq", 3, within).await.expect("depth");
            tokio::time::Instant::now()
        },
        async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            lost.close().await;
            tokio::time::Instant::now()
        }
    );
    assert!(waited >= closed, "returned before the hand-back");
    let job = Job {
        queue: "work",
        dlq: "work.dlq",
        action: Action::Redrive,
        filter: Filter::default(),
        dry_run: false,
        rate: None,
    };
    assert_eq!(apply(&broker, &job, &no_progress).await.expect("redrive").done, 3);

    let gave_up = tokio::time::timeout(within, handed_back(&broker, "work.dlq", 1, Duration::from_millis(300))).await;
    assert!(matches!(gave_up, Ok(Ok(()))), "gives up waiting after `within`");
}

/// The ids of a page.
fn page_ids(page: &Page) -> Vec<&str> {
    page.entries.iter().filter_map(|e| e.id.as_deref()).collect()
}

/// Issue 31 item 8: pages follow their cursors through every message once, in order; a page
/// that ends at the last message says there is no next one; messages removed from before a
/// cursor move nothing past it, unless the cursor's own message went (then as many as were
/// removed are passed over, as documented).
#[tokio::test]
async fn pages_follow_their_cursors() {
    let broker = broker().await;
    for n in 0..10 {
        dead(&broker, n, "exhausted", Duration::from_secs(60)).await;
    }
    let three = Filter { limit: Some(3), ..Filter::default() };
    let (mut seen, mut after) = (Vec::new(), None);
    loop {
        let page = page(&broker, "work.dlq", &three, after.as_ref()).await.expect("page");
        seen.push(page_ids(&page).join(","));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(seen, ["m0,m1,m2", "m3,m4,m5", "m6,m7,m8", "m9"]);
    let nine = Filter { limit: Some(9), ..Filter::default() };
    let first = page(&broker, "work.dlq", &nine, None).await.expect("page");
    let next = first.next.expect("one more");
    let last =
        page(&broker, "work.dlq", &Filter { limit: Some(1), ..Filter::default() }, Some(&next)).await.expect("page");
    assert_eq!((page_ids(&last), &last.next), (vec!["m9"], &None), "full, and the last: no next page");

    let first = page(&broker, "work.dlq", &three, None).await.expect("page");
    let cursor = first.next.expect("a next page");
    assert_eq!(cursor.to_string(), "3:m2");
    let remove = |ids: &[&str]| {
        let filter = Filter { ids: ids.iter().map(|s| s.to_string()).collect(), ..Filter::default() };
        let broker = broker.clone();
        async move {
            let job = Job { queue: "work", dlq: "work.dlq", action: Action::Purge, filter, dry_run: false, rate: None };
            apply(&broker, &job, &no_progress).await.expect("purge");
        }
    };
    remove(&["m0", "m1"]).await;
    let next = page(&broker, "work.dlq", &three, Some(&cursor)).await.expect("page");
    assert_eq!(page_ids(&next), ["m3", "m4", "m5"], "nothing passed over");
    remove(&["m2"]).await;
    let next = page(&broker, "work.dlq", &three, Some(&cursor)).await.expect("page");
    assert_eq!(page_ids(&next), ["m6", "m7", "m8"], "the cursor's own message gone: three read past");
}

#[test]
fn cursors_read_back_what_they_write() {
    for (text, cursor) in [
        ("3", Some(Cursor { read: 3, last: None })),
        ("3:m2", Some(Cursor { read: 3, last: Some("m2".into()) })),
        ("0:a:b", Some(Cursor { read: 0, last: Some("a:b".into()) })),
        ("12:", Some(Cursor { read: 12, last: Some(String::new()) })),
        ("99999999999:x", Some(Cursor { read: u32::MAX, last: Some("x".into()) })),
        ("", None),
        (":m2", None),
        ("-1", None),
        ("x:3", None),
    ] {
        assert_eq!(Cursor::parse(text), cursor, "{text:?}");
        if let Some(cursor) = cursor.filter(|c| c.read != u32::MAX) {
            assert_eq!(cursor.to_string(), text);
        }
    }
}
