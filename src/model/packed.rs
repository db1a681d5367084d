//! Packed linear weights and the one matmul every pass runs on the CPU, whatever its row count.
//!
//! `y = x · Wᵀ` for `x: [m, k]` (f32) and `W: [n, k]`. The weights are repacked at load into
//! panels of [`NR`] output columns, `k`-major, in the file's own quantization where it has one
//! that dequantizes exactly (GGUF `Q4_1` as 4-bit codes, `Q8_0` as 8-bit codes, each with an
//! f32 scale and offset per 32 values) and as f32 otherwise. A decode step reads the weight
//! bytes once: 0.625 bytes per weight for `Q4_1` instead of 2 for an f16 copy or 4 for f32.
//!
//! **Batch invariance.** Each output `y[r][c]` is one chain of fused multiply-adds over
//! `k = 0, 1, …` in order, starting from zero, with the weight value dequantized the same way
//! (`q · d + m`, exact in f32 for both codes: the same value candle's dequantization gives).
//! Neither the row count, a row's place in its tile, the thread split (by column panels) nor
//! the vector width changes that chain, so a row's outputs are bit-identical whether it runs
//! alone or beside 1..N other rows, and the scalar and AVX2 paths agree bit for bit.
//!
//! Cost: `2·m·n·k` flops; per panel, each block of 32 `k` values is dequantized once into an L1
//! buffer and used by every row tile (6 rows × 16 columns of accumulators in registers).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use half::f16;
use rayon::prelude::*;

use crate::{Error, Result};

/// Output columns per panel: two AVX2 vectors.
pub(crate) const NR: usize = 16;
/// Values per quantization block (GGUF `Q4_1` and `Q8_0`).
const QK: usize = 32;
/// Rows per register tile.
const MR: usize = 6;
/// Rows whose activations stay in L2 while a work item's panels run over them.
const ROW_CHUNK: usize = 16 * MR;
/// Most panels per work item.
const MAX_GROUP: usize = 8;

/// The weight values of every panel.
#[derive(Debug)]
enum Codes {
    /// 4-bit codes, two per byte: byte `j` of a `k` row holds column `j` (low nibble) and
    /// column `j + 8` (high nibble). `w = q · scale + offset`.
    Q4 {
        codes: Vec<u8>,
        scales: Vec<f32>,
        offsets: Vec<f32>,
    },
    /// 8-bit codes, one per column. `w = q · scale + offset`.
    Q8 {
        codes: Vec<u8>,
        scales: Vec<f32>,
        offsets: Vec<f32>,
    },
    /// f32 values, `[panel][k][NR]`.
    F32(Vec<f32>),
}

/// A linear layer's weights, packed for [`PackedLinear::matmul`].
#[derive(Debug)]
pub(crate) struct PackedLinear {
    n: usize,
    k: usize,
    codes: Codes,
}

/// Which instructions run the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    /// The best path this CPU has.
    pub(crate) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Every path this CPU can run, for tests.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Self> {
        let mut all = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        if Isa::detect() == Isa::Avx2 {
            all.push(Isa::Avx2);
        }
        all
    }
}

