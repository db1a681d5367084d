//! Per-conversation state the engine keeps beside the KV: the raw-token history (the source of
//! truth, never lost) and the chat transcript the template continues from.
//!
//! Writers: a conversation's tokens change only by a [`Settlement`] (`settle`), which changes
//! its chunk table with them: the scheduler's commit when a step computes tokens, a turn
//! stops or ends; the engine when it trims a reply, rolls a turn back, cuts overflowing
//! history or rewinds. The engine records each finished exchange in the transcript
//! ([`Conversation::record_exchange`]). Where each token's KV lives is the cache manager's
//! chunk table (`crate::kv`), not here.
//!
//! Between turns the conversation keeps [`Mark`]s: the points where a user message begins, in
//! tokens, transcript text and messages at once. Dropping the span between two marks (the
//! oldest turns, when the context window overflows) leaves a history that reads as the
//! template renders the remaining messages.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::ids::ConversationId;
use crate::message::Message;

mod settle;

pub(crate) use settle::{Settlement, Shifted};

/// A point in a conversation where a turn's message begins (or the history could otherwise be
/// cut): as many tokens, transcript bytes and messages come before it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Mark {
    pub tokens: usize,
    pub text: usize,
    pub messages: usize,
}

/// The span of history between two marks, to drop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cut {
    pub start: Mark,
    pub end: Mark,
}

impl Cut {
    /// The token positions it drops.
    pub fn tokens(&self) -> Range<usize> {
        self.start.tokens..self.end.tokens
    }
}

/// How a conversation's drafted tokens fared lately, so that it drafts only what pays: each
/// verified draft position is a trial that succeeds until the first refused token, and the
/// recent successes give the chance that a drafted token is taken. A draft is as long as its
/// last token is still likelier to be taken than the step's price for it; when even one is
/// not, a one-token probe comes after a cool-down that doubles while probes fail.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Acceptance {
    /// Drafted tokens taken, decayed over recent drafts.
    hits: f32,
    /// Draft positions tried (taken ones and the first refused), decayed alike.
    tries: f32,
    /// Decode steps left before the next draft.
    cooldown: u16,
    /// Failed probes in a row.
    misses: u8,
}

impl Acceptance {
    /// The weight of earlier drafts against the latest.
    const DECAY: f32 = 0.9;

    /// The chance that a drafted token is taken, given the one before it was (even odds
    /// before anything is known).
    fn rate(&self) -> f32 {
        ((self.hits + 1.0) / (self.tries + 2.0)).min(0.95)
    }

    /// How many tokens to draft now, up to `max`, when verifying a drafted token costs
    /// `price` (the share of a token's worth of step time it takes; see
    /// `Scheduler::draft_price`): every drafted position whose chance of being reached and
    /// taken exceeds it, or a one-token probe.
    pub fn draft_len(&self, max: usize, price: f32) -> usize {
        if self.cooldown > 0 || max == 0 {
            return 0;
        }
        let (rate, price) = (self.rate(), price.clamp(1e-3, 1.0));
        let worth = (price.ln() / rate.ln()).floor();
        (worth as usize).clamp(1, max)
    }

    /// One decode step of the conversation: `drafted` tokens verified (0: none drafted),
    /// `accepted` of them taken, at `price` per drafted token.
    pub fn record(&mut self, drafted: usize, accepted: usize, price: f32) {
        if drafted == 0 {
            self.cooldown = self.cooldown.saturating_sub(1);
            return;
        }
        let refused = usize::from(accepted < drafted);
        self.hits = Self::DECAY * self.hits + accepted as f32;
        self.tries = Self::DECAY * self.tries + (accepted + refused) as f32;
        self.misses = match accepted {
            0 => self.misses.saturating_add(1).min(6),
            _ => 0,
        };
        if self.rate() <= price {
            self.cooldown = 2 << self.misses;
        }
    }
}

