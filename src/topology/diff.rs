//! What a reload changes: the queues to start, to drain and replace, and to drain and leave,
//! and the bindings to remove. Start-up is the diff from the empty config, so one apply path
//! serves both (and a start-up never unbinds anything).

use std::collections::BTreeSet;

use super::{BindingDecl, bindings};
use crate::config::Config;

/// Queue names by what a reload does to them, and the bindings it removes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diff {
    /// In the new config only: start.
    pub added: BTreeSet<String>,
    /// In both, compiled from different sources: drain the old, start the new.
    pub changed: BTreeSet<String>,
    /// In the old config only: drain and unbind; the queue and its messages stay on the broker.
    pub removed: BTreeSet<String>,
    /// Bindings of the old config the new one no longer has: every binding of a removed
    /// queue, and those a changed queue's `bind:` list dropped. Left in place, a removed
    /// queue would keep taking a copy of every matching message, unconsumed, forever.
    pub unbound: Vec<BindingDecl>,
}

impl Diff {
    /// Nothing to start, stop or unbind (exchanges may still need declaring).
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty() && self.unbound.is_empty()
    }

    /// Queues whose workers stop.
    pub fn to_stop(&self) -> impl Iterator<Item = &String> {
        self.changed.iter().chain(&self.removed)
    }

    /// Queues whose workers start.
    pub fn to_start(&self) -> impl Iterator<Item = &String> {
        self.changed.iter().chain(&self.added)
    }
}

