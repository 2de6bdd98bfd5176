//! W3C trace context through message headers (the client's `opentelemetry` feature): a
//! handler's span continues the trace of the span that produced its message. Its own test
//! binary, because it installs a global tracing subscriber and propagator.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::trace::{SpanKind, TraceContextExt, TraceId, TracerProvider};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde::{Deserialize, Serialize};
use sqlstreams_client::{BatchOptions, Client, ConsumerConfig, Delivery, HandlerError, Headers, ProduceOptions};
use sqlstreams_tests::{database_url, unique};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Order {
    n: u32,
}

/// The trace a span belongs to (what a trace backend would group it under).
fn trace_of(span: &tracing::Span) -> TraceId {
    span.context().span().span_context().trace_id()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_continues_the_trace_its_message_was_produced_in() {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let spans = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder().with_simple_exporter(spans.clone()).build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("sqlstreams-test"));
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer)).unwrap();

    let client = Client::connect(&database_url()).unwrap();
    client.pool().get().await.unwrap().batch_execute(sqlstreams_tests::CREATE_EXTENSION).await.unwrap();
    let stream = client.stream::<Order>(unique("traced"));
    stream.register().await.unwrap();
    let producer = stream.producer();

    // Produced inside a request's span: one alone, two in a batch (with headers of their own).
    let request = tracing::info_span!("checkout");
    let request_trace = trace_of(&request);
    assert_ne!(request_trace, TraceId::INVALID, "the test's tracer makes real traces");
    let single = producer.produce(&Order { n: 1 }, ProduceOptions::default()).instrument(request.clone()).await;
    let single = single.unwrap().id().unwrap();
    let mut tenant = Headers::new();
    tenant.insert("tenant".into(), 7.into());
    let options = BatchOptions { headers: Some(tenant), ..Default::default() };
    let (a, b) = (Order { n: 2 }, Order { n: 3 });
    let batch = producer.produce_batch([(&a, None), (&b, None)], options).instrument(request.clone()).await.unwrap();
    // Outside any span of the caller's.
    let untraced = producer.produce(&Order { n: 4 }, ProduceOptions::default()).await.unwrap().id().unwrap();
    // A traceparent the caller set wins over the current span's.
    let theirs = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut own = Headers::new();
    own.insert("traceparent".into(), theirs.into());
    let own_options = ProduceOptions { headers: Some(own), ..Default::default() };
    let explicit = producer.produce(&Order { n: 5 }, own_options).instrument(request.clone()).await;
    let explicit = explicit.unwrap().id().unwrap();

    type Seen = Arc<Mutex<HashMap<i64, (TraceId, Headers)>>>;
    let seen: Seen = Arc::default();
    let consumer = stream.consumer("g").register(ConsumerConfig::default()).await.unwrap();
    let running = {
        let seen = seen.clone();
        consumer.start(move |d: Delivery<Order>| {
            let trace = trace_of(&tracing::Span::current());
            seen.lock().unwrap().insert(d.id, (trace, d.headers.clone()));
            std::future::ready(Ok::<(), HandlerError>(()))
        })
    };
    for _ in 0..500 {
        if seen.lock().unwrap().len() == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.shutdown(Duration::from_secs(5)).await;
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 5, "every message handled: {seen:?}");

    for id in [single, batch[0], batch[1]] {
        let (trace, headers) = &seen[&id];
        assert_eq!(*trace, request_trace, "message {id} is handled in the request's trace");
        let parent = headers["traceparent"].as_str().unwrap();
        assert!(parent.contains(&request_trace.to_string()), "{parent}");
    }
    assert_eq!(seen[&batch[0]].1["tenant"], 7, "the caller's headers are kept");

    // Outside any span, its `produce` span starts a trace of its own, which the handler continues.
    let (trace, headers) = &seen[&untraced];
    assert_ne!(*trace, request_trace, "an untraced message starts a trace of its own");
    assert_ne!(*trace, TraceId::INVALID);
    let parent = headers["traceparent"].as_str().unwrap();
    assert!(parent.contains(&trace.to_string()), "{parent}");

    let (trace, headers) = &seen[&explicit];
    assert_eq!(headers["traceparent"], theirs);
    assert_eq!(trace.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");

    // The spans carry OpenTelemetry's messaging names and attributes.
    let spans = spans.get_finished_spans().unwrap();
    let name = stream.name();
    let named =
        |prefix: &str| -> Vec<&SpanData> { spans.iter().filter(|s| s.name == format!("{prefix} {name}")).collect() };
    let (send, receive, process) = (named("produce"), named("claim"), named("process"));
    for (span, kind, operation, operation_name) in send
        .iter()
        .map(|s| (s, SpanKind::Producer, "send", "produce"))
        .chain(receive.iter().map(|s| (s, SpanKind::Client, "receive", "claim")))
        .chain(process.iter().map(|s| (s, SpanKind::Consumer, "process", "process")))
    {
        assert_eq!(span.span_kind, kind, "{}", span.name);
        assert_eq!(attribute(span, "messaging.system").as_deref(), Some("sqlstreams"));
        assert_eq!(attribute(span, "messaging.operation.type").as_deref(), Some(operation));
        assert_eq!(
            attribute(span, "messaging.operation.name").as_deref(),
            Some(operation_name),
            "the span's name begins with it"
        );
        assert_eq!(attribute(span, "messaging.destination.name").as_deref(), Some(name));
        if operation != "send" {
            assert_eq!(attribute(span, "messaging.consumer.group.name").as_deref(), Some("g"));
        }
    }
    let ids = |spans: &[&SpanData]| -> Vec<String> {
        let mut ids: Vec<String> = spans.iter().filter_map(|s| attribute(s, "messaging.message.id")).collect();
        ids.sort();
        ids
    };
    let mut all = [single, batch[0], batch[1], untraced, explicit].iter().map(i64::to_string).collect::<Vec<_>>();
    all.sort();
    assert_eq!(ids(&process), all, "one process span per message");
    let singles = [single, untraced, explicit].iter().map(i64::to_string).collect::<std::collections::BTreeSet<_>>();
    assert_eq!(
        ids(&send).into_iter().collect::<std::collections::BTreeSet<_>>(),
        singles,
        "a single send names its message"
    );
    let batches: Vec<String> = send.iter().filter_map(|s| attribute(s, "messaging.batch.message_count")).collect();
    assert_eq!(batches, ["2"], "the batch send counts its messages");
    let received: i64 = receive
        .iter()
        .filter_map(|s| attribute(s, "messaging.batch.message_count"))
        .map(|n| n.parse::<i64>().unwrap())
        .sum();
    assert_eq!(received, 5, "the claims' counts add up to what was handled");
}

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| kv.value.to_string())
}
