//! Token selection for one turn: validated sampling parameters turned into candle's logits
//! processor, seeded per request so a turn's samples do not depend on its batch.
//!
//! Before the processor sees a row, in this order (vLLM's): the repetition, presence and
//! frequency penalties and `logit_bias` on the model's logits, the end-of-turn mask of
//! `min_tokens`, then `min_p` against the most likely token at the turn's temperature.

use std::collections::{HashMap, HashSet};

use candle_core::Tensor;
use candle_transformers::generation::{LogitsProcessor, Sampling};

use super::{SamplingParams, TokenLogprobs};
use crate::chat::Guide;
use crate::{Error, Result};

/// The highest temperature taken.
const MAX_TEMPERATURE: f64 = 100.0;

/// Temperatures below this decode greedily, as vLLM's `_SAMPLING_EPS`: logits divided by a
/// temperature near zero overflow f32 to infinities, whose softmax is NaN.
const GREEDY_BELOW: f64 = 1e-5;

/// The smallest `top_p` the sampler is given: candle's nucleus keeps nothing for a `top_p` that
/// rounds to 0 in f32, and any `top_p` below the most likely token's probability keeps that
/// token alone, as this one does.
const MIN_TOP_P: f64 = f32::MIN_POSITIVE as f64;

/// Checks parameters at the API edge.
///
/// # Errors
/// [`Error::InvalidParams`] naming the bad value.
pub(crate) fn validate(p: &SamplingParams, vocab: usize) -> Result<()> {
    let bad = |param, reason: &str| {
        Err(Error::InvalidParams {
            param,
            reason: reason.to_string(),
        })
    };
    if p.max_tokens == 0 {
        return bad("max_tokens", "must be at least 1");
    }
    if p.min_tokens > p.max_tokens {
        return bad("min_tokens", "must not exceed max_tokens");
    }
    if p.logit_bias
        .iter()
        .any(|&(t, b)| t as usize >= vocab || !b.is_finite())
    {
        return bad(
            "logit_bias",
            "needs token ids in the vocabulary and finite biases",
        );
    }
    // Drafted tokens are fed to the model: one outside the vocabulary has no embedding.
    if p.prediction.iter().any(|&t| t as usize >= vocab) {
        return bad("prediction", "needs token ids in the vocabulary");
    }
    // Logits are f32: a temperature past f32's range would make them NaN (the fuzzer's
    // `1e300`), and past 100 sampling is uniform for any model anyway.
    if !(0.0..=MAX_TEMPERATURE).contains(&p.temperature) {
        return bad("temperature", &format!("must be in [0, {MAX_TEMPERATURE}]"));
    }
    if p.top_p.is_some_and(|x| !(x > 0.0 && x <= 1.0)) {
        return bad("top_p", "must be in (0, 1]");
    }
    if p.top_k == Some(0) {
        return bad("top_k", "must be at least 1");
    }
    if !(p.min_p.is_finite() && (0.0..=1.0).contains(&p.min_p)) {
        return bad("min_p", "must be in [0, 1]");
    }
    for (name, x) in [
        ("presence_penalty", p.presence_penalty),
        ("frequency_penalty", p.frequency_penalty),
    ] {
        if !(x.is_finite() && (-2.0..=2.0).contains(&x)) {
            return bad(name, "must be in [-2, 2]");
        }
    }
    if !(p.repetition_penalty.is_finite() && p.repetition_penalty > 0.0) {
        return bad("repetition_penalty", "must be a finite number > 0");
    }
    Ok(())
}

/// Picks tokens from logits for one turn.
pub(crate) struct Sampler {
    processor: LogitsProcessor,
    bias: Vec<(u32, f32)>,
    /// Tokens that would end the turn, masked while fewer than `min_tokens` were sampled.
    stops: Vec<u32>,
    min_tokens: usize,
    sampled: usize,
    presence: f32,
    frequency: f32,
    repetition: f32,
    /// `ln(min_p) * temperature`: how far below the best logit a token may lie; None when
    /// `min_p` keeps everything (0) or decoding is greedy.
    min_p_gap: Option<f32>,
    /// How often the turn generated each token (presence and frequency penalties).
    counts: HashMap<u32, u32>,
    /// Every token of the conversation and the turn so far (repetition penalty), filled from
    /// the conversation at the first sample.
    seen: Option<HashSet<u32>>,
    /// The reply's constraint, if it has one.
    guide: Option<Guide>,
}

