//! How `sluice test` prints what it found: human (a line per test, a diff per failure),
//! JSON, JUnit XML for CI dashboards, and GitHub annotations at each failed expectation.
//!
//! This module only formats; the tests have run.

use std::fmt::Write as _;

use serde_json::json;

use super::{Outcome, TestResult};
use crate::config::diagnostic::{self, Diagnostic, Format as DiagnosticFormat, Severity};
use crate::terminal::visible;

/// Output formats of `sluice test`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Human,
    Json,
    Junit,
    Github,
}

/// Everything found, in `format`.
pub fn render(outcome: &Outcome, format: Format) -> String {
    let source = |path: &std::path::Path| outcome.sources.get(path).cloned();
    match format {
        Format::Human => human(outcome, &source),
        Format::Json => {
            let passed = outcome.results.len() - outcome.failed();
            let tests: Vec<serde_json::Value> = outcome
                .results
                .iter()
                .map(|r| {
                    json!({
                        "file": r.file, "line": r.line, "column": r.column, "name": r.name,
                        "passed": r.passed(), "failures": r.failures,
                    })
                })
                .collect();
            let all = json!({
                "passed": passed,
                "failed": outcome.failed(),
                "tests": tests,
                "diagnostics": outcome.diagnostics,
            });
            // Serializing plain strings and numbers cannot fail.
            format!("{}\n", serde_json::to_string_pretty(&all).unwrap_or_default())
        }
        Format::Junit => junit(outcome),
        Format::Github => {
            let mut all = outcome.diagnostics.clone();
            all.extend(outcome.results.iter().flat_map(annotations));
            diagnostic::render(&all, DiagnosticFormat::Github, &source)
        }
    }
}

fn human(outcome: &Outcome, source: &dyn Fn(&std::path::Path) -> Option<String>) -> String {
    let mut out = diagnostic::render(&outcome.diagnostics, DiagnosticFormat::Human, source);
    if outcome.has_errors() {
        out.push_str("no tests ran: the files above have errors\n");
        return out;
    }
    // Names, values and errors come from the test files and what the pipelines render: a
    // control character in them must not rewrite a verdict on the terminal.
    for r in &outcome.results {
        let verdict = if r.passed() { "ok  " } else { "FAIL" };
        let file = r.file.display().to_string();
        let _ = writeln!(out, "{verdict} {}:{}:{}: {}", visible(&file), r.line, r.column, visible(&r.name));
        for f in &r.failures {
            let m = &f.mismatch;
            let _ = writeln!(out, "     {} (line {})", visible(&m.field), f.line);
            let _ = writeln!(out, "       expected: {}", visible(&m.expected));
            let _ = writeln!(out, "       actual:   {}", visible(&m.actual));
        }
    }
    let failed = outcome.failed();
    let verdict = if failed == 0 { "ok" } else { "FAILED" };
    let _ = writeln!(out, "\ntest result: {verdict}. {} passed; {failed} failed", outcome.results.len() - failed);
    out
}

/// One annotation per difference, at the expectation.
fn annotations(r: &TestResult) -> Vec<Diagnostic> {
    r.failures
        .iter()
        .map(|f| Diagnostic {
            file: r.file.clone(),
            line: f.line,
            column: f.column,
            severity: Severity::Error,
            pointer: String::new(),
            message: format!(
                "test \"{}\": {}: expected {}, actual {}",
                r.name, f.mismatch.field, f.mismatch.expected, f.mismatch.actual
            ),
        })
        .collect()
}

/// JUnit XML: a suite per test file, a case per test; problems with the files are errors of
/// a suite of their own.
fn junit(outcome: &Outcome) -> String {
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let errors: Vec<&Diagnostic> = outcome.diagnostics.iter().filter(|d| d.severity == Severity::Error).collect();
    let _ = writeln!(
        out,
        "<testsuites name=\"sluice test\" tests=\"{}\" failures=\"{}\" errors=\"{}\">",
        outcome.results.len(),
        outcome.failed(),
        errors.len()
    );
    if !errors.is_empty() {
        let _ = writeln!(out, "  <testsuite name=\"files\" tests=\"{0}\" failures=\"0\" errors=\"{0}\">", errors.len());
        for d in errors {
            let file = xml(&visible(&d.file.display().to_string()));
            let _ =
                writeln!(out, "    <testcase name=\"{file}\" classname=\"files\" file=\"{file}\" line=\"{}\">", d.line);
            let _ = writeln!(out, "      <error message=\"{}\"/>", xml(&d.headline()));
            out.push_str("    </testcase>\n");
        }
        out.push_str("  </testsuite>\n");
    }
    let mut files: Vec<&std::path::Path> = outcome.results.iter().map(|r| r.file.as_path()).collect();
    files.dedup();
    for file in files {
        let results: Vec<&TestResult> = outcome.results.iter().filter(|r| r.file == file).collect();
        let failed = results.iter().filter(|r| !r.passed()).count();
        let name = xml(&visible(&file.display().to_string()));
        let _ = writeln!(out, "  <testsuite name=\"{name}\" tests=\"{}\" failures=\"{failed}\">", results.len());
        for r in results {
            let _ = write!(
                out,
                "    <testcase name=\"{}\" classname=\"{name}\" file=\"{name}\" line=\"{}\"",
                xml(&visible(&r.name)),
                r.line
            );
            if r.passed() {
                out.push_str("/>\n");
                continue;
            }
            out.push_str(">\n");
            let text: Vec<String> = r
                .failures
                .iter()
                .map(|f| {
                    let m = &f.mismatch;
                    let (field, expected, actual) = (visible(&m.field), visible(&m.expected), visible(&m.actual));
                    format!("{field} (line {}): expected {expected}, actual {actual}", f.line)
                })
                .collect();
            let _ = writeln!(
                out,
                "      <failure message=\"{} difference(s)\">{}</failure>",
                r.failures.len(),
                xml(&text.join("\n"))
            );
            out.push_str("    </testcase>\n");
        }
        out.push_str("  </testsuite>\n");
    }
    out.push_str("</testsuites>\n");
    out
}

/// Text as XML attribute or element content: the line breaks sluice writes (between a test's
/// failures) and tabs as character references, which a parser keeps (a raw one in an attribute
/// is read back as a space); characters XML 1.0 cannot hold replaced. Text from outside is
/// escaped with [`visible`] first, so none of its control characters reaches here.
fn xml(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\n' => out.push_str("&#10;"),
            '\r' => out.push_str("&#13;"),
            '\t' => out.push_str("&#9;"),
            c if c.is_control() => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_escapes_markup_and_control_characters() {
        assert_eq!(xml("a<b>&\"c\"'d'\n\r\t\u{1b}"), "a&lt;b&gt;&amp;&quot;c&quot;&apos;d&apos;&#10;&#13;&#9;\u{fffd}");
    }
}
