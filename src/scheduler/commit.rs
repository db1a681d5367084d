//! Applying a step's outcome (`Scheduler::commit`): where a running turn's tokens, remaining
//! work and counters change, from the plan and what actually ran. Tokens whose KV a turn took
//! from other conversations (`share.rs`) stay pending until its rows run past them; they enter
//! the history here like the rest.
//!
//! A drafted row (`draft.rs`) keeps the drafts its turn's sampler agreed with: they enter the
//! history with their KV, the refused ones' blocks go back to the pool, and how the draft
//! fared updates the conversation's `Acceptance`. A turn that ends on a token before the
//! step's last takes the rest back (`retract`).

use std::time::Instant;

use super::plan::{Outcome, RowPlan, Run, RunKind, StepPlan};
use super::Scheduler;
use crate::conversation::{Conversations, Settlement};
use crate::ids::RequestId;
use crate::kv::CacheManager;

impl<T> Scheduler<T> {
    /// Applies a step: admissions set their work, each row that ran extends its conversation
    /// and consumes its work, sampled tokens become the next work, and requests whose KV was
    /// lost go back to the queue.
    pub fn commit(
        &mut self,
        plan: &StepPlan,
        outcome: &Outcome,
        convs: &mut Conversations,
        cache: &mut CacheManager,
        now: Instant,
    ) {
        for a in &plan.admitted {
            if let Some(req) = self.requests.get_mut(&a.request) {
                req.first_run.get_or_insert(now);
                req.work = a.work.clone();
                req.progress = 0;
                if let Some(r) = a.first_reuse {
                    req.counts.reused_device = r.device;
                    req.counts.reused_host = r.host;
                    req.counts.reused_store = r.store;
                }
                req.admitted = true;
                req.recount = false;
            }
        }
        let price = self.draft_price();
        for (row, _) in plan.rows.iter().zip(&outcome.ran).filter(|&(_, &ran)| ran) {
            // A drafted row keeps the drafts its sampled tokens agreed with: all but the last.
            let accepted = match row.drafted {
                0 => 0,
                _ => (outcome.sampled.iter())
                    .find(|(id, _)| *id == row.request)
                    .map_or(0, |(_, t)| t.len().saturating_sub(1)),
            };
            self.commit_row(row, (accepted, price), convs, cache);
        }
        // Aging for `prefill_order`: unfinished work that had no row this step was passed over.
        let ran: Vec<RequestId> = (plan.rows.iter().zip(&outcome.ran))
            .filter(|&(_, &ran)| ran)
            .map(|(row, _)| row.request)
            .collect();
        for id in &self.running {
            if let Some(req) = self.requests.get_mut(id) {
                req.passed = match ran.contains(id) || req.decoding() {
                    true => 0,
                    false => req.passed + 1,
                };
            }
        }
        for (id, tokens) in &outcome.sampled {
            let (Some(req), Some(&token)) = (self.requests.get_mut(id), tokens.last()) else {
                continue;
            };
            // The tokens before the last are accepted drafts, in the history by now.
            let p = convs.get(&req.conv).map_or(0, |c| c.tokens().len()) + req.pending.len();
            req.pending.push(token);
            req.generated += tokens.len();
            req.work.push_back(Run {
                range: p..p + 1,
                kind: RunKind::Decode,
            });
        }
        for &id in &outcome.requeue {
            if let Some(req) = self.requests.get_mut(&id) {
                req.recount = true;
            }
            self.requeue(id, cache);
        }
    }

    fn commit_row(
        &mut self,
        row: &RowPlan,
        (accepted, price): (usize, f32),
        convs: &mut Conversations,
        cache: &mut CacheManager,
    ) {
        let Some(req) = self.requests.get_mut(&row.request) else {
            return;
        };
        let Some(conv) = convs.get_mut(&row.conv) else {
            return;
        };
        // Drafts past the accepted ones computed KV for tokens that are not the
        // conversation's: the row ends before them.
        let worked = row.tokens.len() - row.drafted;
        let kept = worked + accepted;
        let end = row
            .positions
            .get(kept.wrapping_sub(1))
            .map_or(0, |&p| p as usize + 1);
        let new = end
            .saturating_sub(conv.tokens().len())
            .min(req.pending.len());
        if row.decoded == row.tokens.len() {
            conv.acceptance.record(row.drafted, accepted, price);
        }
        let tokens = (req.pending.drain(..new))
            .chain(row.tokens[worked..kept].iter().copied())
            .collect();
        let ran = Settlement::Ran {
            tokens,
            computed: end,
            refused: accepted < row.drafted,
        };
        convs.settle(row.conv, ran, cache);
        let mut left = worked;
        while left > 0 {
            let Some(run) = req.work.front_mut() else {
                break;
            };
            let take = left.min(run.range.len());
            run.range.start += take;
            left -= take;
            if run.range.is_empty() {
                req.work.pop_front();
            }
        }
        req.progress = req.progress.max(end);
        req.counts.recomputed += row.recomputed;
        req.counts.drafted += row.drafted;
        req.counts.accepted += accepted;
        req.counts.prefilled += row.tokens.len() - row.decoded;
    }

    /// Takes back the last `n` tokens a step gave `id`'s turn: those sampled after the token
    /// the turn ended with (a step may sample several, from accepted drafts). The history
    /// and the KV end with that token again.
    pub fn retract(
        &mut self,
        id: RequestId,
        n: usize,
        convs: &mut Conversations,
        cache: &mut CacheManager,
    ) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        let Some(conv) = convs.get(&req.conv) else {
            return;
        };
        let from_pending = n.min(req.pending.len());
        req.pending.truncate(req.pending.len() - from_pending);
        let len = conv.tokens().len() - (n - from_pending).min(conv.tokens().len());
        convs.settle(req.conv, Settlement::Truncate(len), cache);
        req.generated = req.generated.saturating_sub(n);
        let end = len + req.pending.len();
        req.work.retain_mut(|run| {
            run.range.end = run.range.end.min(end);
            !run.range.is_empty()
        });
        req.progress = req.progress.min(len);
    }
}
