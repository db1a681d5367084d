//! What the routers fleets run put into the requests they forward: vLLM's router
//! (`vllm-router` 0.1.17, from PyPI) writes SGLang's and vLLM's extra fields at their defaults
//! into every chat and completion request, and every one was refused as unknown, so a server
//! behind it failed every call. The bodies below are what it forwarded, captured. SGLang's
//! router asks a worker what it serves before it routes to it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::server::{post, request, start};
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

/// SGLang's router (`sglang-router` 0.3.2) registers a worker under the model its
/// `/server_info` names (then its older `/get_server_info`) and labels it from `/model_info`
/// (`/get_model_info`): answered as it parses them, so requests naming the served model reach
/// this server and none is registered as "unknown". vLLM's router reads `/get_load`.
#[test]
fn real_model_what_sglang_s_router_asks_of_a_worker_is_answered() {
    let server = start(&["--served-model-name", "smollm2"]);
    for path in ["/server_info", "/get_server_info"] {
        let (status, info) = request("GET", &server.base, path, "");
        assert_eq!(status, 200, "{path}: {info}");
        assert_eq!(info["served_model_name"], "smollm2", "{info}");
        assert!(info["version"].is_string(), "{info}");
        // No model path: the router would load a tokenizer from it.
        assert!(info.get("model_path").is_none(), "{info}");
    }
    for path in ["/model_info", "/get_model_info"] {
        let (status, info) = request("GET", &server.base, path, "");
        assert_eq!(status, 200, "{path}: {info}");
        assert_eq!(info["is_generation"], true, "{info}");
        assert_eq!(info["model_type"], "llama", "{info}");
        assert_eq!(info["architectures"], json!(["LlamaForCausalLM"]), "{info}");
    }
    // vLLM's router reads a worker's load (its `power_of_two` policy, its `/get_loads`).
    let (status, load) = request("GET", &server.base, "/get_load", "");
    assert_eq!((status, load), (200, json!({"load": 0})));
}
