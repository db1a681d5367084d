//! A turn from the API edge to its end: [`prepare`] validates it into the tokens the model
//! will see (template, tokenizer, window and budget checks), so nothing past `submit` meets
//! invalid input; [`ActiveTurn`] is the engine's state of a turn while it runs (sampler,
//! streaming detokenizer, reply text, stop rules, timings).

use std::collections::VecDeque;
use std::time::Instant;

use super::encode::{encode, extras, Encoded};
use super::sampler::Sampler;
use super::{FinishReason, OverflowPolicy, SamplingParams, TokenLogprobs, Turn};
use crate::chat::Guide;
use crate::chat::TemplateExtras;
use crate::conversation::{Conversation, Cut, Mark};
use crate::model::{IncrementalDecoder, Message, Model, ToolCall};
use crate::{Error, Result};

/// What bounds a turn's size, from the model and the engine configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
#[non_exhaustive]
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
#[derive(Clone, Debug)]
pub(crate) struct PreparedTurn {
    pub prompt: Vec<u32>,
    pub prompt_text: String,
    pub user_messages: Vec<Message>,
    /// Where the turn begins (recorded with its exchange, a later cut point), if known.
    pub mark: Option<Mark>,
    /// The tail of the history to drop first, which the template renders otherwise
    /// (`super::rewind`).
    pub rewind: Option<Cut>,
    /// The oldest history to drop before the turn runs ([`OverflowPolicy::DropOldest`]),
    /// after the rewind.
    pub cut: Option<Cut>,
    pub size: TurnSize,
}

/// Templates and tokenizes `turn` as the continuation of `conv`, and checks that it fits,
/// leaving room for a reply of up to `max_reply` tokens when the policy drops history.
///
/// # Errors
/// [`Error::EmptyTurn`], [`Error::TokenOutOfVocab`], [`Error::ContextOverflow`],
/// [`Error::BudgetTooSmall`]; template and tokenizer errors.
pub(crate) fn prepare(
    model: &Model,
    conv: &Conversation,
    turn: Turn,
    limits: &TurnLimits,
    max_reply: usize,
) -> Result<PreparedTurn> {
    validate(model, conv, &turn)?;
    let rewind = super::rewind::rewind(model, conv, &turn)?;
    let rewound;
    let conv = match &rewind {
        Some(cut) => {
            rewound = conv.with_cut(cut);
            &rewound
        }
        None => conv,
    };
    let history = conv.tokens().len();
    let enc = encode(
        model,
        conv.messages(),
        extras(conv),
        conv.seen_text(),
        history,
        &turn,
    );
    let mut enc = enc?;
    let limit = limits.max_conversation_tokens();
    let mut cut = None;
    let reply = max_reply.min(limit / 4).max(1);
    if limits.overflow == OverflowPolicy::DropOldest && history + enc.prompt.len() + reply > limit {
        let need = (enc.prompt.len(), reply);
        let chosen = match history {
            0 => choose_unfed_cut(model, conv, &turn, limit, reply)?,
            _ => choose_cut(model, conv, &turn, limit, need)?,
        };
        if let Some((c, e)) = chosen {
            cut = Some(c);
            enc = e;
        }
    }
    let history = history - cut.map_or(0, |c| c.tokens().len());
    let mut prompt = enc.prompt;
    fit(&mut prompt, history, limits)?;
    let size = TurnSize {
        history_tokens: history,
        prompt_tokens: prompt.len(),
        max_reply_tokens: limit - history - prompt.len(),
    };
    Ok(PreparedTurn {
        prompt,
        prompt_text: enc.text,
        user_messages: enc.messages,
        mark: enc.mark,
        rewind,
        cut,
        size,
    })
}

/// Refuses a turn that can never run on `model` in `conv`: empty, a token outside the
/// vocabulary, messages not the user's or tools', tools the template cannot write.
fn validate(model: &Model, conv: &Conversation, turn: &Turn) -> Result<()> {
    match turn {
        Turn::User(text) if text.trim().is_empty() => return Err(Error::EmptyTurn),
        Turn::Tokens(ids) if ids.is_empty() => return Err(Error::EmptyTurn),
        Turn::Messages(m) if m.is_empty() => return Err(Error::EmptyTurn),
        Turn::Tokens(ids) => {
            let vocab = model.config().vocab_size;
            if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::TokenOutOfVocab { id: bad, vocab });
            }
        }
        Turn::Messages(m) => {
            if let Some(bad) = m.iter().find(|m| m.role != "user" && m.role != "tool") {
                return Err(Error::InvalidParams {
                    param: "messages",
                    reason: format!(
                        "a turn's messages are the user's or tools' results, not {:?}",
                        bad.role
                    ),
                });
            }
        }
        Turn::User(_) => {}
    }
    if !conv.tools().is_empty() && model.template().and_then(|t| t.tool_format()).is_none() {
        return Err(Error::Unsupported(
            "tools: this model's chat template takes none (a template such as chatml-tools \
             does)"
                .into(),
        ));
    }
    Ok(())
}

