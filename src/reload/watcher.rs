//! The file half of reload requests: notify watches, the filter that decides which events are
//! worth a reload, and the debounce that turns a burst of them into one request.
//!
//! Editors save by writing a temporary file and renaming it over the original, and deploy
//! tools replace whole directories, so a watch on the file or directory itself would die with
//! the inode it was on. Instead the *parent* of each named file is watched and its events are
//! filtered by name, and each watched directory's parent is watched too so that a directory
//! that comes back is watched again.
//!
//! Symbolic links are followed where loading follows them, and no further (no loops, no
//! watching `/` through a stray link): a named path that is a link is watched by name in its
//! directory and at its target; a pipeline file that discovery loads through a link has its
//! target counted as named, and on every event the links are resolved again, so that a link
//! pointed elsewhere (a Kubernetes ConfigMap's `..data` swap) is a change to the file. A
//! directory is only ever watched under its real path: inotify has one watch per inode.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::path::{Component, Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use notify::event::{AccessKind, AccessMode, CreateKind, MetadataKind, ModifyKind, RemoveKind, RenameMode};
use notify::{ErrorKind, Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher as _};
use tracing::{debug, warn};

use super::{Source, Trigger};
use crate::config::source::{discover, is_pipeline_file};

/// A burst of changes becomes one request once no relevant change has come for this long:
/// longer than the gap between an editor's writes, or between the saves of a save-all.
const QUIET: Duration = Duration::from_millis(250);
/// ...or this long after the burst began, so that files that never stop changing still reload.
const MAX_DELAY: Duration = Duration::from_secs(1);

/// The running file watcher, shared by `Reloads::set_paths` and the thread that reads events.
pub(super) struct Handle {
    watching: Arc<Mutex<Watching>>,
    events: mpsc::Sender<Message>,
}

enum Message {
    Event(notify::Result<Event>),
    Stop,
}

/// Watches `paths` and posts what changed to `source` from a thread of its own (notify's calls
/// block, and a recursive watch walks the directory tree).
pub(super) fn start(paths: Vec<PathBuf>, source: Source) -> notify::Result<Handle> {
    let (events, inbox) = mpsc::channel();
    let forward = events.clone();
    // Raw events, debounced below: notify-debouncer-full drops an expired event when a newer
    // one of the same kind is queued for the same path, so a file saved by rename more often
    // than its delay never produced a request until the saves stopped.
    let watcher = RecommendedWatcher::new(
        move |result| {
            // Fails only once the reading thread has stopped, and then nobody is listening.
            let _ = forward.send(Message::Event(result));
        },
        notify::Config::default().with_follow_symlinks(false),
    )?;
    let mut watching = Watching { watcher, paths: Vec::new(), plan: Plan::default(), armed: BTreeSet::new() };
    watching.set_paths(paths);
    let watching = Arc::new(Mutex::new(watching));
    let shared = watching.clone();
    std::thread::Builder::new()
        .name("sluice-reload-watch".into())
        .spawn(move || read_events(&shared, &inbox, &source))
        .map_err(notify::Error::io)?;
    Ok(Handle { watching, events })
}

impl Handle {
    pub(super) fn set_paths(&self, paths: Vec<PathBuf>) {
        lock(&self.watching).set_paths(paths);
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let _ = self.events.send(Message::Stop);
    }
}

fn lock(watching: &Mutex<Watching>) -> MutexGuard<'_, Watching> {
    // A panic while (un)watching leaves at worst a watch too many or too few: still usable.
    watching.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Changes seen since the last request, waiting for the files to go quiet.
struct Burst {
    files: BTreeSet<PathBuf>,
    first: Instant,
    last: Instant,
}

impl Burst {
    fn due(&self) -> Instant {
        (self.last + QUIET).min(self.first + MAX_DELAY)
    }
}

