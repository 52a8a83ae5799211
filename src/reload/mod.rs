//! Reload requests: turns changes to the pipeline files (and the payload-schema files and
//! command programs they name) and SIGHUP into one stream of [`Trigger`]s for the runtime.
//!
//! A burst of saves becomes one request: file events are debounced (in `watcher`) and, if
//! the runtime is still busy with the previous reload, every request since merges into the
//! next one. SIGHUP always works, with `--no-watch` too, and keeps working when the file
//! watcher cannot start or fails (its errors are logged, never fatal).
//!
//! This module only *asks* for a reload. It never reads, parses, validates, diffs or applies
//! configuration: that happens in one place in the runtime, whatever asked.

pub mod loader;
mod watcher;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Poll;

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Why a reload was asked for (for the log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger {
    /// Watched files changed: their paths, absolute, sorted and deduplicated.
    Files(Vec<PathBuf>),
    /// The process received SIGHUP.
    Signal,
}

/// Reload requests cannot be listened for at all.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot listen for SIGHUP")]
    Signal(#[source] std::io::Error),
}

/// The receiving end of reload requests; dropping it stops the file watcher.
pub struct Reloads {
    mailbox: Arc<Mailbox>,
    files: Option<watcher::Handle>,
    stop: CancellationToken,
}

/// Starts listening for SIGHUP and, with `watch` (no `--no-watch`), for changes to `paths`:
/// directories are watched recursively for `*.yaml`/`*.yml`, anything else as that one file.
///
/// Call it before the first load, so that no change between loading and watching is missed:
/// the watches are in place when it returns. A file watcher that cannot start is logged and
/// leaves SIGHUP as the only trigger. Once called, SIGHUP no longer terminates the process,
/// even after the `Reloads` is dropped.
///
/// # Panics
///
/// Outside a Tokio runtime.
pub fn spawn(paths: Vec<PathBuf>, watch: bool) -> Result<Reloads, WatchError> {
    let hangups = signal(SignalKind::hangup()).map_err(WatchError::Signal)?;
    let mailbox = Arc::new(Mailbox::default());
    let stop = CancellationToken::new();
    tokio::spawn(forward_hangups(hangups, Source::new(&mailbox), stop.clone()));
    let files = if watch {
        watcher::start(paths, Source::new(&mailbox))
            .inspect_err(|error| {
                warn!(%error, "cannot watch the pipeline files; reload with SIGHUP instead");
            })
            .ok()
    } else {
        None
    };
    Ok(Reloads { mailbox, files, stop })
}

impl Reloads {
    /// The next reload request (several file events within the debounce window arrive as one).
    ///
    /// Cancel-safe: a request is taken only when it is returned. `None` once nothing can ask
    /// any more (the signal listener ended), which a running process does not see.
    pub async fn next(&mut self) -> Option<Trigger> {
        loop {
            if let Poll::Ready(request) = self.mailbox.take() {
                return request;
            }
            // A post between `take` and here leaves a permit, so this cannot miss it.
            self.mailbox.ready.notified().await;
        }
    }

    /// Replaces the set of watched paths (after a reload, the pipeline files may name other
    /// payload-schema files or programs). Does nothing without the file watcher.
    pub fn set_paths(&mut self, paths: Vec<PathBuf>) {
        if let Some(files) = &self.files {
            files.set_paths(paths);
        }
    }
}

impl Drop for Reloads {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn forward_hangups(mut hangups: Signal, source: Source, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            received = hangups.recv() => match received {
                Some(()) => {
                    debug!("SIGHUP received; asking for a reload");
                    source.post(Trigger::Signal);
                }
                None => break,
            },
        }
    }
}

/// Requests not yet taken, merged: the runtime reloads everything anyway, so ten requests
/// that queue up while it is busy need one more reload, not ten.
#[derive(Default)]
struct Mailbox {
    pending: Mutex<Pending>,
    ready: Notify,
}

#[derive(Default)]
struct Pending {
    signal: bool,
    files: BTreeSet<PathBuf>,
    /// Live producers (the signal listener, the file watcher); none left means no more requests.
    sources: usize,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Pending is valid after any panic: each update is a single insert or flag.
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A signal first: it already covers the files that changed before it.
    fn take(&self) -> Poll<Option<Trigger>> {
        let mut pending = self.lock();
        if std::mem::take(&mut pending.signal) {
            Poll::Ready(Some(Trigger::Signal))
        } else if !pending.files.is_empty() {
            Poll::Ready(Some(Trigger::Files(std::mem::take(&mut pending.files).into_iter().collect())))
        } else if pending.sources == 0 {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    }
}

/// One producer's handle on the mailbox; dropping it tells the receiver this producer is gone.
struct Source(Arc<Mailbox>);

impl Source {
    fn new(mailbox: &Arc<Mailbox>) -> Source {
        mailbox.lock().sources += 1;
        Source(mailbox.clone())
    }

    fn post(&self, trigger: Trigger) {
        {
            let mut pending = self.0.lock();
            match trigger {
                Trigger::Signal => pending.signal = true,
                Trigger::Files(files) => pending.files.extend(files),
            }
        }
        self.0.ready.notify_one();
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        self.0.lock().sources -= 1;
        self.0.ready.notify_one();
    }
}

#[cfg(test)]
mod tests;
