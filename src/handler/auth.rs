//! Outbound authentication of webhooks: OAuth 2.0 client-credentials tokens (RFC 6749 §4.4),
//! fetched when first needed, cached until shortly before they expire, shared by every call of
//! the queue (calls that wait for one fetch all use its token), and fetched again once when
//! the receiver answers 401.
//!
//! A token endpoint that cannot give a token says nothing about the message: its failures are
//! transient and say "receiver unwell" (the circuit breaker counts them), never a dead letter.
//! What it answers is outside input: `expires_in` is read leniently (a number, whole or not, or
//! a string holding one) and clamped, so no answer can make the clock arithmetic panic.
//! Neither the client secret nor a token ever reaches an error text, a log line or `Debug`.

use std::path::PathBuf;
use std::time::Duration;

use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::Url;
use reqwest::header::{CONTENT_TYPE, HeaderValue};
use serde_json::value::RawValue;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::http::{read_bounded, send_error};
use super::{HandlerError, head_excerpt};

/// The most of a token endpoint's answer ever read: room for large JWTs (one carrying many
/// group or role claims runs past 64 KiB).
const MAX_TOKEN_RESPONSE_BYTES: usize = 1024 * 1024;

/// The longest lifetime a token is taken to have: a longer `expires_in` (2^63 − 1 seconds
/// overflowed the clock) is this, so a token is fetched again at least daily.
const MAX_LIFETIME: Duration = Duration::from_secs(24 * 3600);

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
    /// When it arrived.
    received: Instant,
}

impl Token {
    /// Whether a call that asked for a token at `asked` takes this one: while it is not due
    /// for refresh, or when it arrived after the call asked. A token of no lifetime left
    /// (`expires_in: 0`) still serves the calls that waited for its fetch: concurrent calls
    /// fetch once, not once each in turn.
    fn serves(&self, asked: Instant) -> bool {
        self.received >= asked || self.refresh_at.is_none_or(|at| Instant::now() < at)
    }
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
        let asked = Instant::now();
        let mut cache = self.cache.lock().await;
        if let Some(token) = cache.as_ref().filter(|t| t.serves(asked)) {
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
        // One byte past the limit tells an answer that is too long from one that fits exactly.
        read_bounded(&mut response, &mut body, MAX_TOKEN_RESPONSE_BYTES + 1).await;
        if !status.is_success() {
            return Err(unwell(with_excerpt(format!("HTTP {}", status.as_u16()), &body)));
        }
        if body.len() > MAX_TOKEN_RESPONSE_BYTES {
            return Err(unwell(format!("HTTP {}: the answer is over 1 MiB, longer than any token", status.as_u16())));
        }
        let answer: TokenResponse = serde_json::from_slice(&body)
            .map_err(|_| unwell(format!("HTTP {}: the answer is not a token response", status.as_u16())))?;
        if !answer.token_type.eq_ignore_ascii_case("bearer") {
            return Err(unwell(format!("token_type \"{}\" is not Bearer", answer.token_type)));
        }
        let lifetime = answer.expires_in.as_deref().map(|raw| lifetime(raw.get())).transpose().map_err(unwell)?;
        let mut header = HeaderValue::try_from(format!("Bearer {}", answer.access_token))
            .map_err(|_| unwell("the access token is not a valid header value".into()))?;
        header.set_sensitive(true);
        // `lifetime` is at most a day: the sum cannot overflow.
        let refresh_at = lifetime.map(|lifetime| sent + refresh_after(lifetime));
        Ok(Token { header, refresh_at, received: Instant::now() })
    }
}

/// A token's lifetime from `expires_in` as the endpoint wrote it (`raw` JSON): seconds as a
/// number, whole or not, or a string holding one (Azure AD v1 sends `"3600"`). A negative one
/// is no time left; one past [`MAX_LIFETIME`] (`1e400` included) is that.
fn lifetime(raw: &str) -> Result<Duration, String> {
    let text = serde_json::from_str::<String>(raw).unwrap_or_else(|_| raw.to_string());
    let seconds = text
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|s| !s.is_nan())
        .ok_or_else(|| format!("expires_in {} is not a number of seconds", head_excerpt(raw.as_bytes())))?;
    Ok(Duration::from_secs_f64(seconds.clamp(0.0, MAX_LIFETIME.as_secs_f64())))
}

/// How long after it was requested a token of `lifetime` is fetched again.
fn refresh_after(lifetime: Duration) -> Duration {
    lifetime - REFRESH_EARLY.min(lifetime / 10)
}

fn with_excerpt(prefix: String, body: &[u8]) -> String {
    super::with_excerpt(prefix, head_excerpt(body))
}

/// What a token endpoint answers (RFC 6749 §5.1); other fields are ignored. `expires_in` is
/// kept as written: a number too large for a float (`1e400`) would fail the whole answer.
#[derive(serde::Deserialize)]
struct TokenResponse {
    access_token: String,
    token_type: String,
    expires_in: Option<Box<RawValue>>,
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

    /// Issue 31 items 5 and 15: `expires_in` as endpoints write it, clamped to a day; what is
    /// no number is said so, quoted.
    #[test]
    fn expires_in_is_read_leniently_and_clamped() {
        let s = Duration::from_secs;
        let cases: [(&str, Result<Duration, &str>); 14] = [
            ("3600", Ok(s(3600))),
            ("\"3600\"", Ok(s(3600))),
            ("\" 3600 \"", Ok(s(3600))),
            ("3599.5", Ok(Duration::from_millis(3_599_500))),
            ("\"1.5\"", Ok(Duration::from_millis(1500))),
            ("0", Ok(Duration::ZERO)),
            ("-5", Ok(Duration::ZERO)),
            ("9223372036854775807", Ok(MAX_LIFETIME)),
            ("18446744073709551616", Ok(MAX_LIFETIME)),
            ("1e400", Ok(MAX_LIFETIME)),
            ("-1e400", Ok(Duration::ZERO)),
            ("\"soon\"", Err("expires_in \"soon\" is not a number of seconds")),
            ("true", Err("expires_in true is not a number of seconds")),
            ("\"NaN\"", Err("expires_in \"NaN\" is not a number of seconds")),
        ];
        for (raw, expected) in cases {
            assert_eq!(lifetime(raw), expected.map_err(str::to_string), "{raw}");
        }
        let answer: TokenResponse =
            serde_json::from_str(r#"{"access_token":"t","token_type":"Bearer","expires_in":1e400}"#).expect("parses");
        assert_eq!(answer.expires_in.map(|raw| lifetime(raw.get())), Some(Ok(MAX_LIFETIME)));
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
