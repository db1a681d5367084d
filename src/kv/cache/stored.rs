//! The cache manager's side of the store: which chunks get a file, what a failed file
//! does to the tables, eviction of files under the budget, and the tables a restarted engine
//! rebuilds from its conversations' manifests.
//!
//! A chunk's file is an extra copy: the chunk keeps its place in the device pool or the host
//! tier, and leaving either later costs nothing (AttentionStore §3.3: host eviction of a saved
//! chunk is free). Saving is skipped for chunks that are cheaper to recompute than to read
//! back, so dropping one wins only when it is cheaper than reading it.

use std::sync::Arc;
use std::time::Instant;

use super::{CacheManager, ChunkTable};
use crate::ids::ConversationId;
use crate::kv::{Address, BlockId, ChunkBytes, ChunkLoc, CostModel, Saved, Store, StoreStats};

/// The store tier as the cache manager uses it.
#[derive(Debug)]
pub(crate) struct StoreTier {
    pub store: Store,
    /// The recompute cost curve, to compare with reading a chunk back.
    pub cost: CostModel,
    /// Bytes per second the store reads back.
    pub read_bytes_per_s: f64,
}

/// A device chunk to copy off and save (its block stays where it is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Save {
    pub conv: ConversationId,
    pub chunk: usize,
    pub block: BlockId,
    pub len: usize,
    pub address: Address,
}

impl CacheManager {
    /// Adds the store below host.
    pub fn attach_store(&mut self, tier: StoreTier) {
        self.store = Some(tier);
    }

    /// The store tier's counters, if there is one.
    pub fn store_stats(&self) -> Option<StoreStats> {
        self.store.as_ref().map(|d| d.store.stats())
    }

    /// The addresses of `id`'s saved chunks, in order (`None` where a chunk has no file), each
    /// with the number of its write if it is still queued (a manifest lists a chunk whose write
    /// is queued only if that write succeeds).
    pub fn saved(&self, id: ConversationId) -> Vec<Option<(Address, Option<u64>)>> {
        let (Some(d), Some(t)) = (&self.store, self.tables.get(&id)) else {
            return Vec::new();
        };
        (t.files().iter())
            .map(|a| a.map(|a| (a, d.store.pending_write(&a))))
            .collect()
    }

    /// Rebuilds the table of a conversation resumed from a manifest: `computed` tokens whose
    /// chunks' files are `saved` (in a shared store, by this engine or others). The chunks
    /// its table already holds (found in memory by [`CacheManager::adopt_resident`]) stay;
    /// chunks whose file is gone or refused are dropped (recomputed on the next turn).
    pub fn adopt(
        &mut self,
        id: ConversationId,
        computed: usize,
        saved: &[Option<Address>],
        now: Instant,
    ) {
        let chunk = self.chunk_size();
        let n = computed.div_ceil(chunk);
        if !self.tables.contains_key(&id) {
            self.open(id, now);
        }
        self.drop_records(id, n);
        let Some(table) = self.tables.get_mut(&id) else {
            return;
        };
        table.set_computed(computed);
        for i in table.len()..n {
            let claimed = (saved.get(i).copied().flatten())
                .filter(|a| self.store.as_mut().is_some_and(|d| d.store.claim(a)));
            let loc = match claimed {
                Some(_) => ChunkLoc::Stored,
                None => ChunkLoc::Dropped,
            };
            table.push(self.arena.insert(loc, id), claimed);
        }
    }

    /// After a restart has adopted its conversations: deletes the files none of them needs,
    /// and evicts down to the budget (which may have shrunk since the files were written).
    pub fn collect_store_garbage(&mut self, now: Instant) {
        if let Some(d) = &mut self.store {
            d.store.collect_garbage();
        }
        self.make_store_room(0, &|_| false, now);
    }

    /// Extends `id`'s table with chunks stored under `addresses` (its next full chunks'
    /// content addresses, in order) as far as the store has them: KV that other
    /// conversations computed for the same tokens, found by content and shared (one file, one
    /// more reference). Only for a table whose computed tokens end at a chunk boundary with no
    /// chunk past them. Only chunks the store has indexed count (see [`Self::look_up`]).
    /// Returns the chunks adopted; they are `Disk`, read when the turn runs.
    pub fn adopt_stored(&mut self, id: ConversationId, addresses: &[Address]) -> usize {
        let chunk = self.chunk_size();
        let (Some(d), Some(t)) = (&mut self.store, self.tables.get_mut(&id)) else {
            return 0;
        };
        if !t.computed().is_multiple_of(chunk) || t.len() != t.computed() / chunk {
            return 0;
        }
        let n = addresses
            .iter()
            .take_while(|&&a| {
                // Its narrow file serves too: a turn that a window would read it through
                // recomputes it (see `restore`).
                let found = [a, a.narrow()].into_iter().find(|a| d.store.retain(a));
                if let Some(a) = found {
                    t.push(self.arena.insert(ChunkLoc::Stored, id), Some(a));
                }
                found.is_some()
            })
            .count();
        t.set_computed(t.computed() + n * chunk);
        n
    }

