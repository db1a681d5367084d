//! Random interleavings of open / fork / submit / step / cancel / close on the tiny model, in
//! every cache mode and under budgets that force swaps, drops and suspensions. Conversations
//! open with one of two system prompts (or none) and forks continue others' histories, so many
//! of them hold the same chunks, shared by content. After every operation
//! the invariants hold, every submit and cancel answers as the API promises, and every turn
//! that ran to its length generated exactly the greedy tokens of a stateless recompute of its
//! conversation alone (one forward pass over the whole history). Half the sequences run a
//! template that rewrites replies, so that turns take back histories the template renders
//! otherwise (`EngineStats::rewound_tokens`); their turns are checked as they end, against
//! the history they ran on.
//!
//! `PENSIEVE_PROPTEST_CASES` sets the number of sequences (64 by default; `.ci/run` runs a
//! longer pass).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;

use pensieve::engine::{
    Budgets, CacheMode, ConversationId, ConversationOptions, CostProfile, Engine, EngineConfig,
    Event, FinishReason, RequestId, SamplingParams, Turn,
};
use pensieve::kv::CostModel;
use pensieve::model::Model;
use pensieve::Error;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PENSIEVE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

#[derive(Clone, Debug)]
enum Op {
    /// Opens a conversation with system prompt `k % 3` (none for 0).
    Open(usize),
    /// Forks an open conversation (its whole history).
    Fork(usize),
    Submit(usize, usize),
    Step,
    Cancel(usize),
    Close(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => any::<usize>().prop_map(Op::Open),
        2 => any::<usize>().prop_map(Op::Fork),
        4 => (any::<usize>(), 1usize..12).prop_map(|(c, n)| Op::Submit(c, n)),
        6 => Just(Op::Step),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => any::<usize>().prop_map(Op::Close),
    ]
}

/// What the test knows of one turn.
struct TurnLog {
    conv: ConversationId,
    generated: Vec<u32>,
    /// Where the reply starts in the conversation's history (after the history and prompt).
    start: usize,
    /// Length of the conversation's history when the turn ended (its last token's end).
    end: Option<usize>,
    finished: Option<FinishReason>,
    /// Checked already (when it ended).
    checked: bool,
}

struct Harness {
    e: Engine,
    model: Model,
    turns: HashMap<RequestId, TurnLog>,
    open: Vec<ConversationId>,
    /// Whether the template rewrites replies: a later turn may then take back the tokens of
    /// an earlier reply, which is checked when it ends instead of when its conversation
    /// closes.
    rewrites: bool,
}

/// ChatML that renders every reply without its first character (as thinking templates drop
/// a reply's thought, and Gemma's trims it), so that each turn takes back the latest reply.
const REWRITING: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n\
    {% if m.role == 'assistant' %}{{ m.content[1:] }}{% else %}{{ m.content }}{% endif %}\
    <|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

impl Harness {
    fn record(&mut self, events: Vec<Event>) {
        for ev in events {
            match ev {
                Event::Token { request, token, .. } => {
                    self.turns.get_mut(&request).unwrap().generated.push(token);
                }
                Event::Finished {
                    request, reason, ..
                } => {
                    let t = self.turns.get_mut(&request).unwrap();
                    assert!(t.finished.is_none(), "{request} finished twice");
                    assert!(
                        !matches!(reason, FinishReason::Failed(_)),
                        "{request}: {reason:?}"
                    );
                    t.end = self.e.tokens(t.conv).ok().map(|h| h.len());
                    let ran = matches!(reason, FinishReason::Length);
                    t.finished = Some(reason);
                    if self.rewrites && ran {
                        let history = self.e.tokens(self.turns[&request].conv).unwrap();
                        let logits = common::score_all(&self.model, history);
                        self.check(&self.turns[&request], history, &logits).unwrap();
                        self.turns.get_mut(&request).unwrap().checked = true;
                    }
                }
                other => panic!("unexpected event {other:?}"),
            }
        }
    }

    /// Every turn of `conv` that ran to its length generated the stateless greedy tokens.
    fn verify(&self, conv: ConversationId) -> Result<(), TestCaseError> {
        let history = self.e.tokens(conv).unwrap();
        let done: Vec<&TurnLog> = self
            .turns
            .values()
            .filter(|t| t.conv == conv && t.finished == Some(FinishReason::Length) && !t.checked)
            .collect();
        if done.is_empty() {
            return Ok(());
        }
        let logits = common::score_all(&self.model, history);
        for t in done {
            self.check(t, history, &logits)?;
        }
        Ok(())
    }

    /// Turn `t` generated the greedy tokens of `history` (with its `logits`), which holds its
    /// reply where the turn ended.
    fn check(
        &self,
        t: &TurnLog,
        history: &[u32],
        logits: &[Vec<f32>],
    ) -> Result<(), TestCaseError> {
        let (start, end) = (t.start, t.end.unwrap());
        // The history keeps the reply as the client got it: the tokens of a character the
        // length limit cut in two are not in it.
        let kept = end - start;
        let cut = &t.generated[kept..];
        prop_assert!(
            cut.len() <= 3,
            "{} tokens cut from {:?}",
            cut.len(),
            t.generated
        );
        let text = self.model.decode(cut).unwrap();
        prop_assert!(
            cut.is_empty() || text.ends_with('\u{FFFD}'),
            "cut {:?}",
            text
        );
        prop_assert_eq!(&history[start..end], &t.generated[..kept]);
        for (i, &token) in t.generated[..kept].iter().enumerate() {
            let p = start + i;
            prop_assert_eq!(
                common::argmax(&logits[p - 1]),
                token,
                "{} position {}",
                t.conv,
                p
            );
        }
        Ok(())
    }

