//! The server against llama.cpp, through HTTP as clients call it (issue 38): for each real model
//! the tests have (SmolLM2-135M-Instruct with its own template, Gemma 3 270M base with the
//! built-in `gemma` template), 50 ShareGPT prompts through `/tokenize` (a prompt, and messages),
//! raw `/v1/completions` and `/v1/chat/completions`, compared with what llama.cpp makes of the
//! same text (`tests/fixtures/llamacpp/server-*.json`, written by
//! `scripts/reference/server-fixtures`). Token ids must be identical; greedy replies identical,
//! or diverging only at a near-tie: where they first differ, one of the engines puts the
//! other's token within a tie bound of its own choice, in its own log-probabilities (the
//! issue's rule, from vLLM's `check_logprobs_close`, is ours within 0.5 nat; llama.cpp's view
//! counts too, since both engines round); after that the two texts go their own ways. The
//! bound is 0.5 nat for SmolLM2, and 1 for Gemma 3, whose activations have outliers that
//! llama.cpp's 8-bit activations round by up to 0.77 (`tests/real_model_gemma3.rs` measures its
//! logits against ours). A near-tie need not be a two-way one: three or more tokens within a
//! tenth of a nat are common at 4 bits, so the other's token is not always one's second. A base model without a template serves completions
//! and refuses chat naming `--chat-template`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::llamacpp::{fixture, ids};
use common::server::{post, start};
use serde_json::{json, Value};

/// Alternatives our server lists per step (its most): enough to find llama.cpp's token
/// wherever it is within a tie of ours.
const TOP: usize = 20;

/// Our greedy tokens and, per step, each listed alternative's log-probability, from an answer
/// with `return_tokens_as_token_ids` (completions: `logprobs` lists; chat: `content` entries).
fn generated(choice: &Value) -> Vec<(u32, Vec<(u32, f64)>)> {
    let id = |s: &str| s.strip_prefix("token_id:").unwrap().parse::<u32>().unwrap();
    let logprobs = &choice["logprobs"];
    if let Some(content) = logprobs["content"].as_array() {
        return content
            .iter()
            .map(|e| {
                let top = (e["top_logprobs"].as_array().unwrap().iter())
                    .map(|t| {
                        (
                            id(t["token"].as_str().unwrap()),
                            t["logprob"].as_f64().unwrap(),
                        )
                    })
                    .collect();
                (id(e["token"].as_str().unwrap()), top)
            })
            .collect();
    }
    let tokens = logprobs["tokens"].as_array().unwrap();
    let tops = logprobs["top_logprobs"].as_array().unwrap();
    tokens
        .iter()
        .zip(tops)
        .map(|(t, top)| {
            let top = (top.as_object().unwrap().iter())
                .map(|(k, v)| (id(k), v.as_f64().unwrap()))
                .collect();
            (id(t.as_str().unwrap()), top)
        })
        .collect()
}

/// Whether our greedy tokens agree with llama.cpp's `reference` (`ids`, and per step every
/// token within 1 nat of its best, with its log-probability), ties within `tie` nats:
/// `Ok(true)` identical, `Ok(false)` diverging at a near-tie, `Err` otherwise.
fn agrees(ours: &[(u32, Vec<(u32, f64)>)], reference: &Value, tie: f64) -> Result<bool, String> {
    let theirs = ids(&reference["ids"]);
    let their_top: Vec<Vec<(u32, f64)>> = serde_json::from_value(reference["top"].clone()).unwrap();
    assert_eq!(
        ours.len(),
        theirs.len(),
        "both generate the same number of tokens"
    );
    let Some(i) = (0..ours.len()).find(|&i| ours[i].0 != theirs[i]) else {
        return Ok(true);
    };
    // `other` within `tie` of `chosen`, in one engine's log-probabilities.
    let close = |top: &[(u32, f64)], chosen: u32, other: u32| {
        let lp = |t: u32| top.iter().find(|(id, _)| *id == t).map(|&(_, lp)| lp);
        matches!((lp(chosen), lp(other)), (Some(a), Some(b)) if a - b <= tie)
    };
    let (mine, top) = (ours[i].0, &ours[i].1);
    match close(top, mine, theirs[i]) || close(&their_top[i], theirs[i], mine) {
        true => Ok(false),
        false => Err(format!(
            "step {i}: ours {mine} (top {:?}), llama.cpp's {} (near {:?})",
            &top[..top.len().min(5)],
            theirs[i],
            their_top[i]
        )),
    }
}

