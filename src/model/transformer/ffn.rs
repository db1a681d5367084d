//! A layer's MLP: one gated MLP, or a mixture of gated experts behind a router.
//!
//! A mixture routes each token by itself: the router's scores of the token, a softmax over
//! the experts, the `k` most likely (the lower index first on a tie), their probabilities
//! (rescaled to sum to one where the model says so) as the weights of their outputs. The rows
//! routed to an expert are gathered and run through it as one batch, so an expert's weights
//! are read once per pass whatever the number of its rows, and only the chosen experts'
//! weights are read at all. A row's output is the sum of its experts' weighted outputs, added
//! in the order of the experts' indices: what a row computes, and in which order its terms
//! add, depends on the row alone, so its logits do not depend on the rest of its batch (the
//! packed matmul's rows do not either).

use candle_core::{DType, Tensor};

use super::Linear;
use crate::model::arch::Activation;
use crate::model::config::Experts;
use crate::model::ops::gated;
use crate::Result;

/// A layer's MLP.
#[derive(Debug)]
// One per layer: its size is nothing beside the weights it points to.
#[expect(clippy::large_enum_variant)]
pub(super) enum Ffn {
    /// `down(act(gate · x) * (up · x))`.
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// A mixture of experts.
    Experts(Mixture),
}

/// A mixture of gated experts.
#[derive(Debug)]
pub(super) struct Mixture {
    pub router: Linear,
    /// Each expert's gate, up and down projections.
    pub experts: Vec<[Linear; 3]>,
    pub shape: Experts,
    /// The router's bias and each expert's projections' (gpt-oss), where the model has them.
    pub biases: Option<Biases>,
}

/// A mixture's biases.
#[derive(Debug)]
pub(super) struct Biases {
    pub router: Tensor,
    /// Each expert's gate, up and down biases.
    pub experts: Vec<[Tensor; 3]>,
}

impl Ffn {
    /// Its linear layers.
    pub(super) fn linears(&self) -> Vec<&Linear> {
        match self {
            Ffn::Dense { gate, up, down } => vec![gate, up, down],
            Ffn::Experts(m) => std::iter::once(&m.router)
                .chain(m.experts.iter().flatten())
                .collect(),
        }
    }

    /// Its vectors that activations meet (the mixture's biases).
    pub(super) fn vectors(&self) -> impl Iterator<Item = &Tensor> {
        let biases = match self {
            Ffn::Experts(Mixture {
                biases: Some(b), ..
            }) => Some(b),
            _ => None,
        };
        biases
            .into_iter()
            .flat_map(|b| std::iter::once(&b.router).chain(b.experts.iter().flatten()))
    }

    /// [`Self::vectors`], to convert with the activations.
    pub(super) fn vectors_mut(&mut self) -> impl Iterator<Item = &mut Tensor> {
        let biases = match self {
            Ffn::Experts(Mixture {
                biases: Some(b), ..
            }) => Some(b),
            _ => None,
        };
        biases
            .into_iter()
            .flat_map(|b| std::iter::once(&mut b.router).chain(b.experts.iter_mut().flatten()))
    }

    /// The MLP of `h` (`[tokens, hidden]`), added to `residual` where given.
    pub(super) fn forward(
        &self,
        h: &Tensor,
        residual: Option<&Tensor>,
        act: Activation,
    ) -> Result<Tensor> {
        match self {
            Ffn::Dense { gate, up, down } => {
                let [g, u] = Linear::forward_many([gate, up], h)?;
                let a = gated(&g, &u, act)?;
                match residual {
                    Some(r) => down.forward_residual(&a, r),
                    None => down.forward(&a),
                }
            }
            Ffn::Experts(m) => {
                let out = m.forward(h, act)?;
                Ok(match residual {
                    Some(r) => (r + out)?,
                    None => out,
                })
            }
        }
    }
}

impl Mixture {
    fn forward(&self, h: &Tensor, act: Activation) -> Result<Tensor> {
        let mut scores = self.router.forward(h)?;
        if let Some(b) = &self.biases {
            scores = scores.broadcast_add(&b.router)?;
        }
        let scores = scores.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let routes = route(&scores, self.shape.per_token, self.shape.normalize);
        let mut out = h.zeros_like()?;
        for (e, [gate, up, down]) in self.experts.iter().enumerate() {
            let (rows, weights): (Vec<u32>, Vec<f32>) = (routes.iter().enumerate())
                .filter_map(|(row, r)| {
                    let k = r.iter().position(|&(expert, _)| expert == e)?;
                    Some((row as u32, r[k].1))
                })
                .unzip();
            if rows.is_empty() {
                continue;
            }
            let n = rows.len();
            let rows = Tensor::from_vec(rows, n, h.device())?;
            let x = h.index_select(&rows, 0)?;
            let [mut g, mut u] = Linear::forward_many([gate, up], &x)?;
            let bias = self.biases.as_ref().map(|b| &b.experts[e]);
            if let Some([gb, ub, _]) = bias {
                (g, u) = (g.broadcast_add(gb)?, u.broadcast_add(ub)?);
            }
            let mut y = down.forward(&gated(&g, &u, act)?)?;
            if let Some([_, _, db]) = bias {
                y = y.broadcast_add(db)?;
            }
            let weights = Tensor::from_vec(weights, (n, 1), h.device())?.to_dtype(y.dtype())?;
            out = out.index_add(&rows, &y.broadcast_mul(&weights)?, 0)?;
        }
        Ok(out)
    }
}

/// Each row's experts and their weights, from the router's scores: the `k` largest of the
/// softmax (the lower index first on a tie), their probabilities rescaled to sum to one when
/// `normalize`.
fn route(scores: &[Vec<f32>], k: usize, normalize: bool) -> Vec<Vec<(usize, f32)>> {
    scores
        .iter()
        .map(|s| {
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exp: Vec<f32> = s.iter().map(|&x| (x - max).exp()).collect();
            let sum: f32 = exp.iter().sum();
            let mut order: Vec<usize> = (0..s.len()).collect();
            // Stable: equal probabilities keep the lower index first.
            order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]));
            let chosen: Vec<(usize, f32)> = order
                .into_iter()
                .take(k)
                .map(|e| (e, exp[e] / sum))
                .collect();
            let total: f32 = chosen.iter().map(|&(_, p)| p).sum();
            match normalize {
                true => chosen.into_iter().map(|(e, p)| (e, p / total)).collect(),
                false => chosen,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn routes_take_the_k_most_likely_lower_index_first_on_ties() {
        let scores = vec![vec![0.0, 2.0, 1.0, 2.0], vec![1.0, 1.0, 1.0, 1.0]];
        let r = route(&scores, 2, false);
        assert_eq!(r[0].iter().map(|x| x.0).collect::<Vec<_>>(), [1, 3]);
        assert_eq!(r[1].iter().map(|x| x.0).collect::<Vec<_>>(), [0, 1]);
        assert!((r[1][0].1 - 0.25).abs() < 1e-6);
        let n = route(&scores, 2, true);
        assert!((n[1][0].1 - 0.5).abs() < 1e-6 && (n[0][0].1 - 0.5).abs() < 1e-6);
        let p: f32 = route(&scores, 4, false)[0].iter().map(|x| x.1).sum();
        assert!((p - 1.0).abs() < 1e-6);
    }
}
