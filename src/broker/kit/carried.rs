//! How a broker that routes its own messages carries sluice's properties beside a body it
//! does not read: one JSON object in one header (JetStream) or message attribute (SQS). It owns
//! the encoding both ways; a header that does not decode reads as no properties.

use bytes::Bytes;

use super::headers;
use crate::broker::{Properties, Route};

/// A message's body and sluice's properties, as a broker carries them beside a body it does
/// not read (a JetStream header, an SQS message attribute).
#[derive(Debug, Clone, Default)]
pub struct Carried {
    pub body: Bytes,
    pub properties: Properties,
    /// When it is due, ms since the epoch (a delayed copy).
    pub due: Option<u64>,
}

impl Carried {
    /// The properties as one header holds them: a JSON object on one line.
    pub fn properties_json(&self) -> String {
        let p = &self.properties;
        let mut o = serde_json::Map::new();
        let mut put = |k: &str, v: serde_json::Value| {
            o.insert(k.into(), v);
        };
        if let Some(id) = &p.message_id {
            put("i", id.clone().into());
        }
        if let Some(kind) = &p.kind {
            put("k", kind.clone().into());
        }
        if let Some(content_type) = &p.content_type {
            put("c", content_type.clone().into());
        }
        if let Some(ts) = p.timestamp {
            put("t", ts.into());
        }
        if !p.headers.is_empty() {
            put("h", headers::encode(&p.headers).into());
        }
        if let Some(route) = &p.route {
            put("x", route.exchange.clone().into());
            put("r", route.routing_key.clone().into());
        }
        if let Some(due) = self.due {
            put("d", due.into());
        }
        serde_json::Value::Object(o).to_string()
    }

    /// A message as delivered: its body and the properties header (none: a message of a
    /// producer other than sluice).
    pub fn read(body: Bytes, header: Option<&str>) -> Carried {
        let o: serde_json::Map<String, serde_json::Value> =
            header.and_then(|h| serde_json::from_str(h).ok()).unwrap_or_default();
        let text = |k: &str| o.get(k).and_then(serde_json::Value::as_str).map(str::to_string);
        let route = match (text("x"), text("r")) {
            (Some(exchange), Some(routing_key)) => Some(Route { exchange, routing_key }),
            _ => None,
        };
        Carried {
            body,
            properties: Properties {
                headers: text("h").map(|h| headers::decode_lossy(h.as_bytes())).unwrap_or_default(),
                message_id: text("i"),
                kind: text("k"),
                content_type: text("c"),
                timestamp: o.get("t").and_then(serde_json::Value::as_u64),
                route,
            },
            due: o.get("d").and_then(serde_json::Value::as_u64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::HeaderValue;

    #[test]
    fn properties_round_trip_through_the_header() {
        let m = Carried {
            body: Bytes::from_static(b"{}"),
            properties: Properties {
                message_id: Some("m\n1".into()),
                kind: Some("t".into()),
                content_type: Some("application/cloudevents+json".into()),
                timestamp: Some(42),
                headers: [("s".to_string(), HeaderValue::Str("v\r\n".into())), ("n".to_string(), HeaderValue::Int(-3))]
                    .into(),
                route: Some(Route { exchange: "ev".into(), routing_key: "a.b".into() }),
            },
            due: Some(7),
        };
        let header = m.properties_json();
        assert!(!header.contains('\n') && !header.contains('\r'), "{header}");
        let back = Carried::read(m.body.clone(), Some(&header));
        assert_eq!(back.due, m.due);
        assert_eq!(back.properties, m.properties);
    }
}
