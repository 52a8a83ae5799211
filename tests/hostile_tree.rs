//! Hostile trees for `sluice validate` (issue 9): a pull request can add any file, link or
//! FIFO to a pipeline directory, and CI runs `validate` on it. Nothing may hang, exhaust
//! memory, read outside the given paths, print what it read there, or forge an annotation.
//! The binary is driven as CI drives it; the loader itself is also run over random trees.

use crate::util;

use std::collections::BTreeSet;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use proptest::prelude::*;
use sluice::config::{self, source};
use util::sluice;

/// Long enough for a debug build on a busy machine; a hang is caught long before CI's own limit.
const DEADLINE: Duration = Duration::from_secs(30);

/// A valid pipeline, so that a tree is not rejected merely for being empty.
const VALID: &str = "version: 1\nqueues:\n  work:\n    handler: {command: {program: /bin/true}}\n";

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("no NUL in the path");
    // SAFETY: mkfifo(3) with a NUL-terminated path we own.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo {}", path.display());
}

/// `sluice validate ARGS`, killed (and failed) past the deadline.
fn validate(args: &[&str]) -> (Option<i32>, String, String) {
    let out = sluice().arg("validate").args(args).timeout(DEADLINE).output().expect("sluice runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A directory holding a valid pipeline, ready for something hostile beside it.
fn tree() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("pipelines");
    std::fs::create_dir(&root).expect("mkdir");
    std::fs::write(root.join("ok.yaml"), VALID).expect("write");
    (dir, root)
}

fn arg(path: &Path) -> &str {
    path.to_str().expect("UTF-8 temp path")
}

// Issue 9: `a -> .` and `b -> .` made the walk descend forever.
#[test]
fn a_symlink_loop_ends() {
    let (_dir, root) = tree();
    symlink(".", root.join("a")).expect("symlink");
    symlink(".", root.join("b")).expect("symlink");
    symlink("..", root.join("sub-up")).expect("symlink");
    let (code, stdout, stderr) = validate(&[arg(&root)]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    // Each file once: not "defined twice" under a/, b/, a/b/, ...
    assert!(stderr.contains("ok: 1 queue(s) valid"), "{stderr}");
    assert!(stdout.contains("sub-up:1:1: warning: symbolic link to"), "{stdout}");
}

// Issue 9: a FIFO named x.yaml blocked the open (and the read) forever.
#[test]
fn a_fifo_is_an_error_not_a_hang() {
    let (_dir, root) = tree();
    mkfifo(&root.join("x.yaml"));
    let (code, stdout, _) = validate(&[arg(&root)]);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.contains("x.yaml:1:1: error: cannot read: not a regular file (a FIFO)"), "{stdout}");
    // Named on the command line, too.
    let (code, stdout, _) = validate(&[arg(&root.join("x.yaml"))]);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.contains("not a regular file (a FIFO)"), "{stdout}");
}

// Issue 9: a link to /dev/zero named x.yaml was read until memory ran out.
#[test]
fn a_link_to_a_device_is_skipped_and_a_named_device_refused() {
    let (_dir, root) = tree();
    symlink("/dev/zero", root.join("x.yaml")).expect("symlink");
    let (code, stdout, stderr) = validate(&[arg(&root)]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(
        stdout
            .contains("x.yaml:1:1: warning: symbolic link to /dev/zero leads outside the paths being loaded; skipped"),
        "{stdout}"
    );
    let (code, stdout, _) = validate(&[arg(&root.join("x.yaml"))]);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.contains("not a regular file (a device)"), "{stdout}");
}

// Issue 9: a link named x.yaml to /proc/self/environ printed every environment variable in
// the error's snippet.
#[test]
fn a_link_to_the_environment_prints_none_of_it() {
    const CANARY: &str = "sluice-issue-9-canary-d41d8cd9";
    let (_dir, root) = tree();
    symlink("/proc/self/environ", root.join("x.yaml")).expect("symlink");
    for path in [root.clone(), root.join("x.yaml")] {
        let out = sluice()
            .args(["validate", arg(&path)])
            .env("SLUICE_CANARY", CANARY)
            .timeout(DEADLINE)
            .output()
            .expect("sluice runs");
        let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!all.contains(CANARY), "{}: the environment leaked:\n{all}", path.display());
        assert!(!all.contains("SLUICE_CANARY"), "{}: the environment leaked:\n{all}", path.display());
    }
}

