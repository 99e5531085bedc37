//! Refusals made before the engine is asked: no key, a key, client or epoch that cannot
//! be read, a body over the limit or the budget, or one that cannot be read. Each is
//! counted (`rejected`) and logged here, the same whatever the transport: its answer is
//! the adapter's.

use super::observe;
use crate::code::event;
use crate::Code;

/// How a refusal was answered, in its transport's own terms, for its log line.
#[derive(Debug, Clone, Copy)]
pub enum Answered {
    /// An HTTP status: the line's `status`.
    Http(u16),
    /// A gRPC status code, by its canonical name (`INVALID_ARGUMENT`): the line's
    /// `grpc_code`.
    Grpc(&'static str),
    /// Not answered on the wire: a message, acknowledged or dead-lettered by its driver.
    Message,
}

/// A refusal of the key, the client or the request's framing: WARN
/// `idempotency.rejected` with `reason` (short and stable), `code` (the problem code)
/// and `detail` (the layer's own text, never the request's), and the answer as its
/// transport says it: `status` (HTTP) or `grpc_code` (gRPC). In the request's span,
/// or one of the layer's own where that span lacks the layer's fields, as every keyed
/// request's events are ([`observe::protected_span`]).
pub fn rejected(reason: &'static str, code: Code, detail: &str, answered: Answered) {
    let span = observe::protected_span(None, None, None);
    let _entered = span.as_ref().map(tracing::Span::enter);
    observe::outcome("rejected");
    let (status, grpc_code): (Option<u16>, Option<&str>) = match answered {
        Answered::Http(status) => (Some(status), None),
        Answered::Grpc(name) => (None, Some(name)),
        Answered::Message => (None, None),
    };
    tracing::warn!(
        target: "tower_ids::idempotency",
        event = event::REJECTED,
        reason,
        code = code.as_str(),
        detail,
        status,
        grpc_code,
        "refused before deduplication: {code}"
    );
}

/// A body over `max_bytes`: WARN `idempotency.body_too_large`.
pub fn body_too_large(max_bytes: usize) {
    observe::outcome("rejected");
    tracing::warn!(
        target: "tower_ids::idempotency",
        event = event::BODY_TOO_LARGE,
        max_bytes,
        "request body over the idempotency limit"
    );
}

/// A body the byte budget cannot take now: WARN `idempotency.overloaded`.
pub fn overloaded(budget_bytes: usize, requested_bytes: usize) {
    observe::outcome("rejected");
    tracing::warn!(
        target: "tower_ids::idempotency",
        event = event::OVERLOADED,
        budget_bytes,
        requested_bytes,
        "request bodies in flight fill the idempotency byte budget; request refused"
    );
}

/// A body that failed mid-read: WARN `idempotency.body_unreadable`.
pub fn body_unreadable(error: &str) {
    observe::outcome("rejected");
    tracing::warn!(
        target: "tower_ids::idempotency",
        event = event::BODY_UNREADABLE,
        error,
        "request body could not be read"
    );
}
