//! Pipeline files in, a validated [`Config`] out: discovery and merge of the files, `${VAR}`
//! from the environment, the JSON Schema, the span map for file:line:column, and every semantic
//! check, all errors collected.
//!
//! Validation does no IO beyond reading the pipeline files and the files they name
//! (payload schemas, command programs); the broker is never contacted here.

mod arguments;
mod capabilities;
pub(crate) mod compile;
pub mod diagnostic;
pub mod filter;
mod interpolate;
pub mod raw;
pub mod reference;
mod rules;
pub mod schema;
pub mod source;
mod url;

use std::collections::BTreeMap;
use std::num::{NonZeroU16, NonZeroU32};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub use diagnostic::{Diagnostic, Format, Severity};
pub use filter::Filter;
pub use interpolate::Unset;
// The vocabulary the brokers share lives below both; named here too, as config's users know it.
pub use crate::vocab::{ExchangeKind, MAX_MESSAGE_BYTES, QueueKind, duration_problem, parse_duration, suggest};

use crate::file::{ReadError, read_regular};
use crate::handler::auth::{OAuth2, SecretSource};
use crate::handler::rules::Rules;
use crate::handler::template::Template;
use crate::handler::webhook::{SigningError, SigningKey};

/// The broker's consumer timeout (RabbitMQ's default): a handler must finish well before it.
pub const CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The longest retry delay the delay cascade can hold (its levels cover a little more).
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(30 * 24 * 3600);

/// The validated pipeline: every name resolved, every default applied.
#[derive(Debug, Default)]
pub struct Config {
    pub exchanges: BTreeMap<String, Exchange>,
    /// Shared: the worker of each queue owns its queue for as long as it runs.
    pub queues: BTreeMap<String, Arc<Queue>>,
}

/// An exchange declared by the pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exchange {
    pub name: String,
    pub kind: ExchangeKind,
}

/// A queue bound to an exchange.
#[derive(Debug, Clone, PartialEq)]
pub struct Binding {
    pub exchange: String,
    /// The exchange's kind, declared or built in: none only for an undefined exchange, which
    /// is an error unless the files are checked in part.
    pub exchange_kind: Option<ExchangeKind>,
    pub routing_key: String,
    pub arguments: BTreeMap<String, serde_json::Value>,
    /// The queue takes a message through this binding only when this holds.
    pub filter: Option<Filter>,
}

/// A queue and everything about how its messages are handled.
#[derive(Debug)]
pub struct Queue {
    pub name: String,
    pub kind: QueueKind,
    pub bindings: Vec<Binding>,
    pub max_length: Option<u64>,
    /// How long a message may wait in the queue; then the broker dead-letters it (`expired`).
    pub message_ttl: Option<Duration>,
    /// Priority levels (`x-max-priority`): a classic queue on RabbitMQ.
    pub priority: Option<u8>,
    /// Other `x-` arguments of the queue, checked against the known ones.
    pub arguments: BTreeMap<String, serde_json::Value>,
    /// A bigger body is dead-lettered as `too_large`, unparsed.
    pub max_message_bytes: usize,
    /// How its messages are read.
    pub format: crate::vocab::format::Format,
    pub payload_schema: Option<PayloadSchema>,
    /// Prefetch, and the most handlers in flight at once.
    pub concurrency: NonZeroU16,
    /// The in-flight limit follows the receiver (AIMD), up to `concurrency`.
    pub adaptive: bool,
    /// `None` when turned off (`enabled: false`).
    pub circuit_breaker: Option<CircuitBreaker>,
    pub rate_limit: Option<RateLimit>,
    pub ordered: bool,
    /// Per-key ordering: one message of a key at a time, in arrival order.
    pub order_by: Option<OrderBy>,
    pub handler: Handler,
    pub retry: RetryPolicy,
    /// `None` when idempotency is turned off for this queue.
    pub idempotency: Option<Idempotency>,
    pub dead_letter: String,
    /// The file the queue is defined in.
    pub file: PathBuf,
    /// Everything the queue was compiled from: its definition as merged, and what it read
    /// from other files (the payload schema, the resolved program). Two queues with the same
    /// source behave the same, so a reload leaves the queue running.
    pub source: serde_json::Value,
    /// The queue's definition as its file writes it, before `${VAR}` substitution: what the
    /// admin port shows, which must not hold what the environment fills in.
    pub written: serde_json::Value,
}

/// A queue's per-key ordering (`order_by`).
#[derive(Debug, Clone)]
pub struct OrderBy {
    /// The key's template.
    pub key: Template,
    /// What dead-lettering a message does to its key.
    pub on_dead_letter: OnDeadLetter,
}

