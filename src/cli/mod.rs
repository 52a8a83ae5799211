//! The command line: clap subcommands, each a thin call into the modules that do the work.
//! Exit codes: 0 ok, 1 failure, 2 usage error (clap's own). It opens no broker itself and matches
//! on no broker kind: [`crate::app`] turns what `--broker` names into sessions.

mod demo;
mod dlq;
mod output;
mod pause;
mod publish;
mod reads;

use std::future::Future;
use std::io::IsTerminal as _;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};

use crate::admin::api::Connect;
use crate::admin::token;
use crate::app::{self, DEFAULT_BROKER, Endpoint};
use crate::broker::amqp;
use crate::broker::embedded::ReadOnly;
use crate::broker::redis::{Checks as RedisChecks, Purpose};
use crate::broker::render::{self, PlanFormat};
use crate::broker::{BrokerError, Operate};
use crate::call::{self, Call};
use crate::config::{self, Format};
use crate::dedup::Location;
use crate::handler::command::Stdin;
use crate::runtime::Readiness;
use crate::runtime::gate::Pauses;
use crate::topology;
use crate::{reload, runtime, testing};

#[derive(Debug, Parser)]
#[command(
    name = "sluice",
    version = VERSION,
    propagate_version = true,
    about = "Declarative message pipelines: YAML in, RabbitMQ topology and workers out"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The version with the commit it was built from, when built in a git checkout (build.rs):
/// `0.1.0 (abc1234 2026-12-02)`.
pub const VERSION: &str = env!("SLUICE_BUILD_VERSION");

