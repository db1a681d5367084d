//! The unified iteration-level scheduler (Pensieve §4.2, thesis §3.4.2).
//!
//! Each step, `schedule()` turns the request queues and the cache state into a plain-data
//! [`StepPlan`]: the tier moves to do first and the rows of the batch (each row one request's
//! tokens with positions, destination slots and context). Running requests go first, in
//! arrival order (a decode contributes one token, an unfinished prefill as many as the step's
//! token budget allows); then waiting requests are admitted first come first served while the
//! budget allows and free device blocks stay above the reserve. A running request that finds no
//! free block suspends the latest-arrived running request (its KV swapped out, itself
//! requeued). Finally, when free blocks fall below the swap-out threshold, idle conversations'
//! chunks are swapped out ahead of time. `commit()` applies the executor's outcome.
//!
//! A request's remaining work is a list of position runs, in order: the dropped runs of its
//! history to recompute, then its pending tokens. Because attention's rule is positional, a
//! row's context is simply every position up to its last query. No candle types here.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::time::Instant;

use crate::conversation::{ConversationId, Conversations};
use crate::engine::RequestId;
use crate::kv::cache::{CacheManager, SwapIn, SwapOut};
use crate::kv::ChunkLoc;

/// One request's share of a step: new tokens and where their KV goes, plus its context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RowPlan {
    pub request: RequestId,
    pub conv: ConversationId,
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub ctx_slots: Vec<u32>,
    pub ctx_positions: Vec<u32>,
    /// The row completes the request's work: sample a token from its last position.
    pub sample: bool,
}

/// Everything one step does, as plain data.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct StepPlan {
    pub swap_out: Vec<SwapOut>,
    pub swap_in: Vec<SwapIn>,
    pub rows: Vec<RowPlan>,
    /// Requests that can never fit the device pool: `(request, slots needed, slots free)`.
    pub rejected: Vec<(RequestId, usize, usize)>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.swap_out.is_empty()
            && self.swap_in.is_empty()
            && self.rows.is_empty()
            && self.rejected.is_empty()
    }
}

/// Scheduler-side state of a turn.
#[derive(Debug)]
pub(crate) struct Request {
    pub id: RequestId,
    pub conv: ConversationId,
    pub arrival: Instant,
    /// The new turn's tokens, appended to the conversation at first admission.
    pub prompt: Vec<u32>,
    /// Positions still to compute, in order.
    pub work: VecDeque<Range<usize>>,
    /// One past the highest position computed for this turn.
    pub progress: usize,
    pub admitted_once: bool,
    /// Set while the turn's prefill is done and it generates one token per step.
    pub generated: usize,
    /// Reuse counters taken at (first) admission.
    pub reused_device: usize,
    pub reused_host: usize,
    pub recomputed: usize,
    pub prefilled: usize,
}

/// Step sizing, from the engine configuration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub token_budget: usize,
    /// Admission keeps this many blocks free.
    pub reserve_blocks: usize,
    /// Ahead-of-time swap-out keeps this many blocks free.
    pub swap_out_blocks: usize,
}

#[derive(Debug)]
pub(crate) struct Scheduler {
    pub requests: HashMap<RequestId, Request>,
    pub waiting: VecDeque<RequestId>,
    pub running: Vec<RequestId>,
    limits: Limits,
    pub suspensions: u64,
}

impl Request {
    /// A turn of `conv` with new tokens `prompt`, not yet admitted.
    pub fn new(id: RequestId, conv: ConversationId, arrival: Instant, prompt: Vec<u32>) -> Self {
        Self {
            id,
            conv,
            arrival,
            prompt,
            work: VecDeque::new(),
            progress: 0,
            admitted_once: false,
            generated: 0,
            reused_device: 0,
            reused_host: 0,
            recomputed: 0,
            prefilled: 0,
        }
    }
}

