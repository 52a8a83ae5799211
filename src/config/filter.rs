//! A binding's `filter:` as written, checked and turned into a [`Filter`]: the shape of each
//! condition (one operator beside `field`, or one of `all`, `any`, `not`), the field's path
//! (an envelope field, or a path into the payload), numbers a comparison can hold exactly, and
//! what the queue's payload schema says of the field: a field no payload can have, or an
//! operator that cannot apply to the field's type, is an error at its node.
//!
//! The JSON Schema checks the keys and the value types first (for editors too); this module
//! adds what a schema cannot say. Evaluation is the runtime's (`runtime::filter`).

use std::collections::HashSet;

use serde_json::{Map, Value};

use super::diagnostic::{Diagnostic, Severity};
use super::source::{SourceFile, escape_token};
use super::suggest;
use crate::vocab::format::Format;

/// A binding's condition on a message: the queue takes a message through this binding only
/// when it holds.
#[derive(Debug, Clone, PartialEq)]
pub enum Filter {
    All(Vec<Filter>),
    Any(Vec<Filter>),
    Not(Box<Filter>),
    Test { field: Field, op: Op },
}

/// What a condition reads: an envelope field, or the payload or a path into it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    pub root: Root,
    /// Object keys below the root (the payload's only).
    pub path: Vec<String>,
}

/// The fields of a message a condition may read (which of them a message has depends on its
/// queue's format, [`Format::has`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Root {
    Id,
    Type,
    Version,
    OccurredAt,
    IdempotencyKey,
    /// The JSON payload: an envelope's or a `json` message's `payload`, a CloudEvent's `data`.
    Payload,
    /// A header, named by the one step below `headers`.
    Header,
    RoutingKey,
    Exchange,
    ContentType,
    Source,
    Subject,
    Time,
    SpecVersion,
    DataContentType,
    /// A `bytes` message's body, as text.
    Body,
}

const ROOTS: [(&str, Root); 17] = [
    ("id", Root::Id),
    ("type", Root::Type),
    ("version", Root::Version),
    ("occurred_at", Root::OccurredAt),
    ("idempotency_key", Root::IdempotencyKey),
    ("payload", Root::Payload),
    ("data", Root::Payload),
    ("headers", Root::Header),
    ("routing_key", Root::RoutingKey),
    ("exchange", Root::Exchange),
    ("content_type", Root::ContentType),
    ("source", Root::Source),
    ("subject", Root::Subject),
    ("time", Root::Time),
    ("specversion", Root::SpecVersion),
    ("datacontenttype", Root::DataContentType),
    ("body", Root::Body),
];

/// How a condition tests its field's value. A missing field fails every test but
/// `exists: false`; a value of another type than the operator's fails it too.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// Equal as JSON (numbers by value: `1` equals `1.0`).
    Eq(Value),
    /// Equal to one of the values, as `Eq`.
    In(Values),
    Gt(serde_json::Number),
    Gte(serde_json::Number),
    Lt(serde_json::Number),
    Lte(serde_json::Number),
    Exists(bool),
    Prefix(String),
}

/// The values of an `in:` list, held as sets: a message is looked up once, whatever the
/// length of the list (a list of 40,000 customer ids is one lookup, not 40,000 comparisons).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Values {
    /// As written, in order: for messages.
    listed: Vec<Value>,
    strings: HashSet<String>,
    numbers: HashSet<NumberKey>,
    booleans: [bool; 2],
    null: bool,
}

/// A number by value, so that equal numbers are one key (`1` and `1.0`, as [`Op::Eq`] compares
/// them): an integral float within 64 bits is its integer, any other float its bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum NumberKey {
    Integer(i128),
    Float(u64),
}

impl NumberKey {
    fn of(n: &serde_json::Number) -> Option<NumberKey> {
        if let Some(i) = n.as_i64() {
            return Some(NumberKey::Integer(i.into()));
        }
        if let Some(u) = n.as_u64() {
            return Some(NumberKey::Integer(u.into()));
        }
        let f = n.as_f64()?;
        // Integral and within ±2^64: exactly an integer (JSON holds no NaN or infinity).
        Some(if f.fract() == 0.0 && f.abs() < 18_446_744_073_709_551_616.0 {
            NumberKey::Integer(f as i128)
        } else {
            NumberKey::Float(f.to_bits())
        })
    }
}

