//! The code book: every refusal's stable code, and what it is on each transport (an
//! HTTP status, a gRPC code, a message's requeue or dead letter). A code is spelled
//! here and nowhere else.

use std::fmt;

use http::StatusCode;

/// Why an idempotency layer answered for the handler: the same code on every transport.
///
/// It is the `code` member of an HTTP problem (and the anchor its `type` points at),
/// the `reason` of a gRPC status's `google.rpc.ErrorInfo`, and a message
/// `Refusal::code` (the message layer's).
/// Match on the variant, or on its [`as_str`](Self::as_str) text
/// (`idempotency.in_flight`), which never changes; see the
/// [status table](crate#status-codes) for when each is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Code {
    /// `idempotency.key_missing`: the route requires a key and none was sent.
    KeyMissing,
    /// `idempotency.key_invalid`: the key is empty, too long, not visible ASCII or
    /// malformed.
    KeyInvalid,
    /// `idempotency.keys_disagree`: `Idempotency-Key` and `X-Idempotency-Key` differ.
    KeysDisagree,
    /// `idempotency.key_repeated`: one key header sent twice with different values.
    KeyRepeated,
    /// `idempotency.attempt_id_invalid`: the attempt ID is repeated or malformed.
    AttemptIdInvalid,
    /// `idempotency.client_invalid`: the client cannot be told.
    ClientInvalid,
    /// `idempotency.client_missing`: the route keeps keys per client and none is named.
    ClientMissing,
    /// `idempotency.body_unreadable`: the request body failed mid-read.
    BodyUnreadable,
    /// `idempotency.body_not_json`: the key is read from a JSON body that is not JSON.
    BodyNotJson,
    /// `idempotency.body_too_large`: the request is over the layer's limit.
    BodyTooLarge,
    /// `idempotency.epoch_invalid`: the epoch header is not one decimal number.
    EpochInvalid,
    /// `idempotency.epoch_mismatch`: the key was first seen in another epoch.
    EpochMismatch,
    /// `idempotency.fingerprint_mismatch`: the key was used with another request.
    FingerprintMismatch,
    /// `idempotency.in_flight`: a request with this key is running.
    InFlight,
    /// `idempotency.original_failed`: the request waited on failed; retry.
    OriginalFailed,
    /// `idempotency.not_replayable`: the request ran, but its response was not kept.
    NotReplayable,
    /// `idempotency.outcome_undecodable`: a message's stored outcome does not decode
    /// into the consumer's outcome type.
    OutcomeUndecodable,
    /// `idempotency.response_failed`: the handler's response failed mid-read.
    ResponseFailed,
    /// `idempotency.transaction_missing`: a handler took a `Transaction` no layer
    /// offered (a server misconfiguration).
    TransactionMissing,
    /// `idempotency.overloaded`: the bodies in flight fill the layer's byte budget.
    Overloaded,
    /// `idempotency.store_unavailable`: the store failed; nothing ran.
    StoreUnavailable,
    /// `idempotency.pool_exhausted`: the store's pool had no free connection in time.
    PoolExhausted,
    /// `idempotency.not_committed`: the handler's transaction did not commit.
    NotCommitted,
    /// `idempotency.outcome_unknown`: whether the handler's transaction committed is
    /// not known; a retry replays it if it did.
    OutcomeUnknown,
    /// `idempotency.handler_unavailable`: the handler failed on a passing fault (its
    /// database unreachable, a deadlock); nothing is kept and a retry runs it again.
    HandlerUnavailable,
    /// `idempotency.streaming_unsupported`: a keyed gRPC call sent more than one
    /// message.
    StreamingUnsupported,
    /// `idempotency.message_invalid`: a gRPC body that is not length-prefixed
    /// messages.
    MessageInvalid,
}

