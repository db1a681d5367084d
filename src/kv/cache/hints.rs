//! Session hints (what the host application knows that the cache cannot guess): a pinned
//! conversation is never evicted below the host tier, and a conversation whose next turn is
//! expected at a known time is valued by that time instead of its idle time, and read ahead
//! from disk when the time comes near.

use std::collections::BTreeSet;
use std::ops::Bound::{Excluded, Unbounded};
use std::time::{Duration, Instant};

use super::CacheManager;
use crate::ids::ConversationId;

/// The hints' indexes across conversations (each table holds its own hints): the pinned
/// conversations, for the room pins take and the host tier's eviction, and the expected
/// resumes by time, for the read-ahead.
#[derive(Debug, Default)]
pub(super) struct HintIndex {
    pinned: BTreeSet<ConversationId>,
    resumes: BTreeSet<(Instant, ConversationId)>,
}

impl HintIndex {
    fn pin(&mut self, id: ConversationId, pinned: bool) {
        match pinned {
            true => self.pinned.insert(id),
            false => self.pinned.remove(&id),
        };
    }

    /// `id`'s expected resume moves from `old` to `at` (`None`: it has none any more).
    pub fn resume(&mut self, id: ConversationId, old: Option<Instant>, at: Option<Instant>) {
        if let Some(old) = old {
            self.resumes.remove(&(old, id));
        }
        if let Some(at) = at {
            self.resumes.insert((at, id));
        }
    }

    /// The pinned conversations.
    pub fn pinned(&self) -> &BTreeSet<ConversationId> {
        &self.pinned
    }
}

impl CacheManager {
    /// Pins or unpins `id`; `false` if it has no table.
    pub fn pin(&mut self, id: ConversationId, pinned: bool) -> bool {
        let Some(t) = self.tables.get_mut(&id) else {
            return false;
        };
        t.set_pinned(pinned);
        self.hints.pin(id, pinned);
        true
    }

    /// Records that `id`'s next turn is expected at `at`; `false` if it has no table.
    pub fn expect_resume(&mut self, id: ConversationId, at: Instant) -> bool {
        let Some(t) = self.tables.get_mut(&id) else {
            return false;
        };
        let old = t.expect_resume(Some(at));
        self.hints.resume(id, old, Some(at));
        self.candidates.mark(id);
        true
    }

    /// Tokens pinned conversations other than `except` hold KV for, and how many tokens
    /// pins may hold at most: half of the device pool and host tier together, so that
    /// pinned conversations can never starve the others.
    pub fn pin_room(&self, except: ConversationId) -> (usize, usize) {
        let held = (self.hints.pinned.iter())
            .filter(|&&id| id != except)
            .filter_map(|id| self.tables.get(id))
            .map(|t| t.computed())
            .sum();
        let device = self.num_blocks() * self.chunk_size();
        let host = self.host.budget_bytes() / self.token_bytes.max(1);
        (held, (device + host) / 2)
    }

    /// Conversations whose expected resume is at most `lead` away (and not yet passed by more
    /// than `lead`), for the read-ahead.
    pub fn resuming_within(&self, now: Instant, lead: Duration) -> Vec<ConversationId> {
        let from = now.checked_sub(lead).unwrap_or(now);
        (self.hints.resumes.range((from, ConversationId(0))..))
            .take_while(|&&(at, _)| at <= now + lead)
            .map(|&(_, id)| id)
            .collect()
    }

    /// The next moment, after `now`, when a conversation's expected resume comes within
    /// `lead` (its read-ahead is then due).
    pub fn next_resume_lead(&self, now: Instant, lead: Duration) -> Option<Instant> {
        let after = Excluded((now + lead, ConversationId(u64::MAX)));
        let (at, _) = self.hints.resumes.range((after, Unbounded)).next()?;
        Some(*at - lead)
    }
}
