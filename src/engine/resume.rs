//! The engine's side of resuming a stored conversation by name: what a
//! [`ResumeReader`](crate::persist::ResumeReader) read (on this thread or another) applied to the
//! conversations and the cache, a copy held here replaced when the store has a later state.

use std::time::Instant;

use crate::engine::{ConversationOptions, Engine};
use crate::ids::ConversationId;
use crate::kv::Address;
use crate::persist::{Durability, Fetched, Manifest, Registration, Removal, ResumeReader};
use crate::{Error, Result};

impl Engine {
    /// A reader of what [`Engine::resume`] and [`Engine::open`] need from the store, for any
    /// thread; `None` without a store.
    pub fn resume_reader(&self) -> Option<ResumeReader> {
        self.persist.reader()
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
        let r = m.restore(chunk);
        self.cache.open(id, now);
        self.cache.index_found(found);
        if self.sharing() {
            self.cache
                .adopt_resident(id, &r.addresses[..r.computed / chunk]);
        }
        self.cache.adopt(id, r.computed, &r.files, now);
        self.convs.insert(id, r.conversation);
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
        if held.is_none() {
            match self.persist.removal(name) {
                Removal::Pending => return Err(Error::NotStored(name.to_string())),
                Removal::Written => fetched = None,
                Removal::None => {}
            }
        }
        let mut fetched = fetched.or_else(|| self.resume_reader().map(|r| r.fetch(name)));
        // A copy stored once that the read says was removed: read again, after this engine's
        // own last write of it (a read made before that write would not show it).
        let removed = fetched.as_ref().is_some_and(|f| f.removed);
        if removed && held.is_some_and(|id| self.stored_once(id)) {
            fetched = self.resume_reader().map(|r| r.fetch(name));
        }
        let (true, Some(fetched)) = (self.persist.active(), fetched) else {
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
                if m.name() != name {
                    return Err(damaged(format!(
                        "its manifest holds another conversation ({} bytes of name)",
                        m.name().len()
                    )));
                }
                Some(m)
            }
            Ok(None) => match held {
                // Stored, and removed from the store since (its tombstone): another engine of
                // a fleet closed it. This copy goes too, so that no engine serves, or writes
                // back, a conversation a client was told is deleted. (A manifest merely
                // missing, a store restarted empty, is given back by the copy's next write.)
                Some(id) if fetched.removed && self.stored_once(id) => {
                    if self.sched.turn_of(id).is_some() {
                        return Err(Error::ConversationBusy(id));
                    }
                    self.detach(id)?;
                    return Err(Error::NotStored(name.to_string()));
                }
                // The one held here is being written, or the name is free, or was lost.
                Some(_) => None,
                None => return Err(unstored(name, fetched.registration)),
            },
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

    /// Whether the copy `id` is in the store as this engine last wrote it (or resumed it): its
    /// state was stored, and no write of it is queued or refused since.
    fn stored_once(&self, id: ConversationId) -> bool {
        self.convs.get(&id).is_some_and(|c| {
            (c.revision() > 0 || !c.stamp().is_empty())
                && self.persist.durability(id, c) == Durability::Durable
        })
    }

    /// Whether the copy `id` holds an older state than the stored `m`: a later revision, or
    /// the same one written by another engine while this copy's write was refused.
    fn stale(&self, id: ConversationId, m: &Manifest) -> bool {
        let Some(c) = self.convs.get(&id) else {
            return true;
        };
        let refused = matches!(
            self.persist.durability(id, c),
            Durability::Failed(_) | Durability::Conflict(_)
        );
        m.newer_than(c, refused)
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