impl Scheduler {
    pub fn new(limits: Limits) -> Self {
        Self {
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            limits,
            suspensions: 0,
        }
    }

    pub fn enqueue(&mut self, req: Request) {
        self.waiting.push_back(req.id);
        self.requests.insert(req.id, req);
    }

    /// Removes a request from the queues (finished or cancelled) and returns it.
    pub fn remove(&mut self, id: RequestId) -> Option<Request> {
        self.waiting.retain(|r| *r != id);
        self.running.retain(|r| *r != id);
        self.requests.remove(&id)
    }

    pub fn is_idle(&self) -> bool {
        self.requests.is_empty()
    }

    /// Plans one step.
    pub fn schedule(
        &mut self,
        convs: &mut Conversations,
        cache: &mut CacheManager,
        now: Instant,
    ) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.limits.token_budget;

        // 1. Running requests, oldest first.
        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i];
            match self.plan_rows(id, convs, cache, &mut budget) {
                Ok(Some(row)) => plan.rows.push(row),
                Ok(None) => {}
                Err(NoBlock) => {
                    // Suspend the latest-arrived running request (possibly this one).
                    let victim = self.latest_running();
                    self.suspend(victim, convs, cache, now, &mut plan.swap_out);
                    if victim == id {
                        continue;
                    }
                    // This request retries next step, when the swap-outs have freed blocks.
                }
            }
            i += 1;
        }

        // 2. Admission, first come first served.
        while let Some(&id) = self.waiting.front() {
            if budget == 0 {
                break;
            }
            let Some(req) = self.requests.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let conv_id = req.conv;
            let chunk = cache.chunk_size();
            // Blocks for every token after this turn plus its first output, beyond those held.
            let (total, held) = convs
                .get(&conv_id)
                .map_or((0, 0), |c| (c.tokens.len(), c.chunks.len()));
            let grow = (total + req.prompt.len() + 1)
                .div_ceil(chunk)
                .saturating_sub(held);
            let needed = CacheManager::blocks_to_restore(convs, conv_id) + grow;
            let want_free = needed + self.limits.reserve_blocks;
            if cache.blocks.num_free() < want_free {
                // Idle conversations first; queued ones' KV only if that is not enough.
                let busy = self.busy_set(conv_id);
                let protect = |c: ConversationId| busy.contains(&c);
                cache.evict_device(convs, &protect, want_free, now, &mut plan.swap_out);
                let running = self.running_set(conv_id);
                let protect = |c: ConversationId| running.contains(&c);
                cache.evict_device(convs, &protect, want_free, now, &mut plan.swap_out);
                // Swap-outs free their blocks at commit: admission waits for them, unless nothing
                // runs at all and the pool minus the reserve is simply all there is.
                let alone = self.running.is_empty() && plan.swap_out.is_empty();
                if alone && cache.blocks.num_free() < needed {
                    // Nothing else holds blocks that could be freed: it can never fit.
                    self.waiting.pop_front();
                    plan.rejected
                        .push((id, needed * chunk, cache.blocks.num_free() * chunk));
                    continue;
                }
                if cache.blocks.num_free() < want_free && !alone {
                    break;
                }
            }
            self.waiting.pop_front();
            if !self.admit(id, convs, cache, &mut plan.swap_in) {
                self.waiting.push_front(id);
                break;
            }
            self.running.push(id);
            // Admission checked the blocks; a row can only be missing for lack of budget.
            if let Ok(Some(row)) = self.plan_rows(id, convs, cache, &mut budget) {
                plan.rows.push(row);
            }
        }

        // 3. Ahead-of-time swap-out of idle conversations.
        if cache.blocks.num_free() + plan.swap_out.len() < self.limits.swap_out_blocks {
            let busy = self.busy_set(ConversationId(u64::MAX));
            let protect = |c: ConversationId| busy.contains(&c);
            cache.evict_device(
                convs,
                &protect,
                self.limits.swap_out_blocks,
                now,
                &mut plan.swap_out,
            );
        }
        plan
    }

    /// Conversations with a queued or running turn, plus `extra`.
    fn busy_set(&self, extra: ConversationId) -> Vec<ConversationId> {
        let mut v: Vec<ConversationId> = self.requests.values().map(|r| r.conv).collect();
        v.push(extra);
        v
    }

    /// Conversations with a running turn, plus `extra`.
    fn running_set(&self, extra: ConversationId) -> Vec<ConversationId> {
        let mut v: Vec<ConversationId> = self
            .running
            .iter()
            .filter_map(|r| self.requests.get(r))
            .map(|r| r.conv)
            .collect();
        v.push(extra);
        v
    }

    fn latest_running(&self) -> RequestId {
        // `running` is in admission order; the last admitted arrived latest among them or was
        // requeued after a suspension, and either way is the cheapest to push back.
        self.running.last().copied().unwrap_or(RequestId(u64::MAX))
    }

    /// First admission appends the prompt; every admission restores the conversation's KV
    /// (swap-ins, recompute runs) and sets the work list. `false` if blocks ran out.
    fn admit(
        &mut self,
        id: RequestId,
        convs: &mut Conversations,
        cache: &mut CacheManager,
        swaps: &mut Vec<SwapIn>,
    ) -> bool {
        let Some(req) = self.requests.get_mut(&id) else {
            return false;
        };
        let chunk = cache.chunk_size();
        let host_before: usize = convs.get(&req.conv).map_or(0, |c| {
            (0..c.chunks.len())
                .filter(|&i| matches!(c.chunks[i], ChunkLoc::Host(_)))
                .map(|i| c.chunk_len(i, chunk))
                .sum()
        });
        let Some(runs) = cache.restore(convs, req.conv, swaps) else {
            return false;
        };
        let Some(conv) = convs.get_mut(&req.conv) else {
            return false;
        };
        if !req.admitted_once {
            conv.tokens.append(&mut req.prompt);
            let recomputed: usize = runs.iter().map(|r| r.len()).sum();
            req.recomputed = recomputed;
            req.reused_host = host_before;
            req.reused_device = conv.kv_len - recomputed - host_before;
            req.admitted_once = true;
        }
        req.work = runs.into_iter().collect();
        if conv.kv_len < conv.tokens.len() {
            req.work.push_back(conv.kv_len..conv.tokens.len());
        }
        req.progress = 0;
        true
    }

    /// Takes the next tokens of `id`'s work within `budget`, giving them blocks.
    fn plan_rows(
        &mut self,
        id: RequestId,
        convs: &mut Conversations,
        cache: &mut CacheManager,
        budget: &mut usize,
    ) -> Result<Option<RowPlan>, NoBlock> {
        let Some(req) = self.requests.get_mut(&id) else {
            return Ok(None);
        };
        let chunk = cache.chunk_size();
        let mut positions = Vec::new();
        let mut work = req.work.clone();
        while positions.len() < *budget {
            let Some(run) = work.front_mut() else { break };
            let take = (*budget - positions.len()).min(run.len());
            positions.extend(run.start..run.start + take);
            run.start += take;
            if run.start >= run.end {
                work.pop_front();
            }
        }
        let Some(&last) = positions.last() else {
            return Ok(None);
        };
        // Blocks for new positions past the chunk table.
        let needed_chunks = last / chunk + 1;
        let have = convs.get(&req.conv).map_or(0, |c| c.chunks.len());
        for _ in have..needed_chunks {
            if cache.grow(convs, req.conv).is_none() {
                return Err(NoBlock);
            }
        }
        let Some(conv) = convs.get(&req.conv) else {
            return Ok(None);
        };
        let slot = |p: usize| -> u32 {
            let off = p % chunk;
            match conv.chunks[p / chunk] {
                ChunkLoc::Device(b)
                | ChunkLoc::Recomputing(b)
                | ChunkLoc::SwappingIn { block: b, .. } => cache.blocks.slot(b, off),
                // Unreachable for a busy conversation: admission restored every chunk and
                // eviction never touches busy conversations.
                _ => u32::MAX,
            }
        };
        let ctx_positions: Vec<u32> = (0..=last as u32).collect();
        let row = RowPlan {
            request: id,
            conv: req.conv,
            tokens: positions.iter().map(|&p| conv.tokens[p]).collect(),
            slots: positions.iter().map(|&p| slot(p)).collect(),
            positions: positions.iter().map(|&p| p as u32).collect(),
            ctx_slots: (0..=last).map(slot).collect(),
            ctx_positions,
            sample: work.is_empty(),
        };
        *budget -= row.tokens.len();
        req.work = work;
        Ok(Some(row))
    }

    /// Swaps out (or drops) every device chunk of a running request's conversation and puts
    /// the request back in the waiting queue, ahead of later arrivals.
    fn suspend(
        &mut self,
        id: RequestId,
        convs: &mut Conversations,
        cache: &mut CacheManager,
        now: Instant,
        swaps: &mut Vec<SwapOut>,
    ) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        self.running.retain(|r| *r != id);
        self.suspensions += 1;
        let conv_id = req.conv;
        cache.settle(convs, conv_id, req.progress);
        req.work.clear();
        let arrival = req.arrival;
        let busy = self.busy_set(conv_id);
        let protect = |c: ConversationId| busy.contains(&c);
        cache.evict_conversation(convs, conv_id, &protect, now, swaps);
        let pos = self
            .waiting
            .iter()
            .position(|w| self.requests.get(w).is_some_and(|r| r.arrival > arrival))
            .unwrap_or(self.waiting.len());
        self.waiting.insert(pos, id);
    }

    /// Applies a computed row: the conversation's KV now covers its positions.
    pub fn commit_row(&mut self, row: &RowPlan, convs: &mut Conversations) {
        let Some(req) = self.requests.get_mut(&row.request) else {
            return;
        };
        let end = row.positions.last().map_or(0, |&p| p as usize + 1);
        req.progress = req.progress.max(end);
        if req.generated == 0 {
            req.prefilled += row.tokens.len();
        }
        if let Some(conv) = convs.get_mut(&row.conv) {
            conv.kv_len = conv.kv_len.max(end);
        }
    }

    /// Appends a sampled token: it becomes the request's next (one-token) work.
    pub fn push_token(&mut self, id: RequestId, token: u32, convs: &mut Conversations) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        req.generated += 1;
        if let Some(conv) = convs.get_mut(&req.conv) {
            conv.tokens.push(token);
            let p = conv.tokens.len() - 1;
            req.work.push_back(p..p + 1);
        }
    }
}

