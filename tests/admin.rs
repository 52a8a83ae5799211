//! `sluice run --admin`: Prometheus metrics, liveness and readiness over HTTP.

mod support;

use std::time::Duration;

use support::*;

async fn get(url: &str) -> Option<(u16, String)> {
    let response = reqwest::get(url).await.ok()?;
    let status = response.status().as_u16();
    Some((status, response.text().await.ok()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_outcomes_and_probes_answer() {
    let vhost = Vhost::new();
    let dir = work_pipeline(
        r##"    handler:
      command: {program: /bin/sh, args: ["-c", "[ \"$SLUICE_IDEMPOTENCY_KEY\" != bad ]"], permanent_exit_codes: [1]}
"##,
    );
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    publish(&broker, "ev", "a", "good", serde_json::json!({})).await;
    publish(&broker, "ev", "a", "bad", serde_json::json!({})).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
    let admin = format!("127.0.0.1:{port}");
    let dedup = format!("file:{}", dir.path().join("dedup").display());
    let _sluice = Sluice::run(dir.path(), &vhost.url(), &["--admin", &admin, "--dedup", &dedup]);
    let base = format!("http://{admin}");
    wait_until(Duration::from_secs(30), "both outcomes counted", || async {
        let Some((200, text)) = get(&format!("{base}/metrics")).await else { return false };
        text.contains(r#"sluice_messages_total{queue="work",outcome="success"} 1"#)
            && text.contains(r#"sluice_messages_total{queue="work",outcome="dead_lettered"} 1"#)
    })
    .await;
    wait_until(Duration::from_secs(30), "the DLQ depth polled", || async {
        matches!(get(&format!("{base}/metrics")).await, Some((200, t)) if t.contains(r#"sluice_dlq_depth{queue="work"} 1"#))
    })
    .await;
    let (_, metrics) = get(&format!("{base}/metrics")).await.expect("metrics");
    assert!(metrics.contains(r#"sluice_handler_duration_seconds_count{queue="work"} 2"#), "{metrics}");
    assert_eq!(get(&format!("{base}/healthz")).await.map(|r| r.0), Some(200));
    assert_eq!(get(&format!("{base}/readyz")).await.map(|r| r.0), Some(200));
}
