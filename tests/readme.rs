//! The README tells the truth (issue 14): "A complete pipeline" is the shipped
//! `pipelines/orders.yaml` and validates; every sample output it shows is what the binary
//! prints; its example test file passes.

mod util;

use std::path::Path;

use util::sluice;

fn readme() -> String {
    std::fs::read_to_string("README.md").expect("README.md")
}

/// The text of the first fenced block opening with "```" + `info` after `marker`.
fn block_after(text: &str, marker: &str, info: &str) -> String {
    let at = text.find(marker).unwrap_or_else(|| panic!("README has no {marker:?}"));
    let mut lines = text[at..].lines();
    while let Some(line) = lines.next() {
        let Some(opened) = line.strip_prefix("```") else { continue };
        let body: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        if opened == info {
            return body.iter().map(|l| format!("{l}\n")).collect();
        }
    }
    panic!("no ```{info} block after {marker:?}")
}

/// A directory holding the shipped pipeline (the file, the program it runs, the payload schema
/// it names), laid out as in the repository, without its tests.
fn shipped_pipeline() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    for (from, to) in [
        ("pipelines/orders.yaml", "pipelines/orders.yaml"),
        ("pipelines/scripts/audit.sh", "pipelines/scripts/audit.sh"),
        ("schemas/order-created.json", "schemas/order-created.json"),
    ] {
        let to = dir.path().join(to);
        std::fs::create_dir_all(to.parent().expect("a parent")).expect("mkdir");
        std::fs::copy(from, &to).unwrap_or_else(|e| panic!("{from}: {e}"));
    }
    dir
}

fn stdout(output: &std::process::Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("UTF-8")
}

#[test]
fn the_complete_pipeline_is_the_shipped_file_and_validates() {
    let shown = block_after(&readme(), "## A complete pipeline", "yaml");
    let shipped = std::fs::read_to_string("pipelines/orders.yaml").expect("pipelines/orders.yaml");
    assert!(shown == shipped, "README's \"A complete pipeline\" differs from pipelines/orders.yaml");
    // Valid with nothing to say, as shown: no warning either.
    let dir = shipped_pipeline();
    let out =
        sluice().args(["validate", "pipelines", "--format", "json"]).current_dir(dir.path()).output().expect("runs");
    assert_eq!((out.status.code(), stdout(&out)), (Some(0), "[]\n".to_string()));
    assert!(Path::new("pipelines/scripts/audit.sh").is_file());
}

#[test]
fn the_validate_sample_is_real_output() {
    let sample = block_after(&readme(), "## `sluice validate` in CI", "");
    let (command, shown) = sample.split_once('\n').expect("a command line, then its output");
    assert_eq!(command, "$ sluice validate pipelines/");
    let dir = shipped_pipeline();
    let file = dir.path().join("pipelines/orders.yaml");
    let text = std::fs::read_to_string(&file).expect("read");
    let anchor = "  max_attempts: 5          # handler runs in all";
    assert!(text.contains(anchor), "the anchor's max_attempts line moved");
    std::fs::write(&file, text.replace(anchor, "  max_attempts: 0          # handler runs in all")).expect("write");
    let out = sluice().args(["validate", "pipelines/"]).current_dir(dir.path()).output().expect("runs");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stdout(&out), shown);
}

#[test]
fn the_test_samples_are_real_output() {
    let readme = readme();
    let section = "## `sluice test`: pipelines tested without a broker";
    let passing = block_after(&readme, section, "");
    let (command, shown) = passing.split_once('\n').expect("a command line, then its output");
    assert_eq!(command, "$ sluice test pipelines");
    let out = sluice().args(["test", "pipelines"]).output().expect("runs");
    assert_eq!((out.status.code(), stdout(&out)), (Some(0), shown.to_string()));

    // The failing sample: the 503 test expecting success.
    let failing = block_after(&readme, "A failing test names each field that differs", "");
    let dir = shipped_pipeline();
    let tests = std::fs::read_to_string("pipelines/orders.test.yaml").expect("read");
    let expectation = "        orders.charge: retry\n";
    assert_eq!(tests.matches(expectation).count(), 1, "the 503 test's expectation moved");
    let tests = tests.replace(expectation, "        orders.charge: success\n");
    std::fs::write(dir.path().join("pipelines/orders.test.yaml"), tests).expect("write");
    let out = sluice().args(["test", "pipelines"]).current_dir(dir.path()).output().expect("runs");
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains(&failing), "README's failing sample is not in:\n{}", stdout(&out));
}

#[test]
fn the_test_file_example_passes() {
    let example = block_after(&readme(), "## `sluice test`: pipelines tested without a broker", "yaml");
    let dir = shipped_pipeline();
    std::fs::write(dir.path().join("pipelines/orders.test.yaml"), example).expect("write");
    let out = sluice().args(["test", "pipelines"]).current_dir(dir.path()).output().expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(stdout(&out).ends_with("test result: ok. 1 passed; 0 failed\n"), "{}", stdout(&out));
}
