//! AMX-INT8 (Xeons from Sapphire Rapids on): a block's dots for 16 rows × 16 columns in one
//! `tdpbssd`, for the full 16-row tiles of a prefill; what is left of a chunk's rows (and
//! every decode step) runs on the AVX-512 kernel.
//!
//! A tile multiply sums the same integer products as `vpdpbusd` does, exactly, and the
//! factors are applied by the AVX-512 kernel's own arithmetic ([`add_block_with`],
//! [`add_centred`]), so this path gives the same bits as every other. `Q6_K`'s codes are
//! unpacked less their centre (`q - 32`, signed bytes, which `tdpbssd` multiplies as they are
//! and `vpdpbusd` cannot), so its dots need no subtraction.
//!
//! Tiles: `tmm0`/`tmm1` the dots (16 rows × 16 `i32`), `tmm2`/`tmm3` the activations' codes
//! (16 rows × 32 bytes), `tmm4`/`tmm5` the weights' codes as signed bytes (8 rows of 4 `k` ×
//! 16 columns: a panel's groups, as the packing lays them); one of each per block in flight.
//! `Q6_K`'s two halves of a block take `tmm0`-`tmm5` (16 bytes of activations, 4 rows of
//! weights each), with `tmm6`/`tmm7` the next block's dots.

use std::arch::asm;
use std::arch::x86_64::*;

use super::avx512::{add_block_with, add_centred, block_factors, halves, unpack};
use super::{Bits, Factors, Out, QuantRows, QuantWeights, Spot, GROUP, NR, QK};

/// Rows of one tile.
pub(super) const ROWS: usize = 16;

/// Bytes of one block of one panel as the multiply reads it: 8 groups of [`GROUP`] bytes.
const BLOCK: usize = QK * NR;

/// A tile configuration (palette 1), as `ldtilecfg` reads it.
#[repr(C, align(64))]
struct Config([u8; 64]);

impl Config {
    /// The module's tiles; `split`: the activations and weights of half a block each
    /// (`Q6_K`'s two scales), not of a whole one.
    fn new(split: bool) -> Self {
        let (a_bytes, w_rows) = if split { (16, 4) } else { (32, 8) };
        let dots = (4 * NR, ROWS);
        let tiles = [
            dots,
            dots,
            (a_bytes, ROWS),
            (a_bytes, ROWS),
            (GROUP, w_rows),
            (GROUP, w_rows),
            dots,
            dots,
        ];
        let mut c = [0u8; 64];
        c[0] = 1;
        for (t, &(bytes, rows)) in tiles.iter().enumerate() {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&(bytes as u16).to_le_bytes());
            c[48 + t] = rows as u8;
        }
        Config(c)
    }
}

/// A block's dots, as a tile stores them: `[row][column]`.
#[repr(C, align(64))]
struct Dots([i32; ROWS * NR]);

