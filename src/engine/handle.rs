//! [`EngineHandle`]: submit and cancel from any thread while one thread drives `step()`.
//!
//! Commands go into a mutex-protected inbox that `step()` drains first; request ids come from
//! a shared atomic counter, so a handle returns the id at once. Errors of a handle's
//! submission (unknown conversation, ...) arrive as `Finished` events with
//! [`super::FinishReason::Failed`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::{
    ConversationId, Engine, Event, FinishReason, RequestId, SamplingParams, Turn, TurnStats,
};

#[derive(Debug)]
pub(super) enum Command {
    Submit {
        id: RequestId,
        conv: ConversationId,
        turn: Turn,
        /// Boxed: parameters are most of a command's size, and cancels are frequent.
        params: Box<SamplingParams>,
    },
    Cancel(RequestId),
}

#[derive(Debug)]
pub(super) struct Shared {
    inbox: Mutex<Vec<Command>>,
    next_request: AtomicU64,
    /// This engine's part of its tool calls' ids (a request's id is the rest), so that ids do
    /// not repeat across engines or restarts of a stored conversation.
    pub call_ids: u64,
}

impl Default for Shared {
    fn default() -> Self {
        static ENGINES: AtomicU64 = AtomicU64::new(0);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        Self {
            inbox: Mutex::default(),
            next_request: AtomicU64::new(0),
            call_ids: now.map_or(0, |d| d.as_nanos() as u64)
                ^ u64::from(std::process::id()).rotate_left(40)
                ^ ENGINES.fetch_add(1, Ordering::Relaxed).rotate_left(20),
        }
    }
}

impl Shared {
    pub fn next_request_id(&self) -> RequestId {
        RequestId(self.next_request.fetch_add(1, Ordering::Relaxed))
    }

    pub fn take_commands(&self) -> Vec<Command> {
        std::mem::take(&mut *self.inbox.lock())
    }

    pub fn has_commands(&self) -> bool {
        !self.inbox.lock().is_empty()
    }
}

/// A cheap, cloneable, `Send + Sync` handle to an [`super::Engine`].
#[derive(Clone, Debug)]
pub struct EngineHandle {
    shared: Arc<Shared>,
}

impl EngineHandle {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// Queues a turn; it is validated and admitted at the engine's next `step()`.
    pub fn submit(&self, conv: ConversationId, turn: Turn, params: SamplingParams) -> RequestId {
        let id = self.shared.next_request_id();
        self.shared.inbox.lock().push(Command::Submit {
            id,
            conv,
            turn,
            params: Box::new(params),
        });
        id
    }

    /// Asks for a turn to be cancelled at the next `step()`.
    pub fn cancel(&self, id: RequestId) {
        self.shared.inbox.lock().push(Command::Cancel(id));
    }
}

impl Engine {
    /// Takes the handles' commands: submissions (a refused one finishes failed in the next
    /// events) and cancels.
    pub(super) fn drain_commands(&mut self, now: Instant) {
        for cmd in self.shared.take_commands() {
            match cmd {
                Command::Submit {
                    id,
                    conv,
                    turn,
                    params,
                } => {
                    if let Err(e) = self.submit_with(id, conv, turn, *params, now, None) {
                        self.backlog.push(Event::Finished {
                            request: id,
                            conversation: conv,
                            reason: FinishReason::failed(e),
                            stats: TurnStats::default(),
                        });
                    }
                }
                Command::Cancel(id) => {
                    // Cancelling an unknown or finished request from a handle is a no-op.
                    let _ = self.cancel(id);
                }
            }
        }
    }
}
