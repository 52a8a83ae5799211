//! `sluice dlq`, `sluice status` and `sluice plan --broker` against the real RabbitMQ: what
//! a redrive does downstream (each redriven message handled once, despite idempotency), what
//! the filters select, a `kill -9` in the middle of a redrive, and the tables and JSON the
//! commands print for a known state.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use sluice::broker::{Broker as _, HeaderValue, Headers};
use sluice::envelope::{self, Envelope};
use support::{Finished, Place, Receiver, Reply, Sluice, broker_cli};

fn ok(finished: &Finished) -> &str {
    assert_eq!(finished.code, Some(0), "stdout: {}\nstderr: {}", finished.stdout, finished.stderr);
    &finished.stdout
}

/// A dead-letter copy as the runner writes it, published straight into `work.dlq`.
/// [`plant`] with a payload of about `size` bytes.
async fn plant_sized<B: sluice::broker::Publish>(broker: &B, key: &str, size: usize) {
    let envelope = Envelope::new("test.event", &json!({"pad": "x".repeat(size)}), Some(key.to_string()));
    let headers = Headers::from([(envelope::REASON_HEADER.to_string(), HeaderValue::Str("exhausted".into()))]);
    let message = sluice::broker::Outgoing { body: envelope.encode(), headers, ..Default::default() };
    broker.publish("", "work.dlq", message).await.expect("plant");
}

pub async fn plant<B: sluice::broker::Publish>(broker: &B, key: &str, reason: &str, failed: Duration) -> String {
    let envelope = Envelope::new("test.event", &json!({"n": key}), Some(key.to_string()));
    let failed_at = humantime::format_rfc3339_seconds(SystemTime::now() - failed).to_string();
    let headers = Headers::from([
        (envelope::REASON_HEADER.to_string(), HeaderValue::Str(reason.into())),
        (envelope::ERROR_HEADER.to_string(), HeaderValue::Str("HTTP 503: down".into())),
        (envelope::ATTEMPTS_HEADER.to_string(), HeaderValue::Int(3)),
        (envelope::FAILED_AT_HEADER.to_string(), HeaderValue::Str(failed_at)),
        (envelope::SOURCE_QUEUE_HEADER.to_string(), HeaderValue::Str("work".into())),
        (envelope::ATTEMPT_HEADER.to_string(), HeaderValue::Int(3)),
    ]);
    let message = sluice::broker::Outgoing {
        body: envelope.encode(),
        message_id: Some(envelope.id.clone()),
        kind: Some(envelope.kind.clone()),
        headers,
        ..Default::default()
    };
    broker.publish("", "work.dlq", message).await.expect("plant");
    envelope.id.clone()
}

