//! The command line: clap subcommands, each a thin call into the modules that do the work.
//! Exit codes: 0 ok, 1 failure, 2 usage error (clap's own).

mod dlq;
mod output;
mod pause;
mod publish;

use std::future::Future;
use std::io::IsTerminal as _;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::admin::Readiness;
use crate::broker::amqp::{self, Amqp, PlanFormat};
use crate::broker::embedded::Embedded;
use crate::config::{self, Format};
use crate::dedup::{Location, Store};
use crate::envelope::Envelope;
use crate::handler::call::{self, Call};
use crate::handler::command::Stdin;
use crate::runtime::gate::Pauses;
use crate::topology;
use crate::{reload, runtime, testing};

#[derive(Debug, Parser)]
#[command(
    name = "sluice",
    version,
    about = "Declarative message pipelines: YAML in, RabbitMQ topology and workers out"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check pipeline files; exit 1 on any error (warnings alone exit 0).
    Validate {
        /// Files or directories (searched recursively for *.yaml and *.yml).
        #[arg(default_value = config::source::DEFAULT_DIR)]
        paths: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
    },
    /// Print the broker topology the files declare; with --broker, also how the live broker
    /// differs from it (exit 1 on a conflict that would stop `run`).
    Plan {
        #[arg(default_value = config::source::DEFAULT_DIR)]
        paths: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = PlanFormat::Text)]
        format: PlanFormat,
        /// Compare with this broker (amqp://... or the embedded broker's directory): missing
        /// exchanges and queues, and declarations that conflict with what exists. Nothing is created.
        #[arg(long = "broker")]
        broker: Option<String>,
        #[arg(long, default_value = "10s", value_parser = parse_duration)]
        connect_timeout: Duration,
    },
    /// Every queue at a glance: ready, consumers, dead-lettered, oldest dead letter.
    Status {
        #[arg(default_value = config::source::DEFAULT_DIR)]
        paths: Vec<PathBuf>,
        #[command(flatten)]
        broker: BrokerArg,
        /// A runner's admin address (`sluice run --admin`), whose held deliveries are counted
        /// as UNACKED; repeat it for every runner.
        #[arg(long, value_parser = parse_host_port)]
        admin: Vec<String>,
        #[arg(long, value_enum, default_value_t = dlq::Format::Text)]
        format: dlq::Format,
    },
    /// Read, redrive or purge a queue's dead-lettered messages.
    #[command(subcommand)]
    Dlq(dlq::Command),
    /// Print the JSON Schema of pipeline files (with --tests, of test files).
    Schema {
        /// The schema of test files (*.test.yaml) instead.
        #[arg(long)]
        tests: bool,
    },
    /// Run the tests in *.test.yaml files against the pipelines beside them: routing,
    /// rendered calls and outcomes, with simulated answers; nothing is sent. Exit 1 when a
    /// test fails or a file has an error.
    Test {
        /// Files or directories (searched recursively for pipelines and *.test.yaml files).
        #[arg(default_value = config::source::DEFAULT_DIR)]
        paths: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = testing::report::Format::Human)]
        format: testing::report::Format,
    },
    /// Declare the topology and consume: call the handlers, retry, dead-letter.
    Run {
        #[arg(default_value = config::source::DEFAULT_DIR)]
        paths: Vec<PathBuf>,
        #[command(flatten)]
        broker: BrokerArg,
        /// Stop consuming on SIGTERM/SIGINT and let in-flight handlers finish for this long.
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        shutdown_grace: Duration,
        /// Exit 0 once every queue and pending retry is drained.
        #[arg(long)]
        exit_when_idle: bool,
        /// Serve /metrics, /healthz and /readyz on this HOST:PORT (e.g. 127.0.0.1:9464, localhost:9464).
        #[arg(long, value_parser = parse_host_port)]
        admin: Option<String>,
        /// Idempotency store: redis://host:port (shared by many runners) or the embedded store's directory.
        #[arg(long, env = "SLUICE_DEDUP", default_value = ".sluice/dedup", hide_env_values = true)]
        dedup: String,
        /// Do not watch the pipeline files for changes (SIGHUP still reloads them).
        #[arg(long)]
        no_watch: bool,
        /// Threads running handlers and I/O. One is the fastest beside a local broker (see
        /// BENCHMARKS.md); more pay off on a many-core machine whose broker is elsewhere.
        #[arg(long, env = "SLUICE_THREADS", default_value = "1")]
        threads: NonZeroUsize,
        /// How log lines are written to stderr: text for people, json (one object a line) for
        /// log collectors.
        #[arg(long, value_enum, default_value_t = LogFormat::Text)]
        log_format: LogFormat,
    },
    /// Stop consuming a queue in a running runner (in-flight messages finish; the rest wait
    /// on the broker) until `sluice resume`; kept across reloads.
    Pause {
        /// The pipeline queue.
        queue: String,
        #[command(flatten)]
        admin: AdminArg,
    },
    /// Consume a paused queue again.
    Resume {
        /// The pipeline queue.
        queue: String,
        #[command(flatten)]
        admin: AdminArg,
    },
    /// Publish messages (JSON envelopes) and wait for the broker to confirm each.
    Publish(publish::Args),
    /// Dry run: print the HTTP request or the command a message would produce.
    Render {
        #[arg(default_value = config::source::DEFAULT_DIR)]
        paths: Vec<PathBuf>,
        /// The pipeline queue whose handler renders the message.
        #[arg(long)]
        queue: String,
        /// A file holding the message envelope (JSON).
        #[arg(long)]
        message: PathBuf,
        /// The attempt number to render as.
        #[arg(long, default_value_t = 1)]
        attempt: u32,
    },
}

