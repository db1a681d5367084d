//! Context overflow that keeps the cache (AttentionStore §3.5): when a turn would pass the
//! window, `turn::prepare` picks the oldest whole turns after the system prompt to drop
//! ([`super::OverflowPolicy::DropOldest`]); here the conversation's KV past the cut is read
//! from whatever tier holds it, moved back to its new positions with its keys re-rotated
//! (`KvPool::shift_chunks`), and placed back, so the next turn recomputes only what had been
//! evicted, not the whole shortened history.

use std::ops::Range;
use std::sync::Arc;

use super::Engine;
use crate::attention::KeyRotation;
use crate::conversation::{Cut, Settlement, Shifted};
use crate::ids::ConversationId;
use crate::kv::{ChunkBytes, Held};
use crate::model::RopeVariant;

impl Engine {
    /// Drops the history of `cut` from conversation `id` (idle: no turn of it is queued),
    /// keeping the KV of what follows.
    pub(super) fn apply_cut(&mut self, id: ConversationId, cut: &Cut) {
        self.stats.tokens_shifted += self.cut_history(id, cut) as u64;
        self.stats.context_cuts += 1;
        self.stats.tokens_cut += cut.tokens().len() as u64;
        self.write_manifest(id);
    }

    /// Drops the history of `cut` from conversation `id` with its KV, the KV of what follows
    /// moved back to its new positions and placed where it was. Returns how many tokens' KV
    /// it placed.
    pub(super) fn cut_history(&mut self, id: ConversationId, cut: &Cut) -> usize {
        let range = cut.tokens();
        // A cut of a history not yet fed to the model drops messages and no KV.
        let (shifted, tokens) = match range.is_empty() {
            true => (None, 0),
            false => {
                let (shifted, tokens) = self.shift_past_cut(id, range);
                (Some(shifted), tokens)
            }
        };
        let settlement = Settlement::Cut { cut, shifted };
        for (i, block, bytes) in self.convs.settle(id, settlement, &mut self.cache) {
            let start = self.cache.first_slot(block);
            let written = bytes
                .bytes()
                .ok()
                .is_some_and(|b| self.pool.write_slots(start, b).is_ok());
            if !written {
                self.cache.lose_chunk(id, i);
            }
        }
        tokens
    }

    /// The KV of conversation `id` past the dropped `range`, moved back to its new positions;
    /// the chunk `range` begins in is rewritten with the KV before it (never truncated in
    /// place: it may be shared by content). With it, how many tokens' KV it holds.
    fn shift_past_cut(&mut self, id: ConversationId, range: Range<usize>) -> (Shifted, usize) {
        let chunk = self.config.chunk_size;
        let first = range.start / chunk;
        let computed = self.cache.table(id).map_or(0, |t| t.computed());
        let kept = if computed >= range.end {
            computed - range.len()
        } else {
            computed.min(range.start)
        };
        let old: Vec<Option<Arc<ChunkBytes>>> = self
            .cache
            .held(id, first)
            .into_iter()
            .map(|h| match h {
                Held::Device { start, len } => self
                    .pool
                    .read_slots(start, len)
                    .ok()
                    .map(|b| Arc::new(ChunkBytes::from(b))),
                Held::Bytes(b) => Some(b),
                Held::Stored { address, len } => self.cache.read_saved(&address, len),
                Held::Gone => None,
            })
            .collect();
        let views: Vec<Option<&[u8]>> = old
            .iter()
            .map(|b| b.as_ref().and_then(|b| b.bytes().ok()))
            .collect();
        let c = self.model.config();
        let interleaved = c.rope.variant == RopeVariant::Interleaved;
        let delta = -(range.len() as i64);
        let rotations: Vec<KeyRotation> = (0..c.num_layers)
            .map(|l| KeyRotation::new(&c.rope_inv_freq(l), interleaved, delta))
            .collect();
        let new_chunks = kept.div_ceil(chunk).saturating_sub(first);
        let new = self
            .pool
            .shift_chunks(first, chunk, &views, range.clone(), kept, &rotations)
            .unwrap_or_else(|_| vec![None; new_chunks]);
        drop(views);
        let shifted: usize = new
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_some())
            .map(|(j, _)| (kept - (first + j) * chunk).min(chunk))
            .sum();
        let chunks = new
            .into_iter()
            .map(|c| c.map(|b| Arc::new(ChunkBytes::from(b))))
            .collect();
        let moved = Shifted {
            first,
            computed: kept,
            chunks,
        };
        (moved, shifted)
    }
}
