//! `sluice publish`: builds envelopes from flags (or one per JSONL line), publishes each with
//! confirm and `mandatory`, and fails on the first nack, unroutable message or missing exchange.
//! Before sending anything it checks every message against the `max_message_bytes` of the
//! queues it would reach, where the broker can tell (the embedded one keeps them when `run`
//! declares; RabbitMQ keeps no such limit and routes only once a message is sent): a message
//! over all of them is refused, a payload file or a `--jsonl` line without being read whole. A
//! `--jsonl` file is read twice, never held: checked line by line, then sent in batches. A
//! message is held about twice at most (its payload parsed and its body, or its body and the
//! copy a publish takes).
//! Each message starts a new trace (its `traceparent` header).
//!
//! `--format` writes the messages as a queue of that format reads them (issue 34): the
//! envelope; a `json` body with the id and type as message properties; a CloudEvent in binary
//! mode (attributes as `cloudEvents:*` application properties) or, `--structured`, as one JSON
//! object; or `bytes` as given. `--header` sets headers on every message.

use std::borrow::Cow;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use futures_util::{StreamExt, stream};
use indicatif::ProgressBar;
use serde_json::value::RawValue;

use super::{BrokerArg, Refusals};
use crate::admin::api::Connect;
use crate::app;
use crate::broker::{BrokerError, HeaderValue, Headers, Operate, Outgoing, Publish};
use crate::config::MAX_MESSAGE_BYTES;
use crate::envelope::{Envelope, TRACEPARENT_HEADER, Timestamp};
use crate::trace::TraceContext;
use crate::vocab::format::Format;

/// Confirms awaited at once in bulk mode: enough to keep the channel busy.
const IN_FLIGHT: usize = 256;

/// Lines of a `--jsonl` file sent at once, each batch confirmed before the next is read: memory
/// holds a batch, not the file.
const BATCH: usize = 4096;

#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["payload", "payload_file", "jsonl"]))]
pub struct Args {
    #[arg(long)]
    exchange: String,
    #[arg(long, default_value = "")]
    routing_key: String,
    /// The envelope's `type`.
    #[arg(long = "type")]
    kind: String,
    /// Default: the envelope's id.
    #[arg(long, conflicts_with = "jsonl", value_parser = parse_key)]
    idempotency_key: Option<String>,
    /// The payload as JSON text.
    #[arg(long)]
    payload: Option<String>,
    /// A file holding the payload as JSON.
    #[arg(long)]
    payload_file: Option<PathBuf>,
    /// A file with one payload (JSON) per line; each becomes its own message.
    #[arg(long)]
    jsonl: Option<PathBuf>,
    /// Not handled before this long from now (`30s`, `10m`, `2h`): sets the envelope's
    /// `not_before`.
    #[arg(long, value_parser = super::parse_duration, conflicts_with = "at")]
    delay: Option<Duration>,
    /// Not handled before this time (RFC 3339, e.g. 2026-12-24T18:00:00Z); a time past is now.
    #[arg(long, value_parser = parse_time)]
    at: Option<Timestamp>,
    /// The messages' priority, for a queue with `priority` levels (RabbitMQ): higher first.
    #[arg(long)]
    priority: Option<u8>,
    /// How the messages are written: envelope (sluice's own), json (the payload as the body,
    /// the id and type as message properties), cloudevents (binary mode: the attributes as
    /// cloudEvents:* properties, the payload as data; --structured: the whole event as JSON),
    /// or bytes (the text of --payload, or the file of --payload-file, as it is).
    #[arg(long, default_value = "envelope", value_parser = parse_format)]
    format: Format,
    /// A CloudEvent's source (--format cloudevents).
    #[arg(long, required_if_eq("format", "cloudevents"))]
    source: Option<String>,
    /// A CloudEvent in structured mode (application/cloudevents+json).
    #[arg(long)]
    structured: bool,
    /// The messages' content type; default application/json (application/octet-stream for
    /// bytes, application/cloudevents+json for a structured CloudEvent).
    #[arg(long)]
    content_type: Option<String>,
    /// A header set on every message, NAME=VALUE (repeatable).
    #[arg(long = "header", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    #[command(flatten)]
    broker: BrokerArg,
    #[command(flatten)]
    evicting: super::EvictingArg,
}

