//! The JSON Schemas of pipeline files and of test files (`*.test.yaml`): embedded in the binary
//! (`sluice schema [--tests]` prints them) and checked against every file, each violation
//! reported at its node, in words (allowed values, "did you mean", what to write instead).
//!
//! Only structural checks live in the schemas; cross-file and semantic checks are in `compile`
//! (and, for test files, in `testing`).

use std::sync::LazyLock;

use jsonschema::error::ValidationErrorKind;
use jsonschema::{ValidationError, Validator};
use serde_json::Value;

use super::diagnostic::{Diagnostic, Severity};
use super::source::{SourceFile, escape_token};
use super::suggest;

/// The schema text, as committed in `schemas/pipeline.schema.json`.
pub const TEXT: &str = include_str!("../../schemas/pipeline.schema.json");

/// The schema of test files (`sluice schema --tests`), as committed in `schemas/test.schema.json`.
pub const TESTS_TEXT: &str = include_str!("../../schemas/test.schema.json");

/// A schema and its compiled validator.
struct Schema {
    value: Value,
    validator: Validator,
}

impl Schema {
    fn new(text: &str) -> Schema {
        let value: Value = serde_json::from_str(text).expect("the embedded schemas are valid JSON (tested)");
        let validator = jsonschema::draft202012::new(&value).expect("the embedded schemas compile (tested)");
        Schema { value, validator }
    }

    /// Every violation in one file, each at its node.
    fn check(&self, file: &SourceFile) -> Vec<Diagnostic> {
        let mut out: Vec<Diagnostic> =
            self.validator.iter_errors(&file.value).flat_map(|e| diagnostics(&self.value, file, &e)).collect();
        out.sort_by_key(|d| (d.line, d.column));
        out.dedup();
        out
    }
}

static PIPELINE: LazyLock<Schema> = LazyLock::new(|| Schema::new(TEXT));

static TESTS: LazyLock<Schema> = LazyLock::new(|| Schema::new(TESTS_TEXT));

/// The pipeline schema as a value.
pub fn value() -> &'static Value {
    &PIPELINE.value
}

