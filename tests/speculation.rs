//! Speculative decoding from the conversation's history, on the real SmolLM2 weights, through
//! the public API: an engine that drafts gives the same turns as one that does not, token for
//! token (text, log-probabilities, why each turn ended, and the history the next turn
//! continues), under greedy decoding and under seeded sampling with penalties, with stop
//! strings and token limits that end turns inside a step's accepted drafts, and under
//! `Stateless` as under `Tiered` with the tiers under pressure. It must also draft, have drafts
//! taken and refused, and yield more than a token per decode step.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use pensieve::engine::{
    Budgets, CacheMode, ConversationOptions, Engine, EngineStats, Event, SamplingParams,
    Speculation, TokenLogprobs, Turn,
};
use pensieve::model::{Model, WeightFormat};

/// Turns that invite copying: text to repeat, lists to continue, code to revise.
const TURNS: [&str; 3] = [
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "Here is a function:\n```python\ndef area(width, height):\n    return width * height\n```\nAdd a docstring to it and show the whole function again.",
    "Now list the numbers from one to twelve, each on its own line, as words.",
];

/// One turn as a client sees it, and the history the next turn continues.
#[derive(Debug, PartialEq)]
struct Seen {
    tokens: Vec<u32>,
    text: String,
    logprobs: Vec<Option<TokenLogprobs>>,
    reason: String,
    history: Vec<u32>,
}

/// Runs `conversations` conversations of all `TURNS`, interleaved in an engine of `mode`.
fn run(
    model: &Arc<Model>,
    mode: CacheMode,
    speculation: Speculation,
    params: impl Fn(usize, usize) -> SamplingParams,
    conversations: usize,
) -> (Vec<Seen>, EngineStats) {
    let config = common::pressure_config(mode, Budgets::default())
        .speculation(speculation)
        .step_token_budget(256);
    let mut e = Engine::with_model(model.clone(), config).unwrap();
    run_on(&mut e, params, conversations)
}

/// Runs `conversations` conversations of all `TURNS`, interleaved in `e`.
fn run_on(
    e: &mut Engine,
    params: impl Fn(usize, usize) -> SamplingParams,
    conversations: usize,
) -> (Vec<Seen>, EngineStats) {
    let convs: Vec<_> = (0..conversations)
        .map(|_| e.open(ConversationOptions::default()).unwrap())
        .collect();
    let mut seen = Vec::new();
    for (t, text) in TURNS.iter().enumerate() {
        let mut turns: Vec<Seen> = Vec::new();
        let mut ids = Vec::new();
        for (i, &c) in convs.iter().enumerate() {
            e.submit(c, Turn::user(*text), params(i, t)).unwrap();
            ids.push(c);
            turns.push(Seen {
                tokens: Vec::new(),
                text: String::new(),
                logprobs: Vec::new(),
                reason: String::new(),
                history: Vec::new(),
            });
        }
        while e.has_work() {
            for ev in e.step().unwrap() {
                match ev {
                    Event::Token {
                        conversation,
                        token,
                        text,
                        logprobs,
                        ..
                    } => {
                        let s = &mut turns[ids.iter().position(|&c| c == conversation).unwrap()];
                        s.tokens.push(token);
                        s.text.push_str(&text);
                        s.logprobs.push(logprobs);
                    }
                    Event::Finished {
                        conversation,
                        reason,
                        ..
                    } => {
                        let i = ids.iter().position(|&c| c == conversation).unwrap();
                        turns[i].reason = format!("{reason:?}");
                    }
                    _ => {}
                }
            }
        }
        for (s, &c) in turns.iter_mut().zip(&convs) {
            s.history = e.tokens(c).unwrap().to_vec();
        }
        seen.extend(turns);
    }
    (seen, e.stats())
}

fn model() -> Arc<Model> {
    Arc::new(common::real_model(WeightFormat::Packed))
}

/// The two runs agree turn by turn; the first difference is reported.
fn assert_same(drafting: &[Seen], plain: &[Seen]) {
    for (i, (a, b)) in drafting.iter().zip(plain).enumerate() {
        assert_eq!(a, b, "turn {i} differs with speculation");
    }
}

fn assert_drafted(stats: &EngineStats) {
    assert!(stats.accepted_tokens > 0, "no draft was taken: {stats:?}");
    assert!(
        stats.drafted_tokens > stats.accepted_tokens,
        "no draft was refused: {stats:?}"
    );
}

#[test]
fn real_model_greedy_turns_are_the_same_with_drafts_in_fewer_steps() {
    let model = model();
    // Lengths that end turns at every offset within a step's drafts.
    let params = |i: usize, _| SamplingParams::greedy().max_tokens(40 + 7 * i);
    let (drafting, stats) = run(&model, CacheMode::Tiered, Speculation::default(), params, 4);
    let (plain, plain_stats) = run(&model, CacheMode::Tiered, Speculation::off(), params, 4);
    assert_same(&drafting, &plain);
    assert_drafted(&stats);
    assert_eq!(plain_stats.drafted_tokens, 0);
    assert_eq!(stats.generated_tokens, plain_stats.generated_tokens);
    assert!(
        stats.steps < plain_stats.steps,
        "{} steps with drafts, {} without",
        stats.steps,
        plain_stats.steps
    );
}

#[test]
fn real_model_seeded_sampling_with_penalties_and_stop_strings_is_the_same_with_drafts() {
    let model = model();
    let params = |i: usize, t: usize| {
        SamplingParams::greedy()
            .temperature(0.7)
            .top_p(0.95)
            .seed((i * 10 + t) as u64)
            .presence_penalty(0.3)
            .repetition_penalty(1.05)
            .logprobs(2)
            .max_tokens(64)
            .stop_strings(vec!["lazy dog.".into(), "seven".into()])
    };
    let (drafting, stats) = run(&model, CacheMode::Tiered, Speculation::default(), params, 3);
    let (plain, _) = run(&model, CacheMode::Tiered, Speculation::off(), params, 3);
    assert_same(&drafting, &plain);
    assert!(stats.drafted_tokens > 0, "{stats:?}");
}

#[test]
fn real_model_stateless_with_drafts_equals_tiered_without_under_pressure() {
    let model = model();
    let params = |_, _| SamplingParams::greedy().max_tokens(48);
    // A device pool of a few conversations' KV and a small host tier: swaps, drops and
    // recomputes between the drafted steps.
    let budgets = Budgets::default()
        .device_tokens(1024)
        .host_bytes(2 * common::chunk_bytes(&model));
    let config = |mode| {
        common::pressure_config(mode, budgets)
            .speculation(Speculation::default())
            .step_token_budget(256)
    };
    let mut tiered = Engine::with_model(model.clone(), config(CacheMode::Tiered)).unwrap();
    let mut stateless = Engine::with_model(model.clone(), config(CacheMode::Stateless)).unwrap();
    let (a, stats) = run_on(&mut tiered, params, 8);
    let (b, _) = run_on(&mut stateless, params, 8);
    let (c, _) = run(&model, CacheMode::Stateless, Speculation::off(), params, 8);
    assert_same(&a, &b);
    assert_same(&b, &c);
    assert_drafted(&stats);
    common::assert_pressure_exercised(&stats);
}
