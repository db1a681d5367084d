//! Applying a step's outcome (`Scheduler::commit`): where a running turn's tokens, remaining
//! work and counters change, from the plan and what actually ran. Tokens whose KV a turn took
//! from other conversations (`share.rs`) stay pending until its rows run past them; they enter
//! the history here like the rest.

use std::time::Instant;

use super::plan::{Outcome, RowPlan, Run, RunKind, StepPlan};
use super::Scheduler;
use crate::conversation::Conversations;
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
        for (row, _) in plan.rows.iter().zip(&outcome.ran).filter(|(_, &ran)| ran) {
            self.commit_row(row, convs, cache);
        }
        for &(id, token) in &outcome.sampled {
            let Some(req) = self.requests.get_mut(&id) else {
                continue;
            };
            let p = convs.get(&req.conv).map_or(0, |c| c.tokens().len()) + req.pending.len();
            req.pending.push(token);
            req.generated += 1;
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

    fn commit_row(&mut self, row: &RowPlan, convs: &mut Conversations, cache: &mut CacheManager) {
        let Some(req) = self.requests.get_mut(&row.request) else {
            return;
        };
        let Some(conv) = convs.get_mut(&row.conv) else {
            return;
        };
        let end = row.positions.last().map_or(0, |&p| p as usize + 1);
        let new = end
            .saturating_sub(conv.tokens().len())
            .min(req.pending.len());
        conv.extend_tokens(req.pending.drain(..new));
        let mut left = row.tokens.len();
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
        req.counts.prefilled += row.tokens.len() - row.decoded;
        cache.mark_computed(row.conv, end);
    }
}
