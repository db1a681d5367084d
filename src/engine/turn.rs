//! A turn from the API edge to its end: [`prepare`] validates it into the tokens the model
//! will see (template, tokenizer, window and budget checks), so nothing past `submit` meets
//! invalid input; [`ActiveTurn`] is the engine's state of a turn while it runs (sampler,
//! streaming detokenizer, reply text, stop rules, timings).

use std::time::Instant;

use super::sampler::Sampler;
use super::{FinishReason, OverflowPolicy, SamplingParams, Turn};
use crate::conversation::Conversation;
use crate::model::{IncrementalDecoder, Message, Model};
use crate::{Error, Result};

/// What bounds a turn's size, from the model and the engine configuration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TurnLimits {
    /// The model's context window.
    pub window: usize,
    /// Device slots one conversation can ever hold (the whole pool).
    pub pool_slots: usize,
    pub chunk_size: usize,
    pub overflow: OverflowPolicy,
}

impl TurnLimits {
    /// Tokens a conversation may reach: the window, capped by the device pool.
    pub fn max_conversation_tokens(&self) -> usize {
        self.window.min(self.pool_slots)
    }
}

/// How much room a turn takes; see [`super::Engine::turn_size`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TurnSize {
    /// Tokens already in the conversation.
    pub history_tokens: usize,
    /// Tokens the turn adds before the reply (the message as templated).
    pub prompt_tokens: usize,
    /// Most tokens the reply can have before the conversation fills the context window or
    /// the device pool (the turn then ends with [`FinishReason::ContextFull`]).
    pub max_reply_tokens: usize,
}

/// A turn checked at the API edge: the tokens to append, and what the transcript records.
#[derive(Debug)]
pub(crate) struct PreparedTurn {
    pub prompt: Vec<u32>,
    pub prompt_text: String,
    pub user_message: Option<Message>,
    pub size: TurnSize,
}

/// Templates and tokenizes `turn` as the continuation of `conv`, and checks that it fits.
///
/// # Errors
/// [`Error::EmptyTurn`], [`Error::TokenOutOfVocab`], [`Error::ContextOverflow`],
/// [`Error::BudgetTooSmall`]; template and tokenizer errors.
pub(crate) fn prepare(
    model: &Model,
    conv: &Conversation,
    turn: Turn,
    limits: &TurnLimits,
) -> Result<PreparedTurn> {
    let (mut prompt, prompt_text, user_message) = match turn {
        Turn::User(text) => {
            if text.trim().is_empty() {
                return Err(Error::EmptyTurn);
            }
            let message = Message::new("user", text.clone());
            let new_text = match model.template() {
                Some(t) => {
                    let mut messages = conv.messages().to_vec();
                    messages.push(message.clone());
                    t.continuation(&messages, conv.seen_text())?
                }
                None => text,
            };
            (model.encode(&new_text)?, new_text, Some(message))
        }
        Turn::Tokens(ids) => {
            if ids.is_empty() {
                return Err(Error::EmptyTurn);
            }
            let vocab = model.config().vocab_size;
            if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::TokenOutOfVocab { id: bad, vocab });
            }
            let text = model.decode(&ids)?;
            (ids, text, None)
        }
    };
    let history = conv.tokens().len();
    if history + prompt.len() >= limits.window {
        let room = limits.window.saturating_sub(history + 1);
        match limits.overflow {
            OverflowPolicy::TruncatePrompt if room > 0 => {
                prompt.drain(..prompt.len() - room);
            }
            _ => {
                return Err(Error::ContextOverflow {
                    position: history + prompt.len(),
                    window: limits.window,
                });
            }
        }
    }
    let chunk = limits.chunk_size;
    let needed = (history + prompt.len() + 1).div_ceil(chunk) * chunk;
    if needed > limits.pool_slots {
        return Err(Error::BudgetTooSmall {
            needed,
            available: limits.pool_slots,
        });
    }
    let size = TurnSize {
        history_tokens: history,
        prompt_tokens: prompt.len(),
        max_reply_tokens: limits.max_conversation_tokens() - history - prompt.len(),
    };
    Ok(PreparedTurn {
        prompt,
        prompt_text,
        user_message,
        size,
    })
}

/// The engine's state of a queued or running turn.
#[derive(Debug)]
pub(crate) struct ActiveTurn {
    params: SamplingParams,
    sampler: Sampler,
    decoder: IncrementalDecoder,
    reply: String,
    generated: Vec<u32>,
    prompt_text: String,
    user_message: Option<Message>,
    prompt_tokens: usize,
    submitted: Instant,
    first_token: Option<Instant>,
}

/// One accepted token: its text, and why the turn ends with it, if it does.
pub(crate) struct Accepted {
    pub text: String,
    pub finish: Option<FinishReason>,
}

impl ActiveTurn {
    /// A turn of `prepared` with `params` (checked by `sampler::validate`), submitted at
    /// `now`.
    pub fn new(prepared: PreparedTurn, params: SamplingParams, now: Instant) -> Self {
        Self {
            sampler: Sampler::new(&params),
            params,
            decoder: IncrementalDecoder::new(),
            reply: String::new(),
            generated: Vec::new(),
            prompt_text: prepared.prompt_text,
            user_message: prepared.user_message,
            prompt_tokens: prepared.size.prompt_tokens,
            submitted: now,
            first_token: None,
        }
    }

    pub fn sampler(&mut self) -> &mut Sampler {
        &mut self.sampler
    }

    /// Takes a generated token; `full` says the conversation reached its longest.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if the token cannot be detokenized.
    pub fn accept(
        &mut self,
        model: &Model,
        token: u32,
        full: bool,
        now: Instant,
    ) -> Result<Accepted> {
        self.first_token.get_or_insert(now);
        self.generated.push(token);
        let p = &self.params;
        let eos = !p.ignore_eos
            && (model.eos_token_ids().contains(&token) || p.stop_token_ids.contains(&token));
        let text = if eos {
            String::new()
        } else {
            self.decoder.push(model.tokenizer(), token)?
        };
        self.reply.push_str(&text);
        let stop_string = p
            .stop_strings
            .iter()
            .any(|s| !s.is_empty() && self.reply.ends_with(s.as_str()));
        let finish = if eos {
            Some(FinishReason::Stop)
        } else if stop_string {
            Some(FinishReason::StopString)
        } else if self.generated.len() >= p.max_tokens {
            Some(FinishReason::Length)
        } else if full {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        Ok(Accepted { text, finish })
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    pub fn output_tokens(&self) -> usize {
        self.generated.len()
    }

    pub fn submitted(&self) -> Instant {
        self.submitted
    }

    pub fn first_token(&self) -> Option<Instant> {
        self.first_token
    }

    /// Records the finished exchange in `conv`'s transcript.
    pub fn record(self, model: &Model, conv: &mut Conversation) {
        // The transcript holds what the model saw: special tokens (an end-of-turn) included.
        let seen = model.decode(&self.generated).unwrap_or_default();
        conv.record_exchange(
            &self.prompt_text,
            self.user_message,
            &seen,
            Message::new("assistant", self.reply),
        );
    }
}
