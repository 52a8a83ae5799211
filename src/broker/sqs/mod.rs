//! The Amazon SQS broker: the [`Broker`] trait on SQS standard and FIFO queues, through the SQS JSON
//! protocol over our own HTTP client ([`aws`]). Many processes on many hosts share one
//! deployment (a name prefix in one account and region).
//!
//! - A sluice queue is the SQS queue `PREFIX-NAME`, its name's `.` and `:` written as `-`
//!   (`orders.email` under `shop` is `shop-orders-email`); `validate --broker sqs://…` refuses
//!   two names that would meet, and a name past SQS's 80 characters. The queue's tag
//!   `sluice-queue` holds the exact name.
//! - Routing is sluice's, on publish, with the kit's [`Topology`](super::kit::topology) (AMQP's
//!   direct, fanout, topic and headers semantics exactly): each queue's tags hold its
//!   declaration, its bindings and the plan's exchanges (JSON, base64, in 256-character tags),
//!   so any process of ours publishes to an exchange and reaches every bound queue with its
//!   filter, while a producer that speaks only SQS sends straight to a queue. Not SNS: an SNS
//!   topic's filter policies cannot say AMQP's `*` and `#`, a subscription is one more service
//!   (and policy) to run, and a fan-out copy lost between SNS and a queue is out of our sight.
//! - A delivery is leased by its visibility timeout (30 s, `?lease=`), renewed every third
//!   of it while held (`ChangeMessageVisibilityBatch`), handed back at once on a close
//!   (visibility 0). A killed runner's messages come back when their lease runs out. Receives
//!   long-poll ([`LONG_POLL`]) and take 10 at a time; deletes (acks) go 10 to a request.
//! - A retry is a new copy sent with `DelaySeconds` (SQS holds a copy at most 15 minutes: the
//!   runtime serves longer delays in hops) and its exact due time; the attempt count is
//!   sluice's header, not SQS's receive count. Every work queue has a redrive policy to its
//!   dead-letter queue (`maxReceiveCount` [`MAX_RECEIVES`]) only as a safety net for a message
//!   that kills its runner; it lands there with the reason `delivery_limit`.
//! - An ordered queue (`ordered`, `order_by`: a declaration with a single active consumer) is
//!   a FIFO queue, `PREFIX-NAME.fifo`, and so is its dead-letter queue (SQS redrives a FIFO
//!   queue only to a FIFO queue). A message's group (`MessageGroupId`) is its `order_by` key,
//!   rendered by whoever sends it from the template the queue's tags keep, or one group for
//!   `ordered`; SQS then hands out a group's messages in order, none while one of them is held,
//!   so per-key order holds across runners. A delayed copy keeps its original's group; a
//!   dead-letter copy is a group of its own (a browse holding a group's first messages would
//!   never see the rest), and so is a redriven one (its key may be held for it by a runner
//!   holding the key's next message, which SQS would not let it pass). Its
//!   deduplication id is the message id on a publish (a send repeated within SQS's 5 minutes is
//!   dropped), a fresh one on a copy (a redrive is the same message again). SQS takes no delay
//!   per message there: a delayed copy is sent at once with its due time and held by the
//!   consumer that receives it, its group waiting behind it (an `order_by` retry never is a
//!   copy: it waits in the runner, holding its key).
//! - sluice's properties ride in one message attribute, `sluice`; a body SQS cannot carry as
//!   text (not UTF-8, or characters SQS refuses) goes base64 with the attribute `sluice-body`.
//!   A message of another producer is read as it is: its attributes are its headers, its SQS
//!   id its message id.
//!
//! URL: `sqs://REGION[/PREFIX][?endpoint=http://HOST:PORT&lease=DUR&hop=DUR]`; credentials from the
//! standard AWS chain ([`aws`]).

pub mod aws;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::Notify;

use self::aws::{Aws, AwsError};
use super::declaration::{self, unsupported};
use super::kit::carried::Carried;
use super::kit::claim::{self, Ask, Claimed, Claimer, Holder};
use super::kit::lease::Renewal;
use super::kit::topology::{self, QueueRule, binding_from, binding_text};
use super::kit::{kept, lock};
use super::render::Picture;
use super::{
    BodyLimits, Broker, BrokerError, Consumer, Credit, Drift, Edits, HeaderValue, Headers, Kept, KeptDeliveries,
    Operate, Outgoing, Properties, Publish, QueueStats, Target,
};
use crate::envelope;
use crate::topology::{BindingDecl, Plan, QueueDecl, Role};
use crate::vocab::capabilities::{Capabilities, HandBack, QueueNames};
use crate::vocab::{ExchangeKind, QueueKind};

/// How long a delivery stays leased to its consumer without a renewal, unless the URL says
/// otherwise (`?lease=`).
pub const LEASE: Duration = Duration::from_secs(30);

/// How long a receive waits for a message when none is ready (SQS long polling): an idle
/// consumer asks every this often.
pub const LONG_POLL: Duration = Duration::from_secs(2);

/// How many times SQS delivers a message before its redrive policy moves it to the queue's
/// dead-letter queue (a message that kills its runner each time): RabbitMQ's delivery limit.
pub const MAX_RECEIVES: i64 = super::amqp::DELIVERY_LIMIT;

/// Amazon SQS: a copy waits at most 15 minutes (longer delays in hops); bodies up to 256 KiB
/// (the message with its attributes; send a reference to a larger blob kept elsewhere); no
/// bound on a queue, no priorities, no expiry, no broker arguments, no single active
/// consumer: order per key (FIFO queues' message groups) instead. sluice routes every exchange
/// kind itself. SQS does not know a queue's consumers; a standard queue delivers in no strict
/// order.
pub const CAPABILITIES: Capabilities = Capabilities {
    name: BROKER,
    longest_delay: Some(LONGEST_DELAY),
    largest_body: 256 << 10,
    priorities: false,
    message_ttl: false,
    max_length: false,
    queue_types: QueueKind::ALL,
    exchange_kinds: ExchangeKind::ALL,
    orderings: &[crate::vocab::capabilities::Ordering::PerKey],
    arguments: false,
    hand_back: HandBack::PerMessage,
    leases: true,
    holds_acks: false,
    holds_keys: false,
    browse_in_order: false,
    atomic_copy_and_remove: false,
    admits_past_max_length: 0,
    // Under the default prefix; each deployment's own is its `Kind`'s.
    queue_names: Some(QueueNames { longest: LONGEST_NAME - DEFAULT_PREFIX.len() - 1, ordered_suffix: FIFO.len() }),
    counts_consumers: false,
    counts_waiting_consumers: false,
};

/// The longest SQS holds one delayed copy.
pub const LONGEST_DELAY: Duration = Duration::from_secs(900);

/// The most characters of an SQS queue name.
pub const LONGEST_NAME: usize = 80;

/// How a FIFO queue's name ends.
pub const FIFO: &str = ".fifo";

/// The most characters of a FIFO message's group and deduplication ids.
const LONGEST_ID: usize = 128;

/// How long SQS keeps a message (its longest): a message never handled is deleted after it.
const RETENTION: Duration = Duration::from_secs(14 * 24 * 3600);

/// How long a topology read serves publishes before it is read again.
const TOPOLOGY_FRESH: Duration = Duration::from_secs(1);

/// The most entries of one batch request.
const BATCH: usize = 10;

/// The most receives of one claim (each takes up to [`BATCH`]).
const RECEIVES: usize = 5;

/// This broker, as a refused declaration names it.
const BROKER: &str = "the SQS broker";

/// Where this broker looks for declarations, as a refusal on an empty one says.
const PLACE: &str = "under this prefix";

/// The default name prefix.
pub const DEFAULT_PREFIX: &str = "sluice";

/// The message attribute holding sluice's properties (one JSON object).
const PROPERTIES: &str = "sluice";

/// The message attribute saying the body is base64.
const BODY_ENCODING: &str = "sluice-body";

/// The tag naming a queue's deployment (its prefix), and the one holding its exact name.
const TAG_DEPLOYMENT: &str = "sluice-deployment";
const TAG_QUEUE: &str = "sluice-queue";

