//! Message formats: how a queue reads what its producers send (`format:` per queue). Each
//! format decodes a delivery into the same [`Envelope`] the runtime works with (id, type,
//! idempotency key, occurred_at, the payload when there is one), and keeps the delivery for
//! what templates and filters read beside it (`headers`, `routing_key`, `exchange`,
//! `content_type`, and per format its own fields).
//!
//! - `envelope`: sluice's own JSON envelope (the default).
//! - `json`: any JSON body is the payload; the id is the broker's message id, else the SHA-256
//!   of the body; the type is the broker's `type`, else a `type` header, else the routing key;
//!   `occurred_at` the timestamp, when there is one.
//! - `cloudevents`: binary mode (attributes in `cloudEvents:*` application properties, as the
//!   CloudEvents AMQP binding says, or `ce-*` headers; the body is `data`) or structured mode
//!   (the whole event as JSON, `application/cloudevents+json`). Its key is `source` and `id`.
//! - `bytes`: the body is opaque; templates see it as `body` when it is UTF-8.
//!
//! Decoding never fails on a broker's metadata alone: a body that is not what the format says
//! is [`Unreadable`], which the runtime dead-letters as `malformed`.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;
use sha2::{Digest as _, Sha256};

use crate::broker::Delivery;
use crate::envelope::{self, Envelope, is_blank};
use crate::vocab::format::Format;

/// Why a body is not a message of its queue's format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unreadable(String);

/// Attribute values longer than this make a CloudEvent unreadable: an id or source is a key,
/// and goes out in HTTP headers.
pub const MAX_ATTRIBUTE_BYTES: usize = 4096;

/// A CloudEvent's attributes beyond `id` and `type` (which the envelope holds).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Event {
    pub specversion: String,
    pub source: String,
    pub subject: Option<String>,
    pub time: Option<String>,
    pub datacontenttype: Option<String>,
    /// In binary mode, every attribute (extensions included), to send on as `ce-*` headers;
    /// empty in structured mode, where the body holds them.
    pub binary: Vec<(String, String)>,
}

/// A delivery decoded in its queue's format.
pub struct Message<'a> {
    pub format: Format,
    pub envelope: Envelope<'a>,
    /// Whether the message has a JSON payload (`payload`, or a CloudEvent's `data`).
    pub has_payload: bool,
    pub event: Option<Event>,
    pub delivery: &'a dyn Delivery,
}

