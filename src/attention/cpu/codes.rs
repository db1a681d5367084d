//! Scores over a pool of `q8_0` codes in integers, as llama.cpp's CPU path scores a quantized K
//! cache: each query (turned and pre-scaled) quantized to 8 bits per block of 32 as the matmuls
//! quantize activations ([`crate::cpu::quantize_block`]: scale `s`, codes `a`), dotted against
//! the keys' codes `k` (scale `d` per block):
//! `score = Σ_b (Σ_i a_i k_i) · (s_b · d_b)`. The inner sums are exact integers on every path
//! (VNNI `vpdpbusd`, AVX2 `vpmaddubsw`, scalar); the outer one is a fused multiply-add per
//! block in block order from zero, each lane one key. Every build gives the same bits, and a
//! query's scores depend on nothing but the query and the key.
//!
//! Keys are never widened: a tile holds their codes as bytes, a quarter of the f32 tile the
//! scores read otherwise, laid out for the vector paths (a lane per key, 4 dimensions per lane).

use super::rows::CodeRows;
use super::tiles::Simd;
use super::{K_TILE, QG};
use crate::attention::codes::{scale, Codes};
use crate::cpu::{quantize_block, Isa, QK};

/// A block's queries in codes: query `i`'s codes `codes[i * d..][..d]`, its blocks' scales
/// and code sums `scales[i * nb + b]`, `sums[i * nb + b]` (`nb = d / 32`).
pub(super) struct QueryCodes {
    codes: Vec<i8>,
    scales: Vec<f32>,
    sums: Vec<i32>,
    d: usize,
}

impl QueryCodes {
    /// The queries `qv` (`[nq][d]`, pre-scaled, `d` whole blocks), quantized on `simd`'s path.
    pub(super) fn of(qv: &[f32], d: usize, simd: Simd) -> Self {
        let isa = match simd {
            Simd::None => Isa::Scalar,
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => Isa::Avx2,
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => Isa::Avx512,
        };
        let blocks = qv.len() / QK;
        let mut codes = vec![0i8; qv.len()];
        let (mut scales, mut sums) = (vec![0f32; blocks], vec![0i32; blocks]);
        let each = qv.chunks_exact(QK).zip(codes.chunks_exact_mut(QK));
        for ((x, c), (s, sum)) in each.zip(scales.iter_mut().zip(&mut sums)) {
            if let (Ok(x), Ok(c)) = (x.try_into(), c.try_into()) {
                (*s, *sum) = quantize_block(isa, x, c);
            }
        }
        Self {
            codes,
            scales,
            sums,
            d,
        }
    }

    /// Query `i`.
    pub(super) fn query(&self, i: usize) -> Query<'_> {
        let nb = self.d / QK;
        Query {
            codes: &self.codes[i * self.d..][..self.d],
            scales: &self.scales[i * nb..][..nb],
            sums: &self.sums[i * nb..][..nb],
        }
    }
}

/// One query of a [`QueryCodes`].
#[derive(Clone, Copy)]
pub(super) struct Query<'a> {
    codes: &'a [i8],
    scales: &'a [f32],
    /// Read by the VNNI path only (its bias on the keys' codes).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    sums: &'a [i32],
}

impl Query<'_> {
    /// Its codes of dimensions `4c..4c + 4` as one little-endian word (the vector paths'
    /// broadcast).
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn word(&self, c: usize) -> i32 {
        let q = &self.codes[4 * c..][..4];
        i32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8])
    }
}

/// A tile's keys in codes: dimensions `4c..4c + 4` of key `j` in the word `words[c * K_TILE +
/// j]` (little-endian bytes; so 16 keys' words are 64 consecutive bytes), block `b`'s scale of
/// key `j` at `scales[b * K_TILE + j]`.
pub(super) struct CodeTile {
    words: Vec<u32>,
    scales: Vec<f32>,
    d: usize,
}

impl CodeTile {
    /// A tile for heads of `d` values (whole blocks).
    pub(super) fn new(d: usize) -> Self {
        Self {
            words: vec![0; K_TILE * d / 4],
            scales: vec![0.0; K_TILE * d / QK],
            d,
        }
    }

