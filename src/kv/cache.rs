//! The cache manager: every conversation's chunk table, and the moves of KV between tiers
//! (Pensieve §4.3, thesis §3.4.3).
//!
//! It owns the device block allocator, the host pool, the eviction policy and one
//! [`ChunkTable`] per conversation; a chunk table changes only through its methods (`table`
//! keeps its fields private, so a chunk and its file are added and cut together). Moves are
//! two-phase: planning marks a chunk `SwappingOut` / `SwappingIn` and books the destination
//! (the plan's [`Moves`]); the executor copies the bytes; `complete_*` frees the source, or
//! `abort_*` drops the chunk when the copy failed (counted). Drops take effect at once (nothing
//! to copy). Eviction picks, among each unprotected conversation's first own chunk in a tier
//! and the shared chunks there no protected conversation holds, the lowest value under the
//! policy. Ahead-of-time eviction only moves KV to a lower tier with free room; dropping
//! happens only on demand.
//!
//! A table is a list of handles to chunk records (see `arena`): a chunk shared by
//! conversations whose histories start alike (see `share`) is one record with several
//! holders, and moves for all of them at once.
//!
//! Invariants (checked by [`CacheManager::check`]): every allocated block and host chunk is
//! named by exactly one record, and every record by exactly its holders' tables; the host
//! pool never exceeds its budget; a table covers at least its computed tokens.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

mod arena;
mod candidates;
mod check;
mod evict;
mod hints;
mod restore;
mod share;
mod shift;
mod stored;
mod table;

pub(crate) use shift::Held;
pub(crate) use stored::StoreTier;
pub(crate) use table::ChunkTable;

use super::{
    Address, BlockAllocator, BlockId, ChunkBytes, ChunkLoc, EvictionPolicy, HostChunkId, HostPool,
};
use crate::ids::ConversationId;
use arena::{Arena, ChunkId};
use candidates::Candidates;
use hints::HintIndex;

/// A planned device → host copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SwapOut {
    pub conv: ConversationId,
    pub chunk: usize,
    pub block: BlockId,
    pub host: HostChunkId,
    pub len: usize,
    /// Only the narrow layers leave (see [`Narrowing`]).
    pub narrow: bool,
}

/// Where a swap-in's bytes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    Host(HostChunkId),
    /// The chunk's file, read and checked whole by the executor.
    Stored(Address),
}

/// A planned host (or store) → device copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SwapIn {
    pub conv: ConversationId,
    pub chunk: usize,
    pub from: Source,
    pub block: BlockId,
    pub len: usize,
    /// Its bytes hold only the narrow layers.
    pub narrow: bool,
}

/// The copies one step does before its forward pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Moves {
    pub swap_out: Vec<SwapOut>,
    pub swap_in: Vec<SwapIn>,
}

impl SwapOut {
    /// Where the chunk is while the copy is planned.
    fn loc(&self) -> ChunkLoc {
        ChunkLoc::SwappingOut {
            block: self.block,
            host: self.host,
        }
    }
}

impl SwapIn {
    /// Where the chunk is while the copy is planned.
    fn loc(&self) -> ChunkLoc {
        match self.from {
            Source::Host(host) => ChunkLoc::SwappingIn {
                host,
                block: self.block,
            },
            Source::Stored(_) => ChunkLoc::Loading(self.block),
        }
    }
}

impl Moves {
    pub fn is_empty(&self) -> bool {
        self.swap_out.is_empty() && self.swap_in.is_empty()
    }
}

/// Why KV leaves the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Eviction {
    /// Blocks are needed now: swap to the host, making room there by dropping host chunks,
    /// else drop.
    OnDemand,
    /// Keeping free blocks for later: swap only into free host room, never drop.
    AheadOfTime,
}

/// Sliding-window layers keep their window: a chunk that none of them will read again (not
/// from where its conversation computes next, nor from where its latest turn began, which a
/// retry or an edit goes back to) leaves the device narrow, with only the layers that attend to
/// the whole history, in every tier below. A turn that would compute where a sliding window
/// reads a narrow chunk recomputes that chunk too (and so on back), so its KV is always what
/// a stateless run computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Narrowing {
    /// The longest sliding window, in positions.
    pub window: usize,
    /// Host bytes of one narrow KV-token, where the pool copies chunks narrow (a GPU's copies
    /// move whole chunks: `None`, and chunks leave whole).
    pub token_bytes: Option<usize>,
}