    /// Indexes the chunks a shared store was found to hold (by a [`crate::kv::StoreReader`]).
    pub fn index_found(&mut self, found: &[(Address, usize)]) {
        if let Some(d) = &mut self.store {
            d.store.index_found(found);
        }
    }

    /// Asks a shared store behind which of the full chunks `addresses` other engines stored
    /// (see [`Store::look_up`]); `None` when there is nothing to ask.
    pub fn look_up(&mut self, addresses: &[Address]) -> Option<u64> {
        let chunk = self.chunk_size();
        let full: Vec<(Address, usize)> = addresses.iter().map(|a| (*a, chunk)).collect();
        self.store.as_mut()?.store.look_up(&full)
    }

    /// Whether lookup `lookup` was answered.
    pub fn looked(&self, lookup: u64) -> bool {
        self.store.as_ref().is_none_or(|d| d.store.looked(lookup))
    }

    /// Starts reading `id`'s chunks that are only on disk into free host room, leading chunk
    /// first, on the reader thread (the scheduler's look-ahead over its wait queue): the turn
    /// then finds them in host memory. Never evicts to make room.
    pub fn prefetch(&mut self, id: ConversationId) {
        let chunk = self.chunk_size();
        let (Some(_), Some(t)) = (&self.store, self.tables.get(&id)) else {
            return;
        };
        let stored: Vec<_> = (t.records().iter().enumerate())
            .filter_map(|(i, &rec)| match (self.arena.loc(rec), t.file(i)) {
                (ChunkLoc::Stored, Some(a)) => Some((rec, a, t.chunk_len(i, chunk))),
                _ => None,
            })
            .collect();
        for (rec, a, len) in stored {
            let Some(h) = self.host.reserve(self.chunk_bytes(len, a.is_narrow())) else {
                return;
            };
            let Some(d) = &mut self.store else {
                return;
            };
            match d.store.prefetch(&a, len) {
                Some(bytes) => {
                    self.host.store(h, bytes);
                    self.arena.set_loc(rec, ChunkLoc::Host(h));
                    self.arena.set_narrow(rec, a.is_narrow());
                }
                None => self.host.release(h),
            }
        }
    }

    /// Plans saving every computed chunk of `id` that has no file yet and is worth one
    /// (`tokens`: the conversation's history, which names the chunks). Host chunks are saved
    /// at once from their bytes; device chunks are returned, for the executor to copy off and
    /// hand to [`CacheManager::complete_save`].
    pub fn saves(&mut self, id: ConversationId, tokens: &[u32], now: Instant) -> Vec<Save> {
        let chunk = self.chunk_size();
        let Some(t) = self.tables.get(&id) else {
            return Vec::new();
        };
        let computed = t.computed().min(tokens.len());
        let mut out = Vec::new();
        let mut from_host = Vec::new();
        // Whole files of chunks that now leave narrow are written again narrow (the whole one
        // let go once it is): the disk keeps what the windows still read, as memory does.
        if self.narrowing.is_some_and(|n| n.token_bytes.is_some()) {
            for (i, &rec) in t.records().iter().enumerate() {
                let Some(file) = t.file(i).filter(|a| !a.is_narrow()) else {
                    continue;
                };
                let len = t.chunk_len(i, chunk);
                match self.arena.loc(rec) {
                    ChunkLoc::Device(block) if self.leaves_narrow(t, i, rec) => out.push(Save {
                        conv: id,
                        chunk: i,
                        block,
                        len,
                        address: file.narrow(),
                    }),
                    ChunkLoc::Host(h) if self.arena.narrow(rec) => {
                        from_host.push((i, h, len, file.narrow()));
                    }
                    _ => {}
                }
            }
        }
        // Hashed from the first chunk to save (usually the turn's new ones).
        let first = (0..t.len()).find(|&i| t.file(i).is_none() && self.worth_saving(i, t, chunk));
        let addresses = match first {
            Some(first) => self.addresses_from(id, &tokens[..computed], &[], first),
            None => Vec::new(),
        };
        for (i, &address) in (first.unwrap_or(0)..).zip(&addresses) {
            let Some(rec) = t.record(i).filter(|_| t.file(i).is_none()) else {
                continue;
            };
            if !self.worth_saving(i, t, chunk) {
                continue;
            }
            let len = t.chunk_len(i, chunk);
            let narrow = match self.arena.loc(rec) {
                ChunkLoc::Device(_) => self.leaves_narrow(t, i, rec),
                _ => self.arena.narrow(rec),
            };
            // A narrow chunk is saved narrow, where the pool copies narrow (elsewhere its
            // bytes are whole in size, the other layers zeros: not saved).
            if narrow && self.narrowing.is_none_or(|n| n.token_bytes.is_none()) {
                continue;
            }
            let address = if narrow { address.narrow() } else { address };
            match self.arena.loc(rec) {
                ChunkLoc::Device(block) => out.push(Save {
                    conv: id,
                    chunk: i,
                    block,
                    len,
                    address,
                }),
                ChunkLoc::Host(h) => from_host.push((i, h, len, address)),
                _ => {}
            }
        }
        for (i, h, len, address) in from_host {
            if let Some(bytes) = self.host.get(h) {
                let save = Save {
                    conv: id,
                    chunk: i,
                    block: BlockId(0),
                    len,
                    address,
                };
                self.complete_save(&save, bytes, now);
            }
        }
        out
    }

