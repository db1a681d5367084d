//! Chat messages and the tool calls they carry: plain data, with no model behind them, so
//! the conversation state (and the layers under it) can hold them.

use serde::{Deserialize, Serialize};

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
    /// The tools an assistant message calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant's thought before its answer (a thinking model's `<think>` text, without
    /// the tags), kept apart from `content` as templates that take it (Qwen3's) expect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            reasoning_content: None,
        }
    }

    /// The same, with `thought` before its answer (an assistant's message).
    pub fn with_reasoning(self, thought: impl Into<String>) -> Self {
        Self {
            reasoning_content: Some(thought.into()),
            ..self
        }
    }

    /// The same, calling `calls` (an assistant's message).
    pub fn with_tool_calls(self, tool_calls: Vec<ToolCall>) -> Self {
        Self { tool_calls, ..self }
    }

    /// The same, answering the call `id` (a `tool` message).
    pub fn answering(self, id: impl Into<String>) -> Self {
        Self {
            tool_call_id: Some(id.into()),
            ..self
        }
    }
}

/// A call of a tool (a function) an assistant message makes, as OpenAI's API carries it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ToolCall {
    /// The call's id, which the tool's result message names (`tool_call_id`).
    pub id: String,
    /// The function's name.
    pub name: String,
    /// Its arguments: JSON text, as the model wrote it.
    pub arguments: String,
}

impl ToolCall {
    /// A call `id` of function `name` with `arguments` (JSON text).
    pub fn new(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: impl Into<String>,
    ) -> Self {
        Self {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
        }
    }
}
