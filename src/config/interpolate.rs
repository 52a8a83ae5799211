//! `${VAR}`, `${VAR:-default}` and `${VAR:?message}` in the values of a parsed pipeline file,
//! resolved from the environment when the file is loaded; `$$` is a literal `$`, and a `$`
//! before anything else stays as written (`$1`, `$HOME`: no bare `$VAR` form).
//!
//! Substitution works on the parsed document, never on its text: a value cannot add YAML
//! structure, and keys stay as written. A plain scalar is typed again once substituted, as YAML
//! typed it (`concurrency: ${WORKERS:-4}` is a number); a quoted one stays a string. A default
//! or message is literal text up to the first `}` (no nesting), a value is never scanned again,
//! and a value holding a line break is refused (as Vector refuses it).
//!
//! This module never reads the environment itself: [`Env`] brings the lookup.

use std::collections::HashMap;
use std::env::VarError;

use super::diagnostic::{Diagnostic, Severity};
use super::source::{MAX_FILE_BYTES, SourceFile, Substitution, escape_token, is_null};

/// How loading treats a variable that is unset and has no default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unset {
    /// An error: for the commands that use the config (`run`, `test`, `plan`, ...).
    Error,
    /// A warning, the value that reads it left unchecked: for `validate` (CI has no secrets).
    Warning,
}

/// Where `${VAR}` takes its values from, and what an unset variable without a default is.
#[derive(Debug, Clone, Copy)]
pub struct Env {
    pub lookup: fn(&str) -> Result<String, VarError>,
    pub unset: Unset,
}

impl Env {
    /// The process's environment.
    pub fn process(unset: Unset) -> Env {
        Env { lookup: |name| std::env::var(name), unset }
    }
}

/// The most the environment's values may add to one file: a file of a MiB referring to a large
/// variable thousands of times must not take gigabytes to load.
const MAX_ADDED_BYTES: usize = MAX_FILE_BYTES as usize;

/// The most problems reported for one string: the rest of a string that is wrong this often
/// says nothing new.
const MAX_FAULTS: usize = 10;

/// What substitution found in one file.
#[derive(Debug, Default)]
pub struct Interpolated {
    pub diagnostics: Vec<Diagnostic>,
    /// The strings left as written because of a diagnostic above: what the other checks say
    /// about them would only repeat it.
    pub unresolved: Vec<String>,
    /// Each variable unset here (without a default) that a string left as written reads, by
    /// the string's pointer: what a command that does not use the string can do without.
    pub unset: Vec<(String, String)>,
}

/// Substitutes the environment into every string value of `file` (keys are left alone).
pub fn interpolate(file: &mut SourceFile, env: &Env) -> Interpolated {
    let mut value = std::mem::take(&mut file.value);
    let mut out = Interpolated::default();
    let mut scan = Scan::new(env);
    // An explicit stack: no recursion, however deep the document.
    let mut stack: Vec<(String, &mut serde_json::Value)> = vec![(String::new(), &mut value)];
    while let Some((pointer, node)) = stack.pop() {
        match node {
            serde_json::Value::Object(map) => {
                stack.extend(map.iter_mut().map(|(k, v)| (format!("{pointer}/{}", escape_token(k)), v)));
            }
            serde_json::Value::Array(items) => {
                stack.extend(items.iter_mut().enumerate().map(|(i, v)| (format!("{pointer}/{i}"), v)));
            }
            serde_json::Value::String(text) if text.contains('$') => {
                let (substituted, faults) = scan.string(text);
                if faults.is_empty() {
                    *node = if file.typed(&pointer) {
                        let value = typed(substituted.clone());
                        file.substituted(pointer, Substitution { written: text.clone(), value: substituted });
                        value
                    } else {
                        substituted.into()
                    };
                    continue;
                }
                for fault in faults {
                    if let Kind::Unset { name } | Kind::Required { name, .. } = &fault.kind {
                        out.unset.push((pointer.clone(), name.clone()));
                    }
                    let pos = file.offset_pos(&pointer, text, fault.offset);
                    let severity = match (&fault.kind, env.unset) {
                        (Kind::Unset { .. } | Kind::Required { .. }, Unset::Warning) => Severity::Warning,
                        _ => Severity::Error,
                    };
                    out.diagnostics.push(file.diag_at(pos, severity, &pointer, fault.kind.message(severity)));
                }
                out.unresolved.push(pointer);
            }
            _ => {}
        }
    }
    file.value = value;
    out
}

