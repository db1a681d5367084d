//! Fast CPU implementation of the attention op: flash-attention style tiling with an online
//! softmax, so memory stays `O(block)` whatever the context length.
//!
//! Work is split into items of (sequence, block of up to [`Q_BLOCK`] query rows), run in
//! parallel by rayon; each item owns the output rows it writes, so no synchronisation is
//! needed. Inside an item, for each kv head the queries of all heads sharing it (GQA) are
//! processed together against tiles of [`K_TILE`] context entries, so a K/V row read from the
//! pool is reused by every query of the block while it is in L1.
//!
//! The pools hold f32, f16 or blocks of codes; each tile is loaded once (keys as f32 or as
//! 8-bit codes, values widened to f32: `tiles`, `codes`) and shared by every query of the
//! block, while the next tile's rows are prefetched. An f16 pool's rows are not copied: the
//! vector paths widen them in registers as they read them in place. The inner loops use `mul_add`:
//! one fused instruction in the AVX2+FMA+F16C build selected at run time on x86-64 (the
//! portable build is correct but slow on CPUs without FMA).
//!
//! Cost: `O(queries × visible context × head_dim)` flops per head; context entries at positions
//! after every query of a tile are skipped without reading K or V.

use std::ops::Range;

use candle_core::{CpuStorage, CustomOp3, Layout, Shape};
use rayon::prelude::*;

use super::{AttentionBatch, Dims, SequenceView};
use crate::math::exp;

mod codes;
mod rows;
mod tiles;

use codes::{CodeTile, QueryCodes};
use rows::{CodeRows, HalfRows, KvRows, Values};
use tiles::{Simd, TileData, TileRows, QG};

/// Query rows per work item.
const Q_BLOCK: usize = 16;
/// Context entries per tile.
const K_TILE: usize = 64;
/// Tiles per segment: contexts longer than this are split across work items.
const SEGMENT: usize = 8;

/// The op as candle sees it; borrowed batch and checked shapes.
pub(super) struct PagedAttention<'a> {
    pub batch: &'a AttentionBatch,
    pub dims: Dims,
    pub scale: f32,
    /// Positions a query sees back from its own (`u32::MAX`: all).
    pub window: u32,
    /// Each query head's attention sink, if the model has them.
    pub sinks: Option<&'a [f32]>,
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
        let CpuStorage::F32(q) = q else {
            candle_core::bail!("q must be f32 for the CPU attention kernel")
        };
        let q = contiguous(q, q_l, "q")?;
        let d = self.dims;
        let out = match (k, v) {
            (CpuStorage::F32(k), CpuStorage::F32(v)) => forward(
                q,
                Values::of(contiguous(k, k_l, "k")?, d),
                Values::of(contiguous(v, v_l, "v")?, d),
                self,
            ),
            (CpuStorage::F16(k), CpuStorage::F16(v)) => forward(
                q,
                Values::of(contiguous(k, k_l, "k")?, d),
                Values::of(contiguous(v, v_l, "v")?, d),
                self,
            ),
            (CpuStorage::U8(k), CpuStorage::U8(v)) => {
                let Some(codes) = d.codes else {
                    candle_core::bail!("a U8 KV pool of no known blocks of codes")
                };
                forward(
                    q,
                    CodeRows::of(contiguous(k, k_l, "k")?, codes, d),
                    CodeRows::of(contiguous(v, v_l, "v")?, codes, d),
                    self,
                )
            }
            _ => candle_core::bail!("the CPU attention kernel reads f32, f16 or code KV pools"),
        };
        Ok((
            CpuStorage::F32(out),
            Shape::from((d.tokens, d.n_heads, d.head_dim)),
        ))
    }
}

fn contiguous<'a, T>(data: &'a [T], l: &Layout, name: &str) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{name} must be contiguous for the CPU attention kernel"),
    }
}

/// One unit of parallel work: rows `[row0, row1)` of sequence `seq`, the query heads that read
/// kv head `g`, against context tiles `tiles` (one segment). Splitting by kv head and by
/// segment keeps both cores busy when a single sequence decodes a long context.
struct Item {
    seq: usize,
    row0: usize,
    row1: usize,
    g: usize,
    tiles: Range<usize>,
}

impl Item {
    /// Whether `other` computes the same rows and heads (another segment of them).
    fn same_rows(&self, other: &Item) -> bool {
        (self.seq, self.row0, self.g) == (other.seq, other.row0, other.g)
    }
}

