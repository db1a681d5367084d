//! Public request/response types of the engine: turns, sampling parameters, events, stats.

use std::sync::Arc;
use std::time::Duration;

use crate::ids::{ConversationId, RequestId};
use crate::kv::CostModel;
use crate::model::Message;
use crate::setters::setters;
use crate::Error;

/// One turn's input.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Turn {
    /// A user message, rendered with the model's chat template (only the new turn's text is
    /// tokenized; the history's tokens are reused as generated).
    User(String),
    /// Raw token ids appended to the conversation as they are.
    Tokens(Vec<u32>),
    /// Messages to add before the reply, through the chat template: a `tool` message with a
    /// call's result (or several), or user messages. Roles `user` and `tool` only.
    Messages(Vec<Message>),
}

impl Turn {
    /// A user message.
    pub fn user(text: impl Into<String>) -> Self {
        Turn::User(text.into())
    }
}

/// Options of a new conversation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConversationOptions {
    /// System prompt; the template's default applies when `None`.
    pub system: Option<String>,
    /// A name to store the conversation under in the store
    /// ([`super::EngineConfig::store`]): its state persists after every turn, and a later engine over
    /// the same folder resumes it ([`super::Engine::find`]). Ignored without a store tier.
    pub name: Option<String>,
    /// Earlier messages (user and assistant turns, after the system prompt) the conversation
    /// starts with, as a client that resends its history has them: the first turn computes
    /// them with its own message, or shares their KV where another conversation holds the
    /// same tokens ([`super::EngineConfig::prefix_sharing`]).
    pub history: Vec<Message>,
    /// Tools the assistant may call (OpenAI's `tools` entries: `{"type": "function",
    /// "function": {"name", "description", "parameters"}}`), listed by the chat template
    /// in every turn's prompt. The template must take tools ([`crate::chat::ToolFormat`]).
    pub tools: Vec<serde_json::Value>,
    /// Variables the chat template reads beside the standard ones (vLLM's
    /// `chat_template_kwargs`: Qwen3's `enable_thinking`, gpt-oss's `reasoning_effort`),
    /// fixed for the conversation's life: a fork keeps them, and a store keeps them.
    pub template_vars: serde_json::Map<String, serde_json::Value>,
    /// The host's own data about the conversation (a creation time, tags, its items' ids):
    /// never rendered or read by the engine, kept with the conversation as its history is (a
    /// store writes it in every manifest, a resume brings it back, a fork copies it), so it
    /// needs no table of the host's beside the store. Read with
    /// [`super::Engine::attributes`], changed with [`super::Engine::set_attributes`].
    pub attributes: serde_json::Map<String, serde_json::Value>,
}

setters!(ConversationOptions {
    some_into system: String,
    some_into name: String,
    value history: Vec<Message>,
    value tools: Vec<serde_json::Value>,
    value template_vars: serde_json::Map<String, serde_json::Value>,
    value attributes: serde_json::Map<String, serde_json::Value>,
});

