//! The CPU kernel's builds against each other, bit for bit.

use half::f16;

use super::rows::{CodeRows, KvElem, KvRows, Values};
use super::{Block, Dims, SequenceView, Simd};
use crate::attention::codes::Codes;

/// Deterministic values in [-1, 1).
fn values(n: usize, mut state: u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

#[cfg(target_arch = "x86_64")]
fn bits(p: &super::Partial) -> Vec<u32> {
    p.acc
        .iter()
        .chain(&p.m)
        .chain(&p.l)
        .map(|x| x.to_bits())
        .collect()
}

/// Every build of the block kernel this CPU can run against the portable one, bit for bit:
/// 7 prefill rows (21 queries: full and partial query groups) and one decode row (3 queries,
/// read from the pool in place) over 150 slots in shuffled blocks of 5 with a partial last
/// tile, for head dims on and off the vector paths' chunk sizes (256: Gemma 3's), with and
/// without a sliding window. `pools` stores the keys and values as the kind of pool under test
/// and runs `agree` on them (a head dim it cannot store is skipped).
fn paths_agree(pools: fn(&Case, Vec<f32>, Vec<f32>)) {
    let cases = [256, 64, 40, 12]
        .into_iter()
        .flat_map(|d| [(d, u32::MAX), (d, 40)])
        .flat_map(|(d, window)| [(d, window, 7), (d, window, 1)]);
    for (d, window, rows) in cases {
        let case = Case { d, window, rows };
        let (kv, ctx) = (case.dims().n_kv_heads, 150);
        pools(&case, values(ctx * kv * d, 2), values(ctx * kv * d, 3));
    }
}

/// One shape of [`paths_agree`].
struct Case {
    d: usize,
    window: u32,
    /// Query rows (the last positions of the context).
    rows: usize,
}

impl Case {
    fn dims(&self) -> Dims {
        Dims {
            tokens: self.rows,
            n_heads: 6,
            n_kv_heads: 2,
            head_dim: self.d,
            n_slots: 150,
            codes: None,
        }
    }

    fn agree<P: KvRows>(&self, k: P, v: P) {
        let (d, window, dims) = (self.d, self.window, self.dims());
        let (ctx, rows) = (dims.n_slots, dims.tokens);
        let blocks: Vec<u32> = (0..30).map(|i| (i * 7) % 30).collect();
        let q_positions: Vec<u32> = (ctx as u32 - rows as u32..ctx as u32).collect();
        let q = values(rows * dims.n_heads * d, 1);
        let block = Block {
            q_rows: &q,
            q_positions: &q_positions,
            context: SequenceView {
                first_row: 0,
                q_positions: &q_positions,
                blocks: &blocks,
                block_size: 5,
                ctx_len: ctx,
            },
            tiles: 0..ctx.div_ceil(super::K_TILE),
            k,
            v,
            g: 1,
            dims,
            scale: 0.125,
            window,
        };
        let portable = block.body(Simd::None);
        assert!(portable.l.iter().all(|&l| l > 0.0));
        #[cfg(target_arch = "x86_64")]
        for isa in crate::cpu::Isa::available() {
            use crate::cpu::Isa;
            // SAFETY: the CPU has every feature of each path `available` lists.
            let simd = match isa {
                Isa::Avx2 => unsafe { block.body_avx2() },
                Isa::Avx512 => unsafe { block.body_avx512() },
                Isa::Scalar | Isa::Amx => continue,
            };
            assert_eq!(
                bits(&portable),
                bits(&simd),
                "{isa:?}, head dim {d}, window {window}, {rows} rows"
            );
        }
    }
}

fn as_values<T: KvElem>(case: &Case, k: Vec<f32>, v: Vec<f32>, convert: fn(f32) -> T) {
    let (k, v): (Vec<T>, Vec<T>) = (
        k.into_iter().map(convert).collect(),
        v.into_iter().map(convert).collect(),
    );
    case.agree(Values::of(&k, case.dims()), Values::of(&v, case.dims()));
}

#[test]
fn every_build_gives_the_same_bits_f32() {
    paths_agree(|case, k, v| as_values(case, k, v, |x| x));
}

#[test]
fn every_build_gives_the_same_bits_f16() {
    paths_agree(|case, k, v| as_values(case, k, v, f16::from_f32));
}

fn as_codes(case: &Case, k: Vec<f32>, v: Vec<f32>, codes: Codes) {
    if !Codes::fits(case.d) {
        return;
    }
    let quantized = |x: Vec<f32>| {
        let mut out = Vec::new();
        codes.quantize(&x, &mut out);
        out
    };
    let (k, v) = (quantized(k), quantized(v));
    let dims = case.dims();
    case.agree(CodeRows::of(&k, codes, dims), CodeRows::of(&v, codes, dims));
}

#[test]
fn every_build_gives_the_same_bits_q8() {
    paths_agree(|case, k, v| as_codes(case, k, v, Codes::Q8));
}

#[test]
fn every_build_gives_the_same_bits_q4() {
    paths_agree(|case, k, v| as_codes(case, k, v, Codes::Q4));
}
