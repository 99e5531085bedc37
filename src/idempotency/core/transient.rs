//! Which handler failures are passing faults: retried (a `503`, a message requeued
//! uncounted), never counted toward a dead letter, never stored as the handler's
//! failure.

use std::{any::Any, fmt::Display, sync::Arc};

type Recognise = Arc<dyn Fn(&dyn Any) -> Option<String> + Send + Sync>;

/// The layer's test for a handler's error: the crate's own (the database's passing
/// faults, with feature `postgres`), and the user's `transient_if` hooks.
///
/// The handler's error type is the service's, which the engine does not name: each
/// hook is typed on the error it recognises and skips any other.
///
/// Each claimed request holds a clone: a reference count, not a copy of the hooks.
#[derive(Clone, Default)]
pub(crate) struct Transient {
    hooks: Arc<Vec<Recognise>>,
}

impl Transient {
    /// Also counts as transient an error of type `E` that `hook` says is.
    pub(crate) fn add<E: Display + 'static>(
        &mut self,
        hook: impl Fn(&E) -> bool + Send + Sync + 'static,
    ) {
        Arc::make_mut(&mut self.hooks).push(Arc::new(move |error: &dyn Any| {
            let error = error.downcast_ref::<E>()?;
            hook(error).then(|| error.to_string())
        }));
    }

    /// What the error says, if it is a passing fault.
    pub(crate) fn recognise(&self, error: &dyn Any) -> Option<String> {
        by_default(error).or_else(|| self.hooks.iter().find_map(|hook| hook(error)))
    }
}

impl std::fmt::Debug for Transient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transient")
            .field("hooks", &self.hooks.len())
            .finish()
    }
}

/// The crate's own: a database error (`sqlx::Error`, alone or in a `BoxError`'s chain)
/// that [`is_transient`](crate::idempotency::store::is_transient) recognises.
#[cfg(feature = "postgres")]
fn by_default(error: &dyn Any) -> Option<String> {
    use crate::idempotency::store::postgres::transient_cause;
    let error: &(dyn std::error::Error + 'static) = if let Some(error) =
        error.downcast_ref::<sqlx::Error>()
    {
        error
    } else if let Some(error) = error.downcast_ref::<Box<dyn std::error::Error + Send + Sync>>() {
        &**error
    } else {
        return None;
    };
    transient_cause(error)
}

#[cfg(not(feature = "postgres"))]
fn by_default(_: &dyn Any) -> Option<String> {
    None
}
