//! The AWS emulators the SQS tests run against (issue 36): moto, the shared one at
//! [`sqs_endpoint`] (`.ci/run` starts it on 127.0.0.1:5000; `SLUICE_TEST_SQS_ENDPOINT` names
//! another), or an [`Emulator`] of a test's own, moto or LocalStack, killed when it drops.
//! Both take any credentials.

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

/// Where `.ci/run` installs LocalStack (`localstack-core`, in a Python 3.13 virtualenv) unless
/// `SLUICE_TEST_LOCALSTACK_PYTHON` names another interpreter that has it.
pub const LOCALSTACK_PYTHON: &str = "/opt/localstack-venv/bin/python";

/// An AWS emulator of one test's own on a free port, killed on drop: moto, or LocalStack (the
/// second oracle: its own SQS, whose FIFO message groups hold across concurrent receives).
pub struct Emulator {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    child: Child,
    /// Its output, quoted when it does not start.
    log: tempfile::NamedTempFile,
    /// LocalStack's files.
    _data: Option<tempfile::TempDir>,
}

impl Emulator {
    /// Starts `moto_server` and waits until it takes connections (it starts in about a second).
    pub fn moto() -> Emulator {
        let port = super::free_port();
        let mut command = Command::new("moto_server");
        command.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
        let how = "install it with `pip install 'moto[server]'`";
        Emulator::start(command, port, None, how, |_| true)
    }

    /// Starts LocalStack in host mode, SQS only, and waits until it says it is ready (about 2 s
    /// here; its first start after an install takes longer).
    pub fn localstack() -> Emulator {
        let port = super::free_port();
        let data = tempfile::tempdir().expect("LocalStack's directory");
        let python = std::env::var("SLUICE_TEST_LOCALSTACK_PYTHON").unwrap_or_else(|_| LOCALSTACK_PYTHON.into());
        let mut command = Command::new(python);
        command
            .args(["-m", "localstack.runtime.main"])
            .env("GATEWAY_LISTEN", format!("127.0.0.1:{port}"))
            .env("SERVICES", "sqs")
            .env("EAGER_SERVICE_LOADING", "1")
            .env("DNS_ADDRESS", "0")
            .env("SKIP_SSL_CERT_DOWNLOAD", "1")
            .env("DISABLE_EVENTS", "1")
            .env("FILESYSTEM_ROOT", data.path());
        let how = "install it as .ci/run does (localstack-core in a Python 3.13 virtualenv), or name its python in \
                   SLUICE_TEST_LOCALSTACK_PYTHON";
        Emulator::start(command, port, Some(data), how, |log| log.lines().any(|l| l.trim() == "Ready."))
    }

    /// Runs `command` and waits until it takes connections on `port` and `ready` says so of
    /// its output.
    fn start(
        mut command: Command,
        port: u16,
        data: Option<tempfile::TempDir>,
        how: &str,
        ready: impl Fn(&str) -> bool,
    ) -> Emulator {
        let log = tempfile::NamedTempFile::new().expect("a log file");
        let output = || Stdio::from(log.reopen().expect("the log file"));
        let child = command
            .stdin(Stdio::null())
            .stdout(output())
            .stderr(output())
            .spawn()
            .unwrap_or_else(|e| panic!("{:?} does not run ({e}): {how}", command.get_program()));
        let mut emulator = Emulator { endpoint: format!("http://127.0.0.1:{port}"), child, log, _data: data };
        let address = address(&emulator.endpoint);
        let start = Instant::now();
        loop {
            let output = std::fs::read_to_string(emulator.log.path()).unwrap_or_default();
            if TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_ok() && ready(&output) {
                return emulator;
            }
            let exited = emulator.child.try_wait().ok().flatten();
            if exited.is_some() || start.elapsed() > Duration::from_secs(60) {
                panic!("{:?} on port {port} did not start ({exited:?}; {how}): {output}", command.get_program());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
