//! The integer kernel on real weights in the formats people download: SmolLM2 re-quantized by
//! candle (at test time, `examples/common/requantize.rs`: rows of 576 take llama.cpp's fallback
//! type) to `Q4_K`, `Q6_K` and `Q5_0`, each loaded in its own codes.
//!
//! - Perplexity on held-back ShareGPT replies is within 2% of the same weights dequantized to
//!   f32 (the kernel's only approximation is its 8-bit activations).
//! - Under KV pressure, `Tiered` gives the same greedy tokens as `Stateless` (the kernel is
//!   batch-invariant in every format).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "../examples/common/requantize.rs"]
#[allow(dead_code)]
mod requantize;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use pensieve::engine::{
    Budgets, CacheMode, ConversationOptions, Engine, EngineStats, KvPrecision, SamplingParams, Turn,
};
use pensieve::model::{default_model_path, LoadOptions, Model, ModelSource, WeightFormat};

/// The SmolLM2 file with every matrix re-quantized to `target`, written under `dir`.
fn requantized(target: GgmlDType, dir: &Path) -> PathBuf {
    let path = dir.join(format!("smollm2-{target:?}.gguf"));
    requantize::requantize(&default_model_path(), &path, target).unwrap();
    path
}

fn load(path: &Path, format: WeightFormat) -> Model {
    let options = LoadOptions::default().format(format);
    Model::load(&ModelSource::Gguf(path.to_path_buf()), &options).unwrap()
}

/// Greedy tokens of 12 conversations × 2 turns under `mode`.
fn conversations(
    model: &Arc<Model>,
    mode: CacheMode,
    budgets: Budgets,
) -> (Vec<Vec<u32>>, EngineStats) {
    let config = common::pressure_config(mode, budgets).step_token_budget(256);
    let mut e = Engine::with_model(model.clone(), config).unwrap();
    let convs: Vec<_> = (0..12)
        .map(|_| e.open(ConversationOptions::default()).unwrap())
        .collect();
    for turn in 0..2 {
        for (i, &c) in convs.iter().enumerate() {
            let params = SamplingParams::greedy().max_tokens(8).ignore_eos(true);
            let q = format!("Question {i}.{turn}: name a country and its capital.");
            e.submit(c, Turn::user(q), params).unwrap();
        }
        while e.has_work() {
            e.step().unwrap();
        }
    }
    let tokens = convs
        .iter()
        .map(|&c| e.tokens(c).unwrap().to_vec())
        .collect();
    (tokens, e.stats())
}

fn check(target: GgmlDType) {
    let dir = tempfile::tempdir().unwrap();
    let path = requantized(target, dir.path());
    let reference = load(&path, WeightFormat::F32);
    let samples = common::held_back_replies(&reference, 40);
    let ppl_ref = common::reply_nll(&reference, &samples, KvPrecision::F32).exp();
    drop(reference);
    let packed = Arc::new(load(&path, WeightFormat::Packed));
    let ppl = common::reply_nll(&packed, &samples, KvPrecision::default()).exp();
    eprintln!("{target:?}: perplexity over 40 replies: f32 {ppl_ref:.4}, packed {ppl:.4}");
    assert!(
        (ppl / ppl_ref - 1.0).abs() < 0.02,
        "{target:?}: f32 {ppl_ref}, packed {ppl}"
    );

    let chunk_bytes = common::chunk_bytes(&packed);
    let tight = Budgets::default()
        .device_tokens(256)
        .host_bytes(12 * chunk_bytes);
    let roomy = Budgets::default().device_tokens(8 * 1024).host_bytes(0);
    let (tiered, stats) = conversations(&packed, CacheMode::Tiered, tight);
    common::assert_pressure_exercised(&stats);
    let (stateless, _) = conversations(&packed, CacheMode::Stateless, roomy);
    assert_eq!(
        tiered, stateless,
        "{target:?}: Tiered and Stateless diverge"
    );
}

#[test]
fn q4_k_in_its_codes() {
    check(GgmlDType::Q4K);
}

#[test]
fn q6_k_in_its_codes() {
    check(GgmlDType::Q6K);
}

#[test]
fn q5_0_in_its_codes() {
    check(GgmlDType::Q5_0);
}
