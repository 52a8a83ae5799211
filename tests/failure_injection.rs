//! `sluice run` against real RabbitMQ under injected faults: duplicates, out-of-order retries,
//! poison messages, a crash between side effect and ack, connection loss, SIGTERM, and delays
//! that must not block each other. Every assertion counts side effects where they land (the
//! receiver, by Idempotency-Key; a file a command appends `$SLUICE_IDEMPOTENCY_KEY` to) or
//! reads the broker, never the runner's log.

use crate::support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime};

use sluice::broker::{Broker, HeaderValue, Headers};
use support::*;

/// Long enough for a loaded 2-core machine; a passing run takes a fraction of it.
const DEADLINE: Duration = Duration::from_secs(60);

/// A direct exchange `ev` and a queue `work` bound with key `work` (the messages of
/// [`webhook_pipeline`] route to it too), with a command handler `handler.sh` (written from
/// `body`) that gets the path of `side-effects` in the pipeline directory as `$1`; `extra` is
/// appended to the queue's definition (indented by four spaces). The handler's timeout is
/// `timeout` (every script here is done sooner): the idempotency claim of a handler cut off by
/// a crash or by the shutdown grace holds its key for 2 × timeout + 5s where the store cannot
/// tell that its runner is gone (Redis), which the default 60s would make longer than a test
/// waits for the message to run again.
fn command_pipeline(body: &str, timeout: &str, extra: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    script(dir.path(), "handler.sh", body);
    let effects = dir.path().join("side-effects");
    let yaml = format!(
        "version: 1\nexchanges:\n  ev: {{type: direct}}\nqueues:\n  work:\n    bind: [{{exchange: ev, routing_key: work}}]\n    handler:\n      command: {{program: ./handler.sh, args: [\"{}\"], timeout: {timeout}}}\n{extra}",
        effects.display()
    );
    std::fs::write(dir.path().join("pipeline.yaml"), yaml).expect("write pipeline");
    (dir, effects)
}

/// Publishes envelopes with keys `{prefix}-00`, `{prefix}-01`, ... to `work`; the keys.
async fn publish_keys(place: &impl Place, prefix: &str, n: usize) -> BTreeSet<String> {
    let broker = place.connect().await;
    let mut keys = BTreeSet::new();
    for i in 0..n {
        let key = format!("{prefix}-{i:02}");
        publish(&broker, "ev", "work", &key, serde_json::json!({"n": i})).await;
        keys.insert(key);
    }
    keys
}

/// Stops the runner with SIGTERM (it must exit 0) and checks that nothing is left behind:
/// no message ready or unacked in `work` (unacked ones return to the queue when the runner's
/// connection closes) and none dead-lettered.
async fn stop_and_assert_drained(sluice: &mut Sluice, place: &impl Place) {
    assert_eq!(sluice.stop(Duration::from_secs(30)), Some(0), "clean exit; log:\n{}", sluice.log());
    assert_eq!(place.depth("work").await, 0, "work queue empty after the runner stopped");
    assert_eq!(place.depth("work.dlq").await, 0, "nothing dead-lettered");
}