impl Code {
    /// The gRPC status code (its number, as `google.rpc.Code` has it) a call refused with
    /// this code is answered with.
    #[doc(hidden)]
    pub const fn grpc_status(self) -> i32 {
        match self {
            Code::KeyMissing
            | Code::KeyInvalid
            | Code::KeysDisagree
            | Code::KeyRepeated
            | Code::AttemptIdInvalid
            | Code::ClientInvalid
            | Code::BodyUnreadable
            | Code::BodyNotJson
            | Code::EpochInvalid
            | Code::MessageInvalid =>
            /* InvalidArgument */
            {
                3
            }
            Code::ClientMissing =>
            /* Unauthenticated */
            {
                16
            }
            Code::InFlight | Code::OriginalFailed =>
            /* Aborted */
            {
                10
            }
            Code::FingerprintMismatch
            | Code::EpochMismatch
            | Code::NotReplayable
            | Code::OutcomeUndecodable =>
            /* FailedPrecondition */
            {
                9
            }
            Code::BodyTooLarge | Code::PoolExhausted =>
            /* ResourceExhausted */
            {
                8
            }
            Code::ResponseFailed | Code::TransactionMissing =>
            /* Internal */
            {
                13
            }
            Code::StreamingUnsupported =>
            /* Unimplemented */
            {
                12
            }
            Code::Overloaded
            | Code::StoreUnavailable
            | Code::NotCommitted
            | Code::OutcomeUnknown
            | Code::HandlerUnavailable =>
            /* Unavailable */
            {
                14
            }
        }
    }

    /// Every code, in the order of the status table.
    #[doc(hidden)]
    pub const ALL: [Code; 27] = [
        Code::KeyMissing,
        Code::KeyInvalid,
        Code::KeysDisagree,
        Code::KeyRepeated,
        Code::AttemptIdInvalid,
        Code::ClientInvalid,
        Code::BodyUnreadable,
        Code::BodyNotJson,
        Code::EpochInvalid,
        Code::MessageInvalid,
        Code::ClientMissing,
        Code::InFlight,
        Code::OriginalFailed,
        Code::NotReplayable,
        Code::OutcomeUndecodable,
        Code::BodyTooLarge,
        Code::FingerprintMismatch,
        Code::EpochMismatch,
        Code::ResponseFailed,
        Code::TransactionMissing,
        Code::StreamingUnsupported,
        Code::Overloaded,
        Code::StoreUnavailable,
        Code::PoolExhausted,
        Code::NotCommitted,
        Code::OutcomeUnknown,
        Code::HandlerUnavailable,
    ];

