//! Anthropic's Messages request read into what the engine takes: content blocks into the
//! chat's messages (tool results as `tool` messages, thoughts as `reasoning_content`, calls
//! with their input as JSON text), tools and `tool_choice` in OpenAI's shape (what chat
//! templates list), and the prompt-cache breakpoints (`cache_control`) it marks.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::model::{Message, ToolCall};

use super::super::error::ApiError;

/// `POST /v1/messages` and `/v1/messages/count_tokens` (which has no `max_tokens`).
#[derive(Deserialize, Debug)]
pub struct Request {
    pub model: String,
    pub messages: Vec<InMessage>,
    pub max_tokens: Option<usize>,
    pub system: Option<System>,
    #[serde(default)]
    pub stop_sequences: Vec<String>,
    #[serde(default)]
    pub stream: bool,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    #[serde(default)]
    pub tools: Vec<Value>,
    pub tool_choice: Option<Value>,
    pub thinking: Option<Value>,
    pub output_config: Option<OutputConfig>,
    /// Top-level: a breakpoint at the request's last cacheable block.
    pub cache_control: Option<CacheControl>,
    /// Context editing: which earlier thoughts the model sees (`clear_thinking`).
    pub context_management: Option<Value>,
}

/// A system prompt: text, or text blocks.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum System {
    Text(String),
    Blocks(Vec<Value>),
}

/// One message of the request, its content text or blocks.
#[derive(Deserialize, Debug)]
pub struct InMessage {
    pub role: String,
    pub content: InContent,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum InContent {
    Text(String),
    Blocks(Vec<Value>),
}

impl InContent {
    /// The content as blocks: a text is one text block.
    fn blocks(&self) -> std::borrow::Cow<'_, [Value]> {
        match self {
            InContent::Text(t) => vec![json!({"type": "text", "text": t})].into(),
            InContent::Blocks(b) => b.as_slice().into(),
        }
    }
}

/// `output_config`: the reply's format and the effort of its thought.
#[derive(Deserialize, Debug)]
pub struct OutputConfig {
    pub effort: Option<String>,
    pub format: Option<Value>,
}

/// A prompt-cache breakpoint: `{"type": "ephemeral", "ttl": "5m" | "1h"}`.
#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct CacheControl {
    #[serde(rename = "type")]
    pub kind: String,
    pub ttl: Option<String>,
}

impl CacheControl {
    /// How long the prefix up to the breakpoint is kept: 5 minutes unless `ttl` says 1 hour.
    fn ttl(&self, at: &str) -> Result<Duration, ApiError> {
        if self.kind != "ephemeral" {
            return Err(ApiError::bad(format!(
                "cache_control of type {:?}: \"ephemeral\" only",
                self.kind
            ))
            .with_param(at.to_string()));
        }
        match self.ttl.as_deref() {
            None | Some("5m") => Ok(Duration::from_secs(300)),
            Some("1h") => Ok(Duration::from_secs(3600)),
            Some(other) => Err(ApiError::bad(format!(
                "cache_control.ttl {other:?}: \"5m\" or \"1h\""
            ))
            .with_param(at.to_string())),
        }
    }
}

/// Where the request's last prompt-cache breakpoint lies, in the engine's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Breakpoint {
    /// After the tools (which the template renders before the messages).
    Tools,
    /// After the engine's message of this index.
    Message(usize),
}

/// The request as the engine takes it.
#[derive(Debug)]
pub struct Prompt {
    pub messages: Vec<Message>,
    /// OpenAI's `tools` entries.
    pub tools: Vec<Value>,
    /// OpenAI's `tool_choice`.
    pub choice: Option<Value>,
    /// Whether a reply may make several calls.
    pub parallel: bool,
    /// The last breakpoint, if the request marks any.
    pub breakpoint: Option<Breakpoint>,
    /// The longest time-to-live among its breakpoints.
    pub ttl: Option<Duration>,
    /// Bytes of text in its messages and system prompt (what the window's bound counts).
    pub bytes: usize,
}

/// Collects the breakpoints of a request as its blocks are read.
#[derive(Default)]
struct Marks {
    last: Option<Breakpoint>,
    ttl: Option<Duration>,
}

impl Marks {
    /// Reads a block's `cache_control`, if it has one, as a breakpoint at `at`.
    fn read(&mut self, block: &Value, at: Breakpoint, path: &str) -> Result<(), ApiError> {
        let Some(c) = block.get("cache_control").filter(|c| !c.is_null()) else {
            return Ok(());
        };
        let path = format!("{path}.cache_control");
        let c: CacheControl = serde_json::from_value(c.clone())
            .map_err(|e| ApiError::bad(format!("{path}: {e}")).with_param(path.clone()))?;
        self.mark(&c, at, &path)
    }