/// Publishes two envelopes with one key to the pipeline in `dir`, runs it until `calls` calls
/// reached the receiver, stops it cleanly and returns the calls and the envelopes.
async fn deliver_a_duplicate(
    dir: &std::path::Path,
    place: &impl Place,
    receiver: &Receiver,
    calls: usize,
) -> (Vec<Hit>, [sluice::envelope::Envelope<'static>; 2]) {
    let broker = place.connect().await;
    declare(dir, &broker).await;
    let first = publish(&broker, "ev", "work", "order:1:charge", serde_json::json!({"order": 1})).await;
    let second = publish(&broker, "ev", "work", "order:1:charge", serde_json::json!({"order": 1})).await;
    assert_ne!(first.id, second.id, "two envelopes, one key");
    let (mut sluice, admin) = run_with_admin(dir, &place.url(), "work").await;
    wait_until(DEADLINE, &format!("{calls} call(s) at the receiver"), || async { receiver.hits().len() >= calls })
        .await;
    // Both deliveries settled, the duplicate too, as the runner counts them: an empty queue
    // said nothing of a delivery still in flight, which a stop then sent to the delay cascade
    // (the key still held by the other) and which came back after the stop.
    wait_until(DEADLINE, "both deliveries settled", || async {
        let (handled, duplicates) = (
            sample(&admin, r#"sluice_messages_total{queue="work",outcome="success"}"#).await,
            sample(&admin, r#"sluice_messages_total{queue="work",outcome="duplicate"}"#).await,
        );
        handled.unwrap_or(0.0) + duplicates.unwrap_or(0.0) >= 2.0
    })
    .await;
    stop_and_assert_drained(&mut sluice, place).await;
    (receiver.hits(), [first, second])
}

// With the idempotency store (src/dedup/, on by default), a second delivery of a key is
// acked as a duplicate without running the handler.
async fn duplicate_delivery_has_its_side_effect_once<P: Place>(place: P) {
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let (hits, envelopes) = deliver_a_duplicate(dir.path(), &place, &receiver, 1).await;
    assert_eq!(hits.len(), 1, "one call for two deliveries of one key: {hits:?}");
    assert!(hits[0].key() == "order:1:charge" && hits[0].succeeded(), "{hits:?}");
    // Both are in flight at once (concurrency 4): whichever claims the key first runs.
    let ran = hits[0].header("x-sluice-message-id");
    assert!(envelopes.iter().any(|e| ran == Some(e.id.as_str())), "a call for one of the envelopes: {hits:?}");
}

// Without the store (idempotency disabled on the queue) both deliveries reach the receiver,
// and what makes them safe downstream is that both carry the same Idempotency-Key.
async fn duplicate_delivery_without_idempotency_calls_twice_with_one_idempotency_key<P: Place>(place: P) {
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "    idempotency: {enabled: false}\n");
    let (hits, [first, second]) = deliver_a_duplicate(dir.path(), &place, &receiver, 2).await;
    assert_eq!(hits.len(), 2, "each delivery processed once: {hits:?}");
    assert!(hits.iter().all(|h| h.key() == "order:1:charge" && h.succeeded()), "{hits:?}");
    let ids: BTreeSet<&str> = hits.iter().map(|h| h.header("x-sluice-message-id").unwrap_or_default()).collect();
    assert_eq!(ids, BTreeSet::from([first.id.as_str(), second.id.as_str()]), "one call per envelope");
}

async fn a_retried_message_lets_later_ones_pass_and_nothing_is_lost<P: Place>(place: P) {
    let receiver =
        Receiver::start(|hit, n| if hit.key() == "a" && n == 0 { Reply::status(503) } else { Reply::ok() }).await;
    // A fixed retry delay, so A's retry cannot come back before the later messages are done.
    let dir = webhook_pipeline(
        &receiver,
        "    retry: {max_attempts: 3, backoff: fixed, initial: 2s, max: 2s, jitter: none}\n",
    );
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let mut sluice = Sluice::run(dir.path(), &place.url(), &[]);
    publish(&broker, "ev", "work", "a", serde_json::json!({"n": 0})).await;
    wait_until(DEADLINE, "A's first attempt", || async { !receiver.hits_for("a").is_empty() }).await;
    let later = ["b", "c", "d"];
    for key in later {
        publish(&broker, "ev", "work", key, serde_json::json!({"n": key})).await;
    }

    let all: BTreeSet<String> = ["a", "b", "c", "d"].map(String::from).into();
    wait_until(DEADLINE, "every key succeeded", || async { receiver.succeeded_keys() == all }).await;
    stop_and_assert_drained(&mut sluice, &place).await;
    let hits = receiver.hits();
    let statuses: Vec<u16> = receiver.hits_for("a").iter().map(|h| h.status).collect();
    assert_eq!(statuses, [503, 200], "A failed once, then succeeded on its retry");
    for key in later {
        assert_eq!(receiver.hits_for(key).len(), 1, "{key} called once: {hits:?}");
    }
    let a_success = hits.iter().position(|h| h.key() == "a" && h.succeeded()).expect("A succeeded");
    for key in later {
        let at = hits.iter().position(|h| h.key() == key).expect("called");
        assert!(at < a_success, "{key} (published after A) succeeded before A's retry: {hits:?}");
    }
}

/// Checks a dead-lettered copy: the original body, byte for byte, and the headers DESIGN names.
fn assert_dead_letter(
    dead: &[(Vec<u8>, std::collections::BTreeMap<String, HeaderValue>)],
    body: &[u8],
    queue: &str,
    reason: &str,
    error_prefix: Option<&str>,
) {
    let Some((_, headers)) = dead.iter().find(|(b, _)| b == body) else {
        panic!("no copy with the original body in {queue}.dlq for the {reason} case; bodies: {:?}", bodies(dead));
    };
    assert_eq!(header_str(headers, "x-sluice-reason"), Some(reason), "{reason}: {headers:?}");
    assert_eq!(headers.get("x-sluice-attempts"), Some(&HeaderValue::Int(1)), "{reason}: at once");
    assert_eq!(header_str(headers, "x-sluice-source-queue"), Some(queue), "{reason}");
    let failed_at = header_str(headers, "x-sluice-failed-at").unwrap_or_else(|| panic!("{reason}: failed-at"));
    let failed_at = humantime::parse_rfc3339(failed_at).unwrap_or_else(|e| panic!("{reason}: {failed_at}: {e}"));
    let age = SystemTime::now().duration_since(failed_at).unwrap_or_default();
    assert!(age < Duration::from_secs(600), "{reason}: failed-at is recent");
    let error = header_str(headers, "x-sluice-error").unwrap_or_default();
    assert!(!error.is_empty(), "{reason}: x-sluice-error says why");
    if let Some(prefix) = error_prefix {
        assert!(error.starts_with(prefix), "{reason}: error {error:?} starts with {prefix:?}");
    }
}

fn bodies(dead: &[(Vec<u8>, std::collections::BTreeMap<String, HeaderValue>)]) -> Vec<String> {
    dead.iter().map(|(b, _)| String::from_utf8_lossy(b).into_owned()).collect()
}

pub(crate) async fn poison_messages_are_dead_lettered_at_once_and_the_next_message_is_processed<P: Place>(place: P) {
    let receiver = Receiver::start(|hit, _| match hit.key() {
        "poison-422" => Reply::status(422).body("order 7 is unknown"),
        _ => Reply::ok(),
    })
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("order.schema.json"),
        r#"{"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}}"#,
    )
    .expect("write schema");
    script(dir.path(), "handler.sh", r#"echo "$SLUICE_IDEMPOTENCY_KEY" >> "$1"; echo "bad record" >&2; exit "$2""#);
    let calls = dir.path().join("command-calls");
    // Concurrency 1: each good message can only be handled once the poison before it is gone.
    let yaml = r#"version: 1
exchanges:
  ev: {type: direct}
queues:
  hook:
    bind: [{exchange: ev, routing_key: hook}]
    concurrency: 1
    payload_schema: order.schema.json
    handler:
      webhook: {url: "RECEIVER/hook/{{payload.route}}"}
  cmd:
    bind: [{exchange: ev, routing_key: cmd}]
    concurrency: 1
    handler:
      command:
        program: ./handler.sh
        args: ["CALLS", "{{payload.exit}}"]
        permanent_exit_codes: [65]
"#
    .replace("RECEIVER", receiver.uri())
    .replace("CALLS", &calls.display().to_string());
    std::fs::write(dir.path().join("pipeline.yaml"), yaml).expect("write pipeline");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;

    let malformed = b"{\"id\": \"cut off \xff\x00".to_vec();
    publish_raw(&broker, "ev", "hook", malformed.clone(), Headers::new()).await;
    publish(&broker, "ev", "hook", "good-1", serde_json::json!({"id": "1", "route": "r"})).await;
    let schema = publish(&broker, "ev", "hook", "poison-schema", serde_json::json!({"id": 7, "route": "r"})).await;
    publish(&broker, "ev", "hook", "good-2", serde_json::json!({"id": "2", "route": "r"})).await;
    let template = publish(&broker, "ev", "hook", "poison-template", serde_json::json!({"id": "7"})).await;
    publish(&broker, "ev", "hook", "good-3", serde_json::json!({"id": "3", "route": "r"})).await;
    let rejected = publish(&broker, "ev", "hook", "poison-422", serde_json::json!({"id": "7", "route": "r"})).await;
    publish(&broker, "ev", "hook", "good-4", serde_json::json!({"id": "4", "route": "r"})).await;
    let exit65 = publish(&broker, "ev", "cmd", "poison-exit", serde_json::json!({"exit": 65})).await;
    publish(&broker, "ev", "cmd", "good-5", serde_json::json!({"exit": 0})).await;
    let mut sluice = Sluice::run(dir.path(), &place.url(), &[]);

    let goods: BTreeSet<String> = ["good-1", "good-2", "good-3", "good-4"].map(String::from).into();
    wait_until(DEADLINE, "every good webhook message handled", || async { receiver.succeeded_keys() == goods }).await;
    wait_until(DEADLINE, "the good command message handled", || async {
        lines(&calls).contains(&"good-5".to_string())
    })
    .await;
    wait_until(DEADLINE, "4 poison messages in hook.dlq", || async { place.drain_queue("hook.dlq").await.len() >= 4 })
        .await;
    wait_until(DEADLINE, "1 poison message in cmd.dlq", || async { !place.drain_queue("cmd.dlq").await.is_empty() })
        .await;

    let dead = place.drain_queue("hook.dlq").await;
    assert_eq!(dead.len(), 4, "exactly the poison messages: {:?}", bodies(&dead));
    assert_dead_letter(&dead, &malformed, "hook", "malformed", None);
    assert_dead_letter(&dead, &schema.encode(), "hook", "schema", None);
    let missing = "template url: the message has no payload.route (the template reads {{payload.route}})";
    assert_dead_letter(&dead, &template.encode(), "hook", "template", Some(missing));
    assert_dead_letter(&dead, &rejected.encode(), "hook", "permanent", Some("HTTP 422"));
    let dead = place.drain_queue("cmd.dlq").await;
    assert_eq!(dead.len(), 1, "exactly the poison message: {:?}", bodies(&dead));
    assert_dead_letter(&dead, &exit65.encode(), "cmd", "permanent", Some("exit 65"));

    let hits = receiver.hits();
    assert_eq!(hits.len(), 5, "the webhook saw the 4 good messages and the 422 one, once each: {hits:?}");
    assert_eq!(receiver.hits_for("poison-422").len(), 1, "a 422 is not retried");
    assert_eq!(counts(lines(&calls)), counts(["poison-exit", "good-5"]), "the command ran once per message");
    assert_eq!(sluice.stop(Duration::from_secs(30)), Some(0), "log:\n{}", sluice.log());
    assert_eq!(place.depth("hook").await + place.depth("cmd").await, 0, "nothing left behind");
}

/// Publishes `N` messages to the `work` queue of the pipeline in `dir` (concurrency 4, a handler
/// whose side effect comes well before it returns), kills the runner with SIGKILL once some side
/// effects happened, restarts it, and checks at-least-once with a bounded number of repeats.
/// `side_effects` lists the keys of the side effects so far, repeats included.
async fn crash_between_side_effect_and_ack(
    dir: &std::path::Path,
    place: &impl Place,
    side_effects: impl Fn() -> Vec<String>,
) {
    const N: usize = 20;
    const CONCURRENCY: usize = 4;
    let broker = place.connect().await;
    declare(dir, &broker).await;
    let keys = publish_keys(place, "k", N).await;
    let mut first = Sluice::run(dir, &place.url(), &[]);
    wait_until(DEADLINE, "some side effects", || async { side_effects().len() >= 2 }).await;
    first.signal(libc::SIGKILL);
    assert_eq!(first.wait(Duration::from_secs(10)), None, "killed by the signal");
    let at_kill = side_effects().len();
    assert!(at_kill < N, "the crash came partway through ({at_kill} of {N} done)");

    let mut second = Sluice::run(dir, &place.url(), &[]);
    wait_until(DEADLINE, "every key's side effect", || async {
        side_effects().into_iter().collect::<BTreeSet<_>>() == keys
    })
    .await;
    wait_until(DEADLINE, "the work queue delivered", || async { place.depth("work").await == 0 }).await;
    stop_and_assert_drained(&mut second, place).await;
    let done = side_effects();
    let per_key = counts(done.iter().cloned());
    assert_eq!(per_key.keys().cloned().collect::<BTreeSet<_>>(), keys, "every key at least once");
    // Only unacked deliveries come back, and prefetch (= concurrency) bounds those.
    let repeats = done.len() - N;
    assert!(repeats <= CONCURRENCY, "at most {CONCURRENCY} messages run twice, got {repeats}: {per_key:?}");
    assert!(per_key.values().all(|n| *n <= 2), "no key more than twice: {per_key:?}");
}

async fn a_crash_between_command_side_effect_and_ack_repeats_at_most_the_in_flight_messages<P: Place>(place: P) {
    // The side effect first, then the slow rest of the work: the crash lands between the two.
    let (dir, effects) =
        command_pipeline(r#"echo "$SLUICE_IDEMPOTENCY_KEY" >> "$1"; sleep 1"#, "10s", "    concurrency: 4\n");
    crash_between_side_effect_and_ack(dir.path(), &place, || lines(&effects)).await;
}

pub(crate) async fn a_crash_between_webhook_side_effect_and_ack_repeats_at_most_the_in_flight_messages<P: Place>(
    place: P,
) {
    // The receiver records the call when it arrives and answers a second later.
    let receiver = Receiver::start(|_, _| Reply::ok().after(Duration::from_secs(1))).await;
    let dir = webhook_pipeline(&receiver, "    concurrency: 4\n");
    crash_between_side_effect_and_ack(dir.path(), &place, || {
        receiver.hits().iter().map(|h| h.key().to_string()).collect()
    })
    .await;
}

async fn a_command_failing_transiently_runs_exactly_max_attempts_then_dead_letters<P: Place>(place: P) {
    let (dir, effects) = command_pipeline(
        r#"echo "$SLUICE_IDEMPOTENCY_KEY $SLUICE_ATTEMPT" >> "$1"; echo "upstream down" >&2; exit 3"#,
        "10s",
        "    retry: {max_attempts: 4, initial: 100ms, max: 300ms}\n",
    );
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let _sluice = Sluice::run(dir.path(), &place.url(), &[]);
    let envelope = publish(&broker, "ev", "work", "job-1", serde_json::json!({"n": 1})).await;
    wait_until(DEADLINE, "one message in work.dlq", || async { place.drain_queue("work.dlq").await.len() == 1 }).await;

    assert_eq!(lines(&effects), ["job-1 1", "job-1 2", "job-1 3", "job-1 4"], "exactly max_attempts runs");
    let dead = place.drain_queue("work.dlq").await;
    let (body, headers) = &dead[0];
    assert_eq!(body, &envelope.encode(), "original body");
    assert_eq!(header_str(headers, "x-sluice-reason"), Some("exhausted"));
    assert_eq!(headers.get("x-sluice-attempts"), Some(&HeaderValue::Int(4)));
    assert_eq!(header_str(headers, "x-sluice-source-queue"), Some("work"));
    let error = header_str(headers, "x-sluice-error").unwrap_or_default();
    assert!(error.starts_with("exit 3") && error.contains("upstream down"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_recovers_from_a_lost_broker_connection_without_losing_messages() {
    const N: usize = 200;
    let vhost = Vhost::new();
    // The first 20 requests are answered; the rest wait at the gate until the connection is
    // gone, so it is lost with handlers in flight and most of the queue still to do.
    const BEFORE: usize = 20;
    let gate = Gate::closed();
    let answered = std::sync::atomic::AtomicUsize::new(0);
    let held = gate.clone();
    let receiver = Receiver::start(move |_, _| {
        let reply = Reply::ok().after(Duration::from_millis(50));
        match answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < BEFORE {
            true => reply,
            false => reply.held_by(&held),
        }
    })
    .await;
    let dir = webhook_pipeline(&receiver, "    concurrency: 4\n");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let keys = publish_keys(&vhost, "m", N).await;
    broker.close().await;
    let mut sluice = Sluice::run(dir.path(), &vhost.url(), &[]);
    wait_until(DEADLINE, "handlers held in flight", || async { receiver.hits().len() > BEFORE }).await;

    let closed = vhost.close_all_connections();
    let when_closed = receiver.succeeded_keys().len();
    gate.open();
    assert!(closed >= 1, "the runner's connection was closed");
    assert!(when_closed < N, "the connection was lost partway through ({when_closed} of {N} done)");
    wait_until(DEADLINE, "every message received after the connection loss", || async {
        receiver.succeeded_keys() == keys
    })
    .await;
    assert!(sluice.is_running(), "the same process recovered; log:\n{}", sluice.log());
    wait_until(DEADLINE, "the work queue delivered", || async { vhost.depth("work").await == 0 }).await;
    stop_and_assert_drained(&mut sluice, &vhost).await;
}

async fn sigterm_finishes_in_flight_messages_and_acks_them<P: Place>(place: P) {
    const N: usize = 8;
    let (dir, effects) = command_pipeline(
        r#"echo "start $SLUICE_IDEMPOTENCY_KEY" >> "$1"; sleep 2; echo "done $SLUICE_IDEMPOTENCY_KEY" >> "$1""#,
        "10s",
        "    concurrency: 4\n",
    );
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let keys = publish_keys(&place, "t", N).await;
    let grace = Duration::from_secs(10);
    let mut first = Sluice::run(dir.path(), &place.url(), &["--shutdown-grace", "10s"]);
    let with = |prefix: &str| -> BTreeSet<String> { lines_with(&effects, prefix).into_iter().collect() };
    wait_until(DEADLINE, "4 handlers in flight", || async { with("start ").len() >= 4 }).await;
    let in_flight = with("start ");
    let signalled = Instant::now();
    first.signal(libc::SIGTERM);
    assert_eq!(first.wait(grace + Duration::from_secs(5)), Some(0), "log:\n{}", first.log());
    assert!(signalled.elapsed() < grace + Duration::from_secs(5), "exit within the grace");
    let done = with("done ");
    assert!(in_flight.is_subset(&done), "in flight at SIGTERM {in_flight:?}, completed {done:?}");
    assert_eq!(with("start "), done, "nothing was left half-done");
    assert!(done.len() < N, "some messages were left for the next run");

    let mut second = Sluice::run(dir.path(), &place.url(), &[]);
    wait_until(DEADLINE, "every message done", || async { with("done ") == keys }).await;
    wait_until(DEADLINE, "the work queue delivered", || async { place.depth("work").await == 0 }).await;
    stop_and_assert_drained(&mut second, &place).await;
    let starts = counts(lines_with(&effects, "start "));
    assert!(starts.values().all(|n| *n == 1), "no message ran twice (acked, not requeued): {starts:?}");
}

async fn sigterm_with_a_handler_slower_than_the_grace_exits_in_time_and_loses_nothing<P: Place>(place: P) {
    // Slow (far beyond the grace) while the marker file exists, quick once it is gone. The
    // grace (1 s) cuts it off long before its timeout (4 s), whose claim on Redis then holds
    // the key for 13 s.
    let (dir, effects) = command_pipeline(
        r#"echo $$ > "$1.pid"; echo "start $SLUICE_IDEMPOTENCY_KEY" >> "$1"; if [ -e "$1.slow" ]; then sleep 30; fi; echo "done $SLUICE_IDEMPOTENCY_KEY" >> "$1""#,
        "4s",
        "",
    );
    let marker = effects.with_extension("slow");
    std::fs::write(&marker, "").expect("marker");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    publish(&broker, "ev", "work", "slow-1", serde_json::json!({"n": 1})).await;
    let grace = Duration::from_secs(1);
    let mut first = Sluice::run(dir.path(), &place.url(), &["--shutdown-grace", "1s"]);
    wait_until(DEADLINE, "the handler started", || async { !lines(&effects).is_empty() }).await;
    let pid = read_pid(&effects.with_extension("pid")).expect("the handler wrote its pid");
    let signalled = Instant::now();
    first.signal(libc::SIGTERM);
    let margin = Duration::from_secs(5);
    let code = first.wait(grace + margin + Duration::from_secs(30));
    let took = signalled.elapsed();
    assert!(code.is_some(), "exited by itself");
    assert!(took < grace + margin, "exit within the 1s grace (plus {margin:?}), took {took:?}");
    wait_until(Duration::from_secs(5), "the unfinished handler is killed with the runner", || async {
        !is_running(pid)
    })
    .await;
    assert_eq!(lines(&effects), ["start slow-1"], "the handler did not finish");

    std::fs::remove_file(&marker).expect("remove marker");
    let mut second = Sluice::run(dir.path(), &place.url(), &[]);
    wait_until(DEADLINE, "the message done on the next run", || async {
        lines(&effects).contains(&"done slow-1".to_string())
    })
    .await;
    wait_until(DEADLINE, "the work queue delivered", || async { place.depth("work").await == 0 }).await;
    stop_and_assert_drained(&mut second, &place).await;
    assert_eq!(lines(&effects), ["start slow-1", "start slow-1", "done slow-1"], "redelivered, done once");
}

async fn a_long_delay_does_not_hold_back_a_short_one<P: Place>(place: P) {
    let receiver = Receiver::start(|hit, n| match (hit.key(), n) {
        ("a", 0) => Reply::status(429).header("Retry-After", "60"),
        ("b", 0) => Reply::status(503),
        _ => Reply::ok(),
    })
    .await;
    let dir = webhook_pipeline(
        &receiver,
        "    retry: {max_attempts: 3, backoff: fixed, initial: 1s, max: 2m, jitter: none}\n",
    );
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let _sluice = Sluice::run(dir.path(), &place.url(), &[]);
    publish(&broker, "ev", "work", "a", serde_json::json!({"n": 1})).await;
    wait_until(DEADLINE, "A's first attempt", || async { !receiver.hits_for("a").is_empty() }).await;
    // B fails only once A's copy is waiting in the cascade, ahead of it.
    wait_until(DEADLINE, "A's copy waiting in the delay cascade", || async { place.delayed().await >= 1 }).await;
    publish(&broker, "ev", "work", "b", serde_json::json!({"n": 2})).await;

    wait_until(Duration::from_secs(10), "B's retry, about 1s after its first attempt", || async {
        receiver.hits_for("b").len() >= 2
    })
    .await;
    let b = receiver.hits_for("b");
    let gap = wall_gap(&b[0], &b[1]);
    assert!(gap >= Duration::from_millis(900) && gap < Duration::from_secs(10), "B's retry after {gap:?}");
    assert_eq!(receiver.hits_for("a").len(), 1, "A (Retry-After: 60) is not retried yet");
    assert!(place.delayed().await >= 1, "A is still waiting in the cascade");
}

// Regression: retry copies kept the broker's `x-death` history. Every retry below takes the
// same path, 3 units: level 1, dead-lettered into level 0, then into the work queue. On the
// second trip, RabbitMQ saw level 0 in `x-death` already, took it for a dead-letter cycle and
// stranded the copy in level 1 for good (at-least-once dead-lettering; at-most-once drops it).
async fn retries_that_take_the_same_path_through_the_delay_cascade_all_arrive<P: Place>(place: P) {
    let receiver = Receiver::start(|_, n| if n < 3 { Reply::status(503) } else { Reply::ok() }).await;
    let dir = webhook_pipeline(
        &receiver,
        "    retry: {max_attempts: 4, backoff: fixed, initial: 300ms, max: 300ms, jitter: none}\n",
    );
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let mut sluice = Sluice::run(dir.path(), &place.url(), &[]);
    publish(&broker, "ev", "work", "again", serde_json::json!({"n": 1})).await;

    wait_until(Duration::from_secs(30), "the 4th attempt, after 3 trips through the cascade", || async {
        !receiver.succeeded_keys().is_empty()
    })
    .await;
    let statuses: Vec<u16> = receiver.hits_for("again").iter().map(|h| h.status).collect();
    assert_eq!(statuses, [503, 503, 503, 200]);
    stop_and_assert_drained(&mut sluice, &place).await;
}

on_every_broker!(
    duplicate_delivery_has_its_side_effect_once,
    duplicate_delivery_without_idempotency_calls_twice_with_one_idempotency_key,
    a_retried_message_lets_later_ones_pass_and_nothing_is_lost,
    poison_messages_are_dead_lettered_at_once_and_the_next_message_is_processed,
    a_crash_between_command_side_effect_and_ack_repeats_at_most_the_in_flight_messages,
    a_crash_between_webhook_side_effect_and_ack_repeats_at_most_the_in_flight_messages,
    a_command_failing_transiently_runs_exactly_max_attempts_then_dead_letters,
    sigterm_finishes_in_flight_messages_and_acks_them,
    sigterm_with_a_handler_slower_than_the_grace_exits_in_time_and_loses_nothing,
    a_long_delay_does_not_hold_back_a_short_one,
    retries_that_take_the_same_path_through_the_delay_cascade_all_arrive,
);
