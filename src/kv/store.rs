//! The store tier (AttentionStore §3.2-3.3): chunk files under a byte budget, named by content,
//! written behind on a background thread, and checked whole before any byte is used.
//!
//! Layout under the store's folder: `<fingerprint>/chunks/<address>.kvc` (one file per chunk,
//! format in [`format`]) and `<fingerprint>/conversations/<name>.json` (what a restarted engine
//! needs to resume a conversation; written through the [`ManifestStore`] handle, on the same
//! writer as the chunks, so a manifest never overtakes the chunk writes it names).
//! One folder per model fingerprint, so engines of different models can share a store folder.
//! The bytes' keeper is a [`medium::Medium`]: files, or a Redis shared by a fleet of engines
//! ([`redis`]); the bookkeeping, the format and the threads do not depend on it.
//!
//! In a shared store, entries are this engine's view: chunks it wrote (owned: booked against
//! its budget while its conversations hold them) and chunks other engines wrote, found by
//! address when a turn needs them ([`Store::look_up`], [`Store::index_found`]; never booked, and refused like
//! any bad file if they went missing or changed since). No engine deletes a chunk there,
//! since another may have found it by content: chunks leave by TTL or the server's eviction.
//!
//! Bookkeeping: an entry per address, reference-counted (chunk tables of conversations, which
//! may share content), booked against the budget when its save is queued (so queued writes
//! never exceed it) and freed when the last reference goes (the file is deleted behind). A save
//! is `Pending` until the worker reports it; its bytes stay readable from memory meanwhile, so
//! a host chunk whose save is queued can be evicted at once. A failed write makes the entry
//! `Failed`: [`Store::poll`] returns its address so the tables stop counting on it.
//!
//! Invariant: `used_bytes <= budget_bytes` and `used_bytes` is the sum of the owned entries'
//! sizes.

mod error;
pub mod format;
mod lookup;
mod manifests;
mod medium;
mod redis;
mod stats;
mod worker;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use error::{RedisFailure, StoreError};
pub(crate) use format::ChunkFormat;
pub use format::{Address, Fault};
use format::{ChunkId, HEADER_BYTES};
pub(crate) use manifests::{ManifestStore, StoreReader};
pub(crate) use medium::Refused;
pub(crate) use medium::{is_tombstone, Owner};
use medium::{Folder, Medium};
pub use redis::RedisConfig;
pub use stats::{FaultCounts, StoreStats};
pub(crate) use worker::{BuildManifest, Waker};
use worker::{Job, Worker};

use super::{ChunkBytes, LayerCells};

/// Most bytes of saves queued and not yet written; beyond it saves wait for a later chance
/// rather than pile up in memory outside every budget.
const MAX_PENDING_BYTES: usize = 256 << 20;

#[derive(Debug)]
enum State {
    /// Queued for the worker as write number `.0`; the bytes are still in memory.
    Pending(u64, Arc<ChunkBytes>),
    /// Written and renamed into place.
    Stored,
    /// The write failed or the file was refused: never loaded again.
    Failed,
}

#[derive(Debug)]
struct Entry {
    bytes: usize,
    refs: u32,
    state: State,
    /// Written by this engine (or found at open in a store of its own): booked and deleted by
    /// it.
    owned: bool,
}

/// Chunk files under a byte budget.
#[derive(Debug)]
pub(crate) struct Store {
    medium: Arc<dyn Medium>,
    format: ChunkFormat,
    /// Who this store registers the names of its conversations as.
    owner: Owner,
    budget_bytes: usize,
    used_bytes: usize,
    pending_bytes: usize,
    /// Number of the next queued write, so a late report of a write whose entry was since
    /// released and saved again is told apart.
    next_write: u64,
    entries: HashMap<Address, Entry>,
    /// The thread that reads ahead, apart from the writer so reads never queue behind writes.
    reader: Worker,
    /// Files the start-up scan refused (already counted under their fault).
    refused: HashSet<Address>,
    /// Lookups by content queued to the reader and not yet answered, by number.
    lookups: BTreeSet<u64>,
    next_lookup: u64,
    stats: StoreStats,
    /// The writer, shared with the [`ManifestStore`] handle.
    worker: Arc<Worker>,
}

