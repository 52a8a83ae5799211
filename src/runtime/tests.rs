//! The runtime's rules, in-process against the in-memory broker (issue 10): every disposition
//! and what it leaves behind, the ack window, a reload that adds, changes and removes queues
//! and unbinds what the new config dropped (issue 19), a refused reload that changes nothing,
//! drain before replace, and shutdown. The dispositions, the ack window, the unbinding, drain
//! before replace and shutdown also run on the embedded broker (issue 12): one suite, two
//! brokers.
//!
//! The handlers are a [`Script`] (issue 32): each call's outcome and latency decided per
//! message and attempt, no process run. On the in-memory broker the tests run on paused time
//! (`start_paused`): retries, delays, openings and latencies pass on tokio's clock, with no
//! real sleep. The embedded broker keeps its messages by the system clock, so its runs are on
//! real time. Every wait is on a condition with a deadline, and an absence is asserted only
//! once a positive condition shows the system has settled.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::future::BoxFuture;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Readiness;
use super::gate::{self, Pauses};
use super::{Options, Reload, RunError, run};
use crate::broker::embedded::Embedded;
use crate::broker::memory::{Memory, Message};
use crate::broker::{Broker, BrokerError, HeaderValue, Headers, Outgoing, Properties, Publish};
use crate::call::{Call, Execute};
use crate::config::Config;
use crate::dedup::{Location, Store};
use crate::envelope::{self, Envelope};
use crate::handler::{HandlerError, Observed};
use crate::topology::Diff;

/// How long a condition may take before the test fails; only a failing test waits this long.
/// Real time: on paused time, the idempotency store's file writes (real IO, during which
/// tokio's clock jumps to its next timer) must not eat a test's patience.
const DEADLINE: Duration = Duration::from_secs(5);

/// The shutdown grace unless a test is about the grace.
const GRACE: Duration = Duration::from_secs(5);

/// Waits until `condition` holds, polling every few milliseconds, failing after [`DEADLINE`].
async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + DEADLINE;
    while !condition() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// One handler call as the script sees it: the queue's log (its command's first argument),
/// the message's idempotency key and attempt, the rest of the rendered arguments, and when it
/// started on tokio's clock.
#[derive(Debug, Clone)]
struct Job {
    log: String,
    key: String,
    attempt: u32,
    args: Vec<String>,
    at: Instant,
}

impl Job {
    /// What a call of a command handler carries.
    fn of(call: &Call) -> Job {
        let Call::Command(invocation) = call else { panic!("the tests' queues run commands: {call:?}") };
        let env = |name: &str| invocation.env.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        let mut args = invocation.args.clone();
        let log = if args.is_empty() { String::new() } else { args.remove(0) };
        let key = env("SLUICE_IDEMPOTENCY_KEY").unwrap_or_default();
        let attempt = env("SLUICE_ATTEMPT").and_then(|a| a.parse().ok()).unwrap_or_default();
        Job { log, key, attempt, args, at: Instant::now() }
    }

    /// "<key> <attempt>", as the tests list runs.
    fn line(&self) -> String {
        format!("{} {}", self.key, self.attempt)
    }
}

/// How the scripted handler answers a call: after `latency` (tokio's clock), and while
/// `held`, only once the script's gate opens.
struct Answer {
    result: Result<(), HandlerError>,
    latency: Duration,
    held: bool,
}

impl Answer {
    fn ok() -> Answer {
        Answer { result: Ok(()), latency: Duration::ZERO, held: false }
    }

    fn fails(error: HandlerError) -> Answer {
        Answer { result: Err(error), ..Answer::ok() }
    }

    fn after(self, latency: Duration) -> Answer {
        Answer { latency, ..self }
    }

    fn held(self) -> Answer {
        Answer { held: true, ..self }
    }
}

/// What happened in the scripted downstream, in order.
#[derive(Debug, Clone)]
enum Event {
    Start(Job),
    End(Job),
    /// A test's mark between events.
    Mark,
}

/// The scripted handlers: `answer` decides each call, and every call is logged as it starts
/// and ends.
#[derive(Clone)]
struct Script(Arc<ScriptState>);

struct ScriptState {
    answer: Box<dyn Fn(&Job) -> Answer + Send + Sync>,
    events: Mutex<Vec<Event>>,
    /// Open once set: held calls end then.
    gate: watch::Sender<bool>,
}

impl Script {
    fn new(answer: impl Fn(&Job) -> Answer + Send + Sync + 'static) -> Script {
        Script(Arc::new(ScriptState {
            answer: Box::new(answer),
            events: Mutex::new(Vec::new()),
            gate: watch::Sender::new(false),
        }))
    }

    /// Every call succeeds at once.
    fn record() -> Script {
        Script::new(|_| Answer::ok())
    }

    fn handlers(&self) -> Arc<dyn Execute> {
        Arc::new(self.clone())
    }

    fn events(&self) -> MutexGuard<'_, Vec<Event>> {
        self.0.events.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The calls of `log` that ended, in order.
    fn ended(&self, log: &str) -> Vec<Job> {
        let events = self.events();
        events
            .iter()
            .filter_map(|e| if let Event::End(j) = e { Some(j) } else { None })
            .filter(|j| j.log == log)
            .cloned()
            .collect()
    }

    /// "<key> <attempt>" of each call of `log` that ended, in order.
    fn lines(&self, log: &str) -> Vec<String> {
        self.ended(log).iter().map(Job::line).collect()
    }

    /// How many calls of `log` started.
    fn started(&self, log: &str) -> usize {
        self.events().iter().filter(|e| matches!(e, Event::Start(j) if j.log == log)).count()
    }

    fn mark(&self) {
        self.events().push(Event::Mark);
    }

    /// Lets the held calls end, and those to come run through.
    fn open(&self) {
        self.0.gate.send_replace(true);
    }
}

impl Execute for Script {
    fn execute<'a>(&'a self, call: Call, _: &'a mut Observed) -> BoxFuture<'a, Result<(), HandlerError>> {
        let job = Job::of(&call);
        let answer = (self.0.answer)(&job);
        self.events().push(Event::Start(job.clone()));
        Box::pin(async move {
            tokio::time::sleep(answer.latency).await;
            if answer.held {
                let mut gate = self.0.gate.subscribe();
                let _ = gate.wait_for(|open| *open).await;
            }
            self.events().push(Event::End(job));
            answer.result
        })
    }
}

/// A pipeline directory, rewritten for each config.
struct Pipeline {
    dir: tempfile::TempDir,
}

impl Pipeline {
    fn new() -> Pipeline {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("pipelines")).expect("pipelines dir");
        Pipeline { dir }
    }

    /// Writes a file into the pipeline directory (a payload schema).
    fn write(&self, name: &str, text: &str) {
        std::fs::write(self.dir.path().join("pipelines").join(name), text).expect("write");
    }

    /// Loads `queues` (name, YAML body indented by four spaces) as the pipeline, beside a
    /// topic exchange `ev` they may bind to.
    fn config(&self, queues: &[(&str, String)]) -> Arc<Config> {
        let mut text = String::from("version: 1\nexchanges:\n  ev: {type: topic}\nqueues:\n");
        for (name, body) in queues {
            text.push_str(&format!("  {name}:\n{body}"));
        }
        let dir = self.dir.path().join("pipelines");
        std::fs::write(dir.join("p.yaml"), &text).expect("write");
        let loaded = crate::config::load(&[dir]);
        Arc::new(loaded.config.unwrap_or_else(|| panic!("invalid: {:?}\n{text}", loaded.diagnostics)))
    }

    async fn store(&self) -> Store {
        Store::open(&Location::File(self.dir.path().join("state")), false).await.expect("embedded store")
    }
}

/// A queue body whose handler is a command the [`Script`] answers (`/bin/true`, never run), its first argument the
/// log its calls go to (`args[0]`), then `args` (rendered per message), and `extra` YAML (each
/// line indented by four spaces).
/// Unless `extra` says otherwise, three attempts, a few milliseconds apart.
fn command(args: &[&str], extra: &str) -> String {
    let argv: Vec<String> = args.iter().map(|a| json!(a).to_string()).collect();
    let retry = if extra.contains("retry:") { "" } else { "    retry: {max_attempts: 3, initial: 1ms, max: 5ms}\n" };
    format!(
        "{extra}{retry}    handler:\n      command:\n        program: /bin/true\n        args: [{}]\n        stdin: none\n",
        argv.join(", ")
    )
}