/// What dead-lettering a message of an `order_by` queue does to its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDeadLetter {
    /// The key's next message runs.
    Release,
    /// The key stays blocked until its dead-lettered message is redriven (or the runner restarts).
    Hold,
}

/// A compiled JSON Schema that payloads must satisfy.
#[derive(Clone)]
pub struct PayloadSchema {
    pub path: PathBuf,
    /// The schema as read, to tell whether a reload changed it.
    pub schema: serde_json::Value,
    pub validator: Arc<jsonschema::Validator>,
}

impl std::fmt::Debug for PayloadSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PayloadSchema").field("path", &self.path).finish_non_exhaustive()
    }
}

/// When a queue stops consuming because its receiver is unwell.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CircuitBreaker {
    /// The share (0 to 1) of calls in the window that must say "unwell" to open.
    pub failure_rate: f64,
    /// Calls in the window before it may open.
    pub min_calls: u32,
    pub window: Duration,
    /// How long it stays open the first time; doubled on each failed probe, up to ten times.
    pub open_for: Duration,
}

impl Default for CircuitBreaker {
    fn default() -> Self {
        CircuitBreaker {
            failure_rate: 0.5,
            min_calls: 20,
            window: Duration::from_secs(30),
            open_for: Duration::from_secs(30),
        }
    }
}

/// At most `count` handler runs per `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub count: NonZeroU32,
    pub per: Duration,
}

impl RateLimit {
    /// A rate such as `20/s`, `100/m` or `5000/h`; `None` for anything else, a count of 0
    /// included.
    pub fn parse(text: &str) -> Option<RateLimit> {
        let (n, unit) = text.split_once('/')?;
        let per = match unit {
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            _ => return None,
        };
        Some(RateLimit { count: n.parse().ok()?, per })
    }
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
    /// Standard Webhooks signing, when configured.
    pub signing: Option<Signing>,
    /// The queue's `on_status` rules.
    pub on_status: Arc<Rules>,
    /// OAuth 2.0 client credentials (`auth.oauth2`) and the queue's token cache, shared by
    /// every call of the queue.
    pub oauth2: Option<Arc<OAuth2>>,
    /// `tls:`: the files, and the client of its own they make.
    pub tls: Option<Tls>,
}

/// A webhook's TLS files (resolved relative to the pipeline file) and the client they make.
#[derive(Debug)]
pub struct Tls {
    pub client_cert_file: Option<PathBuf>,
    pub client_key_file: Option<PathBuf>,
    pub ca_file: Option<PathBuf>,
    /// The webhook's own client; `None` while a file cannot be read here (`validate` warns,
    /// `run` refuses to start).
    pub client: Option<reqwest::Client>,
    /// SHA-256 of what the files held (empty while one cannot be read): in the queue's
    /// `source`, so that a reload restarts the queue when a file changed.
    pub fingerprint: String,
}

impl Tls {
    /// Every file named, with its setting's name.
    pub fn files(&self) -> impl Iterator<Item = (&'static str, &PathBuf)> {
        [
            ("client_cert_file", &self.client_cert_file),
            ("client_key_file", &self.client_key_file),
            ("ca_file", &self.ca_file),
        ]
        .into_iter()
        .filter_map(|(name, path)| Some((name, path.as_ref()?)))
    }
}

/// Where a webhook's Standard Webhooks secrets come from: each one signs every call (one
/// signature each, so receivers can roll over from one secret to the next).
#[derive(Debug)]
pub struct Signing {
    /// Environment variables holding one secret each, in the order given.
    pub secret_env: Vec<String>,
    /// A file holding one secret a line (resolved relative to the pipeline file); watched,
    /// so that an edit reloads the queue with the new secrets.
    pub secret_file: Option<PathBuf>,
    /// The keys, read once by [`Config::prepare_run`]; `None` until then (`sluice test` and
    /// `render` read them per call).
    pub keys: Option<Arc<[SigningKey]>>,
}

/// The most a secrets file may hold: a few secrets, with room for comments.
const MAX_SECRETS_FILE_BYTES: u64 = 64 * 1024;

impl Signing {
    /// Reads every secret now, the variables' first, then the file's in line order. Every
    /// problem is reported; none quotes a secret.
    pub fn load(&self) -> Result<Vec<SigningKey>, Vec<SecretError>> {
        let (keys, errors) = self.read();
        if errors.is_empty() { Ok(keys) } else { Err(errors) }
    }