/// Makes `prompt` fit after `history` tokens in the context window (cut at its front, when
/// the policy says so) and the whole in the device pool.
fn fit(prompt: &mut Vec<u32>, history: usize, limits: &TurnLimits) -> Result<()> {
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
    Ok(())
}

/// The drop of the oldest whole turns (between two marks, or a mark and the end of the
/// history) after which `turn` (`prompt` tokens before the drop) fits in `limit` with
/// `reply` tokens to spare, else after which
/// it fits at all, with the turn encoded after it. `None` if no drop makes it fit. A drop is
/// usable only if the template renders the remaining messages as the kept history
/// reads (so the next turn continues it): with a default system prompt that the template
/// adds itself, the first exchange carries it and stays.
fn choose_cut(
    model: &Model,
    conv: &Conversation,
    turn: &Turn,
    limit: usize,
    (prompt, reply): (usize, usize),
) -> Result<Option<(Cut, Encoded)>> {
    let history = conv.tokens().len();
    let end_now = Mark {
        tokens: history,
        text: conv.seen_text().len(),
        messages: conv.messages().len(),
    };
    let marks = conv.marks();
    // The oldest start whose smallest fitting drop keeps a later turn wins at once; a drop
    // of everything to the end, or one that leaves no room for the reply, only if none does.
    let mut last_resort: Option<(Cut, Encoded)> = None;
    let dropped =
        |c: &Option<(Cut, Encoded)>| c.as_ref().map_or(usize::MAX, |(c, _)| c.tokens().len());
    for (i, &start) in marks.iter().enumerate() {
        for &end in marks[i + 1..].iter().chain([&end_now]) {
            let drop = end.tokens.saturating_sub(start.tokens);
            // Too small to make room (the turn's own tokens barely change with the cut).
            if drop == 0 || history - drop + prompt >= limit + 8 {
                continue;
            }
            let cut = Cut { start, end };
            let (messages, seen) = conv.transcript_after(&cut);
            if !continues(model, &messages, extras(conv), &seen, turn)? {
                continue;
            }
            let enc = encode(model, &messages, extras(conv), &seen, history - drop, turn)?;
            let total = history - drop + enc.prompt.len();
            let fits = total + reply <= limit;
            if fits && end != end_now {
                return Ok(Some((cut, enc)));
            }
            if total < limit && (fits || last_resort.is_none()) && drop < dropped(&last_resort) {
                last_resort = Some((cut, enc));
            }
            if fits {
                break;
            }
        }
    }
    Ok(last_resort)
}

