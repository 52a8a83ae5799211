//! A stand-in for the three services of `pipelines/orders.yaml`: answers 200 to every request
//! on 127.0.0.1:8088 and prints what arrived. Run by `scripts/demo` as
//! `cargo run --example demo-receiver`.

use axum::http::{HeaderMap, Method, Uri};

async fn answer(method: Method, uri: Uri, headers: HeaderMap, body: String) {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("-").to_string();
    println!(
        "receiver: {method} {uri} key={} attempt={} body={body}",
        header("idempotency-key"),
        header("x-sluice-attempt")
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:8088").await?;
    axum::serve(listener, axum::Router::new().fallback(answer)).await
}
