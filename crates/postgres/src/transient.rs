//! The database's passing faults, as a handler meets them on its `Transaction` or its
//! own pool.

use std::error::Error;

/// Whether `error`, or an error in its [`source`](Error::source) chain, is a database
/// fault that passes: a retry of the same work can succeed once it has.
///
/// It recognises `sqlx::Error`s:
///
/// - a connection lost, cut or refused (an I/O error), the pool timing out;
/// - SQLSTATE class `08` (connection exception) and `57P` (the server shutting down,
///   crashed, or not yet accepting connections: `terminating connection due to
///   administrator command`), and `53300` (too many connections);
/// - `40001` (serialization failure) and `40P01` (deadlock detected): the transaction
///   was rolled back, and running it again is what the database asks for.
///
/// The idempotency layers already apply it to a handler's error that is an
/// `sqlx::Error` or a `BoxError`: such a failure is answered `503
/// idempotency.handler_unavailable` (gRPC `UNAVAILABLE`) and a message is requeued
/// uncounted, instead of being kept as the handler's failure. Apply it to an error type
/// of your own with `transient_if`:
///
/// ```
/// use tower_ids_postgres::is_transient;
///
/// #[derive(Debug)]
/// enum PaymentError {
///     Database(sqlx::Error),
///     UnknownAccount(String),
/// }
/// # impl std::fmt::Display for PaymentError {
/// #     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
/// #         f.write_str("payment failed")
/// #     }
/// # }
///
/// impl std::error::Error for PaymentError {
///     fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
///         match self {
///             PaymentError::Database(error) => Some(error),
///             PaymentError::UnknownAccount(_) => None,
///         }
///     }
/// }
///
/// assert!(is_transient(&PaymentError::Database(sqlx::Error::PoolTimedOut)));
/// assert!(!is_transient(&PaymentError::UnknownAccount("42".into())));
/// // A layer's `.transient_if(|error: &PaymentError| is_transient(error))` counts them.
/// ```
///
/// In an axum handler, whose errors are responses, answer such an error with a `503`
/// yourself: the layer never stores a `503`, so the key runs again.
pub fn is_transient(error: &(dyn Error + 'static)) -> bool {
    transient_cause(error).is_some()
}

/// The fault [`is_transient`] recognises in `error`, as a log line says it: the
/// SQLSTATE and the database's message, or the error's chain.
pub(crate) fn transient_cause(error: &(dyn Error + 'static)) -> Option<String> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(error) = error.downcast_ref::<sqlx::Error>() {
            if let Some(cause) = passes(error) {
                return Some(cause);
            }
        }
        next = error.source();
    }
    None
}

fn passes(error: &sqlx::Error) -> Option<String> {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed => {
            Some(tower_ids_core::store::Chain(error).to_string())
        }
        sqlx::Error::Database(error) => {
            let code = error.code()?;
            let passing = code.starts_with("08")
                || code.starts_with("57P")
                || matches!(&*code, "40001" | "40P01" | "53300");
            passing.then(|| format!("SQLSTATE {code}: {}", error.message()))
        }
        _ => None,
    }
}

/// The database's passing faults in a handler's error of any type: an `sqlx::Error`,
/// alone or in a `BoxError`'s chain, that [`is_transient`] recognises; what the layers
/// add to every engine they build.
pub fn passing_fault(error: &dyn std::any::Any) -> Option<String> {
    let error: &(dyn Error + 'static) = if let Some(error) = error.downcast_ref::<sqlx::Error>() {
        error
    } else if let Some(error) = error.downcast_ref::<Box<dyn Error + Send + Sync>>() {
        &**error
    } else {
        return None;
    };
    transient_cause(error)
}
