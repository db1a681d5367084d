//! Turns held out of admission while the store answers a lookup by content (see
//! `Store::look_up`): the engine holds a turn when it asks, and lets it in once the answer
//! is indexed.

use super::Scheduler;
use crate::ids::{ConversationId, RequestId};

impl<T> Scheduler<T> {
    /// Holds turn `id` out of admission until lookup `lookup` in the store is answered (the
    /// turns behind it wait too; the running ones go on).
    pub fn hold(&mut self, id: RequestId, lookup: u64) {
        if let Some(r) = self.requests.get_mut(&id) {
            r.lookup = Some(lookup);
        }
    }

    /// Lets in the held turns whose lookup `looked` says was answered; returns their
    /// conversations and prompts, to look up again now the answer is indexed.
    pub fn release_looked(
        &mut self,
        looked: impl Fn(u64) -> bool,
    ) -> Vec<(ConversationId, &mut Vec<u32>)> {
        (self.requests.values_mut())
            .filter(|r| r.lookup.is_some_and(&looked))
            .map(|r| {
                r.lookup = None;
                (r.conv, &mut r.pending)
            })
            .collect()
    }

    /// Whether a step could do anything: a turn runs, or one waits that no lookup holds.
    pub fn has_ready(&self) -> bool {
        !self.running.is_empty()
            || (self.waiting.iter())
                .any(|id| self.requests.get(id).is_some_and(|r| r.lookup.is_none()))
    }
}
