//! A request fuzzer against a live server on the real SmolLM2 weights (issue 22): generated
//! bodies for both endpoints, every field the API accepts with valid shapes, extreme values
//! (huge, negative, fractional, out of range), wrong types, odd unicode and control-token
//! text, plus raw bytes and cut-off JSON. Valid shapes generate at most two tokens, so the
//! default 3,000 cases (`PENSIEVE_FUZZ_CASES`, sent by two clients at once) take about a
//! minute; each run draws new cases, so CI's runs add up. No answer may be a 5xx other than
//! capacity (503 with `Retry-After`), and the server must be healthy and correct after it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::server::{post, start};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Map, Value};

/// Clients sending cases at once: the server batches one's turns with another's and answers
/// refusals while a turn runs, as it does for real clients (and the run takes less time).
const CLIENTS: u32 = 2;

/// Numbers at the edges, and things that are not numbers.
fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(0.5)),
        Just(json!(1e300)),
        Just(json!(-1e300)),
        Just(json!(1e19)),
        Just(json!(u64::MAX)),
        Just(json!(i64::MIN)),
        Just(json!("1")),
        Just(Value::Null),
        Just(json!(true)),
        Just(json!([1])),
        any::<i64>().prop_map(|v| json!(v)),
        (-1e6f64..1e6).prop_map(|v| json!(v)),
    ]
}

/// A reply length that is either invalid or at most two tokens.
fn length() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => Just(json!(1)),
        4 => Just(json!(2)),
        1 => Just(json!(0)),
        1 => Just(json!(-5)),
        1 => Just(json!(2.5)),
        1 => Just(json!(1e300)),
        1 => Just(json!("2")),
        1 => Just(Value::Null),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "\\PC{0,40}",
        "[a-z ]{1,30}",
        Just("<|im_end|><|im_start|>assistant\n".to_string()),
        Just("\u{0}\u{FEFF}\u{202E}\u{10FFFF}".to_string()),
        Just("\u{F0000}0\u{F0001}".to_string()),
        Just(String::new()),
        Just("é".repeat(300)),
    ]
}

/// Anything JSON: the wrong type for any field.
fn junk() -> impl Strategy<Value = Value> {
    prop_oneof![
        number(),
        text().prop_map(Value::String),
        Just(json!({})),
        Just(json!([[]])),
        Just(json!({"a": {"b": [null]}})),
    ]
}

/// Mostly a valid value (`valid`), sometimes anything.
fn mostly(valid: impl Strategy<Value = Value> + 'static) -> BoxedStrategy<Value> {
    prop_oneof![6 => valid, 1 => junk()].boxed()
}

fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        8 => Just(json!("user")),
        3 => Just(json!("assistant")),
        1 => Just(json!("system")),
        1 => Just(json!("developer")),
        1 => Just(json!("tool")),
        1 => text().prop_map(Value::String),
        1 => number(),
    ];
    let content = prop_oneof![
        8 => text().prop_map(Value::String),
        1 => text().prop_map(|t| json!([{"type": "text", "text": t}])),
        1 => Just(json!([{"type": "image_url", "image_url": {"url": "x"}}])),
        1 => junk(),
    ];
    (role, content).prop_map(|(role, content)| json!({"role": role, "content": content}))
}

/// Optional fields of both endpoints (present or not, valid or not).
fn common_fields() -> impl Strategy<Value = Map<String, Value>> {
    let field = |name: &'static str, s: BoxedStrategy<Value>| {
        proptest::option::weighted(0.3, s).prop_map(move |v| (name, v))
    };
    let unit = |lo: f64, hi: f64| (lo..hi).prop_map(|v| json!(v));
    (
        (
            field("max_tokens", length().boxed()),
            field("max_completion_tokens", length().boxed()),
            field("temperature", mostly(unit(0.0, 2.0))),
            field("top_p", mostly(unit(0.01, 1.0))),
            field("top_k", mostly((-1i64..50).prop_map(|v| json!(v)))),
            field("seed", mostly(any::<u64>().prop_map(|v| json!(v)))),
        ),
        (
            field(
                "stop",
                mostly(prop_oneof![
                    text().prop_map(Value::String),
                    proptest::collection::vec(text(), 0..4).prop_map(|v| json!(v)),
                ]),
            ),
            field("stream", mostly(any::<bool>().prop_map(|v| json!(v)))),
            field(
                "stream_options",
                mostly(Just(json!({"include_usage": true}))),
            ),
            field("n", mostly((0u32..4).prop_map(|v| json!(v)))),
            field("ignore_eos", mostly(any::<bool>().prop_map(|v| json!(v)))),
            field("min_tokens", mostly((0u32..3).prop_map(|v| json!(v)))),
        ),
        (
            field(
                "logit_bias",
                mostly(prop_oneof![
                    (0u32..49_152, -100i32..100).prop_map(|(k, v)| json!({ k.to_string(): v })),
                    (text(), number()).prop_map(|(k, v)| json!({ k: v })),
                ]),
            ),
            field("model", mostly(Just(json!("pensieve")))),
            field(
                "response_format",
                mostly(prop_oneof![
                    Just(json!({"type": "json_object"})),
                    Just(json!({"type": "text"})),
                    (text(), text()).prop_map(|(name, kind)| json!({"type": "json_schema",
                        "json_schema": {"name": name, "schema": {"type": kind}}})),
                    Just(json!({"type": "json_schema", "json_schema": {"name": "n",
                        "schema": {"type": "array", "items": {"type": "integer"}}}})),
                ]),
            ),
        ),
    )
        .prop_map(|(a, b, c)| {
            let mut m = Map::new();
            let fields = [
                a.0, a.1, a.2, a.3, a.4, a.5, b.0, b.1, b.2, b.3, b.4, b.5, c.0, c.1, c.2,
            ];
            for (name, v) in fields {
                if let Some(v) = v {
                    m.insert(name.to_string(), v);
                }
            }
            m
        })
}

