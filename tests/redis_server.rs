//! The Redis server as sluice finds it (issue 31): a `maxmemory-policy` that can evict is
//! refused (item 3), a full server is drained (item 4), a server that came back empty is
//! reported (item 11), what the server refuses (a password, a command, a replica, a cluster
//! node) is named at start-up (item 12), bindings the files do not declare are drift (item 13),
//! and a publish the ACL refuses writes nothing (item 14). Each test that changes a server's
//! configuration runs its own server ([`OwnRedis`]); the shared one is never changed.

use crate::redis_broker::OwnRedis;
use crate::support;

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::json;
use sluice::broker::{Outgoing, Publish as _};
use support::*;

/// How long a one-shot command may take: a refusal comes at once, a hang is the bug.
const DEADLINE: Duration = Duration::from_secs(25);

/// The command ended with exit 1, its `error:` line naming each of `words`; the line.
fn refused(done: &Finished, words: &[&str]) -> String {
    assert_eq!(done.code, Some(1), "{}", done.stderr);
    let line = done.stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("{}", done.stderr));
    for word in words {
        assert!(line.contains(word), "{word:?} is not in: {line}");
    }
    line.to_string()
}

/// `CONFIG SET name value` on `server`, as its default user.
fn config_set(server: &OwnRedis, name: &str, value: &str) {
    let _: () =
        redis::cmd("CONFIG").arg("SET").arg(name).arg(value).query(&mut server.raw(&server.url())).expect("CONFIG SET");
}

/// `ACL SETUSER name on >password RULES...` on `server` (given the default user's `url`).
fn acl_user(server: &OwnRedis, url: &str, name: &str, rules: &[&str]) {
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(name)
        .arg("on")
        .arg(">pw")
        .arg(rules)
        .query(&mut server.raw(url))
        .expect("ACL SETUSER");
}

/// The arguments of `sluice publish` of one message to `url`.
fn publish_args(url: &str) -> Vec<&str> {
    vec!["publish", "--exchange", "ev", "--routing-key", "x", "--type", "t", "--payload", "{}", "--broker", url]
}

/// A message keyed `key` with `filler` in its payload.
fn keyed(key: &str, filler: &str) -> Outgoing {
    let envelope = sluice::envelope::Envelope::new("test.event", &json!({ "f": filler }), Some(key.to_string()));
    Outgoing { body: envelope.encode(), message_id: Some(envelope.id.clone()), ..Default::default() }
}

/// `/readyz` of the runner whose admin address is `admin`: its status and body.
async fn readyz(admin: &str) -> Option<(u16, String)> {
    let answer = http().get(format!("http://{admin}/readyz")).send().await.ok()?;
    let status = answer.status().as_u16();
    Some((status, answer.text().await.ok()?))
}

// Issue 31 item 3: with allkeys-lru Redis evicted a whole queue's stream, with volatile-lru every
// idempotency key (and the messages ran twice); sluice never read the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_server_is_refused_unless_allowed() {
    let server = OwnRedis::with(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]);
    let place = RedisPrefix::on(&server.url(), "");
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "    idempotency: {ttl: 1h}\n");
    declare(dir.path(), &place.connect().await).await;
    let (d, url) = (dir.path().to_str().expect("utf-8"), place.url());
    let words = ["maxmemory-policy allkeys-lru", "noeviction", "--allow-evicting-redis"];
    refused(&sluice_cli(&["run", d, "--broker", &url], &[], DEADLINE), &words);
    refused(&sluice_cli(&publish_args(&url), &[], DEADLINE), &words);
    refused(&sluice_cli(&["plan", d, "--broker", &url], &[], DEADLINE), &words);
    assert_eq!(place.depth("work").await, 0, "nothing published");
    // The idempotency store alone, beside the embedded broker: volatile-lru evicts its keys first.
    config_set(&server, "maxmemory-policy", "volatile-lru");
    let embedded = tempfile::tempdir().expect("tempdir");
    let store =
        sluice_cli(&["run", d, "--broker", embedded.path().to_str().expect("utf-8"), "--dedup", &url], &[], DEADLINE);
    refused(&store, &["maxmemory-policy volatile-lru", "idempotency", "--allow-evicting-redis"]);
    // Allowed: it runs, and says so at the start.
    config_set(&server, "maxmemory-policy", "allkeys-lru");
    let allowed: Vec<&str> = publish_args(&url).into_iter().chain(["--allow-evicting-redis"]).collect();
    let published = sluice_cli(&allowed, &[], DEADLINE);
    assert_eq!(published.code, Some(0), "{}", published.stderr);
    let mut runner = Sluice::run(dir.path(), &url, &["--allow-evicting-redis"]);
    receiver.wait_for(1, Duration::from_secs(30)).await;
    let log = runner.log();
    assert!(log.lines().any(|l| l.contains("WARN") && l.contains("maxmemory-policy allkeys-lru")), "{log}");
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
}

