//! The configuration reference: every key of the pipeline schema with its type, its default and
//! its description, walked out of `schemas/pipeline.schema.json`. `sluice schema --reference`
//! prints it as the README's table (a test keeps the two equal), so the schema stays the one
//! description of the format.

use serde_json::Value;

/// One key of a pipeline file.
#[derive(Debug)]
pub struct Key<'a> {
    /// From the top of the file: `["queues", "<name>", "retry", "max_attempts"]`; `[]` marks
    /// the items of a list (`bind[]`).
    pub path: Vec<String>,
    /// The key's own schema, as written (its `$ref` not followed).
    pub schema: &'a Value,
}

impl Key<'_> {
    pub fn description(&self) -> Option<&str> {
        self.schema.get("description").and_then(Value::as_str)
    }

    pub fn default(&self) -> Option<&Value> {
        self.schema.get("default")
    }

    /// The path as the table shows it: `queues.<name>.bind[].routing_key`.
    pub fn dotted(&self) -> String {
        let mut out = String::new();
        for step in &self.path {
            if !out.is_empty() && step != "[]" {
                out.push('.');
            }
            out.push_str(step);
        }
        out
    }
}

/// The schema a `$ref` (`#/$defs/NAME`) names, or `node` itself.
fn resolve<'a>(root: &'a Value, node: &'a Value) -> &'a Value {
    node.get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix("#/$defs/"))
        .and_then(|name| root.get("$defs")?.get(name))
        .unwrap_or(node)
}

/// Every key of the schema `root`, each followed by the keys inside it.
pub fn keys(root: &Value) -> Vec<Key<'_>> {
    let mut out = Vec::new();
    walk(root, root, &[], &mut Vec::new(), &mut out);
    out
}

/// Walks the keys inside `node`; `inside` names the definitions walked into on the way, which
/// are not walked into again (a filter holds filters: the table lists their keys once).
fn walk<'a>(root: &'a Value, node: &'a Value, path: &[String], inside: &mut Vec<&'a str>, out: &mut Vec<Key<'a>>) {
    let definition = node.get("$ref").and_then(Value::as_str);
    if let Some(name) = definition {
        if inside.contains(&name) {
            return;
        }
        inside.push(name);
    }
    let node = resolve(root, node);
    let named = |prefix: &[String], step: &str| -> Vec<String> {
        prefix.iter().cloned().chain(std::iter::once(step.to_string())).collect()
    };
    for (name, schema) in node.get("properties").and_then(Value::as_object).into_iter().flatten() {
        let here = named(path, name);
        out.push(Key { path: here.clone(), schema });
        walk(root, schema, &here, inside, out);
        let inner = resolve(root, schema);
        if let Some(items) = inner.get("items") {
            walk(root, items, &named(&here, "[]"), inside, out);
        }
        if let Some(values) = inner.get("additionalProperties").filter(|v| v.is_object()) {
            walk(root, values, &named(&here, "<name>"), inside, out);
        }
    }
    for (pattern, schema) in node.get("patternProperties").and_then(Value::as_object).into_iter().flatten() {
        let name = pattern.trim_start_matches('^').to_string() + "*";
        out.push(Key { path: named(path, &name), schema });
    }
    if definition.is_some() {
        inside.pop();
    }
}

/// What a key holds, in words: `duration`, `integer or object`, `` `direct`, `fanout` ``.
fn kind(root: &Value, schema: &Value) -> String {
    if let Some(value) = schema.get("const") {
        return format!("`{value}`");
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        let values: Vec<String> = values.iter().map(|v| format!("`{}`", v.as_str().unwrap_or_default())).collect();
        return values.join(", ");
    }
    if let Some(name) = schema.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix("#/$defs/")) {
        return match name {
            "duration" => "duration".into(),
            "template" => "template".into(),
            "templateMap" => "map of templates".into(),
            "envName" => "variable name".into(),
            "name" => "name".into(),
            "filter" => "filter".into(),
            _ => kind(root, resolve(root, schema)),
        };
    }
    if let Some(choices) = schema.get("oneOf").and_then(Value::as_array) {
        return choices.iter().map(|c| kind(root, c)).collect::<Vec<_>>().join(" or ");
    }
    match schema.get("type") {
        Some(Value::Array(types)) => types.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(" or "),
        Some(Value::String(t)) if t == "array" => match schema.get("items") {
            Some(items) => format!("list of {}", kind(root, items)),
            None => "list".into(),
        },
        Some(Value::String(t)) if t == "object" && schema.get("additionalProperties").is_some_and(Value::is_object) => {
            "map".into()
        }
        Some(Value::String(t)) => t.clone(),
        _ => "any".into(),
    }
}

