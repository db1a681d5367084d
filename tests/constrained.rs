//! Constrained decoding (llguidance) on the real SmolLM2 weights: a reply held to a JSON
//! schema parses and validates, one held to a regular expression matches it whole, and a
//! constraint that does not compile is refused at submission.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use pensieve::chat::Constraint;
use pensieve::engine::{
    ConversationOptions, Engine, EngineConfig, FinishReason, SamplingParams, Turn,
};
use pensieve::model::WeightFormat;
use serde_json::{json, Value};

mod common;

fn engine() -> Engine {
    let model = Arc::new(common::real_model(WeightFormat::default()));
    Engine::with_model(model, EngineConfig::default()).unwrap()
}

fn constrained(c: Constraint, max_tokens: usize) -> SamplingParams {
    SamplingParams::greedy()
        .max_tokens(max_tokens)
        .constraint(c)
}

#[test]
fn real_model_replies_follow_a_json_schema_and_a_regular_expression() {
    let mut e = engine();
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"], "additionalProperties": false});
    let conv = e.open(ConversationOptions::default()).unwrap();
    let ask = Turn::user("Describe a famous scientist as JSON with a name and an age.");
    let params = constrained(Constraint::JsonSchema(schema), 64);
    let (reason, _) = e.run_turn(conv, ask, params, |_| {}).unwrap();
    let reply = e.messages(conv).unwrap().last().unwrap().content.clone();
    // The schema's object is complete: the reply ends there, not at its length.
    assert_eq!(reason, FinishReason::Stop, "{reply}");
    let v: Value = serde_json::from_str(&reply).unwrap_or_else(|e| panic!("{e}: {reply}"));
    let obj = v.as_object().unwrap();
    assert_eq!(obj.len(), 2, "{reply}");
    assert!(
        obj["name"]
            .as_str()
            .is_some_and(|n| n.chars().count() <= 20),
        "{reply}"
    );
    assert!(obj["age"].as_u64().is_some_and(|a| a <= 150), "{reply}");

    // Any JSON object, on the same conversation (its history now holds the first).
    let params = constrained(Constraint::JsonObject, 48);
    let ask = Turn::user("Now another one.");
    e.run_turn(conv, ask, params, |_| {}).unwrap();
    let reply = e.messages(conv).unwrap().last().unwrap().content.clone();
    let v: Result<Value, _> = serde_json::from_str(&reply);
    // Cut at its length an object may be unfinished, but it begins as one.
    assert!(
        v.is_ok_and(|v| v.is_object()) || reply.starts_with('{'),
        "{reply}"
    );

    let conv = e.open(ConversationOptions::default()).unwrap();
    let params = constrained(Constraint::Regex("[0-9]{3}-[0-9]{4}".into()), 16);
    let (reason, _) = e
        .run_turn(conv, Turn::user("A phone number?"), params, |_| {})
        .unwrap();
    let reply = e.messages(conv).unwrap().last().unwrap().content.clone();
    assert_eq!(reason, FinishReason::Stop);
    assert!(
        reply.len() == 8
            && reply.chars().enumerate().all(|(i, c)| match i {
                3 => c == '-',
                _ => c.is_ascii_digit(),
            }),
        "{reply:?}"
    );

    // Forced text whose characters span several tokens of this vocabulary (the first bytes
    // of `｜` are a token of their own) is written exactly.
    let conv = e.open(ConversationOptions::default()).unwrap();
    let forced = r#"start: "<｜tool▁sep｜>" /[a-z]{2,6}/"#;
    let params = constrained(Constraint::Lark(forced.into()), 24);
    e.run_turn(conv, Turn::user("Name a tool."), params, |_| {})
        .unwrap();
    let reply = e.messages(conv).unwrap().last().unwrap().content.clone();
    let word = reply
        .strip_prefix("<｜tool▁sep｜>")
        .unwrap_or_else(|| panic!("{reply:?}"));
    assert!(word.chars().all(|c| c.is_ascii_lowercase()), "{reply:?}");

    // A constraint that does not compile is the submission's error; the engine serves on.
    let bad = constrained(Constraint::JsonSchema(json!({"type": "no such type"})), 8);
    let err = e.submit(conv, Turn::user("x"), bad).unwrap_err();
    assert!(
        matches!(
            err,
            pensieve::Error::InvalidParams {
                param: "constraint",
                ..
            }
        ),
        "{err}"
    );
    let (reason, _) = e
        .run_turn(
            conv,
            Turn::user("Hi"),
            SamplingParams::greedy().max_tokens(4),
            |_| {},
        )
        .unwrap();
    assert_eq!(reason, FinishReason::Length);
}
