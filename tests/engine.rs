//! The engine's mechanism on a tiny random-weight model: API behaviour, typed errors and the
//! thread-safe handle (random operation sequences: `tests/engine_proptest.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;

use pensieve::engine::{
    Budgets, CacheMode, ConversationOptions, CostProfile, Engine, EngineConfig, Event,
    FinishReason, RequestId, SamplingParams, Turn,
};
use pensieve::kv::CostModel;
use pensieve::model::Model;
use pensieve::Error;

fn config(mode: CacheMode, device_tokens: usize, host_bytes: usize) -> EngineConfig {
    EngineConfig::default()
        .budgets(
            Budgets::default()
                .device_tokens(device_tokens)
                .host_bytes(host_bytes),
        )
        .mode(mode)
        .chunk_size(8)
        .step_token_budget(64)
        .cost_profile(CostProfile::Fixed(CostModel::new(1e-4, 1e-7)))
        .check_invariants(true)
}

fn engine(mode: CacheMode, device_tokens: usize, host_bytes: usize) -> Engine {
    engine_of(
        pensieve::model::Model::tiny(7).unwrap(),
        mode,
        device_tokens,
        host_bytes,
    )
}

fn engine_of(model: Model, mode: CacheMode, device_tokens: usize, host_bytes: usize) -> Engine {
    Engine::with_model(model, config(mode, device_tokens, host_bytes)).unwrap()
}

/// Steps until no work is left; returns the events.
fn drain(e: &mut Engine) -> Vec<Event> {
    let mut out = Vec::new();
    let mut guard = 0;
    while e.has_work() {
        out.extend(e.step().unwrap());
        e.check_invariants().unwrap();
        guard += 1;
        assert!(guard < 10_000, "engine did not finish");
    }
    out
}

fn finished(events: &[Event]) -> HashMap<RequestId, (FinishReason, pensieve::engine::TurnStats)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Finished {
                request,
                reason,
                stats,
                ..
            } => Some((*request, (reason.clone(), stats.clone()))),
            _ => None,
        })
        .collect()
}

fn params(n: usize) -> SamplingParams {
    SamplingParams::greedy().max_tokens(n).ignore_eos(true)
}

#[test]
fn second_turn_prefills_only_its_new_tokens() {
    let mut e = engine(CacheMode::Tiered, 1024, 1 << 20);
    let c = e.open(ConversationOptions::default()).unwrap();
    let (r1, s1) = e
        .run_turn(c, Turn::user("hello there"), params(5), |_| {})
        .unwrap();
    assert_eq!(r1, FinishReason::Length);
    assert_eq!(
        (s1.reused_tokens, s1.prefilled_tokens),
        (0, s1.prompt_tokens)
    );
    let history = e.tokens(c).unwrap().len();
    let (_, s2) = e
        .run_turn(c, Turn::user("and again"), params(5), |_| {})
        .unwrap();
    // Everything but the previous reply's last token (sampled, never fed back) is reused.
    assert_eq!(s2.reused_tokens, history - 1);
    assert_eq!(s2.prefilled_tokens, s2.prompt_tokens + 1);
    assert_eq!(s2.recomputed_tokens, 0);
    // Stateless re-prefills the whole history every turn.
    let mut s = engine(CacheMode::Stateless, 1024, 0);
    let c = s.open(ConversationOptions::default()).unwrap();
    s.run_turn(c, Turn::user("hello there"), params(5), |_| {})
        .unwrap();
    let (_, s2) = s
        .run_turn(c, Turn::user("and again"), params(5), |_| {})
        .unwrap();
    assert_eq!(s2.reused_tokens, 0);
    assert_eq!(s2.prefilled_tokens, history + s2.prompt_tokens);
}

#[test]
fn tiered_outputs_equal_stateless_under_pressure_on_the_tiny_model() {
    tiered_equals_stateless_under_pressure(&|| Model::tiny(7).unwrap());
}

/// Routing is per token: a mixture's conversation reuses its KV as a dense model's does.
#[test]
fn tiered_outputs_equal_stateless_under_pressure_on_a_tiny_mixture_of_experts() {
    tiered_equals_stateless_under_pressure(&|| Model::tiny_experts(7).unwrap());
}

