//! Outbound authentication of webhooks: OAuth 2.0 client-credentials tokens (RFC 6749 §4.4),
//! fetched when first needed, cached until shortly before they expire, shared by every call of
//! the queue, and fetched again once when the receiver answers 401.
//!
//! A token endpoint that cannot give a token says nothing about the message: its failures are
//! transient and say "receiver unwell" (the circuit breaker counts them), never a dead letter.
//! Neither the client secret nor a token ever reaches an error text, a log line or `Debug`.

use std::path::PathBuf;
use std::time::Duration;

use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::Url;
use reqwest::header::{CONTENT_TYPE, HeaderValue};
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::http::{read_bounded, send_error};
use super::{HandlerError, head_excerpt};

/// The most of a token endpoint's answer ever read: room for large JWTs.
const MAX_TOKEN_RESPONSE_BYTES: usize = 64 * 1024;

/// A token is fetched again this long before it expires (a tenth of its lifetime when that is
/// shorter), so that no call leaves with a token about to expire on the way.
const REFRESH_EARLY: Duration = Duration::from_secs(60);

/// Where the client secret is read, each time a token is fetched (a rotated secret file is
/// used at the next fetch, without a reload).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretSource {
    /// An environment variable, by name.
    Env(String),
    /// A file (a Docker or Kubernetes secret), read by [`crate::secret::read_secret_file`].
    File(PathBuf),
}

impl SecretSource {
    fn read(&self) -> Result<String, String> {
        match self {
            SecretSource::Env(name) => {
                std::env::var(name).map_err(|_| format!("environment variable {name} (the client secret) is not set"))
            }
            SecretSource::File(path) => crate::secret::read_secret_file(path).map_err(|e| e.to_string()),
        }
    }

    /// Whether the secret can be read here: `run` checks this at start-up.
    pub fn check(&self) -> Result<(), String> {
        self.read().map(drop)
    }
}

/// A cached access token: the whole `Authorization` header value, marked sensitive.
#[derive(Clone)]
struct Token {
    header: HeaderValue,
    /// When to fetch a new one; `None`: the endpoint gave no lifetime, so until a 401.
    refresh_at: Option<Instant>,
}

/// A queue's OAuth 2.0 client credentials and its token cache.
pub struct OAuth2 {
    pub token_url: Url,
    pub client_id: String,
    pub secret: SecretSource,
    pub scopes: Vec<String>,
    pub audience: Option<String>,
    /// Held while a token is fetched: concurrent calls wait for that one fetch.
    cache: Mutex<Option<Token>>,
}

impl std::fmt::Debug for OAuth2 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OAuth2")
            .field("token_url", &self.token_url.as_str())
            .field("client_id", &self.client_id)
            .field("secret", &self.secret)
            .field("scopes", &self.scopes)
            .field("audience", &self.audience)
            .finish_non_exhaustive()
    }
}

impl OAuth2 {
    /// Client credentials with an empty cache.
    pub fn new(
        token_url: Url,
        client_id: String,
        secret: SecretSource,
        scopes: Vec<String>,
        audience: Option<String>,
    ) -> OAuth2 {
        OAuth2 { token_url, client_id, secret, scopes, audience, cache: Mutex::new(None) }
    }

    /// The cached token, or a new one when none is cached or it is due for refresh.
    pub async fn bearer(&self, client: &reqwest::Client) -> Result<HeaderValue, HandlerError> {
        let mut cache = self.cache.lock().await;
        if let Some(token) = cache.as_ref().filter(|t| t.refresh_at.is_none_or(|at| Instant::now() < at)) {
            return Ok(token.header.clone());
        }
        let token = self.fetch(client).await?;
        *cache = Some(token.clone());
        Ok(token.header)
    }

    /// A token other than `refused`, which the receiver answered 401 to: a new one, unless
    /// another call has fetched one since.
    pub async fn refresh(&self, client: &reqwest::Client, refused: &HeaderValue) -> Result<HeaderValue, HandlerError> {
        let mut cache = self.cache.lock().await;
        if let Some(token) = cache.as_ref().filter(|t| t.header != refused) {
            return Ok(token.header.clone());
        }
        *cache = None;
        let token = self.fetch(client).await?;
        *cache = Some(token.clone());
        Ok(token.header)
    }

