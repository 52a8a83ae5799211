//! `sluice test`: test files (`*.test.yaml`, `*.test.yml`) beside the pipelines, each test
//! publishing one message and expecting the queues it reaches, the calls rendered there and
//! their outcomes. Loading a test file reports its mistakes at file:line:column, as
//! pipelines' are; running a test uses the routing, rendering and classification code of
//! `run` (see [`run`]), so a rule added there applies here too.
//!
//! No broker, no network, no subprocess: answers are simulated.

mod file;
pub mod report;
mod run;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use run::Mismatch;

use crate::config::compile::{deserialize, foreign};
use crate::config::source::{self, is_test_file};
use crate::config::{self, Diagnostic, Severity, schema};

/// The result of one test.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TestResult {
    pub file: PathBuf,
    pub line: usize,
    pub column: usize,
    pub name: String,
    /// Empty when the test passed.
    pub failures: Vec<Failure>,
}

impl TestResult {
    /// Whether the test found what it expected.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// A difference, at the expectation in the test file.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Failure {
    pub line: usize,
    pub column: usize,
    #[serde(flatten)]
    pub mismatch: Mismatch,
}

/// Everything `sluice test` found: problems with the files (pipelines or tests), which stop
/// the tests from running, and the result of each test otherwise.
#[derive(Debug, Default)]
pub struct Outcome {
    pub diagnostics: Vec<Diagnostic>,
    /// The text of every file read, for the snippets of diagnostics.
    pub sources: BTreeMap<PathBuf, String>,
    pub results: Vec<TestResult>,
    /// What the run did differently from `run` to run at all (a throwaway signing secret).
    pub notes: Vec<String>,
}

impl Outcome {
    /// Whether a file had an error, so that no test ran.
    pub fn has_errors(&self) -> bool {
        self.diagnostics.iter().any(|d| d.severity == Severity::Error)
    }

    /// How many tests failed.
    pub fn failed(&self) -> usize {
        self.results.iter().filter(|r| !r.passed()).count()
    }
}

/// Loads the pipelines under `paths` and the test files among them, and runs every test. A
/// test file named directly is tested against the pipelines of its directory.
pub fn run(paths: &[PathBuf]) -> Outcome {
    let mut pipeline_paths: Vec<PathBuf> = paths
        .iter()
        .map(|p| match p.parent() {
            Some(dir) if is_test_file(p) && p.is_file() => {
                if dir.as_os_str().is_empty() {
                    PathBuf::from(".")
                } else {
                    dir.to_path_buf()
                }
            }
            _ => p.clone(),
        })
        .collect();
    pipeline_paths.dedup();
    let validation = config::load(&pipeline_paths);
    let mut outcome = Outcome {
        diagnostics: validation.diagnostics,
        sources: validation.sources,
        results: Vec::new(),
        notes: Vec::new(),
    };
    let Some(mut config) = validation.config else {
        return outcome;
    };
    outcome.notes = throwaway_secrets(&mut config);
    let discovery = source::discover_tests(paths);
    outcome.diagnostics.extend(discovery.diagnostics);
    let exchanges: Vec<&str> = config.exchanges.keys().map(String::as_str).collect();
    let mut files = Vec::new();
    for path in &discovery.files {
        let parsed = source::read(path).and_then(|text| {
            outcome.sources.insert(path.clone(), text.clone());
            source::parse(path, text)
        });
        let problems = match parsed {
            Err(d) => vec![d],
            Ok(source) if let Some(note) = foreign(&source, &["tests"], "test") => vec![note],
            Ok(source) => {
                let mut problems = schema::check_tests(&source);
                if problems.is_empty() {
                    match deserialize::<file::File>(&source) {
                        Ok(tests) => {
                            problems = file::check(&source, tests.tests.iter().enumerate(), &config, &exchanges);
                            files.push((source, tests));
                        }
                        Err(d) => problems.push(d),
                    }
                } else {
                    // A schema error hides nothing in the tests it is not in.
                    let whole = file::whole_tests(&source, &problems);
                    problems.extend(file::check(&source, whole.iter().map(|(i, t)| (*i, t)), &config, &exchanges));
                }
                problems
            }
        };
        outcome.diagnostics.extend(problems);
    }
    if files.is_empty() && !outcome.has_errors() {
        let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        let at = paths.first().map(PathBuf::as_path).unwrap_or(Path::new("."));
        outcome
            .diagnostics
            .push(source::file_diag(at, format!("no test files (*.test.yaml, *.test.yml) under {}", shown.join(", "))));
    }
    outcome.diagnostics.sort_by(|a, b| (&a.file, a.line, a.column).cmp(&(&b.file, b.line, b.column)));
    if outcome.has_errors() {
        return outcome;
    }
    let suite = run::Suite::new(config);
    for (source, tests) in &files {
        for (i, test) in tests.tests.iter().enumerate() {
            let pos = source.pos(&format!("/tests/{i}"));
            outcome.results.push(TestResult {
                file: source.path.clone(),
                line: pos.line,
                column: pos.column,
                name: test.name.clone(),
                failures: suite
                    .run(i, test)
                    .into_iter()
                    .map(|mismatch| {
                        let pos = source.pos(&mismatch.pointer);
                        Failure { line: pos.line, column: pos.column, mismatch }
                    })
                    .collect(),
            });
        }
    }
    outcome
}

/// Gives a throwaway signing secret to each webhook whose secrets are not here (CI has no
/// secrets: a variable unset, a secrets file missing), so that its tests run as they would
/// with the real ones; a secret that is there but unusable stays, and fails as `run` would.
/// One note per such queue.
fn throwaway_secrets(config: &mut config::Config) -> Vec<String> {
    use base64::Engine as _;
    use config::{Handler, SecretError, Webhook};
    let mut notes = Vec::new();
    for queue in config.queues_mut() {
        let Handler::Webhook(Webhook { signing: Some(signing), .. }) = &mut queue.handler else { continue };
        let Err(errors) = signing.load() else { continue };
        let absent: Vec<String> = errors
            .iter()
            .filter_map(|error| match error {
                SecretError::Unset { var } => Some(var.clone()),
                SecretError::Unreadable { path, error: crate::file::ReadError::Io(e) }
                    if e.kind() == std::io::ErrorKind::NotFound =>
                {
                    Some(path.display().to_string())
                }
                _ => None,
            })
            .collect();
        if absent.len() < errors.len() {
            continue;
        }
        let secret = format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(rand::random::<[u8; 32]>()));
        // A secret made of 32 random bytes in base64 always parses.
        let Ok(key) = crate::handler::webhook::SigningKey::parse(&secret) else { continue };
        signing.keys = Some([key].into());
        notes.push(format!(
            "queue {}: signing secret {} not set here: its calls are signed with a throwaway secret",
            queue.name,
            absent.join(", ")
        ));
    }
    notes
}
