//! AVX-512 VNNI: one `vpdpbusd` per 64-byte group of 16 columns × 4 codes and row.

use std::arch::x86_64::*;

use super::{Bits, Out, QuantRows, QuantWeights, Spot, GROUP, NR, QK};

/// # Safety
/// The CPU has AVX-512 F, BW and VNNI, and `super::in_bounds` holds for the arguments.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn kernel(w: &QuantWeights, a: &QuantRows, spot: Spot, o: Out, out: &mut [f32]) {
    // SAFETY: as this function's contract.
    unsafe { tile_shapes!(spot.rows, spot.panels, tile(w, a, spot, o, out)) }
}

/// `R` rows × `P` panels, every block; integer dots per block, f32 accumulators across blocks.
///
/// # Safety
/// As [`kernel`], with `R == spot.rows` and `P <= spot.panels`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const R: usize, const P: usize>(
    w: &QuantWeights,
    a: &QuantRows,
    spot: Spot,
    o: Out,
    out: &mut [f32],
) {
    let blocks = a.blocks();
    let bytes = w.bits.block_bytes();
    let low = _mm512_set1_epi8(0x0F);
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
            let mut dot = [[_mm512_setzero_si512(); P]; R];
            match w.bits {
                Bits::Four => {
                    for c in 0..4 {
                        let mut lo = [low; P];
                        let mut hi = [low; P];
                        for j in 0..P {
                            let v = _mm512_loadu_si512(codes(j).add(c * GROUP).cast());
                            lo[j] = _mm512_and_si512(v, low);
                            hi[j] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                        }
                        for (r, dot) in dot.iter_mut().enumerate() {
                            let (xl, xh) = (x_at(r, b, c), x_at(r, b, c + 4));
                            for j in 0..P {
                                dot[j] = _mm512_dpbusd_epi32(dot[j], lo[j], xl);
                                dot[j] = _mm512_dpbusd_epi32(dot[j], hi[j], xh);
                            }
                        }
                    }
                }
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
            }
            for j in 0..P {
                let at = ((spot.panel + j) * blocks + b) * NR;
                let d = _mm512_loadu_ps(w.scales.as_ptr().add(at));
                let m = _mm512_loadu_ps(w.offsets.as_ptr().add(at));
                for r in 0..R {
                    let rb = (spot.row + r) * blocks + b;
                    let s = _mm512_set1_ps(*a.scales.get_unchecked(rb));
                    let sa = _mm512_set1_ps(*a.scaled_sums.get_unchecked(rb));
                    let f = _mm512_cvtepi32_ps(dot[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, s), acc[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(m, sa, acc[r][j]);
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
