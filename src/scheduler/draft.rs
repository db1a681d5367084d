//! Speculative decoding by lookup in the conversation's own history (prompt-lookup decoding,
//! as llama.cpp's lookup and vLLM's `ngram` speculator, but over every turn the engine keeps,
//! not only the prompt a stateless server is sent): the last few tokens are looked for earlier
//! in the history, and the tokens that followed them there are drafted as the row's next
//! tokens. The step verifies them as extra query rows of the same decode row; the engine keeps
//! the prefix its sampler agrees with (see `Engine::execute`), and commit releases the rest.
//!
//! A draft is a single guess, so sampling the model's own distribution at each drafted
//! position and keeping the draft while it matches is the standard rejection rule for it (a
//! draft token `d` is kept with probability `p(d)`; on a miss the token drawn is distributed as
//! `p` without `d`, renormalized): the output is the model's under any sampling, and under
//! greedy decoding or a fixed seed the same tokens as without speculation.

use crate::conversation::Acceptance;
use crate::setters::setters;

/// Speculative decoding by lookup in the conversation's history: how far to draft.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Speculation {
    /// Most tokens a decode row drafts per step (0 turns speculation off). How many it drafts
    /// follows the conversation's recent acceptance, up to this.
    pub max_draft: usize,
    /// Longest run of last tokens looked up (the longest match is tried first).
    pub max_ngram: usize,
    /// Shortest run of last tokens looked up: shorter matches draft too often in vain.
    pub min_ngram: usize,
}

impl Default for Speculation {
    fn default() -> Self {
        Self {
            max_draft: 8,
            max_ngram: 4,
            min_ngram: 2,
        }
    }
}

setters!(Speculation {
    value max_draft: usize,
    value max_ngram: usize,
    value min_ngram: usize,
});

impl Speculation {
    /// No speculation: one token per row per step.
    pub fn off() -> Self {
        Self {
            max_draft: 0,
            ..Self::default()
        }
    }

    /// Whether rows draft at all.
    pub fn is_on(&self) -> bool {
        self.max_draft > 0
    }

    /// Up to `cap` tokens to draft after `history` followed by `pending` (the tokens not yet
    /// in the history, the last sampled one among them), for a conversation whose drafts were
    /// accepted as `acceptance` says, at `price` per drafted token. Empty when there is no
    /// match, or drafting does not pay.
    pub(crate) fn draft(
        &self,
        history: &[u32],
        pending: &[u32],
        (acceptance, price): (&Acceptance, f32),
        cap: usize,
    ) -> Vec<u32> {
        let want = acceptance.draft_len(self.max_draft, price).min(cap);
        if want == 0 || self.min_ngram == 0 {
            return Vec::new();
        }
        let len = history.len() + pending.len();
        let at = |i: usize| match i.checked_sub(history.len()) {
            None => history[i],
            Some(j) => pending[j],
        };
        for n in (self.min_ngram..=self.max_ngram.min(len.saturating_sub(1))).rev() {
            let suffix = len - n;
            // The latest earlier occurrence: recent text is the likeliest to be repeated.
            let found = (0..suffix)
                .rev()
                .find(|&start| (0..n).all(|i| at(start + i) == at(suffix + i)));
            if let Some(start) = found {
                let from = start + n;
                return (from..(from + want).min(len)).map(at).collect();
            }
        }
        Vec::new()
    }
}

impl Speculation {
    /// Up to `cap` tokens of `prediction` (what the client expects the reply to be much
    /// like: OpenAI's Predicted Outputs) to draft after a reply whose `generated` tokens so
    /// far end `history` followed by `pending`: the prediction's next tokens while the reply
    /// follows it from its start, else what follows the reply's last few tokens in it (the
    /// reply left the prediction and came back to it), else a lookup in the history as
    /// [`Speculation::draft`] does. Drafted at full length: a client's prediction is not a
    /// guess the conversation's acceptance speaks for. The rule that keeps a draft is the
    /// same, so the reply is the same with any prediction or none.
    pub(crate) fn draft_predicted(
        &self,
        prediction: &[u32],
        (history, pending, generated): (&[u32], &[u32], usize),
        odds: (&Acceptance, f32),
        cap: usize,
    ) -> Vec<u32> {
        let want = self.max_draft.min(cap);
        if want == 0 {
            return Vec::new();
        }
        let whole: Vec<u32> = history.iter().chain(pending).copied().collect();
        let reply = &whole[whole.len().saturating_sub(generated)..];
        let take = |from: usize| prediction[from..(from + want).min(prediction.len())].to_vec();
        if prediction.starts_with(reply) {
            return take(reply.len());
        }
        for n in (self.min_ngram.max(1)..=self.max_ngram.min(reply.len())).rev() {
            let last = &reply[reply.len() - n..];
            let found = (0..=prediction.len().saturating_sub(n))
                .rev()
                .find(|&start| prediction[start..].starts_with(last));
            if let Some(start) = found {
                return take(start + n);
            }
        }
        self.draft(history, pending, odds, cap)
    }
}

/// A step's time as `fixed + per_token * tokens`, fitted by least squares over the steps that
/// ran, the older ones weighing less, so that it follows the machine and its load. Its ratio
/// `fixed / per_token` prices a drafted token: where weights stream once per step whatever
/// its rows (a GPU, one row on a CPU) an extra row is nearly free; where the step is
/// compute-bound (many rows on a CPU) it costs what the token it may save does.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StepCost {
    n: f64,
    x: f64,
    xx: f64,
    y: f64,
    xy: f64,
}

impl StepCost {
    /// The weight of the earlier steps against the latest.
    const DECAY: f64 = 0.995;
    /// The fixed cost in tokens assumed before the fit can tell (a few rows' worth).
    const PRIOR: f64 = 2.0;

