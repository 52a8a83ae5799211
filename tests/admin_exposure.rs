//! Issue 31 (items 1 and 2): what the admin port gives away. Every secret a pipeline can hold
//! (written in the file, filled in from `${VAR}` or `{{env.X}}`) stays out of every answer of
//! the port, the log and `/metrics`; reads of message data need the admin token unless
//! `--admin-open-reads`; a request for a host the port does not answer for (DNS rebinding) is
//! refused; `/metrics`, `/healthz` and `/readyz` stay open.

use crate::support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice::broker::Broker as _;
use support::*;

const DEADLINE: Duration = Duration::from_secs(60);
const TOKEN: &str = "exposure-test-token-0123456789";

/// GETs `path` on the admin port with `headers`; the status and the body.
async fn get(admin: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut request = http().get(format!("http://{admin}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_else(|e| panic!("GET {path}: the body: {e}")))
}

/// GETs `path` with the test's token, expecting 200; the body.
async fn read(admin: &str, path: &str) -> String {
    let bearer = format!("Bearer {TOKEN}");
    let (status, body) = get(admin, path, &[("authorization", &bearer)]).await;
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

/// A pipeline directory whose file is `yaml`, with the test's token in `admin-token`; the
/// path of the token file.
fn with_token(yaml: &str) -> (tempfile::TempDir, String) {
    let dir = pipeline(yaml);
    let token = dir.path().join("admin-token");
    std::fs::write(&token, format!("{TOKEN}\n")).expect("write the token");
    let token = token.to_str().expect("utf-8 path").to_string();
    (dir, token)
}

/// Issue 31 item 1: 20 secrets planted in every way a pipeline can hold one; none is in any
/// answer of the port (every GET the OpenAPI document names, for every queue and dead letter,
/// the console's files, the probes), nor in `/metrics` or the log. The handler view shows the
/// file's text instead: `${VAR}` and `{{env.X}}` as written, URL passwords and query values
/// masked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_leaves_through_the_admin_port() {
    let receiver = Receiver::start(|hit, _| Reply::status(if hit.key().starts_with("dead") { 422 } else { 200 })).await;
    let hook = receiver.uri().trim_start_matches("http://").to_string();
    // Each value below is a secret: none may be seen.
    let env: [(&str, String); 11] = [
        ("HOOK_URL", format!("http://envuser:secret-url-from-env@{hook}")),
        ("HOOK_PASS", "secret-url-from-var".into()),
        ("QUERY_TOKEN", "secret-query-from-var".into()),
        ("API_TOKEN", "secret-header-named".into()),
        ("CUSTOM_VALUE", "secret-header-from-var".into()),
        ("CUSTOM_ENV", "secret-header-from-env".into()),
        ("BODY_VALUE", "secret-body-from-var".into()),
        ("ARG_TOKEN", "secret-arg-from-var".into()),
        ("CONN_URL", "postgres://dbuser:secret-env-from-var@db.example/x".into()),
        ("SIGN_SECRET", "whsec_c2VjcmV0LXNpZ25pbmcta2V5LTEyMzQ1Njc4".into()),
        ("OAUTH_SECRET", "secret-oauth-client".into()),
    ];
    let written = [
        "secret-url-literal",
        "secret-query-literal",
        "secret-arg-literal",
        "secret-arg-next",
        "secret-arg-url",
        "secret-env-dsn",
        "secret-env-named",
        "secret-token-url-query",
        "secret-query-after-env",
    ];
    let yaml = format!(
        r#"version: 1
exchanges:
  ev: {{type: topic}}
queues:
  literal:
    bind: [{{exchange: ev, routing_key: literal}}]
    handler:
      webhook:
        url: "http://hookuser:secret-url-literal@{hook}/hook?api_key=secret-query-literal&tenant=t1"
        headers:
          Authorization: "Bearer ${{API_TOKEN}}"
          X-Custom: "${{CUSTOM_VALUE}}"
          X-From-Env: "{{{{env.CUSTOM_ENV}}}}"
        body: '{{"k": "${{BODY_VALUE}}", "id": "{{{{id}}}}"}}'
        signing: {{secret_env: SIGN_SECRET}}
    retry: {{max_attempts: 1}}
  fromenv:
    bind: [{{exchange: ev, routing_key: fromenv}}]
    handler:
      webhook: {{url: "{{{{env.HOOK_URL}}}}/hook?sig=secret-query-after-env"}}
  fromvar:
    bind: [{{exchange: ev, routing_key: fromvar}}]
    handler:
      webhook: {{url: "http://varuser:${{HOOK_PASS}}@{hook}/hook?token=${{QUERY_TOKEN}}"}}
  oauth:
    handler:
      webhook:
        url: "https://127.0.0.1:9/hook"
        auth:
          oauth2:
            token_url: "https://127.0.0.1:9/token?x=secret-token-url-query"
            client_id: partner
            client_secret_env: OAUTH_SECRET
  command:
    bind: [{{exchange: ev, routing_key: command}}]
    handler:
      command:
        program: /bin/sh
        args: ["-c", "exit 3", "--password=secret-arg-literal", "--password", "secret-arg-next",
               "--token=${{ARG_TOKEN}}", "postgres://dbuser:secret-arg-url@db.example/x"]
        env:
          DSN: "postgres://dbuser:secret-env-dsn@db.example/x"
          CONN: "${{CONN_URL}}"
          DB_PASSWORD: secret-env-named
        permanent_exit_codes: [3]
"#
    );
    let (dir, token) = with_token(&yaml);
    let place = EmbeddedDir::new();
    let broker = place.connect().await;
    let env_pairs: Vec<(&str, &str)> = env.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let admin = format!("127.0.0.1:{}", free_port());
    let sluice =
        Sluice::run_with_env(dir.path(), &place.url(), &["--admin", &admin, "--admin-token-file", &token], &env_pairs);
    // The runner declares the topology before its workers start (the breaker gauge).
    wait_until(DEADLINE, "the admin port up", || async {
        gauge(&admin, "sluice_circuit_state", "command").await.is_some()
    })
    .await;
    for (key, routing) in
        [("ok-1", "literal"), ("dead-1", "literal"), ("ok-2", "fromenv"), ("ok-3", "fromvar"), ("run-1", "command")]
    {
        publish(&broker, "ev", routing, key, json!({ "n": 1 })).await;
    }
    wait_until(DEADLINE, "the webhooks called", || async {
        ["ok-1", "ok-2", "ok-3"].iter().all(|k| receiver.succeeded_keys().contains(*k))
    })
    .await;
    wait_until(DEADLINE, "two dead letters", || async {
        place.depth("literal.dlq").await == 1 && place.depth("command.dlq").await == 1
    })
    .await;
    broker.close().await;

    // Every GET the API documents, for each queue and each dead letter.
    let openapi: Value = serde_json::from_str(&read(&admin, "/api/v1/openapi.json").await).expect("JSON");
    let queues = ["literal", "fromenv", "fromvar", "oauth", "command"];
    let mut answers: Vec<(String, String)> = Vec::new();
    let mut paths = BTreeSet::new();
    for (path, item) in openapi["paths"].as_object().expect("paths") {
        if item.get("get").is_none() {
            continue;
        }
        for queue in queues {
            let path = path.replace("{name}", queue);
            if path.contains("{id}") {
                let list: Value =
                    serde_json::from_str(&read(&admin, &format!("/api/v1/queues/{queue}/dead-letters")).await)
                        .expect("JSON");
                for entry in list["entries"].as_array().expect("entries") {
                    let id = entry["id"].as_str().expect("an id");
                    paths.insert(path.replace("{id}", id));
                }
            } else {
                paths.insert(path);
            }
        }
    }
    assert!(paths.iter().filter(|p| p.contains("/dead-letters/")).count() == 2, "both dead letters read: {paths:?}");
    for path in
        paths.iter().map(String::as_str).chain(["/", "/console.js", "/console.css", "/metrics", "/healthz", "/readyz"])
    {
        answers.push((path.to_string(), read(&admin, path).await));
    }
    answers.push(("the log".into(), sluice.log()));
    let secrets: Vec<&str> = env
        .iter()
        .map(|(_, v)| v.as_str())
        .filter(|v| !v.starts_with("http://") && !v.starts_with("postgres://"))
        .chain(["secret-url-from-env", "secret-env-from-var", "c2VjcmV0LXNpZ25pbmcta2V5"])
        .chain(written)
        .collect();
    let mut seen = Vec::new();
    for (path, body) in &answers {
        for secret in &secrets {
            if body.contains(secret) {
                seen.push(format!("{secret} in {path}"));
            }
        }
    }
    assert!(seen.is_empty(), "{} secret(s) readable:\n{}", seen.len(), seen.join("\n"));

    // What the file says instead.
    let view = |queue: &str| {
        let body = &answers.iter().find(|(p, _)| p == &format!("/api/v1/queues/{queue}")).expect("read").1;
        serde_json::from_str::<Value>(body).expect("JSON")["handler"].clone()
    };
    let literal = view("literal");
    assert_eq!(literal["url"], format!("http://hookuser:***@{hook}/hook?api_key=***&tenant=***"));
    assert_eq!(
        literal["headers"],
        json!([["Authorization", "***"], ["X-Custom", "${CUSTOM_VALUE}"], ["X-From-Env", "{{env.CUSTOM_ENV}}"]])
    );
    assert_eq!(literal["body"], r#"{"k": "${BODY_VALUE}", "id": "{{id}}"}"#);
    assert_eq!(view("fromenv")["url"], "{{env.HOOK_URL}}/hook?sig=***");
    assert_eq!(view("fromvar")["url"], format!("http://varuser:***@{hook}/hook?token=***"));
    let command = view("command");
    assert_eq!(
        command["args"],
        json!([
            "-c",
            "exit 3",
            "--password=***",
            "--password",
            "***",
            "--token=***",
            "postgres://dbuser:***@db.example/x"
        ])
    );
    assert_eq!(
        command["env"],
        json!([["CONN", "${CONN_URL}"], ["DB_PASSWORD", "***"], ["DSN", "postgres://dbuser:***@db.example/x"]])
    );
}

/// A runner of one command queue `work` on an embedded broker of its own, with the test's
/// token and `extra` args; its admin address.
async fn runner(extra: &[&str]) -> (tempfile::TempDir, EmbeddedDir, Sluice, String) {
    let (dir, token) = with_token("version: 1\nqueues:\n  work:\n    handler: {command: {program: /bin/true}}\n");
    let place = EmbeddedDir::new();
    let args: Vec<&str> = ["--admin-token-file", token.as_str()].into_iter().chain(extra.iter().copied()).collect();
    let (sluice, admin) = run_with_admin_and(dir.path(), &place.url(), "work", &args).await;
    (dir, place, sluice, admin)
}

/// The reads of message data the API serves.
const DATA: [&str; 5] = [
    "/api/v1/queues",
    "/api/v1/queues/work",
    "/api/v1/queues/work/attempts",
    "/api/v1/queues/work/dead-letters",
    "/api/v1/topology",
];
const PROBES: [&str; 3] = ["/metrics", "/healthz", "/readyz"];

/// Issue 31 item 2: every read of the API needs the token (401 without it or with another);
/// the probes, the console's files and the OpenAPI document do not; a request for a host the
/// port does not answer for is refused whatever it carries, the probes excepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_need_the_token_and_a_host_the_port_answers_for() {
    let (_dir, _place, _sluice, admin) = runner(&["--admin-allowed-hosts", "sluice.internal,Other.Example."]).await;
    let port = admin.rsplit_once(':').expect("a port").1;
    let bearer = format!("Bearer {TOKEN}");
    for path in DATA {
        assert_eq!(get(&admin, path, &[]).await.0, 401, "GET {path} without the token");
        assert_eq!(get(&admin, path, &[("authorization", "Bearer wrong")]).await.0, 401, "GET {path}, a wrong token");
        assert_eq!(get(&admin, path, &[("authorization", &bearer)]).await.0, 200, "GET {path} with the token");
        // The names the port answers for: its address, localhost, and those allowed.
        for host in [
            format!("localhost:{port}"),
            "localhost".into(),
            format!("LOCALHOST:{port}"),
            format!("[::1]:{port}"),
            format!("sluice.internal:{port}"),
            "other.example".into(),
        ] {
            let answered = get(&admin, path, &[("authorization", &bearer), ("host", &host)]).await;
            assert_eq!(answered.0, 200, "GET {path} for host {host}: {}", answered.1);
        }
        for host in [
            format!("attacker.example:{port}"),
            "attacker.example".into(),
            format!("localhost.attacker.example:{port}"),
        ] {
            let (status, body) = get(&admin, path, &[("authorization", &bearer), ("host", &host)]).await;
            assert_eq!(status, 421, "GET {path} for host {host}: {body}");
            assert!(body.contains("--admin-allowed-hosts"), "says how to allow it: {body}");
        }
    }
    for path in ["/", "/console.js", "/console.css", "/api/v1/openapi.json"] {
        assert_eq!(get(&admin, path, &[]).await.0, 200, "GET {path} needs no token: it holds no data");
        assert_eq!(get(&admin, path, &[("host", "attacker.example")]).await.0, 421, "GET {path} for another host");
    }
    for path in PROBES {
        assert_eq!(get(&admin, path, &[]).await.0, 200, "GET {path} stays open");
        assert_eq!(get(&admin, path, &[("host", "attacker.example")]).await.0, 200, "GET {path} for any host");
    }
    // A write for another host is refused too, token or not.
    let refused = http()
        .post(format!("http://{admin}/api/v1/queues/work/pause"))
        .header("authorization", &bearer)
        .header("host", "attacker.example")
        .send()
        .await
        .expect("answered");
    assert_eq!(refused.status().as_u16(), 421);
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(0.0), "not paused");
}

/// Issue 31 item 2: `--admin-open-reads` opens the reads again, and nothing else: writes still
/// need the token, and the host is still checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_reads_open_the_reads_only() {
    let (_dir, _place, _sluice, admin) = runner(&["--admin-open-reads"]).await;
    for path in DATA {
        assert_eq!(get(&admin, path, &[]).await.0, 200, "GET {path} without the token");
        assert_eq!(get(&admin, path, &[("host", "attacker.example")]).await.0, 421, "GET {path} for another host");
    }
    let write = http().post(format!("http://{admin}/api/v1/queues/work/pause")).send().await.expect("answered");
    assert_eq!(write.status().as_u16(), 401, "a write still needs the token");
    assert_eq!(gauge(&admin, "sluice_paused", "work").await, Some(0.0), "not paused");
}

