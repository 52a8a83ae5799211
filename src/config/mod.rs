//! Pipeline files in, a validated [`Config`] out: discovery and merge of the files, the JSON
//! Schema, the span map for file:line:column, and every semantic check, all errors collected.
//!
//! Validation does no IO beyond reading the pipeline files and the files they name
//! (payload schemas, command programs); the broker is never contacted here.

mod compile;
pub mod diagnostic;
pub mod raw;
pub mod schema;
pub mod source;

use std::collections::BTreeMap;
use std::num::{NonZeroU16, NonZeroU32};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use diagnostic::{Diagnostic, Format, Severity};

use crate::handler::template::Template;

/// The broker's consumer timeout (RabbitMQ's default): a handler must finish well before it.
pub const CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The longest retry delay the delay cascade can hold (its levels cover a little more).
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(30 * 24 * 3600);

/// The validated pipeline: every name resolved, every default applied.
#[derive(Debug, Default)]
pub struct Config {
    pub exchanges: BTreeMap<String, Exchange>,
    pub queues: BTreeMap<String, Queue>,
}

/// An exchange declared by the pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchange {
    pub name: String,
    pub kind: ExchangeKind,
}

/// AMQP exchange types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeKind {
    Direct,
    Fanout,
    Topic,
    Headers,
}

impl ExchangeKind {
    /// The AMQP name of the type.
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Headers => "headers",
        }
    }
}

/// A queue bound to an exchange.
#[derive(Debug, Clone, PartialEq)]
pub struct Binding {
    pub exchange: String,
    pub routing_key: String,
    pub arguments: BTreeMap<String, serde_json::Value>,
}

/// Quorum (replicated, the default) or classic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueKind {
    Quorum,
    Classic,
}

/// A queue and everything about how its messages are handled.
#[derive(Debug)]
pub struct Queue {
    pub name: String,
    pub kind: QueueKind,
    pub bindings: Vec<Binding>,
    pub max_length: Option<u64>,
    pub payload_schema: Option<PayloadSchema>,
    pub concurrency: NonZeroU16,
    pub rate_limit: Option<RateLimit>,
    pub ordered: bool,
    pub handler: Handler,
    pub retry: RetryPolicy,
    /// `None` when idempotency is turned off for this queue.
    pub idempotency: Option<Idempotency>,
    pub dead_letter: String,
    /// The file the queue is defined in.
    pub file: PathBuf,
}

/// A compiled JSON Schema that payloads must satisfy.
#[derive(Clone)]
pub struct PayloadSchema {
    pub path: PathBuf,
    pub validator: Arc<jsonschema::Validator>,
}

impl std::fmt::Debug for PayloadSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadSchema").field("path", &self.path).finish_non_exhaustive()
    }
}

/// At most `count` handler runs per `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub count: NonZeroU32,
    pub per: Duration,
}

/// What runs for each message.
#[derive(Debug)]
#[allow(clippy::large_enum_variant, reason = "one per queue, built once")]
pub enum Handler {
    Webhook(Webhook),
    Command(Command),
}

impl Handler {
    /// The handler's own timeout.
    pub fn timeout(&self) -> Duration {
        match self {
            Handler::Webhook(w) => w.timeout,
            Handler::Command(c) => c.timeout,
        }
    }
}

/// An HTTP call per message.
#[derive(Debug)]
pub struct Webhook {
    pub url: Template,
    /// `url` parsed once, when it has no expression (most do): no URL parse per message.
    pub fixed_url: Option<reqwest::Url>,
    pub method: String,
    pub headers: Vec<(String, Template)>,
    /// `None`: the whole envelope as JSON.
    pub body: Option<Template>,
    pub timeout: Duration,
    /// The environment variable holding the Standard Webhooks secret.
    pub signing_secret_env: Option<String>,
}

/// A subprocess per message.
#[derive(Debug)]
pub struct Command {
    pub program: PathBuf,
    pub args: Vec<Template>,
    pub env: Vec<(String, Template)>,
    /// Variables passed through from the runner's environment, when set there.
    pub pass_env: Vec<String>,
    pub stdin: StdinMode,
    pub timeout: Duration,
    pub permanent_exit_codes: Vec<i32>,
}

/// What a command reads on standard input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StdinMode {
    Envelope,
    Payload,
    None,
}