/// The tags holding a queue's record, `sluice-0`, `sluice-1`, …: at most this many (SQS takes
/// 50 tags a queue), each at most 256 characters.
const RECORD_TAGS: usize = 40;
const TAG_CHARS: usize = 256;

/// Where a deployment is: its region, endpoint, name prefix and lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub region: String,
    pub prefix: String,
    pub endpoint: Option<String>,
    pub lease: Duration,
    /// The longest one delayed copy is sent to wait ([`LONGEST_DELAY`] unless `?hop=` lowers
    /// it: tests serve a long delay in many short hops so).
    pub hop: Duration,
}

impl Location {
    /// Parses `sqs://REGION[/PREFIX][?endpoint=URL&lease=DUR&hop=DUR]`.
    pub fn parse(url: &str) -> Result<Location, BrokerError> {
        let bad = |reason: String| BrokerError::Connect { url: url.into(), reason: reason.into() };
        let rest = url.strip_prefix("sqs://").ok_or_else(|| bad("expected sqs://REGION[/PREFIX]".into()))?;
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (region, prefix) = path.split_once('/').unwrap_or((path, DEFAULT_PREFIX));
        let prefix = prefix.trim_end_matches('/');
        if region.is_empty() || !region.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-') {
            return Err(bad(format!("region {region:?}: expected an AWS region such as us-east-1")));
        }
        if prefix.is_empty()
            || prefix.len() > 40
            || !prefix.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(bad(format!("prefix {prefix:?}: expected 1 to 40 letters, digits, - or _")));
        }
        let mut location =
            Location { region: region.into(), prefix: prefix.into(), endpoint: None, lease: LEASE, hop: LONGEST_DELAY };
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("endpoint", value)) if value.starts_with("http://") || value.starts_with("https://") => {
                    location.endpoint = Some(value.to_string());
                }
                Some(("endpoint", value)) => {
                    return Err(bad(format!("endpoint={value}: expected http://HOST:PORT or https://HOST")));
                }
                Some(("lease", value)) => {
                    location.lease = crate::vocab::parse_duration(value)
                        .filter(|d| *d >= Duration::from_secs(3) && *d <= Duration::from_secs(12 * 3600))
                        .ok_or_else(|| bad(format!("lease={value}: expected a duration from 3s to 12h, e.g. 30s")))?;
                }
                Some(("hop", value)) => {
                    location.hop = crate::vocab::parse_duration(value)
                        .filter(|d| *d >= Duration::from_secs(1) && *d <= LONGEST_DELAY && d.subsec_nanos() == 0)
                        .ok_or_else(|| bad(format!("hop={value}: expected whole seconds from 1s to 15m, e.g. 2s")))?;
                }
                _ => return Err(bad(format!("unknown parameter {pair:?}: expected endpoint, lease or hop"))),
            }
        }
        Ok(location)
    }

    /// The SQS name of sluice's queue `queue` (a standard queue's).
    pub fn queue_name(&self, queue: &str) -> String {
        format!("{}-{}", self.prefix, fold(queue))
    }

    /// The SQS name of sluice's queue `queue`, a FIFO queue's when `fifo`.
    fn name_of(&self, queue: &str, fifo: bool) -> String {
        let name = self.queue_name(queue);
        if fifo { name + FIFO } else { name }
    }

    /// The lease in whole seconds, as SQS takes it (rounded up).
    fn lease_seconds(&self) -> u64 {
        self.lease.as_secs() + u64::from(self.lease.subsec_nanos() > 0)
    }
}

/// A sluice name as SQS takes it: `.` and `:` (which SQS refuses) written as `-`.
fn fold(name: &str) -> String {
    QueueNames::write(name)
}

/// What `sluice plan --broker sqs://…` shows: the plan as this broker keeps it, with each
/// queue's SQS name.
pub fn picture(plan: &Plan, location: &Location) -> Picture {
    let title = format!(
        "the SQS broker in {}, names under {:?} (a standard queue for each queue, a FIFO queue for an ordered one and its dead-letter queue, grouped by its order_by key; sluice routes on publish, bindings kept in the queues' tags; lease {}s)",
        location.region,
        location.prefix,
        location.lease_seconds()
    );
    let delays = "delays: a retry is a copy sent with DelaySeconds (at most 15 minutes: longer delays are served in hops), held by its consumer for the last second; on a FIFO queue, which takes no delay per message, an order_by retry waits in the runner, and another delayed copy is sent at once and held by its consumer until due".to_string();
    let fifo = fifo_queues(plan);
    declaration::picture(plan, BROKER, title, delays, |q| {
        Some(("sqs queue", format!("{:?}", location.name_of(q, fifo.contains_key(q)))))
    })
}

/// How the messages of a FIFO queue are grouped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Grouping {
    /// All in one group: an `ordered` queue, a dead-letter queue (what a producer of another
    /// kind sends there).
    One,
    /// By the `order_by` key the template renders over a message read in the format.
    Key { template: String, format: String },
}

impl Grouping {
    /// The group of a message sent to `queue`: its `order_by` key as SQS takes it, or the one
    /// group.
    fn group(&self, queue: &str, message: &Carried) -> String {
        let Grouping::Key { template, format } = self else { return ONE_GROUP.into() };
        let key = crate::vocab::format::Format::parse(format).and_then(|format| {
            let key = crate::topology::OrderKey { template: template.clone(), format };
            let delivery = Kept::standalone(message.body.clone(), message.properties.clone());
            let read = crate::format::Message::decode(format, &delivery).ok()?;
            crate::call::order_key_of(&key, queue, &read)
        });
        // One whose key does not render is dead-lettered by its runner: a group of its own.
        sqs_id(&key.unwrap_or_else(|| message.properties.message_id.clone().unwrap_or_default()))
    }
}

/// The group of an ordered queue's messages, and of a copy whose original had none.
const ONE_GROUP: &str = "sluice";

/// `text` as a FIFO message's group or deduplication id takes it (at most 128 characters,
/// letters, digits and ASCII punctuation), else its digest.
fn sqs_id(text: &str) -> String {
    let fits = !text.is_empty() && text.len() <= LONGEST_ID && text.chars().all(|c| c.is_ascii_graphic());
    if fits { text.to_string() } else { crate::format::sha256_id(text.as_bytes()) }
}

/// A deduplication id of its own for a copy.
fn fresh_id(message: &Carried) -> String {
    static COPIES: AtomicU64 = AtomicU64::new(0);
    let id = message.properties.message_id.as_deref().unwrap_or_default();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let copy = COPIES.fetch_add(1, Ordering::SeqCst);
    crate::format::sha256_id(format!("{id} {} {nanos} {copy}", std::process::id()).as_bytes())
}

/// The FIFO queues of `plan`, by name: its ordered work queues (single active consumer) and
/// their dead-letter queues.
fn fifo_queues(plan: &Plan) -> HashMap<String, Grouping> {
    let mut fifo = HashMap::new();
    for q in plan.queues.iter().filter(|q| q.role == Role::Work && q.single_active_consumer) {
        let grouping = match &q.order_key {
            Some(k) => Grouping::Key { template: k.template.clone(), format: k.format.name().into() },
            None => Grouping::One,
        };
        fifo.insert(q.name.clone(), grouping);
        if let Some(dlq) = &q.dead_letter {
            fifo.insert(dlq.clone(), Grouping::One);
        }
    }
    fifo
}

/// What a queue's tags record of it: its declaration, body limit, bindings, and the
/// exchanges of the plan that declared it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Record {
    /// The declaration's JSON.
    declaration: String,
    limit: Option<u64>,
    bindings: Vec<String>,
    exchanges: BTreeMap<String, String>,
    /// A FIFO queue's grouping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fifo: Option<Grouping>,
}

impl Record {
    /// The tags holding it: chunks of its base64 JSON.
    fn tags(&self) -> BTreeMap<String, String> {
        let encoded = base64::engine::general_purpose::STANDARD.encode(serde_json::to_vec(self).unwrap_or_default());
        let mut tags = BTreeMap::new();
        for (i, chunk) in encoded.as_bytes().chunks(TAG_CHARS).enumerate() {
            tags.insert(format!("sluice-{i}"), String::from_utf8_lossy(chunk).into_owned());
        }
        tags
    }

