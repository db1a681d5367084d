//! The OpenAI wire format: request bodies (parsed by hand from bytes, so that a malformed one
//! gets an OpenAI-style 400 instead of the framework's plain-text rejection), sampling
//! parameters, response and stream chunk bodies, and errors.

use std::collections::HashMap;
use std::time::Duration;

use crate::engine::SamplingParams;
use crate::service::Hints;

use super::error::ApiError;
use super::fields::Endpoint;
use super::structured::{Guided, ResponseFormat};
use super::tools::{WireCall, WireFunction};
pub use super::usage::Usage;

use crate::chat::Constraint;
use crate::model::{GenerationDefaults, Message, ToolCall};
use serde::Deserialize;
use serde_json::Value;

/// `stop`: one string or several.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields `/v1/chat/completions` and `/v1/completions` share. A field of the wrong type,
/// or one the server does not implement ([`parse`]), is a 400.
#[derive(Deserialize, Debug, Default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub min_tokens: Option<usize>,
    pub logit_bias: Option<HashMap<String, f64>>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub min_p: Option<f64>,
    /// vLLM's: tokens that end the reply, beside the model's own.
    pub stop_token_ids: Option<Vec<u32>>,
    pub response_format: Option<ResponseFormat>,
    /// vLLM's guided decoding: the reply follows a JSON schema, a regular expression, one of
    /// some strings, or a grammar (`structured::Guided`).
    #[serde(flatten)]
    pub guided: Guided,
    /// vLLM's: log-probabilities name tokens `token_id:N` instead of by their text.
    #[serde(default)]
    pub return_tokens_as_token_ids: bool,
}

/// vLLM's `/tokenize`: a prompt, or chat messages rendered with the model's template.
#[derive(Deserialize, Debug)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    /// With messages: end with the assistant's turn opening, as a chat request does.
    #[serde(default = "yes")]
    pub add_generation_prompt: bool,
    /// vLLM's: add the begin (and end) tokens the vocabulary asks for around the text. By
    /// default, yes for a prompt (as `/v1/completions` encodes it) and no for messages (the
    /// template writes them).
    pub add_special_tokens: Option<bool>,
}

fn yes() -> bool {
    true
}

/// vLLM's `/detokenize`.
#[derive(Deserialize, Debug)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// Most alternatives a request may ask for per token (vLLM's default `max_logprobs`).
const MAX_TOP_LOGPROBS: usize = 20;

/// Message content: a string, or parts of which the text ones are joined.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize, Debug)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ChatMessage {
    pub role: String,
    /// Null in an assistant message that only calls tools.
    pub content: Option<Content>,
    /// The calls an assistant message made.
    pub tool_calls: Option<Vec<WireCall>>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
    /// The legacy form of `tool_calls`: the one function an assistant message called.
    pub function_call: Option<WireFunction>,
    /// A participant's name; a legacy `function` message names the function it answers.
    pub name: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub common: Common,
    /// Extension: a conversation to continue by name (also the `X-Conversation-Id` header).
    pub conversation_id: Option<String>,
    /// Extension (with a conversation id): keep its KV in memory.
    pub pin: Option<bool>,
    /// Extension (with a conversation id): its next turn is expected in this many seconds.
    pub expect_resume_s: Option<f64>,
    /// Extension (with a conversation id): the conversation ends with this turn; free it.
    #[serde(default)]
    pub end_conversation: bool,
    /// Report each token's log-probability ...
    #[serde(default)]
    pub logprobs: bool,
    /// ... and this many most likely alternatives (0 to 20).
    pub top_logprobs: Option<usize>,
    /// Functions the model may call.
    #[serde(default)]
    pub tools: Vec<Value>,
    pub tool_choice: Option<Value>,
    /// Whether a reply may make several calls (the first only when false).
    pub parallel_tool_calls: Option<bool>,
    /// OpenAI's Predicted Outputs: `{"type": "content", "content": text or text parts}`.
    pub prediction: Option<Prediction>,
    /// The chat template's variables (vLLM's `chat_template_kwargs`).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// How hard a reasoning model thinks (`low`, `medium`, `high`, ...): the template's
    /// `reasoning_effort` variable, as vLLM passes it.
    pub reasoning_effort: Option<String>,
    /// The legacy form of `tools`: the functions' own objects.
    pub functions: Option<Vec<Value>>,
    /// The legacy form of `tool_choice`: `"auto"`, `"none"` or `{"name": ...}`.
    pub function_call: Option<Value>,
}

