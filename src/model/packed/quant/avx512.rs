//! AVX-512 VNNI: one `vpdpbusd` per 64-byte group of 16 columns × 4 codes and row.

use std::arch::x86_64::*;

use super::{Bits, Factors, Out, QuantRows, QuantWeights, Spot, FP4, GROUP, NR, QK, SUPER};

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
    let supers = blocks / SUPER;
    let bytes = w.bits.block_bytes();
    let low = _mm512_set1_epi8(0x0F);
    let bias = _mm512_set1_epi8(i8::MIN);
    // SAFETY: `FP4` is 16 bytes.
    let fp4 = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(FP4.as_ptr().cast()) });
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
                        let mut lo = [low; P];
                        let mut hi = [low; P];
                        for j in 0..P {
                            let v = _mm512_loadu_si512(codes(j).add(c * GROUP).cast());
                            lo[j] = _mm512_and_si512(v, low);
                            hi[j] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                            match bits {
                                Bits::Four => {}
                                Bits::Fp4 => {
                                    lo[j] = _mm512_shuffle_epi8(fp4, lo[j]);
                                    hi[j] = _mm512_shuffle_epi8(fp4, hi[j]);
                                }
                                _ => {
                                    lo[j] = _mm512_or_si512(lo[j], high_bits(codes(j), bits, c));
                                    hi[j] =
                                        _mm512_or_si512(hi[j], high_bits(codes(j), bits, c + 4));
                                }
                            }
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
                let at = ((spot.panel + j) * blocks + b) * NR;
                let sb = ((spot.panel + j) * supers + b / SUPER) * NR;
                let (dv, mv) = match &w.factors {
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
                        let ints = |v: &[u8]| {
                            let b = _mm_loadu_si128(v.as_ptr().add(at).cast());
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))
                        };
                        (
                            _mm512_mul_ps(_mm512_loadu_ps(d.as_ptr().add(sb)), ints(sc)),
                            _mm512_mul_ps(_mm512_loadu_ps(m.as_ptr().add(sb)), ints(mn)),
                        )
                    }
                    Factors::Halves { d, sc } => {
                        let dv = _mm512_loadu_ps(d.as_ptr().add(sb));
                        let scale = |h: usize| {
                            let v = sc.as_ptr().add(2 * at + h * NR);
                            _mm512_cvtepi8_epi32(_mm_loadu_si128(v.cast()))
                        };
                        let (s0, s1) = (scale(0), scale(1));
                        for r in 0..R {
                            let rb = (spot.row + r) * blocks + b;
                            let c0 = _mm512_set1_epi32(*a.halves.get_unchecked(2 * rb));
                            let c1 = _mm512_set1_epi32(*a.halves.get_unchecked(2 * rb + 1));
                            let int = _mm512_add_epi32(
                                _mm512_mullo_epi32(s0, _mm512_sub_epi32(dot[r][j], c0)),
                                _mm512_mullo_epi32(s1, _mm512_sub_epi32(dot1[r][j], c1)),
                            );
                            let s = _mm512_set1_ps(*a.scales.get_unchecked(rb));
                            let f = _mm512_cvtepi32_ps(int);
                            acc[r][j] = _mm512_fmadd_ps(f, _mm512_mul_ps(dv, s), acc[r][j]);
                        }
                        continue;
                    }
                };
                for r in 0..R {
                    let rb = (spot.row + r) * blocks + b;
                    let s = _mm512_set1_ps(*a.scales.get_unchecked(rb));
                    let sa = _mm512_set1_ps(*a.scaled_sums.get_unchecked(rb));
                    let f = _mm512_cvtepi32_ps(dot[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(f, _mm512_mul_ps(dv, s), acc[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(mv, sa, acc[r][j]);
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
