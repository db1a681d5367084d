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
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
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

/// Queries scored and accumulated together against a tile: every K and V row loaded from the
/// tile serves this many queries (register blocking).
pub(super) const QG: usize = 3;

/// Keys scored together: a quad of scores comes out of one reduction tree.
const KQ: usize = 4;

/// `out[i][j] = qs[i] · keys[j]` for the first `n` keys of a gathered tile
/// (`keys[j * d..][..d]`), rounded up to a multiple of 4. Every score takes one fixed order
/// whatever the tile, the batch or the queries scored beside it: eight lanes, lane `l` summing
/// dimensions `t ≡ l (mod 8)` in order, then the lanes pairwise
/// (`((0+1)+(2+3)) + ((4+5)+(6+7))`). `simd`: the caller runs with AVX2 and FMA.
#[inline(always)]
pub(super) fn scores<const Q: usize>(
    qs: [&[f32]; Q],
    keys: &[f32],
    n: usize,
    out: &mut [[f32; K_TILE]; QG],
    simd: bool,
) {
    let d = keys.len() / K_TILE;
    let quads = n.div_ceil(KQ).min(K_TILE / KQ);
    #[cfg(target_arch = "x86_64")]
    if simd && d.is_multiple_of(8) && qs.iter().all(|q| q.len() == d) {
        for b in 0..quads {
            // SAFETY: `simd` is only true inside the AVX2+FMA build; each query holds `d`
            // floats (checked above), `keys` the `K_TILE` rows of `d` (its length defines `d`),
            // and `b * KQ + KQ <= K_TILE`.
            unsafe { avx2::scores_quad(&qs, &keys[b * KQ * d..][..KQ * d], out, b * KQ) };
        }
        return;
    }
    let _ = simd;
    for (q, out) in qs.iter().zip(out.iter_mut()) {
        for (j, o) in out.iter_mut().enumerate().take(quads * KQ) {
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
}

/// `accs[i] += Σ_j ps[i][j] · values[j]` over the first `n` rows of a gathered tile, one
/// multiply-add per element and key in key order (a key every query gives weight 0 is skipped:
/// adding `0 · v` changes no bits). `simd`: the caller runs with AVX2 and FMA.
#[inline(always)]
pub(super) fn accumulate<const Q: usize>(
    ps: &[[f32; K_TILE]; QG],
    values: &[f32],
    n: usize,
    accs: [&mut [f32]; Q],
    simd: bool,
) {
    let d = values.len() / K_TILE;
    let n = n.min(K_TILE);
    #[cfg(target_arch = "x86_64")]
    if simd && d.is_multiple_of(8) && accs.iter().all(|a| a.len() == d) {
        // SAFETY: `simd` is only true inside the AVX2+FMA build; each accumulator holds `d`
        // floats (checked above) and `values` `K_TILE` rows of `d`.
        unsafe { avx2::accumulate(ps, values, n, accs) };
        return;
    }
    let _ = simd;
    let mut accs = accs;
    for j in 0..n {
        if ps.iter().take(Q).all(|p| p[j] == 0.0) {
            continue;
        }
        let v = &values[j * d..][..d];
        for (acc, p) in accs.iter_mut().zip(ps) {
            for (a, &x) in acc.iter_mut().zip(v) {
                *a = p[j].mul_add(x, *a);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{KQ, K_TILE, QG};

    /// Scores of `Q` queries against the `KQ` keys of `keys` (`KQ` rows of `d`), in the order
    /// [`super::scores`] describes, stored at `out[i][j0..j0 + KQ]`.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `d % 8 == 0`, every query holds `d` floats, `keys` `KQ * d`
    /// and `j0 + KQ <= K_TILE`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores_quad<const Q: usize>(
        qs: &[&[f32]; Q],
        keys: &[f32],
        out: &mut [[f32; K_TILE]; QG],
        j0: usize,
    ) {
        let d = keys.len() / KQ;
        // SAFETY: loads stay inside each query (d floats) and `keys` (KQ rows of d); the
        // stores write 4 floats of `out[i]` at `j0 + KQ <= K_TILE` (the contract).
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); KQ]; Q];
            for t in (0..d).step_by(8) {
                let q: [__m256; Q] =
                    std::array::from_fn(|i| _mm256_loadu_ps(qs[i].as_ptr().add(t)));
                for (j, key) in keys.chunks_exact(d).enumerate() {
                    let k = _mm256_loadu_ps(key.as_ptr().add(t));
                    for (acc, &q) in acc.iter_mut().zip(&q) {
                        acc[j] = _mm256_fmadd_ps(q, k, acc[j]);
                    }
                }
            }
            for (acc, out) in acc.iter().zip(out.iter_mut()) {
                // Lane pairs, then pairs of pairs ([(0+1)+(2+3)] of each key in the low half,
                // [(4+5)+(6+7)] in the high half), then the halves added.
                let h01 = _mm256_hadd_ps(acc[0], acc[1]);
                let h23 = _mm256_hadd_ps(acc[2], acc[3]);
                let h = _mm256_hadd_ps(h01, h23);
                let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
                _mm_storeu_ps(out.as_mut_ptr().add(j0), s);
            }
        }
    }

    /// [`super::accumulate`] with 32 dimensions of every query in registers at a time.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `d % 8 == 0`, every accumulator holds `d` floats, `values`
    /// `K_TILE * d` and `n <= K_TILE`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn accumulate<const Q: usize>(
        ps: &[[f32; K_TILE]; QG],
        values: &[f32],
        n: usize,
        mut accs: [&mut [f32]; Q],
    ) {
        let d = values.len() / K_TILE;
        // SAFETY: as this function's contract: chunks start below `d` and hold 8 floats.
        unsafe {
            let mut c0 = 0;
            while c0 < d {
                if d - c0 >= 32 {
                    chunks::<Q, 4>(ps, values, n, &mut accs, c0, d);
                    c0 += 32;
                } else {
                    chunks::<Q, 1>(ps, values, n, &mut accs, c0, d);
                    c0 += 8;
                }
            }
        }
    }

    /// Dimensions `c0..c0 + 8 * C` of every query.
    ///
    /// # Safety
    /// As [`accumulate`], with `c0 + 8 * C <= d`.
    #[inline(always)]
    unsafe fn chunks<const Q: usize, const C: usize>(
        ps: &[[f32; K_TILE]; QG],
        values: &[f32],
        n: usize,
        accs: &mut [&mut [f32]; Q],
        c0: usize,
        d: usize,
    ) {
        // SAFETY: as this function's contract; 8 floats at `c0 + 8c < d` of each accumulator
        // and of each value row.
        unsafe {
            let mut a: [[__m256; C]; Q] = std::array::from_fn(|i| {
                std::array::from_fn(|c| _mm256_loadu_ps(accs[i].as_ptr().add(c0 + 8 * c)))
            });
            for j in 0..n {
                if ps.iter().take(Q).all(|p| p[j] == 0.0) {
                    continue;
                }
                let row = values.as_ptr().add(j * d + c0);
                let p: [__m256; Q] = std::array::from_fn(|i| _mm256_set1_ps(ps[i][j]));
                for (c, v) in (0..C).map(|c| (c, _mm256_loadu_ps(row.add(8 * c)))) {
                    for (a, &p) in a.iter_mut().zip(&p) {
                        a[c] = _mm256_fmadd_ps(p, v, a[c]);
                    }
                }
            }
            for (a, acc) in a.iter().zip(accs.iter_mut()) {
                for (c, &a) in a.iter().enumerate() {
                    _mm256_storeu_ps(acc.as_mut_ptr().add(c0 + 8 * c), a);
                }
            }
        }
    }
}
