//! Idempotent message consumers: each key handled once, its outcome handed back,
//! unchanged, for every redelivery and retry.
//!
//! Brokers deliver at least once: a consumer that dies after handling a message but
//! before acknowledging it gets it again, and a sender that times out sends it again
//! under a new correlation ID. [`MessageIdempotencyLayer`] is the HTTP layer's core
//! without HTTP: a tower layer over any message type `M` whose handler returns an
//! outcome `R` (serde). An extractor ([`ExtractMessageKey`]) reads the key, the parts
//! that scope it and the fingerprint ([`MessageKey`]); the first delivery runs the
//! handler and its outcome is stored as JSON; every duplicate within the TTL gets that
//! outcome back, decoded, without running the handler.
//!
//! The same stores (`MokaStore` in process, `RedisStore`
//! or `PostgresStore` shared by consumers and across restarts), the same claim, lease
//! renewal, completion and keep-until-stored rules (once the handler has produced an
//! outcome the key is never released), the same tracing events and codes.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use serde::{Deserialize, Serialize};
//! use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
//! use tower_ids_core::{IdempotencyKey, KeyRejection};
//! use tower_ids_message::{Handled, MessageIdempotencyLayer, MessageKey};
//!
//! struct Signal { swarm: String, kind: String, key: String, data: Vec<u8> }
//!
//! #[derive(Serialize, Deserialize, Debug, PartialEq)]
//! struct Outcome { status: String }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // Deduplicate on (swarm, signal, key); the data is the fingerprint.
//! let key = |signal: &Signal| -> Result<Option<MessageKey>, KeyRejection> {
//!     let key = IdempotencyKey::new(&signal.key)?;
//!     Ok(Some(MessageKey::new(key).scope(&signal.swarm).scope(&signal.kind).fingerprint(&signal.data)))
//! };
//! let mut consumer = ServiceBuilder::new()
//!     .layer(MessageIdempotencyLayer::new().key(key).require_key(true))
//!     .service(service_fn(|signal: Signal| async move {
//!         Ok::<_, Infallible>(Outcome { status: format!("{} done", signal.kind) })
//!     }));
//!
//! let signal = || Signal {
//!     swarm: "swarm-42".into(), kind: "swarm-start".into(), key: "k-1".into(), data: vec![],
//! };
//! let first = consumer.ready().await.unwrap().call(signal()).await.unwrap();
//! assert!(matches!(first, Handled::Ran(_)));
//! let again = consumer.ready().await.unwrap().call(signal()).await.unwrap();
//! assert!(again.is_replay());
//! assert_eq!(first.outcome(), again.outcome());
//! # }
//! ```
//!
//! # What a consumer does with each answer
//!
//! | [`Handled`] | Ack | Publish |
//! |---|---|---|
//! | `Ran(outcome)` | ack | the outcome |
//! | `Replayed { outcome, .. }` | ack | the stored outcome, unchanged: identical to the first |
//! | `InFlight { retry_after }` | nack, requeue (after `retry_after`) | nothing yet |
//! | `Refused(r)` if `r.retryable()` | nack, requeue | nothing |
//! | `Refused(r)` otherwise | reject (dead-letter) | nothing, or an error outcome |
//! | `Err(e)` (the handler failed; the key is released) | nack, requeue | nothing |
//!
//! Acknowledge after publishing the outcome: a consumer killed between the two gets
//! the message again, and the redelivery publishes the stored outcome again, identical;
//! the handler does not run again (with a store that outlives the consumer:
//! `RedisStore` or `PostgresStore`). A consumer killed while its handler runs leaves
//! its key claimed until the claim runs out (one and a half leases, 15 s by default;
//! not in the transactional inbox below, where the key is free at once): redeliveries
//! meanwhile are `InFlight`, and the first one after it runs the handler again, as the
//! HTTP layer's "process killed mid-handler" row of
//! the guarantees page (`tower_ids::guide::guarantees`) says.
//!
//! # The transactional inbox
//!
//! Over a `PostgresStore` in
//! transactional mode (`PostgresMode`), the delivery's own
//! transaction holds its key, and the handler finds it with
//! `Transaction::current`: its writes
//! and the dedupe record commit together, and the layer's future returns only after the
//! commit, so the acknowledgement follows it. Killed before the commit, nothing of the
//! delivery stands and its key is free at once: the redelivery runs it. Killed between
//! the commit and the ack, the redelivery replays. Each message's effect lands once.
//!
//! ```rust,ignore
//! let store = PostgresStore::builder(pool).mode(PostgresMode::Transactional).build()?;
//! let consumer = ServiceBuilder::new()
//!     .layer(MessageIdempotencyLayer::with_store(store).key(key))
//!     .service(service_fn(|payment: Payment| async move {
//!         let transaction = Transaction::current().ok_or("no delivery transaction")?;
//!         let mut db = transaction.lock().await?;
//!         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
//!             .bind(payment.amount)
//!             .bind(&payment.account)
//!             .execute(&mut *db)
//!             .await?;
//!         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Paid { id: payment.id })
//!     }));
//! // Ack once `consumer.call(delivery)` returned `Ran` or `Replayed`: after the commit.
//! ```
//!
//! # Correlation
//!
//! Run each delivery inside its correlation ID, read from the message's headers (or
//! envelope) and extended for the delivery with
//! [`MessageCorrelation`](tower_ids_correlation::MessageCorrelation): the layer's events
//! then carry it, and the record keeps the ID of the delivery that ran (replays log it
//! as `original_attempt`). Write the ID and the key into outgoing messages with
//! [`MessageCorrelation::inject`](tower_ids_correlation::MessageCorrelation::inject) and
//! [`IdempotencyKey::inject`](tower_ids_core::IdempotencyKey::inject).
//!
//! # Events
//!
//! As the HTTP layer's (see `tower_ids::idempotency`'s events), in an
//! `idempotency` span with `idempotency_key` and `idempotency_scope`, where the layer
//! records `idempotency_outcome`, `idempotency_request_count` and
//! `idempotency_store_ms` as the HTTP layer does on the request's span (the steps of a
//! delivery that goes well at DEBUG): `idempotency.accepted`,
//! `idempotency.replayed`, `idempotency.stored`, `idempotency.released`,
//! `idempotency.in_flight`, `idempotency.conflict`, `idempotency.not_replayable`,
//! `idempotency.store_failed`, `idempotency.lease_lost`, ...; and
//! `idempotency.rejected` (before the span) for a message refused on its key,
//! `idempotency.outcome_undecodable` and `idempotency.outcome_unserialisable` for
//! outcomes that do not round-trip through JSON.

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(any(feature = "amqp", feature = "kafka"))]
mod drive;
#[cfg(feature = "kafka")]
pub mod kafka;
mod key;
mod layer;
mod service;

