//! The unified iteration-level scheduler (Pensieve §4.2, thesis §3.4.2), and the table of live
//! turns.
//!
//! The scheduler owns every queued or running turn ([`Request`]; the engine keeps its own
//! per-turn state in the request's `payload`, so a turn is described once). Each step,
//! [`Scheduler::schedule`] turns the queues and the cache state into a plain-data [`StepPlan`]:
//! the tier moves to do first, the admissions, and the rows of the batch (each row one
//! request's tokens with positions, destination slots and context). Running requests go first,
//! in queue order with their decode rows (one token each, and their drafts); then waiting
//! requests are admitted first come first served while the budget allows and free device
//! blocks stay above the reserve; then the rest of the step's token budget goes to unfinished
//! prefills and recomputations, the admitted ones among them, shortest remaining first (aged
//! ones before all: `AGED_AFTER`), so a short turn starts within a step or two while a long
//! prefill goes on in chunks beside it. A running request that finds
//! no free block suspends the running request that arrived latest (its KV swapped out, itself
//! requeued in arrival order). Finally, when free blocks fall below the swap-out threshold,
//! idle conversations' chunks move to the host ahead of time.
//!
//! Planning books resources (blocks, host room, queue places, and the chunks a queued turn
//! takes by content, `share.rs`) but changes nothing that the step's outcome decides: the
//! tokens a turn adds to its conversation, its remaining work and its counters change only in
//! [`Scheduler::commit`], from the plan and what actually ran.
//!
//! A request's work is a list of position runs, in order: the dropped runs of its history to
//! recompute, then its pending tokens. Because attention's rule is positional, a row's context
//! is simply every position up to its last query. No candle or model types here.

mod commit;
mod draft;
mod plan;
mod row;
mod share;

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

pub use draft::Speculation;
use draft::StepCost;
pub(crate) use plan::{Admission, Outcome, Rejection, Reuse, RowPlan, StepPlan};
use plan::{Run, RunKind};

use crate::conversation::{Conversations, Settlement};
use crate::ids::{ConversationId, RequestId};
use crate::kv::{CacheManager, Eviction, Moves, Violation};

/// Steps a turn's unfinished prefill may go without a row before it goes first (the aging of
/// `Scheduler::prefill_order`): a stream of short turns delays a long prefill by at most this
/// many steps in every `AGED_AFTER + 1`.
const AGED_AFTER: u32 = 4;

/// Work counters of one turn.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TurnCounts {
    /// History tokens found on the device at first admission.
    pub reused_device: usize,
    /// History tokens found on the host at first admission.
    pub reused_host: usize,
    /// History tokens found in the store at first admission.
    pub reused_store: usize,
    /// Tokens recomputed after a drop (at any admission, also after a suspension).
    pub recomputed: usize,
    /// Tokens run through the model other than decode steps.
    pub prefilled: usize,
    /// Tokens drafted for it and verified (speculative decoding), and of those the accepted.
    pub drafted: usize,
    pub accepted: usize,
}

/// A queued or running turn.
#[derive(Debug)]
pub(crate) struct Request<T> {
    id: RequestId,
    conv: ConversationId,
    arrival: Instant,
    /// This turn's tokens not yet in the conversation's history, in order.
    pending: Vec<u32>,
    /// Positions still to compute, while running.
    work: VecDeque<Run>,
    /// One past the highest position computed for this turn.
    progress: usize,
    admitted: bool,
    /// When a step first ran it.
    first_run: Option<Instant>,
    /// Steps in a row its unfinished prefill or recomputation went without a row.
    passed: u32,
    /// Its KV could not be restored (a refused chunk): what it reuses is counted again at its
    /// next admission, the rest as recomputed.
    recount: bool,
    /// A lookup by content in the store it waits for before admission.
    lookup: Option<u64>,
    generated: usize,
    /// Most tokens the turn may generate: nothing is drafted past them.
    max_tokens: usize,
    /// What the client expects the reply to be much like (OpenAI's Predicted Outputs): drafts
    /// come from it first.
    prediction: Vec<u32>,
    counts: TurnCounts,
    /// The engine's state of this turn.
    pub payload: T,
}

impl<T> Request<T> {
    /// Whether all its work is feeding back sampled tokens (none, once finished).
    fn decoding(&self) -> bool {
        self.work.iter().all(|run| run.kind == RunKind::Decode)
    }

    pub fn conv(&self) -> ConversationId {
        self.conv
    }

    /// Whether the turn was ever admitted (its prompt entered the conversation).
    pub fn admitted(&self) -> bool {
        self.admitted
    }