/// What [`Store::save`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Saved {
    /// A write is queued.
    Queued,
    /// The content is already stored or queued; one more reference to it.
    Shared,
    /// Not enough room under the budget.
    NoRoom,
    /// Too many writes are queued; try again later.
    Busy,
}

impl Store {
    /// Opens (creating) the store for chunks of `format` under `dir`: deletes the temporary
    /// files a crash left, and indexes every valid chunk file (refused ones are deleted and
    /// counted). Indexed files hold no reference until [`Store::retain`]ed;
    /// [`Store::collect_garbage`] deletes the rest.
    ///
    /// # Errors
    /// The folder cannot be created or listed, or the writer thread cannot start.
    pub fn open(
        dir: &Path,
        format: ChunkFormat,
        owner: Owner,
        budget_bytes: usize,
        expire_after: Option<Duration>,
    ) -> std::io::Result<Self> {
        let medium = Arc::new(Folder::open(dir, owner.clone(), expire_after)?);
        Self::over(medium, format, owner, budget_bytes)
    }

    /// Opens the store for chunks of `format` in the Redis `config` names, shared with other
    /// engines: nothing is indexed or deleted at start.
    ///
    /// # Errors
    /// The server cannot be reached or refuses the credentials (as text without secrets), or
    /// the worker threads cannot start.
    pub fn open_redis(
        config: &RedisConfig,
        format: ChunkFormat,
        owner: Owner,
        budget_bytes: usize,
    ) -> Result<Self, StoreError> {
        let medium = Arc::new(redis::Redis::open(config, owner.clone())?);
        // Only starting the store's threads can fail here.
        Self::over(medium, format, owner, budget_bytes)
            .map_err(|e| StoreError::io("the store's worker threads", e))
    }

    fn over(
        medium: Arc<dyn Medium>,
        format: ChunkFormat,
        owner: Owner,
        budget_bytes: usize,
    ) -> std::io::Result<Self> {
        let mut store = Self {
            medium: medium.clone(),
            format,
            owner,
            budget_bytes,
            used_bytes: 0,
            pending_bytes: 0,
            next_write: 0,
            entries: HashMap::new(),
            reader: Worker::start(medium.clone())?,
            refused: HashSet::new(),
            lookups: BTreeSet::new(),
            next_lookup: 0,
            stats: StoreStats {
                budget_bytes,
                ..StoreStats::default()
            },
            worker: Arc::new(Worker::start(medium)?),
        };
        store.scan()?;
        Ok(store)
    }

    fn scan(&mut self) -> std::io::Result<()> {
        let listing = self.medium.list()?;
        // Debris of interrupted writes is no fault; entries that are not chunks are.
        self.stats.faults.bad_header += listing.foreign as u64;
        self.stats.files_removed += (listing.interrupted + listing.foreign) as u64;
        for a in listing.chunks {
            match self.check_stored(&a) {
                Ok(bytes) => {
                    self.used_bytes += bytes;
                    let state = State::Stored;
                    let (refs, owned) = (0, true);
                    let entry = Entry {
                        bytes,
                        refs,
                        state,
                        owned,
                    };
                    self.entries.insert(a, entry);
                }
                Err(fault) => {
                    tracing::warn!(%fault, "a stored chunk was refused and deleted; it will be recomputed");
                    self.refused.insert(a);
                    self.stats.faults.count(fault);
                    self.medium.remove_chunk(&a);
                    self.stats.files_removed += 1;
                }
            }
        }
        self.stats.bytes_used = self.used_bytes;
        Ok(())
    }