fn json_ids(stdout: &str) -> Vec<String> {
    let listed: Vec<Value> = serde_json::from_str(stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    listed.iter().map(|e| e["id"].as_str().expect("id").to_string()).collect()
}

pub(crate) async fn messages_dead_lettered_while_the_receiver_was_down_run_once_each_after_a_redrive<P: Place>(
    place: P,
) {
    let down = Arc::new(AtomicBool::new(true));
    let flag = down.clone();
    let receiver =
        Receiver::start(move |_, _| if flag.load(Ordering::SeqCst) { Reply::status(503) } else { Reply::ok() }).await;
    // Without the breaker, which would rightly stop consuming (and so dead-letter nothing)
    // while every call fails: this is about redriving what was dead-lettered.
    let dir = support::webhook_pipeline(
        &receiver,
        "    retry: {max_attempts: 2, initial: 100ms, max: 200ms}\n    circuit_breaker: {enabled: false}\n",
    );
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    let keys: Vec<String> = (0..20).map(|n| format!("down-{n}")).collect();
    for key in &keys {
        support::publish(&broker, "ev", "x", key, json!({"key": key})).await;
    }
    let mut runner = Sluice::run(dir.path(), &place.url(), &[]);
    support::wait_until(Duration::from_secs(60), "every message dead-lettered", || async {
        place.depth("work.dlq").await == 20
    })
    .await;
    assert!(receiver.succeeded_keys().is_empty());

    // The receiver recovers; the operator redrives. Each key was claimed, failed and released:
    // the idempotency store must not take the redriven copies for duplicates.
    down.store(false, Ordering::SeqCst);
    let dir_arg = dir.path().to_str().expect("utf-8 path");
    let redriven = broker_cli(&["dlq", "redrive", "work", "--pipelines", dir_arg], &place.url()).await;
    assert!(ok(&redriven).starts_with("20 message(s) redriven to work"), "{}", redriven.stdout);
    support::wait_until(Duration::from_secs(60), "every redriven message handled", || async {
        receiver.succeeded_keys().len() == 20
    })
    .await;
    // A graceful stop finishes whatever is in flight: a second run of a key would show now.
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
    let successes = support::counts(receiver.hits().iter().filter(|h| h.succeeded()).map(|h| h.key().to_string()));
    assert_eq!(successes, keys.iter().map(|k| (k.clone(), 1)).collect::<BTreeMap<_, _>>(), "each once");
    for hit in receiver.hits().iter().filter(|h| h.succeeded()) {
        assert_eq!(hit.header("x-sluice-attempt"), Some("1"), "a redriven copy is a first attempt");
    }
    assert_eq!((place.depth("work").await, place.depth("work.dlq").await), (0, 0));
    broker.close().await;
}

async fn filters_and_dry_run_select_exactly_the_messages_they_name<P: Place>(place: P) {
    let dir = support::work_pipeline("    handler:\n      webhook: {url: \"http://127.0.0.1:9/hook\"}\n");
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    let hour = Duration::from_secs(3600);
    let mut ids = Vec::new();
    for (n, (reason, age)) in [("exhausted", 2 * hour), ("permanent", 2 * hour), ("exhausted", hour / 60)]
        .into_iter()
        .cycle()
        .take(9)
        .enumerate()
    {
        ids.push(plant(&broker, &format!("k{n}"), reason, age).await);
    }
    broker.close().await;
    let url = place.url();
    let d = dir.path().to_str().expect("utf-8 path");
    let list = |extra: &'static [&'static str]| {
        let url = url.clone();
        async move {
            let mut args = vec!["dlq", "list", "work", "--pipelines", d, "--format", "json"];
            args.extend_from_slice(extra);
            json_ids(ok(&broker_cli(&args, &url).await))
        }
    };
    let pick = |f: &dyn Fn(usize) -> bool| -> Vec<String> {
        ids.iter().enumerate().filter(|(n, _)| f(*n)).map(|(_, id)| id.clone()).collect()
    };
    assert_eq!(list(&[]).await, ids, "all, in queue order");
    assert_eq!(list(&["--reason", "exhausted"]).await, pick(&|n| n % 3 != 1));
    assert_eq!(list(&["--since", "30m"]).await, pick(&|n| n % 3 == 2));
    assert_eq!(list(&["--reason", "exhausted", "--limit", "2"]).await, vec![ids[0].clone(), ids[2].clone()]);
    // Issue 31 (left by round 3): a list stopped by its --limit says so, and blames no other
    // client (the embedded broker's said "another client (a runner, another `sluice dlq`) took
    // or holds them" at every --limit).
    let limited = broker_cli(&["dlq", "list", "work", "--pipelines", d, "--limit", "2"], &url).await;
    assert_eq!(ok(&limited).lines().count(), 3, "a header and two rows: {}", limited.stdout);
    assert!(
        limited.stderr.contains("note: 7 message(s) of work.dlq not read: the list stopped at its --limit")
            && !limited.stderr.contains("another client"),
        "{}",
        limited.stderr
    );

    let dry =
        broker_cli(&["dlq", "redrive", "work", "--pipelines", d, "--reason", "permanent", "--dry-run"], &url).await;
    assert!(ok(&dry).starts_with("3 message(s) would be redriven to work (dry run)"), "{}", dry.stdout);
    assert_eq!((place.depth("work.dlq").await, place.depth("work").await), (9, 0), "a dry run moves nothing");

    let moved = broker_cli(&["dlq", "redrive", "work", "--pipelines", d, "--since", "30m", "--limit", "2"], &url).await;
    assert!(ok(&moved).starts_with("2 message(s) redriven to work"), "{}", moved.stdout);
    let in_work: Vec<String> = place
        .drain_queue("work")
        .await
        .iter()
        .map(|(body, _)| Envelope::decode(body).expect("envelope").id.to_string())
        .collect();
    assert_eq!(in_work, vec![ids[2].clone(), ids[5].clone()]);
    let left = list(&[]).await;
    assert_eq!(left, pick(&|n| n != 2 && n != 5));

    let refused = broker_cli(&["dlq", "purge", "work", "--pipelines", d, "--reason", "permanent"], &url).await;
    assert_eq!(refused.code, Some(1), "purge without --yes deletes nothing");
    let purged = broker_cli(&["dlq", "purge", "work", "--pipelines", d, "--reason", "permanent", "--yes"], &url).await;
    assert!(ok(&purged).starts_with("3 message(s) purged"), "{}", purged.stdout);
    assert_eq!(place.depth("work.dlq").await, 4);
}

