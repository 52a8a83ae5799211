//! The `sluice` binary: `validate` exit codes and output formats, `schema`, `plan`, and the
//! pipeline files shipped in the repository.

use crate::util;

use std::collections::BTreeSet;
use std::path::Path;

use predicates::prelude::*;
use serde_json::Value;
use util::sluice;

/// A fixture with one error whose position and message are easy to check by eye.
const ONE_ERROR: &str = "tests/fixtures/invalid/max-attempts-zero.yaml";

#[test]
fn validate_exits_0_on_the_valid_fixtures() {
    sluice()
        .args(["validate", util::VALID])
        .assert()
        .success()
        .stderr(predicate::str::contains("ok: 8 queue(s) valid"));
}

#[test]
fn validate_exits_1_on_errors_and_0_on_warnings_alone() {
    for fixture in util::invalid_fixtures() {
        let code = if fixture.warnings_only() { 0 } else { 1 };
        let output = sluice().arg("validate").arg(&fixture.path).output().unwrap();
        assert_eq!(output.status.code(), Some(code), "{}: {output:?}", fixture.path.display());
        let stdout = String::from_utf8(output.stdout).unwrap();
        let worst = fixture.expected.iter().map(|e| e.severity).min().expect("an expected line");
        let severity = format!(": {}: ", util::severity_name(worst));
        assert!(stdout.contains(&severity), "{}: {stdout}", fixture.path.display());
    }
}

#[test]
fn usage_errors_exit_2() {
    let cases: &[&[&str]] = &[
        &["validate", "--bogus"],
        &["validate", "--format", "xml", util::VALID],
        &["plan", "--format", "png", util::VALID],
        &["run", "--admin", "9464", util::VALID],
        &["run", "--log-format", "xml", util::VALID],
        &["frobnicate"],
        &[],
    ];
    for args in cases {
        sluice().args(*args).assert().code(2).stdout("");
    }
}

#[test]
fn human_format_is_a_headline_and_a_snippet_with_a_caret() {
    let out = sluice().args(["validate", ONE_ERROR, "--format", "human"]).assert().code(1).get_output().clone();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        stdout,
        format!(
            "{ONE_ERROR}:10:21: error: /queues/work/retry/max_attempts: 0 is less than the minimum of 1\n   |\n10 |       max_attempts: 0\n   |                     ^\n"
        )
    );
    // Human is the default.
    sluice().args(["validate", ONE_ERROR]).assert().code(1).stdout(stdout);
}

#[test]
fn human_format_of_a_syntax_error_has_no_pointer() {
    let file = "tests/fixtures/invalid/yaml-unclosed-flow.yaml";
    let out = sluice().args(["validate", file]).assert().code(1).get_output().stdout.clone();
    let stdout = String::from_utf8(out).unwrap();
    let mut lines = stdout.lines();
    assert_eq!(
        lines.next(),
        Some(&*format!("{file}:9:30: error: YAML syntax error: while parsing a flow sequence, expected ',' or ']'"))
    );
    assert_eq!(lines.nth(1), Some("9 |     bind: [{exchange: orders}"));
    assert_eq!(lines.next(), Some("  |                              ^"));
}

/// `validate --format json` on `path`, checked to be an array of objects with exactly the
/// documented keys.
fn json_diagnostics(path: &str, code: i32) -> Vec<Value> {
    let out = sluice().args(["validate", path, "--format", "json"]).assert().code(code).get_output().stdout.clone();
    let Value::Array(items) = serde_json::from_slice(&out).expect("JSON") else { panic!("not an array") };
    let keys: BTreeSet<&str> = ["file", "line", "column", "severity", "pointer", "message"].into();
    for item in &items {
        let got: BTreeSet<&str> = item.as_object().expect("objects").keys().map(String::as_str).collect();
        assert_eq!(got, keys, "{item}");
        assert!(item["line"].as_u64().unwrap() >= 1 && item["column"].as_u64().unwrap() >= 1, "{item}");
        assert!(matches!(item["severity"].as_str(), Some("error" | "warning")), "{item}");
    }
    items
}

