//! The declarations a broker that routes its own messages keeps at hand: exchanges' kinds,
//! queues' rules and bindings, as read at one version of what it stores ([`Topology`]), and the
//! one cached copy every publish and claim reads ([`Cache`]). It owns routing on them and
//! naming what is missing; it must not read or write the broker's storage, nor decide when the
//! copy is stale (each broker knows its version: a counter in its file, a key on its server).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::lock;
use crate::broker::{BodyLimits, BrokerError, Headers};
use crate::topology::{BindingDecl, route};
use crate::vocab::ExchangeKind;
use crate::vocab::suggest::did_you_mean;

/// The declarations routing and claiming need, read at `version`.
#[derive(Debug, Default)]
pub struct Topology<V> {
    pub version: V,
    pub exchanges: HashMap<String, ExchangeKind>,
    pub queues: HashMap<String, QueueRule>,
    pub bindings: Vec<BindingDecl>,
}

/// What a broker enforces of a queue's declaration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueRule {
    pub max_length: Option<u64>,
    pub single_active: bool,
    /// The largest body its consumers take, as the last declare said.
    pub max_body: Option<u64>,
    /// Its dead-letter queue, for a broker that sends there what it cannot read.
    pub dead_letter: Option<String>,
}

/// An exchange kind as stored (its name).
pub fn exchange_kind(text: &str) -> Option<ExchangeKind> {
    [ExchangeKind::Direct, ExchangeKind::Fanout, ExchangeKind::Topic, ExchangeKind::Headers]
        .into_iter()
        .find(|k| k.as_str() == text)
}

/// A binding as stored (its JSON).
pub fn binding_text(b: &BindingDecl) -> String {
    serde_json::to_string(b).unwrap_or_default()
}

/// A binding from its stored JSON; `None` from what is none.
pub fn binding_from(text: &str) -> Option<BindingDecl> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let s = |name: &str| v.get(name).and_then(serde_json::Value::as_str).map(str::to_string);
    let arguments = match v.get("arguments") {
        Some(serde_json::Value::Object(map)) => map.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        _ => BTreeMap::new(),
    };
    Some(BindingDecl { exchange: s("exchange")?, queue: s("queue")?, routing_key: s("routing_key")?, arguments })
}

impl<V> Topology<V> {
    /// The queues a message reaches (at least one), sorted; `place` says where a broker with
    /// nothing declared looks ("on it", "under this prefix").
    pub fn route(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &Headers,
        place: &str,
    ) -> Result<Vec<String>, BrokerError> {
        let declared = self.exchanges.get(exchange).copied();
        let is_queue = |q: &str| self.queues.contains_key(q);
        let targets = route::targets(exchange, routing_key, headers, declared, is_queue, &self.bindings)
            .ok_or_else(|| self.missing("exchange", exchange, place))?;
        if targets.is_empty() {
            return Err(BrokerError::Unroutable { exchange: exchange.into(), routing_key: routing_key.into() });
        }
        Ok(targets)
    }

    /// The queues a message reaches, each with the largest body it takes where declared: what
    /// `Publish::body_limits` answers.
    pub fn body_limits(
        &self,
        exchange: &str,
        routing_key: &str,
        headers: &Headers,
        place: &str,
    ) -> Result<BodyLimits, BrokerError> {
        let size = |max: u64| usize::try_from(max).unwrap_or(usize::MAX);
        let targets = self.route(exchange, routing_key, headers, place)?;
        Ok(targets.into_iter().map(|q| (q.clone(), self.queues.get(&q).and_then(|r| r.max_body).map(size))).collect())
    }

    /// An exchange or queue (`what`) not declared, with the closest declared name; or, when
    /// nothing is declared at all, that the broker is empty (a mistyped location?).
    pub fn missing(&self, what: &str, name: &str, place: &str) -> BrokerError {
        if self.exchanges.is_empty() && self.queues.is_empty() {
            return BrokerError::NotFound(format!(
                "{what} \"{name}\": the broker is empty, nothing is declared {place} (`sluice run` declares the pipelines' exchanges and queues)"
            ).into());
        }
        let close = match what {
            "exchange" => did_you_mean(name, self.exchanges.keys().map(String::as_str)),
            _ => did_you_mean(name, self.queues.keys().map(String::as_str)),
        };
        BrokerError::NotFound(format!("{what} \"{name}\"{close}").into())
    }
}

