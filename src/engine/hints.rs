//! Session hints: what the host application knows about a conversation's future that the
//! cache cannot guess. They feed the eviction value and the store's read-ahead.

use std::time::{Duration, Instant};

use super::Engine;
use crate::ids::ConversationId;
use crate::{Error, Result};

impl Engine {
    /// Pins `conv` (or unpins it): its KV is never evicted below host memory. It may still
    /// leave the device for the host tier, but is never dropped or left on disk only; when
    /// neither has room, other conversations' KV goes instead (and a pinned device chunk stays
    /// put). Pinned conversations together may hold at most half of the device pool and
    /// host tier (checked when a pin is asked for: one that grows past it stays pinned).
    ///
    /// # Errors
    /// [`Error::UnknownConversation`]; [`Error::PinLimit`] if pinning `conv` would take the
    /// pinned KV past its share (nothing changes).
    pub fn pin(&mut self, conv: ConversationId, pinned: bool) -> Result<()> {
        let tokens = self.known(conv)?.tokens().len();
        if pinned {
            let (held, limit) = self.cache.pin_room(conv);
            if held + tokens > limit {
                return Err(Error::PinLimit {
                    tokens: held + tokens,
                    limit,
                });
            }
        }
        self.cache.pin(conv, pinned);
        Ok(())
    }

    /// Declares that `conv`'s next turn is expected `after` from now (a tool call that
    /// returns in 30 s, a user typing). Eviction values its KV by that time rather than by how
    /// long it has been idle (so a conversation about to return keeps its KV over one that
    /// will not), and its chunks on disk are read ahead into host memory once the time is
    /// within [`super::EngineConfig::prefetch_lead`]. A later hint replaces it; once its turn
    /// has run, the conversation is valued by its idle time again.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`]; [`Error::InvalidParams`] if `after` is beyond what the
    /// clock can represent.
    pub fn expect_resume(&mut self, conv: ConversationId, after: Duration) -> Result<()> {
        self.known(conv)?;
        let at = Instant::now()
            .checked_add(after)
            .ok_or_else(|| Error::InvalidParams {
                param: "after",
                reason: format!("a resume {after:?} from now is out of range"),
            })?;
        self.cache.expect_resume(conv, at);
        // Already within the lead: read ahead now, not at the next step that may be long away.
        if after <= self.config.prefetch_lead {
            self.cache.prefetch(conv);
        }
        Ok(())
    }

    /// When the engine next has work of its own, in the manner of quinn-proto's
    /// `poll_timeout`: now while a step can make progress (a turn runs or can be admitted,
    /// events or commands wait); else the moment a conversation's expected resume comes
    /// within [`super::EngineConfig::prefetch_lead`] (its KV is then read ahead); `None` when
    /// nothing is timed. Turns waiting for a lookup in a shared store are not work until it
    /// answers: the store's waker ([`Engine::set_store_waker`]) reports that. A host loop
    /// sleeps until this instant, a wake or a new submission, whichever is first, then calls
    /// [`Engine::step`]; it never needs to poll.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let now = Instant::now();
        if self.sched.has_ready() || !self.backlog.is_empty() || self.shared.has_commands() {
            return Some(now);
        }
        self.cache.next_resume_lead(now, self.config.prefetch_lead)
    }

    /// Frees `conv`'s KV in every tier now (the conversation is finished for a while, or for
    /// good, but its history is kept): its next turn, if any, recomputes the history. A named
    /// conversation keeps its manifest (tokens and transcript) but no chunk files.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`]; [`Error::ConversationBusy`] while a turn of it is queued
    /// or running.
    pub fn release(&mut self, conv: ConversationId) -> Result<()> {
        self.idle(conv)?;
        self.cache.release_all(conv);
        self.write_manifest(conv);
        Ok(())
    }

    fn known(&self, conv: ConversationId) -> Result<&crate::conversation::Conversation> {
        self.convs
            .get(&conv)
            .ok_or(Error::UnknownConversation(conv))
    }

    /// `conv`, if it is open and no turn of it is queued or running.
    ///
    /// # Errors
    /// [`Error::UnknownConversation`], [`Error::ConversationBusy`].
    pub(super) fn idle(&self, conv: ConversationId) -> Result<&crate::conversation::Conversation> {
        let c = self
            .convs
            .get(&conv)
            .ok_or(Error::UnknownConversation(conv))?;
        if self.sched.turn_of(conv).is_some() {
            return Err(Error::ConversationBusy(conv));
        }
        Ok(c)
    }

    /// Reads ahead the disk-only KV of conversations expected back within the lead time.
    pub(super) fn prefetch_expected(&mut self, now: Instant) {
        for conv in self.cache.resuming_within(now, self.config.prefetch_lead) {
            self.cache.prefetch(conv);
        }
    }
}
