//! Every response the layer writes for a protected route: the headers each carries
//! (`idempotent-replayed`, the key and the attempt ID echoed), refusals, the engine's
//! verdicts, and replays of a stored record. Problem details are built here and only
//! here, each naming the request's key.

use std::time::{Duration, SystemTime};

use http::{header, HeaderValue, Response};

use super::{layer::Settings, replay, stored::StoredResponse};
use crate::idempotency::{
    client::ClientRejection,
    core::{self, ReplayInfo, Unsettled, Verdict},
    response::{echo, http_date, replay_headers},
    store::Record,
    AttemptId, Code, IdempotencyKey, InvalidIdempotencyKey, IDEMPOTENCY_EXPIRES,
    IDEMPOTENCY_FIRST_SEEN, IDEMPOTENCY_REQUEST_COUNT,
};
use crate::{body::Body, problem::Problem};

/// Whom an answer is for: the key the request sent (echoed, and named in problem
/// details) and its attempt ID (echoed). Either is `None` before it is read, or when
/// the request has none.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Reply<'a> {
    pub(super) key: Option<&'a IdempotencyKey>,
    pub(super) attempt: Option<&'a AttemptId>,
    /// The base of problem types the layer was given, if any.
    pub(super) docs: Option<&'a str>,
}

impl<'a> Reply<'a> {
    /// The reply of a layer with `settings` (its problems link to its docs) to a
    /// request with `key` and `attempt`.
    pub(super) fn new(
        settings: &'a Settings,
        key: Option<&'a IdempotencyKey>,
        attempt: Option<&'a AttemptId>,
    ) -> Self {
        Self {
            key,
            attempt,
            docs: settings.problem_docs.as_deref(),
        }
    }
}