/// OpenAI's Predicted Outputs: what the reply is expected to be much like.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct Prediction {
    #[serde(rename = "type")]
    pub kind: String,
    pub content: Content,
}

impl Prediction {
    /// The predicted text.
    pub fn text(&self) -> Result<String, ApiError> {
        if self.kind != "content" {
            return Err(ApiError::bad(format!(
                "prediction of type {:?}: \"content\" only",
                self.kind
            )));
        }
        Ok(match &self.content {
            Content::Text(t) => t.clone(),
            Content::Parts(parts) => {
                let texts: Option<String> = (parts.iter())
                    .map(|p| p.text.as_deref().filter(|_| p.kind == "text"))
                    .collect();
                let e = ApiError::bad("prediction: every part of its content is text");
                texts.ok_or(e.with_param("prediction.content"))?
            }
        })
    }
}

/// `prompt` of `/v1/completions`: text, or token ids (one prompt only).
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
    /// Report each token's log-probability and this many most likely alternatives (0 to 20).
    pub logprobs: Option<usize>,
    /// vLLM's: add the begin (and end) tokens the vocabulary asks for around a text prompt
    /// (`add_bos_token`, as llama.cpp and vLLM do); true by default. Token prompts are taken
    /// as they are.
    pub add_special_tokens: Option<bool>,
}

impl CompletionRequest {
    /// `logprobs` as the engine takes it.
    pub fn top_logprobs(&self) -> Result<Option<usize>, ApiError> {
        match self.logprobs {
            Some(n) if n > MAX_TOP_LOGPROBS => Err(ApiError::bad(format!(
                "logprobs must be at most {MAX_TOP_LOGPROBS}"
            ))),
            n => Ok(n),
        }
    }
}

/// A chat request needs a chat template: a base model without one serves completions only.
pub fn check_template(model: &crate::model::Model) -> Result<(), ApiError> {
    match model.template() {
        Some(_) => Ok(()),
        None => Err(ApiError::bad(
            "this model has no chat template, so it serves /v1/completions only: start the \
             server with --chat-template NAME|FILE (built-in: chatml, gemma, llama3) to serve \
             chat requests",
        )),
    }
}

/// Parses a JSON body of `endpoint` into `T`, or a 400 saying what is wrong: malformed JSON, a
/// field of the wrong type, a field the endpoint does not have (refused by name, unless
/// `ignore_unknown`), or one at a value this server does not take ([`Endpoint::check`]).
pub fn parse<T: for<'de> Deserialize<'de>>(
    body: &[u8],
    endpoint: Endpoint,
    ignore_unknown: bool,
) -> Result<T, ApiError> {
    let invalid = |e: serde_json::Error| ApiError::bad(format!("invalid request body: {e}"));
    let value: Value = serde_json::from_slice(body).map_err(invalid)?;
    if let Some(object) = value.as_object() {
        endpoint.check(object, ignore_unknown)?;
    }
    serde_path_to_error::deserialize(value).map_err(|e| ApiError::body_type(&e))
}