    /// Loads head `g`'s rows of `slots` (at most [`K_TILE`]) from `pool` (of `q8_0` codes), a
    /// word of 4 codes at a time (a row outside the pool is left as it was); `simd`: the
    /// caller's build. Every build fills the tile with the same bits.
    #[inline(always)]
    pub(super) fn gather(&mut self, pool: &CodeRows<'_>, slots: &[u32], g: usize, simd: Simd) {
        #[cfg(target_arch = "x86_64")]
        if simd == Simd::Avx512 {
            // SAFETY: the AVX-512 build (F and F16C among its features).
            return unsafe { x86::gather_avx512(self, pool, slots, g) };
        }
        let _ = simd;
        for (j, &slot) in slots.iter().enumerate().take(K_TILE) {
            let Some(row) = pool.row(slot, g) else {
                continue;
            };
            for (b, block) in row.chunks_exact(Codes::Q8.block_bytes()).enumerate() {
                self.scales[b * K_TILE + j] = scale(block);
                let words = &mut self.words[b * QK / 4 * K_TILE..];
                for (w, x) in block[2..].chunks_exact(4).enumerate() {
                    words[w * K_TILE + j] = u32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                }
            }
        }
    }

    /// Key `j`'s codes of dimensions `4c..4c + 4`.
    fn codes(&self, c: usize, j: usize) -> [i8; 4] {
        self.words[c * K_TILE + j].to_le_bytes().map(|b| b as i8)
    }
}