// Issue 31 item 3: the policy is checked again on every reconnect; a runner stops consuming
// from a server that can now evict, says why in /readyz, and goes on once it cannot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_that_can_evict_is_noticed_on_reconnect() {
    let server = OwnRedis::with(&["--maxmemory", "64mb"]);
    let place = RedisPrefix::on(&server.url(), "");
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let (mut runner, admin) = run_with_admin(dir.path(), &place.url(), "work").await;
    let broker = place.connect().await;
    broker.publish("ev", "x", keyed("k1", "")).await.expect("publish");
    receiver.wait_for(1, Duration::from_secs(30)).await;
    config_set(&server, "maxmemory-policy", "allkeys-lru");
    let _: redis::Value =
        redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal").query(&mut server.raw(&server.url())).expect("kill");
    wait_until(Duration::from_secs(30), "/readyz naming the policy", || async {
        readyz(&admin)
            .await
            .is_some_and(|(status, body)| status == 503 && body.contains("maxmemory-policy allkeys-lru"))
    })
    .await;
    assert!(runner.log().contains("maxmemory-policy allkeys-lru"), "{}", runner.log());
    config_set(&server, "maxmemory-policy", "noeviction");
    let broker = place.connect().await;
    broker.publish("ev", "x", keyed("k2", "")).await.expect("publish");
    wait_until(Duration::from_secs(60), "k2 handled once the policy is noeviction", || async {
        receiver.succeeded_keys().contains("k2")
    })
    .await;
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
}

/// A server of `maxmemory` (noeviction) with the topology of `dir` declared, filled with
/// messages of about 4 KB until it refuses one: the keys it confirmed.
async fn fill(place: &RedisPrefix, dir: &std::path::Path) -> BTreeSet<String> {
    let broker = place.connect().await;
    declare(dir, &broker).await;
    let filler = "x".repeat(4000);
    let mut confirmed = BTreeSet::new();
    for i in 0..100_000 {
        let key = format!("k{i}");
        match broker.publish("ev", "x", keyed(&key, &filler)).await {
            Ok(()) => confirmed.insert(key),
            Err(e) => {
                assert!(e.to_string().contains("maxmemory"), "refused for its memory: {e}");
                break;
            }
        };
    }
    assert!(confirmed.len() > 200, "a backlog: {}", confirmed.len());
    confirmed
}

// Issue 31 item 4: on a full server under noeviction the runner could neither declare nor claim
// (handled 0 in 129 s), and status printed nothing. Now status reads it, and a runner drains it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_drains_a_full_server() {
    let server = OwnRedis::with(&["--maxmemory", "6mb"]);
    let place = RedisPrefix::on(&server.url(), "");
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "    concurrency: 8\n    idempotency: {ttl: 1h}\n");
    declare(dir.path(), &place.connect().await).await;
    place.connect().await.publish("", "work.dlq", keyed("dead", "")).await.expect("a dead letter");
    let confirmed = fill(&place, dir.path()).await;
    let (d, url) = (dir.path().to_str().expect("utf-8"), place.url());
    // The writes the server counts since it started (none are saved).
    let writes = || -> String {
        let info: String = redis::cmd("INFO").arg("persistence").query(&mut server.raw(&server.url())).expect("INFO");
        info.lines().find(|l| l.starts_with("rdb_changes_since_last_save:")).expect("a count").to_string()
    };
    let before = writes();
    let status = sluice_cli(&["status", d, "--broker", &url, "--format", "json"], &[], DEADLINE);
    assert_eq!(status.code, Some(0), "{}", status.stderr);
    let read: serde_json::Value = serde_json::from_str(&status.stdout).expect("status JSON");
    assert_eq!(read["queues"][0]["ready"], json!(confirmed.len()), "{}", status.stdout);
    assert_eq!(read["queues"][0]["dead_lettered"], json!(1), "{}", status.stdout);
    assert_eq!(writes(), before, "status wrote nothing");
    let listed = sluice_cli(&["dlq", "list", "work", "--pipelines", d, "--broker", &url], &[], DEADLINE);
    assert_eq!(listed.code, Some(0), "{}", listed.stderr);
    assert!(listed.stdout.contains("dead"), "{}", listed.stdout);
    let mut runner = Sluice::run(dir.path(), &url, &[]);
    wait_until(Duration::from_secs(120), "every confirmed message handled", || async {
        receiver.succeeded_keys().is_superset(&confirmed)
    })
    .await;
    wait_until(Duration::from_secs(30), "the stream empty", || async { place.depth("work").await == 0 }).await;
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
}

