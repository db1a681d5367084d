//! Scheduler and cache bookkeeping without a model: plans are applied as the engine would,
//! with every sampled row producing token 9 and every copy succeeding.

use std::time::Duration;

use super::*;
use crate::conversation::Conversation;
use crate::kv::{ChunkLoc, LruPolicy};

const CHUNK: usize = 4;

struct World {
    s: Scheduler<()>,
    convs: Conversations,
    cache: CacheManager,
    t0: Instant,
}

fn world(blocks: usize, host_chunks: usize, reserve: usize, swap_out: usize) -> World {
    World {
        s: Scheduler::new(Limits {
            token_budget: 100,
            reserve_blocks: reserve,
            swap_out_blocks: swap_out,
            prefetch_window: 8,
            sharing: false,
            speculation: Speculation::off(),
            window: 1 << 20,
        }),
        convs: Conversations::new(),
        // One byte per KV-token: the host budget counts tokens.
        cache: CacheManager::new(blocks, CHUNK, host_chunks * CHUNK, Box::new(LruPolicy), 1),
        t0: Instant::now(),
    }
}

impl World {
    /// A turn of `conv` with a `prompt`-token prompt, arriving `ms` after the start.
    fn submit(&mut self, conv: u64, prompt: usize, ms: u64) -> RequestId {
        let c = ConversationId(conv);
        if !self.convs.contains_key(&c) {
            self.convs.insert(c, Conversation::new(Vec::new()));
            self.cache.open(c, self.t0);
        }
        let id = RequestId(self.s.requests.len() as u64 * 100 + conv);
        let arrival = self.t0 + Duration::from_millis(ms);
        self.s
            .enqueue(id, c, arrival, (vec![7 + conv as u32; prompt], 1 << 20), ());
        id
    }

    fn plan(&mut self) -> StepPlan {
        self.s.schedule(&self.convs, &mut self.cache, self.t0)
    }

    /// Applies `plan` as the engine does when every copy and row succeeds.
    fn commit(&mut self, plan: &StepPlan) {
        for o in &plan.moves.swap_out {
            self.cache
                .complete_swap_out(o, std::sync::Arc::new(vec![0; o.len].into()));
        }
        for i in &plan.moves.swap_in {
            assert!(self.cache.take_swap_in(i, false).is_some());
            self.cache.complete_swap_in(i);
        }
        let outcome = Outcome {
            ran: vec![true; plan.rows.len()],
            sampled: plan
                .rows
                .iter()
                .filter(|r| r.sample)
                .map(|r| (r.request, vec![9]))
                .collect(),
            requeue: Vec::new(),
        };
        let now = Instant::now();
        self.s
            .commit(plan, &outcome, &mut self.convs, &mut self.cache, now);
        self.check();
    }

    fn step(&mut self) -> StepPlan {
        let plan = self.plan();
        assert!(plan.broken.is_empty(), "{:?}", plan.broken);
        self.commit(&plan);
        plan
    }

    fn check(&self) {
        self.cache.check().unwrap();
        self.s.check().unwrap();
    }

    fn chunks(&self, conv: u64) -> Vec<ChunkLoc> {
        self.cache.locs(ConversationId(conv))
    }
}

#[test]
fn admission_is_fcfs_and_keeps_the_reserve() {
    let mut w = world(10, 0, 1, 0);
    for conv in 0..3 {
        w.submit(conv, 12, 0);
    }
    let plan = w.plan();
    // Each needs 4 blocks (12 tokens + the first output); the third would eat the reserve.
    assert_eq!(plan.rows.len(), 2);
    assert_eq!(w.s.waiting.len(), 1);
    assert!(plan.rows.iter().all(|r| r.sample && r.tokens.len() == 12));
    assert!(plan.rejected.is_empty());
    // Planning changed no conversation: the prompts enter the history at commit.
    assert!(w.convs.iter().all(|(_, c)| c.tokens().is_empty()));
    w.commit(&plan);
    assert_eq!(w.convs[&ConversationId(0)].tokens().len(), 12);
}

#[test]
fn decode_out_of_blocks_suspends_the_latest_arrival() {
    let mut w = world(4, 16, 0, 0);
    w.submit(0, 4, 0);
    w.submit(1, 4, 1);
    for _ in 0..8 {
        w.step();
        if w.s.suspensions > 0 {
            break;
        }
    }
    assert_eq!(w.s.suspensions, 1);
    assert_eq!(w.s.running.len(), 1);
    let running = w.s.requests[&w.s.running[0]].conv;
    assert_eq!(running, ConversationId(0));
    // Its KV went to the host tier, not lost.
    assert!(w.chunks(1).iter().any(|c| matches!(c, ChunkLoc::Host(_))));
}

