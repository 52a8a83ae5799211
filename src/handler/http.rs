//! What the handlers' HTTP calls share, the webhook's and the OAuth2 token fetch's: how a
//! request that got no response fails (by its innermost cause, never with the URL, which may
//! carry a token), and reading no more of an answer than is wanted.

use super::HandlerError;

/// Classifies a request that got no response at all.
pub(super) fn send_error(error: &reqwest::Error) -> HandlerError {
    if error.is_builder() {
        HandlerError::permanent(format!("invalid request: {}", cause(error)))
    } else if error.is_connect() {
        HandlerError::unwell(format!("connect error: {}", cause(error)), None)
    } else {
        // The connection broke mid-exchange: as much the receiver's trouble as a refused one.
        HandlerError::unwell(format!("request error: {}", cause(error)), None)
    }
}

/// The innermost cause says what went wrong ("Connection refused") and, unlike reqwest's
/// own text, does not repeat the URL.
pub(super) fn cause(error: &reqwest::Error) -> String {
    let mut innermost = None;
    let mut next = std::error::Error::source(error);
    while let Some(source) = next {
        innermost = Some(source);
        next = source.source();
    }
    innermost.map_or_else(|| "no detail given".to_owned(), ToString::to_string)
}

/// Appends the start of the response body to `body`, stopping after `limit` bytes.
pub(super) async fn read_bounded(response: &mut reqwest::Response, body: &mut Vec<u8>, limit: usize) {
    while body.len() < limit {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = limit - body.len();
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            // A broken body is no reason to lose the status we already have.
            Ok(None) | Err(_) => break,
        }
    }
}