    /// Every secret that can be read now, and every problem (see [`Signing::load`]).
    fn read(&self) -> (Vec<SigningKey>, Vec<SecretError>) {
        let mut keys = Vec::new();
        let mut errors = Vec::new();
        for var in &self.secret_env {
            match std::env::var(var) {
                Ok(secret) => match SigningKey::parse(&secret) {
                    Ok(key) => keys.push(key),
                    Err(reason) => errors.push(SecretError::Env { var: var.clone(), reason }),
                },
                Err(_) => errors.push(SecretError::Unset { var: var.clone() }),
            }
        }
        if let Some(path) = &self.secret_file {
            match read_regular(path, MAX_SECRETS_FILE_BYTES) {
                Ok(text) => {
                    let before = keys.len() + errors.len();
                    for (line, secret) in crate::handler::webhook::secrets_in(&text) {
                        match SigningKey::parse(secret) {
                            Ok(key) => keys.push(key),
                            Err(reason) => errors.push(SecretError::Line { path: path.clone(), line, reason }),
                        }
                    }
                    if keys.len() + errors.len() == before {
                        errors.push(SecretError::Empty { path: path.clone() });
                    }
                }
                Err(error) => errors.push(SecretError::Unreadable { path: path.clone(), error }),
            }
        }
        (keys, errors)
    }

    /// How many signatures each call carries: one a secret, counting those that cannot be
    /// read here (an unset variable is set where it runs), and the `webhook-signature` header
    /// they make, in bytes.
    fn signature_header(&self) -> (usize, usize) {
        let (keys, errors) = self.read();
        let unread = errors
            .iter()
            .filter(|e| matches!(e, SecretError::Unset { .. } | SecretError::Env { .. } | SecretError::Line { .. }));
        let signatures = keys.len() + unread.count();
        // `v1,` and the base64 of a 32-byte HMAC-SHA256 (44 characters) each, space-separated.
        (signatures, (signatures * 48).saturating_sub(1))
    }
}

/// A signing secret that cannot be used; no message quotes the secret itself.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("environment variable {var} is not set")]
    Unset { var: String },
    #[error("environment variable {var}: {reason} (a Standard Webhooks secret is whsec_ followed by base64)")]
    Env { var: String, reason: SigningError },
    #[error("cannot read secrets file {}: {error}", .path.display())]
    Unreadable { path: PathBuf, error: ReadError },
    #[error("secrets file {}, line {line}: {reason} (a Standard Webhooks secret is whsec_ followed by base64)", .path.display())]
    Line { path: PathBuf, line: usize, reason: SigningError },
    #[error("secrets file {} holds no secret (one a line: whsec_ followed by base64)", .path.display())]
    Empty { path: PathBuf },
}

impl SecretError {
    /// The key of `signing` the problem is about.
    pub fn field(&self) -> &'static str {
        match self {
            SecretError::Unset { .. } | SecretError::Env { .. } => "secret_env",
            SecretError::Unreadable { .. } | SecretError::Line { .. } | SecretError::Empty { .. } => "secret_file",
        }
    }
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
    /// `on_exit` rules; no code is also in `permanent_exit_codes`.
    pub on_exit: Arc<Rules>,
}

/// What a command reads on standard input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StdinMode {
    Envelope,
    Payload,
    None,
}

