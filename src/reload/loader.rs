//! The one place a running `sluice run` loads, validates and hands over a new config: on each
//! reload request (a file change or SIGHUP) the pipeline files are loaded as `validate` loads
//! them; an invalid edit is logged with the same file:line:column diagnostics and counted as
//! rejected, and the running config stays; a valid one goes to the runtime, which applies it
//! (or, if the broker refuses its declarations, keeps the old one) and says what changed.

use std::path::PathBuf;
use std::sync::Arc;

use metrics::counter;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::{Reloads, Trigger};
use crate::config::{self, Config, Severity};
use crate::runtime::Reload;

/// Serves reload requests until `shutdown` or until the runtime is gone.
pub async fn serve(
    paths: Vec<PathBuf>,
    mut requests: Reloads,
    runtime: mpsc::UnboundedSender<Reload>,
    shutdown: CancellationToken,
) {
    loop {
        let trigger = tokio::select! {
            _ = shutdown.cancelled() => return,
            t = requests.next() => match t {
                Some(t) => t,
                None => return,
            },
        };
        match &trigger {
            Trigger::Signal => info!("SIGHUP: reloading the pipeline files"),
            Trigger::Files(files) => {
                let files: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
                info!(changed = %files.join(", "), "pipeline files changed; reloading");
            }
        }
        let Some(config) = load(&paths) else {
            rejected();
            continue;
        };
        let config = Arc::new(config);
        let (applied, outcome) = oneshot::channel();
        if runtime.send(Reload { config: config.clone(), applied }).is_err() {
            return;
        }
        match outcome.await {
            Ok(Ok(diff)) => {
                counter!("sluice_config_reloads_total", "result" => "applied").increment(1);
                let list =
                    |names: &std::collections::BTreeSet<String>| names.iter().cloned().collect::<Vec<_>>().join(", ");
                info!(
                    added = %list(&diff.added),
                    changed = %list(&diff.changed),
                    removed = %list(&diff.removed),
                    "reload applied"
                );
                for name in &diff.removed {
                    warn!(queue = %name, "queue removed from the pipeline files: no longer consumed; the queue and its messages stay on the broker");
                }
                requests.set_paths(watched(&paths, &config));
            }
            Ok(Err(e)) => {
                error!(error = %e, "reload rejected by the broker; the running config stays");
                rejected();
            }
            Err(_) => return,
        }
    }
}

fn rejected() {
    counter!("sluice_config_reloads_total", "result" => "rejected").increment(1);
}

/// Loads the files; on errors logs each diagnostic as `validate` prints it and returns `None`.
fn load(paths: &[PathBuf]) -> Option<Config> {
    let validation = config::load(paths);
    for d in validation.diagnostics.iter().filter(|d| d.severity == Severity::Error) {
        error!("{}", d.headline());
    }
    let Some(config) = validation.config else {
        error!("invalid pipeline files; the running config stays");
        return None;
    };
    Some(config)
}

/// What to watch for a config: the pipeline paths, and the files its queues read (payload
/// schemas, command programs given as paths).
pub fn watched(paths: &[PathBuf], config: &Config) -> Vec<PathBuf> {
    let mut watched = paths.to_vec();
    for q in config.queues.values() {
        watched.extend(q.payload_schema.as_ref().map(|s| s.path.clone()));
        if let config::Handler::Command(c) = &q.handler
            && c.program.components().count() > 1
        {
            watched.push(c.program.clone());
        }
    }
    watched.sort();
    watched.dedup();
    watched
}
