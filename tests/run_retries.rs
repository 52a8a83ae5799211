//! `sluice run` against real RabbitMQ: retries and dead-lettering, counted at the receiver.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use sluice::broker::HeaderValue;
use sluice::broker::amqp::DELAY_UNIT;
use support::*;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

pub(crate) async fn retry_exhaustion_calls_exactly_max_attempts_then_dead_letters<P: Place>(place: P) {
    let server = MockServer::start().await;
    Mock::given(method("POST")).respond_with(ResponseTemplate::new(503)).mount(&server).await;
    let dir = work_pipeline(&format!(
        r##"    handler:
      webhook: {{url: "{}/hook"}}
    retry: {{max_attempts: 3, initial: 100ms, max: 300ms}}
"##,
        server.uri()
    ));
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let _sluice = Sluice::run(dir.path(), &place.url(), &[]);
    publish(&broker, "ev", "x", "key-1", serde_json::json!({"n": 1})).await;
    wait_until(Duration::from_secs(30), "one message in work.dlq", || async {
        place.drain_queue("work.dlq").await.len() == 1
    })
    .await;
    let keys = keys_received(&server).await;
    assert_eq!(keys, ["key-1", "key-1", "key-1"], "exactly max_attempts calls");
    let dead = place.drain_queue("work.dlq").await;
    let headers = &dead[0].1;
    assert_eq!(headers.get("x-sluice-reason"), Some(&HeaderValue::Str("exhausted".into())));
    assert_eq!(headers.get("x-sluice-attempts"), Some(&HeaderValue::Int(3)));
    assert_eq!(headers.get("x-sluice-source-queue"), Some(&HeaderValue::Str("work".into())));
    assert!(matches!(headers.get("x-sluice-error"), Some(HeaderValue::Str(e)) if e.starts_with("HTTP 503")));
}

/// DESIGN "Life of a delivery": when the broker refuses the dead-letter copy (a full DLQ), the
/// worker holds the original unacked and retries the publish; once the DLQ takes it, the copy
/// lands and the original is acked. Nothing is dropped meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_dead_letter_copy_holds_the_message_until_the_broker_takes_it() {
    let vhost = Vhost::new();
    let dir = work_pipeline(
        r##"    type: classic
    handler:
      command: {program: /bin/sh, args: ["-c", "exit 65"], permanent_exit_codes: [65]}
"##,
    );
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let policy = |args: &[&str]| {
        let out = std::process::Command::new("rabbitmqctl").args(args).output().expect("rabbitmqctl");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    // A full DLQ: max-length 0 with reject-publish nacks every copy.
    policy(&[
        "set_policy",
        "-p",
        &vhost.name,
        "full-dlq",
        r"^work\.dlq$",
        r#"{"max-length": 0, "overflow": "reject-publish"}"#,
        "--apply-to",
        "queues",
    ]);
    publish(&broker, "ev", "a", "poison", serde_json::json!({})).await;
    let sluice = Sluice::run(dir.path(), &vhost.url(), &[]);
    // The handler ran (exit 65) and the copy was refused twice, the worker retrying it: the
    // original stays in `work`, unacked.
    wait_until(Duration::from_secs(30), "the copy refused a second time", || async {
        sluice
            .log()
            .lines()
            .any(|l| l.contains("the broker refused a retry or dead-letter copy") && l.contains("failures=2"))
    })
    .await;
    assert!(vhost.drain_queue("work.dlq").await.is_empty(), "the full DLQ took nothing");
    let held = std::process::Command::new("rabbitmqctl")
        .args(["list_queues", "-p", &vhost.name, "name", "messages"])
        .output()
        .expect("rabbitmqctl");
    let listing = String::from_utf8_lossy(&held.stdout);
    assert!(listing.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["work", "1"]), "held: {listing}");
    policy(&["clear_policy", "-p", &vhost.name, "full-dlq"]);
    wait_until(Duration::from_secs(30), "the copy lands once the DLQ has room", || async {
        vhost.drain_queue("work.dlq").await.len() == 1
    })
    .await;
    wait_until(Duration::from_secs(30), "the original acked", || async {
        sluice::broker::Broker::depth(&broker, "work").await.ok() == Some(0)
    })
    .await;
    let dead = vhost.drain_queue("work.dlq").await;
    assert_eq!(dead[0].1.get("x-sluice-reason"), Some(&HeaderValue::Str("permanent".into())));
}