    /// How long it waited before a step first ran it (until `now`, if none has).
    pub fn queue_time(&self, now: Instant) -> std::time::Duration {
        self.first_run
            .unwrap_or(now)
            .saturating_duration_since(self.arrival)
    }

    pub fn counts(&self) -> TurnCounts {
        self.counts
    }
}

/// Step sizing, from the engine configuration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub token_budget: usize,
    /// Admission keeps this many blocks free.
    pub reserve_blocks: usize,
    /// Ahead-of-time swap-out keeps this many blocks free.
    pub swap_out_blocks: usize,
    /// Waiting turns whose KV is read ahead from disk (and spared by ahead-of-time eviction),
    /// and that look again for shared KV before admission.
    pub prefetch_window: usize,
    /// Whether turns take KV other conversations computed for the same tokens.
    pub sharing: bool,
    /// Drafting of decode rows' next tokens from their history.
    pub speculation: Speculation,
    /// Positions a conversation may reach (the context window): nothing is drafted past it.
    pub window: usize,
}

#[derive(Debug)]
pub(crate) struct Scheduler<T> {
    requests: HashMap<RequestId, Request<T>>,
    /// The turn of each conversation that has one (a conversation has at most one).
    by_conv: HashMap<ConversationId, RequestId>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    limits: Limits,
    suspensions: u64,
    /// Step times as they ran: what a drafted token costs.
    step_cost: StepCost,
}

/// Why a row could not be planned.
enum RowError {
    /// The device pool had no free block for the row's new positions.
    NoBlock,
    /// A position it needs has no token or slot.
    Broken(Violation),
}

impl<T> Scheduler<T> {
    pub fn new(limits: Limits) -> Self {
        Self {
            requests: HashMap::new(),
            by_conv: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            limits,
            suspensions: 0,
            step_cost: StepCost::default(),
        }
    }

    /// Queues a turn of `conv` whose new tokens are `prompt`, to generate at most
    /// `max_tokens`.
    pub fn enqueue(
        &mut self,
        id: RequestId,
        conv: ConversationId,
        arrival: Instant,
        (prompt, max_tokens): (Vec<u32>, usize),
        payload: T,
    ) {
        self.waiting.push_back(id);
        self.by_conv.insert(conv, id);
        self.requests.insert(
            id,
            Request {
                id,
                conv,
                arrival,
                pending: prompt,
                work: VecDeque::new(),
                progress: 0,
                admitted: false,
                first_run: None,
                passed: 0,
                recount: false,
                lookup: None,
                generated: 0,
                max_tokens,
                prediction: Vec::new(),
                counts: TurnCounts::default(),
                payload,
            },
        );
    }

    /// Gives the queued or running turn `id` a prediction of its reply (OpenAI's Predicted
    /// Outputs): its decode rows draft from it first (`Speculation::draft_predicted`).
    pub fn predict(&mut self, id: RequestId, prediction: Vec<u32>) {
        if let Some(req) = self.requests.get_mut(&id) {
            req.prediction = prediction;
        }
    }