/// An envelope with idempotency key `key`.
fn message(key: &str, payload: &Value) -> Vec<u8> {
    Envelope::new("test", payload, Some(key.into())).encode()
}
/// What the tests read of a broker, at once and without going through it, and the fault they
/// inject into it.
trait Inspect: Send + Sync {
    /// Open consumers of `queue`.
    fn consumers(&self, queue: &str) -> usize;
    /// Deliveries of `queue` handed out and not yet acked.
    fn unacked(&self, queue: &str) -> usize;
    /// Messages ready in `queue`, oldest first.
    fn messages(&self, queue: &str) -> Vec<Message>;
    /// Delayed copies not yet due.
    fn delayed(&self) -> u32;
    /// Acks fail and change nothing (as a full disk, or another process's write lock held past
    /// the busy timeout, fails them) while `refuse`.
    fn refuse_acks(&self, refuse: bool);
    /// Whether the broker's tests run on paused time. Then they hold no idempotency store
    /// unless they are about idempotency: its file writes are real IO, over which paused time
    /// jumps to its next timer (a grace could expire while a success is recorded).
    fn paused(&self) -> bool;
}

impl Inspect for Memory {
    fn consumers(&self, queue: &str) -> usize {
        Memory::consumers(self, queue)
    }

    fn unacked(&self, queue: &str) -> usize {
        Memory::unacked(self, queue)
    }

    fn messages(&self, queue: &str) -> Vec<Message> {
        Memory::messages(self, queue)
    }

    fn delayed(&self) -> u32 {
        Broker::delayed(self).now_or_never().expect("in-memory").expect("delayed")
    }

    fn refuse_acks(&self, refuse: bool) {
        Memory::refuse_acks(self, refuse);
    }

    fn paused(&self) -> bool {
        true
    }
}

/// The embedded broker's file, read through a connection of its own (as another process
/// would).
struct File {
    path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl File {
    /// A new file and the broker on it.
    fn new() -> (Embedded, File) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sluice.db");
        (Embedded::open(&path).expect("open"), File { path, _dir: dir })
    }

    fn count(&self, sql: &str, queue: &str) -> usize {
        let db = rusqlite::Connection::open(&self.path).expect("open");
        let now = crate::broker::embedded::now_ms();
        let n: i64 = db.query_row(sql, rusqlite::params![queue, now], |r| r.get(0)).expect(sql);
        usize::try_from(n).expect("a count")
    }
}

impl Inspect for File {
    fn consumers(&self, queue: &str) -> usize {
        self.count("SELECT count(*) FROM consumers WHERE queue = ?1 AND until > ?2", queue)
    }

    fn unacked(&self, queue: &str) -> usize {
        self.count(
            "SELECT count(*) FROM messages WHERE queue = ?1 AND lease_owner IS NOT NULL AND visible_at > ?2",
            queue,
        )
    }

    fn messages(&self, queue: &str) -> Vec<Message> {
        let db = rusqlite::Connection::open(&self.path).expect("open");
        let mut s = db
            .prepare("SELECT b.data, m.headers, m.message_id, m.timestamp FROM messages m JOIN bodies b ON b.id = m.body WHERE m.queue = ?1 AND m.visible_at <= ?2 ORDER BY m.id")
            .expect("prepare");
        let rows = s.query_map(rusqlite::params![queue, crate::broker::embedded::now_ms()], |r| {
            Ok((
                r.get::<_, Vec<u8>>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<String>>(2)?,
                r.get::<_, Option<i64>>(3)?,
            ))
        });
        rows.expect("query")
            .map(|row| {
                let (body, headers, message_id, timestamp) = row.expect("row");
                let headers: BTreeMap<String, Value> = serde_json::from_str(&headers).expect("headers");
                let headers: Headers = headers
                    .into_iter()
                    .map(|(k, v)| match v {
                        Value::String(s) => (k, HeaderValue::Str(s)),
                        other => (k, HeaderValue::Int(other.as_i64().expect("an integer header"))),
                    })
                    .collect();
                Message {
                    body: body.into(),
                    properties: Properties {
                        headers,
                        message_id,
                        timestamp: timestamp.map(|t| t as u64),
                        ..Properties::default()
                    },
                }
            })
            .collect()
    }

    fn delayed(&self) -> u32 {
        let db = rusqlite::Connection::open(&self.path).expect("open");
        let sql = "SELECT count(*) FROM messages WHERE lease_owner IS NULL AND visible_at > ?1";
        db.query_row(sql, [crate::broker::embedded::now_ms()], |r| r.get(0)).expect(sql)
    }

    /// Only acks delete messages: a trigger that refuses deletes fails each ack's transaction.
    fn refuse_acks(&self, refuse: bool) {
        let db = rusqlite::Connection::open(&self.path).expect("open");
        db.busy_timeout(DEADLINE).expect("busy timeout");
        let sql = if refuse {
            "CREATE TRIGGER refuse_acks BEFORE DELETE ON messages BEGIN SELECT RAISE(ABORT, 'disk full'); END"
        } else {
            "DROP TRIGGER refuse_acks"
        };
        db.execute_batch(sql).expect(sql);
    }

    fn paused(&self) -> bool {
        false
    }
}

/// `run` over a broker, with the handles a test drives it by: `memory` is the broker (the
/// in-memory one unless a test says otherwise), `look` reads it.
struct Runner<B: Publish = Memory> {
    memory: B,
    look: Arc<dyn Inspect>,
    reloads: mpsc::UnboundedSender<Reload>,
    shutdown: CancellationToken,
    readiness: Readiness,
    pauses: Pauses,
    task: JoinHandle<Result<(), RunError>>,
}

impl Runner<Memory> {
    /// Starts `config` on a new in-memory broker, its calls answered by `script`.
    async fn start(config: Arc<Config>, script: &Script, store: Option<Store>, grace: Duration) -> Runner<Memory> {
        let memory = Memory::new();
        Runner::start_on(memory.clone(), Arc::new(memory), config, script.handlers(), store, grace).await
    }
}

impl<B: Publish> Runner<B> {
    /// Starts `config` on `broker` and waits until each of its queues has its consumer.
    async fn start_on(
        broker: B,
        look: Arc<dyn Inspect>,
        config: Arc<Config>,
        handlers: Arc<dyn Execute>,
        store: Option<Store>,
        grace: Duration,
    ) -> Runner<B> {
        let queues: Vec<String> = config.queues.keys().cloned().collect();
        let (reloads, received) = mpsc::unbounded_channel();
        let shutdown = CancellationToken::new();
        let readiness = Readiness::default();
        let pauses = Pauses::default();
        let options = Options {
            shutdown_grace: grace,
            exit_when_idle: false,
            readiness: readiness.clone(),
            pauses: pauses.clone(),
            attempts: Default::default(),
        };
        let session = broker.clone();
        let connect = move |_| {
            let session = session.clone();
            async move { Ok::<_, BrokerError>(session) }
        };
        let sessions = crate::broker::failover::Failover::new(vec!["memory".into()], connect);
        let task = tokio::spawn(run(config, sessions, handlers, store, options, received, shutdown.clone()));
        wait_until("every queue has a consumer", || queues.iter().all(|q| look.consumers(q) == 1)).await;
        Runner { memory: broker, look, reloads, shutdown, readiness, pauses, task }
    }

    async fn publish(&self, queue: &str, body: Vec<u8>) {
        self.publish_to("", queue, body).await;
    }

    async fn publish_to(&self, exchange: &str, routing_key: &str, body: Vec<u8>) {
        let message = Outgoing { body, ..Outgoing::default() };
        self.memory.publish(exchange, routing_key, message).await.expect("publish");
    }

    async fn reload(&self, config: Arc<Config>) -> Result<Diff, BrokerError> {
        let (applied, outcome) = oneshot::channel();
        self.reloads.send(Reload { config, applied }).unwrap_or_else(|_| panic!("run has ended"));
        outcome.await.expect("run answers every reload")
    }

    /// Nothing ready or unacked in `queue`, and no delayed copy on its way back.
    fn settled(&self, queue: &str) -> bool {
        self.look.unacked(queue) == 0 && self.look.messages(queue).is_empty() && self.look.delayed() == 0
    }

