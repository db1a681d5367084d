//! The engine's side of persistence (the component is [`crate::persist`]): opening the store
//! for the loaded model, saving the KV of finished turns behind, naming, replacing, detaching
//! and closing stored conversations, and resuming a folder's conversations at start-up (warm
//! restart).
//!
//! A store shared by a fleet (Redis) is not resumed whole at start: [`Engine::resume`] fetches
//! one conversation's manifest when a turn of it arrives, and replaces a copy held here when
//! another engine stored a later revision of it (served a turn since).

use std::sync::Arc;
use std::time::Instant;

use super::config::StoreLocation;
use super::resume::unstored;
use super::{ConversationOptions, Engine, EngineConfig, FinishReason};
use crate::attention::{KvShape, Span};
use crate::ids::ConversationId;
use crate::kv::{hex, ChunkFormat, CostModel, Owner, Store, StoreTier};
use crate::model::Model;
use crate::persist::{Durability, Registration, Removing, Writing};
use crate::{Error, Result};

/// Opens the store `config` names for `model`'s KV of `shape` at `value_bytes` per value
/// (see [`ChunkFormat::value_bytes`]).
///
/// # Errors
/// [`Error::Io`] if the folder cannot be created or read; [`Error::Store`] if Redis cannot be
/// reached; [`Error::Candle`] if the model's fingerprint cannot be computed.
pub(super) fn open_store(
    model: &Model,
    config: &EngineConfig,
    shape: KvShape,
    value_bytes: u32,
    cost: CostModel,
) -> Result<Option<StoreTier>> {
    let Some(wanted) = &config.store else {
        return Ok(None);
    };
    let mut h = blake3::Hasher::new();
    h.update(&model.transformer().fingerprint()?);
    h.update(format!("{:?}|{}", config.kv_precision, config.chunk_size).as_bytes());
    let fingerprint = *h.finalize().as_bytes();
    let c = model.config();
    let owner = Owner {
        fingerprint: hex(&fingerprint)[..16].to_string(),
        label: format!(
            "a model of {} layers x {} wide, vocabulary {}, {:?} weights; KV {:?} in chunks of {}",
            c.num_layers,
            c.hidden_size,
            c.vocab_size,
            model.transformer().weight_format(),
            config.kv_precision,
            config.chunk_size
        ),
    };
    let narrow_layers = model.config().full_layers().len();
    let format = ChunkFormat {
        fingerprint,
        layers: shape.num_layers as u32,
        narrow_layers: narrow_layers as u32,
        kv_heads: shape.num_kv_heads as u32,
        head_dim: shape.head_dim as u32,
        value_bytes,
    };
    let store = match &wanted.location {
        StoreLocation::Folder(dir) => {
            Store::open(dir, format, owner, wanted.budget_bytes, wanted.expire_after).map_err(
                |source| Error::Io {
                    path: dir.clone(),
                    source,
                },
            )?
        }
        StoreLocation::Redis(_) if wanted.expire_after.is_some() => {
            return Err(Error::InvalidConfig {
                field: "store.expire_after",
                reason: "a Redis store expires its keys by RedisConfig::ttl".into(),
            })
        }
        StoreLocation::Redis(redis) => Store::open_redis(redis, format, owner, wanted.budget_bytes)
            .map_err(|source| Error::Store {
                what: format!("opening {}", redis.redacted_url()),
                source,
            })?,
    };
    Ok(Some(StoreTier {
        store,
        cost,
        read_bytes_per_s: wanted.read_bytes_per_s,
    }))
}

impl Engine {
    /// Resumes every named conversation stored in the store (at start-up), then deletes
    /// the files none of them needs. Not for a shared store, where every conversation of the
    /// fleet is stored: those are resumed one by one ([`Engine::resume`]).
    pub(super) fn resume_stored(&mut self, now: Instant) {
        let Some(manifests) = self.persist.own_manifests() else {
            return;
        };
        for m in manifests {
            if self.find(m.name()).is_none() {
                self.restore(m, &[], now);
            }
        }
        self.cache.collect_store_garbage(now);
    }

