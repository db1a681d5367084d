//! Persistence: what a conversation leaves in the store beyond its KV, and what this engine
//! promised about it. [`Persistence`] owns the store's manifest handle and the journal of
//! writes: the conversations whose finished turns are saved at the end of the step, each named
//! conversation's latest manifest write (what [`Durability`] reports), and the names whose
//! removal is queued. The chunk files themselves are the cache manager's store tier; a
//! manifest's write queues on the same writer thread, behind the chunk writes it names.
//!
//! A manifest holds what the tiers cannot rebuild: the conversation's token ids, its chat
//! transcript, how many tokens have KV, and the address of each chunk's file. It is rewritten
//! (atomically, behind, after the chunk writes it names) whenever a turn of the conversation
//! ends, by compare-and-set against the state the conversation continues, so two engines of a
//! fleet never fork one conversation. The engine coordinates: it tells this component what to
//! write, and applies what a resume read ([`ResumeReader`]) to its conversations and cache.

mod manifest;
mod resume;

use std::collections::HashMap;

pub(crate) use manifest::Manifest;
pub use resume::{Fetched, Registration, ResumeReader};

use crate::conversation::Conversation;
use crate::ids::ConversationId;
use crate::kv::{Address, ManifestStore, Refused, StoreError};

/// A stored conversation's removal that [`Engine::close_removing`](crate::Engine::close_removing)
/// queued: its store job (`None`: it could not be queued).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Removing(Option<u64>);

/// A named conversation's manifest write, as [`Engine::writing`](crate::Engine::writing)
/// reported it: its store job (`None`: it could not be queued). Waiting on this write, not on
/// the conversation's latest, tells a caller whether the state it wrote was stored even after
/// a later edit replaced the conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Writing(Option<u64>);

/// Whether a named conversation's latest state is stored; see
/// [`Engine::durability`](crate::Engine::durability).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Durability {
    /// Not a named conversation in a store: nothing of it outlives the engine.
    NotStored,
    /// Its manifest write is queued or running.
    Pending,
    /// Its manifest (tokens, transcript, chunk list) is written and synced: a restart, even
    /// after `kill -9`, resumes it as it is now. (Chunk files the manifest lists that could
    /// not be written only cost a recompute.)
    Durable,
    /// The write failed (disk full, read-only folder, Redis unreachable past its deadline):
    /// a restart resumes an older state. Says why.
    Failed(StoreError),
    /// Another engine stored a turn of this conversation since the state this copy continues
    /// (two servers served it at once): this copy's turn was not stored, so as not to fork the
    /// conversation. [`Engine::resume`](crate::Engine::resume) replaces the copy with the
    /// stored state.
    Conflict(String),
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

/// The manifests of an engine's named conversations, and the journal of what it queued for
/// them. Without a store it holds nothing and every question has the answer "not stored".
#[derive(Debug)]
pub(crate) struct Persistence {
    store: Option<ManifestStore>,
    /// The model's vocabulary, which a manifest's tokens must fit.
    vocab: usize,
    /// Tokens per chunk, which a manifest's chunk list is cut by.
    chunk: usize,
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

impl Persistence {
    /// Persistence through `store` (none: nothing is stored), for a model of `vocab` tokens
    /// whose KV is kept in chunks of `chunk`.
    pub fn new(store: Option<ManifestStore>, vocab: usize, chunk: usize) -> Self {
        Self {
            store,
            vocab,
            chunk,
            writer: std::hash::BuildHasher::hash_one(
                &std::collections::hash_map::RandomState::new(),
                (std::process::id(), std::time::SystemTime::now()),
            ),
            to_save: Vec::new(),
            manifest_writes: HashMap::new(),
            removals: HashMap::new(),
        }
    }

    /// Whether conversations are stored (the engine has a store).
    pub fn active(&self) -> bool {
        self.store.is_some()
    }

    /// The manifests of a store of this engine's own, to resume at start-up; `None` without
    /// one, or for a shared store, whose conversations are resumed one by one. A damaged
    /// manifest is left where it is: resuming its name reports the damage.
    pub fn own_manifests(&self) -> Option<Vec<Manifest>> {
        let store = self.store.as_ref().filter(|s| !s.shared())?;
        let all = store.all();
        Some(
            all.iter()
                .filter_map(|b| Manifest::parse(b, self.vocab).ok())
                .collect(),
        )
    }