// Issue 9: 5,000 aliases of a 5,000-element anchor (25 KB) made the YAML loader allocate 25
// million nodes and abort.
#[test]
fn an_alias_bomb_is_refused_at_the_alias() {
    let (_dir, root) = tree();
    let ones = vec!["1"; 5000].join(",");
    let aliases = vec!["*a"; 5000].join(",");
    let text = format!("version: 1\nx-a: &a [{ones}]\nx-b: [{aliases}]\n");
    assert!(text.len() < 30_000);
    std::fs::write(root.join("bomb.yaml"), text).expect("write");
    let (code, stdout, _) = validate(&[arg(&root), "--format", "json"]);
    assert_eq!(code, Some(1), "{stdout}");
    let diagnostics: serde_json::Value = serde_json::from_str(&stdout).expect("JSON diagnostics");
    let bomb = diagnostics
        .as_array()
        .expect("an array")
        .iter()
        .find(|d| d["file"].as_str().is_some_and(|f| f.ends_with("bomb.yaml")))
        .unwrap_or_else(|| panic!("no diagnostic for bomb.yaml: {stdout}"));
    // The 49th alias of line 3 (`x-b: [` is 6 characters, each `*a,` 3) is one too many.
    assert_eq!((bomb["line"].as_u64(), bomb["column"].as_u64()), (Some(3), Some(7 + 3 * 48)), "{bomb}");
    assert!(bomb["message"].as_str().is_some_and(|m| m.contains("alias")), "{bomb}");
}

// Issue 9: nothing bounded the size of a file.
#[test]
fn a_huge_file_is_an_error() {
    let (_dir, root) = tree();
    let mut text = String::from("version: 1\n");
    text.push_str(&format!("# {}\n", "x".repeat(2 << 20)));
    std::fs::write(root.join("huge.yaml"), text).expect("write");
    let (code, stdout, _) = validate(&[arg(&root)]);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.contains("huge.yaml:1:1: error: cannot read: larger than 1 MiB"), "{stdout}");
}

// Issue 9: links that stay inside the tree are fine; those leading out are skipped with a
// warning, and what they point at is never read.
#[test]
fn links_inside_are_followed_once_and_links_outside_skipped() {
    let (dir, root) = tree();
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(root.join("v2")).expect("mkdir");
    std::fs::create_dir_all(&outside).expect("mkdir");
    let queue =
        |name: &str| format!("version: 1\nqueues:\n  {name}:\n    handler: {{command: {{program: /bin/true}}}}\n");
    std::fs::write(root.join("v2/more.yaml"), queue("more")).expect("write");
    std::fs::write(outside.join("evil.yaml"), "version: 1\nqueues: {evil: bogus}\n").expect("write");
    symlink("v2", root.join("current")).expect("symlink");
    symlink("v2/more.yaml", root.join("more-alias.yaml")).expect("symlink");
    symlink("../outside", root.join("shared")).expect("symlink");
    symlink("../outside/evil.yaml", root.join("evil.yaml")).expect("symlink");
    let (code, stdout, stderr) = validate(&[arg(&root)]);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stderr.contains("ok: 2 queue(s) valid"), "{stderr}");
    for name in ["evil.yaml", "shared"] {
        assert!(stdout.contains(&format!("{name}:1:1: warning: symbolic link to ")), "{name}: {stdout}");
    }
    assert!(!stdout.contains("bogus"), "{stdout}");
}

// Issue 9: a file name with a line break injected annotations into `--format github`.
#[test]
fn github_annotations_escape_the_file_name() {
    let (_dir, root) = tree();
    let name = "x.yaml\n::error file=forged.yaml,line=1,col=1::forged,yes:really.yaml";
    std::fs::write(root.join(name), "version: 1\nqueues: {bad: 1}\n").expect("write");
    let (code, stdout, _) = validate(&[arg(&root), "--format", "github"]);
    assert_eq!(code, Some(1), "{stdout}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(
        !lines.is_empty() && lines.iter().all(|l| l.starts_with("::error file=") || l.starts_with("::warning file=")),
        "{stdout}"
    );
    assert!(!lines.iter().any(|l| l.starts_with("::error file=forged.yaml")), "{stdout}");
    assert!(
        stdout
            .contains("x.yaml%0A%3A%3Aerror file=forged.yaml%2Cline=1%2Ccol=1%3A%3Aforged%2Cyes%3Areally.yaml,line=2,"),
        "{stdout}"
    );
}

// Issue 9: a line holding control characters (escape sequences, NULs) went to the terminal
// as is.
#[test]
fn a_snippet_never_echoes_control_characters() {
    let (_dir, root) = tree();
    std::fs::write(root.join("esc.yaml"), "version: 1\nqueues: {bad: \"\x1b]0;owned\x07\x1b[2J\"}\n").expect("write");
    std::fs::write(root.join("nul.yaml"), "version: 1\nqueues: {bad: \"a\0b\"}\n").expect("write");
    let (code, stdout, _) = validate(&[arg(&root)]);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(stdout.contains("esc.yaml:") && stdout.contains("nul.yaml:2:"), "{stdout}");
    assert!(!stdout.contains(['\x1b', '\x07', '\0']), "{stdout:?}");
    assert!(!stdout.contains("2 | "), "{stdout}");
}