    fn depth(&self, queue: &str) -> usize {
        self.look.messages(queue).len()
    }

    /// Cancels the token and returns how `run` ended and how long that took.
    async fn stop(self, within: Duration) -> (Result<(), RunError>, Duration, B, Readiness) {
        let started = Instant::now();
        self.shutdown.cancel();
        let ended = tokio::time::timeout(within, self.task).await.expect("run returns in time").expect("no panic");
        (ended, started.elapsed(), self.memory, self.readiness)
    }
}

/// A new broker for a test, and what reads it.
type NewBroker<B> = fn() -> (B, Arc<dyn Inspect>);

fn memory() -> (Memory, Arc<dyn Inspect>) {
    let memory = Memory::new();
    (memory.clone(), Arc::new(memory))
}

fn embedded() -> (Embedded, Arc<dyn Inspect>) {
    let (broker, file) = File::new();
    (broker, Arc::new(file))
}

/// An idempotency store for a test not about idempotency: none on paused time
/// ([`Inspect::paused`]).
async fn store_for(look: &dyn Inspect, pipeline: &Pipeline) -> Option<Store> {
    if look.paused() { None } else { Some(pipeline.store().await) }
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Permanent failures (`EX_DATAERR`, as a command's permanent exit code said).
fn permanent() -> Answer {
    Answer::fails(HandlerError::permanent("exit code 65"))
}

/// A transient failure of this message alone.
fn transient() -> Answer {
    Answer::fails(HandlerError::transient("exit code 1"))
}

/// What a disposition test publishes.
enum Body {
    /// An envelope with the row's key and this payload.
    Payload(Value),
    /// These bytes, verbatim.
    Raw(&'static str),
    /// An envelope with the row's key, not to be handled before this many milliseconds from
    /// its publish (before it, when negative).
    NotBefore(i64),
}

/// One disposition: the queue's YAML, what is published (how many times), the attempts the
/// handler runs, and the dead-letter copy if any (`x-sluice-reason`, `x-sluice-attempts`).
struct Row {
    name: &'static str,
    /// How the handler answers.
    answer: fn() -> Answer,
    /// Arguments after the log.
    args: &'static [&'static str],
    extra: &'static str,
    body: Body,
    copies: usize,
    runs: &'static [&'static str],
    dead: Option<(&'static str, &'static str)>,
}

/// Issue 10: each disposition, end to end through `run`: the handler runs as many times as it
/// should, the delivery is acked (nothing ready, nothing unacked, no delayed copy), and the
/// dead-letter queue holds exactly the copy the disposition calls for, with its reason.
#[tokio::test(start_paused = true)]
async fn every_disposition_ends_acked_with_its_effects() {
    dispositions(memory).await;
}

/// Issue 12: the same on the embedded broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_disposition_ends_acked_with_its_effects_on_the_embedded_broker() {
    dispositions(embedded).await;
}

