//! The fixtures under `tests/fixtures/`: every invalid one reports exactly its `.expected`
//! diagnostics, and the valid directory loads, resolves its defaults and uses every key and
//! enum value of the schema.

use crate::util;

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use sluice::config::{
    self, Backoff, ExchangeKind, Filter, Handler, Jitter, QueueKind, RateLimit, Severity, StdinMode, Validation,
};
use sluice::handler::rules::{Action, Key, Rules};
use util::{Expected, Fixture, Shown};

/// What a fixture reported, if it is not exactly what it expects.
fn mismatch(fixture: &Fixture, validation: &Validation) -> Option<String> {
    let got = &validation.diagnostics;
    let same = got.len() == fixture.expected.len()
        && fixture.expected.iter().zip(got).all(|(e, d)| e.matches(d, &fixture.path));
    let mut problems = Vec::new();
    if !same {
        let expected: Vec<String> = fixture.expected.iter().map(|e| format!("    {e}")).collect();
        let shown: Vec<String> = got.iter().map(|d| format!("    {}", Shown(d, &fixture.path))).collect();
        problems.push(format!("  expected:\n{}\n  reported:\n{}", expected.join("\n"), shown.join("\n")));
    }
    // Warnings alone must leave a usable config; any error must leave none.
    if fixture.warnings_only() != validation.config.is_some() {
        problems.push(format!("  config is {}", if validation.config.is_some() { "Some" } else { "None" }));
    }
    (!problems.is_empty()).then(|| format!("{}:\n{}", fixture.path.display(), problems.join("\n")))
}

#[test]
fn invalid_fixtures_report_exactly_their_expected_diagnostics() {
    let fixtures = util::invalid_fixtures();
    assert!(fixtures.len() >= 28, "only {} invalid fixtures", fixtures.len());
    let failures: Vec<String> =
        fixtures.iter().filter_map(|f| mismatch(f, &config::load(std::slice::from_ref(&f.path)))).collect();
    assert!(failures.is_empty(), "{} of {} fixtures differ:\n{}", failures.len(), fixtures.len(), failures.join("\n"));
}

#[test]
fn directory_fixtures_hold_several_files() {
    for fixture in util::invalid_fixtures().iter().filter(|f| f.path.is_dir()) {
        let files = util::yaml_files(&fixture.path);
        assert!(files.len() >= 2, "{}: a directory fixture is about several files", fixture.path.display());
        for e in &fixture.expected {
            let file = e.file.as_deref().unwrap_or_else(|| panic!("{}: lines name their file", fixture.name));
            assert!(files.contains(&fixture.path.join(file)), "{}: no file {file}", fixture.name);
        }
    }
}

#[test]
fn expected_lines_parse_strictly() {
    let e = Expected::parse("dir/a.yml:12:7 warning /queues/my queue/x | some | text").unwrap();
    assert_eq!(e.file.as_deref(), Some("dir/a.yml"));
    assert_eq!((e.line, e.column, e.severity), (12, 7, Severity::Warning));
    assert_eq!((e.pointer.as_str(), e.fragment.as_str()), ("/queues/my queue/x", "some | text"));
    assert_eq!(Expected::parse("3:1 error - | m").unwrap().pointer, "");
    for bad in [
        "3:1 error - m",
        "3 error - | m",
        "3:1 fatal - | m",
        "3:1 error queues | m",
        "3:1 error - | ",
        "3:x error - | m",
    ] {
        assert!(Expected::parse(bad).is_err(), "{bad:?} should not parse");
    }
}

