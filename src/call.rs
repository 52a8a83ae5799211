//! From a message to a ready call: renders the handler's templates against the message (its
//! fields in its queue's format, [`crate::format`]), adds the headers (or env vars) every
//! handler receives, and signs webhooks. A command's
//! environment is built whole here, from an allowlist of the runner's variables and what the
//! pipeline names. `sluice render` prints what this produces; the runtime has it run by the
//! [`Execute`] it is given ([`Handlers`] in a runner).
//!
//! It stands between the config and [`crate::handler`]: it reads the queue's config and
//! hands the handlers a ready request, so the handlers never read the config themselves.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use handlebars::Context;
use serde_json::{Map, Value, json};

use crate::config::{Handler, Queue, StdinMode};
use crate::envelope::Malformed;
use crate::format;
use crate::handler::auth::OAuth2;
use crate::handler::command::{self, Invocation, Stdin};
use crate::handler::rules::Rules;
use crate::handler::template::Template;
use crate::handler::webhook::{self, Request};
use crate::handler::{HandlerError, Observed};
use crate::topology::OrderKey;

/// One message as a handler sees it.
pub struct Message<'a> {
    pub message: &'a format::Message<'a>,
    /// The body as received: the default webhook body (shared, not copied) and command stdin.
    pub body: &'a Bytes,
    pub attempt: u32,
    pub queue: &'a str,
    pub idempotency_key: &'a str,
    pub traceparent: Option<&'a str>,
}

/// A rendered handler call, ready to run.
#[derive(Debug)]
pub enum Call {
    /// `on_status`: the queue's rules for the response's status; `oauth2`: the queue's token
    /// cache; `client`: the queue's own HTTP client (its `tls:`), else the shared one.
    Webhook {
        request: Request,
        timeout: Duration,
        on_status: Arc<Rules>,
        oauth2: Option<Arc<OAuth2>>,
        client: Option<reqwest::Client>,
    },
    Command(Invocation),
}

/// Why a call could not be prepared: the message cannot be handled as configured.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("template {field}: {reason}")]
    Render { field: String, reason: String },
    #[error("signing secret: {0}")]
    Signing(String),
    #[error("payload: {0}")]
    Payload(#[from] Malformed),
}

/// The template context of a message: its fields ([`format::Message::fields`]), attempt,
/// queue, and the environment variables the templates name (as `***` when `redact`, for
/// printing).
fn context(
    message: &format::Message<'_>,
    attempt: u32,
    queue: &str,
    templates: &[&Template],
    redact: bool,
) -> Result<Context, Malformed> {
    let mut env = Map::new();
    for t in templates {
        for name in t.env_vars() {
            if let Ok(value) = std::env::var(name) {
                let value = if redact { "***".to_string() } else { value };
                env.insert(name.clone(), Value::String(value));
            }
        }
    }
    let reads_headers = templates.iter().any(|t| t.roots().iter().any(|(root, _)| root == "headers"));
    let mut fields = message.fields(reads_headers)?;
    fields.insert("attempt".into(), json!(attempt));
    fields.insert("queue".into(), json!(queue));
    fields.insert("env".into(), Value::Object(env));
    Ok(Context::from(Value::Object(fields)))
}

fn render(template: &Template, field: &str, ctx: &Context) -> Result<String, PrepareError> {
    template.render(ctx).map_err(|e| PrepareError::Render { field: field.to_string(), reason: render_reason(&e) })
}

/// The render error without handlebars' internal template names.
fn render_reason(e: &handlebars::RenderError) -> String {
    match e.reason() {
        handlebars::RenderErrorReason::MissingVariable(Some(path)) => {
            format!("the message has no {path} (the template reads {{{{{path}}}}})")
        }
        reason => reason.to_string(),
    }
}

/// Every template of a handler, for building its context.
fn templates(handler: &Handler) -> Vec<&Template> {
    match handler {
        Handler::Webhook(w) => {
            std::iter::once(&w.url).chain(w.headers.iter().map(|(_, t)| t)).chain(w.body.as_ref()).collect()
        }
        Handler::Command(c) => c.args.iter().chain(c.env.iter().map(|(_, t)| t)).collect(),
    }
}

/// The runner's variables every command gets when they are set: where programs are and how
/// to format text, nothing that usually holds a secret. Plus every `LC_*`.
const INHERITED_ENV: &[&str] = &["PATH", "HOME", "LANG", "TZ", "TMPDIR"];

