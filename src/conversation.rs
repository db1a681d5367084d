//! Per-conversation state the engine keeps beside the KV: the raw-token history (the source of
//! truth, never lost) and the chat transcript the template continues from.
//!
//! Writers: the scheduler appends tokens when a step computes them or a turn ends
//! ([`Conversation::extend_tokens`]); the engine records each finished exchange in the
//! transcript ([`Conversation::record_exchange`]). Where each token's KV lives is the cache
//! manager's chunk table (`crate::kv`), not here.

use std::collections::BTreeMap;

use crate::ids::ConversationId;
use crate::model::Message;

/// One conversation's history.
#[derive(Debug, Default)]
pub(crate) struct Conversation {
    /// The name it is stored under, for a conversation that persists across restarts.
    name: Option<String>,
    /// Every token the model has been given or has generated, in order.
    tokens: Vec<u32>,
    /// The chat so far, for the template.
    messages: Vec<Message>,
    /// The text the model has seen, for the template's continuation of the next turn.
    seen_text: String,
}

impl Conversation {
    /// A conversation that starts with `messages` (a system prompt, say).
    pub fn new(messages: Vec<Message>) -> Self {
        Self {
            messages,
            ..Self::default()
        }
    }

    /// A conversation restored from its stored parts.
    pub fn restore(
        name: String,
        tokens: Vec<u32>,
        messages: Vec<Message>,
        seen_text: String,
    ) -> Self {
        Self {
            name: Some(name),
            tokens,
            messages,
            seen_text,
        }
    }

    /// The same, stored under `name`.
    pub fn named(self, name: Option<String>) -> Self {
        Self { name, ..self }
    }

    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    pub fn seen_text(&self) -> &str {
        &self.seen_text
    }

    pub fn extend_tokens(&mut self, tokens: impl IntoIterator<Item = u32>) {
        self.tokens.extend(tokens);
    }

    /// Records a finished exchange: the text the model saw (the prompt as templated, then the
    /// reply), and the messages for the template.
    pub fn record_exchange(
        &mut self,
        prompt_text: &str,
        user: Option<Message>,
        reply_text: &str,
        reply: Message,
    ) {
        self.seen_text.push_str(prompt_text);
        self.seen_text.push_str(reply_text);
        self.messages.extend(user);
        self.messages.push(reply);
    }
}

/// The table of open conversations, ordered by id so that iteration is deterministic.
pub(crate) type Conversations = BTreeMap<ConversationId, Conversation>;
