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
