//! Helpers shared by the integration tests: the fixture directories, the `.expected` format
//! (specified in `tests/fixtures/README.md`), the editor schema header, and the `sluice` binary.
//!
//! Paths are relative to the package root, which is where cargo runs integration tests, so
//! that diagnostics name files the way a user at the root would see them.

#![allow(dead_code, reason = "each test crate uses its own subset of these helpers")]

use std::fmt;
use std::path::{Path, PathBuf};

use sluice::config::{Diagnostic, Severity};

/// The committed JSON Schema of pipeline files.
pub const SCHEMA: &str = "schemas/pipeline.schema.json";

/// The committed JSON Schema of test files (`*.test.yaml`).
pub const TEST_SCHEMA: &str = "schemas/test.schema.json";

/// How every pipeline file in the repository starts, so that editors find the schema.
pub const SCHEMA_HEADER: &str = "# yaml-language-server: $schema=";

/// Fixtures that must fail validation, each beside its `.expected` file.
pub const INVALID: &str = "tests/fixtures/invalid";

/// Fixtures that together use every feature of the format and must validate.
pub const VALID: &str = "tests/fixtures/valid";

/// The real `sluice` binary, run from the package root.
pub fn sluice() -> assert_cmd::Command {
    let mut cmd = assert_cmd::Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"));
    cmd
}

/// Every `*.yaml`/`*.yml` file under `dir`, recursively, sorted (as `sluice` discovers them).
pub fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("reading {}: {e}", d.display())) {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")) {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Whether `file` is a test file (`*.test.yaml`, `*.test.yml`) rather than a pipeline.
pub fn is_test_file(file: &Path) -> bool {
    sluice::config::source::is_test_file(file)
}

/// Checks that `file` starts with the schema header and that its relative path reaches the
/// committed schema: the test files' for a test file, else the pipelines'.
pub fn check_schema_header(file: &Path) -> Result<(), String> {
    let schema = if is_test_file(file) { TEST_SCHEMA } else { SCHEMA };
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let first = text.lines().next().unwrap_or_default();
    let Some(relative) = first.strip_prefix(SCHEMA_HEADER) else {
        return Err(format!("{}: first line is {first:?}, not {SCHEMA_HEADER}<path>", file.display()));
    };
    let target = file.parent().unwrap_or(Path::new(".")).join(relative.trim());
    let same = match (target.canonicalize(), Path::new(schema).canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same { Ok(()) } else { Err(format!("{}: {} is not {schema}", file.display(), target.display())) }
}

/// One line of an `.expected` file: a diagnostic that must be reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// For a directory fixture, the file relative to the directory.
    pub file: Option<String>,
    pub line: usize,
    pub column: usize,
    pub severity: Severity,
    /// Empty for a problem with the file as a whole (written `-`).
    pub pointer: String,
    /// Text the message must contain.
    pub fragment: String,
}

impl Expected {
    /// Parses one line: `[FILE:]LINE:COL SEVERITY POINTER | MESSAGE-FRAGMENT`.
    pub fn parse(line: &str) -> Result<Expected, String> {
        let (head, fragment) = line.split_once(" | ").ok_or("no \" | \" before the message fragment")?;
        let mut parts = head.splitn(3, ' ');
        let (Some(position), Some(severity), Some(pointer)) = (parts.next(), parts.next(), parts.next()) else {
            return Err("expected `[FILE:]LINE:COL SEVERITY POINTER | FRAGMENT`".into());
        };
        let mut position = position.rsplitn(3, ':');
        let column = position.next().and_then(|c| c.parse().ok()).ok_or("bad column")?;
        let line_no = position.next().and_then(|l| l.parse().ok()).ok_or("bad line")?;
        let file = position.next().map(str::to_string);
        let severity = match severity {
            "error" => Severity::Error,
            "warning" => Severity::Warning,
            "note" => Severity::Note,
            other => return Err(format!("severity {other:?} is not error, warning or note")),
        };
        let pointer = match pointer {
            "-" => String::new(),
            p if p.starts_with('/') => p.to_string(),
            p => return Err(format!("pointer {p:?} is neither `-` nor a JSON pointer")),
        };
        if fragment.trim().is_empty() {
            return Err("the message fragment is empty".into());
        }
        Ok(Expected { file, line: line_no, column, severity, pointer, fragment: fragment.to_string() })
    }

    /// Whether `d`, reported for the fixture at `root`, is this expected diagnostic.
    pub fn matches(&self, d: &Diagnostic, root: &Path) -> bool {
        let file_ok = match &self.file {
            Some(f) => d.file == root.join(f),
            None => d.file == root,
        };
        file_ok
            && d.line == self.line
            && d.column == self.column
            && d.severity == self.severity
            && d.pointer == self.pointer
            && d.message.contains(&self.fragment)
    }
}

impl fmt::Display for Expected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{file}:")?;
        }
        let pointer = if self.pointer.is_empty() { "-" } else { &self.pointer };
        write!(f, "{}:{} {} {pointer} | {}", self.line, self.column, severity_name(self.severity), self.fragment)
    }
}