async fn list_show_and_status_print_a_known_state_as_tables_and_json<P: Place>(place: P) {
    let dir = support::work_pipeline("    handler:\n      webhook: {url: \"http://127.0.0.1:9/hook\"}\n");
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    support::publish(&broker, "ev", "x", "ready-1", json!({})).await;
    support::publish(&broker, "ev", "x", "ready-2", json!({})).await;
    let id = plant(&broker, "key-1", "exhausted", Duration::from_secs(90)).await;
    broker.close().await;
    let (url, d) = (place.url(), dir.path().to_str().expect("utf-8 path"));

    let text = broker_cli(&["dlq", "list", "work", "--pipelines", d], &url).await;
    let lines: Vec<&str> = ok(&text).lines().collect();
    assert_eq!(lines.len(), 2, "{}", text.stdout);
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(header, ["ID", "TYPE", "REASON", "ATTEMPTS", "FAILED-AT", "AGE", "IDEMPOTENCY-KEY", "ERROR"]);
    let row: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(&row[..4], [id.as_str(), "test.event", "exhausted", "3"]);
    assert!(row[5].starts_with("1m"), "age about 90 s: {}", lines[1]);
    assert_eq!(&row[6..], ["key-1", "HTTP", "503:", "down"]);

    let json = broker_cli(&["dlq", "list", "work", "--pipelines", d, "--format", "json"], &url).await;
    let listed: Value = serde_json::from_str(ok(&json)).expect("json");
    let entry = &listed[0];
    assert_eq!(entry["id"], id.as_str());
    assert_eq!(entry["type"], "test.event");
    assert_eq!(entry["reason"], "exhausted");
    assert_eq!(entry["error"], "HTTP 503: down");
    assert_eq!(entry["attempts"], 3);
    assert_eq!(entry["idempotency_key"], "key-1");
    assert!(entry["age_seconds"].as_u64().is_some_and(|a| (89..120).contains(&a)), "{entry}");

    let shown = broker_cli(&["dlq", "show", "work", &id, "--pipelines", d, "--format", "json"], &url).await;
    let shown: Value = serde_json::from_str(ok(&shown)).expect("json");
    assert_eq!(shown["headers"]["x-sluice-source-queue"], "work");
    assert_eq!(shown["body"]["idempotency_key"], "key-1");
    let missing = broker_cli(&["dlq", "show", "work", "no-such-id", "--pipelines", d], &url).await;
    assert_eq!(missing.code, Some(1));
    assert!(missing.stderr.contains("no message with id \"no-such-id\" in work.dlq"), "{}", missing.stderr);

    let status = broker_cli(&["status", d, "--format", "json"], &url).await;
    let status: Value = serde_json::from_str(ok(&status)).expect("json");
    let row = &status["queues"][0];
    assert_eq!(row["queue"], "work");
    assert_eq!(row["ready"], 2);
    assert_eq!(row["consumers"], 0);
    assert_eq!(row["unacked"], Value::Null, "no runner named");
    assert_eq!(row["dead_lettered"], 1);
    assert!(row["oldest_dead_letter_age_seconds"].as_u64().is_some_and(|a| (89..120).contains(&a)), "{row}");
    assert_eq!(status["retries_waiting"], 0);
    let table = broker_cli(&["status", d], &url).await;
    let lines: Vec<&str> = ok(&table).lines().collect();
    assert_eq!(
        lines[0].split_whitespace().collect::<Vec<_>>(),
        ["QUEUE", "READY", "UNACKED", "CONSUMERS", "DEAD-LETTERED", "OLDEST-DEAD-LETTER", "CIRCUIT"]
    );
    assert_eq!(row["circuit"], Value::Null, "no runner named");
    assert_eq!(&lines[1].split_whitespace().collect::<Vec<_>>()[..5], ["work", "2", "-", "0", "1"]);
    assert!(table.stdout.contains("retries waiting (all queues): 0"), "{}", table.stdout);
    // Reading changed nothing.
    assert_eq!((place.depth("work").await, place.depth("work.dlq").await), (2, 1));
}

