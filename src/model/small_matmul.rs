//! Small-batch matmul with f16 weights on the CPU: `x · wᵀ` for `x: [m, k]` (f32) and
//! `w: [n, k]` (f16), `m <= MAX_ROWS`.
//!
//! Batched decode is bound by the bytes of weights read per step. f16 weights halve them, and
//! each weight row is converted to f32 once (F16C) and used by all `m` rows while it sits in
//! registers. candle's own f16 path converts the activations to f16 and runs an f16 GEMM that
//! is 3-4x slower than f32 from two rows on (`docs/BENCHMARKS.md`), so it only ever paid off
//! for a single row. Activations stay f32 here, so this is also more precise than that path.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use half::f16;
use rayon::prelude::*;

/// Largest `m` the op takes: one accumulator register per row.
pub(crate) const MAX_ROWS: usize = 8;

/// Output columns per parallel work item (enough to amortise rayon's dispatch).
const COLS_PER_ITEM: usize = 64;

/// `x · wᵀ` for `x: [m, k]` and f16 `w: [n, k]`, `m <= MAX_ROWS`: on the CPU the kernel of
/// this module, elsewhere candle's f16 matmul.
///
/// # Errors
/// [`crate::Error::Candle`] for other shapes or dtypes.
pub(crate) fn small_matmul_f16(x: &Tensor, w: &Tensor) -> crate::Result<Tensor> {
    if x.device().is_cpu() {
        Ok(x.to_dtype(DType::F32)?
            .contiguous()?
            .apply_op2_no_bwd(w, &SmallF16Matmul)?)
    } else {
        Ok(x.to_dtype(DType::F16)?
            .matmul(&w.t()?)?
            .to_dtype(x.dtype())?)
    }
}

/// The op as candle sees it.
struct SmallF16Matmul;

impl CustomOp2 for SmallF16Matmul {
    fn name(&self) -> &'static str {
        "pensieve-small-f16-matmul"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_l: &Layout,
        w: &CpuStorage,
        w_l: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(x), CpuStorage::F16(w)) = (x, w) else {
            candle_core::bail!("small f16 matmul takes f32 activations and f16 weights")
        };
        let (Some((xa, xb)), Some((wa, wb))) = (x_l.contiguous_offsets(), w_l.contiguous_offsets())
        else {
            candle_core::bail!("small f16 matmul takes contiguous inputs")
        };
        let (m, k) = x_l.shape().dims2()?;
        let (n, kw) = w_l.shape().dims2()?;
        if k != kw || m > MAX_ROWS {
            candle_core::bail!("small f16 matmul: x [{m}, {k}], w [{n}, {kw}]")
        }
        // No rows: a prefill chunk that needs no logits asks the output layer for none.
        if m == 0 {
            return Ok((CpuStorage::F32(Vec::new()), Shape::from((0, n))));
        }
        let (x, w) = (&x[xa..xb], &w[wa..wb]);
        // Work items own consecutive output columns, so compute `[n][m]` and transpose.
        let mut out_t = vec![0f32; n * m];
        out_t
            .par_chunks_mut(COLS_PER_ITEM * m)
            .enumerate()
            .for_each(|(item, chunk)| {
                let n0 = item * COLS_PER_ITEM;
                for (j, o) in chunk.chunks_exact_mut(m).enumerate() {
                    dot_rows(&w[(n0 + j) * k..][..k], x, o);
                }
            });
        let mut out = vec![0f32; m * n];
        for (j, col) in out_t.chunks_exact(m).enumerate() {
            for (r, &value) in col.iter().enumerate() {
                out[r * n + j] = value;
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((m, n))))
    }
}

/// `out[r] = w · x[r]` for the `out.len()` rows of `x` (each `w.len()` long).
fn dot_rows(w: &[f16], x: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the CPU has AVX2, FMA and F16C, checked just above; the callee only
            // reads inside `w` and `x`, whose lengths it checks.
            unsafe { avx2::dot_rows(w, x, out) };
            return;
        }
    }
    let k = w.len();
    for (r, o) in out.iter_mut().enumerate() {
        *o = w
            .iter()
            .zip(&x[r * k..(r + 1) * k])
            .map(|(a, b)| a.to_f32() * b)
            .sum();
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    /// Dispatches on the row count so each case keeps its accumulators in registers.
    /// `dot::<M>` reads `M` rows of `x` and writes `M` outputs, so `M` must equal `out.len()`
    /// and `x` must hold that many rows: checked here, where the reads happen, for every
    /// row count including none.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_rows(w: &[f16], x: &[f32], out: &mut [f32]) {
        let k = w.len();
        let m = out.len();
        if x.len() < m * k {
            return;
        }
        match m {
            1 => dot::<1>(w, x, out),
            2 => dot::<2>(w, x, out),
            3 => dot::<3>(w, x, out),
            4 => dot::<4>(w, x, out),
            5 => dot::<5>(w, x, out),
            6 => dot::<6>(w, x, out),
            7 => dot::<7>(w, x, out),
            8 => dot::<8>(w, x, out),
            // No rows (nothing to read) or more than MAX_ROWS (the caller refuses them).
            _ => {}
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot<const M: usize>(w: &[f16], x: &[f32], out: &mut [f32]) {
        let k = w.len();
        let body = k / 8 * 8;
        let mut acc = [_mm256_setzero_ps(); M];
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let mut t = 0;
        while t < body {
            // SAFETY: t + 8 <= body <= k, and x holds M rows of k values (checked by the
            // caller), so every load is in bounds.
            unsafe {
                let wv = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(t).cast::<__m128i>()));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(r * k + t)), *a);
                }
            }
            t += 8;
        }
        for (r, a) in acc.iter().enumerate() {
            let mut lanes = [0f32; 8];
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *a) };
            let tail: f32 = w[body..]
                .iter()
                .zip(&x[r * k + body..(r + 1) * k])
                .map(|(a, b)| a.to_f32() * b)
                .sum();
            out[r] = lanes.iter().sum::<f32>() + tail;
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;

    /// No rows: the vector kernel reads nothing (its guard sits beside the reads).
    #[test]
    fn no_rows_read_nothing() {
        let w = vec![f16::from_f32(1.0); 64];
        let mut out: [f32; 0] = [];
        dot_rows(&w, &[], &mut out);
    }

    /// Against candle's f32 matmul of the same (f16-rounded) weights, for every row count and
    /// a k that is not a multiple of 8.
    #[test]
    fn matches_f32_matmul() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for (m, k, n) in [
            (0, 64, 9),
            (1, 64, 3),
            (3, 37, 130),
            (8, 576, 200),
            (5, 1536, 65),
        ] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?.to_dtype(DType::F16)?;
            let ours = small_matmul_f16(&x, &w).map_err(candle_core::Error::wrap)?;
            let want = x.matmul(&w.to_dtype(DType::F32)?.t()?)?;
            assert_eq!(ours.dims(), [m, n]);
            if m == 0 {
                continue;
            }
            let diff = (ours - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-3 * (k as f32).sqrt(), "m={m} k={k} n={n}: {diff}");
        }
        Ok(())
    }
}
