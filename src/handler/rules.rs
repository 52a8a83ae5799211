//! Per-outcome rules (`on_status` for webhooks, `on_exit` for commands): the action a status
//! or exit code leads to when the pipeline overrides DESIGN's Outcomes table. An exact code's
//! rule beats its class's (`404` before `4xx`).
//!
//! `config` builds and checks the rules; [`super::webhook::classify`] and
//! [`super::command::classify`] apply them. Nothing here reads config files or runs handlers.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use super::{HandlerError, with_excerpt};

/// What a handler result leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Done: ack.
    Success,
    /// Worth another attempt after the retry delay (dead-lettered as `exhausted` on the last).
    Retry,
    /// Retrying cannot help: dead-letter at once, reason `permanent`.
    DeadLetter,
}

impl Action {
    /// The name as written in pipeline files.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Success => "success",
            Action::Retry => "retry",
            Action::DeadLetter => "dead_letter",
        }
    }
}

/// What a rule matches: one code, or a class of status codes (`4` for `4xx`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Key {
    Code(u16),
    Class(u16),
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Code(code) => write!(f, "{code}"),
            Key::Class(class) => write!(f, "{class}xx"),
        }
    }
}

/// One action per key; a code without a rule keeps its default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules(BTreeMap<Key, Action>);

impl Rules {
    /// Rules from checked keys (config has rejected duplicates).
    pub fn new(rules: BTreeMap<Key, Action>) -> Rules {
        Rules(rules)
    }

    /// The rule for `code`: its own, else its class's.
    pub fn find(&self, code: u16) -> Option<(Key, Action)> {
        [Key::Code(code), Key::Class(code / 100)]
            .into_iter()
            .find_map(|key| self.0.get(&key).map(|action| (key, *action)))
    }
}

/// What a status or exit code means for the message, and the rule that said so (`None`: the
/// default of DESIGN's Outcomes table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub action: Action,
    pub rule: Option<Key>,
}

impl Verdict {
    /// The default, when no rule matches.
    pub fn default_is(action: Action) -> Verdict {
        Verdict { action, rule: None }
    }

    /// The handler result of this verdict for a run that ended as `what` (`HTTP 404`,
    /// `exit 65`). A rule names itself in the error text (`HTTP 404 (on_status "4xx":
    /// dead_letter)`), so a dead letter says which rule sent it there; `excerpt` (of the body
    /// or stderr, made only for a failure) follows.
    pub fn result(
        self,
        what: String,
        rules: &str,
        excerpt: impl FnOnce() -> String,
        retry_after: Option<Duration>,
    ) -> Result<(), HandlerError> {
        let prefix = match self.rule {
            Some(key) => format!("{what} ({rules} \"{key}\": {})", self.action.as_str()),
            None => what,
        };
        let error = || with_excerpt(prefix, excerpt());
        match self.action {
            Action::Success => Ok(()),
            Action::Retry => Err(HandlerError::Transient { error: error(), retry_after, unwell: false }),
            Action::DeadLetter => Err(HandlerError::permanent(error())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exact_code_beats_its_class() {
        let rules = Rules::new(BTreeMap::from([
            (Key::Code(404), Action::DeadLetter),
            (Key::Class(4), Action::Retry),
            (Key::Code(503), Action::Retry),
        ]));
        let cases = [
            (404, Some((Key::Code(404), Action::DeadLetter))),
            (422, Some((Key::Class(4), Action::Retry))),
            (499, Some((Key::Class(4), Action::Retry))),
            (503, Some((Key::Code(503), Action::Retry))),
            (500, None),
            (200, None),
        ];
        for (code, expected) in cases {
            assert_eq!(rules.find(code), expected, "{code}");
        }
        assert_eq!(Rules::default().find(404), None);
    }

    #[test]
    fn keys_read_as_written() {
        assert_eq!(Key::Code(75).to_string(), "75");
        assert_eq!(Key::Class(5).to_string(), "5xx");
    }

    #[test]
    fn a_rule_names_itself_in_the_error() {
        let hint = Some(Duration::from_secs(3));
        let ruled = |action| Verdict { action, rule: Some(Key::Class(4)) };
        let cases = [
            (Verdict::default_is(Action::Success), Ok(())),
            (ruled(Action::Success), Ok(())),
            (Verdict::default_is(Action::DeadLetter), Err(HandlerError::permanent("HTTP 404: not here"))),
            (
                ruled(Action::DeadLetter),
                Err(HandlerError::permanent("HTTP 404 (on_status \"4xx\": dead_letter): not here")),
            ),
            (
                ruled(Action::Retry),
                Err(HandlerError::Transient {
                    error: "HTTP 404 (on_status \"4xx\": retry): not here".into(),
                    retry_after: hint,
                    unwell: false,
                }),
            ),
        ];
        for (verdict, expected) in cases {
            let result = verdict.result("HTTP 404".into(), "on_status", || "not here".into(), hint);
            assert_eq!(result, expected, "{verdict:?}");
        }
    }
}
