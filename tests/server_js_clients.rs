//! The server through the official JavaScript SDKs from npm (`@anthropic-ai/sdk`, `openai`),
//! as Node programs call it: `tests/js_client.cjs` runs on the Node.js and SDK versions
//! scripts/fetch-assets pins, and prints what it saw.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::server::{js_client, start};
use serde_json::json;

#[test]
fn real_model_anthropic_s_typescript_sdk_chats_streams_counts_and_calls_tools() {
    let server = start(&["--chat-template", "chatml-tools"]);
    let out = js_client(&server.base, &["anthropic"]);
    let first = &out["first"]["usage"];
    // The count is the prompt the reply's usage splits into input, cache read and creation.
    let total = ["input", "cache_read", "cache_creation"]
        .iter()
        .map(|k| first[k].as_u64().unwrap())
        .sum::<u64>();
    assert_eq!(out["counted"].as_u64().unwrap(), total, "{out}");
    assert!(first["cache_creation"].as_u64().unwrap() > 0, "{out}");
    // The second turn, streamed, read the first's prompt from the cache.
    let second = &out["second"];
    assert!(second["usage"]["cache_read"].as_u64().unwrap() > 0, "{out}");
    assert!(second["deltas"].as_u64().unwrap() > 0, "{out}");
    assert_eq!(second["blocks"], json!(["text"]), "{out}");
    // A forced call, then its result answered from the cache.
    assert_eq!(out["call"]["stop"], "tool_use", "{out}");
    assert_eq!(out["call"]["name"], "read_file", "{out}");
    assert!(out["call"]["input"]["path"].is_string(), "{out}");
    let answered = &out["answered"]["usage"];
    assert!(answered["cache_read"].as_u64().unwrap() > 0, "{out}");
    assert_eq!(out["refused"]["status"], 404, "{out}");
    assert_eq!(out["refused"]["type"], "not_found_error", "{out}");
}

#[test]
fn real_model_openai_s_typescript_sdk_chats_continues_responses_and_compacts() {
    let server = start(&["--chat-template", "chatml-tools"]);
    let out = js_client(&format!("{}/v1", server.base), &["openai"]);
    let text = out["chat"]["text"].as_str().unwrap();
    assert!(!text.is_empty(), "{out}");
    // Greedy: the stream is the same answer, in pieces.
    assert_eq!(out["stream"]["text"], text, "{out}");
    assert!(out["stream"]["chunks"].as_u64().unwrap() >= 2, "{out}");
    // A response continued by its id read its history from the cache.
    assert!(out["responses"][1]["cached"].as_u64().unwrap() > 0, "{out}");
    assert_eq!(out["compacted"]["object"], "response.compaction", "{out}");
    let types = out["compacted"]["types"].as_array().unwrap();
    assert_eq!(types.first(), Some(&json!("message")), "{out}");
    assert_eq!(types.last(), Some(&json!("compaction")), "{out}");
    // The turn on the compacted window shared its opening by content.
    assert!(out["after"]["cached"].as_u64().unwrap() > 0, "{out}");
}