impl Values {
    /// The scalars of a list (arrays and objects are never equal to a field's value here).
    pub fn new(listed: Vec<Value>) -> Values {
        let mut values = Values::default();
        for value in &listed {
            match value {
                Value::String(s) => {
                    values.strings.insert(s.clone());
                }
                Value::Number(n) => values.numbers.extend(NumberKey::of(n)),
                Value::Bool(b) => values.booleans[usize::from(*b)] = true,
                Value::Null => values.null = true,
                Value::Array(_) | Value::Object(_) => {}
            }
        }
        values.listed = listed;
        values
    }

    /// The values as written.
    pub fn listed(&self) -> &[Value] {
        &self.listed
    }

    /// Whether `value` is one of them (numbers by value).
    pub fn contains(&self, value: &Value) -> bool {
        match value {
            Value::String(s) => self.contains_str(s),
            Value::Number(n) => self.contains_number(n),
            Value::Bool(b) => self.booleans[usize::from(*b)],
            Value::Null => self.null,
            Value::Array(_) | Value::Object(_) => false,
        }
    }

    pub fn contains_str(&self, s: &str) -> bool {
        self.strings.contains(s)
    }

    pub fn contains_number(&self, n: &serde_json::Number) -> bool {
        NumberKey::of(n).is_some_and(|key| self.numbers.contains(&key))
    }
}

/// The operators, as written.
const OPERATORS: [&str; 8] = ["eq", "in", "gt", "gte", "lt", "lte", "exists", "prefix"];

/// The combinators, as written.
const COMBINATORS: [&str; 3] = ["all", "any", "not"];

/// Checks the filter at `pointer` and builds it; `None` after any error (each reported).
/// `schema` is the queue's payload schema, when it has one; `format` says which fields its
/// messages have.
pub(super) fn compile(
    file: &SourceFile,
    pointer: &str,
    value: &Value,
    schema: Option<&Value>,
    format: Format,
    diags: &mut Vec<Diagnostic>,
) -> Option<Filter> {
    let mut checker = Checker { file, schema, format, diags, failed: false };
    let filter = checker.filter(pointer, value);
    if checker.failed { None } else { filter }
}

struct Checker<'a> {
    file: &'a SourceFile,
    schema: Option<&'a Value>,
    format: Format,
    diags: &'a mut Vec<Diagnostic>,
    failed: bool,
}