/// The idempotency key of a dead-lettered body, to tell messages apart.
fn dead_key(body: &[u8]) -> String {
    let envelope: serde_json::Value = serde_json::from_slice(body).expect("a dead letter keeps its envelope body");
    envelope["idempotency_key"].as_str().expect("an idempotency key").to_string()
}

/// Every dead letter in `queue` by idempotency key: (reason, error, attempts).
async fn dead_letters(place: &impl Place, queue: &str) -> BTreeMap<String, (String, String, i64)> {
    let mut out = BTreeMap::new();
    for (body, headers) in place.drain_queue(queue).await {
        let text = |name| header_str(&headers, name).unwrap_or_default().to_string();
        let attempts = match headers.get("x-sluice-attempts") {
            Some(HeaderValue::Int(n)) => *n,
            other => panic!("x-sluice-attempts is {other:?}"),
        };
        out.insert(dead_key(&body), (text("x-sluice-reason"), text("x-sluice-error"), attempts));
    }
    out
}

/// Issue 13: `retry.schedule` waits its listed delays (never less, and not the next level), in
/// the order listed, the last one again past the end of the list, and dead-letters after
/// max_attempts.
async fn a_schedule_spaces_the_attempts_by_its_delays_then_repeats_the_last<P: Place>(place: P) {
    let receiver = Receiver::start(|_, _| Reply::status(503)).await;
    let dir = webhook_pipeline(&receiver, "    retry: {schedule: [600ms, 200ms, 1s], max_attempts: 6}\n");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    publish(&broker, "ev", "x", "key-1", serde_json::json!({})).await;
    let mut sluice = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(60)), Some(0), "log:\n{}", sluice.log());

    let hits = receiver.hits();
    let attempts: Vec<&str> = hits.iter().map(|h| h.header("x-sluice-attempt").unwrap_or_default()).collect();
    assert_eq!(attempts, ["1", "2", "3", "4", "5", "6"], "max_attempts calls, in order");
    let schedule = [600, 200, 1000, 1000, 1000].map(Duration::from_millis);
    let gaps: Vec<Duration> = hits.windows(2).map(|pair| wall_gap(&pair[0], &pair[1])).collect();
    // Never early; late by less than half the delay and a unit (a busy machine's scheduling),
    // so that a wrong delay (the next or the previous level, 2x or 0.5x) still fails.
    for (i, (gap, delay)) in gaps.iter().zip(schedule).enumerate() {
        assert!(
            not_before(*gap, delay) && *gap < delay.mul_f64(1.5) + DELAY_UNIT,
            "attempt {} came {gap:?} after attempt {}; the schedule says {delay:?} (one unit {DELAY_UNIT:?}); gaps {gaps:?}",
            i + 2,
            i + 1
        );
    }
    let dead = dead_letters(&place, "work.dlq").await;
    let (reason, error, attempts) = &dead["key-1"];
    assert_eq!((reason.as_str(), *attempts), ("exhausted", 6));
    assert!(error.starts_with("HTTP 503"), "{error}");
}

