//! Reading pipeline files: discovery (files and directories, recursive, `*.yaml`/`*.yml`),
//! YAML parsing into JSON values with anchors and merge keys applied, and the span map that
//! gives every node's line and column by JSON pointer.
//!
//! A pull request can put anything in a pipeline directory, and CI validates it: discovery
//! follows links only inside the given paths and enters each directory once, only regular
//! files of at most [`MAX_FILE_BYTES`] are read, and a document whose aliases would expand past
//! [`MAX_NODES`] is refused before the YAML loader builds it.
//!
//! This module knows YAML, not the pipeline format: it never interprets keys.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use saphyr_parser::{Event, Parser, ScalarStyle, Span};

use super::diagnostic::{Diagnostic, Severity, lines};
use crate::file::{ReadError, read_regular};

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
    /// The document as JSON, with `<<` merge keys applied (and, once loading substitutes
    /// them, `${VAR}`s).
    pub value: serde_json::Value,
    /// [`value`](Self::value) as the file writes it: `${VAR}`s never substituted, for showing
    /// a pipeline without the secrets the environment puts in it.
    pub written: serde_json::Value,
    spans: SpanMap,
    /// Where the text ends (see [`end_of`]), found once: positions are clamped to it.
    end: Option<Pos>,
    /// The plain scalars `${VAR}` substitution changed, by pointer (see [`super::interpolate`]).
    substituted: HashMap<String, Substitution>,
}

/// A plain scalar as written (`${Y}`) and as `${VAR}` substitution made it (`~`), which YAML
/// types as it would the same text written in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Substitution {
    pub written: String,
    pub value: String,
}

impl SourceFile {
    /// Where the node at `pointer` starts; a node that only exists through a merge or an alias
    /// falls back to its nearest ancestor in this file.
    pub fn pos(&self, pointer: &str) -> Pos {
        // An empty document's (implicit) value sits past the last line.
        within(self.end, self.spans.value_pos(pointer))
    }

    /// Where the key of the member at `pointer` starts (for unknown or misplaced keys).
    pub fn key_pos(&self, pointer: &str) -> Pos {
        self.spans.keys.get(pointer).copied().unwrap_or_else(|| self.spans.value_pos(pointer))
    }

    /// Where byte `offset` of the string at `pointer` (whose text is `text`) sits, when the
    /// string is written on one line as it reads (plain or quoted, no escapes before the
    /// offset); else where the string starts.
    pub fn offset_pos(&self, pointer: &str, text: &str, offset: usize) -> Pos {
        let start = self.pos(pointer);
        let before = &text[..text.floor_char_boundary(offset)];
        // Read from where the node starts, never the whole line: a flow list of thousands of
        // values is one line, and each of its values may be asked about.
        let column = self.spans.value_node(pointer).and_then(|node| {
            let rest = self.text.get(node.offset..)?;
            let quote = usize::from(rest.starts_with(['"', '\'']));
            let written = rest.get(quote..)?;
            (!before.contains(['\n', '\r']) && written.starts_with(before))
                .then(|| start.column + quote + before.chars().count())
        });
        column.map_or(start, |column| Pos { line: start.line, column })
    }

    /// Whether the string at `pointer` is a plain scalar without a tag holding a `$`, which YAML
    /// typed from its text (see [`super::interpolate`]).
    pub fn typed(&self, pointer: &str) -> bool {
        self.spans.values.get(pointer).is_some_and(|node| node.typed)
    }

    /// The text of the plain scalar at `pointer` as written (`1e400`), when it is written on
    /// its own in this file (not through an alias or a merge): the value alone may not say
    /// what was written (YAML reads `1e400` as infinity, which JSON holds as null).
    ///
    /// A scalar `${VAR}` substitution changed is the text it substituted (`${Y}` set to `~`
    /// reads `~`), which is what YAML typed.
    pub fn scalar_text(&self, pointer: &str) -> Option<&str> {
        if let Some(substitution) = self.substituted.get(pointer) {
            return Some(&substitution.value);
        }
        // From where the node starts, never the whole line (see `offset_pos`).
        let rest = self.text.get(self.spans.values.get(pointer)?.offset..)?;
        let end = rest.find([' ', '\t', ',', ']', '}', '#', '\n', '\r']).unwrap_or(rest.len());
        Some(&rest[..end])
    }

