//! Every answer the layer writes for a covered call, in its transport's form: the
//! headers each carries (`idempotent-replayed`, the key and the attempt ID echoed),
//! refusals, the engine's verdicts and replays. Each code's text is written here once.

use std::time::{Duration, SystemTime};

use http::{HeaderValue, Response};

use super::{Answer, Settings, Transport};
use crate::body::Body;
use crate::idempotency::{
    core::{self, Unsettled, Verdict},
    response::{echo, http_date, replay_headers},
    store::Record,
    AttemptId, Code, IdempotencyKey, IDEMPOTENCY_FIRST_SEEN, IDEMPOTENCY_REQUEST_COUNT,
};

/// The wait a client is asked for before it retries a call nothing ran for.
const RETRY_LATER: Duration = Duration::from_secs(1);

/// Whom an answer is for: the key the call sent (echoed, and named in problem
/// details) and its attempt ID (echoed). Either is `None` before it is read, or when
/// the call has none.
pub(crate) struct Reply<'a, T> {
    pub(crate) settings: &'a Settings<T>,
    pub(crate) key: Option<&'a IdempotencyKey>,
    pub(crate) attempt: Option<&'a AttemptId>,
}

impl<T> Clone for Reply<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Reply<'_, T> {}

impl<T: Transport> Reply<'_, T> {
    /// The headers every answer of a covered call carries when it is not a replay:
    /// `idempotent-replayed: false`, the attempt ID, and the key, unless the handler
    /// set that header itself.
    pub(crate) fn finish<B>(self, mut response: Response<B>) -> Response<B> {
        echo(response.headers_mut(), false, self.key, self.attempt);
        response
    }

    /// `code` answered with `detail`, finished.
    pub(crate) fn answer<B>(
        self,
        code: Code,
        detail: String,
        retry_after: Option<Duration>,
    ) -> Response<Body<B>> {
        let answer = Answer {
            key: self.key,
            code,
            detail,
            retry_after,
        };
        self.finish(T::render(self.settings, answer))
    }

    /// A refusal before the engine is asked, with its WARN event `idempotency.rejected`;
    /// `detail` is the layer's own text, never the call's.
    pub(crate) fn refuse<B>(
        self,
        reason: &'static str,
        code: Code,
        detail: String,
    ) -> Response<Body<B>> {
        core::refusal::rejected(reason, code, &detail, T::answered(code));
        self.answer(code, detail, None)
    }

    /// The answer to a body over `max` bytes.
    pub(crate) fn body_too_large<B>(self, max: usize) -> Response<Body<B>> {
        let detail = format!(
            "an idempotent {} body may be at most {max} bytes; nothing ran",
            T::NOUN
        );
        self.answer(Code::BodyTooLarge, detail, None)
    }

    /// The answer to a call the byte budget cannot take now.
    pub(crate) fn overloaded<B>(self) -> Response<Body<B>> {
        let detail = format!(
            "the server holds as many {} bodies as it can right now, so it ran nothing; retry later",
            T::NOUN
        );
        self.answer(Code::Overloaded, detail, Some(RETRY_LATER))
    }

    /// The answer to a body that failed mid-read.
    pub(crate) fn body_unreadable<B>(self) -> Response<Body<B>> {
        let detail = format!("the {} body could not be read to the end", T::NOUN);
        self.answer(Code::BodyUnreadable, detail, None)
    }

    /// The answer to a handler whose response failed mid-read.
    pub(crate) fn response_failed<B>(self) -> Response<Body<B>> {
        let detail =
            "the response could not be produced; nothing was stored, so a retry runs again";
        self.answer(Code::ResponseFailed, detail.into(), None)
    }

    /// The answer when the handler's outcome does not stand, or may not:
    /// `not_committed` only when nothing was committed; `outcome_unknown` when the
    /// commit's answer was lost and the store could not tell whether it landed. A retry
    /// with the same key is safe either way: it replays what committed, or runs again
    /// once nothing holds the key.
    pub(crate) fn unsettled<B>(self, unsettled: &Unsettled) -> Response<Body<B>> {
        let noun = T::NOUN;
        let (code, detail) = match unsettled {
            Unsettled::NotCommitted(error) => (
                Code::NotCommitted,
                format!("the {noun}'s transaction did not commit ({error}); nothing it wrote stands; retry with the same key"),
            ),
            Unsettled::Unknown(error) => (
                Code::OutcomeUnknown,
                format!("the {noun} ran, but whether its transaction committed is not known ({error}); retry with the same key: it replays the outcome if it committed, and runs again if it did not"),
            ),
        };
        self.answer(code, detail, Some(RETRY_LATER))
    }

    /// The handler failed on a passing fault: nothing is kept, and the key is free.
    pub(crate) fn handler_unavailable<B>(self) -> Response<Body<B>> {
        let noun = T::NOUN;
        let detail = format!("the {noun}'s handler failed on a passing fault (its database unavailable, or its transaction in conflict); nothing of it is kept; retry with the same key");
        self.answer(Code::HandlerUnavailable, detail, Some(RETRY_LATER))
    }

    /// The answer the engine decided on instead of running the handler.
    pub(crate) fn decided<B>(self, verdict: Verdict) -> Response<Body<B>> {
        let noun = T::NOUN;
        match verdict {
            Verdict::Replay {
                record,
                request_count,
            } => self.replay(&record, request_count),
            Verdict::NotReplayable {
                record,
                request_count,
            } => self.not_replayable(&record, request_count),
            Verdict::InFlight {
                first_seen,
                request_count,
                retry_after,
            } => self.in_flight(first_seen, request_count, retry_after),
            Verdict::Conflict => self.answer(
                Code::FingerprintMismatch,
                format!("this idempotency key was used with a different {noun}; use a new key for a new {noun}"),
                None,
            ),
            Verdict::EpochMismatch {
                recorded,
                requested,
            } => {
                let describe =
                    |epoch: Option<u64>| epoch.map_or_else(|| "none".to_owned(), |e| e.to_string());
                let detail = format!(
                    "this idempotency key belongs to epoch {}, the {noun} to epoch {}; derive a new key in the current epoch",
                    describe(recorded),
                    describe(requested)
                );
                self.answer(Code::EpochMismatch, detail, None)
            }
            Verdict::OriginalFailed => self.answer(
                Code::OriginalFailed,
                format!("the {noun} with this key that was running failed and stored nothing; retry to run it again"),
                Some(RETRY_LATER),
            ),
            Verdict::StoreUnavailable => self.answer(
                Code::StoreUnavailable,
                "the server cannot check this idempotency key now, so it ran nothing; retry later".into(),
                Some(RETRY_LATER),
            ),
            Verdict::PoolExhausted => self.answer(
                Code::PoolExhausted,
                format!("every database connection is in use, so this {noun} ran nothing; retry later"),
                Some(RETRY_LATER),
            ),
        }
    }

    fn in_flight<B>(
        self,
        first_seen: Option<SystemTime>,
        request_count: Option<u64>,
        retry_after: Duration,
    ) -> Response<Body<B>> {
        let detail = format!(
            "a {} with this idempotency key is still running; retry after the delay to get its response",
            T::NOUN
        );
        let mut response = self.answer(Code::InFlight, detail, Some(retry_after));
        let headers = response.headers_mut();
        if let Some(first_seen) = first_seen {
            headers.insert(IDEMPOTENCY_FIRST_SEEN, http_date(first_seen));
        }
        if let Some(request_count) = request_count {
            headers.insert(IDEMPOTENCY_REQUEST_COUNT, HeaderValue::from(request_count));
        }
        response
    }

    /// The answer to a duplicate of a call whose response was not kept.
    fn not_replayable<B>(self, record: &Record, request_count: u64) -> Response<Body<B>> {
        let detail = format!(
            "the {} with this idempotency key ran, but its response was too large to keep for replay; it will not run again",
            T::NOUN
        );
        let mut response = self.answer(Code::NotReplayable, detail, None);
        replay_headers(response.headers_mut(), record, request_count);
        response
    }

    /// The stored response, for a duplicate of a call that completed.
    fn replay<B>(self, record: &Record, request_count: u64) -> Response<Body<B>> {
        // An outcome this layer cannot read: never run it again.
        let Some(mut response) = T::replay(self.settings, record, request_count) else {
            core::replay_failed(request_count);
            return self.not_replayable(record, request_count);
        };
        let headers = response.headers_mut();
        replay_headers(headers, record, request_count);
        echo(headers, true, self.key, self.attempt);
        response
    }
}
