//! The CPU kernel's builds against each other, bit for bit.

use half::f16;

use super::{Block, Dims, KvElem, SequenceView, Simd};

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
/// 7 prefill rows (21 queries: full and partial query groups) over 150 slots in shuffled
/// blocks of 5 with a partial last tile, for head dims on and off the vector paths' chunk sizes (256:
/// Gemma 3's), with and without a sliding window.
fn paths_agree<T: KvElem>(convert: fn(f32) -> T) {
    let cases = [256, 64, 40, 12]
        .into_iter()
        .flat_map(|d| [(d, u32::MAX), (d, 40)]);
    for (d, window) in cases {
        let (n_heads, n_kv_heads, ctx, rows) = (6, 2, 150, 7);
        let blocks: Vec<u32> = (0..30).map(|i| (i * 7) % 30).collect();
        let q_positions: Vec<u32> = (ctx as u32 - rows as u32..ctx as u32).collect();
        let q = values(rows * n_heads * d, 1);
        let kv = |seed| -> Vec<T> {
            values(ctx * n_kv_heads * d, seed)
                .into_iter()
                .map(convert)
                .collect()
        };
        let (k, v) = (kv(2), kv(3));
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
            k: &k,
            v: &v,
            g: 1,
            dims: Dims {
                tokens: rows,
                n_heads,
                n_kv_heads,
                head_dim: d,
                n_slots: ctx,
            },
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
                "{isa:?}, head dim {d}, window {window}"
            );
        }
    }
}

#[test]
fn every_build_gives_the_same_bits_f32() {
    paths_agree::<f32>(|x| x);
}

#[test]
fn every_build_gives_the_same_bits_f16() {
    paths_agree::<f16>(f16::from_f32);
}
