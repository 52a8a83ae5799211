//! The message envelope: the JSON body every sluice message carries, and the AMQP headers
//! sluice reads and writes (their names, the attempt a delivery is on, and what a dead-letter
//! copy adds).
//!
//! Decoding is strict about what sluice needs (id, type, payload) and ignores unknown fields,
//! so producers can add fields without breaking older runners.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime};

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

/// Attempt number of a delivery, 1-based.
pub const ATTEMPT_HEADER: &str = "x-sluice-attempt";
/// When a delayed copy is due, in milliseconds since the epoch: set on a copy whose delay is
/// longer than the broker holds one (served in hops), read on its arrival.
pub const DUE_HEADER: &str = "x-sluice-due";
/// W3C trace context, carried across the async hop.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// Dead-letter headers.
pub const REASON_HEADER: &str = "x-sluice-reason";
pub const ERROR_HEADER: &str = "x-sluice-error";
pub const ATTEMPTS_HEADER: &str = "x-sluice-attempts";
pub const FAILED_AT_HEADER: &str = "x-sluice-failed-at";
pub const SOURCE_QUEUE_HEADER: &str = "x-sluice-source-queue";
/// What a dead-letter copy adds, and a redrive takes away.
pub const FAILURE_HEADERS: [&str; 5] =
    [REASON_HEADER, ERROR_HEADER, ATTEMPTS_HEADER, FAILED_AT_HEADER, SOURCE_QUEUE_HEADER];

/// Header values sluice reads and writes (AMQP's types, as every broker carries them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderValue {
    Str(String),
    Int(i64),
}

impl HeaderValue {
    /// The value as text, whatever its type.
    pub fn to_text(&self) -> String {
        match self {
            HeaderValue::Str(s) => s.clone(),
            HeaderValue::Int(i) => i.to_string(),
        }
    }

    /// The value as JSON, for showing a message to a person.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            HeaderValue::Str(s) => serde_json::Value::from(s.as_str()),
            HeaderValue::Int(i) => serde_json::Value::from(*i),
        }
    }
}

/// Headers to set on a message (merged over the original's on a copy).
pub type Headers = BTreeMap<String, HeaderValue>;

/// Error texts in headers are kept short.
const MAX_ERROR_HEADER: usize = 1000;

/// Why a message was dead-lettered (the `x-sluice-reason` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Permanent,
    Exhausted,
    Malformed,
    Schema,
    Template,
    /// The webhook could not be signed (its secret unset or malformed).
    Signing,
    TooLarge,
    Internal,
}

impl Reason {
    /// The header value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Permanent => "permanent",
            Reason::Exhausted => "exhausted",
            Reason::Malformed => "malformed",
            Reason::Schema => "schema",
            Reason::Template => "template",
            Reason::Signing => "signing",
            Reason::TooLarge => "too_large",
            Reason::Internal => "internal",
        }
    }
}

/// The attempt number an attempt header says (1 when absent or nonsense).
pub fn attempt_in(header: Option<&HeaderValue>) -> u32 {
    match header {
        Some(HeaderValue::Int(n)) if *n >= 1 => u32::try_from(*n).unwrap_or(u32::MAX),
        Some(HeaderValue::Str(s)) => s.parse().ok().filter(|n| *n >= 1).unwrap_or(1),
        _ => 1,
    }
}

/// The due-time header of a copy due at `now` + `after`; none when that time cannot be said
/// (a delay past the clock's range).
pub fn due_header(now: SystemTime, after: Duration) -> Option<(String, HeaderValue)> {
    let due = now.checked_add(after)?.duration_since(SystemTime::UNIX_EPOCH).ok()?;
    Some((DUE_HEADER.to_string(), HeaderValue::Int(i64::try_from(due.as_millis()).ok()?)))
}

/// How long until a copy carrying `header` ([`DUE_HEADER`]) is due, when that is still ahead
/// of `now`.
pub fn due_in(header: Option<&HeaderValue>, now: SystemTime) -> Option<Duration> {
    let ms = match header? {
        HeaderValue::Int(n) => u64::try_from(*n).ok()?,
        HeaderValue::Str(s) => s.parse().ok()?,
    };
    let due = SystemTime::UNIX_EPOCH.checked_add(Duration::from_millis(ms))?;
    due.duration_since(now).ok().filter(|left| !left.is_zero())
}