    fn close(&mut self, conv: ConversationId) -> Result<(), TestCaseError> {
        self.verify(conv)?;
        self.e.close(conv).unwrap();
        self.open.retain(|&c| c != conv);
        Ok(())
    }
}

fn params(n: usize) -> SamplingParams {
    SamplingParams::greedy().max_tokens(n).ignore_eos(true)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_invariants_and_outputs(
        ops in prop::collection::vec(op(), 1..60),
        mode in 0usize..3,
        reserve in prop_oneof![Just(0.0), Just(0.1)],
        rewrites in any::<bool>(),
    ) {
        let mode = [CacheMode::Tiered, CacheMode::DeviceOnly, CacheMode::Stateless][mode];
        let config = EngineConfig::default()
// 20 chunks of 8 tokens at 256 bytes per KV-token.
.budgets(Budgets::default()
.device_tokens(96)
.host_bytes(20 * 8 * 256))
.mode(mode)
.chunk_size(8)
.step_token_budget(64)
.reserve(reserve)
.cost_profile(CostProfile::Fixed(CostModel::new(1e-4, 1e-7)))
.check_invariants(true);
        let mut model = Model::tiny(7).unwrap();
        if rewrites {
            model = model.with_template_source(REWRITING).unwrap();
        }
        let mut h = Harness {
            e: Engine::with_model(model, config).unwrap(),
            model: Model::tiny(7).unwrap(),
            turns: HashMap::new(),
            open: Vec::new(),
            rewrites,
        };
        let mut submitted: Vec<RequestId> = Vec::new();
        for op in ops {
            match op {
                Op::Open(k) => {
                    let mut options = ConversationOptions::default();
                    options.system = [None, Some("Be brief."), Some("Be kind.")][k % 3].map(String::from);
                    h.open.push(h.e.open(options).unwrap());
                }
                Op::Fork(c) if !h.open.is_empty() => {
                    let conv = h.open[c % h.open.len()];
                    let busy = h.turns.values().any(|t| t.conv == conv && t.finished.is_none());
                    match h.e.fork(conv, None) {
                        Ok(copy) => {
                            prop_assert!(!busy, "{conv} forked while busy");
                            h.open.push(copy);
                        }
                        Err(Error::ConversationBusy(c)) => prop_assert!(busy && c == conv),
                        Err(e) => prop_assert!(false, "fork failed: {e}"),
                    }
                }
                Op::Submit(c, n) if !h.open.is_empty() => {
                    let conv = h.open[c % h.open.len()];
                    let busy = h.turns.values().any(|t| t.conv == conv && t.finished.is_none());
                    let turn = Turn::user(format!("message {n}"));
                    let start = h.e.turn_size(conv, turn.clone()).map_or(0, |s| s.history_tokens + s.prompt_tokens);
                    match h.e.submit(conv, turn, params(n)) {
                        Ok(id) => {
                            prop_assert!(!busy, "{conv} accepted a second turn");
                            submitted.push(id);
                            h.turns.insert(id, TurnLog { conv, generated: Vec::new(), start, end: None, finished: None, checked: false });
                        }
                        Err(Error::ConversationBusy(c)) => prop_assert!(busy && c == conv),
                        // The 96-slot pool bounds a conversation's length.
                        Err(Error::BudgetTooSmall { .. }) => prop_assert!(h.e.tokens(conv).unwrap().len() > 40),
                        Err(e) => prop_assert!(false, "submit failed: {e}"),
                    }
                }
                Op::Cancel(r) if !submitted.is_empty() => {
                    let id = submitted[r % submitted.len()];
                    let live = h.turns[&id].finished.is_none();
                    match h.e.cancel(id) {
                        Ok(()) => prop_assert!(live),
                        Err(Error::UnknownRequest(r)) => prop_assert!(!live && r == id),
                        Err(e) => prop_assert!(false, "cancel failed: {e}"),
                    }
                    // A cancelled turn's event arrives with the next step; mark it now so a new
                    // submit to its conversation is expected to succeed.
                    if let Some(t) = h.turns.get_mut(&id) {
                        t.finished.get_or_insert(FinishReason::Cancelled);
                    }
                }
                Op::Close(c) if !h.open.is_empty() => {
                    let conv = h.open[c % h.open.len()];
                    for t in h.turns.values_mut().filter(|t| t.conv == conv) {
                        t.finished.get_or_insert(FinishReason::Cancelled);
                    }
                    h.close(conv)?;
                }
                _ => {
                    let events = h.e.step().unwrap();
                    h.record_step(events);
                }
            }
            h.e.check_invariants().unwrap();
            let s = h.e.stats();
            prop_assert!(s.device_slots_used <= s.device_slots_total);
        }
        let mut guard = 0;
        while h.e.has_work() {
            let events = h.e.step().unwrap();
            h.record_step(events);
            guard += 1;
            prop_assert!(guard < 10_000, "the engine did not finish");
        }
        for id in &submitted {
            prop_assert!(h.turns[id].finished.is_some(), "{id} never finished");
        }
        for conv in h.open.clone() {
            h.close(conv)?;
        }
        let s = h.e.stats();
        prop_assert_eq!((s.device_slots_used, s.host_bytes_used), (0, 0));
    }
}

impl Harness {
    /// Records a step's events; turns cancelled by the test already count as finished.
    fn record_step(&mut self, events: Vec<Event>) {
        let events = events
            .into_iter()
            .filter(|ev| match ev {
                Event::Finished {
                    request,
                    reason: FinishReason::Cancelled,
                    ..
                } => self.turns[request].finished.is_none(),
                _ => true,
            })
            .collect();
        self.record(events);
    }
}