#[test]
fn fixture_files_start_with_the_schema_header() {
    let files = util::yaml_files(Path::new("tests/fixtures"));
    assert!(files.len() > 30, "{files:?}");
    let problems: Vec<String> = files.iter().filter_map(|f| util::check_schema_header(f).err()).collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

fn load_valid() -> config::Config {
    let validation = config::load(&[PathBuf::from(util::VALID)]);
    let errors: Vec<String> =
        validation.diagnostics.iter().filter(|d| d.severity == Severity::Error).map(|d| d.headline()).collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    validation.config.expect("no errors, so a config")
}

#[test]
fn valid_fixtures_warn_only_about_the_environment_and_jitter() {
    let validation = config::load(&[PathBuf::from(util::VALID)]);
    let got: Vec<(String, Severity, String)> = validation
        .diagnostics
        .iter()
        .map(|d| (d.file.strip_prefix(util::VALID).unwrap().display().to_string(), d.severity, d.pointer.clone()))
        .collect();
    let warning = |file: &str, pointer: &str| (file.to_string(), Severity::Warning, pointer.to_string());
    assert_eq!(
        got,
        [
            // One anchor, merged into two queues: reported once (issue 14).
            warning("billing/invoices.yml", "/queues/billing.invoice/retry/jitter"),
            warning("billing/invoices.yml", "/queues/billing.invoice/handler/webhook/headers/Authorization"),
            warning("billing/invoices.yml", "/queues/billing.lookup/handler/webhook/auth/oauth2/client_secret_env"),
            warning("orders.yaml", "/queues/orders.charge/handler/webhook/signing/secret_env"),
        ]
    );
}

#[test]
fn valid_fixtures_resolve_names_defaults_and_durations() {
    let config = load_valid();
    let kinds: Vec<(&str, ExchangeKind)> = config.exchanges.values().map(|e| (e.name.as_str(), e.kind)).collect();
    assert_eq!(
        kinds,
        [
            ("broadcasts", ExchangeKind::Fanout),
            ("orders", ExchangeKind::Topic),
            ("payments", ExchangeKind::Direct),
            ("routing.headers", ExchangeKind::Headers),
        ]
    );
    let names: Vec<&str> = config.queues.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "billing.cleanup",
            "billing.invoice",
            "billing.lookup",
            "media.archive",
            "media.resize",
            "media.thumbnail",
            "orders.audit",
            "orders.charge",
        ]
    );

    let charge = &config.queues["orders.charge"];
    assert_eq!(charge.kind, QueueKind::Quorum);
    assert_eq!(charge.max_length, Some(100_000));
    let Some(Filter::Any(conditions)) = &charge.bindings[0].filter else { panic!("a filter of any: {charge:?}") };
    assert_eq!(conditions.len(), 6);
    assert_eq!(charge.bindings[1].filter, None);
    assert_eq!(charge.concurrency.get(), 8);
    assert_eq!(charge.rate_limit, Some(RateLimit { count: NonZeroU32::new(50).unwrap(), per: Duration::from_secs(1) }));
    assert_eq!(charge.dead_letter, "orders.charge.failed");
    assert!(charge.payload_schema.as_ref().unwrap().validator.is_valid(&serde_json::json!({"order_id": 7})));
    assert!(!charge.payload_schema.as_ref().unwrap().validator.is_valid(&serde_json::json!({"order_id": 0})));
    // Merged from the anchor, with max_attempts overridden.
    assert_eq!(charge.retry.max_attempts.get(), 4);
    assert_eq!(charge.retry.initial, Duration::from_millis(250));
    assert_eq!(charge.retry.max, Duration::from_secs(120));
    assert_eq!((charge.retry.multiplier, charge.retry.jitter), (3.0, Jitter::Equal));
    assert_eq!(charge.idempotency.as_ref().unwrap().ttl, Duration::from_secs(48 * 3600));
    assert_eq!(charge.idempotency.as_ref().unwrap().key.as_ref().unwrap().source(), "charge:{{payload.order_id}}");
    let Handler::Webhook(hook) = &charge.handler else { panic!("orders.charge has a webhook") };
    assert_eq!((hook.method.as_str(), hook.timeout), ("POST", Duration::from_secs(5)));
    let signing = hook.signing.as_ref().expect("orders.charge is signed");
    assert_eq!(signing.secret_env, ["SLUICE_TEST_VALID_SIGNING_SECRET_UNSET"]);
    assert_eq!(signing.secret_file, Some(PathBuf::from(util::VALID).join("payments-webhook.secrets")));
    let headers: Vec<&str> = hook.headers.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(headers, ["Content-Type", "X-Queue"]);
    assert_eq!(charge.bindings[1].exchange, "payments");

    let audit = &config.queues["orders.audit"];
    assert_eq!(audit.kind, QueueKind::Classic);
    assert!(audit.ordered);
    assert_eq!(audit.concurrency.get(), 1, "ordered queues default to one at a time");
    assert!(audit.idempotency.is_none());
    assert_eq!(audit.rate_limit.unwrap().per, Duration::from_secs(60));
    assert_eq!(audit.retry.max_attempts.get(), 6);
    assert_eq!(audit.bindings[0].routing_key, "", "routing_key defaults to empty");
    let arguments = serde_json::to_value(&audit.bindings[1].arguments).unwrap();
    assert_eq!(arguments, serde_json::json!({"x-match": "all", "region": "eu", "priority": 3, "urgent": true}));
    let Handler::Webhook(audit_hook) = &audit.handler else { panic!("orders.audit has a webhook") };
    let on_status =
        [(Key::Code(404), Action::DeadLetter), (Key::Code(409), Action::Success), (Key::Class(5), Action::Retry)];
    assert_eq!(*audit_hook.on_status, Rules::new(on_status.into_iter().collect()));
    assert_eq!(*hook.on_status, Rules::default(), "no rules unless written");

    let invoice = &config.queues["billing.invoice"];
    assert_eq!(invoice.concurrency.get(), 2, "from the merged defaults");
    assert_eq!(invoice.rate_limit.unwrap().per, Duration::from_secs(3600));
    assert_eq!((&invoice.retry.backoff, invoice.retry.jitter), (&Backoff::Fixed, Jitter::None));
    assert_eq!(invoice.retry.initial, Duration::from_secs(30));
    assert_eq!(config.queues["billing.lookup"].concurrency.get(), 1, "explicit beats merged");

    // Nothing written: every default.
    let cleanup = &config.queues["billing.cleanup"];
    assert_eq!(cleanup.kind, QueueKind::Quorum);
    assert_eq!(cleanup.concurrency.get(), 4);
    assert_eq!(cleanup.dead_letter, "billing.cleanup.dlq");
    assert_eq!(cleanup.retry, sluice::config::RetryPolicy::default());
    assert_eq!(cleanup.retry.max, Duration::from_secs(300));
    assert_eq!(cleanup.idempotency.as_ref().unwrap().ttl, Duration::from_secs(24 * 3600));
    assert!(cleanup.idempotency.as_ref().unwrap().key.is_none(), "the envelope's idempotency_key");
    assert_eq!(cleanup.handler.timeout(), Duration::from_secs(10));
    assert_eq!(cleanup.bindings[0].exchange, "amq.topic");

    let resize = &config.queues["media.resize"];
    let Handler::Command(cmd) = &resize.handler else { panic!("media.resize runs a command") };
    assert!(cmd.program.ends_with("tests/fixtures/valid/jobs/media/../../../scripts/noop.sh"), "{cmd:?}");
    let args: Vec<&str> = cmd.args.iter().map(|a| a.source()).collect();
    assert_eq!(args, ["{{payload.image_id}}", "--size", "{{payload.size}}"]);
    let env: Vec<&str> = cmd.env.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(env, ["BUCKET", "MESSAGE_TYPE"]);
    assert_eq!(cmd.pass_env, ["AWS_REGION", "AWS_PROFILE"]);
    assert_eq!((cmd.stdin, cmd.timeout), (StdinMode::Envelope, Duration::from_secs(120)));
    assert_eq!(cmd.permanent_exit_codes, [64, 65]);
    let on_exit =
        [(Key::Code(75), Action::Retry), (Key::Code(3), Action::Success), (Key::Code(66), Action::DeadLetter)];
    assert_eq!(*cmd.on_exit, Rules::new(on_exit.into_iter().collect()));
    assert_eq!((resize.retry.max_attempts.get(), resize.retry.max), (10, Duration::from_secs(600)));

    let Handler::Command(cat) = &config.queues["media.thumbnail"].handler else { panic!("a command") };
    assert!(cat.program.is_absolute() && cat.program.ends_with("cat"), "found on PATH: {cat:?}");
    assert_eq!((cat.stdin, cat.timeout), (StdinMode::Payload, Duration::from_secs(60)));
    let Handler::Command(archive) = &config.queues["media.archive"].handler else { panic!("a command") };
    assert_eq!(archive.stdin, StdinMode::None);
    assert!(archive.pass_env.is_empty());
    // A schedule: its delays exactly, one attempt more than delays listed.
    let archive_retry = &config.queues["media.archive"].retry;
    let delays = vec![Duration::from_secs(1), Duration::from_secs(30), Duration::from_secs(300)];
    assert_eq!(archive_retry.backoff, Backoff::Schedule(delays));
    assert_eq!(archive_retry.max_attempts.get(), 4);
    assert_eq!((archive_retry.initial, archive_retry.max), (Duration::from_secs(1), Duration::from_secs(300)));
    assert_eq!(archive_retry.jitter, Jitter::None);
}