/// One conversation's history.
#[derive(Clone, Debug, Default)]
pub(crate) struct Conversation {
    /// The name it is stored under, for a conversation that persists across restarts.
    name: Option<String>,
    /// Every token the model has been given or has generated, in order.
    tokens: Vec<u32>,
    /// The chat so far, for the template.
    messages: Vec<Message>,
    /// The tools its template lists (OpenAI's `tools` entries), fixed for its life.
    tools: Vec<serde_json::Value>,
    /// The variables its template reads beside the standard ones, fixed for its life.
    template_vars: serde_json::Map<String, serde_json::Value>,
    /// The host's own data kept with it (stored with it; never rendered).
    attributes: serde_json::Map<String, serde_json::Value>,
    /// The text the model has seen, for the template's continuation of the next turn.
    seen_text: String,
    /// Where the recorded turns begin, in order.
    marks: Vec<Mark>,
    /// Where the latest reply begins (after its turn's prompt): where a next turn takes the
    /// history back to when the template renders that reply otherwise than the model saw it
    /// (a thought it drops). Not stored: a resumed conversation goes back to a turn's mark.
    reply_start: Option<Mark>,
    /// How many times its manifest has been stored, by any engine: a shared store's manifest
    /// of a higher revision was written by another engine after this copy.
    revision: u64,
    /// Which writer stored that revision: the state the next write of its manifest continues
    /// (compare-and-set), empty before the first.
    stamp: String,
    /// How its speculative drafts fared lately (not stored: a resumed conversation learns it
    /// again within a few steps).
    pub acceptance: Acceptance,
}

impl Conversation {
    /// A conversation that starts with `messages` (a system prompt, say).
    pub fn new(messages: Vec<Message>) -> Self {
        Self {
            messages,
            ..Self::default()
        }
    }

    /// A conversation restored from its stored parts.
    pub fn restore(
        name: String,
        tokens: Vec<u32>,
        messages: Vec<Message>,
        seen_text: String,
        marks: Vec<Mark>,
    ) -> Self {
        // Marks that do not fit the stored history are not cut points.
        let marks = marks
            .into_iter()
            .filter(|m| {
                m.tokens <= tokens.len()
                    && m.messages <= messages.len()
                    && seen_text.is_char_boundary(m.text)
            })
            .collect();
        Self {
            name: Some(name),
            tokens,
            messages,
            seen_text,
            marks,
            ..Self::default()
        }
    }

    /// The same, with the tools its template lists.
    pub fn with_tools(self, tools: Vec<serde_json::Value>) -> Self {
        Self { tools, ..self }
    }

    pub fn tools(&self) -> &[serde_json::Value] {
        &self.tools
    }

    /// The same, with the variables its template reads.
    pub fn with_template_vars(self, vars: serde_json::Map<String, serde_json::Value>) -> Self {
        Self {
            template_vars: vars,
            ..self
        }
    }

    pub fn template_vars(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.template_vars
    }

    /// The same, with the host's data `attributes`.
    pub fn with_attributes(self, attributes: serde_json::Map<String, serde_json::Value>) -> Self {
        Self { attributes, ..self }
    }

    pub fn attributes(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.attributes
    }

    /// Replaces the host's data.
    pub fn set_attributes(&mut self, attributes: serde_json::Map<String, serde_json::Value>) {
        self.attributes = attributes;
    }

    /// The revision of its stored manifest this copy holds.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The stamp of its stored manifest this copy holds (empty if none).
    pub fn stamp(&self) -> &str {
        &self.stamp
    }

    /// Records that this copy is (or is about to be) stored as `revision`, stamped `stamp`.
    pub fn set_stored(&mut self, revision: u64, stamp: String) {
        self.revision = revision;
        self.stamp = stamp;
    }

    /// The same, stored under `name`.
    pub fn named(self, name: Option<String>) -> Self {
        Self { name, ..self }
    }

    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    pub fn seen_text(&self) -> &str {
        &self.seen_text
    }

    pub fn marks(&self) -> &[Mark] {
        &self.marks
    }

