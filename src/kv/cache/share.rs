//! Prefix sharing in memory: a full chunk is addressed by the tokens it covers and every token
//! before it ([`Address::chain`]), so two conversations whose histories start alike compute
//! chunks with equal addresses. The content index maps an address to the chunk records that
//! have it; a conversation whose next chunks are found there in memory becomes one more
//! holder of the record instead of computing them (the same KV, stored once).
//!
//! A shared chunk is always full, so nothing writes into it again: a conversation diverging
//! from the others writes its own next chunk (copy-on-write at chunk granularity), and a cut
//! of the history (context overflow) re-lays the tail into new blocks. A shared chunk moves
//! between tiers for all of its holders at once (one copy, one host chunk), is valued by
//! eviction as the sum of its holders' values, and stays where it is while any holder runs.
//! Chunks only in the store are shared through the store's own references instead.
//!
//! A record listed in the index but no longer in memory is passed over; a record leaves the
//! index when its last holder lets go of it.

use super::{CacheManager, ChunkTable};
use crate::ids::ConversationId;
use crate::kv::Address;

impl CacheManager {
    /// The conversations sharing chunk `i` of `id` (`id` alone when it is not shared).
    pub(super) fn sharers(&self, id: ConversationId, i: usize) -> Vec<ConversationId> {
        match self.tables.get(&id).and_then(|t| t.record(i)) {
            Some(rec) => self.arena.holders(rec).to_vec(),
            None => Vec::new(),
        }
    }

    /// The content addresses of chunks `from..` of `id`'s tokens (`history`, then `more` not
    /// yet in its history, as one sequence; the last chunk possibly partial). Hashed from the
    /// last full chunk before `from` whose address the table knows (listed in the content
    /// index, or naming its file), not from the first token: a turn's end or a waiting turn's
    /// lookup hashes what is new, not the whole history again.
    pub fn addresses_from(
        &self,
        id: ConversationId,
        history: &[u32],
        more: &[u32],
        from: usize,
    ) -> Vec<Address> {
        let chunk = self.chunk_size();
        let known = |i: usize| {
            let t = self.tables.get(&id)?;
            if (i + 1) * chunk > t.computed().min(history.len() + more.len()) {
                return None;
            }
            let rec = t.record(i)?;
            (self.arena.get(rec).addr).or_else(|| t.file(i))
        };
        let (start, prev) = (0..from)
            .rev()
            .find_map(|i| known(i).map(|a| (i + 1, a)))
            .unwrap_or((0, Address::default()));
        let tokens: Vec<u32> = (history.iter().chain(more))
            .skip(start * chunk)
            .copied()
            .collect();
        let mut addresses = Address::chained(prev, &tokens, chunk);
        addresses.drain(..(from - start).min(addresses.len()));
        addresses
    }

    /// Lists `id`'s full computed chunks (`tokens`: its history) in the content index by
    /// their addresses, so later conversations starting with the same tokens can share them.
    pub fn index_chunks(&mut self, id: ConversationId, tokens: &[u32]) {
        let chunk = self.chunk_size();
        let Some(t) = self.tables.get(&id) else {
            return;
        };
        let full = (t.computed().min(tokens.len()) / chunk).min(t.len());
        // Chunks already listed under their address are passed over unhashed: a record's
        // contents never change while it is listed.
        let listed = (t.records().iter())
            .take(full)
            .take_while(|&&r| self.arena.get(r).addr.is_some())
            .count();
        let recs: Vec<_> = t.records()[listed..full].to_vec();
        let addrs = self.addresses_from(id, &tokens[..full * chunk], &[], listed);
        for (rec, a) in recs.into_iter().zip(&addrs) {
            self.arena.set_addr(rec, Some(*a));
        }
    }

