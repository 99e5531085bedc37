//! What every transport's layer configures the same way: how long outcomes are kept,
//! the lease, what a duplicate of work in flight gets, and what a store failure does.

use std::time::Duration;

// The defaults, which the setters' docs give with their reasons; the crates of the
// workspace read them, users read a policy's `Debug`.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

pub const DEFAULT_MAX_KEPT_BYTES: usize = 64 * 1024 * 1024;

pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// What a duplicate does while the first request is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlight {
    /// Answer `409 Conflict` with `Retry-After` (the default).
    Reject {
        /// The `Retry-After` to send.
        retry_after: Duration,
    },
    /// Wait up to `timeout` for the first outcome and replay it; past the timeout,
    /// answer `409` as `Reject` does with a `Retry-After` of one second.
    Wait {
        /// The longest wait.
        timeout: Duration,
    },
}

/// What to do when the store cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFailure {
    /// Answer `503` and run nothing (the default): no duplicate can slip through.
    FailClosed,
    /// Run the request without deduplication and log a WARN: availability over safety.
    FailOpen,
}

/// Which outcomes of the handler are stored and replayed; the others release the key,
/// so a retry runs again. Each layer reads the rule in its transport's terms; a layer's
/// own `store_if` closure overrides it.
///
/// | Rule | HTTP | gRPC | Messages |
/// |---|---|---|---|
/// | [`Default`](Self::Default) | all but a 4xx and `503` | `OK` and the server errors (`UNKNOWN`, `DEADLINE_EXCEEDED`, `UNIMPLEMENTED`, `INTERNAL`, `DATA_LOSS`) | every outcome |
/// | [`SuccessesOnly`](Self::SuccessesOnly) | 1xx to 3xx | `OK` | every outcome |
/// | [`AllButRetryable`](Self::AllButRetryable) | all but `408`, `429` and `503` | all but `UNAVAILABLE`, `RESOURCE_EXHAUSTED` and `ABORTED` | every outcome |
///
/// A refusal the layer makes itself (a bad key or client, a body over the limit) is
/// never stored, whatever the rule: nothing ran. A handler that took the PostgreSQL
/// store's `Transaction` has its server errors rolled back and released, whatever the
/// rule: nothing it wrote stands.
///
/// Why the default stores server errors and not a handler's refusals: a refusal (a
/// 4xx, `INVALID_ARGUMENT`) says the request was wrong or not allowed, and a handler
/// refuses before it acts. The client is meant to correct the request and send it
/// again, under the same key when the key names the user's action (a partner
/// contract's `correlation_id`): a stored refusal would answer that corrected request
/// `422 idempotency.fingerprint_mismatch` for the whole TTL, and a retry of the same
/// request gets the same refusal from the handler anyway. Stripe saves no result for a
/// request that failed validation, axum-idempotent caches no 4xx, Powertools stores
/// successes only. A server error is stored because a handler can fail after its side
/// effect (the row written, then a `500`), and then must not run again; this is what
/// the IETF draft's section 2.6 asks ("success or an error"). `503` (`UNAVAILABLE`)
/// says the request was not processed.
///
/// [`SuccessesOnly`](Self::SuccessesOnly) suits handlers whose errors never follow a
/// side effect (one that answers `500` only after its transaction rolled back);
/// [`AllButRetryable`](Self::AllButRetryable) suits handlers whose refusals can follow
/// a side effect (a `402` after a partial charge), whose refusals must replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StorageRule {
    /// Successes and server errors; not a handler's refusals nor "not processed".
    #[default]
    Default,
    /// Successes only: every error releases the key.
    SuccessesOnly,
    /// Everything but the answers that say the request was not processed.
    AllButRetryable,
}

impl StorageRule {
    /// Whether this rule keeps an outcome of `class`.
    pub fn keeps(self, class: OutcomeClass) -> bool {
        match self {
            StorageRule::SuccessesOnly => class == OutcomeClass::Success,
            StorageRule::AllButRetryable => class != OutcomeClass::NotProcessed,
            // `StorageRule::Default` and any rule added later.
            _ => matches!(class, OutcomeClass::Success | OutcomeClass::Failed),
        }
    }
}

/// What an outcome says, in no transport's terms: the class a [`StorageRule`] reads.
/// Each transport sorts its statuses into these (the table on [`StorageRule`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutcomeClass {
    /// It went well: HTTP 1xx to 3xx, gRPC `OK`, a message's outcome.
    Success,
    /// The handler refused it: a 4xx but `408` and `429`, gRPC's `INVALID_ARGUMENT`,
    /// `NOT_FOUND` and the like.
    Refused,
    /// It was not processed and a retry may succeed: `408`, `429`, `503`, gRPC's
    /// `UNAVAILABLE`, `RESOURCE_EXHAUSTED` and `ABORTED`.
    NotProcessed,
    /// The handler failed, possibly after its side effect: the other 5xx, gRPC's
    /// `UNKNOWN`, `DEADLINE_EXCEEDED`, `UNIMPLEMENTED`, `INTERNAL` and `DATA_LOSS`.
    Failed,
}