#[derive(Debug, Subcommand)]
enum Command {
    /// Check pipeline files; exit 1 on any error (warnings alone exit 0).
    ///
    /// An unset environment variable read by `${VAR}` without a default is a warning (CI has no
    /// secrets), and the value reading it is not checked further; `run` and `test` refuse the
    /// file (as `--env-strict` does), the operator's commands (`status`, `dlq`, `plan`,
    /// `render`) only when they read that value.
    Validate {
        /// Files or directories (searched recursively for *.yaml and *.yml).
        #[arg(default_value = config::source::DEFAULT_DIR)]
        paths: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
        /// Check the files in this environment as `run` does before it starts: an unset
        /// variable read by `${VAR}` without a default, an unset `{{env.X}}` or signing secret,
        /// a secrets or `tls:` file that cannot be read are errors (the systemd unit validates so
        /// before a reload).
        #[arg(long)]
        env_strict: bool,
        /// The broker the files will run on (amqp:// URLs, a redis:// URL or the embedded
        /// broker's directory): what it cannot honour is an error (priorities on Redis), and
        /// with several amqp:// nodes (a cluster) classic queues are warned about. Nothing is
        /// connected to: the URL's scheme says which broker it is.
        #[arg(long = "broker", env = "SLUICE_BROKER", hide_env_values = true, value_delimiter = ',')]
        broker: Vec<String>,
    },
    /// Print the broker topology the files declare; with --broker, also how the live broker
    /// differs from it (exit 1 on a conflict that would stop `run`).
    Plan {
        #[arg(default_value = config::source::DEFAULT_DIR)]
        paths: Vec<PathBuf>,
        #[arg(long, value_enum, default_value_t = PlanFormat::Text)]
        format: PlanFormat,
        /// Compare with this broker (amqp://..., redis://... or the embedded broker's directory):
        /// missing exchanges and queues, and declarations that conflict with what exists (and on
        /// Redis, the server's persistence). Nothing is created.
        #[arg(long = "broker", env = "SLUICE_BROKER", hide_env_values = true, value_delimiter = ',')]
        broker: Vec<String>,
        #[arg(long, default_value = "10s", value_parser = parse_duration)]
        connect_timeout: Duration,
        #[command(flatten)]
        evicting: EvictingArg,
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
        /// The pipeline schema's keys as the README's Markdown table (its configuration reference).
        #[arg(long, hide = true, conflicts_with = "tests")]
        reference: bool,
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
        /// Stop consuming on SIGTERM/SIGINT and let in-flight handlers finish for this long. A
        /// reload waits as long for a changed queue's; those still running then go on beside
        /// its new worker, counted against its concurrency.
        #[arg(long, default_value = "30s", value_parser = parse_duration)]
        shutdown_grace: Duration,
        /// Exit 0 once every queue and pending retry is drained.
        #[arg(long)]
        exit_when_idle: bool,
        /// Serve /metrics, /healthz and /readyz (open to whoever reaches the port), the console
        /// and its API, and the writes of `sluice pause|resume` on this HOST:PORT (e.g.
        /// 127.0.0.1:9464, localhost:9464). All but the probes and the console's own files need
        /// the admin token.
        #[arg(long, env = "SLUICE_ADMIN", value_parser = parse_host_port)]
        admin: Option<String>,
        /// A file holding the admin token (not writable by others, owned by you or root).
        /// Without it, $SLUICE_ADMIN_TOKEN; without that, a token generated once into the
        /// state directory (the embedded broker's directory, else .sluice) as `admin-token`,
        /// mode 0600, where `sluice pause` finds it.
        #[arg(long, value_name = "PATH")]
        admin_token_file: Option<PathBuf>,
        /// Let the console and the API be read without the admin token (writes still need it),
        /// by whoever reaches the port: queues, attempts, dead-lettered messages.
        #[arg(long)]
        admin_open_reads: bool,
        /// Host names, beside IP addresses, localhost and the --admin host, that requests to the
        /// admin port may be addressed to (comma-separated): the name operators or a proxy use
        /// for it. Requests for any other (a DNS-rebinding page) are refused with 421.
        #[arg(long, value_name = "HOST", value_delimiter = ',')]
        admin_allowed_hosts: Vec<String>,
        /// How many recent attempts per queue the console keeps (in memory) and shows.
        #[arg(long, default_value_t = runtime::attempts::DEFAULT_CAPACITY, value_name = "N")]
        admin_attempts: usize,
        /// Idempotency store: redis://host:port (shared by runners on many hosts), or a state
        /// directory whose broker.db holds the keys (default: the embedded broker's directory,
        /// else .sluice; runners on one directory share it). $SLUICE_DEDUP_FILE may name a file
        /// holding the URL instead (a secret with its password).
        #[arg(long, env = "SLUICE_DEDUP", hide_env_values = true)]
        dedup: Option<String>,
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
        #[command(flatten)]
        evicting: EvictingArg,
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
    /// The stand-in receiver `scripts/demo` runs: answers 200 to every request, prints it.
    #[command(hide = true)]
    DemoReceiver {
        #[arg(long, default_value = "127.0.0.1:8088")]
        listen: String,
    },
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
    /// Print the completion script for SHELL, e.g. `sluice completions bash >
    /// ~/.local/share/bash-completion/completions/sluice`.
    Completions { shell: clap_complete::Shell },
    /// Print the man page (roff), e.g. `sluice man > ~/.local/share/man/man1/sluice.1`.
    Man {
        /// Write sluice.1 and a page for each subcommand (sluice-run.1, sluice-dlq-list.1, ...)
        /// into this directory instead (created if missing).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

/// Where the running runner's admin endpoint is, and the token its writes need.
#[derive(Debug, clap::Args)]
pub struct AdminArg {
    /// The runner's admin address (`sluice run --admin HOST:PORT`).
    #[arg(long = "admin", env = "SLUICE_ADMIN", default_value = "127.0.0.1:9464", value_parser = parse_host_port)]
    pub addr: String,
    /// A file holding the runner's admin token. Without it, $SLUICE_ADMIN_TOKEN; without that,
    /// the token the runner generated into its state directory (see --broker).
    #[arg(long, value_name = "PATH")]
    pub admin_token_file: Option<PathBuf>,
    /// The runner's broker, for its state directory, which holds the token it generated: the
    /// embedded broker's directory; for amqp:// and redis:// URLs, .sluice.
    #[arg(
        long = "broker",
        env = "SLUICE_BROKER",
        default_value = DEFAULT_BROKER,
        hide_env_values = true,
        value_delimiter = ','
    )]
    pub broker: Vec<String>,
}

impl AdminArg {
    /// The token to send, and where it came from.
    fn token(&self) -> anyhow::Result<(token::Token, token::Source)> {
        let given = admin_token(self.admin_token_file.clone());
        Ok(given.for_client(&Endpoint::parse(&self.broker)?.state_dir())?)
    }
}

/// What the operator gave for the admin token: a file, else `$SLUICE_ADMIN_TOKEN`.
fn admin_token(file: Option<PathBuf>) -> token::Given {
    token::Given { file, env: std::env::var_os(token::ENV) }
}

/// Where the broker is.
#[derive(Debug, clap::Args)]
pub struct BrokerArg {
    /// amqp://user:pass@host:port/vhost (or amqps://) for RabbitMQ: repeat it, or separate URLs
    /// with commas, for the nodes of one cluster. redis://[user:pass@]host:port[/db] (or
    /// rediss://) for Redis streams, with ?prefix=P to share a server between deployments
    /// (default sluice:). Otherwise the directory of the embedded broker (default:
    /// $SLUICE_BROKER, else the URL in the file $SLUICE_BROKER_FILE names, else .sluice).
    #[arg(
        long = "broker",
        env = "SLUICE_BROKER",
        default_value = DEFAULT_BROKER,
        hide_env_values = true,
        value_delimiter = ','
    )]
    pub urls: Vec<String>,
    /// How long connecting to one RabbitMQ node (TCP, TLS and the AMQP handshake) may take.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub connect_timeout: Duration,
    /// How long a publish waits for RabbitMQ's confirm; past it the session is given up and
    /// the next node tried.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub confirm_timeout: Duration,
    /// What a Redis server must offer this command (an operator's by default).
    #[arg(skip)]
    pub redis: RedisChecks,
}

