//! Diagnostics: one problem found in the pipeline files, at a file, line and column, and the
//! three ways `sluice validate` prints them (human, JSON, GitHub annotations).
//!
//! This module only formats; it never decides what is wrong.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::terminal::{self, visible};

/// How bad a problem is: errors fail validation, warnings and notes do not. A note says what
/// was left alone and why (a file that is not a pipeline).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
    Note,
}

impl Severity {
    fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
            Severity::Note => "note",
        }
    }

    /// The GitHub workflow command of the severity.
    fn github(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
            Severity::Note => "notice",
        }
    }
}

/// One problem at one place in one file (1-based line and column).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    pub file: PathBuf,
    pub line: usize,
    pub column: usize,
    pub severity: Severity,
    pub pointer: String,
    pub message: String,
}

impl Diagnostic {
    /// `file:line:col: error: /pointer: message`, the first line of the human format.
    pub fn headline(&self) -> String {
        let (file, text) = (self.file.display().to_string(), self.text());
        let (file, text) = (visible(&file), visible(&text));
        format!("{file}:{}:{}: {}: {text}", self.line, self.column, self.severity.as_str())
    }

    /// `/pointer: message`, or the message alone for a problem with the file as a whole.
    fn text(&self) -> String {
        if self.pointer.is_empty() { self.message.clone() } else { format!("{}: {}", self.pointer, self.message) }
    }
}

/// Output formats of `sluice validate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Human,
    Json,
    Github,
}

/// Renders every diagnostic in the chosen format; `source` looks up a file's text for snippets.
pub fn render(diagnostics: &[Diagnostic], format: Format, source: &dyn Fn(&Path) -> Option<String>) -> String {
    let mut out = String::new();
    match format {
        Format::Json => {
            // Serializing plain strings and numbers cannot fail.
            out = serde_json::to_string_pretty(diagnostics).unwrap_or_default();
            out.push('\n');
        }
        Format::Github => {
            for d in diagnostics {
                let _ = writeln!(
                    out,
                    "::{} file={},line={},col={}::{}",
                    d.severity.github(),
                    github_property(&d.file.display().to_string()),
                    d.line,
                    d.column,
                    github_data(&d.text())
                );
            }
        }
        Format::Human => {
            // Diagnostics come by file: each file is fetched and split into lines once, not
            // once per diagnostic (a file can have thousands).
            let mut file: Option<(&Path, Option<Lines>)> = None;
            for d in diagnostics {
                let _ = writeln!(out, "{}", d.headline());
                if file.as_ref().is_none_or(|(path, _)| *path != d.file) {
                    file = Some((&d.file, source(&d.file).map(Lines::new)));
                }
                if let Some((_, Some(lines))) = &file
                    && let Some(line) = lines.line(d.line)
                {
                    out.push_str(&snippet(line, d.line, d.column));
                }
            }
        }
    }
    out
}

/// A file's text by line, split once.
struct Lines {
    text: String,
    /// Each line's byte range, and whether it is ASCII (so that a column is a byte offset).
    lines: Vec<(usize, usize, bool)>,
}

impl Lines {
    fn new(text: String) -> Lines {
        let mut start = 0;
        let lines = lines(&text)
            .map(|line| {
                let end = start + line.len();
                let rest = &text[end..];
                let ending = if rest.starts_with("\r\n") { 2 } else { usize::from(!rest.is_empty()) };
                let range = (start, end, line.is_ascii());
                start = end + ending;
                range
            })
            .collect();
        Lines { text, lines }
    }

    /// Line `n` (1-based), and whether it is ASCII.
    fn line(&self, n: usize) -> Option<(&str, bool)> {
        let &(start, end, ascii) = self.lines.get(n.checked_sub(1)?)?;
        Some((&self.text[start..end], ascii))
    }
}

/// The longest line a snippet shows whole; of a longer one (a flow list of thousands of values
/// is one line, which each of its diagnostics would print) it shows [`SNIPPET_REACH`]
/// characters either side of the column.
const SNIPPET_WIDTH: usize = 200;
const SNIPPET_REACH: usize = 80;

