//! AVX2: `vpmaddubsw` per 32-byte half group (8 columns × 4 codes) and row, the two halves of a
//! panel one after the other.

use std::arch::x86_64::*;

use super::{
    prefetch_ahead, Bits, Factors, Out, QuantRows, QuantWeights, Spot, FP4, GROUP, NR, QK, SUPER,
};

kernel_entry!("avx2,fma,f16c", "AVX2, FMA and F16C");

/// Group `g`'s high code bits in the half block at `block`, moved above the nibbles.
///
/// # Safety
/// The CPU has AVX2; `block` starts a block of `bits` codes, or its second half.
#[target_feature(enable = "avx2")]
unsafe fn high_bits(block: *const u8, bits: Bits, g: usize) -> __m256i {
    let (plane, shift, mask) = bits.plane(g);
    // SAFETY: the plane lies inside the block (the caller's contract).
    let v = unsafe { _mm256_loadu_si256(block.add(plane).cast()) };
    // 16-bit shifts: the mask drops what crossed from the neighbouring byte.
    let moved = if shift <= 4 {
        _mm256_sll_epi16(v, _mm_cvtsi32_si128(4 - shift))
    } else {
        _mm256_srl_epi16(v, _mm_cvtsi32_si128(shift - 4))
    };
    _mm256_and_si256(moved, _mm256_set1_epi8(mask as i8))
}

/// `R` rows × `P` panels × 8 columns (half `h` of each panel), every block.
///
/// # Safety
/// As `kernel`, with `R == spot.rows`, `P <= spot.panels`, and `SPLIT` set for `Q6_K`'s
/// factors (the second half's dots kept apart; a constant, so the other formats hold no
/// registers for them).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const P: usize, const SPLIT: bool>(
    w: &QuantWeights,
    a: &QuantRows,
    spot: Spot,
    o: Out,
    out: &mut [f32],
) {
    let blocks = a.blocks();
    let supers = blocks / SUPER;
    let bytes = w.bits.block_bytes();
    let low = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: `FP4` is 16 bytes.
    let fp4 = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(FP4.as_ptr().cast()) });
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
                // The first half's pass brings each block's codes in for the second's.
                if h == 0 {
                    for j in 0..P {
                        prefetch_ahead(codes(j), bytes);
                    }
                }
                let mut dot = [[_mm256_setzero_si256(); P]; R];
                // The second 16 values' dots, kept apart where their scale differs (`Q6_K`).
                let mut dot1 = [[_mm256_setzero_si256(); P]; R];
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
                    Bits::Five | Bits::Six | Bits::Fp4 => {
                        // Pairs of up to 2 · 63 · 127 fit an i16 lane, two of them do not:
                        // each `vpmaddubsw` is widened at once.
                        for c in 0..4 {
                            let mut lo = [low; P];
                            let mut hi = [low; P];
                            for j in 0..P {
                                let v = _mm256_loadu_si256(codes(j).add(c * GROUP).cast());
                                lo[j] = _mm256_and_si256(v, low);
                                hi[j] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                                if w.bits == Bits::Fp4 {
                                    lo[j] = _mm256_shuffle_epi8(fp4, lo[j]);
                                    hi[j] = _mm256_shuffle_epi8(fp4, hi[j]);
                                } else {
                                    lo[j] = _mm256_or_si256(lo[j], high_bits(codes(j), w.bits, c));
                                    hi[j] =
                                        _mm256_or_si256(hi[j], high_bits(codes(j), w.bits, c + 4));
                                }
                            }
                            for r in 0..R {
                                let (xl, xh) = (x_at(r, b, c), x_at(r, b, c + 4));
                                for j in 0..P {
                                    let pl =
                                        _mm256_madd_epi16(_mm256_maddubs_epi16(lo[j], xl), ones);
                                    let ph =
                                        _mm256_madd_epi16(_mm256_maddubs_epi16(hi[j], xh), ones);
                                    dot[r][j] = _mm256_add_epi32(dot[r][j], pl);
                                    if SPLIT {
                                        dot1[r][j] = _mm256_add_epi32(dot1[r][j], ph);
                                    } else {
                                        dot[r][j] = _mm256_add_epi32(dot[r][j], ph);
                                    }
                                }
                            }
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
                    let sb = ((spot.panel + j) * supers + b / SUPER) * NR + 8 * h;
                    let (dv, mv) = match &w.factors {
                        Factors::Block { d, m } => (
                            _mm256_cvtph_ps(_mm_loadu_si128(d.as_ptr().add(at).cast())),
                            _mm256_cvtph_ps(_mm_loadu_si128(m.as_ptr().add(at).cast())),
                        ),
                        Factors::Exponent { e } => {
                            let b = _mm_loadl_epi64(e.as_ptr().add(at).cast());
                            let pow = _mm256_slli_epi32::<23>(_mm256_cvtepu8_epi32(b));
                            let dv = _mm256_mul_ps(_mm256_castsi256_ps(pow), _mm256_set1_ps(0.5));
                            (dv, _mm256_mul_ps(dv, _mm256_set1_ps(-12.0)))
                        }
                        Factors::Super { d, m, sc, mn } => {
                            let ints = |v: &[u8]| {
                                let b = _mm_loadl_epi64(v.as_ptr().add(at).cast());
                                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))
                            };
                            (
                                _mm256_mul_ps(_mm256_loadu_ps(d.as_ptr().add(sb)), ints(sc)),
                                _mm256_mul_ps(_mm256_loadu_ps(m.as_ptr().add(sb)), ints(mn)),
                            )
                        }
                        Factors::Halves { d, sc } => {
                            let dv = _mm256_loadu_ps(d.as_ptr().add(sb));
                            let first = 2 * (at - 8 * h) + 8 * h;
                            let scale = |half: usize| {
                                let v = sc.as_ptr().add(first + half * NR);
                                _mm256_cvtepi8_epi32(_mm_loadl_epi64(v.cast()))
                            };
                            let (s0, s1) = (scale(0), scale(1));
                            for r in 0..R {
                                let rb = (spot.row + r) * blocks + b;
                                let c0 = _mm256_set1_epi32(*a.halves.get_unchecked(2 * rb));
                                let c1 = _mm256_set1_epi32(*a.halves.get_unchecked(2 * rb + 1));
                                let int = _mm256_add_epi32(
                                    _mm256_mullo_epi32(s0, _mm256_sub_epi32(dot[r][j], c0)),
                                    _mm256_mullo_epi32(s1, _mm256_sub_epi32(dot1[r][j], c1)),
                                );
                                let s = _mm256_set1_ps(*a.scales.get_unchecked(rb));
                                let f = _mm256_cvtepi32_ps(int);
                                acc[r][j] = _mm256_fmadd_ps(f, _mm256_mul_ps(dv, s), acc[r][j]);
                            }
                            continue;
                        }
                    };
                    for r in 0..R {
                        let rb = (spot.row + r) * blocks + b;
                        let s = _mm256_set1_ps(*a.scales.get_unchecked(rb));
                        let sa = _mm256_set1_ps(*a.scaled_sums.get_unchecked(rb));
                        let f = _mm256_cvtepi32_ps(dot[r][j]);
                        acc[r][j] = _mm256_fmadd_ps(f, _mm256_mul_ps(dv, s), acc[r][j]);
                        acc[r][j] = _mm256_fmadd_ps(mv, sa, acc[r][j]);
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
