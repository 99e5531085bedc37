//! W3C trace context end to end (feature `opentelemetry`): an axum server with the
//! correlation layer, tracing-opentelemetry exporting to the SDK's in-memory exporter,
//! a request with a `traceparent`, and a downstream call the handler makes through the
//! outbound correlation layer to a second local server.
#![allow(missing_docs)]

use tower_ids_test_support as support;
#[cfg(feature = "amqp")]
use tower_ids_test_support::rabbitmq;

use std::{
    io,
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use axum::{extract::State, routing::get, Router};
use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::Full;
use opentelemetry::{
    trace::{SpanKind, TracerProvider as _},
    Value,
};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde_json::Value as Json;
use support::{client, send, serve, HttpClient};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_ids::correlation::{CorrelationLayer, OutboundCorrelationLayer};
use tracing_subscriber::{
    fmt::MakeWriter, layer::SubscriberExt as _, util::SubscriberInitExt as _,
};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

/// Every JSON log line of the process; tests pick theirs by correlation ID.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Lines {
    type Writer = Self;
    fn make_writer(&'a self) -> Self {
        self.clone()
    }
}

impl Lines {
    fn with_correlation_id(&self, id: &str) -> Vec<Json> {
        let raw = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        raw.lines()
            .map(|line| serde_json::from_str::<Json>(line).unwrap())
            .filter(|line| line["span"]["correlation_id"] == id)
            .collect()
    }
}

/// One process-wide pipeline: tracing-opentelemetry into the in-memory exporter, and
/// JSON logs.
fn pipeline() -> &'static (InMemorySpanExporter, Lines) {
    static PIPELINE: OnceLock<(InMemorySpanExporter, Lines)> = OnceLock::new();
    PIPELINE.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let lines = Lines::default();
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("tests")))
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_span_list(true)
                    .with_writer(lines.clone()),
            )
            .with(tracing_subscriber::EnvFilter::new(
                "info,hyper=off,hyper_util=off",
            ))
            .init();
        (exporter, lines)
    })
}