/// Where the running runner's admin endpoint is.
#[derive(Debug, clap::Args)]
pub struct AdminArg {
    /// The runner's admin address (`sluice run --admin HOST:PORT`).
    #[arg(long = "admin", env = "SLUICE_ADMIN", default_value = "127.0.0.1:9464", value_parser = parse_host_port)]
    pub addr: String,
}

/// Where the broker is.
#[derive(Debug, clap::Args)]
pub struct BrokerArg {
    /// amqp://user:pass@host:port/vhost (or amqps://) for RabbitMQ; otherwise the directory of
    /// the embedded broker (default: $SLUICE_BROKER, else .sluice).
    #[arg(long = "broker", env = "SLUICE_BROKER", default_value = DEFAULT_BROKER, hide_env_values = true)]
    pub url: String,
    /// How long connecting to RabbitMQ (TCP, TLS and the AMQP handshake) may take.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub connect_timeout: Duration,
}

/// Which broker `--broker` names.
enum Endpoint<'a> {
    Amqp(&'a str),
    /// The embedded broker's directory.
    Embedded(&'a Path),
}

impl BrokerArg {
    fn endpoint(&self) -> anyhow::Result<Endpoint<'_>> {
        let url = self.url.as_str();
        if url.starts_with("amqp://") || url.starts_with("amqps://") {
            return Ok(Endpoint::Amqp(url));
        }
        if let Some((scheme, _)) = url.split_once("://") {
            anyhow::bail!(
                "--broker {}: \"{scheme}://\" is not a broker; use amqp:// or amqps:// for RabbitMQ, or a directory for the embedded broker",
                amqp::redact(url)
            );
        }
        Ok(Endpoint::Embedded(Path::new(url)))
    }

    /// The broker for logs and messages: the URL with its password masked, or the directory.
    fn display(&self) -> String {
        match self.endpoint() {
            Ok(Endpoint::Embedded(_)) => format!("embedded in {}", self.url),
            _ => amqp::redact(&self.url),
        }
    }
}

/// Runs `$body` with `$broker` bound to a session with the broker `$arg` names, either kind;
/// `$body` is compiled once for each.
macro_rules! with_broker {
    ($arg:expr, |$broker:ident| $body:expr) => {{
        let arg: &$crate::cli::BrokerArg = $arg;
        match arg.endpoint()? {
            $crate::cli::Endpoint::Amqp(url) => {
                let $broker = $crate::broker::amqp::Amqp::connect(url, arg.connect_timeout).await?;
                $body
            }
            $crate::cli::Endpoint::Embedded(path) => {
                let $broker = $crate::broker::embedded::Embedded::open_dir(path)?;
                $body
            }
        }
    }};
}
use with_broker;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// The embedded broker's directory, beside the idempotency store's.
const DEFAULT_BROKER: &str = ".sluice";

fn parse_duration(text: &str) -> Result<Duration, String> {
    config::parse_duration(text).ok_or_else(|| config::duration_problem(text))
}

/// A listening address as `HOST:PORT`; the host is resolved when the socket is bound.
fn parse_host_port(text: &str) -> Result<String, String> {
    match text.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(text.to_string()),
        _ => Err(format!("\"{text}\" is not HOST:PORT such as 127.0.0.1:9464 or localhost:9464")),
    }
}

