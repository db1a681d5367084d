//! The integer kernel, for `Q4_1` and `Q8_0` weights: activations quantized to 8 bits per
//! 32-value block (as llama.cpp and candle's quantized matmul do), integer dot products per
//! block, f32 across blocks.
//!
//! For a row `x` with blocks `b` of scale `s_b = max|x_b| / 127` and codes
//! `a = round(x / s_b)`, and a weight column with codes `q`, scale `d_b` and offset `m_b`
//! (`w = q · d_b + m_b`):
//!
//! `y = Σ_b  (Σ_i q_i a_i) · (d_b · s_b)  +  m_b · (s_b · Σ_i a_i)`
//!
//! The inner sums are integers, exact in any order and on any path (VNNI `vpdpbusd`, AVX2
//! `vpmaddubsw`, scalar); the outer sum is two fused multiply-adds per block in block order
//! from zero. A row's outputs therefore depend on nothing but its own activations: they are
//! bit-identical alone or in any batch, and every instruction path gives the same bits.
//!
//! Cost per 32 × 16 block: 8 `vpdpbusd` on 64-byte vectors per row, against 64 f32 FMAs on
//! 32-byte vectors; the weights are read as stored (4-bit codes plus an f32 scale and
//! offset per 32: 0.75 bytes per `Q4_1` weight).

use rayon::prelude::*;

use super::{Isa, Tile, NR};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

/// Values per quantization block (GGUF `Q4_1` and `Q8_0`, and the activations).
pub(super) const QK: usize = 32;
/// Bytes of one 4-`k` group of a panel: 16 columns × 4 codes, column-major within the group,
/// so that one 32-bit lane holds one column's 4 codes (the `vpdpbusd` operand order).
const GROUP: usize = NR * 4;

/// The code widths we keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Bits {
    /// Unsigned 4-bit codes (`Q4_1`). A block of a panel is 4 chunks of [`GROUP`] bytes;
    /// chunk `c` holds group `c` in its low nibbles and group `c + 4` in its high nibbles.
    Four,
    /// Signed 8-bit codes (`Q8_0`), offset zero. A block is 8 groups of [`GROUP`] bytes.
    Eight,
}

impl Bits {
    /// Bytes of one block of one panel.
    pub(super) const fn block_bytes(self) -> usize {
        match self {
            Bits::Four => QK * NR / 2,
            Bits::Eight => QK * NR,
        }
    }
}

/// Quantized weights: `[panel][block]` code blocks, and per `[panel][block][column]` an f32
/// scale and offset.
#[derive(Debug)]
pub(super) struct QuantWeights {
    pub(super) k: usize,
    pub(super) bits: Bits,
    pub(super) codes: Vec<u8>,
    pub(super) scales: Vec<f32>,
    pub(super) offsets: Vec<f32>,
}

/// One block of one weight row as read from the file.
pub(super) struct RawBlock {
    /// Codes in `k` order: 0..=15 for [`Bits::Four`], two's-complement bytes for
    /// [`Bits::Eight`].
    pub(super) codes: [u8; QK],
    pub(super) scale: f32,
    pub(super) offset: f32,
}

impl QuantWeights {
    /// Packs `n` rows of `k / QK` blocks each, reading block `b` of row `row` through `read`.
    pub(super) fn pack(
        n: usize,
        k: usize,
        bits: Bits,
        mut read: impl FnMut(usize, usize, &mut RawBlock),
    ) -> Self {
        let (panels, blocks) = (n.div_ceil(NR), k / QK);
        let per_block = bits.block_bytes();
        let mut codes = vec![0u8; panels * blocks * per_block];
        let mut scales = vec![0f32; panels * blocks * NR];
        let mut offsets = vec![0f32; panels * blocks * NR];
        let mut raw = RawBlock {
            codes: [0; QK],
            scale: 0.0,
            offset: 0.0,
        };
        for row in 0..n {
            let (p, c) = (row / NR, row % NR);
            for b in 0..blocks {
                read(row, b, &mut raw);
                let pb = p * blocks + b;
                scales[pb * NR + c] = raw.scale;
                offsets[pb * NR + c] = raw.offset;
                let dst = &mut codes[pb * per_block..][..per_block];
                for (kk, &q) in raw.codes.iter().enumerate() {
                    let (g, t) = (kk / 4, kk % 4);
                    match bits {
                        Bits::Eight => dst[g * GROUP + c * 4 + t] = q,
                        Bits::Four => dst[(g % 4) * GROUP + c * 4 + t] |= q << (4 * (g / 4)),
                    }
                }
            }
        }
        Self {
            k,
            bits,
            codes,
            scales,
            offsets,
        }
    }

