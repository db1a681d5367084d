//! vLLM's `/tokenize` and `/detokenize`, over the served model's tokenizer and chat template.

use std::sync::Arc;

use crate::engine::OverflowPolicy;
use crate::model::Model;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::api;
use super::error::ApiError;
use super::fields::{DETOKENIZE_ENDPOINT, TOKENIZE_ENDPOINT};
use super::{check_model_name, AppState};

/// vLLM's `/tokenize`: the ids of a prompt (as `/v1/completions` encodes it) or of chat
/// messages rendered with the model's template, exactly as a new conversation's first turn
/// feeds them (contents as plain text: a user's `<|im_end|>` stays text).
pub async fn tokenize(State(s): State<AppState>, body: Bytes) -> Response {
    let answer = async {
        let r: api::TokenizeRequest =
            api::parse(&body, TOKENIZE_ENDPOINT, s.ignore_unknown_fields)?;
        check_model_name(&s, r.model.as_deref())?;
        let model = &s.tokens;
        let tokens = match (&r.prompt, &r.messages) {
            (Some(prompt), None) => {
                if let Some(bound) = &s.prompt_bound {
                    bound.check(prompt.len())?;
                }
                encode(model, prompt, r.add_special_tokens.unwrap_or(true)).await?
            }
            (None, Some(messages)) => {
                api::check_template(model)?;
                if let Some(bound) = &s.prompt_bound {
                    bound.check(text_bytes(messages))?;
                }
                let messages = messages
                    .iter()
                    .map(api::ChatMessage::to_message)
                    .collect::<Result<Vec<_>, _>>()?;
                let generation = r.add_generation_prompt;
                let mut ids = match r.add_special_tokens {
                    Some(true) => model.bos_token_id().into_iter().collect(),
                    _ => Vec::new(),
                };
                ids.extend(chat_tokens(model, messages, generation).await?);
                ids
            }
            _ => return Err(ApiError::bad("give either prompt or messages")),
        };
        Ok::<_, ApiError>(json!({"tokens": tokens, "count": tokens.len()}))
    };
    match answer.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// vLLM's `/detokenize`: the text of token ids.
pub async fn detokenize(State(s): State<AppState>, body: Bytes) -> Response {
    let answer = (|| {
        let r: api::DetokenizeRequest =
            api::parse(&body, DETOKENIZE_ENDPOINT, s.ignore_unknown_fields)?;
        check_model_name(&s, r.model.as_deref())?;
        let vocab = s.tokens.config().vocab_size;
        if let Some(&t) = r.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad(format!(
                "token {t} is outside the vocabulary of {vocab}"
            )));
        }
        let text = s
            .tokens
            .decode(&r.tokens)
            .map_err(|e| ApiError::from_engine(&e))?;
        Ok::<_, ApiError>(json!({ "prompt": text }))
    })();
    match answer {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// What must fit in the context window, checked before the engine thread sees a request: a
/// request past it is refused on the request's own task, instead of after the engine thread
/// has tokenized megabytes of it while every stream waited. No token of the vocabulary stands
/// for more than `max_token_bytes` bytes of text, so a text of `n` bytes is at least
/// `n / max_token_bytes` tokens (free to check); past that, a text that could be too long is
/// counted on a blocking thread.
#[derive(Clone, Copy, Debug)]
pub struct PromptBound {
    max_token_bytes: usize,
    window: usize,
    /// Whether a chat's whole transcript must fit (the `error` overflow policy), or only its
    /// new messages (`drop-oldest` drops older turns to make room).
    whole: bool,
}

impl PromptBound {
    /// The bound for `model` with a context window of `window` tokens; `None` under the
    /// `truncate-prompt` policy, which cuts any prompt to fit.
    pub fn new(model: &crate::model::Model, window: usize, policy: OverflowPolicy) -> Option<Self> {
        let whole = match policy {
            OverflowPolicy::Error => true,
            OverflowPolicy::DropOldest => false,
            _ => return None,
        };
        let vocab = model.config().vocab_size as u32;
        let max_token_bytes = (0..vocab)
            .filter_map(|id| model.decode(&[id]).ok())
            .map(|text| text.len())
            .max()
            .unwrap_or(1)
            .max(1);
        Some(Self {
            max_token_bytes,
            window,
            whole,
        })
    }

    /// Refuses `bytes` of text that must be more tokens than the window holds.
    pub fn check(&self, bytes: usize) -> Result<(), ApiError> {
        let at_least = bytes / self.max_token_bytes;
        match at_least > self.window {
            true => Err(self.past(format!("{bytes} bytes of text are at least {at_least}"))),
            false => Ok(()),
        }
    }

    /// Refuses chat messages whose contents are more tokens than the window holds, counted on
    /// a blocking thread (never the engine's, where every stream would wait for it) and only
    /// when their bytes could be: a text has at most a token per byte (one more for a
    /// SentencePiece space marker), and the template only adds to them.
    pub async fn check_messages(
        &self,
        model: &Arc<Model>,
        messages: &[api::ChatMessage],
    ) -> Result<(), ApiError> {
        let new = messages
            .iter()
            .rev()
            .take_while(|m| m.role == "user" || m.role == "tool")
            .count();
        let messages = match self.whole {
            true => messages,
            false => &messages[messages.len() - new..],
        };
        let bytes = text_bytes(messages);
        self.check(bytes)?;
        if bytes + messages.len() <= self.window {
            return Ok(());
        }
        let texts: Vec<String> = messages.iter().map(api::ChatMessage::text).collect();
        let (model, window) = (Arc::clone(model), self.window);
        let counted = tokio::task::spawn_blocking(move || {
            let mut tokens = 0;
            for text in &texts {
                tokens += model.encode_text(text)?.len();
                if tokens > window {
                    break;
                }
            }
            Ok::<_, crate::Error>(tokens)
        });
        let tokens = counted
            .await
            .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "tokenizing failed"))?
            .map_err(|e| ApiError::from_engine(&e))?;
        match tokens > self.window {
            true => Err(self.past(format!("messages hold at least {tokens}"))),
            false => Ok(()),
        }
    }

    /// The refusal of a request whose text is `what` tokens.
    fn past(&self, what: String) -> ApiError {
        ApiError::bad(format!(
            "the request's {what} tokens, past this server's context window of {} tokens",
            self.window
        ))
        .with_code("context_length_exceeded")
    }
}

