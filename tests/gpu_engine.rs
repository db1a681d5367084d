//! The engine on a GPU (feature `cuda`): a seeded random-weight Llama shape (head dim 64, so
//! attention runs the CUDA kernel) under a device budget that forces swaps, drops and
//! recompute. Without a GPU every test says why it skipped and checks nothing; the binary is
//! built here and run on a GPU machine by `scripts/gpu-tests`.
//!
//! On a GPU, cuBLAS picks its algorithm by matrix size, so a history computed in one prefill
//! (`Stateless`) and the same history built turn by turn (`Tiered`) differ in the last bits.
//! The check is therefore the property behind token-for-token equality: every token the
//! engine generated is the argmax, up to a near-tie, of a stateless recompute of its whole
//! history, on the GPU and on the CPU. Each cache setting runs alone (stateless, tiered with
//! room, under pressure, pipelined), so a failure names its cause; the forward pass itself is
//! checked against the CPU in one pass and in prefill pieces.

#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use pensieve::attention::KvPool;
use pensieve::engine::{
    Budgets, CacheMode, ConversationId, ConversationOptions, CostProfile, Engine, EngineConfig,
    EngineStats, Event, FinishReason, KvPrecision, SamplingParams, Turn,
};
use pensieve::kv::CostModel;
use pensieve::model::{ForwardBatch, Model, ModelConfig, Transformer, WeightFormat};

const CHUNK: usize = 8;

/// Two logits closer than this (relative to the row's largest magnitude) are a tie: f16 KV
/// rounds values computed in different batch shapes, which moves logits by ~1e-3 of their size.
const NEAR_TIE: f32 = 1e-2;

fn gpu_model(device: &Device) -> Model {
    let config = ModelConfig::from_hf_json(
        r#"{"architectures":["LlamaForCausalLM"],"vocab_size":259,"hidden_size":256,"intermediate_size":512,"num_hidden_layers":4,
            "num_attention_heads":4,"num_key_value_heads":2,"rms_norm_eps":1e-5,
            "rope_theta":10000.0,"max_position_embeddings":2048,"tie_word_embeddings":true}"#,
    )
    .unwrap();
    let llama = Transformer::random(config, 11, WeightFormat::F32, device).unwrap();
    Model::tiny(7).unwrap().with_transformer(llama)
}

struct Run {
    /// Each conversation's final history.
    histories: Vec<Vec<u32>>,
    /// Each conversation's generated positions in it.
    generated: Vec<Vec<usize>>,
    stats: EngineStats,
}

/// 12 conversations x 3 turns of 6 greedy tokens; `device_tokens` and `host_chunks` decide
/// the pressure.
fn run(
    gpu: &Device,
    mode: CacheMode,
    device_tokens: usize,
    host_chunks: usize,
    precision: KvPrecision,
    pipelined: bool,
) -> Run {
    let model = gpu_model(gpu);
    let token_bytes = model.config().kv_shape().token_bytes(precision);
    let config = EngineConfig::default()
        .budgets(
            Budgets::default()
                .device_tokens(device_tokens)
                .host_bytes(host_chunks * CHUNK * token_bytes),
        )
        .mode(mode)
        .chunk_size(CHUNK)
        .step_token_budget(64)
        .cost_profile(CostProfile::Fixed(CostModel::new(1e-4, 1e-7)))
        .kv_precision(precision)
        .pipelined_restore(pipelined)
        .check_invariants(true)
        // Each conversation keeps its own KV, so the budgets force the drops and swaps this
        // test checks on the device (sharing would relieve them).
        .prefix_sharing(false);
    let mut e = Engine::with_model(model, config).unwrap();
    let convs: Vec<ConversationId> = (0..12)
        .map(|_| e.open(ConversationOptions::default()).unwrap())
        .collect();
    let mut generated: HashMap<ConversationId, Vec<usize>> = HashMap::new();
    let params = SamplingParams::greedy().max_tokens(6).ignore_eos(true);
    for turn in 0..3 {
        let before: Vec<usize> = convs.iter().map(|&c| e.tokens(c).unwrap().len()).collect();
        for (i, &c) in convs.iter().enumerate() {
            e.submit(
                c,
                Turn::user(format!("turn {turn} of conversation {i}")),
                params.clone(),
            )
            .unwrap();
        }
        let mut tokens: HashMap<ConversationId, Vec<u32>> = HashMap::new();
        let mut prompts: HashMap<ConversationId, usize> = HashMap::new();
        let mut guard = 0;
        while e.has_work() {
            for ev in e.step().unwrap() {
                match ev {
                    Event::Token {
                        conversation,
                        token,
                        ..
                    } => tokens.entry(conversation).or_default().push(token),
                    Event::Finished {
                        conversation,
                        reason,
                        stats,
                        ..
                    } => {
                        assert!(matches!(reason, FinishReason::Length), "{reason:?}");
                        prompts.insert(conversation, stats.prompt_tokens);
                    }
                    other => panic!("unexpected event {other:?}"),
                }
            }
            guard += 1;
            assert!(guard < 10_000, "engine did not finish");
        }
        // The reply follows the turn's prompt. A reply that ends inside a character keeps only
        // the tokens whose text the client received whole (the engine settles the history on
        // what the client saw), so the generated tokens still there are the leading ones.
        for (&c, &len) in convs.iter().zip(&before) {
            let history = e.tokens(c).unwrap();
            let start = len + prompts[&c];
            let sampled = &tokens[&c];
            assert_eq!(sampled.len(), 6);
            let kept = sampled
                .iter()
                .zip(&history[start..])
                .take_while(|(a, b)| a == b)
                .count();
            generated.entry(c).or_default().extend(start..start + kept);
        }
    }
    Run {
        histories: convs
            .iter()
            .map(|&c| e.tokens(c).unwrap().to_vec())
            .collect(),
        generated: convs
            .iter()
            .map(|c| generated.remove(c).unwrap_or_default())
            .collect(),
        stats: e.stats(),
    }
}

