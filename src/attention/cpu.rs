//! Fast CPU implementation of the attention op: flash-attention style tiling with an online
//! softmax, so memory stays `O(block)` whatever the context length.
//!
//! Work is split into items of (sequence, block of up to [`Q_BLOCK`] query rows), run in
//! parallel by rayon; each item owns the output rows it writes, so no synchronisation is
//! needed. Inside an item, for each kv head the queries of all heads sharing it (GQA) are
//! processed together against tiles of [`K_TILE`] context entries, so a K/V row read from the
//! pool is reused by every query of the block while it is in L1.
//!
//! The inner loops use `mul_add`: one fused instruction in the AVX2+FMA build selected at run
//! time on x86-64 (the portable build is correct but slow on CPUs without FMA).
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

/// One unit of parallel work: rows `[row0, row1)` of sequence `seq`, the query heads that read
/// kv head `g`. Splitting by kv head keeps both cores busy when a single sequence decodes.
struct Item {
    seq: usize,
    row0: usize,
    row1: usize,
    g: usize,
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
    let d = dims.head_dim;
    let group = dims.n_heads / dims.n_kv_heads;
    let row_len = dims.n_heads * d;
    let mut items = Vec::new();
    for (seq, view) in batch.sequences().enumerate() {
        let n = view.q_positions.len();
        for r in (0..n).step_by(Q_BLOCK) {
            for g in 0..dims.n_kv_heads {
                items.push(Item {
                    seq,
                    row0: r,
                    row1: (r + Q_BLOCK).min(n),
                    g,
                });
            }
        }
    }
    // Each item's heads are interleaved with other items' in the output rows: items write
    // `[rows][group][head_dim]` buffers, copied into place afterwards.
    let parts: Vec<(Item, Vec<f32>)> = items
        .into_par_iter()
        .map(|item| {
            let view = batch.sequence(item.seq);
            let first = view.first_row + item.row0;
            let rows = item.row1 - item.row0;
            let block = Block {
                q_rows: &q[first * row_len..(first + rows) * row_len],
                q_positions: &view.q_positions[item.row0..item.row1],
                ctx_slots: view.ctx_slots,
                ctx_positions: view.ctx_positions,
                k,
                v,
                g: item.g,
                dims,
                scale,
            };
            let mut buf = vec![0f32; rows * group * d];
            block.run(&mut buf);
            (item, buf)
        })
        .collect();
    let mut out = vec![0f32; dims.tokens * row_len];
    for (item, buf) in parts {
        let first = batch.sequence(item.seq).first_row + item.row0;
        for (r, src) in buf.chunks_exact(group * d).enumerate() {
            let at = (first + r) * row_len + item.g * group * d;
            out[at..at + group * d].copy_from_slice(src);
        }
    }
    out
}

/// A block of query rows of one sequence with everything its attention reads.
struct Block<'a> {
    q_rows: &'a [f32],
    q_positions: &'a [u32],
    ctx_slots: &'a [u32],
    ctx_positions: &'a [u32],
    k: &'a [f32],
    v: &'a [f32],
    /// The kv head whose query heads this block computes.
    g: usize,
    dims: Dims,
    scale: f32,
}

impl Block<'_> {
    /// Attention for the block's rows and the query heads of kv head `g`, into `out` as
    /// `[rows][group][head_dim]`: the AVX2+FMA build of
    /// [`Block::body`] where the CPU has it, the baseline build otherwise.
    fn run(&self, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU supports AVX2 and FMA, checked just above; the function is
                // otherwise ordinary safe Rust compiled with those features enabled.
                unsafe { self.body_avx2(out) };
                return;
            }
        }
        self.body(out, false)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn body_avx2(&self, out: &mut [f32]) {
        self.body(out, true)
    }

    /// `avx2`: the caller runs with AVX2 enabled (K tiles are transposed 8x8 in registers).
    #[inline(always)]
    fn body(&self, out: &mut [f32], avx2: bool) {
        let Block {
            q_rows,
            q_positions,
            ctx_slots,
            ctx_positions,
            k,
            v,
            g,
            dims,
            scale,
        } = *self;
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
        let mut scores = [0f32; K_TILE];
        // K tile transposed, kt[dim * K_TILE + key], so scores vectorise across keys without
        // horizontal sums. Every query takes this one path, whatever shares its block: a row's
        // result does not depend on how the batch was cut (batch invariance).
        let mut kt = vec![0f32; d * K_TILE];

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
        for (slots, positions) in ctx_slots.chunks(K_TILE).zip(ctx_positions.chunks(K_TILE)) {
            if positions.iter().all(|&p| p > max_pos) {
                continue;
            }
            let keys = TileKeys {
                k,
                slots,
                kv_row,
                off: g * d,
                d,
            };
            transpose_tile(&mut kt, &keys, avx2);
            for i in 0..nq {
                let tile = Tile {
                    slots,
                    positions,
                    kt: &kt,
                    kv_off: g * d,
                    kv_row,
                };
                let acc_i = &mut acc[i * d..(i + 1) * d];
                let qi = &qv[i * d..(i + 1) * d];
                let (mi, li) = (&mut m[i], &mut l[i]);
                match d {
                    64 => tile_step::<64>(qi, qpos[i], &tile, v, &mut scores, acc_i, mi, li),
                    128 => tile_step::<128>(qi, qpos[i], &tile, v, &mut scores, acc_i, mi, li),
                    _ => tile_step::<0>(qi, qpos[i], &tile, v, &mut scores, acc_i, mi, li),
                }
            }
        }

        for (i, dst) in out.chunks_exact_mut(d).take(nq).enumerate() {
            let inv = if l[i] > 0.0 { 1.0 / l[i] } else { 0.0 };
            for (o, a) in dst.iter_mut().zip(&acc[i * d..(i + 1) * d]) {
                *o = a * inv;
            }
        }
    }
}