#[test]
fn json_format_is_an_array_of_diagnostics() {
    let items = json_diagnostics(ONE_ERROR, 1);
    assert_eq!(
        items,
        [serde_json::json!({
            "file": ONE_ERROR,
            "line": 10,
            "column": 21,
            "severity": "error",
            "pointer": "/queues/work/retry/max_attempts",
            "message": "0 is less than the minimum of 1",
        })]
    );
    let warnings = json_diagnostics(util::VALID, 0);
    assert_eq!(warnings.len(), 4, "the jitter warning of an anchor merged twice is reported once");
    assert!(warnings.iter().all(|w| w["severity"] == "warning"));
    assert_eq!(json_diagnostics("tests/fixtures/invalid/dup", 1).len(), 1);
    assert_eq!(json_diagnostics("pipelines", 0), Vec::<Value>::new());
}

#[test]
fn github_format_is_workflow_commands() {
    sluice().args(["validate", ONE_ERROR, "--format", "github"]).assert().code(1).stdout(format!(
        "::error file={ONE_ERROR},line=10,col=21::/queues/work/retry/max_attempts: 0 is less than the minimum of 1\n"
    ));
    let warning = "tests/fixtures/invalid/warn-jitter-none.yaml";
    sluice().args(["validate", warning, "--format", "github"]).assert().code(0).stdout(format!(
        "::warning file={warning},line=10,col=15::/queues/work/retry/jitter: jitter: none makes every failed message retry at the same moment; prefer full\n"
    ));
    // Regression: without a pointer the message used to start with ": ".
    let syntax = "tests/fixtures/invalid/yaml-tab-indent.yaml";
    sluice().args(["validate", syntax, "--format", "github"]).assert().code(1).stdout(format!(
        "::error file={syntax},line=6,col=2::YAML syntax error: tabs disallowed within this context (block indentation)\n"
    ));
}

#[test]
fn validate_of_a_missing_path_fails_clearly() {
    let missing = "tests/fixtures/does-not-exist.yaml";
    sluice()
        .args(["validate", missing])
        .assert()
        .code(1)
        .stdout(predicate::str::starts_with(format!("{missing}:1:1: error: no such file or directory")));
    let empty = tempfile::tempdir().unwrap();
    sluice()
        .arg("validate")
        .arg(empty.path())
        .assert()
        .code(1)
        .stdout(predicate::str::contains("no pipeline files (*.yaml, *.yml) under"));
    // Issue 14: run with no path where there is no pipelines/, a new user was told only that
    // "pipelines" does not exist.
    sluice().arg("validate").current_dir(empty.path()).assert().code(1).stdout(predicate::str::starts_with(
        "pipelines:1:1: error: no such file or directory; given no path, sluice reads pipelines/ in the current directory: name the files or directories that hold your pipelines, as in `sluice validate path/to/pipelines`\n",
    ));
}

#[test]
fn schema_prints_the_committed_schema_byte_for_byte() {
    for (args, committed) in [(&["schema"][..], util::SCHEMA), (&["schema", "--tests"][..], util::TEST_SCHEMA)] {
        let text = std::fs::read(committed).unwrap();
        let out = sluice().args(args).assert().success().get_output().stdout.clone();
        assert!(out == text, "`sluice {}` differs from {committed}", args.join(" "));
    }
}

// Issue 14: `validate examples/` failed on the Prometheus files of examples/monitoring.
#[test]
fn shipped_pipelines_and_examples_validate_and_name_the_schema() {
    for dir in ["pipelines", "examples"] {
        let out = sluice().args(["validate", dir]).assert().success().get_output().stdout.clone();
        let stdout = String::from_utf8(out).unwrap();
        assert!(!stdout.contains(": error: "), "{stdout}");
        let files: Vec<_> =
            util::yaml_files(Path::new(dir)).into_iter().filter(|f| !f.starts_with("examples/monitoring")).collect();
        assert!(files.iter().any(|f| !util::is_test_file(f)), "{dir}/ has pipeline files");
        assert!(files.iter().any(|f| util::is_test_file(f)), "{dir}/ has a test file");
        for file in files {
            util::check_schema_header(&file).unwrap();
        }
    }
    let out = sluice().args(["validate", "examples"]).assert().success().get_output().stdout.clone();
    let stdout = String::from_utf8(out).unwrap();
    assert!(
        stdout.contains(
            "examples/monitoring/alerts.yaml:8:1: note: not a sluice pipeline file (no \"version:\", and \"groups\" is not a pipeline key); skipped"
        ),
        "{stdout}"
    );
}

/// `sluice plan` of the valid fixtures in `format`.
fn plan(format: &str) -> String {
    let out = sluice().args(["plan", util::VALID, "--format", format]).assert().success().get_output().stdout.clone();
    String::from_utf8(out).unwrap()
}

