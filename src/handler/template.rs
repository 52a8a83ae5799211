//! Handlebars templates in pipeline files: compiled and checked at validate time, rendered per
//! message with escaping that follows where the text goes (URL, JSON body, plain text).
//!
//! Strict: an unknown variable is a render error, never an empty string. No HTML escaping. A
//! rendered URL whose path has a `.` or `..` segment is a render error too: parsing it would
//! walk up the path.

use std::borrow::Cow;
use std::sync::LazyLock;

use handlebars::template::{Parameter, TemplateElement};
use handlebars::{
    Context, Handlebars, Helper, HelperDef, HelperResult, Output, PathSeg, RenderContext, RenderError,
    RenderErrorReason, Renderable, StringOutput,
};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

/// The variables a template may start from, in any message format (which of them a message
/// has depends on its queue's format: [`crate::vocab::format::Format::has`]).
pub const ROOTS: &[&str] = &[
    "id",
    "type",
    "version",
    "occurred_at",
    "idempotency_key",
    "attempt",
    "queue",
    "payload",
    "env",
    "headers",
    "routing_key",
    "exchange",
    "content_type",
    "source",
    "subject",
    "time",
    "specversion",
    "datacontenttype",
    "data",
    "body",
];

const HELPERS: &[&str] = &[
    "json",
    "urlencode",
    "if",
    "unless",
    "each",
    "with",
    "lookup",
    "eq",
    "ne",
    "gt",
    "gte",
    "lt",
    "lte",
    "and",
    "or",
    "not",
    "len",
];

/// Everything but RFC 3986 unreserved characters is encoded, so a value is always one path segment.
const URL_VALUE: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// Where a rendered template goes, which decides how substituted values are escaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Escape {
    /// Percent-encoded: a webhook URL.
    Url,
    /// JSON string content; `{{json x}}` inserts raw JSON: a webhook body.
    Json,
    /// As is: headers (CR/LF rejected by the caller), command args and env.
    Plain,
}

/// A compiled template.
#[derive(Debug, Clone)]
pub struct Template {
    source: String,
    escape: Escape,
    compiled: handlebars::Template,
    env: Vec<String>,
    /// The paths into the payload (`payload` or `data`) it reads from the root (not those
    /// relative to an `each` or `with` block), for checking against the queue's payload schema.
    payload: Vec<PayloadPath>,
    /// The variables it starts from, each where it is first written (bytes), for checking
    /// against the fields of the queue's format.
    roots: Vec<(String, usize)>,
    /// The output of a template with no expression, which every render returns.
    literal: Option<String>,
}

/// A path into the payload that a template reads, and where it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadPath {
    /// Where the path starts in the template, in bytes.
    pub offset: usize,
    /// The path as written (`payload.order.id`).
    pub text: String,
    /// Its steps below `payload` (or `data`), up to the first that is not a name (`this`, `..`).
    pub steps: Vec<String>,
    /// `payload` or `data`.
    pub root: String,
}

/// Why a template cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// `offset`: where in the template (bytes) the fault is, for a caret.
    #[error("template syntax error: {reason}")]
    Syntax { reason: String, offset: usize },
    #[error("{{{{{helper}}}}} takes {wanted}, as in {example}; here it has {given}")]
    Arity { helper: String, wanted: &'static str, example: &'static str, given: usize },
    #[error("unknown variable \"{0}\": templates start from one of {roots}", roots = ROOTS.join(", "))]
    UnknownRoot(String),
    #[error("unknown helper \"{0}\": available helpers are json, urlencode and the Handlebars built-ins")]
    UnknownHelper(String),
    #[error("partials and decorators are not supported in templates")]
    Partial,
    #[error("triple braces would insert unescaped text into a URL; use {{{{x}}}}")]
    RawInUrl,
}

