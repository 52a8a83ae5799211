//! `sluice dlq`: read, redrive and purge the copies in a queue's dead-letter queue.
//!
//! Reading never loses a message or its place: the dead-letter queue is browsed (a consumer
//! that holds what it reads without acknowledging it; closing it hands the rest back in their
//! order), or, on the embedded broker, its file is read without writing (`list`, `show` and
//! `status` take nothing there). A message leaves the dead-letter queue only once its redriven
//! copy is confirmed, so a crash mid-redrive loses nothing: at worst a message is both
//! redriven and still there, and its idempotency key absorbs the second run (on Redis, not
//! even that: the copy and the removal are one step). A redriven copy is a new first attempt;
//! its key was released when it was dead-lettered, so it runs.
//!
//! Generic over the broker; printing is the CLI's.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt as _;
use governor::{DefaultDirectRateLimiter, Quota};
use serde::Serialize;
use serde_json::Value;
use tokio::task::{JoinError, JoinSet};

use crate::broker::{BrokerError, Consumer, Credit, Delivery, Edits, HeaderValue, Leased, Operate, embedded};
use crate::envelope::{self, Envelope};

/// The most messages held (read, not removed) at once. A filter that passes over more than
/// this stops there and says so.
pub const MAX_HELD: u16 = u16::MAX;

/// How long a browse waits for the next message before asking the broker whether any is left
/// to come: a slow delivery (a large message, a busy broker) is waited for while the queue has
/// messages ready; once it has none, the rest is held by another client (not delivered until
/// it lets them go) or gone.
const QUIET: Duration = Duration::from_secs(2);

/// Redrive copies awaiting their confirms at once. Also the bound on what a crash can leave
/// both redriven and still dead-lettered (with the confirmed copies not yet acked): more bought
/// little speed (BENCHMARKS.md).
const IN_FLIGHT: usize = 256;

/// Body bytes a redrive or purge holds at once (copies awaiting their confirms, confirmed ones
/// awaiting their ack), whatever the messages' size: memory stays bounded by a few of them.
const HELD_BYTES: usize = 16 << 20;

/// One dead-lettered message, as `sluice dlq list` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub reason: Option<String>,
    pub error: Option<String>,
    pub attempts: Option<i64>,
    /// RFC 3339, seconds.
    pub failed_at: Option<String>,
    pub idempotency_key: Option<String>,
    /// Seconds since it failed.
    pub age_seconds: Option<u64>,
    #[serde(skip)]
    failed_epoch: Option<u64>,
}

/// One message whole, as `sluice dlq show` prints it.
#[derive(Debug, Serialize)]
pub struct Shown {
    #[serde(flatten)]
    pub entry: Entry,
    pub headers: BTreeMap<String, Value>,
    /// The body as JSON when it is JSON, else as text.
    pub body: Value,
}

/// Which dead-lettered messages an operation takes.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// The reason (`permanent`, `exhausted`, ..., or the broker's own, e.g. `delivery_limit`).
    pub reason: Option<String>,
    /// Failed no longer ago than this.
    pub since: Option<Duration>,
    /// These message ids only (any, when empty).
    pub ids: Vec<String>,
    /// At most this many.
    pub limit: Option<usize>,
}

impl Filter {
    fn selects(&self, entry: &Entry, now: u64) -> bool {
        self.reason.as_ref().is_none_or(|r| entry.reason.as_ref() == Some(r))
            && self
                .since
                .is_none_or(|since| entry.failed_epoch.is_some_and(|t| now.saturating_sub(t) <= since.as_secs()))
            && (self.ids.is_empty() || entry.id.as_ref().is_some_and(|id| self.ids.contains(id)))
    }

    fn is_full(&self, taken: usize) -> bool {
        self.limit.is_some_and(|limit| taken >= limit)
    }
}

/// What a pass over a dead-letter queue did.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct Tally {
    /// Messages in the dead-letter queue when the pass began: how many it reads at most.
    pub queued: u32,
    /// Messages read.
    pub read: usize,
    /// Messages the filter selected (redriven or purged unless a dry run).
    pub selected: usize,
    /// Messages that were moved or removed.
    pub done: usize,
    /// Messages never read: the pass stopped at its filter's limit, or early.
    pub unread: u32,
    /// Why the pass stopped early, when it did.
    pub unread_because: Option<Unread>,
    /// Messages of the dead-letter queue that consumers held under a lease when the pass
    /// began, which it could not read (those of a `sluice dlq` killed mid-run).
    pub leased: Option<Leased>,
}