impl std::fmt::Debug for Sampler {
    // candle's processor has no Debug; its state is the parameters the turn keeps anyway.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler").finish_non_exhaustive()
    }
}

impl Sampler {
    /// A sampler for validated `params`, on a model whose end-of-turn tokens are `eos`, the
    /// reply held to `guide`.
    pub fn new(params: &SamplingParams, eos: &[u32], guide: Option<Guide>) -> Self {
        let top_p = params.top_p.map(|p| p.max(MIN_TOP_P));
        let sampling = match (params.temperature, params.top_k, top_p) {
            (t, _, _) if t < GREEDY_BELOW => Sampling::ArgMax,
            (temperature, None, None) => Sampling::All { temperature },
            (temperature, Some(k), None) => Sampling::TopK { k, temperature },
            (temperature, None, Some(p)) => Sampling::TopP { p, temperature },
            (temperature, Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        };
        let stops = match params.ignore_eos {
            true => Vec::new(),
            false => eos.iter().chain(&params.stop_token_ids).copied().collect(),
        };
        let min_p_gap = (params.min_p > 0.0 && params.temperature >= GREEDY_BELOW)
            .then(|| (params.min_p.ln() * params.temperature) as f32);
        Self {
            processor: LogitsProcessor::from_sampling(params.seed, sampling),
            bias: params.logit_bias.clone(),
            stops,
            min_tokens: params.min_tokens,
            sampled: 0,
            presence: params.presence_penalty,
            frequency: params.frequency_penalty,
            repetition: params.repetition_penalty,
            min_p_gap,
            counts: HashMap::new(),
            seen: None,
            guide,
        }
    }

    /// The next token from one row of logits (`[vocab]`); `context` is the conversation's
    /// tokens so far (read at the first sample, for the repetition penalty).
    ///
    /// # Errors
    /// [`Error::Candle`] if the logits cannot be read.
    pub fn sample(&mut self, logits: &Tensor, context: &[u32]) -> Result<u32> {
        let masked = self.sampled < self.min_tokens && !self.stops.is_empty();
        self.sampled += 1;
        let penalized = self.presence != 0.0 || self.frequency != 0.0 || self.repetition != 1.0;
        let plain = !masked && !penalized && self.bias.is_empty() && self.min_p_gap.is_none();
        let token = if plain && self.guide.is_none() {
            self.processor.sample(logits)?
        } else {
            let mut v: Vec<f32> = logits.to_dtype(candle_core::DType::F32)?.to_vec1()?;
            self.adjust(&mut v, masked, context);
            if let Some(g) = &mut self.guide {
                g.restrict(&mut v)?;
            }
            let n = v.len();
            self.processor
                .sample(&Tensor::from_vec(v, n, logits.device())?)?
        };
        if let Some(g) = &mut self.guide {
            g.accept(token)?;
        }
        *self.counts.entry(token).or_default() += 1;
        if let Some(seen) = &mut self.seen {
            seen.insert(token);
        }
        Ok(token)
    }

    /// Penalties, biases, the end-of-turn mask and `min_p` on one row of logits.
    fn adjust(&mut self, v: &mut [f32], masked: bool, context: &[u32]) {
        if self.repetition != 1.0 {
            let r = self.repetition;
            let seen = self
                .seen
                .get_or_insert_with(|| context.iter().copied().collect());
            for &t in seen.iter() {
                if let Some(x) = v.get_mut(t as usize) {
                    *x = if *x > 0.0 { *x / r } else { *x * r };
                }
            }
        }
        for (&t, &n) in &self.counts {
            if let Some(x) = v.get_mut(t as usize) {
                *x -= self.presence + self.frequency * n as f32;
            }
        }
        for &(t, b) in &self.bias {
            if let Some(x) = v.get_mut(t as usize) {
                *x += b;
            }
        }
        if masked {
            for &t in &self.stops {
                if let Some(x) = v.get_mut(t as usize) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        if let Some(gap) = self.min_p_gap {
            let floor = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) + gap;
            for x in v.iter_mut().filter(|x| **x < floor) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// The log-probability of `token` in one row of `logits` and the `top` most likely tokens.
///
/// # Errors
/// [`Error::Candle`] if the logits cannot be read.
pub(crate) fn logprobs(logits: &Tensor, token: u32, top: usize) -> Result<TokenLogprobs> {
    let row = logits.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = max + row.iter().map(|x| (x - max).exp()).sum::<f32>().ln();
    let lp = |i: usize| row.get(i).map_or(f32::NEG_INFINITY, |x| x - log_sum);
    let mut order: Vec<usize> = (0..row.len()).collect();
    let top = top.min(row.len());
    if top > 0 {
        order.select_nth_unstable_by(top - 1, |&a, &b| row[b].total_cmp(&row[a]));
    }
    order.truncate(top);
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    Ok(TokenLogprobs {
        logprob: lp(token as usize),
        top: order.into_iter().map(|i| (i as u32, lp(i))).collect(),
    })
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    fn row(v: &[f32]) -> Tensor {
        Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
    }

    fn sampler(p: SamplingParams) -> Sampler {
        validate(&p, 4).unwrap();
        Sampler::new(&p, &[], None)
    }

    #[test]
    fn presence_and_frequency_penalties_count_the_turns_own_tokens() {
        let logits = row(&[2.0, 1.5, 0.0, 0.0]);
        // Presence: token 0 once generated loses 1, so token 1 wins next.
        let mut s = sampler(SamplingParams {
            presence_penalty: 1.0,
            ..SamplingParams::greedy()
        });
        assert_eq!(s.sample(&logits, &[]).unwrap(), 0);
        assert_eq!(s.sample(&logits, &[]).unwrap(), 1);
        // Then both were generated once: token 0 is ahead again.
        assert_eq!(s.sample(&logits, &[]).unwrap(), 0);
        // Frequency: each use costs 0.3; token 0 leads by 0.5, so it wins twice in a row.
        let mut s = sampler(SamplingParams {
            frequency_penalty: 0.3,
            ..SamplingParams::greedy()
        });
        let picks: Vec<u32> = (0..3).map(|_| s.sample(&logits, &[]).unwrap()).collect();
        assert_eq!(picks, [0, 0, 1]);
    }

    #[test]
    fn repetition_penalty_covers_the_conversation_before_the_turn() {
        let logits = row(&[2.0, 1.5, -1.0, -1.2]);
        let mut s = sampler(SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy()
        });
        // Token 0 is in the conversation: 2.0 / 2 falls behind token 1.
        assert_eq!(s.sample(&logits, &[0, 2]).unwrap(), 1);
        // Now 1 was generated too: 0.75 against 1.0 for token 0.
        assert_eq!(s.sample(&logits, &[0, 2, 1]).unwrap(), 0);
        // Negative logits are multiplied: token 2 (seen) drops below token 3.
        let mut s = sampler(SamplingParams {
            repetition_penalty: 2.0,
            logit_bias: vec![(0, -100.0), (1, -100.0)],
            ..SamplingParams::greedy()
        });
        assert_eq!(s.sample(&logits, &[2]).unwrap(), 3);
    }

    #[test]
    fn min_p_drops_tokens_far_below_the_best_at_the_turns_temperature() {
        // At temperature 1, token 2 has e^-5 of token 0's probability (below 0.1), token 1
        // e^-1 (above).
        let logits = row(&[0.0, -1.0, -5.0, -5.0]);
        let mut seen = [0usize; 4];
        for seed in 0..400 {
            let mut s = sampler(SamplingParams {
                temperature: 1.0,
                min_p: 0.1,
                seed,
                ..SamplingParams::greedy()
            });
            seen[s.sample(&logits, &[]).unwrap() as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
        assert!(seen[1] > 40, "{seen:?}");
        // Without it, the far tokens come up now and then (e^-5 / (1 + e^-1 + 2e^-5) each).
        let mut far = 0;
        for seed in 0..2000 {
            let mut s = sampler(SamplingParams {
                temperature: 1.0,
                seed,
                ..SamplingParams::greedy()
            });
            far += usize::from(s.sample(&logits, &[]).unwrap() >= 2);
        }
        assert!(far > 0);
    }

    #[test]
    fn out_of_range_penalties_and_min_p_are_refused() {
        for p in [
            SamplingParams {
                presence_penalty: 2.5,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                frequency_penalty: f32::NAN,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                min_p: 1.5,
                ..SamplingParams::greedy()
            },
            // Past f32's range the logits would be NaN (a fuzzer's find).
            SamplingParams {
                temperature: 1e300,
                min_tokens: 1,
                ..SamplingParams::greedy()
            },
        ] {
            assert!(matches!(validate(&p, 4), Err(Error::InvalidParams { .. })));
        }
    }
}
