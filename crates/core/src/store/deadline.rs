//! Deadlines the store checks against its own clock, so that a command reaching it after
//! its caller gave up (it sat in a paused server's socket, or went out on a connection
//! re-made after the caller's timeout) changes nothing.
//!
//! Why a deadline in the store's clock: the store is the only party that knows when a
//! command runs, and a fencing token cannot tell a late claim from a timely one (the
//! late claim is a new request with a token of its own). Why no synchronised clocks are
//! needed: the store's time is read now and then (`TIME`, `clock_timestamp()`), and each
//! reading, taken between sending and receiving, bounds the offset between the two
//! clocks: `offset >= store_time - received`. A deadline sent as
//! `give_up + that lower bound` is never later, by the store's clock, than the moment
//! the caller gives up; so a command the store runs after that moment is always
//! refused. The price of the bound's slack (the reading's round trip, at most a quarter
//! of the command timeout, as readings slower than that are not kept) is that a command
//! arriving just before its caller's timeout may be refused too: a store failure the
//! layer already answers.
//!
//! What it rests on: the two clocks run at the same rate between readings (a drift of
//! 100 ppm is a millisecond over the ten seconds a reading is kept, covered by
//! `DRIFT_MARGIN`), and the store's clock is not stepped back. A step back by `x`
//! lets a command run up to `x` late until the next reading replaces the bound (within
//! `FORGET_AFTER`).

use std::{
    future::Future,
    sync::{Mutex, PoisonError, Weak},
    time::{Duration, Instant},
};

use super::StoreError;

/// How often a store reads its server's clock in the background.
pub const READ_EVERY: Duration = Duration::from_secs(1);

/// A bound older than this is replaced by the next reading even if that reading is
/// looser, so a stepped clock or a new server (a failover) is learned within it.
const FORGET_AFTER: Duration = Duration::from_secs(10);

/// Taken off every deadline for the drift of the two clocks since the reading, and for
/// the store's clock being read in whole microseconds.
const DRIFT_MARGIN: Duration = Duration::from_millis(2);

/// What the store's clock is known to be ahead of this process's, at least.
#[derive(Debug)]
pub struct StoreClock {
    origin: Instant,
    /// Readings slower than this are not kept: their bound would be too loose.
    max_round_trip: Duration,
    bound: Mutex<Option<Bound>>,
}

#[derive(Debug, Clone, Copy)]
struct Bound {
    /// Store microseconds since the Unix epoch minus local microseconds since `origin`.
    offset_us: i64,
    taken: Instant,
}

impl StoreClock {
    /// A clock for a store whose commands are bounded by `command_timeout`.
    pub fn new(command_timeout: Duration) -> Self {
        Self {
            origin: Instant::now(),
            max_round_trip: (command_timeout / 4).max(Duration::from_millis(1)),
            bound: Mutex::new(None),
        }
    }

    fn local_us(&self, at: Instant) -> i64 {
        i64::try_from(at.saturating_duration_since(self.origin).as_micros()).unwrap_or(i64::MAX)
    }

    /// Learns from one reading of the store's clock, `store_us` (microseconds since the
    /// Unix epoch), taken by a call sent at `sent` and answered at `received`.
    pub fn observe(&self, store_us: i64, sent: Instant, received: Instant) {
        let round_trip = received.saturating_duration_since(sent);
        if round_trip > self.max_round_trip {
            return;
        }
        let reading = Bound {
            offset_us: store_us.saturating_sub(self.local_us(received)),
            taken: received,
        };
        let mut bound = self.bound.lock().unwrap_or_else(PoisonError::into_inner);
        let keep = match *bound {
            None => true,
            Some(old) => {
                // A tighter bound is always true; an older one may be stale.
                reading.offset_us >= old.offset_us
                    || received.saturating_duration_since(old.taken) > FORGET_AFTER
            }
        };
        if keep {
            *bound = Some(reading);
        }
    }

    /// The deadline, in the store's microseconds since the Unix epoch, for a command
    /// whose caller gives up at `give_up`; `None` before the first reading.
    pub fn deadline(&self, give_up: Instant) -> Option<i64> {
        let bound = (*self.bound.lock().unwrap_or_else(PoisonError::into_inner))?;
        let margin = i64::try_from(DRIFT_MARGIN.as_micros()).unwrap_or(0);
        Some(
            self.local_us(give_up)
                .saturating_add(bound.offset_us)
                .saturating_sub(margin),
        )
    }

    /// Reads the store's clock with `read` (bounded by `timeout`) and learns from it.
    pub async fn read<F>(&self, timeout: Duration, read: F) -> Result<(), StoreError>
    where
        F: Future<Output = Result<i64, StoreError>>,
    {
        let sent = Instant::now();
        let store_us = tokio::time::timeout(timeout, read)
            .await
            .map_err(|_| StoreError::new("reading the store's clock: timed out"))??;
        self.observe(store_us, sent, Instant::now());
        Ok(())
    }

    /// The deadline for a command given up at `give_up`, reading the store's clock
    /// first (a few times, for a tight bound) if it was never read.
    pub async fn deadline_or_read<F, Fut>(
        &self,
        give_up: Instant,
        timeout: Duration,
        read: F,
    ) -> Result<i64, StoreError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<i64, StoreError>>,
    {
        if let Some(deadline) = self.deadline(give_up) {
            return Ok(deadline);
        }
        for _ in 0..3 {
            self.read(timeout, read()).await?;
        }
        self.deadline(give_up).ok_or_else(|| {
            StoreError::new("the store's clock answered too slowly to bound a deadline")
        })
    }
}

/// Reads the store's clock every [`READ_EVERY`] while `clock` lives.
pub fn read_in_background<F, Fut>(clock: Weak<StoreClock>, timeout: Duration, read: F)
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<i64, StoreError>> + Send,
{
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(READ_EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(clock) = clock.upgrade() else {
                return;
            };
            // A failed reading keeps the bound it had; the commands say what failed.
            let _ = clock.read(timeout, read()).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_never_lies_after_the_give_up() {
        let clock = StoreClock::new(Duration::from_millis(250));
        let sent = Instant::now();
        let received = sent + Duration::from_millis(3);
        // The store is 5 s ahead; it read its clock 1 ms after the call was sent.
        let true_offset_us = 5_000_000;
        let store_us = clock.local_us(sent + Duration::from_millis(1)) + true_offset_us;
        clock.observe(store_us, sent, received);
        let give_up = received + Duration::from_millis(250);
        let deadline = clock.deadline(give_up).unwrap();
        let store_at_give_up = clock.local_us(give_up) + true_offset_us;
        assert!(deadline <= store_at_give_up);
        // ... by no more than the round trip and the margin.
        assert!(store_at_give_up - deadline <= 3_000 + 2_000);
    }

    #[test]
    fn slow_readings_are_not_kept_and_tighter_ones_are() {
        let clock = StoreClock::new(Duration::from_millis(200));
        let sent = Instant::now();
        clock.observe(1_000_000_000, sent, sent + Duration::from_millis(60));
        assert!(
            clock.deadline(sent).is_none(),
            "a reading over 50 ms is dropped"
        );
        clock.observe(1_000_000_000, sent, sent + Duration::from_millis(40));
        let loose = clock.deadline(sent).unwrap();
        clock.observe(1_000_000_000, sent, sent + Duration::from_millis(2));
        let tight = clock.deadline(sent).unwrap();
        assert!(tight > loose);
        clock.observe(1_000_000_000, sent, sent + Duration::from_millis(30));
        assert_eq!(
            clock.deadline(sent).unwrap(),
            tight,
            "a looser, fresh reading waits"
        );
    }
}
