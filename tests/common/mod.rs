//! Helpers shared by the test files that need the real SmolLM2 weights (fetched by
//! `scripts/fetch-assets`, which the README's test command runs first).
#![allow(dead_code)]

pub mod attention_cases;
pub mod llamacpp;
pub mod redis_cluster;
pub mod redis_server;
pub mod server;

use pensieve::attention::KvPool;
use pensieve::engine::{
    ConversationId, Engine, Event, FinishReason, SamplingParams, TokenLogprobs, Turn, TurnStats,
};
use pensieve::model::{ForwardBatch, LoadOptions, Model, ModelSource, WeightFormat};

pub fn real_model(format: WeightFormat) -> Model {
    let options = LoadOptions::default().format(format);
    match Model::load(&ModelSource::Default, &options) {
        Ok(m) => m,
        Err(e) => panic!("the real model is required (run scripts/fetch-assets): {e}"),
    }
}

/// Greedy generation of `n` tokens after `prompt`, one sequence, KV in `slots_for(i)` for the
/// token at position `i`; `prefill_chunk` splits the prompt into several forward passes.
/// Returns the generated ids and the logits that chose each of them.
pub fn greedy(
    model: &Model,
    prompt: &[u32],
    n: usize,
    prefill_chunk: usize,
    slots_for: impl Fn(usize) -> u32,
    n_slots: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let llama = model.transformer();
    let pool = KvPool::new(
        llama.config().kv_shape(),
        n_slots,
        pensieve::engine::KvPrecision::F32,
        llama.device(),
    )
    .unwrap();
    let mut history: Vec<u32> = Vec::new();
    let mut out = Vec::new();
    let mut all_logits = Vec::new();
    let mut pending: Vec<u32> = prompt.to_vec();
    while out.len() < n {
        let take = if history.is_empty() || history.len() < prompt.len() {
            prefill_chunk.min(pending.len())
        } else {
            pending.len()
        };
        let new: Vec<u32> = pending.drain(..take).collect();
        let start = history.len();
        history.extend_from_slice(&new);
        let positions: Vec<u32> = (start as u32..history.len() as u32).collect();
        let slots: Vec<u32> = (start..history.len()).map(&slots_for).collect();
        let ctx_slots: Vec<u32> = (0..history.len()).map(&slots_for).collect();
        let mut batch = ForwardBatch::new();
        batch
            .push(&new, &positions, &slots, &ctx_slots, history.len(), true)
            .unwrap();
        let logits = llama.forward(&batch, &pool).unwrap();
        if !pending.is_empty() {
            continue;
        }
        let row = logits.get(0).unwrap().to_vec1::<f32>().unwrap();
        let next = argmax(&row);
        all_logits.push(row);
        out.push(next);
        pending.push(next);
    }
    (out, all_logits)
}

/// Bytes of one 32-token chunk of `model`'s KV at the default precision: the unit the
/// pressure tests size their host budgets in.
pub fn chunk_bytes(model: &Model) -> usize {
    let kv = pensieve::engine::KvPrecision::default();
    32 * model.config().kv_shape().token_bytes(kv)
}

/// The engine of the pressure tests: `mode` under `budgets`, invariants checked after every
/// step, and each conversation keeping its own KV (Pensieve's model): shared openings would
/// relieve the pressure these tests are about (tests/sharing.rs covers shared chunks under
/// pressure).
pub fn pressure_config(
    mode: pensieve::engine::CacheMode,
    budgets: pensieve::engine::Budgets,
) -> pensieve::engine::EngineConfig {
    pensieve::engine::EngineConfig::default()
        .budgets(budgets)
        .mode(mode)
        .check_invariants(true)
        .prefix_sharing(false)
}

/// Asserts that a run under pressure used every tier's mechanism: swap-out, swap-in, host
/// drops and recompute.
pub fn assert_pressure_exercised(stats: &pensieve::engine::EngineStats) {
    assert!(stats.bytes_swapped_out > 0, "no swap-out");
    assert!(stats.bytes_swapped_in > 0, "no swap-in");
    assert!(stats.chunks_dropped_from_host > 0, "no host drop");
    assert!(stats.recomputed_tokens > 0, "no recompute");
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// The three fixed chat prompts of the correctness tests.
pub const PROMPTS: [&str; 3] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
];