/// Why a pass read fewer messages than the dead-letter queue held when it began.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Unread {
    /// [`MAX_HELD`] messages were read and held (passed over) at once: the broker delivers no
    /// more until some are let go.
    PassedOver,
    /// The broker had none left ready: another client took or holds the rest (a runner,
    /// another `sluice dlq`), or removed them meanwhile.
    Elsewhere,
    /// None was ready when the pass began, and other consumers were attached: they hold what
    /// the queue has (another `sluice dlq` redriving, say), how many the broker cannot say.
    Held { consumers: u32 },
    /// The list stopped at its filter's limit (`--limit`).
    Limit,
}

impl Tally {
    /// This pass followed by `next`, over the same dead-letter queue.
    pub fn and(&self, next: &Tally) -> Tally {
        Tally {
            queued: self.queued.max(next.queued),
            read: self.read + next.read,
            selected: self.selected + next.selected,
            done: self.done + next.done,
            unread: next.unread,
            unread_because: next.unread_because,
            leased: next.leased,
        }
    }
}

/// Seconds since the epoch.
fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn text(headers: &BTreeMap<String, Value>, name: &str) -> Option<String> {
    match headers.get(name)? {
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

/// What a delivery says of its failure: sluice's headers, else what the broker recorded when it
/// dead-lettered the message itself (a quorum queue's delivery limit, a full queue).
pub fn describe<D: Delivery>(delivery: &D, now: u64) -> Entry {
    let headers = delivery.headers();
    let death = delivery.dead_letter_record().unwrap_or_default();
    let envelope = Envelope::decode(delivery.body()).ok();
    let failed_epoch = text(&headers, envelope::FAILED_AT_HEADER)
        .and_then(|t| humantime::parse_rfc3339(&t).ok())
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_secs())
        .or(death.time);
    Entry {
        id: delivery.message_id().map(str::to_string).or_else(|| envelope.as_ref().map(|e| e.id.clone())),
        // Outside an envelope (a queue of another format), the broker's type.
        kind: envelope.as_ref().map(|e| e.kind.clone()).or_else(|| delivery.kind().map(str::to_string)),
        reason: text(&headers, envelope::REASON_HEADER).or(death.reason),
        error: text(&headers, envelope::ERROR_HEADER),
        attempts: headers.get(envelope::ATTEMPTS_HEADER).and_then(Value::as_i64).or(death.count),
        failed_at: failed_epoch.map(envelope::rfc3339_seconds),
        idempotency_key: envelope.as_ref().map(|e| e.idempotency_key().to_string()),
        age_seconds: failed_epoch.map(|t| now.saturating_sub(t)),
        failed_epoch,
    }
}

/// A browse of a dead-letter queue: each message once, in order, up to the depth it had when
/// the browse began (later arrivals wait for the next run). However long a delivery takes, it
/// reads on while the broker has messages ready.
struct Browse<B: Operate> {
    broker: B,
    queue: String,
    deliveries: B::Deliveries,
    consumer: B::Consumer,
    remaining: u32,
    /// Messages read and not acked; the broker delivers no more once `window` are.
    held: u32,
    window: u16,
    /// Why it ended before `remaining` reached 0, once it has.
    short: Option<Unread>,
    /// What other consumers held under a lease when it began.
    leased: Option<Leased>,
}

impl<B: Operate> Browse<B> {
    async fn open(broker: &B, dlq: &str) -> Result<Browse<B>, BrokerError> {
        // First: on the embedded broker it hands back what dead processes held, to be counted
        // ready below and read.
        let leased = broker.leased(dlq).await?;
        let stats = broker.stats(dlq).await?;
        let mut browse = Browse::start(broker, dlq, stats.ready, MAX_HELD).await?;
        browse.leased = leased;
        if stats.ready == 0 && stats.consumers > 0 && leased.is_none() {
            browse.short = Some(Unread::Held { consumers: stats.consumers });
        }
        Ok(browse)
    }

    /// A browse of at most `remaining` messages, `window` held at once.
    async fn start(broker: &B, dlq: &str, remaining: u32, window: u16) -> Result<Browse<B>, BrokerError> {
        let (deliveries, consumer) = broker.browse(dlq, Credit::at_most(window)).await?;
        let (broker, queue) = (broker.clone(), dlq.to_string());
        Ok(Browse { broker, queue, deliveries, consumer, remaining, held: 0, window, short: None, leased: None })
    }

    async fn next(&mut self) -> Result<Option<B::Delivery>, BrokerError> {
        // Set once the broker said it has none ready: a delivery may still be on its way, so
        // the browse ends only after one more quiet wait.
        let mut none_ready = false;
        while self.remaining > 0 {
            if self.held >= u32::from(self.window) {
                self.short = Some(Unread::PassedOver);
                return Ok(None);
            }
            match tokio::time::timeout(QUIET, self.deliveries.next()).await {
                Ok(Some(delivery)) => {
                    self.remaining -= 1;
                    self.held += 1;
                    return delivery.map(Some);
                }
                Ok(None) => {
                    return Err(BrokerError::Lost(
                        format!(
                            "the broker ended the browse of \"{}\" with {} message(s) not read",
                            self.queue, self.remaining
                        )
                        .into(),
                    ));
                }
                Err(_) if none_ready => {
                    self.short = Some(Unread::Elsewhere);
                    return Ok(None);
                }
                Err(_) => none_ready = self.broker.depth(&self.queue).await? == 0,
            }
        }
        Ok(None)
    }

    /// Lets go of `removed` deliveries the broker removed with their copies, and acks `read`
    /// ones: they leave the queue.
    async fn settle(&mut self, read: &[B::Delivery], removed: usize) -> Result<(), BrokerError> {
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        self.held = self.held.saturating_sub(count(removed));
        if !read.is_empty() {
            self.consumer.ack(read).await?;
            self.held = self.held.saturating_sub(count(read.len()));
        }
        Ok(())
    }

    /// Hands back every message not taken, in order; how many were never read, and why.
    async fn close(self) -> (u32, Option<Unread>) {
        self.consumer.close().await;
        let said = |short: &Unread| self.remaining > 0 || matches!(short, Unread::Held { .. });
        (self.remaining, self.short.filter(said))
    }
}

/// What `list`, `show` and `head` read a dead-letter queue with: a [`Browse`] (a consumer
/// that hands back what it read), or the embedded broker's file read without taking anything
/// ([`embedded::Messages`]).
pub trait Reading {
    type Delivery: Delivery;

    /// The next message, in queue order; none once the pass ends.
    fn next(&mut self) -> impl Future<Output = Result<Option<Self::Delivery>, BrokerError>>;

    /// Ends the pass: how many messages it never read, and why.
    fn close(self) -> impl Future<Output = (u32, Option<Unread>)>;
}

impl<B: Operate> Reading for Browse<B> {
    type Delivery = B::Delivery;

    async fn next(&mut self) -> Result<Option<B::Delivery>, BrokerError> {
        Browse::next(self).await
    }

    async fn close(self) -> (u32, Option<Unread>) {
        Browse::close(self).await
    }
}

/// Reads the file in one go per batch: SQLite's reads are short, and the commands that use it
/// run nothing else meanwhile.
impl Reading for embedded::Messages<'_> {
    type Delivery = embedded::EmbeddedDelivery;

    async fn next(&mut self) -> Result<Option<Self::Delivery>, BrokerError> {
        self.next_message()
    }

    async fn close(self) -> (u32, Option<Unread>) {
        // [`MAX_HELD`] bounds what a pass reads here too, as it does a browse.
        let (unread, short) = self.unread();
        let why = short.map(|short| match short {
            embedded::Short::AtMost => Unread::PassedOver,
            embedded::Short::Removed => Unread::Elsewhere,
        });
        (unread, why)
    }
}

