//! One pass from parsed files to the validated `Config`: `${VAR}` substitution, schema, merge,
//! semantic checks, templates, referenced files. Every problem is collected; nothing stops at
//! the first.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::num::{NonZeroU16, NonZeroU32};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::arguments::Finding;
use super::diagnostic::{Diagnostic, Severity};
use super::interpolate::{Env, interpolate};
use super::source::{self, SourceFile, escape_token};
use super::{
    Backoff, Binding, CONSUMER_TIMEOUT, CircuitBreaker, Command, Config, Exchange, ExchangeKind, Handler, Idempotency,
    Jitter, MAX_RETRY_DELAY, OnDeadLetter, OrderBy, PayloadSchema, Progress, Queue, QueueKind, RateLimit, RetryPolicy,
    SecretError, Signing, StdinMode, Tls, Validation, Webhook, raw,
};
use crate::file::{ReadError, read_regular};
use crate::handler::auth::{OAuth2, SecretSource};
use crate::handler::rules::Rules;
use crate::handler::template::{Escape, Template, TemplateError};
use crate::handler::webhook::TlsPem;
use crate::vocab::format::Format;

/// The most a `tls:` file (PEM certificates or a key) may hold: a CA bundle is ~200 KiB.
pub(crate) const MAX_PEM_BYTES: u64 = 1 << 20;

/// The most a payload schema file may hold: generated schemas can be large, but a file
/// without end (a link to a device) must not be read to the end.
const MAX_SCHEMA_BYTES: u64 = 8 << 20;

/// The largest header a webhook's receiver is likely to take: many servers and proxies refuse
/// more (nginx's default buffer for one header line is 8 KiB).
const MAX_HEADER_BYTES: usize = 8 << 10;

/// The longest `message_ttl` RabbitMQ takes: 2^32 - 1 ms.
const MAX_MESSAGE_TTL: Duration = Duration::from_millis(u32::MAX as u64);

pub(super) fn load(paths: &[PathBuf], env: &Env, progress: &Progress) -> Validation {
    let discovery = source::discover(paths);
    progress.files(discovery.files.len());
    let mut diags = discovery.diagnostics;
    let mut complete = !diags.iter().any(|d| d.severity == Severity::Error);
    if discovery.files.is_empty() && complete {
        let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        diags.push(source::file_diag(
            paths.first().map(PathBuf::as_path).unwrap_or(Path::new(".")),
            format!("no pipeline files (*.yaml, *.yml) under {}", shown.join(", ")),
        ));
        complete = false;
    }
    let mut parsed = Vec::new();
    let mut sources = BTreeMap::new();
    let mut skipped = 0;
    // Nodes the schema refused, left out of the semantic checks, by file.
    let mut pruned = Nodes::default();
    // What `${VAR}` substitution said, and the strings it left as written, by file.
    let mut substitution = Vec::new();
    let mut unresolved = Nodes::default();
    let mut unset = Vec::new();
    for path in &discovery.files {
        let loaded = source::read(path).and_then(|text| {
            // Kept for the snippets of diagnostics: printing them never reads a file again.
            sources.insert(path.clone(), text.clone());
            source::parse(path, text)
        });
        match loaded {
            Ok(file) if let Some(note) = foreign(&file, &["exchanges", "queues"], "pipeline") => {
                diags.push(note);
                skipped += 1;
            }
            Ok(mut file) => {
                let interpolated = interpolate(&mut file, env);
                substitution.extend(interpolated.diagnostics);
                unresolved.extend(&file.path, interpolated.unresolved);
                unset.extend(interpolated.unset.into_iter().map(|(pointer, name)| super::UnsetVar {
                    file: file.path.clone(),
                    pointer,
                    name,
                }));
                let schema_errors = super::schema::check(&file);
                if schema_errors.is_empty() {
                    match deserialize(&file) {
                        Ok(raw) => parsed.push((file, raw)),
                        Err(d) => {
                            diags.push(d);
                            complete = false;
                        }
                    }
                } else {
                    // The rest of the file is still checked: without the nodes the schema
                    // refused, what still reads as a pipeline goes on to the semantic checks.
                    let invalid = super::schema::invalid_nodes(&file);
                    diags.extend(schema_errors);
                    match lenient(&file, &invalid) {
                        Some(raw) => {
                            pruned.extend(&file.path, invalid);
                            parsed.push((file, raw));
                        }
                        None => complete = false,
                    }
                }
            }
            Err(d) => {
                diags.push(d);
                complete = false;
            }
        }
        progress.file_read();
    }
    if skipped > 0 && skipped == discovery.files.len() && complete {
        let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        diags.push(source::file_diag(
            paths.first().map(PathBuf::as_path).unwrap_or(Path::new(".")),
            format!("no pipeline files under {}: every YAML file there is something else", shown.join(", ")),
        ));
    }
    let before = diags.len();
    let mut compiler = Compiler {
        diags: &mut diags,
        cluster: Vec::new(),
        complete,
        unresolved: &unresolved,
        progress,
        schema: None,
        format: Format::default(),
    };
    let config = compiler.compile(parsed);
    let cluster = compiler.cluster;
    // What the semantic checks say about a refused node (or a handler that lost its refused
    // part) is already said by the schema.
    let semantic = diags.split_off(before);
    diags.extend(semantic.into_iter().filter(|d| !pruned.related(&d.file, &d.pointer)));
    // A string left as written is explained by its substitution's diagnostic; what the other
    // checks make of its `${...}` would only repeat it.
    diags.retain(|d| !unresolved.explains(d));
    diags.extend(substitution);
    let mut diags = once_per_anchor(diags);
    diags.sort_by(|a, b| (&a.file, a.line, a.column).cmp(&(&b.file, b.line, b.column)));
    let has_errors = diags.iter().any(|d| d.severity == Severity::Error);
    Validation { config: (!has_errors).then_some(config), diagnostics: diags, sources, cluster, unset }
}

/// JSON pointers by file: the nodes the schema refused, or the strings substitution left as
/// written. Looked up per diagnostic, so a set, not a list: a file can have thousands of each.
#[derive(Debug, Default)]
struct Nodes(HashMap<PathBuf, BTreeSet<String>>);

impl Nodes {
    fn extend(&mut self, file: &Path, pointers: Vec<String>) {
        if !pointers.is_empty() {
            self.0.entry(file.to_path_buf()).or_default().extend(pointers);
        }
    }

    /// Whether a diagnostic at `pointer` in `file` is about one of the nodes: the node, a node
    /// inside it, or (below a queue's own keys) a node holding one, such as a handler that
    /// lost its refused part.
    fn related(&self, file: &Path, pointer: &str) -> bool {
        let Some(nodes) = self.0.get(file) else { return false };
        let mut at = pointer;
        loop {
            if nodes.contains(at) {
                return true;
            }
            let Some(parent) = at.rfind('/') else { break };
            at = &at[..parent];
        }
        let inside = format!("{pointer}/");
        pointer.matches('/').count() > 2 && nodes.range(inside.clone()..).next().is_some_and(|n| n.starts_with(&inside))
    }

    /// Whether `d` is an error about a string substitution left as written (by file and
    /// pointer), which that substitution's own diagnostic explains.
    fn explains(&self, d: &Diagnostic) -> bool {
        d.severity == Severity::Error && self.0.get(&d.file).is_some_and(|nodes| nodes.contains(&d.pointer))
    }
}

