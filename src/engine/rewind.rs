//! A history the chat template no longer renders as the model saw it. Thinking models'
//! templates drop a reply's thought from the transcript (R1's renders only what follows
//! `</think>`), and others trim replies; a stateless server would feed the next turn the
//! template's rendering, so a stateful one must too, or the two would answer differently.
//! Before a turn, the history is taken back to the last point the rendering still agrees
//! with, and the turn's prompt carries the rendering from there: only the reply is recomputed
//! (its answer, without the thought), never the turns before it.

use super::encode::turn_messages;
use super::{Engine, Turn};
use crate::conversation::{Conversation, Cut, Mark};
use crate::ids::ConversationId;
use crate::model::{common_prefix, Model};
use crate::Result;

/// The tail of `conv`'s history to drop before `turn`, when the template renders the
/// transcript and `turn` otherwise than the model saw it; `None` when the rendering continues
/// what was seen. Messages stay: only tokens and seen text go, back to the latest reply's
/// last token that the rendering agrees with, or else to the latest turn's start that it
/// does (the start of the conversation if none).
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
    let rendered = t.render_with_tools(&all, conv.tools(), true)?;
    if rendered.starts_with(seen) {
        return Ok(None);
    }
    let common = common_prefix(&rendered, seen);
    let to = match conv.reply_start().filter(|m| m.text <= common) {
        Some(start) => within_reply(model, conv, start, common),
        None => conv
            .marks()
            .iter()
            .rev()
            .find(|m| m.text <= common)
            .copied()
            .unwrap_or_default(),
    };
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

/// The latest point of the reply beginning at `start` that ends at or before byte `common` of
/// the seen text: the most of its tokens that decode to a beginning of the reply's text no
/// longer than that (found by bisection: a thought is thousands of tokens).
fn within_reply(model: &Model, conv: &Conversation, start: Mark, common: usize) -> Mark {
    let tokens = conv.tokens().get(start.tokens..).unwrap_or_default();
    let text = conv.seen_text().get(start.text..).unwrap_or_default();
    let room = common - start.text;
    let fits = |n: usize| -> Option<usize> {
        let decoded = model.decode(&tokens[..n]).ok()?;
        (decoded.len() <= room && text.starts_with(&decoded)).then_some(decoded.len())
    };
    let (mut lo, mut hi) = (0, tokens.len());
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        match fits(mid) {
            Some(_) => lo = mid,
            None => hi = mid - 1,
        }
    }
    Mark {
        tokens: start.tokens + lo,
        text: start.text + fits(lo).unwrap_or(0),
        messages: start.messages,
    }
}

impl Engine {
    /// Drops the tail `cut` of conversation `id`'s history (idle: no turn of it is queued),
    /// with its KV; the turn that follows computes the rendering from there. The KV before
    /// the cut in its chunk is kept (copied to a chunk of its own), not recomputed.
    pub(super) fn rewind(&mut self, id: ConversationId, cut: &Cut) {
        if !cut.tokens().is_empty() {
            self.shift_past_cut(id, cut.tokens());
        }
        if let Some(conv) = self.convs.get_mut(&id) {
            conv.apply_cut(cut);
        }
        self.stats.rewound_tokens += cut.tokens().len() as u64;
        self.write_manifest(id);
    }
}