/// The dead-lettered messages of the embedded broker's file `filter` selects, in queue order,
/// read without taking them.
pub async fn list_read_only(
    file: &mut embedded::ReadOnly,
    dlq: &str,
    filter: &Filter,
) -> Result<(Vec<Entry>, Tally), BrokerError> {
    list_in(file.messages(dlq, u32::from(MAX_HELD))?, filter, None).await.map(|page| (page.entries, page.tally))
}

/// The dead-lettered messages `filter` selects, in queue order.
pub async fn list<B: Operate>(broker: &B, dlq: &str, filter: &Filter) -> Result<(Vec<Entry>, Tally), BrokerError> {
    let browse = Browse::open(broker, dlq).await?;
    let leased = browse.leased;
    list_in(browse, filter, None).await.map(|page| (page.entries, Tally { leased, ..page.tally }))
}

/// Where a page of a listing begins: after the first `read` messages of the dead-letter queue,
/// the last of which had the id `last`. Messages removed from before it since (redriven from
/// the page before, say) move it towards the head: the page begins after the last message
/// with that id among the first `read`, or, with none, after `read` messages (then as many as
/// were removed are passed over). As text, `READ` or `READ:ID`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub read: u32,
    pub last: Option<String>,
}

impl Cursor {
    /// A cursor from its text; a `READ` too large to hold is past every message.
    pub fn parse(text: &str) -> Option<Cursor> {
        let (read, last) = match text.split_once(':') {
            Some((read, last)) => (read, Some(last.to_string())),
            None => (text, None),
        };
        if read.is_empty() || !read.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(Cursor { read: read.parse().unwrap_or(u32::MAX), last })
    }
}

