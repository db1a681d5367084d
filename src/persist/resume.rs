//! Reading a stored conversation by name without waiting for the store on the engine's
//! thread: a [`ResumeReader`] reads the manifest, the name's registration and which of the
//! manifest's chunks a shared store holds, from any thread (the service does it before its
//! command reaches the engine); [`Engine::resume_with`](crate::Engine::resume_with) and
//! [`Engine::open_registered`](crate::Engine::open_registered) apply what it read. A host
//! without the service keeps store reads off its step thread the same way.

use super::Manifest;
use crate::kv::{is_tombstone, Address, StoreError, StoreReader};

/// Who registered a name: its owner's label, and whether it is this engine's model.
type Registrant = Option<(String, bool)>;

/// Who registered a conversation name in the store, as a [`ResumeReader`] read it (or why it
/// could not be read); given to [`Engine::open_registered`](crate::Engine::open_registered).
#[derive(Debug)]
pub struct Registration {
    /// The name read.
    name: String,
    pub(crate) read: std::result::Result<Registrant, StoreError>,
}

/// What the store held of a conversation name when a [`ResumeReader`] read it; given to
/// [`Engine::resume_with`](crate::Engine::resume_with).
#[derive(Debug)]
pub struct Fetched {
    /// The name read.
    pub(crate) name: String,
    /// The manifest (parsed, or why it is damaged), if one is stored.
    pub(crate) manifest:
        std::result::Result<Option<std::result::Result<Manifest, String>>, StoreError>,
    /// Who registered the name, read when no manifest is stored.
    pub(crate) registration: Option<Registration>,
    /// The manifest's chunks the store holds (for a shared store: found by asking).
    pub(crate) found: Vec<(Address, usize)>,
    /// No manifest because the conversation was removed (a tombstone), rather than none ever
    /// stored or one the store lost.
    pub(crate) removed: bool,
}

impl Fetched {
    /// The conversation name read.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Registration {
    /// The conversation name read.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Reads what [`Engine::resume`](crate::Engine::resume) and [`Engine::open`](crate::Engine::open)
/// need from the store, on any thread: a store that stalls (a Redis past its deadline) then
/// holds up the one request that waits for it, never the turns the step thread runs. From
/// [`Engine::resume_reader`](crate::Engine::resume_reader).
#[derive(Clone, Debug)]
pub struct ResumeReader {
    store: StoreReader,
    vocab: usize,
    chunk: usize,
}

impl ResumeReader {
    pub(super) fn new(store: StoreReader, vocab: usize, chunk: usize) -> Self {
        Self {
            store,
            vocab,
            chunk,
        }
    }

    /// What the store holds of the conversation `name` now (blocks on the store).
    pub fn fetch(&self, name: &str) -> Fetched {
        let read = self.store.manifest(name);
        let removed = matches!(&read, Ok(Some(bytes)) if is_tombstone(bytes));
        let manifest =
            read.map(|m| (m.filter(|_| !removed)).map(|bytes| Manifest::parse(&bytes, self.vocab)));
        let registration = matches!(manifest, Ok(None)).then(|| self.registration(name));
        let found = match &manifest {
            Ok(Some(Ok(m))) => self.store.stored(&m.saved_chunks(self.chunk)),
            _ => Vec::new(),
        };
        Fetched {
            name: name.to_string(),
            manifest,
            registration,
            found,
            removed,
        }
    }

    /// Who registered the conversation name `name` now (blocks on the store).
    pub fn registration(&self, name: &str) -> Registration {
        Registration {
            name: name.to_string(),
            read: (self.store.registration(name))
                .map(|r| r.map(|(owner, ours)| (owner.label, ours))),
        }
    }
}