/// Logits after every token of `history`, from stateless passes over a fresh pool: one pass
/// over the whole history, or passes of `piece` tokens each over the KV the earlier ones wrote
/// (as the engine's prefill chunks do).
fn scored(model: &Model, history: &[u32], precision: KvPrecision, piece: usize) -> Vec<Vec<f32>> {
    let llama = model.transformer();
    let n = history.len();
    let pool = KvPool::new(llama.config().kv_shape(), n, precision, llama.device()).unwrap();
    let idx: Vec<u32> = (0..n as u32).collect();
    let mut rows = Vec::with_capacity(n);
    for start in (0..n).step_by(piece.max(1)) {
        let end = (start + piece).min(n);
        let mut batch = ForwardBatch::new();
        let new = &idx[start..end];
        batch
            .push_scored(
                &history[start..end],
                new,
                new,
                &idx[..end],
                idx[..end].len(),
            )
            .unwrap();
        let logits: Tensor = llama.forward(&batch, &pool).unwrap();
        rows.extend(
            logits
                .to_device(&Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap(),
        );
    }
    rows
}

/// Every generated token of `run` that `model`'s stateless recompute does not pick (up to a
/// near-tie), described; panics on a flat row (a check that cannot fail) or a token left unchecked.
fn misses(model: &Model, run: &Run, precision: KvPrecision) -> Vec<String> {
    let mut checked = 0;
    let mut out = Vec::new();
    for (c, (history, generated)) in run.histories.iter().zip(&run.generated).enumerate() {
        let logits = scored(model, history, precision, history.len());
        for &p in generated {
            let row = &logits[p - 1];
            let best = row.iter().copied().fold(f32::MIN, f32::max);
            let min = row.iter().copied().fold(f32::MAX, f32::min);
            assert!(best - min > 0.1, "degenerate logits at {p}: {min}..{best}");
            let scale = row.iter().map(|x| x.abs()).fold(0.0, f32::max);
            let logit = row[history[p] as usize];
            if best - logit > NEAR_TIE * scale {
                out.push(format!(
                    "conversation {c}, token {} at {p}: logit {logit}, best {best} (scale {scale})",
                    history[p]
                ));
            }
            checked += 1;
        }
    }
    assert!(
        checked >= 12 * 3 * 6 * 9 / 10,
        "only {checked} generated tokens checked"
    );
    out
}

/// Largest difference between two sets of logit rows, relative to the rows' largest
/// magnitude, and the first row where it exceeds `tolerance` of it.
fn difference(a: &[Vec<f32>], b: &[Vec<f32>], tolerance: f32) -> (f32, Option<usize>) {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    assert!(scale > 0.1, "degenerate logits");
    let mut worst = 0f32;
    let mut first = None;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let d = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale;
        if d > tolerance && first.is_none() {
            first = Some(i);
        }
        worst = worst.max(d);
    }
    (worst, first)
}