/// Bounded retries with backoff. With a schedule, `initial` is its first delay, `max` its
/// longest (the cap on `Retry-After`) and `jitter` none: the delays are the listed ones.
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backoff {
    Exponential,
    Fixed,
    /// Attempt n + 1 waits the n-th delay; past the end of the list, the last one again.
    /// Never empty.
    Schedule(Vec<Duration>),
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
        match &self.backoff {
            Backoff::Fixed => self.initial.min(self.max),
            Backoff::Schedule(delays) => {
                let i = usize::try_from(retries).unwrap_or(usize::MAX).min(delays.len().saturating_sub(1));
                delays.get(i).copied().unwrap_or(self.max)
            }
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

impl Queue {
    /// Every template of the queue, named as render errors name them (`url`, `header X`,
    /// `args[0]`, ...).
    pub fn templates(&self) -> Vec<(String, &Template)> {
        let mut out = Vec::new();
        match &self.handler {
            Handler::Webhook(w) => {
                out.push(("url".to_string(), &w.url));
                out.extend(w.headers.iter().map(|(name, t)| (format!("header {name}"), t)));
                out.extend(w.body.iter().map(|t| ("body".to_string(), t)));
            }
            Handler::Command(c) => {
                out.extend(c.args.iter().enumerate().map(|(i, t)| (format!("args[{i}]"), t)));
                out.extend(c.env.iter().map(|(name, t)| (format!("env {name}"), t)));
            }
        }
        out.extend(self.idempotency.as_ref().and_then(|i| i.key.as_ref()).map(|t| ("idempotency key".to_string(), t)));
        out.extend(self.order_by.as_ref().map(|o| ("order_by".to_string(), &o.key)));
        out
    }

    /// Reads the webhook's signing secrets, when it has any, once for the run: one that
    /// cannot sign would dead-letter every message. (Unset variables are
    /// [`Config::missing_env`]'s to report.)
    fn load_signing_keys(&mut self) -> Vec<StartError> {
        let Handler::Webhook(Webhook { signing: Some(signing), .. }) = &mut self.handler else { return Vec::new() };
        match signing.load() {
            Ok(keys) => {
                signing.keys = Some(keys.into());
                Vec::new()
            }
            Err(errors) => {
                errors.into_iter().map(|error| StartError::SigningSecret { queue: self.name.clone(), error }).collect()
            }
        }
    }

    /// The signing keys read for the run: a reload that reads other keys changes the queue.
    pub fn signing_keys(&self) -> Option<&[SigningKey]> {
        match &self.handler {
            Handler::Webhook(Webhook { signing: Some(signing), .. }) => signing.keys.as_deref(),
            _ => None,
        }
    }

    /// The files `auth` and `tls` read can be read: a client secret file (unset variables are
    /// [`Config::missing_env`]'s to report), and every `tls:` file, whose client is made here
    /// when one was missing at load.
    fn check_outbound_auth(&mut self) -> Vec<StartError> {
        let Handler::Webhook(w) = &mut self.handler else { return Vec::new() };
        let mut errors = Vec::new();
        if let Some(oauth2) = &w.oauth2
            && let SecretSource::File(_) = &oauth2.secret
            && let Err(reason) = oauth2.secret.check()
        {
            errors.push(StartError::ClientSecret { queue: self.name.clone(), reason });
        }
        if let Some(tls) = w.tls.as_mut().filter(|t| t.client.is_none()) {
            match compile::tls_client(tls) {
                Ok((client, _)) => tls.client = Some(client),
                Err(problem) => errors.push(StartError::Tls { queue: self.name.clone(), problem }),
            }
        }
        errors
    }

    /// Puts the environment's values into the scheme and host of the webhook URL
    /// (`{{env.HOOK_BASE}}/x`), once, so that no message renders them; a URL left without an
    /// expression is parsed here too, like a literal one at load.
    pub fn resolve_webhook_url(&mut self) -> Result<(), StartError> {
        self.resolve_webhook_url_in(|name| std::env::var(name).ok())
    }

    fn resolve_webhook_url_in(&mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<(), StartError> {
        let Handler::Webhook(w) = &mut self.handler else { return Ok(()) };
        let problem = |reason: String| StartError::WebhookUrl {
            queue: self.name.clone(),
            // The log and the console show it: no credential the file or `${VAR}` put there.
            url: crate::secret::mask_url(w.url.source()),
            reason,
        };
        let resolved = match url::resolve(w.url.source(), lookup) {
            Ok(Some(resolved)) => resolved,
            Ok(None) => return Ok(()),
            Err(e) => return Err(problem(e.to_string())),
        };
        let template = Template::compile(&resolved, crate::handler::template::Escape::Url)
            .map_err(|e| problem(format!("after substituting the environment: {e}")))?;
        let fixed_url = match template.literal() {
            Some(text) => Some(reqwest::Url::parse(text).map_err(|e| problem(format!("not a valid URL: {e}")))?),
            None => None,
        };
        w.url = template;
        w.fixed_url = fixed_url;
        Ok(())
    }
}

/// An environment variable the pipeline reads that is not set, and every place reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingEnv {
    pub name: String,
    /// `queue orders.charge, header Authorization`, one per place.
    pub places: Vec<String>,
    /// Set, but not UTF-8: no template can use it either.
    pub not_unicode: bool,
}

impl std::fmt::Display for MissingEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let unicode = if self.not_unicode { "; set, but not UTF-8" } else { "" };
        write!(f, "{} ({}{unicode})", self.name, self.places.join("; "))
    }
}

/// Why `run` refuses to start with this config in this environment.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("environment variables not set: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))]
    MissingEnv(Vec<MissingEnv>),
    #[error("queue \"{queue}\": webhook URL \"{url}\": {reason}")]
    WebhookUrl { queue: String, url: String, reason: String },
    /// Not a secret a webhook can be signed with; the secret itself is never quoted.
    #[error("queue \"{queue}\": signing secret: {error}")]
    SigningSecret { queue: String, error: SecretError },
    /// The OAuth 2.0 client secret file cannot be read; its content is never quoted.
    #[error("queue \"{queue}\": OAuth2 client secret: {reason}")]
    ClientSecret { queue: String, reason: String },
    /// The `tls:` files cannot be read or make no client.
    #[error("queue \"{queue}\": tls: {problem}")]
    Tls { queue: String, problem: compile::TlsProblem },
}

