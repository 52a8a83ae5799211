//! `sluice run --admin`: Prometheus metrics, liveness and readiness over HTTP; the address
//! as a host name, and one that cannot be bound.

use crate::support;

use std::time::Duration;

use prometheus_parse::{LineInfo, SampleType, Scrape, Value};
use support::*;

async fn get(url: &str) -> Option<(u16, String)> {
    let response = http().get(url).send().await.ok()?;
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
    let admin = format!("127.0.0.1:{}", free_port());
    let dedup = format!("file:{}", dir.path().join("state").display());
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

/// Every metric sluice records, with its Prometheus type.
const METRICS: [(&str, SampleType); 12] = [
    ("sluice_messages_total", SampleType::Counter),
    ("sluice_handler_duration_seconds", SampleType::Histogram),
    ("sluice_consumer_lag_seconds", SampleType::Gauge),
    ("sluice_queue_depth", SampleType::Gauge),
    ("sluice_dlq_depth", SampleType::Gauge),
    ("sluice_queue_consumers", SampleType::Gauge),
    ("sluice_in_flight", SampleType::Gauge),
    ("sluice_retries_total", SampleType::Counter),
    ("sluice_config_reloads_total", SampleType::Counter),
    ("sluice_circuit_state", SampleType::Gauge),
    ("sluice_concurrency_limit", SampleType::Gauge),
    ("sluice_paused", SampleType::Gauge),
];

/// `/metrics` as a Prometheus text-format parser reads it: the scrape, and each metric's
/// `# TYPE`.
fn parse(text: &str) -> (Scrape, Vec<(String, SampleType)>) {
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("parses");
    let types = text
        .lines()
        .filter_map(|l| match LineInfo::parse(l) {
            LineInfo::Type { metric_name, metric_alias, sample_type } => {
                Some((metric_alias.unwrap_or(metric_name), sample_type))
            }
            _ => None,
        })
        .collect();
    (scrape, types)
}

/// A counter's or gauge's value for `labels`, if the scrape has it.
fn sample(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape.samples.iter().find_map(|s| match s.value {
        Value::Counter(v) | Value::Gauge(v)
            if s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)) =>
        {
            Some(v)
        }
        _ => None,
    })
}

/// Issue 11: every metric has its `# HELP` and `# TYPE`, read by a Prometheus parser from a
/// real run whose admin address is a host name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_has_help_and_type_for_a_prometheus_parser() {
    let vhost = Vhost::new();
    let receiver = Receiver::start(|hit, _| Reply::status(if hit.key() == "flaky" { 503 } else { 200 })).await;
    let dir = webhook_pipeline(&receiver, "    retry: {max_attempts: 2, initial: 100ms, max: 100ms}\n");
    let broker = vhost.connect().await;
    declare(dir.path(), &broker).await;
    for key in ["a", "b", "flaky"] {
        publish(&broker, "ev", "x", key, serde_json::json!({})).await;
    }
    let admin = format!("localhost:{}", free_port());
    let sluice = Sluice::run(dir.path(), &vhost.url(), &["--admin", &admin]);
    let url = format!("http://{admin}/metrics");
    let scrape = || async {
        let (status, text) = get(&url).await?;
        (status == 200).then(|| parse(&text))
    };
    wait_until(Duration::from_secs(30), "two successes and a dead letter counted", || async {
        scrape().await.is_some_and(|(s, _)| {
            sample(&s, "sluice_messages_total", &[("queue", "work"), ("outcome", "success")]) == Some(2.0)
                && sample(&s, "sluice_messages_total", &[("queue", "work"), ("outcome", "dead_lettered")]) == Some(1.0)
        })
    })
    .await;
    // A reload of the same files, for the reload counter.
    sluice.signal(libc::SIGHUP);
    wait_until(Duration::from_secs(30), "the reload counted", || async {
        scrape()
            .await
            .is_some_and(|(s, _)| sample(&s, "sluice_config_reloads_total", &[("result", "applied")]) == Some(1.0))
    })
    .await;
    // Polled every 5 s: the first poll may precede the consumer.
    wait_until(Duration::from_secs(30), "this runner's consumer counted", || async {
        scrape().await.is_some_and(|(s, _)| sample(&s, "sluice_queue_consumers", &[("queue", "work")]) == Some(1.0))
    })
    .await;
    let (scrape, types) = scrape().await.expect("metrics");
    for (metric, kind) in METRICS {
        let help = scrape.docs.get(metric).unwrap_or_else(|| panic!("no # HELP for {metric}: {:?}", scrape.docs));
        assert!(!help.trim().is_empty(), "empty # HELP for {metric}");
        let declared: Vec<SampleType> = types.iter().filter(|(m, _)| m == metric).map(|(_, t)| *t).collect();
        assert_eq!(declared, [kind], "# TYPE of {metric}");
    }
    assert_eq!(sample(&scrape, "sluice_retries_total", &[("queue", "work")]), Some(1.0));
}

#[test]
fn an_admin_address_that_cannot_be_bound_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let dir = pipeline("version: 1\nqueues:\n  work:\n    handler: {command: {program: /bin/true}}\n");
    let dedup = dir.path().join("state");
    let args = ["run", path(dir.path()), "--admin", &addr, "--dedup", path(&dedup), "--no-watch"];
    let finished = sluice_cli(&args, &[], Duration::from_secs(30));
    assert_eq!(finished.code, Some(1), "{finished:?}");
    let expected = format!("error: cannot listen on {addr} for the admin endpoint: ");
    assert!(finished.stderr.contains(&expected), "{expected} not in:\n{}", finished.stderr);
}

fn path(path: &std::path::Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// Issue 21: `run` takes its admin address from `$SLUICE_ADMIN` when `--admin` is not given,
/// as `pause` and `resume` do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_takes_the_admin_address_from_sluice_admin() {
    let dir = work_pipeline("    handler:\n      command: {program: /bin/true}\n");
    let admin = format!("127.0.0.1:{}", free_port());
    let state = dir.path().join("broker");
    let _sluice = Sluice::run_with_env(dir.path(), &state.display().to_string(), &[], &[("SLUICE_ADMIN", &admin)]);
    wait_until(Duration::from_secs(30), "the admin endpoint at $SLUICE_ADMIN", || async {
        matches!(get(&format!("http://{admin}/healthz")).await, Some((200, _)))
    })
    .await;
}