/// Counters the engine reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CacheCounters {
    pub bytes_swapped_out: u64,
    pub bytes_swapped_in: u64,
    pub chunks_dropped_from_device: u64,
    pub chunks_dropped_from_host: u64,
    /// Swap-outs whose copy failed: the chunk was dropped instead.
    pub swap_out_failures: u64,
    /// Swap-ins whose copy failed: the chunk is recomputed instead.
    pub swap_in_failures: u64,
    /// Chunks moved off the device or host to their stored copy alone (nothing to write).
    pub chunks_to_store: u64,
    /// Chunks dropped from the store (evicted, or their file refused).
    pub chunks_dropped_from_store: u64,
    /// Chunks that left the device narrow.
    pub narrow_swap_outs: u64,
    /// Narrow chunks recomputed where a window read them.
    pub narrow_recomputed: u64,
}

#[derive(Debug)]
pub(crate) struct CacheManager {
    blocks: BlockAllocator,
    host: HostPool,
    policy: Box<dyn EvictionPolicy>,
    /// Host bytes of one KV-token.
    token_bytes: usize,
    tables: BTreeMap<ConversationId, ChunkTable>,
    counters: CacheCounters,
    /// The tier below host, when the engine has one.
    store: Option<StoreTier>,
    /// Every chunk record, and the content index over them.
    arena: Arena,
    /// Eviction candidates of every tier, in order.
    candidates: Candidates,
    /// The session hints' indexes.
    hints: HintIndex,
    /// How chunks out of every sliding window narrow, for a model with such layers.
    narrowing: Option<Narrowing>,
}

impl CacheManager {
    pub fn new(
        num_blocks: usize,
        chunk_size: usize,
        host_bytes: usize,
        policy: Box<dyn EvictionPolicy>,
        token_bytes: usize,
    ) -> Self {
        Self {
            blocks: BlockAllocator::new(num_blocks, chunk_size),
            host: HostPool::new(host_bytes),
            policy,
            token_bytes,
            tables: BTreeMap::new(),
            counters: CacheCounters::default(),
            store: None,
            arena: Arena::default(),
            candidates: Candidates::default(),
            hints: HintIndex::default(),
            narrowing: None,
        }
    }

    /// Chunks out of every sliding window leave the device narrow, as `narrowing` says.
    pub fn set_narrowing(&mut self, narrowing: Narrowing) {
        self.narrowing = Some(narrowing);
    }

    /// Host bytes of `len` KV-tokens, of the narrow layers only with `narrow`.
    fn chunk_bytes(&self, len: usize, narrow: bool) -> usize {
        match self.narrowing.and_then(|n| n.token_bytes) {
            Some(per) if narrow => len * per,
            _ => self.bytes_of(len),
        }
    }

    /// Whether chunk `i` of `t` (record `rec`) holds only the narrow layers where it lives.
    fn is_narrow(&self, t: &ChunkTable, i: usize, rec: ChunkId) -> bool {
        match self.arena.loc(rec) {
            ChunkLoc::Stored => t.file(i).is_some_and(|a| a.is_narrow()),
            ChunkLoc::Dropped | ChunkLoc::Recomputing(_) => false,
            _ => self.arena.narrow(rec),
        }
    }

    /// Whether chunk `i` of `t` (record `rec`, on the device) leaves it narrow: it is narrow
    /// already, or, where the pool copies narrow, no sliding window reads it from the latest
    /// turn's start on and no other conversation holds it (another may resume right after).
    fn leaves_narrow(&self, t: &ChunkTable, i: usize, rec: ChunkId) -> bool {
        let Some(n) = self.narrowing.filter(|n| n.token_bytes.is_some()) else {
            return false;
        };
        let end = (i + 1) * self.chunk_size();
        self.arena.narrow(rec)
            || (!self.arena.is_shared(rec) && end + n.window <= t.turn_start() + 1)
    }

    pub fn chunk_size(&self) -> usize {
        self.blocks.chunk_size()
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.num_blocks()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.blocks.num_free()
    }

    pub fn host_used_bytes(&self) -> usize {
        self.host.used_bytes()
    }

    pub fn counters(&self) -> CacheCounters {
        self.counters
    }

    /// First slot of `block`.
    pub fn first_slot(&self, block: BlockId) -> usize {
        self.blocks.slot(block, 0) as usize
    }

    /// Host bytes of `len` KV-tokens.
    fn bytes_of(&self, len: usize) -> usize {
        len * self.token_bytes
    }

    /// Starts an empty table for a new conversation.
    pub fn open(&mut self, id: ConversationId, now: Instant) {
        self.tables.insert(id, ChunkTable::new(now));
    }

    /// Releases everything `id` holds and forgets it.
    pub fn close(&mut self, id: ConversationId) {
        self.replace_tail(id, 0, 0, Vec::new());
        self.pin(id, false);
        let at = self.tables.remove(&id).and_then(|t| t.resume_at());
        self.hints.resume(id, at, None);
        self.candidates.mark(id);
    }

