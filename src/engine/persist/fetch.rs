//! Resuming a stored conversation by name without waiting for the store on the engine's
//! thread: a [`ResumeReader`] reads the manifest, the name's registration and which of the
//! manifest's chunks a shared store holds, from any thread (the service does it before its
//! command reaches the engine); [`Engine::resume_with`] and [`Engine::open_registered`] apply
//! what it read. A host without the service keeps store reads off its step thread the same way.

use std::time::Instant;

use super::journal::Removal;
use super::{Durability, Manifest};
use crate::conversation::Conversation;
use crate::engine::{ConversationOptions, Engine};
use crate::ids::ConversationId;
use crate::kv::{Address, StoreError, StoreReader};
use crate::{Error, Result};

/// Who registered a name: its owner's label, and whether it is this engine's model.
type Registrant = Option<(String, bool)>;

/// Who registered a conversation name in the store, as a [`ResumeReader`] read it (or why it
/// could not be read); given to [`Engine::open_registered`].
#[derive(Debug)]
pub struct Registration {
    /// The name read.
    name: String,
    read: std::result::Result<Registrant, StoreError>,
}

/// What the store held of a conversation name when a [`ResumeReader`] read it; given to
/// [`Engine::resume_with`].
#[derive(Debug)]
pub struct Fetched {
    /// The name read.
    name: String,
    /// The manifest (parsed, or why it is damaged), if one is stored.
    manifest: std::result::Result<Option<std::result::Result<Manifest, String>>, StoreError>,
    /// Who registered the name, read when no manifest is stored.
    registration: Option<Registration>,
    /// The manifest's chunks the store holds (for a shared store: found by asking).
    found: Vec<(Address, usize)>,
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

/// Reads what [`Engine::resume`] and [`Engine::open`] need from the store, on any thread: a
/// store that stalls (a Redis past its deadline) then holds up the one request that waits for
/// it, never the turns the step thread runs. From [`Engine::resume_reader`].
#[derive(Clone, Debug)]
pub struct ResumeReader {
    store: StoreReader,
    vocab: usize,
    chunk: usize,
}

impl ResumeReader {
    /// What the store holds of the conversation `name` now (blocks on the store).
    pub fn fetch(&self, name: &str) -> Fetched {
        let manifest =
            (self.store.manifest(name)).map(|m| m.map(|bytes| Manifest::parse(&bytes, self.vocab)));
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
        }
    }
}

impl ResumeReader {
    /// Who registered the conversation name `name` now (blocks on the store).
    pub fn registration(&self, name: &str) -> Registration {
        Registration {
            name: name.to_string(),
            read: (self.store.registration(name))
                .map(|r| r.map(|(owner, ours)| (owner.label, ours))),
        }
    }
}

impl Manifest {
    /// The chunks its list names whose address its tokens confirm, each with its KV-tokens.
    fn saved_chunks(&self, chunk: usize) -> Vec<(Address, usize)> {
        let want = Address::of_chunks(&self.tokens[..self.computed], chunk);
        (self.chunks.iter().zip(want).enumerate())
            .filter(|(_, (got, want))| got.as_deref().and_then(Address::from_hex) == Some(*want))
            .map(|(i, (_, a))| (a, chunk.min(self.computed - i * chunk)))
            .collect()
    }
}

impl Engine {
    /// A reader of what [`Engine::resume`] and [`Engine::open`] need from the store, for any
    /// thread; `None` without a store.
    pub fn resume_reader(&self) -> Option<ResumeReader> {
        Some(ResumeReader {
            store: self.cache.store()?.reader(),
            vocab: self.model.config().vocab_size,
            chunk: self.config.chunk_size,
        })
    }

    /// Opens the conversation `m` describes, with the KV of its chunks that another
    /// conversation holds in memory (a stale copy of it, a shared prefix), else that the
    /// store still holds (`found`: the chunks a shared store was found to hold).
    pub(super) fn restore(
        &mut self,
        m: Manifest,
        found: &[(Address, usize)],
        now: Instant,
    ) -> ConversationId {
        let id = self.next_id();
        let chunk = self.config.chunk_size;
        // A file counts only if it is the one these tokens name: a manifest and files that
        // disagree (edited, or from an interrupted save) cost a recompute, never wrong KV.
        let want = Address::of_chunks(&m.tokens[..m.computed], self.config.chunk_size);
        let saved: Vec<Option<Address>> = m
            .chunks
            .iter()
            .zip(&want)
            .map(|(got, want)| {
                got.as_deref()
                    .and_then(Address::from_hex)
                    .filter(|a| a == want)
            })
            .collect();
        self.cache.open(id, now);
        self.cache.index_found(found);
        if self.sharing() {
            self.cache.adopt_resident(id, &want[..m.computed / chunk]);
        }
        self.cache.adopt(id, m.computed, &saved, now);
        let mut conv = Conversation::restore(m.name, m.tokens, m.messages, m.seen_text, m.marks)
            .with_tools(m.tools)
            .with_template_vars(m.template_vars);
        conv.set_stored(m.revision, m.stamp);
        self.convs.insert(id, conv);
        id
    }

    /// The conversation stored under `name`, ready for its next turn: the copy this engine
    /// holds, unless the store has a later state (another engine of the fleet served a turn
    /// since, or this copy's last turn could not be stored), which then replaces it; or, if
    /// this engine holds none, the stored one, with the KV the store still has (fetched when
    /// its turn runs, ahead of it while it waits in the queue). The id changes when the
    /// conversation is (re)loaded.
    ///
    /// A folder's conversations were resumed at start-up: this finds them, or reloads one
    /// this engine [`Engine::detach`]ed.
    ///
    /// # Errors
    /// [`Error::NotStored`] if no conversation of that name is held or stored;
    /// [`Error::StoreDamaged`] if its manifest is damaged, or missing while the name is
    /// registered as stored; [`Error::StoredElsewhere`] if engines of another model or format
    /// store it; [`Error::Store`] if the store cannot be read and none is held;
    /// [`Error::ConversationBusy`] if the copy held here has a turn running while the store
    /// has a later state.
    pub fn resume(&mut self, name: &str) -> Result<ConversationId> {
        self.resume_fetched(name, None)
    }