impl Checker<'_> {
    fn error(&mut self, pointer: &str, message: impl Into<String>) {
        self.failed = true;
        self.diags.push(self.file.diag(Severity::Error, pointer, message));
    }

    /// An error about the condition at `pointer`, shown at the key `key` of it.
    fn key_error(&mut self, pointer: &str, key: &str, message: impl Into<String>) {
        self.failed = true;
        let pos = self.file.key_pos(&format!("{pointer}/{}", escape_token(key)));
        self.diags.push(self.file.diag_at(pos, Severity::Error, pointer, message));
    }

    fn filter(&mut self, pointer: &str, value: &Value) -> Option<Filter> {
        let Some(map) = value.as_object() else {
            self.error(pointer, format!("a filter is an object, not {}", kind_of(value)));
            return None;
        };
        // In file order, so that the second of two operators is the one reported.
        let mut keys: Vec<&String> = map.keys().collect();
        let at = |key: &str| format!("{pointer}/{}", escape_token(key));
        keys.sort_by_key(|k| {
            let pos = self.file.key_pos(&at(k));
            (pos.line, pos.column)
        });
        if let Some(combinator) = keys.iter().find(|k| COMBINATORS.contains(&k.as_str())) {
            if let Some(other) = keys.iter().find(|k| *k != combinator) {
                self.key_error(
                    pointer,
                    other,
                    format!(
                        "\"{combinator}\" stands alone in its object; put \"{other}\" in a condition of its own inside it"
                    ),
                );
                return None;
            }
            return self.combinator(&at(combinator), combinator, &map[combinator.as_str()]);
        }
        let ops: Vec<&&String> = keys.iter().filter(|k| OPERATORS.contains(&k.as_str())).collect();
        let field = map.get("field");
        match (field, ops.as_slice()) {
            (None, []) => {
                self.error(
                    pointer,
                    "an empty filter: write a condition {field, and one of eq, in, gt, gte, lt, lte, exists, prefix}, or all, any or not",
                );
                None
            }
            (Some(_), []) => {
                self.key_error(
                    pointer,
                    "field",
                    "a condition without an operator: add one of eq, in, gt, gte, lt, lte, exists, prefix",
                );
                None
            }
            (None, [op, ..]) => {
                self.key_error(pointer, op, format!("\"{op}\" needs the \"field\" it tests beside it"));
                None
            }
            (Some(_), [first, second, ..]) => {
                self.key_error(
                    pointer,
                    second,
                    format!(
                        "one operator per condition: \"{first}\" and \"{second}\" here; combine conditions with all: [...]"
                    ),
                );
                None
            }
            (Some(field), [op]) => self.condition(pointer, field, op, &map[op.as_str()]),
        }
    }

    fn combinator(&mut self, pointer: &str, name: &str, value: &Value) -> Option<Filter> {
        if name == "not" {
            return self.filter(pointer, value).map(|f| Filter::Not(Box::new(f)));
        }
        let Some(items) = value.as_array().filter(|items| !items.is_empty()) else {
            self.error(pointer, format!("\"{name}\" takes a non-empty list of conditions"));
            return None;
        };
        let inner: Vec<Option<Filter>> =
            items.iter().enumerate().map(|(i, item)| self.filter(&format!("{pointer}/{i}"), item)).collect();
        let inner: Option<Vec<Filter>> = inner.into_iter().collect();
        inner.map(|filters| if name == "all" { Filter::All(filters) } else { Filter::Any(filters) })
    }

    fn condition(&mut self, pointer: &str, field: &Value, op: &str, value: &Value) -> Option<Filter> {
        let field_pointer = format!("{pointer}/field");
        let op_pointer = format!("{pointer}/{op}");
        let Some(text) = field.as_str() else {
            self.error(&field_pointer, format!("\"field\" is a path such as payload.amount, not {}", kind_of(field)));
            return None;
        };
        let field = self.field(&field_pointer, text)?;
        let op = self.op(&op_pointer, op, value)?;
        let types = self.types(&field_pointer, text, &field)?;
        if let Some(types) = types
            && let Some(problem) = mismatch(&op, &types)
        {
            let whose = if field.root == Root::Payload { " by the payload schema" } else { "" };
            self.error(&op_pointer, format!("{text} is {}{whose}; {problem}", shown_types(&types)));
            return None;
        }
        Some(Filter::Test { field, op })
    }

    fn field(&mut self, pointer: &str, text: &str) -> Option<Field> {
        let format = self.format;
        let (first, rest) = match text.split_once('.') {
            Some((first, rest)) => (first, Some(rest)),
            None => (text, None),
        };
        let root = ROOTS.iter().find(|(name, _)| *name == first).map(|(_, root)| *root);
        let Some(root) = root.filter(|_| format.has(first)) else {
            let fields = format.fields();
            let close = suggest::closest(first, fields.iter().copied())
                .map(|c| format!("; did you mean \"{c}\"?"))
                .unwrap_or_default();
            let paths = match format.payload() {
                Some(payload) => format!(" and paths into {payload} ({payload}.amount)"),
                None => String::new(),
            };
            let fields: Vec<&str> = fields.into_iter().filter(|f| *f != "headers").collect();
            self.error(
                pointer,
                format!(
                    "\"{text}\" is not a field of a message of format {format}: a filter reads {}, headers.NAME{paths}{close}",
                    fields.join(", ")
                ),
            );
            return None;
        };
        if root == Root::Header {
            return match rest.filter(|name| !name.is_empty()) {
                Some(name) => Some(Field { root, path: vec![name.to_string()] }),
                None => {
                    self.error(pointer, format!("\"{text}\": name the header, as in headers.x-tenant"));
                    None
                }
            };
        }
        let path: Vec<String> = rest.map(|rest| rest.split('.').map(str::to_string).collect()).unwrap_or_default();
        if root != Root::Payload && !path.is_empty() {
            let whose = format.payload().map(|p| format!("; only {p} does")).unwrap_or_default();
            self.error(pointer, format!("\"{text}\": the message's {first} has no fields{whose}"));
            return None;
        }
        if path.iter().any(String::is_empty) {
            self.error(
                pointer,
                format!("\"{text}\" has an empty step: write {first}.a.b, with no dot doubled or at the end"),
            );
            return None;
        }
        Some(Field { root, path })
    }

    fn op(&mut self, pointer: &str, op: &str, value: &Value) -> Option<Op> {
        let number = |this: &mut Self, value: &Value| -> Option<serde_json::Number> {
            match value {
                Value::Number(n) => this.exact(pointer, n).then(|| n.clone()),
                other => {
                    this.error(pointer, format!("\"{op}\" compares numbers, not {}", kind_of(other)));
                    None
                }
            }
        };
        Some(match op {
            "eq" => Op::Eq(self.scalar(pointer, value)?),
            "in" => {
                let Some(items) = value.as_array().filter(|items| !items.is_empty()) else {
                    self.error(pointer, "\"in\" takes a non-empty list of values");
                    return None;
                };
                let values: Vec<Option<Value>> =
                    items.iter().enumerate().map(|(i, v)| self.scalar(&format!("{pointer}/{i}"), v)).collect();
                Op::In(Values::new(values.into_iter().collect::<Option<Vec<Value>>>()?))
            }
            "gt" => Op::Gt(number(self, value)?),
            "gte" => Op::Gte(number(self, value)?),
            "lt" => Op::Lt(number(self, value)?),
            "lte" => Op::Lte(number(self, value)?),
            "exists" => match value {
                Value::Bool(b) => Op::Exists(*b),
                other => {
                    self.error(pointer, format!("\"exists\" is true or false, not {}", kind_of(other)));
                    return None;
                }
            },
            "prefix" => match value {
                Value::String(s) => Op::Prefix(s.clone()),
                other => {
                    self.error(pointer, format!("\"prefix\" is a string, not {}", kind_of(other)));
                    return None;
                }
            },
            _ => {
                self.error(pointer, format!("unknown operator \"{op}\""));
                return None;
            }
        })
    }

    /// A value `eq` and `in` compare with: a string, number, boolean or null.
    fn scalar(&mut self, pointer: &str, value: &Value) -> Option<Value> {
        match value {
            Value::Array(_) | Value::Object(_) => {
                self.error(pointer, format!("compare with a string, number, boolean or null, not {}", kind_of(value)));
                None
            }
            Value::Number(n) => self.exact(pointer, n).then(|| value.clone()),
            _ => self.not_out_of_range(pointer, value).then(|| value.clone()),
        }
    }

    /// YAML reads a number too large for a float as infinity (`.inf`), which JSON holds as
    /// null, or as a string (`1e400`).
    fn not_out_of_range(&mut self, pointer: &str, value: &Value) -> bool {
        match self.file.infinite_number(pointer, value) {
            Some(text) => {
                self.error(pointer, infinite(&text));
                false
            }
            None => true,
        }
    }

    /// An integer written past what a 64-bit integer holds reads as a float, which could not
    /// tell it from its neighbours: refused rather than compared inexactly.
    fn exact(&mut self, pointer: &str, n: &serde_json::Number) -> bool {
        let Some(text) = self.file.scalar_text(pointer) else { return true };
        let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
        if n.is_f64() && !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit() || b == b'_') {
            self.error(
                pointer,
                format!(
                    "{text} is past the integers a filter compares exactly (-9223372036854775808 to 18446744073709551615); write it as a float ({:e}) to compare approximately",
                    n.as_f64().unwrap_or_default()
                ),
            );
            return false;
        }
        true
    }

    /// The JSON types the field's value can have, when known: the envelope's own, or what the
    /// payload schema says; `Some(None)` when unknown; `None` after an error (the field cannot
    /// be there at all).
    fn types(&mut self, pointer: &str, text: &str, field: &Field) -> Option<Option<Vec<String>>> {
        let fixed = |t: &[&str]| Some(Some(t.iter().map(|s| s.to_string()).collect()));
        match field.root {
            // A null occurred_at or idempotency_key reads as absent: `exists: false` tests it.
            Root::Id
            | Root::Type
            | Root::OccurredAt
            | Root::IdempotencyKey
            | Root::RoutingKey
            | Root::Exchange
            | Root::ContentType
            | Root::Source
            | Root::Subject
            | Root::Time
            | Root::SpecVersion
            | Root::DataContentType
            | Root::Body => return fixed(&["string"]),
            Root::Version => return fixed(&["integer"]),
            // Text or an integer, as the producer set it.
            Root::Header => return Some(None),
            Root::Payload => {}
        }
        let Some(schema) = self.schema else { return Some(None) };
        let steps: Vec<&str> = field.path.iter().map(String::as_str).collect();
        let root = self.format.payload().unwrap_or("payload");
        match reach(schema, schema, &steps, root, Steps::Fields, 0) {
            Ok(leaves) => Some(declared_types(schema, &leaves)),
            Err(why) => {
                self.error(pointer, format!("{text} cannot be in a payload of this queue: {why}"));
                None
            }
        }
    }
}