/// `out[i][j] = qs[i] · key j` for the first `n` keys of `tile`, rounded up to a multiple of
/// 16 (the keys past `n` are scored too, and masked by the caller), as the module describes.
#[inline(always)]
pub(super) fn scores<const Q: usize>(
    qs: [Query<'_>; Q],
    tile: &CodeTile,
    n: usize,
    out: &mut [[f32; K_TILE]; QG],
    simd: Simd,
) {
    let n = n.div_ceil(16).min(K_TILE / 16) * 16;
    #[cfg(target_arch = "x86_64")]
    match simd {
        // SAFETY: the AVX-512 build (F, BW and VNNI: `Isa::Avx512`); `n` is a multiple of 16
        // within the tile.
        Simd::Avx512 => return unsafe { x86::scores_vnni(&qs, tile, n, out) },
        // SAFETY: the AVX2 build; `n` is a multiple of 8 within the tile.
        Simd::Avx2 => return unsafe { x86::scores_avx2(&qs, tile, n, out) },
        Simd::None => {}
    }
    let _ = simd;
    let nb = tile.d / QK;
    for (q, out) in qs.iter().zip(out.iter_mut()) {
        for (j, o) in out.iter_mut().enumerate().take(n) {
            let mut acc = 0f32;
            for b in 0..nb {
                let sum: i32 = (b * QK / 4..(b + 1) * QK / 4)
                    .flat_map(|c| {
                        let a = &q.codes[4 * c..][..4];
                        a.iter()
                            .zip(tile.codes(c, j))
                            .map(|(&a, k)| i32::from(a) * i32::from(k))
                    })
                    .sum();
                acc = (sum as f32).mul_add(q.scales[b] * tile.scales[b * K_TILE + j], acc);
            }
            *o = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{CodeRows, CodeTile, Query, K_TILE, QG, QK};
    use crate::attention::codes::Codes;

    /// [`CodeTile::gather`] 16 keys at a time: each word of a block (and its scale, the f16 in
    /// the low half of the word before the codes) gathered from the 16 rows by 64-bit offsets
    /// into the pool, stored where the tile keeps it (lanes of keys outside the pool or past
    /// `slots` neither read nor written).
    ///
    /// # Safety
    /// The CPU has AVX-512 F and F16C.
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn gather_avx512(
        tile: &mut CodeTile,
        pool: &CodeRows<'_>,
        slots: &[u32],
        g: usize,
    ) {
        let slots = &slots[..slots.len().min(K_TILE)];
        let base = pool.bytes().as_ptr();
        let block = Codes::Q8.block_bytes();
        for (j0, slots) in (0..).step_by(16).zip(slots.chunks(16)) {
            let (mut at, mut mask) = ([0i64; 16], 0u16);
            for (j, &slot) in slots.iter().enumerate() {
                if let Some(start) = pool.start(slot, g) {
                    at[j] = start as i64;
                    mask |= 1 << j;
                }
            }
            // SAFETY: every gathered lane (those `mask` keeps) reads 4 bytes at an offset of at
            // most `row_bytes - 4` into a row that `start` found within the pool; the stores
            // write 16 lanes at `j0 + (0..16)` of a row of `K_TILE` entries (`j0 + 16 <=
            // K_TILE`: `K_TILE` is a multiple of 16), masked likewise.
            unsafe {
                let (lo, hi) = (
                    _mm512_loadu_si512(at.as_ptr().cast()),
                    _mm512_loadu_si512(at.as_ptr().add(8).cast()),
                );
                let (mlo, mhi) = (mask as u8, (mask >> 8) as u8);
                let word = |offset: i64| {
                    let off = _mm512_set1_epi64(offset);
                    let zero = _mm256_setzero_si256();
                    let a = _mm512_mask_i64gather_epi32::<1>(
                        zero,
                        mlo,
                        _mm512_add_epi64(lo, off),
                        base.cast(),
                    );
                    let b = _mm512_mask_i64gather_epi32::<1>(
                        zero,
                        mhi,
                        _mm512_add_epi64(hi, off),
                        base.cast(),
                    );
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
                };
                for b in 0..tile.d / QK {
                    let first = (b * block) as i64;
                    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(word(first)));
                    let scales = tile.scales.as_mut_ptr().add(b * K_TILE + j0);
                    _mm512_mask_storeu_ps(scales, mask, d);
                    for w in 0..QK / 4 {
                        let words = tile.words.as_mut_ptr().add((b * QK / 4 + w) * K_TILE + j0);
                        let codes = word(first + 2 + 4 * w as i64);
                        _mm512_mask_storeu_epi32(words.cast(), mask, codes);
                    }
                }
            }
        }
    }

    /// [`super::scores`] with `vpdpbusd`, 16 keys a register. It multiplies unsigned bytes by
    /// signed ones: the keys' codes are taken as `k + 128` (their sign bit flipped) and
    /// `128 · Σ a` taken off each block's sum (the query's code sum: exact).
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VNNI, and FMA; `n % 16 == 0`, `n <= K_TILE`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    pub(super) unsafe fn scores_vnni<const Q: usize>(
        qs: &[Query<'_>; Q],
        tile: &CodeTile,
        n: usize,
        out: &mut [[f32; K_TILE]; QG],
    ) {
        let flip = _mm512_set1_epi8(i8::MIN);
        // SAFETY: loads of 16 words at `c * K_TILE + j0` (j0 + 16 <= K_TILE) and 16 scales at `b * K_TILE + j0`, within the tile; stores of 16 floats
        // at `j0` of each output row (the contract).
        unsafe {
            for j0 in (0..n).step_by(16) {
                let mut f = [_mm512_setzero_ps(); Q];
                for b in 0..tile.d / QK {
                    let mut acc = [_mm512_setzero_si512(); Q];
                    for c in b * QK / 4..(b + 1) * QK / 4 {
                        let k = _mm512_loadu_si512(tile.words.as_ptr().add(c * K_TILE + j0).cast());
                        let k = _mm512_xor_si512(k, flip);
                        for (acc, q) in acc.iter_mut().zip(qs) {
                            *acc = _mm512_dpbusd_epi32(*acc, k, _mm512_set1_epi32(q.word(c)));
                        }
                    }
                    let d = _mm512_loadu_ps(tile.scales.as_ptr().add(b * K_TILE + j0));
                    for ((f, acc), q) in f.iter_mut().zip(acc).zip(qs) {
                        let sum = _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * q.sums[b]));
                        let scale = _mm512_mul_ps(_mm512_set1_ps(q.scales[b]), d);
                        *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, *f);
                    }
                }
                for (f, out) in f.iter().zip(out.iter_mut()) {
                    _mm512_storeu_ps(out.as_mut_ptr().add(j0), *f);
                }
            }
        }
    }

    /// [`super::scores`] with `vpmaddubsw`, 8 keys a register: `|a|` (unsigned) times the
    /// keys' codes given `a`'s signs, pairs summed in 16 bits (at most 2 · 127² : no
    /// saturation), then in 32.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `n % 8 == 0`, `n <= K_TILE`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores_avx2<const Q: usize>(
        qs: &[Query<'_>; Q],
        tile: &CodeTile,
        n: usize,
        out: &mut [[f32; K_TILE]; QG],
    ) {
        let ones = _mm256_set1_epi16(1);
        // SAFETY: as `scores_vnni`, 8 keys (8 words, 8 scales, 8 floats) at a time.
        unsafe {
            for j0 in (0..n).step_by(8) {
                let mut f = [_mm256_setzero_ps(); Q];
                for b in 0..tile.d / QK {
                    let mut acc = [_mm256_setzero_si256(); Q];
                    for c in b * QK / 4..(b + 1) * QK / 4 {
                        let k = _mm256_loadu_si256(tile.words.as_ptr().add(c * K_TILE + j0).cast());
                        for (acc, q) in acc.iter_mut().zip(qs) {
                            let a = _mm256_set1_epi32(q.word(c));
                            let p =
                                _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(k, a));
                            *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(p, ones));
                        }
                    }
                    let d = _mm256_loadu_ps(tile.scales.as_ptr().add(b * K_TILE + j0));
                    for ((f, acc), q) in f.iter_mut().zip(acc).zip(qs) {
                        let scale = _mm256_mul_ps(_mm256_set1_ps(q.scales[b]), d);
                        *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), scale, *f);
                    }
                }
                for (f, out) in f.iter().zip(out.iter_mut()) {
                    _mm256_storeu_ps(out.as_mut_ptr().add(j0), *f);
                }
            }
        }
    }
}
