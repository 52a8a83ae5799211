//! Diagnostics: one problem found in the pipeline files, at a file, line and column, and the
//! three ways `sluice validate` prints them (human, JSON, GitHub annotations).
//!
//! This module only formats; it never decides what is wrong.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

/// How bad a problem is: errors fail validation, warnings do not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

impl Severity {
    fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
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
        format!("{}:{}:{}: {}: {}", self.file.display(), self.line, self.column, self.severity.as_str(), self.text())
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
                    d.severity.as_str(),
                    d.file.display(),
                    d.line,
                    d.column,
                    github_escape(&d.text())
                );
            }
        }
        Format::Human => {
            for d in diagnostics {
                let _ = writeln!(out, "{}", d.headline());
                if let Some(text) = source(&d.file) {
                    out.push_str(&snippet(&text, d.line, d.column));
                }
            }
        }
    }
    out
}

/// The offending line with its number and a caret under the column.
fn snippet(text: &str, line: usize, column: usize) -> String {
    let Some(src) = super::source::lines(text).nth(line.saturating_sub(1)) else {
        return String::new();
    };
    let gutter = line.to_string().len();
    let pad: String = src.chars().take(column.saturating_sub(1)).map(|c| if c == '\t' { '\t' } else { ' ' }).collect();
    format!("{:gutter$} |\n{line} | {src}\n{:gutter$} | {pad}^\n", "", "")
}

/// GitHub workflow commands end a message at a newline and treat `%` specially.
fn github_escape(s: &str) -> String {
    s.replace('%', "%25").replace('\r', "%0D").replace('\n', "%0A")
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn json_fields() {
        let out = render(&[diag()], Format::Json, &|_| None);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v[0]["line"], 2);
        assert_eq!(v[0]["severity"], "error");
        assert_eq!(v[0]["pointer"], "/queues/a/concurrency");
    }
}