impl Template {
    /// Compiles `source` and checks every variable it names.
    pub fn compile(source: &str, escape: Escape) -> Result<Template, TemplateError> {
        let compiled = handlebars::Template::compile(source).map_err(|e| syntax_error(source, &e))?;
        let mut reads = Reads { source, env: Vec::new(), payload: Vec::new(), roots: Vec::new() };
        reads.template(&compiled, escape, true)?;
        let Reads { mut env, payload, roots, .. } = reads;
        env.sort();
        env.dedup();
        let literal = compiled
            .elements
            .iter()
            .map(|e| match e {
                TemplateElement::RawString(text) => Some(text.as_str()),
                TemplateElement::Comment(_) => Some(""),
                _ => None,
            })
            .collect::<Option<String>>();
        Ok(Template { source: source.to_string(), escape, compiled, env, payload, roots, literal })
    }

    /// The template's text as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Environment variables the template reads (`{{env.NAME}}`).
    pub fn env_vars(&self) -> &[String] {
        &self.env
    }

    /// The paths into the payload the template reads (`{{payload.order.id}}`), each where it
    /// is written.
    pub fn payload_paths(&self) -> &[PayloadPath] {
        &self.payload
    }

    /// The variables the template starts from, each with where it is first written (bytes).
    pub fn roots(&self) -> &[(String, usize)] {
        &self.roots
    }

    /// What every render returns, when the template is plain text with no expression.
    pub fn literal(&self) -> Option<&str> {
        self.literal.as_deref()
    }

    /// Renders with the given context (see `ROOTS`).
    pub fn render(&self, context: &Context) -> Result<String, RenderError> {
        if let Some(text) = &self.literal {
            return Ok(text.clone());
        }
        let registry = match self.escape {
            Escape::Url => &*URL,
            Escape::Json => &*JSON,
            Escape::Plain => &*PLAIN,
        };
        let mut out = StringOutput::new();
        let mut rc = RenderContext::new(None);
        self.compiled.render(registry, context, &mut rc, &mut out)?;
        let text = out.into_string().map_err(|e| RenderErrorReason::Other(e.to_string()))?;
        if self.escape == Escape::Url
            && let Some(segment) = dot_segment(&text)
        {
            return Err(RenderErrorReason::Other(format!(
                "the path segment \"{segment}\" would be removed by URL parsing, taking the segment before it along; a value may not make a \".\" or \"..\" segment"
            ))
            .into());
        }
        Ok(text)
    }
}

/// The first `.` or `..` segment in the path of absolute URL `url`, in any form the URL
/// standard treats as one (`%2E`, `.%2e`, ...).
///
/// URL parsing removes such segments, and the segment before a `..`, so a value rendered into
/// the path could walk up it (`/users/{{id}}/charge` with id `..` is `/charge`). Escaping cannot
/// prevent that, since `%2E%2E` counts as `..` too: such a URL is refused instead.
fn dot_segment(url: &str) -> Option<String> {
    // The parser drops tabs and line breaks before it looks at segments (values cannot
    // contain them, they are percent-encoded, but the template's own text could).
    let url: Cow<'_, str> = if url.contains(['\t', '\n', '\r']) {
        Cow::Owned(url.chars().filter(|c| !matches!(c, '\t' | '\n' | '\r')).collect())
    } else {
        Cow::Borrowed(url)
    };
    let (_, after_scheme) = url.split_once("://")?;
    let path_start = after_scheme.find(['/', '\\', '?', '#'])?;
    let path = &after_scheme[path_start..];
    let path = &path[..path.find(['?', '#']).unwrap_or(path.len())];
    // Special schemes (http, https) treat a backslash as a slash.
    path.split(['/', '\\'])
        .find(|segment| {
            segment.len() <= "%2e%2e".len()
                && matches!(segment.to_ascii_lowercase().replace("%2e", ".").as_str(), "." | "..")
        })
        .map(str::to_string)
}

/// The plain `{{path}}` expressions of a JSON body template that stand outside any JSON
/// string, with their offsets: each inserts its value's text bare, which is valid JSON only
/// when the value is a number or a boolean. `{{json x}}`, helpers and blocks are not listed.
pub fn bare_in_json(source: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let (mut in_string, mut escaped) = (false, false);
    let mut at = 0;
    while at < source.len() {
        let rest = &source[at..];
        if rest.starts_with("{{") {
            let Some(end) = rest.find("}}") else { break };
            let inner = rest[2..end].trim_matches('~').trim();
            let plain = !inner.is_empty() && inner.chars().all(|c| c.is_alphanumeric() || "._-[]".contains(c));
            if !in_string && plain && inner != "else" && inner != "this" {
                out.push((at, inner.to_string()));
            }
            at += end + 2;
            continue;
        }
        let c = rest.chars().next().unwrap_or_default();
        match c {
            '\\' if in_string => escaped = !escaped,
            '"' if !escaped => in_string = !in_string,
            _ => escaped = false,
        }
        if c != '\\' {
            escaped = false;
        }
        at += c.len_utf8();
    }
    out
}