/// The raw file without the nodes at `invalid` (JSON pointers), for checking the rest of a
/// file the schema refused; `None` when even that does not read as a pipeline. A refused array
/// element takes its array along (removing it alone would shift the pointers of the others),
/// a queue that no longer reads as one is left out, and an exchange whose type was refused
/// stays defined (as topic), so that bindings to it are not reported as undefined.
fn lenient(file: &SourceFile, invalid: &[String]) -> Option<raw::File> {
    let mut value = file.value.clone();
    for pointer in invalid {
        prune(&mut value, pointer);
    }
    let declared: Vec<String> = file
        .value
        .get("exchanges")
        .and_then(serde_json::Value::as_object)
        .into_iter()
        .flatten()
        .map(|(k, _)| k.clone())
        .collect();
    if let Some(exchanges) = value.get_mut("exchanges").and_then(serde_json::Value::as_object_mut) {
        for name in declared {
            let exchange = exchanges.entry(name).or_insert_with(|| serde_json::json!({}));
            if let Some(exchange) = exchange.as_object_mut() {
                exchange.entry("type").or_insert_with(|| "topic".into());
            }
        }
    }
    if let Some(queues) = value.get_mut("queues").and_then(serde_json::Value::as_object_mut) {
        queues.retain(|_, q| deserialize_value::<raw::Queue>(file, q.clone()).is_ok());
    }
    deserialize_value(file, value).ok()
}

/// Removes the node at `pointer`; an array element takes its whole array.
fn prune(value: &mut serde_json::Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else { return };
    let key = last.replace("~1", "/").replace("~0", "~");
    match value.pointer_mut(parent) {
        Some(serde_json::Value::Object(map)) => {
            map.remove(&key);
        }
        Some(serde_json::Value::Array(_)) => prune(value, parent),
        _ => {}
    }
}

/// One diagnostic for a mistake that several places share through a YAML anchor (same file,
/// position, severity and message), naming every place.
fn once_per_anchor(diags: Vec<Diagnostic>) -> Vec<Diagnostic> {
    let mut out: Vec<(Diagnostic, Vec<String>)> = Vec::new();
    let mut seen: BTreeMap<(PathBuf, usize, usize, Severity, String), usize> = BTreeMap::new();
    for d in diags {
        let key = (d.file.clone(), d.line, d.column, d.severity, d.message.clone());
        match seen.get(&key) {
            Some(&i) if out[i].0.pointer != d.pointer && !d.pointer.is_empty() => out[i].1.push(d.pointer),
            Some(_) => {}
            None => {
                seen.insert(key, out.len());
                out.push((d, Vec::new()));
            }
        }
    }
    out.into_iter()
        .map(|(mut d, others)| {
            if !others.is_empty() {
                let places: Vec<&str> =
                    std::iter::once(d.pointer.as_str()).chain(others.iter().map(String::as_str)).collect();
                d.message = format!("{} (reported once: an anchor shared by {})", d.message, places.join(", "));
            }
            d
        })
        .collect()
}

/// A note that `file` is left alone when it is some other tool's YAML: it has no `version:`
/// and a top-level key that is neither one of `keys` nor an `x-` extension (Prometheus rules,
/// a Compose file beside the pipelines). A file with only our keys is ours, mistakes included.
pub(crate) fn foreign(file: &SourceFile, keys: &[&str], what: &str) -> Option<Diagnostic> {
    let map = file.value.as_object()?;
    if map.contains_key("version") {
        return None;
    }
    let other = map.keys().find(|k| !keys.contains(&k.as_str()) && !k.starts_with("x-"))?;
    let message = format!("not a sluice {what} file (no \"version:\", and \"{other}\" is not a {what} key); skipped");
    Some(file.diag_at(file.key_pos(&format!("/{}", escape_token(other))), Severity::Note, "", message))
}

/// The serde model of a file that passed its schema; `x-` keys are dropped.
pub(crate) fn deserialize<T: serde::de::DeserializeOwned>(file: &SourceFile) -> Result<T, Diagnostic> {
    deserialize_value(file, file.value.clone())
}

/// [`deserialize`] of `value`, a changed copy of `file`'s document.
fn deserialize_value<T: serde::de::DeserializeOwned>(
    file: &SourceFile,
    mut value: serde_json::Value,
) -> Result<T, Diagnostic> {
    if let Some(map) = value.as_object_mut() {
        map.retain(|k, _| !k.starts_with("x-"));
    }
    integral_floats_as_integers(&mut value);
    serde_json::from_value(value).map_err(|e| file.diag(Severity::Error, "", e.to_string()))
}

/// JSON Schema counts `8.0` as an integer, so the schema accepts `concurrency: 8.0`; serde would
/// then fail with no position. Make such numbers integers, as the schema already saw them.
fn integral_floats_as_integers(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Number(n) if n.is_f64() => {
            if let Some(f) = n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 2f64.powi(53)) {
                *n = (f as i64).into();
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(integral_floats_as_integers),
        serde_json::Value::Object(map) => map.values_mut().for_each(integral_floats_as_integers),
        _ => {}
    }
}

struct Compiler<'a> {
    diags: &'a mut Vec<Diagnostic>,
    /// Warnings that hold only on a cluster (see [`Validation::on_nodes`]).
    cluster: Vec<Diagnostic>,
    /// False when some file could not be read: cross-file references are then not checked.
    complete: bool,
    /// Strings `${...}` substitution left as written: errors there do not count.
    unresolved: &'a Nodes,
    progress: &'a Progress,
    /// The payload schema of the queue being compiled, which its templates' paths are checked
    /// against as its filters' fields are.
    schema: Option<PayloadSchema>,
    /// The format of the queue being compiled, whose fields its templates may read.
    format: Format,
}

/// Where a name was first defined: file and position, for "defined twice" messages.
struct Definition {
    file: PathBuf,
    line: usize,
    column: usize,
}

