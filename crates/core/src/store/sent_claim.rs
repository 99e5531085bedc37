//! A claim sent to a store outside the process, released if its caller gives up on it.

use crate::code::event;
use std::time::Duration;

use tracing::Instrument as _;

use super::{IdempotencyStore, Lease, ScopeKey};

/// A claim sent to a store outside the process whose answer has not come back. If the
/// caller gives up on it (an error, a timeout, a dropped future), the claim may still
/// have landed, or land later; so, dropped before [`answered`](Self::answered), it is
/// released from a task of its own, again and again until the store answers or the
/// claim, held for `hold`, would have run out anyway. A release is fenced by the
/// claim's token, so it never touches another request's claim, nor a record.
pub struct SentClaim<'a, St: IdempotencyStore + Clone> {
    /// Borrowed: a clone is made only if the claim must be given up.
    store: &'a St,
    scope: ScopeKey,
    lease: Option<Lease>,
    hold: Duration,
}

impl<'a, St: IdempotencyStore + Clone> SentClaim<'a, St> {
    pub fn new(store: &'a St, scope: ScopeKey, lease: Lease, hold: Duration) -> Self {
        Self {
            store,
            scope,
            lease: Some(lease),
            hold,
        }
    }

    /// The store answered: whatever it says of the claim is known.
    pub fn answered(mut self) {
        self.lease = None;
    }
}

impl<St: IdempotencyStore + Clone> Drop for SentClaim<'_, St> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, scope, hold) = (self.store.clone(), self.scope, self.hold);
        let release = async move {
            let until = tokio::time::Instant::now() + hold;
            let mut pause = Duration::from_millis(50);
            loop {
                match store.release(&scope, &lease).await {
                    Ok(released) => {
                        tracing::debug!(
                            target: "tower_ids::idempotency",
                            event = event::UNANSWERED_CLAIM_RELEASED,
                            released,
                            "gave up a claim whose answer never came; its request ran nothing"
                        );
                        return;
                    }
                    Err(_) if tokio::time::Instant::now() + pause < until => {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(500));
                    }
                    Err(_) => return,
                }
            }
        };
        runtime.spawn(release.instrument(tracing::Span::current()));
    }
}