    /// A record from a queue's tags; `None` when they hold none that reads.
    fn from_tags(tags: &serde_json::Map<String, Value>) -> Option<Record> {
        let mut encoded = String::new();
        for i in 0..RECORD_TAGS {
            match tags.get(&format!("sluice-{i}")).and_then(Value::as_str) {
                Some(chunk) => encoded.push_str(chunk),
                None => break,
            }
        }
        let json = base64::engine::general_purpose::STANDARD.decode(encoded).ok()?;
        serde_json::from_slice(&json).ok()
    }

    fn role(&self) -> Option<String> {
        let d: Value = serde_json::from_str(&self.declaration).ok()?;
        d.get("role").and_then(Value::as_str).map(str::to_string)
    }
}

/// The deployment's queues as their tags record them, by sluice name.
#[derive(Debug, Clone, Default)]
struct Stored {
    queues: BTreeMap<String, Record>,
}

impl Stored {
    fn exchange(&self, name: &str) -> Option<String> {
        self.queues.values().find_map(|r| r.exchanges.get(name).cloned())
    }

    fn has_binding(&self, b: &BindingDecl) -> bool {
        let text = binding_text(b);
        self.queues.get(&b.queue).is_some_and(|r| r.bindings.contains(&text))
    }

    fn routes(&self) -> Routes {
        let fifo = self.queues.iter().filter_map(|(name, r)| Some((name.clone(), r.fifo.clone()?))).collect();
        Routes { topology: self.topology(), fifo }
    }

    fn topology(&self) -> Topology {
        let mut exchanges = HashMap::new();
        let mut bindings = Vec::new();
        for record in self.queues.values() {
            for (name, kind) in &record.exchanges {
                if let Some(kind) = topology::exchange_kind(kind) {
                    exchanges.insert(name.clone(), kind);
                }
            }
            bindings.extend(record.bindings.iter().filter_map(|b| binding_from(b)));
        }
        let queues = self
            .queues
            .iter()
            .map(|(name, r)| (name.clone(), QueueRule { max_body: r.limit, ..QueueRule::default() }))
            .collect();
        Topology { version: (), exchanges, queues, bindings }
    }
}

/// The topology as last read.
type Topology = topology::Topology<()>;

/// What a publish reads: the topology, and the FIFO queues' groupings by name.
struct Routes {
    topology: Topology,
    fifo: HashMap<String, Grouping>,
}

/// An AWS error as the broker's: a missing queue is [`BrokerError::NotFound`]; anything else
/// may pass on a retry.
fn failed(context: &str, e: AwsError) -> BrokerError {
    match &e {
        AwsError::Service { code, .. } if code == "QueueDoesNotExist" => {
            BrokerError::NotFound(format!("sqs: {context}: {e}").into())
        }
        _ => BrokerError::Lost(format!("sqs: {context}: {e}").into()),
    }
}

/// A session with an SQS deployment. Cheap to clone; clones share it.
#[derive(Clone)]
pub struct Sqs {
    inner: Arc<Inner>,
}

struct Inner {
    aws: Aws,
    location: Location,
    /// Queue URLs by sluice name.
    urls: Mutex<HashMap<String, String>>,
    /// The topology last read, and when.
    topology: Mutex<Option<(tokio::time::Instant, Arc<Routes>)>>,
    /// Whether the last request was answered.
    answered: AtomicBool,
    closed: AtomicBool,
}

impl Sqs {
    /// Connects to the deployment `url` names: its endpoint answers and takes the credentials
    /// (the standard chain, from this process's environment and files).
    pub async fn connect(url: &str) -> Result<Sqs, BrokerError> {
        Sqs::connect_with_env(url, Arc::new(|name: &str| std::env::var(name).ok())).await
    }

    /// [`Sqs::connect`] with the environment read through `env` (an emulator's dummy keys).
    pub async fn connect_with_env(url: &str, env: aws::Env) -> Result<Sqs, BrokerError> {
        let location = Location::parse(url)?;
        let refused = |reason: String| BrokerError::Connect { url: url.into(), reason: reason.into() };
        let aws =
            Aws::with_env(&location.region, location.endpoint.as_deref(), env).map_err(|e| refused(e.to_string()))?;
        let sqs = Sqs {
            inner: Arc::new(Inner {
                aws,
                location,
                urls: Mutex::new(HashMap::new()),
                topology: Mutex::new(None),
                answered: AtomicBool::new(true),
                closed: AtomicBool::new(false),
            }),
        };
        let prefix = format!("{}-", sqs.inner.location.prefix);
        sqs.call("ListQueues", &json!({"QueueNamePrefix": prefix, "MaxResults": 1}))
            .await
            .map_err(|e| refused(e.to_string()))?;
        Ok(sqs)
    }

    /// The name prefix of this deployment.
    pub fn prefix(&self) -> &str {
        &self.inner.location.prefix
    }

    /// Deletes every queue of this deployment (tests clean up so).
    pub async fn destroy(&self) -> Result<(), BrokerError> {
        for url in self.deployment_urls().await? {
            self.call("DeleteQueue", &json!({"QueueUrl": url})).await.map_err(|e| failed("deleting a queue", e))?;
        }
        lock(&self.inner.urls).clear();
        Ok(())
    }

    /// Messages in `queue`, visible or not (held, delayed).
    pub async fn messages(&self, queue: &str) -> Result<u32, BrokerError> {
        let names = [
            "ApproximateNumberOfMessages",
            "ApproximateNumberOfMessagesNotVisible",
            "ApproximateNumberOfMessagesDelayed",
        ];
        let total: u64 = self.attributes(queue, &names).await?.iter().sum();
        Ok(u32::try_from(total).unwrap_or(u32::MAX))
    }

    /// Calls `action`, noting whether SQS answered.
    async fn call(&self, action: &str, input: &Value) -> Result<Value, AwsError> {
        let answer = self.inner.aws.call(action, input).await;
        self.inner.answered.store(!matches!(answer, Err(AwsError::Transport(_))), Ordering::SeqCst);
        answer
    }

    /// The URLs of every queue under this deployment's prefix (another deployment's among
    /// them when its prefix starts with ours: their tags tell).
    async fn deployment_urls(&self) -> Result<Vec<String>, BrokerError> {
        let prefix = format!("{}-", self.inner.location.prefix);
        let mut urls = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut input = json!({"QueueNamePrefix": prefix, "MaxResults": 1000});
            if let Some(t) = &token {
                input["NextToken"] = Value::String(t.clone());
            }
            let page = self.call("ListQueues", &input).await.map_err(|e| failed("listing queues", e))?;
            urls.extend(
                page.get("QueueUrls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .map(str::to_string),
            );
            token = page.get("NextToken").and_then(Value::as_str).map(str::to_string);
            if token.is_none() {
                return Ok(urls);
            }
        }
    }

    /// The deployment's queues as their tags record them.
    async fn stored(&self) -> Result<Stored, BrokerError> {
        let urls = self.deployment_urls().await?;
        let asks: Vec<Value> = urls.iter().map(|url| json!({"QueueUrl": url})).collect();
        let tags = futures_util::future::join_all(asks.iter().map(|ask| self.call("ListQueueTags", ask))).await;
        let mut stored = Stored::default();
        let mut found = HashMap::new();
        for (url, tags) in urls.into_iter().zip(tags) {
            let tags = match tags {
                Ok(tags) => tags,
                // Deleted between the listing and now.
                Err(AwsError::Service { code, .. }) if code == "QueueDoesNotExist" => continue,
                Err(e) => return Err(failed("reading a queue's tags", e)),
            };
            let Some(tags) = tags.get("Tags").and_then(Value::as_object) else { continue };
            let ours = tags.get(TAG_DEPLOYMENT).and_then(Value::as_str) == Some(self.inner.location.prefix.as_str());
            let name = tags.get(TAG_QUEUE).and_then(Value::as_str);
            if let (true, Some(name), Some(record)) = (ours, name, Record::from_tags(tags)) {
                found.insert(name.to_string(), url);
                stored.queues.insert(name.to_string(), record);
            }
        }
        lock(&self.inner.urls).extend(found);
        Ok(stored)
    }

