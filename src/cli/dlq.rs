//! `sluice dlq list|show|redrive|purge QUEUE` and `sluice status`: the operator's commands,
//! printed as tables or JSON. The work is `ops`'s; this resolves the queue's dead-letter queue
//! from the pipeline files, connects, and prints.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context as _, bail};
use indicatif::ProgressBar;

use super::reads::{self, Reads};
use super::{BrokerArg, Refusals, output, parse_duration};
use crate::admin::api::Connect;
use crate::app;
use crate::broker::{BrokerError, Operate};
use crate::config::{self, Config, RateLimit};
use crate::ops::dlq::{self, Action, Entry, Filter, Unread};
use crate::ops::status::{self, Status};
use crate::terminal::visible;

/// Table or JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
}

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// The dead-lettered messages of QUEUE: id, type, reason, error, attempts, when, key, age.
    List {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: FilterArgs,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// One dead-lettered message of QUEUE, headers and body.
    Show {
        #[command(flatten)]
        target: Target,
        /// The message id.
        id: String,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Send dead-lettered messages back to QUEUE as first attempts; each leaves the
    /// dead-letter queue once its copy is confirmed.
    Redrive {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: FilterArgs,
        /// Only say which messages would go.
        #[arg(long)]
        dry_run: bool,
        /// At most this many messages a second, e.g. 100/s.
        #[arg(long, value_parser = parse_rate)]
        rate: Option<NonZeroU32>,
    },
    /// Delete dead-lettered messages of QUEUE.
    Purge {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        filter: FilterArgs,
        /// Delete for real (without it, nothing is deleted).
        #[arg(long)]
        yes: bool,
        /// Only say which messages would go.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Which queue, on which broker.
#[derive(Debug, clap::Args)]
pub struct Target {
    /// The pipeline queue (`orders.charge`), not its dead-letter queue.
    queue: String,
    /// The pipeline files that name the queue's dead-letter queue (default `<QUEUE>.dlq` when
    /// the path does not exist).
    #[arg(long, default_value = crate::config::source::DEFAULT_DIR)]
    pipelines: Vec<PathBuf>,
    #[command(flatten)]
    broker: BrokerArg,
}

#[derive(Debug, clap::Args)]
pub struct FilterArgs {
    /// Only messages dead-lettered for this reason (permanent, exhausted, malformed, schema,
    /// template, signing, too_large, internal, or the broker's: delivery_limit, maxlen, ...).
    #[arg(long)]
    reason: Option<String>,
    /// Only messages that failed within this long, e.g. 1h.
    #[arg(long, value_parser = parse_duration)]
    since: Option<Duration>,
    /// Only these message ids (repeatable).
    #[arg(long = "id")]
    ids: Vec<String>,
    /// At most this many messages.
    #[arg(long)]
    limit: Option<usize>,
}

impl From<FilterArgs> for Filter {
    fn from(a: FilterArgs) -> Filter {
        Filter { reason: a.reason, since: a.since, ids: a.ids, limit: a.limit }
    }
}

fn parse_rate(text: &str) -> Result<NonZeroU32, String> {
    match RateLimit::parse(text) {
        Some(r) if r.per == Duration::from_secs(1) => Ok(r.count),
        _ => Err(format!("\"{text}\" is not a rate such as 500/s")),
    }
}

impl Target {
    /// The queue's dead-letter queue, as the pipeline files name it.
    fn dead_letter_queue(&self) -> anyhow::Result<String> {
        if !self.pipelines.iter().any(|p| p.exists()) {
            return Ok(format!("{}.dlq", self.queue));
        }
        let config = load(&self.pipelines, "dlq")?;
        match config.queues.get(&self.queue) {
            Some(q) => Ok(q.dead_letter.clone()),
            None => bail!(
                "no queue \"{}\" in {}{} (name the pipeline queue, not its dead-letter queue; --pipelines DIR says where the files are)",
                self.queue,
                paths(&self.pipelines),
                config::suggest::did_you_mean(&self.queue, config.queues.keys().map(String::as_str)),
            ),
        }
    }
}

fn paths(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// The pipeline files, for the queues' names and their dead-letter queues' (all `command`
/// reads of them).
fn load(paths: &[PathBuf], command: &str) -> anyhow::Result<Config> {
    reads::load_for(paths, 1, command, Reads::DeadLetters)
        .with_context(|| format!("invalid pipeline files in {}", self::paths(paths)))
}

/// Runs `sluice dlq ...`.
pub async fn dlq(command: Command) -> anyhow::Result<()> {
    match command {
        Command::List { target, filter, format } => {
            let dlq = target.dead_letter_queue()?;
            let filter = filter.into();
            let read = target.broker.read_only(async |file| dlq::list_read_only(file, &dlq, &filter).await).await?;
            let (entries, tally) = match read {
                Some(read) => read,
                None => target.broker.assemble(List { dlq: &dlq, filter: &filter }).await?,
            };
            match format {
                Format::Json => output::stdout(&format!("{}\n", serde_json::to_string_pretty(&entries)?))?,
                Format::Text => output::stdout(&table(&entries))?,
            }
            unread_note(&tally, &dlq);
            Ok(())
        }
        Command::Show { target, id, format } => {
            let dlq = target.dead_letter_queue()?;
            let read = target.broker.read_only(async |file| dlq::show_read_only(file, &dlq, &id).await).await?;
            let shown = match read {
                Some(shown) => shown,
                None => target.broker.assemble(Show { dlq: &dlq, id: &id }).await?,
            };
            let shown = shown.with_context(|| format!("no message with id \"{id}\" in {dlq}"))?;
            let text = match format {
                Format::Json => format!("{}\n", serde_json::to_string_pretty(&shown)?),
                Format::Text => {
                    let mut text = table(std::slice::from_ref(&shown.entry));
                    text.push_str("\nheaders:\n");
                    for (name, value) in &shown.headers {
                        text.push_str(&format!("  {}: {}\n", visible(name), visible(&value.to_string())));
                    }
                    // JSON escapes the ASCII controls in strings, but not DEL or the C1 controls.
                    text.push_str("\nbody:\n");
                    for line in serde_json::to_string_pretty(&shown.body)?.lines() {
                        text.push_str(&format!("{}\n", visible(line)));
                    }
                    text
                }
            };
            output::stdout(&text)?;
            Ok(())
        }
        Command::Redrive { target, filter, dry_run, rate } => {
            apply(target, Action::Redrive, filter.into(), dry_run, rate).await
        }
        Command::Purge { target, filter, yes, dry_run } => {
            if !yes && !dry_run {
                bail!("purge deletes messages for good: add --yes (or see them first with --dry-run)");
            }
            apply(target, Action::Purge, filter.into(), dry_run, None).await
        }
    }
}

/// `dlq list` on a broker that takes sessions.
struct List<'a> {
    dlq: &'a str,
    filter: &'a Filter,
}

impl app::Job for List<'_> {
    type Output = (Vec<Entry>, dlq::Tally);

    async fn run<B: Operate>(self, sessions: app::Sessions<'_, B>, _: Connect<B>) -> anyhow::Result<Self::Output> {
        app::once(sessions, async |broker| dlq::list(broker, self.dlq, self.filter).await).await
    }
}

/// `dlq show` on a broker that takes sessions.
struct Show<'a> {
    dlq: &'a str,
    id: &'a str,
}

impl app::Job for Show<'_> {
    type Output = Option<dlq::Shown>;

    async fn run<B: Operate>(self, sessions: app::Sessions<'_, B>, _: Connect<B>) -> anyhow::Result<Self::Output> {
        app::once(sessions, async |broker| dlq::show(broker, self.dlq, self.id).await).await
    }
}

