//! Forks: a new conversation that continues another one's history (or its first turns), for
//! regenerating a reply, editing an earlier turn, or branching an agent. The fork's KV is
//! found by content: the chunks the source holds in memory are shared in place, and with a
//! store tier the chunks it saved are shared too (one file, one more reference) and read back
//! on the fork's first turn; only the part of the last chunk past the fork point, and what
//! no tier holds any more, is recomputed.

use std::time::Instant;

use super::Engine;
use crate::ids::ConversationId;
use crate::Result;

impl Engine {
    /// Opens a new conversation with `conv`'s history: all of it, or its first `turns` turns
    /// (the system prompt included). The source is unchanged.
    ///
    /// # Errors
    /// [`crate::Error::UnknownConversation`]; [`crate::Error::ConversationBusy`] while a turn
    /// of `conv` is queued or running (its history is not settled).
    pub fn fork(&mut self, conv: ConversationId, turns: Option<usize>) -> Result<ConversationId> {
        let copy = self.idle(conv)?.prefix(turns.unwrap_or(usize::MAX));
        let id = self.next_id();
        self.convs.insert(id, copy);
        self.cache.open(id, Instant::now());
        Ok(id)
    }
}
