//! Tenants: with several API keys, each key's conversations, responses and conversation ids
//! are its own. Another tenant's id or name answers 404 (or starts afresh), never its data,
//! through every endpoint that takes one; the owner's data is untouched by the attempts.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::server::start;
use serde_json::{json, Value};

/// `method` `path` as the tenant of `key`; the status and the JSON answer.
fn call(method: &str, base: &str, path: &str, key: &str, body: Option<Value>) -> (u16, Value) {
    let r = ureq::request(method, &format!("{base}{path}"))
        .set("authorization", &format!("Bearer {key}"))
        .set("content-type", "application/json");
    let r = match body {
        Some(b) => r.send_string(&b.to_string()),
        None => r.call(),
    };
    let r = match r {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{e}"),
    };
    (r.status(), r.into_json().unwrap_or(Value::Null))
}

#[test]
fn real_model_two_tenants_cannot_reach_each_other_s_data() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# two teams\nalpha sk-alpha\nbeta sk-beta\n").unwrap();
    let server = start(&[
        "--api-key-file",
        keys.to_str().unwrap(),
        "--store",
        dir.path().join("store").to_str().unwrap(),
    ]);
    let b = &server.base;
    let (a, other) = ("sk-alpha", "sk-beta");
    let (status, _) = call("GET", b, "/v1/models", "sk-gamma", None);
    assert_eq!(status, 401);

    // A named chat conversation: the other tenant's request of the same name starts afresh.
    let chat = |key: &str, text: &str| {
        let body = json!({"conversation_id": "team-chat", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": text}]});
        let (status, r) = call("POST", b, "/v1/chat/completions", key, Some(body));
        assert_eq!(status, 200, "{r}");
        r["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let first = chat(a, "The secret word is walnut.");
    let theirs = chat(other, "What is the secret word?");
    let ours = chat(a, "What is the secret word?");
    assert!(
        theirs < first + 4,
        "the other tenant saw a history: {theirs} vs {first}"
    );
    assert!(
        ours > first,
        "the owner's conversation went on: {ours} vs {first}"
    );

    // A stored response.
    let (status, r) = call(
        "POST",
        b,
        "/v1/responses",
        a,
        Some(json!({"input": "Hi", "max_output_tokens": 4})),
    );
    assert_eq!(status, 200, "{r}");
    let resp = r["id"].as_str().unwrap().to_string();
    for (method, path, body) in [
        ("GET", format!("/v1/responses/{resp}"), None),
        ("DELETE", format!("/v1/responses/{resp}"), None),
        (
            "POST",
            "/v1/responses".into(),
            Some(json!({"input": "Go on", "previous_response_id": resp, "max_output_tokens": 2})),
        ),
    ] {
        let (status, r) = call(method, b, &path, other, body);
        assert_eq!(status, 404, "{method} {path}: {r}");
        assert!(!r.to_string().contains("Hi"), "{r}");
    }
    assert_eq!(
        call("GET", b, &format!("/v1/responses/{resp}"), a, None).0,
        200
    );

    // A conversation of the Conversations API.
    let items = json!({"items": [{"role": "user", "content": "The code is 4711."}], "metadata": {"team": "alpha"}});
    let (status, c) = call("POST", b, "/v1/conversations", a, Some(items));
    assert_eq!(status, 200, "{c}");
    let conv = c["id"].as_str().unwrap().to_string();
    let (_, listed) = call(
        "GET",
        b,
        &format!("/v1/conversations/{conv}/items"),
        a,
        None,
    );
    let item = listed["data"][0]["id"].as_str().unwrap().to_string();
    let attempts = [
        ("GET", format!("/v1/conversations/{conv}"), None),
        (
            "POST",
            format!("/v1/conversations/{conv}"),
            Some(json!({"metadata": {"team": "beta"}})),
        ),
        ("GET", format!("/v1/conversations/{conv}/items"), None),
        (
            "POST",
            format!("/v1/conversations/{conv}/items"),
            Some(json!({"items": [{"role": "user", "content": "x"}]})),
        ),
        (
            "GET",
            format!("/v1/conversations/{conv}/items/{item}"),
            None,
        ),
        (
            "DELETE",
            format!("/v1/conversations/{conv}/items/{item}"),
            None,
        ),
        (
            "POST",
            "/v1/responses".into(),
            Some(json!({"input": "The code?", "conversation": conv, "max_output_tokens": 2})),
        ),
        ("DELETE", format!("/v1/conversations/{conv}"), None),
    ];
    for (method, path, body) in attempts {
        let (status, r) = call(method, b, &path, other, body);
        assert_eq!(status, 404, "{method} {path}: {r}");
        assert!(!r.to_string().contains("4711"), "{r}");
    }
    let (status, c) = call("GET", b, &format!("/v1/conversations/{conv}"), a, None);
    assert_eq!((status, &c["metadata"]), (200, &json!({"team": "alpha"})));
    let (_, after) = call(
        "GET",
        b,
        &format!("/v1/conversations/{conv}/items"),
        a,
        None,
    );
    assert_eq!(
        after["data"], listed["data"],
        "the owner's items are as they were"
    );
}
