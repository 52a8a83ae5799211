//! `sluice run` and the environment (issue 9): an unset `{{env.X}}` or signing secret stops
//! the start instead of dead-lettering every message, and a webhook's scheme and host may come
//! from the operator's environment (resolved once at start-up), never from a message.

use crate::support;
use crate::util;

use std::time::Duration;

use serde_json::json;
use sluice::broker::Broker as _;
use support::*;

/// A webhook queue `work` on exchange `ev` calling `url`; `extra` goes into the webhook.
fn hook_pipeline(url: &str, extra: &str) -> tempfile::TempDir {
    work_pipeline(&format!("    handler:\n      webhook:\n        url: \"{url}\"\n{extra}"))
}

// Issue 9: with a template's variable or a signing secret unset, `run` started and
// dead-lettered every message with reason `template`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_refuses_to_start_naming_every_unset_variable() {
    let vhost = Vhost::new();
    let dir = work_pipeline(concat!(
        "    handler:\n",
        "      webhook:\n",
        "        url: \"https://h.example/{{env.SLUICE_T9_PATH}}\"\n",
        "        headers: {Authorization: \"Bearer {{env.SLUICE_T9_TOKEN}}\"}\n",
        "        signing: {secret_env: SLUICE_T9_SECRET}\n",
        "  other:\n",
        "    handler: {command: {program: /bin/echo, args: [\"{{env.SLUICE_T9_TOKEN}}\", \"{{env.SLUICE_T9_SET}}\"]}}\n",
    ));
    let mut sluice = Sluice::run_with_env(dir.path(), &vhost.url(), &[], &[("SLUICE_T9_SET", "x")]);
    assert_eq!(sluice.wait(Duration::from_secs(20)), Some(1), "{}", sluice.log());
    let log = sluice.log();
    let line = log
        .lines()
        .find(|l| l.starts_with("error: environment variables not set: "))
        .unwrap_or_else(|| panic!("no error naming the variables:\n{log}"));
    assert_eq!(
        line,
        "error: environment variables not set: SLUICE_T9_PATH (queue work, url), \
         SLUICE_T9_SECRET (queue work, signing secret), \
         SLUICE_T9_TOKEN (queue other, args[0]; queue work, header Authorization)"
    );
    // It refused before declaring anything: the queue does not exist on the broker.
    let broker = vhost.connect().await;
    assert!(broker.depth("work").await.is_err(), "the queue was declared");
    broker.close().await;

    // `validate` only warns (CI has no secrets).
    let out = util::sluice().arg("validate").arg(dir.path()).output().expect("sluice runs");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for name in ["SLUICE_T9_PATH", "SLUICE_T9_TOKEN", "SLUICE_T9_SECRET"] {
        assert!(stdout.contains("warning: /queues/") && stdout.contains(name), "{name}: {stdout}");
    }
}

// Issue 9: the operator's environment may give a webhook its scheme and host; resolved once,
// the runner calls it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_host_from_the_environment_is_called() {
    let vhost = Vhost::new();
    let receiver = Receiver::ok().await;
    let dir = hook_pipeline("{{env.SLUICE_T9_HOOK_BASE}}/hook/{{payload.n}}", "");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let mut sluice = Sluice::run_with_env(dir.path(), &vhost.url(), &[], &[("SLUICE_T9_HOOK_BASE", receiver.uri())]);
    let envelope = publish(&broker, "ev", "k", "key-1", json!({"n": "a/b"})).await;
    let hits = receiver.wait_for(1, Duration::from_secs(20)).await;
    assert_eq!(hits[0].target, "/hook/a%2Fb");
    assert_eq!(hits[0].key(), "key-1");
    assert_eq!(hits[0].header("x-sluice-message-id"), Some(envelope.id.as_str()));
    assert_eq!(sluice.stop(Duration::from_secs(20)), Some(0), "{}", sluice.log());
    assert_eq!(vhost.depth("work.dlq").await, 0);
    broker.close().await;
}

// Issue 9: an environment value that does not make an http(s) URL with a host stops the start,
// naming the queue (and the variable, not its value).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_webhook_host_from_the_environment_refuses_start() {
    let vhost = Vhost::new();
    let dir = hook_pipeline("{{env.SLUICE_T9_HOOK_BASE}}/hook", "");
    for value in ["ftp://files.example", "http:", "not a url"] {
        let mut sluice = Sluice::run_with_env(dir.path(), &vhost.url(), &[], &[("SLUICE_T9_HOOK_BASE", value)]);
        assert_eq!(sluice.wait(Duration::from_secs(20)), Some(1), "{value}: {}", sluice.log());
        let log = sluice.log();
        assert!(
            log.contains(
                "error: queue \"work\": webhook URL \"{{env.SLUICE_T9_HOOK_BASE}}/hook\": with SLUICE_T9_HOOK_BASE as set, the scheme and host are not usable"
            ),
            "{value}: {log}"
        );
    }
}

// Issue 9: a message's values still never choose where a request goes.
#[test]
fn a_payload_value_in_the_scheme_or_host_is_still_rejected() {
    for url in [
        "https://{{payload.host}}/x",
        "{{payload.url}}",
        "{{env.SLUICE_T9_HOOK_BASE}}{{payload.path}}",
        "https://{{urlencode env.SLUICE_T9_HOOK_BASE}}/x",
        "http:/{{payload.host}}/x",
    ] {
        let dir = hook_pipeline(url, "");
        let out = util::sluice().arg("validate").arg(dir.path()).output().expect("sluice runs");
        assert_eq!(out.status.code(), Some(1), "{url}: {out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("error: /queues/work/handler/webhook/url: "), "{url}: {stdout}");
    }
    // With an env host and unset variables, validate passes with a warning.
    let dir = hook_pipeline("{{env.SLUICE_T9_HOOK_BASE}}/x/{{payload.id}}", "");
    let out = util::sluice().arg("validate").arg(dir.path()).output().expect("sluice runs");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

// Issue 9: `render` resolves the scheme and host the same way, and says which variable is
// missing.
#[test]
fn render_resolves_the_webhook_host_from_the_environment() {
    let dir = hook_pipeline("{{env.SLUICE_T9_HOOK_BASE}}/hook/{{payload.n}}", "");
    let message = dir.path().join("message.json");
    std::fs::write(
        &message,
        r#"{"id": "m1", "type": "t", "version": 1, "occurred_at": "2026-01-01T00:00:00Z", "idempotency_key": "k", "payload": {"n": 7}}"#,
    )
    .expect("write");
    let render = |env: &[(&str, &str)]| {
        util::sluice()
            .arg("render")
            .arg(dir.path())
            .args(["--queue", "work", "--message"])
            .arg(&message)
            .envs(env.iter().copied())
            .output()
            .expect("sluice runs")
    };
    let out = render(&[("SLUICE_T9_HOOK_BASE", "http://user:pw@127.0.0.1:9")]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("POST http://user:***@127.0.0.1:9/hook/7\n"), "{stdout}");
    let out = render(&[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("environment variable SLUICE_T9_HOOK_BASE is not set"), "{stderr}");
}
