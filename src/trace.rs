//! Trace context across the async hop: the W3C `traceparent` a message carries, continued into
//! its handler calls, the spans of a delivery (receive → handle → settle), and their export
//! over OTLP/HTTP (protobuf) when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set.
//!
//! Without an endpoint nothing is installed and no span is created: a delivery costs one parse
//! of its header and one new span id. A missing or broken `traceparent` starts a new trace; it
//! never decides anything about a message.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState, TracerProvider,
};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::{Level, Span, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;

use crate::broker::{Delivery, HeaderValue};
use crate::envelope::TRACEPARENT_HEADER;

/// The target of the delivery spans: exported, never printed as log lines.
const SPANS: &str = "sluice::spans";

/// Set once an exporter is installed; until then the span functions return disabled spans.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// A W3C trace context (`traceparent`), version 00.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

impl TraceContext {
    /// Parses a `traceparent`. None for anything the W3C spec says to ignore: a wrong length or
    /// separator, a character that is not lowercase hex, version `ff`, an all-zero id.
    pub fn parse(text: &str) -> Option<TraceContext> {
        let b = text.trim_matches([' ', '\t']).as_bytes();
        if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        let version = hex::<1>(&b[0..2])?[0];
        // Version 00 is exactly 55 characters; a later version may append fields after a dash.
        let valid_length = if version == 0 { b.len() == 55 } else { b.len() == 55 || b[55] == b'-' };
        if version == 0xff || !valid_length {
            return None;
        }
        let trace_id = hex::<16>(&b[3..35])?;
        let span_id = hex::<8>(&b[36..52])?;
        let flags = hex::<1>(&b[53..55])?[0];
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext { trace_id, span_id, flags })
    }

    /// A new trace, sampled.
    pub fn new_root() -> TraceContext {
        let trace_id = nonzero::<u128>().to_be_bytes();
        TraceContext { trace_id, span_id: new_span_id(), flags: 1 }
    }

    /// The same trace, with a new span id.
    pub fn child(self) -> TraceContext {
        TraceContext { span_id: new_span_id(), ..self }
    }

    /// The context as an OpenTelemetry parent from another process.
    fn remote(self) -> opentelemetry::Context {
        let span = SpanContext::new(
            TraceId::from_bytes(self.trace_id),
            SpanId::from_bytes(self.span_id),
            TraceFlags::new(self.flags),
            true,
            TraceState::default(),
        );
        opentelemetry::Context::new().with_remote_span_context(span)
    }
}

impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        self.trace_id.iter().try_for_each(|b| write!(f, "{b:02x}"))?;
        f.write_str("-")?;
        self.span_id.iter().try_for_each(|b| write!(f, "{b:02x}"))?;
        write!(f, "-{:02x}", self.flags)
    }
}

/// `N` bytes from `2N` lowercase hex digits.
fn hex<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0; N];
    for (byte, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *byte = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// A random value other than zero (an all-zero id is invalid).
fn nonzero<T: Default + PartialEq>() -> T
where
    rand::distr::StandardUniform: rand::distr::Distribution<T>,
{
    loop {
        let value = rand::random::<T>();
        if value != T::default() {
            return value;
        }
    }
}

fn new_span_id() -> [u8; 8] {
    nonzero::<u64>().to_be_bytes()
}

/// The trace context a delivery carries: None when it has no valid `traceparent` header.
pub fn incoming(delivery: &impl Delivery) -> Option<TraceContext> {
    from_header(delivery.header(TRACEPARENT_HEADER).as_ref())
}

fn from_header(header: Option<&HeaderValue>) -> Option<TraceContext> {
    match header {
        Some(HeaderValue::Str(text)) => TraceContext::parse(text),
        _ => None,
    }
}

/// The trace context a handler call carries. While spans are exported, the current span's
/// (the delivery's `handle` span, so the receiver's spans join sluice's); otherwise the
/// message's trace continued with a new span id, or a new trace.
pub fn outgoing(incoming: Option<TraceContext>) -> TraceContext {
    if EXPORTING.load(Ordering::Relaxed) {
        let cx = Span::current().context();
        let span = cx.span();
        let current = span.span_context();
        if current.is_valid() {
            return TraceContext {
                trace_id: current.trace_id().to_bytes(),
                span_id: current.span_id().to_bytes(),
                flags: current.trace_flags().to_u8(),
            };
        }
    }
    incoming.map_or_else(TraceContext::new_root, TraceContext::child)
}

/// The span of one delivery, from its arrival until it is settled, in the message's trace (a
/// new one when it carries none). Disabled unless spans are exported. Its tracing parent is
/// the delivery's log span (`logged`), which the exporter does not see, so log lines inside
/// it still name the message and the exported span is a root in the message's trace.
pub fn receive_span(queue: &str, delivery: &impl Delivery, logged: &Span) -> Span {
    if !EXPORTING.load(Ordering::Relaxed) {
        return Span::none();
    }
    let message_id = delivery.message_id();
    let span =
        tracing::info_span!(target: SPANS, parent: logged, "receive", "otel.kind" = "consumer", queue, message_id);
    if let Some(parent) = incoming(delivery) {
        // Fails only when no exporter sees the span, which then needs no parent.
        let _ = span.set_parent(parent.remote());
    }
    span
}

/// Decoding the delivery and running its handler, inside `receive`.
pub fn handle_span(receive: &Span) -> Span {
    if receive.is_disabled() { Span::none() } else { tracing::info_span!(target: SPANS, parent: receive, "handle") }
}

/// Making the outcome durable (a retry or dead-letter copy), inside `receive`.
pub fn settle_span(receive: &Span) -> Span {
    if receive.is_disabled() { Span::none() } else { tracing::info_span!(target: SPANS, parent: receive, "settle") }
}

/// False for the delivery spans: a filter that keeps them out of log lines (they are for the
/// exporter alone).
pub fn not_a_delivery_span(metadata: &tracing::Metadata<'_>) -> bool {
    metadata.target() != SPANS
}

/// Why traces cannot be exported.
#[derive(Debug, thiserror::Error)]
#[error("cannot export traces over OTLP: {0}")]
pub struct ExportError(#[from] opentelemetry_otlp::ExporterBuildError);

/// The installed exporter: dropping it flushes the spans not yet sent and stops it.
pub struct Exporter(SdkTracerProvider);

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Err(e) = self.0.shutdown() {
            tracing::warn!(error = %e, "flushing traces at exit failed; the last spans are lost");
        }
    }
}