    pub fn table(&self, id: ConversationId) -> Option<&ChunkTable> {
        self.tables.get(&id)
    }

    /// The device block holding chunk `i` of `id`, if attention can read it this step.
    pub fn block(&self, id: ConversationId, i: usize) -> Option<u32> {
        let rec = self.tables.get(&id)?.record(i)?;
        Some(self.arena.loc(rec).readable_block()?.0)
    }

    /// The device slot holding position `pos` of `id`, if attention can read it this step.
    pub fn slot(&self, id: ConversationId, pos: usize) -> Option<u32> {
        let chunk = self.chunk_size();
        let rec = self.tables.get(&id)?.record(pos / chunk)?;
        let block = self.arena.loc(rec).readable_block()?;
        Some(self.blocks.slot(block, pos % chunk))
    }

    /// Where each chunk of `id` lives.
    #[cfg(test)]
    pub fn locs(&self, id: ConversationId) -> Vec<ChunkLoc> {
        self.tables.get(&id).map_or_else(Vec::new, |t| {
            t.records().iter().map(|&r| self.arena.loc(r)).collect()
        })
    }

    /// The record chunk `i` of `id` names, if its location is `loc`.
    fn record_at(&self, id: ConversationId, i: usize, loc: ChunkLoc) -> Option<ChunkId> {
        let rec = self.tables.get(&id)?.record(i)?;
        (self.arena.loc(rec) == loc).then_some(rec)
    }

    /// Gives every holder of `rec` (chunk `i` of each) a record of its own at the location
    /// `loc_of` picks for its table: a shared chunk leaving memory becomes each holder's own.
    fn scatter(&mut self, rec: ChunkId, i: usize, loc_of: impl Fn(&ChunkTable) -> ChunkLoc) {
        for h in self.arena.holders(rec).to_vec() {
            let Some(t) = self.tables.get_mut(&h) else {
                continue;
            };
            let own = self.arena.detach(rec, h, loc_of(t));
            t.set_record(i, own);
        }
    }

    /// Releases the block and host chunk a freed record named.
    fn release_loc(&mut self, loc: ChunkLoc) {
        if let Some(b) = loc.named_block() {
            self.blocks.release(b);
        }
        if let ChunkLoc::Host(h)
        | ChunkLoc::SwappingOut { host: h, .. }
        | ChunkLoc::SwappingIn { host: h, .. } = loc
        {
            self.host.release(h);
        }
    }

    /// `id` lets go of its chunks from `from` on: of their records (what no one holds any
    /// more is released) and of their files.
    fn drop_records(&mut self, id: ConversationId, from: usize) {
        let Some(t) = self.tables.get_mut(&id) else {
            return;
        };
        let cut = t.cut(from);
        for rec in cut.records {
            if let Some(loc) = self.arena.remove_holder(rec, id) {
                self.release_loc(loc);
            }
        }
        if let Some(d) = &mut self.store {
            cut.files.iter().for_each(|a| d.store.release(a));
        }
    }

    /// Records that positions below `end` of `id` now have their KV computed.
    pub fn mark_computed(&mut self, id: ConversationId, end: usize) {
        let chunk = self.chunk_size();
        let Some(t) = self.tables.get_mut(&id) else {
            return;
        };
        let computed = t.computed();
        if end > computed && !computed.is_multiple_of(chunk) {
            // A partial chunk grows: its saved file no longer holds all of it.
            if let Some(a) = t.set_file(computed / chunk, None)
                && let Some(d) = &mut self.store
            {
                d.store.release(&a);
            }
        }
        t.set_computed(computed.max(end));
        self.candidates.mark(id);
    }

    /// Records activity of `id` at `now` (eviction's idle time restarts).
    pub fn touch(&mut self, id: ConversationId, now: Instant) {
        if let Some(t) = self.tables.get_mut(&id) {
            t.touch(now);
            self.candidates.mark(id);
        }
    }

    /// A swap-out's bytes were copied: they go into the booked host chunk and the block is
    /// freed. If the host no longer has the booking, the chunk is dropped (counted).
    pub fn complete_swap_out(&mut self, s: &SwapOut, data: Arc<ChunkBytes>) {
        if !self.host.store(s.host, data) {
            self.abort_swap_out(s);
            return;
        }
        let Some(rec) = self.record_at(s.conv, s.chunk, s.loc()) else {
            return;
        };
        self.blocks.release(s.block);
        self.arena.set_loc(rec, ChunkLoc::Host(s.host));
        if s.narrow {
            self.arena.set_narrow(rec, true);
            self.counters.narrow_swap_outs += 1;
        }
        self.counters.bytes_swapped_out += self.chunk_bytes(s.len, s.narrow) as u64;
    }