/// `--allow-evicting-redis`, for the commands that refuse a Redis that can evict keys.
#[derive(Debug, clap::Args)]
pub struct EvictingArg {
    /// Run on a Redis whose maxmemory-policy can evict keys (anything but noeviction), or whose
    /// policy cannot be read. Only for a server used for nothing else, with room to spare: a
    /// full one drops queued messages and idempotency keys without a word. Warns at the start
    /// and on every reconnect.
    #[arg(long)]
    pub allow_evicting_redis: bool,
}

impl BrokerArg {
    fn endpoint(&self) -> anyhow::Result<Endpoint<'_>> {
        Endpoint::parse(&self.urls)
    }

    fn timeouts(&self) -> amqp::Timeouts {
        amqp::Timeouts { connect: self.connect_timeout, confirm: self.confirm_timeout }
    }

    /// The broker for logs and messages: the URLs with their passwords masked, or the directory.
    fn display(&self) -> String {
        app::display(&self.urls)
    }

    /// Runs `job` on sessions with the broker, as an operator's command: it gives up after three
    /// rounds of failures over every node, an embedded broker must exist already (only `run`
    /// creates one), and an error out of `job` names the broker.
    async fn assemble<J: app::Job>(&self, job: J) -> anyhow::Result<J::Output> {
        let endpoint = self.endpoint()?;
        let dial =
            app::Dial { timeouts: self.timeouts(), redis: &self.redis, embedded: None, readiness: None, give_up: true };
        app::assemble(&endpoint, &dial, job).await.with_context(|| format!("broker {}", self.display()))
    }

    /// Runs `read` on the embedded broker's file opened read-only, when `--broker` names its
    /// directory (None for the others): an error names the broker.
    async fn read_only<T>(
        &self,
        read: impl AsyncFnOnce(&mut ReadOnly) -> Result<T, BrokerError>,
    ) -> anyhow::Result<Option<T>> {
        let endpoint = self.endpoint()?;
        app::read_only(&endpoint, read).await.with_context(|| format!("broker {}", self.display()))
    }
}

