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
pub(crate) fn validate(p: &SamplingParams) -> Result<()> {
    let bad = |m: &str| Err(Error::InvalidParams(m.to_string()));
    if p.max_tokens == 0 {
        return bad("max_tokens must be at least 1");
    }
    if !p.temperature.is_finite() {
        return bad("temperature must be finite");
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
}

impl std::fmt::Debug for Sampler {
    // candle's processor has no Debug; its state is the parameters the turn keeps anyway.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler").finish_non_exhaustive()
    }
}

impl Sampler {
    /// A sampler for validated `params`.
    pub fn new(params: &SamplingParams) -> Self {
        let sampling = match (params.temperature, params.top_k, params.top_p) {
            (t, _, _) if t <= 0.0 => Sampling::ArgMax,
            (temperature, None, None) => Sampling::All { temperature },
            (temperature, Some(k), None) => Sampling::TopK { k, temperature },
            (temperature, None, Some(p)) => Sampling::TopP { p, temperature },
            (temperature, Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        };
        Self {
            processor: LogitsProcessor::from_sampling(params.seed, sampling),
        }
    }

    /// The next token from one row of logits (`[vocab]`).
    ///
    /// # Errors
    /// [`Error::Candle`] if the logits cannot be read.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        Ok(self.processor.sample(logits)?)
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