impl Config {
    /// Queue `name`, to change before the config is shared (once its worker runs, the worker
    /// holds the queue and it changes no more).
    pub fn queue_mut(&mut self, name: &str) -> Option<&mut Queue> {
        self.queues.get_mut(name).and_then(Arc::get_mut)
    }

    /// Every queue, as [`queue_mut`](Config::queue_mut) gives one.
    pub fn queues_mut(&mut self) -> impl Iterator<Item = &mut Queue> {
        self.queues.values_mut().filter_map(Arc::get_mut)
    }

    /// The environment variables that templates (`{{env.X}}`) and signing secrets read but
    /// that are not set here, by name. `validate` only warns about them (CI has no secrets);
    /// `run` refuses to start, rather than dead-letter every message.
    pub fn missing_env(&self) -> Vec<MissingEnv> {
        self.missing_env_in(|name| std::env::var(name))
    }

    fn missing_env_in(&self, lookup: impl Fn(&str) -> Result<String, std::env::VarError>) -> Vec<MissingEnv> {
        let mut missing: BTreeMap<String, MissingEnv> = BTreeMap::new();
        let mut note = |name: &str, place: String| {
            let not_unicode = match lookup(name) {
                Ok(_) => return,
                Err(std::env::VarError::NotPresent) => false,
                Err(std::env::VarError::NotUnicode(_)) => true,
            };
            let entry = missing.entry(name.to_string()).or_insert_with(|| MissingEnv {
                name: name.to_string(),
                places: Vec::new(),
                not_unicode,
            });
            entry.places.push(place);
        };
        for queue in self.queues.values() {
            for (field, template) in queue.templates() {
                for name in template.env_vars() {
                    note(name, format!("queue {}, {field}", queue.name));
                }
            }
            if let Handler::Webhook(w) = &queue.handler {
                for name in w.signing.iter().flat_map(|signing| &signing.secret_env) {
                    note(name, format!("queue {}, signing secret", queue.name));
                }
                if let Some(SecretSource::Env(name)) = w.oauth2.as_ref().map(|o| &o.secret) {
                    note(name, format!("queue {}, OAuth2 client secret", queue.name));
                }
            }
        }
        missing.into_values().collect()
    }

    /// Readies the config for `run` in this environment: every variable it reads is set,
    /// signing secrets are read (once: a reload reads them again) and can sign, and webhook URLs whose scheme
    /// and host come from the environment are resolved and checked.
    pub fn prepare_run(&mut self) -> Result<(), Vec<StartError>> {
        let missing = self.missing_env();
        if !missing.is_empty() {
            return Err(vec![StartError::MissingEnv(missing)]);
        }
        let errors: Vec<StartError> = self
            .queues_mut()
            .flat_map(|queue| {
                let mut errors = queue.load_signing_keys();
                errors.extend(queue.check_outbound_auth());
                errors.extend(queue.resolve_webhook_url().err());
                errors
            })
            .collect();
        if errors.is_empty() { Ok(()) } else { Err(errors) }
    }
}

/// What loading the pipeline files found: a config when there were no errors, and every problem.
#[derive(Debug)]
pub struct Validation {
    pub config: Option<Config>,
    pub diagnostics: Vec<Diagnostic>,
    /// The text of every file that could be read, by path, for the snippets of diagnostics.
    pub sources: BTreeMap<PathBuf, String>,
    /// Warnings that hold only when the broker is a cluster (a classic queue lives on one node).
    pub cluster: Vec<Diagnostic>,
    /// The `${VAR}`s unset here that left a string as written (with [`Unset::Warning`]).
    pub unset: Vec<UnsetVar>,
}

/// An environment variable unset here, without a default, and the string reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsetVar {
    pub file: PathBuf,
    /// The string's JSON pointer in the file, as the diagnostics name it.
    pub pointer: String,
    pub name: String,
}

impl Validation {
    /// Every diagnostic in `format`, with snippets from the files as they were loaded.
    pub fn render(&self, format: Format) -> String {
        diagnostic::render(&self.diagnostics, format, &|path| self.sources.get(path).cloned())
    }

    /// The diagnostics for a broker of `nodes` addresses: more than one is a cluster, and
    /// brings the cluster's warnings in.
    pub fn on_nodes(mut self, nodes: usize) -> Validation {
        if nodes > 1 {
            self.diagnostics.append(&mut self.cluster);
            self.diagnostics.sort_by(|a, b| (&a.file, a.line, a.column).cmp(&(&b.file, b.line, b.column)));
        }
        self
    }