/// A quorum queue refuses publishes (nacks) while it elects a leader after a node loss, as a
/// full one does for good. RabbitMQ 3.10 routes to the leader its queue record names, which can
/// lag the election by seconds on a busy cluster: a refusal is tried again, with backoff, for
/// about half a minute without progress before it stands.
#[derive(Debug, Default)]
struct Refusals {
    tried: u32,
}

impl Refusals {
    /// Tries after the first before a refusal stands: 0.5 + 1 + 2 + 4 + 8 + 8 + 8 s of waiting.
    const RETRIES: u32 = 7;
    /// The longest wait between two tries.
    const LONGEST: Duration = Duration::from_secs(8);

    /// How long to wait before trying again after `error`; `None` when it stands.
    fn again(&mut self, error: &crate::broker::BrokerError) -> Option<Duration> {
        if !matches!(error, crate::broker::BrokerError::Rejected { .. }) || self.tried >= Self::RETRIES {
            return None;
        }
        self.tried += 1;
        Some((Duration::from_millis(250) * (1 << self.tried.min(6))).min(Self::LONGEST))
    }

    /// Something went through since the last refusal: the next one starts a new count.
    fn progressed(&mut self) {
        self.tried = 0;
    }
}

#[cfg(test)]
mod report_tests {
    use super::report;
    use crate::broker::{BrokerError, Cause};

    /// Contexts and a broker error, each said once: the broker error's source (and that
    /// source's own) already end its message.
    #[test]
    fn a_report_says_each_source_once() {
        let io = std::io::Error::other("connection reset");
        let lost = BrokerError::Lost(Cause::from_error(lapin::Error::from(io)).within("declaring queue \"a\""));
        let e = anyhow::Error::from(lost).context("broker amqp://localhost");
        assert_eq!(
            report(&e),
            "broker amqp://localhost: broker connection lost: declaring queue \"a\": IO error: connection reset"
        );
        let e = anyhow::Error::from(std::io::Error::other("denied")).context("cannot read the file");
        assert_eq!(report(&e), "cannot read the file: denied");
    }
}

#[cfg(test)]
mod refusal_tests {
    use super::Refusals;
    use crate::broker::BrokerError;
    use std::time::Duration;

    fn nack() -> BrokerError {
        BrokerError::Rejected { exchange: "ev".into(), reason: "nack".into() }
    }

