//! The pools the CPU kernel reads, as rows of one head widened to f32: values (f32, f16; an
//! f16 -> f32 conversion is exact) and blocks of codes (`q8_0`, `q4_0`: `d · q`, one correctly
//! rounded product of exact operands). Every build of a row's load gives the portable one's
//! bits.

use half::f16;

use super::tiles::Simd;
use crate::attention::codes::{scale, Codes, QK};
use crate::attention::Dims;

/// An element type the kernel reads KV pools of.
pub(super) trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;

    /// Eight values from `p`, as f32.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C, and `p` points at 8 readable values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: as the trait's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as the trait's contract: 8 f16 values are 16 readable bytes.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

/// A layer's K (or V) pool as the kernel reads it: one head's row of a slot at a time, widened
/// to f32.
pub(super) trait KvRows: Copy + Send + Sync {
    /// Writes head `g`'s row of `slot` into `dst` as f32, in chunks of 8 values: chunk `c` to
    /// `dst[c * step..][..8]` (`step` 8: in order; 16: every other 8 floats, as
    /// [`super::tiles::TileRows::gather_keys_into`] interleaves pairs of keys). A head dimension that is not
    /// a multiple of 8 is only asked for in order. `false`, writing nothing, when the slot
    /// lies outside the pool.
    fn load(&self, slot: u32, g: usize, dst: &mut [f32], step: usize, simd: Simd) -> bool;

    /// The pool as blocks of `q8_0` codes, if it holds them: its keys are then scored in
    /// integers (`codes.rs`). `q4_0` keys are widened to f32 and scored against f32 queries:
    /// scored in integers they lost 0.5 points of perplexity more on Gemma 3 270M, for no
    /// speed (docs/BENCHMARKS.md).
    fn q8_rows(&self) -> Option<CodeRows<'_>> {
        None
    }
}

/// A pool of values (f32 or f16), `[n_slots][n_kv_heads][d]`.
#[derive(Clone, Copy)]
pub(super) struct Values<'a, T> {
    data: &'a [T],
    /// Values per slot: `n_kv_heads * d`.
    kv_row: usize,
    d: usize,
}

impl<'a, T> Values<'a, T> {
    /// The pool `data` of `dims`.
    pub(super) fn of(data: &'a [T], dims: Dims) -> Self {
        Self {
            data,
            kv_row: dims.n_kv_heads * dims.head_dim,
            d: dims.head_dim,
        }
    }
}

impl<T: KvElem> KvRows for Values<'_, T> {
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn load(&self, slot: u32, g: usize, dst: &mut [f32], step: usize, simd: Simd) -> bool {
        let (d, start) = (self.d, slot as usize * self.kv_row + g * self.d);
        let Some(row) = self.data.get(start..start + d) else {
            return false;
        };
        #[cfg(target_arch = "x86_64")]
        if simd.avx2() && d.is_multiple_of(8) {
            for (c, src) in row.chunks_exact(8).enumerate() {
                // SAFETY: `simd` names the AVX2+F16C build (or a wider one); `src` holds 8
                // values and the destination 8 floats (the caller's `step` layout).
                unsafe { copy8(src, &mut dst[c * step..][..8]) };
            }
            return true;
        }
        for (o, &x) in dst.iter_mut().zip(row) {
            *o = x.to_f32();
        }
        true
    }
}

/// A pool of blocks of codes (`attention/codes.rs`), `[n_slots][n_kv_heads][row bytes]`: each
/// value widened as `d · q`, exact in f32 on every path.
#[derive(Clone, Copy)]
pub(super) struct CodeRows<'a> {
    data: &'a [u8],
    codes: Codes,
    /// Bytes per slot: `n_kv_heads * codes.row_bytes(d)`.
    kv_row: usize,
    d: usize,
}