/// A key that is not blank: an empty shell variable would otherwise key every message alike,
/// and each after the first would be skipped as a duplicate.
fn parse_key(text: &str) -> Result<String, String> {
    if crate::envelope::is_blank(text) {
        return Err("an empty idempotency key would be shared by every message published with it; leave out --idempotency-key to key each message by its id".into());
    }
    Ok(text.to_string())
}

fn parse_format(text: &str) -> Result<Format, String> {
    Format::parse(text).ok_or_else(|| {
        let names: Vec<&str> = Format::ALL.iter().map(|f| f.name()).collect();
        format!("\"{text}\" is not a format: one of {}", names.join(", "))
    })
}

fn parse_header(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((name, value)) if !name.trim().is_empty() => Ok((name.to_string(), value.to_string())),
        _ => Err(format!("\"{text}\" is not NAME=VALUE")),
    }
}

/// Refuses what the format cannot carry: a schedule outside an envelope (only an envelope has
/// `not_before`), `--structured` outside CloudEvents, a `--jsonl` file of bytes.
fn check_format(args: &Args) -> anyhow::Result<()> {
    let format = args.format;
    if format != Format::Envelope && (args.delay.is_some() || args.at.is_some()) {
        bail!("--delay and --at set an envelope's not_before; a message of format {format} has none");
    }
    if args.structured && format != Format::CloudEvents {
        bail!("--structured writes a CloudEvent: add --format cloudevents");
    }
    if format == Format::Bytes && args.jsonl.is_some() {
        bail!("--jsonl holds one JSON payload a line; publish bytes with --payload or --payload-file");
    }
    Ok(())
}

fn parse_time(text: &str) -> Result<Timestamp, String> {
    Timestamp::parse(text).ok_or_else(|| {
        format!("\"{text}\" is not an RFC 3339 time such as 2026-12-24T18:00:00Z or 2026-12-24T19:00:00+01:00")
    })
}

/// When the messages may be handled, from `--delay` (counted from `now`) or `--at`.
fn not_before(args: &Args, now: SystemTime) -> Option<Timestamp> {
    args.at.or_else(|| args.delay.map(|delay| Timestamp::after(now, delay)))
}

/// Refuses a time further ahead than the broker can hold a message back.
fn check_not_before(not_before: Option<Timestamp>, max_delay: Option<Duration>, now: SystemTime) -> anyhow::Result<()> {
    let (Some(at), Some(max)) = (not_before, max_delay) else { return Ok(()) };
    let ahead = at.0.duration_since(now).unwrap_or_default();
    if ahead > max {
        bail!(
            "not before {at} is {} ahead, further than this broker can hold a message back (at most {}): nothing was published",
            days(ahead),
            days(max),
        );
    }
    Ok(())
}

/// A long duration to the second, as `38d 20h 44m 3s` (humantime's would say `1month 8days`).
fn days(d: Duration) -> String {
    let s = d.as_secs();
    format!("{}d {}h {}m {}s", s / 86_400, s % 86_400 / 3600, s % 3600 / 60, s % 60)
}

/// The envelope of one message: a new id, and the schedule of the command.
fn envelope(args: &Args, payload: &serde_json::Value, key: Option<String>, at: Option<Timestamp>) -> Envelope<'static> {
    let mut envelope = Envelope::new(&args.kind, payload, key);
    envelope.not_before = at;
    envelope
}

/// The properties and headers every message of the command has: a new trace, `--header`s,
/// the time, the priority, the content type; `id` and `kind` as its message id and type.
fn base(args: &Args, id: &str, kind: &str) -> Outgoing {
    let timestamp = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).ok();
    let mut headers =
        Headers::from([(TRACEPARENT_HEADER.to_string(), HeaderValue::Str(TraceContext::new_root().to_string()))]);
    headers.extend(args.headers.iter().map(|(name, value)| (name.clone(), HeaderValue::Str(value.clone()))));
    Outgoing {
        body: Vec::new(),
        message_id: Some(id.to_string()),
        kind: Some(kind.to_string()),
        content_type: args.content_type.clone(),
        timestamp,
        priority: args.priority,
        headers,
    }
}

