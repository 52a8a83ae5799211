//! The admin HTTP endpoint: `/metrics` (Prometheus text format), `/healthz` (the process is
//! alive), `/readyz` (connected to the broker and consuming), and `POST /queues/{name}/pause`
//! and `/resume` (what `sluice pause|resume` call).
//!
//! It only reports and describes the metrics (their `# HELP` lines); they are recorded where
//! the events happen (`runtime::events`, `reload::loader`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::{get, post};
use metrics::{describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

use crate::runtime::gate::Pauses;

/// Whether the runner is connected and consuming; set by the runtime, read by `/readyz`.
#[derive(Debug, Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }

    pub fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Installs the global Prometheus recorder and describes every metric sluice records (the
/// `# HELP` lines).
pub fn install_recorder() -> Result<PrometheusHandle, String> {
    let buckets = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(metrics_exporter_prometheus::Matcher::Suffix("duration_seconds".into()), &buckets)
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())?;
    describe_metrics();
    Ok(handle)
}

/// One line of help per metric, in one place; the metrics themselves are recorded where their
/// events happen.
fn describe_metrics() {
    describe_counter!(
        "sluice_messages_total",
        "Messages settled, by queue and outcome (success, retry, dead_lettered, duplicate)."
    );
    describe_histogram!("sluice_handler_duration_seconds", "How long handler calls took, by queue.");
    describe_gauge!(
        "sluice_consumer_lag_seconds",
        "Now minus the timestamp of the newest message delivered, by queue."
    );
    describe_gauge!("sluice_queue_depth", "Messages ready in the queue, as last polled.");
    describe_gauge!("sluice_dlq_depth", "Messages in the queue's dead-letter queue, as last polled.");
    describe_gauge!("sluice_queue_consumers", "Consumers attached to the queue (every runner's), as last polled.");
    describe_gauge!("sluice_in_flight", "Deliveries being handled, by queue.");
    describe_counter!("sluice_retries_total", "Retry copies scheduled, by queue.");
    describe_counter!("sluice_config_reloads_total", "Reloads of the pipeline files, by result (applied, rejected).");
    describe_gauge!("sluice_circuit_state", "The queue's circuit breaker: 0 closed, 1 half-open, 2 open.");
    describe_gauge!(
        "sluice_concurrency_limit",
        "How many handlers of the queue may run at once (adaptive: the current limit)."
    );
    describe_gauge!("sluice_paused", "1 while the queue is paused by hand (sluice pause), else 0.");
}

/// Pauses or resumes a queue: 200 with what happened, 404 for a queue not running here.
fn set_paused(pauses: &Pauses, queue: &str, paused: bool) -> (StatusCode, String) {
    let verb = if paused { "paused" } else { "resumed" };
    match pauses.set(queue, paused) {
        Ok(true) => (StatusCode::OK, format!("{verb} \"{queue}\"\n")),
        Ok(false) => (StatusCode::OK, format!("\"{queue}\" was already {verb}\n")),
        Err(e) => (StatusCode::NOT_FOUND, format!("{e}\n")),
    }
}

/// Serves the admin endpoints on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: PrometheusHandle,
    readiness: Readiness,
    pauses: Pauses,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let resumes = pauses.clone();
    let app = Router::new()
        .route("/metrics", get(move || std::future::ready(metrics.render())))
        .route("/healthz", get(|| std::future::ready("ok\n")))
        .route(
            "/readyz",
            get(move || {
                let ready = readiness.get();
                std::future::ready(if ready {
                    (StatusCode::OK, "ready\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not connected to the broker\n")
                })
            }),
        )
        .route(
            "/queues/{name}/pause",
            post(move |Path(name): Path<String>| std::future::ready(set_paused(&pauses, &name, true))),
        )
        .route(
            "/queues/{name}/resume",
            post(move |Path(name): Path<String>| std::future::ready(set_paused(&resumes, &name, false))),
        );
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "admin endpoint listening (/metrics, /healthz, /readyz, /queues/NAME/pause|resume)");
    }
    axum::serve(listener, app).with_graceful_shutdown(async move { shutdown.cancelled().await }).await
}
