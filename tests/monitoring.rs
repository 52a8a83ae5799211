//! `examples/monitoring/` (issue 11): the Prometheus alert rules pass `promtool check rules`,
//! their unit tests (`alerts.test.yaml`: every alert fires on a crafted series and stays silent
//! on a healthy one) pass `promtool test rules`, the Grafana dashboard's queries parse, and
//! every `sluice_*` metric the rules and the dashboard query is one sluice emits, so renaming a
//! metric breaks this test instead of a dashboard.
//!
//! promtool comes with Debian's `prometheus` package; without it these tests fail (never skip).

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value as Json;
use serde_yaml::Value as Yaml;

const DIR: &str = "examples/monitoring";

/// Counters and gauges sluice exposes on `/metrics` (DESIGN.md, "Metrics").
/// `sluice_queue_consumers` is the consumers attached to a queue, read from the broker.
const SCALARS: &[&str] = &[
    "sluice_messages_total",
    "sluice_consumer_lag_seconds",
    "sluice_queue_depth",
    "sluice_dlq_depth",
    "sluice_in_flight",
    "sluice_keys_blocked",
    "sluice_retries_total",
    "sluice_config_reloads_total",
    "sluice_queue_consumers",
    "sluice_circuit_state",
    "sluice_concurrency_limit",
    "sluice_paused",
    "sluice_broker_connected",
    "sluice_redis_empty_restarts_total",
];

/// Histograms: queried only through their `_bucket`, `_count` and `_sum` series.
const HISTOGRAMS: &[&str] = &["sluice_handler_duration_seconds"];
const HISTOGRAM_SUFFIXES: &[&str] = &["_bucket", "_count", "_sum"];

fn path(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(DIR).join(file)
}

fn promtool(args: &[&str]) -> Output {
    match Command::new("promtool").args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "promtool is not installed; it comes with Debian's prometheus package: `apt-get install prometheus` \
             (.ci/run installs it)"
        ),
        Err(e) => panic!("running promtool: {e}"),
    }
}

fn assert_success(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn yaml(file: &str) -> Yaml {
    let text = fs::read_to_string(path(file)).unwrap_or_else(|e| panic!("reading {file}: {e}"));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("parsing {file}: {e}"))
}

fn dashboard() -> Json {
    let file = "grafana-dashboard.json";
    let text = fs::read_to_string(path(file)).unwrap_or_else(|e| panic!("reading {file}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {file}: {e}"))
}

/// The alerting and recording rules of a rule file.
fn rules(file: &Yaml) -> Vec<&Yaml> {
    let groups = file["groups"].as_sequence().expect("groups");
    groups.iter().flat_map(|g| g["rules"].as_sequence().expect("rules")).collect()
}

fn alert_names() -> BTreeSet<String> {
    rules(&yaml("alerts.yaml")).iter().filter_map(|r| r["alert"].as_str().map(String::from)).collect()
}

/// Every alert expression, labelled with its alert.
fn alert_exprs() -> Vec<(String, String)> {
    rules(&yaml("alerts.yaml"))
        .iter()
        .map(|r| {
            let name = r["alert"].as_str().or(r["record"].as_str()).expect("alert or record").to_string();
            (format!("alert {name}"), r["expr"].as_str().expect("expr").to_string())
        })
        .collect()
}

/// Every PromQL query of the dashboard: panel targets and the variables' queries.
fn dashboard_exprs() -> Vec<(String, String)> {
    fn walk(at: &str, v: &Json, out: &mut Vec<(String, String)>) {
        match v {
            Json::Object(map) => {
                let at = map.get("title").and_then(Json::as_str).map_or(at.to_string(), |t| format!("panel {t:?}"));
                for (key, v) in map {
                    match (key.as_str(), v) {
                        ("expr" | "definition" | "query", Json::String(s)) => out.push((at.clone(), s.clone())),
                        _ => walk(&at, v, out),
                    }
                }
            }
            Json::Array(items) => items.iter().for_each(|v| walk(at, v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk("dashboard", &dashboard(), &mut out);
    // The datasource variable's query is a plugin id, not PromQL.
    out.retain(|(_, e)| e != "prometheus");
    out
}

/// The `sluice_[a-z_]+` names in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("sluice_") {
        let inside_identifier =
            rest[..at].chars().next_back().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
        let len = rest[at..].find(|c: char| !(c.is_ascii_lowercase() || c == '_')).unwrap_or(rest.len() - at);
        if !inside_identifier {
            names.push(rest[at..at + len].to_string());
        }
        rest = &rest[at + len..];
    }
    names
}

fn is_known(name: &str) -> bool {
    SCALARS.contains(&name)
        || HISTOGRAMS.iter().any(|h| HISTOGRAM_SUFFIXES.iter().any(|s| name.strip_prefix(h) == Some(s)))
}

#[test]
fn alert_rules_pass_promtool_check() {
    let rules = path("alerts.yaml");
    let out = promtool(&["check", "rules", rules.to_str().expect("utf-8 path")]);
    assert_success("promtool check rules examples/monitoring/alerts.yaml", &out);
}

#[test]
fn every_alert_fires_on_a_crafted_series_and_not_on_a_healthy_one() {
    let tests = path("alerts.test.yaml");
    let out = promtool(&["test", "rules", tests.to_str().expect("utf-8 path")]);
    assert_success("promtool test rules examples/monitoring/alerts.test.yaml", &out);

    // Each alert has a test where it fires and one where it must stay silent (pending, or only
    // healthy series): a new alert without a test fails here.
    let (mut fires, mut silent) = (BTreeSet::new(), BTreeSet::new());
    for test in yaml("alerts.test.yaml")["tests"].as_sequence().expect("tests") {
        for case in test["alert_rule_test"].as_sequence().into_iter().flatten() {
            let name = case["alertname"].as_str().expect("alertname").to_string();
            let expected = case["exp_alerts"].as_sequence().map_or(0, Vec::len);
            if expected == 0 {
                silent.insert(name)
            } else {
                fires.insert(name)
            };
        }
    }
    let alerts = alert_names();
    assert!(alerts.len() >= 5, "expected the five alerts of issue 11 at least, got {alerts:?}");
    for alert in &alerts {
        assert!(fires.contains(alert), "alerts.test.yaml never expects {alert} to fire");
        assert!(silent.contains(alert), "alerts.test.yaml never expects {alert} to stay silent");
    }
}

#[test]
fn the_dashboard_queries_are_valid_promql() {
    // promtool has no query linter, so the dashboard's queries become recording rules, with
    // Grafana's variables replaced by what Grafana would send.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in dashboard_exprs().iter().enumerate() {
        let expr = expr.replace("$__rate_interval", "1m").replace("$__range", "1h").replace("$queue", ".*");
        let promql = if expr.starts_with("label_values(") { "vector(0)".to_string() } else { expr };
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(&promql).unwrap()
        ));
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("dashboard-queries.yaml");
    fs::write(&file, &rules).expect("write rules");
    let out = promtool(&["check", "rules", file.to_str().expect("utf-8 path")]);
    assert_success(&format!("promtool check rules on the dashboard's queries:\n{rules}"), &out);
}