    fn mark(&mut self, c: &CacheControl, at: Breakpoint, path: &str) -> Result<(), ApiError> {
        self.keep(c.ttl(path)?, at);
        Ok(())
    }

    /// A breakpoint at `at`, kept for `ttl`: the latest, and the longest time-to-live.
    fn keep(&mut self, ttl: Duration, at: Breakpoint) {
        self.ttl = Some(self.ttl.map_or(ttl, |t| t.max(ttl)));
        self.last = Some(at);
    }
}

impl Request {
    /// The request's messages, tools and breakpoints as the engine takes them.
    ///
    /// # Errors
    /// A 400 naming the block at fault: an image or document (a text model), a block type
    /// this server has no meaning for, a reply to continue (a last assistant message), a
    /// server tool.
    pub fn prompt(&self) -> Result<Prompt, ApiError> {
        let mut marks = Marks::default();
        let tools = self.tools(&mut marks)?;
        let (choice, parallel) = self.choice()?;
        let mut messages = Vec::new();
        let mut bytes = 0;
        match &self.system {
            None => {}
            Some(System::Text(t)) => messages.push(Message::new("system", t.clone())),
            Some(System::Blocks(blocks)) => {
                let mut text = Vec::new();
                for (j, b) in blocks.iter().enumerate() {
                    let path = format!("system[{j}]");
                    text.push(block_text(b, &path)?);
                    marks.read(b, Breakpoint::Message(0), &path)?;
                }
                messages.push(Message::new("system", text.join("\n\n")));
            }
        }
        bytes += messages.first().map_or(0, |m| m.content.len());
        for (i, m) in self.messages.iter().enumerate() {
            let path = format!("messages[{i}]");
            let read = match m.role.as_str() {
                "user" => user(m, &path, &mut messages, &mut marks)?,
                "assistant" => assistant(m, &path, &mut messages, &mut marks)?,
                "system" => reminder(m, &path, &mut messages, &mut marks)?,
                other => {
                    return Err(ApiError::bad(format!(
                        "{path}.role {other:?}: \"user\", \"assistant\" or \"system\""
                    ))
                    .with_param(format!("{path}.role")))
                }
            };
            bytes += read;
        }
        match messages.last() {
            Some(m) if m.role == "assistant" => {
                return Err(ApiError::bad(
                    "the last message is the assistant's: continuing a reply written in the \
                     request (a prefill) is not supported here; end with the user's message",
                )
                .with_param("messages"))
            }
            None => return Err(ApiError::bad("messages: at least one").with_param("messages")),
            Some(_) => {}
        }
        self.clear_thinking(&mut messages)?;
        if let Some(c) = &self.cache_control {
            let last = Breakpoint::Message(messages.len() - 1);
            marks.mark(c, last, "cache_control")?;
        }
        Ok(Prompt {
            messages,
            tools,
            choice,
            parallel,
            breakpoint: marks.last,
            ttl: marks.ttl,
            bytes,
        })
    }

    /// Applies `context_management`'s edits: `clear_thinking` drops the thoughts of all but
    /// the latest `keep` assistant turns that have one (`"all"` keeps them all). Other edits
    /// (clearing tool results) are refused by type.
    fn clear_thinking(&self, messages: &mut [Message]) -> Result<(), ApiError> {
        let Some(edits) = self.context_management.as_ref().filter(|c| !c.is_null()) else {
            return Ok(());
        };
        let path = "context_management.edits";
        let bad = |what: String| Err(ApiError::bad(format!("{path}: {what}")).with_param(path));
        let Some(edits) = edits["edits"].as_array() else {
            return bad("a list of edits".into());
        };
        for e in edits {
            let kind = e["type"].as_str().unwrap_or_default();
            if !kind.starts_with("clear_thinking_") {
                return bad(format!(
                    "an edit of type {:?}: only `clear_thinking` edits here (clearing tool \
                     results would change the prefix every cached turn shares)",
                    e["type"]
                ));
            }
            let keep = match &e["keep"] {
                Value::Null => 1,
                Value::String(a) if a == "all" => continue,
                k => match k["value"].as_u64() {
                    Some(n) if k["type"] == "thinking_turns" => n as usize,
                    _ => {
                        return bad(format!(
                            "keep {k}: \"all\" or {{\"type\": \"thinking_turns\", \"value\": N}}"
                        ))
                    }
                },
            };
            let thinking = messages
                .iter_mut()
                .rev()
                .filter(|m| m.reasoning_content.is_some());
            for m in thinking.skip(keep) {
                m.reasoning_content = None;
            }
        }
        Ok(())
    }