/// Issue 31 (low): refused requests are logged one line per 10 s with a count of the others,
/// not one line each (5,000 refused writes once made 1 MB of log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_do_not_flood_the_log() {
    let (_dir, _place, sluice, admin) = runner(&[]).await;
    let started = Instant::now();
    for _ in 0..500 {
        let refused = http().post(format!("http://{admin}/queues/work/pause")).send().await.expect("answered");
        assert_eq!(refused.status().as_u16(), 401);
    }
    let intervals = started.elapsed().as_secs() / 10 + 1;
    let log = sluice.log();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("refused") && l.contains("remote=")).collect();
    assert!(
        !lines.is_empty() && lines.len() as u64 <= intervals,
        "{} line(s) for 500 refusals in {intervals} interval(s) of 10 s:\n{}",
        lines.len(),
        lines.iter().take(3).copied().collect::<Vec<_>>().join("\n")
    );
}

/// Issue 31 (low): under `umask 000` the state directory a runner makes (here the embedded
/// broker's, which holds its admin token), and each parent it makes, is the owner's alone
/// (0700), not 0777.
#[test]
fn the_state_directory_is_private_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = pipeline("version: 1\nqueues:\n  work:\n    handler: {command: {program: /bin/true}}\n");
    let parent = dir.path().join("state");
    let state = parent.join("broker");
    let path = |p: &std::path::Path| p.to_str().expect("utf-8 path").to_string();
    let finished = std::process::Command::new("timeout")
        .args(["60", "/bin/sh", "-c", "umask 000 && exec \"$@\"", "sh", env!("CARGO_BIN_EXE_sluice"), "run"])
        .args([path(dir.path()), "--broker".into(), path(&state), "--admin".into(), "127.0.0.1:0".into()])
        .args(["--exit-when-idle", "--no-watch"])
        .output()
        .expect("run sluice under umask 000");
    assert!(finished.status.success(), "{finished:?}");
    for made in [&parent, &state] {
        let mode = std::fs::metadata(made).expect("made").permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{} is mode {mode:o}", made.display());
    }
    let token = std::fs::metadata(state.join("admin-token")).expect("the token generated");
    assert_eq!(token.permissions().mode() & 0o777, 0o600);
}