/// Defect 3: the victim is the latest arrival, not the last admitted. A turn that arrived
/// first but was admitted last (here: queued behind a later arrival) is kept running.
#[test]
fn suspension_spares_an_early_arrival_admitted_last() {
    let mut w = world(4, 16, 0, 0);
    let late = w.submit(1, 4, 5);
    let early = w.submit(0, 4, 0);
    let plan = w.step();
    assert_eq!(plan.rows.len(), 2);
    assert_eq!(w.s.running, vec![late, early]);
    for _ in 0..8 {
        w.step();
        if w.s.suspensions > 0 {
            break;
        }
    }
    assert_eq!(w.s.suspensions, 1);
    assert_eq!(w.s.running, vec![early]);
    assert_eq!(w.s.waiting.front(), Some(&late));
}

#[test]
fn idle_conversations_are_swapped_out_ahead_of_time() {
    let mut w = world(4, 16, 0, 3);
    let id = w.submit(0, 11, 0);
    w.step();
    // The turn ends: its conversation is idle and holds 3 of 4 blocks.
    w.s.finish(id, &mut w.convs, &mut w.cache, w.t0);
    let plan = w.plan();
    assert_eq!(
        plan.moves.swap_out.len(),
        2,
        "free 1 + 2 swapped = threshold 3"
    );
    assert_eq!(plan.moves.swap_out[0].chunk, 0, "leading chunk first");
    w.commit(&plan);
    assert_eq!(w.cache.num_free_blocks(), 3);
}

/// Defect 4: without a host tier, keeping blocks free ahead of time must not drop anyone's
/// KV; dropping happens only when a turn needs the blocks.
#[test]
fn ahead_of_time_eviction_never_drops() {
    let mut w = world(4, 0, 0, 3);
    let id = w.submit(0, 11, 0);
    w.step();
    w.s.finish(id, &mut w.convs, &mut w.cache, w.t0);
    let plan = w.plan();
    assert!(plan.is_empty(), "{plan:?}");
    assert_eq!(w.cache.counters().chunks_dropped_from_device, 0);
    assert!(w.chunks(0).iter().all(|c| matches!(c, ChunkLoc::Device(_))));
    // On demand, it is dropped: a new conversation needs 3 blocks.
    w.submit(1, 11, 1);
    let plan = w.step();
    assert_eq!(plan.rows.len(), 1);
    assert!(w.cache.counters().chunks_dropped_from_device > 0);
}

/// Defect 1: a conversation whose chunks are being swapped out in the step that admits it
/// gets them back (the copies are cancelled), instead of rows without slots.
#[test]
fn admission_reclaims_chunks_being_swapped_out_in_the_same_step() {
    let mut w = world(4, 16, 0, 0);
    let id = w.submit(0, 7, 0);
    w.step();
    w.s.finish(id, &mut w.convs, &mut w.cache, w.t0);
    let mut plan = StepPlan::default();
    w.cache
        .evict_device(&|_| false, 4, Eviction::OnDemand, w.t0, &mut plan.moves);
    assert_eq!(plan.moves.swap_out.len(), 2);
    let again = w.submit(0, 3, 1);
    let mut budget = 100;
    w.s.admit_and_fill(&[], (&w.convs, w.t0), &mut w.cache, &mut budget, &mut plan);
    assert!(plan.broken.is_empty(), "{:?}", plan.broken);
    assert!(plan.moves.swap_out.is_empty(), "copies cancelled");
    let row = &plan.rows[0];
    assert_eq!(row.request, again);
    assert_eq!(row.ctx_len, 11);
    assert_eq!(row.blocks.len(), 11usize.div_ceil(CHUNK));
    // The block table names the blocks the chunk table holds, the row's slots inside them.
    let named: Vec<u32> = (w.chunks(0).iter())
        .filter_map(|c| c.readable_block().map(|b| b.0))
        .collect();
    assert_eq!(row.blocks, named[..row.blocks.len()]);
    for (&p, &slot) in row.positions.iter().zip(&row.slots) {
        let b = row.blocks[p as usize / CHUNK];
        assert_eq!(slot as usize, b as usize * CHUNK + p as usize % CHUNK);
    }
    assert!(w.chunks(0).iter().all(|c| matches!(c, ChunkLoc::Device(_))));
    w.commit(&plan);
    assert_eq!(w.cache.counters().bytes_swapped_out, 0);
}