    /// The tools in OpenAI's shape; Anthropic's server tools (typed, without a schema) are
    /// refused by their type.
    fn tools(&self, marks: &mut Marks) -> Result<Vec<Value>, ApiError> {
        let mut out = Vec::new();
        for (i, t) in self.tools.iter().enumerate() {
            let path = format!("tools[{i}]");
            let custom = t.get("type").is_none_or(|k| k.is_null() || k == "custom");
            let (Some(name), Some(schema), true) =
                (t["name"].as_str(), t.get("input_schema"), custom)
            else {
                return Err(ApiError::bad(format!(
                    "{path}: tools of type {} are not supported: client tools (a name and an \
                     input_schema) only",
                    t["type"]
                ))
                .with_param(path));
            };
            let mut function = json!({"name": name, "parameters": schema});
            if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                function["description"] = d.clone();
            }
            if t.get("strict") == Some(&json!(true)) {
                function["strict"] = json!(true);
            }
            out.push(json!({"type": "function", "function": function}));
            marks.read(t, Breakpoint::Tools, &path)?;
        }
        Ok(out)
    }

    /// `tool_choice` in OpenAI's shape, and whether a reply may make several calls.
    fn choice(&self) -> Result<(Option<Value>, bool), ApiError> {
        let Some(c) = &self.tool_choice else {
            return Ok((None, true));
        };
        let parallel = c.get("disable_parallel_tool_use") != Some(&json!(true));
        let choice = match (c["type"].as_str(), c["name"].as_str()) {
            (Some("auto"), _) => json!("auto"),
            (Some("any"), _) => json!("required"),
            (Some("none"), _) => json!("none"),
            (Some("tool"), Some(name)) => json!({"type": "function", "function": {"name": name}}),
            _ => {
                return Err(ApiError::bad(format!(
                    "tool_choice {c}: {{\"type\": \"auto\" | \"any\" | \"none\"}} or \
                     {{\"type\": \"tool\", \"name\": ...}}"
                ))
                .with_param("tool_choice"))
            }
        };
        Ok((Some(choice), parallel))
    }

    /// The chat template's variables: `thinking` as `enable_thinking` (Qwen3's switch), and
    /// `output_config.effort` as `reasoning_effort` (gpt-oss's).
    pub fn template_vars(&self) -> Result<serde_json::Map<String, Value>, ApiError> {
        let mut vars = serde_json::Map::new();
        if let Some(t) = &self.thinking {
            match t["type"].as_str() {
                Some("enabled") => {
                    vars.insert("enable_thinking".into(), json!(true));
                }
                Some("disabled") => {
                    vars.insert("enable_thinking".into(), json!(false));
                }
                // The model decides, as its template does by default.
                Some("adaptive") | Some("between_tools") => {}
                _ => {
                    return Err(ApiError::bad(format!(
                        "thinking {t}: of type \"enabled\", \"disabled\" or \"adaptive\""
                    ))
                    .with_param("thinking"))
                }
            }
        }
        if let Some(effort) = self.output_config.as_ref().and_then(|o| o.effort.as_ref()) {
            vars.insert("reasoning_effort".into(), json!(effort));
        }
        Ok(vars)
    }

    /// `output_config.format` as OpenAI's `response_format`.
    pub fn response_format(&self) -> Result<Option<Value>, ApiError> {
        let Some(f) = self.output_config.as_ref().and_then(|o| o.format.as_ref()) else {
            return Ok(None);
        };
        if f.is_null() {
            return Ok(None);
        }
        match (f["type"].as_str(), f.get("schema")) {
            (Some("json_schema"), Some(schema)) => Ok(Some(json!({"type": "json_schema",
                "json_schema": {"name": "output", "schema": schema}}))),
            _ => Err(ApiError::bad(format!(
                "output_config.format {f}: {{\"type\": \"json_schema\", \"schema\": ...}}"
            ))
            .with_param("output_config.format")),
        }
    }
}

/// A text block's text; any other block is refused.
fn block_text(b: &Value, path: &str) -> Result<String, ApiError> {
    match (b["type"].as_str(), b["text"].as_str()) {
        (Some("text"), Some(t)) => Ok(t.to_string()),
        _ => Err(unsupported(b, path)),
    }
}