fn read_events(watching: &Mutex<Watching>, inbox: &mpsc::Receiver<Message>, source: &Source) {
    let mut burst: Option<Burst> = None;
    loop {
        let message = match burst.as_ref().map(Burst::due) {
            None => inbox.recv().ok(),
            // Checked before receiving, so that a steady stream of events cannot hold it back.
            Some(due) if due <= Instant::now() => {
                let files = burst.take().map(|b| b.files).unwrap_or_default();
                debug!(files = files.len(), "pipeline files changed; asking for a reload");
                source.post(Trigger::Files(files.into_iter().collect()));
                continue;
            }
            Some(due) => match inbox.recv_timeout(due - Instant::now()) {
                Ok(message) => Some(message),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => None,
            },
        };
        match message {
            None | Some(Message::Stop) => return,
            Some(Message::Event(Ok(event))) => {
                let changed = lock(watching).changed(&event);
                if !changed.is_empty() {
                    let now = Instant::now();
                    let burst = burst.get_or_insert_with(|| Burst { files: BTreeSet::new(), first: now, last: now });
                    burst.files.extend(changed);
                    burst.last = now;
                }
            }
            Some(Message::Event(Err(error))) => log_error(&error),
        }
    }
}

fn log_error(error: &notify::Error) {
    if matches!(error.kind, ErrorKind::MaxFilesWatch) {
        warn!(
            %error,
            paths = ?error.paths,
            "the file watch limit is reached (raise fs.inotify.max_user_watches); reload with SIGHUP"
        );
    } else {
        warn!(%error, paths = ?error.paths, "file watcher error; if a change is missed, reload with SIGHUP");
    }
}

struct Watching {
    watcher: RecommendedWatcher,
    /// The paths as given, to plan again when links move.
    paths: Vec<PathBuf>,
    plan: Plan,
    /// The planned watches notify accepted (a missing directory is planned, not armed).
    armed: BTreeSet<PathBuf>,
}

impl Watching {
    fn set_paths(&mut self, paths: Vec<PathBuf>) {
        let (named, links) = resolve(&paths);
        let plan = Plan::new(&named, links, |path| path.is_dir());
        let old = std::mem::replace(&mut self.plan, plan);
        // Unwatch first: a recursive watch going away takes every watch below it along.
        for (path, mode) in &old.watches {
            if self.plan.watches.get(path) != Some(mode) {
                self.unwatch(path);
            }
        }
        // Kept watches stay as they are; one still missing gets another try.
        for (path, mode) in self.plan.watches.clone() {
            if !self.armed.contains(&path) {
                self.watch(&path, mode);
            }
        }
        debug!(named = paths.len(), watches = self.plan.watches.len(), "watching pipeline files");
        self.paths = paths;
    }

    fn watch(&mut self, path: &Path, mode: RecursiveMode) {
        // Missing now, it is watched when the watch on its parent sees it appear.
        if !path.is_dir() {
            debug!(path = %path.display(), "not watching a missing directory yet");
            return;
        }
        match self.watcher.watch(path, mode) {
            Ok(()) => {
                self.armed.insert(path.to_path_buf());
            }
            Err(error) => log_error(&error),
        }
    }

    fn unwatch(&mut self, path: &Path) {
        // Fails when notify already dropped the watch with its directory: fine.
        let _ = self.watcher.unwatch(path);
        self.armed.remove(path);
    }

    /// Watches `path` afresh: after it was removed, re-created or replaced by a rename, the
    /// old watch (if any) is on a dead inode.
    fn rewatch(&mut self, path: &Path) {
        if let Some(&mode) = self.plan.watches.get(path) {
            self.unwatch(path);
            self.watch(path, mode);
        }
    }