/// The message of `envelope`, written in the command's format (not `bytes`, see
/// [`bytes_message`]). Outside an envelope, `--idempotency-key` is the message's id (what
/// `json` and `cloudevents` queues key by).
fn outgoing(args: &Args, envelope: &Envelope) -> Outgoing {
    let id = match args.format {
        Format::Envelope => &envelope.id,
        _ => args.idempotency_key.as_ref().unwrap_or(&envelope.id),
    };
    let mut message = base(args, id, &envelope.kind);
    let payload = envelope.payload.get();
    message.body = match (args.format, args.structured) {
        (Format::Envelope, _) => envelope.encode(),
        (Format::Json | Format::Bytes, _) => payload.as_bytes().to_vec(),
        (Format::CloudEvents, false) => {
            let time = envelope.occurred_at.clone().unwrap_or_default();
            let source = args.source.clone().unwrap_or_default();
            for (name, value) in [
                ("specversion", "1.0".to_string()),
                ("id", id.clone()),
                ("source", source),
                ("type", envelope.kind.clone()),
                ("time", time),
            ] {
                message.headers.insert(format!("cloudEvents:{name}"), HeaderValue::Str(value));
            }
            payload.as_bytes().to_vec()
        }
        (Format::CloudEvents, true) => {
            message.content_type.get_or_insert_with(|| "application/cloudevents+json".into());
            let event = serde_json::json!({
                "specversion": "1.0", "id": id, "source": args.source, "type": envelope.kind,
                "time": envelope.occurred_at, "datacontenttype": "application/json", "data": &*envelope.payload,
            });
            // A JSON value always serializes.
            serde_json::to_vec(&event).unwrap_or_default()
        }
    };
    message
}

/// A `bytes` message: `body` as it is.
fn bytes_message(args: &Args, body: Vec<u8>) -> Outgoing {
    let id = args.idempotency_key.clone().unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    let mut message = base(args, &id, &args.kind);
    message.content_type.get_or_insert_with(|| "application/octet-stream".into());
    message.body = body;
    message
}

/// Runs `sluice publish`: learns the limits of the queues the messages would reach (where
/// the broker can tell), checks every message against them before sending any, then sends
/// them, a batch at a time for `--jsonl`.
pub async fn publish(mut args: Args) -> anyhow::Result<()> {
    use crate::broker::redis::{Checks, Purpose};
    args.broker.redis = Checks::new(Purpose::Publish, args.evicting.allow_evicting_redis);
    // What can be checked without the broker is, before connecting. Every message of one
    // command has the same time: `--delay` counts from the start.
    let at = not_before(&args, SystemTime::now());
    check_format(&args)?;
    let input = match (&args.payload, &args.payload_file, &args.jsonl) {
        (Some(text), _, _) if args.format == Format::Bytes => Input::Bytes(text.clone().into_bytes()),
        (Some(text), _, _) => Input::Payload(serde_json::from_str(text).context("--payload is not JSON")?),
        (None, Some(path), _) => Input::File(path),
        (None, None, Some(path)) => Input::Lines(path),
        (None, None, None) => bail!("one of --payload, --payload-file or --jsonl is required"),
    };
    let total = args.broker.assemble(PublishAll { args: &args, input: &input, at }).await?;
    super::output::stderr(&format!("published {total} message(s) to exchange \"{}\"\n", args.exchange));
    Ok(())
}

/// Every message, over sessions with whichever broker.
struct PublishAll<'a> {
    args: &'a Args,
    input: &'a Input<'a>,
    at: Option<Timestamp>,
}

impl app::Job for PublishAll<'_> {
    /// How many were published.
    type Output = usize;

    async fn run<B: Operate>(self, mut sessions: app::Sessions<'_, B>, _: Connect<B>) -> anyhow::Result<usize> {
        let mut session = Session { sessions: &mut sessions, broker: None };
        let result = publish_all(&mut session, self.args, self.input, self.at).await;
        if let Some(broker) = session.broker.take() {
            broker.close().await;
        }
        result
    }
}