/// The spot's rows (a multiple of [`ROWS`]), every block, one panel at a time: a panel's codes
/// are unpacked to bytes once, then each tile of rows runs over them.
///
/// # Safety
/// `Isa::available` found the tiles usable, `super::in_bounds` holds for the arguments, and `spot.rows` is a
/// multiple of [`ROWS`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn kernel(w: &QuantWeights, a: &QuantRows, spot: Spot, o: Out, out: &mut [f32]) {
    let blocks = a.blocks();
    let split = matches!(w.factors, Factors::Halves { .. });
    let config = Config::new(split);
    // `Eight`'s codes are bytes already, laid out as the multiply reads them.
    let unpacked = if w.bits == Bits::Eight {
        0
    } else {
        blocks * BLOCK
    };
    let mut bytes = vec![0u8; unpacked];
    let factors = row_factors(a, spot.row, spot.rows);
    let centre = _mm512_set1_epi8(32);
    // SAFETY: the configuration is 64 bytes; the CPU has AMX and this process the state.
    unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
    for j in 0..spot.panels {
        let panel = spot.panel + j;
        // SAFETY: `in_bounds` covers the panel's blocks.
        let codes = unsafe { w.codes.as_ptr().add(panel * blocks * w.bits.block_bytes()) };
        let weights = if w.bits == Bits::Eight {
            codes
        } else {
            for (b, dst) in bytes.chunks_exact_mut(BLOCK).enumerate() {
                // SAFETY: block `b` of the panel is inside the codes; `dst` is 8 groups.
                unsafe {
                    let block = codes.add(b * w.bits.block_bytes());
                    for c in 0..4 {
                        let (lo, hi) = unpack(block, w.bits, c);
                        // `Q6_K`'s codes less their centre: the dots `add_centred` takes.
                        let (lo, hi) = if split {
                            (_mm512_sub_epi8(lo, centre), _mm512_sub_epi8(hi, centre))
                        } else {
                            (lo, hi)
                        };
                        _mm512_storeu_si512(dst.as_mut_ptr().add(c * GROUP).cast(), lo);
                        _mm512_storeu_si512(dst.as_mut_ptr().add((c + 4) * GROUP).cast(), hi);
                    }
                }
            }
            bytes.as_ptr()
        };
        for t in (0..spot.rows).step_by(ROWS) {
            let f = &factors[t * 2 * blocks..][..2 * ROWS * blocks];
            // SAFETY: as this function's contract; `weights` holds the panel's blocks.
            unsafe {
                if split {
                    tile::<true>(w, a, f, weights, panel, spot.row + t, o, j, t, out);
                } else {
                    tile::<false>(w, a, f, weights, panel, spot.row + t, o, j, t, out);
                }
            }
        }
    }
    // SAFETY: gives back the tile state (so a context switch need not save it).
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Starts a block's multiply (or half a block's, for `Q6_K`): zeroes dot tile `$c`, loads the
/// activations at `$xp` into `$x` and the weights at `$wp` into `$w`, multiplies.
macro_rules! start {
    ($c:literal, $x:literal, $w:literal, $xp:expr, $wp:expr, $k:expr) => {
        asm!(
            concat!("tilezero ", $c),
            concat!("tileloadd ", $x, ", [{x} + {k}*1]"),
            concat!("tileloadd ", $w, ", [{w} + {g}*1]"),
            concat!("tdpbssd ", $c, ", ", $x, ", ", $w),
            x = in(reg) $xp,
            w = in(reg) $wp,
            k = in(reg) $k,
            g = in(reg) GROUP,
            options(nostack, readonly),
        )
    };
}

/// Stores dot tile `$c` at `$d` (`[row][column]`).
macro_rules! store {
    ($c:literal, $d:expr) => {
        asm!(
            concat!("tilestored [{d} + {g}*1], ", $c),
            d = in(reg) $d,
            g = in(reg) GROUP,
            options(nostack),
        )
    };
}