/// The topology as last read: shared by a broker's publishes and claims, replaced whole when
/// read again (a reader keeps the copy it took).
pub struct Cache<V>(Mutex<Option<Arc<Topology<V>>>>);

impl<V> Default for Cache<V> {
    fn default() -> Self {
        Cache(Mutex::new(None))
    }
}

impl<V: PartialEq> Cache<V> {
    /// The copy last read, if any.
    pub fn get(&self) -> Option<Arc<Topology<V>>> {
        lock(&self.0).clone()
    }

    /// The copy last read, if it was read at `version`.
    pub fn at(&self, version: &V) -> Option<Arc<Topology<V>>> {
        lock(&self.0).as_ref().filter(|t| t.version == *version).cloned()
    }

    /// Keeps a copy just read.
    pub fn keep(&self, topology: Topology<V>) -> Arc<Topology<V>> {
        let topology = Arc::new(topology);
        *lock(&self.0) = Some(topology.clone());
        topology
    }

    /// Keeps a copy just read unless the one held is newer (copies read by several tasks
    /// arrive in any order); returns the newer of the two.
    pub fn keep_newer(&self, topology: Topology<V>) -> Arc<Topology<V>>
    where
        V: PartialOrd,
    {
        let mut held = lock(&self.0);
        match held.as_ref() {
            Some(t) if t.version > topology.version => t.clone(),
            _ => held.insert(Arc::new(topology)).clone(),
        }
    }

    /// Forgets the copy: the next reader reads again.
    pub fn forget(&self) {
        *lock(&self.0) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topology() -> Topology<i64> {
        let queue = |name: &str| (name.to_string(), QueueRule::default());
        Topology {
            version: 1,
            exchanges: [("orders".to_string(), ExchangeKind::Topic)].into(),
            queues: [queue("billing"), queue("shipping")].into(),
            bindings: ["billing", "shipping"]
                .map(|q| BindingDecl {
                    exchange: "orders".into(),
                    queue: q.into(),
                    routing_key: "order.*".into(),
                    arguments: Default::default(),
                })
                .into(),
        }
    }

    /// An exchange, a routing key, and the queues reached or the error.
    type Case<'a> = (&'a str, &'a str, Result<&'a [&'a str], &'a str>);

    #[test]
    fn routes_and_names_what_is_missing() {
        let t = topology();
        let cases: &[Case] = &[
            ("orders", "order.placed", Ok(&["billing", "shipping"])),
            ("", "billing", Ok(&["billing"])),
            (
                "orders",
                "refund.placed",
                Err("unroutable: no queue is bound to exchange \"orders\" for routing key \"refund.placed\""),
            ),
            ("order", "order.placed", Err("not found: exchange \"order\"; did you mean \"orders\"?")),
        ];
        for (exchange, key, want) in cases {
            let got = t.route(exchange, key, &Headers::new(), "on it");
            let got = got.map_err(|e| e.to_string());
            let want = want.map(|qs| qs.iter().map(|q| q.to_string()).collect::<Vec<_>>()).map_err(str::to_string);
            assert_eq!(got, want, "{exchange} {key}");
        }
        assert_eq!(
            t.missing("queue", "biling", "on it").to_string(),
            "not found: queue \"biling\"; did you mean \"billing\"?"
        );
        let empty = Topology::<i64>::default().missing("queue", "q", "under this prefix").to_string();
        assert!(empty.contains("queue \"q\": the broker is empty, nothing is declared under this prefix"), "{empty}");
    }

    #[test]
    fn the_cache_gives_the_copy_of_its_version() {
        let cache = Cache::default();
        assert!(cache.get().is_none());
        cache.keep(topology());
        assert!(cache.at(&1).is_some());
        assert!(cache.at(&2).is_none(), "read at another version");
        assert_eq!(cache.get().map(|t| t.queues.len()), Some(2));
        cache.forget();
        assert!(cache.get().is_none());
        assert_eq!(exchange_kind("topic"), Some(ExchangeKind::Topic));
        assert_eq!(exchange_kind("x-delayed"), None);
    }

    #[test]
    fn the_cache_keeps_the_newer_copy() {
        let cache = Cache::default();
        let at = |version| Topology { version, ..topology() };
        assert_eq!(cache.keep_newer(at(2)).version, 2);
        assert_eq!(cache.keep_newer(at(1)).version, 2, "an older copy read late is not kept");
        assert_eq!(cache.get().map(|t| t.version), Some(2));
        assert_eq!(cache.keep_newer(at(3)).version, 3);
    }
}