impl ChatMessage {
    /// The text the message carries: its content's text parts, then its calls' names and
    /// arguments.
    pub fn text(&self) -> String {
        let mut text = match &self.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => parts.iter().filter_map(|p| p.text.as_deref()).collect(),
        };
        for c in self.tool_calls.iter().flatten() {
            text.push_str(&c.function.name);
            text.push_str(&c.function.arguments);
        }
        text
    }

    /// Bytes of text the message carries (its content and its calls' arguments).
    pub fn text_bytes(&self) -> usize {
        let content = match &self.content {
            None => 0,
            Some(Content::Text(t)) => t.len(),
            Some(Content::Parts(parts)) => parts
                .iter()
                .filter_map(|p| p.text.as_ref())
                .map(String::len)
                .sum(),
        };
        let calls = self
            .tool_calls
            .iter()
            .flatten()
            .map(WireCall::text_bytes)
            .sum::<usize>();
        content + calls
    }

    /// The message as the engine takes it.
    pub fn to_message(&self) -> Result<Message, ApiError> {
        let text = match &self.content {
            None if self.role == "assistant" => String::new(),
            None => {
                return Err(ApiError::bad(format!(
                    "a {} message needs content",
                    self.role
                )))
            }
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::bad(format!(
                                "unsupported content part type {kind:?}"
                            )))
                        }
                    }
                }
                out
            }
        };
        let calls = self.tool_calls.iter().flatten();
        let mut tool_calls = calls
            .map(WireCall::to_call)
            .collect::<Result<Vec<_>, _>>()?;
        // The legacy function-calling messages, in the tools' form: a call's id is its
        // function's name, which the `function` message answering it names.
        if let Some(f) = &self.function_call {
            tool_calls.push(ToolCall::new(
                legacy_call_id(&f.name),
                &f.name,
                &f.arguments,
            ));
        }
        if self.role == "function" {
            let Some(name) = &self.name else {
                return Err(ApiError::bad(
                    "a function message needs the function's name",
                ));
            };
            return Ok(Message::new("tool", text).answering(legacy_call_id(name)));
        }
        if !tool_calls.is_empty() && self.role != "assistant" {
            return Err(ApiError::bad("only assistant messages carry tool_calls"));
        }
        match (self.role.as_str(), &self.tool_call_id) {
            ("tool", None) => Err(ApiError::bad("a tool message needs its tool_call_id")),
            ("tool", Some(id)) => Ok(Message::new("tool", text).answering(id.clone())),
            (_, Some(_)) => Err(ApiError::bad("only tool messages carry a tool_call_id")),
            ("system" | "developer", _) => Ok(Message::new("system", text)),
            ("user", _) => Ok(Message::new("user", text)),
            ("assistant", _) => Ok(Message::new("assistant", text).with_tool_calls(tool_calls)),
            (other, _) => Err(ApiError::bad(format!("unsupported message role {other:?}"))),
        }
    }
}

/// The id a legacy `function_call` takes in the transcript, where every call has one.
fn legacy_call_id(name: &str) -> String {
    format!("call_{name}")
}

/// The chat template's variables of a request: `chat_template_kwargs` (vLLM's), and
/// `reasoning_effort` as the variable of that name unless the kwargs set it.
pub fn template_vars(
    kwargs: Option<&serde_json::Map<String, Value>>,
    reasoning_effort: Option<&str>,
) -> serde_json::Map<String, Value> {
    let mut vars = kwargs.cloned().unwrap_or_default();
    if let Some(effort) = reasoning_effort {
        vars.entry("reasoning_effort")
            .or_insert_with(|| Value::String(effort.to_string()));
    }
    vars
}

/// The longest wait a client may announce (`expect_resume_s`): hints further out say nothing
/// eviction can use, and every duration the server handles stays far from overflow.
pub const MAX_RESUME_S: f64 = 30.0 * 24.0 * 3600.0;

/// The longest conversation name taken (a name is stored under a digest, but is kept whole
/// in memory and in its manifest).
pub const MAX_NAME_BYTES: usize = 1024;