/// The refusal of a block this server cannot take.
fn unsupported(b: &Value, path: &str) -> ApiError {
    let what = match b["type"].as_str() {
        Some("image") | Some("document") => {
            "this server serves a text model: images and documents are refused"
        }
        _ => "text, tool_use, tool_result and thinking blocks are supported here",
    };
    ApiError::bad(format!("{path}: a block of type {}: {what}", b["type"]))
        .with_param(path.to_string())
}

/// A user message: its tool results as `tool` messages (Anthropic puts them first), then its
/// text as a user message. Returns the bytes of text read.
fn user(
    m: &InMessage,
    path: &str,
    out: &mut Vec<Message>,
    marks: &mut Marks,
) -> Result<usize, ApiError> {
    let blocks = m.content.blocks();
    let mut text = Vec::new();
    let mut bytes = 0;
    // A breakpoint in the text marks the user message made of it, after the results.
    let mut text_marks = Marks::default();
    for (j, b) in blocks.iter().enumerate() {
        let path = format!("{path}.content[{j}]");
        match b["type"].as_str() {
            Some("text") => {
                text.push(block_text(b, &path)?);
                text_marks.read(b, Breakpoint::Tools, &path)?;
            }
            Some("tool_result") => {
                let Some(id) = b["tool_use_id"].as_str() else {
                    return Err(ApiError::bad(format!("{path}.tool_use_id: required"))
                        .with_param(format!("{path}.tool_use_id")));
                };
                let mut result = match &b["content"] {
                    Value::Null => String::new(),
                    Value::String(s) => s.clone(),
                    Value::Array(parts) => {
                        let each = |(k, p): (usize, &Value)| {
                            block_text(p, &format!("{path}.content[{k}]"))
                        };
                        let texts: Result<Vec<_>, _> = parts.iter().enumerate().map(each).collect();
                        texts?.join("\n\n")
                    }
                    other => {
                        return Err(ApiError::bad(format!(
                            "{path}.content: text or text blocks, not {other}"
                        ))
                        .with_param(format!("{path}.content")))
                    }
                };
                // Templates have no field for a failed call: the result says so itself.
                if b["is_error"] == json!(true) {
                    result = format!("Error: {result}");
                }
                bytes += result.len();
                out.push(Message::new("tool", result).answering(id));
                marks.read(b, Breakpoint::Message(out.len() - 1), &path)?;
            }
            _ => return Err(unsupported(b, &path)),
        }
    }
    if !text.is_empty() {
        let text = text.join("\n\n");
        bytes += text.len();
        out.push(Message::new("user", text));
        if let Some(ttl) = text_marks.ttl {
            marks.keep(ttl, Breakpoint::Message(out.len() - 1));
        }
    }
    Ok(bytes)
}

/// A system message inside `messages` (Claude Code's reminders): the templates take one system
/// prompt, first, so its text joins the user's turn it follows (or opens one).
fn reminder(
    m: &InMessage,
    path: &str,
    out: &mut Vec<Message>,
    marks: &mut Marks,
) -> Result<usize, ApiError> {
    let blocks = m.content.blocks();
    let mut text = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        text.push(block_text(b, &format!("{path}.content[{j}]"))?);
    }
    let text = text.join("\n\n");
    match out.last_mut() {
        Some(last) if last.role == "user" => {
            last.content.push_str("\n\n");
            last.content.push_str(&text);
        }
        _ => out.push(Message::new("user", text.clone())),
    }
    let at = Breakpoint::Message(out.len() - 1);
    for (j, b) in blocks.iter().enumerate() {
        marks.read(b, at, &format!("{path}.content[{j}]"))?;
    }
    Ok(text.len())
}

