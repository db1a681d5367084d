//! The end of a turn: its last token accepted, its reply settled into the conversation as the
//! client received it (tokens past a stop string or a cut character replaced by the text's
//! own tokens), or, for a turn cancelled or failed, the conversation rolled back to where it
//! was before the turn (tokens and KV; the transcript never took the turn). A history cut
//! made for the turn (context overflow) stays.

use std::time::Instant;

use super::turn::ActiveTurn;
use super::{CacheMode, Engine, Event, FinishReason, TurnStats};
use crate::conversation::Settlement;
use crate::ids::{ConversationId, RequestId};

impl Engine {
    /// Takes a sampled token (already committed to the turn, with `after` more sampled in the
    /// same step): emits it, and ends the turn if a stop rule fires, taking the tokens after
    /// it back. Returns whether the turn goes on.
    pub(super) fn accept_token(
        &mut self,
        id: RequestId,
        token: u32,
        after: usize,
        now: Instant,
    ) -> bool {
        let Some(req) = self.sched.get_mut(id) else {
            return false;
        };
        let conv = req.conv();
        // The last sampled token is pending beyond the history, the others in it: the
        // conversation is one longer than the history, less the tokens after this one.
        let length = self.convs.get(&conv).map_or(0, |c| c.tokens().len()) + 1 - after;
        let full = length >= self.limits.max_conversation_tokens();
        self.stats.generated_tokens += 1;
        let finish = match req.payload.accept(&self.model, token, full, now) {
            Ok(accepted) => {
                self.backlog.push(Event::Token {
                    request: id,
                    conversation: conv,
                    token,
                    text: accepted.text,
                    logprobs: accepted.logprobs,
                });
                accepted.finish
            }
            Err(e) => Some(FinishReason::failed(e)),
        };
        let Some(reason) = finish else {
            return true;
        };
        self.sched
            .retract(id, after, &mut self.convs, &mut self.cache);
        self.finish(id, reason, now);
        false
    }

    /// Ends a turn: its KV stays cached (released in `Stateless` mode), the conversation
    /// records the exchange, and a `Finished` event is emitted.
    pub(super) fn finish(&mut self, id: RequestId, reason: FinishReason, now: Instant) {
        let Some(req) = self.sched.finish(id, &mut self.convs, &mut self.cache, now) else {
            return;
        };
        let conv_id = req.conv();
        let counts = req.counts();
        let admitted = req.admitted();
        let queue_time = req.queue_time(now);
        let turn = req.payload;
        let history = turn.history_tokens();
        let stats = TurnStats {
            history_tokens: history,
            prompt_tokens: turn.prompt_tokens(),
            output_tokens: turn.output_tokens(),
            ttft: turn
                .first_token()
                .map(|t| t - turn.submitted())
                .unwrap_or_default(),
            latency: now.saturating_duration_since(turn.submitted()),
            queue_time,
            reused_tokens: counts.reused_device + counts.reused_host + counts.reused_store,
            reused_from_host_tokens: counts.reused_host,
            reused_from_store_tokens: counts.reused_store,
            recomputed_tokens: counts.recomputed,
            prefilled_tokens: counts.prefilled,
            drafted_tokens: counts.drafted,
            accepted_tokens: counts.accepted,
            stop_string: turn.stopped_by().map(str::to_string),
        };
        let completed = !matches!(reason, FinishReason::Failed(_) | FinishReason::Cancelled);
        if admitted {
            self.stats.reused_device_tokens += counts.reused_device as u64;
            self.stats.reused_host_tokens += counts.reused_host as u64;
            self.stats.reused_store_tokens += counts.reused_store as u64;
            self.stats.recomputed_tokens += counts.recomputed as u64;
            self.stats.prefilled_tokens += counts.prefilled as u64;
            if completed {
                self.settle_reply(id, conv_id, turn);
            }
        }
        // A turn never admitted may have booked shared chunks past the history in the table.
        if !completed {
            self.roll_back(conv_id, history);
        }
        if self.config.mode == CacheMode::Stateless {
            self.cache.release_all(conv_id);
        }
        if admitted && completed {
            self.index_finished(conv_id);
        }
        self.stats.turns_finished += 1;
        self.backlog.push(Event::Finished {
            request: id,
            conversation: conv_id,
            reason,
            stats,
        });
    }

    /// Records a finished turn's exchange; when its reply was cut short of what was generated,
    /// the history keeps the tokens whose text the client received whole, then the text's
    /// own tokens for the rest (without KV: the next turn computes them).
    fn settle_reply(&mut self, id: RequestId, conv_id: ConversationId, turn: ActiveTurn) {
        let trim = turn.trim(&self.model);
        let calls = self.tool_calls(conv_id, id, &turn);
        let Some(length) = self.convs.get(&conv_id).map(|c| c.tokens().len()) else {
            return;
        };
        // A rest that cannot be tokenized leaves the generated tokens: the history then holds
        // text the client did not get, which is better than failing a finished turn.
        if let Ok(Some((kept, tail))) = trim {
            let keep = length - turn.output_tokens() + kept;
            let trimmed = Settlement::Trim { keep, tail };
            self.convs.settle(conv_id, trimmed, &mut self.cache);
        }
        if let Some(conv) = self.convs.get_mut(&conv_id) {
            turn.record(&self.model, conv, calls);
        }
    }

    /// Takes the conversation back to the `history` tokens it had before a turn that did not
    /// complete.
    fn roll_back(&mut self, conv_id: ConversationId, history: usize) {
        let back = Settlement::Truncate(history);
        self.convs.settle(conv_id, back, &mut self.cache);
    }
}
