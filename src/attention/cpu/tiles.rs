//! One context tile of the pool loaded into f32 buffers (`[key][dim]`, through the pool's
//! rows, `rows.rs`), and the scores of a query against it.

use super::rows::{HalfRows, KvRows};
use super::K_TILE;

/// The vector registers a build of the kernel enables. Every build gives the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Simd {
    /// None: the portable build.
    None,
    /// AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 F as well: 16 lanes.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Simd {
    /// Whether AVX2, FMA and F16C are enabled.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn avx2(self) -> bool {
        self != Simd::None
    }
}

/// The rows of one context tile for kv head `g`: row `j` is head `g`'s row of `slots[j]`.
pub(super) struct TileRows<'a, P> {
    pub pool: P,
    pub slots: &'a [u32],
    pub g: usize,
    pub d: usize,
}

impl<P: KvRows> TileRows<'_, P> {
    /// Fills `vt[j * d..][..d]` with row `j`, as f32 (a row outside the pool is left as is).
    #[inline(always)]
    pub(super) fn gather_into(&self, vt: &mut [f32], simd: Simd) {
        let d = self.d;
        for (dst, &slot) in vt.chunks_exact_mut(d).zip(self.slots) {
            self.pool.load(slot, self.g, dst, 8, simd);
        }
    }

    /// The keys for [`scores`]: as [`TileRows::gather_into`], except in the AVX-512 build
    /// (for `d` a multiple of 8), where keys `2p` and `2p + 1` are interleaved by 8
    /// dimensions: `kt[2pd + 16c..][..8]` holds key `2p`'s dimensions `8c..8c + 8` and the next
    /// 8 floats key `2p + 1`'s, so that one 16-lane register holds a chunk of two keys.
    #[inline(always)]
    pub(super) fn gather_keys_into(&self, kt: &mut [f32], simd: Simd) {
        #[cfg(target_arch = "x86_64")]
        if simd == Simd::Avx512 && self.d.is_multiple_of(8) {
            let d = self.d;
            for (j, &slot) in self.slots.iter().enumerate().take(K_TILE) {
                let pair = &mut kt[j / 2 * 2 * d..][..2 * d];
                // Chunk `c` lands at `16c + 8(j % 2)`, 8 floats, within the pair's `2d`.
                self.pool
                    .load(slot, self.g, &mut pair[j % 2 * 8..], 16, simd);
            }
            return;
        }
        self.gather_into(kt, simd);
    }
}

/// Where [`scores`] and [`accumulate`] read a tile's rows: the f32 tile a gather filled, or an
/// f16 pool's rows in place. An f16 → f32 conversion is exact, so both give every path the
/// same registers and every score and sum the same bits.
#[derive(Clone, Copy)]
pub(super) enum TileData<'a> {
    /// `[K_TILE][d]` f32 (keys as [`TileRows::gather_keys_into`] lays them out).
    Gathered(&'a [f32]),
    /// Row `j` of the tile is `rows[j]`, read only by the vector paths (built where
    /// [`Simd::avx2`] holds and `d` is a multiple of 8).
    Half(&'a HalfRows<'a>),
}

impl TileData<'_> {
    /// Dimension `t` of row `j` (`d` per row; keys in the portable layout).
    #[inline(always)]
    fn at(&self, j: usize, t: usize, d: usize) -> f32 {
        match self {
            TileData::Gathered(data) => data[j * d + t],
            TileData::Half(rows) => rows[j][t].to_f32(),
        }
    }
}

/// Queries scored and accumulated together against a tile: every K and V row loaded from the
/// tile serves this many queries (register blocking).
pub(super) const QG: usize = 3;

/// Keys scored together: a quad of scores comes out of one reduction tree.
const KQ: usize = 4;

