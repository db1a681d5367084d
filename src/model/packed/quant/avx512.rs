//! AVX-512 VNNI: one `vpdpbusd` per 64-byte group of 16 columns × 4 codes and row.

use std::arch::x86_64::*;

use super::{
    prefetch_ahead, Bits, Factors, Out, QuantRows, QuantWeights, Spot, FP4, GROUP, NR, QK, SUPER,
};

kernel_entry!("avx512f,avx512bw,avx512vnni", "AVX-512 F, BW and VNNI");

/// Group `g`'s high code bits in the block at `block`, moved above the nibbles.
///
/// # Safety
/// The CPU has AVX-512 F and BW; `block` starts a block of `bits` codes.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn high_bits(block: *const u8, bits: Bits, g: usize) -> __m512i {
    let (plane, shift, mask) = bits.plane(g);
    // SAFETY: the plane lies inside the block (the caller's contract).
    let v = unsafe { _mm512_loadu_si512(block.add(plane).cast()) };
    // 16-bit shifts: the mask drops what crossed from the neighbouring byte.
    let moved = if shift <= 4 {
        _mm512_sll_epi16(v, _mm_cvtsi32_si128(4 - shift))
    } else {
        _mm512_srl_epi16(v, _mm_cvtsi32_si128(shift - 4))
    };
    _mm512_and_si512(moved, _mm512_set1_epi8(mask as i8))
}

/// Chunk `c` of the block at `block` as bytes: group `c`'s codes and group `c + 4`'s (the
/// low and high nibbles, with their high bits or read through [`FP4`]), 16 columns × 4 codes
/// each. Not for [`Bits::Eight`], whose groups are bytes already.
///
/// # Safety
/// The CPU has AVX-512 F and BW; `block` starts a block of `bits` codes; `c < 4`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) unsafe fn unpack(block: *const u8, bits: Bits, c: usize) -> (__m512i, __m512i) {
    let low = _mm512_set1_epi8(0x0F);
    // SAFETY: the chunk lies inside the block (the caller's contract).
    let v = unsafe { _mm512_loadu_si512(block.add(c * GROUP).cast()) };
    let lo = _mm512_and_si512(v, low);
    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
    match bits {
        Bits::Fp4 => {
            // SAFETY: `FP4` is 16 bytes.
            let fp4 = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(FP4.as_ptr().cast()) });
            (_mm512_shuffle_epi8(fp4, lo), _mm512_shuffle_epi8(fp4, hi))
        }
        Bits::Five | Bits::Six => {
            // SAFETY: as above.
            let (l, h) = unsafe { (high_bits(block, bits, c), high_bits(block, bits, c + 4)) };
            (_mm512_or_si512(lo, l), _mm512_or_si512(hi, h))
        }
        Bits::Four | Bits::Eight => (lo, hi),
    }
}

/// The factors `(d_b, m_b)` of block `b` of `panel`, one lane per column, for the forms with
/// factors per block (not [`Factors::Halves`], whose lanes are zero here).
///
/// # Safety
/// The CPU has AVX-512 F; the factors cover `panel` and `b` is below its block count.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn block_factors(w: &QuantWeights, panel: usize, b: usize) -> (__m512, __m512) {
    let blocks = w.k / QK;
    let at = (panel * blocks + b) * NR;
    // SAFETY: every index is inside the factor arrays (the caller's contract).
    unsafe {
        match &w.factors {
            Factors::Block { d, m } => (
                _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr().add(at).cast())),
                _mm512_cvtph_ps(_mm256_loadu_si256(m.as_ptr().add(at).cast())),
            ),
            Factors::Exponent { e } => {
                let b = _mm_loadu_si128(e.as_ptr().add(at).cast());
                let pow = _mm512_slli_epi32::<23>(_mm512_cvtepu8_epi32(b));
                let dv = _mm512_mul_ps(_mm512_castsi512_ps(pow), _mm512_set1_ps(0.5));
                (dv, _mm512_mul_ps(dv, _mm512_set1_ps(-12.0)))
            }
            Factors::Super { d, m, sc, mn } => {
                let sb = (panel * (blocks / SUPER) + b / SUPER) * NR;
                let ints = |v: &[u8]| {
                    let b = _mm_loadu_si128(v.as_ptr().add(at).cast());
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))
                };
                (
                    _mm512_mul_ps(_mm512_loadu_ps(d.as_ptr().add(sb)), ints(sc)),
                    _mm512_mul_ps(_mm512_loadu_ps(m.as_ptr().add(sb)), ints(mn)),
                )
            }
            Factors::Halves { .. } => (_mm512_setzero_ps(), _mm512_setzero_ps()),
        }
    }
}