/// One problem in a string, at the byte offset of its `$`.
#[derive(Debug, PartialEq, Eq)]
struct Fault {
    offset: usize,
    kind: Kind,
}

#[derive(Debug, PartialEq, Eq)]
enum Kind {
    Unclosed,
    BadName,
    BadOperator {
        name: String,
    },
    Nested {
        name: String,
    },
    Unset {
        name: String,
    },
    Required {
        name: String,
        message: String,
    },
    LineBreak {
        name: String,
    },
    NotUnicode {
        name: String,
    },
    /// `name` would take the bytes the environment adds to the file past the limit; `most` is
    /// the variable that adds the most, counting this use: its bytes in all and its uses.
    TooLarge {
        name: String,
        most: (String, usize, usize),
    },
}

impl Kind {
    fn message(&self, severity: Severity) -> String {
        let literal = "(write `$${` for a literal `${`)";
        match self {
            Kind::Unclosed => format!("`${{` has no closing `}}` {literal}"),
            Kind::BadName => {
                format!(
                    "`${{` is followed by a variable name: letters, digits and `_`, not starting with a digit {literal}"
                )
            }
            Kind::BadOperator { name } => {
                format!("`${{{name}` is followed by `}}`, `:-default` or `:?message` {literal}")
            }
            Kind::Nested { name } => format!(
                "`${{{name}:...}}` holds another `${{`: a default or message is literal text, \
                 and cannot read another variable"
            ),
            Kind::Unset { name } if severity == Severity::Warning => format!(
                "environment variable {name} is not set here, and `${{{name}}}` has no default: \
                 `sluice run` refuses this file where it is unset"
            ),
            Kind::Unset { name } => format!(
                "environment variable {name} is not set, and `${{{name}}}` has no default: \
                 set it, or give one, as in `${{{name}:-default}}`"
            ),
            Kind::Required { name, message } => format!("environment variable {name} is not set or empty: {message}"),
            Kind::LineBreak { name } => {
                format!("environment variable {name} holds a line break; values with line breaks are refused")
            }
            Kind::NotUnicode { name } => format!("environment variable {name} is not UTF-8 text"),
            Kind::TooLarge { name, most: (most, bytes, uses) } => {
                let whose = if most == name {
                    format!("{name} would add {bytes} bytes in {uses} uses")
                } else {
                    format!("most of them come from {most} ({bytes} bytes in {uses} uses)")
                };
                format!(
                    "substituting {name} here makes the environment's values add more than {} KiB to this file, \
                     the most allowed: {whose}",
                    MAX_ADDED_BYTES >> 10
                )
            }
        }
    }
}

/// The substitution of one file's strings.
struct Scan<'a> {
    env: &'a Env,
    /// Bytes the environment's values added to the file so far.
    added: usize,
    /// Per variable, the bytes it added and how many times it was substituted, to name the
    /// one that fills the file when the limit is reached.
    uses: HashMap<String, (usize, usize)>,
}