#[test]
fn plan_json_declares_queues_their_dead_letter_queues_and_the_delay_cascade() {
    let plan: Value = serde_json::from_str(&plan("json")).expect("JSON");
    let queues: Vec<(&str, &str)> = plan["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| (q["name"].as_str().unwrap(), q["role"].as_str().unwrap()))
        .collect();
    let names_with =
        |role: &str| -> BTreeSet<String> { queues.iter().filter(|q| q.1 == role).map(|q| q.0.to_string()).collect() };
    let work: BTreeSet<String> = [
        "billing.cleanup",
        "billing.invoice",
        "billing.lookup",
        "media.archive",
        "media.resize",
        "media.thumbnail",
        "orders.audit",
        "orders.charge",
    ]
    .map(String::from)
    .into();
    assert_eq!(names_with("work"), work);
    let dead = work.iter().map(|q| if q == "orders.charge" { format!("{q}.failed") } else { format!("{q}.dlq") });
    assert_eq!(names_with("dead_letter"), dead.collect());
    assert_eq!(names_with("delay"), (0..25).map(|n| format!("sluice.delay.{n:02}")).collect());
    assert_eq!(queues.len(), 8 + 8 + 25, "nothing else is declared");

    let charge = queues.iter().position(|q| q.0 == "orders.charge").unwrap();
    let args = &plan["queues"][charge]["arguments"];
    assert_eq!(args["x-max-length"], 100_000);
    assert_eq!(args["x-dead-letter-routing-key"], "orders.charge.failed");
    let audit = queues.iter().position(|q| q.0 == "orders.audit").unwrap();
    assert_eq!(plan["queues"][audit]["arguments"]["x-queue-type"], "classic");
    assert_eq!(plan["queues"][audit]["arguments"]["x-single-active-consumer"], true);
    let headers = plan["bindings"].as_array().unwrap().iter().find(|b| b["source"] == "routing.headers").unwrap();
    assert_eq!(headers["arguments"]["x-match"], "all");
}

#[test]
fn plan_text_dot_and_mermaid() {
    let text = plan("text");
    assert!(text.starts_with("exchanges:\n"), "{text}");
    assert!(text.contains("  orders.charge.failed [dead-letter]\n"), "{text}");
    assert!(text.contains("delay cascade: 25 levels"), "{text}");
    let dot = plan("dot");
    assert!(dot.starts_with("digraph"), "{dot}");
    assert!(dot.trim_end().ends_with('}'), "{dot}");
    assert!(dot.contains("q_orders_charge -> q_orders_charge_failed"), "{dot}");
    let mermaid = plan("mermaid");
    assert!(mermaid.starts_with("flowchart"), "{mermaid}");
    assert!(mermaid.contains("q_media_resize"), "{mermaid}");
    // Text is the default.
    sluice().args(["plan", util::VALID]).assert().success().stdout(text);
}

#[test]
fn plan_of_an_invalid_pipeline_fails_with_the_diagnostics() {
    sluice()
        .args(["plan", ONE_ERROR, "--format", "json"])
        .assert()
        .code(1)
        .stdout("")
        .stderr(predicate::str::contains(format!("{ONE_ERROR}:10:21: error:")));
}

#[test]
fn paths_default_to_pipelines() {
    let explicit = sluice().args(["plan", "pipelines"]).assert().success().get_output().stdout.clone();
    assert!(!explicit.is_empty());
    sluice().arg("plan").assert().success().stdout(explicit);
}

/// A pipeline whose plan is longer than a pipe's buffer (64 KiB): 500 queues.
fn long_pipeline() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut yaml = String::from("version: 1\nexchanges:\n  ev: {type: topic}\nqueues:\n");
    for i in 0..500 {
        yaml.push_str(&format!(
            "  q{i}:\n    bind: [{{exchange: ev, routing_key: k{i}}}]\n    handler: {{command: {{program: /bin/true, args: [\"{{{{payload.n}}}}\"]}}}}\n"
        ));
    }
    std::fs::write(dir.path().join("p.yaml"), yaml).unwrap();
    std::fs::write(
        dir.path().join("message.json"),
        format!(
            r#"{{"id": "1", "type": "t", "version": 1, "occurred_at": "2026-01-01T00:00:00Z", "idempotency_key": "k", "payload": {{"n": "{}"}}}}"#,
            "x".repeat(200_000)
        ),
    )
    .unwrap();
    dir
}