/// Local `$ref`s are followed at most this deep (a schema may refer to itself).
const MAX_REF_DEPTH: usize = 32;

/// Why no payload the queue's `schema` accepts has anything at `steps` (`["order", "id"]` for
/// `payload.order.id`; `root` names the payload, `payload` or a CloudEvent's `data`), if so:
/// for a template's path, where a step may also index a list (`payload.items.0.sku`), as
/// templates read them.
pub(super) fn ruled_out(schema: &Value, root: &str, steps: &[&str]) -> Option<String> {
    reach(schema, schema, steps, root, Steps::FieldsAndIndexes, 0).err()
}

/// What a step of a path reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Steps {
    /// An object's field only: a filter's path.
    Fields,
    /// A field, or a list's item by its index (`0`): a template's path.
    FieldsAndIndexes,
}

/// The schema nodes that apply to the value at `path` below `node` (`at` names the node, for
/// messages): empty when the schema says nothing of it. `Err(why)` when no value the schema
/// accepts has anything there. Where the schema branches (`anyOf`, `oneOf`), a path any
/// branch allows is allowed, with nothing said of its type.
fn reach<'a>(
    root: &'a Value,
    node: &'a Value,
    path: &[&str],
    at: &str,
    steps: Steps,
    depth: usize,
) -> Result<Vec<&'a Value>, String> {
    if depth > MAX_REF_DEPTH {
        return Ok(Vec::new());
    }
    let node = match node.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix('#')) {
        Some(target) => match root.pointer(target) {
            Some(target) => return reach(root, target, path, at, steps, depth + 1),
            None => return Ok(Vec::new()),
        },
        None => node,
    };
    let map = match node {
        Value::Bool(false) => return Err(format!("the schema allows nothing at {at}")),
        Value::Object(map) => map,
        _ => return Ok(Vec::new()),
    };
    let mut leaves = Vec::new();
    for branch in map.get("allOf").and_then(Value::as_array).into_iter().flatten() {
        leaves.extend(reach(root, branch, path, at, steps, depth + 1)?);
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(branches) = map.get(key).and_then(Value::as_array) {
            let reached: Vec<Result<Vec<&Value>, String>> =
                branches.iter().map(|b| reach(root, b, path, at, steps, depth + 1)).collect();
            if let Some(Err(why)) = reached.iter().find(|r| r.is_err()).filter(|_| reached.iter().all(Result::is_err)) {
                return Err(why.clone());
            }
        }
    }
    let Some((step, rest)) = path.split_first() else {
        leaves.push(node);
        return Ok(leaves);
    };
    let here = format!("{at}.{step}");
    let types = map.get("type").map(type_names);
    let has = |t: &str| types.as_ref().is_some_and(|types| types.iter().any(|x| x == t));
    // A list's item, when the step is an index and the node is a list rather than an object.
    let items = map.contains_key("items") || map.contains_key("prefixItems");
    if steps == Steps::FieldsAndIndexes
        && let Ok(index) = step.parse::<usize>()
        && (has("array") || (types.is_none() && items && !map.contains_key("properties")))
        && !has("object")
    {
        let item = map.get("prefixItems").and_then(|p| p.get(index)).or_else(|| map.get("items"));
        if let Some(item) = item {
            leaves.extend(reach(root, item, rest, &here, steps, depth + 1)?);
        }
        return Ok(leaves);
    }
    if let Some(types) = &types
        && !has("object")
    {
        return Err(format!("{at} is {}, which has no field \"{step}\"", shown_types(types)));
    }
    let properties = map.get("properties").and_then(Value::as_object);
    if let Some(child) = properties.and_then(|p| p.get(*step)) {
        leaves.extend(reach(root, child, rest, &here, steps, depth + 1)?);
        return Ok(leaves);
    }
    if map.get("patternProperties").is_some() {
        // Which patterns match is the validator's business: nothing is said of it here.
        return Ok(leaves);
    }
    match map.get("additionalProperties") {
        Some(Value::Bool(false)) => Err(no_such_property(at, step, properties)),
        Some(extra @ Value::Object(_)) => {
            leaves.extend(reach(root, extra, rest, &here, steps, depth + 1)?);
            Ok(leaves)
        }
        _ => Ok(leaves),
    }
}

