//! The server through the official JavaScript SDKs from npm (`@anthropic-ai/sdk`, `openai`),
//! as Node programs call it: `tests/js_client.cjs` runs on the Node.js and SDK versions
//! scripts/fetch-assets pins, and prints what it saw; and through Claude Code itself, in print
//! mode.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Command;

use common::server::{claude_code, js_client, start};
use serde_json::{json, Value};

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

/// One print-mode run of Claude Code against `base` in `dir` (its home too), `extra` flags
/// after the prompt: the result it prints last.
fn claude(base: &str, dir: &std::path::Path, prompt: &str, extra: &[&str]) -> Value {
    // Its own prompt is ~12k tokens, past SmolLM2's 8k window: a short system prompt and one
    // tool (`--bare`, `--system-prompt`, `--tools`) leave ~500.
    let out = Command::new(claude_code())
        .current_dir(dir)
        .env("HOME", dir)
        .env("ANTHROPIC_BASE_URL", base)
        .env("ANTHROPIC_API_KEY", "unused")
        .env("ANTHROPIC_SMALL_FAST_MODEL", "pensieve")
        .env("ANTHROPIC_DEFAULT_HAIKU_MODEL", "pensieve")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("DISABLE_TELEMETRY", "1")
        .env("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "256")
        .args(["-p", prompt])
        .args(extra)
        .args([
            "--bare",
            "--system-prompt",
            "You are a helpful assistant. Be brief.",
        ])
        .args([
            "--tools",
            "Read",
            "--model",
            "pensieve",
            "--output-format",
            "json",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn real_model_claude_code_completes_turns_in_print_mode_and_reads_the_cache() {
    // Claude Code sends no sampling parameters: the server's default makes its turns greedy,
    // so the test's replies are always the same.
    let server = start(&[
        "--chat-template",
        "chatml-tools",
        "--override-generation-config",
        r#"{"temperature": 0}"#,
    ]);
    let dir = std::env::temp_dir().join(format!("pensieve-claude-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let first = claude(&server.base, &dir, "Say hello.", &[]);
    assert_eq!(first["is_error"], false, "{first}");
    assert_eq!(first["stop_reason"], "end_turn", "{first}");
    assert!(!first["result"].as_str().unwrap().is_empty(), "{first}");
    // The session continued: its history resent, its prompt read from the cache.
    let second = claude(&server.base, &dir, "Say hello.", &["--continue"]);
    assert_eq!(second["is_error"], false, "{second}");
    let read = second["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(read > 0, "{second}");
    std::fs::remove_dir_all(&dir).unwrap();
}
