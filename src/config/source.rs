//! Reading pipeline files: discovery (files and directories, recursive, `*.yaml`/`*.yml`),
//! YAML parsing into JSON values with anchors and merge keys applied, and the span map that
//! gives every node's line and column by JSON pointer.
//!
//! This module knows YAML, not the pipeline format: it never interprets keys.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use saphyr_parser::{Event, Parser, Span};

use super::diagnostic::{Diagnostic, Severity};

/// A 1-based line and column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pos {
    pub line: usize,
    pub column: usize,
}

/// One parsed pipeline file.
#[derive(Debug)]
pub struct SourceFile {
    /// The path as the user named it (or found under a named directory).
    pub path: PathBuf,
    pub text: String,
    /// The document as JSON, with `<<` merge keys applied.
    pub value: serde_json::Value,
    spans: SpanMap,
}

impl SourceFile {
    /// Where the node at `pointer` starts; a node that only exists through a merge or an alias
    /// falls back to its nearest ancestor in this file.
    pub fn pos(&self, pointer: &str) -> Pos {
        // An empty document's (implicit) value sits past the last line.
        within(&self.text, self.spans.value_pos(pointer))
    }

    /// Where the key of the member at `pointer` starts (for unknown or misplaced keys).
    pub fn key_pos(&self, pointer: &str) -> Pos {
        self.spans.keys.get(pointer).copied().unwrap_or_else(|| self.spans.value_pos(pointer))
    }

    /// A diagnostic at the value of `pointer`.
    pub fn diag(&self, severity: Severity, pointer: &str, message: impl Into<String>) -> Diagnostic {
        self.diag_at(self.pos(pointer), severity, pointer, message)
    }

    /// A diagnostic at an explicit position in this file.
    pub fn diag_at(&self, pos: Pos, severity: Severity, pointer: &str, message: impl Into<String>) -> Diagnostic {
        Diagnostic {
            file: self.path.clone(),
            line: pos.line,
            column: pos.column,
            severity,
            pointer: pointer.to_string(),
            message: message.into(),
        }
    }

    /// The directory relative paths in this file are resolved against.
    pub fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }
}

/// Expands the given paths into the sorted list of pipeline files.
pub fn discover(paths: &[PathBuf]) -> Result<Vec<PathBuf>, Diagnostic> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            walk(path, &mut files).map_err(|e| io_diag(path, &e))?;
        } else if path.is_file() {
            files.push(path.clone());
        } else {
            return Err(file_diag(path, "no such file or directory"));
        }
    }
    files.sort();
    files.dedup();
    Ok(files)
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            walk(&path, files)?;
        } else if matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")) {
            files.push(path);
        }
    }
    Ok(())
}

/// A problem with a file as a whole, reported at its first line.
pub fn file_diag(path: &Path, message: impl Into<String>) -> Diagnostic {
    Diagnostic {
        file: path.to_path_buf(),
        line: 1,
        column: 1,
        severity: Severity::Error,
        pointer: String::new(),
        message: message.into(),
    }
}

fn io_diag(path: &Path, error: &std::io::Error) -> Diagnostic {
    file_diag(path, format!("cannot read: {error}"))
}

/// Reads and parses one file; a syntax error comes back as a diagnostic at its position.
pub fn load(path: &Path) -> Result<SourceFile, Diagnostic> {
    let text = std::fs::read_to_string(path).map_err(|e| io_diag(path, &e))?;
    parse(path, text)
}

/// Parses YAML text that came from `path`.
pub fn parse(path: &Path, text: String) -> Result<SourceFile, Diagnostic> {
    let at = |pos: Pos, message: String| {
        let pos = within(&text, pos);
        Diagnostic {
            file: path.to_path_buf(),
            line: pos.line,
            column: pos.column,
            severity: Severity::Error,
            pointer: String::new(),
            message,
        }
    };
    let spans = SpanMap::build(&text).map_err(|(pos, msg)| at(pos, format!("YAML syntax error: {msg}")))?;
    let mut yaml: serde_yaml::Value = serde_yaml::from_str(&text).map_err(|e| {
        let pos =
            e.location().map(|l| Pos { line: l.line(), column: l.column() }).unwrap_or(Pos { line: 1, column: 1 });
        at(pos, format!("YAML error: {e}"))
    })?;
    yaml.apply_merge().map_err(|e| at(Pos { line: 1, column: 1 }, format!("YAML merge key error: {e}")))?;
    let value = match yaml {
        serde_yaml::Value::Null => serde_json::Value::Object(Default::default()),
        other => serde_json::to_value(other)
            .map_err(|e| at(Pos { line: 1, column: 1 }, format!("not representable as JSON: {e}")))?,
    };
    Ok(SourceFile { path: path.to_path_buf(), text, value, spans })
}

