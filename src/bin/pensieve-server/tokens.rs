//! vLLM's `/tokenize` and `/detokenize`, over the served model's tokenizer and chat template.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::api::{self, ApiError};
use crate::{check_model_name, AppState};

/// vLLM's `/tokenize`: the ids of a prompt (as `/v1/completions` encodes it) or of chat
/// messages rendered with the model's template (as a new conversation's first turn).
pub async fn tokenize(State(s): State<AppState>, body: Bytes) -> Response {
    let answer = (|| {
        let r: api::TokenizeRequest = api::parse_only(&body, api::TOKENIZE_FIELDS)?;
        check_model_name(&s, r.model.as_deref())?;
        let model = &s.tokens;
        let engine = |e: pensieve::Error| ApiError::from_engine(&e);
        let tokens = match (&r.prompt, &r.messages) {
            (Some(prompt), None) => model.encode(prompt).map_err(engine)?,
            (None, Some(messages)) => {
                let messages = messages
                    .iter()
                    .map(api::ChatMessage::to_message)
                    .collect::<Result<Vec<_>, _>>()?;
                let text = model
                    .render_chat(&messages, r.add_generation_prompt)
                    .map_err(engine)?;
                model.encode(&text).map_err(engine)?
            }
            _ => return Err(ApiError::bad("give either prompt or messages")),
        };
        Ok::<_, ApiError>(json!({"tokens": tokens, "count": tokens.len()}))
    })();
    match answer {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// vLLM's `/detokenize`: the text of token ids.
pub async fn detokenize(State(s): State<AppState>, body: Bytes) -> Response {
    let answer = (|| {
        let r: api::DetokenizeRequest = api::parse_only(&body, api::DETOKENIZE_FIELDS)?;
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
