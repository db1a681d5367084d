//! Fast CPU implementation of the attention op: flash-attention style tiling with an online
//! softmax, so memory stays `O(block)` whatever the context length.
//!
//! Work is split into items of (sequence, block of up to [`Q_BLOCK`] query rows), run in
//! parallel by rayon; each item owns the output rows it writes, so no synchronisation is
//! needed. Inside an item, for each kv head the queries of all heads sharing it (GQA) are
//! processed together against tiles of [`K_TILE`] context entries, so a K/V row read from the
//! pool is reused by every query of the block while it is in L1.
//!
//! Cost: `O(queries × visible context × head_dim)` flops per head; context entries at positions
//! after every query of a tile are skipped without reading K or V.

use candle_core::{CpuStorage, CustomOp3, Layout, Shape};
use rayon::prelude::*;

use super::{AttentionBatch, Dims};

/// Query rows per work item.
const Q_BLOCK: usize = 16;
/// Context entries per tile.
const K_TILE: usize = 64;

/// The op as candle sees it; borrowed batch and checked shapes.
pub(super) struct PagedAttention<'a> {
    pub batch: &'a AttentionBatch,
    pub dims: Dims,
    pub scale: f32,
}

impl CustomOp3 for PagedAttention<'_> {
    fn name(&self) -> &'static str {
        "pensieve-paged-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        q_l: &Layout,
        k: &CpuStorage,
        k_l: &Layout,
        v: &CpuStorage,
        v_l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let q = contiguous_f32(q, q_l, "q")?;
        let k = contiguous_f32(k, k_l, "k_pool")?;
        let v = contiguous_f32(v, v_l, "v_pool")?;
        let out = forward(q, k, v, self.batch, self.dims, self.scale);
        let d = self.dims;
        Ok((
            CpuStorage::F32(out),
            Shape::from((d.tokens, d.n_heads, d.head_dim)),
        ))
    }
}

fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout, name: &str) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(data) = s else {
        candle_core::bail!("{name} must be f32 for the CPU attention kernel")
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{name} must be contiguous for the CPU attention kernel"),
    }
}

/// One unit of parallel work: rows `[row0, row1)` of sequence `seq`.
struct Item {
    seq: usize,
    row0: usize,
    row1: usize,
}

/// `q`: `[tokens, n_heads, head_dim]`, `k`/`v`: `[n_slots, n_kv_heads, head_dim]`, all f32
/// row-major; returns `[tokens, n_heads, head_dim]`.
pub(super) fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    batch: &AttentionBatch,
    dims: Dims,
    scale: f32,
) -> Vec<f32> {
    let row_len = dims.n_heads * dims.head_dim;
    let mut out = vec![0f32; dims.tokens * row_len];
    let mut items = Vec::new();
    for (seq, view) in batch.sequences().enumerate() {
        let n = view.q_positions.len();
        for r in (0..n).step_by(Q_BLOCK) {
            items.push(Item {
                seq,
                row0: r,
                row1: (r + Q_BLOCK).min(n),
            });
        }
    }
    // Items cover the query rows in order, so the output splits into disjoint consecutive
    // chunks, one per item.
    let mut work = Vec::with_capacity(items.len());
    let mut rest = out.as_mut_slice();
    for item in items {
        let (chunk, tail) = rest.split_at_mut((item.row1 - item.row0) * row_len);
        work.push((item, chunk));
        rest = tail;
    }
    work.into_par_iter().for_each(|(item, chunk)| {
        let view = batch.sequence(item.seq);
        let first = view.first_row + item.row0;
        let q_rows = &q[first * row_len..(first + item.row1 - item.row0) * row_len];
        let positions = &view.q_positions[item.row0..item.row1];
        block(
            q_rows,
            positions,
            view.ctx_slots,
            view.ctx_positions,
            k,
            v,
            dims,
            scale,
            chunk,
        );
    });
    out
}

/// Attention for a block of query rows of one sequence, all heads.
#[allow(clippy::too_many_arguments)]
fn block(
    q_rows: &[f32],
    q_positions: &[u32],
    ctx_slots: &[u32],
    ctx_positions: &[u32],
    k: &[f32],
    v: &[f32],
    dims: Dims,
    scale: f32,
    out: &mut [f32],
) {
    let d = dims.head_dim;
    let group = dims.n_heads / dims.n_kv_heads;
    let rows = q_positions.len();
    let nq = rows * group;
    let kv_row = dims.n_kv_heads * d;
    let max_pos = q_positions.iter().copied().max().unwrap_or(0);

    let mut qv = vec![0f32; nq * d];
    let mut qpos = vec![0u32; nq];
    let mut m = vec![f32::NEG_INFINITY; nq];
    let mut l = vec![0f32; nq];
    let mut acc = vec![0f32; nq * d];
    let mut scores = vec![0f32; K_TILE];

    for g in 0..dims.n_kv_heads {
        // Gather this group's query vectors, pre-scaled; index = row * group + head-in-group.
        for r in 0..rows {
            for j in 0..group {
                let h = g * group + j;
                let src = &q_rows[(r * dims.n_heads + h) * d..][..d];
                let i = r * group + j;
                for (dst, s) in qv[i * d..(i + 1) * d].iter_mut().zip(src) {
                    *dst = s * scale;
                }
                qpos[i] = q_positions[r];
            }
        }
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        acc.fill(0.0);

        for (slots, positions) in ctx_slots.chunks(K_TILE).zip(ctx_positions.chunks(K_TILE)) {
            if positions.iter().all(|&p| p > max_pos) {
                continue;
            }
            for i in 0..nq {
                let qi = &qv[i * d..(i + 1) * d];
                let mut tile_max = f32::NEG_INFINITY;
                for (j, (&slot, &pos)) in slots.iter().zip(positions).enumerate() {
                    scores[j] = if pos <= qpos[i] {
                        let kj = &k[slot as usize * kv_row + g * d..][..d];
                        let s = dot(qi, kj);
                        tile_max = tile_max.max(s);
                        s
                    } else {
                        f32::NEG_INFINITY
                    };
                }
                if tile_max == f32::NEG_INFINITY {
                    continue;
                }
                let m_new = m[i].max(tile_max);
                let alpha = (m[i] - m_new).exp();
                let acc_i = &mut acc[i * d..(i + 1) * d];
                if alpha != 1.0 {
                    acc_i.iter_mut().for_each(|a| *a *= alpha);
                }
                let mut sum = 0f32;
                for (j, &slot) in slots.iter().enumerate() {
                    let s = scores[j];
                    if s == f32::NEG_INFINITY {
                        continue;
                    }
                    let p = (s - m_new).exp();
                    sum += p;
                    let vj = &v[slot as usize * kv_row + g * d..][..d];
                    axpy(acc_i, p, vj);
                }
                l[i] = l[i] * alpha + sum;
                m[i] = m_new;
            }
        }

        for r in 0..rows {
            for j in 0..group {
                let i = r * group + j;
                let h = g * group + j;
                let dst = &mut out[(r * dims.n_heads + h) * d..][..d];
                let inv = if l[i] > 0.0 { 1.0 / l[i] } else { 0.0 };
                for (o, a) in dst.iter_mut().zip(&acc[i * d..(i + 1) * d]) {
                    *o = a * inv;
                }
            }
        }
    }
}

/// Dot product with eight independent accumulators so the compiler vectorises it.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
    lanes.iter().sum::<f32>() + tail
}

/// `acc += p * x`.
#[inline]
fn axpy(acc: &mut [f32], p: f32, x: &[f32]) {
    for (a, x) in acc.iter_mut().zip(x) {
        *a += p * x;
    }
}
