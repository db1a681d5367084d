//! Calls that write the function's name as text, then its arguments as one JSON object,
//! streamed as the model writes it: Mistral's from tokenizer v11 on
//! (`[TOOL_CALLS]NAME[ARGS]{...}`) and DeepSeek's (`function<｜tool▁sep｜>NAME` and a fenced
//! object in V3, `NAME<｜tool▁sep｜>{...}` in V3.1) and harmony's (`NAME ... <|message|>{...}`
//! after ` to=functions.`), each after its opener.

use super::{call_id, Phase, ToolDelta, ToolStream};
use crate::chat::ToolFormat;
use crate::message::ToolCall;

const ARGS: &str = "[ARGS]";
const SEP: &str = "<｜tool▁sep｜>";
/// DeepSeek V3's fence before the arguments' object.
const FENCE: &str = "```json";

/// What ends a call's name in `format`, and what comes before the name (to be dropped).
fn name_bounds(format: ToolFormat) -> (&'static str, Option<&'static str>) {
    match format {
        ToolFormat::DeepSeekV3 => ("\n", Some(SEP)),
        ToolFormat::DeepSeekV31 => (SEP, None),
        ToolFormat::Harmony => ("<|message|>", None),
        _ => (ARGS, None),
    }
}

/// A call as it is read: its name once `[ARGS]` ends it, then its arguments' object.
#[derive(Clone, Debug, Default)]
pub(super) struct NamedCall {
    name: Option<String>,
    /// The arguments' text so far (sent as it grows).
    arguments: String,
    depth: u32,
    in_str: bool,
    escaped: bool,
}

impl ToolStream {
    /// One move inside a call; false when it needs more input.
    pub(super) fn named_step(&mut self, out: &mut Vec<ToolDelta>) -> bool {
        let Phase::Named(call) = &mut self.phase else {
            return false;
        };
        let index = self.calls.len();
        if call.name.is_none() {
            let (end, before) = name_bounds(self.format);
            let Some(at) = self.held.find(end) else {
                return false;
            };
            let (name, kind_given) = match before {
                Some(sep) => match self.held[..at].split_once(sep) {
                    Some((_, name)) => (name.trim().to_string(), true),
                    None => (String::new(), false),
                },
                // Harmony's header goes on after the name (` <|constrain|>json`, `<|channel|>`).
                None if self.format == ToolFormat::Harmony => {
                    let header = &self.held[..at];
                    let end = header.find(|c: char| c.is_whitespace() || c == '<');
                    (header[..end.unwrap_or(at)].to_string(), true)
                }
                None => (self.held[..at].trim().to_string(), true),
            };
            let valid = kind_given && !name.is_empty() && !name.contains(char::is_whitespace);
            self.held.drain(..at + end.len());
            if !valid {
                self.malformed = true;
                self.phase = Phase::Done;
                return true;
            }
            out.push(ToolDelta::Call {
                index,
                id: call_id(self.format, self.seed, index),
                name: name.clone(),
            });
            call.name = Some(name);
            return true;
        }
        if call.arguments.is_empty() {
            let lead = self.held.len() - self.held.trim_start().len();
            self.held.drain(..lead);
            if self.format == ToolFormat::DeepSeekV3 {
                if self.held.starts_with(FENCE) {
                    self.held.drain(..FENCE.len());
                    return true;
                }
                if FENCE.starts_with(self.held.as_str()) {
                    return false;
                }
            }
            match self.held.chars().next() {
                None => return false,
                Some('{') => {}
                Some(_) => {
                    self.malformed = true;
                    self.phase = Phase::Done;
                    return true;
                }
            }
        }
        let mut used = self.held.len();
        let mut closed = false;
        for (at, c) in self.held.char_indices() {
            if call.take(c) {
                used = at + c.len_utf8();
                closed = true;
                break;
            }
        }
        let fragment: String = self.held.drain(..used).collect();
        call.arguments.push_str(&fragment);
        if !fragment.is_empty() {
            out.push(ToolDelta::Arguments { index, fragment });
        }
        if !closed {
            return false;
        }
        let valid = serde_json::from_str::<serde_json::Value>(&call.arguments).is_ok();
        self.calls.push(ToolCall {
            id: call_id(self.format, self.seed, index),
            name: call.name.take().unwrap_or_default(),
            arguments: std::mem::take(&mut call.arguments),
        });
        self.malformed |= !valid;
        self.phase = Phase::Between;
        true
    }
}

impl NamedCall {
    /// Takes the arguments' next character; true when it closes their object.
    fn take(&mut self, c: char) -> bool {
        if self.in_str {
            match (self.escaped, c) {
                (true, _) => self.escaped = false,
                (false, '\\') => self.escaped = true,
                (false, '"') => self.in_str = false,
                _ => {}
            }
            return false;
        }
        match c {
            '"' => self.in_str = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            _ => {}
        }
        false
    }
}