    /// The topology and groupings, read at most [`TOPOLOGY_FRESH`] ago.
    async fn routes(&self) -> Result<Arc<Routes>, BrokerError> {
        if let Some((read, t)) = lock(&self.inner.topology).as_ref()
            && read.elapsed() < TOPOLOGY_FRESH
        {
            return Ok(t.clone());
        }
        let t = Arc::new(self.stored().await?.routes());
        *lock(&self.inner.topology) = Some((tokio::time::Instant::now(), t.clone()));
        Ok(t)
    }

    /// The topology must be read again (this process changed it).
    fn forget_topology(&self) {
        *lock(&self.inner.topology) = None;
    }

    /// The URL of a declared queue, or what is missing.
    async fn url(&self, queue: &str) -> Result<String, BrokerError> {
        if let Some(url) = lock(&self.inner.urls).get(queue) {
            return Ok(url.clone());
        }
        for fifo in [false, true] {
            let name = self.inner.location.name_of(queue, fifo);
            match self.call("GetQueueUrl", &json!({"QueueName": name})).await {
                Ok(answer) => {
                    let url = answer.get("QueueUrl").and_then(Value::as_str).unwrap_or_default().to_string();
                    lock(&self.inner.urls).insert(queue.into(), url.clone());
                    return Ok(url);
                }
                Err(AwsError::Service { code, .. }) if code == "QueueDoesNotExist" => {}
                Err(e) => return Err(failed("finding a queue", e)),
            }
        }
        Err(self.routes().await?.topology.missing("queue", queue, PLACE))
    }

    /// A queue's attribute `name`, as a number.
    async fn attributes(&self, queue: &str, names: &[&str]) -> Result<Vec<u64>, BrokerError> {
        let url = self.url(queue).await?;
        let answer = self
            .call("GetQueueAttributes", &json!({"QueueUrl": url, "AttributeNames": names}))
            .await
            .map_err(|e| failed(&format!("reading queue \"{queue}\""), e))?;
        let attributes = answer.get("Attributes");
        Ok(names
            .iter()
            .map(|n| {
                attributes.and_then(|a| a.get(*n)).and_then(Value::as_str).and_then(|v| v.parse().ok()).unwrap_or(0)
            })
            .collect())
    }

    /// Makes `q`'s queue with `record` in its tags, or brings an existing one's tags and
    /// settings up to date; its URL.
    async fn make_queue(&self, q: &QueueDecl, record: &Record) -> Result<String, BrokerError> {
        let name = self.inner.location.name_of(&q.name, record.fifo.is_some());
        let mut tags = record.tags();
        tags.insert(TAG_DEPLOYMENT.into(), self.inner.location.prefix.clone());
        tags.insert(TAG_QUEUE.into(), q.name.clone());
        let mut attributes = json!({"MessageRetentionPeriod": RETENTION.as_secs().to_string()});
        if let (Role::Work, Some(dlq)) = (q.role, &q.dead_letter) {
            let arn = self.attributes_text(dlq, "QueueArn").await?;
            let policy = json!({"deadLetterTargetArn": arn, "maxReceiveCount": MAX_RECEIVES}).to_string();
            attributes["RedrivePolicy"] = Value::String(policy);
        }
        let context = format!("making queue \"{}\" ({name})", q.name);
        let url = match self.call("GetQueueUrl", &json!({"QueueName": name})).await {
            Ok(answer) => answer.get("QueueUrl").and_then(Value::as_str).unwrap_or_default().to_string(),
            Err(AwsError::Service { code, .. }) if code == "QueueDoesNotExist" => {
                let mut attributes = attributes;
                if record.fifo.is_some() {
                    // Set once, when the queue is made: SQS cannot change it.
                    attributes["FifoQueue"] = Value::String("true".into());
                }
                let input = json!({"QueueName": name, "Attributes": attributes, "tags": tags});
                let made = self.call("CreateQueue", &input).await.map_err(|e| failed(&context, e))?;
                let url = made.get("QueueUrl").and_then(Value::as_str).unwrap_or_default().to_string();
                lock(&self.inner.urls).insert(q.name.clone(), url.clone());
                return Ok(url);
            }
            Err(e) => return Err(failed(&context, e)),
        };
        lock(&self.inner.urls).insert(q.name.clone(), url.clone());
        self.call("SetQueueAttributes", &json!({"QueueUrl": url, "Attributes": attributes}))
            .await
            .map_err(|e| failed(&context, e))?;
        self.write_record(&url, &q.name, record).await?;
        Ok(url)
    }

    /// Writes `record` into the tags of the queue at `url`, removing chunks of a longer one.
    async fn write_record(&self, url: &str, queue: &str, record: &Record) -> Result<(), BrokerError> {
        let tags = record.tags();
        if tags.len() > RECORD_TAGS {
            return Err(BrokerError::Conflict(
                format!(
                    "queue \"{queue}\": its bindings are too many for SQS's tags (at most about {} bytes of them)",
                    RECORD_TAGS * TAG_CHARS * 3 / 4
                )
                .into(),
            ));
        }
        let context = format!("writing the bindings of queue \"{queue}\"");
        let stale: Vec<String> = (tags.len()..RECORD_TAGS).map(|i| format!("sluice-{i}")).collect();
        let mut all = tags;
        all.insert(TAG_DEPLOYMENT.into(), self.inner.location.prefix.clone());
        all.insert(TAG_QUEUE.into(), queue.into());
        self.call("TagQueue", &json!({"QueueUrl": url, "Tags": all})).await.map_err(|e| failed(&context, e))?;
        self.call("UntagQueue", &json!({"QueueUrl": url, "TagKeys": stale})).await.map_err(|e| failed(&context, e))?;
        Ok(())
    }

    /// A queue's attribute `name` as text.
    async fn attributes_text(&self, queue: &str, name: &str) -> Result<String, BrokerError> {
        let url = self.url(queue).await?;
        let answer = self
            .call("GetQueueAttributes", &json!({"QueueUrl": url, "AttributeNames": [name]}))
            .await
            .map_err(|e| failed(&format!("reading queue \"{queue}\""), e))?;
        Ok(answer.pointer(&format!("/Attributes/{name}")).and_then(Value::as_str).unwrap_or_default().to_string())
    }

    /// Sends one copy of `message` into `queue`, no sooner than `delay` from now (a standard
    /// queue), or with its group and deduplication id (a FIFO queue, which takes no delay per
    /// message); `exchange` names where a refusal came from.
    async fn send(
        &self,
        queue: &str,
        exchange: &str,
        message: &Carried,
        delay: Duration,
        fifo: Option<(String, String)>,
    ) -> Result<(), BrokerError> {
        let url = self.url(queue).await?;
        let mut attributes = json!({PROPERTIES: {"DataType": "String", "StringValue": message.properties_json()}});
        let body = match std::str::from_utf8(&message.body) {
            Ok(text) if text.chars().all(sqs_text) => text.to_string(),
            _ => {
                attributes[BODY_ENCODING] = json!({"DataType": "String", "StringValue": "base64"});
                base64::engine::general_purpose::STANDARD.encode(&message.body)
            }
        };
        let mut input = json!({"QueueUrl": url, "MessageBody": body, "MessageAttributes": attributes});
        match fifo {
            Some((group, deduplication)) => {
                input["MessageGroupId"] = Value::String(group);
                input["MessageDeduplicationId"] = Value::String(deduplication);
            }
            None => input["DelaySeconds"] = json!(delay.min(self.inner.location.hop).as_secs()),
        }
        match self.call("SendMessage", &input).await {
            Ok(_) => Ok(()),
            Err(AwsError::Service { code, message, .. })
                if code.contains("InvalidParameterValue") || code.contains("MessageTooLong") =>
            {
                Err(BrokerError::Rejected {
                    exchange: exchange.into(),
                    reason: format!("queue \"{queue}\": {message}"),
                })
            }
            Err(e) => Err(failed(&format!("sending to queue \"{queue}\""), e)),
        }
    }