impl<'a> Scan<'a> {
    fn new(env: &'a Env) -> Scan<'a> {
        Scan { env, added: 0, uses: HashMap::new() }
    }

    /// `text` with every `${...}` substituted and `$$` made `$`, and what went wrong where
    /// (when anything did, the text is of no use).
    fn string(&mut self, text: &str) -> (String, Vec<Fault>) {
        let mut out = String::with_capacity(text.len());
        let mut faults = Vec::new();
        let mut at = 0;
        while let Some(found) = text[at..].find('$') {
            let dollar = at + found;
            out.push_str(&text[at..dollar]);
            let rest = &text[dollar + 1..];
            if rest.starts_with('$') {
                out.push('$');
                at = dollar + 2;
            } else if let Some(inner) = rest.strip_prefix('{') {
                let Some(close) = inner.find('}') else {
                    faults.push(Fault { offset: dollar, kind: Kind::Unclosed });
                    break;
                };
                match self.expression(&inner[..close]) {
                    Ok(value) => out.push_str(&value),
                    Err(kind) => {
                        // After a syntax error, what follows is not worth reading.
                        let syntax = matches!(kind, Kind::BadName | Kind::BadOperator { .. } | Kind::Nested { .. });
                        faults.push(Fault { offset: dollar, kind });
                        if syntax || faults.len() == MAX_FAULTS {
                            break;
                        }
                    }
                }
                at = dollar + 2 + close + 1;
            } else {
                out.push('$');
                at = dollar + 1;
            }
        }
        if faults.is_empty() {
            out.push_str(&text[at..]);
        }
        (out, faults)
    }

    /// The value of what stands between `${` and `}`.
    fn expression(&mut self, body: &str) -> Result<String, Kind> {
        let end = body.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(body.len());
        let (name, operator) = body.split_at(end);
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(Kind::BadName);
        }
        let owned = || name.to_string();
        let (fallback, required) = if operator.is_empty() {
            (None, None)
        } else if let Some(default) = operator.strip_prefix(":-") {
            (Some(default), None)
        } else if let Some(message) = operator.strip_prefix(":?") {
            (None, Some(message))
        } else {
            return Err(Kind::BadOperator { name: owned() });
        };
        if operator.contains("${") {
            return Err(Kind::Nested { name: owned() });
        }
        let value = match (self.env.lookup)(name) {
            Ok(value) => Some(value),
            Err(VarError::NotPresent) => None,
            Err(VarError::NotUnicode(_)) => return Err(Kind::NotUnicode { name: owned() }),
        };
        let value = match (value, fallback, required) {
            (Some(v), None, None) => v,
            (Some(v), _, _) if !v.is_empty() => v,
            (_, Some(default), _) => return Ok(default.to_string()),
            (_, _, Some(message)) => return Err(Kind::Required { name: owned(), message: message.to_string() }),
            (None, None, None) => return Err(Kind::Unset { name: owned() }),
        };
        if value.contains(['\n', '\r']) {
            return Err(Kind::LineBreak { name: owned() });
        }
        let (bytes, uses) = self.uses.get(name).copied().unwrap_or_default();
        let (bytes, uses) = (bytes.saturating_add(value.len()), uses + 1);
        let added = self.added.saturating_add(value.len());
        if added > MAX_ADDED_BYTES {
            // Refused, so not counted: what a later, smaller value adds may still fit.
            let most = self
                .uses
                .iter()
                .map(|(n, &(b, u))| (n.as_str(), b, u))
                .chain([(name, bytes, uses)])
                .max_by_key(|&(n, b, _)| (b, std::cmp::Reverse(n)))
                .map(|(n, b, u)| (n.to_string(), b, u))
                .unwrap_or_default();
            return Err(Kind::TooLarge { name: owned(), most });
        }
        self.added = added;
        self.uses.insert(owned(), (bytes, uses));
        Ok(value)
    }
}

/// A plain scalar's substituted text as YAML would type it: a number, a boolean or null where
/// it reads as one (YAML 1.2 core schema), else the string. Nothing else is parsed: a value
/// never becomes a list or a mapping.
fn typed(text: String) -> serde_json::Value {
    match text.as_str() {
        t if is_null(t) => serde_json::Value::Null,
        "true" | "True" | "TRUE" => true.into(),
        "false" | "False" | "FALSE" => false.into(),
        t if is_number(t) => {
            // The YAML loader's own reading of the number, so that it types it as it would in the file.
            match serde_yaml::from_str::<serde_json::Value>(t) {
                Ok(number @ serde_json::Value::Number(_)) => number,
                _ => text.into(),
            }
        }
        _ => text.into(),
    }
}

