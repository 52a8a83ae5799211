//! `sluice run` against real RabbitMQ, observed from the outside: what webhook receivers and
//! commands get (fan-out, headers, signatures, templating, env, stdin) and when they get it
//! (Retry-After, rate limits, ordering).

use crate::support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;
use sluice::broker::{HeaderValue, Headers};
use sluice::envelope::Envelope;
use support::*;

/// The receiver's address stands for this word in pipeline texts (handlebars braces make
/// `format!` unreadable).
const RECEIVER: &str = "RECEIVER";

fn pipeline_for(receiver: &Receiver, yaml: &str) -> tempfile::TempDir {
    pipeline(&yaml.replace(RECEIVER, receiver.uri()))
}

pub(crate) async fn fan_out_delivers_once_per_bound_queue<P: Place>(place: P) {
    let receiver = Receiver::ok().await;
    let dir = pipeline_for(
        &receiver,
        r##"version: 1
exchanges:
  ev: {type: topic}
queues:
  exact:
    bind: [{exchange: ev, routing_key: order.created}]
    handler: {webhook: {url: "RECEIVER/exact"}}
  star:
    bind: [{exchange: ev, routing_key: "order.*"}]
    handler: {webhook: {url: "RECEIVER/star"}}
  hash:
    bind: [{exchange: ev, routing_key: "#"}]
    handler: {webhook: {url: "RECEIVER/hash"}}
  invoices:
    bind: [{exchange: ev, routing_key: "invoice.*"}]
    handler: {webhook: {url: "RECEIVER/invoices"}}
"##,
    );
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let sent = publish(&broker, "ev", "order.created", "order-1", json!({"order": 1})).await;
    // Exiting when idle is the condition that says every queue is done, so counting after
    // it proves "exactly once" and "none" rather than "so far".
    let mut sluice = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(30)), Some(0), "log:\n{}", sluice.log());

    let hits = receiver.hits();
    let mut per_path: BTreeMap<&str, usize> = BTreeMap::new();
    for hit in &hits {
        *per_path.entry(hit.target.as_str()).or_default() += 1;
        assert_eq!(hit.header("x-sluice-message-id"), Some(sent.id.as_str()));
        let traceparent = hit.header("traceparent").expect("a traceparent, though the message carried none");
        assert!(sluice::trace::TraceContext::parse(traceparent).is_some(), "{traceparent}");
    }
    assert_eq!(per_path, BTreeMap::from([("/exact", 1), ("/hash", 1), ("/star", 1)]), "no call to /invoices");
}

/// A receiver that answers 429 with `Retry-After: {seconds}` once, then 200.
async fn too_many_requests_once(seconds: u64) -> Receiver {
    Receiver::start(move |_, n| {
        if n == 0 { Reply::status(429).header("Retry-After", &seconds.to_string()) } else { Reply::status(200) }
    })
    .await
}

/// Runs a queue with the given retry policy against `receiver` and returns the gap between its
/// first two calls.
async fn gap_between_first_two_calls(place: &impl Place, receiver: &Receiver, retry: &str) -> Duration {
    let dir = webhook_pipeline(receiver, &format!("    retry: {retry}\n"));
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let _sluice = Sluice::run(dir.path(), &place.url(), &[]);
    publish(&broker, "ev", "x", "key-1", json!({})).await;
    let hits = receiver.wait_for(2, Duration::from_secs(20)).await;
    assert_eq!(hits[1].header("x-sluice-attempt"), Some("2"));
    wall_gap(&hits[0], &hits[1])
}

async fn retry_after_is_honoured_over_a_shorter_backoff<P: Place>(place: P) {
    let receiver = too_many_requests_once(2).await;
    let gap = gap_between_first_two_calls(&place, &receiver, "{max_attempts: 3, initial: 100ms, max: 10s}").await;
    assert!(not_before(gap, Duration::from_secs(2)), "second call {gap:?} after the first, before Retry-After: 2");
    assert!(gap < Duration::from_secs(8), "second call {gap:?} after the first; Retry-After was 2s");
}