/// Sinks, biases and sliding windows change nothing of what a conversation keeps.
#[test]
fn tiered_outputs_equal_stateless_under_pressure_on_a_tiny_gpt_oss() {
    tiered_equals_stateless_under_pressure(&|| Model::tiny_gpt_oss(7).unwrap());
}

fn tiered_equals_stateless_under_pressure(model: &dyn Fn() -> Model) {
    // 12 conversations of ~170 tokens in 30 device blocks of 8 tokens and 40 host chunks:
    // swaps, drops and recomputes all happen.
    let run = |mode: CacheMode, device: usize, host: usize| {
        let mut e = engine_of(model(), mode, device, host);
        let convs: Vec<_> = (0..12)
            .map(|_| e.open(ConversationOptions::default()).unwrap())
            .collect();
        for turn in 0..3 {
            for (i, &c) in convs.iter().enumerate() {
                e.submit(
                    c,
                    Turn::user(format!("turn {turn} of conversation {i}")),
                    params(6),
                )
                .unwrap();
            }
            drain(&mut e);
        }
        let outputs: Vec<Vec<u32>> = convs
            .iter()
            .map(|&c| e.tokens(c).unwrap().to_vec())
            .collect();
        (outputs, e.stats())
    };
    let (tiered, stats) = run(CacheMode::Tiered, 240, 40 * 8 * 256);
    let (stateless, _) = run(CacheMode::Stateless, 4096, 0);
    assert_eq!(tiered, stateless);
    assert!(
        stats.bytes_swapped_out > 0 && stats.bytes_swapped_in > 0,
        "{stats:?}"
    );
    assert!(
        stats.chunks_dropped_from_host + stats.chunks_dropped_from_device > 0,
        "{stats:?}"
    );
    assert!(stats.recomputed_tokens > 0, "{stats:?}");
}