/// How to pick each generated token and when to stop.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct SamplingParams {
    /// 0 means greedy, and so does any temperature below 1e-5 (vLLM's rule: dividing logits
    /// by less overflows them).
    pub temperature: f64,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches `p`.
    pub top_p: Option<f64>,
    /// Seed of the request's sampler.
    pub seed: u64,
    /// Maximum tokens to generate (at least 1).
    pub max_tokens: usize,
    /// Extra tokens that end the turn (the model's end-of-turn tokens always do, unless
    /// `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end the turn when the reply's text ends with one of them.
    pub stop_strings: Vec<String>,
    /// Generate exactly `max_tokens`, ignoring end-of-turn tokens (benchmarks).
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and this many most likely alternatives
    /// ([`Event::Token::logprobs`]; OpenAI's `logprobs`/`top_logprobs`). Log-probabilities
    /// are the model's (before temperature and truncation).
    pub logprobs: Option<usize>,
    /// Generate at least this many tokens before an end-of-turn or stop token may end the
    /// turn (their logits are masked until then; vLLM's `min_tokens`).
    pub min_tokens: usize,
    /// Added to the logits of these tokens before sampling (OpenAI's `logit_bias`: -100 bans
    /// a token, +100 all but forces it).
    pub logit_bias: Vec<(u32, f32)>,
    /// Subtracted from the logit of every token this turn has generated (OpenAI's
    /// `presence_penalty`, -2 to 2; 0 is off).
    pub presence_penalty: f32,
    /// Subtracted from each token's logit once for every time this turn generated it
    /// (OpenAI's `frequency_penalty`, -2 to 2; 0 is off).
    pub frequency_penalty: f32,
    /// Divides the positive logits, and multiplies the negative ones, of every token in the
    /// conversation so far or generated (vLLM's and Hugging Face's `repetition_penalty`; 1 is
    /// off, above 1 discourages repeats).
    pub repetition_penalty: f32,
    /// Drops the tokens whose probability, at the turn's temperature, is below `min_p` times
    /// the most likely one's (vLLM's `min_p`; 0 is off, no effect on greedy decoding).
    pub min_p: f64,
    /// What the reply must match (a JSON schema, any JSON object, a regular expression, a
    /// grammar): decoding is constrained to it, and the reply ends once it is complete.
    pub constraint: Option<crate::chat::Constraint>,
    /// What this turn does when the conversation outgrows the context window, over the
    /// engine's [`super::EngineConfig::overflow`] (OpenAI's `truncation: "auto"` is
    /// [`super::OverflowPolicy::DropOldest`]).
    pub overflow: Option<crate::engine::OverflowPolicy>,
    /// Tokens the reply is expected to be much like (OpenAI's Predicted Outputs: a file being
    /// edited, say): drafted by speculative decoding where the reply follows them, so that it
    /// takes fewer steps. The reply is the same with any prediction or none (the rule that
    /// keeps a draft is the sampler's). Nothing is drafted with speculation off.
    pub prediction: Vec<u32>,
    /// The reply is text, never read as tool calls, while the conversation's tools stay
    /// listed in its prompt (OpenAI's `tool_choice: "none"`, as vLLM serves it): the prompt,
    /// and so the KV reused, is that of the turns that may call them.
    pub text_only: bool,
}

impl SamplingParams {
    /// Greedy decoding of up to 256 tokens.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
            max_tokens: 256,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            min_tokens: 0,
            logit_bias: Vec::new(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
            constraint: None,
            overflow: None,
            prediction: Vec::new(),
            text_only: false,
        }
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

setters!(SamplingParams {
    value temperature: f64,
    some top_k: usize,
    some top_p: f64,
    value seed: u64,
    value max_tokens: usize,
    value stop_token_ids: Vec<u32>,
    value stop_strings: Vec<String>,
    value ignore_eos: bool,
    some logprobs: usize,
    value min_tokens: usize,
    value logit_bias: Vec<(u32, f32)>,
    value presence_penalty: f32,
    value frequency_penalty: f32,
    value repetition_penalty: f32,
    value min_p: f64,
    some constraint: crate::chat::Constraint,
    some overflow: crate::engine::OverflowPolicy,
    value prediction: Vec<u32>,
    value text_only: bool,
});

/// Why a turn ended.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum FinishReason {
    /// An end-of-turn or stop token was generated.
    Stop,
    /// A stop string appeared.
    StopString,
    /// `max_tokens` were generated.
    Length,
    /// The context window is full.
    ContextFull,
    /// Cancelled by the caller.
    Cancelled,
    /// The turn failed with this error. Other conversations are unaffected.
    Failed(Arc<Error>),
}

impl FinishReason {
    pub(crate) fn failed(e: Error) -> Self {
        FinishReason::Failed(Arc::new(e))
    }
}

