//! Device-agnostic attention built from candle ops: gather each sequence's context into
//! contiguous K/V, then masked `softmax(q kᵀ) v` as batched matmuls. It materialises the
//! `[heads, queries, context]` score matrix, so it serves as the GPU path until the CUDA kernel
//! lands and as the "gather then attend" baseline of the benchmarks.

use candle_core::{DType, Tensor};

use super::{visible, Attend, Dims};
use crate::Result;

/// Same contract as [`super::attention_in_window`], for any candle device.
///
/// # Errors
/// As [`super::attention_in_window`].
pub fn attention_gather(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    how: Attend<'_>,
) -> Result<Tensor> {
    super::over_values(q, k_pool, v_pool, how, gathered)
}

/// The gather path over pools of values.
fn gathered(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    how: Attend<'_>,
    dims: Dims,
) -> Result<Tensor> {
    let (batch, scale, window, sinks) = (how.batch, how.scale, how.window, how.sinks);
    let device = q.device();
    let group = dims.n_heads / dims.n_kv_heads;
    let mut outs = Vec::with_capacity(batch.num_sequences());
    for seq in batch.sequences() {
        let nq = seq.q_positions.len();
        let nc = seq.ctx_len;
        let qs = q
            .narrow(0, seq.first_row, nq)?
            .transpose(0, 1)?
            .contiguous()?; // [H, nq, d]
        if nc == 0 {
            outs.push(qs.zeros_like()?.transpose(0, 1)?);
            continue;
        }
        let idx = Tensor::from_iter(seq.slots(), device)?;
        let expand = |pool: &Tensor| -> Result<Tensor> {
            let g = pool.index_select(&idx, 0)?.transpose(0, 1)?; // [kvh, nc, d]
            let (kvh, c, d) = g.dims3()?;
            // GQA: head h reads kv head h / group.
            Ok(g.unsqueeze(1)?
                .expand((kvh, group, c, d))?
                .reshape((kvh * group, c, d))?
                .to_dtype(qs.dtype())?)
        };
        let (ks, vs) = (expand(k_pool)?, expand(v_pool)?);
        let mask: Vec<f32> = seq
            .q_positions
            .iter()
            .flat_map(|&qp| {
                (0..nc as u32).map(move |cp| match visible(qp, cp, window) {
                    true => 0.0,
                    false => f32::NEG_INFINITY,
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (1, nq, nc), device)?.to_dtype(qs.dtype())?;
        let scores = (qs.matmul(&ks.t()?)? * f64::from(scale))?.broadcast_add(&mask)?;
        let mut scores = scores.to_dtype(DType::F32)?;
        if let Some(s) = sinks {
            // Each head's sink is one more score, whose value is dropped after the softmax.
            let s = Tensor::from_slice(s, (dims.n_heads, 1, 1), device)?;
            scores = Tensor::cat(&[scores, s.broadcast_as((dims.n_heads, nq, 1))?], 2)?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores.contiguous()?)?.narrow(2, 0, nc)?;
        // A query with no visible entry has an all -inf row: softmax gives NaN, the contract zeros.
        let probs = probs.eq(&probs)?.where_cond(&probs, &probs.zeros_like()?)?;
        let out = probs.to_dtype(qs.dtype())?.matmul(&vs)?; // [H, nq, d]
        outs.push(out.transpose(0, 1)?);
    }
    Ok(Tensor::cat(&outs, 0)?)
}
