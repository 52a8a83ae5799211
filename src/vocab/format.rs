//! How a queue reads its messages (`format:`), and which fields a message of each format has:
//! what `config` checks templates and filters against, and [`crate::format`] decodes.

/// How a queue reads its messages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Format {
    #[default]
    Envelope,
    Json,
    CloudEvents,
    Bytes,
}

/// What every format shows templates and filters (with `attempt`, `queue` and `env` in
/// templates).
const COMMON: &[&str] =
    &["id", "type", "idempotency_key", "occurred_at", "headers", "routing_key", "exchange", "content_type"];

impl Format {
    /// Every format, as written in pipeline files.
    pub const ALL: [Format; 4] = [Format::Envelope, Format::Json, Format::CloudEvents, Format::Bytes];

    /// The name written in pipeline files.
    pub fn name(self) -> &'static str {
        match self {
            Format::Envelope => "envelope",
            Format::Json => "json",
            Format::CloudEvents => "cloudevents",
            Format::Bytes => "bytes",
        }
    }

    pub fn parse(text: &str) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.name() == text)
    }

    /// The fields of a message of this format beyond those every format has.
    fn own_fields(self) -> &'static [&'static str] {
        match self {
            Format::Envelope => &["version", "payload"],
            Format::Json => &["payload"],
            Format::CloudEvents => &["source", "subject", "time", "specversion", "datacontenttype", "data"],
            Format::Bytes => &["body"],
        }
    }

    /// Whether a message of this format has the field `name` (a template's or filter's first
    /// step).
    pub fn has(self, name: &str) -> bool {
        COMMON.contains(&name) || self.own_fields().contains(&name)
    }

    /// The fields of a message of this format, for messages.
    pub fn fields(self) -> Vec<&'static str> {
        COMMON.iter().chain(self.own_fields()).copied().collect()
    }

    /// The name of the JSON payload (what `payload_schema` describes), where the format has one.
    pub fn payload(self) -> Option<&'static str> {
        match self {
            Format::Envelope | Format::Json => Some("payload"),
            Format::CloudEvents => Some("data"),
            Format::Bytes => None,
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