/// Issue 13: every kind of `on_status` rule, against a real runner: success, retry and
/// dead_letter for an exact code and for a class, an exact code beating its class either way,
/// and a status without a rule keeping its default. A retried status runs max_attempts times
/// (one more than the schedule's delays); a dead-lettered one names its rule.
async fn on_status_rules_decide_each_status_by_code_then_class<P: Place>(place: P) {
    // The key names the status to answer with: "s404" gets a 404.
    let receiver = Receiver::start(|hit, _| {
        let status = hit.key().trim_start_matches('s').parse().expect("keys are s<status>");
        Reply::status(status).body("nope")
    })
    .await;
    let dir = webhook_pipeline(
        &receiver,
        r#"    retry: {schedule: [100ms, 200ms]}
    on_status:
      "409": success
      3xx: success
      "202": retry
      4xx: retry
      "404": dead_letter
      5xx: dead_letter
      "503": retry
"#,
    );
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let statuses = [409, 302, 202, 422, 404, 500, 503, 200, 400];
    for status in statuses {
        publish(&broker, "ev", "x", &format!("s{status}"), serde_json::json!({})).await;
    }
    let mut sluice = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(60)), Some(0), "log:\n{}", sluice.log());

    let calls = counts(receiver.hits().iter().map(|h| h.key().to_string()));
    let expected_calls = [
        ("s409", 1), // exact success
        ("s302", 1), // class success
        ("s202", 3), // exact retry, over a 2xx
        ("s422", 3), // class retry
        ("s404", 1), // exact dead_letter beats the class's retry
        ("s500", 1), // class dead_letter
        ("s503", 3), // exact retry beats the class's dead_letter
        ("s200", 1), // no rule: 2xx succeeds
        ("s400", 3), // 4xx's rule, not the default dead_letter
    ];
    let expected_calls: BTreeMap<String, usize> = expected_calls.iter().map(|(k, n)| (k.to_string(), *n)).collect();
    assert_eq!(calls, expected_calls);

    let dead = dead_letters(&place, "work.dlq").await;
    let exhausted = |status: u16, rule: &str| {
        ("exhausted".to_string(), format!("HTTP {status} (on_status \"{rule}\": retry): nope"), 3)
    };
    let permanent = |status: u16, rule: &str| {
        ("permanent".to_string(), format!("HTTP {status} (on_status \"{rule}\": dead_letter): nope"), 1)
    };
    let expected_dead = BTreeMap::from([
        ("s202".to_string(), exhausted(202, "202")),
        ("s400".to_string(), exhausted(400, "4xx")),
        ("s404".to_string(), permanent(404, "404")),
        ("s422".to_string(), exhausted(422, "4xx")),
        ("s500".to_string(), permanent(500, "5xx")),
        ("s503".to_string(), exhausted(503, "503")),
    ]);
    assert_eq!(dead, expected_dead, "successes are not dead-lettered; the others name their rule");
}

/// Issue 13: every `on_exit` action against a real runner, beside `permanent_exit_codes` and the
/// defaults for codes without a rule.
async fn on_exit_rules_decide_each_exit_code<P: Place>(place: P) {
    let dir = work_pipeline(
        r##"    handler:
      command:
        program: ./exit-as-told.sh
        stdin: none
        permanent_exit_codes: [65]
        on_exit: {"3": success, "75": retry, "66": dead_letter}
    retry: {schedule: [100ms, 200ms]}
"##,
    );
    // The key names the exit code: "e75" exits 75. Each run is a line in `calls`.
    let body = "echo \"$SLUICE_IDEMPOTENCY_KEY\" >> \"$(dirname \"$0\")/calls\"\necho 'told to exit' >&2\nexit \"${SLUICE_IDEMPOTENCY_KEY#e}\"";
    script(dir.path(), "exit-as-told.sh", body);
    let calls = dir.path().join("calls");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for code in [3, 75, 66, 65, 0, 1] {
        publish(&broker, "ev", "x", &format!("e{code}"), serde_json::json!({})).await;
    }
    let mut sluice = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(60)), Some(0), "log:\n{}", sluice.log());

    let expected_calls = [("e0", 1), ("e1", 3), ("e3", 1), ("e65", 1), ("e66", 1), ("e75", 3)];
    let expected_calls: BTreeMap<String, usize> = expected_calls.iter().map(|(k, n)| (k.to_string(), *n)).collect();
    assert_eq!(counts(lines(&calls)), expected_calls);

    let dead = dead_letters(&place, "work.dlq").await;
    let entry = |reason: &str, error: &str, attempts| (reason.to_string(), error.to_string(), attempts);
    let expected_dead = BTreeMap::from([
        ("e1".to_string(), entry("exhausted", "exit 1: told to exit", 3)),
        ("e65".to_string(), entry("permanent", "exit 65: told to exit", 1)),
        ("e66".to_string(), entry("permanent", "exit 66 (on_exit \"66\": dead_letter): told to exit", 1)),
        ("e75".to_string(), entry("exhausted", "exit 75 (on_exit \"75\": retry): told to exit", 3)),
    ]);
    assert_eq!(dead, expected_dead, "exit 0 and the success rule's 3 are not dead-lettered");
}

on_every_broker!(
    retry_exhaustion_calls_exactly_max_attempts_then_dead_letters,
    a_schedule_spaces_the_attempts_by_its_delays_then_repeats_the_last,
    on_status_rules_decide_each_status_by_code_then_class,
    on_exit_rules_decide_each_exit_code,
);
