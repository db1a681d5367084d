//! Forks: a new conversation that continues another one's history (or its first turns), for
//! regenerating a reply, editing an earlier turn, or branching an agent. The fork's KV is
//! found by content: with a store tier, the chunks the source saved are shared (one file, one
//! more reference) and read back on the fork's first turn; only the part of the last chunk
//! past the fork point is recomputed. Without a store tier the fork recomputes its history.

use std::time::Instant;

use super::Engine;
use crate::ids::ConversationId;
use crate::Result;

impl Engine {
    /// Opens a new conversation with `conv`'s history: all of it, or its first `turns` turns
    /// (the system prompt included). The source is unchanged.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`]; [`Error::ConversationBusy`] while a turn of `conv` is
    /// queued or running (its history is not settled).
    pub fn fork(&mut self, conv: ConversationId, turns: Option<usize>) -> Result<ConversationId> {
        let copy = self.idle(conv)?.prefix(turns.unwrap_or(usize::MAX));
        let id = self.next_id();
        self.convs.insert(id, copy);
        self.cache.open(id, Instant::now());
        Ok(id)
    }
}