async fn plan_against_the_broker_names_missing_objects_and_conflicts_with_both_values<P: Place>(place: P) {
    let dir = support::work_pipeline(
        "    type: quorum\n    max_length: 100\n    handler:\n      webhook: {url: \"http://127.0.0.1:9/hook\"}\n",
    );
    let (url, d) = (place.url(), dir.path().to_str().expect("utf-8 path"));
    let fresh = broker_cli(&["plan", d], &url).await;
    let fresh_text = ok(&fresh).to_string();
    assert!(fresh_text.contains("missing exchange \"ev\""), "{fresh_text}");
    assert!(fresh_text.contains("missing queue \"work\""), "{fresh_text}");
    let broker = place.connect().await;
    assert!(broker.depth("work").await.is_err(), "plan created work");
    broker.close().await;

    // The running deploy declared `work` with another length limit.
    let running = support::work_pipeline(
        "    type: quorum\n    max_length: 50\n    handler:\n      webhook: {url: \"http://127.0.0.1:9/hook\"}\n",
    );
    let broker = place.connect().await;
    support::declare(running.path(), &broker).await;
    broker.close().await;
    let matching = broker_cli(&["plan", running.path().to_str().expect("utf-8 path")], &url).await;
    assert!(ok(&matching).contains("matches the files"), "{}", matching.stdout);

    let conflict = broker_cli(&["plan", d, "--format", "json"], &url).await;
    assert_eq!(conflict.code, Some(1), "a conflict fails the plan: {}", conflict.stderr);
    let both: Value = serde_json::from_str(&conflict.stdout).expect("json");
    let drift = both["drift"].as_array().expect("drift");
    let found = drift.iter().find(|d| d["kind"] == "conflict").expect("a conflict");
    assert_eq!(found["name"], "work");
    let detail = found["detail"].as_str().expect("detail");
    // RabbitMQ's words name 'x-max-length'; the embedded broker's, max_length.
    assert!(detail.contains("max") && detail.contains("length"), "{detail}");
    assert!(detail.contains("100") && detail.contains("50"), "{detail}");
    assert!(conflict.stderr.contains("conflict with the broker"), "{}", conflict.stderr);
    assert!(both["plan"]["queues"].is_array());
    // Nothing was changed by looking.
    let running = running.path().to_str().expect("utf-8 path");
    assert!(ok(&broker_cli(&["plan", running], &url).await).contains("matches the files"), "the queue is as it was");
}

