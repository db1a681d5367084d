//! The f32 kernel, for weights the file holds in no quantization we keep (f32, f16, bf16 and
//! the quantizations other than `Q4_1`/`Q8_0`): `[panel][k][NR]` f32 values.
//!
//! Each output is one chain of fused multiply-adds over `k = 0, 1, …` in order, from zero,
//! whatever the tile's shape, so rows are batch-invariant and the scalar and AVX2 paths agree
//! bit for bit. Per work item, each chunk of rows runs over the item's panels in `QK`-value
//! blocks; a tile keeps up to 6 rows × 16 columns of accumulators in registers and spans
//! 2–4 panels when it has few rows, so that it still has enough independent chains.

use super::{tile_width, Isa, Tile, NR};

/// Values per `k` block: a block of every panel in a work item stays in L1.
const KB: usize = 32;

/// `[panel][k][NR]` f32 weights.
#[derive(Debug)]
pub(super) struct FloatWeights {
    pub(super) k: usize,
    pub(super) values: Vec<f32>,
}

impl FloatWeights {
    /// Packs row-major `[n, k]` values; `w` holds `n · k` values.
    pub(super) fn pack(w: &[f32], n: usize, k: usize) -> Self {
        let panels = n.div_ceil(NR);
        let mut values = vec![0f32; panels * k * NR];
        for (row, src) in w.chunks_exact(k.max(1)).enumerate().take(n) {
            let (p, c) = (row / NR, row % NR);
            for (kk, &v) in src.iter().enumerate() {
                values[(p * k + kk) * NR + c] = v;
            }
        }
        Self { k, values }
    }

    /// One work item: its panels over rows `tile.row0..` of `x` (f32, `k` per row).
    pub(super) fn run(&self, x: &[f32], t: &mut Tile, isa: Isa) {
        let k = self.k;
        for k0 in (0..k).step_by(KB) {
            let kb = KB.min(k - k0);
            for r in (0..t.rows).step_by(6) {
                let rows = 6.min(t.rows - r);
                let mut j = 0;
                while j < t.panels {
                    let wide = tile_width(rows, t.panels - j);
                    let ws: [&[f32]; 4] = std::array::from_fn(|i| {
                        let p = (t.first + j + i).min(t.first + t.panels - 1);
                        &self.values[(p * k + k0) * NR..][..kb * NR]
                    });
                    let block = Block {
                        x: &x[(t.row0 + r) * k + k0..],
                        stride: k,
                        rows,
                        kb,
                    };
                    accumulate(isa, &block, &ws[..wide], t, j, r);
                    j += wide;
                }
            }
        }
    }
}

/// One block of a row tile: `rows` rows of `x` (`stride` apart), `kb` values each.
struct Block<'a> {
    x: &'a [f32],
    stride: usize,
    rows: usize,
    kb: usize,
}

/// For each of `ws.len()` panels `j` (from `first` on, within the item) and each row `r` of
/// the block: `out[j][row + r][c] += Σ_kk x[r][kk] · w_j[kk][c]`, one fused multiply-add per
/// term, in `kk` order, whatever the tile's shape.
fn accumulate(isa: Isa, b: &Block, ws: &[&[f32]], t: &mut Tile, first: usize, row: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the AVX2 and AVX-512 paths are only chosen when the CPU has AVX2 and FMA
        // (`Isa::detect`); the callee checks every length it relies on.
        Isa::Avx2 | Isa::Avx512 => unsafe { avx2::accumulate(b, ws, t, first, row) },
        Isa::Scalar => {
            for (j, w) in ws.iter().enumerate() {
                for r in 0..b.rows {
                    let x = &b.x[r * b.stride..][..b.kb];
                    let at = t.at(first + j, row + r);
                    let acc = &mut t.out[at..][..NR];
                    for (kk, &xv) in x.iter().enumerate() {
                        for (a, &wv) in acc.iter_mut().zip(&w[kk * NR..][..NR]) {
                            *a = xv.mul_add(wv, *a);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Block, Tile, NR};

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn accumulate(b: &Block, ws: &[&[f32]], t: &mut Tile, first: usize, row: usize) {
        let (rows, wide) = (b.rows, ws.len());
        if rows == 0
            || wide == 0
            || ws.iter().any(|w| w.len() < b.kb * NR)
            || t.out.len() < t.at(first + wide - 1, row + rows)
            || b.x.len() < (rows - 1) * b.stride + b.kb
        {
            return;
        }
        tile_shapes!(rows, wide, tile(b, ws, t, first, row))
    }

    /// `R` rows × `P` panels × 16 columns of accumulators in registers. The caller checked
    /// that `x` holds `R` rows of `kb` values `stride` apart, each of the first `P` weight
    /// blocks `kb` rows of NR, and the output the `P` panels' rows `row..row + R`.
    #[target_feature(enable = "avx2,fma")]
    fn tile<const R: usize, const P: usize>(
        b: &Block,
        ws: &[&[f32]],
        t: &mut Tile,
        first: usize,
        row: usize,
    ) {
        let (stride, row0) = (t.panel_stride, t.row0 + row);
        let at = |p: usize, r: usize| (first + p) * stride + (row0 + r) * NR;
        // SAFETY: all offsets are within the lengths `accumulate` checked (R == b.rows,
        // P <= ws.len()).
        unsafe {
            let mut acc = [[[_mm256_setzero_ps(); 2]; P]; R];
            let out = t.out.as_mut_ptr();
            for (r, acc_r) in acc.iter_mut().enumerate() {
                for (p, a) in acc_r.iter_mut().enumerate() {
                    a[0] = _mm256_loadu_ps(out.add(at(p, r)));
                    a[1] = _mm256_loadu_ps(out.add(at(p, r) + 8));
                }
            }
            let xp = b.x.as_ptr();
            for kk in 0..b.kb {
                let mut w = [[_mm256_setzero_ps(); 2]; P];
                for (p, wp) in w.iter_mut().enumerate() {
                    let src = ws[p].as_ptr().add(kk * NR);
                    wp[0] = _mm256_loadu_ps(src);
                    wp[1] = _mm256_loadu_ps(src.add(8));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xb = _mm256_broadcast_ss(&*xp.add(r * b.stride + kk));
                    for (a, wp) in acc_r.iter_mut().zip(&w) {
                        a[0] = _mm256_fmadd_ps(xb, wp[0], a[0]);
                        a[1] = _mm256_fmadd_ps(xb, wp[1], a[1]);
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                for (p, a) in acc_r.iter().enumerate() {
                    _mm256_storeu_ps(out.add(at(p, r)), a[0]);
                    _mm256_storeu_ps(out.add(at(p, r) + 8), a[1]);
                }
            }
        }
    }
}