/// Defect 5: when a turn is suspended during decode and its KV dropped, the work redone at
/// re-admission counts as recomputed (and prefilled), not as nothing.
#[test]
fn work_redone_after_a_suspension_is_counted() {
    let mut w = world(4, 0, 0, 0);
    let first = w.submit(0, 4, 0);
    let second = w.submit(1, 4, 1);
    let mut steps = 0;
    while w.s.suspensions == 0 && steps < 16 {
        w.step();
        steps += 1;
    }
    assert_eq!(w.s.suspensions, 1);
    // The victim's KV was dropped (no host tier); finish the first turn to make room.
    w.s.finish(first, &mut w.convs, &mut w.cache, w.t0);
    let computed = w.cache.table(ConversationId(1)).unwrap().computed();
    let before = w.s.requests[&second].counts;
    assert_eq!(before.recomputed, 0);
    w.step();
    let after = w.s.requests[&second].counts;
    assert_eq!(after.recomputed, computed);
    assert_eq!(after.prefilled, before.prefilled + computed);
}

#[test]
fn a_request_that_can_never_fit_is_rejected() {
    let mut w = world(2, 0, 0, 0);
    let id = w.submit(0, 9, 0);
    let plan = w.plan();
    assert_eq!(
        plan.rejected,
        vec![Rejection {
            request: id,
            needed: 12,
            available: 8
        }]
    );
}

/// Two idle conversations with 2 of 6 blocks each (conversation 1 the least recently used)
/// and a turn of conversation 2 that needs 3 blocks of the 2 free, with (`queued`) a turn of
/// conversation 1 behind it: the conversations admission swaps chunks out of.
fn admission_victims(queued: bool) -> Vec<u64> {
    let mut w = world(6, 16, 0, 0);
    for (conv, at) in [(1, 0), (0, 10)] {
        let id = w.submit(conv, 7, at);
        w.step();
        w.s.finish(id, &mut w.convs, &mut w.cache, w.t0);
        w.cache
            .touch(ConversationId(conv), w.t0 + Duration::from_millis(at));
    }
    w.submit(2, 11, 20);
    if queued {
        w.submit(1, 3, 21);
    }
    let now = w.t0 + Duration::from_millis(30);
    let plan = w.s.schedule(&w.convs, &mut w.cache, now);
    plan.moves.swap_out.iter().map(|o| o.conv.0).collect()
}

/// Admission frees blocks from idle conversations before it touches the KV of a turn queued
/// behind it, even when the queued one's KV is the least recently used.
#[test]
fn admission_evicts_idle_conversations_before_queued_ones() {
    assert_eq!(admission_victims(false), vec![1], "the least recently used");
    let victims = admission_victims(true);
    assert!(!victims.is_empty());
    assert!(
        victims.iter().all(|&c| c == 0),
        "swapped out of {victims:?}"
    );
}

#[test]
fn a_decode_row_drafts_from_its_history_and_keeps_only_the_accepted_drafts() {
    let mut w = world(16, 0, 0, 0);
    w.s.limits.speculation = Speculation::default();
    let c = ConversationId(1);
    w.convs.insert(c, Conversation::new(Vec::new()));
    w.cache.open(c, w.t0);
    let prompt = vec![1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2];
    w.s.enqueue(RequestId(1), c, w.t0, (prompt, 100), ());
    let apply = |w: &mut World, plan: &StepPlan, tokens: Vec<u32>| {
        let outcome = Outcome {
            ran: vec![true; plan.rows.len()],
            sampled: vec![(RequestId(1), tokens)],
            requeue: Vec::new(),
        };
        (w.s).commit(plan, &outcome, &mut w.convs, &mut w.cache, w.t0);
        w.check();
    };
    let prefill = w.plan();
    assert_eq!(prefill.rows[0].drafted, 0);
    apply(&mut w, &prefill, vec![3]);
    // A conversation whose drafts were all taken drafts what followed "6 1 2 3" last, up to
    // the history's end.
    let conv = w.convs.get_mut(&c).unwrap();
    for _ in 0..20 {
        conv.acceptance.record(4, 4, 0.3);
    }
    let decode = w.plan();
    let row = &decode.rows[0];
    assert_eq!(
        (&row.tokens[..], row.drafted),
        (&[3, 4, 5, 6, 1, 2, 3][..], 6)
    );
    assert_eq!(row.positions, (14..21).collect::<Vec<_>>());
    assert_eq!(w.cache.table(c).map(|t| t.len()), Some(6));
    // The sampler took 4, then sampled 7 where 5 was drafted.
    apply(&mut w, &decode, vec![4, 7]);
    let tokens = w.convs.get(&c).map(|c| c.tokens().to_vec()).unwrap();
    assert_eq!(tokens[12..], [1, 2, 3, 4]);
    // The blocks past position 15 held only refused drafts: they went back to the pool.
    assert_eq!(
        w.cache.table(c).map(|t| (t.len(), t.computed())),
        Some((4, 16))
    );
    let next = w.plan();
    assert_eq!((next.rows[0].tokens[0], next.rows[0].positions[0]), (7, 16));
}

