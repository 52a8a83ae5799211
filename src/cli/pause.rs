//! `sluice pause|resume QUEUE`: asks a running runner, through its admin endpoint, to stop or
//! go on consuming one queue. The runner keeps the state (across reloads); nothing is written
//! here.

use anyhow::Context as _;

/// Pauses (`true`) or resumes `queue` in the runner whose admin endpoint is at `admin`.
pub async fn pause(admin: &str, queue: &str, paused: bool) -> anyhow::Result<()> {
    let action = if paused { "pause" } else { "resume" };
    // Queue names are letters, digits, '_', '.', ':' and '-' (validate allows no others), so
    // they need no escaping in a path.
    let url = format!("http://{admin}/queues/{queue}/{action}");
    let response =
        reqwest::Client::new().post(&url).send().await.with_context(|| {
            format!("cannot reach the runner at {admin} (is `sluice run --admin {admin}` running?)")
        })?;
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    if !status.is_success() {
        anyhow::bail!("the runner at {admin} refused to {action} \"{queue}\": {}", text.trim());
    }
    super::output::stdout(&text)?;
    Ok(())
}
