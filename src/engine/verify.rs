//! A step's sampled tokens: one per row, or for a drafted row (see `scheduler/draft.rs`) the
//! drafts the turn's own sampler agrees with and the token it samples after them, each taken
//! by the turn in order.
//!
//! Verification samples each position exactly as plain decoding would (same logits, since a
//! row's logits do not depend on the rest of its batch; same sampler state, one draw per
//! token), and stops at the first token that differs from the draft. So speculation changes
//! how many tokens a step yields, never which.

use std::time::Instant;

use candle_core::Tensor;

use super::{sampler, Engine};
use crate::ids::RequestId;
use crate::scheduler::RowPlan;
use crate::{Error, Result};

impl Engine {
    /// Samples `row`'s tokens from `logits`, its rows from `first` on: one token, or while
    /// the sampled tokens are the drafted ones, one more per drafted token.
    pub(super) fn verify(
        &mut self,
        row: &RowPlan,
        logits: Option<&Tensor>,
        first: usize,
    ) -> Result<Vec<u32>> {
        let drafts = &row.tokens[row.tokens.len() - row.drafted..];
        let mut tokens = Vec::with_capacity(1 + drafts.len());
        for i in 0..=drafts.len() {
            let token = self.sample(row.request, logits, first + i)?;
            tokens.push(token);
            if drafts.get(i) != Some(&token) {
                break;
            }
        }
        self.stats.drafted_tokens += drafts.len() as u64;
        self.stats.accepted_tokens += (tokens.len() - 1) as u64;
        Ok(tokens)
    }

    /// Samples `id`'s next token from row `index` of `logits`.
    fn sample(&mut self, id: RequestId, logits: Option<&Tensor>, index: usize) -> Result<u32> {
        let row = logits
            .ok_or_else(|| Error::InvalidBatch("no logits for a sampled row".into()))?
            .get(index)?;
        let req = self.sched.get_mut(id).ok_or(Error::UnknownRequest(id))?;
        let context = self.convs.get(&req.conv()).map_or(&[][..], |c| c.tokens());
        let token = req.payload.sampler().sample(&row, context)?;
        if let Some(top) = req.payload.params().logprobs {
            let lp = sampler::logprobs(&row, token, top)?;
            req.payload.push_logprobs(lp);
        }
        Ok(token)
    }

    /// The turn of `id` takes the tokens a step sampled for it, in order, until one ends it;
    /// the tokens after that one are taken back from its conversation.
    pub(super) fn accept_tokens(&mut self, id: RequestId, tokens: &[u32], now: Instant) {
        for (i, &token) in tokens.iter().enumerate() {
            let after = tokens.len() - 1 - i;
            if !self.accept_token(id, token, after, now) {
                break;
            }
        }
    }
}
