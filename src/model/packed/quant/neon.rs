//! NEON with the dot-product extension (Armv8.2 `sdot`: Apple M1 on, Graviton 2 on, Ampere):
//! one `sdot` per 16-byte quarter group (4 columns × 4 codes) and row, the four quarters of a
//! panel one after the other.
//!
//! `sdot` multiplies signed bytes by signed bytes, so every code width feeds it directly: the
//! unsigned 4-, 5- and 6-bit codes are below 64, and `Q8_0`'s codes are signed already.
//! Rust's `vdotq_s32` is not stable yet (`stdarch_neon_dotprod`), so the instruction is written
//! as inline assembly; everything else is `std::arch` intrinsics.

use std::arch::aarch64::*;
use std::arch::asm;

use half::f16;

use super::{Bits, Factors, Out, QuantRows, QuantWeights, Spot, FP4, GROUP, NR, QK, SUPER};

kernel_entry!("neon,dotprod", "NEON and the dot-product extension");

/// `acc + ` the dot of each 4-byte lane of `w` with the same lane of `x`, per lane.
///
/// # Safety
/// The CPU has the dot-product extension.
#[inline(always)]
unsafe fn sdot(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: `sdot` reads and writes registers only (the caller's contract for the CPU).
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {w:v}.16b, {x:v}.16b",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            x = in(vreg) x,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}

/// Group `g`'s high code bits in the quarter block at `block`, moved above the nibbles.
///
/// # Safety
/// `block` starts a block of `bits` codes, or one of its quarters.
#[target_feature(enable = "neon")]
unsafe fn high_bits(block: *const u8, bits: Bits, g: usize) -> uint8x16_t {
    let (plane, shift, mask) = bits.plane(g);
    // SAFETY: the plane lies inside the block (the caller's contract).
    let v = unsafe { vld1q_u8(block.add(plane)) };
    // Byte shifts (a negative count shifts right): nothing crosses from the neighbours.
    let moved = vshlq_u8(v, vdupq_n_s8((4 - shift) as i8));
    vandq_u8(moved, vdupq_n_u8(mask))
}

/// Four values of `v` from `at` on, as f32.
///
/// # Safety
/// `at + 4 <= v.len()`.
#[inline(always)]
unsafe fn load4<T: Copy>(v: &[T], at: usize, widen: impl Fn(T) -> f32) -> float32x4_t {
    // SAFETY: as this function's contract.
    let lanes: [f32; 4] = std::array::from_fn(|i| widen(unsafe { *v.get_unchecked(at + i) }));
    // SAFETY: `lanes` holds four floats.
    unsafe { vld1q_f32(lanes.as_ptr()) }
}

/// `R` rows × `P` panels × 4 columns (quarter `h` of each panel), every block.
///
/// # Safety
/// As `kernel`, with `R == spot.rows`, `P <= spot.panels`, and `SPLIT` set for `Q6_K`'s
/// factors (the second half's dots kept apart).
#[target_feature(enable = "neon,dotprod")]
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
    let low = vdupq_n_u8(0x0F);
    // SAFETY: `FP4` is 16 bytes.
    let fp4 = unsafe { vld1q_u8(FP4.as_ptr()) };
    // SAFETY: every pointer below indexes a panel in `spot.panel..+P`, a row in
    // `spot.row..+R` and a block below `blocks`, which `in_bounds` checked.
    unsafe {
        let x_at = |r: usize, b: usize, g: usize| {
            let p = a.codes.as_ptr().add((spot.row + r) * a.k + b * QK + 4 * g);
            vreinterpretq_s8_s32(vdupq_n_s32(p.cast::<i32>().read_unaligned()))
        };
        for h in 0..NR / 4 {
            let mut acc = [[vdupq_n_f32(0.0); P]; R];
            for b in 0..blocks {
                let codes = |j: usize| {
                    let at = ((spot.panel + j) * blocks + b) * bytes + 16 * h;
                    w.codes.as_ptr().add(at)
                };
                let mut dot = [[vdupq_n_s32(0); P]; R];
                // The second 16 values' dots, kept apart where their scale differs (`Q6_K`).
                let mut dot1 = [[vdupq_n_s32(0); P]; R];
                match w.bits {
                    Bits::Four | Bits::Five | Bits::Six | Bits::Fp4 => {
                        for c in 0..4 {
                            let mut lo = [vdupq_n_s8(0); P];
                            let mut hi = [vdupq_n_s8(0); P];
                            for j in 0..P {
                                let v = vld1q_u8(codes(j).add(c * GROUP));
                                let (mut l, mut u) = (vandq_u8(v, low), vshrq_n_u8::<4>(v));
                                match w.bits {
                                    Bits::Four => {}
                                    Bits::Fp4 => (l, u) = (vqtbl1q_u8(fp4, l), vqtbl1q_u8(fp4, u)),
                                    _ => {
                                        l = vorrq_u8(l, high_bits(codes(j), w.bits, c));
                                        u = vorrq_u8(u, high_bits(codes(j), w.bits, c + 4));
                                    }
                                }
                                lo[j] = vreinterpretq_s8_u8(l);
                                hi[j] = vreinterpretq_s8_u8(u);
                            }
                            for r in 0..R {
                                let (xl, xh) = (x_at(r, b, c), x_at(r, b, c + 4));
                                for j in 0..P {
                                    dot[r][j] = sdot(dot[r][j], lo[j], xl);
                                    if SPLIT {
                                        dot1[r][j] = sdot(dot1[r][j], hi[j], xh);
                                    } else {
                                        dot[r][j] = sdot(dot[r][j], hi[j], xh);
                                    }
                                }
                            }
                        }
                    }
                    Bits::Eight => {
                        for g in 0..QK / 4 {
                            let q: [int8x16_t; P] =
                                std::array::from_fn(|j| vld1q_s8(codes(j).add(g * GROUP).cast()));
                            for (r, dot) in dot.iter_mut().enumerate() {
                                let x = x_at(r, b, g);
                                for j in 0..P {
                                    dot[j] = sdot(dot[j], q[j], x);
                                }
                            }
                        }
                    }
                }
                for j in 0..P {
                    let at = ((spot.panel + j) * blocks + b) * NR + 4 * h;
                    let sb = ((spot.panel + j) * supers + b / SUPER) * NR + 4 * h;
                    let (dv, mv) = match &w.factors {
                        Factors::Block { d, m } => {
                            (load4(d, at, f16::to_f32), load4(m, at, f16::to_f32))
                        }
                        Factors::Exponent { e } => {
                            let b: [u32; 4] =
                                std::array::from_fn(|i| u32::from(*e.get_unchecked(at + i)) << 23);
                            let pow = vreinterpretq_f32_u32(vld1q_u32(b.as_ptr()));
                            let dv = vmulq_n_f32(pow, 0.5);
                            (dv, vmulq_n_f32(dv, -12.0))
                        }
                        Factors::Super { d, m, sc, mn } => (
                            vmulq_f32(vld1q_f32(d.as_ptr().add(sb)), load4(sc, at, f32::from)),
                            vmulq_f32(vld1q_f32(m.as_ptr().add(sb)), load4(mn, at, f32::from)),
                        ),
                        Factors::Halves { d, sc } => {
                            let dv = vld1q_f32(d.as_ptr().add(sb));
                            let first = 2 * (at - 4 * h) + 4 * h;
                            let scale = |half: usize| {
                                let s: [i32; 4] = std::array::from_fn(|i| {
                                    i32::from(*sc.get_unchecked(first + half * NR + i))
                                });
                                vld1q_s32(s.as_ptr())
                            };
                            let (s0, s1) = (scale(0), scale(1));
                            for r in 0..R {
                                let rb = (spot.row + r) * blocks + b;
                                let c0 = vdupq_n_s32(*a.halves.get_unchecked(2 * rb));
                                let c1 = vdupq_n_s32(*a.halves.get_unchecked(2 * rb + 1));
                                let int = vaddq_s32(
                                    vmulq_s32(s0, vsubq_s32(dot[r][j], c0)),
                                    vmulq_s32(s1, vsubq_s32(dot1[r][j], c1)),
                                );
                                let s = vdupq_n_f32(*a.scales.get_unchecked(rb));
                                let f = vcvtq_f32_s32(int);
                                acc[r][j] = vfmaq_f32(acc[r][j], f, vmulq_f32(dv, s));
                            }
                            continue;
                        }
                    };
                    for r in 0..R {
                        let rb = (spot.row + r) * blocks + b;
                        let s = vdupq_n_f32(*a.scales.get_unchecked(rb));
                        let sa = vdupq_n_f32(*a.scaled_sums.get_unchecked(rb));
                        let f = vcvtq_f32_s32(dot[r][j]);
                        acc[r][j] = vfmaq_f32(acc[r][j], f, vmulq_f32(dv, s));
                        acc[r][j] = vfmaq_f32(acc[r][j], mv, sa);
                    }
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                for (j, v) in acc.iter().enumerate() {
                    vst1q_f32(out.as_mut_ptr().add(o.index(j, r) + 4 * h), *v);
                }
            }
        }
    }
}