#[test]
fn bad_input_gets_typed_errors_and_the_engine_keeps_serving() {
    let mut e = engine(CacheMode::Tiered, 256, 1 << 20);
    let c = e
        .open(ConversationOptions::default().system("be brief"))
        .unwrap();
    let other = e.open(ConversationOptions::default()).unwrap();
    let busy = e
        .submit(other, Turn::user("keep going"), params(20))
        .unwrap();
    // Ids are opaque: an unknown one is one closed.
    let gone = e.open(ConversationOptions::default()).unwrap();
    e.close(gone).unwrap();
    assert!(matches!(
        e.submit(gone, Turn::user("x"), params(3)),
        Err(Error::UnknownConversation(c)) if c == gone
    ));
    assert!(matches!(
        e.submit(c, Turn::user("   "), params(3)),
        Err(Error::EmptyTurn)
    ));
    assert!(matches!(
        e.submit(c, Turn::Tokens(vec![]), params(3)),
        Err(Error::EmptyTurn)
    ));
    assert!(matches!(
        e.submit(c, Turn::Tokens(vec![100_000]), params(3)),
        Err(Error::TokenOutOfVocab { .. })
    ));
    assert!(matches!(
        e.submit(c, Turn::user("x"), params(0)),
        Err(Error::InvalidParams {
            param: "max_tokens",
            ..
        })
    ));
    assert!(matches!(
        e.submit(other, Turn::user("x"), params(3)),
        Err(Error::ConversationBusy(_))
    ));
    // Prompt beyond the model's 2048-token window.
    let long = "word ".repeat(500);
    assert!(matches!(
        e.submit(c, Turn::user(long.clone()), params(3)),
        Err(Error::ContextOverflow { .. })
    ));
    // Truncation keeps the end of the prompt instead.
    let mut t = Engine::with_model(
        pensieve::model::Model::tiny(7).unwrap(),
        config(CacheMode::Tiered, 4096, 0)
            .overflow(pensieve::engine::OverflowPolicy::TruncatePrompt),
    )
    .unwrap();
    let tc = t.open(ConversationOptions::default()).unwrap();
    let (_, st) = t.run_turn(tc, Turn::user(long), params(3), |_| {}).unwrap();
    assert_eq!(st.prompt_tokens, 2047);
    // The device budget in bytes: 2 layers x 2 x 2 kv heads x 8 dims x 2 bytes (f16, the
    // default) = 128 per token; f32 takes twice that.
    let bytes = config(CacheMode::Tiered, 0, 0).budgets(
        Budgets::default()
            .device_tokens(0)
            .device_bytes(64 * 256)
            .host_bytes(0),
    );
    let by_bytes = Engine::with_model(pensieve::model::Model::tiny(7).unwrap(), bytes.clone());
    assert_eq!(by_bytes.unwrap().stats().device_slots_total, 128);
    let f32_kv = bytes.kv_precision(pensieve::engine::KvPrecision::F32);
    let by_bytes = Engine::with_model(pensieve::model::Model::tiny(7).unwrap(), f32_kv).unwrap();
    assert_eq!(by_bytes.stats().device_slots_total, 64);
    let too_small = config(CacheMode::Tiered, 0, 0).budgets(
        Budgets::default()
            .device_tokens(0)
            .device_bytes(100)
            .host_bytes(0),
    );
    assert!(matches!(
        Engine::with_model(pensieve::model::Model::tiny(7).unwrap(), too_small),
        Err(Error::InvalidConfig {
            field: "budgets",
            ..
        })
    ));
    // Drafts looked up by runs of at least 5 tokens and at most 4: refused by name.
    let lookup = pensieve::engine::Speculation::default().min_ngram(5);
    assert!(matches!(
        Engine::with_model(
            pensieve::model::Model::tiny(7).unwrap(),
            config(CacheMode::Tiered, 64, 0).speculation(lookup),
        ),
        Err(Error::InvalidConfig {
            field: "speculation",
            ..
        })
    ));
    // A budget too small for one request.
    let mut small = engine(CacheMode::Tiered, 16, 0);
    let sc = small.open(ConversationOptions::default()).unwrap();
    assert!(matches!(
        small.submit(
            sc,
            Turn::user("a prompt longer than sixteen tokens"),
            params(3)
        ),
        Err(Error::BudgetTooSmall { .. })
    ));
    // Cancel of a finished request.
    let events = drain(&mut e);
    assert_eq!(finished(&events)[&busy].0, FinishReason::Length);
    assert!(matches!(e.cancel(busy), Err(Error::UnknownRequest(_))));
    // The system prompt conversation still works.
    let (reason, _) = e.run_turn(c, Turn::user("hi"), params(2), |_| {}).unwrap();
    assert_eq!(reason, FinishReason::Length);
    assert!(matches!(e.close(gone), Err(Error::UnknownConversation(_))));
}

#[test]
fn cancel_and_close_release_everything() {
    let mut e = engine(CacheMode::Tiered, 256, 1 << 20);
    let a = e.open(ConversationOptions::default()).unwrap();
    let b = e.open(ConversationOptions::default()).unwrap();
    let ra = e.submit(a, Turn::user("first"), params(50)).unwrap();
    let rb = e.submit(b, Turn::user("second"), params(4)).unwrap();
    e.step().unwrap();
    e.cancel(ra).unwrap();
    let events = drain(&mut e);
    let f = finished(&events);
    assert_eq!(f[&ra].0, FinishReason::Cancelled);
    assert_eq!(f[&rb].0, FinishReason::Length);
    e.close(a).unwrap();
    e.close(b).unwrap();
    let s = e.stats();
    assert_eq!((s.device_slots_used, s.host_bytes_used), (0, 0));
}

#[test]
fn handle_submits_from_another_thread() {
    let mut e = engine(CacheMode::Tiered, 256, 1 << 20);
    let c = e.open(ConversationOptions::default()).unwrap();
    let h = e.handle();
    let id = std::thread::spawn(move || h.submit(c, Turn::user("from a thread"), params(3)))
        .join()
        .unwrap();
    let gone = e.open(ConversationOptions::default()).unwrap();
    e.close(gone).unwrap();
    let bad = e.handle().submit(gone, Turn::user("x"), params(3));
    let f = finished(&drain(&mut e));
    assert_eq!(f[&id].0, FinishReason::Length);
    assert!(matches!(f[&bad].0, FinishReason::Failed(_)));
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<pensieve::engine::EngineHandle>();
}