// The largest outcome kept for replay, which the layers' `max_response_bytes` docs give.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// The settings every idempotency layer shares, whatever its transport: how long an
/// outcome is replayed, the claim's lease, the bytes kept for a store that is down,
/// what a duplicate of work in flight gets, what a store failure does, and which
/// outcomes are stored.
///
/// Build one with [`Policy::new`] and its setters, hand it to a layer with
/// `.policy(p)` (`IdempotencyLayer::policy`, `MessageIdempotencyLayer::policy`, and
/// the gRPC layer's); its `Debug` shows what a layer uses. One policy can go to
/// several layers. Settings of one transport (body limits, header names, key
/// extractors) stay on its layer.
///
/// ```
/// use std::time::Duration;
/// use tower_ids_core::{InFlight, Policy, StorageRule};
///
/// let policy = Policy::new()
///     .ttl(Duration::from_secs(3600))
///     .in_flight(InFlight::Wait { timeout: Duration::from_secs(5) })
///     .storage(StorageRule::SuccessesOnly);
/// assert_eq!(policy.ttl, Duration::from_secs(3600));
/// // `IdempotencyLayer::new().policy(policy)?` hands it to a layer.
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Policy {
    pub ttl: Duration,
    /// `None`: 10 seconds, or the shortest the store allows if that is longer.
    pub lease: Option<Duration>,
    pub max_kept_bytes: usize,
    pub in_flight: InFlight,
    pub store_failure: StoreFailure,
    pub storage: StorageRule,
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("ttl", &self.ttl)
            .field("lease", &self.lease.unwrap_or(DEFAULT_LEASE))
            .field("max_kept_bytes", &self.max_kept_bytes)
            .field("in_flight", &self.in_flight)
            .field("store_failure", &self.store_failure)
            .field("storage", &self.storage)
            .finish()
    }
}

impl Default for Policy {
    fn default() -> Self {
        Self::new()
    }
}

impl Policy {
    /// The defaults: a TTL of 24 hours, a lease of 10 seconds (or the shortest the
    /// store allows, if longer), 64 MiB kept, [`InFlight::Reject`] with a retry after 1
    /// second, [`StoreFailure::FailClosed`], [`StorageRule::Default`].
    pub const fn new() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            lease: None,
            max_kept_bytes: DEFAULT_MAX_KEPT_BYTES,
            in_flight: InFlight::Reject {
                retry_after: DEFAULT_RETRY_AFTER,
            },
            store_failure: StoreFailure::FailClosed,
            storage: StorageRule::Default,
        }
    }

    /// How long an outcome is replayed: at least the longest retry (or redelivery)
    /// window. Default 24 hours, as Stripe's keys: a client's retries across a working
    /// day and a restart.
    #[must_use]
    pub const fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The longest store outage a running request's claim outlives, counted from when
    /// the outage began. Default 10 seconds, or the shortest the store allows if that is
    /// longer. The claim holds the key for the lease and half again and is
    /// renewed every quarter of the lease while the handler runs, so a handler may run
    /// longer than its lease, and a crashed worker locks its key for at most one and a
    /// half leases. A shorter lease frees such keys sooner but renews more often.
    ///
    /// A layer refuses this policy with a [`PolicyError`] if a quarter of the lease
    /// does not cover its store's
    /// [`recovery_time`](crate::store::IdempotencyStore::recovery_time)
    /// (its command timeout, the replicas' wait, reconnecting) plus the 50 ms before a
    /// failed renewal is tried again: such a claim could run out in an outage shorter
    /// than the lease. The error names the shortest lease that would do.
    #[must_use]
    pub const fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// The most response bytes a layer keeps for outcomes the store could not take
    /// when their request ended (they are stored from a task of their own as soon as it
    /// can), per layer. Default 64 MiB; past it, an outcome is kept without its
    /// response, and its duplicates are refused as not replayable (`410` over HTTP),
    /// never run again.
    #[must_use]
    pub const fn max_kept_bytes(mut self, max: usize) -> Self {
        self.max_kept_bytes = max;
        self
    }

    /// What a duplicate does while the first is running. Default [`InFlight::Reject`]
    /// with a `retry_after` of 1 second (`Retry-After: 1` on a `409`).
    #[must_use]
    pub const fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.in_flight = in_flight;
        self
    }

    /// What to do when the store fails. Default [`StoreFailure::FailClosed`].
    #[must_use]
    pub const fn store_failure(mut self, failure: StoreFailure) -> Self {
        self.store_failure = failure;
        self
    }

    /// Which outcomes are stored. Default [`StorageRule::Default`].
    #[must_use]
    pub const fn storage(mut self, rule: StorageRule) -> Self {
        self.storage = rule;
        self
    }
}

/// A [`Policy`] a layer refused: its lease is too short for the layer's store (see
/// [`Policy::lease`]). Its text names the shortest lease that would do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    pub lease: Duration,
    pub shortest: Duration,
}

impl PolicyError {
    /// The shortest lease the store allows.
    pub fn shortest_lease(&self) -> Duration {
        self.shortest
    }
}

impl std::fmt::Display for PolicyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a lease of {:?} cannot outlive a store outage: a claim is renewed every quarter lease, and after an outage the store needs up to {:?} (its command timeout, the replicas' wait, reconnecting, and the 50 ms before a failed renewal is tried again) before a renewal lands; set a lease of at least {:?}, or shorten the store's timeouts",
            self.lease,
            self.shortest / 4,
            self.shortest
        )
    }
}

impl std::error::Error for PolicyError {}