    /// Drops this engine's copy of a conversation, keeping what is stored of it: a named
    /// conversation's manifest stays for this engine or another to [`Engine::resume`] (with
    /// its chunks, in a shared store; a folder's files go with their last reference, so its KV
    /// is then recomputed). A running turn is cancelled. A server drops conversations its
    /// clients went quiet on this way.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn detach(&mut self, conv: ConversationId) -> Result<()> {
        if !self.convs.contains_key(&conv) {
            return Err(Error::UnknownConversation(conv));
        }
        if let Some(id) = self.sched.turn_of(conv) {
            self.finish(id, FinishReason::Cancelled, Instant::now());
        }
        self.cache.close(conv);
        self.convs.remove(&conv);
        self.persist.forget(conv);
        Ok(())
    }

    /// The host's data kept with a conversation ([`ConversationOptions::attributes`]).
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn attributes(
        &self,
        conv: ConversationId,
    ) -> Result<&serde_json::Map<String, serde_json::Value>> {
        self.convs
            .get(&conv)
            .map(|c| c.attributes())
            .ok_or(Error::UnknownConversation(conv))
    }

    /// Replaces the host's data kept with a conversation; a named one's manifest is written
    /// again (behind, as after a turn: [`Engine::durability`] says when it is stored).
    ///
    /// # Errors
    /// [`Error::UnknownConversation`]; [`Error::ConversationBusy`] while a turn of it runs
    /// (its end writes the manifest, from the state it began with).
    pub fn set_attributes(
        &mut self,
        conv: ConversationId,
        attributes: serde_json::Map<String, serde_json::Value>,
    ) -> Result<()> {
        if self.sched.turn_of(conv).is_some() {
            return Err(Error::ConversationBusy(conv));
        }
        let c = (self.convs.get_mut(&conv)).ok_or(Error::UnknownConversation(conv))?;
        c.set_attributes(attributes);
        self.write_manifest(conv);
        Ok(())
    }

    /// Makes `new` the conversation stored under `old`'s name, in `old`'s place: `new` (an
    /// unnamed conversation, opened with a history that rewrites `old`'s) takes the name and
    /// the stored revision it replaces, its manifest is written over `old`'s (compare-and-set
    /// against the state `old` continued, as `old`'s next turn would be), and this engine drops
    /// its copy of `old`. A client that rewrote a named conversation's history so replaces it
    /// only once the new history's turn has finished: a refused, failed or cancelled turn
    /// leaves `old` stored as it was.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`] for either; [`Error::InvalidRequest`] if `old` is not
    /// named, `new` is, or either has a turn running.
    pub fn replace(&mut self, old: ConversationId, new: ConversationId) -> Result<()> {
        let (Some(o), Some(n)) = (self.convs.get(&old), self.convs.get(&new)) else {
            let missing = if self.convs.contains_key(&old) {
                new
            } else {
                old
            };
            return Err(Error::UnknownConversation(missing));
        };
        let bad = |why: &str| {
            Err(Error::InvalidRequest {
                field: "conversation",
                reason: why.into(),
            })
        };
        let Some(name) = o.name().map(str::to_string) else {
            return bad("only a named conversation is replaced");
        };
        if n.name().is_some() || old == new {
            return bad("a conversation replaces another only while unnamed");
        }
        if self.sched.turn_of(old).is_some() || self.sched.turn_of(new).is_some() {
            return bad("a conversation with a turn running is not replaced");
        }
        let (revision, stamp) = (o.revision(), o.stamp().to_string());
        self.detach(old)?;
        if let Some(c) = self.convs.remove(&new) {
            let mut c = c.named(Some(name));
            c.set_stored(revision, stamp);
            self.convs.insert(new, c);
        }
        self.write_manifest(new);
        Ok(())
    }

    /// Stores the unnamed conversation `conv` under `name`, writing its first manifest (with
    /// the turns it has). A host that must not store a conversation before its first turn is
    /// answered (a refused or cancelled one would leave an empty conversation stored) opens it
    /// unnamed and names it once that turn has finished.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`]; [`Error::InvalidRequest`] without a store, or if `conv`
    /// is named or has a turn running; [`Error::ConversationExists`] if this engine holds a
    /// conversation of that name; [`Error::StoredElsewhere`] if another model keeps it.
    pub fn name(&mut self, conv: ConversationId, name: String) -> Result<()> {
        let c = self
            .convs
            .get(&conv)
            .ok_or(Error::UnknownConversation(conv))?;
        let bad = |why: &str| {
            Err(Error::InvalidRequest {
                field: "name",
                reason: why.into(),
            })
        };
        if !self.persist.active() {
            return bad("only an engine with a store keeps conversations by name");
        }
        if c.name().is_some() || self.sched.turn_of(conv).is_some() {
            return bad("only an unnamed conversation with no turn running is given a name");
        }
        self.claimable(&name, None)?;
        if let Some(c) = self.convs.remove(&conv) {
            self.convs.insert(conv, c.named(Some(name)));
        }
        self.write_manifest(conv);
        Ok(())
    }

    /// Opens a conversation stored under `options.name`, writing its first manifest.
    pub(super) fn open_named(
        &mut self,
        name: String,
        options: ConversationOptions,
        registration: Option<Registration>,
    ) -> Result<ConversationId> {
        self.claimable(&name, registration)?;
        let id = self.open_unnamed(options);
        if let Some(c) = self.convs.remove(&id) {
            self.convs.insert(id, c.named(Some(name)));
        }
        self.write_manifest(id);
        Ok(id)
    }

    /// Whether [`Engine::name`] would take `name` now: a host checks it before a turn that
    /// will name its conversation once answered, so that a name it cannot take is refused
    /// before the turn runs.
    ///
    /// # Errors
    /// As [`Engine::name`]'s [`Error::ConversationExists`] and [`Error::StoredElsewhere`].
    pub fn check_name(&self, name: &str) -> Result<()> {
        self.claimable(name, None)
    }

    /// Whether a new conversation may take `name`, given who registered it (`None`: read it
    /// now): not if this engine holds one of that name, nor if another model keeps it. One
    /// stored here, and not held, is refused by its first manifest write's compare-and-set (a
    /// removal queued before it may free it).
    fn claimable(&self, name: &str, registration: Option<Registration>) -> Result<()> {
        if self.find(name).is_some() {
            return Err(Error::ConversationExists(name.to_string()));
        }
        let registration =
            registration.or_else(|| self.resume_reader().map(|r| r.registration(name)));
        match unstored(name, registration) {
            Error::StoredElsewhere { name, owner } => Err(Error::StoredElsewhere { name, owner }),
            _ => Ok(()),
        }
    }

    /// The conversation stored under `name`, if it is open (created by this engine or
    /// resumed from the store at start-up).
    pub fn find(&self, name: &str) -> Option<ConversationId> {
        self.convs.find(name)
    }

    /// The names of the conversations stored now, sorted: those [`Engine::resume`] continues
    /// (in a shared store, every engine's; writes still queued are not there yet, see
    /// [`Engine::flush`]). Empty without a store, or if it cannot be read.
    pub fn stored_conversations(&self) -> Vec<String> {
        self.persist.stored_names()
    }

    /// Every named conversation, with its id: those a restart resumed and those opened since.
    pub fn named_conversations(&self) -> Vec<(String, ConversationId)> {
        self.convs
            .iter()
            .filter_map(|(&id, c)| Some((c.name()?.to_string(), id)))
            .collect()
    }

    /// Waits until every chunk file and manifest queued so far is on disk. Dropping the engine
    /// does the same; a crash loses at most what was still queued (the files are written
    /// atomically, so nothing is left half-written).
    pub fn flush(&mut self) {
        self.cache.flush_store();
    }

    /// Registers `wake`, called on the store's own threads whenever its writer or reader
    /// finishes a job: how a host loop that sleeps until its next submission or
    /// [`Engine::poll_timeout`] learns, without polling, that a write it waits for
    /// ([`Engine::store_reached`], [`Engine::durability`]) may be done. It must not block:
    /// send on a channel, notify a condition variable. Nothing is called without a store.
    pub fn set_store_waker(&self, wake: std::sync::Arc<dyn Fn() + Send + Sync>) {
        self.cache.set_store_waker(wake);
    }

    /// A mark of what has been queued for the store so far (the chunks and manifests of
    /// every turn that has finished), to ask [`Engine::store_reached`] later without waiting;
    /// `None` without a store. A server of a fleet answers a turn's end once its mark is
    /// reached, so the next turn finds the conversation stored on whichever engine it lands.
    pub fn store_mark(&self) -> Option<u64> {
        self.persist.mark()
    }

    /// Whether everything queued for the store before `mark` was taken is written (or failed:
    /// the next turn then recomputes).
    pub fn store_reached(&self, mark: u64) -> bool {
        self.persist.reached(mark)
    }

    /// Saves (behind) the chunks of conversations whose turn ended this step, and their
    /// manifests.
    pub(super) fn save_finished(&mut self, now: Instant) {
        for id in self.persist.take_saves() {
            let Some(conv) = self.convs.get(&id) else {
                continue;
            };
            let saves = self.cache.saves(id, conv.tokens(), now);
            let ranges: Vec<Span> = saves
                .iter()
                .map(|s| Span {
                    start: self.cache.first_slot(s.block),
                    len: s.len,
                    narrow: s.address.is_narrow(),
                })
                .collect();
            // A failed copy leaves the chunks unsaved; the next turn's end tries again.
            if let Ok(bytes) = self.pool.copy_chunks(&ranges, Vec::new(), false) {
                for (s, b) in saves.iter().zip(bytes) {
                    self.cache.complete_save(s, Arc::new(b), now);
                }
            }
            self.write_manifest(id);
        }
    }

    /// Writes (behind) the manifest of `id` if it is named, as its next revision, over the
    /// state it continues (compare-and-set); it lists the chunks whose files are written.
    pub(super) fn write_manifest(&mut self, id: ConversationId) {
        let Some(conv) = self.convs.get_mut(&id) else {
            return;
        };
        let computed = self.cache.table(id).map_or(0, |t| t.computed());
        (self.persist).write(id, conv, computed, self.cache.saved(id));
    }

    /// Whether the state of `conv` after its last finished turn is durable in the store: a
    /// server answers a named conversation's turn once it is (so a turn it acknowledged
    /// survives any stop, `kill -9` included), and reports the failure when it cannot be.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn durability(&self, conv: ConversationId) -> Result<Durability> {
        let c = self
            .convs
            .get(&conv)
            .ok_or(Error::UnknownConversation(conv))?;
        Ok(self.persist.durability(conv, c))
    }

    /// The latest write of a named conversation's manifest (after a turn's end, a rename or
    /// [`Engine::set_attributes`]), to wait on with [`Engine::write_durability`]; `None` when
    /// none was queued since it was opened or resumed (see [`Engine::durability`]).
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn writing(&self, conv: ConversationId) -> Result<Option<Writing>> {
        if !self.convs.contains_key(&conv) {
            return Err(Error::UnknownConversation(conv));
        }
        Ok(self.persist.writing(conv))
    }

    /// How durable the manifest write `write` is: [`Durability::Durable`] once stored,
    /// [`Durability::Failed`] or [`Durability::Conflict`] if it was not, whatever became of the
    /// conversation since.
    pub fn write_durability(&self, write: Writing) -> Durability {
        self.persist.write_durability(write)
    }

    /// [`Engine::close`], with the removal of a stored conversation's manifest it queued:
    /// a caller that acknowledges the close waits for [`Engine::removal_durability`].
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn close_removing(&mut self, conv: ConversationId) -> Result<Option<Removing>> {
        if !self.convs.contains_key(&conv) {
            return Err(Error::UnknownConversation(conv));
        }
        let removal = (self.convs.get(&conv)).and_then(|c| self.persist.remove(c));
        self.detach(conv)?;
        Ok(removal)
    }

    /// How durable a queued removal is: [`Durability::Durable`] once the store no longer
    /// holds the conversation, [`Durability::Failed`] if it could not be removed (the store
    /// still holds it: resuming it continues its stored state).
    pub fn removal_durability(&self, removal: Removing) -> Durability {
        self.persist.removal_durability(removal)
    }
}