async fn retry_after_beyond_max_is_capped_at_max<P: Place>(place: P) {
    let receiver = too_many_requests_once(60).await;
    let gap = gap_between_first_two_calls(&place, &receiver, "{max_attempts: 3, initial: 100ms, max: 1s}").await;
    // Capped at max: not the 60s asked for, and not below max either (the hint is a floor).
    assert!(not_before(gap, Duration::from_secs(1)), "second call {gap:?} after the first, below max: 1s");
    assert!(gap < Duration::from_secs(6), "second call {gap:?} after the first; max is 1s");
}

/// A Standard Webhooks secret: `whsec_` + base64 of the key (the specification's example).
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// Verifies a Standard Webhooks signature with an implementation independent of sluice's:
/// Python's standard library, per the specification (HMAC-SHA256 of `id.timestamp.body`
/// under the base64-decoded secret, any of the space-separated `v1,` signatures, timestamp
/// within five minutes).
fn python_verifies(secret: &str, id: &str, timestamp: &str, signature: &str, body: &[u8]) -> bool {
    const VERIFY: &str = r#"
import base64, hashlib, hmac, sys, time
secret, msg_id, timestamp, signatures = sys.argv[1:5]
body = sys.stdin.buffer.read()
if abs(time.time() - int(timestamp)) > 300:
    sys.exit("timestamp outside the tolerance")
key = base64.b64decode(secret[len("whsec_"):] if secret.startswith("whsec_") else secret)
signed = msg_id.encode() + b"." + timestamp.encode() + b"." + body
expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
for candidate in signatures.split(" "):
    version, _, value = candidate.partition(",")
    if version == "v1" and hmac.compare_digest(value, expected):
        sys.exit(0)
sys.exit("no signature matches")
"#;
    use std::io::Write as _;
    let mut child = Command::new("python3")
        .args(["-c", VERIFY, secret, id, timestamp, signature])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3 runs");
    child.stdin.take().expect("stdin").write_all(body).expect("write body");
    child.wait().expect("python3 exits").success()
}

async fn webhook_gets_headers_rendered_templates_and_a_valid_signature<P: Place>(place: P) {
    let receiver = Receiver::start(|_, n| Reply::status(if n == 0 { 503 } else { 200 })).await;
    let dir = pipeline_for(
        &receiver,
        r##"version: 1
exchanges:
  ev: {type: topic}
queues:
  work:
    bind: [{exchange: ev, routing_key: "#"}]
    handler:
      webhook:
        url: "RECEIVER/orders/{{payload.name}}/notes"
        method: PUT
        headers:
          Authorization: "Bearer {{env.SLUICE_TEST_TOKEN}}"
          X-Name: "{{payload.name}}"
        body: '{"name": "{{payload.name}}", "n": {{payload.n}}, "attempt": {{attempt}}, "all": {{json payload}}}'
        signing: {secret_env: SLUICE_TEST_SECRET}
    retry: {max_attempts: 3, initial: 100ms, max: 200ms}
"##,
    );
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let _sluice = Sluice::run_with_env(
        dir.path(),
        &place.url(),
        &[],
        &[("SLUICE_TEST_TOKEN", "t0ken"), ("SLUICE_TEST_SECRET", SECRET)],
    );
    let name = r#"a "quoted"/slashed\ name?&#"#;
    let payload = json!({"name": name, "n": 7});
    let envelope = Envelope::new("order.created", &payload, Some("order:7".into()));
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let headers = Headers::from([("traceparent".to_string(), HeaderValue::Str(traceparent.into()))]);
    publish_raw(&broker, "ev", "x", envelope.encode(), headers).await;

    let hits = receiver.wait_for(2, Duration::from_secs(20)).await;
    for (i, hit) in hits.iter().enumerate() {
        let attempt = i + 1;
        assert_eq!(hit.method, "PUT");
        // One path segment, every reserved character percent-encoded.
        assert_eq!(hit.target, "/orders/a%20%22quoted%22%2Fslashed%5C%20name%3F%26%23/notes");
        assert_eq!(hit.header("idempotency-key"), Some("order:7"));
        assert_eq!(hit.header("x-sluice-message-id"), Some(envelope.id.as_str()));
        assert_eq!(hit.header("x-sluice-attempt"), Some(attempt.to_string().as_str()));
        assert_eq!(hit.header("traceparent").map(|t| &t[..36]), Some(&traceparent[..36]), "the message's trace");
        assert_eq!(hit.header("authorization"), Some("Bearer t0ken"));
        assert_eq!(hit.header("x-name"), Some(name));
        assert_eq!(hit.header("content-type"), Some("application/json"));
        assert_eq!(hit.json(), json!({"name": name, "n": 7, "attempt": attempt, "all": payload}));

        assert_eq!(hit.header("webhook-id"), Some(envelope.id.as_str()));
        let timestamp = hit.header("webhook-timestamp").expect("webhook-timestamp");
        let signature = hit.header("webhook-signature").expect("webhook-signature");
        assert!(
            python_verifies(SECRET, &envelope.id, timestamp, signature, &hit.body),
            "attempt {attempt}: signature {signature:?} does not verify"
        );
        // The verifier is not vacuous: another body, or another secret, fails.
        let mut tampered = hit.body.clone();
        tampered.push(b' ');
        assert!(!python_verifies(SECRET, &envelope.id, timestamp, signature, &tampered));
        assert!(!python_verifies("whsec_AAAAAAAAAAAAAAAAAAAAAAAA", &envelope.id, timestamp, signature, &hit.body));
    }
}