/// The queues `new` adds, changes and removes relative to `old`, and the bindings it drops.
pub fn diff(old: &Config, new: &Config) -> Diff {
    let mut d = Diff::default();
    for (name, q) in &new.queues {
        match old.queues.get(name) {
            None => {
                d.added.insert(name.clone());
            }
            // The same definition with other signing keys (a secrets file edited) changes too.
            Some(before) if before.source != q.source || before.signing_keys() != q.signing_keys() => {
                d.changed.insert(name.clone());
            }
            Some(_) => {}
        }
    }
    d.removed = old.queues.keys().filter(|name| !new.queues.contains_key(*name)).cloned().collect();
    // A queue compiled from the same source has the same bindings: only the others can drop one.
    let mut unbound = Vec::new();
    for q in d.to_stop().filter_map(|name| old.queues.get(name)) {
        let kept: Vec<BindingDecl> = new.queues.get(&q.name).map(|q| bindings(q).collect()).unwrap_or_default();
        unbound.extend(bindings(q).filter(|b| !kept.contains(b)));
    }
    d.unbound = unbound;
    d
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn config(queues: &[(&str, &str)]) -> Config {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("s.json"), r#"{"type": "object"}"#).expect("schema");
        let mut text = String::from("version: 1\nexchanges:\n  ev: {type: topic}\n  hx: {type: headers}\n");
        if !queues.is_empty() {
            text.push_str("queues:\n");
        }
        for (name, body) in queues {
            text.push_str(&format!("  {name}:\n    handler: {{webhook: {{url: \"http://127.0.0.1:9/x\"}}}}\n{body}"));
        }
        std::fs::write(dir.path().join("p.yaml"), text).expect("write");
        let loaded = crate::config::load(&[dir.path().to_path_buf()]);
        loaded.config.unwrap_or_else(|| panic!("invalid: {:?}", loaded.diagnostics))
    }

    fn names(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// (exchange, queue, routing key, headers arguments as JSON) as a declaration.
    fn binding(&(exchange, queue, routing_key, arguments): &(&str, &str, &str, &str)) -> BindingDecl {
        let arguments: BTreeMap<String, serde_json::Value> = serde_json::from_str(arguments).expect("arguments");
        BindingDecl { exchange: exchange.into(), queue: queue.into(), routing_key: routing_key.into(), arguments }
    }

    /// One reload: the old queues and the new (name, extra YAML), then what the diff says.
    struct Case<'a> {
        what: &'a str,
        old: &'a [(&'a str, &'a str)],
        new: &'a [(&'a str, &'a str)],
        added: &'a [&'a str],
        changed: &'a [&'a str],
        removed: &'a [&'a str],
        unbound: &'a [(&'a str, &'a str, &'a str, &'a str)],
    }

    const NONE: Case = Case { what: "", old: &[], new: &[], added: &[], changed: &[], removed: &[], unbound: &[] };

    #[test]
    fn diffs() {
        let two = "    bind: [{exchange: ev, routing_key: \"x.*\"}, {exchange: ev, routing_key: y}]\n";
        let pdf = "    bind: [{exchange: hx, arguments: {x-match: all, format: pdf}}]\n";
        let cases = [
            Case { what: "start-up", new: &[("a", ""), ("b", two)], added: &["a", "b"], ..NONE },
            Case { what: "nothing changed", old: &[("a", two)], new: &[("a", two)], ..NONE },
            Case {
                what: "concurrency",
                old: &[("a", "")],
                new: &[("a", "    concurrency: 9\n")],
                changed: &["a"],
                ..NONE
            },
            Case {
                what: "added and removed",
                old: &[("a", ""), ("b", "")],
                new: &[("b", ""), ("c", "")],
                added: &["c"],
                removed: &["a"],
                ..NONE
            },
            Case {
                what: "binding added",
                old: &[("a", "")],
                new: &[("a", "    bind: [{exchange: ev}]\n")],
                changed: &["a"],
                ..NONE
            },
            Case {
                what: "schema",
                old: &[("a", "")],
                new: &[("a", "    payload_schema: s.json\n")],
                changed: &["a"],
                ..NONE
            },
            Case {
                what: "same value written differently",
                old: &[("a", "    concurrency: 4\n")],
                new: &[("a", "")],
                changed: &["a"],
                ..NONE
            },
            Case { what: "stop all", old: &[("a", "")], removed: &["a"], ..NONE },
            // Issue 19: a removed queue loses every binding; its queue stays.
            Case {
                what: "removed queue",
                old: &[("a", ""), ("b", two)],
                new: &[("a", "")],
                removed: &["b"],
                unbound: &[("ev", "b", "x.*", "{}"), ("ev", "b", "y", "{}")],
                ..NONE
            },
            Case {
                what: "renamed",
                old: &[("b", two)],
                new: &[("c", two)],
                added: &["c"],
                removed: &["b"],
                unbound: &[("ev", "b", "x.*", "{}"), ("ev", "b", "y", "{}")],
                ..NONE
            },
            Case {
                what: "binding dropped from a kept queue",
                old: &[("a", two)],
                new: &[("a", "    bind: [{exchange: ev, routing_key: y}]\n")],
                changed: &["a"],
                unbound: &[("ev", "a", "x.*", "{}")],
                ..NONE
            },
            Case {
                what: "routing key changed",
                old: &[("a", "    bind: [{exchange: ev, routing_key: y}]\n")],
                new: &[("a", "    bind: [{exchange: ev, routing_key: z}]\n")],
                changed: &["a"],
                unbound: &[("ev", "a", "y", "{}")],
                ..NONE
            },
            Case {
                what: "headers arguments changed",
                old: &[("a", pdf)],
                new: &[("a", "    bind: [{exchange: hx, arguments: {x-match: all, format: csv}}]\n")],
                changed: &["a"],
                unbound: &[("hx", "a", "", r#"{"x-match": "all", "format": "pdf"}"#)],
                ..NONE
            },
            Case {
                what: "bindings kept, other settings changed",
                old: &[("a", two)],
                new: &[("a", &format!("{two}    concurrency: 9\n"))],
                changed: &["a"],
                ..NONE
            },
            Case {
                what: "all bindings dropped",
                old: &[("a", two)],
                new: &[("a", "")],
                changed: &["a"],
                unbound: &[("ev", "a", "x.*", "{}"), ("ev", "a", "y", "{}")],
                ..NONE
            },
        ];
        for c in cases {
            let d = diff(&config(c.old), &config(c.new));
            let want = Diff {
                added: names(c.added),
                changed: names(c.changed),
                removed: names(c.removed),
                unbound: c.unbound.iter().map(binding).collect(),
            };
            assert_eq!(d, want, "{}", c.what);
        }
        assert!(diff(&Config::default(), &Config::default()).is_empty());
    }
}