    /// Sends a batch request of `action` for `entries` (10 to a request, all at once); the
    /// indexes of the entries that failed, with why.
    async fn batch(&self, action: &str, url: &str, entries: Vec<Value>) -> Result<Vec<(usize, String)>, BrokerError> {
        let chunks: Vec<Vec<Value>> = entries
            .into_iter()
            .enumerate()
            .map(|(i, mut e)| {
                e["Id"] = Value::String(i.to_string());
                e
            })
            .collect::<Vec<_>>()
            .chunks(BATCH)
            .map(<[Value]>::to_vec)
            .collect();
        let asks: Vec<Value> = chunks.iter().map(|chunk| json!({"QueueUrl": url, "Entries": chunk})).collect();
        let answers = futures_util::future::join_all(asks.iter().map(|ask| self.call(action, ask))).await;
        let mut failures = Vec::new();
        for (chunk, answer) in chunks.iter().zip(answers) {
            match answer {
                Ok(answer) => {
                    for f in answer.get("Failed").and_then(Value::as_array).into_iter().flatten() {
                        let id = f.get("Id").and_then(Value::as_str).and_then(|i| i.parse().ok()).unwrap_or(usize::MAX);
                        let code = f.get("Code").and_then(Value::as_str).unwrap_or("failed");
                        let why = f.get("Message").and_then(Value::as_str).unwrap_or_default();
                        failures.push((id, format!("{code}: {why}")));
                    }
                }
                Err(e) => {
                    let why = e.to_string();
                    for entry in chunk {
                        let id = entry["Id"].as_str().and_then(|i| i.parse().ok()).unwrap_or(usize::MAX);
                        failures.push((id, why.clone()));
                    }
                }
            }
        }
        Ok(failures)
    }

    /// Sets the visibility of deliveries by receipt handle: `seconds` from now.
    async fn show_in(&self, url: &str, receipts: &[(String, u64)]) -> Result<(), BrokerError> {
        if receipts.is_empty() {
            return Ok(());
        }
        let entries = receipts
            .iter()
            .map(|(receipt, seconds)| json!({"ReceiptHandle": receipt, "VisibilityTimeout": seconds}))
            .collect();
        let failures = self.batch("ChangeMessageVisibilityBatch", url, entries).await?;
        match failures.first() {
            None => Ok(()),
            Some((_, why)) => Err(BrokerError::Lost(
                format!("sqs: changing the visibility of {} deliveries: {why}", failures.len()).into(),
            )),
        }
    }

    async fn open_consumer(&self, queue: &str, prefetch: u16) -> Result<(SqsDeliveries, SqsConsumer), BrokerError> {
        let url = self.url(queue).await?;
        let dead_letters = self.stored_role(queue).await? == Some("dead_letter".into());
        let state = Arc::new(Holder::new(
            queue,
            prefetch,
            Member { url: url.clone(), receipts: Mutex::new(HashMap::new()), next: AtomicU64::new(0) },
        ));
        let claimer = SqsClaimer {
            broker: self.clone(),
            fifo: url.ends_with(FIFO),
            url,
            wake: Arc::new(Notify::new()),
            renewal: Renewal::new(self.inner.location.lease),
            waiting: Vec::new(),
            failures: 0,
            dead_letters,
        };
        let deliveries = claim::start(claimer, &state);
        Ok((deliveries, SqsConsumer { broker: self.clone(), state }))
    }

    /// The role a queue was declared with, as its tags record it.
    async fn stored_role(&self, queue: &str) -> Result<Option<String>, BrokerError> {
        let url = self.url(queue).await?;
        let tags =
            self.call("ListQueueTags", &json!({"QueueUrl": url})).await.map_err(|e| failed("reading tags", e))?;
        Ok(tags.get("Tags").and_then(Value::as_object).and_then(Record::from_tags).and_then(|r| r.role()))
    }
}

/// Whether SQS takes `c` in a message body.
fn sqs_text(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..='\u{10FFFF}')
}

/// A received message as sluice reads it: sluice's properties from its attribute, or those of
/// another producer's message from its SQS attributes.
fn read_message(m: &Value) -> Carried {
    let attribute = |name: &str| m.pointer(&format!("/MessageAttributes/{name}/StringValue")).and_then(Value::as_str);
    let text = m.get("Body").and_then(Value::as_str).unwrap_or_default();
    let body = match attribute(BODY_ENCODING) {
        Some("base64") => base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_or_else(|_| Bytes::copy_from_slice(text.as_bytes()), Bytes::from),
        _ => Bytes::copy_from_slice(text.as_bytes()),
    };
    let sqs_id = m.get("MessageId").and_then(Value::as_str).map(str::to_string);
    if let Some(properties) = attribute(PROPERTIES) {
        let mut carried = Carried::read(body, Some(properties));
        carried.properties.message_id = carried.properties.message_id.or(sqs_id);
        return carried;
    }
    let mut headers = Headers::new();
    for (name, a) in m.get("MessageAttributes").and_then(Value::as_object).into_iter().flatten() {
        let value = a.get("StringValue").and_then(Value::as_str).unwrap_or_default();
        let is_number = a.get("DataType").and_then(Value::as_str).is_some_and(|t| t.starts_with("Number"));
        let value = match value.parse::<i64>() {
            Ok(n) if is_number => HeaderValue::Int(n),
            _ => HeaderValue::Str(value.into()),
        };
        headers.insert(name.clone(), value);
    }
    let content_type =
        ["content-type", "Content-Type", "contentType"].iter().find_map(|n| headers.get(*n)).map(|v| match v {
            HeaderValue::Str(s) => s.clone(),
            other => other.to_json().to_string(),
        });
    let sent = m.pointer("/Attributes/SentTimestamp").and_then(Value::as_str).and_then(|t| t.parse::<u64>().ok());
    Carried {
        body,
        properties: Properties {
            headers,
            message_id: sqs_id,
            content_type,
            timestamp: sent.map(|ms| ms / 1000),
            ..Properties::default()
        },
        due: None,
    }
}

/// Milliseconds since the epoch now.
fn now_ms() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(now.as_millis()).unwrap_or(u64::MAX)
}

/// A consumer as this broker keeps it.
type ConsumerState = Holder<u64, Member>;

/// What this broker keeps of a consumer besides what it holds.
struct Member {
    url: String,
    /// The receipt handle of each delivery it holds, by its number here.
    receipts: Mutex<HashMap<u64, String>>,
    /// The number of its next delivery.
    next: AtomicU64,
}

/// A consumer's receives: what fits its room, long-polling when nothing came, renewing the
/// leases it holds every third of the lease.
struct SqsClaimer {
    broker: Sqs,
    url: String,
    wake: Arc<Notify>,
    renewal: Renewal,
    /// Delayed copies received shortly before they are due (SQS counts whole seconds), held
    /// here (leased, renewed) until then: not yet the consumer's deliveries.
    waiting: Vec<(tokio::time::Instant, SqsDelivery)>,
    /// Receives failed in a row.
    failures: u32,
    /// Its queue is a dead-letter queue: a message there without sluice's reason was moved by
    /// SQS's redrive policy.
    dead_letters: bool,
    /// Its queue is a FIFO queue.
    fifo: bool,
}

impl SqsClaimer {
    /// Renews the leases of what the consumer holds and of the copies held here.
    async fn renew(&mut self, s: &ConsumerState) {
        let lease = self.broker.inner.location.lease_seconds();
        let mut receipts: Vec<(String, u64)> = {
            let receipts = lock(&s.own.receipts);
            s.held().iter().filter_map(|id| receipts.get(id).map(|r| (r.clone(), lease))).collect()
        };
        receipts.extend(self.waiting.iter().map(|(_, d)| (d.tag.receipt.clone(), lease)));
        match self.broker.show_in(&self.url, &receipts).await {
            Ok(()) => self.renewal.renewed(),
            Err(e) => {
                tracing::warn!(queue = %s.queue, error = %e, "sqs broker: cannot renew leases; trying again");
                self.renewal.failed(Duration::from_millis(500));
            }
        }
    }

