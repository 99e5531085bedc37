//! In-memory mode (the default): the latest `--max-commands` commands in a list, and a
//! queue to the publisher.

use std::{
    collections::{HashMap, VecDeque},
    num::NonZeroUsize,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

use time::OffsetDateTime;
use tokio::{sync::mpsc, time::Instant};
use uuid::Uuid;

use crate::{
    api::ApiError,
    publisher::{Origin, Publish},
    routes::{Command, NewCommand, Status, Storage},
};

/// Default `--max-commands`: commands the in-memory list keeps. Creating one more drops
/// the oldest, as a user of a demo expects it to keep taking commands (refusing new ones
/// would stop it for good); a real service keeps them in a database. 1,000 commands of
/// at most `MAX_BODY_BYTES` hold at most 64 MiB of payload, which is also the most a
/// `GET /commands` answer carries (in DB mode, which keeps every command, `GET /commands`
/// answers the newest this many).
pub(crate) const MAX_COMMANDS: NonZeroUsize = NonZeroUsize::new(1000).unwrap();

/// In-memory mode: the command list, and the queue to the publisher
/// ([`publish`](crate::publisher::publish)). Nothing survives the process, and each
/// replica has its own commands.
#[derive(Clone)]
pub(crate) struct Memory {
    pub(crate) commands: Commands,
    /// The broker, as far as the handlers know.
    pub(crate) queue: mpsc::Sender<Publish>,
}

impl Storage for Memory {
    /// Nothing: a write in memory stands as soon as it is made.
    type Transaction = ();

    async fn create(&self, (): (), new: NewCommand, origin: Origin) -> Result<Command, ApiError> {
        // Take a queue slot first, so a stored command is always queued.
        let slot = self
            .queue
            .reserve()
            .await
            .map_err(|_| ApiError::PublisherStopped)?;

        let command = Command {
            id: Uuid::now_v7(),
            device_id: new.device_id,
            name: new.name,
            payload: new.payload,
            status: Status::Queued,
            created_at: OffsetDateTime::now_utc(),
        };
        let dropped = self.commands.lock().insert(command.clone());
        if let Some(dropped) = dropped {
            tracing::info!(
                event = "commands.evicted",
                command_id = %dropped.id,
                status = ?dropped.status,
                "command list full: oldest command dropped"
            );
        }
        slot.send(Publish {
            command_id: command.id,
            origin,
            queued_at: Instant::now(),
        });
        Ok(command)
    }

    async fn list(&self) -> Result<Vec<Command>, ApiError> {
        Ok(self.commands.lock().commands.iter().cloned().collect())
    }

    async fn get(&self, id: Uuid) -> Result<Command, ApiError> {
        let store = self.commands.lock();
        let command = store.get(id).ok_or_else(|| ApiError::not_found(id))?;
        Ok(command.clone())
    }

    async fn cancel(&self, (): (), id: Uuid) -> Result<Command, ApiError> {
        let mut store = self.commands.lock();
        let command = store.get_mut(id).ok_or_else(|| ApiError::not_found(id))?;
        match command.status {
            Status::Queued => {
                command.status = Status::Cancelled;
                tracing::info!(event = "commands.cancelled", command_id = %id, "command cancelled");
            }
            // Cancelling twice is not an error: the command is cancelled either way.
            Status::Cancelled => {}
            Status::Sent => return Err(ApiError::AlreadySent),
        }
        Ok(command.clone())
    }
}

/// The command store: the latest `--max-commands` commands in creation order, indexed by
/// ID. Creating one more drops the oldest (see [`MAX_COMMANDS`] for why).
#[derive(Clone)]
pub(crate) struct Commands(Arc<Mutex<Store>>);

pub(crate) struct Store {
    commands: VecDeque<Command>,
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
    fn insert(&mut self, command: Command) -> Option<Command> {
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

    fn get(&self, id: Uuid) -> Option<&Command> {
        self.commands.get(self.position(id)?)
    }

    pub(crate) fn get_mut(&mut self, id: Uuid) -> Option<&mut Command> {
        let position = self.position(id)?;
        self.commands.get_mut(position)
    }
}