#[cfg(any(feature = "amqp", feature = "kafka"))]
pub use self::drive::{
    Received, ATTEMPTS_HEADER, DEFAULT_DRAIN_TIMEOUT, DEFAULT_MAX_ATTEMPTS, DEFAULT_RETRY_PAUSE,
    DELIVERIES, ERROR_HEADER, SOURCE_HEADER,
};
pub use self::{
    key::{ExtractMessageKey, MessageKey, NoMessageKey},
    layer::MessageIdempotencyLayer,
    service::{Handled, MessageIdempotency, Refusal, ResponseFuture},
};

#[cfg(test)]
mod tests {
    use std::{
        convert::Infallible,
        sync::{
            atomic::{AtomicUsize, Ordering},
            Arc,
        },
        time::Duration,
    };

    use serde::{Deserialize, Serialize};
    use tokio::sync::Notify;
    use tower::{service_fn, Service, ServiceExt};

    use super::*;
    use tower_ids_core::{Code, IdempotencyKey, InFlight, KeyRejection, Policy};
    use tower_ids_moka::MokaStore;

    #[derive(Clone)]
    struct Signal {
        kind: &'static str,
        key: Option<&'static str>,
        data: &'static str,
    }

    #[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
    struct Outcome {
        run: usize,
        kind: String,
    }