impl std::fmt::Display for Cursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.last {
            Some(last) => write!(f, "{}:{last}", self.read),
            None => write!(f, "{}", self.read),
        }
    }
}

/// One page of a listing: at most the filter's limit of entries, and where the next page
/// begins while more may follow.
#[derive(Debug)]
pub struct Page {
    pub entries: Vec<Entry>,
    pub tally: Tally,
    pub next: Option<Cursor>,
}

/// The page of the dead-lettered messages `filter` selects that begins at `after` (at the head
/// without it), in queue order, `filter.limit` at most. Each page reads from the head of the
/// queue: the messages before it cost their reading, and it stops, as every pass does, past
/// [`MAX_HELD`] messages.
pub async fn page<B: Operate>(
    broker: &B,
    dlq: &str,
    filter: &Filter,
    after: Option<&Cursor>,
) -> Result<Page, BrokerError> {
    list_in(Browse::open(broker, dlq).await?, filter, after).await
}

async fn list_in<R: Reading>(mut browse: R, filter: &Filter, after: Option<&Cursor>) -> Result<Page, BrokerError> {
    let (mut entries, mut tally, now) = (Vec::new(), Tally::default(), now());
    // Where the last entry was read, and its id: where the next page begins.
    let mut last: Option<Cursor> = None;
    let position = |tally: &Tally| u32::try_from(tally.read).unwrap_or(u32::MAX);
    let result = async {
        if let Some(cursor) = after {
            // Read up to the cursor, keeping what the page would hold from after the last
            // message with the cursor's id: those moved up if messages before it went.
            let mut found = false;
            while position(&tally) < cursor.read {
                let Some(delivery) = browse.next().await? else { break };
                tally.read += 1;
                let entry = describe(&delivery, now);
                if cursor.last.is_some() && entry.id == cursor.last {
                    (found, last) = (true, None);
                    entries.clear();
                } else if found && !filter.is_full(entries.len()) && filter.selects(&entry, now) {
                    last = Some(Cursor { read: position(&tally), last: entry.id.clone() });
                    entries.push(entry);
                }
            }
            if !found {
                last = None;
                entries.clear();
            }
        }
        while !filter.is_full(entries.len()) {
            let Some(delivery) = browse.next().await? else { break };
            tally.read += 1;
            let entry = describe(&delivery, now);
            if filter.selects(&entry, now) {
                last = Some(Cursor { read: position(&tally), last: entry.id.clone() });
                entries.push(entry);
            }
        }
        Ok(())
    }
    .await;
    tally.selected = entries.len();
    (tally.unread, tally.unread_because) = browse.close().await;
    if tally.unread > 0 && filter.is_full(entries.len()) {
        tally.unread_because = Some(Unread::Limit);
    }
    // A full page with messages after it, unread or read past it: they are the next page's.
    let after_page = |last: &Cursor| tally.unread > 0 || last.read < position(&tally);
    let next = last.filter(|last| filter.is_full(entries.len()) && after_page(last));
    result.map(|()| Page { entries, tally, next })
}

/// The message at the head of a dead-letter queue (the oldest): read where the broker reads
/// without taking, else browsed and handed back.
pub async fn head<B: Operate>(broker: &B, dlq: &str) -> Result<Option<Entry>, BrokerError> {
    if let Some(oldest) = broker.oldest(dlq).await? {
        return Ok(oldest.map(|delivery| describe(&delivery, now())));
    }
    head_in(Browse::start(broker, dlq, 1, 1).await?).await
}

