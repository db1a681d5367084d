//! Prefix sharing in memory: a full chunk is addressed by the tokens it covers and every token
//! before it ([`Address::chain`]), so two conversations whose histories start alike compute
//! chunks with equal addresses. The index maps an address to the conversations holding such
//! a chunk; a conversation whose next chunks are found there takes one more reference to the
//! holder's device block or host chunk instead of computing them (the same KV, stored once).
//!
//! A shared chunk is always full, so nothing writes into it again: a conversation diverging
//! from the others writes its own next chunk (copy-on-write at chunk granularity), and a cut
//! of the history (context overflow) re-lays the tail into new blocks. A shared chunk moves
//! between tiers for all of its holders at once (one copy, one host chunk), is valued by
//! eviction as the sum of its holders' values, and stays where it is while any holder runs.
//! Chunks only in the disk tier are shared through the store's own references instead.
//!
//! The index is checked when used: an entry whose holder no longer has that chunk in memory
//! is passed over, and entries leave with their conversation or its truncated chunks.

use super::{CacheManager, ChunkTable};
use crate::ids::ConversationId;
use crate::kv::{Address, ChunkLoc};

impl CacheManager {
    /// References to the block or host chunk `loc` names (1 for a chunk that names neither).
    fn refs_of(&self, loc: ChunkLoc) -> usize {
        match loc {
            ChunkLoc::Host(h) => self.host.refs(h),
            ChunkLoc::Disk | ChunkLoc::Dropped => 1,
            other => other.named_block().map_or(1, |b| self.blocks.refs(b)),
        }
    }

    /// The conversations whose chunk `i` is `loc` (those holding that block or host chunk).
    pub(super) fn holders(&self, i: usize, loc: ChunkLoc) -> Vec<ConversationId> {
        self.tables
            .iter()
            .filter(|(_, t)| t.chunks.get(i) == Some(&loc))
            .map(|(&id, _)| id)
            .collect()
    }

    /// The conversations sharing chunk `i` of `id` (`id` alone when it is not shared).
    pub(super) fn sharers(&self, id: ConversationId, i: usize) -> Vec<ConversationId> {
        match self.tables.get(&id).and_then(|t| t.chunks.get(i).copied()) {
            Some(loc) if self.refs_of(loc) > 1 => self.holders(i, loc),
            Some(_) => vec![id],
            None => Vec::new(),
        }
    }

    /// Places chunk `i` of each of `convs` at `to`.
    pub(super) fn set_chunk(&mut self, convs: &[ConversationId], i: usize, to: ChunkLoc) {
        for c in convs {
            if let Some(loc) = self.tables.get_mut(c).and_then(|t| t.chunks.get_mut(i)) {
                *loc = to;
            }
        }
    }

    /// Records the addresses of `id`'s full computed chunks (`tokens`: its history) in the
    /// index, so later conversations starting with the same tokens can share them.
    pub fn index_chunks(&mut self, id: ConversationId, tokens: &[u32]) {
        let chunk = self.chunk_size();
        let Some(t) = self.tables.get_mut(&id) else {
            return;
        };
        let full = (t.computed.min(tokens.len()) / chunk).min(t.chunks.len());
        let addrs = Address::of_chunks(&tokens[..full * chunk], chunk);
        let keep = t
            .addrs
            .iter()
            .zip(&addrs)
            .take_while(|(a, b)| a == b)
            .count();
        let stale: Vec<Address> = t.addrs.drain(keep..).collect();
        t.addrs.extend_from_slice(&addrs[keep..]);
        for a in &stale {
            self.unindex(id, a);
        }
        for a in &addrs[keep..] {
            let holders = self.index.entry(*a).or_default();
            if !holders.contains(&id) {
                holders.push(id);
            }
        }
    }

    /// Forgets `id`'s addresses from chunk `from` on (their chunks were released or rewritten).
    pub(super) fn forget_addresses(&mut self, id: ConversationId, from: usize) {
        let Some(t) = self.tables.get_mut(&id) else {
            return;
        };
        let stale: Vec<Address> = t.addrs.drain(from.min(t.addrs.len())..).collect();
        for a in &stale {
            self.unindex(id, a);
        }
    }

    fn unindex(&mut self, id: ConversationId, a: &Address) {
        if let Some(holders) = self.index.get_mut(a) {
            holders.retain(|&c| c != id);
            if holders.is_empty() {
                self.index.remove(a);
            }
        }
    }

    /// A chunk in memory addressed `a` at index `i` of some other table: its device block or
    /// host chunk, and the address of its file if it has one.
    fn resident(&self, i: usize, a: &Address) -> Option<(ChunkLoc, Option<Address>)> {
        self.index.get(a)?.iter().find_map(|h| {
            let t: &ChunkTable = self.tables.get(h)?;
            let loc = *t.chunks.get(i)?;
            (t.addrs.get(i) == Some(a) && matches!(loc, ChunkLoc::Device(_) | ChunkLoc::Host(_)))
                .then_some((loc, t.saved.get(i).copied().flatten()))
        })
    }