fn no_such_property(at: &str, step: &str, properties: Option<&Map<String, Value>>) -> String {
    let known: Vec<&str> = properties.into_iter().flat_map(|p| p.keys()).map(String::as_str).collect();
    let close =
        suggest::closest(step, known.iter().copied()).map(|c| format!("; did you mean \"{c}\"?")).unwrap_or_default();
    let listed = if known.is_empty() { "none".to_string() } else { known.join(", ") };
    format!("the schema allows no field \"{step}\" in {at} (additionalProperties: false; its fields: {listed}){close}")
}

/// The types the schema nodes `leaves` all allow, when any of them says (`integer` within
/// `number`); `None` when none says.
fn declared_types(root: &Value, leaves: &[&Value]) -> Option<Vec<String>> {
    let mut out: Option<Vec<String>> = None;
    for leaf in leaves {
        let leaf =
            leaf.get("$ref").and_then(Value::as_str).and_then(|r| root.pointer(r.strip_prefix('#')?)).unwrap_or(leaf);
        let Some(types) = leaf.get("type").map(type_names) else { continue };
        out = Some(match out {
            None => types,
            Some(before) => before
                .into_iter()
                .filter(|t| types.contains(t) || (t == "integer" && types.iter().any(|u| u == "number")))
                .collect(),
        });
    }
    out
}

