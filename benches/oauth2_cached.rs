//! What OAuth2 adds to a webhook call once its token is cached (issue 24): the cache lookup
//! alone, and whole calls with and without a token against a local keep-alive receiver,
//! interleaved so that drift hits both alike. A timing loop, not a test: nothing is asserted.
//!
//! ```text
//! cargo bench --bench oauth2_cached            # release build; prints one line per figure
//! ```
//!
//! Run bare (as `cargo test --all-targets` does) it only says so and exits 0.

use std::time::{Duration, Instant};

use sluice::handler::Observed;
use sluice::handler::auth::{OAuth2, SecretSource};
use sluice::handler::rules::Rules;
use sluice::handler::webhook::{self, Request};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;

const LOOKUPS: u32 = 1_000_000;
const CALLS: u32 = 20_000;
const ROUNDS: u32 = 5;

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("oauth2_cached: run with `cargo bench --bench oauth2_cached`");
        return;
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(bench());
}

async fn bench() {
    let receiver = serve(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
    let token = serve(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 75\r\n\r\n\
          {\"access_token\":\"a-token-of-forty-bytes-as-many-are\",\"token_type\":\"Bearer\"}",
    )
    .await;
    let secret = std::env::temp_dir().join(format!("sluice-bench-secret-{}", std::process::id()));
    std::fs::write(&secret, "s3cret\n").expect("write secret");
    let oauth2 = OAuth2::new(
        format!("{token}/token").parse().expect("url"),
        "bench".into(),
        SecretSource::File(secret.clone()),
        Vec::new(),
        None,
    );
    let client = webhook::client().expect("client");
    oauth2.bearer(&client).await.expect("a token");

    let started = Instant::now();
    for _ in 0..LOOKUPS {
        std::hint::black_box(oauth2.bearer(&client).await.expect("cached"));
    }
    println!("cached token lookup: {:.0} ns", per(started.elapsed(), LOOKUPS));

    let request = Request {
        method: reqwest::Method::POST,
        url: format!("{receiver}/hook").parse().expect("url"),
        headers: vec![("idempotency-key".into(), "k".into()), ("x-sluice-attempt".into(), "1".into())],
        body: bytes::Bytes::from_static(b"{\"id\":\"1\",\"type\":\"t\",\"payload\":{}}"),
    };
    let (rules, timeout) = (Rules::default(), Duration::from_secs(5));
    let (mut plain, mut authorized) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let started = Instant::now();
        for _ in 0..CALLS {
            webhook::call(&client, request.clone(), timeout, &rules, &mut Observed::default()).await.expect("200");
        }
        plain.push(per(started.elapsed(), CALLS));
        let started = Instant::now();
        for _ in 0..CALLS {
            webhook::call_authorized(&client, request.clone(), &oauth2, timeout, &rules, &mut Observed::default())
                .await
                .expect("200");
        }
        authorized.push(per(started.elapsed(), CALLS));
    }
    let (plain, authorized) = (median(plain), median(authorized));
    println!(
        "call without auth: {plain:.1} µs; with a cached OAuth2 token: {authorized:.1} µs (+{:.1} µs, median of {ROUNDS} rounds of {CALLS})",
        authorized - plain
    );
    let _ = std::fs::remove_file(secret);
}

/// Nanoseconds (lookups) or microseconds (calls) per operation.
fn per(elapsed: Duration, n: u32) -> f64 {
    if n == LOOKUPS { elapsed.as_nanos() as f64 / f64::from(n) } else { elapsed.as_micros() as f64 / f64::from(n) }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A keep-alive HTTP/1.1 server answering `answer` to every request; its base URL.
async fn serve(answer: &'static [u8]) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 8192];
                loop {
                    // One whole request (head and its content-length body), then the answer.
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4) else {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    if buf.len() < end + length {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    }
                    buf.drain(..end + length);
                    if stream.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    url
}