/// `out[i][j] = qs[i] · keys[j]` for the first `n` keys of a tile, rounded up to a multiple
/// of 4. Every score takes one fixed order whatever the tile, the batch or the queries scored
/// beside it: eight lanes, lane `l` summing dimensions `t ≡ l (mod 8)` in order, then the
/// lanes pairwise (`((0+1)+(2+3)) + ((4+5)+(6+7))`). The AVX-512 build keeps each key's eight
/// lanes in one half of a 16-lane register (keys laid out by [`TileRows::gather_keys_into`],
/// or read in place in pairs) and scores up to 8 keys more (masked later).
#[inline(always)]
pub(super) fn scores<const Q: usize>(
    qs: [&[f32]; Q],
    keys: TileData<'_>,
    d: usize,
    n: usize,
    out: &mut [[f32; K_TILE]; QG],
    simd: Simd,
) {
    let quads = n.div_ceil(KQ).min(K_TILE / KQ);
    #[cfg(target_arch = "x86_64")]
    if simd.avx2() && d.is_multiple_of(8) && qs.iter().all(|q| q.len() == d) {
        match keys {
            TileData::Gathered(data) => {
                vector_scores(&qs, source::Gathered { data, d }, n, out, simd)
            }
            TileData::Half(rows) => vector_scores(&qs, source::Half(rows), n, out, simd),
        }
        return;
    }
    let _ = simd;
    for (q, out) in qs.iter().zip(out.iter_mut()) {
        for (j, o) in out.iter_mut().enumerate().take(quads * KQ) {
            let mut lanes = [0f32; 8];
            for (t, &a) in q.iter().enumerate() {
                lanes[t % 8] = a.mul_add(keys.at(j, t, d), lanes[t % 8]);
            }
            let l = lanes;
            *o = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
        }
    }
}

/// [`scores`] on the AVX2 (quads of keys) or AVX-512 (octets) path.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn vector_scores<const Q: usize, S: source::Source>(
    qs: &[&[f32]; Q],
    keys: S,
    n: usize,
    out: &mut [[f32; K_TILE]; QG],
    simd: Simd,
) {
    if simd == Simd::Avx512 {
        for b in 0..n.div_ceil(8).min(K_TILE / 8) {
            // SAFETY: the AVX-512 build; each query holds `d` floats, a multiple of 8, and
            // `keys` every row of the tile (the caller checked both), and `8b + 8 <= K_TILE`.
            unsafe { avx512::scores_oct(qs, keys, out, b * 8) };
        }
        return;
    }
    for b in 0..n.div_ceil(KQ).min(K_TILE / KQ) {
        // SAFETY: the AVX2+FMA+F16C build (`simd.avx2()`, the caller checked); each query
        // holds `d` floats, a multiple of 8, `keys` every row of the tile, and
        // `b * KQ + KQ <= K_TILE`.
        unsafe { avx2::scores_quad(qs, keys, out, b * KQ) };
    }
}

/// `accs[i] += Σ_j ps[i][j] · values[j]` over the first `n` rows of a tile, one
/// multiply-add per element and key in key order (a key every query gives weight 0 is skipped:
/// adding `0 · v` changes no bits). Each element's sum is its own, so the lanes' width
/// changes no bits either.
#[inline(always)]
pub(super) fn accumulate<const Q: usize>(
    ps: &[[f32; K_TILE]; QG],
    values: TileData<'_>,
    d: usize,
    n: usize,
    accs: [&mut [f32]; Q],
    simd: Simd,
) {
    let n = n.min(K_TILE);
    #[cfg(target_arch = "x86_64")]
    if accs.iter().all(|a| a.len() == d) && simd.avx2() && d.is_multiple_of(8) {
        match values {
            TileData::Gathered(data) => {
                vector_accumulate(ps, source::Gathered { data, d }, n, accs, simd)
            }
            TileData::Half(rows) => vector_accumulate(ps, source::Half(rows), n, accs, simd),
        }
        return;
    }
    let _ = simd;
    let mut accs = accs;
    for j in 0..n {
        if ps.iter().take(Q).all(|p| p[j] == 0.0) {
            continue;
        }
        for (acc, p) in accs.iter_mut().zip(ps) {
            for (t, a) in acc.iter_mut().enumerate() {
                *a = p[j].mul_add(values.at(j, t, d), *a);
            }
        }
    }
}

/// [`accumulate`] with 16 lanes where the build and `d` allow, 8 otherwise.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn vector_accumulate<const Q: usize, S: source::Source>(
    ps: &[[f32; K_TILE]; QG],
    values: S,
    n: usize,
    accs: [&mut [f32]; Q],
    simd: Simd,
) {
    use std::arch::x86_64::{__m256, __m512};
    let d = accs.first().map_or(0, |a| a.len());
    if simd == Simd::Avx512 && d.is_multiple_of(16) {
        // SAFETY: the AVX-512 build; each accumulator holds `d` floats, a multiple of the 16
        // lanes, and `values` every row of the tile (the caller checked).
        unsafe { vectors::accumulate::<__m512, Q, S>(ps, values, n, accs) };
        return;
    }
    // SAFETY: as above, in the AVX2+FMA+F16C build (or a wider one), with 8 lanes.
    unsafe { vectors::accumulate::<__m256, Q, S>(ps, values, n, accs) };
}

