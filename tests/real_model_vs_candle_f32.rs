//! Our graph on the real SmolLM2 weights, dequantized to f32, against candle-transformers'
//! `quantized_llama` run with `CANDLE_DEQUANTIZE_ALL` (also f32 weights): like for like, so the
//! only differences are attention and reduction order.
//!
//! candle reads `CANDLE_DEQUANTIZE_ALL` once per thread, so this file sets it before loading and
//! the quantized comparison lives in its own test binary.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{candle_greedy, chat_prompt, greedy, max_abs_diff, PROMPTS};
use pensieve::model::WeightFormat;

/// Logit tolerance: max absolute difference over the vocabulary (logits are O(10); observed
/// differences are ~4e-5 against candle and ~1e-4 between chunked and one-shot prefill).
const LOGIT_TOL: f32 = 1e-3;

#[test]
fn real_model_greedy_matches_candle_quantized_llama_dequantized() {
    // SAFETY: this binary's other tests read the environment only through `std::env`, which
    // locks it against this write, and no C code of theirs reads it.
    unsafe { std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1") };
    let model = common::real_model(WeightFormat::F32);
    for user in PROMPTS {
        let prompt = chat_prompt(&model, user);
        let (ours, our_logits) = greedy(&model, &prompt, 32, usize::MAX, |i| i as u32, 512);
        let (theirs, their_logits) = candle_greedy(&prompt, 32);
        assert_eq!(ours, theirs, "greedy tokens differ for {user:?}");
        let first = max_abs_diff(&our_logits[0], &their_logits[0]);
        eprintln!("{user:?}: last-position logits max |diff| = {first:.2e}");
        assert!(first < LOGIT_TOL, "prompt logits differ by {first}");
        let worst = our_logits
            .iter()
            .zip(&their_logits)
            .map(|(a, b)| max_abs_diff(a, b))
            .fold(0.0, f32::max);
        assert!(worst < LOGIT_TOL, "decode logits differ by {worst}");
    }
}

#[test]
fn real_model_scattered_slots_equal_full_recompute() {
    let model = common::real_model(WeightFormat::F32);
    let n_slots = 1024;
    // A permutation of the pool: consecutive positions land far apart.
    let scattered = |i: usize| ((i * 389 + 17) % n_slots) as u32;
    for user in PROMPTS {
        let prompt = chat_prompt(&model, user);
        let (stateful, stateful_logits) = greedy(&model, &prompt, 24, 7, scattered, n_slots);
        // Stateless: every token recomputes the whole history in one pass.
        let mut history = prompt.clone();
        let mut recompute = Vec::new();
        let mut worst = 0f32;
        for (step, logits) in stateful_logits.iter().enumerate() {
            let (next, full_logits) =
                greedy(&model, &history, 1, usize::MAX, |i| i as u32, n_slots);
            recompute.push(next[0]);
            let d = max_abs_diff(logits, &full_logits[0]);
            assert!(d < LOGIT_TOL, "step {step}: logits differ by {d}");
            worst = worst.max(d);
            history.push(stateful[step]);
        }
        eprintln!("{user:?}: stateful vs recompute logits max |diff| = {worst:.2e}");
        assert_eq!(stateful, recompute, "for {user:?}");
    }
}

#[test]
fn real_model_answers_in_english() {
    let model = common::real_model(WeightFormat::F32);
    let prompt = chat_prompt(&model, PROMPTS[0]);
    let (ids, _) = greedy(&model, &prompt, 16, usize::MAX, |i| i as u32, 256);
    let text = model.decode(&ids).unwrap();
    assert!(text.contains("Paris"), "answer was {text:?}");
}
