//! Compaction, as OpenAI's Responses API has it: `POST /v1/responses/compact` and a create
//! request's `context_management` (`{"type": "compaction", "compact_threshold": N}`). The
//! model writes a summary of the conversation so far (a turn on it with a compaction prompt,
//! greedy), and the compacted window is the user's messages followed by one compaction item
//! whose `encrypted_content` carries the summary back; given back as input, that item is an
//! assistant message of the summary.
//!
//! What the cache keeps: the summary's turn continues the conversation's own KV (found by
//! content, or by `previous_response_id`), so only the prompt is computed besides the summary;
//! and the compacted window begins as the conversation began (its system prompt and first
//! user message), so the turn after a compaction shares that KV by content and computes only
//! what follows: the summary, the later user messages, and the new input.
//!
//! The content is not encrypted (this server keeps no secret to hide it from its client): it
//! is [`MARK`] and the summary's text. Content without the mark was not made here, and is
//! refused.

use crate::chat::ReasoningStream;
use crate::engine::SamplingParams;
use crate::model::Message;
use crate::service::{Chat, Hints, TurnEnd};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::super::api::{self, Common, Usage};
use super::super::auth::Tenant;
use super::super::error::ApiError;
use super::super::fields::COMPACT_ENDPOINT;
use super::super::random_id::random_id;
use super::super::{check_model_name, now_s, AppState};
use super::input::Input;
use super::{instruct, missing, stored};

/// A `POST /v1/responses/compact` body.
#[derive(Deserialize)]
struct Request {
    model: Option<String>,
    input: Option<Input>,
    instructions: Option<String>,
    previous_response_id: Option<String>,
}

