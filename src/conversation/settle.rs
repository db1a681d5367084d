//! The one writer of a conversation's length. Every change to a conversation's tokens is a
//! [`Settlement`], applied here together with the change it makes to the conversation's chunk
//! table, so the history and its KV never disagree whoever asks: the scheduler's commit (a
//! row ran, a turn stopped before the step's last token, a turn ended), the engine at a
//! turn's end (a reply trimmed, a turn rolled back) and between turns (an overflow cut, a
//! rewind). The token mutators of [`Conversation`] are private to this module's parent.
//!
//! What a chunk table does without changing the length (a requeue settling its
//! recomputations, swaps, evictions) stays the cache manager's.

use std::sync::Arc;

use super::{Conversations, Cut};
use crate::ids::ConversationId;
use crate::kv::{BlockId, CacheManager, ChunkBytes};

/// A change to a conversation's length, with what it means for its KV.
#[derive(Debug)]
pub(crate) enum Settlement<'a> {
    /// A step ran a row: `tokens` join the history (the pending ones it ran past, then the
    /// drafts the sampler agreed with) and the KV is computed up to `computed`; with
    /// `refused` drafts, the blocks past `computed` go back to the pool.
    Ran {
        tokens: Vec<u32>,
        computed: usize,
        refused: bool,
    },
    /// Back to `len` tokens, with the KV past them: tokens sampled after the one a turn
    /// stopped on, or a turn that did not complete.
    Truncate(usize),
    /// A turn's end: its `pending` tokens join the history; recomputations that did not reach
    /// `progress` are dropped, and blocks reserved past the computed tokens released.
    End { pending: Vec<u32>, progress: usize },
    /// A reply cut short of what was generated: the history keeps `keep` tokens, then `tail`
    /// (the text's own tokens, whose KV the next turn computes).
    Trim { keep: usize, tail: Vec<u32> },
    /// A span dropped from the history (overflow, rewind), with the KV after it moved back
    /// (`None` when the cut dropped no KV).
    Cut {
        cut: &'a Cut,
        shifted: Option<Shifted>,
    },
}

/// The KV of a conversation past a cut, moved back to its new positions: chunks from `first`
/// on are replaced by `chunks`, `computed` tokens then having KV.
#[derive(Debug)]
pub(crate) struct Shifted {
    pub first: usize,
    pub computed: usize,
    pub chunks: Vec<Option<Arc<ChunkBytes>>>,
}

/// A shifted chunk placed in a device block, for the caller to write: its index, the block
/// and the bytes.
pub(crate) type Placed = (usize, BlockId, Arc<ChunkBytes>);

impl Conversations {
    /// Applies `s` to conversation `id` and its chunk table. Returns the shifted chunks a
    /// [`Settlement::Cut`] placed on the device (empty for every other settlement). A
    /// conversation no longer open has only its chunk table settled (a row that ran for it
    /// changes nothing).
    pub fn settle(
        &mut self,
        id: ConversationId,
        s: Settlement,
        cache: &mut CacheManager,
    ) -> Vec<Placed> {
        let conv = self.get_mut(&id);
        match s {
            Settlement::Ran {
                tokens,
                computed,
                refused,
            } => {
                let Some(conv) = conv else {
                    return Vec::new();
                };
                conv.extend_tokens(tokens);
                cache.mark_computed(id, computed);
                if refused {
                    cache.truncate(id, computed);
                }
            }
            Settlement::Truncate(len) => {
                if let Some(conv) = conv {
                    conv.truncate_tokens(len);
                }
                cache.truncate(id, len);
            }
            Settlement::End { pending, progress } => {
                if let Some(conv) = conv {
                    conv.extend_tokens(pending);
                }
                cache.settle(id, progress);
            }
            Settlement::Trim { keep, tail } => {
                if let Some(conv) = conv {
                    conv.truncate_tokens(keep);
                    conv.extend_tokens(tail);
                }
                cache.truncate(id, keep);
            }
            Settlement::Cut { cut, shifted } => {
                let placed = shifted.map_or_else(Vec::new, |s| {
                    cache.replace_tail(id, s.first, s.computed, s.chunks)
                });
                if let Some(conv) = conv {
                    conv.apply_cut(cut);
                }
                return placed;
            }
        }
        Vec::new()
    }
}
