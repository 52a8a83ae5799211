//! Issue 21, "Installable": the shell completions and the man page come out of the binary,
//! `--version` names the commit it was built from, and `dist/sluice.service` passes
//! `systemd-analyze verify` without a word.
//!
//! systemd-analyze comes with Debian's `systemd` package and `man` with `man-db`; without them
//! the unit's test fails (never skips; .ci/run installs them).

use crate::util;

use std::path::Path;
use std::process::Command;

use util::sluice;

const UNIT: &str = "dist/sluice.service";

/// Where the unit expects the binary (`cargo install --path . --root /usr/local`).
const INSTALLED: &str = "/usr/local/bin/sluice";

/// What `sluice ARGS` prints, after checking that it succeeded.
fn printed(args: &[&str]) -> String {
    let out = sluice().args(args).output().expect("runs");
    assert!(out.status.success(), "sluice {args:?}: {out:?}");
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// `git ARGS` in the package root; `None` without git or outside a checkout.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn completions_for_each_shell_know_the_subcommands() {
    for shell in ["bash", "zsh", "fish"] {
        let script = printed(&["completions", shell]);
        for word in ["validate", "run", "dlq", "redrive", "shutdown-grace"] {
            assert!(script.contains(word), "{shell} completions do not mention {word}:\n{script}");
        }
    }
}

#[test]
fn the_man_page_is_roff_titled_sluice_1() {
    let page = printed(&["man"]);
    // The roff crate's string definition for the apostrophe (`.ie`/`.el`) comes before the title.
    let first = page.lines().find(|line| !line.starts_with(".ie ") && !line.starts_with(".el "));
    assert!(first.is_some_and(|line| line.starts_with(".TH sluice 1 ")), "no .TH header first:\n{page}");
    assert!(page.contains("sluice\\-validate(1)"), "the subcommands are not listed:\n{page}");

    // --dir writes the same page and one per subcommand, nested ones too.
    let dir = tempfile::tempdir().expect("tempdir");
    printed(&["man", "--dir", &dir.path().display().to_string()]);
    assert_eq!(std::fs::read_to_string(dir.path().join("sluice.1")).expect("sluice.1"), page);
    for name in ["sluice-validate", "sluice-run", "sluice-dlq-redrive"] {
        let file = dir.path().join(format!("{name}.1"));
        let sub = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let title = format!(".TH {name} 1 ");
        assert!(sub.lines().any(|line| line.starts_with(&title)), "{name}.1 has no {title:?}:\n{sub}");
    }
}

#[test]
fn version_names_the_commit_it_was_built_from() {
    let version = printed(&["--version"]);
    let package = env!("CARGO_PKG_VERSION");
    // Built from a tarball there is no commit to name (build.rs takes only this package's own
    // checkout), and the version stands alone.
    let checkout = git(&["rev-parse", "--show-toplevel"]).is_some_and(|top| {
        Path::new(&top).canonicalize().ok() == Path::new(env!("CARGO_MANIFEST_DIR")).canonicalize().ok()
    });
    let expected = match (checkout, git(&["rev-parse", "--short", "HEAD"]), git(&["log", "-1", "--format=%cs"])) {
        (true, Some(commit), Some(date)) => format!("sluice {package} ({commit} {date})\n"),
        _ => format!("sluice {package}\n"),
    };
    assert_eq!(version, expected);
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    let text = std::fs::read_to_string(UNIT).expect(UNIT);
    assert!(text.contains(&format!("ExecStart={INSTALLED} run ")), "{UNIT} no longer runs {INSTALLED}");
    let dir = tempfile::tempdir().expect("tempdir");
    // verify wants every Exec binary to exist: the one built stands in for the installed one.
    let unit = dir.path().join("sluice.service");
    std::fs::write(&unit, text.replace(INSTALLED, env!("CARGO_BIN_EXE_sluice"))).expect("write the unit");
    // It also looks up Documentation=man:sluice(1) with man: the pages `sluice man --dir` writes.
    let man = dir.path().join("man");
    printed(&["man", "--dir", &man.join("man1").display().to_string()]);

    let out = match Command::new("systemd-analyze").arg("verify").arg(&unit).env("MANPATH", &man).output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "systemd-analyze is not installed; it comes with Debian's systemd package: `apt-get install systemd` \
             (.ci/run installs it)"
        ),
        Err(e) => panic!("running systemd-analyze: {e}"),
    };
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // A warning (an unknown key, a misspelt setting) leaves the exit code 0: any output fails.
    assert!(out.status.success() && said.is_empty(), "systemd-analyze verify {UNIT}: {}\n{said}", out.status);
}