async fn kill_9_in_the_middle_of_a_redrive_of_1000_loses_nothing<P: Place>(place: P) {
    let receiver = Receiver::ok().await;
    let dir = support::webhook_pipeline(&receiver, "");
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    let mut keys = BTreeSet::new();
    for n in 0..1000 {
        let key = format!("r-{n}");
        plant(&broker, &key, "exhausted", Duration::from_secs(10)).await;
        keys.insert(key);
    }
    broker.close().await;
    let d = dir.path().to_str().expect("utf-8 path").to_string();
    let log = dir.path().join("redrive.log");
    let mut redrive = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["dlq", "redrive", "work", "--pipelines", &d, "--rate", "400/s", "--broker", &place.url()])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn redrive");
    support::wait_until(Duration::from_secs(30), "the redrive under way", || async {
        place.depth("work").await >= 100
    })
    .await;
    let still_running = redrive.try_wait().expect("try_wait").is_none();
    redrive.kill().expect("kill -9");
    let _ = redrive.wait();
    let redrive_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(still_running, "the redrive ended before the kill: {redrive_log}");
    let moved = place.depth("work").await;
    assert!(moved < 1000, "the kill came mid-redrive ({moved} moved)");

    // Whatever is in the work queue now runs; the rest is still dead-lettered.
    let mut runner = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(runner.wait(Duration::from_secs(120)), Some(0), "{}", runner.log());
    let handled = receiver.succeeded_keys();
    let left: BTreeSet<String> = place
        .drain_queue("work.dlq")
        .await
        .iter()
        .map(|(body, _)| Envelope::decode(body).expect("envelope").idempotency_key.expect("key").to_string())
        .collect();
    let each_once = support::counts(receiver.hits().iter().map(|h| h.key().to_string()));
    assert!(each_once.values().all(|n| *n == 1), "a side effect twice: {each_once:?}");
    // A message whose copy was confirmed but whose removal the kill cut short is in both
    // places; its key stops a second run. None is in neither.
    let both = handled.intersection(&left).count();
    // 256 copies awaiting confirms and 64 confirmed awaiting their ack, at most.
    assert!(both <= 320, "at most the copies in flight at the kill: {both}; redrive said: {redrive_log}");
    assert_eq!(handled.len() + left.len() - both, 1000, "handled + still dead-lettered covers every message");
    assert_eq!(handled.union(&left).cloned().collect::<BTreeSet<_>>(), keys);
}

async fn a_redrive_of_thousands_at_full_speed_leaves_none_behind<P: Place>(place: P) {
    // Found by the bench, not by a test: acks sent from concurrent tasks reached the broker out
    // of order, one closed the channel, and confirmed messages stayed dead-lettered. On Redis,
    // copies the redrive left unpolled while it awaited an ack held the connection's request
    // slots the ack waited for: a stall until the 15 s timeout, then a session tried again.
    let dir = support::work_pipeline("    handler:\n      webhook: {url: \"http://127.0.0.1:9/hook\"}\n");
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    broker.close().await;
    let jsonl = dir.path().join("payloads.jsonl");
    std::fs::write(
        &jsonl,
        (0..5000).map(|n| format!("{{\"n\": {n}, \"pad\": \"{}\"}}\n", "x".repeat(1000))).collect::<String>(),
    )
    .expect("write");
    let (url, d) = (place.url(), dir.path().to_str().expect("utf-8 path"));
    let jsonl = jsonl.to_str().expect("utf-8 path");
    let args = ["publish", "--exchange", "", "--routing-key", "work.dlq", "--type", "t", "--jsonl", jsonl];
    let _ = ok(&broker_cli(&args, &url).await);
    assert_eq!(place.depth("work.dlq").await, 5000);
    let redriven = broker_cli(&["dlq", "redrive", "work", "--pipelines", d], &url).await;
    assert!(ok(&redriven).starts_with("5000 message(s) redriven to work"), "{}", redriven.stdout);
    assert_eq!((place.depth("work").await, place.depth("work.dlq").await), (5000, 0));
}

