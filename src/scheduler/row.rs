//! One request's row of a step: the next positions of its work within the step's budget,
//! with their tokens, slots and context, and for a decode row the tokens drafted after it
//! (`draft.rs`).

use std::collections::{HashMap, VecDeque};

use super::plan::{RowPlan, Run, RunKind};
use super::{RowError, Scheduler};
use crate::conversation::Conversations;
use crate::ids::RequestId;
use crate::kv::{CacheManager, Violation};

impl<T> Scheduler<T> {
    /// Takes the next tokens of `id`'s work (`work`, or its own) within `budget`, giving the
    /// new positions blocks; a decode row takes `draft` after its token (as much of it as the
    /// budget and the free blocks allow). The work itself is consumed only at commit.
    pub(super) fn plan_row(
        &self,
        id: RequestId,
        work: Option<&VecDeque<Run>>,
        convs: &Conversations,
        cache: &mut CacheManager,
        (budget, draft): (usize, &[u32]),
    ) -> Result<Option<RowPlan>, RowError> {
        let Some(req) = self.requests.get(&id) else {
            return Ok(None);
        };
        let work = work.unwrap_or(&req.work);
        let (mut positions, mut recomputed, mut decoded) = (Vec::new(), 0, 0);
        let mut taken_runs = 0;
        for run in work {
            let take = (budget - positions.len()).min(run.range.len());
            positions.extend(run.range.start..run.range.start + take);
            match run.kind {
                RunKind::Recompute => recomputed += take,
                RunKind::Decode => decoded += take,
                RunKind::Prefill => {}
            }
            if take < run.range.len() {
                break;
            }
            taken_runs += 1;
        }
        let Some(&last) = positions.last() else {
            return Ok(None);
        };
        let chunk = cache.chunk_size();
        let have = cache.table(req.conv).map_or(0, |t| t.len());
        for _ in have..last / chunk + 1 {
            if !cache.grow(req.conv) {
                return Err(RowError::NoBlock);
            }
        }
        let history = convs.get(&req.conv).map_or(&[][..], |c| c.tokens());
        // Only a decode row alone (one sampled token fed back) verifies drafts.
        let alone = decoded == 1 && positions.len() == 1 && taken_runs == work.len();
        let mut drafted = match alone {
            true => draft[..draft.len().min(budget - 1)].to_vec(),
            false => Vec::new(),
        };
        // Drafts take the blocks there are room for, and no more.
        let mut held = cache.table(req.conv).map_or(0, |t| t.len());
        while held * chunk < last + 1 + drafted.len() && cache.grow(req.conv) {
            held += 1;
        }
        drafted.truncate((held * chunk).saturating_sub(last + 1));
        let first_drafted = last + 1;
        let last = last + drafted.len();
        positions.extend(first_drafted..=last);
        let broken = |position: usize| {
            RowError::Broken(Violation::MissingSlot {
                conversation: req.conv,
                position,
            })
        };
        let token = |p: usize| match p.checked_sub(history.len()) {
            None => Some(history[p]),
            Some(i) => req.pending.get(i).copied(),
        };
        let slot = |p: usize| cache.slot(req.conv, p).ok_or_else(|| broken(p));
        let block = |c: usize| cache.block(req.conv, c).ok_or_else(|| broken(c * chunk));
        let mut tokens: Vec<u32> = (positions[..positions.len() - drafted.len()].iter())
            .map(|&p| token(p).ok_or_else(|| broken(p)))
            .collect::<Result<_, _>>()?;
        tokens.extend(&drafted);
        Ok(Some(RowPlan {
            request: id,
            conv: req.conv,
            tokens,
            slots: positions
                .iter()
                .map(|&p| slot(p))
                .collect::<Result<_, _>>()?,
            positions: positions.iter().map(|&p| p as u32).collect(),
            blocks: (0..=last / chunk).map(block).collect::<Result<_, _>>()?,
            ctx_len: last + 1,
            sample: taken_runs == work.len(),
            recomputed,
            decoded: decoded + drafted.len(),
            drafted: drafted.len(),
        }))
    }

    /// The drafts of the running turns' decode rows for this step: each as long as it pays
    /// for its own turn (`Speculation::draft`), then cut, longest first, until the rows that
    /// draft nothing are slowed by a fiftieth on average at most (within a step's noise).
    /// Every row of a step waits for its drafted tokens, so drafts that pay for the step's
    /// throughput may still slow the turns that have nothing to draft: on a CPU, where a
    /// step of several rows is compute-bound, 8 chats in flight with 2 of them drafting gave
    /// 3% more tokens but a 20% worse p90 latency per token. When every row drafts, nobody
    /// waits for nothing; where a token costs little of a step (a GPU), drafts hardly slow
    /// anyone and the cut leaves them.
    pub(super) fn drafts(&self, convs: &Conversations) -> HashMap<RequestId, Vec<u32>> {
        let spec = &self.limits.speculation;
        let mut drafts = HashMap::new();
        if !spec.is_on() {
            return drafts;
        }
        let price = self.draft_price();
        for id in &self.running {
            let Some(req) = self.requests.get(id) else {
                continue;
            };
            let (Some(conv), [run]) = (convs.get(&req.conv), req.work.as_slices().0) else {
                continue;
            };
            if run.kind != RunKind::Decode || run.range.len() != 1 {
                continue;
            }
            let cap = (self.limits.window.saturating_sub(run.range.end))
                .min(req.max_tokens.saturating_sub(req.generated + 1));
            let odds = (&conv.acceptance, price);
            let draft = match req.prediction.is_empty() {
                true => spec.draft(conv.tokens(), &req.pending, odds, cap),
                false => {
                    let reply = (conv.tokens(), req.pending.as_slice(), req.generated);
                    spec.draft_predicted(&req.prediction, reply, odds, cap)
                }
            };
            if !draft.is_empty() {
                drafts.insert(*id, draft);
            }
        }
        let rows = self.running.len();
        let idle = rows - drafts.len();
        if idle > 0 {
            let fixed = self.step_cost.fixed_tokens();
            let most = (0.02 * (fixed + rows as f64) * rows as f64 / idle as f64) as usize;
            let mut total: usize = drafts.values().map(Vec::len).sum();
            while total > most {
                let Some(longest) = drafts.values_mut().max_by_key(|d| d.len()) else {
                    break;
                };
                longest.pop();
                total -= 1;
            }
            drafts.retain(|_, d| !d.is_empty());
        }
        drafts
    }
}
