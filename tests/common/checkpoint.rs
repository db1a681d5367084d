//! Checkpoints of seeded random weights (Hugging Face names, with their `config.json`), and
//! pensieve's logits on them: what the reference checks compare with candle-transformers and
//! with Hugging Face `transformers`.

use std::path::Path;

use candle_core::Device;
use pensieve::attention::KvPool;
use pensieve::model::{ForwardBatch, ModelConfig, Transformer, WeightFormat};

/// Writes `config.json` and `model.safetensors` of random weights from `seed` into `dir`,
/// as the `random_checkpoint` example does.
pub fn write(dir: &Path, json: &str, seed: u64) -> ModelConfig {
    let config = ModelConfig::from_hf_json(json).unwrap();
    let tensors = Transformer::random_tensors(&config, seed, &Device::Cpu).unwrap();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), json).unwrap();
    config
}

/// Our logits after `prompt`, loading the checkpoint in `dir`.
pub fn last_logits(dir: &Path, json: &str, prompt: &[u32]) -> Vec<f32> {
    let config = ModelConfig::from_hf_json(json).unwrap();
    let m = Transformer::from_safetensors(
        config,
        &[dir.join("model.safetensors")],
        WeightFormat::F32,
        &Device::Cpu,
    )
    .unwrap();
    logits(&m, prompt)
}

/// `m`'s logits after `prompt`, in one pass.
pub fn logits(m: &Transformer, prompt: &[u32]) -> Vec<f32> {
    let n = prompt.len();
    let pool = KvPool::new(
        m.config().kv_shape(),
        n,
        pensieve::engine::KvPrecision::F32,
        &Device::Cpu,
    )
    .unwrap();
    let idx: Vec<u32> = (0..n as u32).collect();
    let mut batch = ForwardBatch::new();
    batch.push(prompt, &idx, &idx, &idx, n, true).unwrap();
    m.forward(&batch, &pool)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Checks `ours` against `theirs` within `tolerance` of the largest logit.
pub fn assert_close(name: &str, ours: &[f32], theirs: &[f32], tolerance: f32) {
    assert_eq!(ours.len(), theirs.len(), "{name}");
    let scale = theirs.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = ours
        .iter()
        .zip(theirs)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    println!("{name}: max |diff| {diff:.2e} (logits up to {scale:.2})");
    assert!(scale > 0.1, "{name}: degenerate logits");
    assert!(
        diff <= tolerance * scale,
        "{name}: logits differ by {diff} (scale {scale})"
    );
}