/// The exported spans of trace `trace_id`, once `count` of them are there (spans are
/// exported when they close, just after the response is sent).
async fn spans_of(trace_id: &str, count: usize) -> Vec<SpanData> {
    for _ in 0..200 {
        let spans: Vec<_> = pipeline()
            .0
            .get_finished_spans()
            .unwrap()
            .into_iter()
            .filter(|span| span.span_context.trace_id().to_string() == trace_id)
            .collect();
        if spans.len() >= count {
            return spans;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no {count} spans exported for trace {trace_id}");
}

fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

/// The downstream service: remembers the headers of every request.
async fn downstream() -> (String, Arc<Mutex<Vec<HeaderMap>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let app = Router::new()
        .route(
            "/",
            get(
                |State(seen): State<Arc<Mutex<Vec<HeaderMap>>>>, headers: HeaderMap| async move {
                    seen.lock().unwrap().push(headers);
                    "downstream"
                },
            ),
        )
        .with_state(seen.clone());
    (format!("http://{}/", serve(app).await), seen)
}

/// The service under test: its handler logs a line and calls `downstream` through the
/// outbound correlation layer.
async fn front(
    layer: CorrelationLayer,
    outbound: OutboundCorrelationLayer,
    downstream: String,
) -> String {
    front_with(|router| router.layer(layer), outbound, downstream).await
}

async fn front_with(
    layer: impl FnOnce(Router) -> Router,
    outbound: OutboundCorrelationLayer,
    downstream: String,
) -> String {
    let http = ServiceBuilder::new().layer(outbound).service(client());
    let handler = move || {
        let mut http = http.clone();
        let url = downstream.clone();
        async move {
            tracing::info!(event = "test.calling", "calling downstream");
            let request = Request::get(url).body(Full::new(Bytes::new())).unwrap();
            let response = http.ready().await.unwrap().call(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::OK);
            "front"
        }
    };
    let app = layer(Router::new().route("/", get(handler)));
    format!("http://{}/", serve(app).await)
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .map(|v| v.to_str().unwrap())
        .unwrap_or_default()
}

async fn get_front(client: &HttpClient, url: &str, headers: &[(&str, &str)]) -> support::Reply {
    send(client, "GET", url.to_owned(), headers, "").await
}

#[tokio::test]
async fn an_incoming_traceparent_is_continued_and_sent_on_with_the_correlation_id() {
    let lines = &pipeline().1;
    let (down_url, seen) = downstream().await;
    let url = front(
        CorrelationLayer::new(),
        OutboundCorrelationLayer::new().extend_per_call(true),
        down_url,
    )
    .await;
    let traceparent = format!("00-{TRACE_ID}-{PARENT_ID}-01");
    let reply = get_front(
        &client(),
        &url,
        &[
            ("traceparent", &traceparent),
            ("tracestate", "vendor=abc"),
            ("x-correlation-id", "otel-sampled-1"),
        ],
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("x-correlation-id"), Some("otel-sampled-1"));

    // The server span continues the caller's trace, as a server span under its span,
    // with the correlation ID as an attribute.
    let spans = spans_of(TRACE_ID, 1).await;
    let server = spans
        .iter()
        .find(|span| span.name == "correlation")
        .expect("the correlation span is exported");
    assert_eq!(server.parent_span_id.to_string(), PARENT_ID);
    assert!(server.parent_span_is_remote);
    assert_eq!(server.span_kind, SpanKind::Server);
    assert_eq!(
        attribute(server, "correlation_id")
            .map(Value::as_str)
            .as_deref(),
        Some("otel-sampled-1")
    );
    assert_eq!(server.span_context.trace_state().header(), "vendor=abc");

    // The downstream call carries both: the child correlation ID, and this trace with
    // the server span as its parent.
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(header(&seen[0], "x-correlation-id"), "otel-sampled-1.1");
    let sent = header(&seen[0], "traceparent");
    assert_eq!(
        sent,
        format!("00-{TRACE_ID}-{}-01", server.span_context.span_id()),
        "this trace, under the server span, sampled"
    );
    assert_eq!(header(&seen[0], "tracestate"), "vendor=abc");

    // Plain logs have both IDs.
    let logged = lines.with_correlation_id("otel-sampled-1");
    let calling = logged
        .iter()
        .find(|line| line["fields"]["event"] == "test.calling")
        .expect("the handler's line");
    assert_eq!(calling["span"]["trace_id"], TRACE_ID);
}

#[tokio::test]
async fn an_unsampled_trace_keeps_its_correlation_id() {
    let lines = &pipeline().1;
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let (down_url, seen) = downstream().await;
    let url = front(
        CorrelationLayer::new(),
        OutboundCorrelationLayer::new(),
        down_url,
    )
    .await;
    let reply = get_front(
        &client(),
        &url,
        &[
            ("traceparent", &format!("00-{trace_id}-b7ad6b7169203331-00")),
            ("x-correlation-id", "otel-unsampled-1"),
        ],
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("x-correlation-id"), Some("otel-unsampled-1"));

    // Nothing exported: the caller did not sample the trace.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let exported = pipeline().0.get_finished_spans().unwrap();
    assert!(exported
        .iter()
        .all(|span| span.span_context.trace_id().to_string() != trace_id));

    // The correlation ID and the trace ID still go everywhere.
    let seen = seen.lock().unwrap();
    assert_eq!(header(&seen[0], "x-correlation-id"), "otel-unsampled-1");
    let sent = header(&seen[0], "traceparent");
    assert!(sent.starts_with(&format!("00-{trace_id}-")), "{sent}");
    assert!(sent.ends_with("-00"), "still unsampled: {sent}");
    let logged = lines.with_correlation_id("otel-unsampled-1");
    assert!(!logged.is_empty());
    assert!(logged
        .iter()
        .all(|line| line["span"]["trace_id"] == trace_id));
}

#[tokio::test]
async fn without_a_traceparent_the_span_starts_a_trace_and_logs_its_id() {
    let lines = &pipeline().1;
    let (down_url, seen) = downstream().await;
    let url = front(
        CorrelationLayer::new(),
        OutboundCorrelationLayer::new(),
        down_url,
    )
    .await;
    get_front(&client(), &url, &[("x-correlation-id", "otel-root-1")]).await;
    let logged = lines.with_correlation_id("otel-root-1");
    let trace_id = logged[0]["span"]["trace_id"].as_str().unwrap().to_owned();
    assert_eq!(trace_id.len(), 32);
    let spans = spans_of(&trace_id, 1).await;
    assert_eq!(
        spans[0].parent_span_id,
        opentelemetry::trace::SpanId::INVALID
    );
    let sent = header(&seen.lock().unwrap()[0], "traceparent").to_owned();
    assert!(sent.starts_with(&format!("00-{trace_id}-")), "{sent}");
}

#[tokio::test]
async fn the_correlation_id_travels_in_baggage_when_asked() {
    pipeline();
    let (down_url, seen) = downstream().await;
    let url = front(
        CorrelationLayer::new().baggage(true),
        OutboundCorrelationLayer::new()
            .extend_per_call(true)
            .baggage(true),
        down_url,
    )
    .await;
    // No correlation header: the ID comes from the baggage.
    let reply = get_front(
        &client(),
        &url,
        &[("baggage", "tenant=7,correlation_id=from-baggage")],
    )
    .await;
    assert_eq!(reply.header("x-correlation-id"), Some("from-baggage"));
    {
        let seen = seen.lock().unwrap();
        assert_eq!(header(&seen[0], "x-correlation-id"), "from-baggage.1");
        assert_eq!(header(&seen[0], "baggage"), "correlation_id=from-baggage.1");
    }

    // A header wins over the baggage.
    let reply = get_front(
        &client(),
        &url,
        &[
            ("x-correlation-id", "from-header"),
            ("baggage", "correlation_id=from-baggage"),
        ],
    )
    .await;
    assert_eq!(reply.header("x-correlation-id"), Some("from-header"));
}

#[tokio::test]
async fn an_edge_can_refuse_the_callers_trace_context() {
    pipeline();
    let (down_url, seen) = downstream().await;
    let url = front(
        CorrelationLayer::new().trace_context(false),
        OutboundCorrelationLayer::new(),
        down_url,
    )
    .await;
    let trace_id = "11111111111111111111111111111111";
    get_front(
        &client(),
        &url,
        &[("traceparent", &format!("00-{trace_id}-2222222222222222-01"))],
    )
    .await;
    let sent = header(&seen.lock().unwrap()[0], "traceparent").to_owned();
    assert!(!sent.contains(trace_id), "a trace of its own: {sent}");
}

#[cfg(feature = "access-log")]
#[tokio::test]
async fn with_the_access_log_its_request_span_continues_the_trace() {
    let lines = &pipeline().1;
    let trace_id = "5bf92f3577b34da6a3ce929d0e0e4736";
    let (down_url, seen) = downstream().await;
    let url = front_with(
        |router| router.layer(CorrelationLayer::new().access_log()),
        OutboundCorrelationLayer::new(),
        down_url,
    )
    .await;
    get_front(
        &client(),
        &url,
        &[
            ("traceparent", &format!("00-{trace_id}-{PARENT_ID}-01")),
            ("x-correlation-id", "otel-access-1"),
        ],
    )
    .await;
    let spans = spans_of(trace_id, 1).await;
    let request = spans.iter().find(|span| span.name == "request").unwrap();
    assert_eq!(request.parent_span_id.to_string(), PARENT_ID);
    assert_eq!(request.span_kind, SpanKind::Server);
    assert_eq!(
        attribute(request, "correlation_id")
            .map(Value::as_str)
            .as_deref(),
        Some("otel-access-1")
    );
    let sent = header(&seen.lock().unwrap()[0], "traceparent").to_owned();
    assert_eq!(
        sent,
        format!("00-{trace_id}-{}-01", request.span_context.span_id())
    );
    let access = lines
        .with_correlation_id("otel-access-1")
        .into_iter()
        .find(|line| line["fields"]["event"] == "http.access")
        .expect("the access line");
    assert_eq!(access["span"]["trace_id"], trace_id);
    assert_eq!(access["fields"]["status"], 200);
}

/// An HTTP request with a `traceparent`; its handler publishes a message to RabbitMQ
/// with `MessageCorrelation::inject_current`; a consumer handles it in
/// `MessageCorrelation::scope`. One trace, exported: the server span, and the
/// consumer's span as its child; the consumer's log line carries the trace ID.
#[cfg(feature = "amqp")]
#[tokio::test]
async fn one_trace_runs_from_the_request_through_rabbitmq_into_the_consumer() {
    use axum::routing::post;
    use futures_util::StreamExt as _;
    use lapin::{options::BasicPublishOptions, types::FieldTable, BasicProperties, Channel};
    use tower_ids::correlation::{MessageCorrelation, TraceContext};

    const TRACE: &str = "5af7651916cd43dd8448eb211c80319c";
    let lines = &pipeline().1;
    let Some(connection) = rabbitmq::connect().await else {
        return;
    };
    let channel = connection.create_channel().await.unwrap();
    let queue = rabbitmq::exclusive_queue(&channel).await;

    async fn publish(State((channel, queue)): State<(Channel, String)>) -> StatusCode {
        let mut headers = FieldTable::default();
        MessageCorrelation::new().inject_current(&mut headers);
        channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                b"{}",
                BasicProperties::default().with_headers(headers),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        StatusCode::ACCEPTED
    }
    let app = Router::new()
        .route("/publish", post(publish))
        .with_state((channel.clone(), queue.clone()))
        .layer(CorrelationLayer::new());
    let url = format!("http://{}/publish", serve(app).await);
    let reply = send(
        &client(),
        "POST",
        url,
        &[
            ("traceparent", &format!("00-{TRACE}-{PARENT_ID}-01")),
            ("x-correlation-id", "amqp-traced-1"),
        ],
        "",
    )
    .await;
    assert_eq!(reply.status, StatusCode::ACCEPTED);

    let mut consumer = rabbitmq::no_ack_consumer(&channel, &queue).await;
    let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("the message arrives within 10 s")
        .unwrap()
        .unwrap();
    let headers = delivery.properties.headers();
    let carried = TraceContext::extract(headers).expect("a traceparent on the message");
    assert_eq!(carried.trace_id(), TRACE);
    let correlation = MessageCorrelation::new();
    let id = correlation.for_delivery(headers);
    assert!(id.as_str().starts_with("amqp-traced-1."), "{id}");
    correlation
        .scope(id.clone(), headers, async {
            tracing::info!(event = "test.consumed", "consumed the message");
        })
        .await;

    let spans = spans_of(TRACE, 2).await;
    let server = spans
        .iter()
        .find(|span| span.span_kind == SpanKind::Server)
        .expect("the server span");
    let consumer = spans
        .iter()
        .find(|span| span.span_kind == SpanKind::Consumer)
        .expect("the consumer span");
    assert_eq!(server.parent_span_id.to_string(), PARENT_ID);
    assert_eq!(
        consumer.parent_span_id,
        server.span_context.span_id(),
        "the consumer continues the request's span"
    );
    assert_eq!(
        attribute(consumer, "correlation_id").map(ToString::to_string),
        Some(id.to_string())
    );
    let consumed = lines.with_correlation_id(id.as_str());
    assert_eq!(consumed.len(), 1, "{consumed:?}");
    assert_eq!(consumed[0]["span"]["trace_id"], TRACE);
}

#[allow(clippy::all, clippy::pedantic, missing_docs, unreachable_pub)]
mod ledger {
    include!("grpc/ledger.v1.rs");
}

/// A ledger whose transfers answer the correlation ID they ran under.
struct EchoLedger;

#[tonic::async_trait]
impl ledger::ledger_server::Ledger for EchoLedger {
    async fn transfer(
        &self,
        _: tonic::Request<ledger::TransferRequest>,
    ) -> Result<tonic::Response<ledger::TransferReply>, tonic::Status> {
        tracing::info!(event = "test.transfer", "transfer");
        Ok(tonic::Response::new(ledger::TransferReply {
            transfer_id: tower_ids::correlation::CorrelationId::current()
                .map(|id| id.as_str().to_owned())
                .unwrap_or_default(),
            cents: 0,
        }))
    }

    async fn transfer_many(
        &self,
        _: tonic::Request<tonic::Streaming<ledger::TransferRequest>>,
    ) -> Result<tonic::Response<ledger::TransferReply>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this test"))
    }

    type WatchStream = std::pin::Pin<
        Box<
            dyn tonic::codegen::tokio_stream::Stream<
                    Item = Result<ledger::TransferReply, tonic::Status>,
                > + Send,
        >,
    >;

    async fn watch(
        &self,
        _: tonic::Request<ledger::TransferRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("not in this test"))
    }
}

