//! The drain benchmark: how fast `sluice run` empties a pre-loaded queue into a webhook (or a
//! command), side by side with a hand-written lapin + reqwest consumer
//! (`benches/baseline_consumer.rs`), in one run on one machine so the ratio means something
//! even when the absolute figures wander. The throughput trials also run the baseline acking
//! the way sluice does, which splits the difference into ack strategy and per-message work.
//! Also the retry path, the command handler, and the memory of `sluice run` while a large
//! backlog drains. The same trials run on the embedded broker (`--queues embedded`) and on
//! Redis (`--queues redis`): sluice only (the baseline speaks AMQP), the same pipeline as on a
//! quorum queue; beside the memory, the embedded broker's file sizes and the Redis server's
//! `used_memory`.
//!
//! Run it through `scripts/bench.sh` (which builds both binaries and passes the baseline's
//! path); BENCHMARKS.md describes the method and the latest figures. It needs RabbitMQ at
//! 127.0.0.1:5672 (guest/guest) and `rabbitmqctl`, and makes and deletes one vhost per trial
//! (for the embedded broker, one temporary directory; for Redis, on 127.0.0.1:6379 unless
//! `--redis` names another server, the keys under a prefix of the trial's own).
//! It asserts nothing about timings: it measures and reports.

mod keyspace;
mod place;
mod rabbit;
mod sink;
mod usage;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use clap::{Parser, ValueEnum};

use place::Place;
use sink::{Mode, Sink};
use usage::Sampler;

/// Exchange and routing key every bench pipeline binds its queue with.
const EXCHANGE: &str = "bench";
const ROUTING_KEY: &str = "work";
const QUEUE: &str = "bench.work";
/// Every queue type, in the order the report lists them.
const QUEUES: [&str; 4] = ["classic", "quorum", "embedded", "redis"];
/// No trial may take longer than this.
const TRIAL_DEADLINE: Duration = Duration::from_secs(600);

#[derive(Debug, Parser)]
#[command(about = "Drain benchmark: sluice run vs a hand-written consumer (see BENCHMARKS.md)")]
struct Args {
    /// The hand-written consumer's executable (scripts/bench.sh finds it). Without it the
    /// driver only points at scripts/bench.sh, as when `cargo bench` runs it bare.
    #[arg(long, env = "BASELINE_CONSUMER")]
    baseline: Option<PathBuf>,
    /// The sluice executable.
    #[arg(long, env = "SLUICE_BIN", default_value = env!("CARGO_BIN_EXE_sluice"))]
    sluice: PathBuf,
    /// A second sluice build (say, with a proposed fix) measured in the throughput trials next
    /// to the first, as consumer "candidate".
    #[arg(long)]
    candidate: Option<PathBuf>,
    /// Messages per throughput trial.
    #[arg(long, default_value_t = 50_000)]
    messages: u64,
    /// Throughput trials per consumer and queue type (the figure is their median).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Trials per queue type (retry) or consumer (command).
    #[arg(long, default_value_t = 3)]
    other_runs: usize,
    /// Prefetch of both consumers, and sluice's `concurrency`.
    #[arg(long, default_value_t = 50)]
    concurrency: u16,
    /// Messages per retry-path trial (each fails once).
    #[arg(long, default_value_t = 20_000)]
    retry_messages: u64,
    /// Messages per command-handler trial.
    #[arg(long, default_value_t = 5_000)]
    command_messages: u64,
    /// Backlog drained while sampling sluice's memory.
    #[arg(long, default_value_t = 200_000)]
    backlog: u64,
    /// Memory trials: sluice runs without `--exit-when-idle` and is stopped (SIGTERM) this many
    /// seconds after the last message, so the samples show what the embedded broker's file
    /// gives back once the backlog has drained.
    #[arg(long, default_value_t = 0.0)]
    linger: f64,
    /// Which parts to run (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Part>,
    /// Queue types (brokers) for the throughput and retry trials; the memory trial runs on
    /// quorum, embedded and redis, whichever are given; the command trials on classic.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "classic,quorum")]
    queues: Vec<QueueType>,
    /// Also write every trial as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also measure sluice with idempotency off and with the Redis store (`--redis`, a key
    /// prefix of the trial's own) in the throughput trials ("sluice" itself uses the
    /// broker's own store: beside RabbitMQ, the embedded one).
    #[arg(long)]
    dedup_variants: bool,
    /// The Redis server of the `redis` trials and of the Redis store's (`--dedup-variants`).
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis: String,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Part {
    Throughput,
    Retry,
    Command,
    Memory,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum QueueType {
    Classic,
    Quorum,
    /// The embedded broker (a directory), with the quorum trials' pipeline.
    Embedded,
    /// The Redis broker (a key prefix on the `--redis` server), with the quorum trials' pipeline.
    Redis,
}

impl QueueType {
    fn name(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
            QueueType::Embedded => "embedded",
            QueueType::Redis => "redis",
        }
    }

    /// The queue's `type:` in the pipeline: the embedded and Redis brokers keep it but do not
    /// act on it.
    fn declared(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum | QueueType::Embedded | QueueType::Redis => "quorum",
        }
    }