    /// Whether chunk `i` of `t` costs more to recompute than to read back.
    fn worth_saving(&self, i: usize, t: &ChunkTable, chunk: usize) -> bool {
        let Some(d) = &self.store else {
            return false;
        };
        let len = t.chunk_len(i, chunk);
        // As a whole chunk's file (a narrow one reads less).
        let whole = Address::default();
        let read_s = d.store.file_bytes(&whole, len) as f64 / d.read_bytes_per_s.max(1.0);
        d.cost.recompute_s(i * chunk, len) > read_s
    }

    /// Queues the write of a planned save's bytes, making room under the disk budget by
    /// evicting other conversations' files if needed. A save the tier refuses leaves the
    /// chunk as it was (counted in the disk stats).
    pub fn complete_save(&mut self, s: &Save, bytes: Arc<ChunkBytes>, now: Instant) {
        let Some(d) = &self.store else {
            return;
        };
        let need = d.store.file_bytes(&s.address, s.len);
        if d.store.used_bytes() + need > d.store.budget_bytes() {
            self.make_store_room(need, &|c| c == s.conv, now);
        }
        // Unsaved, or (a narrow file in place of a whole one) saved whole.
        let still_unsaved = self.tables.get(&s.conv).is_some_and(|t| {
            s.chunk < t.len()
                && match t.file(s.chunk) {
                    None => true,
                    Some(a) => s.address.is_narrow() && a == s.address.wide(),
                }
        });
        let Some(d) = &mut self.store else {
            return;
        };
        if !still_unsaved {
            return;
        }
        let saved = d.store.save(s.conv.0, s.chunk, s.address, s.len, bytes);
        if matches!(saved, Saved::Queued | Saved::Shared)
            && let Some(t) = self.tables.get_mut(&s.conv)
        {
            if let Some(whole) = t.set_file(s.chunk, Some(s.address)) {
                d.store.release(&whole);
            }
            self.candidates.mark(s.conv);
        }
    }

    /// Deletes files of unprotected conversations, lowest value first, until `bytes` more fit
    /// under the disk budget (or nothing more can go). A chunk that was only on disk is
    /// dropped.
    fn make_store_room(
        &mut self,
        bytes: usize,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
    ) {
        loop {
            let Some(d) = &self.store else {
                return;
            };
            if d.store.used_bytes() + bytes <= d.store.budget_bytes() {
                return;
            }
            let Some((id, i)) = self.victim(super::candidates::Tier::Stored, protect, now) else {
                return;
            };
            self.drop_saved(id, i);
        }
    }

    /// Forgets chunk `i` of `id`'s file (releasing it); a chunk that was only on disk is
    /// dropped.
    pub(super) fn drop_saved(&mut self, id: ConversationId, i: usize) {
        let Some(t) = self.tables.get_mut(&id) else {
            return;
        };
        let Some(a) = t.set_file(i, None) else {
            return;
        };
        self.candidates.mark(id);
        if let Some(rec) = t
            .record(i)
            .filter(|&r| self.arena.loc(r) == ChunkLoc::Stored)
        {
            self.arena.set_loc(rec, ChunkLoc::Dropped);
            self.counters.chunks_dropped_from_store += 1;
        }
        if let Some(d) = &mut self.store {
            d.store.release(&a);
        }
    }

    /// Takes the disk writer's reports: chunks whose write failed lose their file (a chunk
    /// only on disk is dropped and recomputed when needed).
    pub fn poll_store(&mut self) {
        let failed = self.store.as_mut().map(|d| d.store.poll());
        self.forget_files(failed.unwrap_or_default());
    }

    /// Calls `waker` whenever the store's writer or reader finishes a job.
    pub fn set_store_waker(&self, waker: crate::kv::Waker) {
        if let Some(d) = &self.store {
            d.store.set_waker(waker);
        }
    }

    /// Waits until every queued write has reached the disk.
    pub fn flush_store(&mut self) {
        let failed = self.store.as_mut().map(|d| d.store.flush());
        self.forget_files(failed.unwrap_or_default());
    }

    fn forget_files(&mut self, failed: Vec<Address>) {
        for a in failed {
            let users: Vec<(ConversationId, usize)> = self
                .tables
                .iter()
                .flat_map(|(&id, t)| {
                    t.files()
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| **s == Some(a))
                        .map(move |(i, _)| (id, i))
                })
                .collect();
            for (id, i) in users {
                self.drop_saved(id, i);
            }
        }
    }
}
