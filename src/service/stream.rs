//! A turn's events as a [`futures_core::Stream`] that cancels the turn when dropped early.

use std::pin::Pin;
use std::sync::mpsc::Sender;
use std::task::{Context, Poll};

use tokio::sync::mpsc::UnboundedReceiver;

use super::driver::Command;
use super::Service;
use crate::engine::{ConversationId, FinishReason, RequestId, TokenLogprobs, TurnStats};

/// What happens in a turn.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
// The end, with its statistics, is the large variant: one per turn, where a box would cost
// every turn an allocation and every matching caller a dereference, to spare a token event a
// copy of a few hundred bytes on its way through a channel.
#[allow(clippy::large_enum_variant)]
pub enum TurnEvent {
    /// A generated token and the text it adds to the reply: possibly empty (the middle of a
    /// character, or text held back while it could begin a stop string). The texts of a turn
    /// add up to the reply exactly as the conversation records it.
    Token {
        /// The token id.
        token: u32,
        /// The text it releases.
        text: String,
        /// Its log-probability and the best alternatives, when the parameters asked.
        logprobs: Option<TokenLogprobs>,
    },
    /// For a conversation with tools: what the reply's text so far adds, told apart into the
    /// text before its calls and the calls (each as it begins, then its arguments as they are
    /// written), in the format of the model's template. Follows the `Token` whose text it
    /// reads; the turn's [`TurnEnd::message`] holds the same text and calls whole.
    Tool(crate::chat::ToolDelta),
    /// The turn's end: the last event of its stream.
    Finished(TurnEnd),
}

/// How a turn ended.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct TurnEnd {
    /// Why it ended. A named conversation's turn the store did not keep is
    /// [`FinishReason::Failed`] with [`crate::Error::NotDurable`] or
    /// [`crate::Error::StoreConflict`].
    pub reason: FinishReason,
    /// Its numbers.
    pub stats: TurnStats,
    /// Tokens the conversation holds after it.
    pub history_tokens: usize,
    /// The reply as an assistant message, for a turn that ended with its reply: its text, or
    /// (when the conversation has tools and the reply calls them) the text before the calls
    /// and the calls, parsed in the format of the model's template.
    pub message: Option<crate::model::Message>,
}

/// A whole reply, as [`TurnStream::reply`] collects it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Reply {
    /// The reply's text.
    pub text: String,
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// Each token's log-probabilities, when asked.
    pub logprobs: Vec<TokenLogprobs>,
    /// How the turn ended.
    pub end: TurnEnd,
}

/// The events of one turn, ending with [`TurnEvent::Finished`]. Dropped before that, it
/// cancels the turn: the conversation stays as it was and the turn's KV reservation is freed.
#[derive(Debug)]
pub struct TurnStream {
    request: RequestId,
    conversation: ConversationId,
    events: UnboundedReceiver<TurnEvent>,
    /// Present until the end arrives.
    cancel: Option<Sender<Command>>,
    /// Whether the turn rewrites its named conversation's history.
    rewrites: bool,
    /// Keeps the engine thread serving while the turn runs.
    _service: Service,
}

impl TurnStream {
    pub(super) fn new(
        request: RequestId,
        conversation: ConversationId,
        events: UnboundedReceiver<TurnEvent>,
        cancel: Sender<Command>,
        service: Service,
    ) -> Self {
        Self {
            request,
            conversation,
            events,
            cancel: Some(cancel),
            rewrites: false,
            _service: service,
        }
    }

    pub(super) fn rewriting(mut self, rewrites: bool) -> Self {
        self.rewrites = rewrites;
        self
    }

    /// Whether the turn rewrites the history of the named conversation it continues: the chat
    /// sent another history than the conversation holds (an earlier message changed or
    /// dropped, other tools or template variables), so once it has its reply the conversation
    /// is this chat's messages and reply, and what it held is gone.
    pub fn rewrites(&self) -> bool {
        self.rewrites
    }

    /// The turn's request id.
    pub fn request(&self) -> RequestId {
        self.request
    }

    /// The conversation the turn belongs to.
    pub fn conversation(&self) -> ConversationId {
        self.conversation
    }

    /// The next event, or `None` after the end.
    pub async fn next_event(&mut self) -> Option<TurnEvent> {
        std::future::poll_fn(|cx| self.poll_event(cx)).await
    }

    /// Waits for the whole reply.
    ///
    /// # Errors
    /// [`crate::Error::ServiceStopped`] if the engine thread ended without finishing the turn.
    pub async fn reply(mut self) -> crate::Result<Reply> {
        let (mut text, mut tokens, mut logprobs) = (String::new(), Vec::new(), Vec::new());
        while let Some(event) = self.next_event().await {
            match event {
                TurnEvent::Token {
                    token,
                    text: t,
                    logprobs: l,
                } => {
                    text.push_str(&t);
                    tokens.push(token);
                    logprobs.extend(l);
                }
                TurnEvent::Tool(_) => {}
                TurnEvent::Finished(end) => {
                    return Ok(Reply {
                        text,
                        tokens,
                        logprobs,
                        end,
                    })
                }
            }
        }
        Err(crate::Error::ServiceStopped)
    }

    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Option<TurnEvent>> {
        let event = std::task::ready!(self.events.poll_recv(cx));
        if matches!(event, Some(TurnEvent::Finished(_)) | None) {
            self.cancel = None;
        }
        Poll::Ready(event)
    }
}

impl futures_core::Stream for TurnStream {
    type Item = TurnEvent;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<TurnEvent>> {
        self.get_mut().poll_event(cx)
    }
}

impl Drop for TurnStream {
    fn drop(&mut self) {
        if let Some(tx) = self.cancel.take() {
            // The engine thread gone means the service stopped: nothing left to cancel.
            let _ = tx.send(Command::Cancel(self.request));
        }
    }
}

/// Whether a finish reason is a normal end of the reply (not a cancel or a failure).
pub(super) fn settled(reason: &FinishReason) -> bool {
    !matches!(reason, FinishReason::Cancelled | FinishReason::Failed(_))
}