/// What one run of `record.sh` saw, read back from the files it wrote.
struct Recorded {
    args: Vec<String>,
    env: BTreeMap<String, String>,
    stdin: Vec<u8>,
}

fn read_recorded(dir: &Path) -> Recorded {
    let args = std::fs::read(dir.join("args")).expect("args");
    let env = std::fs::read(dir.join("env")).expect("env");
    let split = |bytes: &[u8]| -> Vec<String> {
        bytes.split(|b| *b == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned()).collect()
    };
    Recorded {
        args: split(&args),
        env: split(&env).iter().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect(),
        stdin: std::fs::read(dir.join("stdin")).expect("stdin"),
    }
}

/// Records its argv (NUL-separated), environment and stdin under `$1/$SLUICE_ATTEMPT/`, marks
/// the run `done`, and fails the first attempt when `FAIL_FIRST` is set (a `#!/bin/sh` body).
const RECORD_SH: &str = r#"set -e
out="$1/$SLUICE_ATTEMPT"
shift
mkdir -p "$out"
printf '%s\0' "$@" > "$out/args"
env -0 > "$out/env"
cat > "$out/stdin"
touch "$out/done"
if [ -n "$FAIL_FIRST" ] && [ "$SLUICE_ATTEMPT" = 1 ]; then exit 3; fi
"#;