    /// The names of the conversations stored now, sorted (in a shared store, every engine's).
    pub fn stored_names(&self) -> Vec<String> {
        let Some(store) = &self.store else {
            return Vec::new();
        };
        let mut names: Vec<String> = (store.all().iter())
            .filter_map(|bytes| Some(Manifest::parse(bytes, self.vocab).ok()?.name().to_string()))
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// A reader of what a resume needs from the store, for any thread; `None` without one.
    pub fn reader(&self) -> Option<ResumeReader> {
        let store = self.store.as_ref()?;
        Some(ResumeReader::new(store.reader(), self.vocab, self.chunk))
    }

    /// `id`'s turn ended: its chunks and manifest are saved at the end of the step.
    pub fn save_after_step(&mut self, id: ConversationId) {
        if self.active() {
            self.to_save.push(id);
        }
    }

    /// The conversations to save now, in the order their turns ended.
    pub fn take_saves(&mut self) -> Vec<ConversationId> {
        std::mem::take(&mut self.to_save)
    }

    /// Writes (behind) the manifest of `conv` (the conversation `id`) if it is named, as its
    /// next revision, over the state it continues (compare-and-set): `computed` of its tokens
    /// have KV, in the chunks `chunks` lists (each chunk's file and, while queued, its write).
    pub fn write(
        &mut self,
        id: ConversationId,
        conv: &mut Conversation,
        computed: usize,
        chunks: Vec<Option<(Address, Option<u64>)>>,
    ) {
        let (Some(store), Some(name)) = (&self.store, conv.name()) else {
            return;
        };
        let revision = conv.revision() + 1;
        let stamp = format!("{:016x}-{revision}", self.writer);
        let manifest = Manifest::of(conv, computed, stamp.clone(), revision);
        let write = store.write(name, conv.stamp().to_string(), manifest.build(chunks));
        conv.set_stored(revision, stamp);
        self.manifest_writes.insert(id, write);
    }

    /// The latest manifest write queued for `id`, if any since it was resumed or opened.
    pub fn writing(&self, id: ConversationId) -> Option<Writing> {
        self.manifest_writes.get(&id).map(|&job| Writing(job))
    }

    /// How durable the manifest write `write` is.
    pub fn write_durability(&self, write: Writing) -> Durability {
        match &self.store {
            Some(store) => outcome(write.0, store),
            None => Durability::NotStored,
        }
    }

    /// This engine no longer holds `id`: what it wrote is the store's to tell.
    pub fn forget(&mut self, id: ConversationId) {
        self.manifest_writes.remove(&id);
    }

    /// How durable the state of `conv` (the conversation `id`) is in the store.
    pub fn durability(&self, id: ConversationId, conv: &Conversation) -> Durability {
        let (Some(store), Some(_)) = (&self.store, conv.name()) else {
            return Durability::NotStored;
        };
        match self.manifest_writes.get(&id) {
            // Resumed from the store, nothing written since.
            None => Durability::Durable,
            Some(&write) => outcome(write, store),
        }
    }

    /// Deletes (behind) the manifest of `conv` if it is named (the conversation is closed
    /// for good); the removal queued, if any.
    pub fn remove(&mut self, conv: &Conversation) -> Option<Removing> {
        let (Some(store), Some(name)) = (&self.store, conv.name()) else {
            return None;
        };
        let job = store.remove(name);
        self.removals.retain(|_, &mut mark| !store.reached(mark));
        (self.removals).insert(name.to_string(), job.unwrap_or_else(|| store.mark()));
        Some(Removing(job))
    }

    /// How durable a queued removal is: durable once the store no longer holds the
    /// conversation.
    pub fn removal_durability(&self, removal: Removing) -> Durability {
        match &self.store {
            Some(store) => outcome(removal.0, store),
            None => Durability::NotStored,
        }
    }

    /// Where `name`'s queued removal stands; once written it is reported once, then
    /// forgotten.
    pub fn removal(&mut self, name: &str) -> Removal {
        let Some(store) = &self.store else {
            return Removal::None;
        };
        match self.removals.get(name) {
            None => Removal::None,
            Some(&mark) if !store.reached(mark) => Removal::Pending,
            Some(_) => {
                self.removals.remove(name);
                Removal::Written
            }
        }
    }

    /// A mark of what has been queued for the store so far; `None` without a store.
    pub fn mark(&self) -> Option<u64> {
        self.store.as_ref().map(ManifestStore::mark)
    }

    /// Whether everything queued for the store before `mark` was taken is written (or
    /// failed).
    pub fn reached(&self, mark: u64) -> bool {
        self.store.as_ref().is_none_or(|s| s.reached(mark))
    }
}

/// How durable store job `job` (a manifest's write or removal) is: `None`, it could not be
/// queued.
fn outcome(job: Option<u64>, store: &ManifestStore) -> Durability {
    let Some(job) = job else {
        return Durability::Failed(StoreError::WriterStopped);
    };
    match store.outcome(job) {
        None => Durability::Pending,
        Some(Ok(())) => Durability::Durable,
        Some(Err(Refused::Failed(why))) => Durability::Failed(why),
        Some(Err(conflict @ Refused::Conflict(_))) => Durability::Conflict(conflict.to_string()),
    }
}
