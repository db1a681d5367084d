//! The float kernel, for weights held as floats (f32, f16, bf16 checkpoints, and the
//! quantizations the integer kernel does not keep, dequantized): `[panel][k][NR]` values in
//! the file's own type, widened to f32 as they are loaded (exactly).
//!
//! Each output is one chain of fused multiply-adds over `k = 0, 1, …` in order, from zero,
//! whatever the tile's shape, so rows are batch-invariant and the scalar, AVX2 and NEON paths agree
//! bit for bit. Per work item, each chunk of rows runs over the item's panels in `QK`-value
//! blocks; a tile keeps up to 6 rows × 16 columns of accumulators in registers and spans
//! 2–4 panels when it has few rows, so that it still has enough independent chains.

use half::{bf16, f16};

use super::{tile_width, Isa, Tile, NR};

/// Values per `k` block: a block of every panel in a work item stays in L1.
const KB: usize = 32;

/// A weight type the kernel widens to f32 as it loads it.
pub(super) trait Elem: Copy + Default + Send + Sync + std::fmt::Debug {
    fn widen(self) -> f32;
    /// The 8 values at `p` as f32.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; `p` points to 8 values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// The 4 values at `p` as f32.
    ///
    /// # Safety
    /// `p` points to 4 values.
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn load4(p: *const Self) -> std::arch::aarch64::float32x4_t {
        // SAFETY: as the trait's contract.
        let lanes: [f32; 4] = std::array::from_fn(|i| unsafe { (*p.add(i)).widen() });
        // SAFETY: `lanes` holds four floats.
        unsafe { std::arch::aarch64::vld1q_f32(lanes.as_ptr()) }
    }
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

impl Elem for f32 {
    fn widen(self) -> f32 {
        self
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn load4(p: *const Self) -> std::arch::aarch64::float32x4_t {
        // SAFETY: as the trait's contract.
        unsafe { std::arch::aarch64::vld1q_f32(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: as the trait's contract.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Elem for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: as the trait's contract (F16C converts exactly, as `to_f32`).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

impl Elem for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn load4(p: *const Self) -> std::arch::aarch64::float32x4_t {
        use std::arch::aarch64::*;
        // SAFETY: as the trait's contract. A bf16 is the high half of its f32.
        unsafe { vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p.cast()))) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        // SAFETY: as the trait's contract. A bf16 is the high half of its f32.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }
}

/// `[panel][k][NR]` weights of type `T`.
#[derive(Debug)]
pub(super) struct FloatWeights<T> {
    pub(super) k: usize,
    pub(super) values: Vec<T>,
}

impl<T: Elem> FloatWeights<T> {
    /// Zero weights of shape `[n, k]`, to [`Self::fill`].
    pub(super) fn zeros(n: usize, k: usize) -> Self {
        Self {
            k,
            values: vec![T::default(); n.div_ceil(NR) * k * NR],
        }
    }

    /// Packs row-major `[n, k]` values; `w` holds `n · k` values.
    pub(super) fn pack(w: &[T], n: usize, k: usize) -> Self {
        let mut packed = Self::zeros(n, k);
        packed.fill(0, w);
        packed
    }

    /// Sets rows `first..` to the row-major values `w` (whole rows).
    pub(super) fn fill(&mut self, first: usize, w: &[T]) {
        let k = self.k;
        for (i, src) in w.chunks_exact(k.max(1)).enumerate() {
            let (p, c) = ((first + i) / NR, (first + i) % NR);
            for (kk, &v) in src.iter().enumerate() {
                if let Some(dst) = self.values.get_mut((p * k + kk) * NR + c) {
                    *dst = v;
                }
            }
        }
    }

    /// Row `row` of the weights, widened.
    pub(super) fn row(&self, row: usize, out: &mut [f32]) {
        let (p, c) = (row / NR, row % NR);
        for (kk, o) in out.iter_mut().enumerate().take(self.k) {
            *o = self.values[(p * self.k + kk) * NR + c].widen();
        }
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
                    let ws: [&[T]; 4] = std::array::from_fn(|i| {
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

impl Block<'_> {
    /// Whether the block, the weight blocks `ws` and the output rows `row..` of panels
    /// `first..` are all there: the vector paths check this once and then index unchecked.
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "aarch64")),
        allow(dead_code)
    )]
    fn fits<T>(&self, ws: &[&[T]], t: &Tile, first: usize, row: usize) -> bool {
        let (rows, wide) = (self.rows, ws.len());
        rows > 0
            && wide > 0
            && ws.iter().all(|w| w.len() >= self.kb * NR)
            && t.out.len() >= t.at(first + wide - 1, row + rows)
            && self.x.len() >= (rows - 1) * self.stride + self.kb
    }
}

/// For each of `ws.len()` panels `j` (from `first` on, within the item) and each row `r` of
/// the block: `out[j][row + r][c] += Σ_kk x[r][kk] · w_j[kk][c]`, one fused multiply-add per
/// term, in `kk` order, whatever the tile's shape.
fn accumulate<T: Elem>(isa: Isa, b: &Block, ws: &[&[T]], t: &mut Tile, first: usize, row: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the AVX2, AVX-512 and AMX paths are only chosen when the CPU has AVX2, FMA and
        // F16C (`Isa::detect`); the callee checks every length it relies on.
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe { avx2::accumulate(b, ws, t, first, row) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::accumulate(b, ws, t, first, row),
        Isa::Scalar => {
            for (j, w) in ws.iter().enumerate() {
                for r in 0..b.rows {
                    let x = &b.x[r * b.stride..][..b.kb];
                    let at = t.at(first + j, row + r);
                    let acc = &mut t.out[at..][..NR];
                    for (kk, &xv) in x.iter().enumerate() {
                        for (a, &wv) in acc.iter_mut().zip(&w[kk * NR..][..NR]) {
                            *a = xv.mul_add(wv.widen(), *a);
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

    use super::{Block, Elem, Tile, NR};

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn accumulate<T: Elem>(
        b: &Block,
        ws: &[&[T]],
        t: &mut Tile,
        first: usize,
        row: usize,
    ) {
        if b.fits(ws, t, first, row) {
            tile_shapes!(b.rows, ws.len(), tile<T>(b, ws, t, first, row))
        }
    }

    /// `R` rows × `P` panels × 16 columns of accumulators in registers. The caller checked
    /// that `x` holds `R` rows of `kb` values `stride` apart, each of the first `P` weight
    /// blocks `kb` rows of NR, and the output the `P` panels' rows `row..row + R`.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn tile<T: Elem, const R: usize, const P: usize>(
        b: &Block,
        ws: &[&[T]],
        t: &mut Tile,
        first: usize,
        row: usize,
    ) {
        let stride = t.panel_stride;
        let at = |p: usize, r: usize| (first + p) * stride + (row + r) * NR;
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
                    wp[0] = T::load8(src);
                    wp[1] = T::load8(src.add(8));
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

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    use super::{Block, Elem, Tile, NR};

    /// As the AVX2 path's `accumulate`, with NEON's fused multiply-add (every aarch64 CPU has
    /// it, so no feature is checked).
    pub(super) fn accumulate<T: Elem>(
        b: &Block,
        ws: &[&[T]],
        t: &mut Tile,
        first: usize,
        row: usize,
    ) {
        if b.fits(ws, t, first, row) {
            tile_shapes!(b.rows, ws.len(), tile<T>(b, ws, t, first, row))
        }
    }

    /// `R` rows × `P` panels × 16 columns (4 vectors) of accumulators. The caller checked the
    /// lengths, as for the AVX2 path's tile.
    fn tile<T: Elem, const R: usize, const P: usize>(
        b: &Block,
        ws: &[&[T]],
        t: &mut Tile,
        first: usize,
        row: usize,
    ) {
        let stride = t.panel_stride;
        let at = |p: usize, r: usize| (first + p) * stride + (row + r) * NR;
        // SAFETY: all offsets are within the lengths `accumulate` checked (R == b.rows,
        // P <= ws.len()).
        unsafe {
            let out = t.out.as_mut_ptr();
            let mut acc: [[[float32x4_t; 4]; P]; R] = std::array::from_fn(|r| {
                std::array::from_fn(|p| {
                    std::array::from_fn(|q| vld1q_f32(out.add(at(p, r) + 4 * q)))
                })
            });
            let xp = b.x.as_ptr();
            for kk in 0..b.kb {
                let w: [[float32x4_t; 4]; P] = std::array::from_fn(|p| {
                    let src = ws[p].as_ptr().add(kk * NR);
                    std::array::from_fn(|q| T::load4(src.add(4 * q)))
                });
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xb = vdupq_n_f32(*xp.add(r * b.stride + kk));
                    for (a, wp) in acc_r.iter_mut().zip(&w) {
                        for (a, &wq) in a.iter_mut().zip(wp) {
                            *a = vfmaq_f32(*a, xb, wq);
                        }
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                for (p, a) in acc_r.iter().enumerate() {
                    for (q, &v) in a.iter().enumerate() {
                        vst1q_f32(out.add(at(p, r) + 4 * q), v);
                    }
                }
            }
        }
    }
}