/// `Q6_K`'s factors of block `b` of `panel`: the super-block's `D` and the two halves' 8-bit
/// scales (as f32, exact), one lane per column.
///
/// # Safety
/// As [`block_factors`], for [`Factors::Halves`] (zeros otherwise).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn halves(w: &QuantWeights, panel: usize, b: usize) -> (__m512, __m512, __m512) {
    let Factors::Halves { d, sc } = &w.factors else {
        return (
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
        );
    };
    let blocks = w.k / QK;
    let at = (panel * blocks + b) * NR;
    let sb = (panel * (blocks / SUPER) + b / SUPER) * NR;
    // SAFETY: every index is inside the factor arrays (the caller's contract).
    unsafe {
        let scale = |h: usize| {
            let v = sc.as_ptr().add(2 * at + h * NR);
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v.cast())))
        };
        (_mm512_loadu_ps(d.as_ptr().add(sb)), scale(0), scale(1))
    }
}

/// `acc` plus a block's term for one row (block `rb` of the activations) and 16 columns, with
/// factors per block: `dot · (d_b · s) + m_b · (s · Σ a)`, as the module's formula.
///
/// # Safety
/// The CPU has AVX-512 F; `rb` is inside the activations' blocks.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn add_block(
    acc: __m512,
    dot: __m512i,
    (dv, mv): (__m512, __m512),
    a: &QuantRows,
    rb: usize,
) -> __m512 {
    // SAFETY: `rb` is inside the arrays (the caller's contract).
    let (s, sa) = unsafe {
        (
            *a.scales.get_unchecked(rb),
            *a.scaled_sums.get_unchecked(rb),
        )
    };
    add_block_with(acc, dot, (dv, mv), s, sa)
}

/// [`add_block`] with the row's block factors given: its scale `s` and `s · Σ a`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn add_block_with(
    acc: __m512,
    dot: __m512i,
    (dv, mv): (__m512, __m512),
    s: f32,
    sa: f32,
) -> __m512 {
    let acc = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(dot),
        _mm512_mul_ps(dv, _mm512_set1_ps(s)),
        acc,
    );
    _mm512_fmadd_ps(mv, _mm512_set1_ps(sa), acc)
}

/// [`add_block`] for `Q6_K`: the two halves' dots, each less its centre and times its scale.
///
/// # Safety
/// As [`add_block`].
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn add_halves(
    acc: __m512,
    dot0: __m512i,
    dot1: __m512i,
    f: (__m512, __m512, __m512),
    a: &QuantRows,
    rb: usize,
) -> __m512 {
    // SAFETY: `rb` is inside the arrays (the caller's contract).
    let (c0, c1, s) = unsafe {
        (
            *a.halves.get_unchecked(2 * rb),
            *a.halves.get_unchecked(2 * rb + 1),
            *a.scales.get_unchecked(rb),
        )
    };
    let dot0 = _mm512_sub_epi32(dot0, _mm512_set1_epi32(c0));
    let dot1 = _mm512_sub_epi32(dot1, _mm512_set1_epi32(c1));
    add_centred(acc, dot0, dot1, f, s)
}

/// `acc` plus a `Q6_K` block's term for one row, from the halves' dots less their centres
/// (`Σ q a - 32 Σ a`): `(sc_0 dot_0 + sc_1 dot_1) · (D · s)`. The scaled sum is taken in f32,
/// where every product and sum is an integer below 2^24 (16 codes of at most 32 in size less
/// their centre, times 127, times a scale of at most 128, twice: 16,646,144), so it is exact,
/// as an integer sum would be, for two conversions and a multiply rather than two 32-bit
/// integer multiplies (two micro-operations each on Intel's cores) and a conversion.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn add_centred(
    acc: __m512,
    dot0: __m512i,
    dot1: __m512i,
    (dv, s0, s1): (__m512, __m512, __m512),
    s: f32,
) -> __m512 {
    let sum = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(dot0),
        s0,
        _mm512_mul_ps(_mm512_cvtepi32_ps(dot1), s1),
    );
    _mm512_fmadd_ps(sum, _mm512_mul_ps(dv, _mm512_set1_ps(s)), acc)
}

