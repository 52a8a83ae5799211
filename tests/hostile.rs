//! Hostile input: random and mutated YAML through the parser and the whole loader. Nothing may
//! panic or hang, and every diagnostic must point at a place that exists in the file.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use sluice::config::{self, Diagnostic, Validation, source};

/// Valid pipelines to mutate.
const BASES: &[&str] = &[
    include_str!("fixtures/valid/orders.yaml"),
    include_str!("fixtures/valid/billing/invoices.yml"),
    include_str!("fixtures/valid/jobs/media/resize.yaml"),
    include_str!("../pipelines/orders.yaml"),
];

/// Text that YAML, the templates or the checks treat specially.
const SNIPPETS: &[&str] = &[
    "{{",
    "}}",
    "{{{payload.x}}}",
    "&a ",
    "*a",
    "<<: *a\n",
    "<<: [*a, *a]\n",
    "\t",
    ": ",
    "- ",
    "? ",
    "\n",
    "\n  ",
    "---\n",
    "...\n",
    "#",
    "'",
    "\"",
    "!!binary ",
    "!custom ",
    "%YAML 1.2\n",
    "99999999999999999999999999",
    "1e400",
    "-0.0",
    "18446744073709551615h",
    "0",
    "null",
    "~",
    "é€𝄞",
    "\u{feff}",
    "\r\n",
    "\r",
];

#[derive(Debug, Clone)]
enum Mutation {
    /// Replace the byte at an index (wrapped to the length) by any byte.
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, &'static str),
    /// Open this many flow collections.
    Nest(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Flip(at, byte)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), prop::sample::select(SNIPPETS)).prop_map(|(at, s)| Mutation::Insert(at, s)),
        (any::<usize>(), 1..300usize).prop_map(|(at, depth)| Mutation::Nest(at, depth)),
    ]
}

fn mutate(base: &str, mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = base.as_bytes().to_vec();
    for m in mutations {
        let at = |i: usize| i % (bytes.len() + 1);
        match *m {
            Mutation::Flip(i, byte) if !bytes.is_empty() => {
                let i = i % bytes.len();
                bytes[i] = byte;
            }
            Mutation::Flip(..) => {}
            Mutation::Truncate(i) => bytes.truncate(at(i)),
            Mutation::Insert(i, s) => {
                let i = at(i);
                bytes.splice(i..i, s.bytes());
            }
            Mutation::Nest(i, depth) => {
                let i = at(i);
                let open: String = (0..depth).map(|d| if d % 2 == 0 { '[' } else { '{' }).collect();
                bytes.splice(i..i, open.bytes());
            }
        }
    }
    bytes
}

/// Every diagnostic is 1-based and, when it is about `text`, inside it: on one of its lines (as
/// YAML counts them: a lone CR ends one too) and at most one column past that line's end.
fn assert_points_into(diagnostics: &[Diagnostic], file: &Path, text: &str) {
    let normalized = text.replace("\r\n", "\n").replace('\r', "\n");
    let lines: Vec<&str> = normalized.lines().collect();
    for d in diagnostics {
        assert!(d.line >= 1 && d.column >= 1, "{}", d.headline());
        if d.file != file {
            continue;
        }
        assert!(d.line <= lines.len().max(1), "{} is past the last line {}", d.headline(), lines.len());
        let width = lines.get(d.line - 1).map_or(0, |l| l.chars().count());
        assert!(d.column <= width + 1, "{} is past the end of its line ({width} characters)", d.headline());
    }
}

/// Loads `bytes` as the only pipeline file of a fresh directory.
fn load_bytes(bytes: &[u8]) -> (Validation, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pipeline.yaml");
    std::fs::write(&file, bytes).unwrap();
    (config::load(&[dir.path().to_path_buf()]), file, dir)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn parse_survives_arbitrary_text(text in "\\PC{0,400}") {
        if let Err(d) = source::parse(Path::new("t.yaml"), text.clone()) {
            assert_points_into(&[d], Path::new("t.yaml"), &text);
        }
    }

    #[test]
    fn parse_and_load_survive_mutated_pipelines(
        base in prop::sample::select(BASES),
        mutations in prop::collection::vec(mutation(), 1..5),
    ) {
        let bytes = mutate(base, &mutations);
        let text = String::from_utf8_lossy(&bytes).into_owned();
        if let Err(d) = source::parse(Path::new("t.yaml"), text.clone()) {
            assert_points_into(&[d], Path::new("t.yaml"), &text);
        }
        let (validation, file, _dir) = load_bytes(&bytes);
        if let Ok(text) = std::str::from_utf8(&bytes) {
            assert_points_into(&validation.diagnostics, &file, text);
        } else {
            assert_points_into(&validation.diagnostics, &file, "");
        }
    }

    #[test]
    fn load_survives_raw_bytes(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let (validation, file, _dir) = load_bytes(&bytes);
        let text = std::str::from_utf8(&bytes).unwrap_or("");
        assert_points_into(&validation.diagnostics, &file, text);
    }
}

/// Loads each text in its own thread and checks the positions of what comes back; fails
/// (instead of hanging the suite) past a deadline.
fn load_all_within(texts: Vec<String>, deadline: Duration) -> Vec<Validation> {
    let pending: Vec<_> = texts
        .into_iter()
        .map(|text| {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let (validation, file, dir) = load_bytes(text.as_bytes());
                let _ = tx.send((validation, file, dir, text));
            });
            rx
        })
        .collect();
    let start = Instant::now();
    pending
        .into_iter()
        .map(|rx| {
            let left = deadline.saturating_sub(start.elapsed());
            let (validation, file, _dir, text) =
                rx.recv_timeout(left).unwrap_or_else(|_| panic!("load did not finish within {deadline:?}"));
            assert_points_into(&validation.diagnostics, &file, &text);
            validation
        })
        .collect()
}

/// Nine levels of ten aliases over five scalars: billions of nodes when expanded.
fn alias_bomb(alias: impl Fn(char) -> String) -> String {
    let mut text = String::from("version: 1\nx-a: &a {l0: lol, l1: lol, l2: lol, l3: lol, l4: lol}\n");
    for level in 1..10u8 {
        let name = (b'a' + level) as char;
        let previous = (b'a' + level - 1) as char;
        text.push_str(&format!("x-{name}: &{name} {}\n", alias(previous)));
    }
    text
}

#[test]
fn alias_bomb_finishes_quickly() {
    let sequences = alias_bomb(|p| format!("[{}]", vec![format!("*{p}"); 10].join(", ")));
    // A merge key and nine aliases per mapping.
    let merges = alias_bomb(|p| {
        let keys: Vec<String> = (1..10).map(|i| format!("k{i}: *{p}")).collect();
        format!("{{<<: *{p}, {}}}", keys.join(", "))
    });
    // A config or diagnostics are both fine; hanging or exhausting memory is not.
    load_all_within(vec![sequences, merges], Duration::from_secs(20));
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let texts = ["[", "{", "- ", "a:\n "].map(|open| format!("version: 1\nx-deep: {}\n", open.repeat(50_000)));
    for validation in load_all_within(texts.to_vec(), Duration::from_secs(20)) {
        assert!(validation.has_errors(), "{validation:?}");
    }
}
