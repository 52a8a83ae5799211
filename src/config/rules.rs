//! `on_status` and `on_exit` as written, checked and turned into [`Rules`]: keys parsed (exact
//! codes, status classes) and range-checked, one rule written twice (`4xx` and `4XX`), and exit
//! codes that `permanent_exit_codes` names too. Every problem is a diagnostic at its key.
//!
//! The JSON Schema holds the same key syntax for editors; its messages for a bad key come from
//! here, so `validate` says the same thing whichever check finds it.

use std::collections::BTreeMap;

use super::diagnostic::{Diagnostic, Severity};
use super::source::{SourceFile, escape_token};
use crate::handler::rules::{Action, Key, Rules};

/// An `on_status` key: an exact code from 100 to 599, or a class `1xx` to `5xx` (`X` too).
pub(super) fn status_key(text: &str) -> Result<Key, String> {
    let bytes = text.as_bytes();
    if bytes.len() == 3 && bytes[1..].eq_ignore_ascii_case(b"xx") {
        return match bytes[0] {
            digit @ b'1'..=b'5' => Ok(Key::Class(u16::from(digit - b'0'))),
            b'0'..=b'9' => Err(format!("unknown status class \"{text}\": the classes are 1xx, 2xx, 3xx, 4xx and 5xx")),
            _ => Err(not_a_status(text)),
        };
    }
    match number(text) {
        None => Err(not_a_status(text)),
        Some(code) if !(100..=599).contains(&code) => {
            Err(format!("status code {text} is out of range: HTTP status codes are 100 to 599"))
        }
        Some(code) => canonical(text, code),
    }
}

fn not_a_status(text: &str) -> String {
    format!("\"{text}\" is neither a status code (100 to 599) nor a status class (1xx to 5xx)")
}

/// An `on_exit` key: an exit code from 0 to 255.
pub(super) fn exit_key(text: &str) -> Result<Key, String> {
    match number(text) {
        None => Err(format!("\"{text}\" is not an exit code (0 to 255)")),
        Some(code) if code > 255 => Err(format!("exit code {text} is out of range: exit codes are 0 to 255")),
        Some(code) => canonical(text, code),
    }
}

/// The value of a key made of digits only; one past `u16::MAX` reads as `u16::MAX`, out of
/// every range all the same.
fn number(text: &str) -> Option<u16> {
    (!text.is_empty() && text.bytes().all(|b| b.is_ascii_digit())).then(|| text.parse().unwrap_or(u16::MAX))
}

/// A code written the one way (no leading zeros), so that no two keys name it.
fn canonical(text: &str, code: u16) -> Result<Key, String> {
    if text == code.to_string() { Ok(Key::Code(code)) } else { Err(format!("write code {text} as {code}")) }
}

/// Checks the `on_status` rules at `pointer` and builds them.
pub(super) fn on_status(
    file: &SourceFile,
    pointer: &str,
    written: &BTreeMap<String, Action>,
    diags: &mut Vec<Diagnostic>,
) -> Rules {
    compile(file, pointer, written, status_key, |_| None, diags)
}

/// Checks the `on_exit` rules at `pointer` and builds them; a code that `permanent_exit_codes`
/// names too is an error, wherever the two agree or not.
pub(super) fn on_exit(
    file: &SourceFile,
    pointer: &str,
    written: &BTreeMap<String, Action>,
    permanent_exit_codes: &[i32],
    diags: &mut Vec<Diagnostic>,
) -> Rules {
    let overlap = |key: Key| match key {
        Key::Code(code) if permanent_exit_codes.contains(&i32::from(code)) => Some(format!(
            "exit code {code} is also in permanent_exit_codes; name each code in one place (on_exit \"{code}\": dead_letter does what permanent_exit_codes does)"
        )),
        _ => None,
    };
    compile(file, pointer, written, exit_key, overlap, diags)
}

