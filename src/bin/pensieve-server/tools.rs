//! Tool calling on the wire: the `tools` a chat request offers, `tool_choice`, the calls an
//! assistant message carries (in requests and in answers), and `tool` messages.

use pensieve::model::{Message, ToolCall};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::ApiError;

/// A call as OpenAI's messages carry it.
#[derive(Deserialize, Debug)]
pub struct WireCall {
    pub id: String,
    #[serde(rename = "type", default = "function")]
    pub kind: String,
    pub function: WireFunction,
}

#[derive(Deserialize, Debug)]
pub struct WireFunction {
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

fn function() -> String {
    "function".into()
}

impl WireCall {
    pub fn to_call(&self) -> Result<ToolCall, ApiError> {
        if self.kind != "function" {
            return Err(ApiError::bad(format!(
                "unsupported tool call type {:?}",
                self.kind
            )));
        }
        Ok(ToolCall {
            id: self.id.clone(),
            name: self.function.name.clone(),
            arguments: self.function.arguments.clone(),
        })
    }
}

/// The tools a request offers the model, checked: `function` entries with a name. With
/// `tool_choice` `"none"` the model is offered none; `"required"` or a named function would
/// need decoding constrained to a call, which this server does not do yet (a 400, never
/// ignored).
pub fn offered(tools: &[Value], choice: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    for t in tools {
        let named = t["function"]["name"]
            .as_str()
            .is_some_and(|n| !n.is_empty());
        if t["type"] != "function" || !named {
            return Err(ApiError::bad(
                "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ));
        }
    }
    match choice {
        None => Ok(tools.to_vec()),
        Some(Value::String(c)) if c == "auto" => Ok(tools.to_vec()),
        Some(Value::String(c)) if c == "none" => Ok(Vec::new()),
        Some(other) => Err(ApiError::bad(format!(
            "tool_choice {other} is not supported (only \"auto\" and \"none\")"
        ))),
    }
}

/// An assistant message's `message` (or stream `delta`) body: its text (null when it only
/// calls tools) and its calls, at most one unless `parallel`.
pub fn message_json(m: &Message, parallel: bool) -> Value {
    if m.tool_calls.is_empty() {
        return json!({"role": "assistant", "content": m.content});
    }
    let keep = if parallel { m.tool_calls.len() } else { 1 };
    let calls: Vec<Value> = m.tool_calls[..keep]
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"index": i, "id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}})
        })
        .collect();
    let content = (!m.content.is_empty()).then_some(m.content.as_str());
    json!({"role": "assistant", "content": content, "tool_calls": calls})
}
