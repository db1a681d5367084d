//! Acknowledged means done: a deletion (`DELETE /v1/responses/{id}`, a chat turn with
//! `end_conversation`) answers 200 only once the store no longer holds the conversation. With
//! the store unreachable it answers 503 and the conversation stays, to be continued once the
//! store is back; a read during the outage answers 503, not "no such response". On the folder
//! store, a `kill -9` right after a deletion's 200 does not bring the conversation back.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::redis_server;
use common::server::{post, request, start};
use serde_json::{json, Value};

/// A stored response to `input`, continuing `previous` if given: its id.
fn respond(base: &str, input: &str, previous: Option<&str>) -> String {
    let mut body = json!({"model": "pensieve", "input": input, "max_output_tokens": 4});
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
    }
    let (status, out) = post(base, "/v1/responses", &body.to_string());
    assert_eq!(status, 200, "{out}");
    out["id"].as_str().unwrap().to_string()
}

/// A chat turn of the conversation `name`, ending it when `end`.
fn chat(base: &str, name: &str, text: &str, end: bool) -> (u16, Value) {
    let body = json!({
        "model": "pensieve", "max_tokens": 4, "conversation_id": name, "end_conversation": end,
        "messages": [{"role": "user", "content": text}],
    });
    post(base, "/v1/chat/completions", &body.to_string())
}

/// `method path` until it answers `want` (the store's client backs off for a while after an
/// outage), within a generous deadline: the verdict is the answer, not how soon it came.
fn until(base: &str, method: &str, path: &str, want: u16) -> Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, out) = request(method, base, path, "");
        if status == want {
            return out;
        }
        assert!(Instant::now() < deadline, "{method} {path}: {status} {out}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn real_model_deletions_wait_for_redis_and_fail_while_it_is_unreachable() {
    let redis = redis_server::Server::start(None);
    let server = start(&["--redis", &redis.url(), "--redis-prefix", "outage"]);
    let base = &server.base;
    let kept = respond(base, "Name a colour.", None);
    let gone = respond(base, "Name a fruit.", None);
    let (status, out) = chat(base, "tutor", "Hello there.", false);
    assert_eq!(status, 200, "{out}");

    redis.freeze(true);
    let (status, out) = request("DELETE", base, &format!("/v1/responses/{kept}"), "");
    assert_eq!(status, 503, "a deletion the store did not take: {out}");
    let (status, out) = request("GET", base, &format!("/v1/responses/{kept}"), "");
    assert_eq!(status, 503, "a read the store could not answer: {out}");
    let (status, out) = chat(base, "tutor", "Goodbye.", true);
    assert_eq!(status, 503, "an end the store did not take: {out}");
    redis.freeze(false);

    // Nothing was deleted: both continue from what the store held.
    let out = until(base, "GET", &format!("/v1/responses/{kept}"), 200);
    assert_eq!(out["id"], json!(kept), "{out}");
    respond(base, "And another?", Some(&kept));
    let (status, out) = chat(base, "tutor", "Still there?", false);
    assert_eq!(status, 200, "{out}");

    // Deleted with the store up: gone, here and on a server started afresh on the store.
    let (status, out) = request("DELETE", base, &format!("/v1/responses/{gone}"), "");
    assert_eq!(status, 200, "{out}");
    let (status, out) = chat(base, "tutor", "Goodbye.", true);
    assert_eq!(status, 200, "{out}");
    let other = start(&["--redis", &redis.url(), "--redis-prefix", "outage"]);
    let (status, out) = request("GET", &other.base, &format!("/v1/responses/{gone}"), "");
    assert_eq!(status, 404, "{out}");
    let (status, out) = request("GET", &other.base, &format!("/v1/responses/{kept}"), "");
    assert_eq!(status, 200, "{out}");
}

#[test]
fn real_model_a_deletion_acknowledged_on_the_folder_store_survives_kill_9() {
    let store = tempfile::tempdir().unwrap();
    let args = ["--store", store.path().to_str().unwrap()];
    for round in 0..3 {
        let mut server = start(&args);
        let id = respond(&server.base, "Name a colour.", None);
        let (status, out) = request("DELETE", &server.base, &format!("/v1/responses/{id}"), "");
        assert_eq!(status, 200, "{out}");
        // No clean stop: whatever the 200 promised is already on disk.
        server.child.kill().unwrap();
        server.child.wait().unwrap();
        let server = start(&args);
        let (status, out) = request("GET", &server.base, &format!("/v1/responses/{id}"), "");
        assert_eq!(
            status, 404,
            "round {round}: a deleted response came back: {out}"
        );
    }
}
