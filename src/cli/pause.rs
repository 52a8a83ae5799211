//! `sluice pause|resume QUEUE`: asks a running runner, through its admin endpoint, to stop or
//! go on consuming one queue, with the admin token. The runner keeps the state (across
//! reloads); nothing is written here.

use anyhow::Context as _;

use super::AdminArg;

/// Pauses (`true`) or resumes `queue` in the runner whose admin endpoint `admin` names.
pub async fn pause(admin: AdminArg, queue: &str, paused: bool) -> anyhow::Result<()> {
    let action = if paused { "pause" } else { "resume" };
    let addr = &admin.addr;
    let (token, source) = admin.token().with_context(|| {
        format!("no admin token for the runner at {addr}: give --admin-token-file or ${}, or --broker for the runner's state directory", super::token::ENV)
    })?;
    // Queue names are letters, digits, '_', '.', ':' and '-' (validate allows no others), so
    // they need no escaping in a path.
    let url = format!("http://{addr}/queues/{queue}/{action}");
    let response = reqwest::Client::new()
        .post(&url)
        .bearer_auth(token.secret())
        .send()
        .await
        .with_context(|| format!("cannot reach the runner at {addr} (is `sluice run --admin {addr}` running?)"))?;
    let status = response.status();
    let text = response.text().await.unwrap_or_default();
    if status == reqwest::StatusCode::UNAUTHORIZED {
        anyhow::bail!(
            "the runner at {addr} refused the admin token from {source}: {} (a runner takes the token from its --admin-token-file, else $SLUICE_ADMIN_TOKEN, else the file it generated)",
            crate::terminal::visible(text.trim())
        );
    }
    if !status.is_success() {
        anyhow::bail!(
            "the runner at {addr} refused to {action} \"{queue}\": {}",
            crate::terminal::visible(text.trim())
        );
    }
    super::output::stdout(&text)?;
    Ok(())
}