/// The rows of [`dispositions`].
fn disposition_rows() -> [Row; 13] {
    let row = |name, answer: fn() -> Answer, runs, dead| Row {
        name,
        answer,
        args: &[],
        extra: "",
        body: Body::Payload(json!({"n": 1})),
        copies: 1,
        runs,
        dead,
    };
    let malformed = |name, body| Row { body: Body::Raw(body), ..row(name, Answer::ok, &[], Some(("malformed", "1"))) };
    [
        row("success", Answer::ok, &["1"], None),
        row("permanent failure", permanent, &["1"], Some(("permanent", "1"))),
        row("transient until exhausted", transient, &["1", "2", "3"], Some(("exhausted", "3"))),
        malformed("not json", "not json"),
        malformed("number out of range", r#"{"id":"m-1","type":"test","idempotency_key":"k","payload":{"n":1e400}}"#),
        Row { args: &["{{payload.missing}}"], ..row("template error", Answer::ok, &[], Some(("template", "1"))) },
        Row {
            extra: "    payload_schema: s.json\n",
            body: Body::Payload(json!({"m": 1})),
            ..row("payload fails its schema", Answer::ok, &[], Some(("schema", "1")))
        },
        Row { extra: "    max_message_bytes: 10\n", ..row("too large", Answer::ok, &[], Some(("too_large", "1"))) },
        // Issue 24: handed back until its time (a delayed copy), then run as attempt 1.
        Row { body: Body::NotBefore(300), ..row("scheduled", Answer::ok, &["1"], None) },
        Row { body: Body::NotBefore(-86_400_000), ..row("scheduled in the past", Answer::ok, &["1"], None) },
        malformed(
            "not_before not a time",
            r#"{"id":"m-1","type":"test","idempotency_key":"k","not_before":"soon","payload":{"n":1}}"#,
        ),
        // One at a time: the second arrives once the first is recorded done.
        Row { extra: "    concurrency: 1\n", copies: 2, ..row("duplicate", Answer::ok, &["1"], None) },
        // Side by side: the second finds the key busy, waits (a delayed copy, same attempt),
        // then finds it done.
        Row {
            extra: "    concurrency: 2\n",
            copies: 2,
            ..row("duplicate while the first runs", || Answer::ok().after(Duration::from_millis(200)), &["1"], None)
        },
    ]
}

async fn dispositions<B: Publish>(new: NewBroker<B>) {
    // One store for every row (opening one takes a while); each row has its own key. The
    // duplicates need it, on paused time too: no grace runs out while it writes.
    let stores = Pipeline::new();
    let store = stores.store().await;
    for (i, row) in disposition_rows().into_iter().enumerate() {
        let key = format!("k{i}");
        let pipeline = Pipeline::new();
        pipeline.write("s.json", r#"{"type": "object", "required": ["n"]}"#);
        let args: Vec<&str> = ["runs"].into_iter().chain(row.args.iter().copied()).collect();
        let config = pipeline.config(&[("work", command(&args, row.extra))]);
        let (broker, look) = new();
        let answer = row.answer;
        let script = Script::new(move |_| answer());
        let runner = Runner::start_on(broker, look, config, script.handlers(), Some(store.clone()), GRACE).await;
        let body = disposition_body(&row.body, &key);
        for _ in 0..row.copies {
            runner.publish("work", body.clone()).await;
        }
        if let Body::NotBefore(ms) = row.body
            && ms > 0
        {
            wait_until("a scheduled message is handed back as a delayed copy", || runner.look.delayed() == 1).await;
            assert!(script.lines("runs").is_empty(), "{}: ran before its time", row.name);
        }
        let dead_copies = usize::from(row.dead.is_some());
        wait_until(row.name, || {
            runner.settled("work")
                && script.lines("runs").len() == row.runs.len()
                && runner.depth("work.dlq") == dead_copies
        })
        .await;
        let runs: Vec<String> = row.runs.iter().map(|attempt| format!("{key} {attempt}")).collect();
        assert_eq!(script.lines("runs"), runs, "{}: handler runs", row.name);
        let dlq = runner.look.messages("work.dlq");
        let found: Vec<_> =
            dlq.iter().map(|m| (m.header(envelope::REASON_HEADER), m.header(envelope::ATTEMPTS_HEADER))).collect();
        let expected: Vec<_> = row.dead.iter().map(|(r, a)| (Some(r.to_string()), Some(a.to_string()))).collect();
        assert_eq!(found, expected, "{}: dead-letter copies", row.name);
        for copy in &dlq {
            assert_eq!(copy.body.as_ref(), body.as_slice(), "{}: the original body", row.name);
            assert_eq!(copy.header(envelope::SOURCE_QUEUE_HEADER).as_deref(), Some("work"), "{}", row.name);
        }
        let (ended, ..) = runner.stop(GRACE).await;
        assert!(ended.is_ok(), "{}: {ended:?}", row.name);
    }
}

/// What a disposition row publishes, its key `key`; a due time on the runtime's clock.
fn disposition_body(body: &Body, key: &str) -> Vec<u8> {
    match body {
        Body::Payload(payload) => message(key, payload),
        Body::Raw(text) => text.as_bytes().to_vec(),
        Body::NotBefore(wait) => {
            let mut envelope = Envelope::new("test", &json!({"n": 1}), Some(key.to_string()));
            let now = super::clock::now();
            let offset = Duration::from_millis(wait.unsigned_abs());
            let at = if *wait < 0 { now - offset } else { now + offset };
            envelope.not_before = Some(envelope::Timestamp(at));
            envelope.encode()
        }
    }
}

/// Issue 10: acks of deliveries finishing out of order, at most `concurrency` at once, leave
/// nothing unacked and nothing handled twice.
#[tokio::test(start_paused = true)]
async fn the_ack_window_settles_every_delivery_once() {
    ack_window(memory).await;
}

/// Issue 12: the same on the embedded broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ack_window_settles_every_delivery_once_on_the_embedded_broker() {
    ack_window(embedded).await;
}

/// Answers after the latency its second argument gives, in seconds.
fn sleeps() -> Script {
    Script::new(|job| Answer::ok().after(Duration::from_secs_f64(job.args[0].parse().expect("seconds"))))
}

async fn ack_window<B: Publish>(new: NewBroker<B>) {
    let pipeline = Pipeline::new();
    let config = pipeline.config(&[("work", command(&["runs", "{{payload.sleep}}"], "    concurrency: 8\n"))]);
    let (broker, look) = new();
    let script = sleeps();
    let store = Some(pipeline.store().await);
    let runner = Runner::start_on(broker, look, config, script.handlers(), store, GRACE).await;
    let speeds = ["0", "0.03", "0.01", "0.02", "0", "0.005"];
    for i in 0..50 {
        runner.publish("work", message(&format!("k{i:02}"), &json!({"sleep": speeds[i % speeds.len()]}))).await;
    }
    let mut most_unacked = 0;
    wait_until("50 messages handled and acked", || {
        most_unacked = most_unacked.max(runner.look.unacked("work"));
        runner.settled("work") && script.lines("runs").len() == 50
    })
    .await;
    assert!(most_unacked <= 8, "{most_unacked} unacked deliveries with a prefetch of 8");
    let mut lines = script.lines("runs");
    lines.sort();
    let expected: Vec<String> = (0..50).map(|i| format!("k{i:02} 1")).collect();
    assert_eq!(lines, expected);
    assert_eq!(runner.depth("work.dlq"), 0);
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// Issue 19: an ack that fails (a full disk; another process's write lock held past the busy
/// timeout) is retried until it goes through, the runner not ready meanwhile: what was handled
/// is acked, never handled again, and its prefetch slots come back. (They leaked: with every
/// slot held by an ack that had failed once, the queue stalled for good.)
#[tokio::test(start_paused = true)]
async fn a_failed_ack_is_retried_and_the_queue_goes_on() {
    failed_acks(memory).await;
}

/// Issue 19: the same on the embedded broker, its acks failing in the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_ack_is_retried_and_the_queue_goes_on_on_the_embedded_broker() {
    failed_acks(embedded).await;
}

async fn failed_acks<B: Publish>(new: NewBroker<B>) {
    let pipeline = Pipeline::new();
    let config = pipeline.config(&[("work", command(&["runs"], "    concurrency: 2\n"))]);
    let (broker, look) = new();
    let script = Script::record();
    let store = Some(pipeline.store().await);
    let runner = Runner::start_on(broker, look.clone(), config, script.handlers(), store, GRACE).await;
    wait_until("ready", || runner.readiness.get()).await;
    // Published first: a publish that shares an embedded commit with a failing ack fails too.
    assert_eq!(runner.pauses.set("work", true), Ok(true));
    wait_until("the consumer is gone", || look.consumers("work") == 0).await;
    for i in 0..6 {
        runner.publish("work", message(&format!("k{i}"), &json!({}))).await;
    }
    look.refuse_acks(true);
    assert_eq!(runner.pauses.set("work", false), Ok(true));
    wait_until("two handled, their acks failing, and not ready", || {
        script.lines("runs").len() == 2 && !runner.readiness.get()
    })
    .await;
    assert_eq!(look.unacked("work"), 2, "held by the runner, not handed back");
    look.refuse_acks(false);
    wait_until("every message handled and acked, and ready again", || {
        runner.settled("work") && script.lines("runs").len() == 6 && runner.readiness.get()
    })
    .await;
    let mut lines = script.lines("runs");
    lines.sort();
    let expected: Vec<String> = (0..6).map(|i| format!("k{i} 1")).collect();
    assert_eq!(lines, expected, "each handled once");
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// Issue 10: a reload starts the added queue, replaces the changed one (one consumer, with the
/// new concurrency) and stops the removed one, whose queue and messages stay on the broker.
#[tokio::test(start_paused = true)]
async fn a_reload_adds_changes_and_removes_queues() {
    let pipeline = Pipeline::new();
    // `a` holds each delivery until the script opens, to show how many it is given.
    let script = Script::new(|job| if job.log == "a" { Answer::ok().held() } else { Answer::ok() });
    let a = |concurrency: u16| command(&["a"], &format!("    concurrency: {concurrency}\n"));
    let before = pipeline.config(&[("a", a(2)), ("b", command(&["b"], ""))]);
    let runner = Runner::start(before, &script, None, GRACE).await;

    let after = pipeline.config(&[("a", a(3)), ("c", command(&["c"], ""))]);
    let diff = runner.reload(after).await.expect("reload applied");
    assert_eq!(diff, Diff { added: names(&["c"]), changed: names(&["a"]), removed: names(&["b"]), ..Diff::default() });
    assert_eq!(runner.memory.consumers("b"), 0, "b's worker drained before the reload returns");
    assert!(runner.memory.has_queue("b"), "a removed queue stays on the broker");

    for i in 1..=4 {
        runner.publish("a", message(&format!("a{i}"), &json!({}))).await;
    }
    runner.publish("b", message("b1", &json!({}))).await;
    runner.publish("c", message("c1", &json!({}))).await;
    wait_until("a holds 3 (its new concurrency) and c is handled", || {
        runner.memory.unacked("a") == 3 && runner.depth("a") == 1 && runner.settled("c") && script.lines("c").len() == 1
    })
    .await;
    assert_eq!(
        (runner.memory.consumers("a"), runner.memory.consumers("b"), runner.memory.consumers("c")),
        (1, 0, 1),
        "consumers of a, b, c"
    );
    assert_eq!(script.lines("c"), ["c1 1"]);

    script.open();
    wait_until("a handles all four", || runner.settled("a") && script.lines("a").len() == 4).await;
    let mut lines = script.lines("a");
    lines.sort();
    assert_eq!(lines, ["a1 1", "a2 1", "a3 1", "a4 1"]);
    assert_eq!(runner.depth("b"), 1, "b's message waits in b");
    assert_eq!(runner.memory.unacked("b"), 0);
    assert!(script.lines("b").is_empty(), "nothing consumes b");
    assert_eq!(runner.memory.consumers("a"), 1, "replaced, not doubled");
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// Queue YAML binding it to `ev` with these routing keys.
fn bound(keys: &[&str]) -> String {
    let bindings: Vec<String> = keys.iter().map(|k| format!("{{exchange: ev, routing_key: \"{k}\"}}")).collect();
    format!("    bind: [{}]\n", bindings.join(", "))
}

/// Issue 19: a reload unbinds a removed queue from its exchanges, and a kept queue from the
/// bindings its `bind:` list dropped: what is published afterwards reaches only what the new
/// config binds, and the removed queue stays on the broker with what it held, taking nothing
/// more (before the fix it kept a copy of every matching message, unconsumed, forever).
#[tokio::test(start_paused = true)]
async fn a_reload_unbinds_removed_queues_and_dropped_bindings() {
    unbinding(memory).await;
}

/// Issue 19: the same on the embedded broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_unbinds_removed_queues_and_dropped_bindings_on_the_embedded_broker() {
    unbinding(embedded).await;
}

async fn unbinding<B: Publish>(new: NewBroker<B>) {
    let pipeline = Pipeline::new();
    let script = Script::record();
    let a = command(&["a"], &bound(&["#"]));
    let before = pipeline.config(&[
        ("a", a.clone()),
        ("b", command(&["b"], &bound(&["k.*", "x"]))),
        ("c", command(&["c"], &bound(&["k.*", "y"]))),
    ]);
    let (broker, look) = new();
    let store = store_for(look.as_ref(), &pipeline).await;
    let runner = Runner::start_on(broker, look, before, script.handlers(), store, GRACE).await;
    runner.publish_to("ev", "x", message("x0", &json!({}))).await;
    wait_until("x0 handled by a and b", || script.lines("a").len() == 1 && script.lines("b").len() == 1).await;

    let after = pipeline.config(&[("a", a), ("c", command(&["c"], &bound(&["k.*"])))]);
    let diff = runner.reload(after).await.expect("reload applied");
    assert_eq!((diff.removed, diff.changed), (names(&["b"]), names(&["c"])));
    let mut unbound: Vec<(&str, &str)> =
        diff.unbound.iter().map(|b| (b.queue.as_str(), b.routing_key.as_str())).collect();
    unbound.sort();
    assert_eq!(unbound, [("b", "k.*"), ("b", "x"), ("c", "y")]);

    for (key, routing_key) in [("k1", "k.1"), ("x1", "x"), ("y1", "y")] {
        runner.publish_to("ev", routing_key, message(key, &json!({}))).await;
    }
    wait_until("a handles all three and c its one", || {
        runner.settled("a") && script.lines("a").len() == 4 && runner.settled("c") && !script.lines("c").is_empty()
    })
    .await;
    assert_eq!(script.lines("c"), ["k1 1"], "c no longer takes routing key y");
    assert_eq!(runner.depth("b"), 0, "nothing reaches the removed queue");
    assert_eq!(script.lines("b"), ["x0 1"]);
    assert_eq!((runner.look.consumers("b"), runner.look.unacked("b")), (0, 0));
    runner.publish("b", message("b1", &json!({}))).await;
    assert_eq!(runner.depth("b"), 1, "the removed queue stays on the broker");
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// Issue 19: an unbind the broker fails may have removed some bindings already, so it ends the
/// session rather than leave the old config running half unbound: the reload is refused, and
/// the next session runs the old config, bound as it was.
#[tokio::test(start_paused = true)]
async fn a_failed_unbind_restarts_the_old_config_bound_as_it_was() {
    let pipeline = Pipeline::new();
    let script = Script::record();
    let a = command(&["a"], &bound(&["#"]));
    let before = pipeline.config(&[("a", a.clone()), ("b", command(&["b"], &bound(&["#"])))]);
    let runner = Runner::start(before, &script, None, GRACE).await;

    runner.memory.refuse_next_unbind(BrokerError::Lost("connection reset".into()));
    let refused = runner.reload(pipeline.config(&[("a", a)])).await;
    assert!(matches!(refused, Err(BrokerError::Lost(_))), "{refused:?}");
    wait_until("b consumed again", || runner.look.consumers("b") == 1 && runner.readiness.get()).await;
    runner.publish_to("ev", "k", message("k1", &json!({}))).await;
    wait_until("k1 handled by a and b", || {
        runner.settled("a") && runner.settled("b") && script.lines("a").len() == 1 && script.lines("b").len() == 1
    })
    .await;
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// Issue 10: a reload the broker refuses changes nothing: the old worker keeps consuming with
/// the old handler, and the next reload is still diffed against the old config.
#[tokio::test(start_paused = true)]
async fn a_refused_reload_keeps_the_old_config_running() {
    let pipeline = Pipeline::new();
    let script = Script::record();
    let marked = |marker: &str| command(&["runs", marker], "    concurrency: 2\n");
    let old = pipeline.config(&[("a", marked("old"))]);
    let runner = Runner::start(old, &script, None, GRACE).await;
    let runs = || -> Vec<String> { script.ended("runs").iter().map(|j| format!("{} {}", j.args[0], j.key)).collect() };

    runner.memory.refuse_next_declare(BrokerError::Conflict("queue \"a\" exists as something else".into()));
    let new = pipeline.config(&[("a", marked("new"))]);
    let refused = runner.reload(new.clone()).await;
    assert!(matches!(refused, Err(BrokerError::Conflict(_))), "{refused:?}");
    assert_eq!(runner.memory.consumers("a"), 1);

    runner.publish("a", message("k1", &json!({}))).await;
    wait_until("k1 handled", || runner.settled("a") && runs().len() == 1).await;
    assert_eq!(runs(), ["old k1"]);
    assert_eq!(runner.memory.consumers("a"), 1);

    let diff = runner.reload(new).await.expect("applied once the broker accepts it");
    assert_eq!(diff, Diff { changed: names(&["a"]), ..Diff::default() });
    runner.publish("a", message("k2", &json!({}))).await;
    wait_until("k2 handled", || runner.settled("a") && runs().len() == 2).await;
    assert_eq!(runs(), ["old k1", "new k2"]);
    assert_eq!(runner.memory.consumers("a"), 1);
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// Issue 10: a reload that changes a queue lets the in-flight delivery finish and acks it
/// before the new worker starts: handled once, never handed back and run again.
#[tokio::test(start_paused = true)]
async fn a_reload_drains_in_flight_deliveries_before_replacing() {
    drain_before_replace(memory).await;
}

/// Issue 12: the same on the embedded broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_drains_in_flight_deliveries_before_replacing_on_the_embedded_broker() {
    drain_before_replace(embedded).await;
}

async fn drain_before_replace<B: Publish>(new: NewBroker<B>) {
    let pipeline = Pipeline::new();
    let script = Script::new(|_| Answer::ok().after(Duration::from_millis(300)));
    let queue = |concurrency: u16| command(&["runs"], &format!("    concurrency: {concurrency}\n"));
    let (broker, look) = new();
    let config = pipeline.config(&[("work", queue(2))]);
    let store = store_for(look.as_ref(), &pipeline).await;
    let runner = Runner::start_on(broker, look, config, script.handlers(), store, GRACE).await;
    runner.publish("work", message("k1", &json!({}))).await;
    wait_until("k1 in flight", || script.started("runs") == 1).await;

    let diff = runner.reload(pipeline.config(&[("work", queue(3))])).await.expect("reload applied");
    assert_eq!(diff, Diff { changed: names(&["work"]), ..Diff::default() });
    // The reload returned: k1 was finished and acked by then, not handed back.
    assert_eq!(script.lines("runs"), ["k1 1"]);
    assert_eq!((runner.look.unacked("work"), runner.depth("work")), (0, 0));

    runner.publish("work", message("k2", &json!({}))).await;
    wait_until("k2 handled by the new worker", || runner.settled("work") && script.lines("runs").len() == 2).await;
    assert_eq!(script.lines("runs"), ["k1 1", "k2 1"]);
    assert_eq!(script.started("runs"), 2, "k1 ran once");
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// Issue 19.11: with 5,000 queues SIGTERM took minutes, the depth poller's pass over every
/// queue finishing before shutdown went on. Shutdown no longer waits for a pass: here one
/// that never ends (the broker never answers a depth read).
#[tokio::test(start_paused = true)]
async fn shutdown_does_not_wait_for_the_depth_poller() {
    let pipeline = Pipeline::new();
    let config = pipeline.config(&[("work", command(&["work"], "")), ("other", command(&["other"], ""))]);
    let memory = Memory::new();
    memory.stall_stats(true);
    let script = Script::record();
    let runner = Runner::start_on(memory.clone(), Arc::new(memory), config, script.handlers(), None, GRACE).await;
    let (ended, ..) = runner.stop(DEADLINE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// Issue 10: shutdown finishes and acks the in-flight delivery within the grace; past the
/// grace the unfinished delivery goes back to the broker (not acked, not dead-lettered).
#[tokio::test(start_paused = true)]
async fn shutdown_finishes_in_flight_deliveries_within_the_grace() {
    shutdown(memory).await;
}

/// Issue 12: the same on the embedded broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_in_flight_deliveries_within_the_grace_on_the_embedded_broker() {
    shutdown(embedded).await;
}

async fn shutdown<B: Publish>(new: NewBroker<B>) {
    // What, the grace, how long the handler takes, then: calls ended, left in the queue.
    let rows: [(&str, Duration, f64, usize, usize); 2] =
        [("finished within the grace", GRACE, 0.3, 1, 0), ("grace expired", Duration::from_millis(100), 3.0, 0, 1)];
    for (what, grace, sleep, lines, left) in rows {
        let pipeline = Pipeline::new();
        let config = pipeline.config(&[("work", command(&["runs", &sleep.to_string()], ""))]);
        let (broker, look) = new();
        let script = sleeps();
        let store = store_for(look.as_ref(), &pipeline).await;
        let runner = Runner::start_on(broker, look.clone(), config, script.handlers(), store, grace).await;
        wait_until("ready", || runner.readiness.get()).await;
        runner.publish("work", message("k1", &json!({}))).await;
        wait_until("k1 in flight", || script.started("runs") == 1).await;

        let (ended, took, _, readiness) = runner.stop(grace + Duration::from_secs(1)).await;
        assert!(ended.is_ok(), "{what}: {ended:?}");
        assert!(!readiness.get(), "{what}: not ready once stopped");
        assert_eq!(script.lines("runs").len(), lines, "{what}: handler finished");
        assert_eq!(
            (look.messages("work").len(), look.unacked("work"), look.consumers("work")),
            (left, 0, 0),
            "{what}: ready, unacked, consumers after run returned (took {took:?})"
        );
        assert!(look.messages("work.dlq").is_empty(), "{what}: nothing dead-lettered");
    }
}

/// Issue 13: when the breaker opens, the queue stops consuming; what the worker had taken and
/// not started goes back unattempted (a delayed copy, same attempt), the calls already made
/// are retried as usual, and nothing is dead-lettered or lost.
#[tokio::test(start_paused = true)]
async fn an_open_breaker_stops_consuming_and_hands_back_unattempted() {
    let pipeline = Pipeline::new();
    // Every call says the receiver is unwell (as a refused connection does).
    let script = Script::new(|_| Answer::fails(HandlerError::unwell("connection refused", None)));
    let breaker = "    concurrency: 4\n    circuit_breaker: {failure_rate: 100%, min_calls: 1, open_for: 1h}\n";
    let runner = Runner::start(pipeline.config(&[("work", command(&["work"], breaker))]), &script, None, GRACE).await;
    for i in 0..10 {
        runner.publish("work", message(&format!("k{i}"), &json!({}))).await;
    }
    wait_until("the consumer is gone and nothing is held", || {
        runner.look.consumers("work") == 0 && runner.look.unacked("work") == 0
    })
    .await;
    // Retries of the calls made come back at once (5 ms); hand-backs wait out the opening.
    let attempt = |m: &Message| m.header("x-sluice-attempt").unwrap_or_default();
    wait_until("the call that opened it is back in the queue as a retry", || {
        let ready = runner.look.messages("work");
        ready.len() + runner.look.delayed() as usize == 10 && ready.iter().any(|m| attempt(m) == "2")
    })
    .await;
    let attempts: Vec<String> = runner.look.messages("work").iter().map(attempt).collect();
    let retried = attempts.iter().filter(|a| a.as_str() == "2").count();
    assert!((1..=4).contains(&retried), "at most one call per slot before it opened: {attempts:?}");
    assert!(attempts.iter().all(|a| a.as_str() != "3"), "{attempts:?}");
    assert!(runner.look.messages("work.dlq").is_empty());
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok());
}
/// Issue 24: a token endpoint that gives no token says the receiver is unwell: the breaker
/// opens and the queue stops consuming, the calls made are retried, and nothing is
/// dead-lettered (the receiver is never reached). The real handlers on real time: what is
/// tested is how the webhook handler classifies a token it could not get.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_token_endpoint_opens_the_breaker_and_dead_letters_nothing() {
    let pipeline = Pipeline::new();
    pipeline.write("client-secret", "s3cret\n");
    // Port 9 refuses connections: every token fetch fails.
    let queue = "    concurrency: 4\n    circuit_breaker: {failure_rate: 100%, min_calls: 1, open_for: 1h}\n    \
                 retry: {max_attempts: 3, initial: 1ms, max: 5ms}\n    \
                 handler:\n      webhook:\n        url: \"http://127.0.0.1:9/hook\"\n        \
                 auth: {oauth2: {token_url: \"http://127.0.0.1:9/token\", client_id: c, client_secret_file: client-secret}}\n"
        .to_string();
    let handlers = Arc::new(crate::call::Handlers::new().expect("client"));
    let (memory, look) = memory();
    let runner = Runner::start_on(memory, look, pipeline.config(&[("work", queue)]), handlers, None, GRACE).await;
    for i in 0..10 {
        runner.publish("work", message(&format!("k{i}"), &json!({}))).await;
    }
    wait_until("the breaker has opened: no consumer, nothing held", || {
        runner.look.consumers("work") == 0 && runner.look.unacked("work") == 0
    })
    .await;
    wait_until("every message is back in the queue or on its way", || {
        runner.look.messages("work").len() + runner.look.delayed() as usize == 10
    })
    .await;
    assert!(runner.look.messages("work.dlq").is_empty());
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok());
}

/// Issue 13: a queue paused by hand stops consuming, stays paused through a reload that
/// restarts its worker, and handles everything once resumed.
#[tokio::test(start_paused = true)]
async fn a_paused_queue_stays_paused_across_a_reload_and_resumes() {
    let pipeline = Pipeline::new();
    let script = Script::record();
    let queue = |concurrency: u16| command(&["runs"], &format!("    concurrency: {concurrency}\n"));
    let runner = Runner::start(pipeline.config(&[("work", queue(2))]), &script, None, GRACE).await;
    assert_eq!(runner.pauses.set("work", true), Ok(true));
    assert_eq!(runner.pauses.set("nope", true), Err(gate::UnknownQueue("nope".into())));
    wait_until("the consumer is gone", || runner.look.consumers("work") == 0).await;
    for i in 0..5 {
        runner.publish("work", message(&format!("k{i}"), &json!({}))).await;
    }
    // The reload also adds a queue, whose worker starts beside the restarted one: once it has
    // handled a message, the paused worker has had all the time it needs to (wrongly) consume.
    let other = ("other", command(&["other"], ""));
    let diff = runner.reload(pipeline.config(&[("work", queue(3)), other])).await.expect("reload");
    assert_eq!((diff.changed, diff.added), (names(&["work"]), names(&["other"])));
    runner.publish("other", message("sentinel", &json!({}))).await;
    wait_until("the new queue's message handled", || script.lines("other").len() == 1).await;
    assert_eq!((runner.look.consumers("work"), runner.depth("work")), (0, 5));
    assert!(script.lines("runs").is_empty());
    assert_eq!(runner.pauses.set("work", false), Ok(true));
    wait_until("all five handled", || runner.settled("work") && script.lines("runs").len() == 5).await;
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok());
}

/// Issue 19: a pause outlives its queue: paused by hand, removed by a reload (which no pause
/// or resume can name meanwhile) and brought back by another, the queue comes back paused;
/// before, it came back consuming.
#[tokio::test(start_paused = true)]
async fn a_pause_survives_removing_and_re_adding_the_queue() {
    let pipeline = Pipeline::new();
    let script = Script::record();
    let other = ("other", command(&["other"], ""));
    let both = || pipeline.config(&[("work", command(&["runs"], "")), other.clone()]);
    let runner = Runner::start(both(), &script, None, GRACE).await;
    assert_eq!(runner.pauses.set("work", true), Ok(true));
    wait_until("the consumer is gone", || runner.look.consumers("work") == 0).await;

    let diff = runner.reload(pipeline.config(std::slice::from_ref(&other))).await.expect("reload");
    assert_eq!(diff.removed, names(&["work"]));
    assert_eq!(runner.pauses.set("work", false), Err(gate::UnknownQueue("work".into())));
    let diff = runner.reload(both()).await.expect("reload");
    assert_eq!(diff.added, names(&["work"]));
    assert_eq!(runner.pauses.set("work", true), Ok(false), "already paused");

    for i in 0..3 {
        runner.publish("work", message(&format!("k{i}"), &json!({}))).await;
    }
    runner.publish("other", message("o1", &json!({}))).await;
    wait_until("other handles its message", || runner.settled("other") && script.lines("other").len() == 1).await;
    assert_eq!((runner.look.consumers("work"), runner.depth("work")), (0, 3));
    assert!(script.lines("runs").is_empty());
    assert_eq!(runner.pauses.set("work", false), Ok(true));
    wait_until("all three handled", || runner.settled("work") && script.lines("runs").len() == 3).await;
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok());
}

/// Issue 19: a reload replacing a queue whose calls outlive the grace leaves those calls
/// running with their deliveries and their slots: none of their messages is delivered again
/// meanwhile, and the new worker, its limit lowered from 3 to 2, starts a call only while fewer
/// than 2 run. Before, the old worker handed its deliveries back once the grace was over and
/// the new one ran them a second time beside the old calls, over the limit.
#[tokio::test(start_paused = true)]
async fn calls_outliving_a_reloads_grace_keep_their_messages_and_slots() {
    calls_outliving_the_grace(memory).await;
}

/// Issue 19: the same on the embedded broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_outliving_a_reloads_grace_keep_their_messages_and_slots_on_the_embedded_broker() {
    calls_outliving_the_grace(embedded).await;
}