/// The device pool had no free block for a running request.
#[derive(Debug)]
pub(crate) struct NoBlock;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::Conversation;
    use crate::kv::{BlockAllocator, HostPool, LruPolicy};

    const CHUNK: usize = 4;

    fn setup(
        blocks: usize,
        host_bytes: usize,
        limits: Limits,
    ) -> (Scheduler, Conversations, CacheManager) {
        let cache = CacheManager::new(
            BlockAllocator::new(blocks, CHUNK),
            HostPool::new(host_bytes),
            Box::new(LruPolicy),
            1,
        );
        (Scheduler::new(limits), Conversations::new(), cache)
    }

    fn submit(
        s: &mut Scheduler,
        convs: &mut Conversations,
        conv: u64,
        prompt: usize,
        now: Instant,
    ) -> RequestId {
        let id = RequestId(conv);
        let c = convs
            .entry(ConversationId(conv))
            .or_insert_with(|| Conversation::new(now, Vec::new()));
        c.busy = true;
        s.enqueue(Request::new(id, ConversationId(conv), now, vec![7; prompt]));
        id
    }

    /// Applies a plan as the engine would, with every sampled row producing token 9.
    fn commit(
        s: &mut Scheduler,
        convs: &mut Conversations,
        cache: &mut CacheManager,
        plan: &StepPlan,
    ) {
        for o in &plan.swap_out {
            cache.host.store(o.host, vec![0.0; o.len]);
            cache.complete_swap_out(convs, o);
        }
        for i in &plan.swap_in {
            cache.host.take(i.host);
            cache.complete_swap_in(convs, i);
        }
        for row in &plan.rows {
            s.commit_row(row, convs);
            if row.sample {
                s.push_token(row.request, 9, convs);
            }
        }
        cache.check(convs).unwrap();
    }

    #[test]
    fn admission_is_fcfs_and_keeps_the_reserve() {
        let limits = Limits {
            token_budget: 100,
            reserve_blocks: 1,
            swap_out_blocks: 0,
        };
        let (mut s, mut convs, mut cache) = setup(10, 0, limits);
        let now = Instant::now();
        for conv in 0..3 {
            submit(&mut s, &mut convs, conv, 12, now);
        }
        let plan = s.schedule(&mut convs, &mut cache, now);
        // Each needs 4 blocks (12 tokens + the first output); the third would eat the reserve.
        assert_eq!(plan.rows.len(), 2);
        assert_eq!(
            s.waiting.iter().copied().collect::<Vec<_>>(),
            vec![RequestId(2)]
        );
        assert!(plan.rows.iter().all(|r| r.sample && r.tokens.len() == 12));
        assert!(plan.rejected.is_empty());
        commit(&mut s, &mut convs, &mut cache, &plan);
    }

    #[test]
    fn decode_out_of_blocks_suspends_the_latest_arrival() {
        let limits = Limits {
            token_budget: 100,
            reserve_blocks: 0,
            swap_out_blocks: 0,
        };
        let (mut s, mut convs, mut cache) = setup(4, 1 << 20, limits);
        let t0 = Instant::now();
        submit(&mut s, &mut convs, 0, 4, t0);
        submit(
            &mut s,
            &mut convs,
            1,
            4,
            t0 + std::time::Duration::from_millis(1),
        );
        for _ in 0..8 {
            let plan = s.schedule(&mut convs, &mut cache, t0);
            commit(&mut s, &mut convs, &mut cache, &plan);
            if s.suspensions > 0 {
                break;
            }
        }
        assert_eq!(s.suspensions, 1);
        assert_eq!(s.running, vec![RequestId(0)]);
        assert_eq!(s.waiting.front(), Some(&RequestId(1)));
        // Its KV went to the host tier, not lost.
        assert!(convs[&ConversationId(1)]
            .chunks
            .iter()
            .any(|c| matches!(c, ChunkLoc::Host(_))));
    }

    #[test]
    fn idle_conversations_are_swapped_out_ahead_of_time() {
        let limits = Limits {
            token_budget: 100,
            reserve_blocks: 0,
            swap_out_blocks: 3,
        };
        let (mut s, mut convs, mut cache) = setup(4, 1 << 20, limits);
        let now = Instant::now();
        submit(&mut s, &mut convs, 0, 11, now);
        let plan = s.schedule(&mut convs, &mut cache, now);
        commit(&mut s, &mut convs, &mut cache, &plan);
        // The turn ends: its conversation is idle and holds 3 of 4 blocks.
        s.remove(RequestId(0));
        if let Some(c) = convs.get_mut(&ConversationId(0)) {
            c.busy = false;
        }
        cache.settle(&mut convs, ConversationId(0), 12);
        let plan = s.schedule(&mut convs, &mut cache, now);
        assert_eq!(plan.swap_out.len(), 2, "free 1 + 2 swapped = threshold 3");
        assert_eq!(plan.swap_out[0].chunk, 0, "leading chunk first");
        commit(&mut s, &mut convs, &mut cache, &plan);
        assert_eq!(cache.blocks.num_free(), 3);
    }
}
