//! The `/load/*` routes of `--load-routes`, for `benches/load.sh`.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{
    body::Bytes,
    extract::{Query, State},
    http::StatusCode,
    Json,
};
use serde::Deserialize;

/// The `/load/*` routes, for `benches/load.sh` (`--load-routes`): the same handler on
/// every route, so that the difference between two routes is the layers around it.
///
/// | Route | Layers |
/// |---|---|
/// | `POST /load/bare` | none |
/// | `POST /load/noop` | a layer that does nothing (`MapRequestLayer` with the identity): what wrapping a route costs |
/// | `POST /load/tower-http` | tower-http's `SetRequestIdLayer` (UUIDv4 in `x-request-id`) and `PropagateRequestIdLayer`, the peer of `CorrelationLayer` |
/// | `POST /load/correlated` | `CorrelationLayer` |
/// | `POST /load/idempotent` | `CorrelationLayer`, then `IdempotencyLayer` (key required, client `x-api-key`, the commands' store) |
/// | `GET /load/logged` | `CorrelationLayer` with its access line (`access_log`), as the service's routes have |
/// | `POST /load/logged` | the same, then `IdempotencyLayer` as on `/load/idempotent` |
/// | `GET /load/executions` | none; how many times the handler has run, in total |
///
/// The handler reads the whole request body, sleeps `?sleep_ms=` if given (so that a
/// burst of duplicates overlaps the first run), counts the run and answers `201` with a
/// small JSON body naming the run.
#[derive(Clone, Default)]
pub(crate) struct LoadState {
    executions: Arc<AtomicU64>,
}

#[derive(Deserialize)]
pub(crate) struct LoadParams {
    sleep_ms: Option<u64>,
}

pub(crate) async fn load_handler(
    State(load): State<LoadState>,
    Query(params): Query<LoadParams>,
    body: Bytes,
) -> (StatusCode, Json<serde_json::Value>) {
    if let Some(ms) = params.sleep_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let run = load.executions.fetch_add(1, Ordering::Relaxed) + 1;
    let answer = serde_json::json!({ "run": run, "received_bytes": body.len() });
    (StatusCode::CREATED, Json(answer))
}

pub(crate) async fn load_executions(State(load): State<LoadState>) -> String {
    load.executions.load(Ordering::Relaxed).to_string()
}
