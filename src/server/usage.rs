//! OpenAI's `usage` of a finished request: the tokens the model saw and wrote.

use serde_json::{json, Value};

use crate::service::TurnEnd;

/// Token counts of a finished request, as OpenAI's `usage` reports them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    /// Every token of the prompt (history and new message), as a stateless server counts.
    pub prompt_tokens: usize,
    /// Of those, tokens whose KV came from the cache (any tier, or shared by content).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// With a prediction: the reply's drafted tokens accepted and rejected (OpenAI's
    /// `accepted_prediction_tokens`, `rejected_prediction_tokens`).
    pub prediction: Option<(usize, usize)>,
}

impl Usage {
    /// A finished turn's usage.
    pub fn of(end: &TurnEnd) -> Self {
        Self {
            // What the model saw: a reply cut inside a token (a stop string, the token limit)
            // keeps fewer tokens than it generated, so the history after it tells less.
            prompt_tokens: end.stats.history_tokens + end.stats.prompt_tokens,
            cached_tokens: end.stats.reused_tokens,
            completion_tokens: end.stats.output_tokens,
            prediction: None,
        }
    }

    pub fn json(&self) -> Value {
        let mut v = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        });
        if let Some((accepted, rejected)) = self.prediction {
            v["completion_tokens_details"] = json!({"accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": rejected});
        }
        v
    }
}
