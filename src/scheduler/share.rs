//! Prefix sharing at admission, the scheduler's side (the cache's is `kv/cache/share.rs`): a
//! turn never admitted takes, for its conversation's next full chunks, the KV other
//! conversations computed for the same tokens. It looks when it is queued (and asks a shared
//! store behind for what memory lacks, held until the store answers), when that answer comes,
//! and while it waits near the head of the queue (a turn queued with others of the same prefix
//! finds what the first of them computed meanwhile), as vLLM looks up computed blocks inside
//! its `schedule()`.
//!
//! What a turn takes is booked in its conversation's chunk table only: the tokens stay
//! pending, and `commit` moves them into the history as the turn's rows run past them, as for
//! any computed token. So the pending prompt changes only here and in `commit`, the history
//! only in `commit` and `finish`.

use super::Scheduler;
use crate::conversation::Conversations;
use crate::ids::{ConversationId, RequestId};
use crate::kv::CacheManager;

/// Takes for `conv_id` (its history `history`, then the tokens `pending`), for its next full
/// chunks, the KV other conversations computed for the same tokens: from memory (one more
/// reference to their block or host chunk), then from the store (one more file reference, read
/// when the turn runs). Only when the table's KV ends at a chunk boundary. With `discover`, a
/// shared store is asked behind for the chunks not found (a request to it, so only once per
/// turn). Returns the tokens taken, and the lookup's number if one was asked.
fn adopt(
    cache: &mut CacheManager,
    conv_id: ConversationId,
    history: &[u32],
    pending: &[u32],
    discover: bool,
) -> (usize, Option<u64>) {
    let chunk = cache.chunk_size();
    let Some(table) = cache.table(conv_id) else {
        return (0, None);
    };
    let computed = table.computed();
    if !computed.is_multiple_of(chunk) || table.len() != computed / chunk || pending.is_empty() {
        return (0, None);
    }
    // The last pending token always runs: its logits start the reply.
    let full = (history.len() + pending.len() - 1) / chunk;
    if full <= computed / chunk {
        return (0, None);
    }
    let upto = full * chunk;
    let (head, more) = match upto.checked_sub(history.len()) {
        Some(rest) => (history, &pending[..rest]),
        None => (&history[..upto], &[][..]),
    };
    let next = cache.addresses_from(conv_id, head, more, computed / chunk);
    let in_memory = cache.adopt_resident(conv_id, &next);
    let adopted = in_memory + cache.adopt_stored(conv_id, &next[in_memory..]);
    let lookup = (discover && adopted < next.len())
        .then(|| cache.look_up(&next[adopted..]))
        .flatten();
    (adopted * chunk, lookup)
}

impl<T> Scheduler<T> {
    /// Looks turn `id`, just queued, up by content; a shared store is asked about the chunks
    /// memory lacks, and the turn held out of admission until it answers. Returns the tokens
    /// taken.
    pub fn share(
        &mut self,
        id: RequestId,
        convs: &Conversations,
        cache: &mut CacheManager,
    ) -> usize {
        let Some(req) = self.requests.get_mut(&id).filter(|r| !r.admitted) else {
            return 0;
        };
        let history = convs.get(&req.conv).map_or(&[][..], |c| c.tokens());
        let (taken, lookup) = adopt(cache, req.conv, history, &req.pending, true);
        if lookup.is_some() {
            req.lookup = lookup;
        }
        taken
    }

    /// Before planning: the held turns whose lookup was answered are let in, each taking what
    /// the store was found to hold; then the first turns of the queue never admitted look
    /// again. Returns the tokens taken.
    pub(super) fn share_waiting(
        &mut self,
        convs: &Conversations,
        cache: &mut CacheManager,
    ) -> usize {
        let mut taken = 0;
        for req in self.requests.values_mut() {
            if req.lookup.is_some_and(|l| cache.looked(l)) {
                req.lookup = None;
                let history = convs.get(&req.conv).map_or(&[][..], |c| c.tokens());
                taken += adopt(cache, req.conv, history, &req.pending, false).0;
            }
        }
        if !self.limits.sharing {
            return taken;
        }
        for id in self.waiting.iter().take(self.limits.prefetch_window) {
            let Some(req) = self.requests.get(id).filter(|r| !r.admitted) else {
                continue;
            };
            let history = convs.get(&req.conv).map_or(&[][..], |c| c.tokens());
            taken += adopt(cache, req.conv, history, &req.pending, false).0;
        }
        taken
    }

    /// Whether a step could do anything: a turn runs, or one waits that no lookup holds.
    pub fn has_ready(&self) -> bool {
        !self.running.is_empty()
            || (self.waiting.iter())
                .any(|id| self.requests.get(id).is_some_and(|r| r.lookup.is_none()))
    }
}