/// Q8: codes written by the GPU's kernel and read by its attention kernel. Q4 differs from it
/// only in its blocks' layout, which the emulator checks; here a 4-bit code one step apart
/// (from keys the two devices' matmuls formed a little apart) would move logits past
/// `LOGIT_TOL`.
const PRECISIONS: [KvPrecision; 4] = [
    KvPrecision::F16,
    KvPrecision::Bf16,
    KvPrecision::F32,
    KvPrecision::Q8,
];

/// Logits relative error allowed between the GPU and the CPU, and between one pass and
/// several: f16/bf16 KV rounds values that different matmul shapes computed a little apart.
const LOGIT_TOL: f32 = 2e-2;

#[test]
fn the_gpu_forward_pass_matches_the_cpu_in_one_pass_and_in_pieces() {
    let Some(gpu) = common::cuda_device("GPU engine tests") else {
        return;
    };
    let (on_gpu, on_cpu) = (gpu_model(&gpu), gpu_model(&Device::Cpu));
    let mut state = 5u32;
    let history: Vec<u32> = (0..200)
        .map(|_| {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            (state >> 8) % 259
        })
        .collect();
    let mut failures = Vec::new();
    for precision in PRECISIONS {
        let cpu = scored(&on_cpu, &history, precision, history.len());
        for piece in [history.len(), 64, 8, 1] {
            let gpu = scored(&on_gpu, &history, precision, piece);
            let (worst, first) = difference(&cpu, &gpu, LOGIT_TOL);
            eprintln!("{precision:?}, pieces of {piece}: GPU vs CPU within {worst:.2e}, first row over {first:?}");
            if first.is_some() {
                failures.push(format!(
                    "{precision:?} pieces of {piece}: {worst:.2e} from row {first:?}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn tiered_equals_stateless_on_the_gpu_under_pressure() {
    let Some(gpu) = common::cuda_device("GPU engine tests") else {
        return;
    };
    let (on_gpu, on_cpu) = (gpu_model(&gpu), gpu_model(&Device::Cpu));
    let mut failures = Vec::new();
    for precision in PRECISIONS {
        // 30 device blocks of 8 tokens and 40 host chunks for ~170 tokens x 12: swaps, drops
        // and recomputes all happen; each setting alone, so a failure names its cause.
        let runs = [
            (
                "stateless",
                run(&gpu, CacheMode::Stateless, 4096, 0, precision, true),
            ),
            (
                "tiered, room",
                run(&gpu, CacheMode::Tiered, 4096, 0, precision, true),
            ),
            (
                "tiered, pressure",
                run(&gpu, CacheMode::Tiered, 240, 40, precision, false),
            ),
            (
                "tiered, pressure, pipelined",
                run(&gpu, CacheMode::Tiered, 240, 40, precision, true),
            ),
        ];
        let s = &runs[3].1.stats;
        assert!(s.bytes_swapped_out > 0 && s.bytes_swapped_in > 0, "{s:?}");
        assert!(
            s.chunks_dropped_from_host + s.chunks_dropped_from_device > 0,
            "{s:?}"
        );
        assert!(s.recomputed_tokens > 0, "{s:?}");
        for (what, r) in &runs {
            let (gpu_misses, cpu_misses) =
                (misses(&on_gpu, r, precision), misses(&on_cpu, r, precision));
            let same = r
                .histories
                .iter()
                .zip(&runs[0].1.histories)
                .filter(|(a, b)| a == b)
                .count();
            eprintln!(
                "{precision:?} {what}: {} misses against the GPU's recompute, {} against the CPU's; {same}/12 equal to stateless; first: {:?}",
                gpu_misses.len(),
                cpu_misses.len(),
                gpu_misses.first().or(cpu_misses.first())
            );
            if !gpu_misses.is_empty() || !cpu_misses.is_empty() {
                failures.push(format!(
                    "{precision:?} {what}: {:?}",
                    gpu_misses.first().or(cpu_misses.first())
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
#[test]
fn pipelined_restore_gives_the_serial_restores_outputs() {
    let Some(gpu) = common::cuda_device("GPU engine tests") else {
        return;
    };
    // The same plans, copies and kernels; only when the pass waits for the copies differs.
    let pipelined = run(&gpu, CacheMode::Tiered, 240, 40, KvPrecision::F16, true);
    let serial = run(&gpu, CacheMode::Tiered, 240, 40, KvPrecision::F16, false);
    assert!(
        pipelined.stats.bytes_swapped_in > 0,
        "{:?}",
        pipelined.stats
    );
    assert_eq!(pipelined.histories, serial.histories);
    assert_eq!(
        pipelined.stats.bytes_swapped_in,
        serial.stats.bytes_swapped_in
    );
}