/// Runs the command line and returns the process exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Validate { paths, format } => validate(&paths, format),
        Command::Plan { paths, format, broker, connect_timeout } => {
            let Some(config) = load_or_report(&paths) else {
                return ExitCode::FAILURE;
            };
            let plan = topology::plan(&config);
            match broker {
                Some(url) => {
                    let broker = BrokerArg { url, connect_timeout };
                    exit(block_on(NonZeroUsize::MIN, LogFormat::Text, drift(plan, broker, format)))
                }
                None => exit(output::stdout(&amqp::render(&amqp::declarations(&plan), format)).map_err(Into::into)),
            }
        }
        Command::Status { paths, broker, admin, format } => {
            exit(block_on(NonZeroUsize::MIN, LogFormat::Text, dlq::status(&paths, broker, &admin, format)))
        }
        Command::Dlq(command) => exit(block_on(NonZeroUsize::MIN, LogFormat::Text, dlq::dlq(command))),
        Command::Schema { tests } => {
            let text = if tests { config::schema::TESTS_TEXT } else { config::schema::TEXT };
            exit(output::stdout(text).map_err(Into::into))
        }
        Command::Test { paths, format } => test(&paths, format),
        Command::Run { paths, broker, shutdown_grace, exit_when_idle, admin, dedup, no_watch, threads, log_format } => {
            let options = runtime::Options {
                shutdown_grace,
                exit_when_idle,
                readiness: Readiness::default(),
                pauses: Pauses::default(),
            };
            let watch = !no_watch;
            let run = run(paths, watch, broker, Location::parse(&dedup), admin, options);
            exit(block_on(threads, log_format, run))
        }
        Command::Pause { queue, admin } => {
            exit(block_on(NonZeroUsize::MIN, LogFormat::Text, pause::pause(&admin.addr, &queue, true)))
        }
        Command::Resume { queue, admin } => {
            exit(block_on(NonZeroUsize::MIN, LogFormat::Text, pause::pause(&admin.addr, &queue, false)))
        }
        Command::Publish(args) => exit(block_on(NonZeroUsize::MIN, LogFormat::Text, publish::publish(args))),
        Command::Render { paths, queue, message, attempt } => {
            let Some(mut config) = load_or_report(&paths) else { return ExitCode::FAILURE };
            exit(render(&mut config, &queue, &message, attempt).and_then(|text| Ok(output::stdout(&text)?)))
        }
    }
}

/// Logs go to stderr in `format`, in colour only on a terminal; `RUST_LOG` filters them
/// (default info). With an OTLP endpoint set, the delivery spans are exported too, until the
/// returned exporter is dropped.
fn init_logging(format: LogFormat) -> Option<crate::trace::Exporter> {
    use tracing_subscriber::filter::{FilterExt as _, filter_fn};
    use tracing_subscriber::{Layer as _, layer::SubscriberExt as _, util::SubscriberInitExt as _};
    // lapin logs, per failed connection attempt, three ERROR lines for what sluice reports in
    // one (every error lapin returns reaches sluice), and a returned (unroutable) message
    // whole at WARN, payload included. RUST_LOG=lapin=warn brings its lines back.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,lapin=off,lsm_tree=warn,fjall=warn"));
    let filter = filter.and(filter_fn(crate::trace::not_a_delivery_span));
    let text = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal());
    let logs = match format {
        LogFormat::Text => text.with_filter(filter).boxed(),
        // The whole span list, not only the innermost span: a span opened inside a delivery's
        // must not hide which message a line is about.
        LogFormat::Json => text.json().with_current_span(false).with_span_list(true).with_filter(filter).boxed(),
    };
    let (otlp, failed) = match crate::trace::otlp() {
        Ok(otlp) => (otlp, None),
        Err(e) => (None, Some(e)),
    };
    let (otlp, exporter) = otlp.unzip();
    tracing_subscriber::registry().with(logs).with(otlp).init();
    if let Some(e) = failed {
        tracing::error!(error = %e, "running without trace export");
    }
    exporter
}

/// Runs `future` on `threads` threads. One thread gets a current-thread runtime: no work
/// stealing and no cross-thread wake-ups, which on two cores shared with the broker is worth
/// 1.1-1.2x the throughput at 0.7x the CPU per message of tokio's multi-threaded runtime.
fn block_on<F: Future<Output = anyhow::Result<()>>>(
    threads: NonZeroUsize,
    log_format: LogFormat,
    future: F,
) -> anyhow::Result<()> {
    // Dropped after the runtime (a tail expression's temporaries go first): flushes the spans.
    let _exporter = init_logging(log_format);
    let mut builder = if threads.get() == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(threads.get());
        builder
    };
    builder.enable_all().build().context("cannot start the async runtime")?.block_on(future)
}

