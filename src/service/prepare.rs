//! A large chat's first turn, prepared before its command reaches the engine thread: a client
//! that sends megabytes of history (or thousands of items) that no held conversation has then
//! costs a thread of its own the templating and tokenizing, instead of every stream a stall.

use super::driver::What;
use super::fetch::on_own_thread;
use super::{chat, Chat, Service};
use crate::engine::{ReadyTurn, SamplingParams};

/// Chats with more text than this, or more messages, have their first turn prepared off the
/// engine thread when they open a conversation: below it, templating and tokenizing take
/// well under a step.
const PREPARE_BYTES: usize = 32 << 10;
const PREPARE_MESSAGES: usize = 256;

impl Service {
    /// What the engine thread is sent for `chat`: with what the store holds of its name, and
    /// its first turn prepared if it is large and continues no conversation held now.
    pub(super) async fn chat_what(&self, chat: Chat, params: &SamplingParams) -> What {
        let fetched = self.fetched(chat.name.as_deref()).await;
        let ready = self.ready(&chat, params).await;
        What::Chat(chat, fetched.map(Box::new), ready.map(Box::new))
    }

    /// `chat`'s first turn, prepared on a thread of its own if it is large and opens a
    /// conversation; `None` otherwise (the engine thread prepares whatever turn it runs).
    async fn ready(&self, chat: &Chat, params: &SamplingParams) -> Option<ReadyTurn> {
        let bytes: usize = chat.messages.iter().map(|m| m.content.len()).sum();
        if bytes < PREPARE_BYTES && chat.messages.len() < PREPARE_MESSAGES {
            return None;
        }
        // A resent history the engine holds feeds only its new messages.
        let probe = chat.clone();
        if self.call(move |d| d.would_continue(&probe)).await.ok()? {
            return None;
        }
        let (options, turn) = chat::opening(chat).ok()?;
        let (preparer, params) = (self.inner.preparer.clone(), params.clone());
        let prepare = move || preparer.first_turn(options, turn, &params);
        on_own_thread("pensieve-prepare", prepare).await
    }
}
