//! What `sluice run` logs for a person to follow (issue 11): one line naming the broker
//! (password masked), the queues and the idempotency store; every line about a message
//! carrying its id, idempotency key and type; a command's output at debug; a non-empty
//! dead-letter queue named with the command that lists it; one line when the run ends; JSON
//! or text, without colour codes when stderr is no terminal; and a second signal during the
//! graceful shutdown stopping at once.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use sluice::broker::{Outgoing, Publish as _};
use support::*;

/// Each line of a `--log-format json` log, parsed (a line that is not JSON fails the test).
fn json_lines(log: &str) -> Vec<Value> {
    log.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect()
}

/// The first line whose message is `message` and whose fields include `fields`.
fn line<'a>(lines: &'a [Value], message: &str, fields: &[(&str, Value)]) -> &'a Value {
    lines
        .iter()
        .find(|l| l["fields"]["message"] == message && fields.iter().all(|(name, value)| l["fields"][*name] == *value))
        .unwrap_or_else(|| panic!("no line \"{message}\" with {fields:?} in:\n{lines:#?}"))
}

/// The fields of the `message` span a line was logged in.
fn message_span(line: &Value) -> &Value {
    line["spans"]
        .as_array()
        .and_then(|spans| spans.iter().find(|s| s["name"] == "message"))
        .unwrap_or_else(|| panic!("not logged in a message span: {line}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_follow_each_message_from_start_to_end() {
    let vhost = Vhost::new();
    let dir = work_pipeline(
        r##"    handler:
      command:
        program: /bin/sh
        args: ["-c", "echo \"out:$SLUICE_IDEMPOTENCY_KEY\"; echo \"err:$SLUICE_IDEMPOTENCY_KEY\" >&2; [ \"$SLUICE_IDEMPOTENCY_KEY\" != bad ]"]
        permanent_exit_codes: [1]
"##,
    );
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let good = publish(&broker, "ev", "a", "good", json!({})).await;
    let bad = publish(&broker, "ev", "a", "bad", json!({})).await;
    let malformed =
        Outgoing { body: b"not an envelope".to_vec(), message_id: Some("m-malformed".into()), ..Default::default() };
    broker.publish("ev", "a", malformed).await.expect("publish confirmed");
    let mut sluice = Sluice::run_with_env(
        dir.path(),
        &vhost.url(),
        &["--log-format", "json"],
        &[("RUST_LOG", "info,sluice::handler=debug,sluice::runtime=debug")],
    );
    // The dead-letter queue is polled every few seconds; its warning comes after the outcomes.
    wait_until(Duration::from_secs(30), "the dead-letter warning", || {
        let log = sluice.log();
        async move { log.contains("dead-letter queue holds messages") }
    })
    .await;
    assert_eq!(sluice.stop(Duration::from_secs(30)), Some(0), "log:\n{}", sluice.log());
    let lines = json_lines(&sluice.log());

    let start = line(&lines, "starting", &[]);
    let url = vhost.url().replace("guest:guest@", "guest:***@");
    assert_eq!(start["fields"]["broker"], url.as_str(), "password not masked: {start}");
    assert_eq!(start["fields"]["queues"], "work");
    assert_eq!(start["fields"]["dedup"], dir.path().join(".sluice").display().to_string());

    let handled = message_span(line(&lines, "handled", &[]));
    assert_eq!(handled["message_id"], good.id.as_str());
    assert_eq!(handled["idempotency_key"], "good");
    assert_eq!(handled["type"], "test.event");
    let output = line(&lines, "command exited", &[("stdout", json!("out:good"))]);
    assert_eq!(output["fields"]["stderr"], "err:good");
    assert_eq!(message_span(output)["idempotency_key"], "good");

    let dead = message_span(line(&lines, "dead-lettered", &[("reason", json!("permanent"))]));
    assert_eq!(dead["message_id"], bad.id.as_str());
    assert_eq!(dead["idempotency_key"], "bad");
    assert_eq!(dead["type"], "test.event");
    let poison = message_span(line(&lines, "dead-lettered", &[("reason", json!("malformed"))]));
    assert_eq!(poison["message_id"], "m-malformed");
    assert_eq!(poison.get("idempotency_key"), None, "a malformed message has no key: {poison}");

    let dlq = line(&lines, "dead-letter queue holds messages", &[]);
    assert_eq!(dlq["fields"]["command"], "sluice dlq list work");
    assert_eq!(dlq["fields"]["messages"], 2);
    let stopped = &line(&lines, "stopped", &[])["fields"];
    assert_eq!((&stopped["handled"], &stopped["dead_lettered"]), (&json!(1), &json!(2)), "{stopped}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_to_a_file_name_the_message_without_colour_codes() {
    let vhost = Vhost::new();
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    let message = publish(&broker, "ev", "a", "key-1", json!({})).await;
    let mut sluice = Sluice::run_with_env(
        dir.path(),
        &vhost.url(),
        &["--exit-when-idle"],
        &[("RUST_LOG", "info,sluice::runtime=debug")],
    );
    assert_eq!(sluice.wait(Duration::from_secs(30)), Some(0), "log:\n{}", sluice.log());
    let log = sluice.log();
    assert!(!log.contains('\u{1b}'), "colour codes in a log file:\n{log}");
    let handled = log.lines().find(|l| l.contains("handled")).unwrap_or_else(|| panic!("no handled line:\n{log}"));
    let span = format!("message{{message_id=\"{}\" idempotency_key=\"key-1\" type=\"test.event\"}}", message.id);
    assert!(handled.contains(&span), "{span} not in: {handled}");
    let stopped = log.lines().find(|l| l.contains("stopped")).unwrap_or_else(|| panic!("no stopped line:\n{log}"));
    assert!(stopped.contains("handled=1"), "{stopped}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_during_the_graceful_shutdown_stops_at_once() {
    let vhost = Vhost::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let pidfile = dir.path().join("handler.pid");
    let yaml = format!(
        "version: 1\nexchanges:\n  ev: {{type: topic}}\nqueues:\n  work:\n    bind: [{{exchange: ev, routing_key: \"#\"}}]\n    handler:\n      command: {{program: /bin/sh, args: [\"-c\", \"echo $$$$ > {}; exec sleep 60\"], timeout: 120s}}\n",
        pidfile.display()
    );
    std::fs::write(dir.path().join("pipeline.yaml"), yaml).expect("write pipeline");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    publish(&broker, "ev", "a", "slow", json!({})).await;
    let mut sluice = Sluice::run(dir.path(), &vhost.url(), &["--shutdown-grace", "120s"]);
    wait_until(Duration::from_secs(30), "the handler runs", || {
        let pid = read_pid(&pidfile);
        async move { pid.is_some() }
    })
    .await;
    sluice.signal(libc::SIGTERM);
    wait_until(Duration::from_secs(30), "the graceful shutdown begins", || {
        let log = sluice.log();
        async move { log.contains("shutting down") }
    })
    .await;
    sluice.signal(libc::SIGINT);
    assert_eq!(sluice.wait(Duration::from_secs(30)), Some(1), "log:\n{}", sluice.log());
    assert!(sluice.log().contains("a second signal during the graceful shutdown"), "{}", sluice.log());
    let handler = read_pid(&pidfile).expect("pid");
    wait_until(Duration::from_secs(10), "the handler killed", || async move { !is_running(handler) }).await;
    // The message was not acked: the broker has it back.
    wait_until(Duration::from_secs(30), "the message back in its queue", || async { vhost.depth("work").await == 1 })
        .await;
}
