//! Qwen3-Coder's calls: inside `<tool_call>`, a `<function=NAME>` element whose
//! `<parameter=KEY>` elements hold one value each, on lines of their own:
//!
//! ```text
//! <tool_call>
//! <function=weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! The arguments are the JSON object of the values, each typed by its parameter's schema as
//! vLLM's `qwen3_coder` parser types it (a string where the schema says so or names no type, a
//! number, boolean or `null` where the text is one and the type allows, objects and arrays as
//! the JSON they are written in); they stream one parameter at a time, as each value closes.

use super::{call_id, Phase, ToolDelta, ToolStream};
use crate::message::ToolCall;

const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// A call's element as it is read.
#[derive(Clone, Debug, Default)]
pub(super) struct XmlCall {
    name: Option<String>,
    /// The arguments' JSON text so far (sent as it grows).
    arguments: String,
}

impl ToolStream {
    /// One move inside a call; false when it needs more input.
    pub(super) fn xml_step(&mut self, out: &mut Vec<ToolDelta>) -> bool {
        let Phase::Xml(call) = &mut self.phase else {
            return false;
        };
        let index = self.calls.len();
        let lead = self.held.len() - self.held.trim_start().len();
        let body = &self.held[lead..];
        let tags = match call.name {
            None => &[FUNCTION][..],
            Some(_) => &[PARAMETER, FUNCTION_END][..],
        };
        let Some(&tag) = tags.iter().find(|t| body.starts_with(**t)) else {
            // Wait while what came may still begin a tag; anything else is no call.
            if !body.is_empty() && !tags.iter().any(|t| t.starts_with(body)) {
                self.malformed = true;
                self.phase = Phase::Done;
                return true;
            }
            return false;
        };
        match tag {
            FUNCTION => {
                let Some(end) = body.find('>') else {
                    return false;
                };
                let name = body[FUNCTION.len()..end].trim().to_string();
                out.push(ToolDelta::Call {
                    index,
                    id: call_id(self.format, self.seed, index),
                    name: name.clone(),
                });
                call.name = Some(name);
                self.held.drain(..lead + end + 1);
                true
            }
            PARAMETER => {
                let (Some(open_end), Some(close)) = (body.find('>'), body.find(PARAMETER_END))
                else {
                    return false;
                };
                if close < open_end {
                    self.malformed = true;
                    self.phase = Phase::Done;
                    return true;
                }
                let key = body[PARAMETER.len()..open_end].trim();
                let raw = &body[open_end + 1..close];
                // The value's own lines: the newline after the tag and before the closer
                // are the format's.
                let raw = raw.strip_prefix('\n').unwrap_or(raw);
                let raw = raw.strip_suffix('\n').unwrap_or(raw);
                let kind = (call.name.as_ref())
                    .and_then(|f| self.types.get(f))
                    .and_then(|t| t.get(key));
                let fragment = format!(
                    "{}{}: {}",
                    if call.arguments.is_empty() { "{" } else { ", " },
                    serde_json::Value::String(key.to_string()),
                    typed(raw, kind.map(String::as_str))
                );
                call.arguments.push_str(&fragment);
                out.push(ToolDelta::Arguments { index, fragment });
                self.held.drain(..lead + close + PARAMETER_END.len());
                true
            }
            _ => {
                let fragment = if call.arguments.is_empty() { "{}" } else { "}" };
                call.arguments.push_str(fragment);
                out.push(ToolDelta::Arguments {
                    index,
                    fragment: fragment.to_string(),
                });
                let name = call.name.take().unwrap_or_default();
                let arguments = std::mem::take(&mut call.arguments);
                self.calls.push(ToolCall {
                    id: call_id(self.format, self.seed, index),
                    name,
                    arguments,
                });
                self.held.drain(..lead + FUNCTION_END.len());
                self.phase = Phase::Closing;
                true
            }
        }
    }
}

/// A parameter's text as the JSON value its schema type makes of it.
fn typed(raw: &str, kind: Option<&str>) -> String {
    let string = || serde_json::Value::String(raw.to_string()).to_string();
    let t = raw.trim();
    let json = |ok: fn(&serde_json::Value) -> bool| match serde_json::from_str(t) {
        Ok(v) if ok(&v) => Some(t.to_string()),
        _ => None,
    };
    if t == "null" && kind.is_some_and(|k| !is_string(k)) {
        return "null".into();
    }
    let value = match kind {
        None => None,
        Some(k) if is_string(k) => None,
        Some("integer" | "int") => json(|v| v.is_i64() || v.is_u64()),
        Some("number" | "float") => json(serde_json::Value::is_number),
        Some("boolean" | "bool") => match t.to_ascii_lowercase().as_str() {
            b @ ("true" | "false") => Some(b.to_string()),
            _ => None,
        },
        Some(_) => json(|_| true),
    };
    value.unwrap_or_else(string)
}

fn is_string(kind: &str) -> bool {
    matches!(
        kind,
        "string" | "str" | "text" | "varchar" | "char" | "enum"
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::chat::ToolFormat;

    #[test]
    fn values_are_typed_by_their_parameter_s_schema() {
        let tools = [
            json!({"type": "function", "function": {"name": "edit", "parameters": {
            "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                "ratio": {"type": "number"}, "dry": {"type": "boolean"},
                "lines": {"type": "array"}, "code": {"type": "string"}}}}}),
        ];
        let reply = "Editing.\n<tool_call>\n<function=edit>\n<parameter=path>\n42\n</parameter>\n\
                     <parameter=line>\n7\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n\
                     <parameter=dry>\nTrue\n</parameter>\n<parameter=lines>\n[1, 2]\n</parameter>\n\
                     <parameter=code>\nif a < b:\n    pass\n</parameter>\n<parameter=other>\n3\n\
                     </parameter>\n</function>\n</tool_call>";
        let mut s = ToolFormat::Qwen3Coder.stream(1).with_tools(&tools);
        s.push(reply);
        s.finish();
        let (text, calls) = s.result().unwrap();
        assert_eq!(text, "Editing.");
        assert_eq!(calls[0].name, "edit");
        let args: serde_json::Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(
            args,
            json!({"path": "42", "line": 7, "ratio": 0.5, "dry": true, "lines": [1, 2],
                   "code": "if a < b:\n    pass", "other": "3"})
        );
        // Without schemas, every value is a string; a call cut off is none.
        let (_, calls) = ToolFormat::Qwen3Coder.parse(reply, 1).unwrap();
        assert!(calls[0].arguments.contains(r#""line": "7""#));
        assert!(ToolFormat::Qwen3Coder
            .parse("<tool_call>\n<function=edit>\n<parameter=path>\nx", 1)
            .is_none());
        assert!(ToolFormat::Qwen3Coder
            .parse("<tool_call>\n{\"name\": \"edit\"}\n</tool_call>", 1)
            .is_none());
    }
}