/// Prefixes of the ids the Responses and Conversations APIs give their conversations: a chat
/// name with one would reach (and rewrite) a stored response or conversation.
const RESERVED_PREFIXES: [&str; 2] = ["resp_", "conv_"];

/// The conversation a request names: its `conversation_id`, or the `X-Conversation-Id`
/// header's value (UTF-8, so a name the body can carry the header can too), or none. Refused:
/// an empty name, one longer than [`MAX_NAME_BYTES`], one with control characters, one in
/// the Responses' or Conversations' namespace (`resp_`, `conv_`), a header that is not UTF-8,
/// and a header that names another conversation than the body.
pub fn conversation_name(
    body: Option<&str>,
    header: Option<&[u8]>,
) -> Result<Option<String>, ApiError> {
    let header = match header.map(std::str::from_utf8) {
        Some(Err(_)) => return Err(ApiError::bad("X-Conversation-Id must be UTF-8 text")),
        Some(Ok(h)) => Some(h),
        None => None,
    };
    let name = match (body, header) {
        (Some(b), Some(h)) if b != h => {
            return Err(ApiError::bad(
                "conversation_id and X-Conversation-Id name different conversations",
            ))
        }
        (b, h) => b.or(h),
    };
    match name {
        Some("") => Err(ApiError::bad("conversation_id must not be empty")),
        Some(n) if n.len() > MAX_NAME_BYTES => Err(ApiError::bad(format!(
            "conversation_id is longer than {MAX_NAME_BYTES} bytes"
        ))),
        Some(n) if n.chars().any(char::is_control) => Err(ApiError::bad(
            "conversation_id must not contain control characters",
        )),
        Some(n) if RESERVED_PREFIXES.iter().any(|p| n.starts_with(p)) => {
            Err(ApiError::bad(format!(
                "conversation_id {n:?}: names starting with {} are the Responses' and \
                 Conversations' ids (continue those with previous_response_id or conversation \
                 on /v1/responses)",
                RESERVED_PREFIXES.join(" or ")
            )))
        }
        n => Ok(n.map(str::to_string)),
    }
}

/// Log-probabilities asked for (`wanted`) with `top` alternatives, as the engine takes them
/// (alternatives alone ask for nothing, as on OpenAI's Responses API).
///
/// # Errors
/// A 400 for more than 20 alternatives.
pub fn top_logprobs(wanted: bool, top: Option<usize>) -> Result<Option<usize>, ApiError> {
    match (wanted, top) {
        (_, Some(n)) if n > MAX_TOP_LOGPROBS => Err(ApiError::bad(format!(
            "top_logprobs must be at most {MAX_TOP_LOGPROBS}"
        ))
        .with_param("top_logprobs")),
        (true, n) => Ok(Some(n.unwrap_or(0))),
        (false, _) => Ok(None),
    }
}

impl ChatRequest {
    /// `logprobs` and `top_logprobs` as the engine takes them.
    pub fn top_logprobs(&self) -> Result<Option<usize>, ApiError> {
        match (self.logprobs, self.top_logprobs) {
            (false, Some(_)) => Err(ApiError::bad("top_logprobs needs logprobs: true")),
            (wanted, top) => top_logprobs(wanted, top),
        }
    }

    /// The session hints; `named` says the request names its conversation, which pins and
    /// resume hints need (an unnamed conversation is closed when nobody continues it).
    #[expect(clippy::field_reassign_with_default)]
    pub fn hints(&self, named: bool) -> Result<Hints, ApiError> {
        let expect_resume = match self.expect_resume_s {
            Some(s) if (0.0..=MAX_RESUME_S).contains(&s) => Some(Duration::from_secs_f64(s)),
            Some(_) => {
                return Err(ApiError::bad(format!(
                    "expect_resume_s must be a number of seconds in [0, {MAX_RESUME_S}]"
                )))
            }
            None => None,
        };
        if !named && (self.pin.is_some() || expect_resume.is_some()) {
            return Err(ApiError::bad(
                "pin and expect_resume_s apply to named conversations: give conversation_id",
            ));
        }
        // `Hints` is non-exhaustive: as a dependent must, set its fields on a default.
        let mut hints = Hints::default();
        hints.pin = self.pin;
        hints.expect_resume = expect_resume;
        hints.end = self.end_conversation;
        Ok(hints)
    }
}

