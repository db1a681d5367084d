//! Bringing a conversation's KV back to the device for a turn: host chunks swapped in, stored
//! chunks read, dropped chunks given blocks to be recomputed into.

use std::ops::Range;

#[cfg(test)]
mod tests;

use super::arena::ChunkId;
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
    /// Device blocks needed to bring `id` fully back: one per host, stored or dropped chunk,
    /// and per narrow chunk shared on the device that it recomputes for itself.
    pub fn blocks_to_restore(&self, id: ConversationId) -> usize {
        let redo = self.narrow_to_redo(id);
        self.tables.get(&id).map_or(0, |t| {
            (t.records().iter().zip(redo))
                .filter(|&(&r, redo)| match self.arena.loc(r) {
                    ChunkLoc::Host(_) | ChunkLoc::Stored | ChunkLoc::Dropped => true,
                    _ => redo && self.arena.is_shared(r),
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
        let redo = self.narrow_to_redo(id);
        let t = self.tables.get_mut(&id)?;
        t.set_turn_start(t.computed());
        for (i, redo) in redo.into_iter().enumerate() {
            let t = self.tables.get(&id)?;
            let (rec, len, saved) = (t.record(i)?, t.chunk_len(i, chunk), t.file(i));
            if redo {
                self.redo(id, i, rec, moves)?;
                self.counters.narrow_recomputed += 1;
                let run = i * chunk..i * chunk + len;
                match out.recompute.last_mut() {
                    Some(r) if r.end == run.start => r.end = run.end,
                    _ => out.recompute.push(run),
                }
                continue;
            }
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
                        narrow: self.arena.narrow(rec),
                    });
                    out.from_host += len;
                }
                ChunkLoc::Stored => {
                    let Some(address) = saved else {
                        continue;
                    };
                    let block = self.blocks.allocate()?;
                    self.arena.set_loc(rec, ChunkLoc::Loading(block));
                    self.arena.set_narrow(rec, address.is_narrow());
                    moves.swap_in.push(SwapIn {
                        conv: id,
                        chunk: i,
                        from: Source::Stored(address),
                        block,
                        len,
                        narrow: address.is_narrow(),
                    });
                    out.from_store += len;
                }
                ChunkLoc::Dropped => {
                    let block = self.blocks.allocate()?;
                    self.arena.set_loc(rec, ChunkLoc::Recomputing(block));
                    self.arena.set_narrow(rec, false);
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

    /// Which held chunks of `id` its next turn recomputes although they are there: the narrow
    /// ones a sliding window reads from where computing starts (the turn's first position, or
    /// a chunk that is recomputed), found from the end back, since each one recomputed starts
    /// computing earlier.
    fn narrow_to_redo(&self, id: ConversationId) -> Vec<bool> {
        let Some(t) = self.tables.get(&id) else {
            return Vec::new();
        };
        let mut redo = vec![false; t.len()];
        let Some(window) = self.narrowing.map(|n| n.window) else {
            return redo;
        };
        let chunk = self.chunk_size();
        let mut start = t.computed();
        for (i, &rec) in t.records().iter().enumerate().rev() {
            let (first, len) = (i * chunk, t.chunk_len(i, chunk));
            if len == 0 {
                continue;
            }
            if matches!(self.arena.loc(rec), ChunkLoc::Dropped) {
                start = first;
            } else if first + len + window > start + 1 && self.is_narrow(t, i, rec) {
                redo[i] = true;
                start = first;
            }
        }
        redo
    }

    /// Gives narrow chunk `i` of `id` (record `rec`) a block to be recomputed into: its own
    /// block on the device, a new one for a host or stored chunk (whose bytes are let go); a
    /// chunk shared with others stays theirs, and `id` recomputes its own. `None` when no
    /// block is free.
    fn redo(
        &mut self,
        id: ConversationId,
        i: usize,
        rec: ChunkId,
        moves: &mut Moves,
    ) -> Option<()> {
        if self.arena.is_shared(rec) {
            let block = self.blocks.allocate()?;
            let own = self.arena.detach(rec, id, ChunkLoc::Recomputing(block));
            self.arena.set_narrow(own, false);
            if let Some(t) = self.tables.get_mut(&id) {
                t.set_record(i, own);
            }
            return Some(());
        }
        let block = match self.arena.loc(rec) {
            ChunkLoc::Device(b) => b,
            ChunkLoc::SwappingOut { block, host } => {
                moves.swap_out.retain(|s| s.block != block);
                self.host.release(host);
                block
            }
            ChunkLoc::Host(h) => {
                let block = self.blocks.allocate()?;
                self.host.release(h);
                block
            }
            ChunkLoc::Stored => {
                let block = self.blocks.allocate()?;
                self.drop_saved(id, i);
                block
            }
            // Not narrow: nothing to redo.
            _ => return Some(()),
        };
        self.arena.set_loc(rec, ChunkLoc::Recomputing(block));
        self.arena.set_narrow(rec, false);
        Some(())
    }
}