impl Reply<'_> {
    /// The headers every response of a protected route carries when it is not a
    /// replay: `idempotent-replayed: false`, the attempt ID, and the key, unless the
    /// handler set that header itself.
    pub(super) fn finish<B>(self, mut response: Response<B>) -> Response<B> {
        echo(response.headers_mut(), false, self.key, self.attempt);
        response
    }

    /// `problem` as the response, naming the key.
    fn problem<B>(self, problem: Problem) -> Response<Body<B>> {
        problem
            .docs(self.docs)
            .idempotency_key(self.key)
            .into_response()
    }

    /// `problem` with `Retry-After`, finished.
    fn retry_later<B>(self, problem: Problem, retry_after: Duration) -> Response<Body<B>> {
        self.finish(with_retry_after(self.problem(problem), retry_after))
    }

    /// The `400` for an idempotency key or attempt ID the layer cannot accept.
    pub(super) fn reject_key<B>(self, error: &InvalidIdempotencyKey) -> Response<Body<B>> {
        self.refuse(error.reason(), error.refusal(), error.to_string())
    }

    /// The `400` for a request whose client cannot be told (two different API keys).
    pub(super) fn reject_client<B>(self, error: &ClientRejection) -> Response<Body<B>> {
        // Fixed text or a configured header name, never what the request sent.
        self.refuse(
            error.logged_reason(),
            Code::ClientInvalid,
            error.to_string(),
        )
    }

    /// A refusal of a request before the engine is asked, with its WARN event;
    /// `detail` is the layer's own text, never the request's.
    pub(super) fn refuse<B>(
        self,
        reason: &'static str,
        code: Code,
        detail: String,
    ) -> Response<Body<B>> {
        core::refusal::rejected(reason, code, &detail, Some(code.http_status().as_u16()));
        self.finish(self.problem(Problem::idempotency(code, detail)))
    }

    /// The `413` for a request body over `max` bytes.
    pub(super) fn body_too_large<B>(self, max: usize) -> Response<Body<B>> {
        let problem = Problem::idempotency(
            Code::BodyTooLarge,
            format!("an idempotent request body may be at most {max} bytes"),
        );
        self.finish(self.problem(problem))
    }

    /// The `503` for a request the byte budget cannot take now.
    pub(super) fn overloaded<B>(self) -> Response<Body<B>> {
        let problem = Problem::idempotency(
                Code::Overloaded,
                "the server holds as many request bodies as it can right now, so it ran nothing; retry later",
        );
        self.retry_later(problem, Duration::from_secs(1))
    }

    /// The `400` for a request body that failed mid-read.
    pub(super) fn body_unreadable<B>(self) -> Response<Body<B>> {
        let problem = Problem::idempotency(
            Code::BodyUnreadable,
            "the request body could not be read to the end",
        );
        self.finish(self.problem(problem))
    }

    /// The answer the engine decided on instead of running the handler.
    pub(super) fn decided<B>(self, verdict: Verdict, settings: &Settings) -> Response<Body<B>> {
        match verdict {
            Verdict::Replay {
                record,
                request_count,
            } => self.replay(&record, request_count, settings),
            Verdict::NotReplayable {
                record,
                request_count,
            } => self.not_replayable(&record, request_count),
            Verdict::InFlight {
                first_seen,
                request_count,
                retry_after,
            } => self.in_flight(first_seen, request_count, retry_after),
            Verdict::Conflict => self.finish(self.problem(Problem::idempotency(
                Code::FingerprintMismatch,
                "this idempotency key was used with a different request (method, path, query, content type or body); use a new key for a new request",
            ))),
            Verdict::EpochMismatch {
                recorded,
                requested,
            } => self.epoch_mismatch(recorded, requested),
            Verdict::OriginalFailed => self.retry_later(
                Problem::idempotency(
                Code::OriginalFailed,
                "the request with this key that was running failed and stored nothing; retry to run it again",
                ),
                Duration::from_secs(1),
            ),
            Verdict::StoreUnavailable => self.retry_later(
                Problem::idempotency(
                Code::StoreUnavailable,
                "the server cannot check this idempotency key now, so it ran nothing; retry later",
                ),
                Duration::from_secs(1),
            ),
            Verdict::PoolExhausted => self.retry_later(
                Problem::idempotency(
                Code::PoolExhausted,
                "every database connection is in use, so this request ran nothing; retry later",
                ),
                Duration::from_secs(1),
            ),
        }
    }

    fn epoch_mismatch<B>(self, recorded: Option<u64>, requested: Option<u64>) -> Response<Body<B>> {
        let describe =
            |epoch: Option<u64>| epoch.map_or_else(|| "none".to_owned(), |e| e.to_string());
        let problem = Problem::idempotency(
                Code::EpochMismatch,
                format!(
                "this idempotency key belongs to epoch {}, the request to epoch {}; derive a new key in the current epoch",
                describe(recorded),
                describe(requested)
            ),
        );
        self.finish(self.problem(problem))
    }

    fn in_flight<B>(
        self,
        first_seen: Option<SystemTime>,
        request_count: Option<u64>,
        retry_after: Duration,
    ) -> Response<Body<B>> {
        let problem = Problem::idempotency(
                Code::InFlight,
                "a request with this idempotency key is still running; retry after the delay to get its response",
        );
        let mut response = self.retry_later(problem, retry_after);
        let headers = response.headers_mut();
        if let Some(first_seen) = first_seen {
            headers.insert(IDEMPOTENCY_FIRST_SEEN, http_date(first_seen));
        }
        if let Some(request_count) = request_count {
            headers.insert(IDEMPOTENCY_REQUEST_COUNT, HeaderValue::from(request_count));
        }
        response
    }

    /// The `410` for a duplicate of a request whose response was too large to keep.
    fn not_replayable<B>(self, record: &Record, request_count: u64) -> Response<Body<B>> {
        let problem = Problem::idempotency(
                Code::NotReplayable,
                "the request with this idempotency key ran, but its response was too large to keep for replay; it will not run again",
        );
        let mut response = self.problem(problem);
        replay_headers(response.headers_mut(), record, request_count);
        self.finish(response)
    }

    /// The stored response, for a duplicate of a request that completed.
    fn replay<B>(
        self,
        record: &Record,
        request_count: u64,
        settings: &Settings,
    ) -> Response<Body<B>> {
        // An outcome this layer cannot read: never run it again.
        let stored = record.payload.as_ref().and_then(StoredResponse::of);
        let Some(stored) = stored else {
            core::replay_failed(request_count);
            return self.not_replayable(record, request_count);
        };
        let mut response = Response::new(stored.body.clone());
        *response.status_mut() = stored.status;
        let headers = response.headers_mut();
        headers.reserve(stored.headers.len() + 5);
        for (name, value) in &stored.headers {
            if !settings.not_replayed.contains(name) {
                headers.append(name.clone(), value.clone());
            }
        }
        // The route's hook adjusts this copy; the stored record stays as it is.
        if let Some(hook) = &settings.on_replay {
            let info = ReplayInfo::of(record, request_count);
            response = replay::apply(&**hook, response, &info);
        }
        let mut response = response.map(Body::complete);
        let headers = response.headers_mut();
        replay_headers(headers, record, request_count);
        if let Some(expires_at) = record.expires_at.filter(|_| settings.expiry_header) {
            headers
                .entry(IDEMPOTENCY_EXPIRES)
                .or_insert_with(|| http_date(expires_at));
        }
        echo(headers, true, self.key, self.attempt);
        response
    }

    /// The `500` for a handler whose response body failed mid-read.
    pub(super) fn response_failed<B>(self) -> Response<Body<B>> {
        self.finish(self.problem(Problem::idempotency(
            Code::ResponseFailed,
            "the response could not be produced; nothing was stored, so a retry runs again",
        )))
    }

    /// The answer when the handler's outcome does not stand, or may not:
    /// `not_committed` only when nothing was committed; `outcome_unknown` when the
    /// commit's answer was lost and the store could not tell whether it landed. A retry
    /// with the same key is safe either way: it replays what committed, or runs again
    /// once nothing holds the key.
    pub(super) fn unsettled<B>(self, unsettled: &Unsettled) -> Response<Body<B>> {
        let problem = match unsettled {
            Unsettled::NotCommitted(error) => Problem::idempotency(
                Code::NotCommitted,
                format!("the request's transaction did not commit ({error}); nothing it wrote stands; retry with the same key"),
            ),
            Unsettled::Unknown(error) => Problem::idempotency(
                Code::OutcomeUnknown,
                format!("the request ran, but whether its transaction committed is not known ({error}); retry with the same key: it replays the outcome if it committed, and runs again if it did not"),
            ),
        };
        self.retry_later(problem, Duration::from_secs(1))
    }
}

fn with_retry_after<B>(mut response: Response<B>, retry_after: Duration) -> Response<B> {
    let seconds = retry_after
        .as_secs()
        .max(u64::from(retry_after.subsec_nanos() > 0));
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    response
}
