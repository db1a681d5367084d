//! Eviction: which chunk leaves a tier, and where it goes (Pensieve §4.3.1). A victim is the
//! lowest-value candidate (see `candidates`): an unprotected conversation's first chunk of its
//! own in the tier, or a shared chunk no protected conversation holds, valued for all of its
//! holders; a device chunk moves to the host if it has room (on demand, after host chunks
//! are dropped to make it), to its file if it has one, else it is dropped.

use std::time::Instant;

use super::candidates::{Found, Tier, View};
use super::{CacheManager, Eviction, Moves, SwapOut};
use crate::ids::ConversationId;
use crate::kv::ChunkLoc;

impl CacheManager {
    /// The lowest-value candidate in `tier` that `protect` leaves, with its value.
    pub(super) fn lowest(
        &mut self,
        tier: Tier,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
    ) -> Option<Found> {
        let changed = self.arena.take_changed();
        let view = View {
            tables: &self.tables,
            arena: &self.arena,
            policy: &*self.policy,
            chunk: self.blocks.chunk_size(),
        };
        (self.candidates).lowest(&view, changed, tier, protect, now)
    }

    /// [`Self::lowest`]'s conversation and chunk index.
    pub(super) fn victim(
        &mut self,
        tier: Tier,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
    ) -> Option<(ConversationId, usize)> {
        self.lowest(tier, protect, now).map(|(_, id, i)| (id, i))
    }

    /// Evicts device chunks of unprotected conversations, lowest value first, until `free + pending` device
    /// blocks reach `target_free` (swap-outs free their blocks at commit; they count as
    /// pending), or until `how` allows no more.
    pub fn evict_device(
        &mut self,
        protect: &dyn Fn(ConversationId) -> bool,
        target_free: usize,
        how: Eviction,
        now: Instant,
        moves: &mut Moves,
    ) {
        // Pinned conversations whose KV found no host room stay; the next victim goes instead.
        let mut stuck = std::collections::HashSet::new();
        while self.blocks.num_free() + moves.swap_out.len() < target_free {
            let spare = |c: ConversationId| protect(c) || stuck.contains(&c);
            let Some((id, i)) = self.victim(Tier::Device, &spare, now) else {
                break;
            };
            if !self.evict_chunk(id, i, protect, how, now, moves) {
                // A chunk a pinned conversation holds (itself or shared with it) stays; the
                // other candidates are still tried.
                let pinned: Vec<_> = (self.sharers(id, i).into_iter())
                    .filter(|c| self.tables.get(c).is_some_and(|t| t.pinned()))
                    .collect();
                if pinned.is_empty() {
                    break;
                }
                stuck.extend(pinned);
            }
        }
    }

    /// Evicts every device chunk of `id`, leading first (suspension of a running turn). The
    /// caller settles the turn first, so every chunk left holds computed tokens.
    pub fn evict_conversation(
        &mut self,
        id: ConversationId,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
        moves: &mut Moves,
    ) {
        let n = self.tables.get(&id).map_or(0, |t| t.len());
        for i in 0..n {
            self.evict_chunk(id, i, protect, Eviction::OnDemand, now, moves);
        }
    }

    /// Moves chunk `i` of `id` off the device: to the host tier if it has room (on demand,
    /// dropping host chunks of conversations `protect` does not cover to make it), else
    /// dropped on demand. `false` if the chunk did not move.
    fn evict_chunk(
        &mut self,
        id: ConversationId,
        i: usize,
        protect: &dyn Fn(ConversationId) -> bool,
        how: Eviction,
        now: Instant,
        moves: &mut Moves,
    ) -> bool {
        let chunk = self.chunk_size();
        let Some((rec, block, len)) = self.tables.get(&id).and_then(|t| {
            let rec = t.record(i)?;
            match self.arena.loc(rec) {
                ChunkLoc::Device(b) => Some((rec, b, t.chunk_len(i, chunk))),
                _ => None,
            }
        }) else {
            return false;
        };
        let sharers = self.sharers(id, i);
        if sharers.iter().any(|&c| c != id && protect(c)) {
            return false;
        }
        let tables = || sharers.iter().filter_map(|c| self.tables.get(c));
        let pinned = tables().any(|t| t.pinned());
        let saved = tables().all(|t| t.file(i).is_some());
        let narrow = (self.tables.get(&id)).is_some_and(|t| self.leaves_narrow(t, i, rec));
        let bytes = self.chunk_bytes(len, narrow);
        let host = match (self.host.reserve(bytes), how) {
            (Some(h), _) => Some(h),
            // Its file holds it: leaving the device costs nothing now, a read later.
            (None, _) if saved && !pinned => {
                self.blocks.release(block);
                self.scatter(rec, i, |_| ChunkLoc::Stored);
                self.counters.chunks_to_store += 1;
                return true;
            }
            (None, Eviction::AheadOfTime) => return false,
            (None, Eviction::OnDemand) if bytes <= self.host.budget_bytes() => {
                let spare = |c: ConversationId| sharers.contains(&c) || protect(c);
                self.make_host_room(bytes, &spare, now);
                self.host.reserve(bytes)
            }
            (None, Eviction::OnDemand) => None,
        };
        match host {
            Some(host) => {
                self.arena
                    .set_loc(rec, ChunkLoc::SwappingOut { block, host });
                moves.swap_out.push(SwapOut {
                    conv: id,
                    chunk: i,
                    block,
                    host,
                    len,
                    narrow,
                });
            }
            // A pinned conversation's KV stays on the device when the host has no room.
            None if pinned => return false,
            None => {
                self.blocks.release(block);
                self.scatter(rec, i, |_| ChunkLoc::Dropped);
                self.counters.chunks_dropped_from_device += 1;
            }
        }
        true
    }

    /// Drops host chunks of unprotected conversations, lowest value first, until
    /// `bytes` fit in the host pool (or nothing more can be dropped).
    fn make_host_room(
        &mut self,
        bytes: usize,
        protect: &dyn Fn(ConversationId) -> bool,
        now: Instant,
    ) {
        let pinned = self.hints.pinned().clone();
        let spare = |c: ConversationId| protect(c) || pinned.contains(&c);
        while self.host.free_bytes() < bytes {
            let Some((id, i)) = self.victim(Tier::Host, &spare, now) else {
                return;
            };
            let Some(rec) = self.tables.get(&id).and_then(|t| t.record(i)) else {
                return;
            };
            let ChunkLoc::Host(h) = self.arena.loc(rec) else {
                return;
            };
            self.host.release(h);
            let sharers = self.sharers(id, i);
            let saved = (sharers.iter())
                .filter(|c| self.tables.get(c).is_some_and(|t| t.file(i).is_some()))
                .count();
            self.counters.chunks_to_store += saved as u64;
            self.counters.chunks_dropped_from_host += (sharers.len() - saved) as u64;
            self.scatter(rec, i, |t| match t.file(i) {
                Some(_) => ChunkLoc::Stored,
                None => ChunkLoc::Dropped,
            });
        }
    }
}