/// Whether `text` is an integer or a finite float of the YAML 1.2 core schema: `8`, `-3`,
/// `0x1f`, `0o17`, `1.5`, `.5`, `1e3`.
fn is_number(text: &str) -> bool {
    let digits = |s: &str, radix: u32| !s.is_empty() && s.chars().all(|c| c.is_digit(radix));
    if let Some(hex) = text.strip_prefix("0x") {
        return digits(hex, 16);
    }
    if let Some(octal) = text.strip_prefix("0o") {
        return digits(octal, 8);
    }
    let unsigned = text.strip_prefix(['-', '+']).unwrap_or(text);
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        Some((m, e)) => (m, Some(e.strip_prefix(['-', '+']).unwrap_or(e))),
        None => (unsigned, None),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let mantissa_ok = (whole.is_empty() || digits(whole, 10))
        && (fraction.is_empty() || digits(fraction, 10))
        && !(whole.is_empty() && fraction.is_empty());
    mantissa_ok && exponent.is_none_or(|e| digits(e, 10))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::source;

    fn lookup(name: &str) -> Result<String, VarError> {
        match name {
            "HOST" => Ok("h.example".into()),
            "EMPTY" => Ok(String::new()),
            "PORT" => Ok("8080".into()),
            "TWO_LINES" => Ok("a\nb".into()),
            "CR" => Ok("a\rb".into()),
            "DOLLARS" => Ok("$${X} ${HOST}".into()),
            "LATIN1" => Err(VarError::NotUnicode("caf\u{e9}".into())),
            "BIG" => Ok("x".repeat(70 * 1024)),
            _ => Err(VarError::NotPresent),
        }
    }

    const ENV: Env = Env { lookup, unset: Unset::Error };

    /// The problems of one string, by byte offset.
    type Faults = Vec<(usize, Kind)>;

    fn substitute(text: &str) -> Result<String, Faults> {
        let (out, faults) = Scan::new(&ENV).string(text);
        if faults.is_empty() { Ok(out) } else { Err(faults.into_iter().map(|f| (f.offset, f.kind)).collect()) }
    }

    fn name(n: &str) -> String {
        n.to_string()
    }

    #[test]
    fn substitution_rules() {
        let cases: Vec<(&str, Result<&str, Faults>)> = vec![
            ("no dollar", Ok("no dollar")),
            ("https://${HOST}:${PORT}/x", Ok("https://h.example:8080/x")),
            ("${HOST}${HOST}", Ok("h.exampleh.example")),
            ("${EMPTY}", Ok("")),
            ("${MISSING:-fallback value}", Ok("fallback value")),
            ("${EMPTY:-used when empty too}", Ok("used when empty too")),
            ("${HOST:-unused}", Ok("h.example")),
            ("${MISSING:-}", Ok("")),
            ("${MISSING:-a:b-c?d$e}", Ok("a:b-c?d$e")),
            ("${HOST:?needed}", Ok("h.example")),
            // `$$` is a `$`; a `$` before anything else is left alone.
            ("$${HOST}", Ok("${HOST}")),
            ("$$$${HOST}", Ok("$${HOST}")),
            ("$$${HOST}", Ok("$h.example")),
            ("cost: $5, $HOME, $1, a $ b, $", Ok("cost: $5, $HOME, $1, a $ b, $")),
            ("$$", Ok("$")),
            ("$$$", Ok("$$")),
            // Handlebars is not touched, and a value is never scanned again.
            ("{{env.HOST}} {{payload.x}} ${HOST}", Ok("{{env.HOST}} {{payload.x}} h.example")),
            ("${DOLLARS}", Ok("$${X} ${HOST}")),
            ("x ${MISSING}", Err(vec![(2, Kind::Unset { name: name("MISSING") })])),
            ("${A} ${B}", Err(vec![(0, Kind::Unset { name: name("A") }), (5, Kind::Unset { name: name("B") })])),
            (
                "${EMPTY:?the token}",
                Err(vec![(0, Kind::Required { name: name("EMPTY"), message: "the token".into() })]),
            ),
            ("${MISSING:?}", Err(vec![(0, Kind::Required { name: name("MISSING"), message: String::new() })])),
            ("a ${TWO_LINES}", Err(vec![(2, Kind::LineBreak { name: name("TWO_LINES") })])),
            ("${CR:-x}", Err(vec![(0, Kind::LineBreak { name: name("CR") })])),
            ("${LATIN1:-x}", Err(vec![(0, Kind::NotUnicode { name: name("LATIN1") })])),
            // Malformed: an error at the `$`, never left as literal text.
            ("ab ${HOST", Err(vec![(3, Kind::Unclosed)])),
            ("${", Err(vec![(0, Kind::Unclosed)])),
            ("x${}", Err(vec![(1, Kind::BadName)])),
            ("${1ST}", Err(vec![(0, Kind::BadName)])),
            ("${-x}", Err(vec![(0, Kind::BadName)])),
            ("${HÖST}", Err(vec![(0, Kind::BadOperator { name: name("H") })])),
            ("${HOST-x}", Err(vec![(0, Kind::BadOperator { name: name("HOST") })])),
            ("${HOST?x}", Err(vec![(0, Kind::BadOperator { name: name("HOST") })])),
            ("${A B}", Err(vec![(0, Kind::BadOperator { name: name("A") })])),
            // Nesting is not supported: said so, not read as a default of "${B".
            ("${A:-${B}}", Err(vec![(0, Kind::Nested { name: name("A") })])),
            ("${A:?${B}}", Err(vec![(0, Kind::Nested { name: name("A") })])),
            // A syntax error ends the reading of the string.
            ("${1} ${MISSING}", Err(vec![(0, Kind::BadName)])),
        ];
        for (text, want) in cases {
            let want = want.map(str::to_string);
            assert_eq!(substitute(text), want, "{text:?}");
        }
    }

    proptest::proptest! {
        // `$$` writes any text at all, dollars and braces included.
        #[test]
        fn doubling_every_dollar_writes_the_text_as_it_is(text in "[${}:?a-zA-Z_ \n-]{0,60}") {
            proptest::prop_assert_eq!(substitute(&text.replace('$', "$$")), Ok(text));
        }

        // Whatever the text, reading it ends without a panic, and a text without `$` is kept.
        #[test]
        fn any_text_is_read(text in "\\PC{0,80}") {
            let read = substitute(&text);
            if !text.contains('$') {
                proptest::prop_assert_eq!(read, Ok(text));
            }
        }
    }

    #[test]
    fn problems_in_one_string_are_bounded() {
        let text = "${NOPE}".repeat(50_000);
        let Err(faults) = substitute(&text) else { panic!("unset variables") };
        assert_eq!(faults.len(), MAX_FAULTS);
    }

    // A hostile pipeline file refers to a large variable of the CI's environment many times.
    #[test]
    fn the_environment_adds_at_most_a_mib_to_a_file() {
        assert_eq!(substitute("${BIG}").map(|v| v.len()), Ok(70 * 1024));
        let mut scan = Scan::new(&ENV);
        let per_string = "${BIG}".repeat(5);
        let results: Vec<bool> = (0..4).map(|_| scan.string(&per_string).1.is_empty()).collect();
        // 14 values fit in a MiB; the 15th is refused, in the third string.
        assert_eq!(results, [true, true, false, false]);
        let (_, faults) = Scan::new(&ENV).string(&"${BIG}".repeat(20));
        let most = (name("BIG"), 15 * 70 * 1024, 15);
        assert_eq!(faults.first(), Some(&Fault { offset: 14 * 6, kind: Kind::TooLarge { name: name("BIG"), most } }));
    }

    #[test]
    fn plain_scalars_are_typed_again() {
        let cases = [
            ("8", serde_json::json!(8)),
            ("-3", serde_json::json!(-3)),
            ("+3", serde_json::json!(3)),
            ("0x1f", serde_json::json!(31)),
            ("0o17", serde_json::json!(15)),
            ("1.5", serde_json::json!(1.5)),
            (".5", serde_json::json!(0.5)),
            ("1e3", serde_json::json!(1000.0)),
            ("true", serde_json::json!(true)),
            ("FALSE", serde_json::json!(false)),
            ("", serde_json::Value::Null),
            ("~", serde_json::Value::Null),
            ("8s", serde_json::json!("8s")),
            ("1.2.3", serde_json::json!("1.2.3")),
            (".", serde_json::json!(".")),
            ("yes", serde_json::json!("yes")),
            ("0x", serde_json::json!("0x")),
            // What would be structure in the file stays text.
            ("[1, 2]", serde_json::json!("[1, 2]")),
            ("a: b", serde_json::json!("a: b")),
            ("- x", serde_json::json!("- x")),
            ("---", serde_json::json!("---")),
            ("8 # comment", serde_json::json!("8 # comment")),
            ("&a 8", serde_json::json!("&a 8")),
            (".inf", serde_json::json!(".inf")),
        ];
        for (text, want) in cases {
            assert_eq!(typed(text.to_string()), want, "{text:?}");
        }
    }

    fn interpolated(yaml: &str, unset: Unset) -> (SourceFile, Interpolated) {
        let mut file = source::parse(Path::new("t.yaml"), yaml.to_string()).expect("parses");
        let out = interpolate(&mut file, &Env { lookup, unset });
        (file, out)
    }

    #[test]
    fn only_values_are_substituted_and_plain_ones_are_typed() {
        let yaml = r#"
a: ${PORT}
b: "${PORT}"
c: '${PORT}'
d: !!str ${PORT}
e:
  - ${PORT}
  - "${PORT}"
  - x${PORT}
${HOST}: key
f: |
  ${HOST}
  line two
g: ${MISSING:-}
h: ${EMPTY:-true}
x-anchor: &n
  n: ${PORT}
  s: "${PORT}"
i: *n
j:
  <<: *n
  s: ${PORT}
k:
  n: "${PORT}"
  <<: *n
"#;
        let (file, out) = interpolated(yaml, Unset::Error);
        assert!(out.diagnostics.is_empty(), "{:?}", out.diagnostics);
        let n = serde_json::json!({"n": 8080, "s": "8080"});
        assert_eq!(
            file.value,
            serde_json::json!({
                "a": 8080, "b": "8080", "c": "8080", "d": "8080", "e": [8080, "8080", "x8080"],
                "${HOST}": "key", "f": "h.example\nline two\n", "g": null, "h": true,
                "x-anchor": n, "i": n, "j": {"n": 8080, "s": 8080}, "k": {"n": "8080", "s": "8080"},
            })
        );
    }

    #[test]
    fn problems_point_at_the_dollar() {
        let yaml = "version: 1\nurl: \"https://${HOST}/${NOPE}\"\nplain: a ${1X}\nblock: |\n  x ${NOPE}\n";
        let (file, out) = interpolated(yaml, Unset::Error);
        let got: Vec<(usize, usize, Severity, &str)> =
            out.diagnostics.iter().map(|d| (d.line, d.column, d.severity, d.pointer.as_str())).collect();
        // A block scalar starts on its first line of text.
        let mut want = vec![
            (2, 23, Severity::Error, "/url"),
            (3, 10, Severity::Error, "/plain"),
            (5, 5, Severity::Error, "/block"),
        ];
        want.sort();
        let mut got = got;
        got.sort();
        assert_eq!(got, want);
        let mut unresolved = out.unresolved.clone();
        unresolved.sort();
        assert_eq!(unresolved, ["/block", "/plain", "/url"]);
        // Left as written.
        assert_eq!(file.value["url"], "https://${HOST}/${NOPE}");
        let unset = out.diagnostics.iter().find(|d| d.pointer == "/url").expect("a diagnostic");
        assert_eq!(
            unset.message,
            "environment variable NOPE is not set, and `${NOPE}` has no default: set it, or give one, as in `${NOPE:-default}`"
        );
    }

    #[test]
    fn unset_variables_are_warnings_when_asked_and_other_problems_stay_errors() {
        let yaml = "a: ${NOPE}\nb: ${NOPE:?the hook's URL}\nc: ${TWO_LINES}\nd: ${A B}\n";
        let (_, out) = interpolated(yaml, Unset::Warning);
        let got: Vec<(&str, Severity, &str)> =
            out.diagnostics.iter().map(|d| (d.pointer.as_str(), d.severity, d.message.as_str())).collect();
        let mut got = got;
        got.sort();
        assert_eq!(
            got,
            [
                (
                    "/a",
                    Severity::Warning,
                    "environment variable NOPE is not set here, and `${NOPE}` has no default: `sluice run` refuses this file where it is unset"
                ),
                ("/b", Severity::Warning, "environment variable NOPE is not set or empty: the hook's URL"),
                (
                    "/c",
                    Severity::Error,
                    "environment variable TWO_LINES holds a line break; values with line breaks are refused"
                ),
                (
                    "/d",
                    Severity::Error,
                    "`${A` is followed by `}`, `:-default` or `:?message` (write `$${` for a literal `${`)"
                ),
            ]
        );
    }

    #[test]
    fn a_dollar_brace_at_the_end_of_the_file() {
        let (_, out) = interpolated("a: 1\nb: x ${", Unset::Error);
        let got: Vec<(usize, usize, &str)> =
            out.diagnostics.iter().map(|d| (d.line, d.column, d.message.as_str())).collect();
        assert_eq!(got, [(2, 6, "`${` has no closing `}` (write `$${` for a literal `${`)")]);
    }

    #[test]
    fn other_checks_do_not_repeat_what_substitution_said() {
        let yaml = r#"version: 1
queues:
  a:
    concurrency: ${NOPE}
    handler:
      webhook:
        url: ${NOPE}/hook
  b:
    max_length: ${PORT}
    handler:
      webhook: {url: "http://h.example/", timeout: "${PORT}ms"}
"#;
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
        for (unset, severity) in [(Unset::Error, Severity::Error), (Unset::Warning, Severity::Warning)] {
            let validation =
                super::super::compile::load(&[dir.path().to_path_buf()], &Env { lookup, unset }, &Default::default());
            let got: Vec<(usize, usize, Severity)> =
                validation.diagnostics.iter().map(|d| (d.line, d.column, d.severity)).collect();
            assert_eq!(got, [(4, 18, severity), (7, 14, severity)], "{:?}", validation.diagnostics);
            assert_eq!(validation.config.is_some(), unset == Unset::Warning);
            if let Some(config) = validation.config {
                // Both queues are there: what could be checked was.
                assert_eq!(config.queues.len(), 2);
                let b = &config.queues["b"];
                assert_eq!((b.max_length, b.handler.timeout()), (Some(8080), std::time::Duration::from_millis(8080)));
            }
        }
    }
}
