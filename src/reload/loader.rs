//! The one place a running `sluice run` loads, validates and hands over a new config: on each
//! reload request (a file change or SIGHUP) the pipeline files are loaded as `validate` loads
//! them; an invalid edit is logged with the same file:line:column diagnostics and counted as
//! rejected, and the running config stays; a valid one goes to the runtime, which applies it
//! (or, if the broker refuses its declarations, keeps the old one) and says what changed.
//!
//! Loading is CPU work on files, done on a blocking thread: the runtime's threads go on
//! serving the running queues meanwhile (with one thread, the default, a load on it would
//! stop every queue until it ends). A load that takes over a second says how far it has got,
//! every second.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use metrics::counter;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::{Reloads, Trigger};
use crate::broker::Capabilities;
use crate::config::{self, Config, Diagnostic, Progress, Severity};
use crate::runtime::Reload;

/// The config running and how the last reload went, for the console.
#[derive(Debug, Clone)]
pub struct Current(Arc<Mutex<Running>>);

/// What [`Current`] holds.
#[derive(Debug, Clone)]
pub struct Running {
    pub config: Arc<Config>,
    /// None until a reload was asked for.
    pub last_reload: Option<LastReload>,
}

/// How the last reload went.
#[derive(Debug, Clone, Serialize)]
pub struct LastReload {
    /// When it ended, in milliseconds since the epoch.
    pub at_ms: u64,
    /// `applied` or `rejected`.
    pub result: &'static str,
    /// Why it was rejected: the files' diagnostics (file:line:column), errors only.
    pub diagnostics: Vec<Diagnostic>,
    /// Why it was rejected, when no file position says it (a secret unset, the broker's refusal).
    pub errors: Vec<String>,
}

impl Current {
    pub fn new(config: Arc<Config>) -> Current {
        Current(Arc::new(Mutex::new(Running { config, last_reload: None })))
    }

    fn lock(&self) -> MutexGuard<'_, Running> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A copy of what runs now.
    pub fn get(&self) -> Running {
        self.lock().clone()
    }

    fn reloaded(&self, config: Option<Arc<Config>>, diagnostics: Vec<Diagnostic>, errors: Vec<String>) {
        let at_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let mut running = self.lock();
        let result = if config.is_some() { "applied" } else { "rejected" };
        if let Some(config) = config {
            running.config = config;
        }
        running.last_reload = Some(LastReload { at_ms, result, diagnostics, errors });
    }
}

/// Serves reload requests until `shutdown` or until the runtime is gone; `current` follows.
pub async fn serve(
    paths: Vec<PathBuf>,
    capabilities: Capabilities,
    requests: Reloads,
    runtime: mpsc::UnboundedSender<Reload>,
    current: Current,
    shutdown: CancellationToken,
) {
    let load: Load = Arc::new(move |paths: &[PathBuf], progress: &Progress| load(paths, progress, &capabilities));
    serve_with(paths, requests, runtime, current, shutdown, load).await;
}

/// How a reload loads the files: [`load`] (a test's holds the load, to see what the runtime
/// does meanwhile).
type Load = Arc<dyn Fn(&[PathBuf], &Progress) -> Result<Config, Rejected> + Send + Sync>;

/// Why a load was rejected: the files' errors, and the errors without a file position.
type Rejected = (Vec<Diagnostic>, Vec<String>);

