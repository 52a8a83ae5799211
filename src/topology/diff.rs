//! What a reload changes: the queues to start, to drain and replace, and to drain and leave.
//! Start-up is the diff from the empty config, so one apply path serves both.

use std::collections::BTreeSet;

use crate::config::Config;

/// Queue names by what a reload does to them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diff {
    /// In the new config only: start.
    pub added: BTreeSet<String>,
    /// In both, compiled from different sources: drain the old, start the new.
    pub changed: BTreeSet<String>,
    /// In the old config only: drain; the queue and its messages stay on the broker.
    pub removed: BTreeSet<String>,
}

impl Diff {
    /// Nothing to start or stop (exchanges may still need declaring).
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.changed.is_empty() && self.removed.is_empty()
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

/// The queues `new` adds, changes and removes relative to `old`.
pub fn diff(old: &Config, new: &Config) -> Diff {
    let mut d = Diff::default();
    for (name, q) in &new.queues {
        match old.queues.get(name) {
            None => {
                d.added.insert(name.clone());
            }
            Some(before) if before.source != q.source => {
                d.changed.insert(name.clone());
            }
            Some(_) => {}
        }
    }
    d.removed = old.queues.keys().filter(|name| !new.queues.contains_key(*name)).cloned().collect();
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(queues: &[(&str, &str)]) -> Config {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("s.json"), r#"{"type": "object"}"#).expect("schema");
        let mut text = String::from("version: 1\nexchanges:\n  ev: {type: topic}\n");
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

    /// What, the old queues and the new (name, extra YAML), and the names added, changed, removed.
    type Case<'a> =
        (&'a str, &'a [(&'a str, &'a str)], &'a [(&'a str, &'a str)], &'a [&'a str], &'a [&'a str], &'a [&'a str]);

    #[test]
    fn diffs() {
        let cases: &[Case] = &[
            ("start-up", &[], &[("a", ""), ("b", "")], &["a", "b"], &[], &[]),
            ("nothing changed", &[("a", "")], &[("a", "")], &[], &[], &[]),
            ("concurrency", &[("a", "")], &[("a", "    concurrency: 9\n")], &[], &["a"], &[]),
            ("added and removed", &[("a", ""), ("b", "")], &[("b", ""), ("c", "")], &["c"], &[], &["a"]),
            ("binding", &[("a", "")], &[("a", "    bind: [{exchange: ev}]\n")], &[], &["a"], &[]),
            ("schema", &[("a", "")], &[("a", "    payload_schema: s.json\n")], &[], &["a"], &[]),
            ("same value written differently", &[("a", "    concurrency: 4\n")], &[("a", "")], &[], &["a"], &[]),
            ("stop all", &[("a", "")], &[], &[], &[], &["a"]),
        ];
        for (what, old, new, added, changed, removed) in cases {
            let d = diff(&config(old), &config(new));
            assert_eq!(d, Diff { added: names(added), changed: names(changed), removed: names(removed) }, "{what}");
        }
        assert!(diff(&Config::default(), &Config::default()).is_empty());
    }
}
