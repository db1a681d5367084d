//! Thinking models: a reply's thought is kept apart from its answer, and it leaves the
//! conversation as the model's template leaves it out, so the next turn reads exactly as on a
//! server that holds nothing and renders the client's history (the stateless baseline).
//! Through the library on a tiny model with DeepSeek R1's template (from the R1-distilled
//! GGUF's header, `tests/fixtures/templates`), and through HTTP with the official `openai`
//! client on the default model with `--reasoning-parser`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::server::{client, start};
use pensieve::engine::{ConversationOptions, Engine, EngineConfig, SamplingParams, Turn};
use pensieve::model::{Constraint, Message, Model};

const R1_TEMPLATE: &str = "tests/fixtures/templates/deepseek-r1-distill.jinja";

/// Replies forced into a thinking model's shape: a thought, then an answer.
fn thinking() -> SamplingParams {
    let shape = r"<think>\n[a-z ]{6,20}\n</think>\n\n[A-Za-z ]{4,20}";
    SamplingParams::greedy()
        .max_tokens(80)
        .constraint(Constraint::Regex(shape.into()))
}

fn r1_engine() -> Engine {
    let template = std::fs::read_to_string(R1_TEMPLATE).unwrap();
    let model = Model::tiny(7)
        .unwrap()
        .with_template_source(&template)
        .unwrap();
    Engine::with_model(model, EngineConfig::default().check_invariants(true)).unwrap()
}

#[test]
fn a_thought_leaves_the_history_as_the_template_drops_it_and_the_rest_is_reused() {
    let mut e = r1_engine();
    let a = e.open(ConversationOptions::default()).unwrap();
    let (_, first) = e
        .run_turn(a, Turn::user("Say hello."), thinking(), |_| {})
        .unwrap();
    let reply = e.messages(a).unwrap().last().unwrap().clone();
    let thought = reply.reasoning_content.clone().expect("the thought, apart");
    assert!(
        !thought.contains("think>") && !thought.is_empty(),
        "{reply:?}"
    );
    assert!(reply.content.starts_with("\n\n") && !reply.content.contains("think>"));

    // The next turn, continued from the engine's state...
    let (_, second) = e
        .run_turn(a, Turn::user("And goodbye?"), thinking(), |_| {})
        .unwrap();
    // ...and on a conversation opened with the history a client sends back (the answer
    // only), as a server that held nothing would run it.
    let b = e
        .open(ConversationOptions::default().history(vec![
            Message::new("user", "Say hello."),
            Message::new("assistant", reply.content.clone()),
        ]))
        .unwrap();
    e.run_turn(b, Turn::user("And goodbye?"), thinking(), |_| {})
        .unwrap();
    assert_eq!(
        e.tokens(a).unwrap(),
        e.tokens(b).unwrap(),
        "the stateful turn fed the model what the stateless one did"
    );
    let answers = |c| -> Vec<String> {
        let m: &[Message] = e.messages(c).unwrap();
        m.iter().map(|m| m.content.clone()).collect()
    };
    assert_eq!(answers(a), answers(b));

    // Only the thought and what followed it were recomputed: the first turn's prompt was
    // reused.
    let stats = e.stats();
    assert!(stats.rewound_tokens >= thought.len() as u64, "{stats:?}");
    assert!(
        second.reused_tokens >= first.prompt_tokens,
        "{second:?} after {first:?}"
    );
}

#[test]
fn a_template_that_keeps_replies_as_generated_rewinds_nothing() {
    let mut e = Engine::with_model(Model::tiny(7).unwrap(), EngineConfig::default()).unwrap();
    let a = e.open(ConversationOptions::default()).unwrap();
    let params = SamplingParams::greedy().max_tokens(12);
    for q in ["one", "two", "three"] {
        e.run_turn(a, Turn::user(q), params.clone(), |_| {})
            .unwrap();
    }
    assert_eq!(e.stats().rewound_tokens, 0);
}

#[test]
fn real_model_reasoning_content_whole_and_streamed_and_the_next_turn_as_on_a_fresh_server() {
    let args = [
        "--chat-template",
        R1_TEMPLATE,
        "--reasoning-parser",
        "deepseek-r1",
    ];
    let server = start(&args);
    let fresh = start(&args);
    let out = client(&server.base, &["reasoning", &fresh.base]);
    let whole = &out["whole"];
    let thought = whole["reasoning"].as_str().expect("reasoning_content");
    let answer = whole["content"].as_str().unwrap();
    assert!(!thought.is_empty() && !thought.contains("think>"), "{out}");
    assert!(
        answer.starts_with("\n\n") && !answer.contains("think>"),
        "{out}"
    );
    // Streamed: the same split, as `reasoning_content` deltas, then `content` deltas.
    assert_eq!(out["streamed"]["reasoning"], whole["reasoning"], "{out}");
    assert_eq!(out["streamed"]["content"], whole["content"], "{out}");
    assert!(out["streamed"]["order_ok"].as_bool().unwrap(), "{out}");
    // The next turn, sent back with the answer only, continued the held conversation: its
    // first turn's prompt came from the cache...
    let next = &out["next"];
    let cached = next["cached_tokens"].as_u64().unwrap();
    assert!(
        cached >= out["first_prompt_tokens"].as_u64().unwrap(),
        "{out}"
    );
    // ...and it answered as a server that held nothing did.
    assert_eq!(next["reply"], out["fresh"]["reply"], "{out}");
    assert_eq!(next["reasoning"], out["fresh"]["reasoning"], "{out}");
    assert_eq!(
        next["prompt_tokens"], out["fresh"]["prompt_tokens"],
        "{out}"
    );
}
