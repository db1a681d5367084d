//! The pools the CPU kernel reads, as rows of one head widened to f32: values (f32, f16; an
//! f16 -> f32 conversion is exact) and blocks of codes (`q8_0`, `q4_0`: `d · q`, one correctly
//! rounded product of exact operands). Every build of a row's load gives the portable one's
//! bits.

use half::f16;

use super::tiles::Simd;
use super::K_TILE;
use crate::attention::codes::{scale, Codes, QK};
use crate::attention::Dims;

/// An element type the kernel reads KV pools of.
pub(super) trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;

    /// `data` as f16 values, if it holds them: the vector paths read such rows in place.
    fn halves(data: &[Self]) -> Option<&[f16]>;

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

    fn halves(_: &[Self]) -> Option<&[f16]> {
        None
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

    fn halves(data: &[Self]) -> Option<&[f16]> {
        Some(data)
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

    /// Asks the CPU to bring head `g`'s row of `slot` into its cache, for a [`KvRows::load`]
    /// soon after (a slot outside the pool is passed over).
    fn prefetch(&self, slot: u32, g: usize);

    /// The pool as blocks of `q8_0` codes, if it holds them: its keys are then scored in
    /// integers (`codes.rs`). `q4_0` keys are widened to f32 and scored against f32 queries:
    /// scored in integers they lost 0.5 points of perplexity more on Gemma 3 270M, for no
    /// speed (docs/BENCHMARKS.md).
    fn q8_rows(&self) -> Option<CodeRows<'_>> {
        None
    }

    /// Head `g`'s rows of `slots` in place, if the pool holds f16 values and every slot lies
    /// in it: the vector paths then widen them as they compute (the same registers as from a
    /// gathered tile) instead of writing and reading back an f32 copy.
    fn half_rows<'s>(&'s self, slots: &[u32; K_TILE], g: usize, rows: &mut HalfRows<'s>) -> bool {
        let _ = (slots, g, rows);
        false
    }
}

/// A tile's rows of one head in an f16 pool, in place: row `j` of the tile is `rows[j]`.
pub(super) type HalfRows<'a> = [&'a [f16]; K_TILE];

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

    /// Head `g`'s row of `slot`, if the slot lies in the pool.
    #[inline(always)]
    fn row(&self, slot: u32, g: usize) -> Option<&'a [T]> {
        let start = slot as usize * self.kv_row + g * self.d;
        self.data.get(start..start + self.d)
    }
}

impl<T: KvElem> KvRows for Values<'_, T> {
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn load(&self, slot: u32, g: usize, dst: &mut [f32], step: usize, simd: Simd) -> bool {
        let d = self.d;
        let Some(row) = self.row(slot, g) else {
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

    #[inline(always)]
    fn prefetch(&self, slot: u32, g: usize) {
        if let Some(row) = self.row(slot, g) {
            prefetch(row);
        }
    }

    #[inline(always)]
    fn half_rows<'s>(&'s self, slots: &[u32; K_TILE], g: usize, rows: &mut HalfRows<'s>) -> bool {
        let Some(data) = T::halves(self.data) else {
            return false;
        };
        for (row, &slot) in rows.iter_mut().zip(slots) {
            let start = slot as usize * self.kv_row + g * self.d;
            match data.get(start..start + self.d) {
                Some(r) => *row = r,
                None => return false,
            }
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
        let start = self.start(slot, g)?;
        self.data.get(start..start + self.codes.row_bytes(self.d))
    }

    /// Where head `g`'s row of `slot` starts in [`CodeRows::bytes`], if the slot lies in the
    /// pool.
    #[inline(always)]
    pub(super) fn start(&self, slot: u32, g: usize) -> Option<usize> {
        let bytes = self.codes.row_bytes(self.d);
        let start = slot as usize * self.kv_row + g * bytes;
        (start + bytes <= self.data.len()).then_some(start)
    }

    /// The whole pool's bytes.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn bytes(&self) -> &'a [u8] {
        self.data
    }
}

impl KvRows for CodeRows<'_> {
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn load(&self, slot: u32, g: usize, dst: &mut [f32], step: usize, simd: Simd) -> bool {
        let Some(row) = self.row(slot, g) else {
            return false;
        };
        #[cfg(target_arch = "x86_64")]
        if simd == Simd::Avx512 && step == 8 && self.codes == Codes::Q8 {
            // SAFETY: the AVX-512 build (F and F16C among its features).
            unsafe { widen_q8_avx512(row, dst) };
            return true;
        }
        for (b, block) in row.chunks_exact(self.codes.block_bytes()).enumerate() {
            let d = scale_of(block, simd);
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

    #[inline(always)]
    fn prefetch(&self, slot: u32, g: usize) {
        if let Some(row) = self.row(slot, g) {
            prefetch(row);
        }
    }

    fn q8_rows(&self) -> Option<CodeRows<'_>> {
        (self.codes == Codes::Q8).then_some(*self)
    }
}

/// Asks the CPU to bring the cache lines of `row` into L2. A tile's rows lie wherever their
/// slots put them (a slot's neighbours in a pool are other sequences' tokens), where the
/// hardware's prefetchers find no stride to follow. Into L2, not L1: a tile's rows are more
/// lines than L1 can have in flight, and prefetches into L1 stalled on them (decode over 32k
/// tokens of f16 KV read at 0.56 of a copy's rate with them, 0.93 into L2; BENCHMARKS.md).
#[inline(always)]
fn prefetch<T>(row: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let (p, n) = (row.as_ptr().cast::<i8>(), std::mem::size_of_val(row));
        // Each line the row touches, once: from the line of its first byte.
        let first = p.wrapping_sub(p as usize % 64);
        let lines = (p as usize % 64 + n).div_ceil(64);
        for line in 0..lines {
            // SAFETY: a prefetch reads nothing the program sees and never faults; its
            // addresses lie in lines that hold bytes of `row`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(first.wrapping_add(64 * line)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// A block's scale, by F16C's conversion where `simd` has it (the same value as [`scale`]'s;
/// the portable conversion is a call, once per block of every row of a tile).
#[inline(always)]
fn scale_of(block: &[u8], simd: Simd) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd.avx2() {
        // SAFETY: `simd` names the AVX2 build (or a wider one), which has F16C.
        return unsafe { scale_f16c(block) };
    }
    let _ = simd;
    scale(block)
}

/// [`scale`] by F16C.
///
/// # Safety
/// The CPU has F16C.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "f16c")]
unsafe fn scale_f16c(block: &[u8]) -> f32 {
    use std::arch::x86_64::*;
    let bits = i32::from(u16::from_le_bytes([block[0], block[1]]));
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
}

/// A row of `q8_0` blocks widened into `dst` in order, 16 values a register: the same correctly
/// rounded products `d · q` as the portable loop.
///
/// # Safety
/// The CPU has AVX-512 F and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn widen_q8_avx512(row: &[u8], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let blocks = row.chunks_exact(Codes::Q8.block_bytes());
    for (block, out) in blocks.zip(dst.chunks_exact_mut(QK)) {
        // SAFETY: F16C, as this function's contract.
        let d = _mm512_set1_ps(unsafe { scale_f16c(block) });
        for (codes, out) in block[2..].chunks_exact(16).zip(out.chunks_exact_mut(16)) {
            // SAFETY: `codes` holds 16 bytes and `out` 16 floats.
            unsafe {
                let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(codes.as_ptr().cast()));
                let x = _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
                _mm512_storeu_ps(out.as_mut_ptr(), x);
            }
        }
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
