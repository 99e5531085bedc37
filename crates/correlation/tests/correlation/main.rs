//! The correlation layers through real axum servers on 127.0.0.1.

use tower_ids_test_support as support;

mod access_log;
mod lifecycle;

use axum::{extract::State, routing::get, Json, Router};
use http::{HeaderMap, HeaderName, StatusCode};
use serde_json::{json, Value};
use support::{client, send, serve, HttpClient, Logs};
use tower::ServiceBuilder;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_ids::correlation::{CorrelationId, CorrelationLayer, OutboundCorrelationLayer};

const X_CORRELATION_ID: &str = "x-correlation-id";

/// Reports every way the handler can see the ID, and logs inside the span.
async fn report(id: CorrelationId, headers: HeaderMap) -> Json<Value> {
    tracing::info!(event = "test.handled", "handled");
    Json(json!({
        "extractor": id.as_str(),
        "task_local": CorrelationId::current().map(|id| id.to_string()),
        "header": headers.get(X_CORRELATION_ID).map(|v| v.to_str().unwrap()),
    }))
}

fn app(layer: CorrelationLayer) -> Router {
    Router::new().route("/", get(report)).layer(layer)
}

fn assert_uuid_v7(text: &str) {
    let uuid = uuid::Uuid::parse_str(text).unwrap_or_else(|_| panic!("{text} is not a UUID"));
    assert_eq!(uuid.get_version_num(), 7, "{text} is not a UUIDv7");
}

#[tokio::test]
async fn restores_the_incoming_id_and_shows_it_everywhere() {
    let (logs, _guard) = Logs::capture();
    let addr = serve(app(CorrelationLayer::new())).await;

    let reply = send(
        &client(),
        "GET",
        format!("http://{addr}/"),
        &[(X_CORRELATION_ID, "abcd-efgh.1")],
        "",
    )
    .await;

    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header(X_CORRELATION_ID), Some("abcd-efgh.1"));
    assert_eq!(
        reply.json(),
        json!({"extractor": "abcd-efgh.1", "task_local": "abcd-efgh.1", "header": "abcd-efgh.1"})
    );
    let handled = logs.events("test.handled");
    assert_eq!(handled.len(), 1);
    assert_eq!(handled[0]["span"]["name"], "correlation");
    assert_eq!(handled[0]["span"]["correlation_id"], "abcd-efgh.1");
    assert!(logs.events("correlation.invalid").is_empty());
}

#[tokio::test]
async fn generates_a_uuid_v7_when_the_header_is_missing() {
    let (logs, _guard) = Logs::capture();
    let addr = serve(app(CorrelationLayer::new())).await;
    let client = client();

    let first = send(&client, "GET", format!("http://{addr}/"), &[], "").await;
    let second = send(&client, "GET", format!("http://{addr}/"), &[], "").await;

    let id = first.header(X_CORRELATION_ID).unwrap();
    assert_uuid_v7(id);
    assert_ne!(
        Some(id),
        second.header(X_CORRELATION_ID),
        "each attempt gets its own ID"
    );
    assert_eq!(
        first.json(),
        json!({"extractor": id, "task_local": id, "header": id})
    );
    assert_eq!(logs.events("test.handled")[0]["span"]["correlation_id"], id);
}

#[tokio::test]
async fn replaces_invalid_ids_without_logging_them() {
    let (logs, _guard) = Logs::capture();
    let addr = serve(app(CorrelationLayer::new())).await;
    let client = client();
    let oversized = "a".repeat(129);
    let cases: [(&str, &[(&str, &str)]); 4] = [
        (
            "invalid_character",
            &[(X_CORRELATION_ID, "evil\"}{injected=1")],
        ),
        ("too_long", &[(X_CORRELATION_ID, &oversized)]),
        ("empty", &[(X_CORRELATION_ID, "")]),
        (
            "multiple_values",
            &[
                (X_CORRELATION_ID, "first-one"),
                (X_CORRELATION_ID, "second-one"),
            ],
        ),
    ];

    for (reason, headers) in cases {
        let reply = send(&client, "GET", format!("http://{addr}/"), headers, "").await;
        assert_eq!(reply.status, StatusCode::OK, "{reason}");
        let fresh = reply.header(X_CORRELATION_ID).unwrap().to_owned();
        assert_uuid_v7(&fresh);
        assert_eq!(
            reply.json()["header"],
            fresh.as_str(),
            "the request header is rewritten"
        );

        let warnings = logs.events("correlation.invalid");
        let warning = warnings.last().unwrap();
        assert_eq!(warning["level"], "WARN");
        assert_eq!(warning["fields"]["reason"], reason);
        assert_eq!(warning["fields"]["correlation_id"], fresh.as_str());
        assert_eq!(warning["fields"]["header"], X_CORRELATION_ID);
    }

    assert_eq!(logs.events("correlation.invalid").len(), 4);
    let raw = logs.raw();
    for value in [
        "injected",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        "first-one",
        "second-one",
    ] {
        assert!(!raw.contains(value), "{value} reached a log line");
    }
}

