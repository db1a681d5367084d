//! `WeightFormat::Mixed` (f16 weights for one-row passes, f32 otherwise) against the f32 path
//! on the real weights: greedy outputs identical, or the first divergence at a near-tie of the
//! f32 reference; logits within a stated tolerance.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{chat_prompt, greedy, max_abs_diff, PROMPTS};
use pensieve::model::WeightFormat;

/// f16 weights and activations move logits by a few 1e-2 at most on this model.
const MIXED_LOGIT_TOL: f32 = 0.1;

#[test]
fn real_model_mixed_weights_match_f32() {
    let f32_model = common::real_model(WeightFormat::F32);
    let mixed = common::real_model(WeightFormat::Mixed);
    let mut worst = 0f32;
    for user in PROMPTS {
        let prompt = chat_prompt(&f32_model, user);
        let (a, la) = greedy(&f32_model, &prompt, 24, usize::MAX, |i| i as u32, 512);
        let (b, lb) = greedy(&mixed, &prompt, 24, usize::MAX, |i| i as u32, 512);
        let same = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        for i in 0..same.min(a.len()) {
            worst = worst.max(max_abs_diff(&la[i], &lb[i]));
        }
        if same < a.len() {
            let mut row = la[same].clone();
            row.sort_by(|x, y| y.total_cmp(x));
            let margin = row[0] - row[1];
            eprintln!("{user:?}: diverges at {same} on margin {margin:.3}");
            assert!(
                margin < MIXED_LOGIT_TOL,
                "divergence at {same} with margin {margin}"
            );
        }
    }
    eprintln!("mixed vs f32 logits max |diff| = {worst:.3e}");
    assert!(worst < MIXED_LOGIT_TOL, "logits differ by {worst}");
}

/// A prompt longer than one step is prefilled in chunks; the chunks before the last need no
/// logits, so the output layer runs on zero rows, which the small-pass path must accept.
#[test]
fn real_model_mixed_weights_serve_a_prompt_longer_than_one_step() {
    use pensieve::engine::{
        ConversationOptions, Engine, EngineConfig, FinishReason, SamplingParams, Turn,
    };
    let model = common::real_model(WeightFormat::Mixed);
    let config = EngineConfig {
        step_token_budget: 64,
        ..EngineConfig::default()
    };
    let mut engine = Engine::with_model(model, config).unwrap();
    let conv = engine.open(ConversationOptions::default()).unwrap();
    let prompt: Vec<u32> = (0..300).map(|i| 100 + (i * 7919) % 40_000).collect();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy().with_max_tokens(8)
    };
    let (reason, stats) = engine
        .run_turn(conv, Turn::Tokens(prompt), params, |_| {})
        .unwrap();
    assert_eq!(reason, FinishReason::Length);
    assert_eq!(stats.prefilled_tokens, 300);
    assert_eq!(stats.output_tokens, 8);
}