async fn command_gets_verbatim_argv_env_and_each_stdin_mode<P: Place>(place: P) {
    let out = tempfile::tempdir().expect("tempdir");
    let out_dir = out.path().display().to_string();
    let mut yaml = String::from("version: 1\nexchanges:\n  ev: {type: topic}\nqueues:\n");
    for (mode, extra_env) in [("envelope", ", FAIL_FIRST: \"yes\""), ("payload", ""), ("none", "")] {
        yaml += &format!(
            r##"  cmd.{mode}:
    bind: [{{exchange: ev, routing_key: "#"}}]
    handler:
      command:
        program: ./record.sh
        args: ["{out_dir}/{mode}", "{{{{payload.text}}}}", "--size", "{{{{payload.size}}}}", "attempt {{{{attempt}}}}"]
        env: {{BUCKET: "{{{{env.SLUICE_TEST_BUCKET}}}}/{{{{payload.size}}}}"{extra_env}}}
        stdin: {mode}
    retry: {{max_attempts: 3, initial: 100ms, max: 200ms}}
"##
        );
    }
    let dir = pipeline(&yaml);
    script(dir.path(), "record.sh", RECORD_SH);

    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let _sluice = Sluice::run_with_env(dir.path(), &place.url(), &[], &[("SLUICE_TEST_BUCKET", "bkt")]);
    let pwned = out.path().join("pwned");
    let text = format!("two words $(touch {}) `touch {}` ; 'q' \"dq\" *", pwned.display(), pwned.display());
    let payload = json!({"text": text, "size": "1 MB"});
    let envelope = Envelope::new("image.resize", &payload, Some("img:1".into()));
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let headers = Headers::from([("traceparent".to_string(), HeaderValue::Str(traceparent.into()))]);
    let body = envelope.encode();
    publish_raw(&broker, "ev", "x", body.clone(), headers).await;

    let runs = [("envelope", 1), ("envelope", 2), ("payload", 1), ("none", 1)];
    wait_until(Duration::from_secs(30), "every command run recorded", || async {
        runs.iter().all(|(mode, attempt)| out.path().join(format!("{mode}/{attempt}/done")).exists())
    })
    .await;

    for (mode, attempt) in runs {
        let seen = read_recorded(&out.path().join(format!("{mode}/{attempt}")));
        let context = format!("{mode} attempt {attempt}");
        assert_eq!(seen.args, [text.as_str(), "--size", "1 MB", &format!("attempt {attempt}")], "{context}");
        let env = |name: &str| seen.env.get(name).map(String::as_str);
        assert_eq!(env("SLUICE_IDEMPOTENCY_KEY"), Some("img:1"), "{context}");
        assert_eq!(env("SLUICE_MESSAGE_ID"), Some(envelope.id.as_str()), "{context}");
        assert_eq!(env("SLUICE_ATTEMPT"), Some(attempt.to_string().as_str()), "{context}");
        assert_eq!(env("TRACEPARENT").map(|t| &t[..36]), Some(&traceparent[..36]), "{context}: the message's trace");
        assert_eq!(env("BUCKET"), Some("bkt/1 MB"), "{context}");
        match mode {
            "envelope" => assert_eq!(seen.stdin, body, "{context}: the body as published"),
            "payload" => {
                let got: serde_json::Value = serde_json::from_slice(&seen.stdin).expect("payload stdin is JSON");
                assert_eq!(got, payload, "{context}");
            }
            _ => assert!(seen.stdin.is_empty(), "{context}: stdin {:?}", String::from_utf8_lossy(&seen.stdin)),
        }
    }
    assert!(!pwned.exists(), "a shell interpreted an argument");
}

async fn rate_limit_spreads_calls_over_time<P: Place>(place: P) {
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "    concurrency: 8\n    rate_limit: 2/s\n");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for i in 0..6 {
        publish(&broker, "ev", "x", &format!("key-{i}"), json!({"i": i})).await;
    }
    let _sluice = Sluice::run(dir.path(), &place.url(), &[]);
    let hits = receiver.wait_for(6, Duration::from_secs(20)).await;
    // A burst of 2, then one token every 500ms: the sixth call comes about 2s after the first.
    // Unlimited, with 8 in flight, all six would arrive within milliseconds.
    let spread = hits[5].at - hits[0].at;
    assert!(spread >= Duration::from_millis(1600), "6 calls at 2/s spread over only {spread:?}");
}

pub(crate) async fn ordered_queue_calls_one_at_a_time_in_publish_order<P: Place>(place: P) {
    // Each call stays in flight a while, so that any overlap would be seen.
    let receiver = Receiver::start(|_, _| Reply::status(200).after(Duration::from_millis(25))).await;
    let dir = webhook_pipeline(&receiver, "    ordered: true\n");
    if refused_without_single_active_consumer(&place, dir.path(), "ordered").await {
        return;
    }
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    for n in 1..=20 {
        publish(&broker, "ev", "x", &format!("key-{n}"), json!({"n": n})).await;
    }
    let _sluice = Sluice::run(dir.path(), &place.url(), &[]);
    let hits = receiver.wait_for(20, Duration::from_secs(30)).await;
    let order: Vec<i64> = hits.iter().map(|h| h.json()["payload"]["n"].as_i64().expect("n")).collect();
    assert_eq!(order, (1..=20).collect::<Vec<_>>());
    assert_eq!(receiver.max_in_flight(), 1, "calls overlapped");
}

on_every_broker!(
    retry_after_beyond_max_is_capped_at_max,
    retry_after_is_honoured_over_a_shorter_backoff,
    fan_out_delivers_once_per_bound_queue,
    webhook_gets_headers_rendered_templates_and_a_valid_signature,
    command_gets_verbatim_argv_env_and_each_stdin_mode,
    rate_limit_spreads_calls_over_time,
    ordered_queue_calls_one_at_a_time_in_publish_order,
);