/// The messages to publish.
enum Input<'a> {
    Payload(serde_json::Value),
    /// A `bytes` body given as text.
    Bytes(Vec<u8>),
    /// A payload file, read once the limits are known.
    File(&'a Path),
    /// A `--jsonl` file, checked once the limits are known.
    Lines(&'a Path),
}

/// A session with the broker kept from one batch to the next, opened again (the next node)
/// when lost.
struct Session<'a, 'b, B> {
    sessions: &'a mut app::Sessions<'b, B>,
    broker: Option<B>,
}

impl<B: Publish> Session<'_, '_, B> {
    async fn broker(&mut self) -> Result<B, BrokerError> {
        if let Some(broker) = &self.broker {
            return Ok(broker.clone());
        }
        let (broker, _) = self.sessions.open().await?;
        self.broker = Some(broker.clone());
        Ok(broker)
    }

    /// The session is gone: the next [`Session::broker`] opens another, unless the command
    /// gives up.
    async fn lost(&mut self, error: BrokerError) -> Result<(), BrokerError> {
        if let Some(broker) = self.broker.take() {
            broker.close().await;
        }
        self.sessions.lost(error)
    }
}

/// Checks and publishes every message; how many.
async fn publish_all<B: Publish>(
    session: &mut Session<'_, '_, B>,
    args: &Args,
    input: &Input<'_>,
    at: Option<Timestamp>,
) -> anyhow::Result<usize> {
    let limit = loop {
        let broker = session.broker().await?;
        check_not_before(at, broker.capabilities().longest_delay, SystemTime::now())?;
        match Limit::of(&broker, args).await {
            Ok(limit) => break limit,
            Err(e) if e.is_session_loss() => session.lost(e).await?,
            Err(e) => return Err(e.into()),
        }
    };
    let path = match input {
        Input::Lines(path) => path,
        Input::Payload(payload) => {
            let message = outgoing(args, &envelope(args, payload, args.idempotency_key.clone(), at));
            return publish_one(session, args, message, limit.as_ref()).await;
        }
        Input::Bytes(body) => {
            return publish_one(session, args, bytes_message(args, body.clone()), limit.as_ref()).await;
        }
        Input::File(path) if args.format == Format::Bytes => {
            let body = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
            return publish_one(session, args, bytes_message(args, body), limit.as_ref()).await;
        }
        Input::File(path) => {
            if let Some(limit) = &limit {
                limit.check_file(path)?;
            }
            let envelope = file_envelope(path, args, at)?;
            let message = outgoing(args, &envelope);
            // Held once: the envelope's payload is in the message's body now.
            drop(envelope);
            return publish_one(session, args, message, limit.as_ref()).await;
        }
    };
    let total = check_lines(path, args, at, limit.as_ref())?;
    let cap = limit.as_ref().map_or(MAX_MESSAGE_BYTES, |limit| limit.max);
    let progress = if total > 1 { ProgressBar::new(total as u64) } else { ProgressBar::hidden() };
    let mut batch = Vec::with_capacity(BATCH.min(total));
    for line in payload_lines(path, cap)? {
        let Line { number, payload } = line?;
        let payload = payload.with_context(|| format!("{}:{number} changed since it was checked", path.display()))?;
        // Built once: a message sent again after a lost session keeps its id and key.
        batch.push(outgoing(args, &envelope(args, &payload, None, at)));
        if batch.len() == BATCH {
            send_confirmed(session, args, &batch, &progress).await?;
            batch.clear();
        }
    }
    send_confirmed(session, args, &batch, &progress).await?;
    progress.finish_and_clear();
    Ok(total)
}

/// The envelope of the payload in the file at `path`, made holding about twice the payload at
/// most: the file's text and the payload parsed, then the payload parsed and its compact text
/// (written into the file's buffer, emptied), then that text alone.
fn file_envelope(path: &Path, args: &Args, at: Option<Timestamp>) -> anyhow::Result<Envelope<'static>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let payload: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let mut compact = text.into_bytes();
    compact.clear();
    serde_json::to_writer(&mut compact, &payload)?;
    drop(payload);
    let mut envelope = envelope(args, &serde_json::Value::Null, args.idempotency_key.clone(), at);
    envelope.payload = Cow::Owned(RawValue::from_string(String::from_utf8(compact)?)?);
    Ok(envelope)
}

/// Checks and publishes `message`.
async fn publish_one<B: Publish>(
    session: &mut Session<'_, '_, B>,
    args: &Args,
    message: Outgoing,
    limit: Option<&Limit>,
) -> anyhow::Result<usize> {
    if let Some(limit) = limit {
        limit.check(message.body.len(), "the message")?;
    }
    send_confirmed(session, args, &[message], &ProgressBar::hidden()).await?;
    Ok(1)
}

