//! Which chunk to evict: Pensieve's value-based policy (thesis §3.4.3, superseding the paper's)
//! and LRU for comparison.
//!
//! Candidates are the *leading* chunk of each conversation in a tier: the front of a
//! conversation is the cheapest to recompute (its attention spans the fewest tokens), and
//! evicting from the front keeps a conversation's cached part a suffix. Among candidates the
//! policy evicts the lowest value first.

use std::fmt::Debug;

/// Seconds to recompute tokens, as a function of position: a token at position `p` costs
/// `per_token_s + per_token_per_position_s * p` (the rest of the layer, plus attention over
/// `p` earlier tokens). Measured on the actual model at start-up (see the engine).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct CostModel {
    /// Position-independent cost of one token (projections, MLP).
    pub per_token_s: f64,
    /// Extra cost per token of context (attention).
    pub per_token_per_position_s: f64,
}

impl CostModel {
    /// A token at position `p` costs `per_token_s + per_token_per_position_s * p` seconds.
    pub fn new(per_token_s: f64, per_token_per_position_s: f64) -> Self {
        Self {
            per_token_s,
            per_token_per_position_s,
        }
    }

    /// Cost of recomputing positions `[start, start + len)`.
    pub fn recompute_s(&self, start: usize, len: usize) -> f64 {
        let (s, n) = (start as f64, len as f64);
        // Sum over p in [s, s + n) of (a + b p) = n a + b (n s + n (n - 1) / 2).
        n * self.per_token_s + self.per_token_per_position_s * (n * s + n * (n - 1.0) / 2.0)
    }

    /// Least-squares fit of `seconds_per_token = a + b * position` to measured
    /// `(mean position, seconds per token)` samples; negative coefficients are clamped to 0.
    pub fn fit(samples: &[(f64, f64)]) -> Self {
        let n = samples.len() as f64;
        if samples.is_empty() {
            return Self {
                per_token_s: 0.0,
                per_token_per_position_s: 0.0,
            };
        }
        let mx = samples.iter().map(|s| s.0).sum::<f64>() / n;
        let my = samples.iter().map(|s| s.1).sum::<f64>() / n;
        let sxx: f64 = samples.iter().map(|s| (s.0 - mx).powi(2)).sum();
        let sxy: f64 = samples.iter().map(|s| (s.0 - mx) * (s.1 - my)).sum();
        let b = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
        Self {
            per_token_s: (my - b * mx).max(0.0),
            per_token_per_position_s: b,
        }
    }
}

/// An eviction candidate: a chunk of one conversation in one tier (a shared chunk is valued
/// once per holder, and the values summed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Position of the chunk's first token.
    pub start: usize,
    /// Tokens in the chunk.
    pub len: usize,
    /// Seconds since the conversation was last active.
    pub idle_s: f64,
}

/// Orders eviction candidates: the lowest value is evicted first.
pub trait EvictionPolicy: Debug + Send + Sync {
    /// The candidate's value; lower is evicted sooner.
    fn value(&self, c: &Candidate) -> f64;
}

/// Pensieve's policy: value = recompute cost / idle time. Cheap-to-recompute chunks of
/// long-idle conversations go first.
#[derive(Clone, Copy, Debug)]
pub struct ValuePolicy {
    /// The measured cost curve.
    pub cost: CostModel,
}

/// Idle times below this are treated as this, so a just-active conversation has a finite,
/// very high value.
const MIN_IDLE_S: f64 = 1e-3;

impl EvictionPolicy for ValuePolicy {
    fn value(&self, c: &Candidate) -> f64 {
        self.cost.recompute_s(c.start, c.len) / c.idle_s.max(MIN_IDLE_S)
    }
}

/// Least recently used conversation first, whatever its cost.
#[derive(Clone, Copy, Debug, Default)]
pub struct LruPolicy;

impl EvictionPolicy for LruPolicy {
    fn value(&self, c: &Candidate) -> f64 {
        -c.idle_s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recompute_cost_sums_the_linear_curve() {
        let m = CostModel {
            per_token_s: 1.0,
            per_token_per_position_s: 0.5,
        };
        let brute: f64 = (10..42).map(|p| 1.0 + 0.5 * p as f64).sum();
        assert!((m.recompute_s(10, 32) - brute).abs() < 1e-9);
    }

    #[test]
    fn fit_recovers_a_line() {
        let samples: Vec<(f64, f64)> = (0..5)
            .map(|i| (i as f64 * 100.0, 2.0 + 0.01 * i as f64 * 100.0))
            .collect();
        let m = CostModel::fit(&samples);
        assert!(
            (m.per_token_s - 2.0).abs() < 1e-9 && (m.per_token_per_position_s - 0.01).abs() < 1e-12
        );
    }

    #[test]
    fn value_prefers_idle_and_leading_chunks() {
        let p = ValuePolicy {
            cost: CostModel {
                per_token_s: 1.0,
                per_token_per_position_s: 0.1,
            },
        };
        let lead = Candidate {
            start: 0,
            len: 32,
            idle_s: 10.0,
        };
        let late = Candidate {
            start: 1024,
            len: 32,
            idle_s: 10.0,
        };
        let fresh = Candidate {
            start: 0,
            len: 32,
            idle_s: 0.5,
        };
        assert!(p.value(&lead) < p.value(&late));
        assert!(p.value(&lead) < p.value(&fresh));
        assert!(LruPolicy.value(&lead) < LruPolicy.value(&fresh));
    }
}
