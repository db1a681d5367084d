//! Session hints on a tiny random-weight model: a pinned conversation keeps its KV under
//! pressure that evicts the same conversation unpinned; an expected resume keeps a
//! conversation's KV over one that is idle; `release` frees a conversation's KV at once; and
//! unknown or busy conversations get typed errors.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use pensieve::engine::{
    Budgets, CacheMode, ConversationId, ConversationOptions, CostModel, CostProfile, Engine,
    EngineConfig, Event, SamplingParams, Turn, TurnStats,
};
use pensieve::model::Model;
use pensieve::Error;

const CHUNK: usize = 8;

/// An engine of `device_chunks` chunks on the device and `host_chunks` chunks of host memory.
fn engine(device_chunks: usize, host_chunks: usize) -> Engine {
    let model = Model::tiny(7).unwrap();
    let chunk_bytes = model
        .config()
        .kv_shape()
        .token_bytes(pensieve::engine::KvPrecision::F16)
        * CHUNK;
    let config = EngineConfig::default()
        .budgets(
            Budgets::default()
                .device_tokens(device_chunks * CHUNK)
                .host_bytes(host_chunks * chunk_bytes),
        )
        .mode(CacheMode::Tiered)
        .chunk_size(CHUNK)
        .step_token_budget(256)
        .swap_out_threshold(0.0)
        .reserve(0.0)
        .cost_profile(CostProfile::Fixed(CostModel::new(1e-4, 1e-7)))
        .check_invariants(true);
    Engine::with_model(model, config).unwrap()
}

/// Runs one turn of `n` raw tokens (8 generated); returns the generated tokens and stats.
fn turn(e: &mut Engine, conv: ConversationId, n: usize, seed: u32) -> (Vec<u32>, TurnStats) {
    let tokens: Vec<u32> = (0..n as u32).map(|i| 40 + (i * 7 + seed) % 60).collect();
    let params = SamplingParams::greedy().max_tokens(8).ignore_eos(true);
    let id = e.submit(conv, Turn::Tokens(tokens), params).unwrap();
    let mut out = Vec::new();
    loop {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { request, token, .. } if request == id => out.push(token),
                Event::Finished { request, stats, .. } if request == id => return (out, stats),
                _ => {}
            }
        }
    }
}

/// A's history, then pressure from other conversations, then A's next turn.
fn pressure(pin: bool) -> (Vec<u32>, TurnStats) {
    let mut e = engine(8, 4);
    let a = e.open(ConversationOptions::default()).unwrap();
    if pin {
        e.pin(a, true).unwrap();
    }
    turn(&mut e, a, 24, 0);
    for k in 0..4 {
        let c = e.open(ConversationOptions::default()).unwrap();
        turn(&mut e, c, 40, k + 1);
    }
    turn(&mut e, a, 8, 9)
}

#[test]
fn a_pinned_conversation_keeps_its_kv_under_pressure_that_evicts_it_unpinned() {
    let (plain_out, plain) = pressure(false);
    let (pinned_out, pinned) = pressure(true);
    assert!(plain.recomputed_tokens > 0, "{plain:?}");
    assert_eq!(pinned.recomputed_tokens, 0, "{pinned:?}");
    assert!(pinned.reused_tokens >= 24, "{pinned:?}");
    // Recomputed or kept, the KV is the same: so are the outputs.
    assert_eq!(plain_out, pinned_out);
}

/// A and B have 4 chunks of history each, A's older; then C needs 6 of the 10 device chunks
/// (no host tier): one of them loses its KV. Returns A's and B's next turns (after C closes).
fn resume(hint: bool) -> (TurnStats, TurnStats) {
    let mut e = engine(10, 0);
    let a = e.open(ConversationOptions::default()).unwrap();
    let b = e.open(ConversationOptions::default()).unwrap();
    turn(&mut e, a, 24, 0);
    std::thread::sleep(Duration::from_millis(100));
    turn(&mut e, b, 24, 1);
    std::thread::sleep(Duration::from_millis(300));
    if hint {
        // A is expected back sooner than B's idle time suggests B is.
        e.expect_resume(a, Duration::from_millis(20)).unwrap();
    }
    let c = e.open(ConversationOptions::default()).unwrap();
    turn(&mut e, c, 40, 2);
    e.close(c).unwrap();
    (turn(&mut e, a, 8, 3).1, turn(&mut e, b, 8, 4).1)
}

#[test]
fn an_expected_resume_keeps_kv_over_a_conversation_that_is_merely_idle() {
    // Without a hint the older conversation goes first; with one it is kept and the other
    // one goes.
    let (a, b) = resume(false);
    assert!(
        a.recomputed_tokens > 0 && b.recomputed_tokens == 0,
        "{a:?} {b:?}"
    );
    let (a, b) = resume(true);
    assert!(
        a.recomputed_tokens == 0 && b.recomputed_tokens > 0,
        "{a:?} {b:?}"
    );
}

#[test]
fn release_frees_a_conversations_kv_now_and_its_next_turn_recomputes_it() {
    let mut e = engine(16, 4);
    let a = e.open(ConversationOptions::default()).unwrap();
    turn(&mut e, a, 24, 0);
    let mut f = engine(16, 4);
    let b = f.open(ConversationOptions::default()).unwrap();
    turn(&mut f, b, 24, 0);
    assert!(e.stats().device_slots_used > 0);
    e.release(a).unwrap();
    assert_eq!(e.stats().device_slots_used, 0);
    let (released, stats) = turn(&mut e, a, 8, 1);
    let (kept, _) = turn(&mut f, b, 8, 1);
    assert_eq!(stats.reused_tokens, 0);
    // The history's KV: 24 prompt tokens and 7 of the 8 reply tokens (the last one had not
    // been run through the model yet; it goes with the new prompt).
    assert_eq!(stats.recomputed_tokens, 24 + 7);
    assert_eq!(released, kept);
}

#[test]
fn hints_on_unknown_or_busy_conversations_are_typed_errors() {
    let mut e = engine(16, 4);
    let a = e.open(ConversationOptions::default()).unwrap();
    e.close(a).unwrap();
    assert!(matches!(e.pin(a, true), Err(Error::UnknownConversation(_))));
    let hint = e.expect_resume(a, Duration::from_secs(1));
    assert!(matches!(hint, Err(Error::UnknownConversation(_))));
    assert!(matches!(e.release(a), Err(Error::UnknownConversation(_))));
    let b = e.open(ConversationOptions::default()).unwrap();
    e.submit(b, Turn::Tokens(vec![40, 41]), SamplingParams::greedy())
        .unwrap();
    assert!(matches!(e.release(b), Err(Error::ConversationBusy(_))));
}