    fn blocks(&self) -> usize {
        self.k / QK
    }

    /// One work item: its panels over rows `tile.row0..` of the quantized activations.
    pub(super) fn run(&self, a: &QuantRows, t: &mut Tile, isa: Isa) {
        for r in (0..t.rows).step_by(super::MR) {
            let rows = super::MR.min(t.rows - r);
            let mut j = 0;
            while j < t.panels {
                let wide = super::tile_width(rows, t.panels - j);
                let spot = Spot {
                    panel: t.first + j,
                    panels: wide,
                    row: t.row0 + r,
                    rows,
                };
                let out = Out {
                    at: t.at(j, r),
                    panel_stride: t.panel_stride,
                };
                kernel(isa, self, a, spot, out, &mut *t.out);
                j += wide;
            }
        }
    }

    /// Code `kk` of column `c` in block `b` of panel `p`, as a signed integer.
    fn code(&self, p: usize, b: usize, kk: usize, c: usize) -> i32 {
        let base = (p * self.blocks() + b) * self.bits.block_bytes();
        let (g, t) = (kk / 4, kk % 4);
        match self.bits {
            Bits::Eight => self.codes[base + g * GROUP + c * 4 + t] as i8 as i32,
            Bits::Four => {
                (self.codes[base + (g % 4) * GROUP + c * 4 + t] >> (4 * (g / 4)) & 0x0F) as i32
            }
        }
    }
}

/// Activations quantized per row and 32-value block.
#[derive(Debug)]
pub(super) struct QuantRows {
    k: usize,
    /// `[row][k]` codes in -127..=127.
    codes: Vec<i8>,
    /// `[row][block]`: the block's scale `s`.
    scales: Vec<f32>,
    /// `[row][block]`: `s · Σ codes`, the factor of the weights' offsets.
    scaled_sums: Vec<f32>,
    /// `[row][block]`: `Σ codes`.
    sums: Vec<i32>,
}

impl QuantRows {
    /// Quantizes `m` rows of `k` values (`k` a multiple of [`QK`]).
    pub(super) fn new(x: &[f32], m: usize, k: usize, isa: Isa) -> Self {
        let blocks = m * (k / QK);
        let mut rows = Self {
            k,
            codes: vec![0; m * k],
            scales: vec![0.0; blocks],
            scaled_sums: vec![0.0; blocks],
            sums: vec![0; blocks],
        };
        rows.codes
            .par_chunks_mut(QK)
            .zip(x.par_chunks(QK))
            .zip(rows.scales.par_iter_mut())
            .zip(rows.scaled_sums.par_iter_mut())
            .zip(rows.sums.par_iter_mut())
            .with_min_len(512)
            .for_each(|((((codes, x), scale), scaled_sum), sum)| {
                let (s, total) = quantize_block(isa, x, codes);
                *scale = s;
                *sum = total;
                *scaled_sum = s * total as f32;
            });
        rows
    }

    fn blocks(&self) -> usize {
        self.k / QK
    }
}