    /// An unnamed copy of the history before turn `k + 1` begins (its first `k` turns); the
    /// whole history when turn `k + 1` has no mark (it has not happened, or the template
    /// gave no cut point there).
    pub fn prefix(&self, k: usize) -> Conversation {
        let Some(&m) = self.marks.get(k) else {
            return self.clone().named(None);
        };
        Conversation {
            name: None,
            tokens: self.tokens[..m.tokens].to_vec(),
            messages: self.messages[..m.messages].to_vec(),
            tools: self.tools.clone(),
            template_vars: self.template_vars.clone(),
            attributes: self.attributes.clone(),
            seen_text: self.seen_text[..m.text].to_string(),
            marks: self.marks[..k].to_vec(),
            reply_start: None,
            revision: 0,
            stamp: String::new(),
            acceptance: self.acceptance,
        }
    }

    /// Where the latest reply begins, while its tokens are all still in the history.
    pub fn reply_start(&self) -> Option<Mark> {
        self.reply_start
    }

    /// Records where a turn begins (before its exchange is recorded); marks stay in order.
    pub fn add_mark(&mut self, mark: Mark) {
        if self.marks.last().is_none_or(|m| m.tokens < mark.tokens) {
            self.marks.push(mark);
        }
    }

    /// The transcript (messages, seen text) as it would read after `cut`.
    pub fn transcript_after(&self, cut: &Cut) -> (Vec<Message>, String) {
        let mut messages = self.messages.clone();
        messages.drain(cut.start.messages..cut.end.messages);
        let mut seen = self.seen_text.clone();
        seen.replace_range(cut.start.text..cut.end.text, "");
        (messages, seen)
    }

    /// A copy with the history of `cut` dropped (what a turn prepared after the cut sees).
    pub fn with_cut(&self, cut: &Cut) -> Self {
        let mut c = self.clone();
        c.apply_cut(cut);
        c
    }

    /// Drops the history between the marks of `cut` (tokens, transcript, and the marks
    /// inside it); the marks after it move back.
    fn apply_cut(&mut self, cut: &Cut) {
        let (messages, seen) = self.transcript_after(cut);
        self.messages = messages;
        self.seen_text = seen;
        self.tokens.drain(cut.tokens());
        let (s, e) = (cut.start, cut.end);
        let kept = |m: &Mark| m.tokens <= s.tokens || m.tokens >= e.tokens;
        self.marks.retain(kept);
        self.reply_start = self.reply_start.filter(kept);
        let moved = self.marks.iter_mut().chain(self.reply_start.as_mut());
        for m in moved.filter(|m| m.tokens >= e.tokens) {
            m.tokens -= e.tokens - s.tokens;
            m.text -= e.text - s.text;
            m.messages -= e.messages - s.messages;
        }
        // The end mark lands on the start mark: keep one.
        self.marks.dedup_by_key(|m| m.tokens);
    }

    /// Drops the tokens from `len` on (a turn rolled back, or its reply cut short of what
    /// was generated). Marks past them go too.
    fn truncate_tokens(&mut self, len: usize) {
        self.tokens.truncate(len);
        self.marks.retain(|m| m.tokens <= len);
        self.reply_start = self.reply_start.filter(|m| m.tokens <= len);
    }

    fn extend_tokens(&mut self, tokens: impl IntoIterator<Item = u32>) {
        self.tokens.extend(tokens);
    }

    /// Records a finished exchange: the text the model saw (the prompt as templated, then the
    /// reply, whose `reply_tokens` tokens end the history), and the messages for the template.
    pub fn record_exchange(
        &mut self,
        prompt_text: &str,
        user: Vec<Message>,
        reply_text: &str,
        reply: Message,
        reply_tokens: usize,
    ) {
        self.seen_text.push_str(prompt_text);
        self.messages.extend(user);
        self.reply_start = Some(Mark {
            tokens: self.tokens.len().saturating_sub(reply_tokens),
            text: self.seen_text.len(),
            messages: self.messages.len(),
        });
        self.seen_text.push_str(reply_text);
        self.messages.push(reply);
    }
}

/// The table of open conversations, ordered by id so that iteration is deterministic, with
/// the names of those that have one indexed (a warm restart resumes thousands by name).
#[derive(Debug, Default)]
pub(crate) struct Conversations {
    by_id: BTreeMap<ConversationId, Conversation>,
    by_name: HashMap<String, ConversationId>,
}

