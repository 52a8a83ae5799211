//! The pipeline file format as serde types: names as strings, durations as text, every field
//! optional where the format allows. `compile` turns these into the validated `Config`.
//!
//! No checks live here beyond what serde enforces; the JSON Schema has already run.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::handler::rules::Action;

/// One pipeline file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    pub version: u32,
    #[serde(default)]
    pub exchanges: BTreeMap<String, Exchange>,
    #[serde(default)]
    pub queues: BTreeMap<String, Queue>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exchange {
    #[serde(rename = "type")]
    pub kind: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Binding {
    pub exchange: String,
    #[serde(default)]
    pub routing_key: String,
    #[serde(default)]
    pub arguments: BTreeMap<String, serde_json::Value>,
    /// As written; `compile` checks it (against the payload schema too) and builds it.
    pub filter: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Queue {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub bind: Vec<Binding>,
    pub max_length: Option<u64>,
    /// A duration (`10m`).
    pub message_ttl: Option<String>,
    pub priority: Option<u64>,
    /// Other `x-` arguments of the work queue (checked in `config::arguments`).
    #[serde(default)]
    pub arguments: BTreeMap<String, serde_json::Value>,
    /// Bytes as an integer, or text with a unit (`16MiB`).
    pub max_message_bytes: Option<serde_json::Value>,
    /// `envelope` (the default), `json`, `cloudevents` or `bytes`.
    pub format: Option<String>,
    pub payload_schema: Option<String>,
    pub concurrency: Option<Concurrency>,
    pub circuit_breaker: Option<CircuitBreaker>,
    pub rate_limit: Option<String>,
    #[serde(default)]
    pub ordered: bool,
    /// A template over the message: messages with the same key are handled one at a time.
    pub order_by: Option<String>,
    /// `release` (the default) or `hold`: what dead-lettering does to its key's lane.
    pub on_dead_letter: Option<String>,
    pub handler: Handler,
    #[serde(default)]
    pub retry: Retry,
    /// Keys as written (`"404"`, `"5xx"`); `compile` parses and checks them.
    #[serde(default)]
    pub on_status: BTreeMap<String, Action>,
    #[serde(default)]
    pub idempotency: Idempotency,
    #[serde(default)]
    pub dead_letter: DeadLetter,
}

/// `concurrency: 8`, or `concurrency: {max: 64, adaptive: true}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Concurrency {
    Fixed(u16),
    Limit(ConcurrencyLimit),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConcurrencyLimit {
    pub max: u16,
    #[serde(default)]
    pub adaptive: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitBreaker {
    pub enabled: Option<bool>,
    /// `50%`.
    pub failure_rate: Option<String>,
    pub min_calls: Option<u32>,
    pub window: Option<String>,
    pub open_for: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Handler {
    pub webhook: Option<Webhook>,
    pub command: Option<Command>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Webhook {
    pub url: String,
    pub method: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    pub body: Option<String>,
    pub timeout: Option<String>,
    pub signing: Option<Signing>,
    pub auth: Option<Auth>,
    pub tls: Option<Tls>,
}

/// How the webhook authenticates itself to the receiver.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Auth {
    pub oauth2: OAuth2,
}

/// OAuth 2.0 client credentials.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OAuth2 {
    pub token_url: String,
    pub client_id: String,
    pub client_secret_env: Option<String>,
    pub client_secret_file: Option<String>,
    #[serde(default)]
    pub scopes: Vec<String>,
    pub audience: Option<String>,
}

/// The TLS client certificate and the certificate authorities a webhook trusts.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tls {
    pub client_cert_file: Option<String>,
    pub client_key_file: Option<String>,
    pub ca_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Signing {
    #[serde(default)]
    pub secret_env: EnvNames,
    pub secret_file: Option<String>,
}

/// `secret_env: NAME`, or several: `secret_env: [NEW, OLD]`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum EnvNames {
    One(String),
    Many(Vec<String>),
}

impl Default for EnvNames {
    fn default() -> Self {
        EnvNames::Many(Vec::new())
    }
}

impl EnvNames {
    /// The names, in the order given.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            EnvNames::One(name) => vec![name],
            EnvNames::Many(names) => names,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Command {
    pub program: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub pass_env: Vec<String>,
    pub stdin: Option<String>,
    pub timeout: Option<String>,
    #[serde(default)]
    pub permanent_exit_codes: Vec<i32>,
    /// Keys as written (`"75"`); `compile` parses and checks them.
    #[serde(default)]
    pub on_exit: BTreeMap<String, Action>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Retry {
    pub max_attempts: Option<u32>,
    pub backoff: Option<String>,
    pub initial: Option<String>,
    pub max: Option<String>,
    pub multiplier: Option<f64>,
    pub jitter: Option<String>,
    pub schedule: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Idempotency {
    pub enabled: Option<bool>,
    pub key: Option<String>,
    pub ttl: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetter {
    pub queue: Option<String>,
}
