//! What `benches/idempotency.rs` and `benches/instructions.rs` share: the request they
//! send, the handler behind every row, and the `axum-idempotent` app they measure
//! against, set up as its README says, with its sessions.
//!
//! axum-idempotent keeps responses in the caller's session, so its layer needs
//! `CookieManagerLayer` and `ruts::SessionLayer` around it and a session cookie on
//! every request (a request without a session is never cached). Direct key mode
//! (`idempotency-key`), TTL 24 h, the session cookie's `Max-Age` 24 h too.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::{body::Body, routing::post, Router};
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use bytes::Bytes;
use http::{header, HeaderValue, Request, StatusCode};
use ruts::{
    store::{moka::MokaStore as SessionMokaStore, SessionStore, Ttl},
    CookieOptions, Session, SessionLayer,
};
use tower::ServiceExt;
use tower_cookies::CookieManagerLayer;

/// The route every row serves.
pub(crate) const PATH: &str = "/commands";
/// The body every request sends.
pub(crate) const REQUEST_BODY: &str =
    r#"{"command":"transfer","from":"acc-1","to":"acc-2","amount":100}"#;
/// The key header, ours and axum-idempotent's (in its direct key mode).
pub(crate) const KEY_HEADER: &str = "idempotency-key";
/// The session cookie's name.
pub(crate) const SESSION_COOKIE: &str = "session";
const TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// A fresh key per `n`: the same formatting work in every row.
pub(crate) fn key(n: u64) -> HeaderValue {
    HeaderValue::try_from(format!("bench-{n:016x}")).expect("visible ASCII")
}

/// A POST of [`REQUEST_BODY`] to [`PATH`] with `key` and a session `cookie`.
pub(crate) fn request(key: HeaderValue, cookie: &HeaderValue) -> Request<Body> {
    Request::post(PATH)
        .header(header::CONTENT_TYPE, "application/json")
        .header(KEY_HEADER, key)
        .header(header::COOKIE, cookie.clone())
        .body(Body::from(REQUEST_BODY))
        .expect("valid request")
}

/// The handler: reads the JSON body, counts its runs, answers 201 with `size` bytes.
pub(crate) fn route(size: usize) -> (axum::routing::MethodRouter, Arc<AtomicU64>) {
    let runs = Arc::new(AtomicU64::new(0));
    let counter = runs.clone();
    let body = Bytes::from(vec![b'x'; size]);
    let handler = post(move |request: Bytes| {
        let runs = counter.clone();
        let body = body.clone();
        async move {
            assert_eq!(request.len(), REQUEST_BODY.len(), "request body intact");
            runs.fetch_add(1, Ordering::Relaxed);
            (
                StatusCode::CREATED,
                [(header::CONTENT_TYPE, "application/octet-stream")],
                body,
            )
        }
    });
    (handler, runs)
}

/// `route` at `path` behind axum-idempotent, plus `POST /session`, which starts a
/// session; and the session store, to end sessions with.
pub(crate) fn their_app(
    path: &str,
    route: axum::routing::MethodRouter,
) -> (Router, Arc<SessionMokaStore>) {
    let store = Arc::new(SessionMokaStore::builder().build());
    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some(KEY_HEADER), false)
        .expire_after(TTL.as_secs() as i64);
    let cookie = CookieOptions::build()
        .name(SESSION_COOKIE)
        .max_age(TTL.as_secs())
        .path("/");
    let app = Router::new()
        .route(path, route)
        .route(
            "/session",
            post(|session: Session<SessionMokaStore>| async move {
                let ttl = Ttl::new(TTL.as_secs() as i64).expect("valid TTL");
                session.set("user", &"bench", ttl, None).await.expect("set");
                StatusCode::NO_CONTENT
            }),
        )
        .layer(IdempotentLayer::<SessionMokaStore>::new(options))
        .layer(SessionLayer::new(store.clone()).with_cookie_options(cookie))
        .layer(CookieManagerLayer::new());
    (app, store)
}

/// Logs in: a request that writes a session field; returns the `cookie` to send.
pub(crate) async fn start_session(app: &Router) -> HeaderValue {
    let request = Request::post("/session")
        .body(Body::empty())
        .expect("valid");
    let response = app.clone().oneshot(request).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::NO_CONTENT, "session started");
    let set_cookie = response
        .headers()
        .get_all(header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with("session="))
        .expect("session cookie");
    let pair = set_cookie.split(';').next().expect("name=value");
    HeaderValue::from_str(pair).expect("cookie")
}

/// Ends the session `cookie` names.
pub(crate) async fn end_session(store: &SessionMokaStore, cookie: &HeaderValue) {
    let id = cookie.to_str().expect("ASCII")[SESSION_COOKIE.len() + 1..]
        .parse()
        .expect("session id");
    store.delete(&id).await.expect("delete");
}