    /// The named paths this event touches, re-arming the watches it invalidated.
    fn changed(&mut self, event: &Event) -> BTreeSet<PathBuf> {
        let mut changed = BTreeSet::new();
        let mut stale = BTreeSet::new();
        // A link moved, or a named path or a link came or went: what to watch may have changed.
        let mut replan = false;
        if event.need_rescan() {
            // The kernel dropped events: anything may have changed, any watch may be stale.
            stale.extend(self.plan.watches.keys().cloned());
            changed.extend(self.plan.named().cloned());
            replan = true;
        } else {
            for (path, change) in changes(&event.kind, &event.paths) {
                let came_or_went = matches!(change.what, What::Appeared | What::Disappeared);
                if came_or_went && self.plan.watches.contains_key(path) {
                    stale.insert(path.to_path_buf());
                }
                if self.plan.is_relevant(path, change, |path| path.is_dir()) {
                    changed.insert(path.to_path_buf());
                    replan |= came_or_went && (self.plan.links.contains_key(path) || path.is_symlink());
                }
            }
        }
        let moved = self.plan.moved_links();
        replan |= !moved.is_empty();
        changed.extend(moved);
        for path in stale {
            self.rewatch(&path);
            // Whatever was created inside before the new watch was in place went unseen: count
            // everything named inside as changed.
            changed.extend(self.plan.named().filter(|named| named.starts_with(&path)).cloned());
        }
        if replan {
            self.set_paths(self.paths.clone());
        }
        changed
    }
}

/// What to watch for a set of named paths, and what counts as a change to them.
#[derive(Debug, Default, PartialEq)]
struct Plan {
    /// Named directories: every `*.yaml`/`*.yml` below them counts (pipeline directories).
    dirs: BTreeSet<PathBuf>,
    /// Named files (or missing paths): only that exact path counts.
    files: BTreeSet<PathBuf>,
    /// The named directories recursively, the parents of named files and the parents of those
    /// (to see them come back), none inside a recursive one.
    watches: BTreeMap<PathBuf, RecursiveMode>,
    /// Each symbolic link among the named paths and the pipeline files found through them,
    /// with its target as it was resolved.
    links: BTreeMap<PathBuf, PathBuf>,
}

/// The named paths, absolute and each spelled with its directory resolved (an ancestor that is
/// a link would put a second watch on one directory), and the links among them and among the
/// pipeline files that discovery finds through them, with their targets.
fn resolve(paths: &[PathBuf]) -> (Vec<PathBuf>, BTreeMap<PathBuf, PathBuf>) {
    let named: Vec<PathBuf> = paths
        .iter()
        .map(|path| {
            let path = normalize(path);
            match (path.parent().and_then(|parent| parent.canonicalize().ok()), path.file_name()) {
                (Some(parent), Some(name)) => parent.join(name),
                _ => path,
            }
        })
        .collect();
    let found = discover(&named).files;
    let links = named
        .iter()
        .chain(&found)
        .filter(|path| path.is_symlink())
        .filter_map(|path| Some((path.clone(), path.canonicalize().ok()?)))
        .collect();
    (named, links)
}

impl Plan {
    /// A plan for the `named` paths (spelled as [`resolve`] spells them) and the `links` among
    /// them and below them: a named link is watched by name, like a file, and every target as
    /// if it were named too. `is_dir` asks the file system.
    fn new(named: &[PathBuf], links: BTreeMap<PathBuf, PathBuf>, is_dir: impl Fn(&Path) -> bool) -> Plan {
        let mut plan = Plan::default();
        let mut watches = BTreeMap::new();
        let mut want = |path: &Path, mode| {
            let entry = watches.entry(path.to_path_buf()).or_insert(mode);
            if mode == RecursiveMode::Recursive {
                *entry = mode;
            }
        };
        for path in named.iter().map(|path| normalize(path)).chain(links.values().cloned()) {
            let watched = if !links.contains_key(&path) && is_dir(&path) {
                want(&path, RecursiveMode::Recursive);
                plan.dirs.insert(path.clone());
                path
            } else {
                let Some(parent) = path.parent().map(Path::to_path_buf) else { continue };
                want(&parent, RecursiveMode::NonRecursive);
                plan.files.insert(path);
                parent
            };
            if let Some(above) = watched.parent() {
                want(above, RecursiveMode::NonRecursive);
            }
        }
        let recursive: Vec<PathBuf> = watches
            .iter()
            .filter(|(_, mode)| **mode == RecursiveMode::Recursive)
            .map(|(path, _)| path.clone())
            .collect();
        // inotify keeps one watch per directory: a second one inside a recursive watch would
        // replace it, and lose the recursion.
        watches.retain(|path, _| !recursive.iter().any(|root| path != root && path.starts_with(root)));
        plan.watches = watches;
        plan.links = links;
        plan
    }

