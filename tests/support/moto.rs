//! moto, the AWS emulator the SQS tests run against (issue 36): the shared one at
//! [`sqs_endpoint`] (`.ci/run` starts it on 127.0.0.1:5000; `SLUICE_TEST_SQS_ENDPOINT` names
//! another), or a [`Moto`] of a test's own, killed when it drops. moto takes any credentials.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The keys moto takes (any), as environment variables: what the tests' `sluice` processes
/// get, and what [`credentials`] gives a session of the test's own.
pub const CREDENTIALS: [(&str, &str); 2] =
    [("AWS_ACCESS_KEY_ID", "AKIDSLUICETEST"), ("AWS_SECRET_ACCESS_KEY", "not-a-secret")];

/// [`CREDENTIALS`] as the environment an `Aws` client or SQS session reads.
pub fn credentials() -> sluice::broker::sqs::aws::Env {
    std::sync::Arc::new(|name: &str| CREDENTIALS.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string()))
}

/// Where the shared emulator answers unless `SLUICE_TEST_SQS_ENDPOINT` says otherwise.
pub const DEFAULT_SQS_ENDPOINT: &str = "http://127.0.0.1:5000";

/// How to start the shared emulator, for failures.
const HOW: &str = "start moto with `moto_server -H 127.0.0.1 -p 5000 &` (`pip install 'moto[server]'`; .ci/run \
                   does both), or name a running one in SLUICE_TEST_SQS_ENDPOINT";

/// The shared emulator's endpoint: `SLUICE_TEST_SQS_ENDPOINT`, else [`DEFAULT_SQS_ENDPOINT`].
pub fn sqs_endpoint() -> String {
    std::env::var("SLUICE_TEST_SQS_ENDPOINT").unwrap_or_else(|_| DEFAULT_SQS_ENDPOINT.to_string())
}

/// The shared emulator's endpoint; fails (never skips) when nothing answers there, saying how
/// to start it.
pub fn require_sqs() -> String {
    let endpoint = sqs_endpoint();
    let address = address(&endpoint);
    if TcpStream::connect_timeout(&address, Duration::from_secs(2)).is_err() {
        panic!("no SQS emulator answers at {endpoint}: {HOW}.");
    }
    endpoint
}

/// The socket address of `endpoint` (`http://host:port`).
fn address(endpoint: &str) -> SocketAddr {
    let url = reqwest::Url::parse(endpoint).unwrap_or_else(|e| panic!("SQS endpoint {endpoint:?} is no URL: {e}"));
    let host = url.host_str().unwrap_or_else(|| panic!("SQS endpoint {endpoint:?} has no host"));
    let port = url.port_or_known_default().unwrap_or(80);
    (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut addresses| addresses.next())
        .unwrap_or_else(|| panic!("SQS endpoint {endpoint:?}: {host} has no address"))
}

/// A moto server of one test's own on a free port, killed on drop.
pub struct Moto {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    child: Child,
    /// Its output, quoted when it does not start.
    log: tempfile::NamedTempFile,
}

impl Moto {
    /// Starts `moto_server` and waits until it takes connections (it starts in about a second).
    pub fn start() -> Moto {
        let port = super::free_port();
        let log = tempfile::NamedTempFile::new().expect("a log file");
        let output = || Stdio::from(log.reopen().expect("the log file"));
        let child = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(output())
            .stderr(output())
            .spawn()
            .unwrap_or_else(|e| panic!("moto_server does not run ({e}): install it with `pip install 'moto[server]'`"));
        let mut moto = Moto { endpoint: format!("http://127.0.0.1:{port}"), child, log };
        let address = address(&moto.endpoint);
        let start = Instant::now();
        while TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_err() {
            let exited = moto.child.try_wait().ok().flatten();
            if exited.is_some() || start.elapsed() > Duration::from_secs(30) {
                let log = std::fs::read_to_string(moto.log.path()).unwrap_or_default();
                panic!("moto_server on port {port} did not start ({exited:?}): {log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        moto
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