async fn a_redrive_into_a_full_queue_waits_for_room_before_it_gives_up<P: Place>(place: P) {
    // A full queue (max_length, reject-publish) refuses copies, as a quorum queue electing a
    // leader after a node loss does for a few seconds: the redrive tries them again. (A classic
    // queue: a quorum queue applies its limit a little late, after some copies went in.)
    let receiver = Receiver::ok().await;
    let dir = support::webhook_pipeline(&receiver, "    type: classic\n    max_length: 5\n");
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    for n in 0..5 {
        support::publish(&broker, "ev", "x", &format!("full-{n}"), json!({})).await;
    }
    for n in 0..10 {
        plant(&broker, &format!("dead-{n}"), "exhausted", Duration::from_secs(10)).await;
    }
    broker.close().await;
    let d = dir.path().to_str().expect("utf-8 path");
    let log = dir.path().join("redrive.log");
    let redrive = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["dlq", "redrive", "work", "--pipelines", d, "--broker", &place.url()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn redrive");
    support::wait_until(Duration::from_secs(30), "a copy refused by the full queue", || async {
        std::fs::read_to_string(&log).unwrap_or_default().contains("the broker refused copies")
    })
    .await;
    // Room appears: a runner takes what is in the queue.
    let (mut runner, admin) = support::run_with_admin(dir.path(), &place.url(), "work").await;
    let finished =
        tokio::task::spawn_blocking(move || redrive.wait_with_output().expect("redrive")).await.expect("redrive task");
    let stdout = String::from_utf8_lossy(&finished.stdout).to_string();
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        finished.status.code(),
        Some(0),
        "stdout: {stdout}\nstderr: {stderr}\nthe runner's log:\n{}",
        runner.log()
    );
    assert!(stdout.starts_with("10 message(s) redriven to work"), "{stdout}");
    // Every message handled, and every copy the redrive sent taken and settled: a copy sent
    // twice would have been counted by now.
    support::wait_until(Duration::from_secs(60), "every message handled and work drained", || async {
        receiver.succeeded_keys().len() == 15
            && place.depth("work").await == 0
            && support::gauge(&admin, "sluice_in_flight", "work").await == Some(0.0)
    })
    .await;
    // Each copy went in once: a pass the full queue refused in part moved what it took, and
    // the next did not copy those again (idempotency would have hidden it from the receiver).
    let duplicates = r#"sluice_messages_total{queue="work",outcome="duplicate"}"#;
    assert_eq!(support::sample(&admin, duplicates).await, Some(0.0), "copies redriven twice");
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
    assert_eq!(place.depth("work").await, 0, "a copy left behind");
    let each = support::counts(receiver.hits().iter().filter(|h| h.succeeded()).map(|h| h.key().to_string()));
    assert!(each.values().all(|n| *n == 1), "a side effect twice: {each:?}");
    assert_eq!(place.depth("work.dlq").await, 0);
}

async fn status_counts_what_the_named_runners_hold_as_unacked<P: Place>(place: P) {
    // Holds every request 20 s: the runner's 3 deliveries stay unacked meanwhile.
    let receiver = Receiver::start(|_, _| Reply::ok().after(Duration::from_secs(20))).await;
    let dir = support::webhook_pipeline(&receiver, "    concurrency: 3\n");
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    for n in 0..10 {
        support::publish(&broker, "ev", "x", &format!("held-{n}"), json!({})).await;
    }
    broker.close().await;
    let admin = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
        format!("localhost:{}", listener.local_addr().expect("addr").port())
    };
    let _runner = Sluice::run(dir.path(), &place.url(), &["--admin", &admin]);
    support::wait_until(Duration::from_secs(30), "three requests held", || async { receiver.hits().len() == 3 }).await;
    let d = dir.path().to_str().expect("utf-8 path");
    let url = place.url();
    // The runner's gauges and the broker's counts settle within a poll.
    support::wait_until(Duration::from_secs(30), "unacked 3, ready 7, one consumer", || async {
        let status = broker_cli(&["status", d, "--admin", &admin, "--format", "json"], &url).await;
        let row = serde_json::from_str::<Value>(ok(&status)).expect("json")["queues"][0].clone();
        row["unacked"] == 3 && row["ready"] == 7 && row["consumers"] == 1 && row["circuit"] == "closed"
    })
    .await;
    let table = broker_cli(&["status", d, "--admin", &admin], &url).await;
    let lines: Vec<&str> = ok(&table).lines().collect();
    assert_eq!(&lines[1].split_whitespace().collect::<Vec<_>>()[..4], ["work", "7", "3", "1"], "{}", table.stdout);
    assert_eq!(lines[1].split_whitespace().last(), Some("closed"), "{}", table.stdout);
    let without = broker_cli(&["status", d], &url).await;
    assert!(ok(&without).contains("UNACKED: name the runners with --admin"), "{}", without.stdout);
    let down = broker_cli(&["status", d, "--admin", "127.0.0.1:9"], &url).await;
    assert_eq!(down.code, Some(1));
    assert!(down.stderr.contains("cannot read the runner's metrics at http://127.0.0.1:9/metrics"), "{}", down.stderr);
}