    /// Turns waiting to be admitted, and turns running.
    pub fn queue_lengths(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    pub fn get(&self, id: RequestId) -> Option<&Request<T>> {
        self.requests.get(&id)
    }

    pub fn get_mut(&mut self, id: RequestId) -> Option<&mut Request<T>> {
        self.requests.get_mut(&id)
    }

    /// The queued or running turn of `conv`, if any.
    pub fn turn_of(&self, conv: ConversationId) -> Option<RequestId> {
        self.by_conv.get(&conv).copied()
    }

    pub fn is_idle(&self) -> bool {
        self.requests.is_empty()
    }

    pub fn suspensions(&self) -> u64 {
        self.suspensions
    }

    /// A step of `tokens` rows' tokens took `secs` on the device: drafts are priced by it.
    pub fn observe_step(&mut self, tokens: usize, secs: f64) {
        self.step_cost.observe(tokens, secs);
    }

    /// What a drafted token costs now, as a share of the worth of a generated token (see
    /// [`StepCost::price`]), with the running turns as the step's rows.
    fn draft_price(&self) -> f32 {
        self.step_cost.price(self.running.len())
    }

    /// Ends a turn (finished, cancelled or failed) and returns it. An admitted turn leaves its
    /// tokens in the conversation (computed or not: the next turn computes the rest) and its
    /// recomputations settled; a turn never admitted leaves nothing.
    pub fn finish(
        &mut self,
        id: RequestId,
        convs: &mut Conversations,
        cache: &mut CacheManager,
        now: Instant,
    ) -> Option<Request<T>> {
        self.waiting.retain(|r| *r != id);
        self.running.retain(|r| *r != id);
        let mut req = self.requests.remove(&id)?;
        if self.by_conv.get(&req.conv) == Some(&id) {
            self.by_conv.remove(&req.conv);
        }
        if req.admitted {
            let end = Settlement::End {
                pending: std::mem::take(&mut req.pending),
                progress: req.progress,
            };
            convs.settle(req.conv, end, cache);
        }
        cache.touch(req.conv, now);
        Some(req)
    }

    /// Plans one step. Changes queue places and books cache resources; see the module header.
    pub fn schedule(
        &mut self,
        convs: &Conversations,
        cache: &mut CacheManager,
        now: Instant,
    ) -> StepPlan {
        let mut plan = StepPlan {
            shared_tokens: self.share_waiting(convs, cache),
            ..StepPlan::default()
        };
        let mut budget = self.limits.token_budget;
        // Decode rows first: a running stream is never held by anyone's prefill.
        let decoding: Vec<RequestId> = (self.running.iter().copied())
            .filter(|id| self.requests.get(id).is_some_and(Request::decoding))
            .collect();
        let drafts = self.drafts(convs);
        self.plan_rows(
            &decoding,
            &drafts,
            (convs, now),
            cache,
            &mut budget,
            &mut plan,
        );
        self.admit_and_fill(&decoding, (convs, now), cache, &mut budget, &mut plan);
        // The look-ahead window over the wait queue (AttentionStore §3.4): the next turns'
        // KV comes up from disk while they wait, and is spared by ahead-of-time eviction.
        let window: HashSet<ConversationId> = self
            .waiting
            .iter()
            .take(self.limits.prefetch_window)
            .filter_map(|id| self.requests.get(id).map(|r| r.conv))
            .collect();
        for &c in &window {
            cache.prefetch(c);
        }
        // Ahead of time: idle conversations' KV moves to free host room.
        let pending_free = cache.num_free_blocks() + plan.moves.swap_out.len();
        if pending_free < self.limits.swap_out_blocks {
            let mut busy = self.conversations(false);
            busy.extend(window);
            cache.evict_device(
                &|c| busy.contains(&c),
                self.limits.swap_out_blocks,
                Eviction::AheadOfTime,
                now,
                &mut plan.moves,
            );
        }
        plan
    }

    /// Rows for the running requests `ids`, in order, within `budget`, suspending the latest
    /// arrival when blocks run out (never a turn this step admitted: its swap-ins are planned).
    fn plan_rows(
        &mut self,
        ids: &[RequestId],
        drafts: &HashMap<RequestId, Vec<u32>>,
        (convs, now): (&Conversations, Instant),
        cache: &mut CacheManager,
        budget: &mut usize,
        plan: &mut StepPlan,
    ) {
        let admitted: HashSet<RequestId> = plan.admitted.iter().map(|a| a.request).collect();
        let mut i = 0;
        while i < ids.len() {
            let id = ids[i];
            if *budget == 0 {
                break;
            }
            if !self.running.contains(&id) {
                i += 1;
                continue;
            }
            let work = (plan.admitted.iter())
                .find(|a| a.request == id)
                .map(|a| a.work.clone());
            let draft = drafts.get(&id).map_or(&[][..], Vec::as_slice);
            match self.plan_row(id, work.as_ref(), convs, cache, (*budget, draft)) {
                Ok(Some(row)) => {
                    *budget -= row.tokens.len();
                    plan.rows.push(row);
                }
                Ok(None) => {}
                Err(RowError::Broken(v)) => plan.broken.push((id, v)),
                Err(RowError::NoBlock) if !plan.moves.swap_out.is_empty() => {
                    // Blocks come free when this step's swap-outs commit: wait for them
                    // rather than suspend more turns.
                }
                Err(RowError::NoBlock) => {
                    let Some(victim) = self.latest_arrival(&admitted) else {
                        i += 1;
                        continue;
                    };
                    if let Some(k) = plan.rows.iter().position(|r| r.request == victim) {
                        *budget += plan.rows.remove(k).tokens.len();
                    }
                    self.suspend(victim, cache, now, &mut plan.moves);
                    // Retry this request, unless it was the victim itself. Drops freed
                    // blocks at once; swap-outs make it wait (above).
                    if victim != id {
                        continue;
                    }
                }
            }
            i += 1;
        }
    }

    /// Admits waiting turns, then gives the rest of `budget` to the running turns other than
    /// `decoding` (those had their rows) in `prefill_order`.
    fn admit_and_fill(
        &mut self,
        decoding: &[RequestId],
        (convs, now): (&Conversations, Instant),
        cache: &mut CacheManager,
        budget: &mut usize,
        plan: &mut StepPlan,
    ) {
        self.admit_waiting(convs, cache, now, *budget, plan);
        let order = self.prefill_order(decoding, plan);
        let none = HashMap::new();
        self.plan_rows(&order, &none, (convs, now), cache, budget, plan);
    }

    /// The running turns with work other than decoding (`decoding` had their rows), this
    /// step's admissions among them, in the order the rest of the step's budget goes to them:
    /// shortest remaining work first, so a short new turn starts within the step however long
    /// a prefill runs beside it; a turn passed over for [`AGED_AFTER`] steps goes first (by
    /// arrival), so a long prefill is never starved by a stream of short ones.
    fn prefill_order(&self, decoding: &[RequestId], plan: &StepPlan) -> Vec<RequestId> {
        let mut order: Vec<_> = (self.running.iter())
            .filter(|id| !decoding.contains(id))
            .filter_map(|id| self.requests.get(id))
            .map(|r| {
                let work = (plan.admitted.iter())
                    .find(|a| a.request == r.id)
                    .map_or(&r.work, |a| &a.work);
                let remaining: usize = work.iter().map(|run| run.range.len()).sum();
                let aged = r.passed >= AGED_AFTER;
                ((!aged, if aged { 0 } else { remaining }, r.arrival), r.id)
            })
            .collect();
        order.sort();
        order.into_iter().map(|(_, id)| id).collect()
    }

    /// Admits waiting requests first come first served while the step has `room` for their
    /// work (their rows come in `prefill_order`, with the running turns' unfinished work).
    fn admit_waiting(
        &mut self,
        convs: &Conversations,
        cache: &mut CacheManager,
        now: Instant,
        mut room: usize,
        plan: &mut StepPlan,
    ) {
        let chunk = cache.chunk_size();
        // Blocks the running turns still take up to the end of their work (a prefill's first
        // output, a decode's next token): prefill rows come after admission, and a turn
        // admitted now must not take them.
        let mut claimed: usize = (self.running.iter())
            .filter_map(|id| self.requests.get(id))
            .filter_map(|r| {
                let end = r.work.back()?.range.end;
                let held = cache.table(r.conv).map_or(0, |t| t.len());
                Some((end + 1).div_ceil(chunk).saturating_sub(held))
            })
            .sum();
        while let Some(&id) = self.waiting.front() {
            if room == 0 {
                break;
            }
            let Some(req) = self.requests.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            if req.lookup.is_some() {
                break;
            }
            let conv = req.conv;
            // Blocks for every token up to this turn's first output, beyond those held.
            let total = convs.get(&conv).map_or(0, |c| c.tokens().len()) + req.pending.len();
            let held = cache.table(conv).map_or(0, |t| t.len());
            let grow = (total + 1).div_ceil(chunk).saturating_sub(held);
            let needed = cache.blocks_to_restore(conv) + grow;
            let want_free = needed + self.limits.reserve_blocks + claimed;
            if cache.num_free_blocks() < want_free {
                // Idle conversations first; queued ones' KV only if that is not enough.
                for keep_queued in [true, false] {
                    let mut protect = self.conversations(keep_queued);
                    protect.insert(conv);
                    let protect = |c: ConversationId| protect.contains(&c);
                    cache.evict_device(
                        &protect,
                        want_free,
                        Eviction::OnDemand,
                        now,
                        &mut plan.moves,
                    );
                }
                // Swap-outs free their blocks at commit: admission waits for them, unless
                // nothing runs at all and the pool minus the reserve is simply all there is.
                let alone = self.running.is_empty() && plan.moves.swap_out.is_empty();
                if alone && cache.num_free_blocks() < needed {
                    self.waiting.pop_front();
                    plan.rejected.push(Rejection {
                        request: id,
                        needed: needed * chunk,
                        available: cache.num_free_blocks() * chunk,
                    });
                    continue;
                }
                if cache.num_free_blocks() < want_free && !alone {
                    break;
                }
            }
            let Some(admission) = self.admission(id, convs, cache, &mut plan.moves) else {
                break;
            };
            self.waiting.pop_front();
            self.running.push(id);
            let work: usize = admission.work.iter().map(|run| run.range.len()).sum();
            room = room.saturating_sub(work);
            claimed += grow;
            plan.admitted.push(admission);
        }
    }

    /// Restores `id`'s conversation (swap-ins, blocks to recompute into) and lays out its
    /// work; `None`, with nothing planned, when blocks ran out.
    fn admission(
        &self,
        id: RequestId,
        convs: &Conversations,
        cache: &mut CacheManager,
        moves: &mut Moves,
    ) -> Option<Admission> {
        let req = self.requests.get(&id)?;
        let history = convs.get(&req.conv)?.tokens().len();
        let restore = cache.restore(req.conv, moves)?;
        let computed = cache.table(req.conv).map_or(0, |t| t.computed());
        let mut work: VecDeque<Run> = restore
            .recompute
            .iter()
            .map(|r| Run {
                range: r.clone(),
                kind: RunKind::Recompute,
            })
            .collect();
        let end = history + req.pending.len();
        // Once the turn has sampled, its one pending token is a sampled one.
        let decode_from = if req.generated > 0 { end - 1 } else { end };
        for (range, kind) in [
            (computed..decode_from, RunKind::Prefill),
            (decode_from.max(computed)..end, RunKind::Decode),
        ] {
            if !range.is_empty() {
                work.push_back(Run { range, kind });
            }
        }
        Some(Admission {
            request: id,
            work,
            first_reuse: (!req.admitted || req.recount).then_some(Reuse {
                device: restore.on_device,
                host: restore.from_host,
                store: restore.from_store,
            }),
        })
    }

    /// Conversations with a running turn, and with `queued_too` those with a waiting one.
    fn conversations(&self, queued_too: bool) -> HashSet<ConversationId> {
        let running = self.running.iter();
        let waiting = self.waiting.iter().filter(|_| queued_too);
        running
            .chain(waiting)
            .filter_map(|id| self.requests.get(id))
            .map(|r| r.conv)
            .collect()
    }

    /// The running request that arrived latest, other than those in `spare`.
    fn latest_arrival(&self, spare: &HashSet<RequestId>) -> Option<RequestId> {
        (self.running.iter())
            .filter(|id| !spare.contains(id))
            .filter_map(|id| self.requests.get(id).map(|r| (r.arrival, *id)))
            .max()
            .map(|(_, id)| id)
    }

    /// Puts a running request back in the waiting queue, in arrival order.
    fn requeue(&mut self, id: RequestId, cache: &mut CacheManager) {
        let Some(req) = self.requests.get(&id) else {
            return;
        };
        self.running.retain(|r| *r != id);
        cache.settle(req.conv, req.progress);
        let arrival = req.arrival;
        let pos = self
            .waiting
            .iter()
            .position(|w| self.requests.get(w).is_some_and(|r| r.arrival > arrival))
            .unwrap_or(self.waiting.len());
        self.waiting.insert(pos, id);
    }

    /// Requeues a running request and moves its conversation's KV off the device.
    fn suspend(
        &mut self,
        id: RequestId,
        cache: &mut CacheManager,
        now: Instant,
        moves: &mut Moves,
    ) {
        let Some(conv) = self.requests.get(&id).map(|r| r.conv) else {
            return;
        };
        self.suspensions += 1;
        self.requeue(id, cache);
        let busy = self.conversations(true);
        let protect = |c: ConversationId| c != conv && busy.contains(&c);
        cache.evict_conversation(conv, &protect, now, moves);
    }

    /// Checks that the turn table, the queues and the index by conversation agree: every
    /// request is in exactly one queue, and indexed under its conversation.
    ///
    /// # Errors
    /// [`Violation::LostRequest`] naming the first request that is not.
    pub fn check(&self) -> Result<(), Violation> {
        let queued = self.waiting.iter().chain(&self.running);
        let mut seen = HashSet::new();
        for id in queued {
            if !self.requests.contains_key(id) || !seen.insert(*id) {
                return Err(Violation::LostRequest(*id));
            }
        }
        if let Some(id) = self.requests.keys().find(|id| !seen.contains(id)) {
            return Err(Violation::LostRequest(*id));
        }
        // The index of turns by conversation names each turn, and nothing else.
        let unindexed = (self.requests.values())
            .find(|r| self.by_conv.get(&r.conv) != Some(&r.id))
            .map(|r| r.id);
        let stale = (self.by_conv.values()).find(|id| !self.requests.contains_key(id));
        match unindexed.or(stale.copied()) {
            Some(id) => Err(Violation::LostRequest(id)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