async fn apply(
    target: Target,
    action: Action,
    filter: Filter,
    dry_run: bool,
    rate: Option<NonZeroU32>,
) -> anyhow::Result<()> {
    let dlq = target.dead_letter_queue()?;
    // A bar only on a terminal (indicatif draws nothing otherwise); its length is the queue's
    // depth, the most a filter can select.
    let bar = ProgressBar::no_length();
    let progress = |t: &dlq::Tally| {
        bar.set_length(u64::from(t.queued));
        bar.set_position(t.done as u64);
    };
    // A session lost mid-run (a cluster node gone) is followed by one with the next node, and
    // the job carries on: what was confirmed and acked is gone from the dead-letter queue, what
    // was not is handed back and read again (a copy confirmed but not acked goes twice; its
    // idempotency key stops the second run).
    let job = dlq::Job { queue: &target.queue, dlq: &dlq, action, filter, dry_run, rate };
    let result = target.broker.assemble(Apply { job, progress: &progress }).await?;
    bar.finish_and_clear();
    let tally = result.with_context(|| format!("stopped; the messages not yet moved are still in {dlq}"))?;
    let verb = match (action, dry_run) {
        (Action::Redrive, false) => format!("redriven to {}", target.queue),
        (Action::Purge, false) => "purged".to_string(),
        (Action::Redrive, true) => format!("would be redriven to {} (dry run)", target.queue),
        (Action::Purge, true) => "would be purged (dry run)".to_string(),
    };
    let count = if dry_run { tally.selected } else { tally.done };
    output::stdout(&format!("{count} message(s) {verb}; {} read from {dlq}\n", tally.read))?;
    unread_note(&tally, &dlq);
    Ok(())
}

