//! The attention op's fast paths equal the naive reference over random batches: shapes, GQA
//! ratios, slot permutations, disjoint query runs in one sequence, decode and prefill mixed.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::attention_cases::{
    build, case, long_case, max_rel_err, rms_rel_err, stored, values, Case, SeqCase,
};
#[cfg(feature = "cuda")]
use common::attention_cases::{kernel_case, pool, Pool};

use candle_core::{DType, Device, Tensor};
use pensieve::attention::{
    attention, attention_gather, attention_in_window, attention_reference, Attend, AttentionBatch,
};
use pensieve::engine::KvPrecision;
use proptest::prelude::*;

/// The fast CPU kernel's error against the reference, with the pools stored as `dtype` (the
/// reference reads the same stored values widened to f32).
fn fast_error(c: &Case, dtype: DType) -> f32 {
    let (q, k, v, batch) = build(c);
    let (k, v) = (k.to_dtype(dtype).unwrap(), v.to_dtype(dtype).unwrap());
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let reference =
        attention_reference(&q, &k, &v, Attend::new(&batch, scale).window(c.window)).unwrap();
    let fast =
        attention_in_window(&q, &k, &v, Attend::new(&batch, scale).window(c.window)).unwrap();
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
        let reference = attention_reference(&q, &k, &v, Attend::new(&batch, scale).window(c.window)).unwrap();
        let gathered = attention_gather(&q, &k, &v, Attend::new(&batch, scale).window(c.window)).unwrap();
        let err = max_rel_err(&gathered, &reference);
        prop_assert!(err < GATHER_TOL, "err {}", err);
    }
}

proptest! {
    // Each case writes two pools and runs three paths over each: fewer cases.
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn pools_in_8_and_4_bits_are_read_as_the_reference_reads_them(
        // Heads in blocks of 32 only; 64 and its multiples are stored rotated. A filter, not
        // `prop_assume!`: the cases it passes over count against a limit of their own.
        c in case().prop_filter("heads in blocks of 32", |c| c.head_dim % 32 == 0)
    ) {
        let (q, k, v, batch) = build(&c);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let exact = attention_reference(&q, &k, &v, Attend::new(&batch, scale).window(c.window)).unwrap();
        // Values in [-2, 2], queries quantized as the keys are scored: over 3,000 cases the
        // outputs missed by 0.005-0.013 of their norm at q8_0 and 0.08-0.19 at q4_0 (the
        // largest error of a single entry, floored at 0.1, reached 0.52 and 6.3: a long tail
        // that a bound on it fails by chance); a query turned otherwise than its keys misses
        // by tenths (0.37 on the case proptest shrank that mutant to).
        for (kv, lossy) in [(KvPrecision::Q8, 0.03), (KvPrecision::Q4, 0.35)] {
            let (kp, vp) = stored(&c, &k, &v, kv, &Device::Cpu);
            let reference = attention_reference(&q, &kp, &vp, Attend::new(&batch, scale).window(c.window)).unwrap();
            let fast = attention_in_window(&q, &kp, &vp, Attend::new(&batch, scale).window(c.window)).unwrap();
            let gathered = attention_gather(&q, &kp, &vp, Attend::new(&batch, scale).window(c.window)).unwrap();
            prop_assert!(max_rel_err(&fast, &reference) < FAST_TOL, "{:?}", kv);
            prop_assert!(max_rel_err(&gathered, &reference) < GATHER_TOL, "{:?}", kv);
            // Against the values before they were stored: what the codes lose, and no more.
            let err = rms_rel_err(&reference, &exact);
            prop_assert!(err < lossy, "{:?}: {}", kv, err);
        }
    }
}

/// Each query head's sink from the case's seed, scores of the size the queries make.
fn sinks(c: &Case) -> Vec<f32> {
    values(c.n_kv_heads * c.group, c.seed ^ 0x51)
}

/// The fast CPU kernel's and the gather path's errors against the reference, with sinks.
fn sink_errors(c: &Case) -> (f32, f32) {
    let (q, k, v, batch) = build(c);
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let s = sinks(c);
    let s = Some(s.as_slice());
    let reference = attention_reference(
        &q,
        &k,
        &v,
        Attend::new(&batch, scale).window(c.window).sinks(s),
    );
    let reference = reference.unwrap();
    let fast = attention_in_window(
        &q,
        &k,
        &v,
        Attend::new(&batch, scale).window(c.window).sinks(s),
    )
    .unwrap();
    let gathered = attention_gather(
        &q,
        &k,
        &v,
        Attend::new(&batch, scale).window(c.window).sinks(s),
    )
    .unwrap();
    (
        max_rel_err(&fast, &reference),
        max_rel_err(&gathered, &reference),
    )
}