#[tokio::test]
async fn enforce_answers_400_problem_json() {
    let (logs, _guard) = Logs::capture();
    let addr = serve(app(CorrelationLayer::new().enforce(true))).await;
    let client = client();

    let missing = send(&client, "GET", format!("http://{addr}/"), &[], "").await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        missing.header("content-type"),
        Some("application/problem+json")
    );
    let problem = missing.json();
    assert_eq!(problem["status"], 400);
    assert_eq!(problem["code"], "correlation_id.missing");
    let docs =
        "https://docs.rs/tower-ids/latest/tower_ids/correlation/index.html#correlation_id.missing";
    assert_eq!(problem["type"], docs);
    assert_eq!(
        missing.header("link"),
        Some(format!("<{docs}>; rel=\"describedby\"").as_str())
    );
    // The refusal itself is traceable: its ID is on the response and on the WARN line.
    let fresh = missing.header(X_CORRELATION_ID).unwrap();
    assert_eq!(
        logs.events("correlation.missing")[0]["fields"]["correlation_id"],
        fresh
    );

    let invalid = send(
        &client,
        "GET",
        format!("http://{addr}/"),
        &[(X_CORRELATION_ID, "no spaces")],
        "",
    )
    .await;
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST);
    assert_eq!(invalid.json()["code"], "correlation_id.invalid");
    assert_eq!(logs.events("correlation.rejected")[0]["level"], "WARN");
    assert!(
        logs.events("test.handled").is_empty(),
        "the handler never ran"
    );

    let valid = send(
        &client,
        "GET",
        format!("http://{addr}/"),
        &[(X_CORRELATION_ID, "ok-1")],
        "",
    )
    .await;
    assert_eq!(valid.status, StatusCode::OK);
}

#[tokio::test]
async fn never_overwrites_a_header_the_handler_set() {
    let app = Router::new()
        .route(
            "/",
            get(|| async { ([(X_CORRELATION_ID, "chosen-by-handler")], "ok") }),
        )
        .layer(CorrelationLayer::new());
    let addr = serve(app).await;

    let reply = send(
        &client(),
        "GET",
        format!("http://{addr}/"),
        &[(X_CORRELATION_ID, "incoming")],
        "",
    )
    .await;

    assert_eq!(reply.header(X_CORRELATION_ID), Some("chosen-by-handler"));
}

#[tokio::test]
async fn accepts_fallback_headers_in_order() {
    let layer = CorrelationLayer::new().accept(HeaderName::from_static("x-request-id"));
    let addr = serve(app(layer)).await;
    let client = client();

    let from_fallback = send(
        &client,
        "GET",
        format!("http://{addr}/"),
        &[("x-request-id", "req-7")],
        "",
    )
    .await;
    assert_eq!(from_fallback.header(X_CORRELATION_ID), Some("req-7"));
    assert_eq!(
        from_fallback.json()["header"],
        "req-7",
        "the primary header is set on the request"
    );

    let primary_wins = send(
        &client,
        "GET",
        format!("http://{addr}/"),
        &[("x-request-id", "req-8"), (X_CORRELATION_ID, "corr-8")],
        "",
    )
    .await;
    assert_eq!(primary_wins.header(X_CORRELATION_ID), Some("corr-8"));
}