/// Runs `sluice ARGS` with stdout a pipe whose reader reads `lines` lines, then goes away (as
/// `head` does); the exit code and stderr.
fn with_closed_stdout(args: &[&str], lines: usize) -> (Option<i32>, String) {
    use std::io::{BufRead, Read};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    for _ in 0..lines {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
    }
    drop(stdout);
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("sluice {args:?} did not end after its stdout closed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status.code(), stderr)
}

// Issue 9: `sluice plan ... | head` panicked on the closed pipe (exit 101).
#[test]
fn a_closed_stdout_ends_every_command_quietly() {
    let dir = long_pipeline();
    let path = dir.path().to_str().unwrap();
    let message = dir.path().join("message.json");
    let message = message.to_str().unwrap();
    let cases: &[(&[&str], i32)] = &[
        (&["plan", path], 0),
        (&["plan", path, "--format", "json"], 0),
        (&["plan", path, "--format", "dot"], 0),
        (&["schema"], 0),
        (&["render", path, "--queue", "q7", "--message", message], 0),
        (&["validate", util::INVALID, "--format", "json"], 1),
        (&["validate", util::INVALID], 1),
    ];
    for (args, code) in cases {
        for lines in [0, 1] {
            let (got, stderr) = with_closed_stdout(args, lines);
            assert_eq!(got, Some(*code), "{args:?} after {lines} line(s): {stderr}");
            assert!(!stderr.contains("panicked") && !stderr.contains("Broken pipe"), "{args:?}: {stderr}");
        }
    }
}

/// Issue 20: a classic queue lives on one node of a cluster: `validate` says so when the broker
/// is several nodes (`--broker` or `$SLUICE_BROKER`), and only then.
#[test]
fn validate_warns_about_classic_queues_on_a_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "version: 1\nqueues:\n  jobs:\n    type: classic\n    handler: {command: {program: /bin/true}}\n";
    std::fs::write(dir.path().join("p.yaml"), yaml).unwrap();
    let warning = "p.yaml:4:11: warning: /queues/jobs/type: queue \"jobs\" is a classic queue, which lives on one node of a cluster";
    let single = sluice().arg("validate").arg(dir.path()).env_remove("SLUICE_BROKER").output().unwrap();
    assert_eq!(single.status.code(), Some(0), "{single:?}");
    assert!(!String::from_utf8_lossy(&single.stdout).contains("classic"), "{single:?}");
    let nodes = "amqp://rabbit-1:5672/%2f,amqp://rabbit-2:5672/%2f";
    let flag = sluice().args(["validate", "--broker", nodes]).arg(dir.path()).output().unwrap();
    let env = sluice().arg("validate").arg(dir.path()).env("SLUICE_BROKER", nodes).output().unwrap();
    for cluster in [flag, env] {
        assert_eq!(cluster.status.code(), Some(0), "warnings alone exit 0: {cluster:?}");
        assert!(String::from_utf8_lossy(&cluster.stdout).contains(warning), "{cluster:?}");
    }
}

/// Issue 21: `plan` takes the broker from `$SLUICE_BROKER` as the other commands do: the
/// drift against it follows the plan (here an embedded broker not created yet, compared as an
/// empty one); without it, the plan alone, as RabbitMQ declares it. Issue 23: the plan is in
/// the selected broker's terms.
#[test]
fn plan_compares_with_the_broker_named_by_sluice_broker() {
    let state = tempfile::tempdir().unwrap();
    let broker = state.path().join("broker");
    let alone = sluice().args(["plan", "pipelines"]).env_remove("SLUICE_BROKER").output().unwrap();
    assert_eq!(alone.status.code(), Some(0), "{alone:?}");
    assert!(!String::from_utf8_lossy(&alone.stdout).contains("missing"), "{alone:?}");
    let env = sluice().args(["plan", "pipelines"]).env("SLUICE_BROKER", &broker).output().unwrap();
    assert_eq!(env.status.code(), Some(0), "{env:?}");
    let (stdout, rabbitmq) = (String::from_utf8_lossy(&env.stdout), String::from_utf8_lossy(&alone.stdout));
    assert!(rabbitmq.contains("x-queue-type = \"quorum\"") && rabbitmq.contains("delay cascade: "), "{alone:?}");
    let embedded = format!("the embedded broker in {}", broker.join("broker.db").display());
    assert!(stdout.starts_with(&embedded), "the plan first, in the embedded broker's terms: {env:?}");
    assert!(!stdout.contains("x-queue-type") && !stdout.contains("delay cascade"), "{env:?}");
    assert!(stdout.contains("  orders.charge\n    dead_letter = \"orders.charge.dlq\"\n"), "{env:?}");
    assert!(stdout.contains("missing exchange \"orders\""), "{env:?}");
    assert!(!broker.exists(), "plan created the broker");
}

