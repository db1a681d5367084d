//! Per-conversation state: the raw-token history (the source of truth, never lost), how far
//! its KV has been computed, and the chunk table saying where each chunk's KV lives.
//!
//! Invariants: `kv_len <= tokens.len()`; the chunk table covers at least the first `kv_len`
//! tokens (`chunks.len() * chunk_size >= kv_len`); chunks past `kv_len` hold only blocks
//! reserved for tokens about to be computed.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::kv::ChunkLoc;
use crate::model::Message;

/// Handle of an open conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConversationId(pub u64);

impl std::fmt::Display for ConversationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "conversation {}", self.0)
    }
}

/// One conversation's state.
#[derive(Debug)]
pub(crate) struct Conversation {
    /// Every token the model has been given or has generated, in order.
    pub tokens: Vec<u32>,
    /// Tokens `[0, kv_len)` have had their KV computed (it may since have been dropped).
    pub kv_len: usize,
    /// Where each chunk of KV lives.
    pub chunks: Vec<ChunkLoc>,
    /// When the conversation last ran; eviction's idle time counts from here.
    pub last_active: Instant,
    /// The chat so far, for the template.
    pub messages: Vec<Message>,
    /// The text the model has seen, for the template's continuation of the next turn.
    pub seen_text: String,
    /// Whether a turn is queued or running.
    pub busy: bool,
}

impl Conversation {
    pub fn new(now: Instant, messages: Vec<Message>) -> Self {
        Self {
            tokens: Vec::new(),
            kv_len: 0,
            chunks: Vec::new(),
            last_active: now,
            messages,
            seen_text: String::new(),
            busy: false,
        }
    }

    /// Number of leading chunks that hold computed tokens.
    pub fn computed_chunks(&self, chunk: usize) -> usize {
        self.kv_len.div_ceil(chunk)
    }

    /// Tokens of chunk `i` that hold computed KV.
    pub fn chunk_len(&self, i: usize, chunk: usize) -> usize {
        self.kv_len.saturating_sub(i * chunk).min(chunk)
    }
}

/// The table of open conversations, ordered by id so that iteration is deterministic.
pub(crate) type Conversations = BTreeMap<ConversationId, Conversation>;