fn type_names(t: &Value) -> Vec<String> {
    match t {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items.iter().filter_map(Value::as_str).map(str::to_string).collect(),
        _ => Vec::new(),
    }
}

/// `a string`, `a string or null`, `never anything` (for types that exclude each other).
fn shown_types(types: &[String]) -> String {
    if types.is_empty() {
        return "never anything (its types exclude each other)".into();
    }
    let named: Vec<String> = types
        .iter()
        .map(|t| match t.as_str() {
            "integer" => "an integer".to_string(),
            "array" | "object" => format!("an {t}"),
            "null" => "null".to_string(),
            other => format!("a {other}"),
        })
        .collect();
    named.join(" or ")
}

/// Why `op` can never hold on a value of one of `types`, if so.
fn mismatch(op: &Op, types: &[String]) -> Option<String> {
    let has = |t: &str| types.iter().any(|x| x == t);
    let numeric = has("number") || has("integer");
    let admits = |v: &Value| match v {
        Value::Null => has("null"),
        Value::Bool(_) => has("boolean"),
        Value::String(_) => has("string"),
        Value::Number(n) if n.is_f64() && n.as_f64().is_some_and(|f| f.fract() != 0.0) => has("number"),
        Value::Number(_) => numeric,
        Value::Array(_) | Value::Object(_) => false,
    };
    match op {
        Op::Gt(_) | Op::Gte(_) | Op::Lt(_) | Op::Lte(_) if !numeric => {
            Some("gt, gte, lt and lte compare numbers, so this condition never holds".into())
        }
        Op::Prefix(_) if !has("string") => Some("prefix tests strings, so this condition never holds".into()),
        Op::Eq(v) if !admits(v) => Some(format!("it never equals {v}")),
        Op::In(values) if !values.listed().iter().any(admits) => {
            Some(format!("it never equals any of {}", shown(values)))
        }
        Op::In(values) => values
            .listed()
            .iter()
            .find(|v| !admits(v))
            .map(|v| format!("{v} in the list is never equal to it; leave it out")),
        _ => None,
    }
}

/// An `in:` list for a message: the first few values, and how many more.
fn shown(values: &Values) -> String {
    const SHOWN: usize = 5;
    let listed = values.listed();
    let first: Vec<String> = listed.iter().take(SHOWN).map(Value::to_string).collect();
    match listed.len().saturating_sub(SHOWN) {
        0 => format!("[{}]", first.join(",")),
        more => format!("[{}, ...] ({more} more)", first.join(",")),
    }
}

/// The message for a number written past what a float holds.
pub(super) fn infinite(text: &str) -> String {
    format!("{text} is not a finite number (at most about 1.8e308 either way)")
}

