//! Every answer the layer writes for a covered call, in its transport's form: the
//! headers each carries (`idempotent-replayed`, the key and the attempt ID echoed),
//! refusals, the engine's answers and replays. The answers' text is the engine's
//! ([`Answer`]), the same for every transport.

use std::sync::Arc;

use http::{HeaderValue, Response};

use crate::body::Body;
use crate::idempotency::{
    core::{self, Answer},
    response::{echo, http_date, replay_headers},
    store::Record,
    transport::{Settings, Transport},
    AttemptId, Code, IdempotencyKey, IDEMPOTENCY_FIRST_SEEN, IDEMPOTENCY_REQUEST_COUNT,
};

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
    /// set them.
    pub(crate) fn finish<B>(self, mut response: Response<B>) -> Response<B> {
        echo(response.headers_mut(), false, self.key, self.attempt);
        response
    }

    /// The engine's `answer`, in the transport's form: a work in flight says when it
    /// arrived and how many requests came with the key; a duplicate that cannot be
    /// replayed, when the work ran and as which attempt.
    pub(crate) fn answer<B>(self, mut answer: Answer) -> Response<Body<B>> {
        let (first_seen, request_count) = (answer.first_seen, answer.request_count);
        let record = answer.record.take();
        let mut response = self.finish(T::render(self.settings, self.key, answer));
        let headers = response.headers_mut();
        match (record, request_count) {
            (Some(record), Some(request_count)) => {
                replay_headers(headers, &record, request_count);
            }
            (_, request_count) => {
                if let Some(first_seen) = first_seen {
                    headers.insert(IDEMPOTENCY_FIRST_SEEN, http_date(first_seen));
                }
                if let Some(request_count) = request_count {
                    headers.insert(IDEMPOTENCY_REQUEST_COUNT, HeaderValue::from(request_count));
                }
            }
        }
        response
    }

    /// A refusal before the engine is asked: counted and logged (WARN
    /// `idempotency.rejected` with `reason`), then answered.
    pub(crate) fn refuse<B>(
        self,
        reason: &'static str,
        code: Code,
        detail: String,
    ) -> Response<Body<B>> {
        core::refusal::rejected(reason, code, &detail, T::answered(code));
        self.answer(Answer::new(code, detail, None))
    }

    /// The stored response of a duplicate, marked as replayed; or, if this transport
    /// cannot decode it, the answer for an outcome that is not replayable.
    pub(crate) fn replay<B>(self, record: Arc<Record>, request_count: u64) -> Response<Body<B>> {
        let Some(mut response) = T::replay(self.settings, &record, request_count) else {
            core::replay_failed(request_count);
            return self.answer(Answer::not_replayable(T::NOUN, record, request_count));
        };
        let headers = response.headers_mut();
        replay_headers(headers, &record, request_count);
        echo(headers, true, self.key, self.attempt);
        response
    }
}
