//! One request's row of a step: the next positions of its work within the step's budget,
//! with their tokens, slots and context, and for a decode row the tokens drafted after it
//! (`draft.rs`).

use std::collections::VecDeque;

use super::plan::{RowPlan, Run, RunKind};
use super::{RowError, Scheduler};
use crate::conversation::Conversations;
use crate::ids::RequestId;
use crate::kv::{CacheManager, Violation};

impl<T> Scheduler<T> {
    /// Takes the next tokens of `id`'s work (`work`, or its own) within `budget`, giving the
    /// new positions blocks. The work itself is consumed only at commit.
    pub(super) fn plan_row(
        &self,
        id: RequestId,
        work: Option<&VecDeque<Run>>,
        convs: &Conversations,
        cache: &mut CacheManager,
        budget: usize,
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
        let conv = convs.get(&req.conv);
        let history = conv.map_or(&[][..], |c| c.tokens());
        // A decode row alone (one sampled token fed back) drafts the tokens after it.
        let alone = decoded == 1 && positions.len() == 1 && taken_runs == work.len();
        let mut drafted = match (&conv, alone) {
            (Some(c), true) if self.limits.speculation.is_on() => {
                let cap = (budget - 1)
                    .min(self.limits.window.saturating_sub(last + 1))
                    .min(req.max_tokens.saturating_sub(req.generated + 1));
                let odds = (&c.acceptance, self.draft_price());
                (self.limits.speculation).draft(history, &req.pending, odds, cap)
            }
            _ => Vec::new(),
        };
        // Drafts take the blocks there are room for, and no more.
        for end in last + 1..last + 1 + drafted.len() {
            if end.is_multiple_of(chunk) && !cache.grow(req.conv) {
                drafted.truncate(end - last - 1);
                break;
            }
        }
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
}