/// A pipeline whose webhook reads a token (`${OPS_TEST_TOKEN}`) and a signing secret
/// (`OPS_TEST_SECRET`) from the environment, as a deployment's does; `dead_letter` is added to
/// the queue as given.
fn secret_pipeline(dead_letter: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let pipelines = dir.path().join("pipelines");
    std::fs::create_dir(&pipelines).unwrap();
    let yaml = format!(
        "version: 1\nexchanges:\n  ev: {{type: topic}}\nqueues:\n  work:\n    bind: [{{exchange: ev, routing_key: \"#\"}}]\n{dead_letter}    \
         handler:\n      webhook:\n        url: http://127.0.0.1:9/x\n        headers: {{Authorization: \"Bearer ${{OPS_TEST_TOKEN}}\"}}\n        \
         signing: {{secret_env: OPS_TEST_SECRET}}\n"
    );
    std::fs::write(pipelines.join("p.yaml"), yaml).unwrap();
    dir
}

/// `sluice ARGS` in a shell without the pipelines' secrets.
fn without_secrets(args: &[&str]) -> std::process::Output {
    sluice()
        .args(args)
        .env_remove("OPS_TEST_TOKEN")
        .env_remove("OPS_TEST_SECRET")
        .env_remove("OPS_TEST_DLQ")
        .env_remove("SLUICE_BROKER")
        .output()
        .unwrap()
}

/// Issue 31 item 17: the operator's commands need no secret they do not use. `status`, `dlq`
/// and `plan` work in a shell without the webhook's token and signing secret (as the
/// README's Deploy section runs `status`), each saying in one note line what it left
/// unresolved; `render`, which renders the webhook's call, still needs its token, and `status`
/// needs a variable the dead-letter queue's name reads.
#[test]
fn operator_commands_resolve_only_what_they_use() {
    let dir = secret_pipeline("");
    let pipelines = dir.path().join("pipelines").display().to_string();
    let broker = dir.path().join("broker").display().to_string();
    let run = sluice()
        .args(["run", &pipelines, "--broker", &broker, "--exit-when-idle"])
        .env("OPS_TEST_TOKEN", "t0ken")
        .env("OPS_TEST_SECRET", "whsec_c2VjcmV0LWtleS1mb3ItdGVzdHM=")
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(0), "the runner declares the broker: {run:?}");
    let cases: [&[&str]; 4] = [
        &["status", &pipelines, "--broker", &broker],
        &["dlq", "list", "work", "--pipelines", &pipelines, "--broker", &broker],
        &["plan", &pipelines],
        &["plan", &pipelines, "--broker", &broker],
    ];
    for args in cases {
        let out = without_secrets(args);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stdout}{stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: one note line: {stderr}");
        let note = lines[0];
        assert!(
            note.starts_with("note: ") && note.contains("OPS_TEST_TOKEN") && note.contains("OPS_TEST_SECRET"),
            "{args:?}: {note}"
        );
    }
    let status = without_secrets(&["status", &pipelines, "--broker", &broker]);
    assert!(String::from_utf8_lossy(&status.stdout).starts_with("QUEUE"), "{status:?}");

    // `render` renders the webhook's call: the token it reads is needed.
    let message = dir.path().join("message.json");
    std::fs::write(&message, r#"{"id": "m-1", "type": "t", "payload": {}}"#).unwrap();
    let render =
        without_secrets(&["render", &pipelines, "--queue", "work", "--message", &message.display().to_string()]);
    assert_eq!(render.status.code(), Some(1), "{render:?}");
    assert!(String::from_utf8_lossy(&render.stderr).contains("OPS_TEST_TOKEN"), "{render:?}");

    // A dead-letter queue named by a variable: `status` and `dlq` read that name.
    let dir = secret_pipeline("    dead_letter: {queue: \"${OPS_TEST_DLQ}\"}\n");
    let pipelines = dir.path().join("pipelines").display().to_string();
    for args in [&["status", &pipelines][..], &["dlq", "list", "work", "--pipelines", &pipelines]] {
        let out = without_secrets(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("OPS_TEST_DLQ")
                || String::from_utf8_lossy(&out.stderr).contains("OPS_TEST_DLQ"),
            "{args:?}: {out:?}"
        );
    }
}