/// Every property (by its place in the schema) and every enum value (`place=value`).
fn schema_features(node: &Value, at: &str, out: &mut BTreeSet<String>) {
    match node {
        Value::Object(map) => {
            for (key, child) in map {
                let here = format!("{at}/{key}");
                match (key.as_str(), child) {
                    ("properties" | "patternProperties", Value::Object(props)) => {
                        for (name, sub) in props {
                            out.insert(format!("{here}/{name}"));
                            schema_features(sub, &format!("{here}/{name}"), out);
                        }
                    }
                    ("enum", Value::Array(values)) => out.extend(values.iter().map(|v| format!("{at}={v}"))),
                    _ => schema_features(child, &here, out),
                }
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                schema_features(item, &format!("{at}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// The schema features an instance uses, following `$ref`s the way a validator would.
fn used_features(schema: &Value, at: &str, instance: &Value, out: &mut BTreeSet<String>) {
    let node = schema.pointer(at).unwrap_or_else(|| panic!("no schema at {at}"));
    if let Some(target) = node.get("$ref").and_then(Value::as_str) {
        return used_features(schema, target.trim_start_matches('#'), instance, out);
    }
    if node.get("enum").is_some() {
        out.insert(format!("{at}={instance}"));
    }
    match instance {
        Value::Object(map) => {
            for (key, value) in map {
                let pattern = node
                    .get("patternProperties")
                    .and_then(Value::as_object)
                    .and_then(|p| p.keys().find(|p| p.starts_with('^') && key.starts_with(&p[1..])));
                let property = node.get("properties").and_then(|p| p.get(key)).is_some();
                let next = if property {
                    format!("{at}/properties/{key}")
                } else if let Some(pattern) = pattern {
                    format!("{at}/patternProperties/{pattern}")
                } else if node.get("additionalProperties").is_some_and(Value::is_object) {
                    format!("{at}/additionalProperties")
                } else {
                    panic!("{key} is not allowed at {at}");
                };
                if property || pattern.is_some() {
                    out.insert(next.clone());
                }
                // Keys under `x-` are a home for anchors, not part of the format.
                if !next.ends_with("/patternProperties/^x-") {
                    used_features(schema, &next, value, out);
                }
            }
        }
        Value::Array(items) if node.get("items").is_some() => {
            for item in items {
                used_features(schema, &format!("{at}/items"), item, out);
            }
        }
        _ => {}
    }
}

#[test]
fn valid_fixtures_use_every_key_and_enum_value_of_the_schema() {
    let schema: Value = serde_json::from_str(config::schema::TEXT).unwrap();
    let mut all = BTreeSet::new();
    schema_features(&schema, "", &mut all);
    assert!(all.len() > 60, "the walk finds the schema's features: {all:?}");
    let mut used = BTreeSet::new();
    for file in util::yaml_files(Path::new(util::VALID)) {
        let source = config::source::load(&file).unwrap_or_else(|d| panic!("{}", d.headline()));
        used_features(&schema, "", &source.value, &mut used);
    }
    let unused: Vec<&String> = all.difference(&used).collect();
    assert!(unused.is_empty(), "no valid fixture uses:\n{unused:#?}");
    let unknown: Vec<&String> = used.difference(&all).collect();
    assert!(unknown.is_empty(), "the walk went astray:\n{unknown:#?}");
}

/// Issue 31: 1,400 signing secrets (a 64 KiB file) made every call carry a 67 KB
/// `webhook-signature` header, which receivers refuse. Past 8 KiB (171 secrets, 48 bytes each
/// in the header) `validate` warns, at the secrets file; 170 pass quietly.
#[test]
fn a_signature_header_past_8_kib_is_a_warning() {
    use base64::Engine as _;
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = "version: 1\nqueues:\n  work:\n    handler:\n      webhook:\n        url: https://h.example/x\n        \
                signing: {secret_file: webhook.secrets}\n";
    std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
    let secrets = |n: usize| -> String {
        let engine = base64::engine::general_purpose::STANDARD;
        (0..n).map(|i| format!("whsec_{}\n", engine.encode(format!("secret number {i:04}")))).collect()
    };
    let diagnostics = |n: usize| {
        std::fs::write(dir.path().join("webhook.secrets"), secrets(n)).expect("write");
        let validation = config::load(&[dir.path().to_path_buf()]);
        assert!(validation.config.is_some(), "a warning only: {:?}", validation.diagnostics);
        validation.diagnostics.iter().map(|d| (d.line, d.column, d.severity, d.message.clone())).collect::<Vec<_>>()
    };
    assert_eq!(diagnostics(170), []);
    assert_eq!(
        diagnostics(171),
        [(
            7,
            32,
            Severity::Warning,
            "171 signing secrets make each call's webhook-signature header 8207 bytes (48 a secret): receivers and \
             proxies commonly refuse a header over 8 KiB (nginx's default), so every call would fail; sign with the \
             secrets in rotation only (at most 170)"
                .to_string()
        )]
    );
}
