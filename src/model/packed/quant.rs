//! The integer kernel, for weights kept in their GGUF codes: activations quantized to 8 bits
//! per 32-value block (as llama.cpp and candle's quantized matmul do), integer dot products
//! per block, f32 across blocks.
//!
//! For a row `x` with blocks `b` of scale `s_b = max|x_b| / 127` and codes
//! `a = round(x / s_b)`, and a weight column with codes `q`, every format is one of three
//! forms ([`Factors`]):
//!
//! - per block, a scale `d_b` and an offset `m_b` (`w = q · d_b + m_b`; the K-quants compute
//!   `d_b = D · sc_b`, `m_b = M · mn_b` from 6-bit integers and a super-block's `D`, `M`):
//!   `y = Σ_b  (Σ_i q_i a_i) · (d_b · s_b)  +  m_b · (s_b · Σ_i a_i)`
//!   (MXFP4 is this form too: its E2M1 codes are read through a table to unsigned integers,
//!   with `d_b = 2^(e_b − 128)` and `m_b = −12 d_b` from an exponent byte per block)
//! - `Q6_K`, an 8-bit scale per 16 values and codes centred on 32:
//!   `y = Σ_b  (Σ_h sc_h · (Σ_{i∈h} q_i a_i − 32 Σ_{i∈h} a_i)) · (D · s_b)`
//!
//! The inner sums are integers, exact in any order and on any path (VNNI `vpdpbusd`, AVX2
//! `vpmaddubsw`, scalar; the AVX-512 and AMX paths add `Q6_K`'s two scaled halves in f32,
//! where they are integers below 2^24 and so just as exact); the outer sum is one or two
//! fused multiply-adds per block in block order from zero, and the products `D · sc` are
//! exact in f32. A row's outputs therefore depend on nothing but its own activations: they
//! are bit-identical alone or in any batch, and every instruction path gives the same bits.
//!
//! Codes are kept at their own width: 4-bit codes as nibbles, a fifth and sixth bit in planes
//! beside them, 8-bit codes as bytes; scales as the file has them (f16, or 6/8-bit integers
//! with an f32 per super-block), so a packed matrix takes about the bytes of its file.

use rayon::prelude::*;

use super::{Isa, Tile, NR};
use crate::{Error, Result};

