//! The open database transaction a store may hold a claim in, offered to the handler.

use std::{future::Future, sync::Arc, time::Duration};

#[cfg(doc)]
use super::Begin;
use super::{Record, ScopeKey, StoreError};

/// The open database transaction that holds a claim, from
/// [`Begin::ClaimedByTransaction`]: offered to the handler (in the request's extensions,
/// and as [`TransactionOffer::current`] while it runs) to make its writes in; the layer
/// stores the outcome in it and commits, or rolls it back to give the key up.
pub trait HandlerTransaction: Send + Sync + 'static {
    /// What the handler takes the transaction from. The HTTP and gRPC layers put it in
    /// the request's extensions (and the PostgreSQL store's `Transaction` in it, as
    /// itself).
    fn offer(&self) -> TransactionOffer;

    /// Whether the handler used the transaction. A server error of a handler that did
    /// is rolled back and its key released, whatever the layer's storage rule: the
    /// rollback undid its writes, so a retry may run again. Default `false`.
    fn taken(&self) -> bool {
        false
    }

    /// After the handler: stores `outcome` (the record and its TTL) in the transaction
    /// and commits; with no outcome (the response is not stored, or the handler
    /// failed), rolls it back, and answers [`TransactionEnd::Failed`] if the transaction
    /// broke under the handler (its rollback failed: the connection lost, the backend
    /// terminated), so the layer answers a passing fault rather than the handler's
    /// failure. Either way the claim ends with it.
    fn settle(
        self: Box<Self>,
        scope: ScopeKey,
        outcome: Option<(Arc<Record>, Duration)>,
    ) -> std::pin::Pin<Box<dyn Future<Output = TransactionEnd> + Send>>;
}

impl std::fmt::Debug for dyn HandlerTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerTransaction").finish_non_exhaustive()
    }
}

/// What a store's [`HandlerTransaction`] offers the handler to run its writes in: the
/// store's own handle, opaque to the layers, read back by its type.
#[derive(Clone)]
pub struct TransactionOffer(Arc<dyn std::any::Any + Send + Sync>);

tokio::task_local! {
    /// The offer of the claimed request whose handler is being polled.
    static CURRENT_OFFER: TransactionOffer;
}

impl TransactionOffer {
    /// Offers `handle`.
    pub fn new<T: std::any::Any + Send + Sync>(handle: T) -> Self {
        Self(Arc::new(handle))
    }

    /// The handle, if it is a `T`.
    pub fn get<T: std::any::Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }

    /// The handle offered to the handler being run, if it is a `T`: how a handler whose
    /// input has no extensions (a message consumer's) finds its transaction. Set while
    /// the layer polls the handler's future, not in tasks it spawns.
    pub fn current<T: std::any::Any + Clone>() -> Option<T> {
        CURRENT_OFFER
            .try_with(|offer| offer.get::<T>().cloned())
            .ok()
            .flatten()
    }

    /// Runs `work` with this offer as [`current`](Self::current).
    #[doc(hidden)]
    pub async fn scope<F: Future>(self, work: F) -> F::Output {
        CURRENT_OFFER.scope(self, work).await
    }
}

impl std::fmt::Debug for TransactionOffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionOffer").finish_non_exhaustive()
    }
}

/// How a [`HandlerTransaction`] ended.
#[derive(Debug)]
pub enum TransactionEnd {
    /// The handler's writes and the record committed together.
    Committed,
    /// Nothing to store: the handler's writes were rolled back.
    RolledBack,
    /// The transaction did not commit (the database refused it, a statement before the
    /// commit failed, or another request holds the key): nothing the handler wrote in
    /// it stands, and the key is free to run again; with no outcome to store, the
    /// transaction broke under the handler. Only for a commit known not to have
    /// landed: one whose answer was lost is [`Unknown`](Self::Unknown) until the store
    /// has found out.
    Failed(StoreError),
    /// The commit was sent but its answer was lost, and the store could not find out in
    /// time whether it landed. The claim ends with the transaction: a retry replays the
    /// outcome if the commit landed, and runs again once the database has settled that
    /// it did not.
    Unknown(StoreError),
}
