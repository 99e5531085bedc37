//! Per-request cost of the correlation layer, side by side with a bare `service_fn` and
//! tower-http's `SetRequestId` + `PropagateRequestId` pair, with no subscriber and with
//! a fmt subscriber writing to `io::sink`.
//!
//! Run: `cargo bench --bench correlation`
#![allow(missing_docs)]

use std::convert::Infallible;

use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion};
use futures_util::FutureExt;
use http::{HeaderName, Request, Response};
use tower::{service_fn, Service, ServiceBuilder};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_ids::correlation::CorrelationLayer;

const HEADER: &str = "x-correlation-id";
const INCOMING: &str = "0193c4a2-7b1e-7cc0-9a51-3f2d6c1e8b47";

fn request(with_id: bool) -> Request<()> {
    let mut builder = Request::builder().uri("/commands");
    if with_id {
        builder = builder.header(HEADER, INCOMING);
    }
    builder.body(()).unwrap()
}

async fn handler(_request: Request<()>) -> Result<Response<&'static str>, Infallible> {
    Ok(Response::new("ok"))
}

/// Calls `service` once per iteration; every service here completes without waiting.
fn run<S, B>(
    group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    mut service: S,
) where
    S: Service<Request<()>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
{
    for (case, with_id) in [("restore", true), ("generate", false)] {
        group.bench_function(format!("{name}/{case}"), |b| {
            b.iter(|| {
                service
                    .call(request(with_id))
                    .now_or_never()
                    .expect("ready at once")
                    .unwrap()
            })
        });
    }
}

fn services(c: &mut Criterion, subscriber: &str) {
    let mut group = c.benchmark_group(format!("correlation/{subscriber}"));
    let header = HeaderName::from_static(HEADER);

    run(&mut group, "bare", service_fn(handler));
    run(
        &mut group,
        "tower_ids",
        ServiceBuilder::new()
            .layer(CorrelationLayer::new())
            .service_fn(handler),
    );
    run(
        &mut group,
        "tower_http",
        ServiceBuilder::new()
            .layer(SetRequestIdLayer::new(header.clone(), MakeRequestUuid))
            .layer(PropagateRequestIdLayer::new(header))
            .service_fn(handler),
    );
    group.finish();
}

fn no_subscriber(c: &mut Criterion) {
    services(c, "no_subscriber");
}

fn fmt_to_sink(c: &mut Criterion) {
    let subscriber = tracing_subscriber::fmt()
        .with_writer(std::io::sink)
        .with_max_level(tracing::Level::INFO)
        .finish();
    tracing::subscriber::with_default(subscriber, || services(c, "fmt_sink"));
}

criterion_group!(benches, no_subscriber, fmt_to_sink);
criterion_main!(benches);