impl<'a> CodeRows<'a> {
    /// The pool `data` of `codes` and `dims`.
    pub(super) fn of(data: &'a [u8], codes: Codes, dims: Dims) -> Self {
        Self {
            data,
            codes,
            kv_row: dims.n_kv_heads * codes.row_bytes(dims.head_dim),
            d: dims.head_dim,
        }
    }

    /// Head `g`'s row of `slot`, if the slot lies in the pool.
    #[inline(always)]
    pub(super) fn row(&self, slot: u32, g: usize) -> Option<&'a [u8]> {
        let bytes = self.codes.row_bytes(self.d);
        let start = slot as usize * self.kv_row + g * bytes;
        self.data.get(start..start + bytes)
    }
}

impl KvRows for CodeRows<'_> {
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn load(&self, slot: u32, g: usize, dst: &mut [f32], step: usize, simd: Simd) -> bool {
        let Some(row) = self.row(slot, g) else {
            return false;
        };
        for (b, block) in row.chunks_exact(self.codes.block_bytes()).enumerate() {
            let d = scale(block);
            // Chunk `i` of the block's 4: its 8 codes' bytes, and whether they are high nibbles.
            for i in 0..QK / 8 {
                let (codes, high) = match self.codes {
                    Codes::Q8 => (&block[2 + 8 * i..][..8], false),
                    Codes::Q4 => (&block[2 + 8 * (i % 2)..][..8], i >= 2),
                };
                let out = &mut dst[(b * QK / 8 + i) * step..][..8];
                #[cfg(target_arch = "x86_64")]
                if simd.avx2() {
                    // SAFETY: `simd` names the AVX2 build (or a wider one); `codes` holds 8
                    // bytes and `out` 8 floats.
                    unsafe { widen8(self.codes, codes, high, d, out) };
                    continue;
                }
                for (o, &c) in out.iter_mut().zip(codes) {
                    *o = f32::from(code(self.codes, c, high)) * d;
                }
            }
        }
        true
    }

    fn q8_rows(&self) -> Option<CodeRows<'_>> {
        (self.codes == Codes::Q8).then_some(*self)
    }
}

/// The signed code a byte holds: a `q8_0` byte, or a `q4_0` nibble less 8.
#[inline(always)]
fn code(codes: Codes, byte: u8, high: bool) -> i8 {
    match (codes, high) {
        (Codes::Q8, _) => byte as i8,
        (Codes::Q4, false) => (byte & 15) as i8 - 8,
        (Codes::Q4, true) => (byte >> 4) as i8 - 8,
    }
}

/// Eight codes of `bytes` times `d` into `dst`: the same correctly rounded products as the
/// portable loop.
///
/// # Safety
/// The CPU has AVX2; `bytes` holds 8 bytes and `dst` 8 floats.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn widen8(codes: Codes, bytes: &[u8], high: bool, d: f32, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    // SAFETY: as this function's contract.
    unsafe {
        let raw = _mm_loadl_epi64(bytes.as_ptr().cast());
        let q = match (codes, high) {
            (Codes::Q8, _) => _mm256_cvtepi8_epi32(raw),
            (Codes::Q4, high) => {
                let wide = _mm256_cvtepu8_epi32(raw);
                let wide = if high {
                    _mm256_srli_epi32(wide, 4)
                } else {
                    wide
                };
                let nibble = _mm256_and_si256(wide, _mm256_set1_epi32(15));
                _mm256_sub_epi32(nibble, _mm256_set1_epi32(8))
            }
        };
        let x = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(d));
        _mm256_storeu_ps(dst.as_mut_ptr(), x);
    }
}

/// Eight values of `src` into `dst`, as f32.
///
/// # Safety
/// The CPU has AVX2 and F16C; `src` and `dst` hold 8 elements.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn copy8<T: KvElem>(src: &[T], dst: &mut [f32]) {
    // SAFETY: as this function's contract.
    unsafe {
        let x = T::load8(src.as_ptr());
        std::arch::x86_64::_mm256_storeu_ps(dst.as_mut_ptr(), x);
    }
}