/// Bounded retries with backoff.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    pub max_attempts: NonZeroU32,
    pub backoff: Backoff,
    pub initial: Duration,
    pub max: Duration,
    pub multiplier: f64,
    pub jitter: Jitter,
}

/// How the delay grows between attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backoff {
    Exponential,
    Fixed,
}

/// How much randomness spreads retries out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// Uniform in [0, delay].
    Full,
    /// Uniform in [delay/2, delay].
    Equal,
    None,
}

impl RetryPolicy {
    /// The delay before attempt `next` (2-based: the first retry) before jitter.
    pub fn ceiling(&self, next: u32) -> Duration {
        let retries = next.saturating_sub(2);
        match self.backoff {
            Backoff::Fixed => self.initial.min(self.max),
            Backoff::Exponential => {
                let factor = self.multiplier.powi(retries.min(1000) as i32);
                let secs = (self.initial.as_secs_f64() * factor).min(self.max.as_secs_f64());
                // Near u64::MAX seconds the float rounds up past what a Duration holds.
                Duration::try_from_secs_f64(secs).unwrap_or(self.max)
            }
        }
    }

    /// The longest time from the first attempt to the last one's end (saturating: validation
    /// computes it for durations it is about to reject).
    pub fn window(&self, handler_timeout: Duration) -> Duration {
        let attempts = self.max_attempts.get();
        let waits = (2..=attempts).map(|n| self.ceiling(n)).fold(Duration::ZERO, Duration::saturating_add);
        waits.saturating_add(handler_timeout.saturating_mul(attempts))
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: NonZeroU32::new(5).unwrap_or(NonZeroU32::MIN),
            backoff: Backoff::Exponential,
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
            multiplier: 2.0,
            jitter: Jitter::Full,
        }
    }
}

/// How duplicates of a message are recognised.
#[derive(Debug)]
pub struct Idempotency {
    /// The key's template; `None`: the envelope's `idempotency_key` (no template to render).
    pub key: Option<Template>,
    pub ttl: Duration,
}

/// What loading the pipeline files found: a config when there were no errors, and every problem.
#[derive(Debug)]
pub struct Validation {
    pub config: Option<Config>,
    pub diagnostics: Vec<Diagnostic>,
}

impl Validation {
    /// Whether any diagnostic is an error.
    pub fn has_errors(&self) -> bool {
        self.diagnostics.iter().any(|d| d.severity == Severity::Error)
    }
}

/// Loads, merges and validates the pipeline files under `paths`.
pub fn load(paths: &[PathBuf]) -> Validation {
    compile::load(paths)
}

/// Parses a duration such as `250ms`, `10s`, `5m` or `24h`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = text.split_at(split);
    let n: u64 = n.parse().ok()?;
    let secs = match unit {
        "ms" => return Some(Duration::from_millis(n)),
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return None,
    };
    Some(Duration::from_secs(n.checked_mul(secs)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let cases = [
            ("250ms", Some(Duration::from_millis(250))),
            ("10s", Some(Duration::from_secs(10))),
            ("5m", Some(Duration::from_secs(300))),
            ("24h", Some(Duration::from_secs(86400))),
            ("10", None),
            ("s", None),
            ("1w", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_duration(text), want, "{text}");
        }
    }

    #[test]
    fn retry_ceilings_and_window() {
        let p = RetryPolicy {
            max_attempts: NonZeroU32::new(5).unwrap(),
            max: Duration::from_secs(5),
            ..Default::default()
        };
        let ceilings: Vec<u64> = (2..=5).map(|n| p.ceiling(n).as_secs()).collect();
        assert_eq!(ceilings, [1, 2, 4, 5]);
        assert_eq!(p.window(Duration::from_secs(10)), Duration::from_secs(12 + 50));
        let fixed = RetryPolicy { backoff: Backoff::Fixed, initial: Duration::from_secs(3), ..p };
        assert_eq!(fixed.ceiling(4), Duration::from_secs(3));
    }

    #[test]
    fn huge_durations_saturate_instead_of_panicking() {
        let huge = Duration::from_secs(u64::MAX);
        let p = RetryPolicy {
            max_attempts: NonZeroU32::new(1000).unwrap(),
            initial: huge,
            max: huge,
            ..Default::default()
        };
        assert_eq!(p.ceiling(3), huge);
        assert_eq!(p.window(huge), Duration::MAX);
        assert_eq!(RetryPolicy::default().window(huge), Duration::MAX);
    }
}
