//! The scheduler's plain-data output: what one step does ([`StepPlan`]) and what came of it
//! ([`Outcome`]). No tensors, no model: the executor turns a plan into copies and one forward
//! pass, and `Scheduler::commit` applies the outcome.

use std::collections::VecDeque;
use std::ops::Range;

use crate::ids::{ConversationId, RequestId};
use crate::kv::{Moves, Violation};

/// One request's share of a step: new tokens and where their KV goes, plus its context as a
/// block table (shared with the attention op).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RowPlan {
    pub request: RequestId,
    pub conv: ConversationId,
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    /// The context's block table: the device block of each chunk up to the last position.
    pub blocks: Vec<u32>,
    /// Context positions (`0..ctx_len`).
    pub ctx_len: usize,
    /// The row completes the request's work: sample a token from its last position.
    pub sample: bool,
    /// Of `tokens`, how many recompute dropped KV.
    pub recomputed: usize,
    /// Of `tokens`, how many feed back a sampled token (decode) or are drafted.
    pub decoded: usize,
    /// Of `tokens`, how many at the end are drafted (the row wants the logits of each, and of
    /// the token before them).
    pub drafted: usize,
}

/// A waiting request admitted by a step: the work it starts with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Admission {
    pub request: RequestId,
    pub(super) work: VecDeque<Run>,
    /// History tokens found in each tier, at the turn's first admission (or the first after
    /// its KV could not be restored).
    pub(super) first_reuse: Option<Reuse>,
}

/// History tokens a turn found in each tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Reuse {
    pub device: usize,
    pub host: usize,
    pub store: usize,
}

/// A request that can never fit the device pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rejection {
    pub request: RequestId,
    /// Slots it needs.
    pub needed: usize,
    /// Slots the pool could give it.
    pub available: usize,
}

/// Everything one step does, as plain data.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct StepPlan {
    pub moves: Moves,
    pub admitted: Vec<Admission>,
    pub rows: Vec<RowPlan>,
    pub rejected: Vec<Rejection>,
    /// Requests whose row could not be built (a bookkeeping bug): the engine fails them.
    pub broken: Vec<(RequestId, Violation)>,
    /// Tokens waiting turns took from other conversations' KV before planning.
    pub shared_tokens: usize,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.moves.is_empty()
            && self.admitted.is_empty()
            && self.rows.is_empty()
            && self.rejected.is_empty()
            && self.broken.is_empty()
    }
}

/// What a step's execution did with its plan.
#[derive(Clone, Debug, Default)]
pub(crate) struct Outcome {
    /// Per row of the plan: whether it was computed.
    pub ran: Vec<bool>,
    /// Tokens sampled from rows that ran and sample, in order: one per row, or for a drafted
    /// row the drafted tokens accepted and the token sampled after them.
    pub sampled: Vec<(RequestId, Vec<u32>)>,
    /// Requests whose KV could not be restored (a swap-in failed): back to the queue, to be
    /// admitted again and recompute what was lost.
    pub requeue: Vec<RequestId>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RunKind {
    /// Dropped history rebuilt from the raw tokens.
    Recompute,
    /// Tokens never computed: the new prompt, or history whose KV was never computed.
    Prefill,
    /// A sampled token fed back.
    Decode,
}

/// A run of positions to compute, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Run {
    pub range: Range<usize>,
    pub kind: RunKind,
}