/// A vector path's entry point `kernel` (for CPUs with `$features`, which `$cpu` names) and
/// the two forms of its `tile`: with one dot per block, or with `Q6_K`'s dot per 16 values kept
/// apart. `SPLIT` is a constant, so the other formats hold no registers for the second dots.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "aarch64")),
    allow(unused_macros)
)]
macro_rules! kernel_entry {
    ($features:literal, $cpu:literal) => {
        #[doc = concat!("# Safety\nThe CPU has ", $cpu, ", and `super::in_bounds` holds for the arguments.")]
        #[target_feature(enable = $features)]
        pub(super) unsafe fn kernel(
            w: &QuantWeights,
            a: &QuantRows,
            spot: Spot,
            o: Out,
            out: &mut [f32],
        ) {
            // SAFETY: as this function's contract.
            unsafe {
                if matches!(w.factors, Factors::Halves { .. }) {
                    tile_shapes!(spot.rows, spot.panels, tile_split(w, a, spot, o, out))
                } else {
                    tile_shapes!(spot.rows, spot.panels, tile_whole(w, a, spot, o, out))
                }
            }
        }

        /// [`tile`] for factors per block: one dot per block.
        ///
        /// # Safety
        /// As [`tile`].
        #[target_feature(enable = $features)]
        unsafe fn tile_whole<const R: usize, const P: usize>(
            w: &QuantWeights,
            a: &QuantRows,
            spot: Spot,
            o: Out,
            out: &mut [f32],
        ) {
            // SAFETY: as this function's contract.
            unsafe { tile::<R, P, false>(w, a, spot, o, out) }
        }

        /// [`tile`] for `Q6_K`: a dot per 16 values.
        ///
        /// # Safety
        /// As [`tile`].
        #[target_feature(enable = $features)]
        unsafe fn tile_split<const R: usize, const P: usize>(
            w: &QuantWeights,
            a: &QuantRows,
            spot: Spot,
            o: Out,
            out: &mut [f32],
        ) {
            // SAFETY: as this function's contract.
            unsafe { tile::<R, P, true>(w, a, spot, o, out) }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod factors;
#[cfg(target_arch = "aarch64")]
mod neon;

use factors::{exponent_scale, FP4};
pub(super) use factors::{Factors, Form, RawBlock};

/// Values per quantization block (the activations', and the weights' unit of factors).
pub(super) const QK: usize = 32;
/// Blocks per K-quant super-block (256 values).
pub(super) const SUPER: usize = 8;
/// Bytes of one 4-`k` group of a panel: 16 columns × 4 codes, column-major within the group,
/// so that one 32-bit lane holds one column's 4 codes (the `vpdpbusd` operand order).
const GROUP: usize = NR * 4;
/// Bytes of a block's low nibbles in a panel: 4 chunks of [`GROUP`] bytes; chunk `c` holds
/// group `c` in its low nibbles and group `c + 4` in its high nibbles.
const NIBBLES: usize = QK * NR / 2;
/// Bytes of one plane of high code bits of a block in a panel: byte `i` holds the high bits
/// of the codes at byte `i` of every chunk.
const PLANE: usize = QK * NR / 8;

/// Blocks ahead of the one being multiplied whose codes the x86 kernels prefetch.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BLOCKS: usize = 4;

/// Asks for the codes of the block [`PREFETCH_BLOCKS`] on from the one at `codes` (`bytes` a
/// block). At 8 rows the AVX-512 kernel spent its time waiting on these loads from L3 or
/// memory, which the hardware's prefetch did not start early enough (the 7B's 8-row step took
/// a third less with this). Past a panel's end it reaches into the next panel's blocks, which
/// come next; a prefetch never faults, even past the array.
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_ahead(codes: *const u8, bytes: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let ahead = codes.wrapping_add(PREFETCH_BLOCKS * bytes);
    for line in (0..bytes).step_by(64) {
        // SAFETY: a prefetch reads nothing and never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast()) };
    }
}

/// The code widths we keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Bits {
    /// Unsigned 4-bit codes: the nibbles only.
    Four,
    /// Unsigned 5-bit codes: the nibbles, then one plane holding group `g`'s fifth bit at
    /// bit `g`.
    Five,
    /// Unsigned 6-bit codes: the nibbles, then two planes; plane `g / 4` holds group `g`'s
    /// two high bits at bits `2 (g % 4)`.
    Six,
    /// Signed 8-bit codes, offset zero: 8 groups of [`GROUP`] bytes.
    Eight,
    /// MXFP4's 4-bit E2M1 codes as nibbles, read through [`FP4`].
    Fp4,
}

impl Bits {
    /// Bytes of one block of one panel.
    pub(super) const fn block_bytes(self) -> usize {
        match self {
            Bits::Four | Bits::Fp4 => NIBBLES,
            Bits::Five => NIBBLES + PLANE,
            Bits::Six => NIBBLES + 2 * PLANE,
            Bits::Eight => QK * NR,
        }
    }

    /// Where group `g`'s high bits are: the plane's offset in the block, their lowest bit
    /// there, and their mask once moved to bit 4 (above the nibble).
    const fn plane(self, g: usize) -> (usize, i32, u8) {
        match self {
            Bits::Five => (NIBBLES, g as i32, 0x10),
            Bits::Six => (NIBBLES + (g / 4) * PLANE, 2 * (g % 4) as i32, 0x30),
            Bits::Four | Bits::Fp4 | Bits::Eight => (NIBBLES, 0, 0),
        }
    }

    /// Writes a block's `codes` (in `k` order) as row `c` of a panel's block `dst`.
    fn place(self, codes: &[u8; QK], dst: &mut [u8], c: usize) {
        for (kk, &q) in codes.iter().enumerate() {
            let (g, t) = (kk / 4, kk % 4);
            let at = (g % 4) * GROUP + c * 4 + t;
            match self {
                Bits::Eight => dst[g * GROUP + c * 4 + t] = q,
                _ => {
                    dst[at] |= (q & 0x0F) << (4 * (g / 4));
                    let (plane, shift, _) = self.plane(g);
                    if !matches!(self, Bits::Four | Bits::Fp4) {
                        dst[plane + c * 4 + t] |= (q >> 4) << shift;
                    }
                }
            }
        }
    }
}

/// Quantized weights: `[panel][block]` code blocks and their factors.
#[derive(Debug)]
pub(super) struct QuantWeights {
    pub(super) k: usize,
    pub(super) bits: Bits,
    pub(super) codes: Vec<u8>,
    pub(super) factors: Factors,
}

impl QuantWeights {
    /// Packs `n` rows of `k / QK` blocks each, reading block `b` of row `row` through `read`
    /// (rows in order).
    ///
    /// # Errors
    /// [`Error::InvalidModel`] if `k` is not a whole number of blocks (super-blocks for the
    /// K-quant forms) or a factor does not fit the form's type; `read`'s errors.
    pub(super) fn pack(
        n: usize,
        k: usize,
        bits: Bits,
        form: Form,
        mut read: impl FnMut(usize, usize, &mut RawBlock) -> Result<()>,
    ) -> Result<Self> {
        let bad = |why: String| Error::invalid_model("packed weights", why);
        let unit = match form {
            Form::Block | Form::Exponent => QK,
            Form::Super | Form::Halves => QK * SUPER,
        };
        if !k.is_multiple_of(unit) {
            return Err(bad(format!("{k} columns: not a multiple of {unit}")));
        }
        let (panels, blocks) = (n.div_ceil(NR), k / QK);
        let per_block = bits.block_bytes();
        let mut codes = vec![0u8; panels * blocks * per_block];
        let (per_b, per_sb) = (panels * blocks * NR, panels * (blocks / SUPER) * NR);
        let mut factors = Factors::zeros(form, per_b, per_sb);
        let mut raw = RawBlock {
            codes: [0; QK],
            d: 0.0,
            m: 0.0,
            sub: [0; 2],
        };
        for row in 0..n {
            let (p, c) = (row / NR, row % NR);
            for b in 0..blocks {
                read(row, b, &mut raw)?;
                let pb = p * blocks + b;
                let sb = (p * (blocks / SUPER).max(1) + b / SUPER) * NR + c;
                factors.set(&raw, pb, c, sb).map_err(bad)?;
                bits.place(&raw.codes, &mut codes[pb * per_block..][..per_block], c);
            }
        }
        Ok(Self {
            k,
            bits,
            codes,
            factors,
        })
    }

    fn blocks(&self) -> usize {
        self.k / QK
    }

    /// Bytes the codes and factors take.
    pub(super) fn bytes(&self) -> usize {
        self.codes.len()
            + match &self.factors {
                Factors::Block { d, m } => 2 * (d.len() + m.len()),
                Factors::Super { d, m, sc, mn } => 4 * (d.len() + m.len()) + sc.len() + mn.len(),
                Factors::Halves { d, sc } => 4 * d.len() + sc.len(),
                Factors::Exponent { e } => e.len(),
            }
    }

    /// One work item: its panels over rows `tile.row0..` of the quantized activations.
    pub(super) fn run(&self, a: &QuantRows, t: &mut Tile, isa: Isa) {
        // Rows the tiles took, where the CPU has them; the rest on the register tiles below.
        #[cfg(target_arch = "x86_64")]
        let done = if isa == Isa::Amx {
            self.run_amx(a, t)
        } else {
            0
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        let mr = isa.quant_tile_rows();
        for r in (done..t.rows).step_by(mr) {
            let rows = mr.min(t.rows - r);
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

    /// The work item's full tiles of 16 rows on AMX; returns how many rows they took.
    #[cfg(target_arch = "x86_64")]
    fn run_amx(&self, a: &QuantRows, t: &mut Tile) -> usize {
        let rows = t.rows / amx::ROWS * amx::ROWS;
        let spot = Spot {
            panel: t.first,
            panels: t.panels,
            row: t.row0,
            rows,
        };
        let o = Out {
            at: t.at(0, 0),
            panel_stride: t.panel_stride,
        };
        if rows == 0 || !in_bounds(self, a, spot, o, t.out) {
            return 0;
        }
        // SAFETY: `Amx` is only chosen where `Isa::available` finds the tiles usable; the bounds
        // were checked; `rows` is a multiple of the tile's rows.
        unsafe { amx::kernel(self, a, spot, o, t.out) };
        rows
    }

    /// Code `kk` of column `c` in block `b` of panel `p`, as a signed integer.
    fn code(&self, p: usize, b: usize, kk: usize, c: usize) -> i32 {
        let block = &self.codes[(p * self.blocks() + b) * self.bits.block_bytes()..];
        let (g, t) = (kk / 4, kk % 4);
        if self.bits == Bits::Eight {
            return block[g * GROUP + c * 4 + t] as i8 as i32;
        }
        let low = block[(g % 4) * GROUP + c * 4 + t] >> (4 * (g / 4)) & 0x0F;
        match self.bits {
            Bits::Four => return low as i32,
            Bits::Fp4 => return i32::from(FP4[usize::from(low)]),
            _ => {}
        }
        let (plane, shift, mask) = self.bits.plane(g);
        let high = (block[plane + c * 4 + t] >> shift) << 4 & mask;
        (low | high) as i32
    }

    /// The super-block factor index of block `b` of panel `p`, column `c`.
    fn super_at(&self, p: usize, b: usize, c: usize) -> usize {
        (p * (self.blocks() / SUPER) + b / SUPER) * NR + c
    }

    /// `(d_b, m_b)` of a per-block form (`D · sc`, `M · mn` for the K-quants, exact in f32;
    /// from the exponent for MXFP4).
    fn block_factors(&self, p: usize, b: usize, c: usize) -> (f32, f32) {
        let at = (p * self.blocks() + b) * NR + c;
        match &self.factors {
            Factors::Block { d, m } => (d[at].to_f32(), m[at].to_f32()),
            Factors::Super { d, m, sc, mn } => {
                let sb = self.super_at(p, b, c);
                (d[sb] * f32::from(sc[at]), m[sb] * f32::from(mn[at]))
            }
            Factors::Exponent { e } => {
                let d = exponent_scale(e[at]);
                (d, -12.0 * d)
            }
            Factors::Halves { .. } => (0.0, 0.0),
        }
    }

    /// Row `row` of the weights (`k` values), dequantized.
    pub(super) fn row(&self, row: usize, out: &mut [f32]) {
        let (p, c) = (row / NR, row % NR);
        for (b, out) in out.chunks_exact_mut(QK).enumerate().take(self.blocks()) {
            for (kk, w) in out.iter_mut().enumerate() {
                let q = self.code(p, b, kk, c) as f32;
                *w = match &self.factors {
                    Factors::Halves { d, sc } => {
                        let h = sc[(2 * (p * self.blocks() + b) + kk / 16) * NR + c];
                        d[self.super_at(p, b, c)] * (f32::from(h) * (q - 32.0))
                    }
                    _ => {
                        let (d, m) = self.block_factors(p, b, c);
                        q.mul_add(d, m)
                    }
                };
            }
        }
    }

    /// Whether the factor arrays hold every panel below `end`.
    fn factors_cover(&self, end: usize) -> bool {
        let (per_b, per_sb) = (end * self.blocks() * NR, end * (self.blocks() / SUPER) * NR);
        match &self.factors {
            Factors::Block { d, m } => per_b <= d.len() && per_b <= m.len(),
            Factors::Super { d, m, sc, mn } => {
                per_sb <= d.len().min(m.len()) && per_b <= sc.len().min(mn.len())
            }
            Factors::Halves { d, sc } => per_sb <= d.len() && 2 * per_b <= sc.len(),
            Factors::Exponent { e } => per_b <= e.len(),
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
    /// `[row][block][half]`: `32 · Σ codes` over each 16 values (the centre of `Q6_K`).
    halves: Vec<i32>,
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
            halves: vec![0; 2 * blocks],
        };
        rows.codes
            .par_chunks_mut(QK)
            .zip(x.par_chunks(QK))
            .zip(rows.scales.par_iter_mut())
            .zip(rows.scaled_sums.par_iter_mut())
            .zip(rows.sums.par_iter_mut())
            .zip(rows.halves.par_chunks_mut(2))
            .with_min_len(512)
            .for_each(|(((((codes, x), scale), scaled_sum), sum), halves)| {
                // Whole blocks: `k` is a multiple of `QK`.
                let (Ok(codes), Ok(x)) = (<&mut [i8; QK]>::try_from(codes), x.try_into()) else {
                    return;
                };
                let (s, total) = crate::cpu::quantize_block(isa, x, codes);
                *scale = s;
                *sum = total;
                *scaled_sum = s * total as f32;
                for (h, half) in halves.iter_mut().zip(codes.chunks(16)) {
                    *h = 32 * half.iter().map(|&q| i32::from(q)).sum::<i32>();
                }
            });
        rows
    }

    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn blocks(&self) -> usize {
        self.k / QK
    }
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
    let end = spot.panel + spot.panels;
    spot.rows > 0
        && spot.panels > 0
        && a.k == w.k
        && end * blocks * w.bits.block_bytes() <= w.codes.len()
        && w.factors_cover(end)
        && (spot.row + spot.rows) * a.k <= a.codes.len()
        && (spot.row + spot.rows) * blocks <= a.sums.len()
        && (spot.row + spot.rows) * blocks * 2 <= a.halves.len()
        && o.index(spot.panels - 1, spot.rows) <= out.len()
}

/// Computes the spot's outputs (every block) and stores them.
fn kernel(isa: Isa, w: &QuantWeights, a: &QuantRows, spot: Spot, o: Out, out: &mut [f32]) {
    if !in_bounds(w, a, spot, o, out) {
        return;
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` and `Amx` (whose rows short of a tile come here) are only chosen
        // when the CPU has AVX-512 F/BW/VNNI (`Isa::detect`), and the bounds were checked above.
        Isa::Avx512 | Isa::Amx => unsafe { avx512::kernel(w, a, spot, o, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is only chosen when the CPU has AVX2, FMA and F16C; bounds checked
        // above.
        Isa::Avx2 => unsafe { avx2::kernel(w, a, spot, o, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: `Neon` is only chosen when the CPU has the dot-product extension; bounds
        // checked above.
        Isa::Neon => unsafe { neon::kernel(w, a, spot, o, out) },
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
                let rb = row * blocks + b;
                let (s, sa) = (a.scales[rb], a.scaled_sums[rb]);
                for (c, acc) in acc.iter_mut().enumerate() {
                    let dot = |from: usize, to: usize| -> i32 {
                        (from..to)
                            .map(|kk| w.code(p, b, kk, c) * x[kk] as i32)
                            .sum()
                    };
                    if let Factors::Halves { d, sc } = &w.factors {
                        let h = (2 * (p * blocks + b)) * NR + c;
                        let int = i32::from(sc[h]) * (dot(0, 16) - a.halves[2 * rb])
                            + i32::from(sc[h + NR]) * (dot(16, QK) - a.halves[2 * rb + 1]);
                        *acc = (int as f32).mul_add(d[w.super_at(p, b, c)] * s, *acc);
                    } else {
                        let (d, m) = w.block_factors(p, b, c);
                        *acc = (dot(0, QK) as f32).mul_add(d * s, *acc);
                        *acc = m.mul_add(sa, *acc);
                    }
                }
            }
            out[o.index(j, r)..][..NR].copy_from_slice(&acc);
        }
    }
}