    /// A swap-out whose copy failed: the chunk is dropped (its raw tokens rebuild it).
    pub fn abort_swap_out(&mut self, s: &SwapOut) {
        if let Some(rec) = self.record_at(s.conv, s.chunk, s.loc()) {
            self.release_loc(s.loc());
            self.scatter(rec, s.chunk, |_| ChunkLoc::Dropped);
        }
        tracing::warn!("a swap-out failed: its chunk is dropped and will be recomputed");
        self.counters.swap_out_failures += 1;
        self.counters.chunks_dropped_from_device += 1;
    }

    /// Hands over a swap-in's bytes: from the host (freeing the host chunk), or from its file,
    /// read on the store's reader thread: whole and checked, or with `layered` layer by layer,
    /// each layer checked before it is used (the bytes wait for their read). `None` if they are
    /// gone or the store has no usable file (counted).
    pub fn take_swap_in(&mut self, s: &SwapIn, layered: bool) -> Option<Arc<ChunkBytes>> {
        match s.from {
            Source::Host(h) => self.host.get(h),
            Source::Stored(a) if layered => self.store.as_mut()?.store.load_layered(&a, s.len),
            Source::Stored(a) => self.store.as_mut()?.store.read_behind(&a, s.len),
        }
    }

    /// A swap-in's bytes are on the device (for every holder of a shared host chunk).
    pub fn complete_swap_in(&mut self, s: &SwapIn) {
        let Some(rec) = self.record_at(s.conv, s.chunk, s.loc()) else {
            return;
        };
        if let Source::Host(host) = s.from {
            self.counters.bytes_swapped_in += self.chunk_bytes(s.len, s.narrow) as u64;
            self.host.release(host);
        }
        self.arena.set_loc(rec, ChunkLoc::Device(s.block));
    }

    /// A swap-in whose copy failed: the chunk is dropped (recomputed when next needed).
    /// Returns the conversations that lost it (every holder of a shared host chunk).
    pub fn abort_swap_in(&mut self, s: &SwapIn) -> Vec<ConversationId> {
        tracing::warn!("a swap-in failed: its chunk is dropped and will be recomputed");
        self.counters.swap_in_failures += 1;
        // A read found bad layer by layer is aborted after the copy completed.
        let landed = ChunkLoc::Device(s.block);
        let Some((rec, loc)) = [s.loc(), landed]
            .into_iter()
            .find_map(|loc| Some((self.record_at(s.conv, s.chunk, loc)?, loc)))
        else {
            return Vec::new();
        };
        let holders = self.arena.holders(rec).to_vec();
        self.release_loc(loc);
        // A file refused (or unreadable) is forgotten; the chunk is recomputed. A chunk read
        // from disk is its conversation's own.
        if let Source::Stored(_) = s.from {
            self.drop_saved(s.conv, s.chunk);
        }
        self.scatter(rec, s.chunk, |_| ChunkLoc::Dropped);
        holders
    }

    /// Gives `id` one more block, for tokens about to be computed; `false` if the device is
    /// full.
    pub fn grow(&mut self, id: ConversationId) -> bool {
        let Some(table) = self.tables.get_mut(&id) else {
            return false;
        };
        match self.blocks.allocate() {
            Some(block) => {
                table.push(self.arena.insert(ChunkLoc::Device(block), id), None);
                true
            }
            None => false,
        }
    }

    /// After a turn ends or is suspended: recomputations that did not finish go back to
    /// `Dropped`, and blocks reserved past the computed tokens are released.
    pub fn settle(&mut self, id: ConversationId, recomputed_upto: usize) {
        let chunk = self.chunk_size();
        let Some(table) = self.tables.get_mut(&id) else {
            return;
        };
        for (i, &rec) in table.records().iter().enumerate() {
            if let ChunkLoc::Recomputing(block) = self.arena.loc(rec) {
                let end = i * chunk + table.chunk_len(i, chunk);
                let to = if end <= recomputed_upto {
                    ChunkLoc::Device(block)
                } else {
                    self.blocks.release(block);
                    ChunkLoc::Dropped
                };
                self.arena.set_loc(rec, to);
            }
        }
        let keep = table.computed_chunks(chunk);
        self.drop_records(id, keep);
    }

    /// Releases every block and host chunk of `id` (stateless mode after a turn, or close):
    /// every chunk becomes `Dropped`, to be recomputed from the raw tokens.
    pub fn release_all(&mut self, id: ConversationId) {
        let Some(t) = self.tables.get(&id) else {
            return;
        };
        let (computed, n) = (t.computed(), t.len());
        self.replace_tail(id, 0, computed, vec![None; n]);
    }
}
