//! What every transport's layer configures the same way: how long outcomes are kept,
//! the lease, what a duplicate of work in flight gets, and what a store failure does.

use std::time::Duration;

/// How long a stored outcome is replayed: 24 hours, as Stripe's keys, covering a
/// client's retries across a working day and a restart.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// How long a store outage a running request's claim outlives: 10 seconds. A claim is
/// written to hold its key for the lease and half again and renewed every quarter of
/// the lease while its handler runs, so at any moment it has at least the lease left:
/// a store paused, down or restarting for less than the lease, counted from when the
/// outage began, never frees the key of a request still running. A crashed worker's
/// key stays locked for at most one and a half leases after its last renewal. The
/// lease does not bound how long a handler may run.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// The most response bytes kept by outcomes waiting for the store (it failed when they
/// were stored): 64 MiB, per layer. Past it an outcome is kept without its response,
/// so its duplicates get `410`, never a second run.
pub const DEFAULT_MAX_KEPT_BYTES: usize = 64 * 1024 * 1024;

/// `Retry-After` on a `409` for a request in flight (and the `retry_after` of a
/// message in flight): 1 second.
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

/// The settings every transport shares, with their defaults.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Policy {
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) max_kept_bytes: usize,
    pub(crate) in_flight: InFlight,
    pub(crate) store_failure: StoreFailure,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            max_kept_bytes: DEFAULT_MAX_KEPT_BYTES,
            in_flight: InFlight::Reject {
                retry_after: DEFAULT_RETRY_AFTER,
            },
            store_failure: StoreFailure::FailClosed,
        }
    }
}
