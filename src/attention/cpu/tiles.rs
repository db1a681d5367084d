//! One context tile of the pool loaded into f32 buffers (`[key][dim]`, from f32 or f16 pools;
//! an f16 → f32 conversion is exact), and the scores of a query against it.

use half::f16;

use super::K_TILE;

/// An element type the kernel reads KV pools of.
pub(crate) trait KvElem: Copy + Send + Sync + 'static {
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

/// The rows of one context tile for one kv head: row `j` is `d` values of `pool` at
/// `slots[j] * kv_row + off`.
pub(super) struct TileRows<'a, T> {
    pub pool: &'a [T],
    pub slots: &'a [u32],
    pub kv_row: usize,
    pub off: usize,
    pub d: usize,
}

impl<T: KvElem> TileRows<'_, T> {
    /// Row `j`, or `None` when its slot lies outside the pool.
    #[inline(always)]
    fn row(&self, j: usize) -> Option<&[T]> {
        let start = *self.slots.get(j)? as usize * self.kv_row + self.off;
        self.pool.get(start..start + self.d)
    }

    /// Fills `vt[j * d..][..d]` with row `j`, as f32.
    #[inline(always)]
    pub(super) fn gather_into(&self, vt: &mut [f32], simd: bool) {
        let d = self.d;
        for (j, dst) in vt.chunks_exact_mut(d).take(self.slots.len()).enumerate() {
            let Some(row) = self.row(j) else {
                continue;
            };
            #[cfg(target_arch = "x86_64")]
            if simd && d.is_multiple_of(8) {
                for (dst, src) in dst.chunks_exact_mut(8).zip(row.chunks_exact(8)) {
                    // SAFETY: `simd` is only true inside the AVX2+F16C build; `src` holds 8
                    // values and `dst` 8 floats.
                    unsafe {
                        let x = T::load8(src.as_ptr());
                        std::arch::x86_64::_mm256_storeu_ps(dst.as_mut_ptr(), x);
                    }
                }
                continue;
            }
            for (o, &x) in dst.iter_mut().zip(row) {
                *o = x.to_f32();
            }
        }
    }
}

/// `out[j] = q · keys[j]` for the first `n` keys of a gathered tile (`keys[j * d..][..d]`),
/// rounded up to a multiple of 8. Every score takes one fixed order whatever the tile or the
/// batch: eight lanes, lane `l` summing dimensions `t ≡ l (mod 8)` in order, then the lanes
/// pairwise (`((0+1)+(2+3)) + ((4+5)+(6+7))`). `simd`: the caller runs with AVX2 and FMA.
#[inline(always)]
pub(super) fn scores(q: &[f32], keys: &[f32], n: usize, out: &mut [f32; K_TILE], simd: bool) {
    let d = q.len();
    let blocks = n.div_ceil(8).min(K_TILE / 8);
    #[cfg(target_arch = "x86_64")]
    if simd && d.is_multiple_of(8) && keys.len() >= blocks * 8 * d {
        for (b, out) in out.chunks_exact_mut(8).take(blocks).enumerate() {
            // SAFETY: `simd` is only true inside the AVX2+FMA build; `keys` holds the 8 keys
            // of block `b` (checked above) and `out` 8 floats.
            unsafe { avx2::scores8(q, &keys[b * 8 * d..][..8 * d], out) };
        }
        return;
    }
    let _ = simd;
    for (j, o) in out.iter_mut().enumerate().take(blocks * 8) {
        let Some(key) = keys.get(j * d..(j + 1) * d) else {
            *o = 0.0;
            continue;
        };
        let mut lanes = [0f32; 8];
        for (t, (&a, &b)) in q.iter().zip(key).enumerate() {
            lanes[t % 8] = a.mul_add(b, lanes[t % 8]);
        }
        let l = lanes;
        *o = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Eight scores, in the order [`super::scores`] describes. `q.len() % 8 == 0`,
    /// `keys.len() == 8 * q.len()`, `out.len() == 8`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores8(q: &[f32], keys: &[f32], out: &mut [f32]) {
        let d = q.len();
        if keys.len() < 8 * d || out.len() < 8 {
            return;
        }
        // SAFETY: loads stay inside `q` (d floats) and `keys` (8 rows of d); the store writes
        // the 8 floats of `out` (all checked above).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 8];
            for t in (0..d).step_by(8) {
                let qv = _mm256_loadu_ps(q.as_ptr().add(t));
                for (j, a) in acc.iter_mut().enumerate() {
                    let kv = _mm256_loadu_ps(keys.as_ptr().add(j * d + t));
                    *a = _mm256_fmadd_ps(qv, kv, *a);
                }
            }
            // Lane pairs, then pairs of pairs: lanes [(0+1)+(2+3)] of each key in the low
            // half, [(4+5)+(6+7)] in the high half, then the halves added.
            let h01 = _mm256_hadd_ps(acc[0], acc[1]);
            let h23 = _mm256_hadd_ps(acc[2], acc[3]);
            let h45 = _mm256_hadd_ps(acc[4], acc[5]);
            let h67 = _mm256_hadd_ps(acc[6], acc[7]);
            let h0123 = _mm256_hadd_ps(h01, h23);
            let h4567 = _mm256_hadd_ps(h45, h67);
            let lo = _mm256_permute2f128_ps::<0x20>(h0123, h4567);
            let hi = _mm256_permute2f128_ps::<0x31>(h0123, h4567);
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(lo, hi));
        }
    }
}