impl<'a> Message<'a> {
    /// Decodes `delivery` as a message of `format`.
    pub fn decode(format: Format, delivery: &'a dyn Delivery) -> Result<Message<'a>, Unreadable> {
        let body = delivery.body();
        let (envelope, has_payload, event) = match format {
            Format::Envelope => (Envelope::decode(body).map_err(|e| Unreadable(e.to_string()))?, true, None),
            Format::Json => {
                let payload = envelope::json_document(body)
                    .map_err(|e| Unreadable(format!("not a JSON document (format: json): {e}")))?;
                (plain(delivery, Cow::Borrowed(payload)), true, None)
            }
            Format::Bytes => (plain(delivery, Cow::Owned(null())), false, None),
            Format::CloudEvents => {
                let (envelope, has_payload, event) = cloud_event(delivery)?;
                (envelope, has_payload, Some(event))
            }
        };
        Ok(Message { format, envelope, has_payload, event, delivery })
    }

    /// A `bytes` message's `body`: the body as text, when it is UTF-8 (other formats have no
    /// such field).
    pub fn text(&self) -> Option<&str> {
        std::str::from_utf8(self.delivery.body()).ok().filter(|_| self.format == Format::Bytes)
    }

    /// The content type the body is forwarded with (the default webhook body), and the headers
    /// it takes along (a binary-mode CloudEvent's attributes as `ce-*`, as CloudEvents over
    /// HTTP has them).
    pub fn forwarded(&self) -> (String, Vec<(String, String)>) {
        // One an HTTP header cannot carry (a line break) is as none.
        let given = self
            .delivery
            .content_type()
            .filter(|c| !c.trim().is_empty() && !c.chars().any(char::is_control))
            .map(str::to_string);
        match (self.format, &self.event) {
            (Format::Envelope, _) => ("application/json".into(), Vec::new()),
            (Format::Json, _) => (given.unwrap_or_else(|| "application/json".into()), Vec::new()),
            (Format::CloudEvents, Some(event)) if !event.binary.is_empty() => {
                let fallback = if self.has_payload { "application/json" } else { "application/octet-stream" };
                let headers =
                    event.binary.iter().map(|(name, value)| (format!("ce-{name}"), http_value(value))).collect();
                (given.unwrap_or_else(|| fallback.into()), headers)
            }
            (Format::CloudEvents, _) => (given.unwrap_or_else(|| STRUCTURED.into()), Vec::new()),
            (Format::Bytes, _) => (given.unwrap_or_else(|| "application/octet-stream".into()), Vec::new()),
        }
    }

    /// The part of the body a handler given only the payload receives (a command's
    /// `stdin: payload`): the envelope's payload, a CloudEvent's data, or the whole body.
    pub fn payload_bytes(&self) -> &[u8] {
        let structured = self.event.as_ref().is_some_and(|e| e.binary.is_empty());
        match self.format {
            Format::Envelope => self.envelope.payload.get().as_bytes(),
            Format::CloudEvents if structured && self.has_payload => self.envelope.payload.get().as_bytes(),
            Format::CloudEvents if structured => b"",
            Format::Json | Format::CloudEvents | Format::Bytes => self.delivery.body(),
        }
    }

    /// The fields templates read beside `attempt`, `queue` and `env`; `headers` only when
    /// `with_headers` (every header turned into JSON, for templates that read them).
    pub fn fields(&self, with_headers: bool) -> Result<serde_json::Map<String, Value>, envelope::Malformed> {
        let e = &self.envelope;
        let route = self.delivery.route();
        let mut fields = serde_json::Map::new();
        fields.insert("id".into(), Value::from(e.id.as_str()));
        fields.insert("type".into(), Value::from(e.kind.as_str()));
        fields.insert("occurred_at".into(), e.occurred_at.as_deref().map_or(Value::Null, Value::from));
        fields.insert("idempotency_key".into(), Value::from(e.idempotency_key()));
        if with_headers {
            fields.insert("headers".into(), Value::Object(self.delivery.headers().into_iter().collect()));
        }
        fields.insert("routing_key".into(), route.map_or(Value::Null, |r| Value::from(r.routing_key.as_str())));
        fields.insert("exchange".into(), route.map_or(Value::Null, |r| Value::from(r.exchange.as_str())));
        fields.insert("content_type".into(), self.delivery.content_type().map_or(Value::Null, Value::from));
        match self.format {
            Format::Envelope => {
                fields.insert("version".into(), Value::from(e.version));
                fields.insert("payload".into(), e.payload_value()?);
            }
            Format::Json => {
                fields.insert("payload".into(), e.payload_value()?);
            }
            Format::CloudEvents => {
                if let Some(event) = &self.event {
                    let text = |t: &Option<String>| t.as_deref().map_or(Value::Null, Value::from);
                    fields.insert("source".into(), Value::from(event.source.as_str()));
                    fields.insert("specversion".into(), Value::from(event.specversion.as_str()));
                    fields.insert("subject".into(), text(&event.subject));
                    fields.insert("time".into(), text(&event.time));
                    fields.insert("datacontenttype".into(), text(&event.datacontenttype));
                }
                // Absent, not null, when the event has none: a template reading it fails.
                if self.has_payload {
                    fields.insert("data".into(), e.payload_value()?);
                }
            }
            Format::Bytes => {
                if let Some(text) = self.text() {
                    fields.insert("body".into(), Value::from(text));
                }
            }
        }
        Ok(fields)
    }
}

/// The media type of a structured-mode CloudEvent.
const STRUCTURED: &str = "application/cloudevents+json";

/// JSON `null`, as a payload.
fn null() -> Box<RawValue> {
    // `null` is JSON.
    RawValue::from_string("null".into()).unwrap_or_default()
}

/// `sha256:` and the SHA-256 of `bytes` in lowercase hex: the id of a message without one, and
/// the key stored for a long one.
pub fn sha256_id(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut text = String::with_capacity(7 + 64);
    text.push_str("sha256:");
    for byte in digest {
        // Writing to a String cannot fail.
        let _ = write!(text, "{byte:02x}");
    }
    text
}

/// The envelope of a `json` or `bytes` message: its id, type and time from the broker's
/// properties.
fn plain<'a>(delivery: &dyn Delivery, payload: Cow<'a, RawValue>) -> Envelope<'a> {
    let id = match delivery.message_id().filter(|id| !is_blank(id)) {
        Some(id) => id.to_string(),
        None => sha256_id(delivery.body()),
    };
    let kind = delivery
        .kind()
        .filter(|k| !is_blank(k))
        .map(str::to_string)
        .or_else(|| delivery.header("type").map(|h| h.to_text()).filter(|k| !is_blank(k)))
        .or_else(|| delivery.route().map(|r| r.routing_key.clone()))
        .unwrap_or_default();
    Envelope {
        id,
        kind,
        version: 1,
        occurred_at: delivery.timestamp().map(envelope::rfc3339_seconds),
        idempotency_key: None,
        not_before: None,
        payload,
    }
}