impl PackedLinear {
    /// Packs a GGUF tensor of shape `[n, k]`: `Q4_1` and `Q8_0` keep their codes, other types
    /// are dequantized to f32.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] for a tensor that is not 2-D or whose data is short.
    pub fn from_qtensor(q: &QTensor) -> Result<Self> {
        let (n, k) = q.shape().dims2()?;
        let bytes = q.data()?;
        let bad = |why: &str| Error::invalid_model("packed weights", why);
        let codes = match q.dtype() {
            GgmlDType::Q4_1 if k % QK == 0 => {
                let blocks = k / QK;
                if bytes.len() < n * blocks * 20 {
                    return Err(bad("Q4_1 data shorter than its shape"));
                }
                pack_blocks(n, k, 4, |row, b, out| {
                    let blk = &bytes[(row * blocks + b) * 20..][..20];
                    for j in 0..QK / 2 {
                        out.codes[j] = blk[4 + j] & 0x0F;
                        out.codes[j + QK / 2] = blk[4 + j] >> 4;
                    }
                    out.scale = f16_at(blk, 0);
                    out.offset = f16_at(blk, 2);
                })
            }
            GgmlDType::Q8_0 if k % QK == 0 => {
                let blocks = k / QK;
                if bytes.len() < n * blocks * 34 {
                    return Err(bad("Q8_0 data shorter than its shape"));
                }
                pack_blocks(n, k, 8, |row, b, out| {
                    let blk = &bytes[(row * blocks + b) * 34..][..34];
                    // Signed codes shifted to 0..=255; the offset undoes the shift exactly.
                    for j in 0..QK {
                        out.codes[j] = (blk[2 + j] as i8 as i16 + 128) as u8;
                    }
                    out.scale = f16_at(blk, 0);
                    out.offset = -128.0 * out.scale;
                })
            }
            _ => {
                let w = q.dequantize(&candle_core::Device::Cpu)?;
                return Self::from_f32(&w.flatten_all()?.to_vec1::<f32>()?, n, k);
            }
        };
        Ok(Self { n, k, codes })
    }

