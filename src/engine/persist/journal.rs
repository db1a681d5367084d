//! What this engine owes the store and what it promised about it: the conversations whose
//! finished turns are to be saved at the end of the step, each named conversation's latest
//! manifest write (what [`Engine::durability`](crate::engine::Engine::durability) reports), and
//! the names whose removal is queued but not yet written. The step reads and updates it through
//! the methods below; nothing else touches its fields.

use std::collections::HashMap;

use super::Durability;
use crate::ids::ConversationId;
use crate::kv::{Refused, Store, StoreError};

/// How durable store job `job` (a manifest's write or removal) is: `None`, it could not be
/// queued.
pub(crate) fn outcome(job: Option<u64>, store: &Store) -> Durability {
    let Some(job) = job else {
        return Durability::Failed(StoreError::WriterStopped);
    };
    match store.manifest_outcome(job) {
        None => Durability::Pending,
        Some(Ok(())) => Durability::Durable,
        Some(Err(Refused::Failed(why))) => Durability::Failed(why),
        Some(Err(conflict @ Refused::Conflict(_))) => Durability::Conflict(conflict.to_string()),
    }
}

/// Whether a name's removal, queued by this engine, stands between a resume and the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Removal {
    /// None queued (or one long written and forgotten).
    None,
    /// Queued and not yet written: the name is gone, whatever the store still says.
    Pending,
    /// Written since: a read of the store made before it may still show the manifest.
    Written,
}

#[derive(Debug)]
pub(crate) struct Journal {
    /// This engine's identity in the stamps of the manifests it writes (random).
    writer: u64,
    /// Conversations whose turn ended this step, to save to the store.
    to_save: Vec<ConversationId>,
    /// Per named conversation, its latest manifest write (`None`: it could not be queued).
    manifest_writes: HashMap<ConversationId, Option<u64>>,
    /// Names of closed conversations whose manifests' removal is queued, with the store mark
    /// that covers it.
    removals: HashMap<String, u64>,
}

impl Journal {
    pub fn new() -> Self {
        Self {
            writer: std::hash::BuildHasher::hash_one(
                &std::collections::hash_map::RandomState::new(),
                (std::process::id(), std::time::SystemTime::now()),
            ),
            to_save: Vec::new(),
            manifest_writes: HashMap::new(),
            removals: HashMap::new(),
        }
    }

    /// `id`'s turn ended: its chunks and manifest are saved at the end of the step.
    pub fn save_after_step(&mut self, id: ConversationId) {
        self.to_save.push(id);
    }

    /// The conversations to save now, in the order their turns ended.
    pub fn take_saves(&mut self) -> Vec<ConversationId> {
        std::mem::take(&mut self.to_save)
    }

    /// The stamp of this engine's manifest of `revision`.
    pub fn stamp(&self, revision: u64) -> String {
        format!("{:016x}-{revision}", self.writer)
    }

    /// `id`'s manifest write was queued as store job `write` (`None`: it could not be).
    pub fn wrote(&mut self, id: ConversationId, write: Option<u64>) {
        self.manifest_writes.insert(id, write);
    }

    /// This engine no longer holds `id`: what it wrote is the store's to tell.
    pub fn forget(&mut self, id: ConversationId) {
        self.manifest_writes.remove(&id);
    }

    /// How durable named conversation `id`'s state in `store` is.
    pub fn durability(&self, id: ConversationId, store: &Store) -> Durability {
        match self.manifest_writes.get(&id) {
            // Resumed from the store, nothing written since.
            None => Durability::Durable,
            Some(&write) => outcome(write, store),
        }
    }

    /// `name`'s manifest removal was just queued in `store` as job `job` (`None`: it could
    /// not be).
    pub fn removed(&mut self, name: &str, job: Option<u64>, store: &Store) {
        self.removals.retain(|_, &mut mark| !store.reached(mark));
        self.removals
            .insert(name.to_string(), job.unwrap_or_else(|| store.mark()));
    }

    /// Where `name`'s queued removal stands in `store`; once written it is reported once, then
    /// forgotten.
    pub fn removal(&mut self, name: &str, store: &Store) -> Removal {
        match self.removals.get(name) {
            None => Removal::None,
            Some(&mark) if !store.reached(mark) => Removal::Pending,
            Some(_) => {
                self.removals.remove(name);
                Removal::Written
            }
        }
    }
}
