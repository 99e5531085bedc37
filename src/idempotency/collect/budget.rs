//! The byte budget the requests in flight through one layer share while their bodies
//! are read and their work runs.

use std::{
    fmt,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
};

/// The bytes of request bodies that the requests in flight through one layer (and
/// its clones) may hold at once.
///
/// A counter, not a semaphore: nothing ever waits for bytes (a request that cannot
/// have them now is refused), and tokio's `Semaphore` takes a mutex on every release,
/// which every protected request would contend for on a multi-threaded runtime.
pub(crate) struct Budget {
    available: AtomicUsize,
    capacity: usize,
}

impl Budget {
    /// A budget of `bytes`.
    pub(crate) fn new(bytes: usize) -> Arc<Self> {
        Arc::new(Self {
            available: AtomicUsize::new(bytes),
            capacity: bytes,
        })
    }

    /// The whole budget.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The bytes no request holds now.
    pub(crate) fn available(&self) -> usize {
        self.available.load(Ordering::Relaxed)
    }

    /// An empty reservation, to grow as a body is read.
    pub(crate) fn reserve(self: &Arc<Self>) -> Reservation {
        Reservation {
            budget: self.clone(),
            bytes: 0,
        }
    }

    /// Takes `bytes` if that many are free; never waits.
    fn take(&self, bytes: usize) -> Result<(), Overloaded> {
        self.available
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |available| {
                available.checked_sub(bytes)
            })
            .map(drop)
            .map_err(|_| Overloaded)
    }

    fn give_back(&self, bytes: usize) {
        self.available.fetch_add(bytes, Ordering::AcqRel);
    }
}

impl fmt::Debug for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Budget")
            .field("capacity", &self.capacity)
            .field("available", &self.available())
            .finish()
    }
}

/// The budget cannot give the bytes asked for now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Overloaded;

/// The bytes of the budget one request holds; all given back when it is dropped, on
/// whatever path (done, refused, failed, cancelled, panicked).
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Reservation {
    /// Holds `bytes` in all, taking more from the budget if needed; never waits: fails
    /// at once, holding what it held, when the budget has not that much free.
    pub(super) fn grow_to(&mut self, bytes: usize) -> Result<(), Overloaded> {
        let more = bytes.saturating_sub(self.bytes);
        if more > 0 {
            self.budget.take(more)?;
            self.bytes += more;
        }
        Ok(())
    }

    /// Gives back all but `bytes`.
    pub(super) fn shrink_to(&mut self, bytes: usize) {
        if bytes < self.bytes {
            self.budget.give_back(self.bytes - bytes);
            self.bytes = bytes;
        }
    }

    /// The bytes held.
    #[cfg(test)]
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.shrink_to(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reservation_takes_what_is_free_and_gives_it_all_back() {
        let budget = Budget::new(100);
        let mut a = budget.reserve();
        let mut b = budget.reserve();

        a.grow_to(60).unwrap();
        assert_eq!(b.grow_to(50), Err(Overloaded), "never more than the budget");
        assert_eq!(b.bytes(), 0, "a failed take holds nothing more");
        b.grow_to(40).unwrap();
        assert_eq!(budget.available(), 0);
        a.grow_to(10).unwrap();
        assert_eq!(a.bytes(), 60, "growing to less is a no-op");

        a.shrink_to(20);
        assert_eq!(budget.available(), 40);
        drop(a);
        drop(b);
        assert_eq!(budget.available(), 100);
    }

    #[test]
    fn a_budget_of_every_byte_takes_more_than_four_gigabytes_at_once() {
        let budget = Budget::new(usize::MAX);
        let mut big = budget.reserve();
        let bytes = u32::MAX as usize + 10;
        big.grow_to(bytes).unwrap();
        assert_eq!(budget.available(), usize::MAX - bytes);
        assert_eq!(
            budget.reserve().grow_to(usize::MAX),
            Err(Overloaded),
            "no more than what is free"
        );
        drop(big);
        assert_eq!(budget.available(), usize::MAX);
    }
}