/// Sets `name` in an environment being built, replacing an earlier value.
fn set_env(env: &mut Vec<(String, String)>, name: &str, value: String) {
    env.retain(|(n, _)| n != name);
    env.push((name.to_string(), value));
}

/// The allowlisted variables of the runner's environment, by name. A value that is not UTF-8
/// is left out, as the invocation carries text.
fn inherited_env() -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
        .filter(|(name, _)| INHERITED_ENV.contains(&name.as_str()) || name.starts_with("LC_"))
        .collect();
    env.sort();
    env
}

/// Renders the call a message makes; with `redact`, passed-through variables read `***`.
fn prepare(handler: &Handler, message: &Message<'_>, ctx: &Context, redact: bool) -> Result<Call, PrepareError> {
    let attempt = message.attempt.to_string();
    match handler {
        Handler::Webhook(w) => {
            let url = match &w.fixed_url {
                Some(url) => url.clone(),
                None => {
                    let text = render(&w.url, "url", ctx)?;
                    reqwest::Url::parse(&text).map_err(|e| PrepareError::Render {
                        field: "url".into(),
                        reason: format!("\"{text}\" is not a valid URL: {e}"),
                    })?
                }
            };
            // The default body is the message's as received, with its content type (and a
            // binary-mode CloudEvent's attributes); a rendered one is JSON.
            let (body, content_type, forwarded) = match &w.body {
                Some(t) => (Bytes::from(render(t, "body", ctx)?), "application/json".to_string(), Vec::new()),
                None => {
                    let (content_type, forwarded) = message.message.forwarded();
                    (message.body.clone(), content_type, forwarded)
                }
            };
            let mut headers = vec![
                ("content-type".to_string(), content_type),
                ("idempotency-key".to_string(), message.idempotency_key.to_string()),
                ("x-sluice-message-id".to_string(), message.message.envelope.id.clone()),
                ("x-sluice-attempt".to_string(), attempt),
            ];
            headers.extend(forwarded);
            if let Some(tp) = message.traceparent {
                headers.push(("traceparent".to_string(), tp.to_string()));
            }
            for (name, t) in &w.headers {
                let value = render(t, &format!("header {name}"), ctx)?;
                if value.contains(['\r', '\n']) {
                    return Err(PrepareError::Render {
                        field: format!("header {name}"),
                        reason: "the value contains a line break".into(),
                    });
                }
                headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
                headers.push((name.clone(), value));
            }
            if let Some(signing) = &w.signing {
                // Read once for `run`; `test` and `render` read them here.
                let loaded;
                let keys = match &signing.keys {
                    Some(keys) => keys,
                    None => {
                        loaded = signing.load().map_err(|errors| {
                            PrepareError::Signing(errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))
                        })?;
                        &loaded[..]
                    }
                };
                let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default();
                let signed = webhook::signature_headers(keys, &message.message.envelope.id, now as i64, &body);
                headers.extend(signed.into_iter().map(|(k, v)| (k.to_string(), v)));
            }
            let method = reqwest::Method::from_bytes(w.method.as_bytes()).unwrap_or(reqwest::Method::POST);
            Ok(Call::Webhook {
                request: Request { method, url, headers, body },
                timeout: w.timeout,
                on_status: w.on_status.clone(),
                oauth2: w.oauth2.clone(),
                client: w.tls.as_ref().and_then(|t| t.client.clone()),
            })
        }
        Handler::Command(c) => {
            let args = c
                .args
                .iter()
                .enumerate()
                .map(|(i, t)| render(t, &format!("args[{i}]"), ctx))
                .collect::<Result<_, _>>()?;
            // The whole environment, in layers, later ones winning: the allowlist, `pass_env`
            // (a variable the runner lacks is left out), sluice's own, then `env:`.
            let mut env = inherited_env();
            for name in &c.pass_env {
                if let Ok(value) = std::env::var(name) {
                    set_env(&mut env, name, if redact { "***".to_string() } else { value });
                }
            }
            set_env(&mut env, "SLUICE_IDEMPOTENCY_KEY", message.idempotency_key.to_string());
            set_env(&mut env, "SLUICE_MESSAGE_ID", message.message.envelope.id.clone());
            set_env(&mut env, "SLUICE_ATTEMPT", attempt);
            if let Some(tp) = message.traceparent {
                set_env(&mut env, "TRACEPARENT", tp.to_string());
            }
            for (name, t) in &c.env {
                set_env(&mut env, name, render(t, &format!("env {name}"), ctx)?);
            }
            let stdin = match c.stdin {
                StdinMode::Envelope => Stdin::Bytes(message.body.clone()),
                StdinMode::Payload => Stdin::Bytes(within(message.body, message.message.payload_bytes())),
                StdinMode::None => Stdin::Null,
            };
            Ok(Call::Command(Invocation {
                program: c.program.clone(),
                args,
                env,
                stdin,
                timeout: c.timeout,
                permanent_exit_codes: c.permanent_exit_codes.clone(),
                on_exit: c.on_exit.clone(),
            }))
        }
    }
}

