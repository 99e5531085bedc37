//! Every response the gRPC layer writes: a status with `google.rpc` details where it
//! does not run the call, the stored call where it replays one, and the metadata that
//! says which.

use std::{collections::HashMap, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, Response};
use tonic_types::{ErrorDetails, StatusExt as _};

use super::call::StoredCall;
use crate::body::Body;
use crate::idempotency::{
    core::{self, Unsettled, Verdict},
    response::{echo, replay_headers},
    store::{PayloadFormat, Record},
    AttemptId, Code, IdempotencyKey,
};

/// The `domain` of every `google.rpc.ErrorInfo` the layer answers; its `reason` is the
/// layer's stable code (`idempotency.in_flight`), as the HTTP layer's problems carry it.
pub const ERROR_DOMAIN: &str = "tower-ids";

/// A status the layer answers instead of running the call.
pub(super) struct Refusal {
    code: Code,
    message: String,
    retry_after: Option<Duration>,
}

impl Refusal {
    pub(super) fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    /// With `google.rpc.RetryInfo`: a retry after `delay` can succeed.
    pub(super) fn retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// The answer the engine decided on instead of running the call, but a replay.
    fn decided(verdict: Verdict) -> Self {
        match verdict {
            Verdict::Replay { .. } | Verdict::NotReplayable { .. } => Self::not_replayable(),
            Verdict::InFlight { retry_after, .. } => Self::new(
                Code::InFlight,
                "a call with this idempotency key is still running; retry after the delay to get its response",
            )
            .retry_after(retry_after),
            // gRPC calls carry no epoch; a mismatch is a conflict if it happened.
            Verdict::Conflict | Verdict::EpochMismatch { .. } => Self::new(
                Code::FingerprintMismatch,
                "this idempotency key was used on this method with a different message; use a new key for a new call",
            ),
            Verdict::OriginalFailed => Self::new(
                Code::OriginalFailed,
                "the call with this key that was running failed and stored nothing; retry to run it again",
            )
            .retry_after(Duration::ZERO),
            Verdict::StoreUnavailable => Self::new(
                Code::StoreUnavailable,
                "the server cannot check this idempotency key now, so it ran nothing; retry later",
            )
            .retry_after(Duration::from_secs(1)),
            Verdict::PoolExhausted => Self::new(
                Code::PoolExhausted,
                "every database connection is in use, so this call ran nothing; retry later",
            )
            .retry_after(Duration::from_secs(1)),
        }
    }

    fn not_replayable() -> Self {
        Self::new(
                Code::NotReplayable,
            "the call with this idempotency key ran, but its response was not kept for replay; it will not run again",
        )
    }

    /// The answer when the call's outcome does not stand, or may not.
    pub(super) fn unsettled(unsettled: &Unsettled) -> Self {
        match unsettled {
            Unsettled::NotCommitted(error) => Self::new(
                Code::NotCommitted,
                format!("the call's transaction did not commit ({error}); nothing it wrote stands; retry with the same key"),
            ),
            Unsettled::Unknown(error) => Self::new(
                Code::OutcomeUnknown,
                format!("whether the call's transaction committed is not known ({error}); retry with the same key: it replays the outcome if it committed"),
            ),
        }
        .retry_after(Duration::from_secs(1))
    }

    /// The trailers-only response carrying this status.
    fn into_response<B>(self) -> Response<Body<B>> {
        let mut details =
            ErrorDetails::with_error_info(self.code.as_str(), ERROR_DOMAIN, HashMap::new());
        if let Some(delay) = self.retry_after {
            details.set_retry_info(Some(delay));
        }
        tonic::Status::with_error_details(self.code.grpc(), self.message, details)
            .into_http::<()>()
            .map(|()| Body::complete(Bytes::new()))
    }
}

/// What every response of one protected call echoes.
#[derive(Clone, Copy, Default)]
pub(super) struct Reply<'a> {
    pub(super) key: Option<&'a IdempotencyKey>,
    pub(super) attempt: Option<&'a AttemptId>,
}

impl Reply<'_> {
    /// `response`, marked as not replayed.
    pub(super) fn finish<B>(self, mut response: Response<B>) -> Response<B> {
        self.mark(response.headers_mut(), false);
        response
    }

    fn mark(self, headers: &mut HeaderMap, replayed: bool) {
        echo(headers, replayed, self.key, self.attempt);
    }

    /// A refusal before the engine is asked, with its WARN event; the message is the
    /// layer's own text, never the request's.
    pub(super) fn refuse<B>(self, reason: &'static str, refusal: Refusal) -> Response<Body<B>> {
        core::refusal::rejected(
            reason,
            refusal.code,
            &refusal.message,
            Some(http_status(refusal.code.grpc())),
        );
        self.status(refusal)
    }

    /// `refusal` as the response, marked as not replayed.
    pub(super) fn status<B>(self, refusal: Refusal) -> Response<Body<B>> {
        self.finish(refusal.into_response())
    }

    /// The answer the engine decided on instead of running the call.
    pub(super) fn decided<B>(self, verdict: Verdict) -> Response<Body<B>> {
        match verdict {
            Verdict::Replay {
                record,
                request_count,
            } => self.replay(&record, request_count),
            Verdict::NotReplayable {
                record,
                request_count,
            } => {
                let mut response = self.status(Refusal::not_replayable());
                replay_headers(response.headers_mut(), &record, request_count);
                response
            }
            verdict => self.status(Refusal::decided(verdict)),
        }
    }

    /// The stored call, for a duplicate of one that completed.
    fn replay<B>(self, record: &Record, request_count: u64) -> Response<Body<B>> {
        // A record another transport wrote cannot be told here: never run it again.
        let Some((headers, data, trailers)) = record
            .payload
            .as_ref()
            .filter(|payload| payload.format() == PayloadFormat::GRPC)
            .and_then(|payload| StoredCall::decode(payload.body()))
        else {
            core::replay_failed(request_count);
            let mut response = self.status(Refusal::not_replayable());
            replay_headers(response.headers_mut(), record, request_count);
            return response;
        };
        let mut response = Response::new(Body::with_trailers(data, trailers.map(Box::new)));
        *response.headers_mut() = headers;
        let headers = response.headers_mut();
        replay_headers(headers, record, request_count);
        self.mark(headers, true);
        response
    }
}

/// The HTTP status the gRPC status `code` maps to, as gRPC's HTTP mapping says it: a
/// `5xx` is a server error (a transaction the handler took is rolled back for it, as for
/// the HTTP layer's), and refusals log it as their `status`.
pub(super) fn http_status(code: tonic::Code) -> u16 {
    use tonic::Code;
    match code {
        Code::Ok => 200,
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
        Code::Unauthenticated => 401,
        Code::PermissionDenied => 403,
        Code::NotFound => 404,
        Code::AlreadyExists | Code::Aborted => 409,
        Code::ResourceExhausted => 429,
        Code::Cancelled => 499,
        Code::Unimplemented => 501,
        Code::Unavailable => 503,
        Code::DeadlineExceeded => 504,
        Code::Unknown | Code::Internal | Code::DataLoss => 500,
    }
}