/// `q`: `[tokens, n_heads, head_dim]` f32, `k`/`v`: `[n_slots, n_kv_heads, head_dim]`, all
/// row-major; returns `[tokens, n_heads, head_dim]`.
///
/// A sequence's context is cut into segments of [`SEGMENT`] tiles by index in its context
/// list, whatever the batch; each segment is its own work item with its own softmax state, and
/// the segments are merged in order. A query's result depends on its own context only.
fn forward<P: KvRows>(q: &[f32], k: P, v: P, op: &PagedAttention) -> Vec<f32> {
    let PagedAttention {
        batch,
        dims,
        scale,
        window,
        sinks,
    } = *op;
    let d = dims.head_dim;
    let group = dims.n_heads / dims.n_kv_heads;
    let row_len = dims.n_heads * d;
    let mut items = Vec::new();
    for (seq, view) in batch.sequences().enumerate() {
        let n = view.q_positions.len();
        let tiles = view.ctx_len.div_ceil(K_TILE);
        for r in (0..n).step_by(Q_BLOCK) {
            for g in 0..dims.n_kv_heads {
                for t in (0..tiles.max(1)).step_by(SEGMENT) {
                    items.push(Item {
                        seq,
                        row0: r,
                        row1: (r + Q_BLOCK).min(n),
                        g,
                        tiles: t..(t + SEGMENT).min(tiles),
                    });
                }
            }
        }
    }
    let parts: Vec<(Item, Partial)> = items
        .into_par_iter()
        .map(|item| {
            let view = batch.sequence(item.seq);
            let first = view.first_row + item.row0;
            let rows = item.row1 - item.row0;
            let block = Block {
                q_rows: &q[first * row_len..(first + rows) * row_len],
                q_positions: &view.q_positions[item.row0..item.row1],
                context: view,
                tiles: item.tiles.clone(),
                k,
                v,
                g: item.g,
                dims,
                scale,
                window,
            };
            let part = block.run();
            (item, part)
        })
        .collect();
    // Each item's heads are interleaved with other items' in the output rows: partials are
    // `[rows][group][head_dim]`, merged and copied into place here.
    let mut out = vec![0f32; dims.tokens * row_len];
    let mut parts = parts.into_iter().peekable();
    while let Some((item, mut part)) = parts.next() {
        while let Some((_, next)) = parts.next_if(|(next, _)| next.same_rows(&item)) {
            part.merge(&next, d);
        }
        let first = batch.sequence(item.seq).first_row + item.row0;
        let sinks = sinks.map(|s| &s[item.g * group..(item.g + 1) * group]);
        for (r, dst) in part
            .normalized(d, sinks)
            .chunks_exact(group * d)
            .enumerate()
        {
            let at = (first + r) * row_len + item.g * group * d;
            out[at..at + group * d].copy_from_slice(dst);
        }
    }
    out
}

/// The softmax state of a block's queries over part of their context: per query `i`, the
/// running maximum score `m[i]`, the sum of `e^(score - m)` `l[i]`, and the weighted sum of
/// values `acc[i * d..][..d]`, not yet divided by `l`.
struct Partial {
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
}

impl Partial {
    /// Folds `other` (the next segment of the same queries) into `self`.
    fn merge(&mut self, other: &Partial, d: usize) {
        for (i, (&mb, &lb)) in other.m.iter().zip(&other.l).enumerate() {
            let ma = self.m[i];
            let acc_b = &other.acc[i * d..][..d];
            let acc_a = &mut self.acc[i * d..][..d];
            if mb == f32::NEG_INFINITY {
                continue;
            }
            if ma == f32::NEG_INFINITY {
                acc_a.copy_from_slice(acc_b);
                (self.m[i], self.l[i]) = (mb, lb);
                continue;
            }
            let m = ma.max(mb);
            let (a, b) = (exp(ma - m), exp(mb - m));
            for (x, &y) in acc_a.iter_mut().zip(acc_b) {
                *x = y.mul_add(b, *x * a);
            }
            self.l[i] = lb.mul_add(b, self.l[i] * a);
            self.m[i] = m;
        }
    }