/// [`choose_cut`] for a conversation opened with a history the model has not been fed yet (a
/// client resending its whole chat to a server that does not hold it): the fewest oldest
/// exchanges after the system prompt to drop so that `turn` fits in `limit` with `reply`
/// tokens to spare, else so that it fits at all. The cut drops messages and no tokens, so the
/// turn reads exactly as a conversation opened with the kept messages would.
fn choose_unfed_cut(
    model: &Model,
    conv: &Conversation,
    turn: &Turn,
    limit: usize,
    reply: usize,
) -> Result<Option<(Cut, Encoded)>> {
    let messages = conv.messages();
    let first = usize::from(messages.first().is_some_and(|m| m.role == "system"));
    // What stays begins with a user's message, as a chat does.
    let ends: Vec<usize> = (first + 1..=messages.len())
        .filter(|&i| messages.get(i).is_none_or(|m| m.role == "user"))
        .collect();
    let after = |end: usize| -> Result<(Cut, Encoded)> {
        let at = |messages| Mark {
            messages,
            ..Mark::default()
        };
        let cut = Cut {
            start: at(first),
            end: at(end),
        };
        let (kept, seen) = conv.transcript_after(&cut);
        Ok((cut, encode(model, &kept, extras(conv), &seen, 0, turn)?))
    };
    // Dropping more never lengthens the prompt, so the fewest that fit are found by bisection:
    // a handful of encodings of a long history, not one per exchange.
    let fewest = |room: usize| -> Result<Option<(Cut, Encoded)>> {
        let (mut lo, mut hi, mut found) = (0, ends.len(), None);
        while lo < hi {
            let mid = (lo + hi) / 2;
            let candidate = after(ends[mid])?;
            if candidate.1.prompt.len() + room <= limit {
                found = Some(candidate);
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Ok(found)
    };
    match fewest(reply)? {
        Some(c) => Ok(Some(c)),
        None => fewest(1),
    }
}

/// Whether a history whose transcript is `messages` and `seen` is one the template continues
/// with `turn`: what it renders begins with what the model has seen.
fn continues(
    model: &Model,
    messages: &[Message],
    extras: TemplateExtras<'_>,
    seen: &str,
    turn: &Turn,
) -> Result<bool> {
    let (Some(t), Some(new)) = (model.template(), super::encode::turn_messages(turn)) else {
        return Ok(true);
    };
    let mut all = messages.to_vec();
    all.extend(new);
    Ok(t.render_with(&all, extras, true)?.starts_with(seen))
}

/// The engine's state of a queued or running turn.
#[derive(Debug)]
pub(crate) struct ActiveTurn {
    params: SamplingParams,
    sampler: Sampler,
    decoder: IncrementalDecoder,
    /// The reply's text as the client receives it: cut before a stop string.
    reply: String,
    /// Bytes of `reply` handed out in `Token` events; the rest may still begin a stop string.
    emitted: usize,
    generated: Vec<u32>,
    /// Per generated token, the reply's length once it was decoded, and whether it ended on a
    /// whole character (no bytes held by the decoder).
    ends: Vec<(usize, bool)>,
    /// The reply was cut short of its tokens' text (a stop string, a character cut by the
    /// end): the history keeps only what the client received.
    trimmed: bool,
    /// The stop string that ended the reply, if one did (Anthropic's `stop_sequence`).
    stopped_by: Option<String>,
    /// Tokens the conversation held before the turn: a cancelled or failed turn rolls back
    /// to them.
    history: usize,
    prompt_text: String,
    user_messages: Vec<Message>,
    mark: Option<Mark>,
    prompt_tokens: usize,
    submitted: Instant,
    first_token: Option<Instant>,
    /// The sampled tokens' log-probabilities, in order, until each is accepted.
    logprobs: VecDeque<TokenLogprobs>,
}

/// One accepted token: its text, and why the turn ends with it, if it does.
pub(crate) struct Accepted {
    pub text: String,
    pub logprobs: Option<TokenLogprobs>,
    pub finish: Option<FinishReason>,
}

impl ActiveTurn {
    /// A turn of `prepared` with `params` (checked by `sampler::validate`), submitted at
    /// `now`.
    pub fn new(
        prepared: PreparedTurn,
        params: SamplingParams,
        eos: &[u32],
        guide: Option<Guide>,
        now: Instant,
    ) -> Self {
        Self {
            sampler: Sampler::new(&params, eos, guide),
            params,
            decoder: IncrementalDecoder::new(),
            reply: String::new(),
            emitted: 0,
            generated: Vec::new(),
            ends: Vec::new(),
            trimmed: false,
            stopped_by: None,
            history: prepared.size.history_tokens,
            prompt_text: prepared.prompt_text,
            user_messages: prepared.user_messages,
            mark: prepared.mark,
            prompt_tokens: prepared.size.prompt_tokens,
            submitted: now,
            first_token: None,
            logprobs: VecDeque::new(),
        }
    }

    pub fn sampler(&mut self) -> &mut Sampler {
        &mut self.sampler
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Keeps the log-probabilities of a token just sampled for its event (a step may sample
    /// several before the turn takes them).
    pub fn push_logprobs(&mut self, logprobs: TokenLogprobs) {
        self.logprobs.push_back(logprobs);
    }

    /// Takes a generated token; `full` says the conversation reached its longest. The text
    /// returned is what the client may see now: text that could still begin a stop string is
    /// held back until it cannot, and a stop string (matched on the text, across token
    /// boundaries) and all after it is never returned.
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
            && self.generated.len() > p.min_tokens
            && (model.eos_token_ids().contains(&token) || p.stop_token_ids.contains(&token));
        let text = if eos {
            String::new()
        } else {
            self.decoder.push(model.tokenizer(), token)?
        };
        let new_from = self.reply.len();
        self.reply.push_str(&text);
        self.ends
            .push((self.reply.len(), self.decoder.pending() == 0));
        let stop_at = match text.is_empty() {
            true => None,
            false => find_stop(&self.reply, new_from, &p.stop_strings),
        };
        if let Some((at, stop)) = stop_at {
            self.reply.truncate(at.max(self.emitted));
            self.trimmed = true;
            self.stopped_by = Some(p.stop_strings[stop].clone());
        }
        let finish = if eos {
            Some(FinishReason::Stop)
        } else if stop_at.is_some() {
            Some(FinishReason::StopString)
        } else if self.generated.len() >= p.max_tokens {
            Some(FinishReason::Length)
        } else if full {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        // Bytes of a character the end cut in two never reach the client.
        if finish.is_some() && self.decoder.pending() > 0 {
            self.trimmed = true;
        }
        let end = match finish {
            Some(_) => self.reply.len(),
            None => self.reply.len() - stop_prefix(&self.reply, &p.stop_strings),
        };
        let text = self.reply[self.emitted..end].to_string();
        self.emitted = end;
        Ok(Accepted {
            text,
            logprobs: self.logprobs.pop_front(),
            finish,
        })
    }

    /// The stop string that ended the reply, if one did.
    pub fn stopped_by(&self) -> Option<&str> {
        self.stopped_by.as_deref()
    }

    /// Tokens the conversation held before this turn.
    pub fn history_tokens(&self) -> usize {
        self.history
    }

    /// When the reply was cut short of its tokens' text: how many generated tokens its text
    /// keeps whole, and the tokens of the rest of the reply (text of the first token past
    /// them, up to the cut), which the history takes instead of what was generated.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if the rest cannot be tokenized.
    pub fn trim(&self, model: &Model) -> Result<Option<(usize, Vec<u32>)>> {
        if !self.trimmed {
            return Ok(None);
        }
        let (kept, from) = self.kept();
        let rest = &self.reply[from..];
        let tail = match rest.is_empty() {
            true => Vec::new(),
            false => model.encode_text(rest)?,
        };
        Ok(Some((kept, tail)))
    }

    /// The generated tokens whose text lies whole within the reply, and where that text ends.
    fn kept(&self) -> (usize, usize) {
        let len = self.reply.len();
        let whole = |&(_, &(end, clean)): &(usize, &(usize, bool))| clean && end <= len;
        match self.ends.iter().enumerate().rev().find(whole) {
            Some((i, &(end, _))) => (i + 1, end),
            None => (0, 0),
        }
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

    /// The reply's text as the client receives it.
    pub fn reply(&self) -> &str {
        &self.reply
    }

    /// Records the finished exchange in `conv`'s transcript: the reply as the client
    /// received it, with the `calls` read out of it.
    pub fn record(
        self,
        model: &Model,
        conv: &mut Conversation,
        calls: Option<(String, Vec<ToolCall>)>,
    ) {
        // The transcript holds what the model saw: special tokens (an end-of-turn) included.
        let (kept, from) = match self.trimmed {
            true => self.kept(),
            false => (self.generated.len(), self.reply.len()),
        };
        let mut seen = model.decode(&self.generated[..kept]).unwrap_or_default();
        seen.push_str(&self.reply[from..]);
        if let Some(mark) = self.mark {
            conv.add_mark(mark);
        }
        let reply = super::tools::reply_message(model, self.reply, calls);
        let reply_tokens = conv
            .tokens()
            .len()
            .saturating_sub(self.history + self.prompt_tokens);
        conv.record_exchange(
            &self.prompt_text,
            self.user_messages,
            &seen,
            reply,
            reply_tokens,
        );
    }
}

/// Where the first stop string in `reply` begins, and which one it is, searching only matches
/// that end in the text from byte `new_from` on (earlier text was searched before).
fn find_stop(reply: &str, new_from: usize, stops: &[String]) -> Option<(usize, usize)> {
    stops
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.is_empty())
        .filter_map(|(k, s)| {
            let mut from = new_from.saturating_sub(s.len() - 1);
            while !reply.is_char_boundary(from) {
                from -= 1;
            }
            reply[from..].find(s.as_str()).map(|i| (from + i, k))
        })
        .min()
}

/// The length of the longest end of `reply` that is the beginning of a stop string (and so
/// is held back until the next tokens tell).
fn stop_prefix(reply: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .flat_map(|s| {
            (1..s.len())
                .filter(|&k| s.is_char_boundary(k))
                .map(|k| &s[..k])
        })
        .filter(|prefix| reply.ends_with(prefix))
        .map(str::len)
        .max()
        .unwrap_or(0)
}
