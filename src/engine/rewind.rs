//! A history the chat template no longer renders as the model saw it. Thinking models'
//! templates drop a reply's thought from the transcript (R1's renders only what follows
//! `</think>`), and others trim replies; a stateless server would feed the next turn the
//! template's rendering, so a stateful one must too, or the two would answer differently.
//! Before a turn, the history is taken back to just before the reply the rendering no longer
//! agrees with (its generation prompt), and the turn's prompt carries the rendering from
//! there: only that reply is recomputed (its answer, without the thought), never the turns
//! before it.

use super::encode::{extras, fresh_tokens, turn_messages};
use super::{Engine, Turn};
use crate::chat::common_prefix;
use crate::conversation::{Conversation, Cut, Mark};
use crate::ids::ConversationId;
use crate::model::{Message, Model};
use crate::Result;

/// The tail of `conv`'s history to drop before `turn`, when the template renders the
/// transcript and `turn` otherwise than the model saw it; `None` when the rendering continues
/// what was seen. Messages stay: only tokens and seen text go, back to the latest point before
/// the divergence where a conversation opened with the transcript would split its tokens too
/// ([`before_control`], then the turns' marks; the start of the conversation if none), so
/// that the rendering from there is tokenized exactly as that conversation tokenizes it.
///
/// # Errors
/// The template's.
pub(super) fn rewind(model: &Model, conv: &Conversation, turn: &Turn) -> Result<Option<Cut>> {
    let (Some(t), Some(new)) = (model.template(), turn_messages(turn)) else {
        return Ok(None);
    };
    let seen = conv.seen_text();
    let mut all = conv.messages().to_vec();
    all.extend(new);
    let rendered = t.render_with(&all, extras(conv), true)?;
    if rendered.starts_with(seen) {
        return retokenized(model, conv, &all);
    }
    let common = common_prefix(&rendered, seen);
    if tracing::enabled!(tracing::Level::DEBUG) {
        let around = |t: &str| {
            let end = (common + 80).min(t.len());
            let end = (end..=t.len())
                .find(|&e| t.is_char_boundary(e))
                .unwrap_or(t.len());
            t[common..end].to_string()
        };
        tracing::debug!(
            at = common,
            rendered = around(&rendered),
            seen = around(seen),
            "the template renders the history otherwise than the model saw it"
        );
    }
    let reply = conv
        .reply_start()
        .and_then(|r| before_control(model, conv, r));
    let marks = conv.marks().iter().rev().copied();
    let to = (reply.into_iter().chain(marks))
        .find(|m| m.text <= common)
        .unwrap_or_default();
    let n = conv.messages().len();
    Ok(Some(Cut {
        start: Mark { messages: n, ..to },
        end: Mark {
            tokens: conv.tokens().len(),
            text: seen.len(),
            messages: n,
        },
    }))
}

/// The tail of `conv`'s history to drop when the template renders it as the model saw it but
/// a conversation opened with the transcript (`all`, the new turn's messages last) would
/// tokenize its latest reply otherwise, for a reply that calls tools: the template writes the
/// calls anew from the transcript's `tool_calls` (as it does for a stateless server), and a
/// call a grammar forced may be tokens that are not how its text tokenizes. The reply is then
/// recomputed from the control token before it, as it always was when the template rendered
/// calls otherwise; `None` when its tokens are the text's (its KV is kept). A reply of text
/// alone keeps the tokens the model wrote, as the history has always held them.
fn retokenized(model: &Model, conv: &Conversation, all: &[Message]) -> Result<Option<Cut>> {
    let calls = conv
        .messages()
        .last()
        .is_some_and(|m| m.role == "assistant" && !m.tool_calls.is_empty());
    let (Some(t), Some(reply), true) = (model.template(), conv.reply_start(), calls) else {
        return Ok(None);
    };
    let Some(from) = before_control(model, conv, reply) else {
        return Ok(None);
    };
    let seen = conv.seen_text();
    let fresh = fresh_tokens(model, t, all, extras(conv), from.text..seen.len())?;
    if fresh == conv.tokens()[from.tokens..] {
        return Ok(None);
    }
    tracing::debug!(
        held = conv.tokens().len() - from.tokens,
        fresh = fresh.len(),
        "the latest reply's tokens are not how its text tokenizes: recomputed"
    );
    let n = conv.messages().len();
    Ok(Some(Cut {
        start: Mark {
            messages: n,
            ..from
        },
        end: Mark {
            tokens: conv.tokens().len(),
            text: seen.len(),
            messages: n,
        },
    }))
}

/// The point just before the last control token that precedes the latest reply (which begins
/// at `reply`) in its turn: the first of its generation prompt, as `<|im_start|>` of
/// `<|im_start|>assistant\n`. Tokenizers split text at control tokens before anything else, so
/// the text from there tokenizes the same alone or after the rest, which a point inside the
/// prompt's markup or the reply does not promise. `None` when the turn has no control token
/// there (a template whose markup is plain text in this vocabulary).
fn before_control(model: &Model, conv: &Conversation, reply: Mark) -> Option<Mark> {
    let added = model.tokenizer().get_added_tokens_decoder();
    let tokens = conv.tokens();
    let turn = conv
        .marks()
        .last()
        .map_or(0, |m| m.tokens)
        .min(reply.tokens);
    let at = (turn..reply.tokens)
        .rev()
        .find(|&k| added.get(&tokens[k]).is_some_and(|t| t.special))?;
    let text = model.decode(&tokens[at..reply.tokens]).ok()?;
    let from = reply.text.checked_sub(text.len())?;
    (conv.seen_text().get(from..reply.text) == Some(text.as_str())).then_some(Mark {
        tokens: at,
        text: from,
        messages: reply.messages,
    })
}

impl Engine {
    /// Drops the tail `cut` of conversation `id`'s history (idle: no turn of it is queued),
    /// with its KV; the turn that follows computes the rendering from there. The KV before
    /// the cut in its chunk is kept (copied to a chunk of its own), not recomputed.
    pub(super) fn rewind(&mut self, id: ConversationId, cut: &Cut) {
        self.cut_history(id, cut);
        self.stats.rewound_tokens += cut.tokens().len() as u64;
        self.write_manifest(id);
    }
}
