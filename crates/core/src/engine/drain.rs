//! What a layer still owes the store when its service stops: handlers that run on for
//! clients that hung up, outcomes kept until the store takes them, and releases the
//! store has not answered yet. Each registers while it lasts, so a graceful stop can
//! wait for them and name the ones it could not wait for.

use crate::code::event;
use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
    time::Duration,
};

use tokio::sync::watch;

/// What one piece of unsettled work is doing, as the drain's WARN event says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owed {
    /// A handler still running in a task of its own (its client went away).
    Handler,
    /// An outcome kept until the store takes it.
    Outcome,
    /// A key to give up once the store answers.
    Release,
}

impl Owed {
    fn as_str(self) -> &'static str {
        match self {
            Self::Handler => "handler_running",
            Self::Outcome => "outcome_kept",
            Self::Release => "release_pending",
        }
    }
}

/// The unsettled work of one layer and its clones.
#[derive(Default)]
pub struct Outstanding {
    next: AtomicU64,
    pending: Mutex<HashMap<u64, (Owed, tracing::Span)>>,
    /// How many are pending, for waiters.
    count: watch::Sender<usize>,
}

impl Outstanding {
    /// Registers work owed in `span` (its request's) until the returned guard drops.
    pub fn enter(self: &Arc<Self>, owed: Owed, span: tracing::Span) -> Pending {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut pending = self.lock();
        pending.insert(id, (owed, span));
        self.count.send_replace(pending.len());
        Pending {
            outstanding: self.clone(),
            id,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (Owed, tracing::Span)>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Work registered with [`Outstanding`]; it is settled when this drops.
pub struct Pending {
    outstanding: Arc<Outstanding>,
    id: u64,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut pending = self.outstanding.lock();
        let removed = pending.remove(&self.id);
        self.outstanding.count.send_replace(pending.len());
        drop(pending);
        drop(removed);
    }
}

/// Waits, at shutdown, for what an idempotency layer still owes its store.
///
/// A layer finishes some work after its response has gone: a handler whose client
/// hung up runs to completion in a task of its own, an outcome the store could not take
/// is kept and stored later, and a key whose release the store did not answer is
/// released again. A process that exits before they end leaves their keys claimed
/// until the lease runs out, and then a retry runs the handler again. Stop taking
/// requests (axum's `with_graceful_shutdown` returns once every connection is done),
/// then call [`wait`](Self::wait) with a deadline before letting the runtime go.
///
/// Got from the layer: `IdempotencyLayer::drain` (whose docs show it at work),
/// `MessageIdempotencyLayer::drain` or a gRPC layer's. Clones of a layer
/// (per-route variants made from one layer included) share it; layers made apart each
/// have their own.
///
/// # Clone
///
/// Clones wait for the same work.
#[derive(Clone)]
pub struct Drain {
    outstanding: Arc<Outstanding>,
}

impl std::fmt::Debug for Drain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drain")
            .field("pending", &self.pending())
            .finish()
    }
}

/// What [`Drain::wait`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Work still unsettled at the deadline: each one was named in a WARN event
    /// `idempotency.drain_unsettled`.
    pub unsettled: usize,
}

impl Drained {
    /// Whether everything settled before the deadline.
    pub fn is_complete(&self) -> bool {
        self.unsettled == 0
    }
}

/// How the `run` of a consumer driver
/// (`AmqpConsumer`,
/// `KafkaConsumer`) or of an
/// outbox relay (`tower_ids::outbox::Relay`) ended.
///
/// A run ends only when its shutdown future resolves: a broker or a database that
/// fails is logged and waited out, never a reason to return. It then takes no more
/// work and settles what it has in hand within its drain timeout; what is still
/// unsettled at the deadline is named here, as its log lines name it (and a WARN
/// `message.drain_unsettled` or `outbox.drain_unsettled` says so):
///
/// | Run | What is left | Named | Where it goes |
/// |---|---|---|---|
/// | `AmqpConsumer` | deliveries in hand, unacknowledged | the message ID, or `tag-{delivery tag}` | back to the queue, when the connection closes |
/// | `KafkaConsumer` | each partition's message in hand | `topic:partition:offset` | handled again from the committed offset |
/// | `Relay` | the messages of the round under way | `outbox:{message id}` | pending in the outbox: the next round (of any relay) publishes them |
///
/// Whatever is left runs again, and the layer replays what had committed, so nothing
/// is lost; a stop that leaves nothing ([`is_complete`](Self::is_complete)) leaves
/// nothing to run again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stopped {
    /// What was in hand and unsettled at the drain's deadline, by name, in no
    /// particular order.
    pub left: Vec<String>,
}