/// The vector paths' reads of a tile's rows ([`TileData`]'s two forms).
#[cfg(target_arch = "x86_64")]
mod source {
    use std::arch::x86_64::*;

    use super::HalfRows;

    /// A tile's rows as registers of f32.
    pub(super) trait Source: Copy {
        /// Dimensions `t..t + 8` of row `j`.
        ///
        /// # Safety
        /// The CPU has AVX2 and F16C; row `j` has them (in the portable layout).
        unsafe fn eight(self, j: usize, t: usize) -> __m256;

        /// Dimensions `t..t + 16` of row `j`.
        ///
        /// # Safety
        /// The CPU has AVX-512 F; row `j` has them (in the portable layout).
        unsafe fn sixteen(self, j: usize, t: usize) -> __m512;

        /// Dimensions `t..t + 8` of keys `2p` and `2p + 1`, in the low and high halves.
        ///
        /// # Safety
        /// The CPU has AVX-512 F; both keys have them (gathered: interleaved in pairs).
        unsafe fn pair(self, p: usize, t: usize) -> __m512;
    }

    /// A gathered tile, `[K_TILE][d]` f32.
    #[derive(Clone, Copy)]
    pub(super) struct Gathered<'a> {
        pub data: &'a [f32],
        pub d: usize,
    }

    impl Source for Gathered<'_> {
        #[inline(always)]
        unsafe fn eight(self, j: usize, t: usize) -> __m256 {
            // SAFETY: as the trait's contract.
            unsafe { _mm256_loadu_ps(self.data.as_ptr().add(j * self.d + t)) }
        }

        #[inline(always)]
        unsafe fn sixteen(self, j: usize, t: usize) -> __m512 {
            // SAFETY: as the trait's contract.
            unsafe { _mm512_loadu_ps(self.data.as_ptr().add(j * self.d + t)) }
        }

        #[inline(always)]
        unsafe fn pair(self, p: usize, t: usize) -> __m512 {
            // SAFETY: as the trait's contract; pair `p`'s chunk at `t` is 16 floats at
            // `2pd + 2t`.
            unsafe { _mm512_loadu_ps(self.data.as_ptr().add(p * 2 * self.d + 2 * t)) }
        }
    }

    /// An f16 pool's rows in place, widened as they are read.
    #[derive(Clone, Copy)]
    pub(super) struct Half<'a>(pub &'a HalfRows<'a>);

    impl Half<'_> {
        /// Eight halves of row `j` from `t`, as raw bits.
        ///
        /// # Safety
        /// Row `j` has dimensions `t..t + 8`.
        #[inline(always)]
        unsafe fn bits8(self, j: usize, t: usize) -> __m128i {
            // SAFETY: as this function's contract (16 bytes from `t`).
            unsafe { _mm_loadu_si128(self.0[j].as_ptr().add(t).cast()) }
        }
    }

    impl Source for Half<'_> {
        #[inline(always)]
        unsafe fn eight(self, j: usize, t: usize) -> __m256 {
            // SAFETY: as the trait's contract.
            unsafe { _mm256_cvtph_ps(self.bits8(j, t)) }
        }

        #[inline(always)]
        unsafe fn sixteen(self, j: usize, t: usize) -> __m512 {
            // SAFETY: as the trait's contract (32 bytes from `t`).
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(self.0[j].as_ptr().add(t).cast())) }
        }

        #[inline(always)]
        unsafe fn pair(self, p: usize, t: usize) -> __m512 {
            // SAFETY: as the trait's contract.
            unsafe {
                let (low, high) = (self.bits8(2 * p, t), self.bits8(2 * p + 1, t));
                _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(
                    _mm256_castsi128_si256(low),
                    high,
                ))
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::source::Source;
    use super::{KQ, K_TILE, QG};

    /// Scores of `Q` queries against keys `j0..j0 + KQ` of `keys`, in the order
    /// [`super::scores`] describes, stored at `out[i][j0..j0 + KQ]`.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `d % 8 == 0`, every query holds `d` floats, `keys`
    /// rows of `d` (in order) and `j0 + KQ <= K_TILE`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores_quad<const Q: usize, S: Source>(
        qs: &[&[f32]; Q],
        keys: S,
        out: &mut [[f32; K_TILE]; QG],
        j0: usize,
    ) {
        let d = qs[0].len();
        // SAFETY: loads stay inside each query (d floats) and the keys' rows (d each); the
        // stores write 4 floats of `out[i]` at `j0 + KQ <= K_TILE` (the contract).
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); KQ]; Q];
            for t in (0..d).step_by(8) {
                let q: [__m256; Q] =
                    std::array::from_fn(|i| _mm256_loadu_ps(qs[i].as_ptr().add(t)));
                for j in 0..KQ {
                    let k = keys.eight(j0 + j, t);
                    for (acc, &q) in acc.iter_mut().zip(&q) {
                        acc[j] = _mm256_fmadd_ps(q, k, acc[j]);
                    }
                }
            }
            for (&acc, out) in acc.iter().zip(out.iter_mut()) {
                _mm_storeu_ps(out.as_mut_ptr().add(j0), reduce_quad(acc));
            }
        }
    }

    /// Four keys' eight lanes each to their four scores: lane pairs, then pairs of pairs
    /// (`(0+1)+(2+3)` of each key in the low half, `(4+5)+(6+7)` in the high half), then the
    /// halves added.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[inline(always)]
    pub(super) unsafe fn reduce_quad(acc: [__m256; KQ]) -> __m128 {
        // SAFETY: register operations only, on AVX2 (the contract).
        unsafe {
            let h01 = _mm256_hadd_ps(acc[0], acc[1]);
            let h23 = _mm256_hadd_ps(acc[2], acc[3]);
            let h = _mm256_hadd_ps(h01, h23);
            _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::source::Source;
    use super::{K_TILE, QG};

    /// Scores of `Q` queries against keys `j0..j0 + 8` of `keys` (read in pairs), stored at
    /// `out[i][j0..j0 + 8]`: each half of a register is [`super::avx2::scores_quad`]'s
    /// register for one key, so each score takes the same operations in the same order.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, AVX2, FMA and F16C; `d % 8 == 0`, every query holds `d` floats,
    /// `keys` rows of `d`, `j0` is even and `j0 + 8 <= K_TILE`.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn scores_oct<const Q: usize, S: Source>(
        qs: &[&[f32]; Q],
        keys: S,
        out: &mut [[f32; K_TILE]; QG],
        j0: usize,
    ) {
        let d = qs[0].len();
        // SAFETY: loads stay inside each query (8 floats at `t < d`) and the keys' rows (pair
        // `j0 / 2 + p`'s chunk at `t < d`); the stores write 4 floats of `out[i]` at `j0` and
        // at `j0 + 4`, below `K_TILE` (the contract).
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 4]; Q];
            for t in (0..d).step_by(8) {
                let q: [__m512; Q] = std::array::from_fn(|i| {
                    let q = _mm256_castps_pd(_mm256_loadu_ps(qs[i].as_ptr().add(t)));
                    _mm512_castpd_ps(_mm512_broadcast_f64x4(q))
                });
                for p in 0..4 {
                    let k = keys.pair(j0 / 2 + p, t);
                    for (acc, &q) in acc.iter_mut().zip(&q) {
                        acc[p] = _mm512_fmadd_ps(q, k, acc[p]);
                    }
                }
            }
            let low = |z: __m512| _mm512_castps512_ps256(z);
            let high =
                |z: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(z)));
            for (a, out) in acc.iter().zip(out.iter_mut()) {
                let first = [low(a[0]), high(a[0]), low(a[1]), high(a[1])];
                let second = [low(a[2]), high(a[2]), low(a[3]), high(a[3])];
                _mm_storeu_ps(out.as_mut_ptr().add(j0), super::avx2::reduce_quad(first));
                _mm_storeu_ps(
                    out.as_mut_ptr().add(j0 + 4),
                    super::avx2::reduce_quad(second),
                );
            }
        }
    }
}