/// A severity as `sluice validate` prints it.
pub fn severity_name(severity: Severity) -> &'static str {
    match severity {
        Severity::Error => "error",
        Severity::Warning => "warning",
        Severity::Note => "note",
    }
}

/// A diagnostic in the `.expected` format, with its whole message: what a failing test prints.
pub struct Shown<'a>(pub &'a Diagnostic, pub &'a Path);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Shown(d, root) = self;
        if let Ok(relative) = d.file.strip_prefix(root)
            && !relative.as_os_str().is_empty()
        {
            write!(f, "{}:", relative.display())?;
        }
        let pointer = if d.pointer.is_empty() { "-" } else { &d.pointer };
        write!(f, "{}:{} {} {pointer} | {}", d.line, d.column, severity_name(d.severity), d.message)
    }
}

/// An invalid fixture: a file, or a directory loaded as a whole, and what it must report.
#[derive(Debug)]
pub struct Fixture {
    pub name: String,
    pub path: PathBuf,
    pub expected: Vec<Expected>,
}

impl Fixture {
    /// Whether the fixture only has warnings or notes (so `validate` must succeed).
    pub fn warnings_only(&self) -> bool {
        self.expected.iter().all(|e| e.severity != Severity::Error)
    }
}

/// Every invalid fixture with its parsed `.expected` file. Panics on a fixture without one, an
/// `.expected` file without a fixture, or a line that does not parse.
pub fn invalid_fixtures() -> Vec<Fixture> {
    let dir = Path::new(INVALID);
    let mut fixtures = Vec::new();
    let mut expected_files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("tests/fixtures/invalid exists") {
        let path = entry.expect("directory entry").path();
        let name = path.file_stem().and_then(|s| s.to_str()).expect("UTF-8 names").to_string();
        match path.extension().and_then(|e| e.to_str()) {
            Some("expected") => expected_files.push(name),
            Some("yaml") => fixtures.push((name, path)),
            None if path.is_dir() => fixtures.push((name, path)),
            _ => panic!("{}: neither a *.yaml fixture, a directory fixture nor an .expected file", path.display()),
        }
    }
    for name in &expected_files {
        assert!(fixtures.iter().any(|(n, _)| n == name), "{INVALID}/{name}.expected has no fixture");
    }
    fixtures.sort();
    fixtures
        .into_iter()
        .map(|(name, path)| {
            let expected_path = dir.join(format!("{name}.expected"));
            let text = std::fs::read_to_string(&expected_path)
                .unwrap_or_else(|e| panic!("{}: {e} (every fixture needs one)", expected_path.display()));
            let expected: Vec<Expected> = text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty() && !l.starts_with('#'))
                .map(|(i, l)| {
                    Expected::parse(l).unwrap_or_else(|e| panic!("{}:{}: {e}", expected_path.display(), i + 1))
                })
                .collect();
            assert!(!expected.is_empty(), "{}: expects nothing", expected_path.display());
            Fixture { name, path, expected }
        })
        .collect()
}
