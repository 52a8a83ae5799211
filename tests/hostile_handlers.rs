//! Hostile messages and handlers under the real `sluice run` and RabbitMQ (issue 9): a command
//! handler that could read the runner's secrets, one that leaves a child behind holding its
//! stdout, and a payload value that would walk up a webhook's path. Each test keeps a ledger of
//! what was published and where it ended.

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{
    Place, Receiver, Sluice, Vhost, declare, header_str, is_running, lines, publish, read_pid, script, wait_until,
    work_pipeline,
};

/// The variables a command's environment is built from, besides the `env:` entries: the
/// runner's allowlist (`LC_*` checked by prefix), the `pass_env` list, sluice's own, and `PWD`,
/// which `/bin/sh` sets itself.
const ALLOWED: &[&str] = &[
    "PATH",
    "HOME",
    "LANG",
    "TZ",
    "TMPDIR",
    "AWS_REGION",
    "SLUICE_IDEMPOTENCY_KEY",
    "SLUICE_MESSAGE_ID",
    "SLUICE_ATTEMPT",
    "TRACEPARENT",
    "PWD",
];

/// Reads a NUL-separated `env -0` dump.
fn read_env(path: &Path) -> BTreeMap<String, String> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .split(|b| *b == 0)
        .filter(|entry| !entry.is_empty())
        .filter_map(|entry| {
            let text = String::from_utf8_lossy(entry);
            let (name, value) = text.split_once('=')?;
            Some((name.to_string(), value.to_string()))
        })
        .collect()
}

/// Issue 9: a command handler inherited the runner's whole environment, `SLUICE_BROKER` with
/// its password and any token included. It gets the allowlist, `pass_env`, `env` and sluice's
/// own variables, nothing else; a `pass_env` variable the runner lacks is left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_sees_only_the_allowlist_pass_env_env_and_sluice_variables() {
    let vhost = Vhost::new();
    let out = tempfile::tempdir().expect("tempdir");
    let dir = work_pipeline(&format!(
        r#"    handler:
      command:
        program: ./dump-env.sh
        env: {{OUT_DIR: "{}"}}
        pass_env: [AWS_REGION, SLUICE_TEST_UNSET_VARIABLE]
    retry: {{max_attempts: 1}}
"#,
        out.path().display()
    ));
    // Written under a temporary name and renamed, so a file that exists is complete.
    script(
        dir.path(),
        "dump-env.sh",
        r#"env -0 > "$OUT_DIR/.$SLUICE_IDEMPOTENCY_KEY" && mv "$OUT_DIR/.$SLUICE_IDEMPOTENCY_KEY" "$OUT_DIR/$SLUICE_IDEMPOTENCY_KEY""#,
    );
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let published = ["env-1", "env-2"];
    for key in published {
        publish(&broker, "ev", "x", key, json!({"key": key})).await;
    }
    let url = vhost.url();
    let runner_env = [
        ("SECRET_TOKEN", "s3cr3t-token"),
        ("SLUICE_BROKER", url.as_str()),
        ("AWS_REGION", "eu-west-1"),
        ("TZ", "Europe/Paris"),
        ("LC_TIME", "C"),
    ];
    let mut sluice = Sluice::run_with_env(dir.path(), &url, &["--exit-when-idle"], &runner_env);
    assert_eq!(sluice.wait(Duration::from_secs(60)), Some(0), "log:\n{}", sluice.log());

    // Ledger: each published message ran once, successfully, and nothing is left anywhere.
    let dumped: BTreeSet<String> = std::fs::read_dir(out.path())
        .expect("out dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(dumped, published.iter().map(|k| k.to_string()).collect::<BTreeSet<_>>());
    assert!(vhost.drain_queue("work").await.is_empty(), "work is not empty");
    assert!(vhost.drain_queue("work.dlq").await.is_empty(), "something was dead-lettered");

    for key in published {
        let env = read_env(&out.path().join(key));
        let unexpected: Vec<&String> = env
            .keys()
            .filter(|name| !ALLOWED.contains(&name.as_str()) && !name.starts_with("LC_") && *name != "OUT_DIR")
            .collect();
        assert!(unexpected.is_empty(), "{key}: variables from the runner leaked: {unexpected:?}");
        for (name, value) in &env {
            assert!(!value.contains("s3cr3t") && !value.contains("guest:guest"), "{key}: {name} holds a secret");
        }
        let get = |name: &str| env.get(name).map(String::as_str);
        assert_eq!(get("SLUICE_IDEMPOTENCY_KEY"), Some(key));
        assert_eq!(get("SLUICE_ATTEMPT"), Some("1"));
        assert_eq!(get("AWS_REGION"), Some("eu-west-1"), "pass_env");
        assert_eq!(get("TZ"), Some("Europe/Paris"), "allowlist");
        assert_eq!(get("LC_TIME"), Some("C"), "allowlist LC_*");
        assert_eq!(get("OUT_DIR"), Some(out.path().to_str().expect("utf-8")), "env:");
        assert!(get("PATH").is_some_and(|p| !p.is_empty()), "PATH is passed");
        assert_eq!(get("SLUICE_TEST_UNSET_VARIABLE"), None);
    }
}