/// The attribute a header carries in binary mode (`cloudEvents:id`, `cloudEvents_id`,
/// `ce-id`, `ce_id`), named in lower case; attribute names are letters and digits (so one is
/// always a valid HTTP header name once sent on as `ce-NAME`).
fn attribute(header: &str) -> Option<String> {
    let lower = header.to_ascii_lowercase();
    ["cloudevents:", "cloudevents_", "ce-", "ce_"]
        .iter()
        .find_map(|prefix| lower.strip_prefix(prefix))
        .filter(|name| !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric()))
        .map(str::to_string)
}

/// A header's value as an attribute's text: a time as AMQP's timestamp (seconds) in RFC 3339.
fn attribute_text(name: &str, value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Number(n) if name == "time" => n.as_u64().map_or_else(|| n.to_string(), envelope::rfc3339_seconds),
        other => other.to_string(),
    }
}

/// Whether a media type says JSON (`application/json`, `…+json`, `text/json`), parameters aside.
fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    essence == "application/json" || essence == "text/json" || essence.ends_with("+json")
}

/// Decodes a CloudEvent in binary mode when its headers carry attributes, else in structured
/// mode.
fn cloud_event<'a>(delivery: &'a dyn Delivery) -> Result<(Envelope<'a>, bool, Event), Unreadable> {
    let attributes: BTreeMap<String, String> = delivery
        .headers()
        .iter()
        .filter_map(|(name, value)| {
            let attribute = attribute(name)?;
            let text = attribute_text(&attribute, value);
            Some((attribute, text))
        })
        .collect();
    let structured = delivery
        .content_type()
        .is_some_and(|c| c.split(';').next().unwrap_or_default().trim().eq_ignore_ascii_case(STRUCTURED));
    if attributes.is_empty() || structured {
        return structured_event(delivery.body(), structured);
    }
    binary_event(delivery, attributes)
}

/// A required attribute, present, not blank and not over [`MAX_ATTRIBUTE_BYTES`].
fn required(name: &str, value: Option<String>, mode: &str) -> Result<String, Unreadable> {
    let value = value.filter(|v| !is_blank(v)).ok_or_else(|| {
        Unreadable(format!("not a CloudEvent ({mode}): the required attribute \"{name}\" is missing or blank"))
    })?;
    within_limit(name, value)
}

fn within_limit(name: &str, value: String) -> Result<String, Unreadable> {
    if value.len() > MAX_ATTRIBUTE_BYTES {
        return Err(Unreadable(format!(
            "CloudEvent attribute \"{name}\" is {} bytes, over the {MAX_ATTRIBUTE_BYTES} sluice reads",
            value.len()
        )));
    }
    Ok(value)
}