    /// The form a client-credentials request sends (the secret in the body, as
    /// `client_secret_post`).
    fn form(&self, secret: &str) -> String {
        let mut pairs = vec![
            ("grant_type", "client_credentials".to_string()),
            ("client_id", self.client_id.clone()),
            ("client_secret", secret.to_string()),
        ];
        if !self.scopes.is_empty() {
            pairs.push(("scope", self.scopes.join(" ")));
        }
        if let Some(audience) = &self.audience {
            pairs.push(("audience", audience.clone()));
        }
        pairs
            .iter()
            .map(|(k, v)| format!("{k}={}", utf8_percent_encode(v, NON_ALPHANUMERIC)))
            .collect::<Vec<_>>()
            .join("&")
    }

    async fn fetch(&self, client: &reqwest::Client) -> Result<Token, HandlerError> {
        let unwell = |what: String| HandlerError::unwell(format!("OAuth2 token endpoint: {what}"), None);
        let secret = self.secret.read().map_err(unwell)?;
        let sent = Instant::now();
        let response = client
            .post(self.token_url.clone())
            .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(reqwest::header::ACCEPT, "application/json")
            .body(self.form(&secret))
            .send()
            .await
            .map_err(|e| unwell(send_error(&e).to_string()))?;
        let status = response.status();
        let mut body = Vec::new();
        let mut response = response;
        read_bounded(&mut response, &mut body, MAX_TOKEN_RESPONSE_BYTES).await;
        if !status.is_success() {
            return Err(unwell(with_excerpt(format!("HTTP {}", status.as_u16()), &body)));
        }
        let answer: TokenResponse = serde_json::from_slice(&body)
            .map_err(|_| unwell(format!("HTTP {}: the answer is not a token response", status.as_u16())))?;
        if !answer.token_type.eq_ignore_ascii_case("bearer") {
            return Err(unwell(format!("token_type \"{}\" is not Bearer", answer.token_type)));
        }
        let mut header = HeaderValue::try_from(format!("Bearer {}", answer.access_token))
            .map_err(|_| unwell("the access token is not a valid header value".into()))?;
        header.set_sensitive(true);
        Ok(Token { header, refresh_at: answer.expires_in.map(|s| sent + refresh_after(Duration::from_secs(s))) })
    }
}

/// How long after it was requested a token of `lifetime` is fetched again.
fn refresh_after(lifetime: Duration) -> Duration {
    lifetime - REFRESH_EARLY.min(lifetime / 10)
}

fn with_excerpt(prefix: String, body: &[u8]) -> String {
    super::with_excerpt(prefix, head_excerpt(body))
}

/// What a token endpoint answers (RFC 6749 §5.1); other fields are ignored.
#[derive(serde::Deserialize)]
struct TokenResponse {
    access_token: String,
    token_type: String,
    expires_in: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_refreshed_a_tenth_of_their_life_early_at_most_a_minute() {
        let s = Duration::from_secs;
        let cases = [
            (s(3600), s(3540)),
            (s(600), s(540)),
            (s(300), s(270)),
            (s(10), s(9)),
            (s(1), Duration::from_millis(900)),
            (s(0), s(0)),
        ];
        for (lifetime, after) in cases {
            assert_eq!(refresh_after(lifetime), after, "lifetime {lifetime:?}");
        }
    }

    #[test]
    fn the_form_encodes_every_value() {
        let oauth2 = OAuth2::new(
            "https://idp.example/token".parse().expect("url"),
            "svc a".into(),
            SecretSource::Env("X".into()),
            vec!["read:orders".into(), "write".into()],
            Some("https://api.example/".into()),
        );
        assert_eq!(
            oauth2.form("p&ss=word"),
            "grant_type=client%5Fcredentials&client_id=svc%20a&client_secret=p%26ss%3Dword\
             &scope=read%3Aorders%20write&audience=https%3A%2F%2Fapi%2Eexample%2F"
        );
    }

    #[test]
    fn debug_shows_where_the_secret_is_never_a_token() {
        let oauth2 = OAuth2::new(
            "https://idp.example/token".parse().expect("url"),
            "svc".into(),
            SecretSource::Env("IDP_SECRET".into()),
            Vec::new(),
            None,
        );
        let shown = format!("{oauth2:?}");
        assert!(shown.contains("IDP_SECRET") && !shown.contains("cache"), "{shown}");
    }
}