/// Checks every case of `server-<name>.json` against the server at `base`, ties within `tie`.
fn compare(base: &str, name: &str, tie: f64) {
    let fixture = fixture(&format!("server-{name}.json"));
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 50, "{} cases", cases.len());
    let (mut same, mut ties) = ([0; 2], [0; 2]);
    let mut failures = Vec::new();
    for (k, case) in cases.iter().enumerate() {
        let text = case["text"].as_str().unwrap();
        let user = json!([{"role": "user", "content": text}]);
        // Tokens: exactly llama.cpp's.
        let (status, v) = post(base, "/tokenize", &json!({"prompt": text}).to_string());
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            ids(&v["tokens"]),
            ids(&case["prompt"]),
            "case {k}: /tokenize of {text:?}"
        );
        let (status, v) = post(base, "/tokenize", &json!({"messages": user}).to_string());
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            ids(&v["tokens"]),
            ids(&case["chat_prompt"]),
            "case {k}: /tokenize of the messages"
        );
        let sampling = json!({"max_tokens": 16, "temperature": 0, "ignore_eos": true,
                              "return_tokens_as_token_ids": true});
        let mut completion = json!({"prompt": text, "logprobs": TOP});
        let mut chat = json!({"messages": user, "logprobs": true, "top_logprobs": TOP});
        for body in [&mut completion, &mut chat] {
            for (k, v) in sampling.as_object().unwrap() {
                body[k] = v.clone();
            }
        }
        let requests = [
            ("/v1/completions", completion, "completion", "prompt"),
            ("/v1/chat/completions", chat, "chat", "chat_prompt"),
        ];
        for (e, (path, body, reference, prompt)) in requests.into_iter().enumerate() {
            let (status, v) = post(base, path, &body.to_string());
            assert_eq!(status, 200, "{v}");
            // The prompt the engine fed is the one tokenized above.
            let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
            assert_eq!(
                prompt_tokens,
                ids(&case[prompt]).len(),
                "case {k}: {path} prompt"
            );
            match agrees(&generated(&v["choices"][0]), &case[reference], tie) {
                Ok(true) => same[e] += 1,
                Ok(false) => ties[e] += 1,
                Err(why) => failures.push(format!("case {k} {path}: {why}")),
            }
        }
    }
    eprintln!(
        "{name}: completions {} identical, {} diverging at a near-tie; chat {} identical, {} at a \
         near-tie (of {})",
        same[0],
        ties[0],
        same[1],
        ties[1],
        cases.len()
    );
    assert!(failures.is_empty(), "{name}: {failures:#?}");
}

#[test]
fn real_model_smollm2_through_every_endpoint_agrees_with_llamacpp() {
    let server = start(&[]);
    compare(&server.base, "smollm2", 0.5);
}

#[test]
fn real_model_gemma3_through_every_endpoint_agrees_with_llamacpp() {
    let server = start(&["--model", "gemma3-270m", "--chat-template", "gemma"]);
    compare(&server.base, "gemma3-270m", 1.0);
}

#[test]
fn real_model_a_base_model_serves_completions_with_bos_and_refuses_chat_naming_the_flag() {
    let server = start(&["--model", "gemma3-270m"]);
    let case = &fixture("server-gemma3-270m.json")["cases"][0];
    let text = case["text"].as_str().unwrap();
    // BOS as the vocabulary says, unless the client opts out.
    let (_, v) = post(
        &server.base,
        "/tokenize",
        &json!({"prompt": text}).to_string(),
    );
    assert_eq!(ids(&v["tokens"]), ids(&case["prompt"]));
    assert_eq!(ids(&v["tokens"])[0], 2, "Gemma's BOS");
    let body = json!({"prompt": text, "add_special_tokens": false});
    let (_, v) = post(&server.base, "/tokenize", &body.to_string());
    assert_eq!(ids(&v["tokens"]), ids(&case["prompt"])[1..]);
    // Completions are served, as llama.cpp continues the text.
    let body = json!({"prompt": text, "max_tokens": 16, "temperature": 0, "ignore_eos": true,
                      "logprobs": TOP, "return_tokens_as_token_ids": true});
    let (status, v) = post(&server.base, "/v1/completions", &body.to_string());
    assert_eq!(status, 200, "{v}");
    agrees(&generated(&v["choices"][0]), &case["completion"], 1.0).unwrap();
    // Chat needs a template: refused, naming the flag.
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": text}]}),
        ),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": text}]}),
        ),
    ] {
        let (status, v) = post(&server.base, path, &body.to_string());
        assert_eq!(status, 400, "{path}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("--chat-template"), "{path}: {message}");
    }
}