    /// Packs f32 weights `[n, k]` (row-major) as f32.
    ///
    /// # Errors
    /// [`Error::InvalidModel`] if `w` does not hold `n · k` values.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Result<Self> {
        if w.len() != n * k {
            return Err(Error::invalid_model(
                "packed weights",
                format!("{} values for a [{n}, {k}] matrix", w.len()),
            ));
        }
        let panels = n.div_ceil(NR);
        let mut packed = vec![0f32; panels * k * NR];
        for (row, values) in w.chunks_exact(k.max(1)).enumerate().take(n) {
            let (p, c) = (row / NR, row % NR);
            for (kk, &v) in values.iter().enumerate() {
                packed[(p * k + kk) * NR + c] = v;
            }
        }
        Ok(Self {
            n,
            k,
            codes: Codes::F32(packed),
        })
    }

    /// Bytes the weights take (what one pass reads).
    pub fn bytes(&self) -> usize {
        match &self.codes {
            Codes::Q4 {
                codes,
                scales,
                offsets,
            }
            | Codes::Q8 {
                codes,
                scales,
                offsets,
            } => codes.len() + 4 * (scales.len() + offsets.len()),
            Codes::F32(w) => 4 * w.len(),
        }
    }

    fn panels(&self) -> usize {
        self.n.div_ceil(NR)
    }

    /// `x · Wᵀ` for `x: [m, k]` row-major; returns `[m, n]` row-major.
    pub fn matmul(&self, x: &[f32], m: usize, isa: Isa) -> Vec<f32> {
        let (n, k) = (self.n, self.k);
        if m == 0 || n == 0 {
            return Vec::new();
        }
        // Panel-major `[panel][row][NR]`, so each work item owns one contiguous chunk: a group
        // of panels, enough items to balance the threads, and each chunk of rows runs over all
        // of the group's panels while its activations are in cache.
        let panels = self.panels();
        let group = (panels / (4 * rayon::current_num_threads())).clamp(1, MAX_GROUP);
        let mut out_t = vec![0f32; panels * m * NR];
        out_t
            .par_chunks_mut(group * m * NR)
            .enumerate()
            .for_each(|(g, out)| {
                let panels = out.len() / (m * NR);
                for r0 in (0..m).step_by(ROW_CHUNK) {
                    let rows = ROW_CHUNK.min(m - r0);
                    let dst = Dst {
                        out: &mut *out,
                        panel_stride: m * NR,
                        row0: r0,
                    };
                    self.group(g * group, panels, &x[r0 * k..m * k], rows, dst, isa);
                }
            });
        let mut out = vec![0f32; m * n];
        for (p, tile) in out_t.chunks_exact(m * NR).enumerate() {
            let cols = NR.min(n - p * NR);
            for (r, row) in tile.chunks_exact(NR).enumerate() {
                out[r * n + p * NR..][..cols].copy_from_slice(&row[..cols]);
            }
        }
        out
    }

    /// Panels `first..first + panels` for `rows` rows of `x`, into `dst`.
    fn group(&self, first: usize, panels: usize, x: &[f32], rows: usize, mut dst: Dst, isa: Isa) {
        let k = self.k;
        let mut bufs = [0f32; MAX_GROUP * QK * NR];
        for k0 in (0..k).step_by(QK) {
            let kb = QK.min(k - k0);
            let mut ws: [&[f32]; MAX_GROUP] = [&[]; MAX_GROUP];
            for (j, buf) in bufs.chunks_exact_mut(QK * NR).take(panels).enumerate() {
                ws[j] = self.block_weights(first + j, k0, kb, buf, isa);
            }
            for r in (0..rows).step_by(MR) {
                let tile_rows = MR.min(rows - r);
                let block = Block {
                    x: &x[r * k + k0..],
                    stride: k,
                    rows: tile_rows,
                    kb,
                };
                // Few rows make few independent FMA chains: widen the tile across panels.
                let width = match tile_rows {
                    1 => 4,
                    2 | 3 => 2,
                    _ => 1,
                };
                let mut j = 0;
                while j < panels {
                    let wide = [4, 2, 1]
                        .into_iter()
                        .find(|&w| w <= width && j + w <= panels)
                        .unwrap_or(1);
                    let row = dst.row0 + r;
                    accumulate(isa, &block, &ws[j..j + wide], &mut dst, j, row);
                    j += wide;
                }
            }
        }
    }

    /// Block `k0..k0 + kb` of panel `p` as f32 `[kb][NR]`: the stored values, or codes
    /// dequantized into `buf`.
    fn block_weights<'s>(
        &'s self,
        p: usize,
        k0: usize,
        kb: usize,
        buf: &'s mut [f32],
        isa: Isa,
    ) -> &'s [f32] {
        let k = self.k;
        let (bits, codes, scales, offsets) = match &self.codes {
            Codes::F32(all) => return &all[(p * k + k0) * NR..][..kb * NR],
            Codes::Q4 {
                codes,
                scales,
                offsets,
            } => (4, codes, scales, offsets),
            Codes::Q8 {
                codes,
                scales,
                offsets,
            } => (8, codes, scales, offsets),
        };
        let b = p * (k / QK) + k0 / QK;
        let per_block = QK * NR * bits / 8;
        let codes = &codes[b * per_block..][..per_block];
        unpack(
            isa,
            bits,
            codes,
            &scales[b * NR..][..NR],
            &offsets[b * NR..][..NR],
            buf,
        );
        buf
    }
}

/// Where a work item writes: its chunk of the output, `[panel][row][NR]`, `panel_stride`
/// values per panel, from row `row0` on.
struct Dst<'a> {
    out: &'a mut [f32],
    panel_stride: usize,
    row0: usize,
}

/// One block of a row tile: `rows` rows of `x` (`stride` apart), `kb` values each.
struct Block<'a> {
    x: &'a [f32],
    stride: usize,
    rows: usize,
    kb: usize,
}

/// Codes and per-column scale and offset of one block, before packing.
struct RawBlock {
    codes: [u8; QK],
    scale: f32,
    offset: f32,
}