/// Greedy generation with candle-transformers' `quantized_llama` on the same file: the
/// independent implementation we compare against. Returns ids and the logits behind each.
pub fn candle_greedy(prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    use candle_core::{Device, Tensor};
    use candle_transformers::models::quantized_llama::ModelWeights;
    let path = pensieve::model::default_model_path();
    let mut file = std::fs::File::open(&path).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let mut model = ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
    let mut ids = Vec::new();
    let mut all_logits = Vec::new();
    let mut input = prompt.to_vec();
    let mut pos = 0;
    while ids.len() < n {
        let x = Tensor::new(input.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = model
            .forward(&x, pos)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        pos += input.len();
        let next = argmax(&logits);
        all_logits.push(logits);
        ids.push(next);
        input = vec![next];
    }
    (ids, all_logits)
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn chat_prompt(model: &Model, user: &str) -> Vec<u32> {
    let text = model
        .render_chat(&[pensieve::model::Message::new("user", user)], true)
        .unwrap();
    model.encode(&text).unwrap()
}

/// Logits at every position of `tokens`, computed in one stateless pass over a KV pool of the
/// engine's default precision (the reference an engine is checked against: its KV goes
/// through the same rounding whether it was computed now or turns ago).
pub fn score_all(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    score_all_with(model, tokens, pensieve::engine::KvPrecision::default())
}

/// [`score_all`] with KV stored at `kv`.
pub fn score_all_with(
    model: &Model,
    tokens: &[u32],
    kv: pensieve::engine::KvPrecision,
) -> Vec<Vec<f32>> {
    let llama = model.transformer();
    let pool = KvPool::new(llama.config().kv_shape(), tokens.len(), kv, llama.device()).unwrap();
    let pos: Vec<u32> = (0..tokens.len() as u32).collect();
    let mut batch = ForwardBatch::new();
    batch
        .push_scored(tokens, &pos, &pos, &pos, pos.len())
        .unwrap();
    llama
        .forward(&batch, &pool)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()
}

/// The GPU to run on, or `None` (said once per binary, naming `what` is skipped) where there
/// is none: GPU tests then pass without checking anything, and say so.
#[cfg(feature = "cuda")]
pub fn cuda_device(what: &str) -> Option<candle_core::Device> {
    static SAID: std::sync::Once = std::sync::Once::new();
    // Creating a CUDA context where no driver is installed aborts: look for the driver first.
    let found = if std::path::Path::new("/proc/driver/nvidia/version").exists() {
        pensieve::model::cuda_device(0).map_err(|e| e.to_string())
    } else {
        Err("no NVIDIA driver".to_string())
    };
    match found {
        Ok(d) => Some(d),
        // On the GPU machine (`scripts/gpu-tests` sets it) a missing GPU is a failure, not a
        // skip.
        Err(why) if std::env::var_os("PENSIEVE_REQUIRE_GPU").is_some() => {
            panic!("{what}: PENSIEVE_REQUIRE_GPU is set but {why}")
        }
        Err(why) => {
            SAID.call_once(|| eprintln!("{what} skipped: {why}"));
            None
        }
    }
}

/// What one turn produced, as its events told.
pub struct TurnRun {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<Option<TokenLogprobs>>,
    pub reason: FinishReason,
    pub stats: TurnStats,
}

/// Submits `turn` and steps until it finishes; events of other turns are dropped.
pub fn run_turn(
    e: &mut Engine,
    conv: ConversationId,
    turn: Turn,
    params: SamplingParams,
) -> TurnRun {
    let id = e.submit(conv, turn, params).unwrap();
    let (mut text, mut tokens, mut logprobs) = (String::new(), Vec::new(), Vec::new());
    loop {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token {
                    request,
                    token,
                    text: t,
                    logprobs: lp,
                    ..
                } if request == id => {
                    text.push_str(&t);
                    tokens.push(token);
                    logprobs.push(lp);
                }
                Event::Finished {
                    request,
                    reason,
                    stats,
                    ..
                } if request == id => {
                    return TurnRun {
                        text,
                        tokens,
                        logprobs,
                        reason,
                        stats,
                    }
                }
                _ => {}
            }
        }
    }
}

/// `count` (user turn, reply) pairs from the end of the ShareGPT dump (the replay samples its
/// front), each side cut to its first 48 tokens.
pub fn held_back_replies(model: &Model, count: usize) -> Vec<(String, String)> {
    let found =
        pensieve::workload::read_sharegpt(&pensieve::workload::default_sharegpt_path(), 1).unwrap();
    let cap = |text: &str| {
        let ids = model.encode(text).unwrap();
        model.decode(&ids[..ids.len().min(48)]).unwrap()
    };
    let samples: Vec<(String, String)> = found
        .conversations
        .iter()
        .rev()
        .filter_map(|c| c.turns.first())
        .filter(|(u, r)| !u.trim().is_empty() && !r.trim().is_empty())
        .take(count)
        .map(|(u, r)| (cap(u), cap(r)))
        .collect();
    assert_eq!(samples.len(), count);
    samples
}

/// Mean negative log-likelihood per token of each reply given its user turn.
pub fn reply_nll(
    model: &Model,
    samples: &[(String, String)],
    kv: pensieve::engine::KvPrecision,
) -> f64 {
    let (mut total, mut count) = (0f64, 0usize);
    for (user, reply) in samples {
        let prompt = model
            .render_chat(&[pensieve::model::Message::new("user", user.clone())], true)
            .unwrap();
        let prompt_ids = model.encode(&prompt).unwrap();
        let reply_ids = model.encode(&format!("{reply}<|im_end|>")).unwrap();
        let ids: Vec<u32> = prompt_ids.iter().chain(&reply_ids).copied().collect();
        let logits = score_all_with(model, &ids, kv);
        for (i, &t) in reply_ids.iter().enumerate() {
            let row = &logits[prompt_ids.len() + i - 1];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            total += lse - row[t as usize] as f64;
            count += 1;
        }
    }
    total / count as f64
}