/// The headers a dead-letter copy adds: why, after how many attempts, when, and from which queue.
pub fn dead_letter_headers(reason: Reason, error: &str, attempts: u32, queue: &str) -> Headers {
    let error: String = error.chars().take(MAX_ERROR_HEADER).collect();
    let failed_at = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    Headers::from([
        (REASON_HEADER.to_string(), HeaderValue::Str(reason.as_str().into())),
        (ERROR_HEADER.to_string(), HeaderValue::Str(error)),
        (ATTEMPTS_HEADER.to_string(), HeaderValue::Int(i64::from(attempts))),
        (FAILED_AT_HEADER.to_string(), HeaderValue::Str(failed_at)),
        (SOURCE_QUEUE_HEADER.to_string(), HeaderValue::Str(queue.to_string())),
    ])
}

/// A message body: decoded, it borrows the payload from the delivery's bytes, so an in-flight
/// message is held once.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope<'a> {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default = "default_version")]
    pub version: u32,
    #[serde(default)]
    pub occurred_at: Option<String>,
    /// Defaults to `id` when the producer sets none, or an empty or blank one.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Not handled before this time (RFC 3339); a time past is now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<Timestamp>,
    /// As the producer sent it (checked to be JSON that parses into a value): most handlers
    /// pass it on untouched, so it is parsed only when a schema or template reads it.
    #[serde(borrow, deserialize_with = "borrowed_raw")]
    pub payload: Cow<'a, RawValue>,
}

/// A point in time written as RFC 3339 (`2026-12-24T18:00:00Z`, `2026-12-24T19:00:00.250+01:00`),
/// held between the epoch and the end of year 9999: a time before 1970 is past, as the epoch
/// is, so nothing is lost by holding it as the epoch, and both ends can always be written out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timestamp(pub SystemTime);

/// The last instant RFC 3339 writes: 9999-12-31T23:59:59.999999999Z.
const LATEST_SECONDS: u64 = 253_402_300_799;

impl Timestamp {
    /// Parses RFC 3339: a date (years 0000 to 9999), `T`, a time with optional fraction (a leap
    /// second, `:60`, is taken as `:59`), and `Z` or an offset `+HH:MM`/`-HH:MM`; `t` and `z`
    /// in either case. Outside the epoch to the end of 9999 it is held at the nearer end.
    pub fn parse(text: &str) -> Option<Timestamp> {
        let upper = text.to_ascii_uppercase();
        let (local, offset) = match upper.strip_suffix('Z') {
            Some(local) => (local, 0),
            None => {
                let (local, offset) = upper.split_at_checked(upper.len().checked_sub(6)?)?;
                (local, offset_seconds(offset)?)
            }
        };
        let (seconds, nanos) = local_seconds(local)?;
        // The local time is ahead of UTC by a positive offset.
        Some(Timestamp::held(seconds - offset, nanos))
    }

    /// `delay` after `now`, held as [`Timestamp::parse`] holds a time.
    pub fn after(now: SystemTime, delay: Duration) -> Timestamp {
        Timestamp(Timestamp::hold(now.checked_add(delay).unwrap_or(SystemTime::UNIX_EPOCH + Timestamp::latest())))
    }

    /// `seconds` (before the epoch when negative) and `nanos` after the epoch, held between the
    /// epoch and the end of 9999.
    fn held(seconds: i64, nanos: u32) -> Timestamp {
        let since_epoch = u64::try_from(seconds).map_or(Duration::ZERO, |s| Duration::new(s, nanos));
        Timestamp(SystemTime::UNIX_EPOCH + since_epoch.min(Timestamp::latest()))
    }

    fn latest() -> Duration {
        Duration::new(LATEST_SECONDS, 999_999_999)
    }

    /// `at` between the epoch and the end of 9999.
    fn hold(at: SystemTime) -> SystemTime {
        let since_epoch = at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        SystemTime::UNIX_EPOCH + since_epoch.min(Timestamp::latest())
    }
}

/// The seconds an offset `+HH:MM` or `-HH:MM` puts local time ahead of UTC.
fn offset_seconds(offset: &str) -> Option<i64> {
    let (sign, hhmm) = offset.split_at_checked(1)?;
    let (hours, minutes) = hhmm.split_once(':')?;
    let (hours, minutes) = (digits(hours)?, digits(minutes)?);
    if hours > 23 || minutes > 59 || hhmm.len() != 5 {
        return None;
    }
    let seconds = hours * 3600 + minutes * 60;
    match sign {
        "+" => Some(seconds),
        "-" => Some(-seconds),
        _ => None,
    }
}

