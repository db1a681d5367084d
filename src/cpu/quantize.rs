//! Values quantized to 8 bits per block of 32, as the integer kernels take them: the model's
//! activations (`model/packed/quant.rs`) and the attention op's queries over a pool of codes
//! (`attention/cpu/codes.rs`). Every path gives the same codes.

use super::Isa;

/// Values per block.
pub(crate) const QK: usize = 32;

/// Quantizes 32 values: returns the scale `max|x| / 127` and the codes' sum. The codes are
/// `round_ties_even(x · (127 / max|x|))`: the scalar and vector paths do the same exact
/// operations, so they give the same codes.
pub(crate) fn quantize_block(isa: Isa, x: &[f32; QK], codes: &mut [i8; QK]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let sum = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the x86-64 vector paths are only chosen when the CPU has AVX2 (`Isa::detect`).
        Isa::Avx2 | Isa::Avx512 | Isa::Amx => unsafe { avx2(x, inv, codes) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: every aarch64 CPU has NEON.
        Isa::Neon => unsafe { neon(x, inv, codes) },
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

/// Quantizes 32 values with `inv = 127 / max|x|` into `codes`; returns their sum.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2(x: &[f32; QK], inv: f32, codes: &mut [i8; QK]) -> i32 {
    use std::arch::x86_64::*;

    let scale = _mm256_set1_ps(inv);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    // SAFETY: `x` holds 32 floats and `codes` 32 bytes.
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

/// Quantizes 32 values with `inv = 127 / max|x|` into `codes`; returns their sum.
///
/// # Safety
/// The CPU has NEON (every aarch64 CPU does).
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn neon(x: &[f32; QK], inv: f32, codes: &mut [i8; QK]) -> i32 {
    use std::arch::aarch64::*;

    let scale = vdupq_n_f32(inv);
    let (lo, hi) = (vdupq_n_f32(-127.0), vdupq_n_f32(127.0));
    // SAFETY: `x` holds 32 floats and `codes` 32 bytes.
    unsafe {
        let q: [int32x4_t; 8] = std::array::from_fn(|i| {
            let v = vmulq_f32(vld1q_f32(x.as_ptr().add(4 * i)), scale);
            // `fcvtns` rounds to nearest, ties to even, as `round_ties_even`.
            vcvtnq_s32_f32(vminq_f32(vmaxq_f32(v, lo), hi))
        });
        let sum = q.iter().fold(vdupq_n_s32(0), |s, &v| vaddq_s32(s, v));
        for (i, q) in q.chunks_exact(4).enumerate() {
            let h0 = vcombine_s16(vqmovn_s32(q[0]), vqmovn_s32(q[1]));
            let h1 = vcombine_s16(vqmovn_s32(q[2]), vqmovn_s32(q[3]));
            let bytes = vcombine_s8(vqmovn_s16(h0), vqmovn_s16(h1));
            vst1q_s8(codes.as_mut_ptr().add(16 * i), bytes);
        }
        vaddvq_s32(sum)
    }
}