    /// The attention outputs: `acc / l` (zero for a query that saw no context), with
    /// `sinks` (one per query head of the group; query `i` is head `i % group`) as one more
    /// score each in the softmax's sum.
    fn normalized(mut self, d: usize, sinks: Option<&[f32]>) -> Vec<f32> {
        for (i, acc) in self.acc.chunks_exact_mut(d).enumerate() {
            let (l, m) = (self.l[i], self.m[i]);
            let sink = match sinks {
                Some(s) if l > 0.0 => exp(s[i % s.len()] - m),
                _ => 0.0,
            };
            let l = l + sink;
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            acc.iter_mut().for_each(|a| *a *= inv);
        }
        self.acc
    }
}

/// A block of query rows of one sequence with everything its attention reads.
struct Block<'a, P> {
    q_rows: &'a [f32],
    q_positions: &'a [u32],
    /// The sequence, for its context's block table.
    context: SequenceView<'a>,
    /// The context tiles (by index) this block reads.
    tiles: Range<usize>,
    k: P,
    v: P,
    /// The kv head whose query heads this block computes.
    g: usize,
    dims: Dims,
    scale: f32,
    /// Positions a query sees back from its own (`u32::MAX`: all).
    window: u32,
}

impl<P: KvRows> Block<'_, P> {
    /// The softmax state of the block's rows and the query heads of kv head `g` (query
    /// `r * group + j`) over its tiles: the build of [`Block::body`] for the widest vectors the
    /// CPU has (the matmuls' path, [`crate::cpu::Isa`]), the baseline build otherwise.
    fn run(&self) -> Partial {
        #[cfg(target_arch = "x86_64")]
        match crate::cpu::Isa::detect() {
            // SAFETY: the CPU has every feature of the path `detect` chose (AVX-512 F on top of
            // AVX2, FMA and F16C); the functions are otherwise ordinary safe Rust.
            crate::cpu::Isa::Avx512 | crate::cpu::Isa::Amx => unsafe {
                return self.body_avx512();
            },
            // SAFETY: as above, AVX2, FMA and F16C.
            crate::cpu::Isa::Avx2 => unsafe { return self.body_avx2() },
            crate::cpu::Isa::Scalar => {}
        }
        self.body(Simd::None)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn body_avx2(&self) -> Partial {
        self.body(Simd::Avx2)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn body_avx512(&self) -> Partial {
        self.body(Simd::Avx512)
    }

    /// This group's query vectors, pre-scaled, and their positions; index = row * group +
    /// head-in-group.
    fn queries(&self) -> (Vec<f32>, Vec<u32>) {
        let (d, dims) = (self.dims.head_dim, self.dims);
        let group = dims.n_heads / dims.n_kv_heads;
        let nq = self.q_positions.len() * group;
        let mut qv = vec![0f32; nq * d];
        let mut qpos = vec![0u32; nq];
        for (r, &position) in self.q_positions.iter().enumerate() {
            for j in 0..group {
                let h = self.g * group + j;
                let src = &self.q_rows[(r * dims.n_heads + h) * d..][..d];
                let i = r * group + j;
                for (dst, s) in qv[i * d..(i + 1) * d].iter_mut().zip(src) {
                    *dst = s * self.scale;
                }
                qpos[i] = position;
            }
        }
        (qv, qpos)
    }

    /// `simd`: the vector registers the caller's build enables.
    #[inline(always)]
    fn body(&self, simd: Simd) -> Partial {
        let Block {
            q_positions,
            context,
            ref tiles,
            k,
            v,
            g,
            dims,
            window,
            ..
        } = *self;
        let d = dims.head_dim;
        let group = dims.n_heads / dims.n_kv_heads;
        let rows = q_positions.len();
        let nq = rows * group;
        let max_pos = q_positions.iter().copied().max().unwrap_or(0);
        let min_pos = q_positions.iter().copied().min().unwrap_or(0);

        let (qv, qpos) = self.queries();
        // Keys in 8-bit codes are scored in integers (`codes.rs`), against the queries in codes.
        let mut in_codes = k
            .q8_rows()
            .map(|pool| (pool, QueryCodes::of(&qv, d, simd), CodeTile::new(d)));
        let mut m = vec![f32::NEG_INFINITY; nq];
        let mut l = vec![0f32; nq];
        let mut acc = vec![0f32; nq * d];
        let mut scores = [[0f32; K_TILE]; QG];
        // The tile's keys and values gathered as f32, `[key][dim]`. Every query takes this one
        // path, whatever shares its block: a row's result does not depend on how the batch
        // was cut (batch invariance).
        let mut kt = vec![0f32; if in_codes.is_some() { 0 } else { K_TILE * d }];
        let mut vt = vec![0f32; K_TILE * d];
        // An f16 pool's rows are read in place on the vector paths, widened in registers as the
        // gather would have widened them (the same values), saving a write and a read of
        // every element: decode is bound by how fast the KV is read. Only for a few queries:
        // each group of `QG` widens a row again, where a prefill's many groups share one
        // gathered tile (a 512-token prefill took 7% longer in place).
        let in_place = simd != Simd::None && d.is_multiple_of(8) && nq <= 2 * QG;
        let (mut k_rows, mut v_rows): (HalfRows, HalfRows) = ([&[]; K_TILE], [&[]; K_TILE]);

        let mut slots = [0u32; K_TILE];
        // Past the tile's end, positions read as "after every query": masked.
        let mut positions = [u32::MAX; K_TILE];
        for t in tiles.clone() {
            let (lo, hi) = (t * K_TILE, ((t + 1) * K_TILE).min(context.ctx_len));
            // Tiles no query of the block sees (all after them, or all before every window)
            // are never read.
            if lo as u32 > max_pos || min_pos.saturating_sub(hi as u32 - 1) >= window {
                continue;
            }
            let n = hi - lo;
            fill_tile(&context, lo..hi, &mut slots, &mut positions);
            // The next tile's rows are on their way while this one is computed.
            if t + 1 < tiles.end {
                for p in hi..((t + 2) * K_TILE).min(context.ctx_len) {
                    let slot = context.slot(p);
                    k.prefetch(slot, g);
                    v.prefetch(slot, g);
                }
            }
            let rows = |pool| TileRows {
                pool,
                slots: &slots[..n],
                g,
                d,
            };
            let keys = match &mut in_codes {
                Some((pool, queries, tile)) => {
                    tile.gather(pool, &slots[..n], g, simd);
                    Keys::Codes { tile, queries }
                }
                None if in_place && k.half_rows(&slots, g, &mut k_rows) => {
                    Keys::Values(TileData::Half(&k_rows))
                }
                None => {
                    rows(k).gather_keys_into(&mut kt, simd);
                    Keys::Values(TileData::Gathered(&kt))
                }
            };
            let values = match in_place && v.half_rows(&slots, g, &mut v_rows) {
                true => TileData::Half(&v_rows),
                false => {
                    rows(v).gather_into(&mut vt, simd);
                    TileData::Gathered(&vt)
                }
            };
            let tile = Tile {
                simd,
                len: n,
                window,
                positions: &positions,
                keys,
                values,
            };
            for i0 in (0..nq).step_by(QG) {
                let i1 = (i0 + QG).min(nq);
                let queries = Queries {
                    first: i0,
                    q: &qv[i0 * d..i1 * d],
                    positions: &qpos[i0..i1],
                    acc: &mut acc[i0 * d..i1 * d],
                    m: &mut m[i0..i1],
                    l: &mut l[i0..i1],
                };
                match i1 - i0 {
                    1 => tile_step::<1>(queries, &tile, &mut scores),
                    2 => tile_step::<2>(queries, &tile, &mut scores),
                    _ => tile_step::<QG>(queries, &tile, &mut scores),
                }
            }
        }

        Partial { acc, m, l }
    }
}

/// The slots and positions of context entries `entries` (at most [`K_TILE`]); past them, slot
/// 0 and the position that no query sees.
fn fill_tile(
    context: &SequenceView<'_>,
    entries: Range<usize>,
    slots: &mut [u32; K_TILE],
    positions: &mut [u32; K_TILE],
) {
    for (j, (slot, position)) in slots.iter_mut().zip(positions).enumerate() {
        let p = entries.start + j;
        (*slot, *position) = match entries.contains(&p) {
            true => (context.slot(p), p as u32),
            false => (0, u32::MAX),
        };
    }
}

/// One tile of context for [`tile_step`].
struct Tile<'a> {
    /// The vector registers the caller's build enables.
    simd: Simd,
    /// Context entries in the tile (up to `K_TILE`).
    len: usize,
    /// Positions a query sees back from its own (`u32::MAX`: all).
    window: u32,
    /// Each entry's position; `u32::MAX` past the tile's end.
    positions: &'a [u32; K_TILE],
    keys: Keys<'a>,
    /// The tile's values, `[K_TILE][head_dim]`.
    values: TileData<'a>,
}