async fn calls_outliving_the_grace<B: Publish>(new: NewBroker<B>) {
    let pipeline = Pipeline::new();
    // Each call is held until the script opens; its events tell which ran at once.
    let script = Script::new(|_| Answer::ok().held());
    let queue = |concurrency: u16| command(&["log"], &format!("    concurrency: {concurrency}\n"));
    let (broker, look) = new();
    let grace = Duration::from_millis(100);
    // No idempotency store: nothing but the runtime keeps a message from running twice.
    let config = pipeline.config(&[("work", queue(3))]);
    let runner = Runner::start_on(broker, look, config, script.handlers(), None, grace).await;
    let keys: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
    for key in &keys {
        runner.publish("work", message(key, &json!({}))).await;
    }
    wait_until("three calls running", || script.started("log") == 3).await;

    let diff = runner.reload(pipeline.config(&[("work", queue(2))])).await.expect("reload applied");
    assert_eq!(diff, Diff { changed: names(&["work"]), ..Diff::default() });
    wait_until("the old calls hold 3, the new worker 2 (or a call started again)", || {
        (runner.look.unacked("work") == 5 && runner.depth("work") == 3) || script.started("log") > 3
    })
    .await;
    assert_eq!(script.started("log"), 3, "no call started beside the three still running: {:?}", script.events());
    script.mark();

    script.open();
    wait_until("all eight handled", || runner.settled("work") && script.ended("log").len() == 8).await;
    let events = script.events().clone();
    let starts =
        counts(events.iter().filter_map(|e| if let Event::Start(j) = e { Some(j.key.as_str()) } else { None }));
    assert_eq!(starts, keys.iter().map(|k| (k.clone(), 1)).collect(), "calls per key: {events:?}");
    // The most calls running when one started after the reload, itself included.
    let (mut running, mut reloaded, mut busiest) = (0usize, false, 0);
    for event in &events {
        match event {
            Event::Start(_) => {
                running += 1;
                if reloaded {
                    busiest = busiest.max(running);
                }
            }
            Event::End(_) => running -= 1,
            Event::Mark => reloaded = true,
        }
    }
    assert!(busiest <= 2, "{busiest} calls at once under the new limit of 2: {events:?}");
    wait_until("the old consumer closed once its calls were settled", || runner.look.consumers("work") == 1).await;
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// How often each item occurs.
fn counts<'a>(items: impl Iterator<Item = &'a str>) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for item in items {
        *counts.entry(item.to_string()).or_insert(0) += 1;
    }
    counts
}