fn exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            output::stderr(&format!("error: {e:#}\n"));
            ExitCode::FAILURE
        }
    }
}

async fn run(
    paths: Vec<PathBuf>,
    watch: bool,
    broker: BrokerArg,
    dedup: Location,
    admin: Option<String>,
    options: runtime::Options,
) -> anyhow::Result<()> {
    let endpoint = broker.endpoint()?;
    // Watching starts before the first load, so that no edit in between goes unseen.
    let requests = reload::spawn(paths.clone(), watch).context("cannot listen for reload requests")?;
    let Some(mut config) = load_or_report(&paths) else {
        anyhow::bail!("invalid pipeline files");
    };
    // Before any connection: a missing secret would otherwise dead-letter every message.
    if let Err(errors) = config.prepare_run() {
        let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
        anyhow::bail!("{}", lines.join("\nerror: "));
    }
    // Commands and future reloads may name queues idempotency is off for today.
    let store = if config.queues.values().any(|q| q.idempotency.is_some()) {
        Some(Store::open(&dedup).await.context("cannot open the idempotency store")?)
    } else {
        None
    };
    let shutdown = CancellationToken::new();
    let forced = CancellationToken::new();
    tokio::spawn(signals(shutdown.clone(), forced.clone()));
    if let Some(addr) = admin {
        let metrics = crate::admin::install_recorder().map_err(anyhow::Error::msg)?;
        let listener = tokio::net::TcpListener::bind(addr.as_str())
            .await
            .with_context(|| format!("cannot listen on {addr} for the admin endpoint"))?;
        let (readiness, pauses, stop) = (options.readiness.clone(), options.pauses.clone(), shutdown.clone());
        tokio::spawn(async move {
            if let Err(e) = crate::admin::serve(listener, metrics, readiness, pauses, stop).await {
                tracing::error!(error = %e, "admin endpoint failed");
            }
        });
    }
    let queues: Vec<&str> = config.queues.keys().map(String::as_str).collect();
    let dedup = match (&store, &dedup) {
        (None, _) => "none".to_string(),
        (Some(_), Location::File(dir)) => dir.display().to_string(),
        (Some(_), Location::Redis(url)) => amqp::redact(url),
    };
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        broker = %broker.display(),
        queues = %queues.join(", "),
        dedup = %dedup,
        "starting"
    );
    let (reload, reloads) = tokio::sync::mpsc::unbounded_channel();
    let mut requests = requests;
    requests.set_paths(reload::loader::watched(&paths, &config));
    tokio::spawn(reload::loader::serve(paths, requests, reload, shutdown.clone()));
    let config = Arc::new(config);
    let running = async {
        match endpoint {
            Endpoint::Amqp(url) => {
                let connect = || Amqp::connect(url, broker.connect_timeout);
                runtime::run(config, connect, store, options, reloads, shutdown).await
            }
            Endpoint::Embedded(path) => {
                let connect = || std::future::ready(Embedded::open_dir(path));
                runtime::run(config, connect, store, options, reloads, shutdown).await
            }
        }
    };
    tokio::select! {
        result = running => Ok(result?),
        // Returning drops the handlers under way, killing their process groups; the broker
        // gets their messages back when the connection goes.
        () = forced.cancelled() => anyhow::bail!(
            "a second signal during the graceful shutdown: stopped at once; messages in flight go back to the broker"
        ),
    }
}

/// Cancels `shutdown` on the first SIGTERM or SIGINT, and `forced` on the second.
async fn signals(shutdown: CancellationToken, forced: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(term), Ok(int)) => (term, int),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM and SIGINT");
            return;
        }
    };
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(
        signal = name,
        "shutting down: no new messages, finishing in-flight ones (a second signal stops at once)"
    );
    shutdown.cancel();
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    forced.cancel();
}