/// Text for a Markdown table cell: no column break, no HTML tag, no emphasis.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('<', "&lt;").replace('*', "\\*")
}

/// The README's table: one row per key, in the schema's order.
pub fn markdown(root: &Value) -> String {
    let mut out = String::from("| key | type | default | description |\n| --- | --- | --- | --- |\n");
    for key in keys(root) {
        let default = match key.default() {
            Some(Value::String(text)) if !text.is_empty() => format!("`{text}`"),
            Some(value) => format!("`{value}`"),
            None => String::new(),
        };
        out.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            key.dotted(),
            kind(root, key.schema),
            default,
            cell(key.description().unwrap_or_default()),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 21: every key says what it is for.
    #[test]
    fn every_key_has_a_description() {
        let schema = super::super::schema::value();
        let missing: Vec<String> =
            keys(schema).iter().filter(|k| k.description().is_none_or(str::is_empty)).map(Key::dotted).collect();
        assert!(missing.is_empty(), "keys without a description: {missing:?}");
        assert!(keys(schema).len() > 50, "the walk reaches every key");
    }

    /// Sets `value` at `path` (steps of a queue's definition, `[]` the first item of a list)
    /// in `node`, making objects on the way.
    fn set(node: &mut Value, path: &[String], value: Value) {
        let Some((step, rest)) = path.split_first() else {
            *node = value;
            return;
        };
        let child = if step == "[]" {
            node.get_mut(0).expect("the base queue has an item there")
        } else {
            node.as_object_mut().expect("an object on the way").entry(step.clone()).or_insert(serde_json::json!({}))
        };
        set(child, rest, value);
    }

    /// The queue `work` compiled from `definition`, as `Debug` shows it, without the source
    /// and the text it keeps (which are the definition as written, and differ by construction).
    fn compiled(definition: &Value) -> String {
        let dir = tempfile::tempdir().expect("tempdir");
        let file =
            serde_json::json!({"version": 1, "exchanges": {"ev": {"type": "topic"}}, "queues": {"work": definition}});
        std::fs::write(dir.path().join("p.yaml"), file.to_string()).expect("write");
        let validation = super::super::load(&[dir.path().to_path_buf()]);
        let mut config = validation.config.unwrap_or_else(|| panic!("{definition}: {:?}", validation.diagnostics));
        let queue = config.queue_mut("work").expect("work");
        queue.source = Value::Null;
        queue.written = Value::Null;
        queue.file = Default::default();
        format!("{queue:?}")
    }

    /// Issue 21: each default the schema states is the code's: writing it changes nothing.
    #[test]
    fn the_schema_defaults_are_the_code_defaults() {
        let schema = super::super::schema::value();
        let mut checked = Vec::new();
        for key in keys(schema) {
            let Some(default) = key.default() else { continue };
            let path = key.path.strip_prefix(&["queues".to_string(), "<name>".to_string()][..]);
            let path = path.unwrap_or_else(|| panic!("{}: a default outside a queue, not checked here", key.dotted()));
            let mut base =
                serde_json::json!({"bind": [{"exchange": "ev"}], "handler": {"webhook": {"url": "http://h/x"}}});
            if path.starts_with(&["handler".to_string(), "command".to_string()]) {
                base["handler"] = serde_json::json!({"command": {"program": "/bin/true"}});
            }
            if path.starts_with(&["handler".to_string(), "webhook".to_string(), "auth".to_string()]) {
                base["handler"]["webhook"]["auth"] = serde_json::json!({"oauth2": {
                    "token_url": "https://idp.example/token", "client_id": "c", "client_secret_env": "S"
                }});
            }
            if path.first().is_some_and(|s| s == "on_dead_letter") {
                base["order_by"] = serde_json::json!("{{payload.k}}");
            }
            if path.first().is_some_and(|s| s == "concurrency") && path.len() > 1 {
                base["concurrency"] = serde_json::json!({"max": 4});
            }
            let mut given = base.clone();
            set(&mut given, path, default.clone());
            assert_eq!(compiled(&given), compiled(&base), "{} = {default}", key.dotted());
            checked.push(key.dotted());
        }
        assert!(checked.len() > 20, "{checked:?}");
    }
}