/// A syntax error in words, at the fault: the usual mistakes (an unclosed `{{`, a block end
/// without a start or closing another block, a block never closed) are found by scanning the text; anything
/// else is named by where handlebars stopped, without its grammar's rule names.
fn syntax_error(source: &str, e: &handlebars::TemplateError) -> TemplateError {
    if let Some((reason, offset)) = explain(source) {
        return TemplateError::Syntax { reason, offset };
    }
    let offset = match e.pos() {
        Some((line, column)) => offset_of(source, line, column),
        None => 0,
    };
    TemplateError::Syntax { reason: format!("not a valid expression at {}", place(source, offset)), offset }
}

/// The usual syntax mistakes, with their offset.
fn explain(source: &str) -> Option<(String, usize)> {
    let mut blocks: Vec<(&str, usize)> = Vec::new();
    let mut at = 0;
    while at < source.len() {
        let rest = &source[at..];
        if rest.starts_with("{{") {
            let (open, close) = match rest {
                r if r.starts_with("{{!--") => ("{{!--", "--}}"),
                r if r.starts_with("{{{") => ("{{{", "}}}"),
                _ => ("{{", "}}"),
            };
            let inner_start = at + open.len();
            let end = source[inner_start..].find(close).map(|e| inner_start + e);
            // A `{{` before the close means this one was never closed.
            let nested = source[inner_start..end.unwrap_or(source.len())].find("{{").filter(|_| open != "{{!--");
            let Some(end) = end.filter(|_| nested.is_none()) else {
                return Some((format!("unclosed `{open}` at {}: close it with `{close}`", place(source, at)), at));
            };
            let inner = source[inner_start..end].trim_matches('~').trim();
            if let Some(block) = inner.strip_prefix('#') {
                blocks.push((block.split_whitespace().next().unwrap_or_default(), at));
            } else if let Some(name) = inner.strip_prefix('/') {
                let name = name.trim();
                match blocks.pop() {
                    Some((opened, _)) if opened == name => {}
                    Some((opened, start)) => {
                        let reason = format!(
                            "`{{{{/{name}}}}}` at {} closes `{{{{#{opened}}}}}` opened at {}",
                            place(source, at),
                            place(source, start)
                        );
                        return Some((reason, at));
                    }
                    None => {
                        return Some((format!("`{{{{/{name}}}}}` at {} closes no block", place(source, at)), at));
                    }
                }
            }
            at = end + close.len();
        } else {
            at += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    blocks.pop().map(|(name, start)| {
        (format!("`{{{{#{name}}}}}` at {} is never closed: add `{{{{/{name}}}}}`", place(source, start)), start)
    })
}

/// `column 7`, or `line 2, column 7` in a template of several lines (1-based, in characters).
fn place(source: &str, offset: usize) -> String {
    let before = &source[..source.floor_char_boundary(offset)];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or_default().chars().count() + 1;
    if source.contains('\n') { format!("line {line}, column {column}") } else { format!("column {column}") }
}

/// The byte offset of a 1-based line and 0-based character column (as handlebars counts).
fn offset_of(source: &str, line: usize, column: usize) -> usize {
    let start: usize = source.split_inclusive('\n').take(line.saturating_sub(1)).map(str::len).sum();
    let rest = &source[start.min(source.len())..];
    start + rest.char_indices().nth(column).map_or(rest.len(), |(i, _)| i)
}

/// How many values a helper takes, in words and as bounds, with an example.
struct Takes {
    min: usize,
    max: usize,
    wanted: &'static str,
    example: &'static str,
}

/// What each helper takes; `None` for helpers that take anything.
fn takes(helper: &str) -> Option<Takes> {
    let (min, max, wanted, example) = match helper {
        "json" => (1, 1, "one value", "{{json payload}}"),
        "urlencode" => (1, 1, "one value", "{{urlencode payload.name}}"),
        "if" | "unless" | "with" | "each" | "not" | "len" => (1, 1, "one value", "{{#if payload.x}}...{{/if}}"),
        "lookup" => (2, 2, "two values", "{{lookup payload.map payload.key}}"),
        "eq" | "ne" | "gt" | "gte" | "lt" | "lte" => (2, 2, "two values", "{{#if (eq payload.a 1)}}...{{/if}}"),
        "and" | "or" => (1, usize::MAX, "at least one value", "{{#if (and payload.a payload.b)}}...{{/if}}"),
        _ => return None,
    };
    Some(Takes { min, max, wanted, example })
}

fn check_arity(helper: &str, given: usize) -> Result<(), TemplateError> {
    match takes(helper) {
        Some(t) if !(t.min..=t.max).contains(&given) => {
            Err(TemplateError::Arity { helper: helper.to_string(), wanted: t.wanted, example: t.example, given })
        }
        _ => Ok(()),
    }
}

/// What a template reads, gathered while its elements are checked.
struct Reads<'s> {
    source: &'s str,
    /// `{{env.NAME}}`.
    env: Vec<String>,
    payload: Vec<PayloadPath>,
    roots: Vec<(String, usize)>,
}

impl Reads<'_> {
    /// Checks the elements of `template` (the whole, or a block's), each found from where the
    /// parser says it starts.
    fn template(&mut self, template: &handlebars::Template, escape: Escape, roots: bool) -> Result<(), TemplateError> {
        for (i, element) in template.elements.iter().enumerate() {
            // 1-based line and column.
            let at = template.mapping.get(i).map_or(0, |m| offset_of(self.source, m.0, m.1.saturating_sub(1)));
            self.element(element, escape, roots, at)?;
        }
        Ok(())
    }

    fn element(
        &mut self,
        element: &TemplateElement,
        escape: Escape,
        roots: bool,
        at: usize,
    ) -> Result<(), TemplateError> {
        match element {
            TemplateElement::RawString(_) | TemplateElement::Comment(_) => {}
            TemplateElement::HtmlExpression(_) if escape == Escape::Url => {
                return Err(TemplateError::RawInUrl);
            }
            TemplateElement::Expression(h) | TemplateElement::HtmlExpression(h) => {
                let name = h.name.as_name().unwrap_or_default();
                if h.params.is_empty() && h.hash.is_empty() && !HELPERS.contains(&name) {
                    self.param(&h.name, roots, at)?;
                } else {
                    check_helper(name)?;
                    check_arity(name, h.params.len())?;
                }
                for p in h.params.iter().chain(h.hash.values()) {
                    self.param(p, roots, at)?;
                }
            }
            TemplateElement::HelperBlock(h) => {
                let name = h.name.as_name().unwrap_or_default();
                check_helper(name)?;
                check_arity(name, h.params.len())?;
                for p in h.params.iter().chain(h.hash.values()) {
                    self.param(p, roots, at)?;
                }
                // Inside each/with, names are relative to the block's value, not the root.
                let inner_roots = roots && !matches!(name, "each" | "with");
                for t in [&h.template, &h.inverse].into_iter().flatten() {
                    self.template(t, escape, inner_roots)?;
                }
            }
            _ => return Err(TemplateError::Partial),
        }
        Ok(())
    }

    /// A value an expression reads, in the expression starting at byte `at`.
    fn param(&mut self, param: &Parameter, roots: bool, at: usize) -> Result<(), TemplateError> {
        match param {
            Parameter::Path(handlebars::Path::Relative((segs, raw))) if roots => {
                let mut names = segs.iter().map(|s| match s {
                    PathSeg::Named(n) => Some(n.as_str()),
                    _ => None,
                });
                let first = names.clone().next().flatten();
                if let Some(root) = first
                    && ROOTS.contains(&root)
                    && !self.roots.iter().any(|(r, _)| r == root)
                {
                    let offset = self.source.get(at..).and_then(|rest| rest.find(raw.as_str())).map_or(at, |i| at + i);
                    self.roots.push((root.to_string(), offset));
                }
                match names.next().flatten() {
                    Some("env") => {
                        if let Some(Some(var)) = names.next() {
                            self.env.push(var.to_string());
                        }
                        Ok(())
                    }
                    Some(root @ ("payload" | "data")) => {
                        let steps = names.map_while(|n| n.map(str::to_string)).collect();
                        // The expression's text from its start holds the path as written.
                        let offset =
                            self.source.get(at..).and_then(|rest| rest.find(raw.as_str())).map_or(at, |i| at + i);
                        self.payload.push(PayloadPath { offset, text: raw.clone(), steps, root: root.to_string() });
                        Ok(())
                    }
                    Some(root) if ROOTS.contains(&root) => Ok(()),
                    Some(root) => Err(TemplateError::UnknownRoot(root.to_string())),
                    None if raw.is_empty() || raw == "this" => Ok(()),
                    None => Err(TemplateError::UnknownRoot(raw.clone())),
                }
            }
            Parameter::Subexpression(sub) => self.element(sub.as_element(), Escape::Plain, roots, at),
            _ => Ok(()),
        }
    }
}

