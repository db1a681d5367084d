//! Tool calling: the calls an assistant message carries, how chat templates see them, and how
//! calls are read back from a reply in the format of the template's family.

use crate::message::ToolCall;
use serde_json::Value;

/// How a chat template's family writes tool calls in a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolFormat {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one element per call
    /// (Hermes; Qwen 2.5 and 3; pensieve's `chatml-tools`).
    Hermes,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral).
    Mistral,
    /// A reply that is one JSON object `{"name": ..., "parameters": {...}}`, possibly after
    /// `<|python_tag|>` (Llama 3.1 to 3.3).
    Llama3Json,
}

impl ToolFormat {
    /// The format of a template that renders tools, from its source; `None` when it takes
    /// no tools.
    pub fn detect(source: &str) -> Option<Self> {
        if !source.contains("tools") {
            return None;
        }
        if source.contains("<tool_call>") {
            Some(Self::Hermes)
        } else if source.contains("[TOOL_CALLS]") {
            Some(Self::Mistral)
        } else if source.contains("<|start_header_id|>") && source.contains("parameters") {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }

    /// The reply's text before its calls, and the calls, each with an id derived from the
    /// reply and its place; `None` when the reply makes no (well-formed) call.
    pub fn parse(self, reply: &str) -> Option<(String, Vec<ToolCall>)> {
        let (text, calls) = match self {
            Self::Hermes => hermes(reply)?,
            Self::Mistral => {
                let at = reply.find("[TOOL_CALLS]")?;
                let list = reply[at + "[TOOL_CALLS]".len()..].trim();
                let calls = serde_json::from_str::<Vec<Value>>(list).ok()?;
                (reply[..at].to_string(), calls)
            }
            Self::Llama3Json => {
                let body = reply.trim();
                let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
                let call = serde_json::from_str::<Value>(body).ok()?;
                (String::new(), vec![call])
            }
        };
        let calls = calls
            .iter()
            .enumerate()
            .map(|(i, c)| call(c, reply, i))
            .collect::<Option<Vec<_>>>()?;
        (!calls.is_empty()).then(|| (text.trim().to_string(), calls))
    }
}

/// The `<tool_call>` elements of a Hermes-style reply, and the text before the first.
fn hermes(reply: &str) -> Option<(String, Vec<Value>)> {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let first = reply.find(OPEN)?;
    let mut calls = Vec::new();
    let mut rest = &reply[first..];
    while let Some(start) = rest.find(OPEN) {
        let body = &rest[start + OPEN.len()..];
        // A reply cut at its length may leave the last element open: read what is there.
        let end = body.find(CLOSE).unwrap_or(body.len());
        calls.push(serde_json::from_str::<Value>(body[..end].trim()).ok()?);
        rest = body.get(end + CLOSE.len()..).unwrap_or("");
    }
    Some((reply[..first].to_string(), calls))
}

/// A call from its JSON: a name, and arguments (`arguments`, or Llama's `parameters`) as JSON
/// text.
fn call(v: &Value, reply: &str, index: usize) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
        None => "{}".to_string(),
    };
    let mut h = blake3::Hasher::new();
    h.update(reply.as_bytes());
    h.update(&(index as u64).to_le_bytes());
    let id = format!("call_{}", &h.finalize().to_hex()[..24]);
    Some(ToolCall {
        id,
        name,
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_family_s_calls_are_read_with_their_arguments() {
        let reply = "Let me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": \
                     {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \
                     \"arguments\": {}}\n</tool_call>";
        let (text, calls) = ToolFormat::Hermes.parse(reply).unwrap();
        assert_eq!(text, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("weather", r#"{"city":"Paris"}"#)
        );
        assert_ne!(calls[0].id, calls[1].id);
        let mistral = r#"[TOOL_CALLS][{"name": "time", "arguments": {"zone": "UTC"}}]"#;
        let (text, calls) = ToolFormat::Mistral.parse(mistral).unwrap();
        assert_eq!((text.as_str(), calls[0].name.as_str()), ("", "time"));
        let llama = r#"<|python_tag|>{"name": "time", "parameters": {"zone": "UTC"}}"#;
        let (_, calls) = ToolFormat::Llama3Json.parse(llama).unwrap();
        assert_eq!(calls[0].arguments, r#"{"zone":"UTC"}"#);
        // Text without calls, or calls that are not JSON, are a plain reply.
        assert!(ToolFormat::Hermes.parse("The weather is fine.").is_none());
        assert!(ToolFormat::Hermes
            .parse("<tool_call>{not json}</tool_call>")
            .is_none());
        assert!(ToolFormat::Llama3Json.parse("Paris is sunny.").is_none());
    }

    #[test]
    fn formats_are_told_by_the_template_source() {
        assert_eq!(
            ToolFormat::detect("{% if tools %}<tools>{% endif %}<tool_call>"),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(ToolFormat::detect("<tool_call> without the list"), None);
        assert_eq!(
            ToolFormat::detect("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"),
            Some(ToolFormat::Mistral)
        );
    }
}