/// Says why a pass read fewer messages than `dlq` held when it began, and what other consumers
/// held that it could not read.
fn unread_note(tally: &dlq::Tally, dlq: &str) {
    if let Some(leased) = tally.leased {
        output::stderr(&format!(
            "note: {} message(s) of {dlq} were not read: a consumer holds them under a lease (a `sluice dlq` killed \
             mid-run, or one still running) that runs out by {}; run again then\n",
            leased.count,
            crate::envelope::rfc3339_seconds(leased.until)
        ));
    }
    let why = match tally.unread_because {
        Some(Unread::PassedOver) => format!(
            "more than {} were passed over at once; narrow the filter, or act on some and run again",
            dlq::MAX_HELD
        ),
        Some(Unread::Elsewhere) => "the broker had none left ready: another client (a runner, another `sluice dlq`) \
                                    took or holds them, or they were removed meanwhile"
            .to_string(),
        Some(Unread::Limit) => "the list stopped at its --limit".to_string(),
        Some(Unread::Held { consumers }) => {
            return output::stderr(&format!(
                "note: {dlq} had no message ready: {consumers} other consumer(s) of it (another `sluice dlq` redriving or purging, say) hold what it has; run again once they are done\n"
            ));
        }
        None => return,
    };
    output::stderr(&format!("note: {} message(s) of {dlq} not read: {why}\n", tally.unread));
}

/// Entries as an aligned table, one line each: what came with the message is shown escaped.
fn table(entries: &[Entry]) -> String {
    let header = ["ID", "TYPE", "REASON", "ATTEMPTS", "FAILED-AT", "AGE", "IDEMPOTENCY-KEY", "ERROR"];
    let rows: Vec<[String; 8]> = entries
        .iter()
        .map(|e| {
            let or_dash = |v: &Option<String>| v.as_deref().map_or("-".into(), |v| visible(v).into_owned());
            [
                or_dash(&e.id),
                or_dash(&e.kind),
                or_dash(&e.reason),
                e.attempts.map_or("-".into(), |a| a.to_string()),
                or_dash(&e.failed_at),
                e.age_seconds.map_or("-".into(), age),
                or_dash(&e.idempotency_key),
                or_dash(&e.error),
            ]
        })
        .collect();
    aligned(&header, &rows)
}

