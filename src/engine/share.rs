//! The engine's side of prefix sharing (the scheduler's is `scheduler/share.rs`, the cache's
//! `kv/cache/share.rs`): whether KV is shared, and when the index learns a conversation's
//! chunks.

use super::Engine;
use crate::ids::ConversationId;
use crate::scheduler::RowPlan;

impl Engine {
    /// Whether KV is shared by content.
    pub(super) fn sharing(&self) -> bool {
        self.config.shares_kv()
    }

    /// After a turn that ran: its full chunks enter the prefix index (when sharing), and are
    /// saved (behind) to the store at the end of the step (when there is one).
    pub(super) fn index_finished(&mut self, id: ConversationId) {
        if let (true, Some(conv)) = (self.sharing(), self.convs.get(&id)) {
            self.cache.index_chunks(id, conv.tokens());
        }
        self.persist.save_after_step(id);
    }

    /// Rows that prefilled this step put their conversations' new full chunks in the prefix
    /// index at once: a turn submitted while they still run can share them.
    pub(super) fn index_prefilled(&mut self, rows: &[RowPlan]) {
        if !self.sharing() {
            return;
        }
        for r in rows.iter().filter(|r| r.tokens.len() > r.decoded) {
            if let Some(conv) = self.convs.get(&r.conv) {
                self.cache.index_chunks(r.conv, conv.tokens());
            }
        }
    }
}