fn compile(
    file: &SourceFile,
    pointer: &str,
    written: &BTreeMap<String, Action>,
    parse: fn(&str) -> Result<Key, String>,
    overlap: impl Fn(Key) -> Option<String>,
    diags: &mut Vec<Diagnostic>,
) -> Rules {
    // In file order, so that the second of two keys for one rule is the one reported.
    let mut entries: Vec<(String, _, &str, Action)> = written
        .iter()
        .map(|(text, action)| {
            let at = format!("{pointer}/{}", escape_token(text));
            (at.clone(), file.key_pos(&at), text.as_str(), *action)
        })
        .collect();
    entries.sort_by_key(|(_, pos, _, _)| (pos.line, pos.column));
    let mut rules = BTreeMap::new();
    let mut first: BTreeMap<Key, (&str, usize, usize)> = BTreeMap::new();
    for (at, pos, text, action) in entries {
        let problem = match parse(text) {
            Err(message) => Some(message),
            Ok(key) => match first.get(&key) {
                Some((other, line, column)) => Some(format!(
                    "\"{text}\" is the same rule as \"{other}\" at line {line}, column {column}; keep one of them"
                )),
                None => {
                    first.insert(key, (text, pos.line, pos.column));
                    rules.insert(key, action);
                    overlap(key)
                }
            },
        };
        if let Some(message) = problem {
            diags.push(file.diag_at(pos, Severity::Error, &at, message));
        }
    }
    Rules::new(rules)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_keys() {
        let cases = [
            ("404", Ok(Key::Code(404))),
            ("100", Ok(Key::Code(100))),
            ("599", Ok(Key::Code(599))),
            ("5xx", Ok(Key::Class(5))),
            ("4XX", Ok(Key::Class(4))),
            ("1xX", Ok(Key::Class(1))),
            ("6xx", Err("unknown status class \"6xx\": the classes are 1xx, 2xx, 3xx, 4xx and 5xx")),
            ("0xx", Err("unknown status class \"0xx\": the classes are 1xx, 2xx, 3xx, 4xx and 5xx")),
            ("700", Err("status code 700 is out of range: HTTP status codes are 100 to 599")),
            ("99", Err("status code 99 is out of range: HTTP status codes are 100 to 599")),
            (
                "99999999999999999999999",
                Err("status code 99999999999999999999999 is out of range: HTTP status codes are 100 to 599"),
            ),
            ("0404", Err("write code 0404 as 404")),
            ("4x", Err("\"4x\" is neither a status code (100 to 599) nor a status class (1xx to 5xx)")),
            ("axx", Err("\"axx\" is neither a status code (100 to 599) nor a status class (1xx to 5xx)")),
            ("", Err("\"\" is neither a status code (100 to 599) nor a status class (1xx to 5xx)")),
            (" 404", Err("\" 404\" is neither a status code (100 to 599) nor a status class (1xx to 5xx)")),
            ("é4xx", Err("\"é4xx\" is neither a status code (100 to 599) nor a status class (1xx to 5xx)")),
        ];
        for (text, expected) in cases {
            assert_eq!(status_key(text), expected.map_err(str::to_string), "{text:?}");
        }
    }

    #[test]
    fn exit_keys() {
        let cases = [
            ("0", Ok(Key::Code(0))),
            ("75", Ok(Key::Code(75))),
            ("255", Ok(Key::Code(255))),
            ("256", Err("exit code 256 is out of range: exit codes are 0 to 255")),
            ("075", Err("write code 075 as 75")),
            ("00", Err("write code 00 as 0")),
            ("5xx", Err("\"5xx\" is not an exit code (0 to 255)")),
            ("-1", Err("\"-1\" is not an exit code (0 to 255)")),
        ];
        for (text, expected) in cases {
            assert_eq!(exit_key(text), expected.map_err(str::to_string), "{text:?}");
        }
    }

    fn checked(yaml: &str, permanent: &[i32]) -> (Rules, Vec<(usize, usize, String, String)>) {
        let file = super::super::source::parse(std::path::Path::new("t.yaml"), yaml.to_string()).expect("parses");
        let written: BTreeMap<String, Action> = serde_json::from_value(file.value["rules"].clone()).expect("rules map");
        let mut diags = Vec::new();
        let rules = if permanent.is_empty() {
            on_status(&file, "/rules", &written, &mut diags)
        } else {
            on_exit(&file, "/rules", &written, permanent, &mut diags)
        };
        (rules, diags.into_iter().map(|d| (d.line, d.column, d.pointer, d.message)).collect())
    }

    #[test]
    fn one_rule_written_twice_is_reported_at_the_second() {
        let (rules, diags) = checked("rules:\n  5XX: retry\n  404: dead_letter\n  5xx: dead_letter\n", &[]);
        assert_eq!(
            diags,
            [(
                4,
                3,
                "/rules/5xx".to_string(),
                "\"5xx\" is the same rule as \"5XX\" at line 2, column 3; keep one of them".to_string()
            )]
        );
        // The first one written stands.
        assert_eq!(rules.find(503), Some((Key::Class(5), Action::Retry)));
        assert_eq!(rules.find(404), Some((Key::Code(404), Action::DeadLetter)));
    }

    #[test]
    fn an_exit_code_in_permanent_exit_codes_too_is_an_overlap() {
        let (_, diags) = checked("rules:\n  \"75\": retry\n  \"65\": dead_letter\n", &[65, 64]);
        let got: Vec<(usize, usize, &str)> = diags.iter().map(|(l, c, p, _)| (*l, *c, p.as_str())).collect();
        assert_eq!(got, [(3, 3, "/rules/65")]);
        assert!(diags[0].3.starts_with("exit code 65 is also in permanent_exit_codes;"), "{}", diags[0].3);
    }
}