/// An age in its two largest units, one word: `45s`, `1m30s`, `2d3h`.
fn age(seconds: u64) -> String {
    let units = [(86_400, "d"), (3_600, "h"), (60, "m"), (1, "s")];
    let first = units.iter().position(|(n, _)| seconds >= *n).unwrap_or(units.len() - 1);
    let mut text = String::new();
    let mut rest = seconds;
    for (n, unit) in &units[first..(first + 2).min(units.len())] {
        if rest / n > 0 || text.is_empty() {
            text.push_str(&format!("{}{unit}", rest / n));
        }
        rest %= n;
    }
    text
}

/// Rows under a header, columns padded to their widest cell (the last one not padded).
fn aligned<const N: usize>(header: &[&str; N], rows: &[[String; N]]) -> String {
    let mut widths = header.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == N {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        out.trim_end().to_string() + "\n"
    };
    let mut text = line(header.to_vec());
    for row in rows {
        text.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    text
}

/// A redrive or purge, carried on over lost sessions.
struct Apply<'a, P> {
    job: dlq::Job<'a>,
    /// Told the tally so far, as the job goes.
    progress: &'a P,
}

impl<P: Fn(&dlq::Tally) + Sync> app::Job for Apply<'_, P> {
    type Output = Result<dlq::Tally, BrokerError>;

    async fn run<B: Operate>(self, mut sessions: app::Sessions<'_, B>, _: Connect<B>) -> anyhow::Result<Self::Output> {
        let Apply { mut job, progress } = self;
        let mut tally = dlq::Tally::default();
        // After a lost session: how many messages the dead-letter queue should hold again.
        let mut expected = None;
        let mut refusals = Refusals::default();
        let result = loop {
            let (broker, _) = sessions.open().await?;
            let done = Mutex::new(dlq::Tally::default());
            let report = |t: &dlq::Tally| {
                *done.lock().unwrap_or_else(PoisonError::into_inner) = *t;
                progress(&tally.and(t));
            };
            let result = async {
                if let Some(expected) = expected {
                    dlq::handed_back(&broker, job.dlq, expected, dlq::HAND_BACK).await?;
                }
                dlq::apply(&broker, &job, &report).await
            }
            .await;
            broker.close().await;
            match result {
                Ok(t) => break Ok(tally.and(&t)),
                Err(e) if job.dry_run => break Err(e),
                Err(e) => {
                    let t = *done.lock().unwrap_or_else(PoisonError::into_inner);
                    if t.done > 0 {
                        refusals.progressed();
                    }
                    let wait = match refusals.again(&e) {
                        _ if e.is_session_loss() => None,
                        Some(wait) => Some(wait),
                        None => break Err(e),
                    };
                    tally = tally.and(&t);
                    job.filter.limit = job.filter.limit.map(|limit| limit.saturating_sub(t.done));
                    expected = Some(tally.queued.saturating_sub(u32::try_from(tally.done).unwrap_or(u32::MAX)));
                    if let Some(wait) = wait {
                        // The refused copies' messages were handed back when the session closed.
                        tracing::warn!(error = %e, done = tally.done, "the broker refused copies; trying them again");
                        tokio::time::sleep(wait).await;
                    } else {
                        tracing::warn!(error = %e, done = tally.done, "broker session lost mid-run; carrying on with the next node");
                        if let Err(e) = sessions.lost(e) {
                            break Err(e);
                        }
                    }
                }
            }
        };
        Ok(result)
    }
}

/// Runs `sluice status`; `admin` names the runners whose held deliveries fill UNACKED.
pub async fn status(paths: &[PathBuf], broker: BrokerArg, admin: &[String], format: Format) -> anyhow::Result<()> {
    let config = load(paths, "status")?;
    let runners = if admin.is_empty() { None } else { Some(runners(admin).await?) };
    let held = runners.as_ref().map(|(held, _)| held);
    let read = broker.read_only(async |file| status::read(file, &config, held).await).await?;
    let status = match read {
        Some(status) => status,
        None => {
            let nodes = runners.as_ref().map(|(_, nodes)| nodes);
            broker.assemble(ReadStatus { config: &config, held, runners: nodes }).await?
        }
    };
    match format {
        Format::Json => output::stdout(&format!("{}\n", serde_json::to_string_pretty(&status)?))?,
        Format::Text => output::stdout(&status_table(&status))?,
    }
    Ok(())
}