impl Stopped {
    /// Whether everything in hand was settled before the deadline.
    pub fn is_complete(&self) -> bool {
        self.left.is_empty()
    }
}

/// What a driver or a relay has in hand, by name, while it has it, and what it let go
/// of unsettled: what a stop names in [`Stopped::left`].
#[derive(Debug, Clone, Default)]
pub struct InHand(Arc<Mutex<Hands>>);

#[derive(Debug, Default)]
struct Hands {
    next: u64,
    held: HashMap<u64, String>,
    /// Let go of unsettled before the stop (a retry in place the stop ended).
    left: Vec<String>,
}

impl InHand {
    /// Holds `name` until the returned guard drops (settled, or its task aborted).
    pub fn hold(&self, name: String) -> Held {
        let mut hands = self.lock();
        let id = hands.next;
        hands.next += 1;
        hands.held.insert(id, name);
        Held {
            in_hand: self.clone(),
            id,
        }
    }

    /// What is held now and what was let go of unsettled, as a stop reports it.
    pub fn stopped(&self) -> Stopped {
        let hands = self.lock();
        Stopped {
            left: hands
                .left
                .iter()
                .chain(hands.held.values())
                .cloned()
                .collect(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Hands> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A name held in an [`InHand`] until this drops.
#[derive(Debug)]
pub struct Held {
    in_hand: InHand,
    id: u64,
}

impl Held {
    /// Lets go of it unsettled: the stop names it among what it left.
    pub fn leave(self) {
        let mut hands = self.in_hand.lock();
        if let Some(name) = hands.held.remove(&self.id) {
            hands.left.push(name);
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.in_hand.lock().held.remove(&self.id);
    }
}

impl Drain {
    pub fn new(outstanding: Arc<Outstanding>) -> Self {
        Self { outstanding }
    }

    /// How much work is unsettled now.
    pub fn pending(&self) -> usize {
        *self.outstanding.count.borrow()
    }

    /// Waits until every handler the layer detached has finished and every outcome it
    /// kept is stored (or its release answered), or `timeout` has passed. Each piece
    /// still unsettled then gets a WARN event `idempotency.drain_unsettled`, in its
    /// request's span (so with its `idempotency_key` and `correlation_id`), saying
    /// what it was doing (`owed`: `handler_running`, `outcome_kept` or
    /// `release_pending`): its key stays claimed until its claim ends (the lease runs
    /// out; in a transactional store, its transaction ends with the process), and a
    /// retry after that may run the handler again.
    pub async fn wait(&self, timeout: Duration) -> Drained {
        let mut count = self.outstanding.count.subscribe();
        let settled = tokio::time::timeout(timeout, count.wait_for(|pending| *pending == 0));
        if matches!(settled.await, Ok(Ok(_))) {
            tracing::info!(
                target: "tower_ids::idempotency",
                event = event::DRAINED,
                "every outcome this layer owed the store is settled"
            );
            return Drained { unsettled: 0 };
        }
        let pending: Vec<_> = self
            .outstanding
            .lock()
            .values()
            .map(|(owed, span)| (*owed, span.clone()))
            .collect();
        for (owed, span) in &pending {
            tracing::warn!(
                target: "tower_ids::idempotency",
                parent: span,
                event = event::DRAIN_UNSETTLED,
                owed = owed.as_str(),
                timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                "shutting down with this key unsettled: it stays claimed until its claim ends (its lease runs out, or its transaction ends with the process), and a retry after that may run the handler again"
            );
        }
        Drained {
            unsettled: pending.len(),
        }
    }
}