    type KeyOf = fn(&Signal) -> Result<Option<MessageKey>, KeyRejection>;
    type TestLayer = MessageIdempotencyLayer<Outcome, MokaStore, KeyOf>;

    fn key_of(signal: &Signal) -> Result<Option<MessageKey>, KeyRejection> {
        let Some(key) = signal.key else {
            return Ok(None);
        };
        Ok(Some(
            MessageKey::new(IdempotencyKey::new(key)?)
                .scope("swarm-42")
                .scope(signal.kind)
                .fingerprint(signal.data),
        ))
    }

    fn signal(kind: &'static str, key: &'static str) -> Signal {
        Signal {
            kind,
            key: Some(key),
            data: "{}",
        }
    }

    /// A consumer counting its runs; each outcome names its run.
    fn consumer(
        layer: TestLayer,
        runs: Arc<AtomicUsize>,
    ) -> impl Service<Signal, Response = Handled<Outcome>, Error = &'static str> + Clone {
        tower_layer::Layer::layer(
            &layer,
            service_fn(move |signal: Signal| {
                let runs = runs.clone();
                async move {
                    if signal.data == "fail" {
                        return Err("failed");
                    }
                    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    Ok(Outcome {
                        run,
                        kind: signal.kind.to_owned(),
                    })
                }
            }),
        )
    }

    fn layer() -> TestLayer {
        MessageIdempotencyLayer::new().key(key_of as KeyOf)
    }

    #[tokio::test]
    async fn a_duplicate_gets_the_stored_outcome_and_another_signal_runs() {
        let runs = Arc::new(AtomicUsize::new(0));
        let service = consumer(layer(), runs.clone());
        let first = service
            .clone()
            .oneshot(signal("swarm-start", "k"))
            .await
            .unwrap();
        let again = service
            .clone()
            .oneshot(signal("swarm-start", "k"))
            .await
            .unwrap();
        assert!(matches!(first, Handled::Ran(_)));
        let Handled::Replayed { outcome, replay } = again else {
            panic!("a duplicate is replayed: {again:?}");
        };
        assert_eq!(Some(&outcome), first.outcome());
        assert_eq!(replay.request_count(), 2);
        // The same key on another signal is another command.
        let stop = service
            .clone()
            .oneshot(signal("swarm-stop", "k"))
            .await
            .unwrap();
        assert_eq!(stop.into_outcome().unwrap().run, 2);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn other_data_under_one_key_is_refused_and_never_run() {
        let runs = Arc::new(AtomicUsize::new(0));
        let service = consumer(layer(), runs.clone());
        service
            .clone()
            .oneshot(signal("swarm-start", "k"))
            .await
            .unwrap();
        let other = Signal {
            data: "{\"n\":1}",
            ..signal("swarm-start", "k")
        };
        let Handled::Refused(refusal) = service.oneshot(other).await.unwrap() else {
            panic!("refused");
        };
        assert_eq!(refusal.code(), Code::FingerprintMismatch);
        assert!(!refusal.retryable());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_failed_handler_releases_the_key_and_keys_are_required_when_asked() {
        let runs = Arc::new(AtomicUsize::new(0));
        let service = consumer(layer().require_key(true), runs.clone());
        let failing = Signal {
            data: "fail",
            ..signal("swarm-start", "k")
        };
        assert_eq!(
            service.clone().oneshot(failing.clone()).await.unwrap_err(),
            "failed"
        );
        // Released: the redelivery runs (and fails) again rather than being in flight.
        assert_eq!(
            service.clone().oneshot(failing).await.unwrap_err(),
            "failed"
        );
        let unkeyed = Signal {
            key: None,
            ..signal("swarm-start", "k")
        };
        let Handled::Refused(refusal) = service.clone().oneshot(unkeyed).await.unwrap() else {
            panic!("refused");
        };
        assert_eq!(refusal.code(), Code::KeyMissing);
        let bad = signal("swarm-start", "has space");
        let Handled::Refused(refusal) = service.oneshot(bad).await.unwrap() else {
            panic!("refused");
        };
        assert_eq!(refusal.code(), Code::KeyInvalid);
        assert_eq!(runs.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_duplicate_in_flight_is_handed_back_or_waits() {
        let gate = Arc::new(Notify::new());
        let runs = Arc::new(AtomicUsize::new(0));
        let store = MokaStore::new();
        let slow = |layer: MessageIdempotencyLayer<Outcome, _, _>| {
            let gate = gate.clone();
            let runs = runs.clone();
            tower_layer::Layer::layer(
                &layer,
                service_fn(move |signal: Signal| {
                    let gate = gate.clone();
                    let runs = runs.clone();
                    async move {
                        gate.notified().await;
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        Ok::<_, Infallible>(Outcome {
                            run,
                            kind: signal.kind.to_owned(),
                        })
                    }
                }),
            )
        };
        let reject = slow(MessageIdempotencyLayer::with_store(store.clone()).key(key_of as KeyOf));
        let wait = slow(
            MessageIdempotencyLayer::with_store(store)
                .key(key_of as KeyOf)
                .policy(Policy::new().in_flight(InFlight::Wait {
                    timeout: Duration::from_secs(5),
                }))
                .unwrap(),
        );
        let first = tokio::spawn(reject.clone().oneshot(signal("swarm-start", "k")));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let handed_back = reject.oneshot(signal("swarm-start", "k")).await.unwrap();
        assert!(
            matches!(handed_back, Handled::InFlight { .. }),
            "{handed_back:?}"
        );
        let waiting = tokio::spawn(wait.oneshot(signal("swarm-start", "k")));
        tokio::time::sleep(Duration::from_millis(50)).await;
        gate.notify_one();
        let first = first.await.unwrap().unwrap();
        let waited = waiting.await.unwrap().unwrap();
        assert!(waited.is_replay());
        assert_eq!(first.outcome(), waited.outcome());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn outcomes_store_if_says_not_to_keep_run_again() {
        let runs = Arc::new(AtomicUsize::new(0));
        let service = consumer(
            layer().store_if(|outcome: &Outcome| outcome.run > 1),
            runs.clone(),
        );
        let first = service
            .clone()
            .oneshot(signal("swarm-start", "k"))
            .await
            .unwrap();
        let second = service
            .clone()
            .oneshot(signal("swarm-start", "k"))
            .await
            .unwrap();
        let third = service.oneshot(signal("swarm-start", "k")).await.unwrap();
        assert!(matches!(first, Handled::Ran(Outcome { run: 1, .. })));
        assert!(matches!(second, Handled::Ran(Outcome { run: 2, .. })));
        assert!(third.is_replay());
        assert_eq!(third.outcome().unwrap().run, 2);
    }

    #[tokio::test]
    async fn an_outcome_too_large_to_keep_is_run_once_and_then_refused() {
        let runs = Arc::new(AtomicUsize::new(0));
        let service = consumer(layer().max_response_bytes(4), runs.clone());
        let first = service
            .clone()
            .oneshot(signal("swarm-start", "k"))
            .await
            .unwrap();
        assert!(matches!(first, Handled::Ran(_)));
        let Handled::Refused(refusal) = service.oneshot(signal("swarm-start", "k")).await.unwrap()
        else {
            panic!("refused");
        };
        assert_eq!(refusal.code(), Code::NotReplayable);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}
