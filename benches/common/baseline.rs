//! What the hand-written baseline consumers (`baseline_consumer`, `baseline_nats_consumer`)
//! share: their count of what they handled, the JSON line that reports it, and their `main`.

use std::future::Future;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

/// Handled count and first/last completion, for the summary line.
#[derive(Default)]
pub struct Progress {
    handled: u64,
    first: Option<f64>,
    last: Option<f64>,
}

impl Progress {
    /// Counts one message handled now; how many so far.
    pub fn handled(&mut self) -> u64 {
        let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default();
        self.first.get_or_insert(t);
        self.last = Some(t);
        self.handled += 1;
        self.handled
    }

    /// The one JSON line a consumer prints when it ends: how many it handled and the
    /// wall-clock time (Unix seconds) of the first and the last.
    pub fn print(&self) {
        println!(
            r#"{{"handled": {}, "first": {}, "last": {}}}"#,
            self.handled,
            self.first.unwrap_or(0.0),
            self.last.unwrap_or(0.0)
        );
    }
}

/// A baseline's `main`: nothing to do when run bare (by `cargo bench` or `cargo test
/// --all-targets`), its usage when the arguments do not parse, else `consume` them.
pub async fn main<A, F, E>(
    driver: &str,
    usage: &str,
    parse: fn() -> Option<A>,
    consume: impl FnOnce(A) -> F,
) -> ExitCode
where
    F: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    if std::env::args().skip(1).all(|a| a == "--bench") {
        eprintln!("{driver}");
        return ExitCode::SUCCESS;
    }
    let Some(args) = parse() else {
        eprintln!("{usage}");
        return ExitCode::from(2);
    };
    match consume(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