/// `R` rows × `P` panels, every block; integer dots per block, f32 accumulators across blocks.
///
/// # Safety
/// As `kernel`, with `R == spot.rows`, `P <= spot.panels`, and `SPLIT` set for `Q6_K`'s
/// factors (the second half's dots kept apart; a constant, so the other formats hold no
/// registers for them).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const R: usize, const P: usize, const SPLIT: bool>(
    w: &QuantWeights,
    a: &QuantRows,
    spot: Spot,
    o: Out,
    out: &mut [f32],
) {
    let blocks = a.blocks();
    let bytes = w.bits.block_bytes();
    let bias = _mm512_set1_epi8(i8::MIN);
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    // SAFETY: every pointer below indexes a panel in `spot.panel..+P`, a row in
    // `spot.row..+R` and a block below `blocks`, which `in_bounds` checked.
    unsafe {
        let x_at = |r: usize, b: usize, g: usize| {
            let p = a.codes.as_ptr().add((spot.row + r) * a.k + b * QK + 4 * g);
            _mm512_set1_epi32(p.cast::<i32>().read_unaligned())
        };
        for b in 0..blocks {
            let codes = |j: usize| {
                w.codes
                    .as_ptr()
                    .add(((spot.panel + j) * blocks + b) * bytes)
            };
            for j in 0..P {
                prefetch_ahead(codes(j), bytes);
            }
            let mut dot = [[_mm512_setzero_si512(); P]; R];
            // The second 16 values' dots, kept apart where their scale differs (`Q6_K`).
            let mut dot1 = [[_mm512_setzero_si512(); P]; R];
            match w.bits {
                Bits::Eight => {
                    // Signed codes biased to unsigned (`q + 128`, the operand order of
                    // `vpdpbusd`); the bias comes off below as `128 · Σ a`.
                    for g in 0..QK / 4 {
                        let mut u = [bias; P];
                        for (j, u) in u.iter_mut().enumerate() {
                            let v = _mm512_loadu_si512(codes(j).add(g * GROUP).cast());
                            *u = _mm512_xor_si512(v, bias);
                        }
                        for (r, dot) in dot.iter_mut().enumerate() {
                            let x = x_at(r, b, g);
                            for j in 0..P {
                                dot[j] = _mm512_dpbusd_epi32(dot[j], u[j], x);
                            }
                        }
                    }
                    for (r, dot) in dot.iter_mut().enumerate() {
                        let sum = *a.sums.get_unchecked((spot.row + r) * blocks + b);
                        let unbias = _mm512_set1_epi32(128 * sum);
                        for d in dot.iter_mut() {
                            *d = _mm512_sub_epi32(*d, unbias);
                        }
                    }
                }
                bits => {
                    for c in 0..4 {
                        let mut lo = [_mm512_setzero_si512(); P];
                        let mut hi = [_mm512_setzero_si512(); P];
                        for j in 0..P {
                            (lo[j], hi[j]) = unpack(codes(j), bits, c);
                        }
                        for r in 0..R {
                            let (xl, xh) = (x_at(r, b, c), x_at(r, b, c + 4));
                            for j in 0..P {
                                dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], lo[j], xl);
                                if SPLIT {
                                    dot1[r][j] = _mm512_dpbusd_epi32(dot1[r][j], hi[j], xh);
                                } else {
                                    dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], hi[j], xh);
                                }
                            }
                        }
                    }
                }
            }
            // Per block and panel: the factors' vectors, then per row the one or two fused
            // multiply-adds of the module's formulas.
            for j in 0..P {
                let rb = |r: usize| (spot.row + r) * blocks + b;
                if SPLIT {
                    let f = halves(w, spot.panel + j, b);
                    for r in 0..R {
                        acc[r][j] = add_halves(acc[r][j], dot[r][j], dot1[r][j], f, a, rb(r));
                    }
                } else {
                    let f = block_factors(w, spot.panel + j, b);
                    for r in 0..R {
                        acc[r][j] = add_block(acc[r][j], dot[r][j], f, a, rb(r));
                    }
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (j, v) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(o.index(j, r)), *v);
            }
        }
    }
}