    /// The links that no longer lead where they led when planned.
    fn moved_links(&self) -> Vec<PathBuf> {
        self.links
            .iter()
            .filter(|(link, target)| link.canonicalize().ok().as_ref() != Some(*target))
            .map(|(link, _)| link.clone())
            .collect()
    }

    fn named(&self) -> impl Iterator<Item = &PathBuf> {
        self.dirs.iter().chain(&self.files)
    }

    /// Whether this change to `path` is worth a reload. `is_dir` asks the file system.
    fn is_relevant(&self, path: &Path, change: Change, is_dir: impl Fn(&Path) -> bool) -> bool {
        if self.files.contains(path) || self.dirs.contains(path) {
            return true;
        }
        let Some(dir) = self.dirs.iter().find(|dir| path.starts_with(dir)) else {
            // A sibling of a named file, or of a named directory.
            return false;
        };
        // Hidden entries below a pipeline directory are not loaded (`.git/`, the runner's own
        // `.sluice/` store), so their changes are no reason to reload.
        let below = path.strip_prefix(dir).unwrap_or(path);
        if below.components().any(|c| c.as_os_str().as_encoded_bytes().starts_with(b".")) {
            return false;
        }
        let Some(name) = path.file_name() else { return false };
        if is_scratch(name) {
            return false;
        }
        if is_pipeline_file(path) {
            return true;
        }
        // A directory that comes or goes carries pipeline files with it, and a rename brings
        // no event for its contents.
        match change.what {
            What::Appeared => change.folder == Some(true) || is_dir(path),
            // Gone, so only its name is left to guess from: a spurious reload is cheap, a
            // missed one is not.
            What::Disappeared => change.folder.unwrap_or_else(|| Path::new(name).extension().is_none()),
            What::Modified => false,
        }
    }
}

/// What happened to one path of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Change {
    what: What,
    /// Whether the path is a directory, when the event says.
    folder: Option<bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum What {
    Appeared,
    Disappeared,
    Modified,
}

/// Each path of an event with what happened to it; reads and metadata-only events yield none.
fn changes<'a>(kind: &EventKind, paths: &'a [PathBuf]) -> Vec<(&'a Path, Change)> {
    let each = |what, folder| paths.iter().map(|path| (path.as_path(), Change { what, folder })).collect();
    match kind {
        EventKind::Create(CreateKind::Folder) => each(What::Appeared, Some(true)),
        EventKind::Create(CreateKind::File) => each(What::Appeared, Some(false)),
        EventKind::Create(_) => each(What::Appeared, None),
        EventKind::Remove(RemoveKind::Folder) => each(What::Disappeared, Some(true)),
        EventKind::Remove(RemoveKind::File) => each(What::Disappeared, Some(false)),
        EventKind::Remove(_) => each(What::Disappeared, None),
        EventKind::Modify(ModifyKind::Name(RenameMode::Both)) => paths
            .iter()
            .enumerate()
            .map(|(i, path)| {
                let what = if i == 0 { What::Disappeared } else { What::Appeared };
                (path.as_path(), Change { what, folder: None })
            })
            .collect(),
        EventKind::Modify(ModifyKind::Name(RenameMode::From)) => each(What::Disappeared, None),
        EventKind::Modify(ModifyKind::Name(RenameMode::To)) => each(What::Appeared, None),
        EventKind::Modify(ModifyKind::Name(_)) => paths
            .iter()
            .map(|path| {
                let what = if path.exists() { What::Appeared } else { What::Disappeared };
                (path.as_path(), Change { what, folder: None })
            })
            .collect(),
        EventKind::Modify(ModifyKind::Metadata(MetadataKind::AccessTime)) => Vec::new(),
        EventKind::Modify(_) | EventKind::Any => each(What::Modified, None),
        // A writer closing the file is the end of a save; every other access is a read.
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => each(What::Modified, None),
        EventKind::Access(_) | EventKind::Other => Vec::new(),
    }
}

