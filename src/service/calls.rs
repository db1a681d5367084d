//! What a host asks of one conversation or turn besides running it: its history, a fork, a
//! name, a cancel, and the conversations a store keeps. Each is one call on the engine thread
//! between steps, as the handle's other methods, so a host (the Python package, a transport)
//! needs no closure over the engine for them.

use super::Service;
use crate::ids::{ConversationId, RequestId};
use crate::model::Message;
use crate::Result;

impl Service {
    /// A conversation's messages so far ([`crate::Engine::messages`]).
    ///
    /// # Errors
    /// [`crate::Error::UnknownConversation`]; [`crate::Error::ServiceStopped`].
    pub async fn messages(&self, conv: ConversationId) -> Result<Vec<Message>> {
        self.call(move |d| d.engine_mut().messages(conv).map(<[_]>::to_vec))
            .await?
    }

    /// A conversation's tokens so far ([`crate::Engine::tokens`]).
    ///
    /// # Errors
    /// [`crate::Error::UnknownConversation`]; [`crate::Error::ServiceStopped`].
    pub async fn tokens(&self, conv: ConversationId) -> Result<Vec<u32>> {
        self.call(move |d| d.engine_mut().tokens(conv).map(<[_]>::to_vec))
            .await?
    }

    /// A new conversation with `conv`'s history, or its first `turns` turns
    /// ([`crate::Engine::fork`]), sharing its KV.
    ///
    /// # Errors
    /// As [`crate::Engine::fork`]; [`crate::Error::ServiceStopped`].
    pub async fn fork(&self, conv: ConversationId, turns: Option<usize>) -> Result<ConversationId> {
        self.call(move |d| d.engine_mut().fork(conv, turns)).await?
    }

    /// Stores the unnamed conversation `conv` under `name` ([`crate::Engine::name`]).
    ///
    /// # Errors
    /// As [`crate::Engine::name`]; [`crate::Error::ServiceStopped`].
    pub async fn name(&self, conv: ConversationId, name: String) -> Result<()> {
        self.call(move |d| d.engine_mut().name(conv, name)).await?
    }

    /// Cancels a turn ([`crate::Engine::cancel`]); its stream then ends with
    /// [`crate::FinishReason::Cancelled`].
    ///
    /// # Errors
    /// [`crate::Error::UnknownRequest`] for a turn that already ended;
    /// [`crate::Error::ServiceStopped`].
    pub async fn cancel(&self, request: RequestId) -> Result<()> {
        self.call(move |d| d.engine_mut().cancel(request)).await?
    }

    /// The names of the conversations the store keeps now
    /// ([`crate::Engine::stored_conversations`]).
    ///
    /// # Errors
    /// [`crate::Error::ServiceStopped`].
    pub async fn stored_conversations(&self) -> Result<Vec<String>> {
        self.call(|d| d.engine_mut().stored_conversations()).await
    }
}