/// A tile's keys as its scores read them.
enum Keys<'a> {
    /// As values: gathered as f32, `[K_TILE][head_dim]` (in [`Simd::Avx512`]'s builds, pairs
    /// of keys interleaved by 8 dimensions: see [`tiles::TileRows::gather_keys_into`]), or an
    /// f16 pool's rows in place.
    Values(TileData<'a>),
    /// In codes, with the block's queries in codes.
    Codes {
        tile: &'a CodeTile,
        queries: &'a QueryCodes,
    },
}

/// Up to [`QG`] queries of a block with their softmax state: query `i` (the block's query
/// `first + i`) is `q[i * d..][..d]` at `positions[i]`, its state `m[i]`, `l[i]`,
/// `acc[i * d..][..d]`.
struct Queries<'a> {
    first: usize,
    q: &'a [f32],
    positions: &'a [u32],
    acc: &'a mut [f32],
    m: &'a mut [f32],
    l: &'a mut [f32],
}

/// `Q` queries against one tile: scores, online-softmax update of `(m, l)`, and `acc += p v`.
/// Each query's arithmetic is the same whatever `Q` and whatever else is in the batch.
#[inline(always)]
fn tile_step<const Q: usize>(
    queries: Queries<'_>,
    tile: &Tile<'_>,
    scores: &mut [[f32; K_TILE]; QG],
) {
    let Queries {
        first,
        q,
        positions,
        acc,
        m,
        l,
    } = queries;
    let d = q.len() / Q;
    let qs: [&[f32]; Q] = std::array::from_fn(|i| &q[i * d..(i + 1) * d]);
    match tile.keys {
        Keys::Values(kt) => tiles::scores(qs, kt, d, tile.len, scores, tile.simd),
        Keys::Codes { tile: t, queries } => {
            let qs: [_; Q] = std::array::from_fn(|i| queries.query(first + i));
            codes::scores(qs, t, tile.len, scores, tile.simd);
        }
    }
    for (i, s) in scores.iter_mut().enumerate().take(Q) {
        softmax_step(
            s,
            positions[i],
            tile,
            &mut m[i],
            &mut l[i],
            &mut acc[i * d..][..d],
        );
    }
    let mut rows = acc.chunks_exact_mut(d);
    let accs: [&mut [f32]; Q] = std::array::from_fn(|_| rows.next().unwrap_or_default());
    tiles::accumulate(scores, tile.values, d, tile.len, accs, tile.simd);
}