    /// The text of a number too large for a float (`1e400`, `.inf`) at `pointer`, whose value
    /// is `value`, for a message: YAML reads `.inf` as infinity, which JSON holds as null, and
    /// `1e400` as a string. A value `${VAR}` substitution gave says so (`1e400 (${Y} here)`).
    pub fn infinite_number(&self, pointer: &str, value: &serde_json::Value) -> Option<String> {
        let infinite = match value {
            serde_json::Value::Null => !is_null(self.scalar_text(pointer)?),
            serde_json::Value::String(_) => self.scalar_text(pointer)?.parse::<f64>().is_ok_and(f64::is_infinite),
            _ => false,
        };
        if !infinite {
            return None;
        }
        let written = self.scalar_text(pointer)?;
        Some(match self.substituted.get(pointer) {
            Some(s) => format!("{written} ({} here)", s.written),
            None => written.to_string(),
        })
    }

    /// How `${VAR}` substitution changed the plain scalar at `pointer`, if it did.
    pub fn substitution(&self, pointer: &str) -> Option<&Substitution> {
        self.substituted.get(pointer)
    }

    /// Records that `${VAR}` substitution changed the plain scalar at `pointer`.
    pub(super) fn substituted(&mut self, pointer: String, substitution: Substitution) {
        self.substituted.insert(pointer, substitution);
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

/// The most a pipeline file may hold. Real ones are a few KiB; a bigger "file" is a mistake or
/// an attack (a link to `/dev/zero`), and is refused before it is read to the end.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// Where the commands look for pipelines when given no path.
pub const DEFAULT_DIR: &str = "pipelines";

/// What discovery found: the pipeline files to load, and what it skipped or could not use.
#[derive(Debug, Default)]
pub struct Discovery {
    /// Sorted, each file once (however many names lead to it).
    pub files: Vec<PathBuf>,
    pub diagnostics: Vec<Diagnostic>,
}

/// Expands the given paths into the sorted list of pipeline files.
///
/// A pull request can add anything to a pipeline directory, so the walk is defensive: a
/// symbolic link is followed only when it resolves inside the given paths (else it is skipped
/// with a warning), a directory is entered at most once, and no file is opened here. Paths
/// named on the command line are the user's own choice and are used as given.
pub fn discover(paths: &[PathBuf]) -> Discovery {
    discover_where(paths, is_pipeline_file)
}

/// Expands the given paths into the sorted list of test files (`*.test.yaml`, `*.test.yml`),
/// walking as [`discover`] does.
pub fn discover_tests(paths: &[PathBuf]) -> Discovery {
    discover_where(paths, is_test_file)
}

fn discover_where(paths: &[PathBuf], wanted: fn(&Path) -> bool) -> Discovery {
    let mut walk = Walk {
        wanted,
        roots: paths.iter().filter_map(|p| p.canonicalize().ok()).collect(),
        visited: HashSet::new(),
        found: Vec::new(),
        diagnostics: Vec::new(),
    };
    for path in paths {
        match std::fs::metadata(path) {
            Ok(meta) if meta.is_dir() => walk.directory(path, &meta),
            // Whatever else it is, loading says why it cannot be read.
            Ok(meta) => walk.found.push(Found { path: path.clone(), link: false, id: Some(file_id(&meta)) }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut message = "no such file or directory".to_string();
                if path == Path::new(DEFAULT_DIR) {
                    message.push_str(&format!(
                        "; given no path, sluice reads {DEFAULT_DIR}/ in the current directory: \
                         name the files or directories that hold your pipelines, as in `sluice validate path/to/pipelines`"
                    ));
                }
                walk.diagnostics.push(file_diag(path, message));
            }
            Err(e) => walk.diagnostics.push(io_diag(path, &e)),
        }
    }
    Discovery { files: walk.files(), diagnostics: walk.diagnostics }
}

/// A device and inode: what makes two paths the same file or directory.
type FileId = (u64, u64);

fn file_id(meta: &std::fs::Metadata) -> FileId {
    use std::os::unix::fs::MetadataExt as _;
    (meta.dev(), meta.ino())
}

/// A candidate pipeline file.
struct Found {
    path: PathBuf,
    /// Found through a symbolic link (a real name for the same file is preferred).
    link: bool,
    /// `None` when it cannot be examined (loading reports why).
    id: Option<FileId>,
}

struct Walk {
    /// Which file names are looked for.
    wanted: fn(&Path) -> bool,
    /// The given paths, resolved: links may point anywhere under them and nowhere else.
    roots: Vec<PathBuf>,
    /// Directories entered so far: a bind mount or a hard-linked directory cannot loop.
    visited: HashSet<FileId>,
    found: Vec<Found>,
    diagnostics: Vec<Diagnostic>,
}

impl Walk {
    /// Walks a directory tree depth first with an explicit stack (no recursion to overflow),
    /// each directory's entries in name order so the result never depends on the filesystem.
    fn directory(&mut self, dir: &Path, meta: &std::fs::Metadata) {
        if !self.visited.insert(file_id(meta)) {
            return;
        }
        let mut pending = vec![dir.to_path_buf()];
        while let Some(dir) = pending.pop() {
            let entries = match std::fs::read_dir(&dir).and_then(|d| d.collect::<std::io::Result<Vec<_>>>()) {
                Ok(entries) => entries,
                Err(e) => {
                    self.diagnostics.push(io_diag(&dir, &e));
                    continue;
                }
            };
            let mut entries: Vec<(PathBuf, std::io::Result<std::fs::Metadata>)> =
                entries.into_iter().map(|e| (e.path(), e.metadata())).collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            for (path, meta) in entries {
                // Hidden entries are the tools' (`.git/`, the runner's own `.sluice/`), not pipelines.
                if is_hidden(&path) {
                    continue;
                }
                // DirEntry::metadata does not follow a symbolic link: this is the entry itself.
                let meta = match meta {
                    Ok(meta) => meta,
                    Err(e) => {
                        self.diagnostics.push(io_diag(&path, &e));
                        continue;
                    }
                };
                if meta.file_type().is_symlink() {
                    self.link(path);
                } else if meta.is_dir() {
                    if self.visited.insert(file_id(&meta)) {
                        pending.push(path);
                    }
                } else if (self.wanted)(&path) {
                    self.found.push(Found { path, link: false, id: Some(file_id(&meta)) });
                }
            }
        }
    }

    /// A symbolic link met in a directory.
    fn link(&mut self, path: PathBuf) {
        let named = (self.wanted)(&path);
        let (target, meta) = match path.canonicalize().and_then(|t| std::fs::metadata(&t).map(|m| (t, m))) {
            Ok(resolved) => resolved,
            // A dangling link or a loop of links: only worth a word when it names a pipeline file.
            Err(e) => {
                if named {
                    self.diagnostics.push(file_diag(&path, format!("cannot follow symbolic link: {e}")));
                }
                return;
            }
        };
        if !meta.is_dir() && !named {
            return;
        }
        if !self.roots.iter().any(|root| target.starts_with(root)) {
            let message =
                format!("symbolic link to {} leads outside the paths being loaded; skipped", target.display());
            self.diagnostics.push(Diagnostic { severity: Severity::Warning, ..file_diag(&path, message) });
        } else if !meta.is_dir() {
            self.found.push(Found { path, link: true, id: Some(file_id(&meta)) });
        }
        // A directory inside the roots is walked where it really is: every component of its
        // resolved path is a real directory under a root. Following the link too would only
        // find its files a second time, under another name.
    }

    /// The files found, sorted, each once: a file reached by several names (links, hard links,
    /// overlapping paths) is loaded under its real name, else the first in order.
    fn files(&mut self) -> Vec<PathBuf> {
        let mut found = std::mem::take(&mut self.found);
        found.sort_by(|a, b| (a.link, &a.path).cmp(&(b.link, &b.path)));
        let mut seen = HashSet::new();
        let mut files: Vec<PathBuf> =
            found.into_iter().filter(|f| f.id.is_none_or(|id| seen.insert(id))).map(|f| f.path).collect();
        files.sort();
        files.dedup();
        files
    }
}

/// Whether a directory entry's name starts with a dot.
fn is_hidden(path: &Path) -> bool {
    path.file_name().is_some_and(|name| name.as_encoded_bytes().starts_with(b"."))
}

/// Whether a file's name makes it a pipeline file: `*.yaml` or `*.yml`, but not a test file.
pub fn is_pipeline_file(path: &Path) -> bool {
    is_yaml(path) && !is_test_file(path)
}

/// Whether a file's name makes it a test file for `sluice test`: `*.test.yaml` or `*.test.yml`.
pub fn is_test_file(path: &Path) -> bool {
    is_yaml(path) && path.file_stem().is_some_and(|stem| Path::new(stem).extension().is_some_and(|e| e == "test"))
}

fn is_yaml(path: &Path) -> bool {
    matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml"))
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

/// Reads one pipeline file's text (see [`read_regular`]).
pub fn read(path: &Path) -> Result<String, Diagnostic> {
    read_regular(path, MAX_FILE_BYTES).map_err(|e| match e {
        ReadError::Io(e) => io_diag(path, &e),
        other => file_diag(path, format!("cannot read: {other}")),
    })
}

/// Reads and parses one file; a syntax error comes back as a diagnostic at its position.
pub fn load(path: &Path) -> Result<SourceFile, Diagnostic> {
    parse(path, read(path)?)
}

/// Parses YAML text that came from `path`.
pub fn parse(path: &Path, text: String) -> Result<SourceFile, Diagnostic> {
    let at = |pos: Pos, message: String| {
        let pos = within(end_of(&text), pos);
        Diagnostic {
            file: path.to_path_buf(),
            line: pos.line,
            column: pos.column,
            severity: Severity::Error,
            pointer: String::new(),
            message,
        }
    };
    let spans = SpanMap::build(&text).map_err(|(pos, msg)| at(pos, msg))?;
    let mut yaml: serde_yaml::Value = serde_yaml::from_str(&text).map_err(|e| {
        let pos =
            e.location().map(|l| Pos { line: l.line(), column: l.column() }).unwrap_or(Pos { line: 1, column: 1 });
        let message = e.to_string();
        // An integer past 64 bits stops the YAML loader, which says so in its own words.
        match message.split_once("invalid type: integer `").and_then(|(_, rest)| rest.split_once('`')) {
            Some((digits, _)) => at(
                pos,
                format!(
                    "{digits} is too large: integers here are at most 64 bits (-9223372036854775808 to 18446744073709551615); write a float ({:e}) or quote it as a string",
                    digits.parse::<f64>().unwrap_or_default()
                ),
            ),
            None => at(pos, format!("YAML error: {message}")),
        }
    })?;
    yaml.apply_merge().map_err(|e| at(Pos { line: 1, column: 1 }, format!("YAML merge key error: {e}")))?;
    let value = match yaml {
        serde_yaml::Value::Null => serde_json::Value::Object(Default::default()),
        other => serde_json::to_value(other)
            .map_err(|e| at(Pos { line: 1, column: 1 }, format!("not representable as JSON: {e}")))?,
    };
    let end = end_of(&text);
    Ok(SourceFile {
        path: path.to_path_buf(),
        text,
        written: value.clone(),
        value,
        spans,
        end,
        substituted: HashMap::new(),
    })
}

/// The texts YAML reads as null.
pub(super) fn is_null(text: &str) -> bool {
    matches!(text, "" | "~" | "null" | "Null" | "NULL")
}

/// Parsers report the end of the input on the line after the last one, or past trailing blank
/// lines: point just after the last character instead, so that there is a line to show.
fn within(end: Option<Pos>, pos: Pos) -> Pos {
    match end {
        Some(end) if pos.line > end.line => end,
        None => Pos { line: 1, column: 1 },
        Some(_) => pos,
    }
}

/// Just after the last character of the last line that holds anything; `None` for blank text.
fn end_of(text: &str) -> Option<Pos> {
    lines(text.trim_end()).enumerate().last().map(|(i, last)| Pos { line: i + 1, column: last.chars().count() + 1 })
}

/// Escapes one JSON pointer token (RFC 6901).
pub fn escape_token(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// How many positions aliases and merges may copy in one file. Beyond it, nodes reached only
/// through an alias report the alias's own position: a document within [`MAX_NODES`] can
/// still copy a quarter of a million pointers, each a string.
const MAX_ALIAS_COPIES: usize = 100_000;

/// How many nodes a document may have once every alias is expanded. The YAML loader copies an
/// alias's whole subtree, so 5,000 aliases of a 5,000-element anchor (25 KB of text) would be
/// 25 million nodes; real pipelines have a few thousand. Past this a file is refused before
/// the loader sees it.
pub const MAX_NODES: usize = 250_000;

/// Counts the nodes a document expands to, from the parser's events, without building it.
#[derive(Default)]
struct Expansion {
    /// Per open collection: its expanded size so far (itself included) and its anchor (0: none).
    open: Vec<(usize, usize)>,
    /// The expanded size of every complete anchored node.
    anchors: HashMap<usize, usize>,
    total: usize,
}

impl Expansion {
    /// Accounts for one event; false once the document is past [`MAX_NODES`].
    fn event(&mut self, event: &Event) -> bool {
        match *event {
            Event::Scalar(_, _, anchor, _) => {
                if anchor > 0 {
                    self.anchors.insert(anchor, 1);
                }
                self.add(1)
            }
            Event::MappingStart(anchor, _) | Event::SequenceStart(anchor, _) => {
                self.open.push((0, anchor));
                self.add(1)
            }
            Event::MappingEnd | Event::SequenceEnd => {
                if let Some((size, anchor)) = self.open.pop() {
                    if anchor > 0 {
                        self.anchors.insert(anchor, size);
                    }
                    // Already in the total: each node was counted as it came.
                    if let Some(parent) = self.open.last_mut() {
                        parent.0 = parent.0.saturating_add(size);
                    }
                }
                true
            }
            // An alias to an anchor still open (a cycle) is the parser's to reject.
            Event::Alias(id) => self.add(self.anchors.get(&id).copied().unwrap_or(1)),
            _ => true,
        }
    }

    fn add(&mut self, nodes: usize) -> bool {
        if let Some(innermost) = self.open.last_mut() {
            innermost.0 = innermost.0.saturating_add(nodes);
        }
        self.total = self.total.saturating_add(nodes);
        self.total <= MAX_NODES
    }
}

/// JSON pointer → position of the value, and of the key for object members. Ordered, so that
/// the nodes under an anchor are one range.
#[derive(Debug, Default)]
struct SpanMap {
    values: BTreeMap<String, Node>,
    keys: BTreeMap<String, Pos>,
    /// Positions copied so far for aliases and merges, bounded by `MAX_ALIAS_COPIES`.
    copied: usize,
}

/// Where a value starts, and how YAML typed it.
#[derive(Debug, Clone, Copy)]
struct Node {
    pos: Pos,
    /// The byte offset of `pos` in the text.
    offset: usize,
    /// A plain scalar without a tag that holds a `$`: YAML typed it from its text (`8` is a
    /// number), and so does `${}` substitution once the text is substituted.
    typed: bool,
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
        self.value_node(pointer).map_or(Pos { line: 1, column: 1 }, |node| node.pos)
    }

    /// The node at `pointer`, else its nearest ancestor that has one.
    fn value_node(&self, pointer: &str) -> Option<&Node> {
        let mut p = pointer;
        loop {
            if let Some(node) = self.values.get(p) {
                return Some(node);
            }
            p = &p[..p.rfind('/')?];
        }
    }

    fn build(text: &str) -> Result<SpanMap, (Pos, String)> {
        let mut map = SpanMap::default();
        let mut stack: Vec<Frame> = Vec::new();
        let mut anchors: HashMap<usize, String> = HashMap::new();
        let mut documents = 0;
        let mut expansion = Expansion::default();
        let mut offsets = Offsets { text, chars: 0, bytes: 0 };
        for event in Parser::new_from_str(text) {
            let (event, span) = event.map_err(|e| {
                let m = e.marker();
                (Pos { line: m.line(), column: m.col() + 1 }, format!("YAML syntax error: {}", e.info()))
            })?;
            let pos = pos_of(span);
            let node = Node { pos, offset: offsets.byte(span.start.index()), typed: false };
            if !expansion.event(&event) {
                let message = if matches!(event, Event::Alias(_)) {
                    format!(
                        "this alias expands the document past {MAX_NODES} nodes (an alias bomb?); write the values out"
                    )
                } else {
                    format!("the document has more than {MAX_NODES} nodes; split it into files")
                };
                return Err((pos, message));
            }
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
                Event::Scalar(value, style, anchor, tag) => {
                    if let Some(Frame::Map { path, key: key @ None, seen }) = stack.last_mut() {
                        if let Some(first) = seen.insert(value.to_string(), pos) {
                            let message = format!(
                                "YAML syntax error: key \"{value}\" is defined twice in one mapping: here and at line {}, column {}",
                                first.line, first.column
                            );
                            return Err((pos, message));
                        }
                        let pointer = format!("{path}/{}", escape_token(&value));
                        map.keys.insert(pointer, pos);
                        *key = Some(value.into_owned());
                        continue;
                    }
                    if let Some(path) = map.place(&mut stack, node) {
                        if style == ScalarStyle::Plain && tag.is_none() && value.contains('$') {
                            map.values.insert(path.clone(), Node { typed: true, ..node });
                        }
                        if anchor > 0 {
                            anchors.insert(anchor, path);
                        }
                    }
                }
                Event::MappingStart(anchor, _) | Event::SequenceStart(anchor, _) => {
                    if let Some(Frame::Map { key: None, .. }) = stack.last() {
                        stack.push(Frame::Skip { depth: 0 });
                        continue;
                    }
                    let path = map.place(&mut stack, node).unwrap_or_default();
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
                            map.place(&mut stack, node);
                        }
                        parent
                    } else {
                        map.place(&mut stack, node)
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
    fn place(&mut self, stack: &mut [Frame], node: Node) -> Option<String> {
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
        self.values.insert(pointer.clone(), node);
        Some(pointer)
    }

    /// Makes the nodes under an anchor addressable under an alias (or a merge target), pointing
    /// at the anchor's own lines. Merged members never override explicit ones.
    fn copy_subtree(&mut self, base: &str, target: &str, merge: bool) {
        copy_subtree(&mut self.values, &mut self.copied, base, target, merge);
        copy_subtree(&mut self.keys, &mut self.copied, base, target, merge);
    }
}

/// [`SpanMap::copy_subtree`] in one table; `copied` counts towards [`MAX_ALIAS_COPIES`].
fn copy_subtree<V: Copy>(table: &mut BTreeMap<String, V>, copied: &mut usize, base: &str, target: &str, merge: bool) {
    let copies: Vec<(String, V)> = table
        .range(base.to_string()..)
        .take_while(|(k, _)| k.starts_with(base))
        .filter_map(|(k, v)| {
            let rest = k.strip_prefix(base)?;
            if merge && rest.is_empty() {
                return None;
            }
            (rest.is_empty() || rest.starts_with('/')).then(|| (format!("{target}{rest}"), *v))
        })
        .take(MAX_ALIAS_COPIES.saturating_sub(*copied))
        .collect();
    *copied += copies.len();
    for (k, v) in copies {
        table.entry(k).or_insert(v);
    }
}

/// Byte offsets of the parser's positions, which count characters: the text is walked once,
/// as the parser's events come in its order.
struct Offsets<'t> {
    text: &'t str,
    /// The character index and the byte offset of the last position asked for.
    chars: usize,
    bytes: usize,
}

impl Offsets<'_> {
    /// The byte offset of character `index` (the end of the text past it).
    fn byte(&mut self, index: usize) -> usize {
        if index < self.chars {
            // Events never go back; were one to, this walks again from the start.
            (self.chars, self.bytes) = (0, 0);
        }
        let rest = &self.text[self.bytes..];
        let step = rest.char_indices().nth(index - self.chars).map_or(rest.len(), |(i, _)| i);
        (self.chars, self.bytes) = (index, self.bytes + step);
        self.bytes
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
        // Within MAX_NODES (about 123,000 nodes), beyond MAX_ALIAS_COPIES.
        let mut text = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for level in 1..5 {
            let prev = (b'a' + level - 1) as char;
            let aliases = vec![format!("*{prev}"); 10].join(", ");
            text.push_str(&format!("{}: &{} [{aliases}]\n", (b'a' + level) as char, (b'a' + level) as char));
        }
        let spans = SpanMap::build(&text).expect("well-formed YAML");
        assert!(spans.values.len() <= MAX_ALIAS_COPIES + 200, "{}", spans.values.len());
        assert_eq!(spans.value_pos("/b/3/9"), Pos { line: 1, column: 35 });
    }

    // Issue 9: 5,000 aliases of a 5,000-element anchor (25 KB) made the loader allocate 25
    // million nodes and abort.
    #[test]
    fn alias_expansion_is_counted_and_refused_at_the_alias() {
        let list = |n: usize, item: &str| vec![item; n].join(",");
        let cases: Vec<(String, Option<(usize, usize)>)> = vec![
            // 5,005 nodes, then 5,001 per alias: the 49th is one too many.
            (format!("a: &a [{}]\nb: [{}]\n", list(5000, "1"), list(5000, "*a")), Some((2, 5 + 3 * 48))),
            (format!("a: &a [{}]\nb: [{}]\n", list(100, "1"), list(100, "*a")), None),
            // Anchors inside anchors: each level doubles.
            (
                (1..20).fold("l0: &l0 [1, 2]\n".to_string(), |text, i| {
                    format!("{text}l{i}: &l{i} [*l{}, *l{}]\n", i - 1, i - 1)
                }),
                // 131,069 nodes before line 16, whose anchor is 65,535 nodes: its second alias.
                Some((16, 18)),
            ),
            (
                format!("x: &x {{k: [{}]}}\ny: {{<<: [{}]}}\n", list(1000, "1"), list(300, "*x")),
                Some((2, 10 + 3 * 248)),
            ),
            // Many nodes without any alias are refused too (a MiB of `0,`).
            (format!("[{}]\n", list(MAX_NODES, "0")), Some((1, 2 * MAX_NODES))),
        ];
        for (text, refused_at) in cases {
            let got = SpanMap::build(&text).err().map(|(pos, message)| {
                assert!(message.contains(&MAX_NODES.to_string()), "{message}");
                (pos.line, pos.column)
            });
            assert_eq!(got, refused_at, "{}", &text[..text.len().min(80)]);
        }
    }

    // Issue 9: a link loop hung discovery; links out of the tree read anything.
    #[test]
    fn discovery_stays_inside_the_given_paths_and_ends() {
        use std::os::unix::fs::symlink;
        let top = tempfile::tempdir().expect("tempdir");
        let root = top.path().join("root");
        let outside = top.path().join("outside");
        for d in [root.join("v2/sub"), root.join(".sluice/dedup"), outside.clone()] {
            std::fs::create_dir_all(d).expect("mkdir");
        }
        let hidden = [root.join(".sluice/dedup/h.yaml"), root.join(".hidden.yaml")];
        for f in [root.join("a.yaml"), root.join("v2/b.yml"), root.join("v2/sub/c.yaml"), outside.join("o.yaml")]
            .into_iter()
            .chain(hidden)
        {
            std::fs::write(f, "version: 1\n").expect("write");
        }
        std::fs::write(root.join("notes.txt"), "").expect("write");
        let links = [
            ("loop1", "."),
            ("loop2", ".."),
            ("v2/sub/up", "../.."),
            ("current", "v2"),
            ("alias.yaml", "a.yaml"),
            ("notes.yaml", "notes.txt"),
            ("out", "../outside"),
            ("out.yaml", "../outside/o.yaml"),
            ("zero.yaml", "/dev/zero"),
            ("self.yaml", "self.yaml"),
            ("dangling.yaml", "missing.yaml"),
            ("dangling", "missing"),
            ("out.txt", "../outside/o.yaml"),
        ];
        for (name, target) in links {
            symlink(target, root.join(name)).expect("symlink");
        }
        let found = discover(std::slice::from_ref(&root));
        let files: Vec<String> =
            found.files.iter().map(|f| f.strip_prefix(&root).expect("under root").display().to_string()).collect();
        assert_eq!(files, ["a.yaml", "notes.yaml", "v2/b.yml", "v2/sub/c.yaml"]);
        let diagnostics: Vec<(String, Severity, bool)> = found
            .diagnostics
            .iter()
            .map(|d| {
                let name = d.file.strip_prefix(&root).expect("under root").display().to_string();
                (name, d.severity, d.message.contains("leads outside the paths being loaded; skipped"))
            })
            .collect();
        assert_eq!(
            diagnostics,
            [
                ("dangling.yaml".to_string(), Severity::Error, false),
                // `..` of the root is outside it.
                ("loop2".to_string(), Severity::Warning, true),
                ("out".to_string(), Severity::Warning, true),
                ("out.yaml".to_string(), Severity::Warning, true),
                ("self.yaml".to_string(), Severity::Error, false),
                ("zero.yaml".to_string(), Severity::Warning, true),
            ]
        );
        // Named on the command line, a link is the user's choice: followed.
        let named = discover(&[root.join("out.yaml"), root.clone(), root.join("v2")]);
        assert_eq!(named.files.len(), 5, "{:?}", named.files);
    }

    // Issue 14: test files sit beside the pipelines and are never loaded as pipelines.
    #[test]
    fn test_files_are_found_apart_from_pipelines() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        for f in ["a.yaml", "a.test.yaml", "sub/b.test.yml", "sub/b.yml", "test.yaml", "c.tests.yaml", "d.test.json"] {
            std::fs::write(dir.path().join(f), "version: 1\n").expect("write");
        }
        let names = |found: Discovery| -> Vec<String> {
            found.files.iter().map(|f| f.strip_prefix(dir.path()).expect("under dir").display().to_string()).collect()
        };
        let root = [dir.path().to_path_buf()];
        assert_eq!(names(discover(&root)), ["a.yaml", "c.tests.yaml", "sub/b.yml", "test.yaml"]);
        assert_eq!(names(discover_tests(&root)), ["a.test.yaml", "sub/b.test.yml"]);
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
    fn positions_count_a_lone_cr_as_a_line_end() {
        let f = parsed("version: 1\rqueues:\r  a: 1\r");
        assert_eq!(f.pos("/queues/a"), Pos { line: 3, column: 6 });
    }

    #[test]
    fn empty_file_is_an_empty_object() {
        assert_eq!(parsed("").value, serde_json::json!({}));
    }
}