/// The largest body a queue the messages reach takes, where the broker can tell.
struct Limit {
    max: usize,
    /// Each queue reached, with its limit.
    queues: Vec<(String, usize)>,
}

impl Limit {
    /// The limit of the queues a message of `args` would reach; none when the broker cannot
    /// tell (RabbitMQ), or when a queue's is unknown (declared by an earlier version).
    async fn of<B: Publish>(broker: &B, args: &Args) -> Result<Option<Limit>, BrokerError> {
        let headers = base(args, "", &args.kind).headers;
        let Some(limits) = broker.body_limits(&args.exchange, &args.routing_key, &headers).await? else {
            return Ok(None);
        };
        let queues: Option<Vec<(String, usize)>> = limits.into_iter().map(|(q, max)| Some((q, max?))).collect();
        Ok(queues.and_then(|queues| Some(Limit { max: queues.iter().map(|(_, max)| *max).max()?, queues })))
    }

    /// An error when a body of `size` bytes is over every queue's limit.
    fn check(&self, size: usize, what: &str) -> anyhow::Result<()> {
        if size <= self.max {
            return Ok(());
        }
        Err(self.refusal(&format!("{what} is {size} bytes")))
    }

    /// The error for a message over every queue's limit: `what` says what it is and its size.
    fn refusal(&self, what: &str) -> anyhow::Error {
        let queues: Vec<String> = self.queues.iter().map(|(q, max)| format!("\"{q}\" takes {max}")).collect();
        anyhow::anyhow!(
            "{what}, over the max_message_bytes of every queue it would reach ({}): none would accept it, so nothing was published",
            queues.join(", ")
        )
    }

    /// An error when the payload in `path` makes a body over every queue's limit, found
    /// without holding the file: its size, then the least its JSON takes once compact.
    fn check_file(&self, path: &Path) -> anyhow::Result<()> {
        let cannot = || format!("cannot read {}", path.display());
        let size = std::fs::metadata(path).with_context(cannot)?.len();
        if size <= self.max as u64 {
            return Ok(());
        }
        let file = std::fs::File::open(path).with_context(cannot)?;
        let at_least = compact_len_at_least(std::io::BufReader::new(file)).with_context(cannot)?;
        self.check(usize::try_from(at_least).unwrap_or(usize::MAX), &format!("the payload in {}", path.display()))
    }
}

/// At least how many bytes the JSON text `reader` holds takes once written compact (as in a
/// message's body): see [`Compact`].
fn compact_len_at_least(reader: impl BufRead) -> std::io::Result<u64> {
    let mut compact = Compact::default();
    for byte in reader.bytes() {
        compact.push(byte?);
    }
    Ok(compact.at_least)
}

/// JSON text read a byte at a time: which bytes a compact form keeps (not the whitespace
/// between tokens), and at least how many bytes it takes once written compact, as a message's
/// body has it (an escape in a string counts as one byte, `\u00e9` may become one; a number
/// as one, `1.000` may become `1.0`).
#[derive(Default)]
struct Compact {
    at_least: u64,
    in_string: bool,
    /// Bytes of an escape still to come.
    skip: u8,
    in_number: bool,
}

