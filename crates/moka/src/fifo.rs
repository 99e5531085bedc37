//! A byte-bounded FIFO queue behind one lock, with the part of moka's API the store
//! uses: the yardstick for what moka costs a first execution. Built only with
//! `--cfg tower_ids_fifo_index`.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, PoisonError},
};

use super::{BuildScopeHasher, ScopeKey, Stored};

#[derive(Clone)]
pub(super) struct FifoIndex(Arc<Mutex<Fifo>>);

struct Fifo {
    max_bytes: usize,
    bytes: usize,
    records: HashMap<ScopeKey, Arc<Stored>, BuildScopeHasher>,
    /// Oldest first; an entry whose record was replaced since is skipped.
    order: VecDeque<(ScopeKey, u64)>,
}

impl FifoIndex {
    pub(super) fn new(max_bytes: usize) -> Self {
        Self(Arc::new(Mutex::new(Fifo {
            max_bytes,
            bytes: 0,
            records: HashMap::default(),
            order: VecDeque::new(),
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Fifo> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn insert(&self, scope: ScopeKey, stored: Arc<Stored>) {
        let mut fifo = self.lock();
        fifo.bytes += stored.weight as usize;
        fifo.order.push_back((scope, stored.token));
        if let Some(replaced) = fifo.records.insert(scope, stored) {
            fifo.bytes -= replaced.weight as usize;
        }
        while fifo.bytes > fifo.max_bytes {
            let Some((oldest, token)) = fifo.order.pop_front() else {
                break;
            };
            if fifo.records.get(&oldest).is_some_and(|r| r.token == token) {
                let evicted = fifo.records.remove(&oldest).map_or(0, |r| r.weight);
                fifo.bytes -= evicted as usize;
            }
        }
    }

    pub(super) fn entry_count(&self) -> u64 {
        self.lock().records.len() as u64
    }

    pub(super) fn weighted_size(&self) -> u64 {
        self.lock().bytes as u64
    }

    pub(super) fn run_pending_tasks(&self) {}
}
