//! The CUDA kernel (`kernels/attention.cu`) run by the emulator (`kernels/emu`) through the
//! real planner: against the f64 reference over the attention proptests' batches, bit for bit
//! the same under every schedule, and its deliberately broken copies caught. No GPU needed;
//! `.ci/run` runs this file again under AddressSanitizer and UBSan.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use candle_core::{DType, Tensor};
use common::attention_cases::{
    build, kernel_case, long_case, max_rel_err, pool, Case, Pool, SeqCase,
};
use pensieve::attention::emulator::{self, Emulation, EmulationError, Schedule};
use pensieve::attention::{attention_reference, Attend, AttentionBatch};
use pensieve::engine::KvPrecision;
use proptest::prelude::*;

/// The kernel's error against the f64 reference: f32 sums in another order, with scores up to
/// ~60 at head dim 256 (measured: up to 2.3e-5; a wrong mask, slot or scale moves outputs by
/// 1e-2 or more).
const EMU_TOL: f32 = 5e-5;

fn bits(t: &Tensor) -> Vec<u32> {
    let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

/// What one variant of the kernel did with one case under every schedule.
enum Outcome {
    /// The same bits under every schedule, this far from the reference.
    Agreed(f32),
    /// Two schedules gave different outputs: a race.
    Differed(Schedule, Schedule),
    /// The emulator stopped it (divergent barrier or collective).
    Stopped(String),
}

fn run(c: &Case, pool: Pool, sms: usize, variant: usize, mma: bool) -> Outcome {
    let (q, k, v, batch) = build(c);
    let (k, v) = pool.keep(c, &k, &v, &candle_core::Device::Cpu);
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let reference =
        attention_reference(&q, &k, &v, Attend::new(&batch, scale).window(c.window)).unwrap();
    let mut first: Option<(Schedule, Tensor)> = None;
    for schedule in Schedule::ALL {
        let how = Emulation {
            variant,
            schedule,
            sms,
            mma,
        };
        let out =
            match emulator::attention(&q, &k, &v, Attend::new(&batch, scale).window(c.window), how)
            {
                Ok(out) => out,
                Err(EmulationError::Divergence(why)) => return Outcome::Stopped(why),
                Err(e) => panic!("{e}"),
            };
        match &first {
            None => first = Some((schedule, out)),
            Some((s0, o0)) if bits(o0) != bits(&out) => return Outcome::Differed(*s0, schedule),
            Some(_) => {}
        }
    }
    let (_, out) = first.unwrap();
    // NaN (an output no block wrote, or poisoned shared memory read) fails every comparison.
    let err = max_rel_err(&out, &reference);
    Outcome::Agreed(if err.is_nan() { f32::INFINITY } else { err })
}

fn check(c: &Case, pool: Pool, sms: usize) -> Result<(), TestCaseError> {
    match run(c, pool, sms, 0, true) {
        Outcome::Agreed(err) => {
            prop_assert!(err < EMU_TOL, "{:?}: err {}", pool, err);
            Ok(())
        }
        Outcome::Differed(a, b) => Err(TestCaseError::fail(format!("{a:?} and {b:?} differ"))),
        Outcome::Stopped(why) => Err(TestCaseError::fail(why)),
    }
}

/// Random cases per property: 64, or `PENSIEVE_EMU_CASES` (`.ci/run`'s second run, under the
/// sanitizers, which make each case ten times slower, takes fewer).
fn cases() -> u32 {
    std::env::var("PENSIEVE_EMU_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn emulated_kernel_equals_reference(c in kernel_case(), pool in pool()) {
        check(&c, pool, 132)?;
    }

    #[test]
    fn emulated_long_contexts_split_and_merge(
        c in long_case(),
        pool in pool(),
        sms in prop_oneof![Just(1usize), Just(4), Just(132)],
    ) {
        check(&c, pool, sms)?;
    }
}

/// The shapes a reviewer would try first, every pool kind and head dim: a sequence with no
/// context, a window that hides the whole first tile, recompute rows beside new ones, and more
/// than 32 query heads per kv head (40 and 48, the shapes that broke the first kernel).
#[test]
fn edge_cases_match_the_reference() {
    let seqs = vec![
        SeqCase {
            ctx_len: 300,
            queries: vec![299],
        },
        SeqCase {
            ctx_len: 150,
            queries: (0..3).chain(140..150).collect(),
        },
    ];
    for head_dim in [64, 128, 256] {
        for (n_kv_heads, group, window) in [(1, 40, None), (2, 48, Some(7)), (2, 3, Some(130))] {
            let c = Case {
                n_kv_heads,
                group,
                head_dim,
                seqs: seqs.clone(),
                seed: head_dim as u64 + group as u64,
                window,
            };
            for pool in Pool::ALL {
                check(&c, pool, 4).unwrap();
            }
        }
    }
    // No context at all: zeros, written (not left as the NaN the output starts as).
    let q = Tensor::ones((1, 4, 64), DType::F32, &candle_core::Device::Cpu).unwrap();
    let k = Tensor::ones((2, 2, 64), DType::F16, &candle_core::Device::Cpu).unwrap();
    let mut batch = AttentionBatch::new(16);
    batch.push_sequence(&[5], &[], 0).unwrap();
    let out =
        emulator::attention(&q, &k, &k, Attend::new(&batch, 0.1), Emulation::default()).unwrap();
    assert!(out
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .all(|&x| x == 0.0));
}

/// Each deliberately broken copy of the kernels (`kernels/emu/mutants`) is caught on at least
/// one of a few cases, by a stop, a difference between schedules or a wrong output, while the
/// kernels as they ship pass all of them. The cases of many queries in f16 or bf16 run once
/// through the tensor-core kernel and once through the other.
#[test]
fn broken_kernels_are_caught() {
    let case = |n_kv_heads, group, head_dim, seqs: Vec<SeqCase>, window| Case {
        n_kv_heads,
        group,
        head_dim,
        seqs,
        seed: 99,
        window,
    };
    let cases = [
        // GQA over several tiles: prefill rows and a decode row.
        (
            case(
                2,
                3,
                64,
                vec![
                    SeqCase {
                        ctx_len: 300,
                        queries: vec![299],
                    },
                    SeqCase {
                        ctx_len: 150,
                        queries: (110..150).collect(),
                    },
                ],
                None,
            ),
            Pool::Values(DType::F16),
            132,
        ),
        // A long decode row split over segments and merged.
        (
            case(
                2,
                2,
                64,
                vec![SeqCase {
                    ctx_len: 1300,
                    queries: vec![1299],
                }],
                None,
            ),
            Pool::Values(DType::F16),
            8,
        ),
        // Prefill rows in bf16 at head dim 128 under a window, a context shorter than a tile,
        // and a decode row.
        (
            case(
                2,
                4,
                128,
                vec![
                    SeqCase {
                        ctx_len: 170,
                        queries: (130..170).collect(),
                    },
                    SeqCase {
                        ctx_len: 20,
                        queries: (0..20).collect(),
                    },
                    SeqCase {
                        ctx_len: 90,
                        queries: vec![89],
                    },
                ],
                Some(100),
            ),
            Pool::Values(DType::BF16),
            132,
        ),
        // Prefill rows at head dim 256 (the tensor-core kernel's 96 KiB of dynamic shared
        // memory), past a host tile.
        (
            case(
                1,
                2,
                256,
                vec![SeqCase {
                    ctx_len: 45,
                    queries: (29..45).collect(),
                }],
                None,
            ),
            Pool::Values(DType::BF16),
            132,
        ),
        // A window whose oldest visible entry is the newest of a tile.
        (
            case(
                1,
                2,
                64,
                vec![SeqCase {
                    ctx_len: 200,
                    queries: vec![199],
                }],
                Some(65),
            ),
            Pool::Values(DType::F32),
            132,
        ),
        // Codes of 8 bits at head dim 128 (four blocks a row, copies of 8 bytes): prefill rows
        // past a tile and a decode row.
        (
            case(
                2,
                2,
                128,
                vec![
                    SeqCase {
                        ctx_len: 160,
                        queries: (140..160).collect(),
                    },
                    SeqCase {
                        ctx_len: 40,
                        queries: vec![39],
                    },
                ],
                None,
            ),
            Pool::Codes(KvPrecision::Q8),
            132,
        ),
        // Codes of 4 bits at head dim 64 (rows of 36 bytes, copies of 4).
        (
            case(
                1,
                4,
                64,
                vec![SeqCase {
                    ctx_len: 70,
                    queries: (60..70).collect(),
                }],
                None,
            ),
            Pool::Codes(KvPrecision::Q4),
            132,
        ),
    ];
    let variants = emulator::variants();
    assert!(variants.len() >= 11, "{variants:?}");
    for (i, (name, why)) in variants.iter().enumerate() {
        let mut verdicts = Vec::new();
        for (c, pool, sms) in &cases {
            let kernels: &[bool] = match pool {
                Pool::Values(DType::F16 | DType::BF16) => &[true, false],
                _ => &[true],
            };
            for &mma in kernels {
                verdicts.push(match run(c, *pool, *sms, i, mma) {
                    Outcome::Agreed(err) if err < EMU_TOL => None,
                    Outcome::Agreed(err) => Some(format!("error {err}")),
                    Outcome::Differed(a, b) => Some(format!("{a:?} and {b:?} differ")),
                    Outcome::Stopped(why) => Some(why),
                });
            }
        }
        eprintln!("{name} ({why}): {verdicts:?}");
        if i == 0 {
            assert!(
                verdicts.iter().all(Option::is_none),
                "the kernel: {verdicts:?}"
            );
        } else {
            assert!(
                verdicts.iter().any(Option::is_some),
                "{name} was not caught"
            );
        }
    }
}

/// The engine's own batches (mixed prefill and decode, swaps, drops and recompute under a
/// tight budget) through the emulated kernel in place of the CPU op, on the shape of
/// `tests/gpu_engine.rs` (head dim 64, two query heads per kv head), with KV in f16 and in 8
/// bits: the tiered engine's tokens are the stateless recompute's, exactly. No context here is long enough to be split, so each
/// query's output depends only on which kernel took it: decode rows the one of a query per
/// warp, prefill runs of 16 queries or more the tensor-core one, whose results differ in the
/// last bits.
#[test]
fn the_engine_runs_on_the_emulated_kernel() {
    use candle_core::Device;
    use pensieve::engine::{Budgets, CacheMode, ConversationOptions, Engine, SamplingParams, Turn};
    use pensieve::model::{Model, ModelConfig, Transformer, WeightFormat};

    // SAFETY: this binary's other tests read the environment only through `std::env`, which
    // locks it against this write; the emulator's C++ runtime never reads it.
    unsafe { std::env::set_var("PENSIEVE_EMULATE_CUDA", "1") };
    assert!(emulator::replaces_the_cpu_op(64, DType::F16));
    let run = |mode: CacheMode, kv: KvPrecision, device_tokens: usize, host_tokens: usize| {
        let config = ModelConfig::from_hf_json(
            r#"{"architectures":["LlamaForCausalLM"],"vocab_size":259,"hidden_size":256,
                "intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
                "num_key_value_heads":2,"rms_norm_eps":1e-5,"rope_theta":10000.0,
                "max_position_embeddings":2048,"tie_word_embeddings":true}"#,
        )
        .unwrap();
        let llama = Transformer::random(config, 11, WeightFormat::F32, &Device::Cpu).unwrap();
        let model = Model::tiny(7).unwrap().with_transformer(llama);
        let shape = pensieve::attention::KvShape {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 64,
        };
        let budgets = Budgets::default()
            .device_tokens(device_tokens)
            .host_bytes(host_tokens * shape.token_bytes(kv));
        let mut config = common::pressure_config(mode, budgets);
        config.kv_precision = kv;
        config.chunk_size = 8;
        config.step_token_budget = 64;
        let mut e = Engine::with_model(model, config).unwrap();
        let convs: Vec<_> = (0..8)
            .map(|_| e.open(ConversationOptions::default()).unwrap())
            .collect();
        let params = SamplingParams::greedy().max_tokens(5).ignore_eos(true);
        for turn in 0..3 {
            for (i, &c) in convs.iter().enumerate() {
                let text = format!("turn {turn} of conversation {i}");
                e.submit(c, Turn::user(text), params.clone()).unwrap();
            }
            while e.has_work() {
                e.step().unwrap();
            }
        }
        let histories: Vec<Vec<u32>> = convs
            .iter()
            .map(|&c| e.tokens(c).unwrap().to_vec())
            .collect();
        (histories, e.stats())
    };
    for kv in [KvPrecision::F16, KvPrecision::Q8] {
        let (tiered, stats) = run(CacheMode::Tiered, kv, 160, 24 * 8);
        common::assert_pressure_exercised(&stats);
        let (stateless, _) = run(CacheMode::Stateless, kv, 4096, 0);
        assert_eq!(tiered, stateless, "{kv:?}");
    }
}