/// The keys of one context tile for one kv head: key `j` is `d` values of `k` at
/// `slots[j] * kv_row + off`.
struct TileKeys<'a> {
    k: &'a [f32],
    slots: &'a [u32],
    kv_row: usize,
    off: usize,
    d: usize,
}

impl TileKeys<'_> {
    /// Key `j`, or `None` when its slot lies outside `k`.
    #[inline(always)]
    fn key(&self, j: usize) -> Option<&[f32]> {
        let start = *self.slots.get(j)? as usize * self.kv_row + self.off;
        self.k.get(start..start + self.d)
    }
}

/// Fills `kt[t * K_TILE + j]` with element `t` of key `j`. With few queries per block
/// (decode) this copy costs more than the scores, so the AVX2 build moves 8x8 blocks through
/// registers; both builds write the same values.
#[inline(always)]
fn transpose_tile(kt: &mut [f32], keys: &TileKeys<'_>, avx2: bool) {
    #[cfg(target_arch = "x86_64")]
    let done = if avx2 && keys.d.is_multiple_of(8) && kt.len() >= keys.d * K_TILE {
        // SAFETY: the caller runs with AVX2 enabled (`avx2` is only true inside
        // `Block::body_avx2`); bounds are checked inside.
        unsafe { transpose_avx2::blocks(kt, keys) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = {
        let _ = avx2;
        0
    };
    for j in done..keys.slots.len() {
        let Some(kj) = keys.key(j) else {
            continue;
        };
        for (t, &x) in kj.iter().enumerate() {
            kt[t * K_TILE + j] = x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod transpose_avx2 {
    use std::arch::x86_64::*;

    use super::{TileKeys, K_TILE};

    /// Transposes the keys in groups of 8 and returns how many it did (a multiple of 8; the
    /// caller copies the rest). `d % 8 == 0` and `kt.len() >= d * K_TILE`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn blocks(kt: &mut [f32], keys: &TileKeys<'_>) -> usize {
        let d = keys.d;
        let groups = keys.slots.len().min(K_TILE) / 8;
        for jb in 0..groups {
            let mut rows = [keys.k.as_ptr(); 8];
            for (i, r) in rows.iter_mut().enumerate() {
                match keys.key(jb * 8 + i) {
                    Some(key) => *r = key.as_ptr(),
                    None => return jb * 8,
                }
            }
            for tb in (0..d).step_by(8) {
                // SAFETY: each row pointer starts a key of d >= tb + 8 floats (`TileKeys::key`);
                // stores go to kt[(tb + i) * K_TILE + jb * 8 ..][..8], inside d * K_TILE.
                unsafe {
                    let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(rows[i].add(tb)));
                    let c = transpose8(r);
                    for (i, col) in c.iter().enumerate() {
                        _mm256_storeu_ps(kt.as_mut_ptr().add((tb + i) * K_TILE + jb * 8), *col);
                    }
                }
            }
        }
        groups * 8
    }

    /// 8x8 transpose: column `i` of the result holds element `i` of each input row.
    #[target_feature(enable = "avx2")]
    fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}

/// One tile of context for [`tile_step`].
struct Tile<'a> {
    slots: &'a [u32],
    positions: &'a [u32],
    /// The tile's keys transposed, `[head_dim][K_TILE]`.
    kt: &'a [f32],
    /// Offset of this kv head inside a pool row, and the row length.
    kv_off: usize,
    kv_row: usize,
}

/// One query against one tile: scores, online-softmax update of `(m, l)`, and `acc += p v`.
/// `D` is the head dimension when known at compile time (64, 128): fixed-size arrays keep the
/// scores and the accumulator in registers; `D = 0` is the generic fallback.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile_step<const D: usize>(
    qi: &[f32],
    qpos: u32,
    tile: &Tile<'_>,
    v: &[f32],
    scores: &mut [f32; K_TILE],
    acc_i: &mut [f32],
    m: &mut f32,
    l: &mut f32,
) {
    let d = qi.len();
    let n = tile.slots.len();
    let row = |slot: u32| -> std::ops::Range<usize> {
        let start = slot as usize * tile.kv_row + tile.kv_off;
        start..start + d
    };
    // Two interleaved accumulators (even and odd dimensions) halve the rounding chain of each
    // score. Half a tile at a time and dimensions in pairs, so both stay in 8 vector registers.
    const HALF: usize = K_TILE / 2;
    for (h, out) in scores.chunks_exact_mut(HALF).enumerate() {
        let (mut s0, mut s1) = ([0f32; HALF], [0f32; HALF]);
        for (t, pair) in qi.chunks_exact(2).enumerate() {
            let row = |dim: usize| -> Option<&[f32; HALF]> {
                let start = dim * K_TILE + h * HALF;
                tile.kt.get(start..start + HALF)?.try_into().ok()
            };
            let (Some(k0), Some(k1)) = (row(2 * t), row(2 * t + 1)) else {
                return;
            };
            for j in 0..HALF {
                s0[j] = pair[0].mul_add(k0[j], s0[j]);
                s1[j] = pair[1].mul_add(k1[j], s1[j]);
            }
        }
        for j in 0..HALF {
            out[j] = s0[j] + s1[j];
        }
    }
    // Entries past the tile's end and masked ones become -inf, and every reduction runs over
    // the whole fixed-size tile: the summation order never depends on where the tile or the
    // batch was cut, so a row's result is the same in any batch (batch invariance).
    let mut tile_max = f32::NEG_INFINITY;
    for (j, sj) in scores.iter_mut().enumerate() {
        if tile.positions.get(j).is_none_or(|&pos| pos > qpos) {
            *sj = f32::NEG_INFINITY;
        }
        tile_max = tile_max.max(*sj);
    }
    if tile_max == f32::NEG_INFINITY {
        return;
    }
    let m_new = m.max(tile_max);
    let alpha = exp(*m - m_new);
    for sj in scores.iter_mut() {
        // -inf gives exactly 0.
        *sj = exp(*sj - m_new);
    }
    let sum = lane_sum(&scores[..]);
    let s = &scores[..n];
    if D > 0 {
        if let Ok(acc) = <&mut [f32; D]>::try_from(&mut *acc_i) {
            let mut a = *acc;
            for x in a.iter_mut() {
                *x *= alpha;
            }
            for (&p, &slot) in s.iter().zip(tile.slots) {
                if p != 0.0 {
                    let r = row(slot);
                    if let Ok(vj) = <&[f32; D]>::try_from(&v[r]) {
                        for t in 0..D {
                            a[t] = p.mul_add(vj[t], a[t]);
                        }
                    }
                }
            }
            *acc = a;
        }
    } else {
        if alpha != 1.0 {
            acc_i.iter_mut().for_each(|a| *a *= alpha);
        }
        for (&p, &slot) in s.iter().zip(tile.slots) {
            if p != 0.0 {
                axpy(acc_i, p, &v[row(slot)]);
            }
        }
    }
    *l = *l * alpha + sum;
    *m = m_new;
}

/// `e^x` for `x <= 0` (softmax arguments), branch-free so loops over it vectorise: range
/// reduction `x = n ln 2 + r` with `|r| <= ln 2 / 2`, a degree-6 polynomial for `e^r`
/// (relative error below 2e-7), and `2^n` built in the exponent bits. Returns exactly 0 for
/// `x < -87` (including -inf).
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let xc = x.max(-87.0);
    let n = (xc * LOG2E).round();
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else {
        p * scale
    }
}

/// Sum with eight independent lanes (a sequential sum cannot vectorise).
#[inline(always)]
fn lane_sum(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (body, tail) = x.split_at(x.len() / 8 * 8);
    for c in body.chunks_exact(8) {
        for i in 0..8 {
            lanes[i] += c[i];
        }
    }
    lanes.iter().sum::<f32>() + tail.iter().sum::<f32>()
}

/// `acc += p * x`.
#[inline(always)]
fn axpy(acc: &mut [f32], p: f32, x: &[f32]) {
    for (a, x) in acc.iter_mut().zip(x) {
        *a += p * x;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_matches_libm() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let (a, b) = (super::exp(x), x.exp());
            worst = worst.max((a - b).abs() / b);
            x += 0.01;
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(super::exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(super::exp(0.0), 1.0);
    }
}
