//! Tool calls in the formats beside Hermes' `<tool_call>` elements, over HTTP on the
//! real SmolLM2 weights with a template of each (`tests/fixtures/templates`): Qwen3-Coder's
//! `<function=...>` with `<parameter=...>` elements (`xml-tools.jinja`) and Mistral's
//! `[TOOL_CALLS]NAME[ARGS]{...}` (`named-tools.jinja`), DeepSeek V3's
//! `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` with its fenced arguments
//! (`deepseek-tools.jinja`) and V3.1's unfenced form (`deepseek-v31-tools.jinja`), and Llama 3.1's reply that is one `{"name", "parameters"}`
//! object (`llama3-tools.jinja`), and gpt-oss's harmony messages to `functions.NAME`
//! (OpenAI's own template, as llama.cpp ships it). A forced call is written, parsed (and
//! typed by the tool's schema), streamed as `delta.tool_calls` fragments that add up to the
//! whole answer, and its result continues the conversation the server holds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use serde_json::{json, Value};

use common::server::{forced_call, post, start};

fn template(name: &str) -> String {
    format!(
        "{}/tests/fixtures/templates/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn xml_tool_calls_are_forced_typed_streamed_and_continued() {
    forced_streamed_and_continued("xml-tools.jinja", 48);
}

#[test]
fn named_tool_calls_are_forced_streamed_and_continued() {
    forced_streamed_and_continued("named-tools.jinja", 48);
}

#[test]
fn deepseek_v31_tool_calls_are_forced_streamed_and_continued() {
    forced_streamed_and_continued("deepseek-v31-tools.jinja", 48);
}

#[test]
fn llama3_tool_calls_are_forced_streamed_and_continued() {
    forced_streamed_and_continued("llama3-tools.jinja", 48);
}

#[test]
fn deepseek_tool_calls_are_forced_streamed_and_continued() {
    forced_streamed_and_continued("deepseek-tools.jinja", 48);
}

#[test]
fn harmony_tool_calls_are_forced_streamed_and_continued() {
    let path = pensieve::model::default_cache_dir()
        .join("llamacpp-templates")
        .join("openai-gpt-oss-120b.jinja");
    // SmolLM2 ends the call with its `<|im_end|>` where the template writes gpt-oss's
    // `<|call|>`, and harmony's markup is plain text in its vocabulary: the history goes back
    // to the turn's start (the question and the call are fed again; the system prompt and the
    // tools are not). With gpt-oss's vocabulary `<|call|>` ends the reply and agrees.
    forced_streamed_and_continued(path.to_str().unwrap(), 128);
}

/// `fed`: how many of the next turn's prompt tokens may be computed rather than cached.
fn forced_streamed_and_continued(template_file: &str, fed: u64) {
    let template = match template_file.starts_with('/') {
        true => template_file.to_string(),
        false => template(template_file),
    };
    let server = start(&["--chat-template", &template]);
    let b = &server.base;
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city over some days",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
            "days": {"type": "integer"}}, "required": ["city"],
            "additionalProperties": false}}}]);
    let question = json!({"role": "user", "content": "What is the weather in Paris?"});
    let made = forced_call(b, json!([question]), &tools, json!("required"));
    let call = &made["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather", "{made}");
    let arguments = call["function"]["arguments"].as_str().unwrap();
    let args: Value = serde_json::from_str(arguments).unwrap();
    let keys: Vec<&String> = args.as_object().unwrap().keys().collect();
    assert!(keys.iter().all(|k| *k == "city" || *k == "days"), "{made}");
    // Typed by the schema: a city is a string whatever it reads as.
    assert!(args.get("city").is_none_or(Value::is_string), "{made}");

    // Streamed, the same call arrives as fragments of the same arguments.
    let streamed = json!({"messages": [question], "tools": tools, "tool_choice": "required",
        "max_tokens": 160, "temperature": 0, "stream": true});
    let text = ureq::post(&format!("{b}/v1/chat/completions"))
        .set("content-type", "application/json")
        .send_string(&streamed.to_string())
        .unwrap()
        .into_string()
        .unwrap();
    let (mut name, mut fragments) = (String::new(), String::new());
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        for d in chunk["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            name.push_str(d["function"]["name"].as_str().unwrap_or_default());
            fragments.push_str(d["function"]["arguments"].as_str().unwrap_or_default());
        }
    }
    assert_eq!(
        (name.as_str(), fragments.as_str()),
        ("get_weather", arguments),
        "{text}"
    );

    // The result goes back; the history is cached, and the call too where the model's tokens
    // are how the template's rendering of it tokenizes: a call the grammar forced may be other
    // tokens, and is then recomputed, as a stateless server computes it (its tokens are at
    // most its bytes, with the markup around it).
    let call_tokens = (arguments.len() + "get_weather".len() + 16) as u64;
    let result = json!({"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"});
    let next = json!({"messages": [question, made, result], "tools": tools, "max_tokens": 8});
    let (status, second) = post(b, "/v1/chat/completions", &next.to_string());
    assert_eq!(status, 200, "{second}");
    let usage = &second["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached > 100 && cached + fed + call_tokens >= prompt,
        "{second}"
    );
}