    /// Extends `id`'s table with chunks other conversations hold in memory under `addresses`
    /// (its next full chunks' content addresses, in order), as far as they are found: one more
    /// reference each, no copy. Only for a table whose computed tokens end at a chunk boundary
    /// with no chunk past them. Returns the chunks adopted.
    pub fn adopt_resident(&mut self, id: ConversationId, addresses: &[Address]) -> usize {
        let chunk = self.chunk_size();
        let Some(start) = self
            .tables
            .get(&id)
            .filter(|t| t.computed == t.chunks.len() * chunk && t.addrs.len() == t.chunks.len())
            .map(|t| t.chunks.len())
        else {
            return 0;
        };
        let mut n = 0;
        for (k, a) in addresses.iter().enumerate() {
            let i = start + k;
            let Some((loc, file)) = self.resident(i, a) else {
                break;
            };
            let shared = match loc {
                ChunkLoc::Device(b) => self.blocks.share(b),
                ChunkLoc::Host(h) => self.host.share(h),
                _ => false,
            };
            if !shared {
                break;
            }
            let file = file.filter(|f| self.disk.as_mut().is_some_and(|d| d.store.retain(f)));
            let Some(t) = self.tables.get_mut(&id) else {
                break;
            };
            t.chunks.push(loc);
            t.saved.push(file);
            t.addrs.push(*a);
            t.computed += chunk;
            self.index.entry(*a).or_default().push(id);
            n += 1;
        }
        n
    }

    /// Bytes that sharing saves now: every block and host chunk held once for several
    /// conversations counts once per holder past the first.
    pub fn shared_bytes_saved(&self) -> usize {
        let chunk = self.chunk_size();
        let mut seen = std::collections::HashSet::new();
        let mut saved = 0;
        for t in self.tables.values() {
            for (i, &loc) in t.chunks.iter().enumerate() {
                let refs = self.refs_of(loc);
                if refs > 1 && seen.insert(loc) {
                    saved += (refs - 1) * self.bytes_of(t.chunk_len(i, chunk));
                }
            }
        }
        saved
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::super::{Eviction, Moves};
    use super::*;
    use crate::kv::LruPolicy;

    const CHUNK: usize = 4;

    /// A manager of 8 blocks of 4 tokens (2 bytes a token); `a` computed 8 tokens (2 full
    /// chunks) and indexed them; `b` adopted both.
    fn two_sharing() -> (CacheManager, ConversationId, ConversationId, Vec<Address>) {
        let mut m = CacheManager::new(8, CHUNK, 1 << 20, Box::new(LruPolicy), 2);
        let (a, b) = (ConversationId(1), ConversationId(2));
        let now = Instant::now();
        m.open(a, now);
        m.open(b, now);
        assert!(m.grow(a) && m.grow(a));
        m.mark_computed(a, 8);
        let tokens: Vec<u32> = (0..8).collect();
        m.index_chunks(a, &tokens);
        let addrs = Address::of_chunks(&tokens, CHUNK);
        assert_eq!(m.adopt_resident(b, &addrs), 2);
        m.check().unwrap();
        (m, a, b, addrs)
    }

    #[test]
    fn adopted_chunks_are_held_once_and_counted_as_saved() {
        let (m, a, b, _) = two_sharing();
        assert_eq!(m.num_free_blocks(), 6);
        assert_eq!(m.table(a).unwrap().chunks(), m.table(b).unwrap().chunks());
        assert_eq!(m.table(b).unwrap().computed(), 8);
        assert_eq!(m.shared_bytes_saved(), 2 * CHUNK * 2);
    }

    #[test]
    fn a_shared_chunk_moves_once_for_all_its_holders_and_comes_back_for_all() {
        let (mut m, a, b, _) = two_sharing();
        let now = Instant::now();
        let mut moves = Moves::default();
        m.evict_device(&|_| false, 8, Eviction::OnDemand, now, &mut moves);
        // Two copies, not four: each shared block is copied once.
        assert_eq!(moves.swap_out.len(), 2);
        m.check().unwrap();
        for s in &moves.swap_out {
            m.complete_swap_out(s, std::sync::Arc::new(vec![0; 8].into()));
        }
        m.check().unwrap();
        assert_eq!(m.num_free_blocks(), 8);
        assert!(matches!(m.table(b).unwrap().chunks()[0], ChunkLoc::Host(_)));
        assert_eq!(m.table(a).unwrap().chunks(), m.table(b).unwrap().chunks());

        let mut moves = Moves::default();
        let r = m.restore(a, &mut moves).unwrap();
        assert_eq!((r.from_host, moves.swap_in.len()), (8, 2));
        m.check().unwrap();
        for s in &moves.swap_in {
            assert!(m.take_swap_in(s, false).is_some());
            m.complete_swap_in(s);
        }
        m.check().unwrap();
        assert_eq!(m.num_free_blocks(), 6);
        assert!(matches!(
            m.table(b).unwrap().chunks()[1],
            ChunkLoc::Device(_)
        ));
        assert_eq!(m.host_used_bytes(), 0);
    }

    #[test]
    fn a_chunk_shared_with_a_running_conversation_stays() {
        let (mut m, a, b, _) = two_sharing();
        let mut moves = Moves::default();
        // `a` runs: `b`'s chunks are its too, so nothing of `b` can leave.
        m.evict_device(
            &|c| c == a,
            8,
            Eviction::OnDemand,
            Instant::now(),
            &mut moves,
        );
        assert!(moves.is_empty());
        m.evict_conversation(b, &|c| c == a, Instant::now(), &mut moves);
        assert!(moves.is_empty());
        m.check().unwrap();
    }

    #[test]
    fn dropping_releases_every_reference_and_a_closed_holder_leaves_the_index() {
        let (mut m, a, b, addrs) = two_sharing();
        let c = ConversationId(3);
        m.close(a);
        m.check().unwrap();
        assert_eq!((m.num_free_blocks(), m.shared_bytes_saved()), (6, 0));
        // `b` holds them now, and is found by content in its turn.
        m.index_chunks(b, &(0..8).collect::<Vec<u32>>());
        m.open(c, Instant::now());
        assert_eq!(m.adopt_resident(c, &addrs[..1]), 1);
        m.release_all(b);
        m.release_all(c);
        m.check().unwrap();
        assert_eq!(m.num_free_blocks(), 8);
        assert!(m.index.is_empty());
    }
}