/// `sluice plan --broker`: the plan, then how the live broker differs from it (with JSON, one
/// object `{"plan", "drift"}`; with the graph formats, the differences on stderr). A conflict
/// fails: `run` would refuse to start.
async fn drift(plan: topology::Plan, broker: BrokerArg, format: PlanFormat) -> anyhow::Result<()> {
    use crate::broker::{Broker as _, Drift};
    let drift = with_broker!(&broker, |session| {
        let drift = session.drift(&plan).await;
        session.close().await;
        drift?
    });
    let declarations = amqp::declarations(&plan);
    if format != PlanFormat::Json {
        output::stdout(&amqp::render(&declarations, format))?;
    }
    let conflicts = drift.iter().filter(|d| matches!(d, Drift::Conflict { .. })).count();
    let matches = drift.iter().all(|d| matches!(d, Drift::BindingsUnchecked { .. }));
    let verdict = if matches { "matches the files" } else { "differs from the files:" };
    let mut text = format!("\nbroker {} {verdict}\n", broker.display());
    for d in &drift {
        text.push_str(&format!("  {d}\n"));
    }
    match format {
        PlanFormat::Json => {
            let both = serde_json::json!({ "plan": declarations, "drift": drift });
            output::stdout(&format!("{}\n", serde_json::to_string_pretty(&both)?))?;
        }
        PlanFormat::Text => output::stdout(&text)?,
        _ => output::stderr(&text),
    }
    if conflicts > 0 {
        anyhow::bail!("{conflicts} declaration(s) conflict with the broker; `sluice run` would refuse to start");
    }
    Ok(())
}

/// What `sluice render` prints: the request or the command a message would produce.
fn render(config: &mut config::Config, queue: &str, message: &Path, attempt: u32) -> anyhow::Result<String> {
    use std::fmt::Write as _;
    let q = config.queues.get_mut(queue).with_context(|| format!("no queue \"{queue}\" in the pipeline files"))?;
    q.resolve_webhook_url()?;
    let body =
        bytes::Bytes::from(std::fs::read(message).with_context(|| format!("cannot read {}", message.display()))?);
    let envelope = Envelope::decode(&body).with_context(|| format!("{}", message.display()))?;
    let renderer = call::Renderer::new(q, &envelope, attempt, true)?;
    let mut out = String::new();
    match renderer.call(&body, &renderer.key()?, None)? {
        Call::Webhook { request, timeout, .. } => {
            let mut url = request.url;
            // Environment values are shown as ***; one may hold the URL's credentials.
            if url.password().is_some() {
                let _ = url.set_password(Some("***"));
            }
            writeln!(out, "{} {url}", request.method)?;
            for (name, value) in &request.headers {
                writeln!(out, "{name}: {value}")?;
            }
            writeln!(out, "(timeout {})\n", humantime::format_duration(timeout))?;
            writeln!(out, "{}", String::from_utf8_lossy(&request.body))?;
        }
        Call::Command(inv) => {
            let argv: Vec<String> =
                std::iter::once(inv.program.display().to_string()).chain(inv.args.iter().cloned()).collect();
            writeln!(out, "argv: {}", serde_json::to_string(&argv)?)?;
            for (name, value) in &inv.env {
                writeln!(out, "env: {name}={value}")?;
            }
            writeln!(out, "timeout: {}", humantime::format_duration(inv.timeout))?;
            match &inv.stdin {
                Stdin::Null => writeln!(out, "stdin: (none)")?,
                Stdin::Bytes(b) => writeln!(out, "stdin: {}", String::from_utf8_lossy(b))?,
            }
        }
    }
    Ok(out)
}

fn validate(paths: &[PathBuf], format: Format) -> ExitCode {
    let validation = config::load(paths);
    let text = validation.render(format);
    if (format == Format::Json || !text.is_empty())
        && let Err(e) = output::stdout(&text)
    {
        output::stderr(&format!("error: cannot write the diagnostics: {e}\n"));
        return ExitCode::FAILURE;
    }
    if validation.has_errors() {
        ExitCode::FAILURE
    } else {
        if format == Format::Human {
            let queues = validation.config.as_ref().map_or(0, |c| c.queues.len());
            output::stderr(&format!("ok: {queues} queue(s) valid\n"));
        }
        ExitCode::SUCCESS
    }
}

/// `sluice test`: every result on stdout; exit 1 when a test fails or a file has an error.
fn test(paths: &[PathBuf], format: testing::report::Format) -> ExitCode {
    let outcome = testing::run(paths);
    if let Err(e) = output::stdout(&testing::report::render(&outcome, format)) {
        output::stderr(&format!("error: cannot write the results: {e}\n"));
        return ExitCode::FAILURE;
    }
    if outcome.has_errors() || outcome.failed() > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}

/// Loads the config for commands that need a valid one; problems go to stderr.
fn load_or_report(paths: &[PathBuf]) -> Option<config::Config> {
    let validation = config::load(paths);
    output::stderr(&validation.render(Format::Human));
    validation.config
}