#[test]
fn a_large_sink_takes_the_attention_and_a_small_one_leaves_it() {
    let (q, k, v, batch) = build(&Case {
        n_kv_heads: 2,
        group: 2,
        head_dim: 64,
        seqs: vec![SeqCase {
            ctx_len: 40,
            queries: (30..40).collect(),
        }],
        seed: 7,
        window: None,
    });
    let scale = 0.125;
    let plain = attention_in_window(&q, &k, &v, Attend::new(&batch, scale)).unwrap();
    let norm = |t: &Tensor| {
        t.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    let with =
        |s: f32| attention_in_window(&q, &k, &v, Attend::new(&batch, scale).sinks(Some(&[s; 4])));
    assert!(norm(&with(40.0).unwrap()) < 1e-6 * norm(&plain));
    assert!(max_rel_err(&with(-40.0).unwrap(), &plain) < FAST_TOL);
    // One value per query head.
    assert!(attention_in_window(
        &q,
        &k,
        &v,
        Attend::new(&batch, scale).sinks(Some(&[0.0; 3]))
    )
    .is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn sinks_join_the_softmax_as_the_reference_s(c in case()) {
        let (fast, gathered) = sink_errors(&c);
        prop_assert!(fast < FAST_TOL, "err {}", fast);
        prop_assert!(gathered < GATHER_TOL, "err {}", gathered);
    }

    #[test]
    fn long_contexts_merge_their_segments_before_their_sinks(c in long_case()) {
        let (fast, _) = sink_errors(&c);
        prop_assert!(fast < FAST_TOL, "err {}", fast);
    }

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

    let mut alone = AttentionBatch::new(1);
    alone.push_sequence(&[1199], &slots, k_len).unwrap();
    let q = Tensor::from_vec(last.to_vec(), (1, heads, d), &Device::Cpu).unwrap();
    let one = attention(&q, &k, &v, &alone, scale).unwrap();

    let mut mixed = AttentionBatch::new(1);
    mixed.push_sequence(&[5], &slots[..6], 6).unwrap();
    let run: Vec<u32> = (1160..1200).collect();
    mixed.push_sequence(&run, &slots, k_len).unwrap();
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
        for (slot, pos) in seq.slots().zip(0..) {
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
    let mut batch = AttentionBatch::new(2);
    batch.push_sequence(&[0], &[2], 1).unwrap();
    assert!(matches!(
        attention(&q, &k, &k, &batch, 1.0),
        Err(pensieve::Error::InvalidBatch(_))
    ));
}

#[test]
fn odd_head_dim_is_a_typed_error() {
    let q = Tensor::zeros((1, 2, 5), candle_core::DType::F32, &Device::Cpu).unwrap();
    let k = Tensor::zeros((4, 1, 5), candle_core::DType::F32, &Device::Cpu).unwrap();
    let mut batch = AttentionBatch::new(1);
    batch.push_sequence(&[0], &[0], 1).unwrap();
    assert!(matches!(
        attention(&q, &k, &k, &batch, 1.0),
        Err(pensieve::Error::UnsupportedHeadDim { head_dim: 5 })
    ));
}

/// The CUDA op's error against the reference, the pools kept as `pool` on the GPU (codes written
/// there by the pool, as the engine writes them) and the reference reading the same stored
/// values; `None` without a GPU.
#[cfg(feature = "cuda")]
fn cuda_error(c: &Case, pool: Pool) -> Option<f32> {
    let gpu = common::cuda_device("CUDA attention tests")?;
    let (q, k, v, batch) = build(c);
    let (k, v) = pool.keep(c, &k, &v, &gpu);
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let on_cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    let reference = attention_reference(
        &q,
        &on_cpu(&k),
        &on_cpu(&v),
        Attend::new(&batch, scale).window(c.window),
    )
    .unwrap();
    let out = attention_in_window(
        &q.to_device(&gpu).unwrap(),
        &k,
        &v,
        Attend::new(&batch, scale).window(c.window),
    )
    .unwrap();
    Some(max_rel_err(&on_cpu(&out), &reference))
}

/// The CUDA kernel's tolerance, for every pool dtype (the reference reads the same stored
/// values): the emulator's (f32 sums in another order than the reference's f64) plus the GPU's
/// `__expf`, a few ulp off over scores up to ~60.
#[cfg(feature = "cuda")]
const CUDA_TOL: f32 = 1e-4;

#[cfg(feature = "cuda")]
proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn cuda_kernel_equals_reference(c in kernel_case(), pool in pool()) {
        if let Some(err) = cuda_error(&c, pool) {
            prop_assert!(err < CUDA_TOL, "{:?}: err {}", pool, err);
        }
    }

    #[test]
    fn cuda_long_contexts_merge_their_segments(c in long_case()) {
        if let Some(err) = cuda_error(&c, Pool::Values(DType::F16)) {
            prop_assert!(err < CUDA_TOL, "err {}", err);
        }
    }
}