/// What a value is, in words (`a number`, `null`).
pub(super) fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{Filter, Op};

    /// The diagnostics of one pipeline file whose queue `q` binds with `filter` (YAML, written
    /// from column 15 of line 7), beside a payload schema.
    fn diagnostics(filter: &str) -> Vec<(usize, usize, String)> {
        let dir = tempfile::tempdir().expect("tempdir");
        let schema = json!({
            "type": "object",
            "properties": {
                "amount": {"type": "integer"},
                "currency": {"type": "string"},
                "customer": {
                    "type": "object",
                    "properties": {"country": {"type": "string"}},
                    "additionalProperties": false
                },
                "tags": {"type": "array"},
                "note": {"$ref": "#/$defs/text"}
            },
            "$defs": {"text": {"type": "string"}},
            "additionalProperties": false
        });
        std::fs::write(dir.path().join("order.json"), schema.to_string()).expect("write");
        let yaml = format!(
            "version: 1\nexchanges:\n  orders: {{type: topic}}\nqueues:\n  q:\n    payload_schema: order.json\n    bind:\n      - exchange: orders\n        filter: {filter}\n    handler: {{webhook: {{url: \"http://h/x\"}}}}\n"
        );
        std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
        let validation = super::super::load(&[dir.path().to_path_buf()]);
        validation.diagnostics.into_iter().map(|d| (d.line, d.column, d.message)).collect()
    }

    /// Issue 31 item 6: validation grew with the square of an `in:` list (47.8 s at 20,000
    /// values, 114 s at 40,000): each value's text was found by reading the file from its start
    /// to the value's line, then along the line. 40,000 values on one line, and as many one a
    /// line, numbers and strings, are loaded here (the suite's timeout bounds how long).
    #[test]
    fn filters_of_40000_values_load() {
        const N: usize = 40_000;
        let value = |i: usize| if i.is_multiple_of(2) { i.to_string() } else { format!("c{i}") };
        let flow: Vec<String> = (0..N).map(value).collect();
        let block: String = (0..N).map(|i| format!("          - {}\n", value(i))).collect();
        let queue = |name: &str, list: &str| {
            format!(
                "version: 1\nqueues:\n  {name}:\n    bind:\n      - exchange: amq.topic\n        filter:\n          \
                 field: payload.customer\n          in:{list}\n    handler: {{webhook: {{url: \"http://h/x\"}}}}\n"
            )
        };
        // Two files: a pipeline file holds at most a MiB.
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("flow.yaml"), queue("flow", &format!(" [{}]", flow.join(", ")))).expect("write");
        std::fs::write(dir.path().join("block.yaml"), queue("block", &format!("\n{}", block.trim_end())))
            .expect("write");
        let validation = super::super::load(&[dir.path().to_path_buf()]);
        let config = validation.config.unwrap_or_else(|| panic!("{:?}", validation.diagnostics));
        assert_eq!(config.queues.len(), 2);
        for binding in config.queues.values().flat_map(|q| &q.bindings) {
            let Some(Filter::Test { op: Op::In(values), .. }) = &binding.filter else { panic!("{binding:?}") };
            assert_eq!(values.listed().len(), N);
            assert!(values.contains(&json!(39_998)) && values.contains(&json!("c39999")));
            assert!(!values.contains(&json!("39998")) && !values.contains(&json!(N)));
        }
    }

    #[test]
    fn valid_filters_compile() {
        let filters = [
            "{field: payload.amount, gte: 100}",
            "{all: [{field: payload.amount, gte: 100}, {field: type, in: [a, b]}, {not: {field: payload.customer.country, exists: true}}]}",
            "{any: [{field: payload.currency, eq: EUR}, {field: payload.note, prefix: \"x\"}]}",
            "{field: payload.amount, eq: 1.0}",
            "{field: occurred_at, exists: false}",
            "{field: version, lt: 3}",
            "{field: payload.amount, lte: 1e308}",
            "{field: payload.currency, in: [EUR, \"1e400\"]}",
            "{field: payload.tags, exists: true}",
            // Issue 34: the broker's metadata, in every format (a header's name may hold dots).
            "{field: headers.x-tenant, eq: acme}",
            "{field: headers.x.y, exists: true}",
            "{field: routing_key, prefix: order.}",
            "{field: exchange, in: [orders]}",
            "{field: content_type, eq: application/json}",
        ];
        for filter in filters {
            assert_eq!(diagnostics(filter), [], "{filter}");
        }
    }

    /// Issue 24: malformed filters and fields the payload schema rules out are errors at their
    /// node (line 9 holds the filter, which starts at column 17).
    #[test]
    fn malformed_filters_are_errors_at_their_node() {
        let cases = [
            (
                "{field: payload.amout, gte: 100}",
                (9, 25),
                "payload.amout cannot be in a payload of this queue: the schema allows no field \"amout\" in payload (additionalProperties: false; its fields: amount, currency, customer, note, tags); did you mean \"amount\"?",
            ),
            (
                "{field: payload.customer.city, eq: Paris}",
                (9, 25),
                "payload.customer.city cannot be in a payload of this queue: the schema allows no field \"city\" in payload.customer (additionalProperties: false; its fields: country)",
            ),
            (
                "{field: payload.currency.code, eq: EUR}",
                (9, 25),
                "payload.currency.code cannot be in a payload of this queue: payload.currency is a string, which has no field \"code\"",
            ),
            (
                "{field: payload.currency, gte: 3}",
                (9, 48),
                "payload.currency is a string by the payload schema; gt, gte, lt and lte compare numbers, so this condition never holds",
            ),
            (
                "{field: payload.note, gt: 3}",
                (9, 43),
                "payload.note is a string by the payload schema; gt, gte, lt and lte compare numbers, so this condition never holds",
            ),
            (
                "{field: payload.amount, eq: \"100\"}",
                (9, 45),
                "payload.amount is an integer by the payload schema; it never equals \"100\"",
            ),
            ("{field: headers, eq: acme}", (9, 25), "\"headers\": name the header, as in headers.x-tenant"),
            (
                "{field: routing_key.x, eq: a}",
                (9, 25),
                "\"routing_key.x\": the message's routing_key has no fields; only payload does",
            ),
            (
                "{field: source, eq: /orders}",
                (9, 25),
                "\"source\" is not a field of a message of format envelope: a filter reads id, type, idempotency_key, occurred_at, routing_key, exchange, content_type, version, payload, headers.NAME and paths into payload (payload.amount)",
            ),
            (
                "{field: type, gte: 3}",
                (9, 36),
                "type is a string; gt, gte, lt and lte compare numbers, so this condition never holds",
            ),
            (
                "{field: paylod.amount, gte: 3}",
                (9, 25),
                "\"paylod.amount\" is not a field of a message of format envelope: a filter reads id, type, idempotency_key, occurred_at, routing_key, exchange, content_type, version, payload, headers.NAME and paths into payload (payload.amount); did you mean \"payload\"?",
            ),
            ("{field: occurred_at, eq: null}", (9, 42), "occurred_at is a string; it never equals null"),
            (
                "{field: type.name, eq: a}",
                (9, 25),
                "\"type.name\": the message's type has no fields; only payload does",
            ),
            (
                "{field: payload..amount, eq: 1}",
                (9, 25),
                "\"payload..amount\" has an empty step: write payload.a.b, with no dot doubled or at the end",
            ),
            (
                "{field: payload.amount}",
                (9, 18),
                "a condition without an operator: add one of eq, in, gt, gte, lt, lte, exists, prefix",
            ),
            ("{gte: 3}", (9, 18), "\"gte\" needs the \"field\" it tests beside it"),
            (
                "{field: payload.amount, gte: 3, lt: 9}",
                (9, 49),
                "one operator per condition: \"gte\" and \"lt\" here; combine conditions with all: [...]",
            ),
            (
                "{all: [{field: type, eq: a}], field: type}",
                (9, 47),
                "\"all\" stands alone in its object; put \"field\" in a condition of its own inside it",
            ),
            ("{field: payload.amount, gtee: 3}", (9, 41), "unknown key \"gtee\"; did you mean \"gte\"?"),
            ("{field: payload.amount, gte: \"3\"}", (9, 46), "\"3\" is not of type \"number\""),
            (
                "{field: payload.amount, gte: 1e400}",
                (9, 46),
                "1e400 is not a finite number (at most about 1.8e308 either way)",
            ),
            (
                "{field: payload.amount, eq: -1e400}",
                (9, 45),
                "-1e400 is not a finite number (at most about 1.8e308 either way)",
            ),
            (
                "{field: payload.amount, in: [1, 99999999999999999999999]}",
                (9, 49),
                "99999999999999999999999 is too large: integers here are at most 64 bits (-9223372036854775808 to 18446744073709551615); write a float (1e23) or quote it as a string",
            ),
            ("{any: []}", (9, 23), "[] has less than 1 item"),
            ("{}", (9, 17), "{} has less than 1 property"),
            (
                "{field: payload.amount, in: [1, 9999999999999999999999999999999999999999999]}",
                (9, 49),
                "9999999999999999999999999999999999999999999 is past the integers a filter compares exactly (-9223372036854775808 to 18446744073709551615); write it as a float (1e43) to compare approximately",
            ),
            (
                "{field: payload.amount, in: [1, .inf]}",
                (9, 49),
                ".inf is not a finite number (at most about 1.8e308 either way)",
            ),
        ];
        let wrong: Vec<String> = cases
            .into_iter()
            .filter_map(|(filter, (line, column), message)| {
                let got = diagnostics(filter);
                (got != [(line, column, message.to_string())]).then(|| format!("{filter}: {got:?}"))
            })
            .collect();
        assert!(wrong.is_empty(), "{wrong:#?}");
    }
}