    /// Half a minute of backoff, then the refusal stands; progress starts the count again;
    /// anything but a nack stands at once.
    #[test]
    fn refusals_back_off_for_half_a_minute_and_progress_starts_again() {
        let mut refusals = Refusals::default();
        let waits: Vec<Duration> = std::iter::from_fn(|| refusals.again(&nack())).collect();
        let total: Duration = waits.iter().sum();
        assert_eq!(waits.first(), Some(&Duration::from_millis(500)));
        assert!(waits.iter().all(|w| *w <= Refusals::LONGEST), "{waits:?}");
        assert_eq!(total, Duration::from_millis(31_500), "{waits:?}");
        refusals.progressed();
        assert_eq!(refusals.again(&nack()), Some(Duration::from_millis(500)));
        assert_eq!(Refusals::default().again(&BrokerError::NotFound("ev".into())), None);
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

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

/// Variables naming a file that holds what a flag takes, for URLs that carry a password
/// (Docker and Kubernetes secrets are files): the flag's long name, its own variable, the file's.
const URL_FILES: [(&str, &str, &str); 2] =
    [("broker", "SLUICE_BROKER", "SLUICE_BROKER_FILE"), ("dedup", "SLUICE_DEDUP", "SLUICE_DEDUP_FILE")];

/// The command line, with `$SLUICE_BROKER_FILE` and `$SLUICE_DEDUP_FILE` read: a file's URL is
/// the flag's value when neither the flag nor its own variable is given. Exits as `Cli::parse`
/// does on a usage error, given both ways included; an unreadable file is an error.
fn parse() -> anyhow::Result<Cli> {
    let mut command = Cli::command();
    let mut from_files = Vec::new();
    for (flag, own, file_var) in URL_FILES {
        let Some(path) = std::env::var_os(file_var) else { continue };
        if std::env::var_os(own).is_some() {
            conflict(format!("${file_var} and ${own} are both set; give the {flag} URL one way"));
        }
        let url = crate::secret::read_secret_file(Path::new(&path)).with_context(|| format!("${file_var}"))?;
        // Once per process; the value must outlive the command definition.
        command = default_for(command, flag, String::leak(url));
        from_files.push((flag, file_var));
    }
    let matches = command.get_matches();
    for (flag, file_var) in from_files {
        if given_on_command_line(&matches, flag) {
            conflict(format!("--{flag} and ${file_var} are both given; give the {flag} URL one way"));
        }
    }
    Cli::from_arg_matches(&matches).map_err(|e| e.exit())
}

/// Ends the process as a usage error (exit 2), as clap ends one.
fn conflict(message: String) -> ! {
    Cli::command().error(clap::error::ErrorKind::ArgumentConflict, message).exit()
}

/// `command` (and its subcommands) with `value` as the default of every `--{long}`, never
/// shown (it carries a password).
fn default_for(command: clap::Command, long: &'static str, value: &'static str) -> clap::Command {
    command
        .mut_args(
            |arg| {
                if arg.get_long() == Some(long) { arg.default_value(value).hide_default_value(true) } else { arg }
            },
        )
        .mut_subcommands(|sub| default_for(sub, long, value))
}

/// Whether `--{long}` was given on the command line, at any level of subcommands (its
/// argument ids are the field names: `urls` in [`BrokerArg`], `broker` and `dedup` elsewhere).
fn given_on_command_line(matches: &clap::ArgMatches, long: &str) -> bool {
    let ids: &[&str] = if long == "broker" { &["broker", "urls"] } else { &[long] };
    let here = matches.ids().any(|id| {
        ids.contains(&id.as_str()) && matches.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine)
    });
    here || matches.subcommand().is_some_and(|(_, sub)| given_on_command_line(sub, long))
}

/// Runs the command line and returns the process exit code.
pub fn main() -> ExitCode {
    crate::install_tls_provider();
    let cli = match parse() {
        Ok(cli) => cli,
        Err(e) => return exit(Err(e)),
    };
    match cli.command {
        Command::Validate { paths, format, env_strict, broker } => {
            let unset = if env_strict { config::Unset::Error } else { config::Unset::Warning };
            validate(&paths, format, unset, &broker)
        }
        Command::Plan { paths, format, broker, connect_timeout, evicting } => {
            let Some(config) = reads::load_for(&paths, app::nodes(&broker), "plan", reads::Reads::Topology) else {
                return ExitCode::FAILURE;
            };
            let plan = topology::plan(&config);
            if broker.is_empty() {
                let picture = app::picture(&plan, None);
                return exit(picture.and_then(|p| Ok(output::stdout(&render::render(&p, format))?)));
            }
            let broker = BrokerArg {
                urls: broker,
                connect_timeout,
                confirm_timeout: amqp::Timeouts::default().confirm,
                redis: RedisChecks::new(Purpose::Plan, evicting.allow_evicting_redis),
            };
            exit(block_on(NonZeroUsize::MIN, LogFormat::Text, drift(plan, broker, format)))
        }
        Command::Status { paths, broker, admin, format } => {
            exit(block_on(NonZeroUsize::MIN, LogFormat::Text, dlq::status(&paths, broker, &admin, format)))
        }
        Command::Dlq(command) => exit(block_on(NonZeroUsize::MIN, LogFormat::Text, dlq::dlq(command))),
        Command::Schema { tests, reference } => {
            let text = match (tests, reference) {
                (true, _) => config::schema::TESTS_TEXT.to_string(),
                (false, true) => config::reference::markdown(config::schema::value()),
                (false, false) => config::schema::TEXT.to_string(),
            };
            exit(output::stdout(&text).map_err(Into::into))
        }
        Command::Test { paths, format } => test(&paths, format),
        Command::Run {
            paths,
            broker,
            shutdown_grace,
            exit_when_idle,
            admin,
            admin_token_file,
            admin_open_reads,
            admin_allowed_hosts,
            admin_attempts,
            dedup,
            no_watch,
            threads,
            log_format,
            evicting,
        } => {
            let options = runtime::Options {
                shutdown_grace,
                exit_when_idle,
                readiness: Readiness::default(),
                pauses: Pauses::default(),
                // Without the admin port nobody reads them: none are kept.
                attempts: runtime::attempts::Attempts::new(if admin.is_some() { admin_attempts } else { 0 }),
            };
            let watch = !no_watch;
            let admin = admin.map(|addr| {
                let policy = crate::admin::Policy::new(&addr, admin_open_reads, &admin_allowed_hosts);
                (addr, admin_token(admin_token_file), policy)
            });
            let dedup = dedup.as_deref().map(Location::parse);
            let run = run(paths, watch, broker, dedup, evicting.allow_evicting_redis, admin, options);
            exit(block_on(threads, log_format, run))
        }
        Command::Pause { queue, admin } => {
            exit(block_on(NonZeroUsize::MIN, LogFormat::Text, pause::pause(admin, &queue, true)))
        }
        Command::Resume { queue, admin } => {
            exit(block_on(NonZeroUsize::MIN, LogFormat::Text, pause::pause(admin, &queue, false)))
        }
        Command::Publish(args) => exit(block_on(NonZeroUsize::MIN, LogFormat::Text, publish::publish(args))),
        Command::DemoReceiver { listen } => exit(block_on(NonZeroUsize::MIN, LogFormat::Text, demo::receive(&listen))),
        Command::Render { paths, queue, message, attempt } => {
            let Some(mut config) = reads::load_for(&paths, 1, "render", reads::Reads::Queue(&queue)) else {
                return ExitCode::FAILURE;
            };
            exit(render(&mut config, &queue, &message, attempt).and_then(|text| Ok(output::stdout(&text)?)))
        }
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "sluice", &mut script);
            exit(output::stdout_bytes(&script).map_err(Into::into))
        }
        Command::Man { dir } => {
            // `help` is clap's, and has no page of its own to point to.
            let command = Cli::command().disable_help_subcommand(true);
            let result = match dir {
                Some(dir) => std::fs::create_dir_all(&dir)
                    .and_then(|()| clap_mangen::generate_to(command, &dir))
                    .with_context(|| format!("cannot write the man pages into {}", dir.display())),
                None => {
                    let mut page = Vec::new();
                    clap_mangen::Man::new(command)
                        .render(&mut page)
                        .and_then(|()| output::stdout_bytes(&page))
                        .map_err(Into::into)
                }
            };
            exit(result)
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
    // whole at WARN, payload included. RUST_LOG=lapin=warn brings its lines back. async-nats
    // says "connected" at INFO on every connection, which sluice's own lines cover.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,lapin=off,async_nats=warn"));
    let filter = filter
        .and(filter_fn(crate::trace::not_a_delivery_span))
        .and(filter_fn(not_an_amqp_frame_dump))
        .and(filter_fn(not_notifys));
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

/// False for notify's lines, whatever `RUST_LOG` says. What its watches fail with reaches sluice,
/// which says it in its own words (`reload::watcher`); its own lines are about watches the
/// kernel already dropped with their directory (a WARN when the pipeline directory is
/// deleted), and at TRACE one per event in a watched directory: a log file there turned each
/// line into another (8.6 MB/s of them, idle).
fn not_notifys(metadata: &tracing::Metadata<'_>) -> bool {
    let target = metadata.target();
    target != "notify" && !target.starts_with("notify::")
}

/// False for lapin's and amq-protocol's TRACE lines, whatever `RUST_LOG` says: they dump the
/// frames sent, connection.start-ok's PLAIN response (user and password) among them.
fn not_an_amqp_frame_dump(metadata: &tracing::Metadata<'_>) -> bool {
    let target = metadata.target();
    let amqp = target == "lapin" || target.starts_with("lapin::") || target.starts_with("amq_protocol");
    !amqp || *metadata.level() <= tracing::Level::DEBUG
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
            output::stderr(&format!("error: {}\n", report(&e)));
            ExitCode::FAILURE
        }
    }
}