/// The offending line with its number and a caret under the column; of a long line, the part
/// around the column, cut with `...`. A line holding control characters is not shown: it is not
/// pipeline text (a link to `/proc/self/environ` holds NULs), and escape sequences would reach
/// the terminal.
fn snippet((src, ascii): (&str, bool), line: usize, column: usize) -> String {
    let before = column.saturating_sub(1);
    let length = if ascii { src.len() } else { src.chars().count() };
    let (from, to) = if length <= SNIPPET_WIDTH {
        (0, length)
    } else {
        (before.saturating_sub(SNIPPET_REACH), before.saturating_add(SNIPPET_REACH))
    };
    // By bytes where they are characters: the cut costs the part shown, not the whole line.
    let byte = |chars: usize| {
        if ascii { chars.min(src.len()) } else { src.char_indices().nth(chars).map_or(src.len(), |(i, _)| i) }
    };
    let (start, end) = (byte(from), byte(to));
    let shown = &src[start..end];
    if shown.chars().any(|c| c != '\t' && terminal::is_hidden(c)) {
        return String::new();
    }
    let (head, tail) = (if start > 0 { "..." } else { "" }, if end < src.len() { "..." } else { "" });
    let gutter = line.to_string().len();
    let pad: String =
        head.chars().chain(shown.chars().take(before - from)).map(|c| if c == '\t' { '\t' } else { ' ' }).collect();
    format!("{:gutter$} |\n{line} | {head}{shown}{tail}\n{:gutter$} | {pad}^\n", "", "")
}

/// A workflow command's message ends at a line break, and `%` starts an escape
/// (<https://github.com/actions/toolkit/blob/main/packages/core/src/command.ts>); the job's log
/// is shown on a terminal, so other control characters (from file names, test names, messages)
/// are written as `terminal::visible` escapes, never raw.
fn github_data(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '\r' => out.push_str("%0D"),
            '\n' => out.push_str("%0A"),
            c if terminal::is_hidden(c) => out.push_str(&visible(c.encode_utf8(&mut [0; 4]))),
            c => out.push(c),
        }
    }
    out
}

/// A property value also ends at `,` (the next property) and `::` (the message).
fn github_property(s: &str) -> String {
    github_data(s).replace(':', "%3A").replace(',', "%2C")
}

