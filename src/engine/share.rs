//! The engine's side of prefix sharing (the cache's is `kv/cache/share.rs`): which tokens a
//! turn looks up by content, and when the index learns a conversation's chunks.

use super::{CacheMode, Engine};
use crate::conversation::Conversation;
use crate::ids::ConversationId;
use crate::kv::CacheManager;
use crate::scheduler::RowPlan;

/// Takes, for `conv`'s next full chunks (history not yet computed, then the front of
/// `prompt`), the KV other conversations computed for the same tokens: from memory (one more
/// reference to their block or host chunk), then from the store (one more file reference,
/// read when the turn runs). The tokens adopted leave `prompt` for the history. Only when the
/// table's KV ends at a chunk boundary. With `discover`, a shared store is asked behind for
/// the chunks not found (a request to it, so only once per turn): returns the tokens adopted,
/// and the lookup's number if one was asked.
fn adopt(
    cache: &mut CacheManager,
    conv_id: ConversationId,
    conv: &mut Conversation,
    prompt: &mut Vec<u32>,
    discover: bool,
) -> (usize, Option<u64>) {
    let chunk = cache.chunk_size();
    let Some(table) = cache.table(conv_id) else {
        return (0, None);
    };
    let (history, computed) = (conv.tokens().len(), table.computed());
    if !computed.is_multiple_of(chunk) || table.len() != computed / chunk || prompt.is_empty() {
        return (0, None);
    }
    // The last prompt token always runs: its logits start the reply.
    let full = (history + prompt.len() - 1) / chunk;
    if full <= computed / chunk {
        return (0, None);
    }
    let more = &prompt[..(full * chunk).saturating_sub(history)];
    let history_part = &conv.tokens()[..history.min(full * chunk)];
    let addresses = cache.addresses_from(conv_id, history_part, more, computed / chunk);
    let next = &addresses[..full - computed / chunk];
    let in_memory = cache.adopt_resident(conv_id, next);
    let adopted = in_memory + cache.adopt_stored(conv_id, &next[in_memory..]);
    let lookup = (discover && adopted < next.len())
        .then(|| cache.look_up(&next[adopted..]))
        .flatten();
    let reach = computed + adopted * chunk;
    conv.extend_tokens(prompt.drain(..reach.saturating_sub(history)));
    (adopted * chunk, lookup)
}

impl Engine {
    /// Whether KV is shared by content.
    pub(super) fn sharing(&self) -> bool {
        self.config.prefix_sharing && self.config.mode != CacheMode::Stateless
    }

    /// Looks a submitted turn up by content (see `adopt`); returns the number of a lookup in
    /// a shared store the turn must wait for.
    pub(super) fn adopt_shared(
        &mut self,
        conv_id: ConversationId,
        prompt: &mut Vec<u32>,
    ) -> Option<u64> {
        let (true, Some(conv)) = (self.sharing(), self.convs.get_mut(&conv_id)) else {
            return None;
        };
        let (adopted, lookup) = adopt(&mut self.cache, conv_id, conv, prompt, true);
        self.stats.shared_tokens += adopted as u64;
        lookup
    }

    /// Lets in the turns whose lookup in the shared store was answered, each taking what the
    /// store was found to hold.
    pub(super) fn adopt_looked(&mut self) {
        let cache = &mut self.cache;
        for (conv_id, prompt) in self.sched.release_looked(|l| cache.looked(l)) {
            if let Some(conv) = self.convs.get_mut(&conv_id) {
                let (adopted, _) = adopt(cache, conv_id, conv, prompt, false);
                self.stats.shared_tokens += adopted as u64;
            }
        }
    }

    /// Looks the turns at the head of the queue up again before they are admitted: a turn
    /// submitted together with others of the same prefix finds what the first of them
    /// computed in the meantime.
    pub(super) fn adopt_waiting(&mut self) {
        if !self.sharing() {
            return;
        }
        for (conv_id, prompt) in self.sched.waiting_prompts(self.config.prefetch_window) {
            if let Some(conv) = self.convs.get_mut(&conv_id) {
                let (adopted, _) = adopt(&mut self.cache, conv_id, conv, prompt, false);
                self.stats.shared_tokens += adopted as u64;
            }
        }
    }

    /// After a turn that ran: its full chunks enter the prefix index (when sharing), and are
    /// saved (behind) to the store at the end of the step (when there is one).
    pub(super) fn index_finished(&mut self, id: ConversationId) {
        if let (true, Some(conv)) = (self.sharing(), self.convs.get(&id)) {
            self.cache.index_chunks(id, conv.tokens());
        }
        if self.cache.store().is_some() {
            self.journal.save_after_step(id);
        }
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