/// [`accumulate`]'s vector loop, for 8 lanes (AVX2) and 16 (AVX-512).
#[cfg(target_arch = "x86_64")]
mod vectors {
    use std::arch::x86_64::*;

    use super::source::Source;
    use super::{K_TILE, QG};

    /// One register of f32 lanes.
    pub(super) trait Lanes: Copy {
        const N: usize;
        /// # Safety
        /// The CPU has the register's instructions; `p` points at `N` readable floats.
        unsafe fn load(p: *const f32) -> Self;
        /// # Safety
        /// As [`Lanes::load`], writable.
        unsafe fn store(self, p: *mut f32);
        /// # Safety
        /// The CPU has the register's instructions.
        unsafe fn splat(x: f32) -> Self;
        /// Dimensions `t..t + N` of row `j` of `rows`.
        ///
        /// # Safety
        /// The CPU has the register's instructions (and F16C); the row has them.
        unsafe fn row<S: Source>(rows: S, j: usize, t: usize) -> Self;
        /// `a · b + self`, rounded once.
        ///
        /// # Safety
        /// The CPU has the register's instructions and FMA.
        unsafe fn fma(self, a: Self, b: Self) -> Self;
    }

    /// `Lanes` for a register type from its intrinsics.
    macro_rules! lanes {
        ($v:ty, $n:expr, $load:ident, $store:ident, $splat:ident, $fma:ident, $row:ident) => {
            impl Lanes for $v {
                const N: usize = $n;
                #[inline(always)]
                unsafe fn load(p: *const f32) -> Self {
                    // SAFETY: as the trait's contract.
                    unsafe { $load(p) }
                }
                #[inline(always)]
                unsafe fn store(self, p: *mut f32) {
                    // SAFETY: as the trait's contract.
                    unsafe { $store(p, self) }
                }
                #[inline(always)]
                unsafe fn splat(x: f32) -> Self {
                    // SAFETY: as the trait's contract.
                    unsafe { $splat(x) }
                }
                #[inline(always)]
                unsafe fn row<S: Source>(rows: S, j: usize, t: usize) -> Self {
                    // SAFETY: as the trait's contract.
                    unsafe { rows.$row(j, t) }
                }
                #[inline(always)]
                unsafe fn fma(self, a: Self, b: Self) -> Self {
                    // SAFETY: as the trait's contract.
                    unsafe { $fma(a, b, self) }
                }
            }
        };
    }