/// With an OTLP endpoint in the environment, the layer that exports the delivery spans, and
/// the exporter to keep until exit; None (nothing installed) without one. The endpoint,
/// headers and timeout come from the standard `OTEL_EXPORTER_OTLP_*` variables.
pub fn otlp<S>() -> Result<Option<(impl Layer<S>, Exporter)>, ExportError>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let set = |name| std::env::var_os(name).is_some_and(|v| !v.is_empty());
    if !set("OTEL_EXPORTER_OTLP_ENDPOINT") && !set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder().with_http().build()?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if !set("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name("sluice");
    }
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build();
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("sluice"))
        .with_filter(Targets::new().with_target(SPANS, Level::INFO));
    EXPORTING.store(true, Ordering::Relaxed);
    Ok(Some((layer, Exporter(provider))))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_formats_version_00() {
        let ctx = TraceContext::parse(VALID).expect("valid");
        assert_eq!(ctx.trace_id[..2], [0x4b, 0xf9]);
        assert_eq!(ctx.span_id[7], 0xb7);
        assert_eq!(ctx.flags, 1);
        assert_eq!(ctx.to_string(), VALID);
    }

    #[test]
    fn what_the_spec_says_to_ignore_starts_nothing() {
        let cases = [
            ("", "empty"),
            ("00", "short"),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", "no flags"),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-", "version 00 with more"),
            ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", "uppercase"),
            ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", "zero trace id"),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", "zero span id"),
            ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "version ff"),
            ("0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "version not hex"),
            ("00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "separator"),
            ("00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01", "shifted dash"),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x", "flags not hex"),
            ("00-4bf92f3577b34da6a3ce929d0e0e47é-00f067aa0ba902b7-01", "multibyte"),
            ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x", "future version, no dash"),
        ];
        for (text, why) in cases {
            assert_eq!(TraceContext::parse(text), None, "{why}: {text:?}");
        }
    }

    #[test]
    fn a_future_version_is_read_as_far_as_00_goes() {
        let future = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds";
        let ctx = TraceContext::parse(future).expect("future version");
        assert_eq!(ctx.to_string(), VALID);
    }

    #[test]
    fn continuing_keeps_the_trace_and_makes_a_new_span() {
        let parent = TraceContext::parse(VALID).expect("valid");
        let child = outgoing(Some(parent));
        assert_eq!((child.trace_id, child.flags), (parent.trace_id, parent.flags));
        assert_ne!(child.span_id, parent.span_id);
        let root = outgoing(None);
        assert_ne!(root.trace_id, parent.trace_id);
        assert_eq!(TraceContext::parse(&root.to_string()), Some(root));
    }

    #[test]
    fn only_a_text_header_is_read() {
        assert_eq!(from_header(Some(&HeaderValue::Int(1))), None);
        assert_eq!(from_header(None), None);
        assert!(from_header(Some(&HeaderValue::Str(VALID.into()))).is_some());
    }

    proptest! {
        /// Issue 11: a hostile header never panics; what parses formats back to itself.
        #[test]
        fn any_text_parses_or_is_ignored(text in ".{0,80}") {
            if let Some(ctx) = TraceContext::parse(&text) {
                prop_assert_eq!(TraceContext::parse(&ctx.to_string()), Some(ctx));
            }
        }

        #[test]
        fn near_misses_of_a_valid_header_never_panic(at in 0usize..55, byte in any::<u8>()) {
            let mut bytes = VALID.as_bytes().to_vec();
            bytes[at] = byte;
            let text = String::from_utf8_lossy(&bytes);
            // A changed version digit reads as a later version, which continues as 00.
            if let Some(ctx) = TraceContext::parse(&text) {
                prop_assert_eq!(&ctx.to_string()[2..], &text[2..]);
            }
        }

        #[test]
        fn new_contexts_format_as_valid_headers(_ in 0..4u8) {
            let root = TraceContext::new_root();
            prop_assert_eq!(TraceContext::parse(&root.to_string()), Some(root));
            let child = root.child();
            prop_assert_eq!(TraceContext::parse(&child.to_string()), Some(child));
        }
    }
}