impl PartialEq for FinishReason {
    /// Failures are equal when they are errors of the same variant (the same failure to a
    /// caller, whatever their details).
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (FinishReason::Failed(a), FinishReason::Failed(b)) => {
                std::mem::discriminant(&**a) == std::mem::discriminant(&**b)
            }
            (a, b) => std::mem::discriminant(a) == std::mem::discriminant(b),
        }
    }
}

/// What happened to one turn.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct TurnStats {
    /// Tokens of the history the turn continued (after any dropped for room): with
    /// `prompt_tokens`, every token the model saw before its reply.
    pub history_tokens: usize,
    /// Tokens of the new turn (after the template).
    pub prompt_tokens: usize,
    /// History tokens whose KV was found in the cache (device or host).
    pub reused_tokens: usize,
    /// Of those, tokens found in the host tier (swapped in).
    pub reused_from_host_tokens: usize,
    /// Of those, tokens read back from the store.
    pub reused_from_store_tokens: usize,
    /// Tokens whose KV had been dropped and was recomputed (history at admission, and work
    /// redone after a suspension).
    pub recomputed_tokens: usize,
    /// Tokens run through the model other than one-token decode steps: the new prompt,
    /// uncomputed history and recomputed tokens.
    pub prefilled_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Time from submission to the first generated token.
    pub ttft: Duration,
    /// Time from submission to the end of the turn.
    pub latency: Duration,
    /// From submission to the first step that ran the turn (vLLM's queue time).
    pub queue_time: Duration,
    /// Tokens drafted for the turn and verified (speculative decoding, from the history or
    /// from [`SamplingParams::prediction`]).
    pub drafted_tokens: usize,
    /// Of those, the ones the sampler agreed with: each a token generated without a step of
    /// its own.
    pub accepted_tokens: usize,
    /// The stop string that ended the reply ([`FinishReason::StopString`]): which of
    /// [`SamplingParams::stop_strings`] appeared first.
    pub stop_string: Option<String>,
}

/// A generated token's log-probability under the model, and the most likely tokens there.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct TokenLogprobs {
    /// The chosen token's log-probability.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Something `step()` reports.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// A generated token and the text it completes (possibly empty mid-character).
    Token {
        /// The turn.
        request: RequestId,
        /// Its conversation.
        conversation: ConversationId,
        /// The token id.
        token: u32,
        /// Text delta.
        text: String,
        /// The token's log-probability and the most likely alternatives, when asked for
        /// ([`SamplingParams::logprobs`]).
        logprobs: Option<TokenLogprobs>,
    },
    /// A turn ended.
    Finished {
        /// The turn.
        request: RequestId,
        /// Its conversation.
        conversation: ConversationId,
        /// Why.
        reason: FinishReason,
        /// Its numbers.
        stats: TurnStats,
    },
}

