//! `sluice demo-receiver` (hidden): the stand-in for the three services `pipelines/orders.yaml`
//! calls, which `scripts/demo` starts. It answers 200 to every request and prints what arrived.
//! A subcommand, not a cargo example, so the demo builds nothing beyond the release binary.

use axum::http::{HeaderMap, Method, Uri};

async fn answer(method: Method, uri: Uri, headers: HeaderMap, body: String) {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("-").to_string();
    println!(
        "receiver: {method} {uri} key={} attempt={} body={body}",
        crate::terminal::visible(&header("idempotency-key")),
        crate::terminal::visible(&header("x-sluice-attempt")),
        body = crate::terminal::visible(&body),
    );
}

/// Answers on `listen` until the process is stopped.
pub async fn receive(listen: &str) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    axum::serve(listener, axum::Router::new().fallback(answer)).await?;
    Ok(())
}