// Issue 31 item 4: what a full server refuses the runner (here: declaring a queue added while it
// is full) is named as its memory in /readyz and the log; raising maxmemory lets it go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_is_named_as_the_cause() {
    let server = OwnRedis::with(&["--maxmemory", "4mb"]);
    let place = RedisPrefix::on(&server.url(), "");
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    fill(&place, dir.path()).await;
    let added = format!(
        "{}  added:\n    bind: [{{exchange: ev, routing_key: \"added\"}}]\n    handler: {{command: {{program: /bin/true}}}}\n",
        webhook_yaml(&receiver, "")
    );
    std::fs::write(dir.path().join("pipeline.yaml"), added).expect("rewrite");
    let admin = format!("127.0.0.1:{}", free_port());
    let mut runner = Sluice::run(dir.path(), &place.url(), &["--admin", &admin]);
    wait_until(Duration::from_secs(30), "/readyz naming the server's memory", || async {
        readyz(&admin).await.is_some_and(|(status, body)| status == 503 && body.contains("maxmemory"))
    })
    .await;
    let log = runner.log();
    assert!(log.lines().any(|l| l.contains("WARN") && l.contains("maxmemory")), "{log}");
    config_set(&server, "maxmemory", "0");
    wait_until(Duration::from_secs(60), "ready once maxmemory is raised", || async {
        readyz(&admin).await.is_some_and(|(status, _)| status == 200)
    })
    .await;
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
}

// Issue 31 item 11: a Redis without persistence restarted empty, and nothing said so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_came_back_empty_is_reported() {
    let mut server = OwnRedis::with(&["--appendonly", "no"]);
    let place = RedisPrefix::on(&server.url(), "");
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "");
    let (mut runner, admin) = run_with_admin(dir.path(), &place.url(), "work").await;
    let series = "sluice_redis_empty_restarts_total";
    place.connect().await.publish("ev", "x", keyed("k1", "")).await.expect("publish");
    receiver.wait_for(1, Duration::from_secs(30)).await;
    assert_eq!(sample(&admin, series).await, Some(0.0), "counted from the start");
    server.restart();
    wait_until(Duration::from_secs(30), "the empty restart counted", || async {
        sample(&admin, series).await.is_some_and(|n| n >= 1.0)
    })
    .await;
    let log = runner.log();
    assert!(log.lines().any(|l| l.contains("ERROR") && l.contains("came back empty")), "{log}");
    // The runner declares again and goes on.
    wait_until(Duration::from_secs(60), "k2 handled after the restart", || async {
        let _ = place.connect().await.publish("ev", "x", keyed("k2", "")).await;
        receiver.succeeded_keys().contains("k2")
    })
    .await;
    assert_eq!(runner.stop(Duration::from_secs(30)), Some(0), "{}", runner.log());
}

// Issue 31 item 12: without the password `run` looped for ever on NOAUTH, blaming CONFIG GET;
// with a wrong one it blamed "the idempotency store".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_wrong_password_is_named() {
    let server = OwnRedis::with(&["--requirepass", "secret"]);
    let receiver = Receiver::ok().await;
    let dir = webhook_pipeline(&receiver, "    idempotency: {ttl: 1h}\n");
    let d = dir.path().to_str().expect("utf-8");
    let none = server.url();
    let line = refused(&sluice_cli(&["run", d, "--broker", &none], &[], DEADLINE), &["password", "NOAUTH"]);
    assert!(!line.contains("CONFIG"), "{line}");
    refused(&sluice_cli(&publish_args(&none), &[], DEADLINE), &["password", "NOAUTH"]);
    let wrong = format!("redis://:wrong@127.0.0.1:{}", server.port);
    let line = refused(&sluice_cli(&["run", d, "--broker", &wrong], &[], DEADLINE), &["password", "WRONGPASS"]);
    assert!(!line.contains("idempotency"), "{line}");
}