/// Engine-wide counters since start.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct EngineStats {
    /// `step()` calls that ran a batch.
    pub steps: u64,
    /// Turns finished (any reason).
    pub turns_finished: u64,
    /// Tokens run through the model other than decode steps (prompts, pending, recomputed).
    pub prefilled_tokens: u64,
    /// History tokens reused from the device tier.
    pub reused_device_tokens: u64,
    /// History tokens reused from the host tier.
    pub reused_host_tokens: u64,
    /// History tokens reused from the store.
    pub reused_store_tokens: u64,
    /// Prompt tokens whose KV was found by content, computed for the same tokens by another
    /// conversation (or an earlier copy of this one), and shared instead of prefilled (in
    /// memory: one more reference; on disk: read back, counted in `reused_store_tokens`).
    pub shared_tokens: u64,
    /// Tokens recomputed after a drop (also work redone after a suspension).
    pub recomputed_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Tokens drafted from conversations' histories and verified (speculative decoding).
    pub drafted_tokens: u64,
    /// Of the drafted tokens, those the sampler agreed with: each one a token generated
    /// without a step of its own.
    pub accepted_tokens: u64,
    /// Bytes copied device → host.
    pub bytes_swapped_out: u64,
    /// Bytes copied host → device.
    pub bytes_swapped_in: u64,
    /// Chunks dropped from the device tier.
    pub chunks_dropped_from_device: u64,
    /// Chunks dropped from the host tier.
    pub chunks_dropped_from_host: u64,
    /// Chunks that left the device or host for their stored copy alone (a free eviction).
    pub chunks_to_store: u64,
    /// Chunks that left the device narrow: only the layers that attend to the whole history,
    /// no sliding window reading them again ([`crate::engine::EngineConfig::narrow_windows`]).
    pub narrow_swap_outs: u64,
    /// Narrow chunks recomputed because a turn's sliding windows read them (a rewind past
    /// the latest turn's start, or a recompute just after them).
    pub narrow_recomputed: u64,
    /// Chunks dropped from the store (evicted under its budget, or their file refused).
    pub chunks_dropped_from_store: u64,
    /// The store tier's own counters (writes, reads, refused files by why), when there is one.
    pub store: Option<crate::kv::StoreStats>,
    /// Swap-outs whose copy failed (the chunk was dropped instead).
    pub swap_out_failures: u64,
    /// Swap-ins whose copy failed (the chunk was recomputed instead).
    pub swap_in_failures: u64,
    /// Running turns suspended (swapped out and requeued) for lack of device slots.
    pub suspensions: u64,
    /// Turns waiting to be admitted now.
    pub requests_waiting: usize,
    /// Turns running now (admitted, not finished; suspended ones wait again).
    pub requests_running: usize,
    /// Times the oldest turns of a conversation were dropped for a turn to fit the window
    /// ([`super::OverflowPolicy::DropOldest`]).
    pub context_cuts: u64,
    /// History tokens those cuts dropped.
    pub tokens_cut: u64,
    /// Tokens whose cached KV a cut moved to new positions (re-rotated, not recomputed).
    pub tokens_shifted: u64,
    /// History tokens dropped because the chat template renders them otherwise than the
    /// model saw them (a thinking model's thought, which its template leaves out of the
    /// transcript): the next turn computes the rendering from there.
    pub rewound_tokens: u64,
    /// Device slots in use now.
    pub device_slots_used: usize,
    /// Device slots in total.
    pub device_slots_total: usize,
    /// Host bytes in use now.
    pub host_bytes_used: usize,
    /// Memory that prefix sharing saves now: KV bytes (device and host) held once for several
    /// conversations, counted once per conversation past the first.
    pub shared_bytes_saved: usize,
    /// The recompute cost curve the value policy uses.
    pub cost_model: Option<CostModel>,
    /// Time in `step()` spent admitting, scheduling and evicting (planning, no KV copies).
    pub schedule_time: Duration,
    /// Time spent copying KV between tiers (swap-in, swap-out).
    pub transfer_time: Duration,
    /// Time in the model's forward passes (prefill and decode rows together).
    pub forward_time: Duration,
    /// Of that, time the passes waited for layers of KV still being read from the store
    /// (the part of the reads a pipelined restore did not hide; CPU).
    pub restore_wait_time: Duration,
    /// Time sampling tokens, detokenizing and finishing turns.
    pub commit_time: Duration,
}

impl EngineStats {
    /// Fraction of history tokens found in the device tier.
    pub fn hit_rate_device(&self) -> f64 {
        self.reused_device_tokens as f64 / self.history_tokens().max(1) as f64
    }

    /// Fraction of history tokens found in the host tier.
    pub fn hit_rate_host(&self) -> f64 {
        self.reused_host_tokens as f64 / self.history_tokens().max(1) as f64
    }

    /// Fraction of history tokens found in the store.
    pub fn hit_rate_store(&self) -> f64 {
        self.reused_store_tokens as f64 / self.history_tokens().max(1) as f64
    }

    /// History tokens admitted turns looked up: reused from a tier or recomputed (the
    /// denominator of the hit rates).
    pub fn history_tokens(&self) -> u64 {
        self.reused_device_tokens
            + self.reused_host_tokens
            + self.reused_store_tokens
            + self.recomputed_tokens
    }
}