/// Issue 19: shutdown stays bounded by the grace with a retiring worker (one whose calls
/// outlived a reload's grace): once the grace is over, what it holds goes back to the broker,
/// unacked and not dead-lettered, as a running worker's does.
#[tokio::test(start_paused = true)]
async fn shutdown_releases_what_a_retiring_worker_holds_within_the_grace() {
    let pipeline = Pipeline::new();
    let script = Script::new(|_| Answer::ok().held());
    let queue = |concurrency: u16| command(&["log"], &format!("    concurrency: {concurrency}\n"));
    let grace = Duration::from_millis(100);
    let runner = Runner::start(pipeline.config(&[("work", queue(2))]), &script, None, grace).await;
    for key in ["k0", "k1"] {
        runner.publish("work", message(key, &json!({}))).await;
    }
    wait_until("two calls running", || script.started("log") == 2).await;
    runner.reload(pipeline.config(&[("work", queue(3))])).await.expect("reload applied");
    wait_until("the old consumer holds both beside the new one", || {
        runner.look.consumers("work") == 2 && runner.look.unacked("work") == 2
    })
    .await;

    let (ended, _, memory, _) = runner.stop(grace + Duration::from_secs(1)).await;
    assert!(ended.is_ok(), "{ended:?}");
    assert_eq!((memory.messages("work").len(), memory.unacked("work"), memory.consumers("work")), (2, 0, 0));
    assert!(memory.messages("work.dlq").is_empty());
}