fn check_helper(name: &str) -> Result<(), TemplateError> {
    if HELPERS.contains(&name) { Ok(()) } else { Err(TemplateError::UnknownHelper(name.to_string())) }
}

static URL: LazyLock<Handlebars<'static>> =
    LazyLock::new(|| registry(|s| utf8_percent_encode(s, URL_VALUE).to_string(), Box::new(JsonHelper { raw: false })));
static JSON: LazyLock<Handlebars<'static>> = LazyLock::new(|| {
    registry(
        |s| {
            let quoted = serde_json::Value::from(s).to_string();
            quoted[1..quoted.len() - 1].to_string()
        },
        Box::new(JsonHelper { raw: true }),
    )
});
static PLAIN: LazyLock<Handlebars<'static>> =
    LazyLock::new(|| registry(handlebars::no_escape, Box::new(JsonHelper { raw: true })));

fn registry(
    escape: impl Fn(&str) -> String + Send + Sync + 'static,
    json: Box<dyn HelperDef + Send + Sync>,
) -> Handlebars<'static> {
    let mut h = Handlebars::new();
    h.set_strict_mode(true);
    h.register_escape_fn(escape);
    h.register_helper("json", json);
    h.register_helper("urlencode", Box::new(UrlEncodeHelper));
    h
}