    /// Whether RabbitMQ holds it.
    fn is_amqp(self) -> bool {
        matches!(self, QueueType::Classic | QueueType::Quorum)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Consumer {
    Baseline,
    /// The baseline acking as sluice does (`--batched-acks`).
    BaselineBatched,
    /// The default idempotency store: the broker's own (beside RabbitMQ, the embedded store).
    Sluice,
    /// `idempotency: {enabled: false}`.
    SluiceNoDedup,
    /// `--dedup` the `--redis` server, under a prefix of the trial's own.
    SluiceRedis,
    Candidate,
}

impl Consumer {
    /// Whether it can consume from `queue`: the baseline speaks only AMQP.
    fn drains(self, queue: QueueType) -> bool {
        queue.is_amqp() || !matches!(self, Consumer::Baseline | Consumer::BaselineBatched)
    }

    fn name(self) -> &'static str {
        match self {
            Consumer::Baseline => "baseline",
            Consumer::BaselineBatched => "baseline-batched",
            Consumer::Sluice => "sluice",
            Consumer::SluiceNoDedup => "sluice-no-dedup",
            Consumer::SluiceRedis => "sluice-redis",
            Consumer::Candidate => "candidate",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Handler {
    Webhook,
    /// Every message fails once with 503, then succeeds.
    WebhookFailOnce,
    /// `/bin/true`.
    Command,
}

/// One drain, measured.
#[derive(Debug, Clone, serde::Serialize)]
struct Trial {
    part: &'static str,
    queue: &'static str,
    consumer: &'static str,
    run: usize,
    messages: u64,
    /// Requests the webhook server received (more than `messages` on the retry path).
    requests: u64,
    /// Messages per second from the first to the last handled.
    rate: f64,
    /// Seconds from the first to the last handled.
    span: f64,
    /// Messages per second `publish` pre-loaded the queue at.
    preload_rate: f64,
    /// Highest VmHWM of the consumer process.
    peak_rss_mib: f64,
    /// CPU time (user + system) of the consumer process per 1,000 messages, start-up and
    /// shutdown included.
    cpu_ms_per_1k: f64,
    /// VmRSS at 10 %, 50 % and 90 % of the drain (webhook trials only).
    rss_mib_at: [Option<f64>; 3],
    /// The embedded broker's files over the trial.
    disk: Option<Disk>,
    /// The Redis server over the trial.
    redis: Option<RedisServer>,
}

/// MiB of the embedded broker's files (`broker.db`, `-wal`, `-shm`) over a trial.
#[derive(Debug, Clone, serde::Serialize)]
struct Disk {
    /// After the backlog was published and the publishing session closed.
    preloaded_mib: f64,
    /// The largest sampled while the consumer ran.
    peak_mib: f64,
    /// At the first sample with every message handled; of which the write-ahead log.
    drained_mib: f64,
    drained_wal_mib: f64,
    /// At the consumer's last sample (it exits once idle, or is stopped with `--linger`), and
    /// how long after the drained sample that was; of which the write-ahead log.
    last_mib: f64,
    last_wal_mib: f64,
    last_after_s: f64,
    /// Once the consumer has exited.
    exited_mib: f64,
}

/// The Redis server over a trial: its `used_memory` (MiB) and CPU time, the whole server's,
/// so whatever else uses it meanwhile is in the figures too; and the keys under the trial's
/// prefix.
#[derive(Debug, Clone, serde::Serialize)]
struct RedisServer {
    /// Before the topology was declared.
    before_mib: f64,
    /// After the backlog was published.
    preloaded_mib: f64,
    /// The backlog's share, per message: (preloaded − before) / messages.
    bytes_per_message: f64,
    /// Once the consumer has exited (its idempotency keys stay, until their time to live).
    drained_mib: f64,
    /// Keys under the prefix after the preload, and once the consumer has exited.
    preloaded_keys: usize,
    drained_keys: usize,
    /// The server's CPU time (user + system) from the preload's end to the consumer's exit,
    /// per 1,000 messages, and as a share of one core over the drain's span.
    cpu_ms_per_1k: f64,
    cpu_share: f64,
}

/// What a consumer is started against: the broker's URL and, for sluice, the `--dedup` store
/// (none: the broker's own).
struct Target {
    url: String,
    dedup: Option<String>,
}

struct Bench {
    args: Args,
    sink: Sink,
    trials: Vec<Trial>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.baseline.is_none() {
        eprintln!("the drain benchmark needs RabbitMQ and the baseline consumer: run scripts/bench.sh");
        return Ok(());
    }
    tokio::runtime::Runtime::new()?.block_on(async {
        let sink = Sink::start().await?;
        let mut bench = Bench { args, sink, trials: Vec::new() };
        bench.run_all().await?;
        print!("{}", bench.report());
        if let Some(path) = &bench.args.json {
            std::fs::write(path, serde_json::to_string_pretty(&bench.trials)?)?;
        }
        Ok(())
    })
}

impl Bench {
    fn wants(&self, part: Part) -> bool {
        self.args.only.is_empty() || self.args.only.contains(&part)
    }

    async fn run_all(&mut self) -> anyhow::Result<()> {
        let (n, runs, other_runs) = (self.args.messages, self.args.runs, self.args.other_runs);
        let mut queues = self.args.queues.clone();
        if self.wants(Part::Throughput) {
            let mut order = vec![Consumer::Baseline, Consumer::BaselineBatched, Consumer::Sluice];
            if self.args.candidate.is_some() {
                order.push(Consumer::Candidate);
            }
            if self.args.dedup_variants {
                order.extend([Consumer::SluiceNoDedup, Consumer::SluiceRedis]);
            }
            for run in 1..=runs {
                for &queue in &queues {
                    for &consumer in order.iter().filter(|c| c.drains(queue)) {
                        self.trial("throughput", run, queue, consumer, Handler::Webhook, n).await?;
                    }
                }
                // Who goes first changes every run, so drift on a noisy machine favours no one;
                // and which broker.
                order.rotate_left(1);
                queues.rotate_left(1);
            }
            queues = self.args.queues.clone();
        }
        if self.wants(Part::Retry) {
            for run in 1..=other_runs {
                for &queue in &queues {
                    let n = self.args.retry_messages;
                    self.trial("retry", run, queue, Consumer::Sluice, Handler::WebhookFailOnce, n).await?;
                }
            }
        }
        if self.wants(Part::Command) {
            for run in 1..=other_runs {
                for consumer in [Consumer::Baseline, Consumer::Sluice] {
                    let n = self.args.command_messages;
                    self.trial("command", run, QueueType::Classic, consumer, Handler::Command, n).await?;
                }
            }
        }
        if self.wants(Part::Memory) {
            let n = self.args.backlog;
            for queue in queues.into_iter().filter(|q| *q != QueueType::Classic) {
                self.trial("memory", 1, queue, Consumer::Sluice, Handler::Webhook, n).await?;
            }
        }
        Ok(())
    }

    /// Fresh vhost (or embedded broker), topology, backlog of `n`; then one consumer drains it.
    async fn trial(
        &mut self,
        part: &'static str,
        run: usize,
        queue: QueueType,
        consumer: Consumer,
        handler: Handler,
        n: u64,
    ) -> anyhow::Result<()> {
        let label = format!("[{part} {} {} run {run}]", queue.name(), consumer.name());
        let place = Place::new(queue, &self.args.redis)?;
        let redis_before = place.redis_usage()?;
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("bench.yaml"), self.pipeline(queue, handler, consumer))?;
        let preload_rate = place.load(dir.path(), EXCHANGE, ROUTING_KEY, n).await?;
        eprintln!("{label} pre-loaded {n} messages at {preload_rate:.0} msg/s");
        let preloaded = place.files().map(|f| place::disk_bytes(&f));
        let redis_preloaded = place.redis_usage()?;

        self.sink.reset(if handler == Handler::WebhookFailOnce { Mode::FailOnce } else { Mode::Ok });
        let cpu_before = usage::reaped_children_cpu();
        let linger = (part == "memory" && self.args.linger > 0.0).then(|| Duration::from_secs_f64(self.args.linger));
        // The idempotency store: by default the broker's own (the embedded broker's file, or
        // Redis under the trial's prefix), beside RabbitMQ a state directory of the trial's own;
        // the Redis store under a prefix of its own, deleted with the trial.
        let dedup_keys = (consumer == Consumer::SluiceRedis).then(|| keyspace::Keyspace::new(&self.args.redis));
        let dedup = match &dedup_keys {
            Some(keys) => Some(keys.url()),
            None if queue.is_amqp() => Some(format!("file:{}", dir.path().join("state").display())),
            None => None,
        };
        let target = Target { url: place.url(), dedup };
        let mut child = self.spawn(consumer, handler, dir.path(), &target, n, linger.is_none())?;
        let sink = self.sink.clone();
        let sampler = Sampler::start(child.id(), move || sink.snapshot().successes, place.files());
        let waited = self.wait(&mut child, handler, n, linger).await;
        let samples = sampler.finish();
        let cpu = usage::reaped_children_cpu() - cpu_before;
        if let Err(e) = waited {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(dir.path().join("consumer.log")).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(20)..].join("\n");
            bail!(
                "{label} {e:#}\nconsumer log (tail):\n{tail}\nkept for inspection: {} and {}",
                place.keep(),
                dir.keep().display()
            );
        }
        let (handled, requests, span) = match handler {
            Handler::Command => {
                let (handled, span) = self.command_span(consumer, &mut child, dir.path())?;
                (handled, handled, span)
            }
            Handler::Webhook | Handler::WebhookFailOnce => {
                let s = self.sink.snapshot();
                (s.successes, s.requests, s.span.context("no request reached the sink")?)
            }
        };
        if handled != n {
            bail!("{label} handled {handled} of {n} messages");
        }
        let rate = n as f64 / span.as_secs_f64();
        let redis = match (redis_before, redis_preloaded, place.redis_usage()?) {
            (Some((before, _)), Some((preloaded, preloaded_keys)), Some((drained, drained_keys))) => {
                let cpu = drained.cpu - preloaded.cpu;
                Some(RedisServer {
                    before_mib: before.memory as f64 / MIB,
                    preloaded_mib: preloaded.memory as f64 / MIB,
                    bytes_per_message: (preloaded.memory as f64 - before.memory as f64) / n as f64,
                    drained_mib: drained.memory as f64 / MIB,
                    preloaded_keys,
                    drained_keys,
                    cpu_ms_per_1k: cpu * 1e6 / n as f64,
                    cpu_share: cpu / span.as_secs_f64(),
                })
            }
            _ => None,
        };
        let trial = Trial {
            part,
            queue: queue.name(),
            consumer: consumer.name(),
            run,
            messages: n,
            requests,
            rate,
            span: span.as_secs_f64(),
            preload_rate,
            peak_rss_mib: usage::peak_mib(&samples),
            cpu_ms_per_1k: cpu.as_secs_f64() * 1e6 / n as f64,
            rss_mib_at: [0.1, 0.5, 0.9].map(|f| usage::rss_at(&samples, n, f)),
            disk: preloaded.and_then(|preloaded| disk(preloaded, &samples, n, place.files()?)),
            redis,
        };
        eprintln!(
            "{label} drained {n} in {:.2}s: {rate:.0} msg/s ({requests} requests), {:.0} CPU ms/1k msgs, peak RSS {:.1} MiB",
            trial.span, trial.cpu_ms_per_1k, trial.peak_rss_mib
        );
        if let Some(d) = &trial.disk {
            eprintln!("{label} broker files (MiB): {d:?}");
        }
        if let Some(r) = &trial.redis {
            eprintln!("{label} Redis server: {r:?}");
        }
        self.trials.push(trial);
        Ok(())
    }

    fn pipeline(&self, queue: QueueType, handler: Handler, consumer: Consumer) -> String {
        let idempotency = if consumer == Consumer::SluiceNoDedup { "    idempotency: {enabled: false}\n" } else { "" };
        let handler = match handler {
            Handler::Webhook | Handler::WebhookFailOnce => {
                format!("webhook: {{url: \"http://{}/hook\"}}", self.sink.addr)
            }
            Handler::Command => "command: {program: /bin/true}".to_string(),
        };
        format!(
            "version: 1
exchanges:
  {EXCHANGE}: {{type: direct}}
queues:
  {QUEUE}:
    type: {}
    bind: [{{exchange: {EXCHANGE}, routing_key: {ROUTING_KEY}}}]
    concurrency: {}
    handler:
      {handler}
    retry: {{max_attempts: 3, backoff: fixed, initial: 100ms, max: 100ms}}
{idempotency}",
            queue.declared(),
            self.args.concurrency
        )
    }

    fn spawn(
        &self,
        consumer: Consumer,
        handler: Handler,
        dir: &Path,
        target: &Target,
        n: u64,
        exit_when_idle: bool,
    ) -> anyhow::Result<Child> {
        let log = std::fs::File::create(dir.join("consumer.log"))?;
        let mut command = match consumer {
            Consumer::Baseline | Consumer::BaselineBatched => {
                let mut c = Command::new(self.args.baseline.as_ref().context("no --baseline")?);
                c.args([&target.url, QUEUE, &self.args.concurrency.to_string(), &n.to_string()]);
                match handler {
                    Handler::Command => c.args(["--command", "/bin/true"]),
                    _ => c.args(["--webhook".to_string(), format!("http://{}/hook", self.sink.addr)]),
                };
                if consumer == Consumer::BaselineBatched {
                    c.arg("--batched-acks");
                }
                c
            }
            Consumer::Sluice | Consumer::SluiceNoDedup | Consumer::SluiceRedis | Consumer::Candidate => {
                let program = match consumer {
                    Consumer::Candidate => self.args.candidate.as_ref().context("no --candidate")?,
                    _ => &self.args.sluice,
                };
                let mut c = Command::new(program);
                c.arg("run").arg(dir).args(["--broker", &target.url]);
                if exit_when_idle {
                    c.arg("--exit-when-idle");
                }
                // A build before the store moved into the broker's file keeps it in
                // `.sluice/dedup` below its working directory: the trial's.
                c.current_dir(dir);
                if let Some(dedup) = &target.dedup {
                    c.args(["--dedup", dedup]);
                }
                // The command figure is read from the per-message debug line (there is no
                // server to count at); webhook trials log at the default level.
                let filter = if handler == Handler::Command { "info,sluice::runtime::events=debug" } else { "info" };
                c.env("RUST_LOG", filter).env("NO_COLOR", "1");
                c
            }
        };
        let stdout = if handler == Handler::Command { Stdio::piped() } else { Stdio::null() };
        command
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {}", consumer.name()))
    }

    /// Waits until the sink has seen all `n` messages succeed (webhooks) and the consumer has
    /// exited on its own (or, with `linger`, been stopped that long after the last message).
    async fn wait(&self, child: &mut Child, handler: Handler, n: u64, linger: Option<Duration>) -> anyhow::Result<()> {
        let start = Instant::now();
        let (mut drained_at, mut stopped) = (None, false);
        loop {
            if let Some(linger) = linger.filter(|_| !stopped) {
                match drained_at {
                    None if self.sink.snapshot().successes >= n => drained_at = Some(Instant::now()),
                    Some(at) if at.elapsed() >= linger => {
                        // SAFETY: kill only sends a signal, to a child this driver started and has
                        // not reaped (so its pid is still its own).
                        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
                        stopped = true;
                    }
                    _ => {}
                }
            }
            if let Some(status) = child.try_wait()? {
                let seen = self.sink.snapshot().successes;
                if !status.success() {
                    bail!("the consumer exited with {status}");
                }
                if handler != Handler::Command && seen < n {
                    bail!("the consumer exited after {seen} of {n} messages");
                }
                return Ok(());
            }
            if start.elapsed() > TRIAL_DEADLINE {
                bail!("not drained within {TRIAL_DEADLINE:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Messages handled and first-to-last span of a command trial, as the consumer reports
    /// them: the baseline's summary line, sluice's per-message debug lines.
    fn command_span(&self, consumer: Consumer, child: &mut Child, dir: &Path) -> anyhow::Result<(u64, Duration)> {
        let (handled, first, last) = match consumer {
            Consumer::Baseline | Consumer::BaselineBatched => {
                let mut out = String::new();
                std::io::Read::read_to_string(&mut child.stdout.take().context("baseline stdout")?, &mut out)?;
                let summary: serde_json::Value = serde_json::from_str(out.trim()).context("baseline summary")?;
                let secs = |k: &str| summary[k].as_f64().map(|s| UNIX_EPOCH + Duration::from_secs_f64(s));
                (summary["handled"].as_u64().unwrap_or(0), secs("first"), secs("last"))
            }
            Consumer::Sluice | Consumer::SluiceNoDedup | Consumer::SluiceRedis | Consumer::Candidate => {
                let log = std::fs::read_to_string(dir.join("consumer.log"))?;
                handled_times(&log)
            }
        };
        let (Some(first), Some(last)) = (first, last) else { bail!("{} handled nothing", consumer.name()) };
        Ok((handled, last.duration_since(first)?))
    }

    fn report(&self) -> String {
        let mut out = String::new();
        let pick = |part: &str, queue: &str, consumer: &str| -> Vec<&Trial> {
            self.trials.iter().filter(|t| t.part == part && t.queue == queue && t.consumer == consumer).collect()
        };
        let _ = writeln!(out, "# sluice drain benchmark\n");
        let _ = writeln!(
            out,
            "{} cores; messages per throughput trial {}; throughput runs {}, other runs {}; concurrency/prefetch {}.\n",
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            self.args.messages,
            self.args.runs,
            self.args.other_runs,
            self.args.concurrency
        );
        for (part, title) in [
            ("throughput", "Webhook throughput (msg/s at the HTTP server, first to last)"),
            ("retry", "Retry path: every message fails once with 503 (msg/s = messages / span)"),
            ("command", "Command handler /bin/true (msg/s, first to last handled)"),
        ] {
            if !self.trials.iter().any(|t| t.part == part) {
                continue;
            }
            let _ = writeln!(out, "## {title}\n");
            let _ = writeln!(
                out,
                "| queue | consumer | median msg/s | min – max | runs | CPU ms / 1k msgs (median) | peak RSS MiB (max) |"
            );
            let _ = writeln!(out, "| --- | --- | ---: | ---: | ---: | ---: | ---: |");
            for queue in QUEUES {
                for consumer in
                    ["baseline", "baseline-batched", "sluice", "sluice-no-dedup", "sluice-redis", "candidate"]
                {
                    let trials = pick(part, queue, consumer);
                    if trials.is_empty() {
                        continue;
                    }
                    let rates: Vec<f64> = trials.iter().map(|t| t.rate).collect();
                    let peak = trials.iter().map(|t| t.peak_rss_mib).fold(0.0, f64::max);
                    let (lo, hi) = min_max(&rates);
                    let _ = writeln!(
                        out,
                        "| {queue} | {consumer} | {:.0} | {lo:.0} – {hi:.0} | {} | {:.0} | {peak:.1} |",
                        median(&rates),
                        rates.len(),
                        median_of(&trials, |t| t.cpu_ms_per_1k),
                    );
                }
            }
            let _ = writeln!(out);
            // The first is the headline; the next two split it into what the ack strategy does
            // and what sluice's per-message work costs.
            let comparisons = [
                ("sluice", "baseline"),
                ("baseline-batched", "baseline"),
                ("sluice", "baseline-batched"),
                ("candidate", "sluice"),
                ("sluice", "sluice-no-dedup"),
                ("sluice-redis", "sluice-no-dedup"),
                ("sluice-no-dedup", "baseline"),
            ];
            for (ours, theirs) in comparisons {
                for queue in QUEUES {
                    let (num, den) = (pick(part, queue, ours), pick(part, queue, theirs));
                    if num.is_empty() || den.is_empty() {
                        continue;
                    }
                    let (rate, per_run, cpu) = compare(&num, &den);
                    let _ = writeln!(
                        out,
                        "- {queue}: {ours} / {theirs} throughput = **{rate:.2}** (ratio of medians; per run: {per_run}); CPU per message {cpu:.2}×"
                    );
                }
            }
            // The same consumer on the embedded broker or Redis and on RabbitMQ's quorum queue.
            for (broker, whose) in [("embedded", "the embedded broker's work is in it"), ("redis", "Redis's is not")] {
                for consumer in ["sluice", "sluice-no-dedup", "sluice-redis", "candidate"] {
                    let (num, den) = (pick(part, broker, consumer), pick(part, "quorum", consumer));
                    if num.is_empty() || den.is_empty() {
                        continue;
                    }
                    let (rate, per_run, cpu) = compare(&num, &den);
                    let _ = writeln!(
                        out,
                        "- {consumer}: {broker} / quorum throughput = **{rate:.2}** (ratio of medians; per run: {per_run}); CPU per message of the consumer process {cpu:.2}× ({whose})"
                    );
                }
            }
            // Redis's CPU is outside the consumer's: the server's own account beside it.
            for consumer in ["sluice", "sluice-no-dedup", "sluice-redis", "candidate"] {
                let trials: Vec<&Trial> =
                    pick(part, "redis", consumer).into_iter().filter(|t| t.redis.is_some()).collect();
                if trials.is_empty() {
                    continue;
                }
                let server =
                    |value: fn(&RedisServer) -> f64| median_of(&trials, |t| t.redis.as_ref().map_or(0.0, value));
                let _ = writeln!(
                    out,
                    "- redis, {consumer}: the Redis server's CPU {:.0} ms / 1k msgs, {:.0} % of a core over the drain (medians; the whole server's)",
                    server(|r| r.cpu_ms_per_1k),
                    server(|r| r.cpu_share * 100.0)
                );
            }
            if part == "retry" {
                for queue in QUEUES {
                    let (retry, happy) = (pick("retry", queue, "sluice"), pick("throughput", queue, "sluice"));
                    if retry.is_empty() || happy.is_empty() {
                        continue;
                    }
                    let _ = writeln!(
                        out,
                        "- {queue}: retry path / happy path (sluice) = **{:.2}**; requests per message {:.2}",
                        median_of(&retry, |t| t.rate) / median_of(&happy, |t| t.rate),
                        retry[0].requests as f64 / retry[0].messages as f64
                    );
                }
            }
            let _ = writeln!(out);
        }
        for t in self.trials.iter().filter(|t| t.part == "memory") {
            let fmt = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.1}"));
            let _ = writeln!(out, "## Memory: sluice run draining a {} message {} backlog\n", t.messages, t.queue);
            let _ =
                writeln!(out, "| peak RSS (VmHWM) MiB | RSS at 10 % | at 50 % | at 90 % | msg/s | CPU ms / 1k msgs |");
            let _ = writeln!(out, "| ---: | ---: | ---: | ---: | ---: | ---: |");
            let [a, b, c] = t.rss_mib_at;
            let (peak, rate, cpu) = (t.peak_rss_mib, t.rate, t.cpu_ms_per_1k);
            let _ = writeln!(out, "| {peak:.1} | {} | {} | {} | {rate:.0} | {cpu:.0} |\n", fmt(a), fmt(b), fmt(c));
            if let Some(d) = &t.disk {
                let _ = writeln!(
                    out,
                    "Embedded broker's files (broker.db + -wal + -shm), MiB: {:.1} after the preload, peak {:.1} \
                     during the drain, {:.1} when drained (-wal {:.1}), {:.1} at the runner's last sample \
                     ({:.1} s later; -wal {:.1}), {:.1} after it exited.\n",
                    d.preloaded_mib,
                    d.peak_mib,
                    d.drained_mib,
                    d.drained_wal_mib,
                    d.last_mib,
                    d.last_after_s,
                    d.last_wal_mib,
                    d.exited_mib
                );
            }
            if let Some(r) = &t.redis {
                let _ = writeln!(
                    out,
                    "Redis used_memory, MiB: {:.1} before, {:.1} after the preload ({:.0} bytes per message; \
                     {} keys under the prefix), {:.1} after the runner exited ({} keys). The server's CPU: \
                     {:.0} ms / 1k msgs, {:.0} % of a core over the drain.\n",
                    r.before_mib,
                    r.preloaded_mib,
                    r.bytes_per_message,
                    r.preloaded_keys,
                    r.drained_mib,
                    r.drained_keys,
                    r.cpu_ms_per_1k,
                    r.cpu_share * 100.0
                );
            }
        }
        let preload: Vec<f64> = self.trials.iter().map(|t| t.preload_rate).collect();
        if !preload.is_empty() {
            let _ = writeln!(
                out,
                "Pre-loading (library publish with confirms, 256 in flight): median {:.0} msg/s.\n",
                median(&preload)
            );
        }
        let stamp = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let _ = writeln!(out, "_Run finished at Unix time {stamp}._");
        out
    }
}

const MIB: f64 = 1024.0 * 1024.0;

/// The embedded broker's file sizes over a trial, from the samples taken while the consumer ran.
fn disk(preloaded: u64, samples: &[usage::Sample], n: u64, db: std::path::PathBuf) -> Option<Disk> {
    let sized: Vec<(&usage::Sample, (u64, u64))> = samples.iter().filter_map(|s| Some((s, s.disk_bytes?))).collect();
    let (drained, (drained_bytes, drained_wal)) = *sized.iter().find(|(s, _)| s.handled >= n)?;
    let (last, (last_bytes, last_wal)) = *sized.last()?;
    Some(Disk {
        preloaded_mib: preloaded as f64 / MIB,
        peak_mib: sized.iter().map(|(_, (b, _))| *b).max()? as f64 / MIB,
        drained_mib: drained_bytes as f64 / MIB,
        drained_wal_mib: drained_wal as f64 / MIB,
        last_mib: last_bytes as f64 / MIB,
        last_wal_mib: last_wal as f64 / MIB,
        last_after_s: last.at.duration_since(drained.at).as_secs_f64(),
        exited_mib: place::disk_bytes(&db) as f64 / MIB,
    })
}

/// Count, first and last timestamp of sluice's `handled` debug lines.
fn handled_times(log: &str) -> (u64, Option<SystemTime>, Option<SystemTime>) {
    let mut count = 0;
    let (mut first, mut last) = (None, None);
    for line in log.lines().filter(|l| l.contains(" handled ") || l.ends_with(" handled")) {
        let Some(stamp) = line.split_whitespace().next() else { continue };
        let Ok(t) = humantime::parse_rfc3339_weak(stamp) else { continue };
        count += 1;
        first = Some(first.map_or(t, |f: SystemTime| f.min(t)));
        last = Some(last.map_or(t, |l: SystemTime| l.max(t)));
    }
    (count, first, last)
}

/// `num` against `den`: the ratio of their median rates, the ratio of each run's pair, and
/// the ratio of their median CPU per message.
fn compare(num: &[&Trial], den: &[&Trial]) -> (f64, String, f64) {
    let per_run: Vec<String> = den
        .iter()
        .filter_map(|d| num.iter().find(|n| n.run == d.run).map(|n| format!("{:.2}", n.rate / d.rate)))
        .collect();
    let cpu = |ts: &[&Trial]| median_of(ts, |t| t.cpu_ms_per_1k);
    (median_of(num, |t| t.rate) / median_of(den, |t| t.rate), per_run.join(", "), cpu(num) / cpu(den))
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn median_of(trials: &[&Trial], value: impl Fn(&Trial) -> f64) -> f64 {
    median(&trials.iter().map(|t| value(t)).collect::<Vec<_>>())
}

fn min_max(values: &[f64]) -> (f64, f64) {
    values.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}