    /// Up to `room` messages, waiting up to `wait` for the first.
    async fn receive(&self, room: usize, wait: Duration) -> Result<Vec<Value>, BrokerError> {
        let lease = self.broker.inner.location.lease_seconds();
        let ask = |n: usize, wait: u64| {
            json!({
                "QueueUrl": self.url,
                "MaxNumberOfMessages": n,
                "WaitTimeSeconds": wait,
                "VisibilityTimeout": lease,
                "MessageAttributeNames": ["All"],
                "AttributeNames": ["All"],
            })
        };
        let messages = |answer: Value| match answer.get("Messages") {
            Some(Value::Array(m)) => m.clone(),
            _ => Vec::new(),
        };
        let first = self
            .broker
            .call("ReceiveMessage", &ask(room.min(BATCH), wait.as_secs()))
            .await
            .map_err(|e| failed("receiving", e))?;
        let mut received = messages(first);
        let left = room.saturating_sub(received.len());
        if received.len() == BATCH.min(room) && left > 0 {
            let asks = (0..left.div_ceil(BATCH).min(RECEIVES - 1))
                .map(|i| ask((left - i * BATCH).min(BATCH), 0))
                .collect::<Vec<_>>();
            if self.fifo {
                // One after the other: a group's messages are handed out in order, and a
                // receive answered later must not be read first.
                for a in &asks {
                    let more =
                        messages(self.broker.call("ReceiveMessage", a).await.map_err(|e| failed("receiving", e))?);
                    let full = more.len() == BATCH;
                    received.extend(more);
                    if !full {
                        break;
                    }
                }
                return Ok(received);
            }
            let more = futures_util::future::join_all(asks.iter().map(|a| self.broker.call("ReceiveMessage", a))).await;
            for answer in more {
                received.extend(messages(answer.map_err(|e| failed("receiving", e))?));
            }
        }
        Ok(received)
    }

    /// A receive that failed: the stream ends with it after a few in a row.
    fn failed(&mut self, s: &ConsumerState, e: BrokerError) -> Claimed<Tag> {
        self.failures += 1;
        tracing::warn!(queue = %s.queue, error = %e, "sqs broker: cannot receive messages; trying again");
        let failed = (self.failures >= 5).then_some(e);
        Claimed { within: Some(Duration::from_secs(1)), failed, ..Claimed::default() }
    }

    /// A delivery of `m`, numbered for this consumer.
    fn kept(&self, s: &ConsumerState, m: &Value) -> Option<(SqsDelivery, Option<u64>)> {
        let receipt = m.get("ReceiptHandle").and_then(Value::as_str)?.to_string();
        let Carried { body, mut properties, due } = read_message(m);
        if self.dead_letters && !properties.headers.contains_key(envelope::REASON_HEADER) {
            let receives = m.pointer("/Attributes/ApproximateReceiveCount").and_then(Value::as_str).unwrap_or("?");
            properties.headers.insert(envelope::REASON_HEADER.into(), HeaderValue::Str("delivery_limit".into()));
            properties.headers.insert(
                envelope::ERROR_HEADER.into(),
                HeaderValue::Str(format!(
                    "SQS moved it here after {receives} receives without an ack (the queue's redrive policy): its runner may have crashed on it"
                )),
            );
        }
        let number = s.own.next.fetch_add(1, Ordering::SeqCst);
        let group = m.pointer("/Attributes/MessageGroupId").and_then(Value::as_str).map(str::to_string);
        Some((Kept::whole(Tag { number, receipt, group }, body, properties, s.live.clone()), due))
    }
}

impl Claimer for SqsClaimer {
    type Id = u64;
    type Tag = Tag;
    type Own = Member;

    fn id(tag: &Tag) -> u64 {
        tag.number
    }

    fn wake(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    async fn claim(&mut self, s: &ConsumerState, ask: Ask) -> Claimed<Tag> {
        if self.renewal.is_due() {
            self.renew(s).await;
        }
        let now = tokio::time::Instant::now();
        let mut deliveries = Vec::new();
        self.waiting.sort_by_key(|(due, _)| *due);
        while deliveries.len() < ask.room && self.waiting.first().is_some_and(|(due, _)| *due <= now) {
            deliveries.push(self.waiting.remove(0).1);
        }
        let room = ask.room - deliveries.len();
        let mut more = false;
        if room > 0 {
            // Long-polls only while nothing else is to be done: no delivery to hand out, no
            // copy held here coming due, no renewal.
            let next_due = self.waiting.first().map(|(due, _)| due.saturating_duration_since(now));
            let wait = if deliveries.is_empty() {
                LONG_POLL.min(next_due.unwrap_or(LONG_POLL)).min(self.renewal.every())
            } else {
                Duration::ZERO
            };
            let received = match self.receive(room, wait).await {
                Ok(received) => received,
                Err(e) => return self.failed(s, e),
            };
            more = received.len() >= room;
            let now_ms = now_ms();
            for m in &received {
                let Some((kept, due)) = self.kept(s, m) else { continue };
                match due.filter(|due| *due > now_ms) {
                    None => deliveries.push(kept),
                    Some(due) => {
                        let left = Duration::from_millis(due - now_ms);
                        self.waiting.push((tokio::time::Instant::now() + left, kept));
                    }
                }
            }
            // A long poll that came back empty is the wait: ask again at once.
            more |= received.is_empty() && wait >= Duration::from_secs(1);
        }
        self.failures = 0;
        {
            let mut receipts = lock(&s.own.receipts);
            for d in &deliveries {
                receipts.insert(d.tag.number, d.tag.receipt.clone());
            }
        }
        let now = tokio::time::Instant::now();
        let mut within = self.renewal.every();
        if let Some(due) = self.waiting.iter().map(|(due, _)| *due).min() {
            within = within.min(due.saturating_duration_since(now));
        }
        Claimed { deliveries, more, within: Some(within), failed: None }
    }

    /// Shows what a claim took after the close at once again.
    async fn hand_back(&mut self, s: &ConsumerState, ids: Vec<u64>) {
        hand_back(&self.broker, s, ids).await;
    }

    /// Copies held until due go back with the time they have left.
    async fn end(&mut self, s: &ConsumerState) {
        let now = tokio::time::Instant::now();
        let receipts: Vec<(String, u64)> = std::mem::take(&mut self.waiting)
            .into_iter()
            .map(|(due, d)| (d.tag.receipt.clone(), due.saturating_duration_since(now).as_secs()))
            .collect();
        if let Err(e) = self.broker.show_in(&self.url, &receipts).await {
            tracing::debug!(queue = %s.queue, error = %e, "sqs broker: cannot put delayed copies back; they come back when their lease runs out");
        }
    }
}

/// Makes deliveries visible again at once (a close, a hand-back).
async fn hand_back(broker: &Sqs, s: &ConsumerState, ids: Vec<u64>) {
    let receipts: Vec<(String, u64)> = {
        let mut receipts = lock(&s.own.receipts);
        ids.iter().filter_map(|id| receipts.remove(id)).map(|r| (r, 0)).collect()
    };
    if let Err(e) = broker.show_in(&s.own.url, &receipts).await {
        tracing::warn!(queue = %s.queue, error = %e, "sqs broker: cannot hand deliveries back; they come back when their lease runs out");
    }
}

/// What this broker keeps of a delivery to settle and copy it.
pub struct Tag {
    number: u64,
    receipt: String,
    /// Its FIFO queue's message group.
    group: Option<String>,
}

/// A delivery from the SQS broker.
pub type SqsDelivery = Kept<Tag>;

/// The deliveries of one consumer.
pub type SqsDeliveries = KeptDeliveries<Tag>;

/// A consumer of the SQS broker. Cheap to clone; clones share the consumer.
#[derive(Clone)]
pub struct SqsConsumer {
    broker: Sqs,
    state: Arc<ConsumerState>,
}

impl Consumer for SqsConsumer {
    type Delivery = SqsDelivery;