// Issue 31 item 12: an ACL user without EVALSHA or XCLAIM started, then failed every second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_without_a_command_sluice_needs_is_named() {
    let server = OwnRedis::with(&[]);
    let place = RedisPrefix::on(&server.url(), "");
    let dir = work_pipeline("    handler: {command: {program: /bin/true}}\n");
    let d = dir.path().to_str().expect("utf-8");
    let url = |user: &str| format!("redis://{user}:pw@127.0.0.1:{}?prefix={}", server.port, place.prefix);
    acl_user(&server, &server.url(), "noeval", &["~*", "&*", "+@all", "-evalsha", "-eval"]);
    acl_user(&server, &server.url(), "noxclaim", &["~*", "&*", "+@all", "-xclaim"]);
    acl_user(&server, &server.url(), "elsewhere", &["~other:*", "&*", "+@all"]);
    refused(&sluice_cli(&["run", d, "--broker", &url("noeval")], &[], DEADLINE), &["\"noeval\"", "EVALSHA"]);
    refused(&sluice_cli(&["run", d, "--broker", &url("noxclaim")], &[], DEADLINE), &["\"noxclaim\"", "XCLAIM"]);
    refused(&sluice_cli(&["run", d, "--broker", &url("elsewhere")], &[], DEADLINE), &["XADD", &place.prefix]);
    let mut c = place.raw();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut c).expect("KEYS");
    assert!(keys.is_empty(), "nothing declared: {keys:?}");
}

// Issue 31 item 12: a read-only replica and a cluster node are named at start-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_or_a_cluster_node_is_named() {
    let primary = OwnRedis::with(&[]);
    let replica = OwnRedis::with(&["--replicaof", "127.0.0.1", &primary.port.to_string()]);
    let node = OwnRedis::with(&["--cluster-enabled", "yes"]);
    let dir = work_pipeline("    handler: {command: {program: /bin/true}}\n");
    let d = dir.path().to_str().expect("utf-8");
    let line = refused(&sluice_cli(&["run", d, "--broker", &replica.url()], &[], DEADLINE), &["replica"]);
    assert!(line.contains(&format!("127.0.0.1:{}", primary.port)), "names the primary: {line}");
    refused(&sluice_cli(&["run", d, "--broker", &node.url()], &[], DEADLINE), &["cluster"]);
    refused(&sluice_cli(&publish_args(&replica.url()), &[], DEADLINE), &["replica"]);
}

/// A queue `work` bound to `ev` with `routing_key`.
fn bound(routing_key: &str) -> tempfile::TempDir {
    pipeline(&format!(
        "version: 1\nexchanges: {{ev: {{type: topic}}}}\nqueues:\n  work:\n    bind: [{{exchange: ev, routing_key: \"{routing_key}\"}}]\n    handler: {{command: {{program: /bin/true}}}}\n"
    ))
}

// Issue 31 item 13: two pipeline sets with one queue name on one prefix merged silently, and
// `plan --broker` said the broker matched the files.
#[tokio::test]
async fn plan_reports_bindings_the_files_do_not_declare() {
    let place = RedisPrefix::new();
    let (mine, theirs) = (bound("a.#"), bound("b.#"));
    let broker = place.connect().await;
    declare(mine.path(), &broker).await;
    declare(theirs.path(), &broker).await;
    let done = sluice_cli(&["plan", mine.path().to_str().expect("utf-8"), "--broker", &place.url()], &[], DEADLINE);
    assert_eq!(done.code, Some(0), "drift, not a conflict: {}", done.stderr);
    assert!(done.stdout.contains("differs from the files"), "{}", done.stdout);
    assert!(done.stdout.contains("binding ev -> work (routing key \"b.#\") is not in the files"), "{}", done.stdout);
    let json = sluice_cli(
        &["plan", mine.path().to_str().expect("utf-8"), "--broker", &place.url(), "--format", "json"],
        &[],
        DEADLINE,
    );
    let read: serde_json::Value = serde_json::from_str(&json.stdout).expect("JSON");
    let drift = read["drift"].as_array().expect("drift");
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert_eq!(drift[0]["kind"], json!("extra_binding"), "{drift:?}");
}

// Issue 31 item 14: an ACL refusing PUBLISH inside the publish script failed the publish after
// the script had written the message.
#[tokio::test]
async fn a_publish_the_acl_refuses_writes_nothing() {
    let server = OwnRedis::with(&[]);
    let place = RedisPrefix::on(&server.url(), "");
    let dir = bound("#");
    declare(dir.path(), &place.connect().await).await;
    acl_user(&server, &server.url(), "nopublish", &["~*", "&*", "+@all", "-publish"]);
    let limited = format!("redis://nopublish:pw@127.0.0.1:{}?prefix={}", server.port, place.prefix);
    let broker = sluice::broker::redis::Redis::connect(&limited).await.expect("connect");
    let failed = broker.publish("ev", "x", keyed("k1", "")).await.expect_err("PUBLISH refused");
    assert!(failed.to_string().contains("PUBLISH"), "{failed}");
    assert_eq!(place.depth("work").await, 0, "nothing written");
    refused(&sluice_cli(&publish_args(&limited), &[], DEADLINE), &["\"nopublish\"", "PUBLISH"]);
    assert_eq!(place.depth("work").await, 0, "nothing written");
}
