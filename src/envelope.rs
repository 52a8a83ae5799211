//! The message envelope: the JSON body every sluice message carries, and the names of the
//! AMQP headers sluice reads and writes.
//!
//! Decoding is strict about what sluice needs (id, type, payload) and ignores unknown fields,
//! so producers can add fields without breaking older runners.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

/// Attempt number of a delivery, 1-based.
pub const ATTEMPT_HEADER: &str = "x-sluice-attempt";
/// W3C trace context, carried across the async hop.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// Dead-letter headers.
pub const REASON_HEADER: &str = "x-sluice-reason";
pub const ERROR_HEADER: &str = "x-sluice-error";
pub const ATTEMPTS_HEADER: &str = "x-sluice-attempts";
pub const FAILED_AT_HEADER: &str = "x-sluice-failed-at";
pub const SOURCE_QUEUE_HEADER: &str = "x-sluice-source-queue";

/// A decoded message body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default = "default_version")]
    pub version: u32,
    #[serde(default)]
    pub occurred_at: Option<String>,
    /// Defaults to `id` when the producer sets none.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// As the producer sent it (checked to be JSON): most handlers pass it on untouched, so
    /// it is parsed only when a schema or template reads it.
    pub payload: Box<RawValue>,
}

fn default_version() -> u32 {
    1
}

/// Why a body is not an envelope.
#[derive(Debug, thiserror::Error)]
#[error("not a sluice envelope: {0}")]
pub struct Malformed(#[from] serde_json::Error);

impl Envelope {
    /// A new envelope with a fresh time-ordered id, stamped now.
    pub fn new(kind: &str, payload: &Value, idempotency_key: Option<String>) -> Envelope {
        let id = uuid::Uuid::now_v7().to_string();
        // A JSON value always serializes.
        let payload = serde_json::value::to_raw_value(payload).unwrap_or_default();
        Envelope {
            idempotency_key: Some(idempotency_key.unwrap_or_else(|| id.clone())),
            id,
            kind: kind.to_string(),
            version: 1,
            occurred_at: Some(humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()),
            payload,
        }
    }

    /// Decodes a message body.
    pub fn decode(body: &[u8]) -> Result<Envelope, Malformed> {
        let envelope: Envelope = serde_json::from_slice(body)?;
        if envelope.id.is_empty() {
            return Err(Malformed(serde::de::Error::custom("\"id\" is empty")));
        }
        Ok(envelope)
    }

    /// The payload as a JSON value.
    pub fn payload_value(&self) -> Result<Value, Malformed> {
        Ok(serde_json::from_str(self.payload.get())?)
    }

    /// The producer's idempotency key, or the id.
    pub fn idempotency_key(&self) -> &str {
        self.idempotency_key.as_deref().unwrap_or(&self.id)
    }

    /// The JSON body.
    pub fn encode(&self) -> Vec<u8> {
        // Serializing strings and a JSON value cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_cases() {
        let cases: &[(&str, bool)] = &[
            (r#"{"id":"1","type":"t","payload":{}}"#, true),
            (r#"{"id":"1","type":"t","payload":null,"extra":[1]}"#, true),
            (r#"{"id":"1","type":"t"}"#, false),
            (r#"{"id":"","type":"t","payload":1}"#, false),
            (r#"{"type":"t","payload":1}"#, false),
            ("not json", false),
            ("", false),
        ];
        for (body, ok) in cases {
            assert_eq!(Envelope::decode(body.as_bytes()).is_ok(), *ok, "{body}");
        }
    }

    #[test]
    fn key_defaults_to_id_and_round_trips() {
        let e = Envelope::decode(br#"{"id":"abc","type":"t","payload":{"a":1}}"#).unwrap();
        assert_eq!(e.idempotency_key(), "abc");
        assert_eq!(e.version, 1);
        let n = Envelope::new("t", &serde_json::json!({"a": 1}), Some("k".into()));
        let again = Envelope::decode(&n.encode()).unwrap();
        assert_eq!(again.encode(), n.encode());
        assert_eq!(again.payload_value().unwrap(), serde_json::json!({"a": 1}));
    }
}
