//! The response future every transport's service returns: once its work has claimed
//! its key, dropping it (the client went away, the consumer's task was cancelled)
//! moves the rest of the work to a task of its own, so a handler that started runs to
//! completion and its outcome is stored for the retry.

use crate::code::event;
use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, OnceLock},
    task::{Context, Poll},
};

use super::drain::{Outstanding, Owed};

/// Set by the engine when the work's request claims its key, with the layer's
/// register of unsettled work, where the work goes if it must finish on its own.
#[derive(Clone, Default)]
pub struct ClaimFlag(Arc<OnceLock<Arc<Outstanding>>>);

impl ClaimFlag {
    pub fn set(&self, outstanding: &Arc<Outstanding>) {
        let _ = self.0.set(outstanding.clone());
    }

    fn outstanding(&self) -> Option<&Arc<Outstanding>> {
        self.0.get()
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A boxed piece of work that, dropped after its claim, finishes in a task of its own.
///
/// Boxed: the work is several awaits on the store and the body, which no hand-written
/// state machine would make clearer.
pub struct Detaching<T: 'static> {
    work: Option<BoxFuture<T>>,
    /// `None` for work that never claims a key (refusals, requests passed through).
    claimed: Option<ClaimFlag>,
    /// Set while the work is polled: if that poll panics (the handler panicked), the
    /// work must not be resumed elsewhere; its lease guard has already let the key go.
    unwinding: bool,
    /// The span current when the work was made (the request's): work finished in a
    /// task of its own goes on in it, so its events and what it records on the span
    /// keep the request's fields.
    span: tracing::Span,
}

impl<T: 'static> Detaching<T> {
    /// Work that claims no key: dropped, it is cancelled, as any future.
    pub fn new(work: impl Future<Output = T> + Send + 'static) -> Self {
        Self {
            work: Some(Box::pin(work)),
            claimed: None,
            unwinding: false,
            span: tracing::Span::none(),
        }
    }

    /// Work made by `make`, which hands its [`ClaimFlag`] to the engine.
    pub fn claiming<F>(make: impl FnOnce(ClaimFlag) -> F) -> Self
    where
        F: Future<Output = T> + Send + 'static,
    {
        let claimed = ClaimFlag::default();
        Self {
            work: Some(Box::pin(make(claimed.clone()))),
            claimed: Some(claimed),
            unwinding: false,
            span: super::observe::request_span(),
        }
    }
}

impl<T: 'static> Future for Detaching<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = &mut *self;
        let Some(work) = this.work.as_mut() else {
            panic!("idempotency ResponseFuture polled after completion");
        };
        this.unwinding = true;
        let poll = work.as_mut().poll(cx);
        this.unwinding = false;
        let output = std::task::ready!(poll);
        this.work = None;
        Poll::Ready(output)
    }
}

impl<T: 'static> Drop for Detaching<T> {
    fn drop(&mut self) {
        let Some(unfinished) = self.work.take() else {
            return;
        };
        let outstanding = match self.claimed.as_ref().and_then(ClaimFlag::outstanding) {
            Some(outstanding) if !self.unwinding => outstanding,
            // Before the claim nothing ran; after a panic the guard let the key go.
            _ => return,
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let span = std::mem::replace(&mut self.span, tracing::Span::none());
        let unsettled = outstanding.enter(Owed::Handler, span.clone());
        let detached = std::time::Instant::now();
        let rest = tracing::Instrument::instrument(
            async move {
                let _ = unfinished.await;
                drop(unsettled);
                // The request's line: no access line is written for an answer no one
                // was there to take.
                tracing::info!(
                    target: "tower_ids::idempotency",
                    event = event::DETACHED,
                    finished_after_ms = tower_ids_correlation::log_millis(detached.elapsed()),
                    "the client went away before the answer; the work ran to its end in a task of its own (its outcome stored, kept for the store, or its key released, as the events before say)"
                );
            },
            span,
        );
        // Dropped inside the correlation layer's scope, so the ID is still current.
        match tower_ids_correlation::CorrelationId::current() {
            Some(id) => runtime.spawn(id.task_local(rest)),
            None => runtime.spawn(rest),
        };
    }
}
