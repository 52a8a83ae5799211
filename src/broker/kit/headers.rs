//! How the brokers that keep their own messages store [`Headers`]: one JSON object, a string
//! as a string and an integer as a number. It owns the encoding both ways; what a value that
//! does not decode means for its message is the broker's to say ([`decode`] names it, for a
//! broker that quarantines the message; [`decode_lossy`] keeps it as its JSON text).

use serde_json::{Map, Value};

use crate::broker::{HeaderValue, Headers};

/// Headers as the JSON text stored.
pub fn encode(headers: &Headers) -> String {
    let map: Map<String, Value> = headers.iter().map(|(k, v)| (k.clone(), v.to_json())).collect();
    Value::Object(map).to_string()
}

/// Headers from their stored JSON, or what in it is not headers.
pub fn decode(json: &[u8]) -> Result<Headers, String> {
    object(json)?
        .into_iter()
        .map(|(k, v)| match value(v) {
            Ok(v) => Ok((k, v)),
            Err(other) => Err(format!("header \"{k}\": {other}")),
        })
        .collect()
}

/// Headers from their stored JSON, keeping what is neither a string nor an integer as its JSON
/// text; none from what is not a JSON object.
pub fn decode_lossy(json: &[u8]) -> Headers {
    let Ok(map) = object(json) else { return Headers::new() };
    map.into_iter().map(|(k, v)| (k, value(v).unwrap_or_else(|other| HeaderValue::Str(other.to_string())))).collect()
}

fn object(json: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice(json).map_err(|e| format!("headers: {e}"))? {
        Value::Object(map) => Ok(map),
        _ => Err("headers: not a JSON object".into()),
    }
}

/// A header's value, or the JSON value that is none.
fn value(v: Value) -> Result<HeaderValue, Value> {
    match v {
        Value::String(s) => Ok(HeaderValue::Str(s)),
        Value::Number(n) => n.as_i64().map(HeaderValue::Int).ok_or(Value::Number(n)),
        other => Err(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let headers: Headers = [
            ("s".to_string(), HeaderValue::Str("v \"quoted\" é".into())),
            ("n".to_string(), HeaderValue::Int(-3)),
            ("max".to_string(), HeaderValue::Int(i64::MAX)),
        ]
        .into();
        let text = encode(&headers);
        assert_eq!(decode(text.as_bytes()), Ok(headers.clone()));
        assert_eq!(decode_lossy(text.as_bytes()), headers);
        assert_eq!(encode(&Headers::new()), "{}");
    }

    /// Stored JSON, `decode`'s error, and what `decode_lossy` keeps (as text).
    type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);

    /// What is not headers: named by `decode`, kept as text (or nothing) by `decode_lossy`.
    #[test]
    fn what_is_not_headers() {
        let cases: &[Case] = &[
            (r#"{"f":1.5}"#, "header \"f\": 1.5", &[("f", "1.5")]),
            (r#"{"b":true}"#, "header \"b\": true", &[("b", "true")]),
            (r#"{"o":{"x":1}}"#, "header \"o\": {\"x\":1}", &[("o", "{\"x\":1}")]),
            (
                r#"{"big":18446744073709551615}"#,
                "header \"big\": 18446744073709551615",
                &[("big", "18446744073709551615")],
            ),
            ("[1]", "headers: not a JSON object", &[]),
            ("{", "headers: EOF while parsing an object at line 1 column 1", &[]),
        ];
        for (json, error, lossy) in cases {
            assert_eq!(decode(json.as_bytes()).as_ref().map_err(String::as_str), Err(*error), "{json}");
            let want: Headers = lossy.iter().map(|(k, v)| (k.to_string(), HeaderValue::Str(v.to_string()))).collect();
            assert_eq!(decode_lossy(json.as_bytes()), want, "{json}");
        }
    }
}
