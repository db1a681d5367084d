//! What a conversation's template renders beside its messages (its tools and variables), and
//! tool calls in the transcript: a reply of a conversation with tools is recorded with its
//! calls read out of it, as a client sends them back, so that the template renders the
//! history as it would for a server that holds nothing (and `super::rewind` makes the next
//! turn read that way).

use super::{Engine, RequestId};
use crate::chat::ToolStream;
use crate::ids::ConversationId;
use crate::model::{Message, Model, ToolCall};
use crate::{Error, Result};

impl Engine {
    /// The tools a conversation's template lists ([`super::ConversationOptions::tools`]).
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn tools(&self, conv: ConversationId) -> Result<&[serde_json::Value]> {
        self.convs
            .get(&conv)
            .map(|c| c.tools())
            .ok_or(Error::UnknownConversation(conv))
    }

    /// The variables a conversation's template reads
    /// ([`super::ConversationOptions::template_vars`]).
    ///
    /// # Errors
    /// [`Error::UnknownConversation`].
    pub fn template_vars(
        &self,
        conv: ConversationId,
    ) -> Result<&serde_json::Map<String, serde_json::Value>> {
        self.convs
            .get(&conv)
            .map(|c| c.template_vars())
            .ok_or(Error::UnknownConversation(conv))
    }

    /// A reader of the tool calls of request `request`'s reply as it streams, when its
    /// conversation `conv` has tools and the turn may call them
    /// ([`super::SamplingParams::text_only`]): the ids it gives are those the conversation
    /// records (and a client sends back), so a host streaming calls gets the same ones.
    pub fn tool_stream(&self, conv: ConversationId, request: RequestId) -> Option<ToolStream> {
        let turn = self.sched.get(request);
        if turn.is_some_and(|r| r.payload.params().text_only) {
            return None;
        }
        self.calls_stream(conv, request)
    }

    /// [`Engine::tool_stream`] whatever the turn's parameters.
    fn calls_stream(&self, conv: ConversationId, request: RequestId) -> Option<ToolStream> {
        let format = self.model.template()?.tool_format()?;
        let tools = self.convs.get(&conv).map(|c| c.tools())?;
        let seed = self.shared.call_ids ^ request.as_u64().wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (!tools.is_empty()).then(|| format.stream(seed).with_tools(tools))
    }

    /// The calls request `request`'s `reply` makes, and its text before them (none for a
    /// turn of text only).
    pub(super) fn tool_calls(
        &self,
        conv: ConversationId,
        request: RequestId,
        turn: &super::turn::ActiveTurn,
    ) -> Option<(String, Vec<ToolCall>)> {
        if turn.params().text_only {
            return None;
        }
        let mut stream = self.calls_stream(conv, request)?;
        let reply = turn.reply();
        stream.push(reply);
        stream.finish();
        stream.result()
    }
}

/// A reply as the transcript keeps it: its calls, when it makes some, after the text before
/// them; a thinking model's thought apart from its answer.
pub(super) fn reply_message(
    model: &Model,
    reply: String,
    calls: Option<(String, Vec<ToolCall>)>,
) -> Message {
    match calls {
        Some((text, calls)) => model.assistant_message(text).with_tool_calls(calls),
        None => model.assistant_message(reply),
    }
}