impl Compiler<'_> {
    fn compile(&mut self, files: Vec<(SourceFile, raw::File)>) -> Config {
        let mut config = Config::default();
        let mut defined: HashMap<(&'static str, String), Definition> = HashMap::new();
        let mut queue_sites: Vec<(usize, String)> = Vec::new();
        for (index, (file, raw)) in files.iter().enumerate() {
            for (name, exchange) in &raw.exchanges {
                let pointer = format!("/exchanges/{}", escape_token(name));
                if !self.define(&mut defined, "exchange", name, file, &pointer) {
                    continue;
                }
                let kind = match exchange.kind.as_str() {
                    "direct" => ExchangeKind::Direct,
                    "fanout" => ExchangeKind::Fanout,
                    "headers" => ExchangeKind::Headers,
                    _ => ExchangeKind::Topic,
                };
                config.exchanges.insert(name.clone(), Exchange { name: name.clone(), kind });
            }
            for name in raw.queues.keys() {
                let pointer = format!("/queues/{}", escape_token(name));
                if self.define(&mut defined, "queue", name, file, &pointer) {
                    queue_sites.push((index, name.clone()));
                }
            }
        }
        let mut files = files;
        self.progress.queues(queue_sites.len());
        for (index, name) in queue_sites {
            let (file, raw) = &mut files[index];
            if let Some(q) = raw.queues.remove(&name)
                && let Some(queue) = self.queue(file, &name, q, &config.exchanges)
            {
                config.queues.insert(name, Arc::new(queue));
            }
            self.progress.queue_compiled();
        }
        self.dead_letter_collisions(&files, &config);
        config
    }

    fn error(&mut self, file: &SourceFile, pointer: &str, message: impl Into<String>) {
        self.diags.push(file.diag(Severity::Error, pointer, message));
    }

    /// Records a definition; a second one with the same name is an error naming both places.
    fn define(
        &mut self,
        defined: &mut HashMap<(&'static str, String), Definition>,
        what: &'static str,
        name: &str,
        file: &SourceFile,
        pointer: &str,
    ) -> bool {
        let pos = file.key_pos(pointer);
        if let Some(message) = reserved(what, name) {
            self.diags.push(file.diag_at(pos, Severity::Error, pointer, message));
            return false;
        }
        if let Some(first) = defined.get(&(what, name.to_string())) {
            let message = format!(
                "{what} \"{name}\" is defined twice: here and at {}:{}:{}",
                first.file.display(),
                first.line,
                first.column
            );
            self.diags.push(file.diag_at(pos, Severity::Error, pointer, message));
            return false;
        }
        defined.insert(
            (what, name.to_string()),
            Definition { file: file.path.clone(), line: pos.line, column: pos.column },
        );
        true
    }

    fn duration(&mut self, file: &SourceFile, pointer: &str, text: Option<&str>, default: Duration) -> Duration {
        match text {
            None => default,
            Some(t) => super::parse_duration(t).unwrap_or_else(|| {
                self.error(file, pointer, super::duration_problem(t));
                default
            }),
        }
    }

    /// A handler's timeout, which must stay below the broker's consumer timeout.
    fn handler_timeout(&mut self, file: &SourceFile, base: &str, text: Option<&str>, default: Duration) -> Duration {
        let pointer = format!("{base}/timeout");
        let timeout = self.duration(file, &pointer, text, default);
        if timeout >= CONSUMER_TIMEOUT {
            let message = format!(
                "a handler timeout of {} reaches the broker's consumer timeout (30m); keep it below",
                humantime::format_duration(timeout)
            );
            self.error(file, &pointer, message);
        }
        timeout
    }

    fn template(&mut self, file: &SourceFile, pointer: &str, text: &str, escape: Escape) -> Option<Template> {
        match Template::compile(text, escape) {
            Ok(t) => {
                for var in t.env_vars() {
                    if std::env::var_os(var).is_none() {
                        let message = format!(
                            "environment variable {var} is not set here; messages fail to render where it is unset"
                        );
                        self.diags.push(file.diag(Severity::Warning, pointer, message));
                    }
                }
                self.format_fields(file, pointer, &t);
                self.payload_paths(file, pointer, &t);
                Some(t)
            }
            Err(e) => {
                let pos = match &e {
                    TemplateError::Syntax { offset, .. } => file.offset_pos(pointer, text, *offset),
                    _ => file.pos(pointer),
                };
                self.diags.push(file.diag_at(pos, Severity::Error, pointer, e.to_string()));
                None
            }
        }
    }

    /// Errors for the variables of template `t` (at `pointer`) that messages of the queue's
    /// format do not have: rendering one fails for every message, which is dead-lettered.
    fn format_fields(&mut self, file: &SourceFile, pointer: &str, t: &Template) {
        let format = self.format;
        for (root, offset) in t.roots() {
            if matches!(root.as_str(), "attempt" | "queue" | "env") || format.has(root) {
                continue;
            }
            let instead = match (root.as_str(), format.payload()) {
                ("payload" | "data", Some(payload)) => format!(" (its JSON payload is {{{{{payload}}}}})"),
                ("payload" | "data", None) => " (its body is {{body}}, as text)".to_string(),
                _ => String::new(),
            };
            let message = format!(
                "a message of format {format} has no {root}{instead}: templates read {}, attempt, queue and env",
                format.fields().join(", ")
            );
            let pos = file.offset_pos(pointer, t.source(), *offset);
            self.diags.push(file.diag_at(pos, Severity::Error, pointer, message));
        }
    }

    /// Errors for the paths of template `t` (at `pointer`) that no payload the queue's schema
    /// accepts has: rendering one fails for every message, which is dead-lettered (`template`).
    fn payload_paths(&mut self, file: &SourceFile, pointer: &str, t: &Template) {
        let Some(schema) = &self.schema else { return };
        let payload = self.format.payload();
        for path in t.payload_paths().iter().filter(|p| Some(p.root.as_str()) == payload) {
            let steps: Vec<&str> = path.steps.iter().map(String::as_str).collect();
            if let Some(why) = super::filter::ruled_out(&schema.schema, &path.root, &steps) {
                let message = format!("{} cannot be in a payload of this queue: {why}", path.text);
                let pos = file.offset_pos(pointer, t.source(), path.offset);
                self.diags.push(file.diag_at(pos, Severity::Error, pointer, message));
            }
        }
    }

    fn queue(
        &mut self,
        file: &SourceFile,
        name: &str,
        q: raw::Queue,
        exchanges: &BTreeMap<String, Exchange>,
    ) -> Option<Queue> {
        let base = format!("/queues/{}", escape_token(name));
        let diags_before = self.diags.len();
        // The schema allows only the formats' names.
        self.format = q.format.as_deref().and_then(Format::parse).unwrap_or_default();
        let format = self.format;

        let max_message_bytes = self.max_message_bytes(file, &format!("{base}/max_message_bytes"), q.max_message_bytes);
        let payload_schema =
            q.payload_schema.as_deref().and_then(|p| self.payload_schema(file, &format!("{base}/payload_schema"), p));

        let mut bindings = Vec::new();
        for (i, b) in q.bind.into_iter().enumerate() {
            let pointer = format!("{base}/bind/{i}");
            let exchange_kind = exchanges.get(&b.exchange).map(|e| e.kind).or(ExchangeKind::builtin(&b.exchange));
            if exchange_kind.is_none() && self.complete {
                let close = super::suggest::did_you_mean(&b.exchange, exchanges.keys().map(String::as_str));
                let message = format!("binding to undefined exchange \"{}\"{close}", b.exchange);
                self.error(file, &format!("{pointer}/exchange"), message);
            }
            let schema = payload_schema.as_ref().map(|s| &s.schema);
            let filter = b.filter.as_ref().and_then(|f| {
                super::filter::compile(file, &format!("{pointer}/filter"), f, schema, format, self.diags)
            });
            bindings.push(Binding {
                exchange: b.exchange,
                exchange_kind,
                routing_key: b.routing_key,
                arguments: b.arguments,
                filter,
            });
        }

        let (concurrency, adaptive) = match q.concurrency {
            None => (None, false),
            Some(raw::Concurrency::Fixed(n)) => (Some(n), false),
            Some(raw::Concurrency::Limit(l)) => (Some(l.max), l.adaptive),
        };
        if adaptive && q.ordered {
            let message = "an ordered queue handles one message at a time; it cannot have adaptive concurrency";
            self.error(file, &format!("{base}/concurrency/adaptive"), message);
        }
        let concurrency = match (concurrency, q.ordered) {
            (Some(n), true) if n > 1 => {
                self.error(
                    file,
                    &format!("{base}/concurrency"),
                    format!("an ordered queue handles one message at a time; concurrency must be 1, not {n}"),
                );
                NonZeroU16::MIN
            }
            (None, true) => NonZeroU16::MIN,
            (n, false) => NonZeroU16::new(n.unwrap_or(4)).unwrap_or(NonZeroU16::MIN),
            (Some(n), true) => NonZeroU16::new(n).unwrap_or(NonZeroU16::MIN),
        };

        let circuit_breaker = self.circuit_breaker(file, &format!("{base}/circuit_breaker"), q.circuit_breaker);

        let rate_limit = q.rate_limit.as_deref().and_then(|text| {
            // The schema has checked the shape: what fails here is a count past u32::MAX.
            let rate = RateLimit::parse(text);
            if rate.is_none() {
                let message = format!("rate limit \"{text}\": the count can be at most {}", u32::MAX);
                self.error(file, &format!("{base}/rate_limit"), message);
            }
            rate
        });

        let on_status_pointer = format!("{base}/on_status");
        if !q.on_status.is_empty() && q.handler.webhook.is_none() && q.handler.command.is_some() {
            let message = "on_status rules a webhook's responses; this queue runs a command, whose exit codes take rules in handler.command.on_exit";
            self.diags.push(file.diag_at(
                file.key_pos(&on_status_pointer),
                Severity::Error,
                &on_status_pointer,
                message,
            ));
        }
        let on_status = super::rules::on_status(file, &on_status_pointer, &q.on_status, self.diags);
        // The handler's and the idempotency key's templates are checked against the schema.
        self.schema = payload_schema;
        let Some(handler) = self.handler(file, &format!("{base}/handler"), q.handler, on_status) else {
            self.schema = None;
            return None;
        };
        if let Handler::Webhook(Webhook { body: Some(body), .. }) = &handler {
            self.bare_json_values(file, &format!("{base}/handler/webhook/body"), body.source());
        }
        let program_source = match &handler {
            Handler::Command(c) => Some(c.program.display().to_string()),
            Handler::Webhook(_) => None,
        };
        // A certificate renewed in place restarts the queue with a client that presents it.
        let tls_source = match &handler {
            Handler::Webhook(Webhook { tls: Some(tls), .. }) => Some(tls.fingerprint.clone()),
            _ => None,
        };
        let timeout = handler.timeout();
        let retry = self.retry(file, &format!("{base}/retry"), &q.retry);
        let idempotency = self.idempotency(file, &base, &q.idempotency, &retry, timeout);
        let order_by = self.order_by(file, &base, q.order_by.as_deref(), q.on_dead_letter.as_deref(), q.ordered);
        // An order_by queue's retries wait in the runner, the delivery unacked all along.
        if order_by.is_some() && retry.window(timeout) >= CONSUMER_TIMEOUT {
            let message = format!(
                "an order_by queue retries in the runner, holding the message unacked: its retry window of {} (every attempt, its timeout and backoff) reaches the broker's consumer timeout (30m); keep it below",
                humantime::format_duration(retry.window(timeout))
            );
            self.error(file, &format!("{base}/retry"), message);
        }
        let payload_schema = self.schema.take();
        let payload_schema_source = payload_schema.as_ref().map(|s| s.schema.clone());
        let dead_letter = q.dead_letter.queue.unwrap_or_else(|| format!("{name}.dlq"));
        if let Some(message) = reserved("dead-letter queue", &dead_letter) {
            self.error(file, &format!("{base}/dead_letter/queue"), message);
        }

        let kind = if q.kind.as_deref() == Some("classic") { QueueKind::Classic } else { QueueKind::Quorum };
        let message_ttl = q.message_ttl.as_deref().and_then(|text| self.message_ttl(file, &base, text));
        let priority = q.priority.and_then(|levels| self.priority(file, &base, levels, kind));
        self.arguments(file, &base, &q.arguments, kind);

        if kind == QueueKind::Classic {
            let message = format!(
                "queue \"{name}\" is a classic queue, which lives on one node of a cluster: while that node is down, publishes to it are confirmed and dropped and consuming it fails (home node down); on a cluster use type: quorum (the default)"
            );
            self.cluster.push(file.diag(Severity::Warning, &format!("{base}/type"), message));
        }
        (self.errors_since(diags_before) == 0).then(|| Queue {
            name: name.to_string(),
            kind,
            bindings,
            max_length: q.max_length,
            message_ttl,
            priority,
            arguments: q.arguments,
            max_message_bytes,
            format,
            payload_schema,
            concurrency,
            adaptive,
            circuit_breaker,
            rate_limit,
            ordered: q.ordered,
            order_by,
            handler,
            retry,
            idempotency,
            dead_letter,
            file: file.path.clone(),
            source: serde_json::json!({
                "definition": file.value.pointer(&base),
                "payload_schema": payload_schema_source,
                "program": program_source,
                "tls": tls_source,
            }),
            written: file.written.pointer(&base).cloned().unwrap_or_default(),
        })
    }

    /// `message_ttl`: RabbitMQ takes whole milliseconds up to 2^32 - 1 (about 49 days).
    fn message_ttl(&mut self, file: &SourceFile, base: &str, text: &str) -> Option<Duration> {
        let pointer = format!("{base}/message_ttl");
        let ttl = super::parse_duration(text);
        match ttl {
            None => self.error(file, &pointer, super::duration_problem(text)),
            Some(ttl) if ttl < Duration::from_millis(1) => {
                self.error(file, &pointer, "a message_ttl must be at least 1ms (leave it out for none)");
            }
            Some(ttl) if ttl > MAX_MESSAGE_TTL => {
                let message = format!(
                    "a message_ttl of {text} is more than RabbitMQ takes (at most {} ms, about 49 days)",
                    MAX_MESSAGE_TTL.as_millis()
                );
                self.error(file, &pointer, message);
            }
            Some(ttl) => return Some(ttl),
        }
        None
    }

    /// `priority`: levels 1 to 255, on a classic queue (RabbitMQ 3.10's quorum queues have none).
    fn priority(&mut self, file: &SourceFile, base: &str, levels: u64, kind: QueueKind) -> Option<u8> {
        let pointer = format!("{base}/priority");
        let levels = match u8::try_from(levels) {
            Ok(levels) if levels >= 1 => levels,
            _ => {
                self.error(
                    file,
                    &pointer,
                    format!("priority levels must be 1 to 255 (10 or fewer is usual), not {levels}"),
                );
                return None;
            }
        };
        if kind == QueueKind::Quorum {
            let message = "priorities need a classic queue (type: classic): RabbitMQ 3.10's quorum queues have none";
            self.error(file, &pointer, message);
            return None;
        }
        Some(levels)
    }

    /// Checks `arguments:`, each against what RabbitMQ takes (see `config::arguments`).
    fn arguments(
        &mut self,
        file: &SourceFile,
        base: &str,
        arguments: &BTreeMap<String, serde_json::Value>,
        kind: QueueKind,
    ) {
        for (name, value) in arguments {
            let pointer = format!("{base}/arguments/{}", escape_token(name));
            let diag = match super::arguments::check(name, value, kind) {
                None => continue,
                Some(Finding::Name(m)) => file.diag_at(file.key_pos(&pointer), Severity::Error, &pointer, m),
                Some(Finding::Value(m)) => file.diag(Severity::Error, &pointer, m),
                Some(Finding::Unknown(m)) => file.diag_at(file.key_pos(&pointer), Severity::Warning, &pointer, m),
            };
            self.diags.push(diag);
        }
    }

    /// The breaker's settings, the defaults for those not given; `None` when turned off.
    fn circuit_breaker(
        &mut self,
        file: &SourceFile,
        base: &str,
        raw: Option<raw::CircuitBreaker>,
    ) -> Option<CircuitBreaker> {
        let d = CircuitBreaker::default();
        let Some(raw) = raw else { return Some(d) };
        // The schema has checked the shape (1% to 100%).
        let failure_rate = raw
            .failure_rate
            .as_deref()
            .and_then(|t| t.strip_suffix('%'))
            .and_then(|t| t.parse::<u8>().ok())
            .map_or(d.failure_rate, |percent| f64::from(percent) / 100.0);
        let breaker = CircuitBreaker {
            failure_rate,
            min_calls: raw.min_calls.filter(|n| *n > 0).unwrap_or(d.min_calls),
            window: self.duration(file, &format!("{base}/window"), raw.window.as_deref(), d.window),
            open_for: self.duration(file, &format!("{base}/open_for"), raw.open_for.as_deref(), d.open_for),
        };
        raw.enabled.unwrap_or(true).then_some(breaker)
    }

    /// Warns of each `{{x}}` standing bare in a JSON body where `x` may be a string: the body
    /// would not be JSON. Numbers and booleans (by the payload schema, or `attempt` and
    /// `version`) are fine bare.
    fn bare_json_values(&mut self, file: &SourceFile, pointer: &str, body: &str) {
        for (offset, path) in crate::handler::template::bare_in_json(body) {
            let scalar = match path.split_once('.') {
                None => matches!(path.as_str(), "attempt" | "version"),
                Some(("payload", rest)) => self.schema.as_ref().is_some_and(|s| is_number_or_bool(&s.schema, rest)),
                Some(_) => false,
            };
            if !scalar {
                let message = format!(
                    "{{{{{path}}}}} stands outside a JSON string, so a string value would make the body invalid JSON; \
                     write {{{{json {path}}}}}, which inserts any value as JSON (or quote it: \"{{{{{path}}}}}\")"
                );
                let pos = file.offset_pos(pointer, body, offset);
                self.diags.push(file.diag_at(pos, Severity::Warning, pointer, message));
            }
        }
    }

    fn max_message_bytes(&mut self, file: &SourceFile, pointer: &str, value: Option<serde_json::Value>) -> usize {
        let bytes = match &value {
            None => return super::DEFAULT_MAX_MESSAGE_BYTES,
            Some(serde_json::Value::Number(n)) => n.as_u64(),
            Some(serde_json::Value::String(s)) => super::parse_size(s),
            Some(_) => None,
        };
        match bytes.and_then(|b| usize::try_from(b).ok()) {
            Some(b) if (1..=super::MAX_MESSAGE_BYTES).contains(&b) => b,
            _ => {
                let shown = value.map(|v| v.to_string()).unwrap_or_default();
                self.error(file, pointer, format!("max_message_bytes {shown} is not a size from 1 byte to 512MiB"));
                super::DEFAULT_MAX_MESSAGE_BYTES
            }
        }
    }

    /// The errors among the diagnostics from `start` on (a queue's own, counted once: all of
    /// them each time would make many queues quadratic).
    fn errors_since(&self, start: usize) -> usize {
        let own = self.diags.get(start..).unwrap_or_default();
        own.iter().filter(|d| d.severity == Severity::Error && !self.unresolved.explains(d)).count()
    }

    fn payload_schema(&mut self, file: &SourceFile, pointer: &str, relative: &str) -> Option<PayloadSchema> {
        let path = file.dir().join(relative);
        let text = match read_regular(&path, MAX_SCHEMA_BYTES) {
            Ok(t) => t,
            Err(e) => {
                self.error(file, pointer, format!("cannot read payload schema {}: {e}", path.display()));
                return None;
            }
        };
        let schema: serde_json::Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => {
                self.error(file, pointer, format!("payload schema {} is not JSON: {e}", path.display()));
                return None;
            }
        };
        match jsonschema::validator_for(&schema) {
            Ok(validator) => Some(PayloadSchema { path, schema, validator: Arc::new(validator) }),
            Err(e) => {
                self.error(file, pointer, format!("payload schema {} is not a valid JSON Schema: {e}", path.display()));
                None
            }
        }
    }

    fn handler(&mut self, file: &SourceFile, base: &str, h: raw::Handler, on_status: Rules) -> Option<Handler> {
        match (h.webhook, h.command) {
            (Some(w), None) => self.webhook(file, &format!("{base}/webhook"), w, on_status).map(Handler::Webhook),
            (None, Some(c)) => self.command(file, &format!("{base}/command"), c).map(Handler::Command),
            _ => {
                self.error(file, base, "a handler has exactly one of \"webhook\" or \"command\"");
                None
            }
        }
    }

    fn webhook(&mut self, file: &SourceFile, base: &str, w: raw::Webhook, on_status: Rules) -> Option<Webhook> {
        let url_pointer = format!("{base}/url");
        let url = self.template(file, &url_pointer, &w.url, Escape::Url);
        if url.is_some()
            && let Err(message) = super::url::check(&w.url)
        {
            self.error(file, &url_pointer, message);
        }
        let mut headers = Vec::new();
        for (name, value) in &w.headers {
            let pointer = format!("{base}/headers/{}", escape_token(name));
            if let Some(problem) = header_name_problem(name) {
                self.diags.push(file.diag_at(file.key_pos(&pointer), Severity::Error, &pointer, problem));
                continue;
            }
            if let Some(t) = self.template(file, &pointer, value, Escape::Plain) {
                headers.push((name.clone(), t));
            }
        }
        let body = match &w.body {
            Some(b) => Some(self.template(file, &format!("{base}/body"), b, Escape::Json)?),
            None => None,
        };
        let signing = w.signing.and_then(|s| self.signing(file, &format!("{base}/signing"), s));
        let timeout = self.handler_timeout(file, base, w.timeout.as_deref(), Duration::from_secs(10));
        // Both checked before giving up on either: every error is reported.
        let oauth2 = w.auth.map(|auth| self.oauth2(file, &format!("{base}/auth/oauth2"), auth.oauth2));
        let tls = w.tls.map(|tls| self.tls(file, &format!("{base}/tls"), tls));
        let (Some(oauth2), Some(tls)) =
            (oauth2.map_or(Some(None), |o| o.map(Some)), tls.map_or(Some(None), |t| t.map(Some)))
        else {
            return None;
        };
        let url = url?;
        Some(Webhook {
            fixed_url: url.literal().and_then(|text| reqwest::Url::parse(text).ok()),
            url,
            method: w.method.unwrap_or_else(|| "POST".into()),
            headers,
            body,
            timeout,
            signing,
            on_status: Arc::new(on_status),
            oauth2: oauth2.map(Arc::new),
            tls,
        })
    }

    /// The secrets' sources; a secret unset or unusable here is a warning (CI has no
    /// secrets), `run` refuses to start on it.
    fn signing(&mut self, file: &SourceFile, base: &str, s: raw::Signing) -> Option<Signing> {
        let signing = Signing {
            secret_env: s.secret_env.into_vec(),
            secret_file: s.secret_file.map(|path| file.dir().join(path)),
            keys: None,
        };
        if signing.secret_env.is_empty() && signing.secret_file.is_none() {
            self.error(file, base, "signing needs secret_env, secret_file or both");
            return None;
        }
        let (signatures, header) = signing.signature_header();
        if header > MAX_HEADER_BYTES {
            let field = if signing.secret_file.is_some() { "secret_file" } else { "secret_env" };
            let message = format!(
                "{signatures} signing secrets make each call's webhook-signature header {header} bytes (48 a secret): \
                 receivers and proxies commonly refuse a header over {} KiB (nginx's default), so every call would fail; \
                 sign with the secrets in rotation only (at most {})",
                MAX_HEADER_BYTES >> 10,
                (MAX_HEADER_BYTES + 1) / 48
            );
            self.diags.push(file.diag(Severity::Warning, &format!("{base}/{field}"), message));
        }
        for error in signing.load().err().unwrap_or_default() {
            let message = match &error {
                SecretError::Unset { var } => {
                    format!(
                        "environment variable {var} (the signing secret) is not set here; webhooks fail where it is unset"
                    )
                }
                other => format!("signing secret: {other}; `sluice run` refuses to start until it is fixed"),
            };
            self.diags.push(file.diag(Severity::Warning, &format!("{base}/{}", error.field()), message));
        }
        Some(signing)
    }

    /// OAuth 2.0 client credentials: a token URL, and the secret in exactly one place.
    fn oauth2(&mut self, file: &SourceFile, base: &str, o: raw::OAuth2) -> Option<OAuth2> {
        let url_pointer = format!("{base}/token_url");
        let token_url = match reqwest::Url::parse(&o.token_url) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => Some(url),
            Ok(url) => {
                let message = format!("token_url scheme \"{}\" is not http or https", url.scheme());
                self.error(file, &url_pointer, message);
                None
            }
            Err(e) => {
                let shown = crate::secret::mask_url(&o.token_url);
                self.error(file, &url_pointer, format!("token_url \"{shown}\" is not a URL: {e}"));
                None
            }
        };
        if let Some(url) = &token_url
            && url.scheme() == "http"
            && !matches!(url.host_str(), Some("localhost" | "127.0.0.1" | "[::1]"))
        {
            let message =
                "token_url is http://: the client secret and the tokens cross the network unencrypted; use https://";
            self.diags.push(file.diag(Severity::Warning, &url_pointer, message));
        }
        let secret = match (o.client_secret_env, o.client_secret_file) {
            (Some(name), None) => {
                if std::env::var_os(&name).is_none() {
                    let message = format!(
                        "environment variable {name} (the OAuth2 client secret) is not set here; run refuses to start where it is unset"
                    );
                    self.diags.push(file.diag(Severity::Warning, &format!("{base}/client_secret_env"), message));
                }
                Some(SecretSource::Env(name))
            }
            (None, Some(path)) => {
                let path = file.dir().join(path);
                if let Err(e) = crate::secret::read_secret_file(&path) {
                    let message = format!("{e} here; run refuses to start without it");
                    self.diags.push(file.diag(Severity::Warning, &format!("{base}/client_secret_file"), message));
                }
                Some(SecretSource::File(path))
            }
            (env, _) => {
                let message = if env.is_some() {
                    "give the client secret once: client_secret_env or client_secret_file, not both"
                } else {
                    "the client secret is missing: give client_secret_env or client_secret_file"
                };
                self.diags.push(file.diag_at(file.key_pos(base), Severity::Error, base, message));
                None
            }
        };
        Some(OAuth2::new(token_url?, o.client_id, secret?, o.scopes, o.audience))
    }

    /// `tls:` files, read and made into the webhook's own client; a file missing here is a
    /// warning (CI has no certificates), which `run` makes an error.
    fn tls(&mut self, file: &SourceFile, base: &str, t: raw::Tls) -> Option<Tls> {
        let resolve = |p: Option<String>| p.map(|p| file.dir().join(p));
        let mut tls = Tls {
            client_cert_file: resolve(t.client_cert_file),
            client_key_file: resolve(t.client_key_file),
            ca_file: resolve(t.ca_file),
            client: None,
            fingerprint: String::new(),
        };
        if tls.client_cert_file.is_some() != tls.client_key_file.is_some() {
            let message = "a client certificate needs its key: give client_cert_file and client_key_file together";
            self.diags.push(file.diag_at(file.key_pos(base), Severity::Error, base, message));
            return None;
        }
        // Each unreadable file is reported; a missing one is a warning and leaves no client.
        let mut unreadable = Vec::new();
        for (setting, path) in tls.files() {
            if let Err(error) = read_regular(path, MAX_PEM_BYTES) {
                unreadable.push(TlsProblem::Read { setting, path: path.clone(), error });
            }
        }
        let problems = if unreadable.is_empty() {
            match tls_client(&tls) {
                Ok((client, fingerprint)) => {
                    tls.client = Some(client);
                    tls.fingerprint = fingerprint;
                    Vec::new()
                }
                Err(problem) => vec![problem],
            }
        } else {
            unreadable
        };
        let mut failed = false;
        for problem in problems {
            let (severity, setting) = match &problem {
                TlsProblem::Read { setting, error, .. } => {
                    let missing = matches!(error, ReadError::Io(e) if e.kind() == std::io::ErrorKind::NotFound);
                    (if missing { Severity::Warning } else { Severity::Error }, *setting)
                }
                TlsProblem::Invalid(
                    crate::handler::webhook::TlsError::Identity(_) | crate::handler::webhook::TlsError::Certificate(_),
                ) => (Severity::Error, "client_cert_file"),
                TlsProblem::Invalid(crate::handler::webhook::TlsError::Key(_)) => (Severity::Error, "client_key_file"),
                TlsProblem::Invalid(crate::handler::webhook::TlsError::Ca(_)) => (Severity::Error, "ca_file"),
                TlsProblem::Invalid(_) => (Severity::Error, ""),
            };
            let pointer = if setting.is_empty() { base.to_string() } else { format!("{base}/{setting}") };
            let message = match severity {
                Severity::Warning => format!("{problem} here; run refuses to start without it"),
                _ => problem.to_string(),
            };
            self.diags.push(file.diag(severity, &pointer, message));
            failed |= severity == Severity::Error;
        }
        if failed {
            return None;
        }
        Some(tls)
    }

    fn command(&mut self, file: &SourceFile, base: &str, c: raw::Command) -> Option<Command> {
        let program = match resolve_program(file.dir(), &c.program) {
            Ok(p) => Some(p),
            Err(message) => {
                self.error(file, &format!("{base}/program"), message);
                None
            }
        };
        let mut args = Vec::new();
        for (i, a) in c.args.iter().enumerate() {
            args.extend(self.template(file, &format!("{base}/args/{i}"), a, Escape::Plain));
        }
        if let Some(i) = crate::handler::command::templated_shell_script(&c.program, &c.args) {
            let message = crate::handler::command::templated_shell_script_warning(&c.program);
            self.diags.push(file.diag(Severity::Warning, &format!("{base}/args/{i}"), message));
        }
        let mut env = Vec::new();
        for (name, value) in &c.env {
            let pointer = format!("{base}/env/{}", escape_token(name));
            if let Some(t) = self.template(file, &pointer, value, Escape::Plain) {
                env.push((name.clone(), t));
            }
        }
        let stdin = match c.stdin.as_deref() {
            Some("payload") => StdinMode::Payload,
            Some("none") => StdinMode::None,
            _ => StdinMode::Envelope,
        };
        let timeout = self.handler_timeout(file, base, c.timeout.as_deref(), Duration::from_secs(60));
        let on_exit =
            super::rules::on_exit(file, &format!("{base}/on_exit"), &c.on_exit, &c.permanent_exit_codes, self.diags);
        Some(Command {
            program: program?,
            args,
            env,
            pass_env: c.pass_env,
            stdin,
            timeout,
            permanent_exit_codes: c.permanent_exit_codes,
            on_exit: Arc::new(on_exit),
        })
    }

    fn retry(&mut self, file: &SourceFile, base: &str, r: &raw::Retry) -> RetryPolicy {
        if let Some(schedule) = &r.schedule {
            return self.schedule(file, base, r, schedule);
        }
        let d = RetryPolicy::default();
        let initial = self.duration(file, &format!("{base}/initial"), r.initial.as_deref(), d.initial);
        let max = self.duration(file, &format!("{base}/max"), r.max.as_deref(), d.max);
        if r.initial.is_some() && initial > max {
            let message = format!(
                "initial delay {} is longer than the maximum {}",
                humantime::format_duration(initial),
                humantime::format_duration(max)
            );
            self.error(file, &format!("{base}/initial"), message);
        }
        if max > MAX_RETRY_DELAY {
            let pointer = format!("{base}/max");
            self.error(file, &pointer, "a retry delay can be at most 30 days (the delay queues cover no more)");
        }
        let jitter = match r.jitter.as_deref() {
            Some("none") => {
                let message = "jitter: none makes every failed message retry at the same moment; prefer full";
                self.diags.push(file.diag(Severity::Warning, &format!("{base}/jitter"), message));
                Jitter::None
            }
            Some("equal") => Jitter::Equal,
            _ => Jitter::Full,
        };
        RetryPolicy {
            max_attempts: r.max_attempts.and_then(NonZeroU32::new).unwrap_or(d.max_attempts),
            backoff: if r.backoff.as_deref() == Some("fixed") { Backoff::Fixed } else { Backoff::Exponential },
            initial,
            max,
            multiplier: r.multiplier.unwrap_or(d.multiplier),
            jitter,
        }
    }

    /// A retry policy of listed delays: attempt n + 1 waits the n-th, and past the end of the list
    /// the last one again. `max_attempts` defaults to one more than the delays listed.
    fn schedule(&mut self, file: &SourceFile, base: &str, r: &raw::Retry, schedule: &[String]) -> RetryPolicy {
        let backoff_fields = [
            ("backoff", r.backoff.is_some()),
            ("initial", r.initial.is_some()),
            ("max", r.max.is_some()),
            ("multiplier", r.multiplier.is_some()),
            ("jitter", r.jitter.is_some()),
        ];
        for (field, _) in backoff_fields.iter().filter(|(_, set)| *set) {
            let pointer = format!("{base}/{field}");
            let message = format!(
                "\"{field}\" shapes computed backoff and cannot be combined with \"schedule\", which lists every delay itself; keep one of them"
            );
            self.diags.push(file.diag_at(file.key_pos(&pointer), Severity::Error, &pointer, message));
        }
        let mut delays = Vec::with_capacity(schedule.len());
        for (i, text) in schedule.iter().enumerate() {
            let pointer = format!("{base}/schedule/{i}");
            let delay = self.duration(file, &pointer, Some(text), Duration::ZERO);
            if delay > MAX_RETRY_DELAY {
                self.error(file, &pointer, "a retry delay can be at most 30 days (the delay queues cover no more)");
            }
            delays.push(delay);
        }
        let listed = u32::try_from(delays.len()).unwrap_or(u32::MAX);
        let max_attempts = match r.max_attempts.and_then(NonZeroU32::new) {
            Some(n) => {
                if n.get() <= listed {
                    let unused = listed - (n.get() - 1);
                    let message = format!(
                        "max_attempts {n} ends the retries before the schedule does: its last {unused} delay(s) are never used"
                    );
                    self.diags.push(file.diag(Severity::Warning, &format!("{base}/max_attempts"), message));
                }
                n
            }
            None => NonZeroU32::new(listed.saturating_add(1)).unwrap_or(NonZeroU32::MIN),
        };
        let d = RetryPolicy::default();
        RetryPolicy {
            max_attempts,
            initial: delays.first().copied().unwrap_or(d.initial),
            max: delays.iter().max().copied().unwrap_or(d.max),
            backoff: Backoff::Schedule(delays),
            multiplier: d.multiplier,
            jitter: Jitter::None,
        }
    }

    /// `order_by` and `on_dead_letter`: a key template checked like the handler's; neither
    /// beside `ordered` (which orders the whole queue), and no `on_dead_letter` without a key.
    fn order_by(
        &mut self,
        file: &SourceFile,
        queue: &str,
        key: Option<&str>,
        on_dead_letter: Option<&str>,
        ordered: bool,
    ) -> Option<OrderBy> {
        let Some(key) = key else {
            if on_dead_letter.is_some() {
                self.error(
                    file,
                    &format!("{queue}/on_dead_letter"),
                    "on_dead_letter says what dead-lettering does to a key's order; it needs order_by",
                );
            }
            return None;
        };
        let pointer = format!("{queue}/order_by");
        if ordered {
            self.error(file, &pointer, "an ordered queue already handles its messages one at a time in queue order; order_by orders them per key: use one or the other");
        }
        let key = self.template(file, &pointer, key, Escape::Plain)?;
        let on_dead_letter = match on_dead_letter {
            Some("hold") => OnDeadLetter::Hold,
            _ => OnDeadLetter::Release,
        };
        Some(OrderBy { key, on_dead_letter })
    }

    fn idempotency(
        &mut self,
        file: &SourceFile,
        queue: &str,
        i: &raw::Idempotency,
        retry: &RetryPolicy,
        timeout: Duration,
    ) -> Option<Idempotency> {
        if i.enabled == Some(false) {
            return None;
        }
        let base = format!("{queue}/idempotency");
        let key = match &i.key {
            Some(key) => Some(self.template(file, &format!("{base}/key"), key, Escape::Plain)?),
            None => None,
        };
        let ttl = self.duration(file, &format!("{base}/ttl"), i.ttl.as_deref(), Duration::from_secs(24 * 3600));
        let window = retry.window(timeout);
        if ttl < window {
            let pointer = if i.ttl.is_some() { format!("{base}/ttl") } else { format!("{queue}/retry") };
            let message = format!(
                "idempotency ttl {} is shorter than the retry window {} (every attempt, its timeout and backoff); a retried message could run twice",
                humantime::format_duration(ttl),
                humantime::format_duration(window)
            );
            self.error(file, &pointer, message);
        }
        Some(Idempotency { key, ttl })
    }

    fn dead_letter_collisions(&mut self, files: &[(SourceFile, raw::File)], config: &Config) {
        let mut owners: BTreeMap<&str, &str> = BTreeMap::new();
        let by_path: HashMap<&Path, &SourceFile> = files.iter().map(|(f, _)| (f.path.as_path(), f)).collect();
        for queue in config.queues.values() {
            let Some(file) = by_path.get(queue.file.as_path()) else {
                continue;
            };
            let base = format!("/queues/{}", escape_token(&queue.name));
            let explicit = format!("{base}/dead_letter/queue");
            let pointer = if file.value.pointer(&explicit).is_some() { explicit } else { base };
            if let Some(other) = config.queues.get(&queue.dead_letter) {
                let message = format!(
                    "dead-letter queue \"{}\" collides with queue \"{}\" defined in {}",
                    queue.dead_letter,
                    other.name,
                    other.file.display()
                );
                self.error(file, &pointer, message);
            } else if let Some(owner) = owners.insert(&queue.dead_letter, &queue.name) {
                let message = format!(
                    "dead-letter queue \"{}\" is already the dead-letter queue of \"{owner}\"",
                    queue.dead_letter
                );
                self.error(file, &pointer, message);
            }
        }
    }
}