#[tokio::test]
async fn a_grpc_calls_traceparent_and_correlation_id_travel_in_its_metadata() {
    use tower_ids::idempotency::IdempotencyLayer;
    let lines = &pipeline().1;
    let trace_id = "5cf92f3577b34da6a3ce929d0e0e4799";
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(CorrelationLayer::new())
            .layer(IdempotencyLayer::new().for_grpc())
            .add_service(ledger::ledger_server::LedgerServer::new(EchoLedger))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = ledger::ledger_client::LedgerClient::new(channel);

    let mut request = tonic::Request::new(ledger::TransferRequest::default());
    let metadata = request.metadata_mut();
    let traceparent = format!("00-{trace_id}-{PARENT_ID}-01");
    metadata.insert("traceparent", traceparent.parse().unwrap());
    metadata.insert("x-correlation-id", "grpc-call-1".parse().unwrap());
    metadata.insert("idempotency-key", "k-trace".parse().unwrap());
    let reply = client.transfer(request).await.unwrap();

    // The handler ran under the caller's correlation ID, which comes back in metadata.
    assert_eq!(reply.get_ref().transfer_id, "grpc-call-1");
    assert_eq!(
        reply.metadata().get("x-correlation-id").unwrap(),
        "grpc-call-1"
    );
    assert_eq!(
        reply.metadata().get("idempotent-replayed").unwrap(),
        "false"
    );
    // The server span continues the caller's trace, under its span.
    let spans = spans_of(trace_id, 1).await;
    let server = spans
        .iter()
        .find(|span| span.name == "correlation")
        .expect("the correlation span is exported");
    assert_eq!(server.parent_span_id.to_string(), PARENT_ID);
    assert!(server.parent_span_is_remote);
    let logged = lines.with_correlation_id("grpc-call-1");
    let transfer = logged
        .iter()
        .find(|line| line["fields"]["event"] == "test.transfer")
        .expect("the handler's line");
    assert_eq!(transfer["span"]["trace_id"], trace_id);
}
