//! Answers held until the store has what they promise: a named conversation's turn end (or
//! edit) until its state is durable, a fleet's until its chunks are written, a close (or a turn
//! that ended its conversation) until the removal is.

use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use super::Driver;
use crate::engine::{ConversationId, Durability, FinishReason, Removing, Writing};
use crate::service::{Slot, TurnEnd, TurnEvent};
use crate::{Error, Result};

/// What an answer waits for.
pub(super) enum Wait {
    /// The named conversation's state, as written by this manifest write (`None`: its latest),
    /// to be durable in the store. The write's own outcome, not the conversation's latest: a
    /// later edit may have replaced the conversation while this write was queued.
    Durable(ConversationId, Option<Writing>),
    /// A manifest write to be done, stored or not (its own waiter judges it): an edit that
    /// must not decide on a state the store may still refuse.
    Settled(Writing),
    /// The store to have written what was queued before this mark (a fleet's shared chunks).
    Mark(u64),
    /// A stored conversation's removal to be written (a close, or a turn that ended it).
    Removed(Removing),
}

/// Who is answered once the wait is over.
pub(super) enum Answer {
    /// A turn's end, holding its place among the turns in flight until then.
    Turn {
        events: UnboundedSender<TurnEvent>,
        end: Box<TurnEnd>,
        _slot: Slot,
    },
    /// A close or an edit: the store has what it wrote, or why not.
    Done(oneshot::Sender<Result<()>>),
}

/// An answer held until the store has what it wrote.
pub(super) struct Held {
    pub(super) wait: Wait,
    pub(super) answer: Answer,
}

impl Driver {
    /// Sends the turn ends the store has caught up with. A named conversation's turn the
    /// store failed to keep ends failed, and this engine's copy is dropped: its next turn
    /// resumes the state the store has, which the client was never told had changed.
    pub(super) fn release_held(&mut self) {
        let mut i = 0;
        while i < self.held.len() {
            let outcome = match self.held[i].wait {
                Wait::Mark(mark) => self
                    .engine
                    .store_reached(mark)
                    .then_some(Durability::Durable),
                Wait::Settled(write) => match self.engine.write_durability(write) {
                    Durability::Pending => None,
                    _ => Some(Durability::NotStored),
                },
                Wait::Durable(_, Some(write)) => match self.engine.write_durability(write) {
                    Durability::Pending => None,
                    d => Some(d),
                },
                Wait::Durable(conv, None) => match self.engine.durability(conv) {
                    Ok(Durability::Pending) => None,
                    Ok(d) => Some(d),
                    // Closed meanwhile: what it wrote is not this turn's to judge.
                    Err(_) => Some(Durability::NotStored),
                },
                Wait::Removed(removing) => match self.engine.removal_durability(removing) {
                    Durability::Pending => None,
                    d => Some(d),
                },
            };
            let Some(outcome) = outcome else {
                i += 1;
                continue;
            };
            let held = self.held.swap_remove(i);
            let failure = match (outcome, &held.wait) {
                (Durability::Failed(why), &Wait::Durable(conv, _)) => {
                    tracing::warn!(%why, "a named conversation's turn could not be stored");
                    self.stats.lock().store_failures += 1;
                    self.sessions.forget(&mut self.engine, conv, false);
                    Some(Error::NotDurable(why))
                }
                (Durability::Conflict(why), &Wait::Durable(conv, _)) => {
                    tracing::warn!(%why, "a named conversation's turn was not stored");
                    self.stats.lock().store_conflicts += 1;
                    self.sessions.forget(&mut self.engine, conv, false);
                    Some(Error::StoreConflict(why))
                }
                // The store keeps the conversation: the client is told it still exists.
                (Durability::Failed(why), Wait::Removed(_)) => {
                    tracing::warn!(%why, "a stored conversation could not be removed");
                    self.stats.lock().store_failures += 1;
                    Some(Error::NotRemoved(why))
                }
                _ => None,
            };
            match held.answer {
                Answer::Turn {
                    events, mut end, ..
                } => {
                    if let Some(e) = failure {
                        end.reason = FinishReason::Failed(Arc::new(e));
                    }
                    let _ = events.send(TurnEvent::Finished(*end));
                }
                Answer::Done(reply) => {
                    let _ = reply.send(failure.map_or(Ok(()), Err));
                }
            }
        }
    }
}