#[tokio::test]
async fn an_invalid_fallback_header_is_replaced_too() {
    let (logs, _guard) = Logs::capture();
    let request_id_echo = Router::new()
        .route(
            "/",
            get(|headers: HeaderMap| async move {
                Json(json!({
                    "x-request-id": headers.get("x-request-id").map(|v| v.to_str().unwrap()),
                    "x-correlation-id": headers.get(X_CORRELATION_ID).map(|v| v.to_str().unwrap()),
                }))
            }),
        )
        .layer(CorrelationLayer::new().accept(HeaderName::from_static("x-request-id")));
    let addr = serve(request_id_echo).await;

    let reply = send(
        &client(),
        "GET",
        format!("http://{addr}/"),
        &[("x-request-id", "bad|value")],
        "",
    )
    .await;

    let fresh = reply.header(X_CORRELATION_ID).unwrap();
    assert_uuid_v7(fresh);
    assert_eq!(
        reply.json(),
        json!({"x-request-id": fresh, "x-correlation-id": fresh})
    );
    assert_eq!(
        logs.events("correlation.invalid")[0]["fields"]["header"],
        "x-request-id"
    );
    assert!(!logs.raw().contains("bad|value"));
}

#[tokio::test]
async fn works_alongside_tower_http_request_id() {
    let x_request_id = HeaderName::from_static("x-request-id");
    let app = Router::new().route("/", get(report)).layer(
        ServiceBuilder::new()
            .layer(SetRequestIdLayer::new(
                x_request_id.clone(),
                MakeRequestUuid,
            ))
            .layer(PropagateRequestIdLayer::new(x_request_id.clone()))
            .layer(CorrelationLayer::new().accept(x_request_id)),
    );
    let addr = serve(app).await;
    let client = client();

    // No IDs at all: tower-http makes an x-request-id, and the correlation ID continues it.
    let fresh = send(&client, "GET", format!("http://{addr}/"), &[], "").await;
    let request_id = fresh.header("x-request-id").unwrap();
    assert_eq!(
        uuid::Uuid::parse_str(request_id).unwrap().get_version_num(),
        4
    );
    assert_eq!(fresh.header(X_CORRELATION_ID), Some(request_id));
    assert_eq!(fresh.json()["extractor"], request_id);

    // The caller's correlation ID takes precedence; tower-http still echoes its own.
    let both = send(
        &client,
        "GET",
        format!("http://{addr}/"),
        &[
            (X_CORRELATION_ID, "caller-attempt-1"),
            ("x-request-id", "proxy-42"),
        ],
        "",
    )
    .await;
    assert_eq!(both.header(X_CORRELATION_ID), Some("caller-attempt-1"));
    assert_eq!(both.header("x-request-id"), Some("proxy-42"));
}

/// A second service that answers with the correlation ID it received.
async fn downstream() -> std::net::SocketAddr {
    let app = Router::new().route(
        "/echo",
        get(|headers: HeaderMap| async move {
            headers
                .get(X_CORRELATION_ID)
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default()
        }),
    );
    serve(app).await
}

type Outbound = tower_ids::correlation::OutboundCorrelation<HttpClient>;

