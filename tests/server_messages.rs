//! Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) driven by the
//! official `anthropic` Python client on the real SmolLM2 weights: chats and an agent's tool
//! loop whose later turns read the cache, the usage Anthropic defines, its stream events and
//! its errors.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::{json, Value};

mod common;

use common::server::{anthropic_client, start};

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[test]
fn real_model_anthropics_client_chats_with_the_cache_counted_as_anthropic_counts_it() {
    let server = start(&[]);
    let out = anthropic_client(&server.base, &["chat"]);
    let turns = out["turns"].as_array().unwrap();
    for (i, t) in turns.iter().enumerate() {
        assert!(t["id"].as_str().unwrap().starts_with("msg_"), "{t}");
        assert_eq!(
            (&t["type"], &t["role"]),
            (&json!("message"), &json!("assistant"))
        );
        assert!(!t["text"].as_str().unwrap().is_empty(), "turn {i}: {t}");
        let u = &t["usage"];
        let prompt = n(&u["input"]) + n(&u["cache_read"]) + n(&u["cache_creation"]);
        // Every prompt token is read, written or plain input, and the count the client asked
        // for first is the prompt the model saw.
        assert_eq!(prompt, n(&t["counted"]), "turn {i}: {t}");
        // The breakpoint is the last block: nothing is plain input.
        assert_eq!(n(&u["input"]), 0, "turn {i}: {t}");
        if i > 0 {
            // The history came from the cache: the previous prompt and most of its reply.
            let before = &turns[i - 1]["usage"];
            let held = n(&before["cache_read"]) + n(&before["cache_creation"]);
            assert!(n(&u["cache_read"]) >= held, "turn {i}: {out}");
            assert!(
                n(&u["cache_creation"]) < n(&u["cache_read"]),
                "turn {i}: {out}"
            );
        }
    }
    // The first turn shared nothing: its prompt was computed and kept.
    assert_eq!(n(&turns[0]["usage"]["cache_read"]), 0, "{out}");
    // Streamed, the same reply in several text deltas; the final message holds it whole with
    // the usage of the message_delta event.
    let streamed = &out["streamed"];
    assert_eq!(streamed["text"], turns[0]["text"], "{out}");
    assert_eq!(streamed["final"], turns[0]["text"], "{out}");
    assert!(n(&streamed["pieces"]) >= 2, "{streamed}");
    assert!(n(&streamed["usage"]["output"]) > 0, "{streamed}");
    // A fresh conversation of the same prompt: its KV found by content.
    assert!(n(&streamed["usage"]["cache_read"]) > 0, "{streamed}");
    let stopped = &out["stopped"];
    assert_eq!(stopped["stop_reason"], "stop_sequence", "{out}");
    let sequence = stopped["stop_sequence"].as_str().unwrap();
    assert!(!sequence.is_empty() && !stopped["text"].as_str().unwrap().contains(sequence));
    let asynchronous = &out["async"];
    assert_eq!(asynchronous["text"], turns[0]["text"], "{out}");
    assert_eq!(asynchronous["streamed"], turns[0]["text"], "{out}");
    let events: Vec<&str> = (asynchronous["events"].as_array().unwrap().iter())
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(events.first(), Some(&"message_start"), "{events:?}");
    assert_eq!(events.last(), Some(&"message_stop"), "{events:?}");
    for kind in [
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "text",
    ] {
        assert!(events.contains(&kind), "{kind}: {events:?}");
    }
    let warmed = &out["warmed"];
    assert_eq!(warmed["content"], 0, "{warmed}");
    assert_eq!(warmed["usage"]["output"], 0, "{warmed}");
    assert!(n(&warmed["usage"]["cache_creation"]) > 0, "{warmed}");
}

#[test]
fn real_model_a_claude_code_style_tool_loop_streams_calls_and_reads_its_history_cached() {
    let server = start(&["--chat-template", "chatml-tools"]);
    let out = anthropic_client(&server.base, &["agent"]);
    let steps = out["steps"].as_array().unwrap();
    for (i, step) in steps.iter().enumerate() {
        assert_eq!(step["stop_reason"], "tool_use", "step {i}: {out}");
        let calls = step["calls"].as_array().unwrap();
        // disable_parallel_tool_use: one call, its input an object as the schema says.
        assert_eq!(calls.len(), 1, "step {i}: {out}");
        assert!(calls[0]["input"]["path"].is_string(), "step {i}: {out}");
        assert!(n(&step["deltas"]) >= 2, "step {i}: {out}");
        if i > 0 {
            // The client sent the call back as an object (`input`), the result in a user
            // message: the server still found the conversation it held, so the previous
            // prompt came from the cache (and the call too, where its tokens are how its text
            // tokenizes: a grammar's may not be, and are then recomputed, as a stateless
            // server computes them).
            let before = &steps[i - 1]["usage"];
            let prompt = n(&before["input"]) + n(&before["cache_read"]);
            let prompt = prompt + n(&before["cache_creation"]);
            let read = n(&step["usage"]["cache_read"]);
            assert!(read + 8 >= prompt, "step {i}: {out}");
        }
    }
    let said = &out["said"];
    assert_ne!(said["stop_reason"], "tool_use", "{said}");
    assert_eq!(said["blocks"], json!(["text"]), "{said}");
    assert!(n(&said["usage"]["cache_read"]) > 0, "{said}");
}

#[test]
fn real_model_anthropics_client_reads_refusals_as_anthropic_types_them() {
    let server = start(&["--api-key", "k"]);
    let out = anthropic_client(&server.base, &["errors", "wrong"]);
    assert_eq!(out["unknown_model"]["status"], 401, "{out}");
    assert_eq!(
        out["unknown_model"]["type"], "authentication_error",
        "{out}"
    );
    // The key as Anthropic's clients send it (`x-api-key`).
    let out = anthropic_client(&server.base, &["errors", "k"]);
    let unknown = &out["unknown_model"];
    assert_eq!(
        (n(&unknown["status"]), &unknown["type"]),
        (404, &json!("not_found_error"))
    );
    assert_eq!(unknown["class"], "NotFoundError", "{out}");
    let image = &out["image"];
    assert_eq!(image["type"], "invalid_request_error", "{out}");
    assert!(
        image["message"].as_str().unwrap().contains("text model"),
        "{out}"
    );
    for name in ["unknown_field", "container"] {
        assert_eq!(out[name]["status"], 400, "{name}: {out}");
    }
    assert!(out["unknown_field"]["message"]
        .as_str()
        .unwrap()
        .contains("Anthropic's"));
    // Raw HTTP, the key as a bearer token: a body that is not JSON, a missing field.
    let post = |body: &str| {
        let r = ureq::post(&format!("{}/v1/messages", server.base))
            .set("authorization", "Bearer k")
            .send_string(body);
        let r = match r {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{e}"),
        };
        (r.status(), r.into_json::<Value>().unwrap())
    };
    let (status, body) = post("{");
    assert_eq!(status, 400);
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let (status, body) = post(
        r#"{"model": "pensieve",
        "messages": [{"role": "user", "content": "Hi"}]}"#,
    );
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens"),
        "{body}"
    );
}
