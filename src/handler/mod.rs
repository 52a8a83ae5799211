//! Handlers: executing one already-rendered request — an HTTP call ([`webhook`]) or a
//! subprocess ([`command`]) — and classifying how it ended as success, transient or
//! permanent failure.
//!
//! Templates are compiled at validate time ([`template`]) and rendered per message into a
//! ready call ([`crate::call`], above this module: it reads the config); [`webhook`] and [`command`] execute such calls and know nothing of
//! config, envelopes or brokers. A call carries the queue's [`rules`] (`on_status`,
//! `on_exit`), which override the default classification. The runtime turns the [`HandlerError`] class into a
//! disposition. Error texts end up in logs and DLQ headers, so they stay short and never
//! carry secrets.

pub mod auth;
pub mod command;
mod http;
pub mod rules;
pub mod template;
pub mod webhook;

use std::time::Duration;

/// A handler run that did not succeed, classified so the runtime knows whether to retry.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HandlerError {
    /// Worth retrying after backoff; `retry_after` is the server's own hint (Retry-After), if any.
    #[error("{error}")]
    Transient {
        /// What went wrong, short enough for a log field or a DLQ header.
        error: String,
        /// The earliest the server wants to hear from us again.
        retry_after: Option<Duration>,
        /// The failure says the receiver itself is unwell (no connection, a timeout, 429, 502,
        /// 503, 504) rather than that this one message failed: what the circuit breaker and
        /// adaptive concurrency count.
        unwell: bool,
    },
    /// Retrying cannot help: dead-letter at once.
    #[error("{error}")]
    Permanent {
        /// What went wrong, short enough for a log field or a DLQ header.
        error: String,
    },
}

impl HandlerError {
    /// A transient failure of this call alone, without a server hint.
    pub fn transient(error: impl Into<String>) -> Self {
        Self::Transient { error: error.into(), retry_after: None, unwell: false }
    }

    /// A transient failure that says the receiver is unwell.
    pub fn unwell(error: impl Into<String>, retry_after: Option<Duration>) -> Self {
        Self::Transient { error: error.into(), retry_after, unwell: true }
    }

    /// The same failure, saying whether the receiver is unwell (a transient one only: a
    /// failure dead-lettered at once, by a rule or by its class, feeds no breaker).
    pub fn with_unwell(self, unwell: bool) -> Self {
        match self {
            Self::Transient { error, retry_after, .. } => Self::Transient { error, retry_after, unwell },
            permanent => permanent,
        }
    }

    /// Whether the failure says the receiver is unwell.
    pub fn is_unwell(&self) -> bool {
        matches!(self, Self::Transient { unwell: true, .. })
    }

    /// A permanent failure.
    pub fn permanent(error: impl Into<String>) -> Self {
        Self::Permanent { error: error.into() }
    }

    /// The handler did not finish within `timeout`: always worth another try.
    pub fn timeout(timeout: Duration) -> Self {
        // Debug prints durations as written in config: `60s`, `250ms`, `1.5s`.
        Self::unwell(format!("timeout after {timeout:?}"), None)
    }
}

/// What a handler run showed beside its verdict, for the console's attempts: the response's
/// status or the exit code, and the start of the response body or of the stderr captured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    pub http_status: Option<u16>,
    pub exit_code: Option<i32>,
    /// At most [`Observed::BYTES`].
    pub excerpt: Vec<u8>,
}

impl Observed {
    /// Bytes of a response body or of stderr kept.
    pub const BYTES: usize = 1024;

    fn keep(&mut self, bytes: &[u8]) {
        self.excerpt = bytes[..bytes.len().min(Self::BYTES)].to_vec();
    }
}

/// How many bytes of a response body or stderr an error text quotes.
const EXCERPT_BYTES: usize = 200;

/// The start of `bytes` as one short line, for quoting a response body in an error.
fn head_excerpt(bytes: &[u8]) -> String {
    let text = collapse_whitespace(&String::from_utf8_lossy(bytes));
    if text.len() <= EXCERPT_BYTES {
        return text;
    }
    format!("{}…", &text[..text.floor_char_boundary(EXCERPT_BYTES)])
}

/// The end of `bytes` as one short line, for quoting stderr in an error: the last lines
/// of a failing program are the ones that say why.
fn tail_excerpt(bytes: &[u8]) -> String {
    let text = collapse_whitespace(&String::from_utf8_lossy(bytes));
    if text.len() <= EXCERPT_BYTES {
        return text;
    }
    format!("…{}", &text[text.ceil_char_boundary(text.len() - EXCERPT_BYTES)..])
}

/// Error texts travel in single-line places (log fields, AMQP headers).
fn collapse_whitespace(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `"{prefix}: {excerpt}"`, or just the prefix when there is nothing to quote.
fn with_excerpt(prefix: String, excerpt: String) -> String {
    if excerpt.is_empty() { prefix } else { format!("{prefix}: {excerpt}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excerpts_are_short_single_lines() {
        let long = "é".repeat(300);
        let head_cases: [(&[u8], String); 4] = [
            (b"", String::new()),
            (b"  bad\n\tinput \r\n", "bad input".into()),
            (b"\xffok", "\u{fffd}ok".into()),
            (long.as_bytes(), format!("{}…", "é".repeat(100))),
        ];
        for (input, expected) in head_cases {
            assert_eq!(head_excerpt(input), expected, "input {input:?}");
        }
        let tail_cases: [(&[u8], String); 3] = [
            (b"", String::new()),
            (b"line 1\nline 2\n", "line 1 line 2".into()),
            (long.as_bytes(), format!("…{}", "é".repeat(100))),
        ];
        for (input, expected) in tail_cases {
            assert_eq!(tail_excerpt(input), expected, "input {input:?}");
        }
    }

    #[test]
    fn tail_excerpt_keeps_the_last_words() {
        let stderr = format!("{}\nfatal: disk full\n", "noise ".repeat(100));
        let excerpt = tail_excerpt(stderr.as_bytes());
        assert!(excerpt.ends_with("fatal: disk full"), "{excerpt}");
        assert!(excerpt.len() <= EXCERPT_BYTES + '…'.len_utf8());
    }

    #[test]
    fn timeout_text_reads_like_config_durations() {
        let cases = [
            (Duration::from_secs(10), "timeout after 10s"),
            (Duration::from_secs(60), "timeout after 60s"),
            (Duration::from_millis(250), "timeout after 250ms"),
            (Duration::from_millis(1500), "timeout after 1.5s"),
        ];
        for (timeout, expected) in cases {
            assert_eq!(HandlerError::timeout(timeout).to_string(), expected);
        }
    }
}