/// How often a long load says how far it has got; the first time once it has taken this long.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// [`serve`], loading with `load`.
async fn serve_with(
    paths: Vec<PathBuf>,
    mut requests: Reloads,
    runtime: mpsc::UnboundedSender<Reload>,
    current: Current,
    shutdown: CancellationToken,
    load: Load,
) {
    loop {
        let trigger = tokio::select! {
            _ = shutdown.cancelled() => return,
            t = requests.next() => match t {
                Some(t) => t,
                None => return,
            },
        };
        match &trigger {
            Trigger::Signal => info!("SIGHUP: reloading the pipeline files"),
            Trigger::Files(files) => {
                info!(changed = %listed(files.iter().map(|f| f.display())), "pipeline files changed; reloading");
            }
        }
        let config = match load_aside(&paths, &load).await {
            Ok(config) => config,
            Err((diagnostics, errors)) => {
                rejected();
                current.reloaded(None, diagnostics, errors);
                continue;
            }
        };
        let config = Arc::new(config);
        let (applied, outcome) = oneshot::channel();
        if runtime.send(Reload { config: config.clone(), applied }).is_err() {
            return;
        }
        match outcome.await {
            Ok(Ok(diff)) => {
                counter!("sluice_config_reloads_total", "result" => "applied").increment(1);
                info!(
                    added = %listed(&diff.added),
                    changed = %listed(&diff.changed),
                    removed = %listed(&diff.removed),
                    "reload applied"
                );
                for name in &diff.removed {
                    let from = diff
                        .unbound
                        .iter()
                        .filter(|b| b.queue == *name)
                        .map(|b| format!("{} (routing key {:?})", b.exchange, b.routing_key));
                    warn!(queue = %name, unbound_from = %listed(from), "queue removed from the pipeline files: no longer consumed and unbound from its exchanges; the queue and its messages stay on the broker");
                }
                for b in diff.unbound.iter().filter(|b| !diff.removed.contains(&b.queue)) {
                    info!(queue = %b.queue, exchange = %b.exchange, routing_key = ?b.routing_key, "binding removed from the pipeline files: unbound");
                }
                requests.set_paths(watched(&paths, &config));
                current.reloaded(Some(config), Vec::new(), Vec::new());
            }
            Ok(Err(e)) => {
                error!(error = %e, "reload rejected by the broker; the running config stays");
                rejected();
                current.reloaded(None, Vec::new(), vec![e.to_string()]);
            }
            Err(_) => return,
        }
    }
}

/// Names for a log line, comma-separated: the first [`LISTED`], then how many more, so that a
/// reload of thousands of files or queues stays one short line.
fn listed<T: std::fmt::Display>(names: impl IntoIterator<Item = T>) -> String {
    let mut names = names.into_iter();
    let mut line = names.by_ref().take(LISTED).map(|n| n.to_string()).collect::<Vec<_>>().join(", ");
    let more = names.count();
    if more > 0 {
        line.push_str(&format!(" and {more} more"));
    }
    line
}

/// How many names a log line lists.
const LISTED: usize = 10;

fn rejected() {
    counter!("sluice_config_reloads_total", "result" => "rejected").increment(1);
}

/// Runs `load` on a blocking thread, off the runtime's, and waits for it; says every second
/// how far it has got once it has taken a second, and how long it took in the end.
async fn load_aside(paths: &[PathBuf], load: &Load) -> Result<Config, Rejected> {
    let progress = Arc::new(Progress::default());
    let started = Instant::now();
    let mut loading = tokio::task::spawn_blocking({
        let (paths, progress, load) = (paths.to_vec(), progress.clone(), load.clone());
        move || load(&paths, &progress)
    });
    let mut every = tokio::time::interval_at((started + PROGRESS_EVERY).into(), PROGRESS_EVERY);
    let loaded = loop {
        tokio::select! {
            loaded = &mut loading => break loaded,
            _ = every.tick() => {
                let elapsed = format!("{}s", started.elapsed().as_secs());
                info!(%elapsed, %progress, "still loading the pipeline files; the running queues go on meanwhile");
            }
        }
    };
    let took = started.elapsed();
    if took >= PROGRESS_EVERY {
        info!(took = %format!("{:.1}s", took.as_secs_f64()), "pipeline files loaded");
    }
    loaded.unwrap_or_else(|e| {
        // A panic in loading is a bug; the running config stays, as for an invalid edit.
        error!(error = %e, "loading the pipeline files failed; the running config stays");
        Err((Vec::new(), vec![format!("loading the pipeline files failed: {e}")]))
    })
}

