//! Bringing a conversation's KV back to the device for a turn: host chunks swapped in, stored
//! chunks read, dropped chunks given blocks to be recomputed into.

use std::ops::Range;

use super::{CacheManager, Moves, Source, SwapIn};
use crate::ids::ConversationId;
use crate::kv::ChunkLoc;

/// What restoring a conversation for a turn found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Restore {
    /// Dropped positions to recompute, in order, as maximal runs.
    pub recompute: Vec<Range<usize>>,
    /// Computed tokens already on the device (or reclaimed from a swap-out in flight).
    pub on_device: usize,
    /// Computed tokens being swapped in from the host.
    pub from_host: usize,
    /// Computed tokens being read from the store.
    pub from_store: usize,
}

impl CacheManager {
    /// Device blocks needed to bring `id` fully back: one per host or dropped chunk.
    pub fn blocks_to_restore(&self, id: ConversationId) -> usize {
        self.tables.get(&id).map_or(0, |t| {
            (t.records().iter())
                .filter(|&&r| {
                    let l = self.arena.loc(r);
                    matches!(l, ChunkLoc::Host(_) | ChunkLoc::Stored | ChunkLoc::Dropped)
                })
                .count()
        })
    }

    /// Plans the restore of `id` for a turn: host chunks swapped in, dropped chunks given a
    /// block to be recomputed into, and chunks still being swapped out this step reclaimed
    /// (their copy is cancelled: the block still holds the KV). `None`, with nothing planned,
    /// when the device lacks free blocks.
    pub fn restore(&mut self, id: ConversationId, moves: &mut Moves) -> Option<Restore> {
        if self.blocks_to_restore(id) > self.blocks.num_free() {
            return None;
        }
        let chunk = self.chunk_size();
        let mut out = Restore::default();
        let n = self.tables.get(&id)?.len();
        for i in 0..n {
            let t = self.tables.get(&id)?;
            let (rec, len, saved) = (t.record(i)?, t.chunk_len(i, chunk), t.file(i));
            // A shared chunk comes back for all of its holders (one copy, one block).
            match self.arena.loc(rec) {
                ChunkLoc::Device(_)
                | ChunkLoc::SwappingIn { .. }
                | ChunkLoc::Loading(_)
                | ChunkLoc::Recomputing(_) => {
                    out.on_device += len;
                }
                ChunkLoc::SwappingOut { block, host } => {
                    moves.swap_out.retain(|s| s.block != block);
                    self.host.release(host);
                    self.arena.set_loc(rec, ChunkLoc::Device(block));
                    out.on_device += len;
                }
                ChunkLoc::Host(host) => {
                    let block = self.blocks.allocate()?;
                    self.arena
                        .set_loc(rec, ChunkLoc::SwappingIn { host, block });
                    moves.swap_in.push(SwapIn {
                        conv: id,
                        chunk: i,
                        from: Source::Host(host),
                        block,
                        len,
                    });
                    out.from_host += len;
                }
                ChunkLoc::Stored => {
                    let Some(address) = saved else {
                        continue;
                    };
                    let block = self.blocks.allocate()?;
                    self.arena.set_loc(rec, ChunkLoc::Loading(block));
                    moves.swap_in.push(SwapIn {
                        conv: id,
                        chunk: i,
                        from: Source::Stored(address),
                        block,
                        len,
                    });
                    out.from_store += len;
                }
                ChunkLoc::Dropped => {
                    let block = self.blocks.allocate()?;
                    self.arena.set_loc(rec, ChunkLoc::Recomputing(block));
                    let run = i * chunk..i * chunk + len;
                    match out.recompute.last_mut() {
                        Some(r) if r.end == run.start => r.end = run.end,
                        _ => out.recompute.push(run),
                    }
                }
            }
        }
        Some(out)
    }
}
