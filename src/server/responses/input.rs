//! A `POST /v1/responses` body: its input items as the conversation's messages, its tools and
//! `tool_choice` in the chat endpoint's shape, and `text.format` as the constraint on the reply.

use crate::model::{Message, ToolCall};
use serde::Deserialize;
use serde_json::{json, Value};

use super::super::error::ApiError;
use super::super::structured::{Guided, JsonSchemaFormat, ResponseFormat};

#[derive(Deserialize)]
pub struct Request {
    pub model: Option<String>,
    pub input: Input,
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    #[serde(default = "yes")]
    pub store: bool,
    #[serde(default)]
    pub stream: bool,
    /// Answered at once and run on, polled with `GET` (`background`).
    #[serde(default)]
    pub background: bool,
    pub max_output_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub metadata: Option<Value>,
    /// `effort` is the chat template's `reasoning_effort` variable; `summary` is taken and
    /// unused.
    pub reasoning: Option<Reasoning>,
    /// vLLM's: the chat template's variables.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Extra output to include: the values this server has (see [`check_include`]).
    #[serde(default)]
    pub include: Vec<String>,
    /// Alternatives reported beside each token's log-probability (0 to 20), with `include`
    /// of `message.output_text.logprobs`.
    pub top_logprobs: Option<usize>,
    /// `auto` drops the oldest turns that do not fit the window; `disabled` refuses them.
    pub truncation: Option<String>,
    /// The conversation (Conversations API) this response continues and adds to.
    pub conversation: Option<Value>,
    /// Functions the model may call, in the Responses API's flat shape.
    #[serde(default)]
    pub tools: Vec<Value>,
    pub tool_choice: Option<Value>,
    /// Whether a reply may make several calls (the first only when false).
    pub parallel_tool_calls: Option<bool>,
    /// Compaction entries: the context is compacted first past their threshold.
    pub context_management: Option<Value>,
    /// `{"format": ...}`: free text, any JSON object, or JSON under a schema.
    pub text: Option<Value>,
    #[serde(flatten)]
    pub guided: Guided,
}

/// `reasoning` of a Responses request: its fields as OpenAI publishes them, any other a 400
/// naming it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reasoning {
    pub effort: Option<String>,
    /// A summary of the thought: none is written here (informational).
    #[serde(default, rename = "summary")]
    _summary: Option<Value>,
    /// The deprecated name of `summary` (informational).
    #[serde(default, rename = "generate_summary")]
    _generate_summary: Option<Value>,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Text {
    format: Option<Format>,
}

/// `text.format`: the chat endpoint's `response_format`, with the schema's fields beside its
/// type rather than under `json_schema`.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
enum Format {
    Text,
    JsonObject,
    JsonSchema(JsonSchemaFormat),
}

/// The include value that asks for the answer's log-probabilities.
pub const LOGPROBS: &str = "message.output_text.logprobs";

/// Checks `include`'s values: those of OpenAI's hosted tools and images add nothing here,
/// where none of those items exist; `reasoning.encrypted_content` adds nothing either, since
/// a thought is not kept to be given back (a reasoning item sent back adds nothing to the
/// input); [`LOGPROBS`] reports the answer's log-probabilities. Any other value is a typo.
///
/// # Errors
/// A 400 naming the value.
pub fn check_include(include: &[String]) -> Result<(), ApiError> {
    const NOTHING_HERE: &[&str] = &[
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
    ];
    for value in include {
        match value.as_str() {
            v if NOTHING_HERE.contains(&v) || v == LOGPROBS => {}
            other => return Err(ApiError::bad(format!("include {other:?}: no such value"))),
        }
    }
    Ok(())
}

/// `text.format` as the chat endpoint's `response_format`.
pub fn response_format(text: Option<&Value>) -> Result<Option<ResponseFormat>, ApiError> {
    let Some(text) = text else {
        return Ok(None);
    };
    let text: Text = serde_json::from_value(text.clone())
        .map_err(|e| ApiError::bad(format!("invalid text.format: {e}")))?;
    Ok(text.format.map(|f| match f {
        Format::Text => ResponseFormat::Text,
        Format::JsonObject => ResponseFormat::JsonObject,
        Format::JsonSchema(json_schema) => ResponseFormat::JsonSchema { json_schema },
    }))
}

#[derive(Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Item>),
}

