//! The default weight path (packed weights, pensieve's own matmul) on the real SmolLM2 weights:
//! a row's logits are bit-identical alone and in mixed batches of several sizes; perplexity on
//! held-back ShareGPT replies is within 1% of the f32 reference; a prompt longer than one step
//! is served (its early chunks ask the output layer for no rows).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use pensieve::attention::KvPool;
use pensieve::engine::KvPrecision;
use pensieve::model::{ForwardBatch, Model, WeightFormat};

/// Logits of row `which` of a batch: the decode of sequence A (prefilled at slots 0..30)
/// beside `others` fresh sequences of the given lengths, A's row placed at `at`.
fn decode_in_batch(model: &Model, pool: &KvPool, others: &[usize], at: usize) -> Vec<u32> {
    let ctx: Vec<u32> = (0..=30).collect();
    let mut batch = ForwardBatch::new();
    let mut pushed_a = false;
    let push_a = |batch: &mut ForwardBatch| {
        batch
            .push(&[1004], &[30], &[30], &ctx, ctx.len(), true)
            .unwrap();
    };
    for (j, &len) in others.iter().enumerate() {
        if j == at {
            push_a(&mut batch);
            pushed_a = true;
        }
        // Each other sequence lives in its own 128 slots, far from A's.
        let base = 1024 + 128 * j as u32;
        let tokens: Vec<u32> = (0..len as u32)
            .map(|t| 200 + (t * 37 + j as u32) % 5000)
            .collect();
        let pos: Vec<u32> = (0..len as u32).collect();
        let slots: Vec<u32> = pos.iter().map(|p| base + p).collect();
        batch
            .push(&tokens, &pos, &slots, &slots, pos.len(), true)
            .unwrap();
    }
    if !pushed_a {
        push_a(&mut batch);
    }
    let logits = model.transformer().forward(&batch, pool).unwrap();
    let row = at.min(others.len());
    logits
        .get(row)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn real_model_a_row_is_bit_identical_alone_and_in_mixed_batches() {
    let model = common::real_model(WeightFormat::default());
    let pool = KvPool::new(
        model.config().kv_shape(),
        16 * 1024,
        pensieve::engine::KvPrecision::F32,
        model.transformer().device(),
    )
    .unwrap();
    // Prefill sequence A (30 tokens) once.
    let prompt = common::chat_prompt(&model, "Tell me about the moon.");
    let a: Vec<u32> = prompt.iter().copied().cycle().take(30).collect();
    let pos: Vec<u32> = (0..30).collect();
    let mut batch = ForwardBatch::new();
    batch.push(&a, &pos, &pos, &pos, pos.len(), false).unwrap();
    model.transformer().forward(&batch, &pool).unwrap();

    let alone = decode_in_batch(&model, &pool, &[], 0);
    let cases: [(&[usize], usize); 7] = [
        (&[1], 0),
        (&[1], 1),
        (&[1, 1, 1], 1),
        (&[40, 1, 1, 1, 1, 1, 1, 1], 3),
        (&[1; 7], 7),
        (&[1; 63], 20),
        (&[100, 1, 60, 1, 1], 2),
    ];
    for (others, at) in cases {
        let got = decode_in_batch(&model, &pool, others, at);
        assert!(got == alone, "row logits changed beside {others:?} at {at}");
    }
}

#[test]
fn real_model_packed_perplexity_is_within_one_percent_of_f32() {
    let f32_model = common::real_model(WeightFormat::F32);
    let samples = common::held_back_replies(&f32_model, 100);
    // The reference computes and keeps everything in f32; the default keeps packed weights,
    // 8-bit activations and an f16 KV cache.
    let reference = common::reply_nll(&f32_model, &samples, KvPrecision::F32);
    drop(f32_model);
    let packed = common::reply_nll(
        &common::real_model(WeightFormat::Packed),
        &samples,
        KvPrecision::default(),
    );
    let (ppl_ref, ppl) = (reference.exp(), packed.exp());
    eprintln!("perplexity over 100 replies: f32 {ppl_ref:.4}, default (packed, f16 KV) {ppl:.4}");
    assert!(
        (ppl / ppl_ref - 1.0).abs() < 0.01,
        "f32 {ppl_ref}, packed {ppl}"
    );
}

/// A prompt longer than one step is prefilled in chunks; the chunks before the last need no
/// logits, so the output layer runs on zero rows.
#[test]
fn real_model_packed_serves_a_prompt_longer_than_one_step() {
    use pensieve::engine::{
        ConversationOptions, Engine, EngineConfig, FinishReason, SamplingParams, Turn,
    };
    let model = common::real_model(WeightFormat::default());
    let config = EngineConfig::default()
        .step_token_budget(64)
        .check_invariants(true);
    let mut engine = Engine::with_model(model, config).unwrap();
    let conv = engine.open(ConversationOptions::default()).unwrap();
    let prompt: Vec<u32> = (0..300).map(|i| 100 + (i * 7919) % 40_000).collect();
    let params = SamplingParams::greedy().max_tokens(8).ignore_eos(true);
    let (reason, stats) = engine
        .run_turn(conv, Turn::Tokens(prompt), params, |_| {})
        .unwrap();
    assert_eq!(reason, FinishReason::Length);
    assert_eq!(stats.prefilled_tokens, 300);
    assert_eq!(stats.output_tokens, 8);
}
