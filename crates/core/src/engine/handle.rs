//! The one call every adapter makes for a keyed request or message: the engine
//! decides (claim, wait, replay or refuse), runs the handler with its claim renewed,
//! has the adapter classify the outcome, stores it or gives the key back, and says in
//! one [`Resolution`] what the adapter renders. The adapter gives it only what its
//! transport knows: the key's scope, the fingerprint, the epoch, its handler
//! ([`Exchange`]) and what of its output is kept ([`Classify`]).

use std::{future::Future, sync::Arc, time::SystemTime};

use super::{
    answer::Answer,
    claimed::{Claimed, Classify, Failure, Finished, Uncommitted},
    decide::{Decision, Engine, Verdict},
    detach::ClaimFlag,
};
use crate::{
    store::{IdempotencyStore, Record, TransactionOffer},
    AttemptId, Fingerprint, ScopeKey,
};

/// What the transport knows of one keyed request or message.
pub struct Keyed {
    pub scope: ScopeKey,
    pub fingerprint: Fingerprint,
    pub epoch: Option<u64>,
    /// The attempt ID the request sent, recorded as the original attempt's (else its
    /// correlation ID is).
    pub attempt: Option<AttemptId>,
    /// What the transport calls one of its requests (`request`, `call`, `message`),
    /// in the answers' text.
    pub noun: &'static str,
}

/// The transport's handler for one keyed request.
pub trait Exchange: Send {
    /// What the handler produced, as the adapter classifies it.
    type Output: Send;
    /// The handler's own error, passed on.
    type Error: Send + 'static;

    /// Runs the handler, with the transaction the store offers (if any) where it
    /// finds it.
    fn run(
        self,
        offer: Option<TransactionOffer>,
    ) -> impl Future<Output = Result<Self::Output, Self::Error>> + Send;
}

/// What became of a keyed request, for its adapter to render.
pub enum Resolution<X: Exchange> {
    /// The handler ran, and its output stands: hand it back. `expires_at` when the
    /// outcome is stored now.
    Ran {
        output: X::Output,
        expires_at: Option<SystemTime>,
    },
    /// The store cannot answer and the policy fails open: run the handler without
    /// deduplication.
    FailOpen(X),
    /// A duplicate of work that completed: hand back its stored outcome, or, if this
    /// transport cannot decode it, [`Answer::not_replayable`] after
    /// [`replay_failed`](super::replay_failed).
    Replay {
        record: Arc<Record>,
        request_count: u64,
    },
    /// Answer this instead of the handler's output.
    Answer(Answer),
    /// The handler failed on its own: pass its error on.
    Failed(X::Error),
}

impl<St: IdempotencyStore> Engine<St> {
    /// Runs `exchange` for the request `keyed` describes, once for its key: see the
    /// [module docs](self). `claimed` is set when the request claims the key, so that
    /// its response future finishes the work if dropped.
    //
    // An `async` block rather than an `async fn`, here and in `run` and `Claimed::run`:
    // an `async fn` keeps each argument twice in its future (as captured and as a local),
    // and copies it from one to the other when first polled; the exchange holds the
    // whole request.
    #[allow(clippy::manual_async_fn)]
    pub fn handle<'a, X: Exchange + 'a>(
        &'a self,
        keyed: Keyed,
        claimed: &'a ClaimFlag,
        exchange: X,
        classify: &'a impl Classify<X::Output>,
    ) -> impl Future<Output = Resolution<X>> + 'a {
        async move {
            let decision = self
                .decide(keyed.scope, keyed.fingerprint, keyed.epoch, claimed)
                .await;
            match decision {
                // Boxed, so the replay path's future stays small.
                Decision::Run(claimed) => {
                    Box::pin(run(claimed, exchange, classify, keyed.attempt, keyed.noun)).await
                }
                Decision::FailOpen => Resolution::FailOpen(exchange),
                Decision::Answer(Verdict::Replay {
                    record,
                    request_count,
                }) => Resolution::Replay {
                    record,
                    request_count,
                },
                Decision::Answer(verdict) => {
                    Resolution::Answer(Answer::verdict(keyed.noun, verdict))
                }
            }
        }
    }
}

/// Runs the claimed request's handler and settles its outcome.
#[allow(clippy::manual_async_fn)] // See `Engine::handle`.
fn run<'a, St: IdempotencyStore, X: Exchange + 'a>(
    mut claimed: Claimed<St>,
    exchange: X,
    classify: &'a impl Classify<X::Output>,
    attempt: Option<AttemptId>,
    noun: &'static str,
) -> impl Future<Output = Resolution<X>> + 'a {
    async move {
        // Pinned where it is made: the work's future (as large as the handler's) is
        // not moved again. Declared after the claim, so dropped before it.
        let work = std::pin::pin!(exchange.run(claimed.transaction_offer()));
        let (output, finished) = match claimed.run(work, classify, attempt).await {
            Ok(ran) => ran,
            Err(Failure::Handler(error)) => return Resolution::Failed(error),
            // What the handler failed on was its transaction's connection: a passing
            // fault, never the handler's failure.
            Err(Failure::TransactionBroke(_, error)) => {
                return Resolution::Answer(Answer::uncommitted(noun, &Uncommitted::Failed(error)))
            }
            Err(Failure::Transient(_)) => {
                return Resolution::Answer(Answer::handler_unavailable(noun))
            }
        };
        finish(output, finished, classify, noun)
    }
}

/// What the handler's settled output is answered as.
fn finish<X: Exchange>(
    output: X::Output,
    finished: Finished,
    classify: &impl Classify<X::Output>,
    noun: &str,
) -> Resolution<X> {
    match finished {
        Finished::Uncommitted(uncommitted) => {
            Resolution::Answer(Answer::uncommitted(noun, &uncommitted))
        }
        Finished::Failed => Resolution::Answer(Answer::response_failed()),
        // A success whose writes were rolled back must not say it succeeded; a failure
        // so settled is passed on, as it says nothing stands.
        Finished::RolledBack(error) if classify.succeeded(&output) => {
            Resolution::Answer(Answer::uncommitted(noun, &Uncommitted::Failed(error)))
        }
        Finished::Kept { expires_at } => Resolution::Ran { output, expires_at },
        Finished::NotKept | Finished::Released | Finished::RolledBack(_) => Resolution::Ran {
            output,
            expires_at: None,
        },
    }
}
