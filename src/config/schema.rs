//! The JSON Schema of pipeline files: embedded in the binary (`sluice schema` prints it) and
//! checked against every file, each violation reported at its node.
//!
//! Only structural checks live in the schema; cross-file and semantic checks are in `compile`.

use std::sync::LazyLock;

use jsonschema::error::ValidationErrorKind;
use jsonschema::{ValidationError, Validator};
use serde_json::Value;

use super::diagnostic::{Diagnostic, Severity};
use super::source::{SourceFile, escape_token};

/// The schema text, as committed in `schemas/pipeline.schema.json`.
pub const TEXT: &str = include_str!("../../schemas/pipeline.schema.json");

static SCHEMA: LazyLock<Value> =
    LazyLock::new(|| serde_json::from_str(TEXT).expect("the embedded schema is valid JSON (tested)"));

static VALIDATOR: LazyLock<Validator> =
    LazyLock::new(|| jsonschema::draft202012::new(&SCHEMA).expect("the embedded schema compiles (tested)"));

/// Every schema violation in one file.
pub fn check(file: &SourceFile) -> Vec<Diagnostic> {
    let mut out: Vec<Diagnostic> = VALIDATOR.iter_errors(&file.value).flat_map(|e| diagnostics(file, &e)).collect();
    out.sort_by_key(|d| (d.line, d.column));
    out.dedup();
    out
}

fn diagnostics(file: &SourceFile, error: &ValidationError<'_>) -> Vec<Diagnostic> {
    let pointer = error.instance_path().as_str().to_string();
    let schema_path = error.schema_path().as_str();
    match error.kind() {
        ValidationErrorKind::AdditionalProperties { unexpected } => unexpected
            .iter()
            .map(|key| {
                let at = format!("{pointer}/{}", escape_token(key));
                let mut message = format!("unknown key \"{key}\"");
                if let Some(known) = closest_known(schema_path, key) {
                    message.push_str(&format!("; did you mean \"{known}\"?"));
                }
                file.diag_at(file.key_pos(&at), Severity::Error, &at, message)
            })
            .collect(),
        // The error is about the object; the inner error's instance is the offending key.
        ValidationErrorKind::PropertyNames { error: inner } => {
            let key = inner.instance().as_str().unwrap_or_default();
            let at = format!("{pointer}/{}", escape_token(key));
            let message = if inner.schema_path().as_str().starts_with("/$defs/name/") {
                format!(
                    "invalid name \"{key}\": names start with a letter or digit, then letters, digits, '_', '.', ':' or '-', at most 200 characters"
                )
            } else {
                format!("invalid name \"{key}\": {inner}")
            };
            vec![file.diag_at(file.key_pos(&at), Severity::Error, &at, message)]
        }
        ValidationErrorKind::MinProperties { .. } | ValidationErrorKind::MaxProperties { .. }
            if schema_path.starts_with("/$defs/handler") || schema_path.contains("/handler/") =>
        {
            vec![file.diag(Severity::Error, &pointer, "a handler has exactly one of \"webhook\" or \"command\"")]
        }
        ValidationErrorKind::Pattern { .. } if schema_path.contains("duration") => {
            let message = format!("{} is not a duration such as 250ms, 10s, 5m or 24h", error.instance());
            vec![file.diag(Severity::Error, &pointer, message)]
        }
        ValidationErrorKind::Pattern { .. } if schema_path.contains("failure_rate") => {
            let message = format!("{} is not a percentage from 1% to 100%", error.instance());
            vec![file.diag(Severity::Error, &pointer, message)]
        }
        ValidationErrorKind::Required { property } => {
            let message = format!("missing required key {property}");
            vec![file.diag(Severity::Error, &pointer, message)]
        }
        _ => vec![file.diag(Severity::Error, &pointer, error.to_string())],
    }
}

/// The known property closest to a misspelt one, from the schema object the error came from.
fn closest_known(schema_path: &str, key: &str) -> Option<String> {
    let object = schema_path.strip_suffix("/additionalProperties")?;
    let properties = SCHEMA.pointer(object)?.get("properties")?.as_object()?;
    properties
        .keys()
        .map(|known| (edit_distance(known, key), known))
        .filter(|(d, known)| *d <= known.len().max(key.len()) / 3 + 1)
        .min()
        .map(|(_, known)| known.clone())
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_is_valid_draft_2020_12() {
        assert!(jsonschema::meta::is_valid(&SCHEMA));
        LazyLock::force(&VALIDATOR);
    }

    #[test]
    fn invalid_names_are_reported_at_the_key() {
        let text = "version: 1\nqueues:\n  ok:\n    handler: {command: {program: x}}\n  -bad:\n    handler: {command: {program: x, env: {1X: a}}}\n";
        let file = crate::config::source::parse(std::path::Path::new("t.yaml"), text.to_string()).unwrap();
        let got: Vec<(usize, usize, String)> =
            check(&file).into_iter().map(|d| (d.line, d.column, d.pointer)).collect();
        assert_eq!(
            got,
            [(5, 3, "/queues/-bad".to_string()), (6, 43, "/queues/-bad/handler/command/env/1X".to_string())]
        );
        assert!(check(&file)[0].message.starts_with("invalid name \"-bad\": names start with"));
        assert!(check(&file)[1].message.starts_with("invalid name \"1X\": \"1X\" does not match"));
    }

    #[test]
    fn edit_distances() {
        for (a, b, d) in [("concurrency", "concurency", 1), ("retry", "retyr", 2), ("", "abc", 3), ("same", "same", 0)]
        {
            assert_eq!(edit_distance(a, b), d, "{a} {b}");
        }
    }
}