/// The envelope of a CloudEvent: its `source` and `id` the default idempotency key, its `data`
/// (when JSON) the payload; and whether it has one.
fn event_envelope<'a>(
    id: String,
    kind: String,
    source: &str,
    time: Option<String>,
    payload: Option<&'a RawValue>,
) -> (Envelope<'a>, bool) {
    let envelope = Envelope {
        idempotency_key: Some(format!("{source} {id}")),
        id,
        kind,
        version: 1,
        occurred_at: time,
        not_before: None,
        payload: payload.map_or_else(|| Cow::Owned(null()), Cow::Borrowed),
    };
    (envelope, payload.is_some())
}

fn binary_event(
    delivery: &dyn Delivery,
    mut attributes: BTreeMap<String, String>,
) -> Result<(Envelope<'_>, bool, Event), Unreadable> {
    let mode = "binary mode";
    let id = required("id", attributes.get("id").cloned(), mode)?;
    let source = required("source", attributes.get("source").cloned(), mode)?;
    let kind = required("type", attributes.get("type").cloned(), mode)?;
    let specversion = attributes.get("specversion").cloned().unwrap_or_else(|| "1.0".into());
    attributes.entry("specversion".into()).or_insert_with(|| specversion.clone());
    let optional = |name: &str| attributes.get(name).cloned().map(|v| within_limit(name, v)).transpose();
    let (subject, time) = (optional("subject")?, optional("time")?);
    let datacontenttype = delivery.content_type().map(str::to_string);
    let body = delivery.body();
    // The data: JSON when the content type says so (or says nothing and it parses), else none
    // that templates can read (the body goes on as it is).
    let payload =
        match datacontenttype.as_deref() {
            _ if body.is_empty() => None,
            Some(c) if is_json(c) => Some(envelope::json_document(body).map_err(|e| {
                Unreadable(format!("CloudEvent data is not JSON though its content type is \"{c}\": {e}"))
            })?),
            Some(_) => None,
            None => envelope::json_document(body).ok(),
        };
    let (envelope, has_payload) = event_envelope(id, kind, &source, time.clone(), payload);
    let binary = attributes.into_iter().collect();
    Ok((envelope, has_payload, Event { specversion, source, subject, time, datacontenttype, binary }))
}

/// A structured-mode event: the JSON object of its attributes, `data` borrowed from the body.
#[derive(Deserialize)]
struct Structured<'a> {
    specversion: Option<String>,
    id: Option<String>,
    source: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    subject: Option<String>,
    time: Option<String>,
    datacontenttype: Option<String>,
    #[serde(borrow, default)]
    data: Option<&'a RawValue>,
}

fn structured_event(body: &[u8], declared: bool) -> Result<(Envelope<'_>, bool, Event), Unreadable> {
    let event: Structured = serde_json::from_slice(body).map_err(|e| {
        let how = if declared {
            "a structured CloudEvent is a JSON object"
        } else {
            "no cloudEvents:* or ce-* attribute headers (binary mode), and the body is not a structured CloudEvent"
        };
        Unreadable(format!("not a CloudEvent: {how}: {e}"))
    })?;
    let mode = "structured mode";
    let id = required("id", event.id, mode)?;
    let source = required("source", event.source, mode)?;
    let kind = required("type", event.kind, mode)?;
    let specversion = required("specversion", event.specversion, mode)?;
    let (subject, time) = (event.subject.map(|s| within_limit("subject", s)).transpose()?, event.time);
    let payload = match event.data {
        Some(data) => Some(
            envelope::json_document(data.get().as_bytes()).map_err(|e| Unreadable(format!("CloudEvent data: {e}")))?,
        ),
        None => None,
    };
    let (envelope, has_payload) = event_envelope(id, kind, &source, time.clone(), payload);
    let event =
        Event { specversion, source, subject, time, datacontenttype: event.datacontenttype, binary: Vec::new() };
    Ok((envelope, has_payload, event))
}

/// What HTTP header values may not hold as they are (CloudEvents over HTTP percent-encodes
/// them): controls, `"`, `%`, and every byte past ASCII.
const HEADER_VALUE: &AsciiSet = &CONTROLS.add(b'"').add(b'%');

fn http_value(value: &str) -> String {
    utf8_percent_encode(value, HEADER_VALUE).to_string()
}

#[cfg(test)]
mod tests;
