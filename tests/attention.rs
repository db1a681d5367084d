//! The attention op's fast paths equal the naive reference over random batches: shapes, GQA
//! ratios, slot permutations, disjoint query runs in one sequence, decode and prefill mixed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use candle_core::{DType, Device, Tensor};
use pensieve::attention::{
    attention, attention_gather, attention_in_window, attention_reference, AttentionBatch,
};
use proptest::prelude::*;

/// One generated sequence: its context length and which of its positions are queried.
#[derive(Clone, Debug)]
struct SeqCase {
    ctx_len: usize,
    /// Queried positions: either the last token (decode), a trailing run (prefill), or a
    /// leading run plus a trailing run (recompute of dropped tokens plus the new prompt).
    queries: Vec<u32>,
}

fn seq_case() -> impl Strategy<Value = SeqCase> {
    (1usize..200, 0usize..3, any::<u64>()).prop_map(|(ctx_len, kind, r)| {
        let n = ctx_len as u32;
        let queries = match kind {
            0 => vec![n - 1],
            1 => {
                let run = 1 + (r as u32 % n);
                (n - run..n).collect()
            }
            _ => {
                let lead = (r as u32 % n).min(n - 1);
                let tail_start = lead + (r as u32 >> 8) % (n - lead);
                (0..lead).chain(tail_start..n).collect()
            }
        };
        SeqCase { ctx_len, queries }
    })
}

#[derive(Clone, Debug)]
struct Case {
    n_kv_heads: usize,
    group: usize,
    head_dim: usize,
    seqs: Vec<SeqCase>,
    seed: u64,
    /// A sliding window (Gemma 3's local layers), or the whole causal context.
    window: Option<u32>,
}

fn window() -> impl Strategy<Value = Option<u32>> {
    prop_oneof![Just(None), (1u32..80).prop_map(Some)]
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..4,
        prop_oneof![Just(1usize), Just(2), Just(3), Just(4)],
        prop_oneof![Just(8usize), Just(64), Just(20), Just(128), Just(256)],
        prop::collection::vec(seq_case(), 1..6),
        any::<u64>(),
        window(),
    )
        .prop_map(|(n_kv_heads, group, head_dim, seqs, seed, window)| Case {
            n_kv_heads,
            group,
            head_dim,
            seqs,
            seed,
            window,
        })
}

/// Tiny deterministic generator so that tensors follow the proptest seed.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// Builds q, pools and batch; every sequence's context lives in a shuffled set of slots.
fn build(c: &Case) -> (Tensor, Tensor, Tensor, AttentionBatch) {
    let total_ctx: usize = c.seqs.iter().map(|s| s.ctx_len).sum();
    let n_slots = total_ctx + 7;
    // A seeded permutation of the pool's slots hands out non-contiguous slots.
    let mut slots: Vec<u32> = (0..n_slots as u32).collect();
    let keys = values(n_slots, c.seed ^ 0xabc);
    slots.sort_by(|a, b| keys[*a as usize].total_cmp(&keys[*b as usize]));
    let mut next = 0;
    let mut batch = AttentionBatch::new();
    for s in &c.seqs {
        let ctx_slots = &slots[next..next + s.ctx_len];
        next += s.ctx_len;
        // Context listed in a scrambled order too: the rule is positional, not by index.
        let mut order: Vec<u32> = (0..s.ctx_len as u32).collect();
        order.reverse();
        let ctx_positions: Vec<u32> = order.clone();
        let ctx_slots: Vec<u32> = order.iter().map(|&p| ctx_slots[p as usize]).collect();
        batch
            .push_sequence(&s.queries, &ctx_slots, &ctx_positions)
            .unwrap();
    }
    let n_heads = c.n_kv_heads * c.group;
    let t = batch.num_queries();
    let dev = Device::Cpu;
    let q = Tensor::from_vec(
        values(t * n_heads * c.head_dim, c.seed),
        (t, n_heads, c.head_dim),
        &dev,
    )
    .unwrap();
    let kv_shape = (n_slots, c.n_kv_heads, c.head_dim);
    let k = Tensor::from_vec(
        values(n_slots * c.n_kv_heads * c.head_dim, c.seed ^ 1),
        kv_shape,
        &dev,
    )
    .unwrap();
    let v = Tensor::from_vec(
        values(n_slots * c.n_kv_heads * c.head_dim, c.seed ^ 2),
        kv_shape,
        &dev,
    )
    .unwrap();
    (q, k, v, batch)
}