    /// Adds an error for each setting the chosen broker cannot honour (issue 32: checked by
    /// `validate --broker` and `run` before anything is declared), at the setting's place in
    /// its file: the `file` given, else the file whose text holds `pointer`. The config is
    /// then none, as with any error.
    pub fn refuse(&mut self, refusals: impl IntoIterator<Item = (Option<PathBuf>, String, String)>) {
        let mut parsed: BTreeMap<PathBuf, Option<source::SourceFile>> = BTreeMap::new();
        let mut added = false;
        for (file, pointer, message) in refusals {
            // A queue's file is known; an exchange is in the one file that defines it.
            let candidates: Vec<PathBuf> = file.map_or_else(|| self.sources.keys().cloned().collect(), |f| vec![f]);
            let found = candidates.into_iter().find_map(|path| {
                let text = self.sources.get(&path)?;
                let entry = parsed.entry(path.clone()).or_insert_with(|| source::parse(&path, text.clone()).ok());
                let file = entry.as_ref().filter(|f| f.value.pointer(&pointer).is_some())?;
                Some(file.diag(Severity::Error, &pointer, &message))
            });
            // Not found in any file read (none are, for a config built in a test): placeless.
            let diagnostic = found.unwrap_or_else(|| Diagnostic {
                file: PathBuf::new(),
                line: 1,
                column: 1,
                severity: Severity::Error,
                pointer,
                message,
            });
            self.diagnostics.push(diagnostic);
            added = true;
        }
        if added {
            self.config = None;
            self.diagnostics.sort_by(|a, b| (&a.file, a.line, a.column).cmp(&(&b.file, b.line, b.column)));
        }
    }

    /// Whether any diagnostic is an error.
    pub fn has_errors(&self) -> bool {
        self.diagnostics.iter().any(|d| d.severity == Severity::Error)
    }
}

/// Loads, merges and validates the pipeline files under `paths`, with `${VAR}` taken from the
/// environment (an unset one without a default is an error).
pub fn load(paths: &[PathBuf]) -> Validation {
    load_with(paths, Unset::Error)
}

/// [`load`], with unset variables without a default as `unset` says: `validate` warns of them,
/// and its config is then not fit to run (the strings that read them are left as written).
pub fn load_with(paths: &[PathBuf], unset: Unset) -> Validation {
    compile::load(paths, &interpolate::Env::process(unset), &Progress::default())
}

/// [`load`], counting in `progress` how far it has got, for a reload that says so when it takes
/// long (it reads `progress` from another thread).
pub fn load_counting(paths: &[PathBuf], progress: &Progress) -> Validation {
    compile::load(paths, &interpolate::Env::process(Unset::Error), progress)
}

/// How far a load has got: files read (parsed and checked against the schema) and queues
/// compiled, each of how many.
#[derive(Debug, Default)]
pub struct Progress {
    files: AtomicUsize,
    files_read: AtomicUsize,
    queues: AtomicUsize,
    queues_compiled: AtomicUsize,
}

impl Progress {
    fn files(&self, total: usize) {
        self.files.store(total, Ordering::Relaxed);
    }

    fn file_read(&self) {
        self.files_read.fetch_add(1, Ordering::Relaxed);
    }

    fn queues(&self, total: usize) {
        self.queues.store(total, Ordering::Relaxed);
    }

    fn queue_compiled(&self) {
        self.queues_compiled.fetch_add(1, Ordering::Relaxed);
    }
}

impl std::fmt::Display for Progress {
    /// `2 of 3 files read`, then `3 of 3 files read, 5 of 12 queues compiled`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [files, read, queues, compiled] =
            [&self.files, &self.files_read, &self.queues, &self.queues_compiled].map(|n| n.load(Ordering::Relaxed));
        write!(f, "{read} of {files} files read")?;
        if read == files {
            write!(f, ", {compiled} of {queues} queues compiled")?;
        }
        Ok(())
    }
}

