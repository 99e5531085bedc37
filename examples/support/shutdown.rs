//! The graceful stop the examples share: the signal that starts it (Ctrl-C, or SIGTERM
//! as a service manager or a rolling deploy sends it), the `--drain-timeout-ms` flag, and
//! the last step, once the example took no more work and its work in flight is done:
//! waiting for what its idempotency layers still owe their store
//! ([`Drain`](tower_ids::idempotency::Drain)).
//!
//! A layer finishes some work after its answer has gone: the outcome of a request the
//! store could not take (paused, failing over) is kept and stored as soon as the store
//! is back, and a handler whose client hung up runs on. A process that exits first
//! leaves the key claimed without an outcome, and once the claim runs out a retry runs
//! the handler again.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tower_ids::idempotency::Drain;

/// Default `--drain-timeout-ms`: 10 s, the library's default lease. A claim outlives a
/// store outage shorter than its lease, and a kept outcome is stored within half a
/// second of the store answering again, so 10 s waits out any outage the claims
/// themselves are built to survive, and leaves room within Kubernetes' default grace
/// period of 30 s between SIGTERM and SIGKILL.
pub(crate) const DRAIN_TIMEOUT_MS: u64 = 10_000;

/// The `--drain-timeout-ms` flag.
#[derive(clap::Args, Debug, Clone, Copy)]
pub(crate) struct DrainArgs {
    /// Milliseconds a graceful stop waits, once the work in flight is done, for what the
    /// idempotency layers still owe their store (outcomes kept while the store was away,
    /// handlers whose client hung up, releases not yet answered); past it, each piece
    /// left is logged (WARN `idempotency.drain_unsettled`) and the process exits.
    #[arg(long, global = true, default_value_t = DRAIN_TIMEOUT_MS)]
    pub(crate) drain_timeout_ms: u64,
}

impl DrainArgs {
    pub(crate) fn timeout(self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }
}

/// Resolves on Ctrl-C, or on SIGTERM on Unix, and says which.
pub(crate) async fn signal() -> &'static str {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => "SIGINT",
        () = terminate => "SIGTERM",
    }
}

/// Waits, all within one `timeout`, for every layer's [`Drain`] (each logs INFO
/// `idempotency.drained`, or a WARN `idempotency.drain_unsettled` per piece left in its
/// request's span), then logs the sum: INFO `shutdown.drained`, or WARN
/// `shutdown.drain_incomplete` with how many pieces were left. Returns that number.
pub(crate) async fn drain(layers: &[Drain], timeout: Duration) -> usize {
    let started = Instant::now();
    let pending: usize = layers.iter().map(Drain::pending).sum();
    let drained = join_all(layers.iter().map(|layer| layer.wait(timeout))).await;
    let unsettled: usize = drained.iter().map(|drained| drained.unsettled).sum();
    let waited_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    if unsettled == 0 {
        tracing::info!(
            event = "shutdown.drained",
            layers = layers.len(),
            pending,
            waited_ms,
            "every idempotency layer settled what it owed its store"
        );
    } else {
        tracing::warn!(
            event = "shutdown.drain_incomplete",
            layers = layers.len(),
            pending,
            unsettled,
            waited_ms,
            timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            "stopping with work the idempotency layers still owed their store: those keys stay claimed until their lease runs out"
        );
    }
    unsettled
}
