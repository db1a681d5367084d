//! The cache manager's side of a history cut (context overflow): the KV of a conversation's
//! chunks past the cut is handed out to be re-laid at the new positions (by the pool, which
//! knows the bytes), and the re-laid chunks are placed back. Their files are released: a file
//! is addressed by the tokens up to its chunk, which the cut changes.

use std::sync::Arc;

use super::CacheManager;
use crate::ids::ConversationId;
use crate::kv::{Address, BlockId, ChunkBytes, ChunkLoc};

/// Where a chunk's KV (every layer's) can be read.
#[derive(Clone, Debug)]
pub(crate) enum Held {
    /// In the device slots from `start`, `len` tokens.
    Device { start: usize, len: usize },
    /// In memory (the host tier).
    Bytes(Arc<ChunkBytes>),
    /// Only in the store.
    Stored { address: Address, len: usize },
    /// Nowhere: recomputed when needed.
    Gone,
}

impl CacheManager {
    /// Where the KV of the computed chunks of `id` from chunk `from` on can be read. Between
    /// turns, when nothing of `id` moves.
    pub fn held(&self, id: ConversationId, from: usize) -> Vec<Held> {
        let chunk = self.chunk_size();
        let Some(t) = self.tables.get(&id) else {
            return Vec::new();
        };
        (from..t.computed_chunks(chunk))
            .map(|i| {
                let len = t.chunk_len(i, chunk);
                // A narrow chunk moved back could be read through a window: it is recomputed.
                if t.record(i).is_some_and(|r| self.is_narrow(t, i, r)) {
                    return Held::Gone;
                }
                match (t.record(i).map(|r| self.arena.loc(r)), t.file(i)) {
                    (Some(ChunkLoc::Device(b)), _) => Held::Device {
                        start: self.first_slot(b),
                        len,
                    },
                    (Some(ChunkLoc::Host(h)), _) => {
                        self.host.get(h).map_or(Held::Gone, Held::Bytes)
                    }
                    (Some(ChunkLoc::Stored), Some(address)) => Held::Stored { address, len },
                    _ => Held::Gone,
                }
            })
            .collect()
    }

    /// Reads a saved chunk of `len` tokens whole on the store's reader thread: the bytes wait
    /// for the read, and fail if it is refused (counted at the next poll); `None` if the store
    /// has no usable file.
    pub fn read_saved(&mut self, address: &Address, len: usize) -> Option<Arc<ChunkBytes>> {
        self.store.as_mut()?.store.read_behind(address, len)
    }

    /// Replaces the chunks of `id` from `from` on with `new`, `computed` tokens of the table
    /// then having KV (the new chunks cover them). The old chunks are released (blocks, host
    /// bytes, files). Each new chunk with bytes goes to a free device block (returned with its
    /// index, for the caller to write), else to free host room, else is dropped; a `None` is dropped.
    pub fn replace_tail(
        &mut self,
        id: ConversationId,
        from: usize,
        computed: usize,
        new: Vec<Option<Arc<ChunkBytes>>>,
    ) -> Vec<(usize, BlockId, Arc<ChunkBytes>)> {
        self.drop_records(id, from);
        let Some(table) = self.tables.get_mut(&id) else {
            return Vec::new();
        };
        table.set_computed(computed);
        let mut writes = Vec::new();
        for bytes in new {
            let loc = match bytes {
                Some(bytes) => match self.blocks.allocate() {
                    Some(block) => {
                        writes.push((table.len(), block, bytes));
                        ChunkLoc::Device(block)
                    }
                    None => match self.host.reserve(bytes.len()) {
                        Some(h) if self.host.store(h, bytes) => ChunkLoc::Host(h),
                        Some(h) => {
                            self.host.release(h);
                            ChunkLoc::Dropped
                        }
                        None => ChunkLoc::Dropped,
                    },
                },
                None => ChunkLoc::Dropped,
            };
            table.push(self.arena.insert(loc, id), None);
        }
        writes
    }

    /// Forgets the KV of `id` from token `len` on (a turn rolled back, a reply cut short).
    /// The chunk `len` falls inside goes too: it may be shared by content, so it is never
    /// written again; the next turn recomputes its tokens before `len` (less than a chunk).
    pub fn truncate(&mut self, id: ConversationId, len: usize) {
        let chunk = self.chunk_size();
        let Some(t) = self.tables.get(&id) else {
            return;
        };
        // KV that ends at or before `len` is all valid: only blocks past it go.
        let keep = match t.computed() <= len {
            true => t.computed().div_ceil(chunk),
            false => len / chunk,
        };
        let computed = t.computed().min(keep * chunk);
        if keep >= t.len() && computed == t.computed() {
            return;
        }
        self.replace_tail(id, keep, computed, Vec::new());
    }

    /// A chunk placed by [`Self::replace_tail`] whose bytes could not be written: dropped.
    pub fn lose_chunk(&mut self, id: ConversationId, i: usize) {
        let Some(rec) = self.tables.get(&id).and_then(|t| t.record(i)) else {
            return;
        };
        if let ChunkLoc::Device(b) = self.arena.loc(rec) {
            self.blocks.release(b);
            self.arena.set_loc(rec, ChunkLoc::Dropped);
        }
    }
}