/// Renders what a delivery on a queue needs at one attempt: its idempotency key, then its
/// handler call. With `redact`, environment values render as `***` (for `sluice render`).
pub struct Renderer<'a> {
    queue: &'a Queue,
    message: &'a format::Message<'a>,
    attempt: u32,
    ctx: Context,
    redact: bool,
}

/// The ordering key of a message of an `order_by` queue (`None` for another queue), as its
/// template renders it over the message, at attempt 1 (a key never depends on the attempt).
pub fn order_key(queue: &Queue, message: &format::Message<'_>) -> Result<Option<String>, PrepareError> {
    let Some(order_by) = &queue.order_by else { return Ok(None) };
    let ctx = match order_by.key.literal() {
        Some(_) => Context::null(),
        None => context(message, 1, &queue.name, &[&order_by.key], false)?,
    };
    render(&order_by.key, "order_by", &ctx).map(Some)
}

/// The ordering key a queue's `order_by` template (`key`) renders over a message sent to it,
/// read in the queue's format (`message`): what a broker that keeps order per key itself (SQS
/// FIFO message groups) groups the message by, as it is sent. `None` when it does not render
/// (no such field): the runner dead-letters that message.
pub fn order_key_of(key: &OrderKey, queue: &str, message: &format::Message<'_>) -> Option<String> {
    let template = Template::compile(&key.template, crate::handler::template::Escape::Plain).ok()?;
    let ctx = match template.literal() {
        Some(_) => Context::null(),
        None => context(message, 1, queue, &[&template], false).ok()?,
    };
    render(&template, "order_by", &ctx).ok()
}

impl<'a> Renderer<'a> {
    /// Fails only for a payload that does not parse, which a decoded envelope's always does.
    pub fn new(
        queue: &'a Queue,
        message: &'a format::Message<'a>,
        attempt: u32,
        redact: bool,
    ) -> Result<Renderer<'a>, PrepareError> {
        let mut used = templates(&queue.handler);
        used.extend(queue.idempotency.as_ref().and_then(|i| i.key.as_ref()));
        // Building the context copies the payload; templates without expressions never read it.
        let ctx = if used.iter().all(|t| t.literal().is_some()) {
            Context::null()
        } else {
            context(message, attempt, &queue.name, &used, redact)?
        };
        Ok(Renderer { queue, message, attempt, ctx, redact })
    }

    /// The idempotency key as stored and sent downstream: the queue's template, else the
    /// message's own ([`Envelope::idempotency_key`](crate::envelope::Envelope::idempotency_key):
    /// a CloudEvent's is its source and id); the message id when either is blank (a key shared by every such message
    /// would run only the first); a long one by its digest ([`effective_key`]).
    pub fn key(&self) -> Result<String, PrepareError> {
        let key = match self.queue.idempotency.as_ref().and_then(|i| i.key.as_ref()) {
            Some(key) => render(key, "idempotency key", &self.ctx)?,
            None => self.message.envelope.idempotency_key().to_string(),
        };
        let key = if crate::envelope::is_blank(&key) { self.message.envelope.id.clone() } else { key };
        Ok(effective_key(key))
    }

    /// The handler's request or invocation.
    pub fn call(&self, key: &str, traceparent: Option<&str>) -> Result<Call, PrepareError> {
        let message = Message {
            message: self.message,
            body: self.message.delivery.body(),
            attempt: self.attempt,
            queue: &self.queue.name,
            idempotency_key: key,
            traceparent,
        };
        prepare(&self.queue.handler, &message, &self.ctx, self.redact)
    }
}

/// Keys longer than this are known by their digest, in the stores and downstream alike.
pub const MAX_KEY_BYTES: usize = 256;