/// An input item: a message (`{"role", "content"}`, with or without `"type": "message"`), a
/// function call the model made, a call's output, a reasoning item given back, or a
/// compaction item.
#[derive(Deserialize)]
pub struct Item {
    #[serde(rename = "type")]
    kind: Option<String>,
    role: Option<String>,
    content: Option<Content>,
    call_id: Option<String>,
    name: Option<String>,
    arguments: Option<String>,
    output: Option<Content>,
    encrypted_content: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

impl Content {
    /// The text of its text parts.
    fn text(&self) -> Result<String, ApiError> {
        let parts = match self {
            Content::Text(t) => return Ok(t.clone()),
            Content::Parts(parts) => parts,
        };
        let mut text = String::new();
        for p in parts {
            match (p.kind.as_str(), &p.text) {
                ("input_text" | "output_text", Some(t)) => text.push_str(t),
                (kind, _) => {
                    return Err(ApiError::bad(format!(
                        "content parts of type {kind:?} are not supported: text only"
                    )))
                }
            }
        }
        Ok(text)
    }
}

impl Input {
    /// Whether the input ends with a `compaction_trigger` item: the response is then a
    /// compaction of the context.
    ///
    /// # Errors
    /// A 400 for a trigger before the last item.
    pub fn compaction_trigger(&self) -> Result<bool, ApiError> {
        let Input::Items(items) = self else {
            return Ok(false);
        };
        let trigger = |i: &Item| i.kind.as_deref() == Some("compaction_trigger");
        let last = items.last().is_some_and(trigger);
        if items.iter().rev().skip(1).any(trigger) {
            return Err(ApiError::bad(
                "a compaction_trigger input item must be the last input item",
            ));
        }
        Ok(last)
    }

    /// Appends the input to `messages`, the conversation so far.
    pub fn append_to(&self, messages: &mut Vec<Message>) -> Result<(), ApiError> {
        match self {
            Input::Text(t) => messages.push(Message::new("user", t.clone())),
            Input::Items(items) => {
                for item in items {
                    item.append_to(messages)?;
                }
            }
        }
        Ok(())
    }
}

impl Item {
    fn append_to(&self, messages: &mut Vec<Message>) -> Result<(), ApiError> {
        let need = |field: Option<&String>, what: &str| {
            field
                .cloned()
                .ok_or_else(|| ApiError::bad(format!("a {what} input item needs its {what}")))
        };
        match self.kind.as_deref().unwrap_or("message") {
            "message" => messages.push(self.message()?),
            // A reply's calls are its message's: they join the answer text before them.
            "function_call" => {
                let call = ToolCall::new(
                    need(self.call_id.as_ref(), "call_id")?,
                    need(self.name.as_ref(), "name")?,
                    need(self.arguments.as_ref(), "arguments")?,
                );
                match messages.last_mut() {
                    Some(m) if m.role == "assistant" => m.tool_calls.push(call),
                    _ => messages.push(Message::new("assistant", "").with_tool_calls(vec![call])),
                }
            }
            "function_call_output" => {
                let output = match &self.output {
                    Some(o) => o.text()?,
                    None => return Err(ApiError::bad("a function_call_output needs its output")),
                };
                let call = need(self.call_id.as_ref(), "call_id")?;
                messages.push(Message::new("tool", output).answering(call));
            }
            // Thoughts do not stay in a conversation (its template drops them from history,
            // and the stored conversation keeps none), so one given back adds nothing.
            "reasoning" => {}
            // What it asks is read by `Input::compaction_trigger`.
            "compaction_trigger" => {}
            "compaction" => {
                let content = self.encrypted_content.as_deref().ok_or_else(|| {
                    ApiError::bad("a compaction input item needs its encrypted_content")
                })?;
                messages.push(super::compact::message(content)?);
            }
            other => {
                return Err(ApiError::bad(format!(
                    "input items of type {other:?} are not supported: message, function_call, \
                     function_call_output, reasoning, compaction and compaction_trigger are"
                )))
            }
        }
        Ok(())
    }

    fn message(&self) -> Result<Message, ApiError> {
        let role = match self.role.as_deref() {
            Some("developer" | "system") => "system",
            Some(r @ ("user" | "assistant")) => r,
            other => return Err(ApiError::bad(format!("an input message's role {other:?}"))),
        };
        match &self.content {
            Some(c) => Ok(Message::new(role, c.text()?)),
            None => Err(ApiError::bad("an input message needs content")),
        }
    }
}

/// The Responses API's function tools (`{"type": "function", "name", "parameters", ...}`) in
/// the chat endpoint's shape (`{"type": "function", "function": {...}}`), which templates
/// take. Other tool types (hosted search, code interpreters) are refused.
pub fn chat_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    tools
        .iter()
        .map(|t| match t.as_object() {
            Some(o) if o.get("type") == Some(&json!("function")) => {
                let mut function = o.clone();
                function.remove("type");
                Ok(json!({"type": "function", "function": function}))
            }
            _ => Err(ApiError::bad(format!(
                "tools of type {} are not supported: function tools only",
                t["type"]
            ))),
        })
        .collect()
}

