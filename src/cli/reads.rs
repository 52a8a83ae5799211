//! The pipeline files as the operator's commands read them (`status`, `dlq`, `plan`, `render`):
//! each reads only part of the files, so a `${VAR}` unset in the rest (a webhook's token in a
//! shell that has none of the runner's secrets) is left unresolved, and one note line names what
//! was left; a `${VAR}` in a part the command reads is still an error, as for `run`.

use std::collections::BTreeSet;
use std::path::PathBuf;

use super::output;
use crate::config::source::escape_token;
use crate::config::{self, Config, Format, Severity};

/// What part of the pipeline files a command reads.
#[derive(Debug, Clone, Copy)]
pub enum Reads<'a> {
    /// Each queue's name and its dead-letter queue's (`status`, `dlq`).
    DeadLetters,
    /// The topology: everything but how the messages are handled (`plan`).
    Topology,
    /// One queue, whole (`render`).
    Queue(&'a str),
}

/// The keys of a queue that say how its messages are handled, and nothing of the topology.
const HANDLING: [&str; 8] =
    ["handler", "on_status", "retry", "idempotency", "payload_schema", "concurrency", "circuit_breaker", "rate_limit"];

impl Reads<'_> {
    /// Whether the value at `pointer` (a JSON pointer into a pipeline file) is read. A problem
    /// with a file as a whole (no pointer) concerns every command.
    fn reads(self, pointer: &str) -> bool {
        if pointer.is_empty() {
            return true;
        }
        let mut tokens = pointer.split('/').skip(1);
        let (top, queue, key) = (tokens.next(), tokens.next(), tokens.next());
        let in_queues = top == Some("queues");
        match self {
            Reads::DeadLetters => in_queues && key == Some("dead_letter"),
            Reads::Topology => !(in_queues && key.is_some_and(|key| HANDLING.contains(&key))),
            Reads::Queue(name) => in_queues && queue == Some(escape_token(name).as_str()),
        }
    }

    /// Whether a variable the config's [`Config::missing_env`] names at `place` (`queue NAME,
    /// field`) is read: only a queue read whole reads its handler's.
    fn reads_place(self, place: &str) -> bool {
        match self {
            Reads::Queue(name) => place.starts_with(&format!("queue {name}, ")),
            Reads::DeadLetters | Reads::Topology => false,
        }
    }
}

/// Loads the pipeline files under `paths` for `command`, which reads only what `reads` says;
/// problems go to stderr. A variable unset here in what it reads is an error (the files are
/// loaded as `run` loads them, and every unset variable is named); one in the rest is named in
/// a note, the value reading it left unresolved.
pub fn load_for(paths: &[PathBuf], nodes: usize, command: &str, reads: Reads<'_>) -> Option<Config> {
    let mut validation = config::load_with(paths, config::Unset::Warning).on_nodes(nodes);
    let needed = validation.unset.iter().any(|u| reads.reads(&u.pointer));
    // A queue whose handler cannot be compiled without the value is left out of such a config;
    // a command must never see a queue missing.
    let complete = validation.config.as_ref().is_some_and(|config| {
        let names: BTreeSet<String> = config.queues.keys().map(|q| escape_token(q)).collect();
        validation.unset.iter().all(|u| u.pointer.split('/').nth(2).is_none_or(|q| names.contains(q)))
    });
    if needed || !complete {
        return super::load_or_report(paths, nodes, None);
    }
    // What is said of the parts it does not read (an unset secret, a value left unchecked) is
    // no news to this command.
    validation.diagnostics.retain(|d| d.severity == Severity::Error || reads.reads(&d.pointer));
    output::stderr(&validation.render(Format::Human));
    let config = validation.config?;
    let mut skipped: BTreeSet<String> = validation.unset.into_iter().map(|u| u.name).collect();
    for missing in config.missing_env() {
        if !missing.places.iter().any(|place| reads.reads_place(place)) {
            skipped.insert(missing.name);
        }
    }
    if !skipped.is_empty() {
        let names: Vec<String> = skipped.into_iter().collect();
        output::stderr(&format!(
            "note: `sluice {command}` does not read {} (not set here): what reads them is left unresolved\n",
            names.join(", ")
        ));
    }
    Some(config)
}

#[cfg(test)]
mod tests {
    use super::Reads;

    #[test]
    fn each_command_reads_its_part_of_the_files() {
        let cases = [
            ("/queues/work/dead_letter/queue", [true, true, true, false]),
            ("/queues/work/handler/webhook/headers/Authorization", [false, false, true, false]),
            ("/queues/work/bind/0/routing_key", [false, true, true, false]),
            ("/queues/work/retry/max_attempts", [false, false, true, false]),
            ("/exchanges/ev/type", [false, true, false, false]),
            ("/queues/a~1b/handler/webhook/url", [false, false, false, true]),
            ("", [true, true, true, true]),
        ];
        for (pointer, expected) in cases {
            let reads = [Reads::DeadLetters, Reads::Topology, Reads::Queue("work"), Reads::Queue("a/b")];
            let actual = reads.map(|r| r.reads(pointer));
            assert_eq!(actual, expected, "{pointer}");
        }
    }
}
