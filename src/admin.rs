//! The admin HTTP endpoint: `/metrics` (Prometheus text format), `/healthz` (the process is
//! alive), `/readyz` (connected to the broker and consuming).
//!
//! It only reports; metrics are recorded where the events happen (`runtime::events`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

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

/// Installs the global Prometheus recorder.
pub fn install_recorder() -> Result<PrometheusHandle, String> {
    let buckets = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];
    PrometheusBuilder::new()
        .set_buckets_for_metric(metrics_exporter_prometheus::Matcher::Suffix("duration_seconds".into()), &buckets)
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| e.to_string())
}

/// Serves the admin endpoints on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: PrometheusHandle,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
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
        );
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "admin endpoint listening (/metrics, /healthz, /readyz)");
    }
    axum::serve(listener, app).with_graceful_shutdown(async move { shutdown.cancelled().await }).await
}