/// The default `max_message_bytes`.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Parses a size such as `512KiB`, `16MiB`, `1GB` or a plain number of bytes.
pub fn parse_size(text: &str) -> Option<u64> {
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (n, unit) = text.split_at(split);
    let n: u64 = n.parse().ok()?;
    let scale: u64 = match unit {
        "" | "B" => 1,
        "KB" => 1000,
        "MB" => 1000 * 1000,
        "GB" => 1000 * 1000 * 1000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 24: `run` refuses to start while a client secret file or a `tls:` file cannot be
    /// read (validate only warned), naming the queue and the file, never the secret; a file
    /// that appears by then is used.
    #[test]
    fn run_refuses_to_start_without_the_files_auth_and_tls_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let yaml = "version: 1\nqueues:\n  work:\n    handler:\n      webhook:\n        url: https://h.example/x\n        \
                    tls: {ca_file: ca.pem}\n        \
                    auth: {oauth2: {token_url: https://idp.example/t, client_id: c, client_secret_file: secret}}\n";
        std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
        let load = || {
            let validation = load(&[dir.path().to_path_buf()]);
            validation.config.unwrap_or_else(|| panic!("{:?}", validation.diagnostics))
        };
        let errors: Vec<String> =
            load().prepare_run().expect_err("files missing").iter().map(ToString::to_string).collect();
        let (secret, ca) = (dir.path().join("secret"), dir.path().join("ca.pem"));
        assert_eq!(
            errors,
            [
                format!(
                    "queue \"work\": OAuth2 client secret: cannot read secret file {}: No such file or directory (os error 2)",
                    secret.display()
                ),
                format!(
                    "queue \"work\": tls: cannot read ca_file {}: No such file or directory (os error 2)",
                    ca.display()
                ),
            ]
        );

        // Loaded while missing, there by the start: the client is made then.
        let mut config = load();
        std::fs::write(&secret, "s3cret\n").expect("write");
        std::fs::copy("tests/fixtures/valid/billing/certs/ca.pem", &ca).expect("copy");
        config.prepare_run().expect("files there now");
        let Handler::Webhook(w) = &config.queues["work"].handler else { panic!("a webhook") };
        assert!(w.tls.as_ref().is_some_and(|t| t.client.is_some()));
    }

    /// Issue 24: an unset client secret variable is reported with the template variables.
    #[test]
    fn an_unset_client_secret_variable_is_missing_env() {
        let dir = tempfile::tempdir().expect("tempdir");
        let yaml = "version: 1\nqueues:\n  work:\n    handler:\n      webhook:\n        url: https://h.example/x\n        \
                    auth: {oauth2: {token_url: https://idp.example/t, client_id: c, client_secret_env: IDP_SECRET}}\n";
        std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
        let validation = load(&[dir.path().to_path_buf()]);
        let config = validation.config.unwrap_or_else(|| panic!("{:?}", validation.diagnostics));
        let missing = config.missing_env_in(|_| Err(std::env::VarError::NotPresent));
        assert_eq!(
            missing,
            [MissingEnv {
                name: "IDP_SECRET".into(),
                places: vec!["queue work, OAuth2 client secret".into()],
                not_unicode: false
            }]
        );
    }

    /// Issue 31: the `webhook-signature` length `validate` warns of is what signing sends.
    #[test]
    fn the_signature_header_length_is_what_signing_sends() {
        use base64::Engine as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("secrets");
        for n in [1, 2, 171] {
            let engine = base64::engine::general_purpose::STANDARD;
            let secrets: String = (0..n).map(|i| format!("whsec_{}\n", engine.encode(format!("key {i}")))).collect();
            std::fs::write(&path, secrets).expect("write");
            let signing = Signing { secret_env: Vec::new(), secret_file: Some(path.clone()), keys: None };
            let keys = signing.load().expect("valid secrets");
            let [_, _, (_, sent)] = crate::handler::webhook::signature_headers(&keys, "msg_1", 1_614_265_330, b"{}");
            assert_eq!(signing.signature_header(), (n, sent.len()), "{n} secrets");
        }
    }

    #[test]
    fn sizes() {
        let cases = [
            ("1", Some(1)),
            ("512KiB", Some(512 << 10)),
            ("16MiB", Some(16 << 20)),
            ("2MB", Some(2_000_000)),
            ("1GiB", Some(1 << 30)),
            ("7B", Some(7)),
            ("99999999999GiB", None),
            ("1TiB", None),
            ("MiB", None),
            ("", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_size(text), want, "{text}");
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
    fn a_schedule_waits_its_delays_then_repeats_the_last() {
        let secs = Duration::from_secs;
        let p = RetryPolicy {
            max_attempts: NonZeroU32::new(6).unwrap(),
            backoff: Backoff::Schedule(vec![secs(5), secs(1), secs(30)]),
            initial: secs(5),
            max: secs(30),
            jitter: Jitter::None,
            ..Default::default()
        };
        let ceilings: Vec<u64> = (2..=6).map(|n| p.ceiling(n).as_secs()).collect();
        assert_eq!(ceilings, [5, 1, 30, 30, 30]);
        assert_eq!(p.ceiling(u32::MAX), secs(30));
        assert_eq!(p.window(secs(10)), secs(5 + 1 + 30 + 30 + 30 + 60));
    }

    /// A config from one pipeline file.
    fn config(yaml: &str) -> Config {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
        let validation = load(&[dir.path().to_path_buf()]);
        validation.config.unwrap_or_else(|| panic!("invalid: {:?}", validation.diagnostics))
    }

    // Issue 9: an unset variable let `run` start and dead-letter every message.
    #[test]
    fn missing_env_names_every_variable_and_where_it_is_read() {
        let config = config(
            r#"version: 1
queues:
  a:
    handler:
      webhook:
        url: "https://h.example/{{env.PATH_PART}}"
        headers: {Authorization: "Bearer {{env.TOKEN}}"}
        body: "{{env.SET}}"
        signing: {secret_env: SECRET}
  b:
    handler:
      command: {program: /bin/true, args: ["{{env.TOKEN}}"], env: {X: "{{env.SET}}"}}
    idempotency: {key: "{{env.KEY}}"}
"#,
        );
        let lookup = |name: &str| match name {
            "SET" => Ok("x".to_string()),
            "KEY" => Err(std::env::VarError::NotUnicode("\u{fffd}".into())),
            _ => Err(std::env::VarError::NotPresent),
        };
        let missing = config.missing_env_in(lookup);
        let got: Vec<String> = missing.iter().map(ToString::to_string).collect();
        assert_eq!(
            got,
            [
                "KEY (queue b, idempotency key; set, but not UTF-8)",
                "PATH_PART (queue a, url)",
                "SECRET (queue a, signing secret)",
                "TOKEN (queue a, header Authorization; queue b, args[0])",
            ]
        );
        let error = StartError::MissingEnv(missing[1..3].to_vec()).to_string();
        assert_eq!(error, "environment variables not set: PATH_PART (queue a, url), SECRET (queue a, signing secret)");
        assert!(config.missing_env_in(|_| Ok(String::new())).is_empty());
    }

    #[test]
    fn webhook_hosts_from_the_environment_resolve_once() {
        let mut config = config(
            r#"version: 1
queues:
  fixed: {handler: {webhook: {url: "{{env.BASE}}/x?k={{env.KEY}}"}}}
  templated: {handler: {webhook: {url: "https://{{env.HOST}}/x/{{payload.id}}"}}}
  literal: {handler: {webhook: {url: "https://h.example/x"}}}
  ftp: {handler: {webhook: {url: "{{env.FTP}}/x?api_key=k1"}}}
"#,
        );
        let lookup = |name: &str| {
            Some(match name {
                "BASE" => "http://127.0.0.1:8080".to_string(),
                "HOST" => "h.example".to_string(),
                "FTP" => "ftp://h.example".to_string(),
                _ => return None,
            })
        };
        let mut results = BTreeMap::new();
        for queue in config.queues_mut() {
            results.insert(queue.name.clone(), queue.resolve_webhook_url_in(lookup).map_err(|e| e.to_string()));
        }
        assert_eq!(results["fixed"], Ok(()));
        assert_eq!(results["templated"], Ok(()));
        assert_eq!(results["literal"], Ok(()));
        assert_eq!(
            results["ftp"],
            // Issue 31 item 1: the URL's credentials are masked (the log and the console show it).
            Err("queue \"ftp\": webhook URL \"{{env.FTP}}/x?api_key=***\": with FTP as set, the scheme and host are not usable: webhook URLs are http or https, not \"ftp\"".to_string())
        );
        let webhook = |name: &str| match &config.queues[name].handler {
            Handler::Webhook(w) => (w.url.source().to_string(), w.fixed_url.as_ref().map(ToString::to_string)),
            Handler::Command(_) => panic!("a webhook"),
        };
        // The path's variable stays a template: only the scheme and host are resolved here.
        assert_eq!(webhook("fixed"), ("http://127.0.0.1:8080/x?k={{env.KEY}}".to_string(), None));
        assert_eq!(webhook("templated"), ("https://h.example/x/{{payload.id}}".to_string(), None));
        assert_eq!(webhook("literal"), ("https://h.example/x".to_string(), Some("https://h.example/x".to_string())));
    }

    #[test]
    fn an_env_host_with_a_literal_rest_becomes_a_fixed_url() {
        let mut config = config("version: 1\nqueues:\n  q: {handler: {webhook: {url: \"{{env.BASE}}/hook\"}}}\n");
        let queue = config.queue_mut("q").expect("queue q");
        queue.resolve_webhook_url_in(|_| Some("http://127.0.0.1:8080".to_string())).expect("resolves");
        let Handler::Webhook(w) = &queue.handler else { panic!("a webhook") };
        assert_eq!(w.fixed_url.as_ref().map(ToString::to_string).as_deref(), Some("http://127.0.0.1:8080/hook"));
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