#[test]
fn the_unit_waits_longer_than_the_shutdown_grace() {
    let text = std::fs::read_to_string(UNIT).expect(UNIT);
    let setting = |key: &str| text.lines().find_map(|line| line.strip_prefix(key)).map(str::trim);
    let grace = setting("ExecStart=")
        .and_then(|line| line.split_once("--shutdown-grace "))
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(sluice::config::parse_duration)
        .expect("ExecStart= names --shutdown-grace");
    let stop = setting("TimeoutStopSec=").and_then(sluice::config::parse_duration).expect("TimeoutStopSec=");
    assert!(stop > grace, "TimeoutStopSec={stop:?} kills sluice within its --shutdown-grace {grace:?}");
}

/// Issue 31 item 18: the unit's `validate` lines check the files as the runner will, so an edit
/// `sluice run` refuses fails `systemctl reload` (and the start), and the running pipelines
/// stay. Each line is run as written (the binary and the pipelines directory swapped for the
/// test's) on edits the runner refuses in a shell without the variables they read: a
/// `${VAR}` unset, a signing secret unset.
#[test]
fn the_units_validate_lines_fail_on_an_edit_the_runner_refuses() {
    const PIPELINES: &str = "/etc/sluice/pipelines";
    let text = std::fs::read_to_string(UNIT).expect(UNIT);
    let lines: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("ExecStartPre=").or_else(|| line.strip_prefix("ExecReload=")))
        .filter(|line| line.split_whitespace().nth(1) == Some("validate"))
        .collect();
    assert_eq!(lines.len(), 2, "ExecStartPre= and ExecReload= each validate: {lines:?}");
    let url = "url: http://127.0.0.1:9/x";
    let edits = [
        ("valid", format!("{{{url}}}"), true),
        ("a ${VAR} unset", format!("{{{url}, headers: {{Authorization: \"Bearer ${{UNIT_TEST_TOKEN}}\"}}}}"), false),
        ("a signing secret unset", format!("{{{url}, signing: {{secret_env: UNIT_TEST_SECRET}}}}"), false),
    ];
    for (what, webhook, runs) in edits {
        let dir = tempfile::tempdir().expect("tempdir");
        let yaml = format!("version: 1\nqueues:\n  work:\n    handler:\n      webhook: {webhook}\n");
        std::fs::write(dir.path().join("p.yaml"), yaml).expect("write the pipeline");
        let pipelines = dir.path().display().to_string();
        if !runs {
            // The runner refuses it: the edit is one the unit must refuse too.
            let out = sluice()
                .args(["run", &pipelines, "--broker", &dir.path().join("broker").display().to_string()])
                .env_remove("UNIT_TEST_TOKEN")
                .env_remove("UNIT_TEST_SECRET")
                .timeout(std::time::Duration::from_secs(30))
                .output()
                .expect("runs");
            assert_eq!(out.status.code(), Some(1), "sluice run refuses {what}: {out:?}");
        }
        for line in &lines {
            let argv: Vec<String> = line
                .split_whitespace()
                .map(|word| match word {
                    INSTALLED => env!("CARGO_BIN_EXE_sluice").to_string(),
                    PIPELINES => pipelines.clone(),
                    other => other.to_string(),
                })
                .collect();
            let out = Command::new(&argv[0])
                .args(&argv[1..])
                .env_remove("UNIT_TEST_TOKEN")
                .env_remove("UNIT_TEST_SECRET")
                .output()
                .expect("runs");
            assert_eq!(out.status.success(), runs, "{line} on {what}: {out:?}");
        }
    }
}