/// `{{json x}}`: `x` as JSON text; raw (unescaped) except in URLs, where it is percent-encoded.
struct JsonHelper {
    raw: bool,
}

impl HelperDef for JsonHelper {
    fn call<'reg: 'rc, 'rc>(
        &self,
        h: &Helper<'rc>,
        r: &'reg Handlebars<'reg>,
        _: &'rc Context,
        _: &mut RenderContext<'reg, 'rc>,
        out: &mut dyn Output,
    ) -> HelperResult {
        let value = h.param(0).ok_or(RenderErrorReason::ParamNotFoundForIndex("json", 0))?;
        let text = value.value().to_string();
        let text = if self.raw { text } else { r.get_escape_fn()(&text) };
        out.write(&text)?;
        Ok(())
    }
}

/// `{{urlencode x}}`: `x` percent-encoded as one URL component, in any context.
struct UrlEncodeHelper;

impl HelperDef for UrlEncodeHelper {
    fn call<'reg: 'rc, 'rc>(
        &self,
        h: &Helper<'rc>,
        _: &'reg Handlebars<'reg>,
        _: &'rc Context,
        _: &mut RenderContext<'reg, 'rc>,
        out: &mut dyn Output,
    ) -> HelperResult {
        let value = h.param(0).ok_or(RenderErrorReason::ParamNotFoundForIndex("urlencode", 0))?;
        let text = match value.value() {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        out.write(&utf8_percent_encode(&text, URL_VALUE).to_string())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, escape: Escape, ctx: serde_json::Value) -> String {
        let t = Template::compile(source, escape).expect("compiles");
        t.render(&Context::wraps(ctx).expect("context")).expect("renders")
    }

    #[test]
    fn escaping_follows_the_destination() {
        let ctx = json!({"payload": {"name": "a \"b\"/c?d", "n": 1, "o": {"k": [1, "x"]}}});
        let cases = [
            ("https://h/x/{{payload.name}}", Escape::Url, "https://h/x/a%20%22b%22%2Fc%3Fd"),
            ("{\"n\": \"{{payload.name}}\"}", Escape::Json, "{\"n\": \"a \\\"b\\\"/c?d\"}"),
            ("{{json payload.o}}", Escape::Json, "{\"k\":[1,\"x\"]}"),
            ("{{json payload.o}}", Escape::Url, "%7B%22k%22%3A%5B1%2C%22x%22%5D%7D"),
            ("{{payload.name}} & <b>", Escape::Plain, "a \"b\"/c?d & <b>"),
            ("{{urlencode payload.name}}", Escape::Plain, "a%20%22b%22%2Fc%3Fd"),
            ("{{urlencode payload.name}}", Escape::Url, "a%20%22b%22%2Fc%3Fd"),
            ("{{payload.n}}", Escape::Json, "1"),
        ];
        for (source, escape, want) in cases {
            assert_eq!(render(source, escape, ctx.clone()), want, "{source} {escape:?}");
        }
    }

    /// Issue 9: `/users/{{payload.id}}/charge` with the id `..` called `/charge`. The URL parser
    /// removes dot segments, `%2E` forms included, so no escaping keeps them: a rendered path
    /// with one is an error. Dots elsewhere, and in the query, are fine.
    #[test]
    fn a_url_path_never_gets_a_dot_segment() {
        let cases = [
            ("https://h/u/{{payload.x}}/charge", "..", Err("\"..\"")),
            ("https://h/u/{{payload.x}}/charge", ".", Err("\".\"")),
            ("https://h/u/{{payload.x}}", "..", Err("\"..\"")),
            ("https://h/u/{{payload.x}}?q=1", ".", Err("\".\"")),
            ("https://h/u/.{{payload.x}}/charge", ".", Err("\"..\"")),
            ("https://h/u/{{payload.x}}./charge", "", Err("\".\"")),
            ("https://h/u/%2e{{payload.x}}/charge", ".", Err("\"%2e.\"")),
            ("https://h/u/{{payload.x}}/charge", "...", Ok("https://h/u/.../charge")),
            ("https://h/u/{{payload.x}}/charge", "a..b", Ok("https://h/u/a..b/charge")),
            ("https://h/u/{{payload.x}}/charge", "%2E%2E", Ok("https://h/u/%252E%252E/charge")),
            ("https://h/u/{{payload.x}}/charge", "../admin", Ok("https://h/u/..%2Fadmin/charge")),
            ("https://h/u/{{payload.x}}/charge", ".\\..", Ok("https://h/u/.%5C../charge")),
            ("https://h/u?next={{payload.x}}", "..", Ok("https://h/u?next=..")),
            ("https://h/u#{{payload.x}}", "..", Ok("https://h/u#..")),
            ("https://h/u/{{payload.x}}/charge", "u7", Ok("https://h/u/u7/charge")),
        ];
        for (source, x, want) in cases {
            let t = Template::compile(source, Escape::Url).expect("compiles");
            let got = t.render(&Context::wraps(json!({"payload": {"x": x}})).expect("context"));
            match (got, want) {
                (Ok(text), Ok(want)) => assert_eq!(text, want, "{source} with {x:?}"),
                (Err(e), Err(segment)) => {
                    let reason = e.reason().to_string();
                    assert!(reason.contains(&format!("path segment {segment}")), "{source} with {x:?}: {reason}");
                }
                (got, want) => panic!("{source} with {x:?}: expected {want:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn a_template_without_expressions_renders_as_written_minus_comments() {
        for (source, literal, want) in [
            ("https://h/x?a=1&b=2", true, "https://h/x?a=1&b=2"),
            ("a{{! a note }}b", true, "ab"),
            ("a{{payload.n}}", false, "a1"),
        ] {
            assert_eq!(Template::compile(source, Escape::Url).unwrap().literal().is_some(), literal, "{source}");
            assert_eq!(render(source, Escape::Url, json!({"payload": {"n": 1}})), want, "{source}");
        }
    }

    #[test]
    fn strict_unknown_variable_is_an_error() {
        let t = Template::compile("{{payload.missing}}", Escape::Plain).unwrap();
        assert!(t.render(&Context::wraps(json!({"payload": {}})).unwrap()).is_err());
    }

    #[test]
    fn compile_checks() {
        let cases: &[(&str, Result<(), TemplateError>)] = &[
            ("{{payload.a}} {{env.X}} {{#if attempt}}{{queue}}{{/if}}", Ok(())),
            ("{{#each payload.items}}{{name}}{{/each}}", Ok(())),
            ("{{paylod.a}}", Err(TemplateError::UnknownRoot("paylod".into()))),
            ("{{json secret}}", Err(TemplateError::UnknownRoot("secret".into()))),
            ("{{shout payload}}", Err(TemplateError::UnknownHelper("shout".into()))),
            ("{{> partial}}", Err(TemplateError::Partial)),
        ];
        for (source, want) in cases {
            assert_eq!(Template::compile(source, Escape::Plain).map(|_| ()), *want, "{source}");
        }
        assert!(matches!(Template::compile("{{#if}}", Escape::Plain), Err(TemplateError::Syntax { .. })));
        assert_eq!(Template::compile("{{{payload.a}}}", Escape::Url).map(|_| ()), Err(TemplateError::RawInUrl));
    }

    // Issue 14: handlebars' parser names its grammar rules ("expected
    // trailing_tilde_to_omit_whitespace"); a syntax error says what is wrong, and where.
    #[test]
    fn syntax_errors_say_what_and_where() {
        let cases = [
            ("http://h/x/{{payload.id", "unclosed `{{` at column 12: close it with `}}`", 11),
            ("{{payload.a}} {{payload.b", "unclosed `{{` at column 15: close it with `}}`", 14),
            ("a {{payload.a {{payload.b}}", "unclosed `{{` at column 3: close it with `}}`", 2),
            ("{{{payload.a}}", "unclosed `{{{` at column 1: close it with `}}}`", 0),
            ("x {{#if payload}}y", "`{{#if}}` at column 3 is never closed: add `{{/if}}`", 2),
            ("{{#if a}}{{/each}}", "`{{/each}}` at column 10 closes `{{#if}}` opened at column 1", 9),
            ("{{/if}}", "`{{/if}}` at column 1 closes no block", 0),
            ("a\n{{#each payload}}", "`{{#each}}` at line 2, column 1 is never closed: add `{{/each}}`", 2),
            ("{{payload.a b=}}", "not a valid expression at column 14", 13),
            ("é{{", "unclosed `{{` at column 2: close it with `}}`", 2),
        ];
        for (source, reason, offset) in cases {
            let got = Template::compile(source, Escape::Plain).map(|_| ());
            assert_eq!(got, Err(TemplateError::Syntax { reason: reason.into(), offset }), "{source}");
        }
        // Comments may hold braces.
        assert!(Template::compile("{{!-- }} {{ --}}ok", Escape::Plain).is_ok());
    }

    #[test]
    fn expressions_outside_json_strings_are_found() {
        let cases: &[(&str, &[(usize, &str)])] = &[
            (r#"{"a": {{payload.a}}, "b": "{{payload.b}}"}"#, &[(6, "payload.a")]),
            (r#"{"a": "x\"{{payload.a}}\"", "n": {{attempt}}}"#, &[(33, "attempt")]),
            (r#"{"a": {{json payload.a}}, "b": [{{#each payload.x}}{{this}}{{/each}}]}"#, &[]),
            (r#"{"a": "\\", "b": {{payload.b}}}"#, &[(17, "payload.b")]),
        ];
        for (source, want) in cases {
            let got = bare_in_json(source);
            let want: Vec<(usize, String)> = want.iter().map(|(o, p)| (*o, p.to_string())).collect();
            assert_eq!(got, want, "{source}");
        }
    }

    // Issue 14: `{{json}}` passed validate and dead-lettered every message.
    #[test]
    fn helpers_get_the_number_of_values_they_take() {
        let cases = [
            ("{{json}}", Some("{{json}} takes one value, as in {{json payload}}; here it has 0")),
            ("{{json payload payload}}", Some("{{json}} takes one value, as in {{json payload}}; here it has 2")),
            ("{{urlencode}}", Some("{{urlencode}} takes one value, as in {{urlencode payload.name}}; here it has 0")),
            ("{{#if (eq payload.a)}}x{{/if}}", Some("{{eq}} takes two values")),
            ("{{#each payload.a payload.b}}x{{/each}}", Some("{{each}} takes one value")),
            ("{{json payload}}{{#if (eq payload.a 1)}}x{{/if}}{{#if (and payload.a payload.b)}}y{{/if}}", None),
        ];
        for (source, want) in cases {
            match (Template::compile(source, Escape::Json), want) {
                (Ok(_), None) => {}
                (Err(e), Some(want)) => assert!(e.to_string().starts_with(want), "{source}: {e}"),
                (got, want) => panic!("{source}: expected {want:?}, got {got:?}"),
            }
        }
    }

    /// Issue 31 item 19: the payload paths a template reads, where each is written, for the
    /// check against the queue's payload schema; not those relative to `each` or `with`.
    #[test]
    fn payload_paths_are_collected_where_they_are_written() {
        /// Where a path starts, as written, and its steps below `payload`.
        type Read<'a> = (usize, &'a str, &'a [&'a str]);
        let cases: &[(&str, &[Read])] = &[
            ("https://h/x/{{payload.order_idd}}", &[(14, "payload.order_idd", &["order_idd"])]),
            ("{{#if payload.a}}{{payload.b.c}}{{/if}}", &[(6, "payload.a", &["a"]), (19, "payload.b.c", &["b", "c"])]),
            ("{{json payload.items.0.sku}}", &[(7, "payload.items.0.sku", &["items", "0", "sku"])]),
            ("{{#each payload.items}}{{sku}}{{payload.x}}{{/each}}", &[(8, "payload.items", &["items"])]),
            ("{{#if (eq payload.a 1)}}x{{else}}{{payload}}{{/if}}", &[(10, "payload.a", &["a"]), (35, "payload", &[])]),
            ("a\n  {{ payload.x }} {{env.E}} {{id}}", &[(7, "payload.x", &["x"])]),
        ];
        for (source, want) in cases {
            let t = Template::compile(source, Escape::Plain).expect("compiles");
            let got: Vec<(usize, &str, Vec<&str>)> = t
                .payload_paths()
                .iter()
                .map(|p| (p.offset, p.text.as_str(), p.steps.iter().map(String::as_str).collect()))
                .collect();
            let want: Vec<(usize, &str, Vec<&str>)> = want.iter().map(|(o, t, s)| (*o, *t, s.to_vec())).collect();
            assert_eq!(got, want, "{source}");
            for (offset, text, _) in &got {
                assert_eq!(&source[*offset..*offset + text.len()], *text, "{source}");
            }
        }
    }

    /// Issue 34: the variables a template starts from, each where it is first written, for
    /// checking against the fields of the queue's format; not those inside `each` or `with`.
    #[test]
    fn roots_are_collected_where_they_are_first_written() {
        let t = Template::compile(
            "{{headers.x-tenant}}/{{#if (eq source 1)}}{{data.a}}{{/if}}{{#each payload}}{{body}}{{/each}}{{source}}",
            Escape::Plain,
        )
        .expect("compiles");
        let roots: Vec<(&str, usize)> = t.roots().iter().map(|(r, o)| (r.as_str(), *o)).collect();
        assert_eq!(roots, [("headers", 2), ("source", 31), ("data", 44), ("payload", 67)]);
        let paths: Vec<(&str, &str)> = t.payload_paths().iter().map(|p| (p.root.as_str(), p.text.as_str())).collect();
        assert_eq!(paths, [("data", "data.a"), ("payload", "payload")]);
    }

    #[test]
    fn env_vars_are_collected() {
        let t = Template::compile("{{env.B}}{{env.A}}{{env.B}}", Escape::Plain).unwrap();
        assert_eq!(t.env_vars(), ["A", "B"]);
    }
}
