//! The store's side of conversation manifests, as a handle of its own for the engine's
//! persistence: written behind by compare-and-set on the chunks' writer (so a manifest follows
//! the chunk writes it names), with the outcome kept; read, listed and removed; and the
//! registrations that tell engines of other models a name is taken.

use std::sync::Arc;

use super::error::StoreError;
use super::format::Address;
use super::medium::Medium;
use super::worker::{BuildManifest, Job, Worker};
use super::{Owner, Refused, State, Store};

impl Store {
    /// The number of the queued write of the chunk at `address`, if its write is queued (a
    /// manifest naming it lists it only if that write succeeds).
    pub fn pending_write(&self, address: &Address) -> Option<u64> {
        match self.entries.get(address)?.state {
            State::Pending(write, _) => Some(write),
            _ => None,
        }
    }

    /// The handle through which conversations' manifests are written, read and removed.
    pub fn manifest_store(&self) -> ManifestStore {
        ManifestStore {
            reader: self.reader(),
            writer: Arc::clone(&self.worker),
        }
    }

    /// A reader of this store, for any thread.
    pub fn reader(&self) -> StoreReader {
        StoreReader {
            medium: Arc::clone(&self.medium),
            owner: self.owner.clone(),
        }
    }
}

/// Conversations' manifests in the store: what the engine's persistence holds of the store.
/// Its writes queue behind the chunk writes queued before them, on the same thread.
#[derive(Clone, Debug)]
pub(crate) struct ManifestStore {
    reader: StoreReader,
    writer: Arc<Worker>,
}

impl ManifestStore {
    /// Writes (behind, atomically) the manifest of the conversation `name`, if the stored
    /// one is the state `expect` stamps (or none is stored): compare-and-set, so that two
    /// engines writing one conversation never fork it. Its bytes are built once the chunk
    /// writes queued before it are done (see [`BuildManifest`]). Returns the write's number
    /// for [`ManifestStore::outcome`] (`None`: the writer thread is gone).
    pub fn write(&self, name: &str, expect: String, build: BuildManifest) -> Option<u64> {
        self.writer.send_numbered(Job::Manifest {
            name: name.to_string(),
            expect,
            build,
        })
    }

    /// Deletes (behind) the manifest of the conversation `name`; the job's number, for
    /// [`ManifestStore::outcome`] (`None`: it could not be queued).
    pub fn remove(&self, name: &str) -> Option<u64> {
        self.writer
            .send_numbered(Job::RemoveManifest(name.to_string()))
    }

    /// What became of manifest write (or removal) `number`: `None` while queued, else done or
    /// why not.
    pub fn outcome(&self, number: u64) -> Option<Result<(), Refused>> {
        self.writer.outcome(number)
    }

    /// A mark of the writes (chunks, manifests, removals) queued so far, for
    /// [`ManifestStore::reached`].
    pub fn mark(&self) -> u64 {
        self.writer.queued()
    }

    /// Whether every write queued before `mark` was taken is done (stored, or failed).
    pub fn reached(&self, mark: u64) -> bool {
        self.writer.ran() >= mark
    }

    /// Every stored manifest's bytes. Unreadable ones are skipped (the conversation is lost,
    /// never half-loaded).
    pub fn all(&self) -> Vec<Vec<u8>> {
        self.reader.medium.manifests()
    }

    /// Whether other engines share the store.
    pub fn shared(&self) -> bool {
        self.reader.medium.shared().is_some()
    }

    /// A reader of the store, for any thread.
    pub fn reader(&self) -> StoreReader {
        self.reader.clone()
    }
}

/// Reads what a resume needs from any thread, so that the engine's thread never waits for the
/// store: a conversation's manifest, who registered its name, and which of its chunks a shared
/// store holds.
#[derive(Clone, Debug)]
pub(crate) struct StoreReader {
    medium: Arc<dyn Medium>,
    owner: Owner,
}

impl StoreReader {
    /// Who registered the conversation name `name`, if anyone, and whether it is this store.
    ///
    /// # Errors
    /// The store cannot be read.
    pub fn registration(&self, name: &str) -> Result<Option<(Owner, bool)>, StoreError> {
        let owner = self.medium.registration(name)?;
        Ok(owner.map(|o| {
            let ours = o.fingerprint == self.owner.fingerprint;
            (o, ours)
        }))
    }

    /// The stored manifest of the conversation `name`, if there is one.
    ///
    /// # Errors
    /// The store cannot be read.
    pub fn manifest(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.medium.manifest(name)
    }

    /// Which of `chunks` (address, KV-tokens) a shared store holds (in one request); none
    /// for a store of this engine's own, which indexed its chunks when it opened.
    pub fn stored(&self, chunks: &[(Address, usize)]) -> Vec<(Address, usize)> {
        super::medium::stored(&*self.medium, chunks)
    }
}