impl Compact {
    /// Takes the next byte; whether a compact form keeps it.
    fn push(&mut self, byte: u8) -> bool {
        if self.in_string {
            match (self.skip, byte) {
                (0, b'\\') => (self.at_least, self.skip) = (self.at_least + 1, 1),
                (0, b'"') => (self.at_least, self.in_string) = (self.at_least + 1, false),
                (0, _) => self.at_least += 1,
                (1, b'u') => self.skip = 4,
                _ => self.skip -= 1,
            }
            return true;
        }
        let number = matches!(byte, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E');
        let kept = match byte {
            b' ' | b'\t' | b'\n' | b'\r' => false,
            _ if number && self.in_number => true,
            b'"' => {
                (self.at_least, self.in_string) = (self.at_least + 1, true);
                true
            }
            _ => {
                self.at_least += 1;
                true
            }
        };
        self.in_number = number;
        kept
    }
}

/// One line of a `--jsonl` file: its number, and its payload or why it has none.
struct Line {
    number: usize,
    payload: Result<serde_json::Value, Unusable>,
}

/// Why a line of a `--jsonl` file gives no payload.
#[derive(Debug, thiserror::Error)]
enum Unusable {
    /// Its text (without its spaces) is not JSON: serde_json's words, without the place it
    /// gives, which counts in that text, not in the line.
    #[error("not JSON: {0}")]
    NotJson(String),
    /// Its payload is over the cap once compact: read no further.
    #[error("its payload is over {0} bytes once compact")]
    OverCap(u64),
}

impl From<serde_json::Error> for Unusable {
    fn from(e: serde_json::Error) -> Unusable {
        let text = e.to_string();
        let place = format!(" at line {} column {}", e.line(), e.column());
        Unusable::NotJson(text.strip_suffix(&place).unwrap_or(&text).to_string())
    }
}

/// The payloads of a `--jsonl` file (blank lines skipped), read as they come, each without
/// the whitespace between its tokens: a line is held only while it could still make a message
/// of `cap` bytes or less, and refused ([`Unusable::OverCap`]) as soon as it cannot, unread
/// beyond (nor is the rest of the file).
fn payload_lines(path: &Path, cap: usize) -> anyhow::Result<impl Iterator<Item = anyhow::Result<Line>>> {
    let file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut input = std::io::BufReader::new(file);
    let cap = u64::try_from(cap).unwrap_or(u64::MAX);
    let (mut number, mut ended) = (0, false);
    Ok(std::iter::from_fn(move || {
        while !ended {
            number += 1;
            let payload = match read_line(&mut input, cap) {
                Ok(Next::Line(text)) if text.is_empty() => continue,
                Ok(Next::Line(text)) => serde_json::from_slice(&text).map_err(Unusable::from),
                Ok(Next::OverCap) => Err(Unusable::OverCap(cap)),
                Ok(Next::End) => return None,
                Err(e) => {
                    ended = true;
                    return Some(Err(anyhow::Error::new(e).context(format!("cannot read {}", path.display()))));
                }
            };
            ended = matches!(payload, Err(Unusable::OverCap(_)));
            return Some(Ok(Line { number, payload }));
        }
        None
    }))
}

/// What [`read_line`] read.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    /// A line, without the whitespace between its JSON tokens.
    Line(Vec<u8>),
    /// A line whose payload is over the cap once compact, read only that far.
    OverCap,
    End,
}

/// The next line of `input`, held only while its payload is within `cap` bytes once compact.
fn read_line(input: &mut impl BufRead, cap: u64) -> std::io::Result<Next> {
    let (mut kept, mut compact, mut any) = (Vec::new(), Compact::default(), false);
    loop {
        let buffer = input.fill_buf()?;
        if buffer.is_empty() {
            return Ok(if any { Next::Line(kept) } else { Next::End });
        }
        any = true;
        let end = buffer.iter().position(|b| *b == b'\n');
        kept.extend(buffer[..end.unwrap_or(buffer.len())].iter().copied().filter(|b| compact.push(*b)));
        let used = end.map_or(buffer.len(), |end| end + 1);
        input.consume(used);
        if compact.at_least > cap {
            return Ok(Next::OverCap);
        }
        if end.is_some() {
            return Ok(Next::Line(kept));
        }
    }
}

/// Checks a `--jsonl` file before anything is sent: every line JSON, and its message (as
/// `args` and `at` make it) within `limit` (else within what any queue may take); how many
/// messages.
fn check_lines(path: &Path, args: &Args, at: Option<Timestamp>, limit: Option<&Limit>) -> anyhow::Result<usize> {
    let cap = limit.map_or(MAX_MESSAGE_BYTES, |limit| limit.max);
    let mut total = 0;
    for line in payload_lines(path, cap)? {
        let Line { number, payload } = line?;
        let what = || format!("the message of {}:{number}", path.display());
        let size = match (payload, limit) {
            (Ok(payload), Some(_)) => outgoing(args, &envelope(args, &payload, None, at)).body.len(),
            (Ok(_), None) => 0,
            (Err(Unusable::OverCap(_)), Some(limit)) => {
                return Err(limit.refusal(&format!("{} is over {cap} bytes", what())));
            }
            (Err(Unusable::OverCap(_)), None) => bail!(
                "{} is over {cap} bytes, more than any queue takes (max_message_bytes is at most 512MiB): nothing was published",
                what()
            ),
            (Err(e), _) => bail!("{}:{number}: {e}", path.display()),
        };
        if let Some(limit) = limit.filter(|limit| size > limit.max) {
            return Err(limit.refusal(&format!("{} is {size} bytes", what())));
        }
        total += 1;
    }
    Ok(total)
}