/// Outputs are weighted means of values in [-2, 2]; one near zero is a cancellation whose
/// absolute f32 rounding (about 1e-6 over a few hundred keys) says nothing about the kernel, so
/// relative error is floored at this magnitude. A wrong mask, slot or scale moves outputs by
/// 1e-2 or more.
const REL_FLOOR: f32 = 0.1;

fn max_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(REL_FLOOR))
        .fold(0.0, f32::max)
}

/// The fast CPU kernel's error against the reference, with the pools stored as `dtype` (the
/// reference reads the same stored values widened to f32).
fn fast_error(c: &Case, dtype: DType) -> f32 {
    let (q, k, v, batch) = build(c);
    let (k, v) = (k.to_dtype(dtype).unwrap(), v.to_dtype(dtype).unwrap());
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let reference = attention_reference(&q, &k, &v, &batch, scale, c.window).unwrap();
    let fast = attention_in_window(&q, &k, &v, &batch, scale, c.window).unwrap();
    max_rel_err(&fast, &reference)
}

/// The fast CPU kernel's tolerance against the f64 reference (relative, floored at `REL_FLOOR`).
const FAST_TOL: f32 = 1e-4;
/// The gather path sums through candle's blocked f32 GEMM and a separate softmax; its error
/// against the f64 reference reaches a few 1e-4 on peaky score rows.
const GATHER_TOL: f32 = 1e-3;

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn fast_cpu_equals_reference(c in case()) {
        let err = fast_error(&c, DType::F32);
        prop_assert!(err < FAST_TOL, "err {}", err);
    }

    #[test]
    fn fast_cpu_reads_f16_pools(c in case()) {
        // The pools as the engine keeps them by default.
        let err = fast_error(&c, DType::F16);
        prop_assert!(err < FAST_TOL, "err {}", err);
    }

    #[test]
    fn gather_equals_reference(c in case()) {
        let (q, k, v, batch) = build(&c);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let reference = attention_reference(&q, &k, &v, &batch, scale, c.window).unwrap();
        let gathered = attention_gather(&q, &k, &v, &batch, scale, c.window).unwrap();
        let err = max_rel_err(&gathered, &reference);
        prop_assert!(err < GATHER_TOL, "err {}", err);
    }
}