/// `YYYY-MM-DDTHH:MM:SS[.fraction]` as seconds from the epoch (negative before it) and the
/// fraction's nanoseconds (digits past the ninth ignored).
fn local_seconds(local: &str) -> Option<(i64, u32)> {
    let (date, time) = local.split_once('T')?;
    let mut date = date.split('-');
    let (year, month, day) = (date.next()?, date.next()?, date.next()?);
    if date.next().is_some() || year.len() != 4 || month.len() != 2 || day.len() != 2 {
        return None;
    }
    let (year, month, day) = (digits(year)?, digits(month)?, digits(day)?);
    let (clock, fraction) = match time.split_once('.') {
        Some((clock, fraction)) => (clock, Some(fraction)),
        None => (time, None),
    };
    let mut clock = clock.split(':');
    let (hour, minute, second) = (clock.next()?, clock.next()?, clock.next()?);
    if clock.next().is_some() || [hour, minute, second].iter().any(|part| part.len() != 2) {
        return None;
    }
    let (hour, minute, second) = (digits(hour)?, digits(minute)?, digits(second)?);
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days_in_month = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return None,
    };
    if day == 0 || day > days_in_month || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let nanos = match fraction {
        None => 0,
        Some(f) if !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()) => {
            let nine: String = f.chars().chain(std::iter::repeat('0')).take(9).collect();
            nine.parse().ok()?
        }
        Some(_) => return None,
    };
    let days = days_from_civil(year, month, day);
    Some((days * 86_400 + hour * 3600 + minute * 60 + second.min(59), nanos))
}

/// A number written in ASCII digits only (no sign, no spaces), small enough for any date part.
fn digits(text: &str) -> Option<i64> {
    if text.is_empty() || text.len() > 4 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar (negative before it);
/// Howard Hinnant's `days_from_civil`.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// `seconds` since the epoch as RFC 3339 to the second (`2026-12-24T18:00:00Z`): a time read
/// from a header may be anything, and past the end of 9999 it is shown as that end.
pub fn rfc3339_seconds(seconds: u64) -> String {
    let at = SystemTime::UNIX_EPOCH + Duration::from_secs(seconds.min(LATEST_SECONDS));
    humantime::format_rfc3339_seconds(at).to_string()
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        // Held again: the field is public, and humantime panics before 1970 and fails after 9999.
        write!(f, "{}", humantime::format_rfc3339_millis(Timestamp::hold(self.0)))
    }
}

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <Cow<'de, str>>::deserialize(d)?;
        Timestamp::parse(&text).ok_or_else(|| {
            de::Error::custom(format_args!("{text:?} is not an RFC 3339 time such as 2026-12-24T18:00:00Z"))
        })
    }
}

fn borrowed_raw<'de, D: Deserializer<'de>>(d: D) -> Result<Cow<'de, RawValue>, D::Error> {
    <&'de RawValue>::deserialize(d).map(Cow::Borrowed)
}

/// Walks a JSON document the way parsing it into a [`Value`] would, without building it: a
/// number out of range (`1e400`) or nesting past serde_json's limit fails here, at decode,
/// rather than later wherever the payload is first parsed.
struct Parses;

impl<'de> Deserialize<'de> for Parses {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Parses)
    }
}