/// An error and its sources, as `{:#}` shows them, but for a source whose words are shown
/// already: a [`BrokerError`](crate::broker::BrokerError), as a lapin error, ends its message
/// with its source's.
fn report(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for said in e.chain().map(ToString::to_string) {
        if text.contains(&said) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&said);
    }
    text
}

async fn run(
    paths: Vec<PathBuf>,
    watch: bool,
    broker: BrokerArg,
    dedup: Option<Location>,
    allow_evicting_redis: bool,
    admin: Option<(String, token::Given, crate::admin::Policy)>,
    options: runtime::Options,
) -> anyhow::Result<()> {
    let endpoint = broker.endpoint()?;
    // Watching starts before the first load, so that no edit in between goes unseen.
    let requests = reload::spawn(paths.clone(), watch).context("cannot listen for reload requests")?;
    let Some(mut config) = load_or_report(&paths, endpoint.nodes(), Some(&endpoint.capabilities())) else {
        anyhow::bail!("invalid pipeline files");
    };
    // Before any connection: a missing secret would otherwise dead-letter every message.
    if let Err(errors) = config.prepare_run() {
        let lines: Vec<String> = errors.iter().map(ToString::to_string).collect();
        anyhow::bail!("{}", lines.join("\nerror: "));
    }
    let (timeouts, broker) = (broker.timeouts(), broker.display());
    let runner = app::run::Runner {
        paths,
        config,
        requests,
        endpoint,
        broker,
        timeouts,
        dedup,
        allow_evicting_redis,
        admin,
        options,
        version: VERSION,
    };
    app::run::run(runner).await
}

