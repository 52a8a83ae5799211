//! The fixtures under `tests/fixtures/`: every invalid one reports exactly its `.expected`
//! diagnostics.

mod util;

use std::path::Path;

use sluice::config::{self, Severity, Validation};
use util::{Expected, Fixture, Shown};

/// What a fixture reported, if it is not exactly what it expects.
fn mismatch(fixture: &Fixture, validation: &Validation) -> Option<String> {
    let got = &validation.diagnostics;
    let same = got.len() == fixture.expected.len()
        && fixture.expected.iter().zip(got).all(|(e, d)| e.matches(d, &fixture.path));
    let mut problems = Vec::new();
    if !same {
        let expected: Vec<String> = fixture.expected.iter().map(|e| format!("    {e}")).collect();
        let shown: Vec<String> = got.iter().map(|d| format!("    {}", Shown(d, &fixture.path))).collect();
        problems.push(format!("  expected:\n{}\n  reported:\n{}", expected.join("\n"), shown.join("\n")));
    }
    // Warnings alone must leave a usable config; any error must leave none.
    if fixture.warnings_only() != validation.config.is_some() {
        problems.push(format!("  config is {}", if validation.config.is_some() { "Some" } else { "None" }));
    }
    (!problems.is_empty()).then(|| format!("{}:\n{}", fixture.path.display(), problems.join("\n")))
}

#[test]
fn invalid_fixtures_report_exactly_their_expected_diagnostics() {
    let fixtures = util::invalid_fixtures();
    assert!(fixtures.len() >= 28, "only {} invalid fixtures", fixtures.len());
    let failures: Vec<String> =
        fixtures.iter().filter_map(|f| mismatch(f, &config::load(std::slice::from_ref(&f.path)))).collect();
    assert!(failures.is_empty(), "{} of {} fixtures differ:\n{}", failures.len(), fixtures.len(), failures.join("\n"));
}

#[test]
fn directory_fixtures_hold_several_files() {
    for fixture in util::invalid_fixtures().iter().filter(|f| f.path.is_dir()) {
        let files = util::yaml_files(&fixture.path);
        assert!(files.len() >= 2, "{}: a directory fixture is about several files", fixture.path.display());
        for e in &fixture.expected {
            let file = e.file.as_deref().unwrap_or_else(|| panic!("{}: lines name their file", fixture.name));
            assert!(files.contains(&fixture.path.join(file)), "{}: no file {file}", fixture.name);
        }
    }
}

#[test]
fn expected_lines_parse_strictly() {
    let e = Expected::parse("dir/a.yml:12:7 warning /queues/my queue/x | some | text").unwrap();
    assert_eq!(e.file.as_deref(), Some("dir/a.yml"));
    assert_eq!((e.line, e.column, e.severity), (12, 7, Severity::Warning));
    assert_eq!((e.pointer.as_str(), e.fragment.as_str()), ("/queues/my queue/x", "some | text"));
    assert_eq!(Expected::parse("3:1 error - | m").unwrap().pointer, "");
    for bad in [
        "3:1 error - m",
        "3 error - | m",
        "3:1 fatal - | m",
        "3:1 error queues | m",
        "3:1 error - | ",
        "3:x error - | m",
    ] {
        assert!(Expected::parse(bad).is_err(), "{bad:?} should not parse");
    }
}

#[test]
fn fixture_files_start_with_the_schema_header() {
    let files = util::yaml_files(Path::new("tests/fixtures"));
    assert!(files.len() > 30, "{files:?}");
    let problems: Vec<String> = files.iter().filter_map(|f| util::check_schema_header(f).err()).collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