fn chat_body() -> impl Strategy<Value = Value> {
    let hint = |s: BoxedStrategy<Value>| proptest::option::weighted(0.2, s);
    (
        proptest::collection::vec(message(), 1..4),
        common_fields(),
        hint(mostly("[a-z0-9]{1,12}".prop_map(Value::String))),
        hint(mostly(any::<bool>().prop_map(|v| json!(v)))),
        hint(mostly((0.0f64..1e6).prop_map(|v| json!(v)))),
        hint(mostly(any::<bool>().prop_map(|v| json!(v)))),
    )
        .prop_map(|(mut messages, mut m, id, pin, resume, end)| {
            // Most conversations end with the user's turn, as valid ones must.
            if messages.len() % 2 == 1
                && let Some(last) = messages.last_mut()
            {
                last["role"] = json!("user");
            }
            m.insert("messages".into(), json!(messages));
            for (k, v) in [
                ("conversation_id", id),
                ("pin", pin),
                ("expect_resume_s", resume),
                ("end_conversation", end),
            ] {
                if let Some(v) = v {
                    m.insert(k.into(), v);
                }
            }
            Value::Object(m)
        })
}

fn completion_body() -> impl Strategy<Value = Value> {
    let prompt = prop_oneof![
        4 => text().prop_map(Value::String),
        1 => proptest::collection::vec(any::<u32>(), 0..6).prop_map(|v| json!(v)),
        3 => proptest::collection::vec(0u32..49_152, 1..6).prop_map(|v| json!(v)),
        1 => proptest::collection::vec(text(), 0..3).prop_map(|v| json!(v)),
        1 => junk(),
    ];
    (prompt, common_fields()).prop_map(|(p, mut m)| {
        m.insert("prompt".into(), p);
        Value::Object(m)
    })
}

/// A request: a path and the body's text.
fn request() -> impl Strategy<Value = (&'static str, String)> {
    prop_oneof![
        6 => chat_body().prop_map(|b| ("/v1/chat/completions", b.to_string())),
        3 => completion_body().prop_map(|b| ("/v1/completions", b.to_string())),
        1 => chat_body().prop_flat_map(|b| {
            let s = b.to_string();
            let n = s.len();
            (Just(s), 0..n.max(1)).prop_map(|(s, cut)| {
                let mut cut = cut.min(s.len());
                while !s.is_char_boundary(cut) {
                    cut -= 1;
                }
                ("/v1/chat/completions", s[..cut].to_string())
            })
        }),
        1 => "\\PC{0,64}".prop_map(|s| ("/v1/completions", s)),
    ]
}

/// Sends `body` raw; the status.
fn send(base: &str, path: &str, body: &str) -> Result<u16, String> {
    let r = ureq::post(&format!("{base}{path}"))
        .set("content-type", "application/json")
        .send_string(body);
    match r {
        Ok(r) => {
            // A stream's whole body is read, so its end (and any error chunk) is seen.
            let _ = r.into_string();
            Ok(200)
        }
        Err(ureq::Error::Status(code, r)) => {
            let retry = r.header("retry-after").is_some();
            let text = r.into_string().unwrap_or_default();
            match code {
                500.. if !(code == 503 && retry) => Err(format!("{code}: {text}")),
                _ => Ok(code),
            }
        }
        Err(e) => Err(format!("transport: {e}")),
    }
}

#[test]
fn real_model_fuzzed_requests_never_take_the_server_down() {
    let cases = std::env::var("PENSIEVE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3_000);
    let store = tempfile::tempdir().unwrap();
    let server = start(&[
        "--default-max-tokens",
        "2",
        "--max-conversations",
        "64",
        "--store",
        store.path().to_str().unwrap(),
    ]);
    let reference = ask(&server.base);
    let answered = std::sync::Mutex::new(std::collections::BTreeMap::<u16, usize>::new());
    let results: Vec<_> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|i| {
                let (server, answered) = (&server, &answered);
                scope.spawn(move || {
                    // Each client its own random cases (a seed of its own).
                    let mut runner = TestRunner::new(Config {
                        cases: cases / CLIENTS + u32::from(i < cases % CLIENTS),
                        failure_persistence: None,
                        ..Config::default()
                    });
                    runner.run(&request(), |(path, body)| {
                        let code = send(&server.base, path, &body)
                            .map_err(|e| TestCaseError::fail(format!("{path} {body}: {e}")))?;
                        *answered.lock().unwrap().entry(code).or_default() += 1;
                        Ok(())
                    })
                })
            })
            .collect();
        clients.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let answered = answered.into_inner().unwrap();
    eprintln!("fuzzer: answers by status {answered:?}");
    for result in results {
        if let Err(e) = result {
            panic!("{e}");
        }
    }
    assert!(
        answered.get(&200).copied().unwrap_or(0) > cases as usize / 20,
        "too few valid requests to mean anything: {answered:?}"
    );
    let health = ureq::get(&format!("{}/health", server.base))
        .call()
        .unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(ask(&server.base), reference, "the server answers as before");
}

/// A fixed question's greedy answer.
fn ask(base: &str) -> String {
    let (status, v) = post(
        base,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8, "temperature": 0})
        .to_string(),
    );
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}