    /// The stable text of the code: `idempotency.in_flight`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Code::KeyMissing => "idempotency.key_missing",
            Code::KeyInvalid => "idempotency.key_invalid",
            Code::KeysDisagree => "idempotency.keys_disagree",
            Code::KeyRepeated => "idempotency.key_repeated",
            Code::AttemptIdInvalid => "idempotency.attempt_id_invalid",
            Code::ClientInvalid => "idempotency.client_invalid",
            Code::ClientMissing => "idempotency.client_missing",
            Code::BodyUnreadable => "idempotency.body_unreadable",
            Code::BodyNotJson => "idempotency.body_not_json",
            Code::BodyTooLarge => "idempotency.body_too_large",
            Code::EpochInvalid => "idempotency.epoch_invalid",
            Code::EpochMismatch => "idempotency.epoch_mismatch",
            Code::FingerprintMismatch => "idempotency.fingerprint_mismatch",
            Code::InFlight => "idempotency.in_flight",
            Code::OriginalFailed => "idempotency.original_failed",
            Code::NotReplayable => "idempotency.not_replayable",
            Code::OutcomeUndecodable => "idempotency.outcome_undecodable",
            Code::ResponseFailed => "idempotency.response_failed",
            Code::TransactionMissing => "idempotency.transaction_missing",
            Code::Overloaded => "idempotency.overloaded",
            Code::StoreUnavailable => "idempotency.store_unavailable",
            Code::PoolExhausted => "idempotency.pool_exhausted",
            Code::NotCommitted => "idempotency.not_committed",
            Code::OutcomeUnknown => "idempotency.outcome_unknown",
            Code::HandlerUnavailable => "idempotency.handler_unavailable",
            Code::StreamingUnsupported => "idempotency.streaming_unsupported",
            Code::MessageInvalid => "idempotency.message_invalid",
        }
    }

    /// The HTTP status a problem with this code is answered with.
    #[doc(hidden)]
    pub const fn http_status(self) -> StatusCode {
        match self {
            Code::KeyMissing
            | Code::KeyInvalid
            | Code::KeysDisagree
            | Code::KeyRepeated
            | Code::AttemptIdInvalid
            | Code::ClientInvalid
            | Code::BodyUnreadable
            | Code::BodyNotJson
            | Code::EpochInvalid
            | Code::MessageInvalid => StatusCode::BAD_REQUEST,
            Code::ClientMissing => StatusCode::UNAUTHORIZED,
            Code::InFlight | Code::OriginalFailed => StatusCode::CONFLICT,
            Code::NotReplayable | Code::OutcomeUndecodable => StatusCode::GONE,
            Code::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Code::FingerprintMismatch | Code::EpochMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Code::ResponseFailed | Code::TransactionMissing => StatusCode::INTERNAL_SERVER_ERROR,
            Code::StreamingUnsupported => StatusCode::NOT_IMPLEMENTED,
            Code::Overloaded
            | Code::StoreUnavailable
            | Code::PoolExhausted
            | Code::NotCommitted
            | Code::OutcomeUnknown
            | Code::HandlerUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The problem's `title`: short, the same for every occurrence of the code.
    #[doc(hidden)]
    pub const fn title(self) -> &'static str {
        match self {
            Code::KeyMissing => "Missing idempotency key",
            Code::KeyInvalid => "Invalid idempotency key",
            Code::KeysDisagree => "Two different idempotency keys",
            Code::KeyRepeated => "Idempotency key header repeated",
            Code::AttemptIdInvalid => "Invalid attempt id",
            Code::ClientInvalid => "Invalid client identity",
            Code::ClientMissing => "Client not identified",
            Code::BodyUnreadable => "Request body unreadable",
            Code::BodyNotJson => "Body is not JSON",
            Code::BodyTooLarge => "Request body too large",
            Code::EpochInvalid => "Invalid epoch",
            Code::EpochMismatch => "Idempotency key from another epoch",
            Code::FingerprintMismatch => "Idempotency key reused",
            Code::InFlight => "Request in progress",
            Code::OriginalFailed => "Original request failed",
            Code::NotReplayable | Code::OutcomeUndecodable => "Response not replayable",
            Code::ResponseFailed => "Response failed",
            Code::TransactionMissing => "Server misconfigured",
            Code::Overloaded | Code::PoolExhausted => "Server busy",
            Code::StoreUnavailable => "Idempotency store unavailable",
            Code::NotCommitted => "Request not committed",
            Code::OutcomeUnknown => "Request outcome unknown",
            Code::HandlerUnavailable => "Handler unavailable",
            Code::StreamingUnsupported => "Streaming call not deduplicated",
            Code::MessageInvalid => "Invalid gRPC message",
        }
    }

    /// Whether a retry (a message's redelivery) can succeed: a message refused with a
    /// retryable code is requeued, any other is dead-lettered.
    #[doc(hidden)]
    pub const fn retryable(self) -> bool {
        matches!(
            self,
            Code::InFlight
                | Code::OriginalFailed
                | Code::Overloaded
                | Code::StoreUnavailable
                | Code::PoolExhausted
                | Code::NotCommitted
                | Code::OutcomeUnknown
                | Code::HandlerUnavailable
        )
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `event` field of every line the idempotency layers log: stable names a log
/// query matches on, listed in the guide's observability page.
#[doc(hidden)]
pub mod event {
    // Each store and transport logs some of them: a build without it leaves those unused.
    #![allow(dead_code)]

    #[doc(hidden)]
    pub const ACCEPTED: &str = "idempotency.accepted";
    #[doc(hidden)]
    pub const BODY_TOO_LARGE: &str = "idempotency.body_too_large";
    #[doc(hidden)]
    pub const BODY_UNREADABLE: &str = "idempotency.body_unreadable";
    #[doc(hidden)]
    pub const CLAIM_LAPSED: &str = "idempotency.claim_lapsed";
    #[doc(hidden)]
    pub const CLAIM_RESTORED: &str = "idempotency.claim_restored";
    #[doc(hidden)]
    pub const COMMIT_CONFIRMED: &str = "idempotency.commit_confirmed";
    #[doc(hidden)]
    pub const COMMIT_FAILED: &str = "idempotency.commit_failed";
    #[doc(hidden)]
    pub const CONFLICT: &str = "idempotency.conflict";
    #[doc(hidden)]
    pub const DETACHED: &str = "idempotency.detached";
    #[doc(hidden)]
    pub const DRAIN_UNSETTLED: &str = "idempotency.drain_unsettled";
    #[doc(hidden)]
    pub const DRAINED: &str = "idempotency.drained";
    #[doc(hidden)]
    pub const EPOCH_MISMATCH: &str = "idempotency.epoch_mismatch";
    #[doc(hidden)]
    pub const EXPIRED_REMOVED: &str = "idempotency.expired_removed";
    #[doc(hidden)]
    pub const IN_FLIGHT: &str = "idempotency.in_flight";
    #[doc(hidden)]
    pub const KEPT_OVER_BUDGET: &str = "idempotency.kept_over_budget";
    #[doc(hidden)]
    pub const LEASE_LOST: &str = "idempotency.lease_lost";
    #[doc(hidden)]
    pub const LEASE_RENEWED: &str = "idempotency.lease_renewed";
    #[doc(hidden)]
    pub const LINEAGE_UNTOLD: &str = "idempotency.lineage_untold";
    #[doc(hidden)]
    pub const NOT_REPLAYABLE: &str = "idempotency.not_replayable";
    #[doc(hidden)]
    pub const ORIGINAL_FAILED: &str = "idempotency.original_failed";
    #[doc(hidden)]
    pub const OUTCOME_UNDECODABLE: &str = "idempotency.outcome_undecodable";
    #[doc(hidden)]
    pub const OUTCOME_UNKNOWN: &str = "idempotency.outcome_unknown";
    #[doc(hidden)]
    pub const OUTCOME_UNSERIALISABLE: &str = "idempotency.outcome_unserialisable";
    #[doc(hidden)]
    pub const OVERLOADED: &str = "idempotency.overloaded";
    #[doc(hidden)]
    pub const POOL_EXHAUSTED: &str = "idempotency.pool_exhausted";
    #[doc(hidden)]
    pub const REJECTED: &str = "idempotency.rejected";
    #[doc(hidden)]
    pub const RELEASED: &str = "idempotency.released";
    #[doc(hidden)]
    pub const REPLAYED: &str = "idempotency.replayed";
    #[doc(hidden)]
    pub const RESPONSE_FAILED: &str = "idempotency.response_failed";
    #[doc(hidden)]
    pub const RESPONSE_TOO_LARGE: &str = "idempotency.response_too_large";
    #[doc(hidden)]
    pub const STORE_FAILED: &str = "idempotency.store_failed";
    #[doc(hidden)]
    pub const STORE_NOT_DURABLE: &str = "idempotency.store_not_durable";
    #[doc(hidden)]
    pub const STORED: &str = "idempotency.stored";
    #[doc(hidden)]
    pub const TRANSACTION_BROKE: &str = "idempotency.transaction_broke";
    #[doc(hidden)]
    pub const TRANSACTION_MISSING: &str = "idempotency.transaction_missing";
    #[doc(hidden)]
    pub const TRANSIENT_FAILURE: &str = "idempotency.transient_failure";
    #[doc(hidden)]
    pub const UNANSWERED_CLAIM_RELEASED: &str = "idempotency.unanswered_claim_released";
    #[doc(hidden)]
    pub const UNCORRELATED: &str = "idempotency.uncorrelated";

    /// Every name above.
    #[doc(hidden)]
    pub const ALL: &[&str] = &[
        ACCEPTED,
        BODY_TOO_LARGE,
        BODY_UNREADABLE,
        CLAIM_LAPSED,
        CLAIM_RESTORED,
        COMMIT_CONFIRMED,
        COMMIT_FAILED,
        CONFLICT,
        DETACHED,
        DRAIN_UNSETTLED,
        DRAINED,
        EPOCH_MISMATCH,
        EXPIRED_REMOVED,
        IN_FLIGHT,
        KEPT_OVER_BUDGET,
        LEASE_LOST,
        LEASE_RENEWED,
        LINEAGE_UNTOLD,
        NOT_REPLAYABLE,
        ORIGINAL_FAILED,
        OUTCOME_UNDECODABLE,
        OUTCOME_UNKNOWN,
        OUTCOME_UNSERIALISABLE,
        OVERLOADED,
        POOL_EXHAUSTED,
        REJECTED,
        RELEASED,
        REPLAYED,
        RESPONSE_FAILED,
        RESPONSE_TOO_LARGE,
        STORE_FAILED,
        STORE_NOT_DURABLE,
        STORED,
        TRANSACTION_BROKE,
        TRANSACTION_MISSING,
        TRANSIENT_FAILURE,
        UNANSWERED_CLAIM_RELEASED,
        UNCORRELATED,
    ];
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn every_code_is_listed_once_and_spelled_apart() {
        let texts: BTreeSet<_> = Code::ALL.iter().map(|code| code.as_str()).collect();
        assert_eq!(texts.len(), Code::ALL.len());
        for code in Code::ALL {
            let name = code.as_str().strip_prefix("idempotency.").unwrap();
            assert!(
                name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{code}"
            );
        }
    }

    #[test]
    fn a_retryable_code_is_one_a_client_may_retry_over_http() {
        for code in Code::ALL {
            let status = code.http_status();
            let retry = matches!(status.as_u16(), 409 | 503);
            assert_eq!(code.retryable(), retry, "{code} answers {status}");
        }
    }
}