/// `sluice status` on a broker that takes sessions: the queues, and on a cluster, which node
/// they were read from.
struct ReadStatus<'a> {
    config: &'a Config,
    held: Option<&'a BTreeMap<String, status::Held>>,
    /// The broker node each runner is on.
    runners: Option<&'a BTreeMap<String, Option<String>>>,
}

impl app::Job for ReadStatus<'_> {
    type Output = Status;

    async fn run<B: Operate>(self, mut sessions: app::Sessions<'_, B>, _: Connect<B>) -> anyhow::Result<Status> {
        let (session, node) = sessions.open().await?;
        let read = status::read(&mut status::Session(&session), self.config, self.held).await;
        session.close().await;
        let mut status = read?;
        if sessions.names().len() > 1 {
            let (nodes, read_from) = (sessions.names().to_vec(), sessions.names()[node].clone());
            let runners = self.runners.cloned().unwrap_or_default();
            status.cluster = Some(status::Cluster { read_from, nodes, runners });
        }
        Ok(status)
    }
}

/// What the runners say of each queue (held deliveries, breaker, pause), and the broker node
/// each is on, over their `/metrics`.
type Runners = (BTreeMap<String, status::Held>, BTreeMap<String, Option<String>>);

async fn runners(admin: &[String]) -> anyhow::Result<Runners> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    let (mut held, mut nodes) = (BTreeMap::new(), BTreeMap::new());
    for addr in admin {
        let url = format!("http://{addr}/metrics");
        let text =
            async { client.get(&url).send().await?.error_for_status()?.text().await }.await.with_context(|| {
                format!("cannot read the runner's metrics at {url} (is `sluice run --admin {addr}` running?)")
            })?;
        status::add_runner(&text, &mut held);
        nodes.insert(addr.clone(), status::connected_node(&text));
    }
    Ok((held, nodes))
}

fn status_table(status: &Status) -> String {
    let header = ["QUEUE", "READY", "UNACKED", "CONSUMERS", "DEAD-LETTERED", "OLDEST-DEAD-LETTER", "CIRCUIT"];
    let rows: Vec<[String; 7]> = status
        .queues
        .iter()
        .map(|r| {
            [
                r.queue.clone(),
                r.ready.to_string(),
                r.unacked.map_or("-".into(), |n| n.to_string()),
                r.consumers.to_string(),
                r.dead_lettered.to_string(),
                r.oldest_dead_letter_age_seconds.map_or("-".into(), age),
                match (r.circuit, r.paused) {
                    (_, Some(true)) => "paused".into(),
                    (Some(circuit), _) => circuit.into(),
                    (None, _) => "-".into(),
                },
            ]
        })
        .collect();
    let mut text = aligned(&header, &rows);
    text.push_str(&format!("\nretries waiting (all queues): {}\n", status.retries_waiting));
    if let Some(cluster) = &status.cluster {
        text.push_str(&format!("broker nodes: {} (read from {})\n", cluster.nodes.join(", "), cluster.read_from));
        for (runner, node) in &cluster.runners {
            let node = node.as_deref().unwrap_or("none (reconnecting)");
            text.push_str(&format!("runner {runner}: connected to {node}\n"));
        }
    }
    if status.queues.iter().any(|r| r.unacked.is_none()) {
        text.push_str("UNACKED: name the runners with --admin HOST:PORT to count what they hold\n");
    }
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn ages_are_one_word_in_their_two_largest_units() {
        let cases =
            [(0, "0s"), (45, "45s"), (90, "1m30s"), (120, "2m"), (3_600, "1h"), (3_660, "1h1m"), (180_000, "2d2h")];
        for (seconds, text) in cases {
            assert_eq!(super::age(seconds), text, "{seconds}");
        }
    }
}