#[test]
fn drafts_are_cut_where_rows_with_nothing_to_draft_would_wait_for_them() {
    let mut w = world(32, 0, 0, 0);
    w.s.limits.speculation = Speculation::default();
    for (conv, prompt) in [(1, [1, 2, 3, 4].repeat(4)), (2, (10..26).collect())] {
        let c = ConversationId(conv);
        let mut state = Conversation::new(Vec::new());
        for _ in 0..20 {
            state.acceptance.record(4, 4, 0.3);
        }
        w.convs.insert(c, state);
        w.cache.open(c, w.t0);
        w.s.enqueue(RequestId(conv), c, w.t0, (prompt, 100), ());
    }
    let prefill = w.plan();
    let outcome = Outcome {
        ran: vec![true; prefill.rows.len()],
        sampled: vec![(RequestId(1), vec![1]), (RequestId(2), vec![99])],
        requeue: Vec::new(),
    };
    (w.s).commit(&prefill, &outcome, &mut w.convs, &mut w.cache, w.t0);
    // Conversation 2 has nothing to draft, and a step costs about two tokens' work here (the
    // prior): conversation 1's draft would slow it by far more than a fiftieth.
    assert!(w.s.drafts(&w.convs).is_empty());
    // Alone, conversation 1 drafts what followed "2 3 4 1" before.
    (w.s).finish(RequestId(2), &mut w.convs, &mut w.cache, w.t0);
    let drafts = w.s.drafts(&w.convs);
    assert_eq!(
        drafts.get(&RequestId(1)).map(|d| d[..4].to_vec()),
        Some(vec![2, 3, 4, 1])
    );
}

/// Issue 74: a short turn arriving while a long prefill runs starts in the next step, beside
/// it, instead of waiting for the whole prefill.
#[test]
fn a_short_turn_starts_beside_a_long_prefill() {
    let mut w = world(600, 0, 0, 0);
    let long = w.submit(0, 1000, 0);
    let plan = w.step();
    assert_eq!(plan.rows[0].tokens.len(), 100);
    let short = w.submit(1, 3, 1);
    let plan = w.step();
    let row = |id| plan.rows.iter().find(|r| r.request == id).unwrap();
    assert!(row(short).sample && row(short).tokens.len() == 3);
    assert_eq!(
        row(long).tokens.len(),
        97,
        "the prefill has the rest of the budget"
    );
    // The short turn decodes from now on, ahead of the prefill.
    let plan = w.step();
    assert_eq!(plan.rows[0].request, short);
    assert_eq!(plan.rows[0].tokens.len(), 1);
    assert_eq!(plan.rows[1].tokens.len(), 99);
}

/// A stream of short turns, each as long as the budget, does not starve a long prefill: it is
/// passed over for `AGED_AFTER` steps at most, then goes first.
#[test]
fn a_long_prefill_is_never_starved_by_short_turns() {
    let mut w = world(4000, 0, 0, 0);
    let long = w.submit(0, 2000, 0);
    let mut passed = 0;
    let mut progressed = 0;
    for step in 1..=40u64 {
        w.submit(step, 90, step);
        let plan = w.step();
        match plan.rows.iter().find(|r| r.request == long) {
            Some(row) => {
                passed = 0;
                progressed += row.tokens.len();
            }
            None => passed += 1,
        }
        assert!(passed <= 4, "passed over {passed} steps in a row");
    }
    // Without aging it gets only its first step's 100 tokens.
    assert!(progressed >= 400, "{progressed}");
}
