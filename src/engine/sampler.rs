//! Token selection for one turn: validated sampling parameters turned into candle's logits
//! processor, seeded per request so a turn's samples do not depend on its batch.

use candle_core::Tensor;
use candle_transformers::generation::{LogitsProcessor, Sampling};

use super::{SamplingParams, TokenLogprobs};
use crate::{Error, Result};

/// Checks parameters at the API edge.
///
/// # Errors
/// [`Error::InvalidParams`] naming the bad value.
pub(crate) fn validate(p: &SamplingParams, vocab: usize) -> Result<()> {
    let bad = |m: &str| Err(Error::InvalidParams(m.to_string()));
    if p.max_tokens == 0 {
        return bad("max_tokens must be at least 1");
    }
    if p.min_tokens > p.max_tokens {
        return bad("min_tokens must not exceed max_tokens");
    }
    if p.logit_bias
        .iter()
        .any(|&(t, b)| t as usize >= vocab || !b.is_finite())
    {
        return bad("logit_bias needs token ids in the vocabulary and finite biases");
    }
    if !(p.temperature.is_finite() && p.temperature >= 0.0) {
        return bad("temperature must be a finite number >= 0");
    }
    if p.top_p.is_some_and(|x| !(x > 0.0 && x <= 1.0)) {
        return bad("top_p must be in (0, 1]");
    }
    if p.top_k == Some(0) {
        return bad("top_k must be at least 1");
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
}

impl std::fmt::Debug for Sampler {
    // candle's processor has no Debug; its state is the parameters the turn keeps anyway.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler").finish_non_exhaustive()
    }
}

impl Sampler {
    /// A sampler for validated `params`, on a model whose end-of-turn tokens are `eos`.
    pub fn new(params: &SamplingParams, eos: &[u32]) -> Self {
        let sampling = match (params.temperature, params.top_k, params.top_p) {
            (t, _, _) if t <= 0.0 => Sampling::ArgMax,
            (temperature, None, None) => Sampling::All { temperature },
            (temperature, Some(k), None) => Sampling::TopK { k, temperature },
            (temperature, None, Some(p)) => Sampling::TopP { p, temperature },
            (temperature, Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        };
        let stops = match params.ignore_eos {
            true => Vec::new(),
            false => eos.iter().chain(&params.stop_token_ids).copied().collect(),
        };
        Self {
            processor: LogitsProcessor::from_sampling(params.seed, sampling),
            bias: params.logit_bias.clone(),
            stops,
            min_tokens: params.min_tokens,
            sampled: 0,
        }
    }

    /// The next token from one row of logits (`[vocab]`).
    ///
    /// # Errors
    /// [`Error::Candle`] if the logits cannot be read.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        let masked = self.sampled < self.min_tokens && !self.stops.is_empty();
        self.sampled += 1;
        if !masked && self.bias.is_empty() {
            return Ok(self.processor.sample(logits)?);
        }
        let mut v: Vec<f32> = logits.to_dtype(candle_core::DType::F32)?.to_vec1()?;
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
        let n = v.len();
        Ok(self
            .processor
            .sample(&Tensor::from_vec(v, n, logits.device())?)?)
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
