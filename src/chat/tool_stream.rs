//! Tool calls read from a reply as it streams, in the format of the template's family: the
//! text before the calls goes out as it comes, each call as soon as its name is read, and its
//! arguments as fragments while the model writes them (OpenAI's `delta.tool_calls`). A whole
//! reply is read by the same code ([`ToolFormat::parse`]), so a streamed reply and the same
//! reply whole give the same text, ids, names and arguments.
//!
//! Every format writes a call as a JSON object with a `name` and `arguments` (Llama's
//! `parameters`); a format differs only in where the objects are: Hermes in `<tool_call>`
//! elements, Mistral in the array after `[TOOL_CALLS]`, Llama 3 as the whole reply (after
//! `<|python_tag|>`). The objects are scanned character by character (strings, escapes and
//! nesting), so the arguments' text is known to end without waiting for the whole object.

use std::collections::HashMap;

use super::reasoning::partial_tag;
use super::tools::ToolFormat;
use crate::message::ToolCall;

mod named;
mod xml;

/// What a streamed reply adds, told apart.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolDelta {
    /// Text of the reply before its calls.
    Text(String),
    /// A call begins: its place among the reply's calls, its id and the function's name.
    Call {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments: JSON text as the model writes it; a call's fragments
    /// add up to its arguments.
    Arguments { index: usize, fragment: String },
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";
const DEEPSEEK_OPEN: &str = "<｜tool▁calls▁begin｜>";
const DEEPSEEK_CALL: &str = "<｜tool▁call▁begin｜>";
/// A harmony message's recipient, when it is a function.
const HARMONY_OPEN: &str = " to=functions.";

#[derive(Clone, Debug)]
enum Phase {
    /// The reply's text, until the format's opener.
    Text,
    /// After a call (or Mistral's opener): what separates calls.
    Between,
    /// Inside a call's object.
    Call(Scan),
    /// Inside a Qwen3-Coder call's `<function=...>` element.
    Xml(xml::XmlCall),
    /// A `[TOOL_CALLS]NAME[ARGS]{...}` call: its name, then its arguments' object.
    Named(named::NamedCall),
    /// Hermes: after a call's object, until `</tool_call>`.
    Closing,
    /// The calls are over: anything but whitespace after them makes them malformed.
    Done,
    /// Not calls (a Llama 3 reply that does not open with an object): text to the end.
    Plain,
}

/// Reads the calls of a reply given piece by piece; see the module.
#[derive(Clone, Debug)]
pub struct ToolStream {
    format: ToolFormat,
    seed: u64,
    phase: Phase,
    /// Input not yet consumed: a possible opener's beginning, or trailing whitespace of the
    /// text (sent only if more text follows).
    held: String,
    /// The text sent, then the calls read.
    text: String,
    calls: Vec<ToolCall>,
    /// A call was cut off, lacked a name, or text followed where none may.
    malformed: bool,
    /// Each tool's parameters' JSON types, by function name (`ToolStream::with_tools`).
    types: HashMap<String, HashMap<String, String>>,
}

impl ToolFormat {
    /// A reader of a streamed reply's calls; `seed` makes the calls' ids (a turn's own, so
    /// that ids do not repeat across a conversation's turns).
    pub fn stream(self, seed: u64) -> ToolStream {
        ToolStream {
            format: self,
            seed,
            phase: Phase::Text,
            held: String::new(),
            text: String::new(),
            calls: Vec::new(),
            malformed: false,
            types: HashMap::new(),
        }
    }

    /// The reply's text before its calls (its trailing whitespace trimmed), and the calls,
    /// their ids made from `seed` as [`Self::stream`]'s; `None` when the reply makes no
    /// well-formed call.
    pub fn parse(self, reply: &str, seed: u64) -> Option<(String, Vec<ToolCall>)> {
        let mut s = self.stream(seed);
        s.push(reply);
        s.finish();
        s.result()
    }
}

impl ToolStream {
    /// The reader with the tools offered (OpenAI's `{"type": "function", "function": {...}}`):
    /// formats whose calls write arguments as text (Qwen3-Coder) type each value by its
    /// parameter's schema; values of parameters it does not name stay strings.
    pub fn with_tools(mut self, tools: &[serde_json::Value]) -> Self {
        for t in tools {
            let f = &t["function"];
            let Some(name) = f["name"].as_str() else {
                continue;
            };
            let props = f["parameters"]["properties"].as_object();
            let types = (props.into_iter().flatten())
                .filter_map(|(k, v)| Some((k.clone(), v["type"].as_str()?.to_string())))
                .collect();
            self.types.insert(name.to_string(), types);
        }
        self
    }

    /// Takes the next piece of the reply; returns what it adds.
    pub fn push(&mut self, piece: &str) -> Vec<ToolDelta> {
        self.held.push_str(piece);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// The end of the reply: held text goes out when no call came; a call still open is
    /// malformed.
    pub fn finish(&mut self) -> Vec<ToolDelta> {
        let mut out = Vec::new();
        match &self.phase {
            Phase::Text | Phase::Plain => {
                let rest = std::mem::take(&mut self.held);
                if !rest.is_empty() {
                    self.text.push_str(&rest);
                    out.push(ToolDelta::Text(rest));
                }
            }
            Phase::Call(_) | Phase::Xml(_) | Phase::Named(_) => self.malformed = true,
            // A reply cut off before `</tool_call>` still made its call.
            Phase::Closing | Phase::Between | Phase::Done => {}
        }
        out
    }

    /// The reply's text and calls once it is over ([`ToolFormat::parse`]'s answer).
    pub fn result(&self) -> Option<(String, Vec<ToolCall>)> {
        if self.calls.is_empty() || self.malformed {
            return None;
        }
        Some((self.text.trim_end().to_string(), self.calls.clone()))
    }

    /// One move over `held`; false when it needs more input.
    fn step(&mut self, out: &mut Vec<ToolDelta>) -> bool {
        match &mut self.phase {
            Phase::Text => self.text_step(out),
            Phase::Plain => {
                let rest = std::mem::take(&mut self.held);
                self.text.push_str(&rest);
                out.extend((!rest.is_empty()).then_some(ToolDelta::Text(rest)));
                false
            }
            Phase::Call(scan) => {
                let index = self.calls.len();
                let id = call_id(self.format, self.seed, index);
                let (used, closed) = scan.feed(&self.held, index, &id, out);
                self.held.drain(..used);
                if !closed {
                    return false;
                }
                let Phase::Call(scan) = std::mem::replace(&mut self.phase, Phase::Between) else {
                    return false;
                };
                match scan.call(id) {
                    Some(call) => self.calls.push(call),
                    None => self.malformed = true,
                }
                self.phase = match self.format {
                    ToolFormat::Hermes => Phase::Closing,
                    ToolFormat::Llama3Json => Phase::Done,
                    _ => Phase::Between,
                };
                true
            }
            Phase::Xml(_) => self.xml_step(out),
            Phase::Named(_) => self.named_step(out),
            Phase::Closing => match self.held.find(HERMES_CLOSE) {
                Some(at) => {
                    self.held.drain(..at + HERMES_CLOSE.len());
                    self.phase = Phase::Between;
                    true
                }
                None => false,
            },
            Phase::Between => self.between_step(),
            Phase::Done => {
                self.malformed |= !self.held.trim().is_empty();
                self.held.clear();
                false
            }
        }
    }

    /// Text until the opener: sent but for what may begin the opener and trailing
    /// whitespace.
    fn text_step(&mut self, out: &mut Vec<ToolDelta>) -> bool {
        let open = match self.format {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder => HERMES_OPEN,
            ToolFormat::Mistral | ToolFormat::MistralArgs => MISTRAL_OPEN,
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => DEEPSEEK_OPEN,
            ToolFormat::Harmony => HARMONY_OPEN,
            ToolFormat::Llama3Json => return self.llama_start(),
        };
        let (send, next) = match self.held.find(open) {
            Some(at) => (self.held[..at].trim_end().len(), Some(at + open.len())),
            None => {
                let keep = partial_tag(&self.held, open);
                let body = &self.held[..self.held.len() - keep];
                (body.trim_end().len(), None)
            }
        };
        if send > 0 {
            let text: String = self.held.drain(..send).collect();
            self.text.push_str(&text);
            out.push(ToolDelta::Text(text));
        }
        let Some(next) = next else {
            return false;
        };
        self.held.drain(..next - send);
        // DeepSeek's calls each open after the list's opener.
        self.phase = match self.format {
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => Phase::Between,
            _ => self.call_phase(),
        };
        true
    }

    /// The phase inside a call, after Hermes' or Qwen3-Coder's opener.
    fn call_phase(&self) -> Phase {
        match self.format {
            ToolFormat::Hermes => Phase::Call(Scan::default()),
            ToolFormat::Qwen3Coder => Phase::Xml(xml::XmlCall::default()),
            ToolFormat::MistralArgs
            | ToolFormat::DeepSeekV3
            | ToolFormat::DeepSeekV31
            | ToolFormat::Harmony => Phase::Named(named::NamedCall::default()),
            _ => Phase::Between,
        }
    }

    /// Llama 3: a reply that opens with an object (after `<|python_tag|>`) is a call;
    /// anything else is text.
    fn llama_start(&mut self) -> bool {
        let lead = self.held.trim_start();
        let body = lead.strip_prefix(PYTHON_TAG).map(str::trim_start);
        match (body, lead) {
            (Some(b), _) if b.starts_with('{') => {
                self.held = b.to_string();
                self.phase = Phase::Call(Scan::default());
                true
            }
            (Some(""), _) => false,
            (None, l) if l.starts_with('{') => {
                self.held = l.to_string();
                self.phase = Phase::Call(Scan::default());
                true
            }
            (None, l) if PYTHON_TAG.starts_with(l) => false,
            _ => {
                self.phase = Phase::Plain;
                true
            }
        }
    }

    /// Between calls: Hermes, Qwen3-Coder, Mistral's named calls and DeepSeek's skip to the
    /// next opener; Mistral's list reads its array's punctuation.
    fn between_step(&mut self) -> bool {
        let opener = match self.format {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder => Some(HERMES_OPEN),
            ToolFormat::MistralArgs => Some(MISTRAL_OPEN),
            ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => Some(DEEPSEEK_CALL),
            ToolFormat::Harmony => Some(HARMONY_OPEN),
            _ => None,
        };
        if let Some(open) = opener {
            // Text after the first call is not the reply's content: it is skipped.
            return match self.held.find(open) {
                Some(at) => {
                    self.held.drain(..at + open.len());
                    self.phase = self.call_phase();
                    true
                }
                None => {
                    let keep = partial_tag(&self.held, open);
                    self.held.drain(..self.held.len() - keep);
                    false
                }
            };
        }
        let lead = self.held.len() - self.held.trim_start().len();
        self.held.drain(..lead);
        match self.held.chars().next() {
            None => false,
            Some('[' | ',') => {
                self.held.drain(..1);
                true
            }
            Some('{') => {
                self.phase = Phase::Call(Scan::default());
                true
            }
            Some(']') => {
                self.held.drain(..1);
                self.phase = Phase::Done;
                true
            }
            Some(_) => {
                self.malformed = true;
                self.phase = Phase::Done;
                true
            }
        }
    }
}

/// A call's id: from the turn's `seed` and its place.
fn call_id(format: ToolFormat, seed: u64, index: usize) -> String {
    let mut h = blake3::Hasher::new();
    h.update(&seed.to_le_bytes());
    h.update(&(index as u64).to_le_bytes());
    let digest = h.finalize();
    match format {
        // Mistral's templates refuse any other id than 9 letters and digits.
        ToolFormat::Mistral | ToolFormat::MistralArgs => {
            const ALPHABET: &[u8] =
                b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
            (digest.as_bytes().iter().take(9))
                .map(|&b| ALPHABET[b as usize % ALPHABET.len()] as char)
                .collect()
        }
        _ => format!("call_{}", &digest.to_hex()[..24]),
    }
}

/// A call's JSON object as it is read.
#[derive(Clone, Debug, Default)]
struct Scan {
    /// The object's text from its `{`.
    raw: String,
    depth: u32,
    in_str: bool,
    escaped: bool,
    /// At depth 1: whether the next string is a key (the object's first is).
    value_next: bool,
    /// The key whose value is being read, at depth 1.
    key: String,
    /// Where the current string, and the current depth-1 value, begin in `raw`.
    str_from: usize,
    value_from: Option<usize>,
    name: Option<String>,
    /// The arguments' text, once whole (JSON text; a string value's contents).
    arguments: Option<String>,
    /// Bytes of the arguments' raw text sent as fragments (from their start).
    sent: usize,
    announced: bool,
}

impl Scan {
    /// Reads `input` until the object closes; returns the bytes used and whether it closed.
    /// Sends the call once its name is read, and its arguments as they grow.
    fn feed(
        &mut self,
        input: &str,
        index: usize,
        id: &str,
        out: &mut Vec<ToolDelta>,
    ) -> (usize, bool) {
        for (at, c) in input.char_indices() {
            let p = self.raw.len();
            self.raw.push(c);
            if self.char(c, p) {
                self.announce(index, id, out);
                self.stream_arguments(index, out);
                return (at + c.len_utf8(), true);
            }
        }
        self.announce(index, id, out);
        self.stream_arguments(index, out);
        (input.len(), false)
    }

    /// Takes character `c` at byte `p` of `raw`; true when it closes the object.
    fn char(&mut self, c: char, p: usize) -> bool {
        if self.in_str {
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_str = false;
                if self.depth == 1 {
                    if self.value_next {
                        self.value_done(p + 1);
                    } else {
                        self.key =
                            serde_json::from_str(&self.raw[self.str_from..=p]).unwrap_or_default();
                    }
                }
            }
            return false;
        }
        match c {
            '"' => {
                self.in_str = true;
                self.str_from = p;
                if self.depth == 1 && self.value_next {
                    self.value_from.get_or_insert(p);
                }
            }
            '{' | '[' => {
                if self.depth == 1 && self.value_next {
                    self.value_from.get_or_insert(p);
                }
                self.depth += 1;
            }
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                match self.depth {
                    0 => {
                        self.value_done(p);
                        return true;
                    }
                    1 => self.value_done(p + 1),
                    _ => {}
                }
            }
            ':' if self.depth == 1 => self.value_next = true,
            ',' if self.depth == 1 => {
                self.value_done(p);
                self.value_next = false;
            }
            c if self.depth == 1 && self.value_next && !c.is_whitespace() => {
                self.value_from.get_or_insert(p);
            }
            _ => {}
        }
        false
    }

    /// The depth-1 value begun at `value_from` ends before byte `end` of `raw`.
    fn value_done(&mut self, end: usize) {
        let Some(from) = self.value_from.take() else {
            return;
        };
        let text = self.raw[from..end].trim_end();
        match self.key.as_str() {
            "name" => self.name = serde_json::from_str(text).ok(),
            "arguments" | "parameters" if self.arguments.is_none() => {
                self.arguments = Some(match serde_json::from_str::<String>(text) {
                    Ok(inner) if text.starts_with('"') => inner,
                    _ => text.to_string(),
                });
            }
            _ => {}
        }
        self.value_next = false;
    }

    fn is_arguments(&self) -> bool {
        matches!(self.key.as_str(), "arguments" | "parameters")
    }

    fn announce(&mut self, index: usize, id: &str, out: &mut Vec<ToolDelta>) {
        if let (false, Some(name)) = (self.announced, &self.name) {
            out.push(ToolDelta::Call {
                index,
                id: id.to_string(),
                name: name.clone(),
            });
            self.announced = true;
        }
    }

    /// Sends what is new of the arguments: while an object's text is read, all of it but
    /// trailing whitespace; a string's contents once whole.
    fn stream_arguments(&mut self, index: usize, out: &mut Vec<ToolDelta>) {
        if !self.announced {
            return;
        }
        let text = match (&self.arguments, self.value_from) {
            (Some(whole), _) => whole.as_str(),
            (None, Some(from)) if self.is_arguments() && self.value_next => {
                let raw = &self.raw[from..];
                if raw.starts_with('"') {
                    return;
                }
                raw.trim_end()
            }
            _ => return,
        };
        if self.sent < text.len() && text.is_char_boundary(self.sent) {
            out.push(ToolDelta::Arguments {
                index,
                fragment: text[self.sent..].to_string(),
            });
        }
        self.sent = text.len().max(self.sent);
    }

    /// The call the closed object makes: `None` without a name, or if it is not JSON.
    fn call(self, id: String) -> Option<ToolCall> {
        serde_json::from_str::<serde_json::Value>(&self.raw).ok()?;
        Some(ToolCall {
            id,
            name: self.name?,
            arguments: self.arguments.unwrap_or_else(|| "{}".to_string()),
        })
    }
}
