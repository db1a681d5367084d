//! What [`Service::chat`](super::Service::chat) takes: a stateless client's whole message
//! list, with the conversation's name, hints, tools and template variables.

use std::time::Duration;

use super::sessions::Setup;
use crate::engine::{ConversationOptions, Turn};
use crate::model::Message;
#[cfg(doc)]
use crate::{engine::Engine, service::Service, service::TurnEnd};
use crate::{Error, Result};

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
    /// The named conversation must exist (held, or in the store): a chat that would make it
    /// anew, because it was deleted since the client last read it, is refused with
    /// [`Error::NotStored`] rather than bringing it back.
    pub existing: bool,
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
            existing: false,
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

    /// Continues only a conversation that exists ([`Chat::existing`]).
    pub fn existing(mut self) -> Self {
        self.existing = true;
        self
    }

    /// Sets the hints.
    pub fn with_hints(mut self, hints: Hints) -> Self {
        self.hints = hints;
        self
    }
}

/// A chat's history, its new messages (after the last assistant message: the user's, or
/// tools' results) and the turn they make.
///
/// # Errors
/// [`Error::InvalidRequest`] when it ends with no new message.
pub(super) fn new_turn(messages: &[Message]) -> Result<(&[Message], &[Message], Turn)> {
    let new = messages
        .iter()
        .rev()
        .take_while(|m| m.role == "user" || m.role == "tool")
        .count();
    if new == 0 {
        return Err(Error::InvalidRequest {
            field: "messages",
            reason: "the last message must be the user's or a tool's result".into(),
        });
    }
    let (history, last) = messages.split_at(messages.len() - new);
    let turn = match last {
        [m] if m.role == "user" => Turn::user(m.content.clone()),
        _ => Turn::Messages(last.to_vec()),
    };
    Ok((history, last, turn))
}

/// The options and first turn of the conversation `chat` opens where it continues none (as
/// [`Sessions::chat_conversation`] opens it).
///
/// # Errors
/// As [`Sessions::chat_conversation`] refuses its messages.
pub(super) fn opening(chat: &Chat) -> Result<(ConversationOptions, Turn)> {
    let (history, _, turn) = new_turn(&chat.messages)?;
    let (system, rest) = split_system(history)?;
    let setup = Setup {
        tools: chat.tools.clone(),
        vars: chat.template_vars.clone(),
    };
    Ok((setup.options(system, rest, serde_json::Map::new()), turn))
}

/// A history's system prompt and the messages after it: the system (or developer) messages it
/// opens with, joined by a blank line (OpenAI's clients send instructions and a framework's
/// own system message one after the other), and the rest.
///
/// # Errors
/// [`Error::InvalidRequest`] for a system message after the opening ones: the conversation's
/// system prompt is its first message.
pub(super) fn split_system(history: &[Message]) -> Result<(Option<String>, &[Message])> {
    let leading = history.iter().take_while(|m| m.role == "system").count();
    let (system, rest) = history.split_at(leading);
    if rest.iter().any(|m| m.role == "system") {
        return Err(Error::InvalidRequest {
            field: "messages",
            reason: "a system message may only come first".into(),
        });
    }
    let joined = system
        .iter()
        .map(|m| m.content.as_str())
        .collect::<Vec<_>>()
        .join("\n\n");
    Ok(((!system.is_empty()).then_some(joined), rest))
}