/// `tool_choice` in the chat endpoint's shape: a named function's `{"type": "function",
/// "name"}` becomes `{"type": "function", "function": {"name"}}`.
pub fn chat_tool_choice(choice: Option<&Value>) -> Result<Option<Value>, ApiError> {
    match choice {
        Some(Value::Object(o)) => match (o.get("type"), o.get("name")) {
            (Some(t), Some(name)) if t == "function" => Ok(Some(
                json!({"type": "function", "function": {"name": name}}),
            )),
            _ => Err(ApiError::bad(format!(
                "tool_choice {} is not valid: \"auto\", \"none\", \"required\" or \
                 {{\"type\": \"function\", \"name\": ...}}",
                Value::Object(o.clone())
            ))),
        },
        other => Ok(other.cloned()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn input(v: Value) -> Vec<Message> {
        let input: Input = serde_json::from_value(v).unwrap();
        let mut messages = vec![Message::new("user", "Fix it.")];
        input.append_to(&mut messages).unwrap();
        messages
    }

    #[test]
    fn calls_join_the_answer_before_them_and_outputs_answer_them() {
        let m = input(json!([
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Reading.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "read", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "ls", "arguments": "{}"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "call_1", "output": "text"},
            {"type": "function_call_output", "call_id": "call_2", "output": [
                {"type": "input_text", "text": "a.py"}]},
        ]));
        assert_eq!(m.len(), 4, "{m:?}");
        assert_eq!(m[1].content, "Reading.");
        let names: Vec<&str> = m[1].tool_calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["read", "ls"]);
        assert_eq!(
            (m[2].role.as_str(), m[2].content.as_str()),
            ("tool", "text")
        );
        assert_eq!(m[3].tool_call_id.as_deref(), Some("call_2"));
        assert_eq!(m[3].content, "a.py");
        // A call with no answer text before it is an assistant message of its own.
        let m = input(
            json!([{"type": "function_call", "call_id": "c", "name": "f",
            "arguments": "{}"}]),
        );
        assert_eq!(
            (m[1].role.as_str(), m[1].tool_calls.len()),
            ("assistant", 1)
        );
    }

    #[test]
    fn malformed_items_and_tools_are_refused_by_name() {
        let refused = |v: Value| {
            let input: Input = serde_json::from_value(v).unwrap();
            input.append_to(&mut Vec::new()).unwrap_err().message
        };
        let e = refused(json!([{"type": "function_call", "name": "f", "arguments": "{}"}]));
        assert!(e.contains("call_id"), "{e}");
        let e = refused(json!([{"type": "function_call_output", "call_id": "c"}]));
        assert!(e.contains("output"), "{e}");
        let e = refused(json!([{"type": "web_search_call", "id": "x"}]));
        assert!(e.contains("web_search_call"), "{e}");
        let e = chat_tools(&[json!({"type": "web_search"})]).unwrap_err();
        assert!(e.message.contains("web_search"), "{}", e.message);
        let e = chat_tool_choice(Some(&json!({"type": "mcp"}))).unwrap_err();
        assert!(e.message.contains("mcp"), "{}", e.message);
    }

    #[test]
    fn a_compaction_trigger_is_read_last_only() {
        let input = |v: Value| -> Input { serde_json::from_value(v).unwrap() };
        let trigger = json!({"type": "compaction_trigger"});
        let hi = json!({"role": "user", "content": "Hi"});
        assert!(input(json!([hi.clone(), trigger.clone()]))
            .compaction_trigger()
            .unwrap());
        assert!(!input(json!([hi.clone()])).compaction_trigger().unwrap());
        assert!(!input(json!("Hi")).compaction_trigger().unwrap());
        let e = input(json!([trigger, hi]))
            .compaction_trigger()
            .unwrap_err();
        assert!(e.message.contains("last"), "{}", e.message);
    }

    #[test]
    fn include_values_are_taken_or_refused_by_name() {
        let include =
            |v: &[&str]| check_include(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert!(include(&[]).is_ok());
        assert!(include(&["reasoning.encrypted_content", "web_search_call.results"]).is_ok());
        assert!(include(&["message.output_text.logprobs"]).is_ok());
        let e = include(&["reasoning.encrypted_contents"])
            .unwrap_err()
            .message;
        assert!(e.contains("reasoning.encrypted_contents"), "{e}");
    }

    #[test]
    fn tools_and_a_named_choice_take_the_chat_shape() {
        let tools = chat_tools(&[json!({"type": "function", "name": "f", "strict": true,
            "parameters": {"type": "object"}})])
        .unwrap();
        assert_eq!(tools[0]["function"]["name"], "f");
        assert_eq!(tools[0]["function"]["parameters"]["type"], "object");
        assert!(tools[0]["function"].get("type").is_none());
        let choice = chat_tool_choice(Some(&json!({"type": "function", "name": "f"}))).unwrap();
        assert_eq!(
            choice,
            Some(json!({"type": "function", "function": {"name": "f"}}))
        );
        let auto = chat_tool_choice(Some(&json!("required"))).unwrap();
        assert_eq!(auto, Some(json!("required")));
    }
}
