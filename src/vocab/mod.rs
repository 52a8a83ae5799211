//! The words the pipeline files and the brokers share, on a floor below both: exchange and queue
//! kinds, durations as written, the largest body any broker takes, "did you mean", what a
//! broker can honour ([`capabilities::Capabilities`]) and the message formats
//! ([`format::Format`]). `config` reads them out of files (and
//! re-exports them for its users), `broker` speaks them; neither imports the other for them.
//!
//! Nothing here reads a file, knows a pipeline or talks to a broker.

pub mod capabilities;
pub mod format;
pub mod suggest;

use std::time::Duration;

/// AMQP exchange types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExchangeKind {
    Direct,
    Fanout,
    Topic,
    Headers,
}

impl ExchangeKind {
    pub const ALL: &[ExchangeKind] =
        &[ExchangeKind::Direct, ExchangeKind::Fanout, ExchangeKind::Topic, ExchangeKind::Headers];

    /// The AMQP name of the type.
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Headers => "headers",
        }
    }

    /// The type of an exchange every RabbitMQ broker has, which queues may bind to without
    /// declaring it (`amq.topic`, ...); `None` for any other name.
    pub fn builtin(name: &str) -> Option<ExchangeKind> {
        Some(match name {
            "amq.direct" => ExchangeKind::Direct,
            "amq.fanout" => ExchangeKind::Fanout,
            "amq.topic" => ExchangeKind::Topic,
            "amq.headers" | "amq.match" => ExchangeKind::Headers,
            _ => return None,
        })
    }
}

/// Quorum (replicated, the default) or classic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueKind {
    Quorum,
    Classic,
}

impl QueueKind {
    pub const ALL: &[QueueKind] = &[QueueKind::Quorum, QueueKind::Classic];
}

/// RabbitMQ refuses messages over 512 MiB whatever it is configured to.
pub const MAX_MESSAGE_BYTES: usize = 512 << 20;

/// Why `text` is not a duration, in words: the usual form, and what to write instead where
/// that can be told (`7d` is `168h`, `1.5s` is `1500ms`, `0s` is no timeout at all).
pub fn duration_problem(text: &str) -> String {
    let usual = format!("\"{text}\" is not a duration such as 250ms, 10s, 5m or 24h");
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: Option<u64> = digits.parse().ok();
    let hint = match (n, unit) {
        (Some(0), "ms" | "s" | "m" | "h") => "; a duration must be positive".to_string(),
        (Some(n), "d" | "day" | "days") => format!("; days are not a unit: use {}h", n.saturating_mul(24)),
        (Some(n), "w" | "week" | "weeks") => format!("; weeks are not a unit: use {}h", n.saturating_mul(168)),
        (Some(n), "") => format!("; it needs a unit, as in {n}s or {n}ms"),
        (Some(_), u) if u.starts_with('.') => {
            let ms = text.trim_end_matches(|c: char| c.is_ascii_alphabetic()).parse::<f64>().ok().and_then(|v| {
                let scale = match text.trim_start_matches(|c: char| c.is_ascii_digit() || c == '.') {
                    "s" => 1e3,
                    "m" => 6e4,
                    "h" => 3.6e6,
                    _ => return None,
                };
                Some(v * scale)
            });
            match ms {
                Some(ms) if ms.fract() == 0.0 => format!("; fractions are not allowed: use {ms}ms"),
                _ => "; fractions are not allowed".to_string(),
            }
        }
        _ => String::new(),
    };
    usual + &hint
}

/// Parses a duration such as `250ms`, `10s`, `5m` or `24h`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = text.split_at(split);
    let n: u64 = n.parse().ok()?;
    let secs = match unit {
        "ms" => return Some(Duration::from_millis(n)),
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return None,
    };
    Some(Duration::from_secs(n.checked_mul(secs)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let cases = [
            ("250ms", Some(Duration::from_millis(250))),
            ("10s", Some(Duration::from_secs(10))),
            ("5m", Some(Duration::from_secs(300))),
            ("24h", Some(Duration::from_secs(86400))),
            ("10", None),
            ("s", None),
            ("1w", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_duration(text), want, "{text}");
        }
    }

    #[test]
    fn duration_problems_say_what_to_write() {
        let cases = [
            ("7d", "\"7d\" is not a duration such as 250ms, 10s, 5m or 24h; days are not a unit: use 168h"),
            ("2w", "\"2w\" is not a duration such as 250ms, 10s, 5m or 24h; weeks are not a unit: use 336h"),
            ("0s", "\"0s\" is not a duration such as 250ms, 10s, 5m or 24h; a duration must be positive"),
            ("30", "\"30\" is not a duration such as 250ms, 10s, 5m or 24h; it needs a unit, as in 30s or 30ms"),
            ("1.5s", "\"1.5s\" is not a duration such as 250ms, 10s, 5m or 24h; fractions are not allowed: use 1500ms"),
            (
                "0.5m",
                "\"0.5m\" is not a duration such as 250ms, 10s, 5m or 24h; fractions are not allowed: use 30000ms",
            ),
            ("1.0001ms", "\"1.0001ms\" is not a duration such as 250ms, 10s, 5m or 24h; fractions are not allowed"),
            ("soon", "\"soon\" is not a duration such as 250ms, 10s, 5m or 24h"),
        ];
        for (text, want) in cases {
            assert_eq!(duration_problem(text), want, "{text}");
        }
    }
}
