//! Replicas of one service for the store tests: each an axum server on 127.0.0.1 whose
//! `POST /commands` runs a counting handler behind an idempotency layer of its own, and
//! a [`Ledger`] they share that counts every run per key.
//!
//! For the tests that run several replicas on one store (the Redis and PostgreSQL
//! crates'), behind the `replica` feature; it serves and calls them with this crate's
//! server and client.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{
    extract::State, http::HeaderMap, response::Response, routing::post, routing::MethodRouter,
    Router,
};
use http::StatusCode;
use serde_json::json;
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{store::IdempotencyStore, IdempotencyLayer},
};

use crate::{client, serve, try_send, HttpClient, Reply};

/// How many times the handler ran, per idempotency key, over every replica (or consumer)
/// that shares it.
#[derive(Clone, Default)]
pub struct Ledger(Arc<Mutex<HashMap<String, usize>>>);

impl Ledger {
    /// How many times `key` ran so far.
    pub fn runs(&self, key: &str) -> usize {
        self.0.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    /// Counts a run of `key`; returns which run it is (1 for the first).
    pub fn count(&self, key: &str) -> usize {
        let mut runs = self.0.lock().unwrap();
        let runs = runs.entry(key.to_owned()).or_default();
        *runs += 1;
        *runs
    }

    /// Every key that ran, with its runs.
    pub fn per_key(&self) -> HashMap<String, usize> {
        self.0.lock().unwrap().clone()
    }

    /// Polls until `key` has started running (5 s at most); returns when it had.
    pub async fn started(&self, key: &str) -> Instant {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.runs(key) == 0 {
            assert!(Instant::now() < deadline, "the handler never started");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Instant::now()
    }
}

/// The replicas' handler: counts its run under the request's `idempotency-key`, sleeps
/// `x-delay-ms` if sent, and answers as [`created`].
pub async fn counted(State(ledger): State<Ledger>, headers: HeaderMap) -> Response {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let run = ledger.count(&key);
    if let Some(ms) = headers.get("x-delay-ms") {
        let ms = ms.to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    created(&key, run)
}

/// `201 Created`, `{"key": key, "run": run}`: what a counted handler answers.
pub fn created(key: &str, run: usize) -> Response {
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(
            json!({ "key": key, "run": run }).to_string(),
        ))
        .unwrap()
}

/// One replica: its own layer (and so its own store client) and its own server.
#[derive(Clone)]
pub struct Replica {
    /// `http://127.0.0.1:PORT/commands`
    pub url: String,
    client: HttpClient,
}

impl Replica {
    /// Serves [`counted`] behind `layer` on `POST /commands`, inside a correlation layer.
    pub async fn start<S: IdempotencyStore>(layer: IdempotencyLayer<S>, ledger: &Ledger) -> Self {
        Self::serve(post(counted).layer(layer), ledger).await
    }

    /// Serves `route` (a handler of the test's own, behind its layer) on `/commands`,
    /// inside a correlation layer, with `ledger` as its state.
    pub async fn serve(route: MethodRouter<Ledger>, ledger: &Ledger) -> Self {
        let router = Router::new()
            .route("/commands", route)
            .with_state(ledger.clone())
            .layer(CorrelationLayer::new());
        Self {
            url: format!("http://{}/commands", serve(router).await),
            client: client(),
        }
    }

    /// Sends `key` with a JSON body `{}`; `None` if the connection failed or closed
    /// before the answer.
    pub async fn post(&self, key: &str) -> Option<Reply> {
        self.send(key, None).await.ok()
    }

    /// Sends `key` with a JSON body `{}`, asking the handler to take `delay`
    /// (`x-delay-ms`) if given.
    pub async fn send(
        &self,
        key: &str,
        delay: Option<Duration>,
    ) -> Result<Reply, Box<dyn std::error::Error + Send + Sync>> {
        let delay = delay.map(|d| d.as_millis().to_string());
        let mut headers = vec![
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ];
        if let Some(delay) = &delay {
            headers.push(("x-delay-ms", delay));
        }
        try_send(&self.client, "POST", self.url.clone(), &headers, "{}").await
    }
}