/// Editor swap, backup, lock and probe files: never a reason to reload by themselves (a named
/// path is checked before this, so naming one explicitly still works).
fn is_scratch(name: &OsStr) -> bool {
    let name = name.to_string_lossy();
    let extension = Path::new(&*name).extension().and_then(OsStr::to_str);
    name.ends_with('~')
        || name.starts_with(".#")
        || (name.len() > 1 && name.starts_with('#') && name.ends_with('#'))
        || name == "4913"
        || matches!(extension, Some("swp" | "swo" | "swn" | "swx"))
}

/// Absolute, with `.` and `..` resolved by name: inotify has one watch per directory, so one
/// directory must have one spelling, whatever the pipeline files wrote.
fn normalize(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut normal = PathBuf::new();
    for component in absolute.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                normal.pop();
            }
            other => normal.push(other),
        }
    }
    normal
}

#[cfg(test)]
mod tests {
    use super::*;

    use RecursiveMode::{NonRecursive as Flat, Recursive as Deep};

    fn paths(list: &[&str]) -> Vec<PathBuf> {
        list.iter().map(PathBuf::from).collect()
    }

    /// What notify should be told to watch.
    type Watches = &'static [(&'static str, RecursiveMode)];

    #[test]
    fn plans_watches_for_directories_files_and_their_parents() {
        // Directories are the paths ending in `/` (without the slash).
        let cases: &[(&str, &[&str], Watches)] = &[
            (
                "a pipeline directory, and its parent to see it come back",
                &["/p/pipes/"],
                &[("/p", Flat), ("/p/pipes", Deep)],
            ),
            (
                "a file: its directory, and that one's parent",
                &["/p/schemas/order.json"],
                &[("/p", Flat), ("/p/schemas", Flat)],
            ),
            (
                "files side by side share their watches",
                &["/p/schemas/a.json", "/p/schemas/b.json"],
                &[("/p", Flat), ("/p/schemas", Flat)],
            ),
            (
                "a file inside a pipeline directory needs no watch of its own",
                &["/p/pipes/", "/p/pipes/scripts/resize.sh"],
                &[("/p", Flat), ("/p/pipes", Deep)],
            ),
            (
                "a recursive watch wins over a flat one on the same directory",
                &["/p/x.yaml", "/p/"],
                &[("/", Flat), ("/p", Deep)],
            ),
            (
                "nested pipeline directories: the outer one covers the inner",
                &["/p/pipes/", "/p/pipes/more/"],
                &[("/p", Flat), ("/p/pipes", Deep)],
            ),
            (
                "one spelling per directory",
                &["/p/pipes/../schemas/./a.json", "/p/schemas/b.json"],
                &[("/p", Flat), ("/p/schemas", Flat)],
            ),
            ("a file at the root has no grandparent", &["/x.yaml"], &[("/", Flat)]),
        ];
        for (name, named, watches) in cases {
            let dirs: Vec<&str> = named.iter().filter_map(|p| p.strip_suffix('/')).collect();
            let named: Vec<PathBuf> = named.iter().map(|p| PathBuf::from(p.trim_end_matches('/'))).collect();
            let plan = Plan::new(&named, BTreeMap::new(), |p| dirs.iter().any(|d| Path::new(d) == p));
            let expected: BTreeMap<PathBuf, RecursiveMode> =
                watches.iter().map(|(p, mode)| (PathBuf::from(p), *mode)).collect();
            assert_eq!(plan.watches, expected, "{name}");
        }
    }

    #[test]
    fn plans_links_by_name_and_their_targets_as_if_named() {
        struct Case {
            name: &'static str,
            named: &'static [&'static str],
            links: &'static [(&'static str, &'static str)],
            /// The directories on this pretend disk.
            real_dirs: &'static [&'static str],
            watches: Watches,
            dirs: &'static [&'static str],
            files: &'static [&'static str],
        }
        let cases = [
            Case {
                name: "a pipeline directory that is a link: the link by name, the target recursively",
                named: &["/p/pipes"],
                links: &[("/p/pipes", "/q/first")],
                real_dirs: &["/q/first"],
                watches: &[("/", Flat), ("/p", Flat), ("/q", Flat), ("/q/first", Deep)],
                dirs: &["/q/first"],
                files: &["/p/pipes"],
            },
            Case {
                name: "a ConfigMap key: its target is named, inside the watch already there",
                named: &["/cfg"],
                links: &[("/cfg/orders.yaml", "/cfg/..2026_12_02_01_00_00.123/orders.yaml")],
                real_dirs: &["/cfg"],
                watches: &[("/", Flat), ("/cfg", Deep)],
                dirs: &["/cfg"],
                files: &["/cfg/..2026_12_02_01_00_00.123/orders.yaml"],
            },
        ];
        for case in cases {
            let links = case.links.iter().map(|(l, t)| (PathBuf::from(l), PathBuf::from(t))).collect();
            let plan = Plan::new(&paths(case.named), links, |p| case.real_dirs.iter().any(|d| Path::new(d) == p));
            let expected: BTreeMap<PathBuf, RecursiveMode> =
                case.watches.iter().map(|(p, mode)| (PathBuf::from(p), *mode)).collect();
            assert_eq!(plan.watches, expected, "{}", case.name);
            assert_eq!(plan.dirs, paths(case.dirs).into_iter().collect(), "{}", case.name);
            assert_eq!(plan.files, paths(case.files).into_iter().collect(), "{}", case.name);
        }
    }

    #[test]
    fn relative_paths_become_absolute() {
        let plan = Plan::new(&paths(&["pipelines"]), BTreeMap::new(), |_| true);
        let cwd = std::env::current_dir().expect("cwd");
        assert_eq!(plan.dirs, BTreeSet::from([cwd.join("pipelines")]));
    }

    #[test]
    fn decides_which_changes_are_worth_a_reload() {
        let plan =
            Plan::new(&paths(&["/p/pipes", "/p/schemas/order.json", "/p/pipes/.#named.yaml"]), BTreeMap::new(), |p| {
                p == Path::new("/p/pipes")
            });
        let appeared = Change { what: What::Appeared, folder: None };
        let created_dir = Change { what: What::Appeared, folder: Some(true) };
        let created_file = Change { what: What::Appeared, folder: Some(false) };
        let gone = Change { what: What::Disappeared, folder: None };
        let removed_file = Change { what: What::Disappeared, folder: Some(false) };
        let modified = Change { what: What::Modified, folder: None };
        // Only `/p/pipes/sub` and `/p/pipes/link` are directories on this pretend disk.
        let is_dir = |p: &Path| p.ends_with("sub") || p.ends_with("link");
        let cases: &[(&str, Change, bool)] = &[
            ("/p/pipes/orders.yaml", modified, true),
            ("/p/pipes/deep/er/orders.yml", created_file, true),
            ("/p/pipes/orders.yaml", removed_file, true),
            ("/p/pipes/notes.txt", modified, false),
            // Test files are `sluice test`'s, not pipelines (issue 14).
            ("/p/pipes/orders.test.yaml", modified, false),
            ("/p/pipes/deep/orders.test.yml", created_file, false),
            ("/p/pipes/orders.json", created_file, false),
            ("/p/pipes/orders.yaml.tmp", created_file, false),
            ("/p/pipes/orders.yaml~", modified, false),
            ("/p/pipes/.orders.yaml.swp", modified, false),
            ("/p/pipes/.#orders.yaml", created_file, false),
            ("/p/pipes/.sluice/dedup/keyspaces", created_dir, false),
            ("/p/pipes/.git/x.yaml", modified, false),
            ("/p/pipes/#orders.yaml#", modified, false),
            ("/p/pipes/4913", created_file, false),
            ("/p/pipes/4913", gone, false),
            // Named explicitly, even a name that looks like scratch counts.
            ("/p/pipes/.#named.yaml", modified, true),
            // The named directory itself comes and goes.
            ("/p/pipes", gone, true),
            ("/p/pipes", created_dir, true),
            // Directories inside: created, renamed in (no kind said), renamed out, removed.
            ("/p/pipes/sub", created_dir, true),
            ("/p/pipes/link", appeared, true),
            ("/p/pipes/moved-out", gone, true),
            ("/p/pipes/sub", Change { what: What::Disappeared, folder: Some(true) }, true),
            ("/p/pipes/sub", modified, false),
            ("/p/pipes/README", removed_file, false),
            ("/p/pipes/file.txt", appeared, false),
            // Named files and their siblings.
            ("/p/schemas/order.json", modified, true),
            ("/p/schemas/order.json", appeared, true),
            ("/p/schemas/other.json", modified, false),
            ("/p/schemas/order.json.tmp", gone, false),
            ("/p/schemas", created_dir, false),
            // Siblings of the named directory, seen through the watch on its parent.
            ("/p/other.yaml", modified, false),
            ("/p/pipes.old", gone, false),
        ];
        for (path, change, relevant) in cases {
            assert_eq!(plan.is_relevant(Path::new(path), *change, is_dir), *relevant, "{path} {change:?}");
        }
    }

    #[test]
    fn reads_each_path_of_an_event() {
        let one = &[PathBuf::from("/p/a")][..];
        let both = &[PathBuf::from("/p/a"), PathBuf::from("/p/b")][..];
        let change = |what, folder| Change { what, folder };
        // The expected change to each path, in order.
        let cases: &[(EventKind, &[PathBuf], &[Change])] = &[
            (EventKind::Create(CreateKind::Folder), one, &[change(What::Appeared, Some(true))]),
            (EventKind::Create(CreateKind::File), one, &[change(What::Appeared, Some(false))]),
            (EventKind::Remove(RemoveKind::Folder), one, &[change(What::Disappeared, Some(true))]),
            (EventKind::Remove(RemoveKind::Any), one, &[change(What::Disappeared, None)]),
            (
                EventKind::Modify(ModifyKind::Name(RenameMode::Both)),
                both,
                &[change(What::Disappeared, None), change(What::Appeared, None)],
            ),
            (EventKind::Modify(ModifyKind::Name(RenameMode::From)), one, &[change(What::Disappeared, None)]),
            (EventKind::Modify(ModifyKind::Name(RenameMode::To)), one, &[change(What::Appeared, None)]),
            (EventKind::Modify(ModifyKind::Data(notify::event::DataChange::Any)), one, &[change(What::Modified, None)]),
            (EventKind::Modify(ModifyKind::Metadata(MetadataKind::Any)), one, &[change(What::Modified, None)]),
            (EventKind::Modify(ModifyKind::Metadata(MetadataKind::AccessTime)), one, &[]),
            (EventKind::Access(AccessKind::Close(AccessMode::Write)), one, &[change(What::Modified, None)]),
            (EventKind::Access(AccessKind::Close(AccessMode::Read)), one, &[]),
            (EventKind::Access(AccessKind::Open(AccessMode::Any)), one, &[]),
            (EventKind::Access(AccessKind::Read), one, &[]),
            (EventKind::Other, one, &[]),
        ];
        for (kind, paths, expected) in cases {
            let expected: Vec<(&Path, Change)> =
                paths.iter().map(PathBuf::as_path).zip(expected.iter().copied()).collect();
            assert_eq!(changes(kind, paths), expected, "{kind:?}");
        }
    }

    #[test]
    fn normalizes_by_name() {
        let cases = [("/p/./a/../b", "/p/b"), ("/p/a/", "/p/a"), ("/../x", "/x"), ("/p//a", "/p/a")];
        for (given, expected) in cases {
            assert_eq!(normalize(Path::new(given)), PathBuf::from(expected), "{given}");
        }
    }
}