/// The ids of a raw prompt (`Model::encode_prompt`), computed on a blocking thread: a long
/// text takes a while, which no other request should wait for.
pub async fn encode(
    model: &Arc<Model>,
    text: &str,
    add_special: bool,
) -> Result<Vec<u32>, ApiError> {
    let (model, text) = (Arc::clone(model), text.to_string());
    tokio::task::spawn_blocking(move || model.encode_prompt(&text, add_special))
        .await
        .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "tokenizing failed"))?
        .map_err(|e| ApiError::from_engine(&e))
}

/// The ids a first turn of `messages` feeds (`crate::engine::chat_tokens`), computed on a
/// blocking thread.
async fn chat_tokens(
    model: &Arc<Model>,
    messages: Vec<crate::model::Message>,
    generation: bool,
) -> Result<Vec<u32>, ApiError> {
    let model = Arc::clone(model);
    tokio::task::spawn_blocking(move || crate::engine::chat_tokens(&model, &messages, generation))
        .await
        .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "tokenizing failed"))?
        .map_err(|e| ApiError::from_engine(&e))
}

/// Bytes of text in chat messages: what the bound counts.
pub fn text_bytes(messages: &[api::ChatMessage]) -> usize {
    messages.iter().map(api::ChatMessage::text_bytes).sum()
}

/// The tokens of `messages` as a conversation with `tools` and `vars` renders them, counted on
/// a blocking thread.
pub async fn prompt_tokens(
    s: &AppState,
    messages: Vec<crate::model::Message>,
    tools: Vec<Value>,
    vars: serde_json::Map<String, Value>,
    generation: bool,
) -> Result<usize, ApiError> {
    let model = std::sync::Arc::clone(&s.tokens);
    let counted = tokio::task::spawn_blocking(move || {
        crate::engine::chat_tokens_with(&model, &messages, &tools, Some(&vars), generation)
    });
    let tokens = counted
        .await
        .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "tokenizing failed"))?;
    Ok(tokens.map_err(|e| ApiError::from_engine(&e))?.len())
}