    lanes!(
        __m256,
        8,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        eight
    );
    lanes!(
        __m512,
        16,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        sixteen
    );

    /// [`super::accumulate`] with 4 registers of every query's dimensions held at a time.
    ///
    /// # Safety
    /// The CPU has `V`'s instructions, FMA and F16C; `d % V::N == 0`, every accumulator holds
    /// `d` floats, `values` `K_TILE` rows of `d` and `n <= K_TILE`.
    #[inline(always)]
    pub(super) unsafe fn accumulate<V: Lanes, const Q: usize, S: Source>(
        ps: &[[f32; K_TILE]; QG],
        values: S,
        n: usize,
        mut accs: [&mut [f32]; Q],
    ) {
        let d = accs.first().map_or(0, |a| a.len());
        // SAFETY: as this function's contract: chunks start below `d` and hold `V::N` floats.
        unsafe {
            let mut c0 = 0;
            while c0 < d {
                if d - c0 >= 4 * V::N {
                    chunks::<V, Q, 4, S>(ps, values, n, &mut accs, c0);
                    c0 += 4 * V::N;
                } else {
                    chunks::<V, Q, 1, S>(ps, values, n, &mut accs, c0);
                    c0 += V::N;
                }
            }
        }
    }

    /// Dimensions `c0..c0 + V::N * C` of every query.
    ///
    /// # Safety
    /// As [`accumulate`], with `c0 + V::N * C <= d`.
    #[inline(always)]
    unsafe fn chunks<V: Lanes, const Q: usize, const C: usize, S: Source>(
        ps: &[[f32; K_TILE]; QG],
        values: S,
        n: usize,
        accs: &mut [&mut [f32]; Q],
        c0: usize,
    ) {
        // SAFETY: as this function's contract; `V::N` floats at `c0 + V::N c < d` of each
        // accumulator and of each value row.
        unsafe {
            let mut a: [[V; C]; Q] = std::array::from_fn(|i| {
                std::array::from_fn(|c| V::load(accs[i].as_ptr().add(c0 + V::N * c)))
            });
            for j in 0..n {
                if ps.iter().take(Q).all(|p| p[j] == 0.0) {
                    continue;
                }
                let p: [V; Q] = std::array::from_fn(|i| V::splat(ps[i][j]));
                for (c, v) in (0..C).map(|c| (c, V::row(values, j, c0 + V::N * c))) {
                    for (a, &p) in a.iter_mut().zip(&p) {
                        a[c] = a[c].fma(p, v);
                    }
                }
            }
            for (a, acc) in a.iter().zip(accs.iter_mut()) {
                for (c, &a) in a.iter().enumerate() {
                    a.store(acc.as_mut_ptr().add(c0 + V::N * c));
                }
            }
        }
    }
}