/// Why `tls:` files make no client; never quotes them.
#[derive(Debug, thiserror::Error)]
pub enum TlsProblem {
    #[error("cannot read {setting} {}: {error}", path.display())]
    Read { setting: &'static str, path: PathBuf, error: ReadError },
    #[error(transparent)]
    Invalid(#[from] crate::handler::webhook::TlsError),
}

/// Reads the `tls:` files and makes the webhook's client from them; with it, a fingerprint of
/// what was read (SHA-256, hex), so that a reload tells a changed file.
pub(crate) fn tls_client(tls: &Tls) -> Result<(reqwest::Client, String), TlsProblem> {
    use sha2::{Digest as _, Sha256};
    let mut read = BTreeMap::new();
    let mut digest = Sha256::new();
    for (setting, path) in tls.files() {
        let text = read_regular(path, MAX_PEM_BYTES).map_err(|error| TlsProblem::Read {
            setting,
            path: path.clone(),
            error,
        })?;
        digest.update(setting.as_bytes());
        digest.update(text.as_bytes());
        read.insert(setting, text.into_bytes());
    }
    let pem = TlsPem {
        identity: read.remove("client_cert_file").zip(read.remove("client_key_file")),
        ca: read.remove("ca_file"),
    };
    let client = crate::handler::webhook::tls_client(&pem)?;
    let fingerprint = digest.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((client, fingerprint))
}

/// Whether the payload schema makes the value at `path` (`a.b`) a number, an integer or a
/// boolean, following `properties` (a schema it cannot follow says no).
fn is_number_or_bool(schema: &serde_json::Value, path: &str) -> bool {
    let node = path.split('.').try_fold(schema, |node, segment| node.get("properties")?.get(segment));
    let scalar = |t: &serde_json::Value| matches!(t.as_str(), Some("number" | "integer" | "boolean"));
    match node.and_then(|n| n.get("type")) {
        Some(serde_json::Value::Array(types)) => !types.is_empty() && types.iter().all(scalar),
        Some(t) => scalar(t),
        None => false,
    }
}

/// Headers the HTTP client sets itself: `Host` from the URL, the body's length and framing.
/// A value of the pipeline's, let alone of a payload's, could pick another virtual host behind
/// the same address, or cut the body short.
const CLIENT_HEADERS: [&str; 3] = ["host", "content-length", "transfer-encoding"];

/// Hop-by-hop headers and those that change how the exchange is framed (RFC 9110 §7.6.1,
/// §10.1.1): they speak of the connection, which the HTTP client manages, not of the request.
/// A value here could ask to switch protocols (`Upgrade`), hold the body back for an interim
/// answer (`Expect`), or announce trailers and codings that are never sent.
const CONNECTION_HEADERS: [&str; 7] =
    ["connection", "upgrade", "te", "trailer", "keep-alive", "proxy-connection", "expect"];

/// Why a webhook may not set a header of this name: a template (the message would choose
/// which header it sets), a header the HTTP client owns, or no HTTP header name at all.
fn header_name_problem(name: &str) -> Option<String> {
    if name.contains("{{") {
        return Some(format!(
            "header names are literal text, not templates: a message must not choose which header \"{name}\" sets"
        ));
    }
    if CLIENT_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(name)) {
        return Some(format!(
            "\"{name}\" cannot be set in headers: the HTTP client sets it from the url and the body (a value here could pick another virtual host, or cut the body short)"
        ));
    }
    if CONNECTION_HEADERS.iter().any(|h| h.eq_ignore_ascii_case(name)) {
        return Some(format!(
            "\"{name}\" cannot be set in headers: it speaks of the connection, which the HTTP client manages (a value here could switch protocols, hold the body back, or announce what is never sent)"
        ));
    }
    if reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
        return Some(format!("\"{name}\" is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)"));
    }
    None
}