#[test]
fn the_dashboard_has_the_queue_variable_and_a_panel_per_metric() {
    let dashboard = dashboard();
    let variables = dashboard["templating"]["list"].as_array().expect("templating.list");
    let queue = variables.iter().find(|v| v["name"] == "queue").expect("a `queue` variable");
    assert_eq!(queue["query"]["query"], "label_values(sluice_messages_total, queue)");

    let exprs = dashboard_exprs();
    let used: BTreeSet<String> = exprs.iter().flat_map(|(_, e)| metric_names(e)).collect();
    for metric in SCALARS {
        assert!(used.contains(*metric), "no dashboard panel queries {metric}");
    }
    for histogram in HISTOGRAMS {
        let bucket = format!("{histogram}_bucket");
        assert!(used.contains(&bucket), "no dashboard panel queries {bucket}");
        let quantiles: BTreeSet<&str> = exprs
            .iter()
            .filter(|(_, e)| e.contains(&bucket))
            .filter_map(|(_, e)| e.strip_prefix("histogram_quantile(")?.split(',').next())
            .collect();
        assert_eq!(quantiles, BTreeSet::from(["0.5", "0.95", "0.99"]), "{histogram}'s quantiles");
    }
}

#[test]
fn the_rules_and_the_dashboard_query_only_metrics_sluice_emits() {
    let mut unknown = Vec::new();
    for (at, expr) in alert_exprs().into_iter().chain(dashboard_exprs()) {
        for name in metric_names(&expr) {
            if !is_known(&name) {
                unknown.push(format!("{at}: {name}"));
            }
        }
    }
    // The unit tests' input series too, so that they test the names the rules use.
    for test in yaml("alerts.test.yaml")["tests"].as_sequence().expect("tests") {
        for series in test["input_series"].as_sequence().expect("input_series") {
            let series = series["series"].as_str().expect("series");
            unknown.extend(
                metric_names(series).into_iter().filter(|n| !is_known(n)).map(|n| format!("alerts.test.yaml: {n}")),
            );
        }
    }
    assert!(
        unknown.is_empty(),
        "unknown sluice metrics (known: {SCALARS:?} and {HISTOGRAMS:?}):\n{}",
        unknown.join("\n")
    );
}

#[test]
fn every_metric_registered_in_src_is_in_the_known_list() {
    // A metric renamed or added in src must be added here, which then checks the examples.
    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).expect("read src") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    rust_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut files);
    let mut registered = BTreeSet::new();
    for file in files {
        let text = fs::read_to_string(&file).expect("read source");
        for mac in ["counter!(", "gauge!(", "histogram!("] {
            for (at, _) in text.match_indices(mac) {
                let args = text[at + mac.len()..].trim_start();
                if let Some(name) = args.strip_prefix('"').and_then(|a| a.split('"').next()) {
                    registered.insert((name.to_string(), file.display().to_string()));
                }
            }
        }
    }
    assert!(registered.iter().any(|(n, _)| n == "sluice_messages_total"), "found no metrics in src: {registered:?}");
    let known: Vec<&str> = SCALARS.iter().chain(HISTOGRAMS).copied().collect();
    let unknown: Vec<_> = registered.iter().filter(|(n, _)| !known.contains(&n.as_str())).collect();
    assert!(unknown.is_empty(), "metrics registered in src but not listed in tests/monitoring.rs: {unknown:?}");
}

#[test]
fn metric_names_are_found_in_expressions() {
    assert_eq!(
        metric_names(
            r#"sum(rate(sluice_a_total{x="sluice_not"}[5m])) / rate(my_sluice_b[5m]) + sluice_handler_duration_seconds_bucket"#
        ),
        ["sluice_a_total", "sluice_not", "sluice_handler_duration_seconds_bucket"]
    );
    assert!(is_known("sluice_handler_duration_seconds_bucket"));
    assert!(!is_known("sluice_handler_duration_seconds"), "a classic histogram has no bare series");
    assert!(!is_known("sluice_message_total"));
}