/// Issue 9: a background child that kept stdout open turned a successful exit into a timeout,
/// so the script ran again and the message was dead-lettered; and children that outlived a
/// successful run survived it. Now the run ends when the script exits, its exit status decides,
/// and the whole process group is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_child_holding_stdout_neither_delays_nor_outlives_a_successful_run() {
    let vhost = Vhost::new();
    let out = tempfile::tempdir().expect("tempdir");
    let timeout = Duration::from_secs(20);
    let dir = work_pipeline(&format!(
        r#"    handler:
      command:
        program: ./leave-child.sh
        env: {{OUT_DIR: "{}"}}
        timeout: 20s
    retry: {{max_attempts: 3, initial: 100ms, max: 200ms}}
"#,
        out.path().display()
    ));
    script(
        dir.path(),
        "leave-child.sh",
        r#"echo run >> "$OUT_DIR/$SLUICE_IDEMPOTENCY_KEY.runs"
sleep 1000 &
echo $! > "$OUT_DIR/$SLUICE_IDEMPOTENCY_KEY.pid"
echo "started $!"
exit 0"#,
    );
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let published = ["bg-1", "bg-2", "bg-3"];
    for key in published {
        publish(&broker, "ev", "x", key, json!({"key": key})).await;
    }

    let started = Instant::now();
    let mut sluice = Sluice::run(dir.path(), &vhost.url(), &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(90)), Some(0), "log:\n{}", sluice.log());
    let elapsed = started.elapsed();

    // Ledger: every message ran exactly once and was acked; none was retried or dead-lettered.
    for key in published {
        assert_eq!(lines(&out.path().join(format!("{key}.runs"))), ["run"], "{key} ran more than once");
    }
    assert!(vhost.drain_queue("work").await.is_empty(), "work is not empty");
    assert!(vhost.drain_queue("work.dlq").await.is_empty(), "something was dead-lettered");
    assert!(elapsed < timeout, "the run took {elapsed:?}, as long as the handler timeout");
    for key in published {
        let pid = read_pid(&out.path().join(format!("{key}.pid"))).expect("the script wrote its child's pid");
        wait_until(Duration::from_secs(5), &format!("{key}'s background child is gone"), || async { !is_running(pid) })
            .await;
    }
}

/// Issue 9: `.` or `..` as a value in a webhook's path walked up the path after rendering
/// (`/api/users/{{payload.user}}/charge` with `..` called `/api/charge`). Such a message is
/// dead-lettered as a template error and never sent; other values, dots included, go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dot_segment_value_never_changes_the_webhook_path() {
    let vhost = Vhost::new();
    let receiver = Receiver::ok().await;
    let dir = work_pipeline(&format!(
        "    handler:\n      webhook: {{url: \"{}/api/users/{{{{payload.user}}}}/charge\"}}\n    retry: {{max_attempts: 1}}\n",
        receiver.uri()
    ));
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let published = [("up", ".."), ("here", "."), ("user", "u7"), ("dots", "..."), ("inner", "a..b")];
    for (key, user) in published {
        publish(&broker, "ev", "x", key, json!({"user": user})).await;
    }
    let mut sluice = Sluice::run(dir.path(), &vhost.url(), &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(60)), Some(0), "log:\n{}", sluice.log());

    // Ledger: three calls, each on its own path; two messages in the DLQ, nothing left in work.
    let targets: BTreeMap<String, String> =
        receiver.hits().iter().map(|h| (h.key().to_string(), h.target.clone())).collect();
    let expected: BTreeMap<String, String> =
        [("user", "/api/users/u7/charge"), ("dots", "/api/users/.../charge"), ("inner", "/api/users/a..b/charge")]
            .iter()
            .map(|(k, t)| (k.to_string(), t.to_string()))
            .collect();
    assert_eq!(targets, expected);
    assert_eq!(receiver.hits().len(), 3, "{:?}", receiver.hits());
    let dead = vhost.drain_queue("work.dlq").await;
    let mut reasons: Vec<(String, String)> = dead
        .iter()
        .map(|(body, headers)| {
            let envelope = sluice::envelope::Envelope::decode(body).expect("an envelope");
            let reason = header_str(headers, "x-sluice-reason").unwrap_or_default().to_string();
            (envelope.idempotency_key().to_string(), reason)
        })
        .collect();
    reasons.sort();
    assert_eq!(reasons, [("here".to_string(), "template".to_string()), ("up".to_string(), "template".to_string())]);
    for (_, headers) in &dead {
        let error = header_str(headers, "x-sluice-error").unwrap_or_default();
        assert!(error.contains("path segment"), "{error}");
    }
    assert!(vhost.drain_queue("work").await.is_empty(), "work is not empty");
}

/// Issue 31 item 16: a `not_before` before 1970 (Go's zero time `0001-01-01T00:00:00Z`, what a
/// Go producer writes for an unset time) was dead-lettered `malformed`; a time past is now, so
/// each is handled at once, on the embedded broker as on every other (the envelope is read
/// alike). A time before the epoch only by its offset is past too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_not_before_before_1970_is_now() {
    let place = support::EmbeddedDir::new();
    let receiver = Receiver::ok().await;
    let dir = support::webhook_pipeline(&receiver, "    retry: {max_attempts: 1}\n");
    let broker = place.connect().await;
    declare(dir.path(), &broker).await;
    let times = [
        ("go-zero", "0001-01-01T00:00:00Z"),
        ("1969", "1969-12-31T23:59:59Z"),
        ("offset", "1970-01-01T00:30:00+01:00"),
    ];
    for (key, time) in times {
        let body = json!({"id": key, "type": "t", "idempotency_key": key, "not_before": time, "payload": {}});
        support::publish_raw(&broker, "ev", "x", body.to_string().into_bytes(), Default::default()).await;
    }
    let mut sluice = Sluice::run(dir.path(), &place.url(), &["--exit-when-idle"]);
    assert_eq!(sluice.wait(Duration::from_secs(60)), Some(0), "log:\n{}", sluice.log());
    assert_eq!(receiver.succeeded_keys(), times.iter().map(|(key, _)| key.to_string()).collect::<BTreeSet<_>>());
    assert_eq!(place.depth("work.dlq").await, 0, "nothing dead-lettered");
}
