//! What the routers fleets run put into the requests they forward: vLLM's router
//! (`vllm-router` 0.1.17, from PyPI) writes SGLang's and vLLM's extra fields at their defaults
//! into every chat and completion request, and every one was refused as unknown, so a server
//! behind it failed every call. The bodies below are what it forwarded, captured.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::server::{post, start};
use serde_json::json;

#[test]
fn real_model_requests_as_vllm_s_router_forwards_them_are_served() {
    let server = start(&[]);
    let chat = json!({"model": "pensieve", "messages": [{"role": "user", "content": "Hi"}],
        "stream": false, "max_tokens": 4, "user": "u1", "logprobs": false,
        "no_stop_trim": false, "ignore_eos": false, "continue_final_message": false,
        "skip_special_tokens": true, "separate_reasoning": true, "stream_reasoning": true,
        "return_hidden_states": false, "include_reasoning": true});
    let (status, answer) = post(&server.base, "/v1/chat/completions", &chat.to_string());
    assert_eq!(status, 200, "{answer}");
    let completion = json!({"model": "pensieve", "prompt": "Hi", "max_tokens": 4,
        "stream": false, "echo": false, "no_stop_trim": false, "ignore_eos": false,
        "skip_special_tokens": true, "return_hidden_states": false});
    let (status, answer) = post(&server.base, "/v1/completions", &completion.to_string());
    assert_eq!(status, 200, "{answer}");
    // Asking for what the server cannot do is still refused, by name.
    let mut hidden = completion.clone();
    hidden["return_hidden_states"] = json!(true);
    let (status, answer) = post(&server.base, "/v1/completions", &hidden.to_string());
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer.to_string().contains("return_hidden_states"),
        "{answer}"
    );
}