/// The message at the head of a dead-letter queue of the embedded broker's file, read without
/// taking it.
pub async fn head_read_only(file: &mut embedded::ReadOnly, dlq: &str) -> Result<Option<Entry>, BrokerError> {
    head_in(file.messages(dlq, 1)?).await
}

async fn head_in<R: Reading>(mut browse: R) -> Result<Option<Entry>, BrokerError> {
    let head = browse.next().await;
    browse.close().await;
    Ok(head?.map(|delivery| describe(&delivery, now())))
}

/// One dead-lettered message by id, headers and body.
pub async fn show<B: Operate>(broker: &B, dlq: &str, id: &str) -> Result<Option<Shown>, BrokerError> {
    show_in(Browse::open(broker, dlq).await?, id).await
}

/// One dead-lettered message of the embedded broker's file by id, read without taking it.
pub async fn show_read_only(file: &mut embedded::ReadOnly, dlq: &str, id: &str) -> Result<Option<Shown>, BrokerError> {
    show_in(file.messages(dlq, u32::from(MAX_HELD))?, id).await
}

async fn show_in<R: Reading>(mut browse: R, id: &str) -> Result<Option<Shown>, BrokerError> {
    let now = now();
    let found = async {
        while let Some(delivery) = browse.next().await? {
            let entry = describe(&delivery, now);
            if entry.id.as_deref() == Some(id) {
                let body = serde_json::from_slice(delivery.body())
                    .unwrap_or_else(|_| Value::from(String::from_utf8_lossy(delivery.body())));
                return Ok(Some(Shown { entry, headers: delivery.headers(), body }));
            }
        }
        Ok(None)
    }
    .await;
    browse.close().await;
    found
}

/// What to do with the selected messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Copy each back to its queue as a first attempt, then remove it.
    Redrive,
    /// Remove each.
    Purge,
}

/// A redrive or purge of one dead-letter queue.
#[derive(Debug, Clone)]
pub struct Job<'a> {
    /// The pipeline queue a redrive sends the messages back to.
    pub queue: &'a str,
    pub dlq: &'a str,
    pub action: Action,
    pub filter: Filter,
    /// Only count the selected messages.
    pub dry_run: bool,
    /// At most this many messages a second.
    pub rate: Option<NonZeroU32>,
}

/// Redrives or purges the messages the job's filter selects; `progress` hears of each batch
/// done.
pub async fn apply<B: Operate>(
    broker: &B,
    job: &Job<'_>,
    progress: &(dyn Fn(&Tally) + Sync),
) -> Result<Tally, BrokerError> {
    let Job { queue, dlq, action, ref filter, dry_run, rate } = *job;
    // No burst: `--rate 100/s` means evenly, not 100 at once and then one every 10 ms.
    let limiter = rate.map(|r| DefaultDirectRateLimiter::direct(Quota::per_second(r).allow_burst(NonZeroU32::MIN)));
    let mut browse = Browse::open(broker, dlq).await?;
    let mut tally = Tally { queued: browse.remaining, leased: browse.leased, ..Tally::default() };
    progress(&tally);
    let now = now();
    // Copies awaiting their confirms, each its own task, which yields its delivery once
    // confirmed and whether the broker removed it with its copy. Tasks, not futures this loop
    // polls: while the loop awaits an ack or the next message, a copy left unpolled could hold
    // a place in the broker's queue of requests that the ack or the read waits behind, for
    // ever (the Redis connection hands a freed slot to the next request waiting: a copy that
    // this loop would poll only after the ack).
    let mut pending = JoinSet::new();
    // Confirmed, to be acked (unless removed already) in batches.
    let mut confirmed = Vec::new();
    // Body bytes of the messages in `pending` and `confirmed`.
    let mut held_bytes = 0;
    let mut result = async {
        loop {
            while pending.len() >= IN_FLIGHT || (held_bytes >= HELD_BYTES && !pending.is_empty()) {
                if let Some(copied) = pending.join_next().await {
                    confirmed.push(joined(copied)?);
                }
            }
            while let Some(copied) = pending.try_join_next() {
                confirmed.push(joined(copied)?);
            }
            if confirmed.len() >= ACK_BATCH || held_bytes >= HELD_BYTES {
                held_bytes -= take(&mut browse, &mut confirmed, &mut tally, progress).await?;
            }
            if filter.is_full(tally.selected) {
                break;
            }
            let Some(delivery) = browse.next().await? else { break };
            tally.read += 1;
            if !filter.selects(&describe(&delivery, now), now) {
                continue;
            }
            tally.selected += 1;
            if dry_run {
                continue;
            }
            if let Some(limiter) = &limiter {
                limiter.until_ready().await;
            }
            held_bytes += delivery.body().len();
            let (broker, queue, consumer) = (broker.clone(), queue.to_string(), browse.consumer.clone());
            pending.spawn(async move {
                let removed = match action {
                    Action::Redrive => broker.copy_and_remove(&queue, &consumer, &delivery, &redrive_edits()).await?,
                    Action::Purge => false,
                };
                Ok::<_, BrokerError>((delivery, removed))
            });
        }
        Ok(())
    }
    .await;
    // The copies still awaiting their confirms, each within the broker's confirm timeout, also
    // when one failed: whatever was confirmed leaves the dead-letter queue, so a pass that a
    // full queue refuses in part still moves what went in, and the next pass does not copy
    // those again. A failed copy's message is not acked; closing hands it back with the rest.
    // The first error stands.
    while let Some(copied) = pending.join_next().await {
        result = result.and(joined(copied).map(|copy| confirmed.push(copy)));
    }
    let taken = take(&mut browse, &mut confirmed, &mut tally, progress).await;
    (tally.unread, tally.unread_because) = browse.close().await;
    result.and(taken.map(drop)).map(|()| tally)
}