/// Lines as YAML counts them, and so every position: `\n`, `\r\n` and a lone `\r` each end one
/// (`str::lines` ignores a lone `\r`).
pub fn lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = rest.find(['\n', '\r']).unwrap_or(rest.len());
        let line = &rest[..end];
        let ending = if rest[end..].starts_with("\r\n") { 2 } else { usize::from(end < rest.len()) };
        rest = &rest[end + ending..];
        Some(line)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_end_as_in_yaml() {
        let cases: &[(&str, &[&str])] = &[
            ("", &[]),
            ("a", &["a"]),
            ("a\n", &["a"]),
            ("a\n\nb", &["a", "", "b"]),
            ("a\r\nb\rc\n", &["a", "b", "c"]),
            ("a\r\r\n", &["a", ""]),
        ];
        for (text, want) in cases {
            assert_eq!(lines(text).collect::<Vec<_>>(), *want, "{text:?}");
        }
    }

    fn diag() -> Diagnostic {
        Diagnostic {
            file: PathBuf::from("pipelines/orders.yaml"),
            line: 2,
            column: 5,
            severity: Severity::Error,
            pointer: "/queues/a/concurrency".into(),
            message: "0 is less than the minimum of 1".into(),
        }
    }

    #[test]
    fn human_has_headline_and_caret() {
        let text = "version: 1\nfoo: bar\n";
        let out = render(&[diag()], Format::Human, &|_| Some(text.to_string()));
        assert_eq!(
            out,
            "pipelines/orders.yaml:2:5: error: /queues/a/concurrency: 0 is less than the minimum of 1\n  |\n2 | foo: bar\n  |     ^\n"
        );
    }

    /// Issue 31 item 6: each of thousands of diagnostics on one long line (a flow list) printed
    /// the whole line. A long line is shown around the column, the caret under it.
    #[test]
    fn a_long_line_is_shown_around_the_column() {
        let line = format!("in: [{}]", (0..1000).map(|i| i.to_string()).collect::<Vec<_>>().join(", "));
        let column = line.find("500,").expect("in the list") + 1;
        let d = Diagnostic { line: 1, column, ..diag() };
        let out = render(&[d], Format::Human, &|_| Some(line.clone()));
        let shown: Vec<&str> = out.lines().collect();
        let (text, caret) = (shown[2], shown[3]);
        assert!(text.starts_with("1 | ...") && text.ends_with("..."), "{text}");
        assert_eq!(text.len(), "1 | ...".len() + 2 * SNIPPET_REACH + "...".len(), "{text}");
        assert_eq!(&text[caret.len() - 1..caret.len() + 3], "500,", "{text}\n{caret}");
        // A short line, and the start or end of a long one, are shown as they are.
        let d = Diagnostic { line: 1, column: 2, ..diag() };
        let out = render(&[d], Format::Human, &|_| Some(line.clone()));
        assert!(out.lines().nth(2).is_some_and(|t| t.starts_with("1 | in: [0, 1") && t.ends_with("...")), "{out}");
    }

    #[test]
    fn snippet_counts_a_lone_carriage_return_as_a_line_break() {
        let text = "version: 1\rfoo: bar\r";
        let out = render(&[diag()], Format::Human, &|_| Some(text.to_string()));
        assert!(out.contains("\n2 | foo: bar\n"), "{out}");
    }

    #[test]
    fn github_annotation() {
        let out = render(&[diag()], Format::Github, &|_| None);
        assert_eq!(
            out,
            "::error file=pipelines/orders.yaml,line=2,col=5::/queues/a/concurrency: 0 is less than the minimum of 1\n"
        );
    }

    #[test]
    fn github_annotation_without_pointer() {
        let d = Diagnostic { pointer: String::new(), message: "YAML syntax error: x".into(), ..diag() };
        let out = render(&[d], Format::Github, &|_| None);
        assert_eq!(out, "::error file=pipelines/orders.yaml,line=2,col=5::YAML syntax error: x\n");
    }

    // Issue 9: a file name is a pull request's to choose; it must not end the annotation early
    // or start another one.
    #[test]
    fn github_annotation_escapes_properties_and_message() {
        let cases = [
            ("a,b:c.yaml", "m", "::error file=a%2Cb%3Ac.yaml,line=2,col=5::m\n"),
            ("100%.yaml", "50% done", "::error file=100%25.yaml,line=2,col=5::50%25 done\n"),
            (
                "x.yaml\n::error file=evil.yaml,line=1,col=1::pwned",
                "one\r\ntwo: a,b",
                "::error file=x.yaml%0A%3A%3Aerror file=evil.yaml%2Cline=1%2Ccol=1%3A%3Apwned,line=2,col=5::one%0D%0Atwo: a,b\n",
            ),
        ];
        for (file, message, want) in cases {
            let d = Diagnostic { file: PathBuf::from(file), pointer: String::new(), message: message.into(), ..diag() };
            assert_eq!(render(&[d], Format::Github, &|_| None), want, "{file:?}");
        }
    }

    // Issue 31 (low): ESC and BEL from a file name or a message reached the job's log raw.
    #[test]
    fn github_annotation_escapes_control_characters() {
        let d = Diagnostic {
            file: PathBuf::from("a\x1b[2J.yaml"),
            pointer: String::new(),
            message: "bell\x07 \u{202e}txt".into(),
            ..diag()
        };
        let out = render(&[d], Format::Github, &|_| None);
        assert_eq!(out, "::error file=a\\x1b[2J.yaml,line=2,col=5::bell\\x07 \\u{202e}txt\n");
    }

    // Issue 9: a link to /proc/self/environ printed the environment in the snippet.
    #[test]
    fn a_line_with_control_characters_has_no_snippet() {
        let cases = [
            ("version: 1\nfoo: bar\n", true),
            ("version: 1\n\tfoo: bar\n", true),
            ("version: 1\nSECRET=x\0PATH=/bin\n", false),
            ("version: 1\nfoo: \x1b[2Jbar\n", false),
            ("version: 1\nfoo: \u{202E}rab\n", false),
            ("version: 1\u{7f}\nfoo: bar\n", true),
        ];
        for (text, shown) in cases {
            let out = render(&[diag()], Format::Human, &|_| Some(text.to_string()));
            assert_eq!(out.contains(" | "), shown, "{text:?}: {out}");
            assert!(out.starts_with("pipelines/orders.yaml:2:5: error: "), "{out}");
        }
    }

    #[test]
    fn headline_escapes_control_characters() {
        let d = Diagnostic {
            file: PathBuf::from("a\nb.yaml"),
            pointer: "/queues/\u{1b}[31m".into(),
            message: "m".into(),
            ..diag()
        };
        assert_eq!(d.headline(), "a\\nb.yaml:2:5: error: /queues/\\x1b[31m: m");
    }

    #[test]
    fn json_fields() {
        let out = render(&[diag()], Format::Json, &|_| None);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v[0]["line"], 2);
        assert_eq!(v[0]["severity"], "error");
        assert_eq!(v[0]["pointer"], "/queues/a/concurrency");
    }
}
