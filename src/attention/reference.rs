//! Naive reference of the attention op: materialised scores, f64 accumulation, one query and
//! one head at a time. Slow on purpose; every fast path is tested against it.

use candle_core::{DType, Tensor};

use super::{visible, Attend, Dims};
use crate::Result;

/// Same contract as [`super::attention_in_window`], computed the obvious way on the host.
///
/// # Errors
/// As [`super::attention_in_window`].
pub fn attention_reference(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    how: Attend<'_>,
) -> Result<Tensor> {
    super::over_values(q, k_pool, v_pool, how, naive)
}

/// The reference over pools of values.
fn naive(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    how: Attend<'_>,
    dims: Dims,
) -> Result<Tensor> {
    let (batch, scale, window, sinks) = (how.batch, how.scale, how.window, how.sinks);
    let qv = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let kv = k_pool
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let vv = v_pool
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let (h_n, d) = (dims.n_heads, dims.head_dim);
    let group = dims.n_heads / dims.n_kv_heads;
    let kv_row = dims.n_kv_heads * d;
    let mut out = vec![0f32; dims.tokens * h_n * d];
    for seq in batch.sequences() {
        for (r, &qp) in seq.q_positions.iter().enumerate() {
            let row = seq.first_row + r;
            for h in 0..h_n {
                let g = h / group;
                let qh = &qv[(row * h_n + h) * d..][..d];
                let visible: Vec<(usize, f64)> = (seq.slots().zip(0..))
                    .filter(|&(_, p)| visible(qp, p, window))
                    .map(|(slot, _)| {
                        let base = slot as usize * kv_row + g * d;
                        let s: f64 = qh
                            .iter()
                            .zip(&kv[base..base + d])
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum();
                        (base, s * scale as f64)
                    })
                    .collect();
                let max = visible
                    .iter()
                    .map(|&(_, s)| s)
                    .fold(f64::NEG_INFINITY, f64::max);
                // A sink is one more score in the softmax, whose value is zero.
                let sink = match (sinks, visible.is_empty()) {
                    (Some(s), false) => (f64::from(s[h]) - max).exp(),
                    _ => 0.0,
                };
                let denom: f64 = visible.iter().map(|&(_, s)| (s - max).exp()).sum::<f64>() + sink;
                let dst = &mut out[(row * h_n + h) * d..][..d];
                for (i, o) in dst.iter_mut().enumerate() {
                    let num: f64 = visible
                        .iter()
                        .map(|&(base, s)| (s - max).exp() * vv[base + i] as f64)
                        .sum();
                    *o = if denom > 0.0 {
                        (num / denom) as f32
                    } else {
                        0.0
                    };
                }
            }
        }
    }
    Ok(Tensor::from_vec(out, (dims.tokens, h_n, d), q.device())?.to_dtype(q.dtype())?)
}