impl Conversations {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) conversation `id`; its name, if any, now names it.
    pub fn insert(&mut self, id: ConversationId, conv: Conversation) -> Option<Conversation> {
        let old = self.remove(&id);
        if let Some(name) = conv.name() {
            self.by_name.insert(name.to_string(), id);
        }
        self.by_id.insert(id, conv);
        old
    }

    pub fn remove(&mut self, id: &ConversationId) -> Option<Conversation> {
        let conv = self.by_id.remove(id)?;
        if let Some(name) = conv.name()
            && self.by_name.get(name) == Some(id)
        {
            self.by_name.remove(name);
        }
        Some(conv)
    }

    pub fn get(&self, id: &ConversationId) -> Option<&Conversation> {
        self.by_id.get(id)
    }

    /// The conversation, to change anything but its name (which `insert` sets).
    pub fn get_mut(&mut self, id: &ConversationId) -> Option<&mut Conversation> {
        self.by_id.get_mut(id)
    }

    pub fn contains_key(&self, id: &ConversationId) -> bool {
        self.by_id.contains_key(id)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&ConversationId, &Conversation)> {
        self.by_id.iter()
    }

    /// The conversation named `name`, if one is open.
    pub fn find(&self, name: &str) -> Option<ConversationId> {
        self.by_name.get(name).copied()
    }
}

impl std::ops::Index<&ConversationId> for Conversations {
    type Output = Conversation;

    fn index(&self, id: &ConversationId) -> &Conversation {
        &self.by_id[id]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_drops_tokens_text_and_messages_between_marks_and_moves_later_marks() {
        let mut c = Conversation::new(vec![Message::new("system", "S")]);
        let turns = [("u1", "r1"), ("u2", "r2"), ("u3", "r3")];
        for (i, (u, r)) in turns.iter().enumerate() {
            c.add_mark(Mark {
                tokens: c.tokens().len(),
                text: c.seen_text().len(),
                messages: c.messages().len(),
            });
            c.extend_tokens([i as u32 * 10, i as u32 * 10 + 1]);
            let user = vec![Message::new("user", *u)];
            c.record_exchange(&format!("<{u}>"), user, r, Message::new("assistant", *r), 1);
        }
        assert_eq!(c.seen_text(), "<u1>r1<u2>r2<u3>r3");
        let m = c.marks().to_vec();
        assert_eq!(m.len(), 3);
        let cut = Cut {
            start: m[0],
            end: m[2],
        };
        c.apply_cut(&cut);
        assert_eq!(c.tokens(), &[20, 21]);
        assert_eq!(c.seen_text(), "<u3>r3");
        let roles: Vec<&str> = c.messages().iter().map(|m| m.content.as_str()).collect();
        assert_eq!(roles, ["S", "u3", "r3"]);
        assert_eq!(
            c.marks(),
            &[Mark {
                tokens: 0,
                text: 0,
                messages: 1
            }]
        );
    }

    #[test]
    fn drafts_are_as_long_as_they_pay_and_probe_after_a_doubling_cool_down() {
        let mut a = Acceptance::default();
        // Even odds against a price of a third: one token.
        assert_eq!(a.draft_len(8, 0.34), 1);
        assert_eq!(a.draft_len(0, 0.34), 0);
        for _ in 0..10 {
            a.record(4, 4, 0.34);
        }
        assert_eq!(a.draft_len(8, 0.34), 8);
        // A dearer step drafts less of the same odds.
        assert!(a.draft_len(8, 0.9) < 8);
        // Refused drafts: none for a cool-down, then a one-token probe.
        while a.cooldown == 0 {
            a.record(a.draft_len(8, 0.34), 0, 0.34);
        }
        while a.draft_len(8, 0.34) == 0 {
            a.record(0, 0, 0.34);
        }
        assert_eq!(a.draft_len(8, 0.34), 1);
        // Failed probes wait twice as long each time.
        let mut b = Acceptance::default();
        b.record(1, 0, 0.6);
        assert_eq!(b.cooldown, 4);
        b.cooldown = 0;
        b.record(1, 0, 0.6);
        assert_eq!(b.cooldown, 8);
        // A taken probe ends the run of misses.
        a.cooldown = 0;
        a.record(1, 1, 0.34);
        assert_eq!(a.misses, 0);
    }
}