/// What a random tree holds at one path.
#[derive(Debug, Clone)]
enum Node {
    Dir,
    File(&'static str),
    Link(&'static str),
    Fifo,
}

const NAMES: &[&str] = &["a", "b", "x.yaml", "y.yml", "z.txt"];

const CONTENTS: &[&str] = &[VALID, "version: 1\nx-a: &a [1, 2]\nx-b: [*a, *a]\n", "{{", "\u{0}\u{1b}[2J", ""];

/// Link targets: loops, the parent and beyond, devices, the environment, the outside tree,
/// siblings, itself, nothing.
const TARGETS: &[&str] = &[
    ".",
    "..",
    "../..",
    "../../..",
    "/",
    "/dev/zero",
    "/proc/self/environ",
    "/proc/self/cwd",
    "OUTSIDE",
    "OUTSIDE/secret.yaml",
    "a",
    "x.yaml",
    "a/x.yaml",
    "../a",
    "missing",
];

fn node() -> impl Strategy<Value = Node> {
    prop_oneof![
        2 => Just(Node::Dir),
        2 => prop::sample::select(CONTENTS).prop_map(Node::File),
        3 => prop::sample::select(TARGETS).prop_map(Node::Link),
        1 => Just(Node::Fifo),
    ]
}

fn entries() -> impl Strategy<Value = Vec<(Vec<&'static str>, Node)>> {
    prop::collection::vec((prop::collection::vec(prop::sample::select(NAMES), 1..4), node()), 1..24)
}

/// Whether `root/components...` is a real directory, reached without following a link.
fn real_dir(root: &Path, components: &[&str]) -> bool {
    let mut path = root.to_path_buf();
    components.iter().all(|c| {
        path.push(c);
        std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir())
    })
}

/// Builds the tree under `root`; entries whose parent is not a real directory are left out.
/// Never through a link: one to `/` or to the working directory would make the test write
/// there.
fn build(root: &Path, outside: &Path, entries: &[(Vec<&'static str>, Node)]) {
    for (components, node) in entries {
        let path: PathBuf = components.iter().fold(root.to_path_buf(), |p, c| p.join(c));
        let (_, parents) = components.split_last().expect("at least one component");
        if !real_dir(root, parents) || std::fs::symlink_metadata(&path).is_ok() {
            continue;
        }
        match node {
            Node::Dir => std::fs::create_dir(&path).expect("mkdir"),
            Node::File(text) => std::fs::write(&path, text).expect("write"),
            Node::Link(target) => {
                let target = target.replace("OUTSIDE", outside.to_str().expect("UTF-8 temp path"));
                symlink(target, &path).expect("symlink");
            }
            Node::Fifo => mkfifo(&path),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    // Issue 9: over random trees of directories, files, links (loops, outward, devices) and
    // FIFOs, the loader ends in time, does not panic, and reads nothing outside the root.
    #[test]
    fn the_loader_stays_inside_random_trees(entries in entries()) {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&root).expect("mkdir");
        std::fs::create_dir_all(&outside).expect("mkdir");
        std::fs::write(outside.join("secret.yaml"), "version: 1\nOUTSIDE_SECRET: 1\n").expect("write");
        build(&root, &outside, &entries);

        let (tx, rx) = mpsc::channel();
        let paths = vec![root.clone()];
        std::thread::spawn(move || {
            let found = source::discover(&paths);
            let validation = config::load(&paths);
            let _ = tx.send((found, validation));
        });
        let (found, validation) = match rx.recv_timeout(DEADLINE) {
            Ok(done) => done,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("loading {entries:?} took over {DEADLINE:?}"),
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("loading {entries:?} panicked"),
        };

        let real_root = root.canonicalize().expect("root resolves");
        let read: BTreeSet<&PathBuf> = validation.sources.keys().collect();
        for file in found.files.iter().chain(read.iter().copied()) {
            let real = file.canonicalize().unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            prop_assert!(real.starts_with(&real_root), "{} is {} outside the root", file.display(), real.display());
        }
        for text in validation.sources.values() {
            prop_assert!(!text.contains("OUTSIDE_SECRET"));
        }
        let rendered = validation.render(config::Format::Human);
        prop_assert!(!rendered.contains("OUTSIDE_SECRET"), "{rendered}");
        prop_assert!(!rendered.chars().any(|c| c.is_control() && c != '\n'), "{rendered:?}");
    }
}