/// One tile of rows `row..row + 16` and one panel, every block, into `out`'s rows `t..` of
/// panel `j`.
///
/// Three stages run at once, on alternating tiles and buffers: block `b + 1`'s multiply, block
/// `b`'s dots stored, and block `b - 1`'s factors applied from the dots stored the step
/// before (a load waits for a tile's store to land; this gives it a step to).
///
/// # Safety
/// As [`kernel`], with the tiles configured for `SPLIT`, and `weights` the panel's blocks as
/// bytes, [`BLOCK`] apart.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const SPLIT: bool>(
    w: &QuantWeights,
    a: &QuantRows,
    factors: &[f32],
    weights: *const u8,
    panel: usize,
    row: usize,
    o: Out,
    j: usize,
    t: usize,
    out: &mut [f32],
) {
    let blocks = a.blocks();
    let mut acc = [_mm512_setzero_ps(); ROWS];
    // `[set][half]`: a set per block in flight; `Q6_K`'s halves apart.
    let mut dots: [[Dots; 2]; 2] =
        std::array::from_fn(|_| [Dots([0; ROWS * NR]), Dots([0; ROWS * NR])]);
    // SAFETY: rows `row..+16` and every block are inside the activations, and the weights'
    // blocks inside `weights` (the caller's contract); `dots` are 1 KiB each.
    unsafe {
        let x = a.codes.as_ptr().add(row * a.k);
        let k = a.k;
        let begin = |b: usize| {
            let (xb, wb) = (x.add(b * QK), weights.add(b * BLOCK));
            // `Q6_K`: `k` 0..16 (groups 0-3) into one tile, 16..32 (groups 4-7) into another.
            let (xh, wh) = (xb.add(QK / 2), wb.add(4 * GROUP));
            match (SPLIT, b % 2) {
                (false, 0) => start!("tmm0", "tmm2", "tmm4", xb, wb, k),
                (false, _) => start!("tmm1", "tmm3", "tmm5", xb, wb, k),
                (true, 0) => {
                    start!("tmm0", "tmm2", "tmm4", xb, wb, k);
                    start!("tmm1", "tmm3", "tmm5", xh, wh, k);
                }
                (true, _) => {
                    start!("tmm6", "tmm2", "tmm4", xb, wb, k);
                    start!("tmm7", "tmm3", "tmm5", xh, wh, k);
                }
            }
        };
        let finish = |b: usize, dots: &mut [[Dots; 2]; 2]| {
            let [d0, d1] = &mut dots[b % 2];
            match (SPLIT, b % 2) {
                (false, 0) => store!("tmm0", d0.0.as_mut_ptr()),
                (false, _) => store!("tmm1", d0.0.as_mut_ptr()),
                (true, 0) => {
                    store!("tmm0", d0.0.as_mut_ptr());
                    store!("tmm1", d1.0.as_mut_ptr());
                }
                (true, _) => {
                    store!("tmm6", d0.0.as_mut_ptr());
                    store!("tmm7", d1.0.as_mut_ptr());
                }
            }
        };
        let dot = |d: &Dots, r: usize| _mm512_load_si512(d.0.as_ptr().add(r * NR).cast());
        let mut apply = |b: usize, dots: &[[Dots; 2]; 2]| {
            let [d0, d1] = &dots[b % 2];
            let (s, sa) = factors[b * 2 * ROWS..][..2 * ROWS].split_at(ROWS);
            if SPLIT {
                let f = halves(w, panel, b);
                for (r, acc) in acc.iter_mut().enumerate() {
                    *acc = add_centred(*acc, dot(d0, r), dot(d1, r), f, s[r]);
                }
            } else {
                let f = block_factors(w, panel, b);
                for (r, acc) in acc.iter_mut().enumerate() {
                    *acc = add_block_with(*acc, dot(d0, r), f, s[r], sa[r]);
                }
            }
        };
        if blocks > 0 {
            begin(0);
        }
        for b in 0..blocks {
            finish(b, &mut dots);
            if b + 1 < blocks {
                begin(b + 1);
            }
            if b > 0 {
                apply(b - 1, &dots);
            }
        }
        if blocks > 0 {
            apply(blocks - 1, &dots);
        }
        for (r, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(o.index(j, t + r)), *acc);
        }
    }
}

/// The activations' factors of rows `row0..row0 + rows`, tile by tile as [`tile`] reads them:
/// `[tile][block]`, the 16 rows' scales `s`, then their `s · Σ a`. In the activations' own
/// `[row][block]` order a tile's 16 rows lie `blocks` apart, and the compiler kept 16 row
/// pointers on the stack and reloaded one per row and block; here they are one base and
/// constant offsets (a `Q4_K` matmul took 0.80-0.84 of the time for it).
fn row_factors(a: &QuantRows, row0: usize, rows: usize) -> Vec<f32> {
    let blocks = a.blocks();
    let mut f = Vec::with_capacity(2 * rows * blocks);
    for t in (row0..row0 + rows).step_by(ROWS) {
        for b in 0..blocks {
            let rb = |r: usize| (t + r) * blocks + b;
            f.extend((0..ROWS).map(|r| a.scales[rb(r)]));
            f.extend((0..ROWS).map(|r| a.scaled_sums[rb(r)]));
        }
    }
    f
}