/// Parsers report the end of the input on the line after the last one, or past trailing blank
/// lines: point just after the last character instead, so that there is a line to show.
fn within(text: &str, pos: Pos) -> Pos {
    match lines(text.trim_end()).enumerate().last() {
        Some((i, last)) if pos.line > i + 1 => Pos { line: i + 1, column: last.chars().count() + 1 },
        None => Pos { line: 1, column: 1 },
        Some(_) => pos,
    }
}

/// Lines as YAML counts them, and so every position: `\n`, `\r\n` and a lone `\r` each end one
/// (`str::lines` ignores a lone `\r`).
pub fn lines(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = rest.find(['\n', '\r']).unwrap_or(rest.len());
        let line = &rest[..end];
        let ending = if rest[end..].starts_with("\r\n") { 2 } else { usize::from(end < rest.len()) };
        rest = &rest[end + ending..];
        Some(line)
    })
}

/// Escapes one JSON pointer token (RFC 6901).
pub fn escape_token(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// How many positions aliases and merges may copy in one file. Beyond it, nodes reached only
/// through an alias report the alias's own position: an alias bomb ("billion laughs") must
/// not expand here (the YAML loader rejects it afterwards).
const MAX_ALIAS_COPIES: usize = 100_000;

/// JSON pointer → position of the value, and of the key for object members. Ordered, so that
/// the nodes under an anchor are one range.
#[derive(Debug, Default)]
struct SpanMap {
    values: BTreeMap<String, Pos>,
    keys: BTreeMap<String, Pos>,
    /// Positions copied so far for aliases and merges, bounded by `MAX_ALIAS_COPIES`.
    copied: usize,
}

enum Frame {
    Map {
        path: String,
        key: Option<String>,
        /// The keys written in this mapping so far, where: YAML keys are unique.
        seen: HashMap<String, Pos>,
    },
    Seq {
        path: String,
        index: usize,
    },
    /// A complex (non-scalar) mapping key: its contents are not addressable by pointer.
    Skip {
        depth: usize,
    },
}

impl SpanMap {
    fn value_pos(&self, pointer: &str) -> Pos {
        let mut p = pointer;
        loop {
            if let Some(pos) = self.values.get(p) {
                return *pos;
            }
            match p.rfind('/') {
                Some(i) => p = &p[..i],
                None => return Pos { line: 1, column: 1 },
            }
        }
    }

    fn build(text: &str) -> Result<SpanMap, (Pos, String)> {
        let mut map = SpanMap::default();
        let mut stack: Vec<Frame> = Vec::new();
        let mut anchors: HashMap<usize, String> = HashMap::new();
        let mut documents = 0;
        for event in Parser::new_from_str(text) {
            let (event, span) = event.map_err(|e| {
                let m = e.marker();
                (Pos { line: m.line(), column: m.col() + 1 }, e.info().to_string())
            })?;
            let pos = pos_of(span);
            if let Some(Frame::Skip { depth }) = stack.last_mut() {
                match event {
                    Event::MappingStart(..) | Event::SequenceStart(..) => *depth += 1,
                    Event::MappingEnd | Event::SequenceEnd if *depth > 0 => *depth -= 1,
                    Event::MappingEnd | Event::SequenceEnd => {
                        stack.pop();
                        if let Some(Frame::Map { key, .. }) = stack.last_mut() {
                            *key = Some("?".into());
                        }
                    }
                    _ => {}
                }
                continue;
            }
            match event {
                Event::DocumentStart(_) => {
                    documents += 1;
                    if documents > 1 {
                        return Err((pos, "a pipeline file holds one YAML document; split it into files".into()));
                    }
                }
                Event::Scalar(value, _, anchor, _) => {
                    if let Some(Frame::Map { path, key: key @ None, seen }) = stack.last_mut() {
                        if let Some(first) = seen.insert(value.to_string(), pos) {
                            let message = format!(
                                "key \"{value}\" is defined twice in one mapping: here and at line {}, column {}",
                                first.line, first.column
                            );
                            return Err((pos, message));
                        }
                        let pointer = format!("{path}/{}", escape_token(&value));
                        map.keys.insert(pointer, pos);
                        *key = Some(value.into_owned());
                        continue;
                    }
                    if let Some(path) = map.place(&mut stack, pos)
                        && anchor > 0
                    {
                        anchors.insert(anchor, path);
                    }
                }
                Event::MappingStart(anchor, _) | Event::SequenceStart(anchor, _) => {
                    if let Some(Frame::Map { key: None, .. }) = stack.last() {
                        stack.push(Frame::Skip { depth: 0 });
                        continue;
                    }
                    let path = map.place(&mut stack, pos).unwrap_or_default();
                    if anchor > 0 {
                        anchors.insert(anchor, path.clone());
                    }
                    stack.push(if matches!(event, Event::MappingStart(..)) {
                        Frame::Map { path, key: None, seen: HashMap::new() }
                    } else {
                        Frame::Seq { path, index: 0 }
                    });
                }
                Event::MappingEnd | Event::SequenceEnd => {
                    stack.pop();
                }
                Event::Alias(id) => {
                    let merge = matches!(stack.last(), Some(Frame::Map { key: Some(k), .. }) if k == "<<")
                        || matches!(stack.as_slice(), [.., Frame::Map { key: Some(k), .. }, Frame::Seq { .. }] if k == "<<");
                    let target = if merge {
                        let parent = stack.iter().rev().find_map(|f| match f {
                            Frame::Map { path, key: Some(k), .. } if k == "<<" => Some(path.clone()),
                            _ => None,
                        });
                        if let Some(Frame::Seq { index, .. }) = stack.last_mut() {
                            *index += 1;
                        } else {
                            map.place(&mut stack, pos);
                        }
                        parent
                    } else {
                        map.place(&mut stack, pos)
                    };
                    if let (Some(target), Some(base)) = (target, anchors.get(&id)) {
                        map.copy_subtree(base, &target, merge);
                    }
                }
                _ => {}
            }
        }
        Ok(map)
    }

    /// Records a value at the current position of the innermost container and advances it;
    /// returns the value's pointer.
    fn place(&mut self, stack: &mut [Frame], pos: Pos) -> Option<String> {
        let pointer = match stack.last_mut() {
            None => String::new(),
            Some(Frame::Map { path, key, .. }) => {
                let k = key.take()?;
                format!("{path}/{}", escape_token(&k))
            }
            Some(Frame::Seq { path, index }) => {
                *index += 1;
                format!("{path}/{}", *index - 1)
            }
            Some(Frame::Skip { .. }) => return None,
        };
        // An explicit value overrides one a `<<` merge earlier in the same mapping recorded.
        self.values.insert(pointer.clone(), pos);
        Some(pointer)
    }

    /// Makes the nodes under an anchor addressable under an alias (or a merge target), pointing
    /// at the anchor's own lines. Merged members never override explicit ones.
    fn copy_subtree(&mut self, base: &str, target: &str, merge: bool) {
        for table in [&mut self.values, &mut self.keys] {
            let copies: Vec<(String, Pos)> = table
                .range(base.to_string()..)
                .take_while(|(k, _)| k.starts_with(base))
                .filter_map(|(k, v)| {
                    let rest = k.strip_prefix(base)?;
                    if merge && rest.is_empty() {
                        return None;
                    }
                    (rest.is_empty() || rest.starts_with('/')).then(|| (format!("{target}{rest}"), *v))
                })
                .take(MAX_ALIAS_COPIES.saturating_sub(self.copied))
                .collect();
            self.copied += copies.len();
            for (k, v) in copies {
                table.entry(k).or_insert(v);
            }
        }
    }
}

fn pos_of(span: Span) -> Pos {
    Pos { line: span.start.line(), column: span.start.col() + 1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> SourceFile {
        parse(Path::new("t.yaml"), text.to_string()).expect("parses")
    }

    #[test]
    fn positions_of_values_and_keys() {
        let f = parsed("version: 1\nqueues:\n  a.b:\n    concurrency: 8\n    bind:\n      - exchange: x\n");
        assert_eq!(f.pos("/queues/a.b/concurrency"), Pos { line: 4, column: 18 });
        assert_eq!(f.key_pos("/queues/a.b/concurrency"), Pos { line: 4, column: 5 });
        assert_eq!(f.pos("/queues/a.b/bind/0/exchange"), Pos { line: 6, column: 19 });
        assert_eq!(f.key_pos("/queues/a.b/bind/0/exchange"), Pos { line: 6, column: 9 });
        // an unknown pointer falls back to its nearest ancestor
        assert_eq!(f.pos("/queues/a.b/retry/max"), Pos { line: 4, column: 5 });
    }

    #[test]
    fn merge_keys_point_at_the_anchor() {
        let text = "x-d: &d\n  retry:\n    max: 5m\nqueues:\n  q:\n    <<: *d\n    concurrency: 2\n";
        let f = parsed(text);
        assert_eq!(f.value["queues"]["q"]["retry"]["max"], "5m");
        assert_eq!(f.pos("/queues/q/retry/max"), Pos { line: 3, column: 10 });
        assert_eq!(f.pos("/queues/q/concurrency"), Pos { line: 7, column: 18 });
    }

    #[test]
    fn explicit_keys_after_a_merge_point_at_themselves() {
        let text = "x-r: &r\n  max: 5m\n  initial: 1s\nretry:\n  <<: *r\n  max: 0s\n";
        let f = parsed(text);
        assert_eq!(f.value["retry"]["max"], "0s");
        assert_eq!(f.pos("/retry/max"), Pos { line: 6, column: 8 });
        assert_eq!(f.key_pos("/retry/max"), Pos { line: 6, column: 3 });
        assert_eq!(f.pos("/retry/initial"), Pos { line: 3, column: 12 });
    }

    #[test]
    fn slash_and_tilde_in_keys_are_escaped() {
        let f = parsed("a/b:\n  c~d: 1\n");
        assert_eq!(f.pos("/a~1b/c~0d"), Pos { line: 2, column: 8 });
    }

    #[test]
    fn syntax_error_has_a_position() {
        let err = parse(Path::new("t.yaml"), "a: [1, 2\nb: 3\n".to_string()).unwrap_err();
        assert!(err.message.starts_with("YAML syntax error"), "{}", err.message);
        assert!(err.line >= 1);
    }

    #[test]
    fn an_error_at_the_end_of_the_input_points_after_the_last_character() {
        for (text, want) in [("a: 1\nb: [x, y\n", (2, 9)), ("[", (1, 2)), ("a: 1\nb: [x\n\n\n", (2, 6))] {
            let err = parse(Path::new("t.yaml"), text.to_string()).unwrap_err();
            assert_eq!((err.line, err.column), want, "{text:?}: {}", err.message);
        }
    }

    #[test]
    fn alias_expansion_is_bounded() {
        let mut text = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for level in 1..10 {
            let prev = (b'a' + level - 1) as char;
            let aliases = vec![format!("*{prev}"); 10].join(", ");
            text.push_str(&format!("{}: &{} [{aliases}]\n", (b'a' + level) as char, (b'a' + level) as char));
        }
        let spans = SpanMap::build(&text).expect("well-formed YAML");
        assert!(spans.values.len() <= MAX_ALIAS_COPIES + 200, "{}", spans.values.len());
        assert_eq!(spans.value_pos("/b/3/9"), Pos { line: 1, column: 35 });
    }

    #[test]
    fn duplicate_key_is_reported_at_the_second_one() {
        let text = "queues:\n  a:\n    x: 1\n  b: {}\n  a:\n    y: 2\nother:\n  a: 1\n";
        let err = parse(Path::new("t.yaml"), text.to_string()).unwrap_err();
        assert_eq!((err.line, err.column), (5, 3));
        assert!(
            err.message.contains("\"a\" is defined twice in one mapping: here and at line 2, column 3"),
            "{}",
            err.message
        );
    }

    #[test]
    fn lines_end_as_in_yaml() {
        let cases: &[(&str, &[&str])] = &[
            ("", &[]),
            ("a", &["a"]),
            ("a\n", &["a"]),
            ("a\n\nb", &["a", "", "b"]),
            ("a\r\nb\rc\n", &["a", "b", "c"]),
            ("a\r\r\n", &["a", ""]),
        ];
        for (text, want) in cases {
            assert_eq!(lines(text).collect::<Vec<_>>(), *want, "{text:?}");
        }
        let f = parsed("version: 1\rqueues:\r  a: 1\r");
        assert_eq!(f.pos("/queues/a"), Pos { line: 3, column: 6 });
    }

    #[test]
    fn empty_file_is_an_empty_object() {
        assert_eq!(parsed("").value, serde_json::json!({}));
    }
}