    /// [`Engine::resume`] with what the store held of `name`, read before by a
    /// [`ResumeReader`] off this thread, so that the step thread does not wait for the store.
    /// What was read is checked as a read here would be: a copy this engine holds is kept
    /// unless the store had a later state, and a removal queued since the read wins.
    ///
    /// # Errors
    /// As [`Engine::resume`]; [`Error::InvalidRequest`] if `fetched` was read for another name.
    pub fn resume_with(&mut self, name: &str, fetched: Fetched) -> Result<ConversationId> {
        if fetched.name != name {
            return Err(Error::InvalidRequest {
                field: "fetched",
                reason: format!(
                    "what was read of {:?} does not resume {name:?}",
                    fetched.name
                ),
            });
        }
        self.resume_fetched(name, Some(fetched))
    }

    /// [`Engine::open`], given who registered `options.name`, read before by a
    /// [`ResumeReader`] off this thread, so that the step thread does not wait for the store.
    ///
    /// # Errors
    /// As [`Engine::open`]; [`Error::InvalidRequest`] if `registration` was read for another
    /// name than `options.name`.
    pub fn open_registered(
        &mut self,
        options: ConversationOptions,
        registration: Registration,
    ) -> Result<ConversationId> {
        if options.name.as_deref() != Some(registration.name()) {
            return Err(Error::InvalidRequest {
                field: "registration",
                reason: format!(
                    "the registration read of {:?} does not open {:?}",
                    registration.name(),
                    options.name
                ),
            });
        }
        self.open_with(options, Some(registration))
    }

    /// [`Engine::resume`] with what the store held of `name` (`None`: read it now).
    fn resume_fetched(&mut self, name: &str, fetched: Option<Fetched>) -> Result<ConversationId> {
        let held = self.find(name);
        let mut fetched = fetched;
        // Closed here: gone while its removal is not written, whatever the store still says.
        // Once it is, a read made before it may still show the manifest: it is read again.
        if let (None, Some(store)) = (held, self.cache.store()) {
            match self.journal.removal(name, store) {
                Removal::Pending => return Err(Error::NotStored(name.to_string())),
                Removal::Written => fetched = None,
                Removal::None => {}
            }
        }
        let fetched = fetched.or_else(|| self.resume_reader().map(|r| r.fetch(name)));
        let (Some(_), Some(fetched)) = (self.cache.store(), fetched) else {
            return held.ok_or_else(|| Error::NotStored(name.to_string()));
        };
        let damaged = |cause: String| Error::StoreDamaged {
            name: name.to_string(),
            cause,
        };
        let stored = match fetched.manifest {
            Ok(Some(m)) => {
                let m = m.map_err(damaged)?;
                // A digest-named manifest holds its name: another name's is not this one.
                if m.name != name {
                    return Err(damaged(format!(
                        "its manifest holds another conversation ({} bytes of name)",
                        m.name.len()
                    )));
                }
                Some(m)
            }
            // The one held here is being written, or the name is free, or was lost.
            Ok(None) if held.is_some() => None,
            Ok(None) => return Err(unstored(name, fetched.registration)),
            // Unreadable now: what is held is the best known.
            Err(source) => match held {
                Some(id) => return Ok(id),
                None => {
                    return Err(Error::Store {
                        what: format!("reading the manifest of {name:?}"),
                        source,
                    })
                }
            },
        };
        let now = Instant::now();
        match (held, stored) {
            (Some(id), Some(m)) if self.stale(id, &m) => {
                if self.sched.turn_of(id).is_some() {
                    return Err(Error::ConversationBusy(id));
                }
                // The stored copy takes its references first, so the chunks both name stay.
                let fresh = self.restore(m, &fetched.found, now);
                self.detach(id)?;
                Ok(fresh)
            }
            (Some(id), _) => Ok(id),
            (None, Some(m)) => Ok(self.restore(m, &fetched.found, now)),
            (None, None) => Err(Error::NotStored(name.to_string())),
        }
    }

    /// Whether the copy `id` holds an older state than the stored `m`: a later revision, or
    /// the same one written by another engine while this copy's write was refused.
    fn stale(&self, id: ConversationId, m: &Manifest) -> bool {
        let Some(c) = self.convs.get(&id) else {
            return true;
        };
        m.revision > c.revision()
            || (m.stamp != c.stamp()
                && matches!(
                    self.durability(id),
                    Ok(Durability::Failed(_) | Durability::Conflict(_))
                ))
    }
}

/// Why no conversation `name` is stored: free, lost (its manifest missing while its name is
/// registered), or another model's.
pub(super) fn unstored(name: &str, registration: Option<Registration>) -> Error {
    match registration.map(|r| r.read) {
        Some(Ok(Some((_, true)))) => Error::StoreDamaged {
            name: name.to_string(),
            cause: "its manifest is missing".into(),
        },
        Some(Ok(Some((owner, false)))) => Error::StoredElsewhere {
            name: name.to_string(),
            owner,
        },
        Some(Ok(None)) | None => Error::NotStored(name.to_string()),
        Some(Err(source)) => Error::Store {
            what: format!("reading the registration of {name:?}"),
            source,
        },
    }
}