/// Publishes `messages` until each is confirmed: what a lost session left unconfirmed goes
/// again with the next one (a message whose confirm was lost goes twice), refused ones again
/// a few times.
async fn send_confirmed<B: Publish>(
    session: &mut Session<'_, '_, B>,
    args: &Args,
    messages: &[Outgoing],
    progress: &ProgressBar,
) -> Result<(), BrokerError> {
    let mut unconfirmed: Vec<usize> = (0..messages.len()).collect();
    let mut refusals = Refusals::default();
    while !unconfirmed.is_empty() {
        let broker = session.broker().await?;
        let (left, error) = send(&broker, args, messages, &unconfirmed, progress).await;
        if left.len() < unconfirmed.len() {
            refusals.progressed();
        }
        unconfirmed = left;
        match error {
            None => {}
            Some(e) if e.is_session_loss() => {
                tracing::warn!(error = %e, unconfirmed = unconfirmed.len(), "broker session lost mid-run; carrying on with the next node");
                session.lost(e).await?;
            }
            Some(e) => match refusals.again(&e) {
                Some(wait) => {
                    tracing::warn!(error = %e, unconfirmed = unconfirmed.len(), "the broker refused messages; trying them again");
                    tokio::time::sleep(wait).await;
                }
                None => return Err(e),
            },
        }
    }
    Ok(())
}