    /// Deletes them, 10 to a request; one whose delete failed stays held, renewed, to be acked
    /// again.
    async fn ack(&self, settled: &[SqsDelivery]) -> Result<(), BrokerError> {
        let s = &self.state;
        s.still_open()?;
        let entries = settled.iter().map(|d| json!({"ReceiptHandle": d.tag.receipt})).collect();
        let failures = self.broker.batch("DeleteMessageBatch", &s.own.url, entries).await?;
        let failed: std::collections::HashSet<usize> = failures.iter().map(|(i, _)| *i).collect();
        let acked: Vec<u64> =
            settled.iter().enumerate().filter(|(i, _)| !failed.contains(i)).map(|(_, d)| d.tag.number).collect();
        {
            let mut receipts = lock(&s.own.receipts);
            for number in &acked {
                receipts.remove(number);
            }
        }
        s.settled(acked.iter());
        match failures.first() {
            None => Ok(()),
            Some((_, why)) => {
                Err(BrokerError::Lost(format!("sqs: deleting {} acked messages: {why}", failures.len()).into()))
            }
        }
    }

    async fn cancel(&self) -> Result<(), BrokerError> {
        self.state.cancel();
        Ok(())
    }

    async fn close(&self) {
        let held = self.state.close();
        hand_back(&self.broker, &self.state, held).await;
    }
}

impl Broker for Sqs {
    type Delivery = SqsDelivery;
    type Deliveries = SqsDeliveries;
    type Consumer = SqsConsumer;

    /// Checks everything first (a conflict changes nothing), then makes each queue (dead-letter
    /// queues first: the work queues' redrive policies name them) with its record in its
    /// tags: its declaration, its bindings and the plan's exchanges, merged with what the
    /// tags held.
    async fn declare(&self, plan: &Plan) -> Result<(), BrokerError> {
        if let Some((q, detail)) = plan.queues.iter().find_map(|q| Some((q, refused(q)?))) {
            return Err(BrokerError::Conflict(format!("queue \"{}\": {detail}", q.name).into()));
        }
        let stored = self.stored().await?;
        if let Some(Drift::Conflict { what, name, detail }) =
            drift_from(plan, &stored)?.into_iter().find(|d| matches!(d, Drift::Conflict { .. }))
        {
            return Err(BrokerError::Conflict(
                format!("{what} \"{name}\" conflicts with what exists: {detail}").into(),
            ));
        }
        let fifo = fifo_queues(plan);
        let changes_kind =
            |q: &&QueueDecl| stored.queues.get(&q.name).is_some_and(|r| r.fifo.is_some() != fifo.contains_key(&q.name));
        if let Some(q) = plan.queues.iter().find(changes_kind) {
            let detail = "SQS cannot turn a standard queue into a FIFO queue (an ordered queue's, or its dead-letter queue's) or back; delete it first, or keep its ordering";
            return Err(BrokerError::Conflict(format!("queue \"{}\": {detail}", q.name).into()));
        }
        let mut queues: Vec<&QueueDecl> = plan.queues.iter().collect();
        queues.sort_by_key(|q| q.role != Role::DeadLetter);
        for q in queues {
            let mut record = stored.queues.get(&q.name).cloned().unwrap_or_default();
            record.fifo = fifo.get(&q.name).cloned();
            if record.declaration.is_empty() {
                record.declaration = serde_json::to_string(q)
                    .map_err(|e| BrokerError::Conflict(format!("queue \"{}\": {e}", q.name).into()))?;
            }
            record.limit = q.max_message_bytes.map(|m| m as u64);
            for x in &plan.exchanges {
                record.exchanges.entry(x.name.clone()).or_insert_with(|| x.kind.as_str().to_string());
            }
            for text in plan.bindings.iter().filter(|b| b.queue == q.name).map(binding_text) {
                if !record.bindings.contains(&text) {
                    record.bindings.push(text);
                }
            }
            self.make_queue(q, &record).await?;
        }
        self.forget_topology();
        Ok(())
    }

    async fn unbind(&self, bindings: &[BindingDecl]) -> Result<(), BrokerError> {
        let stored = self.stored().await?;
        for (queue, mut record) in stored.queues {
            let before = record.bindings.len();
            let gone: Vec<String> = bindings.iter().filter(|b| b.queue == queue).map(binding_text).collect();
            record.bindings.retain(|b| !gone.contains(b));
            if record.bindings.len() != before {
                let url = self.url(&queue).await?;
                self.write_record(&url, &queue, &record).await?;
            }
        }
        self.forget_topology();
        Ok(())
    }

    async fn copy(&self, original: &SqsDelivery, target: Target<'_>, edits: &Edits) -> Result<(), BrokerError> {
        let (due, delay) = match target {
            Target::Later { delay, .. } => {
                (Some(now_ms().saturating_add(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX))), delay)
            }
            Target::Queue(_) | Target::DeadLetter(_) => (None, Duration::ZERO),
        };
        let copy = Carried { body: original.body.clone(), properties: original.copied_properties(edits), due };
        let routes = self.routes().await?;
        let fifo = routes.fifo.get(target.queue()).map(|grouping| {
            let id = fresh_id(&copy);
            let group = match (&target, &original.tag.group) {
                (Target::Later { .. }, Some(group)) => group.clone(),
                (Target::Later { .. }, None) => grouping.group(target.queue(), &copy),
                // A redrive is a group of its own: its key may be held by the runner for it
                // (`on_dead_letter: hold`), that key's next message in flight meanwhile,
                // which SQS would not let it pass in its key's group. So is a dead letter:
                // a dead-letter queue is read by browsing, which a group's first messages,
                // held, would keep from the rest.
                (Target::Queue(_) | Target::DeadLetter(_), _) => id.clone(),
            };
            (group, id)
        });
        // Whole seconds, rounded down: the rest is held by the consumer that receives it.
        self.send(target.queue(), "", &copy, Duration::from_secs(delay.as_secs()), fifo).await
    }

    async fn consume(&self, queue: &str, credit: Credit) -> Result<(SqsDeliveries, SqsConsumer), BrokerError> {
        self.open_consumer(queue, credit.get()).await
    }

    /// Ready: what SQS counts visible; consumers: none counted (SQS does not know them).
    async fn stats(&self, queue: &str) -> Result<QueueStats, BrokerError> {
        let counts = self.attributes(queue, &["ApproximateNumberOfMessages"]).await?;
        Ok(QueueStats { ready: u32::try_from(counts[0]).unwrap_or(u32::MAX), consumers: 0 })
    }

    /// Messages not visible (held under a lease) or delayed, in every work queue.
    async fn delayed(&self) -> Result<u32, BrokerError> {
        let stored = self.stored().await?;
        let mut total = 0u64;
        for (queue, record) in &stored.queues {
            if record.role().as_deref() == Some("dead_letter") {
                continue;
            }
            let counts = self
                .attributes(queue, &["ApproximateNumberOfMessagesNotVisible", "ApproximateNumberOfMessagesDelayed"]);
            total += counts.await?.iter().sum::<u64>();
        }
        Ok(u32::try_from(total).unwrap_or(u32::MAX))
    }

    /// [`CAPABILITIES`], with the deployment's hop.
    fn capabilities(&self) -> crate::broker::Capabilities {
        crate::broker::Capabilities { longest_delay: Some(self.inner.location.hop), ..CAPABILITIES }
    }

    fn is_connected(&self) -> bool {
        !self.inner.closed.load(Ordering::SeqCst) && self.inner.answered.load(Ordering::SeqCst)
    }

    async fn close(&self) {
        self.inner.closed.store(true, Ordering::SeqCst);
    }
}

/// Why this broker refuses a queue's declaration, if it does.
fn refused(q: &QueueDecl) -> Option<String> {
    if q.max_length.is_some() {
        return Some(format!("max_length: {BROKER} cannot bound a queue; remove it or run on RabbitMQ"));
    }
    unsupported(q, BROKER)
}

