//! OpenAI's Predicted Outputs on the real model: a `prediction` is drafted by the exact
//! speculation the engine has, so a reply that follows it takes fewer steps (its drafted
//! tokens accepted, as `usage.completion_tokens_details` counts them) and is the same bytes as
//! without it, greedy or sampled with a seed; a prediction that misses changes nothing either.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::server::{post, start};
use serde_json::{json, Value};

fn ask(base: &str, extra: Value) -> Value {
    let mut body = json!({"max_tokens": 64, "temperature": 0, "messages": [{"role": "user",
        "content": "Write a short Python function that adds two numbers, with a docstring."}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let (status, r) = post(base, "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{r}");
    r
}

fn text(r: &Value) -> &str {
    r["choices"][0]["message"]["content"].as_str().unwrap()
}

#[test]
fn real_model_a_prediction_gives_the_same_reply_in_fewer_steps() {
    let server = start(&[]);
    let b = &server.base;
    let plain = ask(b, json!({}));
    assert!(
        plain["usage"].get("completion_tokens_details").is_none(),
        "{plain}"
    );
    let reply = text(&plain).to_string();
    // The reply itself predicted: nearly every token is drafted and accepted.
    let predicted = ask(
        b,
        json!({"prediction": {"type": "content", "content": reply}}),
    );
    assert_eq!(text(&predicted), reply);
    let details = &predicted["usage"]["completion_tokens_details"];
    let accepted = details["accepted_prediction_tokens"].as_u64().unwrap();
    let generated = predicted["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(accepted * 2 >= generated, "{predicted}");
    // An edit of it (a renamed function): what still matches is drafted, the rest sampled.
    let edited = reply.replacen("add", "sum", 1);
    let parts = json!([{"type": "text", "text": edited}]);
    let partly = ask(
        b,
        json!({"prediction": {"type": "content", "content": parts}}),
    );
    assert_eq!(text(&partly), reply);
    // Sampled with a seed, and a prediction that misses: the same bytes as without.
    let seeded = json!({"temperature": 0.8, "seed": 7});
    let sampled = ask(b, seeded.clone());
    let mut with = seeded.clone();
    with["prediction"] = json!({"type": "content", "content": text(&sampled)});
    assert_eq!(text(&ask(b, with)), text(&sampled));
    let mut miss = seeded;
    miss["prediction"] = json!({"type": "content", "content": "Lorem ipsum dolor sit amet."});
    assert_eq!(text(&ask(b, miss)), text(&sampled));
    // A prediction of another type is refused by name.
    let (status, e) = post(
        b,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user",
        "content": "Hi"}], "prediction": {"type": "diff", "content": "x"}})
        .to_string(),
    );
    assert_eq!(status, 400, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("prediction"),
        "{e}"
    );
}
