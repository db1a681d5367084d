//! Log-probabilities in OpenAI's two formats: chat's `content` entries and the completions
//! API's parallel lists.

use crate::engine::TokenLogprobs;
use crate::model::Model;
use serde_json::{json, Value};

/// One generated token's log-probability and the most likely alternatives, each token as the
/// text it decodes to alone (a piece of a character decodes to U+FFFD), or as `token_id:N`
/// (vLLM's `return_tokens_as_token_ids`, for clients that compare ids).
#[derive(Debug, Clone)]
pub struct Logprob {
    pub token: String,
    /// Bytes of the reply's text the token makes (its `text_offset` step).
    pub len: usize,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

impl Logprob {
    /// `token`'s entry, its alternatives decoded by `model` (or named by id, with `ids`).
    pub fn of(model: &Model, token: u32, l: &TokenLogprobs, ids: bool) -> Self {
        let piece = |id: u32| model.decode(&[id]).unwrap_or_default();
        let name = |id: u32| match ids {
            true => format!("token_id:{id}"),
            false => piece(id),
        };
        Self {
            token: name(token),
            len: piece(token).len(),
            logprob: l.logprob,
            top: l.top.iter().map(|&(id, lp)| (name(id), lp)).collect(),
        }
    }
}

/// One token as OpenAI's chat logprobs give it: text, log-probability and UTF-8 bytes.
fn token_json(token: &str, logprob: f32) -> Value {
    json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
}

/// The `logprobs` of a chat choice (or chunk) for these tokens.
pub fn chat(tokens: &[Logprob]) -> Value {
    json!({ "content": entries(tokens) })
}

/// These tokens' entries as chat's `content` and the Responses API's `output_text` list
/// them: each token's text, log-probability, bytes and `top_logprobs`.
pub fn entries(tokens: &[Logprob]) -> Vec<Value> {
    tokens
        .iter()
        .map(|t| {
            let mut entry = token_json(&t.token, t.logprob);
            entry["top_logprobs"] = t.top.iter().map(|(s, lp)| token_json(s, *lp)).collect();
            entry
        })
        .collect()
}

/// The `logprobs` of a completion choice (or chunk) for these tokens, the first of which
/// starts `offset` bytes into the completion's text.
pub fn completion(tokens: &[Logprob], mut offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        text_offset.push(offset);
        offset += t.len;
    }
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let map: serde_json::Map<String, Value> =
                t.top.iter().map(|(s, lp)| (s.clone(), json!(lp))).collect();
            Value::Object(map)
        })
        .collect();
    json!({
        "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}