/// One query's online-softmax update over a tile: `scores` become the weights `p` (all zero
/// when the tile is invisible to the query), `acc` is rescaled to the new maximum, and `(m, l)`
/// updated.
#[inline(always)]
fn softmax_step(
    scores: &mut [f32; K_TILE],
    qpos: u32,
    tile: &Tile<'_>,
    m: &mut f32,
    l: &mut f32,
    acc: &mut [f32],
) {
    // Entries past the tile's end and masked ones become -inf, and every reduction runs over
    // the whole fixed-size tile: the summation order never depends on where the tile or the
    // batch was cut, so a row's result is the same in any batch (batch invariance).
    // Branch-free over fixed-size arrays, so the loops vectorise; `max` is exact, so its lane
    // order changes no bits.
    let mut lanes = [f32::NEG_INFINITY; 8];
    for (s, p) in scores
        .chunks_exact_mut(8)
        .zip(tile.positions.chunks_exact(8))
    {
        for i in 0..8 {
            // Past the query, or before its window (`qpos - p` wraps past the query, which
            // the first test catches).
            let hidden = p[i] > qpos || qpos.wrapping_sub(p[i]) >= tile.window;
            s[i] = if hidden { f32::NEG_INFINITY } else { s[i] };
            lanes[i] = if s[i] > lanes[i] { s[i] } else { lanes[i] };
        }
    }
    let tile_max = lanes.into_iter().fold(f32::NEG_INFINITY, f32::max);
    if tile_max == f32::NEG_INFINITY {
        scores.fill(0.0);
        return;
    }
    let m_new = m.max(tile_max);
    let alpha = exp(*m - m_new);
    for sj in scores.iter_mut() {
        // -inf gives exactly 0.
        *sj = exp(*sj - m_new);
    }
    let sum = lane_sum(&scores[..]);
    for a in acc.iter_mut() {
        *a *= alpha;
    }
    *l = *l * alpha + sum;
    *m = m_new;
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

#[cfg(test)]
mod tests;