    /// Checks a stored chunk's header and length without reading its payload; returns its
    /// size.
    fn check_stored(&self, address: &Address) -> Result<usize, Fault> {
        let (mut f, len) = self.medium.open_chunk(address)?;
        let mut head = vec![0u8; HEADER_BYTES];
        f.read_exact(&mut head).map_err(|_| Fault::Truncated)?;
        let format = self.format.of(address);
        let h = format::decode_header(&format, &head)?;
        if h.id.address != *address {
            return Err(Fault::WrongContent);
        }
        let want = format.payload_bytes(h.id.tokens as usize) as u64;
        if h.payload_len != want || len != format.head_bytes() as u64 + want {
            return Err(Fault::Truncated);
        }
        Ok(len as usize)
    }

    /// The store's counters.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            connects: self.medium.shared().map_or(0, |s| s.connects()),
            conversations_expired: self.medium.expired(),
            ..self.stats
        }
    }

    /// The byte budget.
    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    /// Bytes booked by stored and queued files.
    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    /// Bytes the file at `address` takes when it holds `tokens` KV-tokens (fewer for a narrow
    /// file).
    pub fn file_bytes(&self, address: &Address, tokens: usize) -> usize {
        let format = self.format.of(address);
        format.head_bytes() + format.payload_bytes(tokens)
    }

    /// References held on every entry (the chunk tables' saved chunks, for the invariant
    /// check).
    pub fn references(&self) -> usize {
        self.entries.values().map(|e| e.refs as usize).sum()
    }

    /// Takes one more reference to a stored or queued file; `false` if there is none.
    pub fn retain(&mut self, address: &Address) -> bool {
        match self.entries.get_mut(address) {
            Some(e) if !matches!(e.state, State::Failed) => {
                e.refs += 1;
                true
            }
            _ => false,
        }
    }

    /// [`Store::retain`]s a file a manifest names, counting it missing if it is not here.
    pub fn claim(&mut self, address: &Address) -> bool {
        let found = self.retain(address);
        if !found && !self.refused.contains(address) {
            tracing::warn!(
                "a chunk a manifest names is missing from the store; it will be recomputed"
            );
            self.stats.faults.count(Fault::Missing);
        }
        found
    }

    /// Saves a chunk (`bytes`: `tokens` KV-tokens, possibly still being copied off a device)
    /// under `address`, behind: the write is queued for the worker.
    pub fn save(
        &mut self,
        conversation: u64,
        index: usize,
        address: Address,
        tokens: usize,
        bytes: Arc<ChunkBytes>,
    ) -> Saved {
        match self.entries.get_mut(&address) {
            Some(e) if !matches!(e.state, State::Failed) => {
                e.refs += 1;
                self.stats.saves_shared += 1;
                return Saved::Shared;
            }
            // A refused file of this content is still referenced: save again once released.
            Some(_) => return Saved::Busy,
            None => {}
        }
        let size = self.file_bytes(&address, tokens);
        if self.pending_bytes + size > MAX_PENDING_BYTES {
            return Saved::Busy;
        }
        if self.used_bytes + size > self.budget_bytes {
            self.stats.saves_refused += 1;
            return Saved::NoRoom;
        }
        // The header's checksum covers the payload, which a device copy may still be filling:
        // the worker builds the header once it has the bytes.
        let id = ChunkId {
            conversation,
            index: index as u32,
            tokens: tokens as u32,
            address,
        };
        let job = Job::Chunk {
            bytes: Arc::clone(&bytes),
            format: self.format.of(&address),
            id,
            write: self.next_write,
        };
        if !self.worker.send(job) {
            tracing::warn!("the store's writer is gone: a chunk was not stored");
            self.stats.save_failures += 1;
            return Saved::NoRoom;
        }
        self.used_bytes += size;
        self.pending_bytes += size;
        let state = State::Pending(self.next_write, bytes);
        self.next_write += 1;
        let entry = Entry {
            bytes: size,
            refs: 1,
            state,
            owned: true,
        };
        self.entries.insert(address, entry);
        self.stats.bytes_used = self.used_bytes;
        Saved::Queued
    }

    /// Drops one reference; the last one deletes the file (behind) and frees its bytes.
    pub fn release(&mut self, address: &Address) {
        let Some(e) = self.entries.get_mut(address) else {
            return;
        };
        e.refs = e.refs.saturating_sub(1);
        if e.refs == 0 {
            self.forget(address);
        }
    }

    /// Drops an entry no conversation here references. Its bytes stay in a shared store:
    /// another engine may have found them by content since, so they leave by TTL or the
    /// server's own eviction, never by this engine.
    fn forget(&mut self, address: &Address) {
        if let Some(e) = self.entries.remove(address).filter(|e| e.owned) {
            self.used_bytes -= e.bytes;
            if matches!(e.state, State::Pending(..)) {
                self.pending_bytes -= e.bytes;
            }
            if self.medium.shared().is_none() {
                self.worker.send(Job::RemoveChunk(*address));
                self.stats.files_removed += 1;
            }
            self.stats.bytes_used = self.used_bytes;
        }
    }

    /// Deletes every indexed file no one references (after a restart has retained what its
    /// conversations need).
    pub fn collect_garbage(&mut self) {
        let unused: Vec<Address> = self
            .entries
            .iter()
            .filter(|(_, e)| e.refs == 0)
            .map(|(a, _)| *a)
            .collect();
        for a in unused {
            self.forget(&a);
        }
    }

    /// Starts reading the chunk at `address` of `tokens` KV-tokens whole on the reader thread,
    /// for a restore that needs it now (from memory if its write is still queued): the
    /// returned bytes wait for the read, and fail if the file is refused ([`Store::poll`] then
    /// reports it). `None`, counted as missing, if the store has no usable file.
    pub fn read_behind(&mut self, address: &Address, tokens: usize) -> Option<Arc<ChunkBytes>> {
        match self.read_whole(address, tokens) {
            Some((bytes, queued)) => {
                self.stats.chunks_read += u64::from(queued);
                Some(bytes)
            }
            None => {
                self.refuse(address, Fault::Missing);
                None
            }
        }
    }

    /// Starts reading the chunk at `address` of `tokens` KV-tokens layer by layer on the reader
    /// thread, for a restore that uses each layer as it arrives (from memory, whole, if its
    /// write is still queued). `None`, counted as missing, if the store has no usable file; a
    /// file refused by the read fails the layers not yet read (reported by
    /// [`Store::poll`]).
    pub fn load_layered(&mut self, address: &Address, tokens: usize) -> Option<Arc<ChunkBytes>> {
        match self.entries.get(address).map(|e| &e.state) {
            Some(State::Pending(_, bytes)) => return Some(Arc::clone(bytes)),
            Some(State::Stored) => {}
            Some(State::Failed) | None => {
                self.refuse(address, Fault::Missing);
                return None;
            }
        }
        let format = self.format.of(address);
        let layers: Arc<LayerCells> =
            Arc::new((0..format.layers).map(|_| OnceLock::new()).collect());
        let job = Job::ReadLayers {
            format,
            address: *address,
            tokens,
            layers: Arc::clone(&layers),
        };
        let len = self.queue_read(job, format.payload_bytes(tokens))?;
        self.stats.chunks_read += 1;
        Some(Arc::new(ChunkBytes::layered(len, layers)))
    }

    /// A stored file was refused when read: counted, never read again, and deleted if its bytes
    /// are bad.
    fn refuse(&mut self, address: &Address, fault: Fault) {
        tracing::warn!(%fault, "a stored chunk was refused when read; it will be recomputed");
        self.stats.faults.count(fault);
        // Bytes proven bad are deleted; a read that failed (a timeout, a lost connection) says
        // nothing about them, and other engines may read them fine.
        let bad_bytes = !matches!(fault, Fault::Io(_) | Fault::Missing);
        let delete = match self.entries.get_mut(address) {
            Some(e) if matches!(e.state, State::Stored) => {
                e.state = State::Failed;
                bad_bytes
            }
            // Written again since (pending), or already refused.
            Some(_) => false,
            // Forgotten while its read was behind (the failed restore released it): the bad
            // bytes are still stored, where another turn (or engine) would find them.
            None => bad_bytes,
        };
        if delete {
            self.worker.send(Job::RemoveChunk(*address));
        }
    }

    /// Starts reading the chunk at `address` of `tokens` KV-tokens ahead of its use, on the
    /// reader thread; the returned bytes wait for the read (and fail if the file is refused,
    /// which [`Store::poll`] then reports). `None` if the store has no usable file.
    pub fn prefetch(&mut self, address: &Address, tokens: usize) -> Option<Arc<ChunkBytes>> {
        let (bytes, queued) = self.read_whole(address, tokens)?;
        self.stats.chunks_prefetched += u64::from(queued);
        Some(bytes)
    }

    /// The bytes of the chunk at `address`, whole: from memory while its write is queued (and
    /// `false`), or read on the reader thread (and `true`). `None` if the store has no usable
    /// file.
    fn read_whole(&mut self, address: &Address, tokens: usize) -> Option<(Arc<ChunkBytes>, bool)> {
        match &self.entries.get(address)?.state {
            State::Pending(_, bytes) => Some((Arc::clone(bytes), false)),
            State::Stored => {
                let cell = Arc::new(OnceLock::new());
                let format = self.format.of(address);
                let job = Job::Read {
                    format,
                    address: *address,
                    tokens,
                    cell: Arc::clone(&cell),
                };
                let len = self.queue_read(job, format.payload_bytes(tokens))?;
                Some((Arc::new(ChunkBytes::reading(len, cell)), true))
            }
            State::Failed => None,
        }
    }

    /// Queues `job`, a read of a payload of `len` bytes, on the reader thread and counts
    /// them: `len`, or `None` if the thread is gone.
    fn queue_read(&mut self, job: Job, len: usize) -> Option<usize> {
        if !self.reader.send(job) {
            return None;
        }
        self.stats.bytes_read += len as u64;
        Some(len)
    }

    /// Calls `waker` whenever the store's writer or reader finishes a job.
    pub fn set_waker(&self, waker: Waker) {
        self.worker.set_waker(Arc::clone(&waker));
        self.reader.set_waker(waker);
    }

    /// Takes the reports of finished writes: returns the addresses whose write failed (their
    /// chunks must no longer count on the disk copy).
    pub fn poll(&mut self) -> Vec<Address> {
        let mut failed = Vec::new();
        for done in self.reader.finished() {
            match done {
                worker::Done::Refused { address, fault } => {
                    self.refuse(&address, fault);
                    failed.push(address);
                }
                worker::Done::Looked { lookup, found } => {
                    self.lookups.remove(&lookup);
                    self.index_found(&found);
                }
                worker::Done::Written { .. } => {}
            }
        }
        for done in self.worker.finished() {
            let worker::Done::Written {
                address,
                write,
                result,
            } = done
            else {
                continue;
            };
            let Some(e) = self.entries.get_mut(&address) else {
                // Released while queued: already forgotten.
                continue;
            };
            let State::Pending(pending, _) = &e.state else {
                continue;
            };
            if write != *pending {
                continue;
            }
            self.pending_bytes -= e.bytes;
            match result {
                Ok(()) => {
                    e.state = State::Stored;
                    self.stats.chunks_written += 1;
                    let head = self.format.of(&address).head_bytes();
                    self.stats.bytes_written += (e.bytes - head) as u64;
                }
                Err(why) => {
                    tracing::warn!(%why, "a chunk could not be stored");
                    e.state = State::Failed;
                    self.stats.save_failures += 1;
                    failed.push(address);
                }
            }
        }
        failed
    }

    /// Waits until every queued write has reached the disk, then takes the reports.
    pub fn flush(&mut self) -> Vec<Address> {
        self.worker.flush();
        self.poll()
    }
}