/// The key as stored and as sent downstream (`Idempotency-Key`, `SLUICE_IDEMPOTENCY_KEY`): the
/// key itself, or for a key over [`MAX_KEY_BYTES`], `sha256:` and its SHA-256 in lowercase hex.
/// Producers choose keys, so their length is theirs too; the embedded store refuses keys of
/// 64 KiB, and receivers cap header sizes far below that.
pub fn effective_key(key: String) -> String {
    if key.len() <= MAX_KEY_BYTES {
        return key;
    }
    format::sha256_id(key.as_bytes())
}

/// `part` as a slice of `whole` when it lies inside it (a decoded payload borrows the body),
/// else a copy.
fn within(whole: &Bytes, part: &[u8]) -> Bytes {
    let start = (part.as_ptr() as usize).wrapping_sub(whole.as_ptr() as usize);
    if start <= whole.len() && part.len() <= whole.len() - start {
        whole.slice(start..start + part.len())
    } else {
        Bytes::copy_from_slice(part)
    }
}

/// What runs a prepared call: [`Handlers`] in a runner, a scripted stand-in in the runtime's
/// tests. The runtime is given one and never reaches for the handlers itself.
pub trait Execute: Send + Sync {
    /// Runs `call`; what the handler answered goes into `observed`.
    fn execute<'a>(&'a self, call: Call, observed: &'a mut Observed) -> BoxFuture<'a, Result<(), HandlerError>>;
}

/// The real handlers: webhooks over HTTP, commands as processes.
pub struct Handlers {
    /// The client of webhooks without one of their own.
    client: reqwest::Client,
}

impl Handlers {
    /// The handlers, with the shared HTTP client built.
    pub fn new() -> Result<Handlers, webhook::ClientError> {
        Ok(Handlers { client: webhook::client()? })
    }
}

impl Execute for Handlers {
    fn execute<'a>(&'a self, call: Call, observed: &'a mut Observed) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(execute(call, &self.client, observed))
    }
}

/// Runs a prepared call; `shared` is the client of webhooks without one of their own. What the
/// handler answered goes into `observed`.
pub async fn execute(call: Call, shared: &reqwest::Client, observed: &mut Observed) -> Result<(), HandlerError> {
    match call {
        Call::Webhook { request, timeout, on_status, oauth2, client } => {
            let client = client.as_ref().unwrap_or(shared);
            match oauth2 {
                Some(oauth2) => webhook::call_authorized(client, request, &oauth2, timeout, &on_status, observed).await,
                None => webhook::call(client, request, timeout, &on_status, observed).await,
            }
        }
        Call::Command(invocation) => command::run(&invocation, observed).await.map(|_| ()),
    }
}

#[cfg(test)]
mod tests {
    use sha2::{Digest as _, Sha256};

    use super::*;
    use crate::envelope::Envelope;

    /// Issue 9: a payload handed to stdin shares the delivery's bytes instead of copying them.
    #[test]
    fn a_payload_inside_the_body_is_shared_not_copied() {
        let body = Bytes::from_static(br#"{"id":"1","type":"t","payload":{"a":[1,2]}}"#);
        let envelope = Envelope::decode(&body).expect("envelope");
        let payload = within(&body, envelope.payload.get().as_bytes());
        assert_eq!(&payload[..], br#"{"a":[1,2]}"#);
        assert_eq!(payload.as_ptr(), envelope.payload.get().as_ptr());
        let elsewhere = b"{}".to_vec();
        let copied = within(&body, &elsewhere);
        assert_eq!(&copied[..], b"{}");
        assert_ne!(copied.as_ptr(), elsewhere.as_ptr());
    }

    #[test]
    fn long_keys_are_known_by_their_digest() {
        let short = "k".repeat(MAX_KEY_BYTES);
        assert_eq!(effective_key(short.clone()), short);
        // Issue 9: a 70 KB key (the embedded store panicked at 64 KiB) becomes 71 bytes.
        let long = "k".repeat(70_000);
        let digest = effective_key(long.clone());
        assert_eq!(digest.len(), 71);
        assert!(
            digest.starts_with("sha256:")
                && digest[7..].bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_eq!(effective_key(long), digest);
        assert_ne!(effective_key("k".repeat(MAX_KEY_BYTES + 1)), digest);
        assert_eq!(
            effective_key("a".repeat(MAX_KEY_BYTES + 1)),
            format!("sha256:{:x}", Sha256::digest("a".repeat(MAX_KEY_BYTES + 1)))
        );
    }
}