on_every_broker!(
    plan_against_the_broker_names_missing_objects_and_conflicts_with_both_values,
    messages_dead_lettered_while_the_receiver_was_down_run_once_each_after_a_redrive,
    filters_and_dry_run_select_exactly_the_messages_they_name,
    list_show_and_status_print_a_known_state_as_tables_and_json,
    kill_9_in_the_middle_of_a_redrive_of_1000_loses_nothing,
    status_counts_what_the_named_runners_hold_as_unacked,
    a_redrive_into_a_full_queue_waits_for_room_before_it_gives_up,
    a_redrive_of_thousands_at_full_speed_leaves_none_behind,
);

/// Issue 31 (low): a redrive killed mid-way leaves what it held leased to it; the next
/// redrive moves what it can and says how many the dead one still holds and when their
/// lease ends, and a redrive after that moves the rest: none is skipped in silence.
async fn a_redrive_after_a_killed_one_names_what_the_dead_one_still_holds<P: Place>(place: P) {
    let receiver = Receiver::ok().await;
    let dir = support::webhook_pipeline(&receiver, "");
    let broker = place.connect().await;
    support::declare(dir.path(), &broker).await;
    for n in 0..1500 {
        plant_sized(&broker, &format!("h-{n}"), 8 << 10).await;
    }
    broker.close().await;
    let d = dir.path().to_str().expect("utf-8 path").to_string();
    let mut first = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["dlq", "redrive", "work", "--pipelines", &d, "--rate", "200/s", "--broker", &place.url()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn redrive");
    support::wait_until(Duration::from_secs(30), "the first redrive under way", || async {
        place.depth("work").await >= 50
    })
    .await;
    first.kill().expect("kill -9");
    let _ = first.wait();

    let second = broker_cli(&["dlq", "redrive", "work", "--pipelines", &d], &place.url()).await;
    ok(&second);
    // What the dead one still holds is left, and said: how many, until when.
    let left = place.depth("work.dlq").await;
    if left > 0 {
        // Held when the pass began: some may have come back meanwhile, and wait for the next.
        let held = second.stderr.lines().find_map(|l| {
            let rest = l.strip_prefix("note: ")?;
            let (count, rest) = rest.split_once(" message(s) of work.dlq ")?;
            rest.contains("lease").then(|| count.parse::<u32>().ok()).flatten()
        });
        assert!(held.is_some_and(|held| held >= left), "{left} left, not said: {}", second.stderr);
    }
    // Once the lease ends, a redrive moves the rest.
    support::wait_until(Duration::from_secs(90), "a redrive leaves none", || async {
        ok(&broker_cli(&["dlq", "redrive", "work", "--pipelines", &d], &place.url()).await);
        place.depth("work.dlq").await == 0
    })
    .await;
    assert!(place.depth("work").await >= 1500, "every message redriven");
}

on_every_broker!(a_redrive_after_a_killed_one_names_what_the_dead_one_still_holds);