/// Why `name` may not be declared, when its prefix belongs to the broker or to sluice.
fn reserved(what: &str, name: &str) -> Option<String> {
    let prefix = ["amq.", "sluice."].into_iter().find(|p| name.starts_with(p))?;
    let owner = if prefix == "amq." { "RabbitMQ" } else { "sluice's own delay queues" };
    Some(format!("{what} name \"{name}\": the prefix \"{prefix}\" is reserved for {owner}"))
}

/// A program with a slash is resolved relative to the pipeline file; a bare name on PATH.
fn resolve_program(dir: &Path, program: &str) -> Result<PathBuf, String> {
    if program.contains('/') {
        let path = dir.join(program);
        return if path.is_file() { Ok(path) } else { Err(format!("program {} does not exist", path.display())) };
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("program \"{program}\" is not found on PATH"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integral_floats_become_integers() {
        let mut v = serde_json::json!({"a": 8.0, "b": [2.5, 1e3], "c": 1e30, "d": 7, "e": "8.0"});
        integral_floats_as_integers(&mut v);
        assert_eq!(v, serde_json::json!({"a": 8, "b": [2.5, 1000], "c": 1e30, "d": 7, "e": "8.0"}));
        assert!(v["a"].is_i64());
    }

    /// Issue 13: the breaker is on with its defaults unless turned off; given values replace
    /// the defaults one by one; concurrency is a number or {max, adaptive}.
    #[test]
    fn circuit_breaker_and_concurrency_forms() {
        let d = CircuitBreaker::default();
        let s = Duration::from_secs;
        let cases = [
            ("", Some(d), 4, false),
            ("    circuit_breaker: {enabled: false}\n", None, 4, false),
            (
                "    circuit_breaker: {failure_rate: 25%, window: 1m}\n",
                Some(CircuitBreaker { failure_rate: 0.25, window: s(60), ..d }),
                4,
                false,
            ),
            (
                "    circuit_breaker: {enabled: true, min_calls: 5, open_for: 5s}\n",
                Some(CircuitBreaker { min_calls: 5, open_for: s(5), ..d }),
                4,
                false,
            ),
            ("    concurrency: 8\n", Some(d), 8, false),
            ("    concurrency: {max: 64, adaptive: true}\n", Some(d), 64, true),
            ("    concurrency: {max: 16}\n", Some(d), 16, false),
        ];
        for (extra, breaker, concurrency, adaptive) in cases {
            let dir = tempfile::tempdir().expect("tempdir");
            let yaml =
                format!("version: 1\nqueues:\n  work:\n    handler: {{webhook: {{url: \"http://h/x\"}}}}\n{extra}");
            std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
            let validation = super::super::load(&[dir.path().to_path_buf()]);
            let config = validation.config.unwrap_or_else(|| panic!("{extra}: {:?}", validation.diagnostics));
            let q = &config.queues["work"];
            assert_eq!(
                (q.circuit_breaker, q.concurrency.get(), q.adaptive),
                (breaker, concurrency, adaptive),
                "{extra}"
            );
        }
    }
}