impl<'de> Visitor<'de> for Parses {
    type Value = Parses;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Parses, E> {
        Ok(Parses)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Parses, E> {
        Ok(Parses)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Parses, E> {
        Ok(Parses)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Parses, E> {
        Ok(Parses)
    }

    fn visit_str<E>(self, _: &str) -> Result<Parses, E> {
        Ok(Parses)
    }

    fn visit_unit<E>(self) -> Result<Parses, E> {
        Ok(Parses)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Parses, A::Error> {
        while seq.next_element::<Parses>()?.is_some() {}
        Ok(Parses)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Parses, A::Error> {
        while map.next_entry::<IgnoredAny, Parses>()?.is_some() {}
        Ok(Parses)
    }
}

/// `text` as a borrowed JSON document, when it parses into a value ([`Parses`]): what every
/// format with a JSON payload checks of it at decode.
pub fn json_document(text: &[u8]) -> Result<&RawValue, serde_json::Error> {
    serde_json::from_slice::<Parses>(text)?;
    serde_json::from_slice(text)
}

/// Whether an idempotency key (or id) is empty or only white space: no key at all.
pub fn is_blank(key: &str) -> bool {
    key.trim().is_empty()
}

fn default_version() -> u32 {
    1
}

/// Why a body is not an envelope.
#[derive(Debug, thiserror::Error)]
#[error("not a sluice envelope: {0}")]
pub struct Malformed(#[from] serde_json::Error);

impl Envelope<'_> {
    /// A new envelope with a fresh time-ordered id, stamped now.
    pub fn new(kind: &str, payload: &Value, idempotency_key: Option<String>) -> Envelope<'static> {
        let id = uuid::Uuid::now_v7().to_string();
        // A JSON value always serializes.
        let payload = serde_json::value::to_raw_value(payload).unwrap_or_default();
        Envelope {
            idempotency_key: Some(idempotency_key.unwrap_or_else(|| id.clone())),
            id,
            kind: kind.to_string(),
            version: 1,
            occurred_at: Some(humantime::format_rfc3339_seconds(SystemTime::now()).to_string()),
            not_before: None,
            payload: Cow::Owned(payload),
        }
    }

    /// Decodes a message body; the payload is borrowed from it.
    pub fn decode(body: &[u8]) -> Result<Envelope<'_>, Malformed> {
        let envelope: Envelope = serde_json::from_slice(body)?;
        // The id keys a message without its own key: a blank one would be shared by many.
        if is_blank(&envelope.id) {
            return Err(Malformed(de::Error::custom("\"id\" is empty or blank")));
        }
        serde_json::from_str::<Parses>(envelope.payload.get())
            .map_err(|e| Malformed(de::Error::custom(format_args!("payload: {e}"))))?;
        Ok(envelope)
    }

    /// How long until the message may be handled, when `not_before` is still ahead of `now`.
    pub fn due_in(&self, now: SystemTime) -> Option<Duration> {
        self.not_before?.0.duration_since(now).ok().filter(|left| !left.is_zero())
    }

    /// The payload as a JSON value.
    pub fn payload_value(&self) -> Result<Value, Malformed> {
        Ok(serde_json::from_str(self.payload.get())?)
    }

    /// The producer's idempotency key, or the id when it set none or a blank one: a blank key
    /// shared by many messages would make each a duplicate of the first.
    pub fn idempotency_key(&self) -> &str {
        self.idempotency_key.as_deref().filter(|key| !is_blank(key)).unwrap_or(&self.id)
    }

    /// The JSON body.
    pub fn encode(&self) -> Vec<u8> {
        // Sized for what it holds (its strings unescaped, and the field names): grown by
        // doubling, a large payload's body took up to twice its size, beside the payload.
        let strings = [Some(&self.id), Some(&self.kind), self.occurred_at.as_ref(), self.idempotency_key.as_ref()];
        let size = strings.iter().flatten().map(|s| s.len()).fold(self.payload.get().len(), usize::saturating_add);
        let mut body = Vec::with_capacity(size.saturating_add(160));
        // Serializing strings and a JSON value cannot fail.
        serde_json::to_writer(&mut body, self).map_or_else(|_| Vec::new(), |()| body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::time::UNIX_EPOCH;

    #[test]
    fn decode_cases() {
        let cases: &[(&str, bool)] = &[
            (r#"{"id":"1","type":"t","payload":{}}"#, true),
            (r#"{"id":"1","type":"t","payload":null,"extra":[1]}"#, true),
            (r#"{"id":"1","type":"t"}"#, false),
            (r#"{"id":"","type":"t","payload":1}"#, false),
            // Found by the envelope_decode fuzz target's checks: a blank id keyed a message
            // without its own key, and so every such message alike.
            (r#"{"id":" \t","type":"t","payload":1}"#, false),
            (r#"{"type":"t","payload":1}"#, false),
            ("not json", false),
            ("", false),
            // Issue 9: numbers out of range are malformed at decode, not a panic later.
            (r#"{"id":"1","type":"t","payload":{"n":1e400}}"#, false),
            (r#"{"id":"1","type":"t","payload":[-1e400]}"#, false),
            (r#"{"id":"1","type":"t","payload":{"n":1e300,"m":18446744073709551616}}"#, true),
        ];
        for (body, ok) in cases {
            assert_eq!(Envelope::decode(body.as_bytes()).is_ok(), *ok, "{body}");
        }
    }

    /// Issue 32 item 1: the due time of a hopping copy reads back as what is left of it; one
    /// past or unreadable is no wait (the copy is handled as it comes).
    #[test]
    fn a_due_time_reads_back_as_the_time_left() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let (name, header) = due_header(now, Duration::from_secs(3600)).expect("in range");
        assert_eq!(name, DUE_HEADER);
        assert_eq!(due_in(Some(&header), now), Some(Duration::from_secs(3600)));
        assert_eq!(due_in(Some(&header), now + Duration::from_secs(3600)), None, "due now");
        let text = HeaderValue::Str(header.to_text());
        assert_eq!(due_in(Some(&text), now + Duration::from_secs(600)), Some(Duration::from_secs(3000)));
        for odd in [HeaderValue::Int(-1), HeaderValue::Str("soon".into())] {
            assert_eq!(due_in(Some(&odd), now), None, "{odd:?}");
        }
        assert_eq!(due_in(None, now), None);
        assert_eq!(due_header(now, Duration::MAX), None, "past the clock's range");
    }

    /// Issue 24: `not_before` is RFC 3339, in UTC or with an offset; anything else makes the
    /// envelope malformed (a message must not run early because its time was misread).
    #[test]
    fn not_before_is_rfc_3339() {
        let at =
            |secs: u64, ms: u64| Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_millis(ms));
        let cases: &[(&str, Option<SystemTime>)] = &[
            ("1970-01-01T00:00:10Z", at(10, 0)),
            ("1970-01-01t00:00:10.250z", at(10, 250)),
            ("1970-01-01T01:00:10+01:00", at(10, 0)),
            ("1970-01-01T00:00:10-00:30", at(1810, 0)),
            ("2026-12-24T18:00:00Z", at(1_798_135_200, 0)),
            ("1970-01-01T00:00:10", None),
            ("1970-01-01 00:00:10Z", None),
            ("1970-01-01T00:00:10+1:00", None),
            ("1970-01-01T00:00:10+24:00", None),
            ("tomorrow", None),
            ("", None),
        ];
        for (text, expected) in cases {
            assert_eq!(Timestamp::parse(text).map(|t| t.0), *expected, "{text}");
            let body = format!(r#"{{"id":"1","type":"t","payload":1,"not_before":"{text}"}}"#);
            assert_eq!(Envelope::decode(body.as_bytes()).is_ok(), expected.is_some(), "{body}");
        }
        // Issue 31 item 16: every day RFC 3339 writes is a time, and one before 1970 (Go's zero
        // time included) is past, so now; one past the end of 9999 (by an offset) is that end.
        // Each is shown again without a panic.
        let latest = UNIX_EPOCH + Duration::new(253_402_300_799, 999_999_999);
        let wide: &[(&str, Option<SystemTime>)] = &[
            ("0001-01-01T00:00:00Z", Some(UNIX_EPOCH)),
            ("0000-01-01T00:00:00Z", Some(UNIX_EPOCH)),
            ("1969-12-31T23:59:59.999Z", Some(UNIX_EPOCH)),
            ("1970-01-01T00:30:00+01:00", Some(UNIX_EPOCH)),
            ("2024-02-29T00:00:00Z", at(1_709_164_800, 0)),
            ("2000-02-29T12:00:00Z", at(951_825_600, 0)),
            ("2026-12-24T18:00:59.123456789999Z", Some(UNIX_EPOCH + Duration::new(1_798_135_259, 123_456_789))),
            ("2016-12-31T23:59:60Z", at(1_483_228_799, 0)),
            ("9999-12-31T23:59:59Z", at(253_402_300_799, 0)),
            ("9999-12-31T23:59:59-23:59", Some(latest)),
            ("2023-02-29T00:00:00Z", None),
            ("1900-02-29T00:00:00Z", None),
            ("2026-13-01T00:00:00Z", None),
            ("2026-00-01T00:00:00Z", None),
            ("2026-04-31T00:00:00Z", None),
            ("2026-12-24T24:00:00Z", None),
            ("2026-12-24T18:60:00Z", None),
            ("2026-12-24T18:00:61Z", None),
            ("2026-12-24T18:00:00.Z", None),
            ("2026-12-24T18:00:00.1x2Z", None),
            ("-001-01-01T00:00:00Z", None),
            ("2026-12-24T18:00:00+01:60", None),
            ("2026-12-24T18:00:00é1:00", None),
            ("2026-12-24T18:00:00ZZ", None),
        ];
        for (text, expected) in wide {
            let parsed = Timestamp::parse(text);
            assert_eq!(parsed.map(|t| t.0), *expected, "{text}");
            if let Some(t) = parsed {
                assert!(t.to_string().ends_with('Z'), "{text} shows as {t}");
            }
        }
        let shown = |at: SystemTime| Timestamp(at).to_string();
        assert_eq!(shown(UNIX_EPOCH - Duration::from_secs(1)), "1970-01-01T00:00:00.000Z");
        assert_eq!(shown(latest + Duration::from_secs(86_400)), "9999-12-31T23:59:59.999Z");
        assert_eq!(Timestamp::after(UNIX_EPOCH, Duration::MAX).0, latest);
        assert_eq!(Timestamp::after(UNIX_EPOCH, Duration::from_secs(10)).0, UNIX_EPOCH + Duration::from_secs(10));

        // Issue 31 item 5: a header's time (`x-death`'s, a u64) past what a clock holds.
        assert_eq!(rfc3339_seconds(u64::MAX), "9999-12-31T23:59:59Z");
        assert_eq!(rfc3339_seconds(1_798_135_200), "2026-12-24T18:00:00Z");

        let body = br#"{"id":"1","type":"t","payload":1,"not_before":12}"#;
        assert!(Envelope::decode(body).is_err(), "a number is not a time");
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(100);
        let envelope = |not_before: &str| {
            Envelope::decode(format!(r#"{{"id":"1","type":"t","payload":1,"not_before":"{not_before}"}}"#).as_bytes())
                .map(|e| e.due_in(now))
                .expect("decodes")
        };
        assert_eq!(envelope("1970-01-01T00:01:42.5Z"), Some(Duration::from_millis(2500)));
        assert_eq!(envelope("1970-01-01T00:01:40Z"), None, "now is due");
        assert_eq!(envelope("1970-01-01T00:00:01Z"), None, "a time past is now");
        assert_eq!(envelope("0001-01-01T00:00:00Z"), None, "Go's zero time is past");
    }

    /// Issue 9: a payload decodes exactly when it parses into a value, nesting included.
    #[test]
    fn decodes_exactly_what_parses_into_a_value() {
        for depth in (1..140).chain([1000, 100_000]) {
            for open in ["[", "{\"a\":"] {
                let close = if open == "[" { "]" } else { "}" };
                let payload = format!("{}1{}", open.repeat(depth), close.repeat(depth));
                let body = format!(r#"{{"id":"1","type":"t","payload":{payload}}}"#);
                let parses = serde_json::from_str::<Value>(&payload).is_ok();
                let decoded = Envelope::decode(body.as_bytes());
                assert_eq!(decoded.is_ok(), parses, "depth {depth} of {open}");
                if let Ok(e) = decoded {
                    assert!(e.payload_value().is_ok());
                }
            }
        }
    }

    #[test]
    fn key_defaults_to_id_and_round_trips() {
        let e = Envelope::decode(br#"{"id":"abc","type":"t","payload":{"a":1}}"#).unwrap();
        assert_eq!(e.idempotency_key(), "abc");
        // Issue 19: an empty or blank key is no key, never one shared by many messages.
        for key in ["", "  ", "\t\n"] {
            let body = serde_json::json!({"id": "abc", "type": "t", "idempotency_key": key, "payload": 1}).to_string();
            assert_eq!(Envelope::decode(body.as_bytes()).unwrap().idempotency_key(), "abc", "{key:?}");
        }
        assert_eq!(e.version, 1);
        let n = Envelope::new("t", &serde_json::json!({"a": 1}), Some("k".into()));
        let encoded = n.encode();
        let again = Envelope::decode(&encoded).unwrap();
        assert_eq!(again.encode(), n.encode());
        assert_eq!(again.payload_value().unwrap(), serde_json::json!({"a": 1}));
    }
}