/// An assistant message: its text, its thought, and its calls (their input as JSON text).
/// Returns the bytes of text read.
fn assistant(
    m: &InMessage,
    path: &str,
    out: &mut Vec<Message>,
    marks: &mut Marks,
) -> Result<usize, ApiError> {
    let blocks = m.content.blocks();
    let (mut text, mut thought, mut calls) = (Vec::new(), Vec::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let path = format!("{path}.content[{j}]");
        match b["type"].as_str() {
            Some("text") => text.push(block_text(b, &path)?),
            Some("thinking") => {
                thought.push(b["thinking"].as_str().unwrap_or_default().to_string())
            }
            // Claude's encrypted thought: nothing here can read it, and no model here wrote it.
            Some("redacted_thinking") => {}
            Some("tool_use") => {
                let (Some(id), Some(name)) = (b["id"].as_str(), b["name"].as_str()) else {
                    return Err(
                        ApiError::bad(format!("{path}: a tool_use needs id and name"))
                            .with_param(path),
                    );
                };
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(ToolCall::new(id, name, input.to_string()));
            }
            _ => return Err(unsupported(b, &path)),
        }
        marks.read(b, Breakpoint::Message(out.len()), &path)?;
    }
    let text = text.join("\n\n");
    let bytes = text.len() + thought.iter().map(String::len).sum::<usize>();
    let mut message = Message::new("assistant", text).with_tool_calls(calls);
    if !thought.is_empty() {
        message = message.with_reasoning(thought.join("\n\n"));
    }
    out.push(message);
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn prompt(v: Value) -> Result<Prompt, ApiError> {
        serde_json::from_value::<Request>(v).unwrap().prompt()
    }

    #[test]
    fn blocks_become_the_engines_messages_in_order() {
        let p = prompt(json!({"model": "m", "max_tokens": 8,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Call it.", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "weather",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "is_error": true,
                     "content": [{"type": "text", "text": "timeout"}]},
                    {"type": "text", "text": "Try again.",
                     "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]}))
        .unwrap();
        let roles: Vec<_> = p.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        let call = &p.messages[2].tool_calls[0];
        assert_eq!((call.id.as_str(), call.name.as_str()), ("t1", "weather"));
        assert_eq!(call.arguments, r#"{"city":"Paris"}"#);
        assert_eq!(p.messages[2].reasoning_content.as_deref(), Some("Call it."));
        assert_eq!(p.messages[3].content, "Error: timeout");
        assert_eq!(p.messages[3].tool_call_id.as_deref(), Some("t1"));
        assert_eq!(p.breakpoint, Some(Breakpoint::Message(4)));
        assert_eq!(p.ttl, Some(Duration::from_secs(3600)));
    }

    #[test]
    fn images_prefills_and_server_tools_are_refused_by_path() {
        let image = prompt(
            json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": ""}}]}]}),
        );
        let e = image.unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"));
        assert!(e.message.contains("text model"), "{}", e.message);
        let prefill = prompt(json!({"model": "m", "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]}));
        assert!(prefill.unwrap_err().message.contains("prefill"));
        let server = prompt(json!({"model": "m", "tools": [
            {"type": "web_search_20250305", "name": "web_search"}],
            "messages": [{"role": "user", "content": "Hi"}]}));
        assert_eq!(server.unwrap_err().param.as_deref(), Some("tools[0]"));
        let ttl = prompt(
            json!({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]}),
        );
        assert!(ttl.unwrap_err().message.contains("\"2h\""));
    }

    #[test]
    fn claude_codes_reminders_join_the_users_turn_and_thoughts_clear_as_asked() {
        let turn = |thought: &str| {
            json!({"role": "assistant", "content": [
                {"type": "thinking", "thinking": thought, "signature": ""},
                {"type": "text", "text": "ok"}]})
        };
        let p = prompt(json!({"model": "m", "max_tokens": 8,
            "context_management": {"edits": [{"type": "clear_thinking_20251015",
                "keep": {"type": "thinking_turns", "value": 1}}]},
            "messages": [{"role": "user", "content": "a"}, turn("t1"),
                {"role": "user", "content": "b"}, turn("t2"),
                {"role": "user", "content": "c"},
                {"role": "system", "content": [{"type": "text", "text": "Remember.",
                    "cache_control": {"type": "ephemeral"}}]}]}))
        .unwrap();
        let thoughts: Vec<_> = p
            .messages
            .iter()
            .map(|m| m.reasoning_content.clone())
            .collect();
        assert_eq!(thoughts, [None, None, None, Some("t2".into()), None]);
        assert_eq!(p.messages[4].content, "c\n\nRemember.");
        assert_eq!(p.breakpoint, Some(Breakpoint::Message(4)));
        let tools = prompt(
            json!({"model": "m", "messages": [{"role": "user", "content": "a"}],
            "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}),
        );
        assert!(tools.unwrap_err().message.contains("clear_tool_uses"));
    }

    #[test]
    fn tool_choice_maps_to_openais_and_tools_keep_their_schema() {
        let p = prompt(
            json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"},
                       "cache_control": {"type": "ephemeral"}}],
            "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": true}}),
        )
        .unwrap();
        assert_eq!(
            p.choice,
            Some(json!({"type": "function", "function": {"name": "f"}}))
        );
        assert!(!p.parallel);
        assert_eq!(
            p.tools[0]["function"]["parameters"],
            json!({"type": "object"})
        );
        assert_eq!(p.breakpoint, Some(Breakpoint::Tools));
        assert_eq!(p.ttl, Some(Duration::from_secs(300)));
    }
}
