//! `escape template NUL payload` (the first byte picks the escaping: URL, JSON body or plain)
//! through the compile and render path of the handlers, with the payload (JSON, or else the
//! text as a JSON string) where a message's payload goes. Then the escaping's promises on the
//! same payload, with fixed templates: a plain value is inserted as is, a value in a JSON
//! string reads back as itself, `{{json x}}` reads back as `x`, and a value in a URL is one
//! path segment that decodes to itself (or refused, when it is `.` or `..`).
#![no_main]

use handlebars::{Context, RenderError};
use libfuzzer_sys::fuzz_target;
use percent_encoding::percent_decode_str;
use serde_json::{Value, json};
use sluice::handler::template::{Escape, Template, bare_in_json};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    let escape = [Escape::Url, Escape::Json, Escape::Plain][usize::from(selector % 3)];
    let (source, payload) = text.split_once('\0').unwrap_or((text, "null"));
    let payload = serde_json::from_str(payload).unwrap_or_else(|_| Value::String(payload.to_string()));
    let context = message(&payload);

    // As `sluice validate` compiles a template, then as a handler renders it.
    if escape == Escape::Json {
        let _ = bare_in_json(source);
    }
    if let Ok(template) = Template::compile(source, escape) {
        let _ = template.literal();
        let _ = template.render(&context);
    }

    let raw = render("{{json payload}}", Escape::Json, &context).expect("json renders any payload");
    assert_eq!(serde_json::from_str::<Value>(&raw).expect("json renders JSON"), payload);
    let Value::String(s) = &payload else { return };
    assert_eq!(&render("{{payload}}", Escape::Plain, &context).expect("plain renders"), s);
    let body = render(r#"{"v": "{{payload}}"}"#, Escape::Json, &context).expect("a JSON body renders");
    let body: Value = serde_json::from_str(&body).expect("a value in a JSON string keeps it JSON");
    assert_eq!(&body["v"], &payload);
    match render("http://h/p/{{payload}}?q={{payload}}", Escape::Url, &context) {
        Ok(url) => {
            let segment = url.strip_prefix("http://h/p/").and_then(|u| u.split_once('?')).expect("shape").0;
            assert!(!segment.contains(['/', '\\', '?', '#']), "{segment:?} is more than one path segment");
            assert_eq!(&percent_decode_str(segment).decode_utf8().expect("UTF-8"), s);
        }
        Err(_) => assert!(s == "." || s == "..", "the URL of {s:?} is refused"),
    }
});

/// A message's context, with the roots the handlers give it.
fn message(payload: &Value) -> Context {
    Context::from(json!({
        "id": "0196f0c8-7d1e-7c4b-9d3a-5f2e8a1b6c4d",
        "type": "order.created",
        "version": 1,
        "occurred_at": "2026-01-01T00:00:00Z",
        "idempotency_key": "charge:1",
        "attempt": 1,
        "queue": "orders.charge",
        "payload": payload,
        "env": {},
    }))
}

fn render(source: &str, escape: Escape, context: &Context) -> Result<String, RenderError> {
    Template::compile(source, escape).expect("compiles").render(context)
}
