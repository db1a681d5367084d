//! What [`Service::chat`](super::Service::chat) takes: a stateless client's whole message
//! list, with the conversation's name, hints, tools and template variables.

use std::time::Duration;

use crate::model::Message;
#[cfg(doc)]
use crate::{engine::ConversationOptions, engine::Engine, service::Service, service::TurnEnd};

/// Session hints of a [`Chat`].
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Hints {
    /// Pin (`Some(true)`) or unpin the conversation's KV before the turn
    /// ([`Engine::pin`]); a pin past the limit refuses the turn.
    pub pin: Option<bool>,
    /// After the turn, expect the conversation back in about this long
    /// ([`Engine::expect_resume`]).
    pub expect_resume: Option<Duration>,
    /// The conversation ends with this turn: it is closed (and deleted from its store).
    pub end: bool,
}

/// A chat turn for [`Service::chat`]: the whole message list, as a stateless client sends it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Chat {
    /// The conversation so far (an optional system message first), ending with the user's
    /// new message.
    pub messages: Vec<Message>,
    /// The conversation's name: it continues the conversation of that name (from the store
    /// when this engine holds none) rather than one found by content.
    pub name: Option<String>,
    /// Hints for the conversation.
    pub hints: Hints,
    /// Tools the assistant may call (OpenAI's `tools` entries), which the chat template
    /// lists; a reply that calls them ends with its calls parsed ([`TurnEnd::message`]).
    /// A conversation continues only with the tools it began with.
    pub tools: Vec<serde_json::Value>,
    /// Variables of the chat template beside the standard ones
    /// ([`ConversationOptions::template_vars`]); a conversation continues only with the
    /// variables it began with.
    pub template_vars: serde_json::Map<String, serde_json::Value>,
}

impl Chat {
    /// A chat turn of `messages`, unnamed, without hints.
    pub fn new(messages: Vec<Message>) -> Self {
        Self {
            messages,
            name: None,
            hints: Hints::default(),
            tools: Vec::new(),
            template_vars: serde_json::Map::new(),
        }
    }

    /// Names the conversation.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Sets the tools.
    pub fn with_tools(mut self, tools: Vec<serde_json::Value>) -> Self {
        self.tools = tools;
        self
    }

    /// Sets the chat template's variables.
    pub fn with_template_vars(mut self, vars: serde_json::Map<String, serde_json::Value>) -> Self {
        self.template_vars = vars;
        self
    }

    /// Sets the hints.
    pub fn with_hints(mut self, hints: Hints) -> Self {
        self.hints = hints;
        self
    }
}