/// `POST /v1/responses/compact`: the compacted window of a conversation (its input, after the
/// stored response `previous_response_id` when given): the user's messages, then a
/// compaction item.
pub async fn compact(State(s): State<AppState>, tenant: Tenant, body: Bytes) -> Response {
    match compacted(&s, &tenant, &body).await {
        Ok(object) => Json(object).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn compacted(s: &AppState, tenant: &Tenant, body: &[u8]) -> Result<Value, ApiError> {
    let request: Request = api::parse(body, COMPACT_ENDPOINT, s.ignore_unknown_fields)?;
    check_model_name(s, request.model.as_deref())?;
    api::check_template(&s.tokens)?;
    // A stored response's conversation lists its tools: the summary's turn renders them as
    // it did, so that its KV is found by content. (Input alone names no tools.)
    let (mut messages, tools, vars) = match &request.previous_response_id {
        Some(previous) => {
            let conv = stored(s, tenant, previous).await?;
            let messages = s
                .service
                .messages(conv)
                .await
                .map_err(|_| missing(previous))?;
            let setup = s.service.with_engine(move |e| {
                let tools = e.tools(conv).map(<[_]>::to_vec).unwrap_or_default();
                let vars = e.template_vars(conv).cloned().unwrap_or_default();
                (tools, vars)
            });
            let (tools, vars) = setup.await.map_err(|e| ApiError::from_engine(&e))?;
            (messages, tools, vars)
        }
        None => (Vec::new(), Vec::new(), serde_json::Map::new()),
    };
    instruct(&mut messages, request.instructions.as_ref());
    if let Some(input) = &request.input {
        input.append_to(&mut messages)?;
    }
    let compaction = summarize(s, &messages, tools, vars).await?;
    let mut output = user_items(&messages)?;
    output.push(compaction.item()?);
    Ok(
        json!({"id": random_id("resp_")?, "object": "response.compaction",
        "created_at": now_s(), "output": output, "usage": compaction.usage()}),
    )
}

/// What the model is asked for the summary: what a continuation needs, since the window keeps
/// only the user's own words besides it.
const PROMPT: &str = "Your context is about to be compacted: everything above except the \
    user's messages will be replaced by what you write now. Write a summary of the \
    conversation for yourself to continue from: the user's goal, what has been done and \
    found (files, commands, results, decisions, tool calls and their outcomes), and what is \
    left to do. Be concise and specific; write only the summary.";

/// The summary message's first line: the model reads the summary back as its own words.
const HEADER: &str = "Summary of the conversation before this point:\n";

/// What a compaction item's content begins with.
pub const MARK: &str = "pensieve-compaction-v1:";

/// The longest summary, in tokens.
const SUMMARY_TOKENS: usize = 512;

/// OpenAI's `frequency_penalty` of the summary's turn (its own tokens only, not the
/// conversation's).
const SUMMARY_FREQUENCY_PENALTY: f32 = 0.5;

/// A compaction made: the summary and the turn that wrote it.
pub struct Compaction {
    pub summary: String,
    pub end: TurnEnd,
}

impl Compaction {
    /// The compaction item's `encrypted_content`.
    pub fn content(&self) -> String {
        content(&self.summary)
    }

    /// The compaction item, as an output lists it.
    pub fn item(&self) -> Result<Value, ApiError> {
        let id = random_id("cmp_")?;
        Ok(json!({"id": id, "type": "compaction", "encrypted_content": self.content()}))
    }

    /// The usage of the summary's turn, in the Responses API's shape.
    pub fn usage(&self) -> Value {
        let u = Usage::of(&self.end);
        json!({"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens})
    }

    /// The context that replaces `messages` ([`window`]).
    pub fn window(&self, messages: &[Message]) -> Vec<Message> {
        window(messages, &self.summary)
    }
}

/// A compaction item's `encrypted_content` for `summary`.
pub fn content(summary: &str) -> String {
    format!("{MARK}{summary}")
}

/// The context that replaces `messages` compacted to `summary`: their system prompt and the
/// user's messages, then the summary.
pub fn window(messages: &[Message], summary: &str) -> Vec<Message> {
    let kept = messages
        .iter()
        .filter(|m| m.role == "system" || m.role == "user");
    let mut window: Vec<Message> = kept.cloned().collect();
    window.push(summary_message(summary));
    window
}

/// The summary in a reply's `text`: a thinking model's thought (told by `split`) is not.
pub fn answer(split: Option<&mut ReasoningStream>, text: &str) -> String {
    let answer = match split {
        Some(split) => {
            let (_, mut answer) = split.push(text);
            answer.push_str(&split.finish().1);
            answer
        }
        None => text.to_string(),
    };
    answer.trim().to_string()
}

/// The user message that asks for the summary.
pub fn prompt() -> Message {
    Message::new("user", PROMPT)
}

/// The summary's sampling: greedy, with repeats of its own words discouraged (a small model's
/// greedy summary otherwise tends to loop to the limit, and the turn after a compaction
/// computes it whole), at most [`SUMMARY_TOKENS`].
///
/// # Errors
/// As [`Common::params`].
pub fn params(s: &AppState) -> Result<SamplingParams, ApiError> {
    let common = Common {
        max_tokens: Some(SUMMARY_TOKENS),
        temperature: Some(0.0),
        frequency_penalty: Some(SUMMARY_FREQUENCY_PENALTY),
        ..Common::default()
    };
    common.params(s.default_max_tokens, s.tokens.generation_defaults())
}

/// The assistant message a compaction item given back as input stands for.
///
/// # Errors
/// A 400 for content this server did not make.
pub fn message(content: &str) -> Result<Message, ApiError> {
    match content.strip_prefix(MARK) {
        Some(summary) => Ok(summary_message(summary)),
        None => Err(ApiError::bad(
            "a compaction item's encrypted_content was not made by this server (compact the \
             input here first)",
        )),
    }
}

fn summary_message(summary: &str) -> Message {
    Message::new("assistant", format!("{HEADER}{summary}"))
}

/// The user's messages of `messages` as the compacted window's input items.
pub fn user_items(messages: &[Message]) -> Result<Vec<Value>, ApiError> {
    let users = messages.iter().filter(|m| m.role == "user");
    users
        .map(|m| {
            let id = random_id("msg_")?;
            Ok(
                json!({"id": id, "type": "message", "status": "completed", "role": "user",
                "content": [{"type": "input_text", "text": m.content}]}),
            )
        })
        .collect()
}

/// Has the model summarize `messages` (a conversation with `tools` and template `vars`), on a
/// turn that ends its conversation: its KV up to the prompt is the conversation's, found by
/// content.
///
/// # Errors
/// A 400 when there is nothing to compact; the turn's failure.
pub async fn summarize(
    s: &AppState,
    messages: &[Message],
    tools: Vec<Value>,
    vars: serde_json::Map<String, Value>,
) -> Result<Compaction, ApiError> {
    if messages.iter().all(|m| m.role == "system") {
        return Err(ApiError::bad("nothing to compact: the input has no items"));
    }
    let mut all = messages.to_vec();
    all.push(prompt());
    let params = params(s)?;
    let hints = Hints {
        end: true,
        ..Hints::default()
    };
    let chat = Chat::new(all)
        .with_tools(tools)
        .with_template_vars(vars)
        .with_hints(hints);
    let engine_error = |e: crate::Error| ApiError::from_engine(&e);
    let turn = s.service.chat(chat, params).await.map_err(engine_error)?;
    let reply = turn.reply().await.map_err(engine_error)?;
    ApiError::of_end(&reply.end)?;
    let mut split = s.reasoning.map(|p| p.stream());
    Ok(Compaction {
        summary: answer(split.as_mut(), &reply.text),
        end: reply.end,
    })
}

/// Compacts `messages` before their new turn (the trailing user messages or tools' results,
/// with the call those results answer): the history before it is summarized, and the window
/// is the history's compacted context followed by the turn. `None` when there is no history
/// to compact.
///
/// # Errors
/// As [`summarize`].
pub async fn before_turn(
    s: &AppState,
    messages: &[Message],
    tools: Vec<Value>,
    vars: serde_json::Map<String, Value>,
) -> Result<Option<(Vec<Message>, Compaction)>, ApiError> {
    let new = |m: &&Message| m.role == "user" || m.role == "tool";
    let mut split = messages.len() - messages.iter().rev().take_while(new).count();
    // Results stay with the call they answer.
    if messages[split..].iter().any(|m| m.role == "tool") {
        split = split.saturating_sub(1);
    }
    let (history, turn) = messages.split_at(split);
    if history.iter().all(|m| m.role == "system") {
        return Ok(None);
    }
    let compaction = summarize(s, history, tools, vars).await?;
    let mut window = compaction.window(history);
    window.extend_from_slice(turn);
    Ok(Some((window, compaction)))
}

/// `context_management` of a create request: the threshold, in the rendered prompt's tokens,
/// past which its context is compacted first; `None` without compaction. A compaction entry
/// without its threshold takes three quarters of `window` (the model's context).
///
/// # Errors
/// A 400 naming what is malformed.
pub fn threshold(management: Option<&Value>, window: usize) -> Result<Option<usize>, ApiError> {
    let entries = match management {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(entries)) => entries,
        Some(other) => {
            return Err(ApiError::bad(format!(
                "context_management {other} is not a list of entries"
            )))
        }
    };
    let mut threshold = None;
    for entry in entries {
        if entry["type"] != "compaction" {
            return Err(ApiError::bad(format!(
                "context_management entry {entry}: only \"compaction\" entries are supported"
            )));
        }
        if let Some(unknown) = entry
            .as_object()
            .and_then(|o| o.keys().find(|k| *k != "type" && *k != "compact_threshold"))
        {
            return Err(ApiError::bad(format!(
                "context_management entry field {unknown:?}: type and compact_threshold are \
                 taken"
            )));
        }
        let n = match &entry["compact_threshold"] {
            Value::Null => window * 3 / 4,
            v => v.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                ApiError::bad(format!(
                    "context_management compact_threshold {v}: a positive number of tokens"
                ))
            })? as usize,
        };
        threshold = Some(threshold.map_or(n, |t: usize| t.min(n)));
    }
    Ok(threshold)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn content_made_here_is_the_summary_and_other_content_is_refused() {
        let m = message(&format!("{MARK}The user wants X.")).unwrap();
        assert_eq!(m.role, "assistant");
        assert!(m.content.ends_with("The user wants X."), "{}", m.content);
        let e = message("gAAAAABo-opaque").unwrap_err();
        assert!(
            e.message.contains("not made by this server"),
            "{}",
            e.message
        );
    }

    #[test]
    fn thresholds_are_read_and_malformed_entries_refused() {
        assert_eq!(threshold(None, 8192).unwrap(), None);
        let t = |v: Value| threshold(Some(&v), 8192);
        assert_eq!(
            t(json!([{"type": "compaction", "compact_threshold": 2000}])).unwrap(),
            Some(2000)
        );
        assert_eq!(t(json!([{"type": "compaction"}])).unwrap(), Some(6144));
        for bad in [
            json!({"type": "compaction"}),
            json!([{"type": "truncation"}]),
            json!([{"type": "compaction", "compact_threshold": 0}]),
            json!([{"type": "compaction", "compact_thresold": 10}]),
        ] {
            assert!(t(bad.clone()).is_err(), "{bad}");
        }
    }
}