/// Most choices one request may ask for (`n`).
pub const MAX_CHOICES: u32 = 16;

impl Common {
    /// How many choices the request asks for (`n`, 1 by default).
    pub fn choices(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n @ 1..=MAX_CHOICES => Ok(n as usize),
            _ => Err(ApiError::bad(format!("n must be in [1, {MAX_CHOICES}]"))),
        }
    }

    /// The engine's sampling parameters; `default_max` when the request names none, and the
    /// model's `defaults` (its `generation_config.json`) for the sampling fields it leaves
    /// unset, as vLLM applies them.
    pub fn params(
        &self,
        default_max: usize,
        defaults: &GenerationDefaults,
    ) -> Result<SamplingParams, ApiError> {
        let max_tokens = self
            .max_completion_tokens
            .or(self.max_tokens)
            .unwrap_or(default_max);
        let top_k = match self.top_k {
            None => defaults.top_k,
            Some(-1) | Some(0) => None,
            Some(k) if k > 0 => Some(k as usize),
            Some(_) => return Err(ApiError::bad("top_k must be -1 or positive")),
        };
        let mut logit_bias = Vec::new();
        for (k, &v) in self.logit_bias.iter().flatten() {
            let id = k
                .parse::<u32>()
                .map_err(|_| ApiError::bad(format!("logit_bias key {k:?} is not a token id")))?;
            if !(-100.0..=100.0).contains(&v) {
                return Err(ApiError::bad("logit_bias values must be in [-100, 100]"));
            }
            logit_bias.push((id, v as f32));
        }
        Ok(SamplingParams::greedy()
            .temperature(self.temperature.or(defaults.temperature).unwrap_or(1.0))
            .top_k(top_k)
            // 1 keeps every token: no truncation. Anything outside (0, 1] is the engine's 400.
            .top_p(self.top_p.or(defaults.top_p).filter(|&p| p != 1.0))
            .seed(self.seed.unwrap_or_else(rand_seed))
            .max_tokens(max_tokens)
            .stop_strings(self.stop_strings())
            .stop_token_ids(self.stop_token_ids.clone().unwrap_or_default())
            .ignore_eos(self.ignore_eos)
            .min_tokens(self.min_tokens.unwrap_or(0))
            .logit_bias(logit_bias)
            // Out-of-range values are the engine's 400.
            .presence_penalty(self.presence_penalty.unwrap_or(0.0))
            .frequency_penalty(self.frequency_penalty.unwrap_or(0.0))
            .repetition_penalty(
                self.repetition_penalty
                    .or(defaults.repetition_penalty)
                    .unwrap_or(1.0),
            )
            .min_p(self.min_p.or(defaults.min_p).unwrap_or(0.0))
            .constraint(match (&self.response_format, self.guided.constraint()?) {
                // Any JSON object, and this schema of an object: the schema holds both (the
                // way code written for vLLM narrows OpenAI's JSON mode).
                (Some(ResponseFormat::JsonObject), Some(Constraint::JsonSchema(s)))
                    if s["type"] == "object" || s.get("properties").is_some() =>
                {
                    Some(Constraint::JsonSchema(s))
                }
                (Some(_), Some(_)) => {
                    return Err(ApiError::bad(
                        "response_format and a guided_* field cannot both hold the reply",
                    ))
                }
                (Some(f), None) => f.constraint()?,
                (None, guided) => guided,
            }))
    }

    pub fn stop_strings(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        }
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect()
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// A seed for a request that names none (sampling then differs from request to request, as
/// OpenAI's does).
fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
