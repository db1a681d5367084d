//! The core property on Gemma 3 270M (real weights, sliding-window layers): conversations whose
//! contexts grow past the 512-token window, interleaved under `Tiered` with budgets small enough
//! that swap-out, swap-in, host drops and recompute all happen, give the same greedy tokens as
//! `Stateless`, token for token; the tiered engine drafts tokens from each conversation's
//! history and verifies them (speculative decoding), the stateless one does not. Chat through the built-in `gemma` template (the file is a base
//! model and ships none). Needs `scripts/fetch-assets --model gemma3-270m`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::llamacpp;
use pensieve::engine::{
    Budgets, CacheMode, ConversationOptions, Engine, EngineStats, Event, FinishReason,
    SamplingParams, Speculation, Turn,
};
use pensieve::model::{LoadOptions, Model, ModelSource};

const CONVERSATIONS: usize = 6;
const TURNS: usize = 3;
const OUTPUT: usize = 64;

fn run(
    model: &Arc<Model>,
    mode: CacheMode,
    budgets: Budgets,
    speculation: Speculation,
) -> (Vec<Vec<u32>>, EngineStats) {
    let config = common::pressure_config(mode, budgets).speculation(speculation);
    let mut e = Engine::with_model(model.clone(), config).unwrap();
    let texts = llamacpp::texts();
    let convs: Vec<_> = (0..CONVERSATIONS)
        .map(|_| e.open(ConversationOptions::default()).unwrap())
        .collect();
    for turn in 0..TURNS {
        for (i, &c) in convs.iter().enumerate() {
            // Six ShareGPT messages per turn: about 270 tokens.
            let k = (i * TURNS + turn) * 6;
            let user = texts[k..k + 6].join("\n\n");
            let params = SamplingParams::greedy().max_tokens(OUTPUT).ignore_eos(true);
            e.submit(c, Turn::user(user), params).unwrap();
        }
        while e.has_work() {
            for ev in e.step().unwrap() {
                if let Event::Finished { reason, .. } = ev {
                    assert_eq!(reason, FinishReason::Length);
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

fn gemma() -> Arc<Model> {
    let source = ModelSource::Gguf(llamacpp::gemma_path());
    let model = Model::load(&source, &LoadOptions::default())
        .unwrap()
        .with_builtin_template("gemma")
        .unwrap();
    Arc::new(model)
}

/// Runs `turn` on `c` to its end, greedily, `OUTPUT` tokens.
fn answer(e: &mut Engine, c: pensieve::ConversationId, user: String) {
    let params = SamplingParams::greedy().max_tokens(OUTPUT).ignore_eos(true);
    e.submit(c, Turn::user(user), params).unwrap();
    while e.has_work() {
        e.step().unwrap();
    }
}

#[test]
fn gemma3_tiered_under_pressure_equals_stateless_past_the_window() {
    let model = gemma();
    let chunk_bytes = common::chunk_bytes(&model);
    let (tiered, stats) = run(
        &model,
        CacheMode::Tiered,
        Budgets::default()
            .device_tokens(1024)
            .host_bytes(60 * chunk_bytes),
        Speculation::default(),
    );
    eprintln!("tiered stats: {stats:?}");
    common::assert_pressure_exercised(&stats);
    assert!(stats.accepted_tokens > 0, "no draft was taken");
    let longest = tiered.iter().map(Vec::len).max().unwrap();
    assert!(
        longest > 700,
        "contexts of {longest} tokens do not pass the window well"
    );
    let (stateless, _) = run(
        &model,
        CacheMode::Stateless,
        Budgets::default().device_tokens(8 * 1024).host_bytes(0),
        Speculation::off(),
    );
    for (i, (t, s)) in tiered.iter().zip(&stateless).enumerate() {
        let first = t.iter().zip(s).position(|(a, b)| a != b);
        assert!(
            first.is_none() && t.len() == s.len(),
            "conversation {i} ({} tokens) diverges at {first:?}",
            t.len()
        );
    }
}

/// A branch from an early turn of a long conversation whose early chunks left the device
/// narrow (no window of its later turns read them): the branch's first turn reads them through
/// its sliding windows, so they are recomputed, and its tokens are a stateless run's.
#[test]
fn gemma3_a_branch_before_the_narrow_chunks_equals_stateless() {
    let model = gemma();
    let texts = llamacpp::texts();
    let user = |k: usize| texts[k * 6..k * 6 + 6].join("\n\n");
    let chunk_bytes = common::chunk_bytes(&model);
    let budgets = Budgets::default()
        .device_tokens(1536)
        .host_bytes(200 * chunk_bytes);
    let config = pensieve::engine::EngineConfig::default()
        .budgets(budgets)
        .check_invariants(true);
    let mut e = Engine::with_model(model.clone(), config).unwrap();
    let a = e.open(ConversationOptions::default()).unwrap();
    for k in 0..4 {
        answer(&mut e, a, user(k));
    }
    eprintln!("{} tokens", e.tokens(a).unwrap().len());
    // Another conversation's long turns push `a` off the device.
    let b = e.open(ConversationOptions::default()).unwrap();
    for k in 4..7 {
        answer(&mut e, b, user(k));
    }
    assert!(e.stats().narrow_swap_outs > 0, "no chunk left narrow");
    let branch = e.fork(a, Some(1)).unwrap();
    answer(&mut e, branch, user(9));
    let stats = e.stats();
    eprintln!("tiered stats: {stats:?}");
    assert!(stats.narrow_recomputed > 0, "no narrow chunk recomputed");

    let stateless = pensieve::engine::EngineConfig::default()
        .budgets(Budgets::default().device_tokens(4096).host_bytes(0))
        .mode(CacheMode::Stateless);
    let mut s = Engine::with_model(model, stateless).unwrap();
    let c = s.open(ConversationOptions::default()).unwrap();
    answer(&mut s, c, user(0));
    answer(&mut s, c, user(9));
    assert_eq!(e.tokens(branch).unwrap(), s.tokens(c).unwrap());
}