/// Loads the files, refusing what the broker cannot honour; on errors logs each diagnostic as
/// `validate` prints it and returns them (and the errors without a file position).
fn load(paths: &[PathBuf], progress: &Progress, capabilities: &Capabilities) -> Result<Config, Rejected> {
    let mut validation = config::load_counting(paths, progress);
    validation.check_capabilities(capabilities);
    let errors: Vec<Diagnostic> =
        validation.diagnostics.into_iter().filter(|d| d.severity == Severity::Error).collect();
    for d in &errors {
        error!("{}", d.headline());
    }
    let Some(mut config) = validation.config else {
        error!("invalid pipeline files; the running config stays");
        return Err((errors, Vec::new()));
    };
    if let Err(unprepared) = config.prepare_run() {
        let unprepared: Vec<String> = unprepared.iter().map(ToString::to_string).collect();
        for e in &unprepared {
            error!("{e}");
        }
        error!("the running config stays");
        return Err((errors, unprepared));
    }
    Ok(config)
}

/// What to watch for a config: the pipeline paths, and the files its queues read (payload
/// schemas, command programs given as paths, signing secrets files, webhooks' `tls:` files: a
/// renewed certificate reloads).
pub fn watched(paths: &[PathBuf], config: &Config) -> Vec<PathBuf> {
    let mut watched = paths.to_vec();
    for q in config.queues.values() {
        watched.extend(q.payload_schema.as_ref().map(|s| s.path.clone()));
        match &q.handler {
            config::Handler::Command(c) if c.program.components().count() > 1 => watched.push(c.program.clone()),
            config::Handler::Webhook(w) => {
                watched.extend(w.signing.as_ref().and_then(|s| s.secret_file.clone()));
            }
            config::Handler::Command(_) => {}
        }
        if let config::Handler::Webhook(config::Webhook { tls: Some(tls), .. }) = &q.handler {
            watched.extend(tls.files().map(|(_, path)| path.clone()));
        }
    }
    watched.sort();
    watched.dedup();
    watched
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::capabilities::RABBITMQ;

    /// Issue 24: a webhook's `tls:` files are watched, and a certificate renewed in place
    /// makes its queue changed, so the reload restarts it with a client that reads it again;
    /// the same files leave it running.
    #[test]
    fn renewed_tls_files_are_watched_and_restart_their_queue() {
        let dir = tempfile::tempdir().expect("tempdir");
        let certs = std::path::Path::new("tests/fixtures/valid/billing/certs");
        for file in ["ca.pem", "client.pem", "client.key"] {
            std::fs::copy(certs.join(file), dir.path().join(file)).expect("copy");
        }
        let yaml = "version: 1\nqueues:\n  work:\n    handler:\n      webhook:\n        url: https://h.example/x\n        \
                    tls: {client_cert_file: client.pem, client_key_file: client.key, ca_file: ca.pem}\n  \
                    other:\n    handler: {webhook: {url: https://h.example/y}}\n";
        std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
        let paths = [dir.path().to_path_buf()];
        let first = load(&paths, &Progress::default(), &RABBITMQ).expect("valid");
        let watched = watched(&paths, &first);
        for file in ["ca.pem", "client.pem", "client.key"] {
            assert!(watched.contains(&dir.path().join(file)), "{file}: {watched:?}");
        }
        let same = load(&paths, &Progress::default(), &RABBITMQ).expect("valid");
        assert!(crate::topology::diff(&first, &same).changed.is_empty());
        // Renewed: another certificate for the same key would do; another CA bundle shows it.
        let mut bundle = std::fs::read_to_string(certs.join("ca.pem")).expect("read");
        bundle.push_str(&std::fs::read_to_string(certs.join("client.pem")).expect("read"));
        std::fs::write(dir.path().join("ca.pem"), bundle).expect("write");
        let renewed = load(&paths, &Progress::default(), &RABBITMQ).expect("valid");
        let diff = crate::topology::diff(&first, &renewed);
        assert_eq!(diff.changed.into_iter().collect::<Vec<_>>(), ["work"]);
    }

    /// Issue 32 item 1: a reload is checked against the broker's capabilities as `run`'s
    /// start is: a priority on Redis is refused at its place, and the running config stays.
    #[test]
    fn a_reload_refuses_what_the_broker_cannot_honour() {
        let dir = tempfile::tempdir().expect("tempdir");
        let yaml = "version: 1\nqueues:\n  work:\n    type: classic\n    priority: 3\n    handler: {command: {program: /bin/true}}\n";
        std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
        let paths = [dir.path().to_path_buf()];
        let Err((diagnostics, _)) = load(&paths, &Progress::default(), &crate::broker::capabilities::REDIS) else {
            panic!("refused")
        };
        let refused: Vec<String> =
            diagnostics.iter().map(|d| format!("{}:{} {}", d.line, d.column, d.message)).collect();
        assert_eq!(refused, ["5:15 the Redis broker does not support priorities"]);
        assert!(load(&paths, &Progress::default(), &RABBITMQ).is_ok());
    }

    /// Issue 31 item 6: a reload adding a 20,000-value filter stopped every other queue's
    /// deliveries while it loaded (28 s), the log saying only "reloading". Here the load of a
    /// 40,000-value filter is held once done, and queue `a`, on the one-thread runtime that
    /// `sluice run` uses by default, handles a message meanwhile; the held load says every
    /// second how far it has got; released, the reload is applied.
    #[test]
    fn other_queues_are_served_while_a_reload_loads() {
        use std::sync::mpsc as std_mpsc;

        use crate::broker::Publish as _;
        use crate::broker::memory::Memory;

        const DEADLINE: Duration = Duration::from_secs(20);
        let dir = tempfile::tempdir().expect("tempdir");
        let pipelines = dir.path().join("pipelines");
        std::fs::create_dir(&pipelines).expect("mkdir");
        let runs = dir.path().join("runs");
        let a = format!(
            "version: 1\nexchanges:\n  ev: {{type: topic}}\nqueues:\n  a:\n    handler:\n      command:\n        \
             program: /bin/sh\n        args: [\"-c\", 'echo \"$SLUICE_IDEMPOTENCY_KEY\" >> \"$1\"', sh, {runs:?}]\n        \
             stdin: none\n"
        );
        std::fs::write(pipelines.join("a.yaml"), a).expect("write");
        let paths = vec![pipelines.clone()];

        // Logs of the runner's thread, where `serve` runs.
        let log = Arc::new(Mutex::new(Vec::new()));
        struct Captured(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Captured {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().expect("log lock").extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || Captured(writer.clone()))
            .with_max_level(tracing::Level::INFO)
            .finish();

        // The load, held once done until the test releases it.
        let (held, holding) = std_mpsc::channel::<()>();
        let (release, released) = std_mpsc::channel::<()>();
        let released = Mutex::new(released);
        let held_load: Load = Arc::new(move |paths: &[PathBuf], progress: &Progress| {
            let loaded = load(paths, progress, &RABBITMQ);
            let _ = held.send(());
            // Until released, or the test has ended (its sender dropped).
            let _ = released.lock().expect("release lock").recv();
            loaded
        });

        let memory = Memory::new();
        let mailbox = Arc::new(super::super::Mailbox::default());
        let source = super::super::Source::new(&mailbox);
        let requests = Reloads { mailbox, files: None, stop: CancellationToken::new() };
        let shutdown = CancellationToken::new();
        let _stop = shutdown.clone().drop_guard();
        let first = Arc::new(load(&paths, &Progress::default(), &RABBITMQ).expect("valid"));
        let current = Current::new(first.clone());
        let runner = std::thread::spawn({
            let (memory, paths, current, shutdown) = (memory.clone(), paths.clone(), current.clone(), shutdown.clone());
            move || {
                let _log = tracing::subscriber::set_default(subscriber);
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
                runtime.block_on(async move {
                    let (reloads, received) = mpsc::unbounded_channel();
                    let options = crate::runtime::Options {
                        shutdown_grace: Duration::from_secs(5),
                        exit_when_idle: false,
                        readiness: Default::default(),
                        pauses: Default::default(),
                        attempts: Default::default(),
                    };
                    let connect = move |_| {
                        let session = memory.clone();
                        async move { Ok::<_, crate::broker::BrokerError>(session) }
                    };
                    let sessions = crate::broker::failover::Failover::new(vec!["memory".into()], connect);
                    let handlers = Arc::new(crate::call::Handlers::new().expect("client"));
                    let running = tokio::spawn(crate::runtime::run(
                        first,
                        sessions,
                        handlers,
                        None,
                        options,
                        received,
                        shutdown.clone(),
                    ));
                    tokio::spawn(serve_with(paths, requests, reloads, current, shutdown, held_load));
                    running.await
                })
            }
        });
        let wait = |what: &str, done: &mut dyn FnMut() -> bool| {
            let start = Instant::now();
            while !done() {
                assert!(start.elapsed() < DEADLINE, "timed out waiting until {what}");
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        let handled = |key: &str| std::fs::read_to_string(&runs).unwrap_or_default().lines().any(|l| l == key);
        let publish = |key: &str| {
            let body = crate::envelope::Envelope::new("test", &serde_json::json!({}), Some(key.into())).encode();
            let message = crate::broker::Outgoing { body, ..Default::default() };
            let publishing = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            publishing.block_on(memory.publish("", "a", message)).expect("publish");
        };
        wait("queue a has its consumer", &mut || memory.consumers("a") == 1);
        publish("before");
        wait("queue a handled \"before\"", &mut || handled("before"));

        let values: Vec<String> = (0..40_000).map(|i| format!("c{i}")).collect();
        let big = format!(
            "version: 1\nqueues:\n  big:\n    bind:\n      - exchange: ev\n        filter: {{field: payload.customer, in: [{}]}}\n    \
             handler: {{webhook: {{url: \"http://127.0.0.1:9/x\"}}}}\n",
            values.join(", ")
        );
        std::fs::write(pipelines.join("big.yaml"), big).expect("write");
        source.post(Trigger::Files(vec![pipelines.join("big.yaml")]));
        holding.recv_timeout(DEADLINE).expect("the reload's load is done and held");

        publish("during");
        wait("queue a handled \"during\" while the reload's load was held", &mut || handled("during"));
        let logged = || String::from_utf8_lossy(&log.lock().expect("log lock")).into_owned();
        // A line a second: the load is held once done, so a line comes that says so.
        wait("a line saying how far the load has got", &mut || {
            logged().lines().any(|line| {
                line.contains("still loading the pipeline files; the running queues go on meanwhile")
                    && line.contains("progress=2 of 2 files read, 2 of 2 queues compiled")
            })
        });

        release.send(()).expect("the load waits");
        wait("the reload applied", &mut || current.get().config.queues.contains_key("big"));
        assert_eq!(current.get().last_reload.map(|r| r.result), Some("applied"));
        shutdown.cancel();
        let ended = runner.join().expect("the runner's thread");
        assert!(matches!(ended, Ok(Ok(()))), "{ended:?}");
    }

    /// Issue 19: one reload line listed 5,000 file names (116 KB). A line names the first
    /// few and counts the rest.
    #[test]
    fn a_log_line_lists_ten_names_and_counts_the_rest() {
        let names = |n: usize| (1..=n).map(|i| format!("f{i}"));
        assert_eq!(listed(names(0)), "");
        assert_eq!(listed(names(2)), "f1, f2");
        assert_eq!(listed(names(10)), "f1, f2, f3, f4, f5, f6, f7, f8, f9, f10");
        assert_eq!(listed(names(11)), "f1, f2, f3, f4, f5, f6, f7, f8, f9, f10 and 1 more");
        assert_eq!(listed(names(5000)), "f1, f2, f3, f4, f5, f6, f7, f8, f9, f10 and 4990 more");
    }
}