    /// Extends `id`'s table with chunks other conversations hold in memory under `addresses`
    /// (its next full chunks' content addresses, in order), as far as they are found: one more
    /// holder each, no copy. Only for a table whose computed tokens end at a chunk boundary
    /// with no chunk past them, every chunk of it listed. Returns the chunks adopted.
    pub fn adopt_resident(&mut self, id: ConversationId, addresses: &[Address]) -> usize {
        let chunk = self.chunk_size();
        let Some(start) = self
            .tables
            .get(&id)
            .filter(|t| t.computed() == t.len() * chunk)
            .filter(|t| {
                t.records()
                    .iter()
                    .all(|&r| self.arena.get(r).addr.is_some())
            })
            .map(ChunkTable::len)
        else {
            return 0;
        };
        let mut n = 0;
        for (k, a) in addresses.iter().enumerate() {
            let i = start + k;
            let Some(rec) = self.arena.resident(a) else {
                break;
            };
            // The holders' files of the chunk: the first one's is referenced for `id` too.
            let file = (self.arena.holders(rec).first())
                .and_then(|h| self.tables.get(h)?.file(i))
                .filter(|f| self.store.as_mut().is_some_and(|d| d.store.retain(f)));
            let Some(t) = self.tables.get_mut(&id) else {
                break;
            };
            self.arena.add_holder(rec, id);
            t.push(rec, file);
            t.set_computed(t.computed() + chunk);
            n += 1;
        }
        n
    }

    /// Bytes that sharing saves now: every chunk held once for several conversations counts
    /// once per holder past the first (a shared chunk is always full).
    pub fn shared_bytes_saved(&self) -> usize {
        self.arena.extra_holders() * self.bytes_of(self.chunk_size())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::super::{Eviction, Moves};
    use super::*;
    use crate::kv::{ChunkLoc, LruPolicy};

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
    fn addresses_hashed_from_a_known_chunk_equal_those_hashed_from_the_start() {
        let mut m = CacheManager::new(8, CHUNK, 1 << 20, Box::new(LruPolicy), 2);
        let a = ConversationId(1);
        m.open(a, Instant::now());
        assert!(m.grow(a) && m.grow(a) && m.grow(a));
        let history: Vec<u32> = (0..12).collect();
        // Two chunks listed, the third computed but not: hashing starts past the second.
        m.mark_computed(a, 8);
        m.index_chunks(a, &history);
        m.mark_computed(a, 12);
        let more = [40, 41, 42, 43, 44];
        let all: Vec<u32> = history.iter().chain(&more).copied().collect();
        let want = Address::of_chunks(&all, CHUNK);
        for from in 0..=want.len() {
            assert_eq!(
                m.addresses_from(a, &history, &more, from),
                want[from..],
                "{from}"
            );
        }
        let unknown = ConversationId(9);
        assert_eq!(m.addresses_from(unknown, &history, &more, 1), want[1..]);
    }

    #[test]
    fn adopted_chunks_are_held_once_and_counted_as_saved() {
        let (m, a, b, _) = two_sharing();
        assert_eq!(m.num_free_blocks(), 6);
        assert_eq!(m.locs(a), m.locs(b));
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
        assert!(matches!(m.locs(b)[0], ChunkLoc::Host(_)));
        assert_eq!(m.locs(a), m.locs(b));

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
        assert!(matches!(m.locs(b)[1], ChunkLoc::Device(_)));
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
    fn a_chunk_a_pinned_holder_keeps_does_not_stop_eviction_of_the_others() {
        // No host tier: a chunk leaving the device is dropped, unless a pinned holder keeps it.
        let mut m = CacheManager::new(8, CHUNK, 0, Box::new(LruPolicy), 2);
        let (a, b, c) = (ConversationId(1), ConversationId(2), ConversationId(3));
        let now = Instant::now();
        for id in [a, b, c] {
            m.open(id, now);
        }
        assert!(m.grow(a) && m.grow(c));
        m.mark_computed(a, 4);
        m.mark_computed(c, 4);
        let tokens: Vec<u32> = (0..4).collect();
        m.index_chunks(a, &tokens);
        assert_eq!(m.adopt_resident(b, &Address::of_chunks(&tokens, CHUNK)), 1);
        assert!(m.pin(b, true));
        // The shared chunk goes first by value (two holders' idle times), and stays.
        let later = now + std::time::Duration::from_secs(1);
        let mut moves = Moves::default();
        m.evict_device(&|_| false, 8, Eviction::OnDemand, later, &mut moves);
        m.check().unwrap();
        assert!(matches!(m.locs(a)[0], ChunkLoc::Device(_)));
        assert_eq!(m.locs(c), vec![ChunkLoc::Dropped]);
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
        assert!(m.arena.index_is_empty());
    }
}