async fn call_downstream(client: &Outbound, url: &str, explicit: Option<&str>) -> String {
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    let mut request = http::Request::get(url);
    if let Some(explicit) = explicit {
        request = request.header(X_CORRELATION_ID, explicit);
    }
    let request = request
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let response = client.clone().oneshot(request).await.unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

async fn fan_out(
    State((client, url)): State<(Outbound, String)>,
    id: CorrelationId,
) -> Json<Value> {
    let first = call_downstream(&client, &url, None).await;
    let second = call_downstream(&client, &url, None).await;
    let explicit = call_downstream(&client, &url, Some("set-by-caller")).await;
    Json(json!({ "id": id.as_str(), "calls": [first, second, explicit] }))
}

#[tokio::test]
async fn propagates_the_id_on_outgoing_calls() {
    let downstream = downstream().await;
    let outbound = ServiceBuilder::new()
        .layer(OutboundCorrelationLayer::new())
        .service(client());
    let app = Router::new()
        .route("/", get(fan_out))
        .with_state((outbound, format!("http://{downstream}/echo")))
        .layer(CorrelationLayer::new());
    let addr = serve(app).await;

    let reply = send(
        &client(),
        "GET",
        format!("http://{addr}/"),
        &[(X_CORRELATION_ID, "parent-1")],
        "",
    )
    .await;

    assert_eq!(
        reply.json(),
        json!({"id": "parent-1", "calls": ["parent-1", "parent-1", "set-by-caller"]})
    );
}

#[tokio::test]
async fn extends_the_id_per_outgoing_call() {
    let downstream = downstream().await;
    let outbound = ServiceBuilder::new()
        .layer(OutboundCorrelationLayer::new().extend_per_call(true))
        .service(client());
    let app = Router::new()
        .route("/", get(fan_out))
        .with_state((outbound, format!("http://{downstream}/echo")))
        .layer(CorrelationLayer::new());
    let addr = serve(app).await;
    let client = client();

    let reply = send(
        &client,
        "GET",
        format!("http://{addr}/"),
        &[(X_CORRELATION_ID, "parent-1")],
        "",
    )
    .await;
    assert_eq!(
        reply.json(),
        json!({"id": "parent-1", "calls": ["parent-1.1", "parent-1.2", "set-by-caller"]})
    );

    // A new request with the same parent ID numbers its children afresh.
    let again = send(
        &client,
        "GET",
        format!("http://{addr}/"),
        &[(X_CORRELATION_ID, "parent-1")],
        "",
    )
    .await;
    assert_eq!(again.json()["calls"][0], "parent-1.1");
}

#[tokio::test]
async fn the_extractor_without_the_layer_is_a_clear_500() {
    let app = Router::new()
        .route("/", get(|id: CorrelationId| async move { id.to_string() }))
        .route(
            "/optional",
            get(|id: Option<CorrelationId>| async move { format!("{id:?}") }),
        );
    let addr = serve(app).await;
    let client = client();

    let reply = send(&client, "GET", format!("http://{addr}/"), &[], "").await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(reply.json()["code"], "correlation_id.not_installed");

    let optional = send(&client, "GET", format!("http://{addr}/optional"), &[], "").await;
    assert_eq!(optional.text(), "None");
}

#[tokio::test]
async fn a_custom_validator_and_generator_and_span() {
    let (logs, _guard) = Logs::capture();
    let layer = CorrelationLayer::new()
        .validator(|id: &str| {
            id.starts_with("tenant-").then_some(()).ok_or(
                tower_ids::correlation::CorrelationIdError::custom("no_tenant_prefix"),
            )
        })
        .make_id(|_: &http::Request<axum::body::Body>| {
            CorrelationId::parse("tenant-generated").unwrap()
        })
        .make_span(
            |request: &http::Request<axum::body::Body>, id: &CorrelationId| {
                tracing::info_span!(
                    "request",
                    correlation_id = id.as_str(),
                    path = request.uri().path()
                )
            },
        );
    let addr = serve(Router::new().route("/", get(report)).layer(layer)).await;

    let reply = send(
        &client(),
        "GET",
        format!("http://{addr}/"),
        &[(X_CORRELATION_ID, "abc")],
        "",
    )
    .await;

    assert_eq!(reply.header(X_CORRELATION_ID), Some("tenant-generated"));
    assert_eq!(
        logs.events("correlation.invalid")[0]["fields"]["reason"],
        "no_tenant_prefix",
        "{}",
        logs.raw()
    );
    let handled = &logs.events("test.handled")[0];
    assert_eq!(handled["span"]["name"], "request");
    assert_eq!(handled["span"]["path"], "/");
    assert_eq!(handled["span"]["correlation_id"], "tenant-generated");
}

#[tokio::test]
async fn works_on_a_plain_hyper_server() {
    use hyper_util::{rt::TokioIo, server::conn::auto, service::TowerToHyperService};

    let service = ServiceBuilder::new()
        .layer(CorrelationLayer::new())
        .service_fn(|request: http::Request<hyper::body::Incoming>| async move {
            let id = request
                .extensions()
                .get::<CorrelationId>()
                .cloned()
                .unwrap();
            let body = http_body_util::Full::new(bytes::Bytes::from(id.to_string()));
            Ok::<_, std::convert::Infallible>(http::Response::new(body))
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                    .unwrap();
            });
        }
    });

    let reply = send(
        &client(),
        "GET",
        format!("http://{addr}/"),
        &[(X_CORRELATION_ID, "from-hyper")],
        "",
    )
    .await;

    assert_eq!(reply.header(X_CORRELATION_ID), Some("from-hyper"));
    assert_eq!(reply.text(), "from-hyper");
}
