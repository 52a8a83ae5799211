//! The HTTP server both consumers call: a minimal HTTP/1.1 keep-alive server that answers at
//! once and counts what arrives, so the figure is measured where the work lands.
//!
//! It understands just what reqwest sends (a head, then a `content-length` body); it is a
//! measuring device, not a web server.

use std::collections::HashSet;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
const UNAVAILABLE: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n";

/// How the sink answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `200` to everything.
    Ok,
    /// `503` to the first request of each `Idempotency-Key`, `200` to the next.
    FailOnce,
}

#[derive(Debug, Default, Clone)]
struct Stats {
    requests: u64,
    successes: u64,
    first: Option<Instant>,
    last_success: Option<Instant>,
}

struct Shared {
    mode: Mutex<Mode>,
    stats: Mutex<Stats>,
    failed_once: Mutex<HashSet<Vec<u8>>>,
}

/// What the sink saw since the last reset.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    pub requests: u64,
    pub successes: u64,
    /// From the first request's arrival to the last `200`.
    pub span: Option<Duration>,
}

/// A running sink; clones share it.
#[derive(Clone)]
pub struct Sink {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Sink {
    /// Listens on a free loopback port and serves from the current tokio runtime.
    pub async fn start() -> io::Result<Sink> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            mode: Mutex::new(Mode::Ok),
            stats: Mutex::new(Stats::default()),
            failed_once: Mutex::new(HashSet::new()),
        });
        let serving = shared.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, serving.clone()));
            }
        });
        Ok(Sink { addr, shared })
    }

    /// Forgets everything seen and answers in `mode` from now on.
    pub fn reset(&self, mode: Mode) {
        *self.shared.mode.lock().expect("sink lock") = mode;
        *self.shared.stats.lock().expect("sink lock") = Stats::default();
        self.shared.failed_once.lock().expect("sink lock").clear();
    }

    pub fn snapshot(&self) -> Snapshot {
        let s = self.shared.stats.lock().expect("sink lock").clone();
        let span = s.first.zip(s.last_success).map(|(first, last)| last - first);
        Snapshot { requests: s.requests, successes: s.successes, span }
    }
}

impl Shared {
    /// Counts one request and picks its answer.
    fn answer(&self, head: &[u8]) -> &'static [u8] {
        let now = Instant::now();
        let fail = *self.mode.lock().expect("sink lock") == Mode::FailOnce
            && header(head, b"idempotency-key")
                .is_some_and(|key| self.failed_once.lock().expect("sink lock").insert(key.to_vec()));
        let mut stats = self.stats.lock().expect("sink lock");
        stats.requests += 1;
        stats.first.get_or_insert(now);
        if fail {
            return UNAVAILABLE;
        }
        stats.successes += 1;
        stats.last_success = Some(now);
        OK
    }
}

async fn serve(mut stream: TcpStream, shared: Arc<Shared>) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut buf = Vec::with_capacity(16 * 1024);
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let length = header(&buf[..head_end], b"content-length")
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let answer = shared.answer(&buf[..head_end]);
        buf.drain(..head_end + length);
        stream.write_all(answer).await?;
    }
}

/// The value of header `name` (lower case) in a request head.
fn header<'a>(head: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    head.split(|&b| b == b'\n').find_map(|line| {
        let colon = line.iter().position(|&b| b == b':')?;
        let (key, value) = line.split_at(colon);
        key.eq_ignore_ascii_case(name).then(|| value[1..].trim_ascii())
    })
}