fn long_case() -> impl Strategy<Value = Case> {
    // Contexts of several segments (512 entries each): decode rows, prefill runs, recompute.
    let seq = (500usize..1400, 0usize..3, any::<u64>()).prop_map(|(ctx_len, kind, r)| {
        let n = ctx_len as u32;
        let queries = match kind {
            0 => vec![n - 1],
            1 => (n - 1 - r as u32 % 40..n).collect(),
            _ => (0..3).chain(n - 5..n).collect(),
        };
        SeqCase { ctx_len, queries }
    });
    // Gemma 3's 512-position window over contexts past it, among others.
    let window = prop_oneof![Just(None), Just(Some(512)), (1u32..1400).prop_map(Some)];
    (prop::collection::vec(seq, 1..3), any::<u64>(), window).prop_map(|(seqs, seed, window)| Case {
        n_kv_heads: 2,
        group: 3,
        head_dim: 64,
        seqs,
        seed,
        window,
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn long_contexts_merge_their_segments(c in long_case()) {
        let err = fast_error(&c, DType::F16);
        prop_assert!(err < FAST_TOL, "err {}", err);
    }
}

#[test]
fn a_query_is_bit_identical_alone_and_in_a_prefill_block() {
    // Position 1199 of a 1,200-entry context (three segments): as a decode row alone, and as
    // the last row of a 40-row prefill run beside another sequence.
    let (k_len, d, heads, kv_heads) = (1200usize, 64usize, 6usize, 2usize);
    let slots: Vec<u32> = (0..k_len as u32).rev().collect();
    let positions: Vec<u32> = (0..k_len as u32).collect();
    let kv = |seed| {
        let t = Tensor::from_vec(
            values(k_len * kv_heads * d, seed),
            (k_len, kv_heads, d),
            &Device::Cpu,
        );
        t.unwrap().to_dtype(DType::F16).unwrap()
    };
    let (k, v) = (kv(11), kv(12));
    let q_all = values(41 * heads * d, 13);
    let last = &q_all[40 * heads * d..];
    let scale = 0.125;

    let mut alone = AttentionBatch::new();
    alone.push_sequence(&[1199], &slots, &positions).unwrap();
    let q = Tensor::from_vec(last.to_vec(), (1, heads, d), &Device::Cpu).unwrap();
    let one = attention(&q, &k, &v, &alone, scale).unwrap();

    let mut mixed = AttentionBatch::new();
    mixed
        .push_sequence(&[5], &slots[..6], &positions[..6])
        .unwrap();
    let run: Vec<u32> = (1160..1200).collect();
    mixed.push_sequence(&run, &slots, &positions).unwrap();
    let q = Tensor::from_vec(q_all, (41, heads, d), &Device::Cpu).unwrap();
    let many = attention(&q, &k, &v, &mixed, scale).unwrap();
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    assert_eq!(bits(&one), bits(&many.narrow(0, 40, 1).unwrap()));
}

#[test]
fn future_context_is_invisible() {
    // Changing K/V at positions after every query must not change the output; changing a
    // visible one must.
    let c = Case {
        n_kv_heads: 1,
        group: 3,
        head_dim: 8,
        seqs: vec![SeqCase {
            ctx_len: 50,
            queries: vec![10, 11, 12],
        }],
        seed: 7,
        window: None,
    };
    let (q, k, v, batch) = build(&c);
    let a = attention(&q, &k, &v, &batch, 0.3).unwrap();
    let seq = batch.sequences().next().unwrap();
    let perturb = |pool: &Tensor, visible: bool| {
        let mut rows = pool.to_vec3::<f32>().unwrap();
        for (&slot, &pos) in seq.ctx_slots.iter().zip(seq.ctx_positions) {
            if (pos <= 12) == visible {
                rows[slot as usize]
                    .iter_mut()
                    .flatten()
                    .for_each(|x| *x += 1.5);
            }
        }
        Tensor::new(rows, &Device::Cpu).unwrap()
    };
    let hidden = attention(&q, &perturb(&k, false), &perturb(&v, false), &batch, 0.3).unwrap();
    assert_eq!(max_rel_err(&hidden, &a), 0.0);
    let shown = attention(&q, &perturb(&k, true), &perturb(&v, true), &batch, 0.3).unwrap();
    assert!(max_rel_err(&shown, &a) > 1e-3);
}

#[test]
fn out_of_pool_slot_is_a_typed_error() {
    let q = Tensor::zeros((1, 2, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
    let k = Tensor::zeros((4, 1, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
    let mut batch = AttentionBatch::new();
    batch.push_sequence(&[0], &[9], &[0]).unwrap();
    assert!(matches!(
        attention(&q, &k, &k, &batch, 1.0),
        Err(pensieve::Error::InvalidBatch(_))
    ));
}

#[test]
fn odd_head_dim_is_a_typed_error() {
    let q = Tensor::zeros((1, 2, 5), candle_core::DType::F32, &Device::Cpu).unwrap();
    let k = Tensor::zeros((4, 1, 5), candle_core::DType::F32, &Device::Cpu).unwrap();
    let mut batch = AttentionBatch::new();
    batch.push_sequence(&[0], &[0], &[0]).unwrap();
    assert!(matches!(
        attention(&q, &k, &k, &batch, 1.0),
        Err(pensieve::Error::UnsupportedHeadDim { head_dim: 5 })
    ));
}

/// The CUDA op's error against the reference, the pools stored as `dtype` on the GPU and the
/// reference reading the same stored values; `None` without a GPU.
#[cfg(feature = "cuda")]
fn cuda_error(c: &Case, dtype: DType) -> Option<f32> {
    let gpu = common::cuda_device("CUDA attention tests")?;
    let (q, k, v, batch) = build(c);
    let (k, v) = (k.to_dtype(dtype).unwrap(), v.to_dtype(dtype).unwrap());
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let reference = attention_reference(&q, &k, &v, &batch, scale, None).unwrap();
    let on_gpu = |t: &Tensor| t.to_device(&gpu).unwrap();
    let out = attention(&on_gpu(&q), &on_gpu(&k), &on_gpu(&v), &batch, scale).unwrap();
    Some(max_rel_err(
        &out.to_device(&Device::Cpu).unwrap(),
        &reference,
    ))
}

/// The CUDA kernel's tolerance, for every pool dtype (the reference reads the same stored
/// values): f32 sums in another order than the reference's f64, and `__expf`, a few ulp off.
#[cfg(feature = "cuda")]
const CUDA_TOL: f32 = 1e-3;

#[cfg(feature = "cuda")]
proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn cuda_kernel_equals_reference(
        c in case(),
        dtype in prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)],
    ) {
        if let Some(err) = cuda_error(&c, dtype) {
            prop_assert!(err < CUDA_TOL, "{:?}: err {}", dtype, err);
        }
    }

    #[test]
    fn cuda_long_contexts_merge_their_segments(c in long_case()) {
        if let Some(err) = cuda_error(&c, DType::F16) {
            prop_assert!(err < CUDA_TOL, "err {}", err);
        }
    }
}