/// Publishes the messages `which` names, [`IN_FLIGHT`] awaiting their confirms at once; after
/// a refusal (nack, unroutable, no exchange) no more are sent. Returns those not confirmed and
/// the error that stopped them (a refusal before a lost session).
async fn send<B: Publish>(
    broker: &B,
    args: &Args,
    messages: &[Outgoing],
    which: &[usize],
    progress: &ProgressBar,
) -> (Vec<usize>, Option<BrokerError>) {
    let (exchange, key) = (&args.exchange, &args.routing_key);
    let refused = AtomicBool::new(false);
    let mut sending = stream::iter(which.iter().copied())
        .map(|i| {
            let refused = &refused;
            async move {
                match refused.load(Ordering::Relaxed) {
                    true => (i, None),
                    false => (i, Some(broker.publish(exchange, key, messages[i].clone()).await)),
                }
            }
        })
        .buffer_unordered(IN_FLIGHT);
    let (mut left, mut error): (Vec<usize>, Option<BrokerError>) = (Vec::new(), None);
    while let Some((i, result)) = sending.next().await {
        match result {
            Some(Ok(())) => progress.inc(1),
            None => left.push(i),
            Some(Err(e)) => {
                left.push(i);
                if !e.is_session_loss() {
                    refused.store(true, Ordering::Relaxed);
                }
                if error.as_ref().is_none_or(BrokerError::is_session_loss) {
                    error = Some(e);
                }
            }
        }
    }
    left.sort_unstable();
    (left, error)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 31 items 5 and 16: `--delay` and `--at` are outside input: a delay past what a
    /// clock can add is the last time RFC 3339 writes (where it panicked), refused by a broker
    /// with a limit; a time before 1970 is past, so now.
    #[test]
    fn delays_and_times_past_what_a_clock_holds_are_held() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let parse = |flags: &[&str]| {
            let mut argv = vec!["publish", "--exchange", "ev", "--type", "t", "--payload", "{}"];
            argv.extend(flags);
            <Cli as clap::Parser>::try_parse_from(argv).map(|cli| cli.args).map_err(|e| e.to_string())
        };
        let now = SystemTime::now();
        let at = |flags: &[&str]| parse(flags).map(|args| not_before(&args, now).map(|t| t.to_string()));
        let latest = Some("9999-12-31T23:59:59.999Z".to_string());
        assert_eq!(at(&["--delay", "18446744073709551615s"]), Ok(latest.clone()));
        assert_eq!(at(&["--delay", "213503982334601d"]), Ok(latest));
        assert_eq!(at(&["--at", "0001-01-01T00:00:00Z"]), Ok(Some("1970-01-01T00:00:00.000Z".to_string())));
        let far = not_before(&parse(&["--delay", "18446744073709551615s"]).expect("parses"), now);
        let refused = check_not_before(far, Some(Duration::from_secs(86_400)), now).map_err(|e| e.to_string());
        assert!(
            refused.as_ref().is_err_and(|e| e.starts_with("not before 9999-12-31T23:59:59.999Z is ")),
            "{refused:?}"
        );
    }

    /// Issue 24: a time further ahead than the broker holds is refused, naming both; a time
    /// past, or any time on a broker without a limit, is not.
    #[test]
    fn a_time_too_far_ahead_is_refused() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let day = Duration::from_secs(86_400);
        let cases: &[(Option<SystemTime>, Option<Duration>, Option<&str>)] = &[
            (None, Some(day), None),
            (Some(now + day), Some(day), None),
            (Some(now - day * 400), Some(day), None),
            (Some(now + day * 400), None, None),
            (
                Some(now + day + Duration::from_secs(1)),
                Some(day),
                Some(
                    "not before 1970-01-13T13:46:41.000Z is 1d 0h 0m 1s ahead, further than this broker can hold a message back (at most 1d 0h 0m 0s): nothing was published",
                ),
            ),
        ];
        for (at, max, refusal) in cases {
            let got = check_not_before(at.map(Timestamp), *max, now).map_err(|e| e.to_string());
            assert_eq!(got.err().as_deref(), *refusal, "{at:?} with {max:?}");
        }
    }

    /// Issue 31 (left by round 3): a `--jsonl` line is read without the spaces between its
    /// tokens (those in strings kept), blank lines skipped, and one whose payload is over the
    /// cap once compact is refused as soon as that is known, the rest of it unread (the reader
    /// stops in its first buffer, 8 KiB).
    #[test]
    fn lines_are_read_compact_and_no_further_than_the_cap() {
        let cases: &[(&str, u64, &[Option<&str>])] = &[
            ("{\"a\": 1}\n\n  \r\n[ \"x y\" , 2 ]", 100, &[Some("{\"a\":1}"), Some(""), Some(""), Some("[\"x y\",2]")]),
            ("{\"a\": \"\\u0041\\n\"}\r\n", 100, &[Some("{\"a\":\"\\u0041\\n\"}")]),
            ("[1, 2]\n[1, 2, 3]\n[]", 5, &[Some("[1,2]"), None, Some("[]")]),
        ];
        for (text, cap, expected) in cases {
            let mut input = std::io::BufReader::new(text.as_bytes());
            let mut got = Vec::new();
            loop {
                match read_line(&mut input, *cap).expect("read") {
                    Next::Line(kept) => got.push(Some(String::from_utf8(kept).expect("utf-8"))),
                    Next::OverCap => got.push(None),
                    Next::End => break,
                }
            }
            let expected: Vec<Option<String>> = expected.iter().map(|e| e.map(str::to_string)).collect();
            assert_eq!(got, expected, "{text:?}");
        }
        let long = format!("[\"{}\"]\n", "x".repeat(1 << 20));
        let mut input = std::io::BufReader::new(long.as_bytes());
        assert_eq!(read_line(&mut input, 1000).expect("read"), Next::OverCap);
        let unread = input.get_ref().len() + input.buffer().len();
        assert!(unread + 8192 >= long.len(), "read {} bytes", long.len() - unread);
    }

    /// Never more than the compact form, whatever the spacing, escapes and numbers.
    #[test]
    fn compact_len_at_least_is_a_lower_bound() {
        let cases: &[(&str, u64)] = &[
            (r#"{"a": [1, 2.50, true, null]}"#, 21),
            ("{\n  \"a b\" :  \"x y\"\n}", 13),
            (r#"["\u00e9\/\n", 1.000e3, -0]"#, 11),
        ];
        for (text, expected) in cases {
            let at_least = compact_len_at_least(text.as_bytes()).expect("read");
            assert_eq!(at_least, *expected, "{text}");
            let value: serde_json::Value = serde_json::from_str(text).expect("JSON");
            let compact = serde_json::to_vec(&value).expect("encode").len() as u64;
            assert!(at_least <= compact, "{text}: {at_least} > {compact}");
        }
    }
}