    /// A step of `tokens` tokens took `secs`.
    pub fn observe(&mut self, tokens: usize, secs: f64) {
        let (x, d) = (tokens as f64, Self::DECAY);
        self.n = d * self.n + 1.0;
        self.x = d * self.x + x;
        self.xx = d * self.xx + x * x;
        self.y = d * self.y + secs;
        self.xy = d * self.xy + x * secs;
    }

    /// The step's fixed cost in tokens (`fixed / per_token`).
    pub fn fixed_tokens(&self) -> f64 {
        let spread = self.n * self.xx - self.x * self.x;
        // Steps of one size alone do not tell a fixed cost from a per-token one.
        if self.n < 8.0 || spread <= 1e-9 * self.n * self.xx {
            return Self::PRIOR;
        }
        let per_token = (self.n * self.xy - self.x * self.y) / spread;
        let fixed = (self.y - per_token * self.x) / self.n;
        match per_token > 0.0 && fixed >= 0.0 {
            true => (fixed / per_token).min(1e6),
            false => Self::PRIOR,
        }
    }

    /// What a drafted token costs in a step of `rows` decode rows, as a share of what one
    /// generated token is worth there: `rows / (fixed_tokens + rows)`. A draft position
    /// pays when the chance that it is taken exceeds it.
    pub fn price(&self, rows: usize) -> f32 {
        let rows = rows.max(1) as f64;
        (rows / (self.fixed_tokens() + rows)) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A draft of up to `cap` tokens, for a conversation whose drafts were all taken.
    fn draft(history: &[u32], pending: &[u32], cap: usize) -> Vec<u32> {
        let mut taken = Acceptance::default();
        for _ in 0..20 {
            taken.record(8, 8, 0.3);
        }
        Speculation::default().draft(history, pending, (&taken, 0.3), cap)
    }

    #[test]
    fn the_tokens_after_the_latest_match_of_the_longest_suffix_are_drafted() {
        // "1 2 3 4 5 ... 1 2 3" drafts "4 5 ...".
        let history = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2];
        assert_eq!(draft(&history, &[3], 3), [4, 5, 6]);
        // The latest occurrence of the suffix wins: "7 8" follows "2 3" last.
        let history = [2, 3, 4, 4, 2, 3, 7, 8, 5, 2];
        assert_eq!(draft(&history, &[3], 2), [7, 8]);
        // A longer suffix beats a later, shorter match.
        let history = [5, 2, 3, 1, 1, 9, 2, 3, 6, 6, 5, 2];
        assert_eq!(draft(&history, &[3], 1), [1]);
        // The draft may run into the suffix itself (a repeated pattern), and stops at the end.
        assert_eq!(draft(&[7, 8, 7, 8], &[7], 4), [8, 7]);
    }

    #[test]
    fn no_match_or_no_room_drafts_nothing() {
        assert!(draft(&[1, 2, 3, 4], &[5], 4).is_empty());
        assert!(draft(&[1, 2, 1], &[2], 0).is_empty());
        assert!(draft(&[], &[1], 4).is_empty());
        assert!(Speculation::off()
            .draft(&[1, 2, 1], &[2], (&Acceptance::default(), 0.3), 4)
            .is_empty());
        // One matching token is below `min_ngram`.
        assert!(draft(&[1, 5, 3], &[1], 4).is_empty());
    }

    #[test]
    fn the_step_cost_fit_prices_drafts_by_the_share_of_a_step_a_token_costs() {
        let mut memory_bound = StepCost::default();
        let mut compute_bound = StepCost::default();
        assert_eq!(memory_bound.fixed_tokens(), StepCost::PRIOR);
        for tokens in [1, 8, 1, 64, 3, 1, 256, 8, 1, 2] {
            // 20 ms a step plus 0.1 ms a token; 1 ms plus 1 ms a token.
            memory_bound.observe(tokens, 0.020 + 1e-4 * tokens as f64);
            compute_bound.observe(tokens, 0.001 + 1e-3 * tokens as f64);
        }
        assert!((memory_bound.fixed_tokens() - 200.0).abs() < 1.0);
        assert!((compute_bound.fixed_tokens() - 1.0).abs() < 0.01);
        assert!(memory_bound.price(8) < 0.05);
        assert!(compute_bound.price(8) > 0.85);
        assert!(compute_bound.price(1) < compute_bound.price(8));
    }

    #[test]
    fn a_prediction_is_drafted_while_the_reply_follows_it_and_found_again_after_it_leaves() {
        let spec = Speculation::default();
        let odds = (&Acceptance::default(), 0.5);
        let prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20];
        let prompt = [1, 2, 3];
        // The reply so far (two tokens) is the prediction's start: its next tokens follow.
        let history = [&prompt[..], &[10]].concat();
        let d = spec.draft_predicted(&prediction, (&history, &[11], 2), odds, 100);
        assert_eq!(d, &prediction[2..10]);
        // The reply left it (an inserted 99) and came back: found by its last tokens.
        let history = [&prompt[..], &[10, 11, 99, 12]].concat();
        let d = spec.draft_predicted(&prediction, (&history, &[13], 5), odds, 3);
        assert_eq!(d, [14, 15, 16]);
        // Nothing of it at the reply's end, nor in the history: nothing drafted.
        let d = spec.draft_predicted(&prediction, (&[5, 6], &[7], 1), odds, 8);
        assert!(d.is_empty(), "{d:?}");
        assert!(Speculation::off()
            .draft_predicted(&prediction, (&prompt, &[10], 1), odds, 8)
            .is_empty());
    }
}