/// Issue 24: a queue bound twice, once with a filter: through the filtered binding only the
/// messages the filter holds for run the handler; the rest are acked as filtered (no run, no
/// copy, nothing left). The unfiltered binding takes everything, a publish straight to the
/// queue (no binding routed it) is taken because one binding takes anything, and a retry copy
/// of a message the filter took is taken again.
#[tokio::test(start_paused = true)]
async fn binding_filters_decide_before_the_handler() {
    binding_filters(memory).await;
}

/// Issue 24: the same on the embedded broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_filters_decide_before_the_handler_on_the_embedded_broker() {
    binding_filters(embedded).await;
}

async fn binding_filters<B: Publish>(new: NewBroker<B>) {
    let pipeline = Pipeline::new();
    // Fails the first attempt of key "retried", so that its retry copy comes back.
    let script = Script::new(|job| if job.line() == "retried 1" { transient() } else { Answer::ok() });
    let extra = "    bind:\n      - exchange: ev\n        routing_key: order.*\n        filter: {all: [{field: payload.amount, gte: 100}, {not: {field: payload.test, exists: true}}]}\n      - exchange: ev\n        routing_key: refund.#\n";
    let config = pipeline.config(&[("work", command(&["runs"], extra))]);
    let (broker, look) = new();
    let runner = Runner::start_on(broker, look, config, script.handlers(), None, GRACE).await;
    let sent = [
        ("order.created", "big", json!({"amount": 150})),
        ("order.created", "small", json!({"amount": 5})),
        ("order.created", "test", json!({"amount": 500, "test": true})),
        ("order.created", "not a number", json!({"amount": "150"})),
        ("order.created", "retried", json!({"amount": 100})),
        ("refund.issued", "refund", json!({"amount": 5})),
    ];
    for (routing_key, key, payload) in &sent {
        runner.publish_to("ev", routing_key, message(key, payload)).await;
    }
    runner.publish("work", message("direct", &json!({"amount": 1}))).await;
    let taken = ["big 1", "direct 1", "refund 1", "retried 1", "retried 2"];
    wait_until("every message settled", || runner.settled("work") && script.lines("runs").len() == taken.len()).await;
    let mut runs = script.lines("runs");
    runs.sort();
    assert_eq!(runs, taken);
    assert_eq!(runner.depth("work.dlq"), 0, "nothing filtered is dead-lettered");
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// Issue 32 item 1: a retry delay longer than the broker's longest delay (here 15 minutes, as
/// SQS's, against an hour's retry) is served in hops, each no longer than the broker holds,
/// and the copy is never handled before its due time, nor its attempt counted twice. On
/// paused time, at full scale.
#[tokio::test(start_paused = true)]
async fn a_delay_longer_than_the_broker_holds_is_served_in_hops_and_never_early() {
    let pipeline = Pipeline::new();
    let longest = Duration::from_secs(15 * 60);
    let retry = Duration::from_secs(3600);
    // Fails the first attempt.
    let script = Script::new(|job| if job.attempt == 1 { transient() } else { Answer::ok() });
    let queue = command(&["runs"], "    retry: {max_attempts: 3, initial: 1h, max: 1h, jitter: none}\n");
    let memory = Memory::with_longest_delay(longest);
    let config = pipeline.config(&[("work", queue)]);
    let runner =
        Runner::start_on(memory.clone(), Arc::new(memory.clone()), config, script.handlers(), None, GRACE).await;
    runner.publish("work", message("k", &json!({}))).await;
    // An hour of tokio's clock passes at once; polling through it would take long.
    tokio::time::sleep(retry).await;
    wait_until("the retry handled", || script.lines("runs").len() == 2 && runner.settled("work")).await;

    let runs = script.ended("runs");
    assert_eq!(runs.iter().map(|j| j.attempt).collect::<Vec<_>>(), [1, 2], "one retry, counted once");
    let waited = runs[1].at - runs[0].at;
    assert!(waited >= retry, "handled {waited:?} after the first attempt, before its due time ({retry:?})");
    let held = memory.held_delays();
    assert!(held.iter().all(|hop| *hop <= longest), "a hop longer than the broker holds: {held:?}");
    // Four hops of 15 minutes (a last one of under a millisecond may follow: the due time's
    // header holds whole milliseconds, rounded up).
    assert!(held.len() >= 4 && held[..4] == [longest; 4], "not in hops of 15 minutes: {held:?}");
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// An `order_by` queue's body: keyed by the payload's `k`, the handler told the key and the
/// message's number `n`, `extra` YAML after.
fn keyed(extra: &str) -> String {
    command(&["runs", "{{payload.k}}", "{{payload.n}}"], &format!("    order_by: \"{{{{payload.k}}}}\"\n{extra}"))
}

/// A keyed message: key `k`, number `n` (its idempotency key `k-n`).
fn keyed_message(k: &str, n: usize) -> Vec<u8> {
    message(&format!("{k}-{n}"), &json!({"k": k, "n": n}))
}

/// Issue 34: an `order_by` queue handles each key's messages one at a time in publish order,
/// a failed first attempt retried before the key's next message starts, while the keys run
/// in parallel.
#[tokio::test(start_paused = true)]
async fn an_order_by_queue_keeps_each_keys_order_and_runs_keys_in_parallel() {
    keys_in_order(memory).await;
}

/// Issue 34: the same on the embedded broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_by_queue_keeps_each_keys_order_on_the_embedded_broker() {
    keys_in_order(embedded).await;
}

async fn keys_in_order<B: Publish>(new: NewBroker<B>) {
    const KEYS: usize = 6;
    const EACH: usize = 8;
    let pipeline = Pipeline::new();
    // Every third message fails its first attempt.
    let script = Script::new(|job| {
        let n: usize = job.args[1].parse().unwrap_or_default();
        match n.is_multiple_of(3) && job.attempt == 1 {
            true => transient().after(Duration::from_millis(5)),
            false => Answer::ok().after(Duration::from_millis(10)),
        }
    });
    let (broker, look) = new();
    let config = pipeline.config(&[("work", keyed("    concurrency: 4\n"))]);
    let store = store_for(look.as_ref(), &pipeline).await;
    let runner = Runner::start_on(broker, look, config, script.handlers(), store, GRACE).await;
    for n in 0..EACH {
        for k in 0..KEYS {
            runner.publish("work", keyed_message(&format!("key{k}"), n)).await;
        }
    }
    let total = KEYS * EACH + EACH.div_ceil(3) * KEYS;
    wait_until("every message handled", || script.lines("runs").len() == total && runner.settled("work")).await;

    let events = script.events().clone();
    let (mut running, mut most) = (BTreeMap::<String, usize>::new(), 0);
    let mut succeeded = BTreeMap::<String, Vec<String>>::new();
    for event in &events {
        match event {
            Event::Start(job) => {
                let busy = running.entry(job.args[0].clone()).or_default();
                *busy += 1;
                assert_eq!(*busy, 1, "two calls of {} at once: {events:?}", job.args[0]);
                most = most.max(running.values().sum());
            }
            Event::End(job) => {
                *running.entry(job.args[0].clone()).or_default() -= 1;
                let n: usize = job.args[1].parse().expect("n");
                if !n.is_multiple_of(3) || job.attempt > 1 {
                    succeeded.entry(job.args[0].clone()).or_default().push(job.args[1].clone());
                }
            }
            Event::Mark => {}
        }
    }
    let in_order: Vec<String> = (0..EACH).map(|n| n.to_string()).collect();
    for k in 0..KEYS {
        assert_eq!(succeeded[&format!("key{k}")], in_order, "key{k}'s successes");
    }
    assert!(most > 1, "the keys never ran in parallel");
    assert!(most <= 4, "{most} calls at once, over the concurrency");
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}

/// Issue 34: a poison message dead-lettered: with `release` its key's next message runs;
/// with `hold` it waits, unacked, while other keys run, until the poison is redriven.
#[tokio::test(start_paused = true)]
async fn a_dead_lettered_message_releases_or_holds_its_key() {
    for hold in [false, true] {
        let pipeline = Pipeline::new();
        let poisoned = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let poison = poisoned.clone();
        let script = Script::new(move |job| {
            let bad = job.args == ["a", "0"] && poison.load(std::sync::atomic::Ordering::SeqCst);
            if bad { permanent() } else { Answer::ok() }
        });
        let extra = if hold { "    on_dead_letter: hold\n" } else { "" };
        let config = pipeline.config(&[("work", keyed(extra))]);
        let runner = Runner::start(config, &script, None, GRACE).await;
        let bad = keyed_message("a", 0);
        for body in [bad.clone(), keyed_message("a", 1), keyed_message("b", 0)] {
            runner.publish("work", body).await;
        }
        let handled = |line: &str| script.ended("runs").iter().any(|j| j.args.join(" ") == line);
        wait_until("the poison dead-lettered and b handled", || runner.depth("work.dlq") == 1 && handled("b 0")).await;
        if !hold {
            wait_until("a's next message runs", || handled("a 1") && runner.settled("work")).await;
        } else {
            wait_until("a's next message held, unacked", || runner.look.unacked("work") == 1).await;
            assert!(!handled("a 1"), "a's next message ran while its key was held");
            // Redriven (the same message again), it runs first and frees the key.
            poisoned.store(false, std::sync::atomic::Ordering::SeqCst);
            runner.publish("work", bad.clone()).await;
            wait_until("the redriven message, then a's next", || handled("a 1") && runner.settled("work")).await;
            let a: Vec<String> =
                script.ended("runs").iter().filter(|j| j.args[0] == "a").map(|j| j.args.join(" ")).collect();
            assert_eq!(a, ["a 0", "a 0", "a 1"], "the redriven poison before a's next");
        }
        let (ended, ..) = runner.stop(GRACE).await;
        assert!(ended.is_ok(), "{ended:?}");
    }
}

/// Issue 34 part 3: a reload that changes an `order_by` queue drains it whole, past the grace:
/// the key's next message, waiting behind a call that outlives the grace, runs only after that
/// call ended, on the new worker.
#[tokio::test(start_paused = true)]
async fn a_reload_of_an_order_by_queue_drains_it_whole_first() {
    let pipeline = Pipeline::new();
    let script = Script::new(|job| if job.args[1] == "0" { Answer::ok().held() } else { Answer::ok() });
    let grace = Duration::from_millis(100);
    let config = pipeline.config(&[("work", keyed(""))]);
    let runner = Runner::start(config, &script, None, grace).await;
    for n in 0..3 {
        runner.publish("work", keyed_message("a", n)).await;
    }
    wait_until("a 0 running, a 1 and a 2 waiting behind it", || {
        script.started("runs") == 1 && runner.look.unacked("work") == 3
    })
    .await;

    // Ordered by another template (the same keys here): the queue changes.
    let changed = command(&["runs", "{{payload.k}}", "{{payload.n}}"], "    order_by: \"k-{{payload.k}}\"\n");
    let mut reload = {
        let config = pipeline.config(&[("work", changed)]);
        let (applied, outcome) = oneshot::channel();
        runner.reloads.send(Reload { config, applied }).unwrap_or_else(|_| panic!("run has ended"));
        outcome
    };
    // Ten graces later the reload still waits for a 0, and nothing else started.
    tokio::time::sleep(grace * 10).await;
    assert_eq!(script.started("runs"), 1, "a call started beside a 0: {:?}", script.events());
    assert!(reload.try_recv().is_err(), "the reload applied before the queue was drained");
    script.mark();
    script.open();
    let diff = reload.await.expect("answered").expect("applied");
    assert_eq!(diff, Diff { changed: names(&["work"]), ..Diff::default() });
    wait_until("a's three handled", || script.ended("runs").len() == 3 && runner.settled("work")).await;
    let order: Vec<String> = script.ended("runs").iter().map(|j| j.args.join(" ")).collect();
    assert_eq!(order, ["a 0", "a 1", "a 2"]);
    let events = script.events().clone();
    let mark = events.iter().position(|e| matches!(e, Event::Mark)).expect("marked");
    assert!(
        events[mark..].iter().any(|e| matches!(e, Event::End(j) if j.args[1] == "0")),
        "a 0 ended after the grace: {events:?}"
    );
    let (ended, ..) = runner.stop(GRACE).await;
    assert!(ended.is_ok(), "{ended:?}");
}
