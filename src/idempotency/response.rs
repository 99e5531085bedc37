//! What every answer of the adapter over HTTP requests and gRPC calls carries: the
//! response future, the headers a replay carries, the headers that belong to one
//! attempt, and where a handler finds the store's transaction.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::SystemTime,
};

use http::{header, header::Entry, Extensions, HeaderMap, HeaderName, HeaderValue, Response};

use crate::body::Body;
use crate::correlation::DEFAULT_HEADER as X_CORRELATION_ID;
use crate::idempotency::{
    core::Detaching, store::Record, store::TransactionOffer, AttemptId, IdempotencyKey, ATTEMPT_ID,
    IDEMPOTENCY_FIRST_SEEN, IDEMPOTENCY_KEY, IDEMPOTENCY_REQUEST_COUNT, IDEMPOTENT_REPLAYED,
    ORIGINAL_ATTEMPT_ID,
};

/// Response future of [`Idempotency`](crate::idempotency::Idempotency), over HTTP and
/// gRPC alike.
///
/// Dropped before it finishes (the client went away) once its request has claimed its
/// key, it hands the rest of its work to a task of its own, in the same span and with
/// the same correlation ID: a handler that started runs to completion and its outcome
/// is stored for the client's retry. Dropped before the claim, it is cancelled, as any
/// future: nothing ran, and the request body stops being read.
pub struct ResponseFuture<B: 'static, E: 'static> {
    pub(crate) work: Detaching<Result<Response<Body<B>>, E>>,
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<Body<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.work).poll(cx)
    }
}

impl<B: 'static, E: 'static> std::fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// The future of a request that claims no key: refused, or passed through.
pub(crate) fn unclaimed<B, E>(
    future: impl Future<Output = Result<Response<Body<B>>, E>> + Send + 'static,
) -> ResponseFuture<B, E> {
    ResponseFuture {
        work: Detaching::new(future),
    }
}

/// The headers that belong to one attempt, not to its outcome: never stored, so a
/// replay carries its own.
pub(crate) fn per_attempt_headers() -> Vec<HeaderName> {
    vec![
        X_CORRELATION_ID,
        ATTEMPT_ID,
        header::DATE,
        ORIGINAL_ATTEMPT_ID,
        IDEMPOTENT_REPLAYED,
        IDEMPOTENCY_FIRST_SEEN,
        IDEMPOTENCY_REQUEST_COUNT,
    ]
}
/// What a duplicate learns of the original: when it came, how many came, which attempt.
pub(crate) fn replay_headers(headers: &mut HeaderMap, record: &Record, request_count: u64) {
    headers.insert(IDEMPOTENCY_FIRST_SEEN, http_date(record.first_seen));
    headers.insert(IDEMPOTENCY_REQUEST_COUNT, HeaderValue::from(request_count));
    if let Some(original) = &record.original_attempt {
        headers.insert(ORIGINAL_ATTEMPT_ID, original.to_header_value());
    }
}

/// `time` as an HTTP-date; the last one formatted on this thread is reused, as replays
/// of one record ask for the same date again and again.
pub(crate) fn http_date(time: SystemTime) -> HeaderValue {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(SystemTime, HeaderValue)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        if let Some((cached, value)) = last.as_ref() {
            if *cached == time {
                return value.clone();
            }
        }
        let value = HeaderValue::from_str(&httpdate::fmt_http_date(time))
            .unwrap_or_else(|_| HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT"));
        *last = Some((time, value.clone()));
        value
    })
}

/// Puts the store's transaction where a handler finds it: the request's extensions,
/// as the store's own type (the PostgreSQL store's `Transaction`), and as the
/// [`TransactionOffer`] itself for a store of another kind.
pub(crate) fn offer_transaction(offer: TransactionOffer, extensions: &mut Extensions) {
    #[cfg(feature = "postgres")]
    if let Some(transaction) = offer.get::<crate::idempotency::store::Transaction>() {
        extensions.insert(transaction.clone());
    }
    extensions.insert(offer);
}

/// What every answer of a protected route carries: whether it was replayed, the
/// attempt ID echoed, and the key echoed unless the handler set `idempotency-key`
/// itself.
pub(crate) fn echo(
    headers: &mut HeaderMap,
    replayed: bool,
    key: Option<&IdempotencyKey>,
    attempt: Option<&AttemptId>,
) {
    let replayed = if replayed { "true" } else { "false" };
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static(replayed));
    if let Some(attempt) = attempt {
        headers.insert(ATTEMPT_ID, attempt.to_header_value());
    }
    if let Some(key) = key {
        if let Entry::Vacant(entry) = headers.entry(IDEMPOTENCY_KEY) {
            entry.insert(key.to_header_value());
        }
    }
}