/// Packs `n` rows of `k / QK` blocks each, `bits` per code, reading each block through `read`.
fn pack_blocks(
    n: usize,
    k: usize,
    bits: usize,
    mut read: impl FnMut(usize, usize, &mut RawBlock),
) -> Codes {
    let (panels, blocks) = (n.div_ceil(NR), k / QK);
    let per_block = QK * NR * bits / 8;
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
                if bits == 8 {
                    dst[kk * NR + c] = q;
                } else {
                    let byte = &mut dst[kk * NR / 2 + c % 8];
                    *byte |= if c < 8 { q } else { q << 4 };
                }
            }
        }
    }
    if bits == 8 {
        Codes::Q8 {
            codes,
            scales,
            offsets,
        }
    } else {
        Codes::Q4 {
            codes,
            scales,
            offsets,
        }
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Dequantizes one block (`QK` rows of `NR` codes) into `out` (`[QK][NR]` f32):
/// `w = q · scale + offset`, one rounding (exact for both codes: `q · scale` is).
fn unpack(isa: Isa, bits: usize, codes: &[u8], scales: &[f32], offsets: &[f32], out: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2` is only chosen when the CPU has AVX2 and FMA (`Isa::detect`); the
        // callee checks every slice length it relies on.
        Isa::Avx2 => unsafe { avx2::unpack(bits, codes, scales, offsets, out) },
        Isa::Scalar => {
            for kk in 0..QK {
                for c in 0..NR {
                    let q = if bits == 8 {
                        codes[kk * NR + c]
                    } else {
                        let byte = codes[kk * NR / 2 + c % 8];
                        if c < 8 {
                            byte & 0x0F
                        } else {
                            byte >> 4
                        }
                    };
                    out[kk * NR + c] = (q as f32).mul_add(scales[c], offsets[c]);
                }
            }
        }
    }
}

/// For each of `ws.len()` panels `j` (from `first` on) and each row `r` of the block:
/// `out[j][row + r][c] += Σ_kk x[r][kk] · w_j[kk][c]`, one fused multiply-add per term, in `kk`
/// order, whatever the tile's shape.
fn accumulate(isa: Isa, b: &Block, ws: &[&[f32]], dst: &mut Dst, first: usize, row: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `unpack`: the CPU has AVX2 and FMA, and the callee checks lengths.
        Isa::Avx2 => unsafe { avx2::accumulate(b, ws, dst, first, row) },
        Isa::Scalar => {
            for (j, w) in ws.iter().enumerate() {
                for r in 0..b.rows {
                    let x = &b.x[r * b.stride..][..b.kb];
                    let at = (first + j) * dst.panel_stride + (row + r) * NR;
                    let acc = &mut dst.out[at..][..NR];
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

    use super::{Block, Dst, NR, QK};

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn unpack(
        bits: usize,
        codes: &[u8],
        scales: &[f32],
        offsets: &[f32],
        out: &mut [f32],
    ) {
        let per_row = NR * bits / 8;
        if codes.len() < QK * per_row
            || scales.len() < NR
            || offsets.len() < NR
            || out.len() < QK * NR
        {
            return;
        }
        // SAFETY: every load and store below stays inside the slices checked just above:
        // `codes` holds QK rows of `per_row` bytes, `out` QK rows of NR floats, and the
        // scales and offsets NR floats each.
        unsafe {
            let (s0, s1) = (
                _mm256_loadu_ps(scales.as_ptr()),
                _mm256_loadu_ps(scales.as_ptr().add(8)),
            );
            let (o0, o1) = (
                _mm256_loadu_ps(offsets.as_ptr()),
                _mm256_loadu_ps(offsets.as_ptr().add(8)),
            );
            let low = _mm_set1_epi8(0x0F);
            for kk in 0..QK {
                let src = codes.as_ptr().add(kk * per_row);
                let (lo, hi) = if bits == 8 {
                    let v = _mm_loadu_si128(src.cast());
                    (v, _mm_srli_si128::<8>(v))
                } else {
                    let v = _mm_loadl_epi64(src.cast());
                    (
                        _mm_and_si128(v, low),
                        _mm_and_si128(_mm_srli_epi16::<4>(v), low),
                    )
                };
                let w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                let w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                let dst = out.as_mut_ptr().add(kk * NR);
                _mm256_storeu_ps(dst, _mm256_fmadd_ps(w0, s0, o0));
                _mm256_storeu_ps(dst.add(8), _mm256_fmadd_ps(w1, s1, o1));
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn accumulate(b: &Block, ws: &[&[f32]], dst: &mut Dst, first: usize, row: usize) {
        let (rows, wide) = (b.rows, ws.len());
        let last = (first + wide).saturating_sub(1) * dst.panel_stride + (row + rows) * NR;
        if rows == 0
            || wide == 0
            || ws.iter().any(|w| w.len() < b.kb * NR)
            || dst.out.len() < last
            || b.x.len() < (rows - 1) * b.stride + b.kb
        {
            return;
        }
        match (rows, wide) {
            (1, 4) => tile::<1, 4>(b, ws, dst, first, row),
            (1, 2) => tile::<1, 2>(b, ws, dst, first, row),
            (2, 2) => tile::<2, 2>(b, ws, dst, first, row),
            (3, 2) => tile::<3, 2>(b, ws, dst, first, row),
            (1, _) => tile::<1, 1>(b, ws, dst, first, row),
            (2, _) => tile::<2, 1>(b, ws, dst, first, row),
            (3, _) => tile::<3, 1>(b, ws, dst, first, row),
            (4, _) => tile::<4, 1>(b, ws, dst, first, row),
            (5, _) => tile::<5, 1>(b, ws, dst, first, row),
            _ => tile::<6, 1>(b, ws, dst, first, row),
        }
    }

    /// `R` rows × `P` panels × 16 columns of accumulators in registers. The caller checked
    /// that `x` holds `R` rows of `kb` values `stride` apart, each of the first `P` weight
    /// blocks `kb` rows of NR, and `dst` the `P` panels' rows `row..row + R`.
    #[target_feature(enable = "avx2,fma")]
    fn tile<const R: usize, const P: usize>(
        b: &Block,
        ws: &[&[f32]],
        dst: &mut Dst,
        first: usize,
        row: usize,
    ) {
        let at = |p: usize, r: usize| (first + p) * dst.panel_stride + (row + r) * NR;
        // SAFETY: all offsets are within the lengths `accumulate` checked (R == b.rows,
        // P <= ws.len()).
        unsafe {
            let mut acc = [[[_mm256_setzero_ps(); 2]; P]; R];
            let out = dst.out.as_mut_ptr();
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

/// [`PackedLinear::matmul`] as a candle op on `x: [m, k]` (f32, CPU).
pub(crate) struct PackedMatmul<'a> {
    pub linear: &'a PackedLinear,
    pub isa: Isa,
}

impl CustomOp1 for PackedMatmul<'_> {
    fn name(&self) -> &'static str {
        "pensieve-packed-matmul"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(x) = x else {
            candle_core::bail!("packed matmul takes f32 activations")
        };
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("packed matmul takes contiguous activations")
        };
        let (m, k) = l.shape().dims2()?;
        if k != self.linear.k {
            candle_core::bail!(
                "packed matmul: x [{m}, {k}] for weights [{}, {}]",
                self.linear.n,
                self.linear.k
            )
        }
        let y = self.linear.matmul(&x[a..b], m, self.isa);
        Ok((CpuStorage::F32(y), Shape::from((m, self.linear.n))))
    }
}

impl PackedLinear {
    /// `x · Wᵀ` for `x: [m, k]` on the CPU.
    ///
    /// # Errors
    /// [`Error::Candle`] for another shape, dtype or device.
    pub fn forward(&self, x: &Tensor, isa: Isa) -> Result<Tensor> {
        let x = x.to_dtype(candle_core::DType::F32)?.contiguous()?;
        Ok(x.apply_op1_no_bwd(&PackedMatmul { linear: self, isa })?)
    }
}

#[cfg(test)]
mod tests;