/// `sluice plan --broker`: the plan, then how the live broker differs from it (with JSON, one
/// object `{"plan", "drift"}`; with the graph formats, the differences on stderr). A conflict
/// fails: `run` would refuse to start. An embedded broker not yet created is compared as an
/// empty one, and left uncreated.
async fn drift(plan: topology::Plan, broker: BrokerArg, format: PlanFormat) -> anyhow::Result<()> {
    use crate::broker::Drift;
    let endpoint = broker.endpoint()?;
    let absent = !endpoint.exists();
    let drift = if absent { Drift::all_missing(&plan) } else { broker.assemble(ReadDrift(&plan)).await? };
    let picture = app::picture(&plan, Some(&endpoint))?;
    if format != PlanFormat::Json {
        output::stdout(&render::render(&picture, format))?;
    }
    let conflicts = drift.iter().filter(|d| matches!(d, Drift::Conflict { .. })).count();
    let matches = drift.iter().all(|d| matches!(d, Drift::BindingsUnchecked { .. }));
    let verdict = if matches { "matches the files" } else { "differs from the files:" };
    let absent = if absent { " (does not exist: only `sluice run` creates it)" } else { "" };
    let mut text = format!("\nbroker {}{absent} {verdict}\n", broker.display());
    if let Some((persistence, warning)) = endpoint.persistence().await {
        let tail = warning.map(|w| format!("\n  warning: {w}")).unwrap_or_default();
        text = format!("\nbroker persistence: {persistence}{tail}{text}");
    }
    if let Some(placed) = endpoint.placement(&plan).await {
        text.push_str("  each queue's node (the Redis Cluster primary of its slot):\n");
        for (queue, node) in placed {
            text.push_str(&format!("    {queue}: {node}\n"));
        }
    }
    for d in &drift {
        text.push_str(&format!("  {d}\n"));
    }
    match format {
        PlanFormat::Json => {
            let both = serde_json::json!({ "plan": picture.json, "drift": drift });
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

/// What `plan --broker` reads of the live broker: how it differs from the plan.
struct ReadDrift<'a>(&'a topology::Plan);

impl app::Job for ReadDrift<'_> {
    type Output = Vec<crate::broker::Drift>;

    async fn run<B: Operate>(self, sessions: app::Sessions<'_, B>, _: Connect<B>) -> anyhow::Result<Self::Output> {
        app::once(sessions, async |broker| broker.drift(self.0).await).await
    }
}

/// What `sluice render` prints: the request or the command a message would produce.
fn render(config: &mut config::Config, queue: &str, message: &Path, attempt: u32) -> anyhow::Result<String> {
    use std::fmt::Write as _;
    let q = config.queue_mut(queue).with_context(|| format!("no queue \"{queue}\" in the pipeline files"))?;
    q.resolve_webhook_url()?;
    let body =
        bytes::Bytes::from(std::fs::read(message).with_context(|| format!("cannot read {}", message.display()))?);
    // A message file is its body alone: no broker gave it an id, a type or headers.
    let delivery = crate::broker::Kept::standalone(body, crate::broker::Properties::default());
    let decoded = crate::format::Message::decode(q.format, &delivery)
        .with_context(|| format!("{} (format: {})", message.display(), q.format))?;
    let renderer = call::Renderer::new(q, &decoded, attempt, true)?;
    let mut out = String::new();
    match renderer.call(&renderer.key()?, None)? {
        Call::Webhook { request, timeout, oauth2, .. } => {
            let mut url = request.url;
            // Environment values are shown as ***; one may hold the URL's credentials.
            if url.password().is_some() {
                let _ = url.set_password(Some("***"));
            }
            writeln!(out, "{} {url}", request.method)?;
            for (name, value) in &request.headers {
                writeln!(out, "{name}: {value}")?;
            }
            if let Some(oauth2) = oauth2 {
                // Nothing is fetched: a dry run sends nothing, the token endpoint included.
                writeln!(out, "authorization: Bearer *** (an OAuth2 token from {})", oauth2.token_url)?;
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
    // The message's values are in there: shown escaped, line by line.
    Ok(out.lines().map(|line| format!("{}\n", crate::terminal::visible(line))).collect())
}

fn validate(paths: &[PathBuf], format: Format, unset: config::Unset, broker: &[String]) -> ExitCode {
    // Only the broker's kind is read: nothing is connected to.
    let capabilities = if broker.is_empty() {
        None
    } else {
        match Endpoint::parse(broker) {
            Ok(endpoint) => Some(endpoint.capabilities()),
            Err(e) => return exit(Err(e)),
        }
    };
    let mut validation = config::load_with(paths, unset).on_nodes(app::nodes(broker));
    if let Some(capabilities) = capabilities {
        validation.check_capabilities(&capabilities);
    }
    let text = validation.render(format);
    if (format == Format::Json || !text.is_empty())
        && let Err(e) = output::stdout(&text)
    {
        output::stderr(&format!("error: cannot write the diagnostics: {e}\n"));
        return ExitCode::FAILURE;
    }
    // Strict: what `run` refuses to start with in this environment fails here too, so that a
    // reload checked so (the systemd unit's) fails where the runner would reject the edit.
    let refused = match (unset, validation.config.as_mut()) {
        (config::Unset::Error, Some(config)) => config.prepare_run().err().unwrap_or_default(),
        _ => Vec::new(),
    };
    for error in &refused {
        output::stderr(&format!("error: {}\n", crate::terminal::visible(&error.to_string())));
    }
    if validation.has_errors() || !refused.is_empty() {
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
    for note in &outcome.notes {
        output::stderr(&format!("note: {}\n", crate::terminal::visible(note)));
    }
    if let Err(e) = output::stdout(&testing::report::render(&outcome, format)) {
        output::stderr(&format!("error: cannot write the results: {e}\n"));
        return ExitCode::FAILURE;
    }
    if outcome.has_errors() || outcome.failed() > 0 { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}

/// Loads the config for commands that need a valid one, refusing what a broker with
/// `capabilities` cannot honour when given; problems go to stderr.
fn load_or_report(
    paths: &[PathBuf],
    nodes: usize,
    capabilities: Option<&crate::vocab::capabilities::Capabilities>,
) -> Option<config::Config> {
    let mut validation = config::load(paths).on_nodes(nodes);
    if let Some(capabilities) = capabilities {
        validation.check_capabilities(capabilities);
    }
    output::stderr(&validation.render(Format::Human));
    validation.config
}