/// The nodes of a pipeline file the schema refuses (JSON pointers): an unknown key or a bad
/// name is the key's node, a missing key none (there is nothing to leave out).
pub fn invalid_nodes(file: &SourceFile) -> Vec<String> {
    let mut out: Vec<String> = PIPELINE
        .validator
        .iter_errors(&file.value)
        .flat_map(|error| {
            let pointer = error.instance_path().as_str().to_string();
            match error.kind() {
                ValidationErrorKind::AdditionalProperties { unexpected } => {
                    unexpected.iter().map(|key| format!("{pointer}/{}", escape_token(key))).collect()
                }
                ValidationErrorKind::PropertyNames { error: inner } => {
                    vec![format!("{pointer}/{}", escape_token(inner.instance().as_str().unwrap_or_default()))]
                }
                ValidationErrorKind::Required { .. } => Vec::new(),
                _ => vec![pointer],
            }
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Every schema violation in one pipeline file.
pub fn check(file: &SourceFile) -> Vec<Diagnostic> {
    PIPELINE.check(file)
}

/// Every schema violation in one test file.
pub fn check_tests(file: &SourceFile) -> Vec<Diagnostic> {
    TESTS.check(file)
}

fn diagnostics(schema: &Value, file: &SourceFile, error: &ValidationError<'_>) -> Vec<Diagnostic> {
    let pointer = error.instance_path().as_str().to_string();
    let schema_path = error.schema_path().as_str();
    match error.kind() {
        ValidationErrorKind::AdditionalProperties { unexpected } => unexpected
            .iter()
            .map(|key| {
                let at = format!("{pointer}/{}", escape_token(key));
                let mut message = format!("unknown key \"{key}\"");
                if let Some(known) = closest_known(schema, schema_path, key) {
                    message.push_str(&format!("; did you mean \"{known}\"?"));
                }
                file.diag_at(file.key_pos(&at), Severity::Error, &at, message)
            })
            .collect(),
        // The error is about the object; the inner error's instance is the offending key.
        ValidationErrorKind::PropertyNames { error: inner } => {
            let key = inner.instance().as_str().unwrap_or_default();
            let at = format!("{pointer}/{}", escape_token(key));
            let inner_path = inner.schema_path().as_str();
            // The rule keys' messages come from the parsers `compile` uses, which say what is wrong.
            let rule_key = if inner_path.starts_with("/$defs/statusKey/") {
                super::rules::status_key(key).err()
            } else if inner_path.starts_with("/$defs/exitKey/") {
                super::rules::exit_key(key).err()
            } else {
                None
            };
            let message = if let Some(message) = rule_key {
                message
            } else if inner_path.starts_with("/$defs/name/") {
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
            let text = error.instance().as_str().unwrap_or_default();
            vec![file.diag(Severity::Error, &pointer, super::duration_problem(text))]
        }
        ValidationErrorKind::Pattern { .. } if pointer.ends_with("/rate_limit") => {
            let text = error.instance().as_str().unwrap_or_default();
            vec![file.diag(Severity::Error, &pointer, rate_problem(text))]
        }
        ValidationErrorKind::Enum { options } => {
            let allowed: Vec<&str> = options.as_array().into_iter().flatten().filter_map(Value::as_str).collect();
            let mut message = format!("{} is not one of {}", error.instance(), allowed.join(", "));
            if let Some(close) =
                error.instance().as_str().and_then(|found| suggest::closest(found, allowed.iter().copied()))
            {
                message.push_str(&format!("; did you mean \"{close}\"?"));
            }
            vec![file.diag(Severity::Error, &pointer, message)]
        }
        ValidationErrorKind::Pattern { .. } if schema_path.contains("failure_rate") => {
            let message = format!("{} is not a percentage from 1% to 100%", error.instance());
            vec![file.diag(Severity::Error, &pointer, message)]
        }
        ValidationErrorKind::Type { .. } if let Some(text) = file.infinite_number(&pointer, error.instance()) => {
            vec![file.diag(Severity::Error, &pointer, super::filter::infinite(&text))]
        }
        // `${Y}` set to `~` is null, as `~` written there would be: say where the null came from.
        ValidationErrorKind::Type { .. }
            if let Some(s) = file.substitution(&pointer)
                && !error.instance().is_string() =>
        {
            let reads = super::filter::kind_of(error.instance());
            let message = format!("{error} ({} is \"{}\" here, which YAML reads as {reads})", s.written, s.value);
            vec![file.diag(Severity::Error, &pointer, message)]
        }
        ValidationErrorKind::Required { property } => {
            let message = format!("missing required key {property}");
            vec![file.diag(Severity::Error, &pointer, message)]
        }
        _ => vec![file.diag(Severity::Error, &pointer, error.to_string())],
    }
}

/// What is wrong with a rate limit the schema refused, in words.
fn rate_problem(text: &str) -> String {
    let count = text.split_once('/').map_or(text, |(n, _)| n);
    if !count.is_empty() && count.bytes().all(|b| b == b'0') {
        return format!("rate limit \"{text}\" must be positive: at least 1 per hour (1/h)");
    }
    format!(
        "\"{text}\" is not a rate such as 20/s, 100/m or 5000/h (a whole number of calls per second, minute or hour)"
    )
}

/// The known property closest to a misspelt one, from the schema object the error came from.
fn closest_known(schema: &Value, schema_path: &str, key: &str) -> Option<String> {
    let object = schema_path.strip_suffix("/additionalProperties")?;
    let properties = schema.pointer(object)?.get("properties")?.as_object()?;
    suggest::closest(key, properties.keys().map(String::as_str)).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemas_are_valid_draft_2020_12() {
        for schema in [&PIPELINE, &TESTS] {
            assert!(jsonschema::meta::is_valid(&schema.value));
        }
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
}