impl Publish for Sqs {
    async fn publish(&self, exchange: &str, routing_key: &str, message: Outgoing) -> Result<(), BrokerError> {
        let (body, properties) = kept::published(BROKER, exchange, routing_key, message)?;
        let routes = self.routes().await?;
        let targets = routes.topology.route(exchange, routing_key, &properties.headers, PLACE)?;
        let message = Carried { body, properties, due: None };
        for queue in &targets {
            let fifo = routes.fifo.get(queue).map(|grouping| {
                let id = message.properties.message_id.as_deref().map(sqs_id);
                (grouping.group(queue, &message), id.unwrap_or_else(|| fresh_id(&message)))
            });
            self.send(queue, exchange, &message, Duration::ZERO, fifo).await?;
        }
        Ok(())
    }

    async fn body_limits(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &Headers,
    ) -> Result<Option<BodyLimits>, BrokerError> {
        Ok(Some(self.routes().await?.topology.body_limits(exchange, routing_key, headers, PLACE)?))
    }
}

impl Operate for Sqs {
    async fn browse(&self, queue: &str, window: Credit) -> Result<(SqsDeliveries, SqsConsumer), BrokerError> {
        self.open_consumer(queue, window.get()).await
    }

    /// Deliveries of `queue` not visible (held under a lease), as SQS counts them; when the
    /// last lease ends is not kept, so it is given as at most one lease from now.
    async fn leased(&self, queue: &str) -> Result<Option<super::Leased>, BrokerError> {
        let held = self.attributes(queue, &["ApproximateNumberOfMessagesNotVisible"]).await?[0];
        Ok(super::Leased::within(held, self.inner.location.lease))
    }

    async fn drift(&self, plan: &Plan) -> Result<Vec<Drift>, BrokerError> {
        drift_from(plan, &self.stored().await?)
    }
}

/// How `stored` differs from `plan`.
fn drift_from(plan: &Plan, stored: &Stored) -> Result<Vec<Drift>, BrokerError> {
    declaration::drift(
        plan,
        Some(BROKER),
        |name| Ok::<_, BrokerError>(stored.exchange(name)),
        |name| Ok(stored.queues.get(name).map(|r| r.declaration.clone())),
        |b| Ok(stored.has_binding(b)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_gives_its_region_prefix_and_parameters() {
        let l = Location::parse("sqs://us-east-1/shop?endpoint=http://127.0.0.1:5000&lease=10s&hop=2s").expect("parse");
        assert_eq!(l.hop, Duration::from_secs(2));
        assert_eq!((l.region.as_str(), l.prefix.as_str()), ("us-east-1", "shop"));
        assert_eq!((l.endpoint.as_deref(), l.lease), (Some("http://127.0.0.1:5000"), Duration::from_secs(10)));
        let plain = Location::parse("sqs://eu-west-2").expect("parse");
        assert_eq!((plain.prefix.as_str(), plain.endpoint, plain.lease), (DEFAULT_PREFIX, None, LEASE));
        assert_eq!(plain.hop, LONGEST_DELAY);
        for bad in [
            "sqs://",
            "sqs://US/x",
            "sqs://r/a.b",
            "sqs://r?lease=1s",
            "sqs://r?x=1",
            "sqs://r?endpoint=ftp://h",
            "sqs://r?hop=16m",
            "sqs://r?hop=1500ms",
        ] {
            assert!(Location::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(l.queue_name("orders.email:v2"), "shop-orders-email-v2");
    }

    #[test]
    fn a_record_round_trips_through_tags_of_256_characters() {
        let record = Record {
            declaration: r#"{"name":"q","role":"work"}"#.into(),
            limit: Some(10),
            bindings: (0..30).map(|i| format!(r#"{{"exchange":"ev","queue":"q","routing_key":"k{i}"}}"#)).collect(),
            exchanges: [("ev".to_string(), "topic".to_string())].into(),
            fifo: Some(Grouping::Key { template: "{{payload.k}}".into(), format: "json".into() }),
        };
        let tags = record.tags();
        assert!(tags.len() > 1 && tags.values().all(|v| v.len() <= TAG_CHARS), "{tags:?}");
        let map: serde_json::Map<String, Value> = tags.into_iter().map(|(k, v)| (k, Value::String(v))).collect();
        assert_eq!(Record::from_tags(&map), Some(record.clone()));
        assert_eq!(record.role().as_deref(), Some("work"));
    }

    /// Issue 36: an ordered queue and its dead-letter queue are FIFO queues (`.fifo`); a
    /// message's group is its `order_by` key as the template renders it, its message id when
    /// it does not render, one group for `ordered`; a key SQS would not take goes as its digest.
    #[test]
    fn ordered_queues_are_fifo_and_grouped_by_their_rendered_key() {
        use crate::topology::OrderKey;
        let keyed = OrderKey { template: "{{payload.k}}".into(), format: crate::vocab::format::Format::Envelope };
        let plan = Plan {
            queues: vec![
                QueueDecl {
                    single_active_consumer: true,
                    dead_letter: Some("w.dlq".into()),
                    order_key: Some(keyed),
                    ..QueueDecl::new("w", Role::Work)
                },
                QueueDecl::new("w.dlq", Role::DeadLetter),
                QueueDecl { single_active_consumer: true, ..QueueDecl::new("all", Role::Work) },
                QueueDecl::new("plain", Role::Work),
            ],
            ..Plan::default()
        };
        let fifo = fifo_queues(&plan);
        let mut names: Vec<&str> = fifo.keys().map(String::as_str).collect();
        names.sort();
        assert_eq!(names, ["all", "w", "w.dlq"]);
        let location = Location::parse("sqs://us-east-1/p").expect("parse");
        assert_eq!(
            (location.name_of("w.dlq", true), location.name_of("plain", false)),
            ("p-w-dlq.fifo".into(), "p-plain".into())
        );
        let message = |payload: Value| Carried {
            body: Bytes::from(crate::envelope::Envelope::new("t", &payload, None).encode()),
            properties: Properties { message_id: Some("m-1".into()), ..Properties::default() },
            due: None,
        };
        assert_eq!(fifo["w"].group("w", &message(json!({"k": "c1"}))), "c1");
        assert_eq!(fifo["w"].group("w", &message(json!({"other": 1}))), "m-1", "no key: its message id");
        assert!(fifo["w"].group("w", &message(json!({"k": "é t"}))).starts_with("sha256:"));
        assert_eq!(fifo["all"].group("all", &message(json!({"k": "c1"}))), ONE_GROUP);
        assert_eq!(sqs_id(&"x".repeat(LONGEST_ID)), "x".repeat(LONGEST_ID));
        assert!(sqs_id(&"x".repeat(LONGEST_ID + 1)).starts_with("sha256:"));
    }

    #[test]
    fn another_producers_message_reads_its_attributes_and_binary_bodies_go_base64() {
        let foreign = json!({
            "MessageId": "m-1",
            "Body": "{\"a\":1}",
            "Attributes": {"SentTimestamp": "1700000000123"},
            "MessageAttributes": {
                "content-type": {"DataType": "String", "StringValue": "application/json"},
                "n": {"DataType": "Number", "StringValue": "7"},
            },
        });
        let c = read_message(&foreign);
        assert_eq!(c.properties.message_id.as_deref(), Some("m-1"));
        assert_eq!(c.properties.content_type.as_deref(), Some("application/json"));
        assert_eq!(c.properties.timestamp, Some(1_700_000_000));
        assert_eq!(c.properties.headers.get("n"), Some(&HeaderValue::Int(7)));
        assert!(!"\u{0}".chars().all(sqs_text) && "é\t".chars().all(sqs_text));
        let ours = json!({
            "MessageId": "m-2",
            "Body": base64::engine::general_purpose::STANDARD.encode([0u8, 159, 1]),
            "MessageAttributes": {
                "sluice": {"DataType": "String", "StringValue": "{\"k\":\"t\",\"d\":5}"},
                "sluice-body": {"DataType": "String", "StringValue": "base64"},
            },
        });
        let c = read_message(&ours);
        assert_eq!((c.body.as_ref(), c.due), (&[0u8, 159, 1][..], Some(5)));
        assert_eq!((c.properties.kind.as_deref(), c.properties.message_id.as_deref()), (Some("t"), Some("m-2")));
    }
}
