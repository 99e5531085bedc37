//! What a keyed request or message gets instead of its handler's output, in the
//! layer's own words: each answer's code, its text (written once, for every transport,
//! naming the transport's noun) and when to come back. The adapter renders it: a
//! problem document, a gRPC status, a refusal its consumer driver settles.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use super::{claimed::Uncommitted, decide::Verdict};
use crate::{store::Record, Code};

/// When to come back after an answer that a retry can change but that names no delay
/// of its own.
const RETRY_LATER: Duration = Duration::from_secs(1);

/// An answer in place of the handler's output.
#[derive(Debug)]
pub struct Answer {
    pub code: Code,
    /// The layer's text, never the request's.
    pub detail: String,
    pub retry_after: Option<Duration>,
    /// Of work in flight: when it arrived, if the store can see it.
    pub first_seen: Option<SystemTime>,
    /// How many requests the store has seen with the key, when it said.
    pub request_count: Option<u64>,
    /// Of a duplicate of work whose outcome is not replayable: its record, which the
    /// answer describes (when it ran, and as which attempt).
    pub record: Option<Arc<Record>>,
}

impl Answer {
    /// An answer with `code` and `detail`, to come back after `retry_after` if set.
    pub fn new(code: Code, detail: String, retry_after: Option<Duration>) -> Self {
        Self {
            code,
            detail,
            retry_after,
            first_seen: None,
            request_count: None,
            record: None,
        }
    }

    /// The engine's answer to a duplicate, or to a request it would not run (every
    /// verdict but a replay, which the adapter decodes).
    pub fn verdict(noun: &str, verdict: Verdict) -> Self {
        match verdict {
            Verdict::Replay {
                record,
                request_count,
            }
            | Verdict::NotReplayable {
                record,
                request_count,
            } => Self::not_replayable(noun, record, request_count),
            Verdict::InFlight {
                first_seen,
                request_count,
                retry_after,
            } => Self {
                first_seen,
                request_count,
                ..Self::new(
                    Code::InFlight,
                    format!("a {noun} with this idempotency key is still running; retry after the delay to get its outcome"),
                    Some(retry_after),
                )
            },
            Verdict::Conflict => Self::new(
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
                Self::new(Code::EpochMismatch, detail, None)
            }
            Verdict::OriginalFailed => Self::new(
                Code::OriginalFailed,
                format!("the {noun} with this key that was running failed and stored nothing; retry to run it again"),
                Some(RETRY_LATER),
            ),
            Verdict::StoreUnavailable => Self::new(
                Code::StoreUnavailable,
                format!("the idempotency store cannot check this key now, so this {noun} ran nothing; retry later"),
                Some(RETRY_LATER),
            ),
            Verdict::PoolExhausted => Self::new(
                Code::PoolExhausted,
                format!("every database connection is in use, so this {noun} ran nothing; retry later"),
                Some(RETRY_LATER),
            ),
        }
    }

    /// A duplicate of work that ran whose outcome was not kept, or cannot be handed
    /// back here.
    pub fn not_replayable(noun: &str, record: Arc<Record>, request_count: u64) -> Self {
        Self {
            request_count: Some(request_count),
            record: Some(record),
            ..Self::new(
                Code::NotReplayable,
                format!("the {noun} with this idempotency key ran, but its outcome was too large to keep for replay; it will not run again"),
                None,
            )
        }
    }

    /// A duplicate whose stored outcome does not decode into the outcome type (it
    /// changed since).
    pub fn undecodable(noun: &str) -> Self {
        Self::new(
            Code::OutcomeUndecodable,
            format!("the {noun} with this key ran, but its stored outcome does not decode into this handler's outcome type; it will not run again"),
            None,
        )
    }

    /// Work that ran whose outcome does not stand, or may not.
    pub fn uncommitted(noun: &str, uncommitted: &Uncommitted) -> Self {
        let (code, detail) = match uncommitted {
            Uncommitted::Failed(error) => (
                Code::NotCommitted,
                format!("the {noun}'s transaction did not commit ({error}); nothing it wrote stands; retry with the same key"),
            ),
            Uncommitted::Unknown(error) => (
                Code::OutcomeUnknown,
                format!("the {noun} ran, but whether its transaction committed is not known ({error}); retry with the same key: it replays the outcome if it committed, and runs again if it did not"),
            ),
        };
        Self::new(code, detail, Some(RETRY_LATER))
    }

    /// A handler that failed on a passing fault.
    pub fn handler_unavailable(noun: &str) -> Self {
        Self::new(
            Code::HandlerUnavailable,
            format!("the {noun}'s handler failed on a passing fault (its database unavailable, or its transaction in conflict); nothing of it is kept; retry with the same key"),
            Some(RETRY_LATER),
        )
    }

    /// An outcome that failed while it was read: nothing was stored.
    pub fn response_failed() -> Self {
        Self::new(
            Code::ResponseFailed,
            "the response could not be produced; nothing was stored, so a retry runs again".into(),
            None,
        )
    }

    /// A body over the limit of what the layer reads.
    pub fn body_too_large(noun: &str, max: usize) -> Self {
        Self::new(
            Code::BodyTooLarge,
            format!("an idempotent {noun} body may be at most {max} bytes; nothing ran"),
            None,
        )
    }

    /// A body the layer's byte budget cannot take now.
    pub fn overloaded(noun: &str) -> Self {
        Self::new(
            Code::Overloaded,
            format!("the server holds as many {noun} bodies as it can right now, so it ran nothing; retry later"),
            Some(RETRY_LATER),
        )
    }

    /// A body that failed mid-read.
    pub fn body_unreadable(noun: &str) -> Self {
        Self::new(
            Code::BodyUnreadable,
            format!("the {noun} body could not be read to the end"),
            None,
        )
    }
}
