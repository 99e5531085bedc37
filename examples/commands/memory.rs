//! The in-memory command list: the latest `--max-commands` commands.

use std::{
    collections::{HashMap, VecDeque},
    num::NonZeroUsize,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

use uuid::Uuid;

use crate::routes::Command;

/// Default `--max-commands`: commands the in-memory list keeps. Creating one more drops
/// the oldest, as a user of a demo expects it to keep taking commands (refusing new ones
/// would stop it for good); a real service keeps them in a database. 1,000 commands of
/// at most `MAX_BODY_BYTES` hold at most 64 MiB of payload, which is also the most a
/// `GET /commands` answer carries.
pub(crate) const MAX_COMMANDS: NonZeroUsize = NonZeroUsize::new(1000).unwrap();

/// The command store: the latest `--max-commands` commands in creation order, indexed by
/// ID. Creating one more drops the oldest (see [`MAX_COMMANDS`] for why).
#[derive(Clone)]
pub(crate) struct Commands(Arc<Mutex<Store>>);

pub(crate) struct Store {
    pub(crate) commands: VecDeque<Command>,
    /// Each command's sequence number: its position in `commands`, plus `dropped`.
    index: HashMap<Uuid, u64>,
    /// Commands dropped from the front so far.
    dropped: u64,
    max: NonZeroUsize,
}

impl Commands {
    pub(crate) fn new(max: NonZeroUsize) -> Self {
        Self(Arc::new(Mutex::new(Store {
            commands: VecDeque::new(),
            index: HashMap::new(),
            dropped: 0,
            max,
        })))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Store> {
        // The store holds plain data that every write leaves consistent.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Store {
    /// Stores `command`, and returns the oldest one if it had to go to make room.
    pub(crate) fn insert(&mut self, command: Command) -> Option<Command> {
        let oldest = if self.commands.len() >= self.max.get() {
            self.commands.pop_front()
        } else {
            None
        };
        if let Some(oldest) = &oldest {
            self.index.remove(&oldest.id);
            self.dropped += 1;
        }
        let sequence = self.dropped + self.commands.len() as u64;
        self.index.insert(command.id, sequence);
        self.commands.push_back(command);
        oldest
    }

    fn position(&self, id: Uuid) -> Option<usize> {
        usize::try_from(self.index.get(&id)? - self.dropped).ok()
    }

    pub(crate) fn get(&self, id: Uuid) -> Option<&Command> {
        self.commands.get(self.position(id)?)
    }

    pub(crate) fn get_mut(&mut self, id: Uuid) -> Option<&mut Command> {
        let position = self.position(id)?;
        self.commands.get_mut(position)
    }
}
