//! The core property on the real SmolLM2 weights under the default weight format: 64
//! multi-turn conversations interleaved under `Tiered`, with budgets small enough that
//! swap-out, swap-in, host drops and recompute all happen, give the same greedy outputs as
//! `Stateless`; with f16 KV and with KV in 8 and 4 bits (both modes quantize each token's K and
//! V once, as it is written, so the host tier's bytes are the device's).
//!
//! The default weight path is batch-invariant (a row's logits do not depend on what shares its
//! step, `tests/real_model_packed.rs`), so the rule is strict: every conversation's tokens are
//! identical, with no near-tie exemption. A divergence is reported with the stateless
//! reference's top-2 logit gap at that position, to tell a broken invariant from a near-tie.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use pensieve::engine::{
    Budgets, CacheMode, ConversationOptions, CostProfile, Engine, EngineStats, KvPrecision,
    SamplingParams, Turn,
};
use pensieve::model::{Model, WeightFormat};

const CONVERSATIONS: usize = 64;
const TURNS: usize = 3;
const QUESTIONS: [&str; 8] = [
    "What is the capital of France?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "What color is the sky on a clear day?",
    "Give me a word that rhymes with cat.",
    "What is two plus two?",
    "Which planet is known as the red planet?",
    "What do bees make?",
];

fn run(
    model: &std::sync::Arc<Model>,
    mode: CacheMode,
    budgets: Budgets,
    kv: KvPrecision,
) -> (Vec<Vec<u32>>, EngineStats) {
    let config = common::pressure_config(mode, budgets)
        .step_token_budget(256)
        .kv_precision(kv)
        .cost_profile(CostProfile::Measure);
    let mut e = Engine::with_model(model.clone(), config).unwrap();
    let convs: Vec<_> = (0..CONVERSATIONS)
        .map(|_| e.open(ConversationOptions::default()).unwrap())
        .collect();
    for turn in 0..TURNS {
        for (i, &c) in convs.iter().enumerate() {
            let q = QUESTIONS[(i + turn * 3) % QUESTIONS.len()];
            let params = SamplingParams::greedy().max_tokens(8).ignore_eos(true);
            e.submit(c, Turn::user(q), params).unwrap();
        }
        while e.has_work() {
            for ev in e.step().unwrap() {
                if let pensieve::engine::Event::Finished { reason, .. } = ev {
                    assert_eq!(reason, pensieve::engine::FinishReason::Length);
                }
            }
        }
    }
    let out = convs
        .iter()
        .map(|&c| e.tokens(c).unwrap().to_vec())
        .collect();
    (out, e.stats())
}

fn top2_margin(row: &[f32]) -> f32 {
    let mut v = row.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

#[test]
fn real_model_tiered_under_pressure_equals_stateless() {
    tiered_equals_stateless(KvPrecision::default());
}

#[test]
fn real_model_tiered_under_pressure_equals_stateless_with_8_bit_kv() {
    tiered_equals_stateless(KvPrecision::Q8);
}

#[test]
fn real_model_tiered_under_pressure_equals_stateless_with_4_bit_kv() {
    tiered_equals_stateless(KvPrecision::Q4);
}

fn tiered_equals_stateless(kv: KvPrecision) {
    let model = std::sync::Arc::new(common::real_model(WeightFormat::default()));
    let chunk_bytes = 32 * model.config().kv_shape().token_bytes(kv);
    // 32 blocks of 32 on the device and 96 chunks on the host, for 64 x 2 chunks of history
    // after the first turn and 64 x 4 after the third: hits at first, then host drops.
    let (tiered, stats) = run(
        &model,
        CacheMode::Tiered,
        Budgets::default()
            .device_tokens(1024)
            .host_bytes(96 * chunk_bytes),
        kv,
    );
    eprintln!("tiered stats: {stats:?}");
    common::assert_pressure_exercised(&stats);
    assert!(stats.reused_host_tokens > 0, "no host hit");
    let (stateless, _) = run(
        &model,
        CacheMode::Stateless,
        Budgets::default().device_tokens(16 * 1024).host_bytes(0),
        kv,
    );
    let mut report = Vec::new();
    for (i, (t, s)) in tiered.iter().zip(&stateless).enumerate() {
        let Some(p) = t.iter().zip(s).position(|(a, b)| a != b) else {
            assert_eq!(t.len(), s.len(), "conversation {i}");
            continue;
        };
        let reference = common::score_all(&model, &s[..p]);
        let margin = top2_margin(&reference[p - 1]);
        report.push((i, p, margin));
    }
    eprintln!(
        "{} of {CONVERSATIONS} conversations diverge (conversation, position, top-2 gap): {report:?}",
        report.len()
    );
    assert!(
        report.is_empty(),
        "Tiered and Stateless diverge: {report:?}"
    );
}
