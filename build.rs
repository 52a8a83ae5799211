//! `sluice --version` names the commit built, `sluice 0.1.0 (abc1234 2026-12-02)`, when built
//! in this package's own git checkout; from a tarball, or without git, it is the version alone.
//! Cargo reruns this only when HEAD or the branch it points to moves.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let version = match std::env::var_os("CARGO_MANIFEST_DIR").and_then(|dir| commit(Path::new(&dir))) {
        Some(commit) => format!("{version} ({commit})"),
        None => version,
    };
    println!("cargo:rustc-env=SLUICE_BUILD_VERSION={version}");
}

/// The short commit and its date, with the files that say which commit is checked out
/// watched; `None` outside a checkout whose top is `dir`.
fn commit(dir: &Path) -> Option<String> {
    // A tarball unpacked inside another checkout (`cargo package` verifies in target/package/)
    // must not take that checkout's commit.
    let top = PathBuf::from(git(dir, &["rev-parse", "--show-toplevel"])?);
    if top.canonicalize().ok()? != dir.canonicalize().ok()? {
        return None;
    }
    let head = git(dir, &["rev-parse", "--git-path", "HEAD", "--symbolic-full-name", "HEAD"])?;
    let mut lines = head.lines();
    watch(dir, lines.next()?);
    // A branch's ref: its own file, or packed-refs while it is only packed (the next commit
    // then writes its file into the directory watched). A detached HEAD names no branch.
    if let Some(branch) = lines.next().filter(|name| name.starts_with("refs/")) {
        let paths = git(dir, &["rev-parse", "--git-path", branch, "--git-path", "packed-refs"])?;
        let (loose, packed) = paths.split_once('\n')?;
        if dir.join(loose).exists() {
            watch(dir, loose);
        } else {
            watch(dir, Path::new(loose).parent()?.to_str()?);
            watch(dir, packed);
        }
    }
    git(dir, &["log", "-1", "--format=%h %cs"])
}

fn watch(dir: &Path, path: &str) {
    let path = dir.join(path);
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

/// `git ARGS` run in `dir`: its output, or `None` when git is missing or fails.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let output = Command::new("git").arg("-C").arg(dir).args(args).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    (output.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}
