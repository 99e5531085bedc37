//! Which handler failures are passing faults: retried (a `503`, a message requeued
//! uncounted), never counted toward a dead letter, never stored as the handler's
//! failure.

use std::{any::Any, fmt::Display, sync::Arc};

type Recognise = Arc<dyn Fn(&dyn Any) -> Option<String> + Send + Sync>;

/// The layer's test for a handler's error: the store crates' (the PostgreSQL crate's
/// database faults, which the layers add), and the user's `transient_if` hooks.
///
/// The handler's error type is the service's, which the engine does not name: each
/// hook is typed on the error it recognises and skips any other.
///
/// Each claimed request holds a clone: a reference count, not a copy of the hooks.
#[derive(Clone, Default)]
pub(super) struct Transient {
    hooks: Arc<Vec<Recognise>>,
}

impl Transient {
    /// Also counts as transient an error of type `E` that `hook` says is.
    pub(super) fn add<E: Display + 'static>(
        &mut self,
        hook: impl Fn(&E) -> bool + Send + Sync + 'static,
    ) {
        Arc::make_mut(&mut self.hooks).push(Arc::new(move |error: &dyn Any| {
            let error = error.downcast_ref::<E>()?;
            hook(error).then(|| error.to_string())
        }));
    }

    /// Also counts as transient whatever `recognise` says is, with its text: a store
    /// crate's test for its database's passing faults, whatever the error's type.
    pub(super) fn add_recogniser(
        &mut self,
        recognise: impl Fn(&dyn Any) -> Option<String> + Send + Sync + 'static,
    ) {
        Arc::make_mut(&mut self.hooks).push(Arc::new(recognise));
    }

    /// What the error says, if it is a passing fault.
    pub(super) fn recognise(&self, error: &dyn Any) -> Option<String> {
        self.hooks.iter().find_map(|hook| hook(error))
    }
}

impl std::fmt::Debug for Transient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transient")
            .field("hooks", &self.hooks.len())
            .finish()
    }
}