/// Quantizes 32 values: returns the scale `max|x| / 127` and the codes' sum. The codes are
/// `round_ties_even(x · (127 / max|x|))`: the scalar and vector paths do the same exact
/// operations, so they give the same codes.
fn quantize_block(isa: Isa, x: &[f32], codes: &mut [i8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let sum = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: both vector paths are only chosen when the CPU has AVX2 (`Isa::detect`);
        // the callee checks the lengths.
        Isa::Avx2 | Isa::Avx512 => unsafe { avx2::quantize(x, inv, codes) },
        Isa::Scalar => x
            .iter()
            .zip(codes.iter_mut())
            .map(|(&v, q)| {
                *q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
                *q as i32
            })
            .sum(),
    };
    (amax / 127.0, sum)
}

/// Where a kernel call works: panels `panel..panel + panels`, rows `row..row + rows`.
#[derive(Clone, Copy)]
struct Spot {
    panel: usize,
    panels: usize,
    row: usize,
    rows: usize,
}

/// Where its outputs go: row `r` of panel `j` (of the spot) at `at + j · panel_stride + r · NR`.
#[derive(Clone, Copy)]
struct Out {
    at: usize,
    panel_stride: usize,
}

impl Out {
    fn index(self, j: usize, r: usize) -> usize {
        self.at + j * self.panel_stride + r * NR
    }
}

/// Whether every index a kernel touches for `spot` is inside the weights, the activations and
/// `out`: the vector paths check this once and then read without bounds checks.
fn in_bounds(w: &QuantWeights, a: &QuantRows, spot: Spot, o: Out, out: &[f32]) -> bool {
    let blocks = w.blocks();
    spot.rows > 0
        && spot.panels > 0
        && a.k == w.k
        && (spot.panel + spot.panels) * blocks * w.bits.block_bytes() <= w.codes.len()
        && (spot.panel + spot.panels) * blocks * NR <= w.scales.len()
        && (spot.panel + spot.panels) * blocks * NR <= w.offsets.len()
        && (spot.row + spot.rows) * a.k <= a.codes.len()
        && (spot.row + spot.rows) * blocks <= a.sums.len()
        && o.index(spot.panels - 1, spot.rows) <= out.len()
}

/// Computes the spot's outputs (every block) and stores them.
fn kernel(isa: Isa, w: &QuantWeights, a: &QuantRows, spot: Spot, o: Out, out: &mut [f32]) {
    if !in_bounds(w, a, spot, o, out) {
        return;
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` is only chosen when the CPU has AVX-512 F/BW/VNNI (`Isa::detect`),
        // and the bounds were checked above.
        Isa::Avx512 => unsafe { avx512::kernel(w, a, spot, o, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is only chosen when the CPU has AVX2 and FMA; bounds checked above.
        Isa::Avx2 => unsafe { avx2::kernel(w, a, spot, o, out) },
        Isa::Scalar => scalar_kernel(w, a, spot, o, out),
    }
}

/// The reference the vector paths equal bit for bit.
fn scalar_kernel(w: &QuantWeights, a: &QuantRows, spot: Spot, o: Out, out: &mut [f32]) {
    let blocks = w.blocks();
    for j in 0..spot.panels {
        let p = spot.panel + j;
        for r in 0..spot.rows {
            let row = spot.row + r;
            let mut acc = [0f32; NR];
            for b in 0..blocks {
                let x = &a.codes[row * a.k + b * QK..][..QK];
                let (s, sa) = (a.scales[row * blocks + b], a.scaled_sums[row * blocks + b]);
                let pb = (p * blocks + b) * NR;
                for (c, acc) in acc.iter_mut().enumerate() {
                    let dot: i32 = (0..QK).map(|kk| w.code(p, b, kk, c) * x[kk] as i32).sum();
                    let ds = w.scales[pb + c] * s;
                    *acc = (dot as f32).mul_add(ds, *acc);
                    *acc = w.offsets[pb + c].mul_add(sa, *acc);
                }
            }
            out[o.index(j, r)..][..NR].copy_from_slice(&acc);
        }
    }
}
