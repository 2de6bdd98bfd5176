//! W3C trace context through message headers (feature `opentelemetry`).
//!
//! A producer writes the context of its `produce` span (a child of the span it produces in, if
//! any) into the message's headers (`traceparent`, `tracestate`), through the globally
//! installed OpenTelemetry propagator; the consumer's `process` span continues that trace, so a message's handling shows up
//! under the request that produced it, however long it waited. Headers the caller set
//! themselves win: a `traceparent` given in the options is kept as it is. Without the feature,
//! or with no propagator installed (OpenTelemetry's default is a no-op), nothing is added and
//! nothing is read.

use tracing::field::Empty;
use tracing::{info_span, Span};

use crate::Headers;

// The client's spans, named and attributed after OpenTelemetry's messaging conventions
// (https://opentelemetry.io/docs/specs/semconv/messaging/): `otel.name` and `otel.kind` are
// tracing-opentelemetry's names for the span's name and kind. The tracing names and the older
// fields (`stream`, `message_id`, ...) stay for log readers.

/// Producing to `stream`: `produce <stream>`, a producer span; `batch` is the size of a
/// `produce_batch` (a batch of one included), none for `produce`.
pub(crate) fn send_span(stream: &str, batch: Option<usize>) -> Span {
    let span = info_span!("sqlstreams.produce", otel.name = %format_args!("produce {stream}"), otel.kind = "producer",
        messaging.system = "sqlstreams", messaging.operation.type = "send", messaging.operation.name = "produce",
        messaging.destination.name = stream, messaging.batch.message_count = Empty, messaging.message.id = Empty);
    if let Some(count) = batch {
        span.record("messaging.batch.message_count", count);
    }
    span
}

/// A group's claim of up to `batch` messages: `claim <stream>`, a client span (the consumer
/// pulls); what came is recorded in `messaging.batch.message_count`.
pub(crate) fn receive_span(stream: &str, group: &str, batch: i32) -> Span {
    info_span!("sqlstreams.claim", stream, group, batch, otel.name = %format_args!("claim {stream}"),
        otel.kind = "client", messaging.system = "sqlstreams", messaging.operation.type = "receive",
        messaging.operation.name = "claim", messaging.destination.name = stream,
        messaging.consumer.group.name = group, messaging.batch.message_count = Empty)
}

/// A handler's run of one message: `process <stream>`, a consumer span continuing the trace
/// the message was produced in.
pub(crate) fn process_span(
    stream: &str,
    group: &str,
    id: i64,
    attempt: u32,
    key: Option<&str>,
    headers: Option<&serde_json::Value>,
) -> Span {
    let span = info_span!("sqlstreams.handler", message_id = id, attempt, key = ?key,
        otel.name = %format_args!("process {stream}"), otel.kind = "consumer", messaging.system = "sqlstreams",
        messaging.operation.type = "process", messaging.operation.name = "process",
        messaging.destination.name = stream, messaging.consumer.group.name = group,
        messaging.message.id = %id, messaging.sqlstreams.message.key = key, messaging.sqlstreams.attempt = attempt);
    continue_trace(&span, headers);
    span
}

/// The header a W3C propagator writes the trace and span ids to.
#[cfg(feature = "opentelemetry")]
const TRACEPARENT: &str = "traceparent";

/// The headers to produce with: the caller's, plus the current span's trace context.
pub(crate) fn outgoing(headers: Option<&Headers>) -> Option<serde_json::Value> {
    #[cfg(feature = "opentelemetry")]
    {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;

        if !headers.is_some_and(|h| h.contains_key(TRACEPARENT)) {
            let context = tracing::Span::current().context();
            if context.span().span_context().is_valid() {
                let mut with_context = headers.cloned().unwrap_or_default();
                opentelemetry::global::get_text_map_propagator(|propagator| {
                    propagator.inject_context(&context, &mut Inject(&mut with_context))
                });
                if headers.is_some() || !with_context.is_empty() {
                    return Some(serde_json::Value::Object(with_context));
                }
                return None;
            }
        }
    }
    headers.cloned().map(serde_json::Value::Object)
}

/// Makes `span` (a handler's) continue the trace the message was produced in, if it carries one.
fn continue_trace(span: &tracing::Span, headers: Option<&serde_json::Value>) {
    #[cfg(feature = "opentelemetry")]
    {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;

        let Some(serde_json::Value::Object(headers)) = headers else { return };
        if !headers.contains_key(TRACEPARENT) {
            return;
        }
        let context =
            opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&Extract(headers)));
        if context.span().span_context().is_valid() {
            // Fails only when no OpenTelemetry layer is installed: then there is no trace to join.
            let _joined = span.set_parent(context);
        }
    }
    #[cfg(not(feature = "opentelemetry"))]
    let _unused = (span, headers);
}

#[cfg(feature = "opentelemetry")]
struct Inject<'a>(&'a mut Headers);

#[cfg(feature = "opentelemetry")]
impl opentelemetry::propagation::Injector for Inject<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_string(), serde_json::Value::String(value));
    }
}

#[cfg(feature = "opentelemetry")]
struct Extract<'a>(&'a Headers);

#[cfg(feature = "opentelemetry")]
impl opentelemetry::propagation::Extractor for Extract<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(serde_json::Value::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}