/// A copy task's outcome; its panic goes on here (the tasks are aborted only when the set
/// is dropped, never while joined).
fn joined<T>(outcome: Result<T, JoinError>) -> T {
    outcome.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

/// How a redriven copy differs from its dead-lettered original: as if new, without sluice's
/// failure headers nor the broker's dead-letter history, at attempt 1.
pub fn redrive_edits() -> Edits {
    Edits {
        remove: envelope::FAILURE_HEADERS.iter().map(|h| h.to_string()).collect(),
        set: [(envelope::ATTEMPT_HEADER.to_string(), HeaderValue::Int(1))].into(),
        drop_history: true,
    }
}

/// How long a pass after a lost session waits for the messages that session held to be ready
/// again before it reads what is there.
pub const HAND_BACK: Duration = Duration::from_secs(30);

/// Waits (at most `within`: [`HAND_BACK`]) until `dlq` holds `expected` messages ready: those a lost
/// session held unacked are handed back only once the queue learns the session is gone (a
/// quorum queue whose leader was on the lost node elects a new one first), and a pass begun
/// before reads only the few that were ready and ends.
pub async fn handed_back<B: Operate>(
    broker: &B,
    dlq: &str,
    expected: u32,
    within: Duration,
) -> Result<(), BrokerError> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let depth = broker.depth(dlq).await?;
        if depth >= expected {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(
                dlq,
                depth,
                expected,
                "fewer messages came back than the lost session held; reading those there are"
            );
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Acks of confirmed copies sent at once.
const ACK_BATCH: usize = 64;

/// Acks the `confirmed` messages the broker did not remove with their copies (removing them
/// from the dead-letter queue) and counts them all; the body bytes let go.
async fn take<B: Operate>(
    browse: &mut Browse<B>,
    confirmed: &mut Vec<(B::Delivery, bool)>,
    tally: &mut Tally,
    progress: &(dyn Fn(&Tally) + Sync),
) -> Result<usize, BrokerError> {
    if confirmed.is_empty() {
        return Ok(0);
    }
    let batch = std::mem::take(confirmed);
    let bytes = batch.iter().map(|(d, _)| d.body().len()).sum();
    let (removed, read): (Vec<_>, Vec<_>) = batch.into_iter().partition(|(_, removed)| *removed);
    let read: Vec<B::Delivery> = read.into_iter().map(|(d, _)| d).collect();
    // The removed ones are done whatever becomes of the ack.
    tally.done += removed.len();
    let acked = browse.settle(&read, removed.len()).await;
    if acked.is_ok() {
        tally.done += read.len();
    }
    progress(tally);
    acked.map(|()| bytes)
}

#[cfg(test)]
mod tests;
