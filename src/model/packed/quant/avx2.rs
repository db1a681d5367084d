//! AVX2: `vpmaddubsw` per 32-byte half group (8 columns × 4 codes) and row, the two halves of a
//! panel one after the other.

use std::arch::x86_64::*;

use super::{Bits, Out, QuantRows, QuantWeights, Spot, GROUP, NR, QK};

/// Quantizes 32 values with `inv = 127 / max|x|` into `codes`; returns their sum.
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize(x: &[f32], inv: f32, codes: &mut [i8]) -> i32 {
    let (Some(x), Some(codes)) = (x.get(..QK), codes.get_mut(..QK)) else {
        return 0;
    };
    let scale = _mm256_set1_ps(inv);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    // SAFETY: `x` holds 32 floats and `codes` 32 bytes (checked above).
    unsafe {
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let v = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(8 * i)), scale);
            // Rounds to nearest even (the default MXCSR mode), as `round_ties_even`.
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi))
        });
        let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let sum = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256::<1>(sum),
        );
        let sum = _mm_hadd_epi32(sum, sum);
        let sum = _mm_cvtsi128_si32(_mm_hadd_epi32(sum, sum));
        // The packs interleave 128-bit lanes; the permutation puts the dwords back in order.
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(codes.as_mut_ptr().cast(), bytes);
        sum
    }
}

/// # Safety
/// The CPU has AVX2 and FMA, and `super::in_bounds` holds for the arguments.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn kernel(w: &QuantWeights, a: &QuantRows, spot: Spot, o: Out, out: &mut [f32]) {
    // SAFETY: as this function's contract.
    unsafe { tile_shapes!(spot.rows, spot.panels, tile(w, a, spot, o, out)) }
}

/// `R` rows × `P` panels × 8 columns (half `h` of each panel), every block.
///
/// # Safety
/// As [`kernel`], with `R == spot.rows`, `P <= spot.panels` and `h < 2`.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize, const P: usize>(
    w: &QuantWeights,
    a: &QuantRows,
    spot: Spot,
    o: Out,
    out: &mut [f32],
) {
    let blocks = a.blocks();
    let bytes = w.bits.block_bytes();
    let low = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: every pointer below indexes a panel in `spot.panel..+P`, a row in
    // `spot.row..+R` and a block below `blocks`, which `in_bounds` checked.
    unsafe {
        let x_at = |r: usize, b: usize, g: usize| {
            let p = a.codes.as_ptr().add((spot.row + r) * a.k + b * QK + 4 * g);
            _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
        };
        for h in 0..2 {
            let mut acc = [[_mm256_setzero_ps(); P]; R];
            for b in 0..blocks {
                let codes = |j: usize| {
                    let at = ((spot.panel + j) * blocks + b) * bytes + 32 * h;
                    w.codes.as_ptr().add(at)
                };
                let mut dot = [[_mm256_setzero_si256(); P]; R];
                match w.bits {
                    Bits::Four => {
                        // Each `vpmaddubsw` pair is at most 2 · 15 · 127; eight of them per
                        // block fit an i16 lane (30,480), so the widening happens once.
                        for c in 0..4 {
                            let mut lo = [low; P];
                            let mut hi = [low; P];
                            for j in 0..P {
                                let v = _mm256_loadu_si256(codes(j).add(c * GROUP).cast());
                                lo[j] = _mm256_and_si256(v, low);
                                hi[j] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                            }
                            for (r, dot) in dot.iter_mut().enumerate() {
                                let (xl, xh) = (x_at(r, b, c), x_at(r, b, c + 4));
                                for j in 0..P {
                                    let s = _mm256_add_epi16(
                                        _mm256_maddubs_epi16(lo[j], xl),
                                        _mm256_maddubs_epi16(hi[j], xh),
                                    );
                                    dot[j] = _mm256_add_epi16(dot[j], s);
                                }
                            }
                        }
                        for d in dot.iter_mut().flatten() {
                            *d = _mm256_madd_epi16(*d, ones);
                        }
                    }
                    Bits::Eight => {
                        // `vpmaddubsw` takes unsigned × signed: |q| × (a · sign q), each pair
                        // at most 2 · 128 · 127, inside an i16.
                        for g in 0..QK / 4 {
                            let mut q = [low; P];
                            let mut mag = [low; P];
                            for j in 0..P {
                                q[j] = _mm256_loadu_si256(codes(j).add(g * GROUP).cast());
                                mag[j] = _mm256_abs_epi8(q[j]);
                            }
                            for (r, dot) in dot.iter_mut().enumerate() {
                                let x = x_at(r, b, g);
                                for j in 0..P {
                                    let p = _mm256_maddubs_epi16(mag[j], _mm256_sign_epi8(x, q[j]));
                                    dot[j] = _mm256_add_epi32(dot[j], _mm256_madd_epi16(p, ones));
                                }
                            }
                        }
                    }
                }
                for j in 0..P {
                    let at = ((spot.panel + j) * blocks + b) * NR + 8 * h;
                    let d = _mm256_loadu_ps(w.scales.as_ptr().add(at));
                    let m = _mm256_loadu_ps(w.offsets.as_ptr().add(at));
                    for r in 0..R {
                        let rb = (spot.row + r) * blocks + b;
                        let s = _mm256_set1_ps(*a.scales.get_unchecked(rb));
                        let sa = _mm256_set1_ps(*a.scaled_sums.get_unchecked(rb));
                        let f = _mm256_cvtepi32_ps(dot[r][j]);
                        acc[r][j] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, s), acc[r][j]);
                        acc[r][j] = _mm256_fmadd_ps(m, sa, acc[r][j]);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (j, v) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.as_mut_ptr().add(o.index(j, r) + 8 * h), *v);
                }
            }
        }
    }
}
