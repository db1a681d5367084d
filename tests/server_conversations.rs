//! OpenAI's Conversations API on the real model: a conversation made through
//! `/v1/conversations` continues through `/v1/responses` with its KV reused, across a restart
//! of the server (folder store) and on another server of a fleet (Redis); its items list,
//! add and delete, and a turn after an edit is what a stateless server computes on the new
//! item list.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::server::{fleet, post, request, start};
use serde_json::{json, Value};

fn create(base: &str, items: Value) -> String {
    let (status, c) = post(
        base,
        "/v1/conversations",
        &json!({"items": items}).to_string(),
    );
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["object"], "conversation");
    c["id"].as_str().unwrap().to_string()
}

/// A greedy turn of `input` on conversation `id`: the reply's text and its usage.
fn turn(base: &str, id: &str, input: &str) -> (String, Value) {
    let body = json!({"input": input, "conversation": id, "max_output_tokens": 12,
        "temperature": 0, "instructions": "Answer in one short sentence."});
    let (status, r) = post(base, "/v1/responses", &body.to_string());
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["conversation"]["id"], id, "{r}");
    (
        r["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .to_string(),
        r["usage"].clone(),
    )
}

fn items(base: &str, id: &str) -> Vec<Value> {
    let (status, l) = request(
        "GET",
        base,
        &format!("/v1/conversations/{id}/items?order=asc"),
        "",
    );
    assert_eq!(status, 200, "{l}");
    assert_eq!(l["has_more"], false);
    l["data"].as_array().unwrap().clone()
}

/// The usage's cached tokens cover the history: all the prompt but the new message's few
/// tokens (and the last partial chunk of the KV, which is recomputed).
fn assert_history_reused(usage: &Value) {
    let (prompt, cached) = (
        usage["input_tokens"].as_u64().unwrap(),
        usage["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    );
    assert!(cached + 48 >= prompt && cached > 0, "{usage}");
}

#[test]
fn real_model_a_conversation_keeps_its_kv_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap();
    let server = start(&["--store", store]);
    let id = create(
        &server.base,
        json!([{"type": "message", "role": "user",
        "content": "My name is Ada and I live in Paris."}]),
    );
    turn(&server.base, &id, "Where do I live?");
    let (_, usage) = turn(&server.base, &id, "And what is my name?");
    assert_history_reused(&usage);
    let before = items(&server.base, &id);
    // The instructions, the first message, two questions and their replies.
    assert_eq!(before.len(), 6, "{before:#?}");
    drop(server);
    let server = start(&["--store", store]);
    assert_eq!(
        items(&server.base, &id),
        before,
        "the items outlive the server"
    );
    let (_, usage) = turn(&server.base, &id, "Thanks.");
    assert_history_reused(&usage);
    let (status, d) = request(
        "DELETE",
        &server.base,
        &format!("/v1/conversations/{id}"),
        "",
    );
    assert_eq!((status, &d["deleted"]), (200, &json!(true)), "{d}");
    let (status, _) = request("GET", &server.base, &format!("/v1/conversations/{id}"), "");
    assert_eq!(status, 404);
}

#[test]
fn real_model_a_conversation_continues_on_another_server_of_a_fleet() {
    let (_redis, a, b) = fleet("conversations-test");
    let id = create(&a.base, json!([]));
    turn(&a.base, &id, "My name is Ada.");
    turn(&a.base, &id, "I live in Paris.");
    let (_, usage) = turn(&b.base, &id, "Where do I live?");
    assert_history_reused(&usage);
    assert_eq!(items(&a.base, &id), items(&b.base, &id));
}

#[test]
fn real_model_a_turn_after_an_edit_is_what_a_stateless_server_computes() {
    let server = start(&[]);
    let reference = start(&[]);
    let id = create(&server.base, json!([]));
    turn(&server.base, &id, "My name is Ada.");
    turn(&server.base, &id, "I live in Paris.");
    turn(&server.base, &id, "I like tea.");
    // Delete the second exchange's message, and add an item at the end.
    let listed = items(&server.base, &id);
    let paris = listed
        .iter()
        .find(|i| i["content"][0]["text"] == "I live in Paris.");
    let second = paris.unwrap()["id"].as_str().unwrap();
    let (status, c) = request(
        "DELETE",
        &server.base,
        &format!("/v1/conversations/{id}/items/{second}"),
        "",
    );
    assert_eq!((status, c["id"].as_str()), (200, Some(id.as_str())), "{c}");
    let add = json!({"items": [{"role": "user", "content": "I also like chess."}]});
    let (status, added) = post(
        &server.base,
        &format!("/v1/conversations/{id}/items"),
        &add.to_string(),
    );
    assert_eq!(status, 200, "{added}");
    assert_eq!(added["data"].as_array().map(Vec::len), Some(1), "{added}");
    let edited = items(&server.base, &id);
    assert_eq!(edited.len(), listed.len(), "one item deleted, one added");
    assert!(edited.iter().all(|i| i["id"] != second));
    for i in &edited {
        let (status, one) = request(
            "GET",
            &server.base,
            &format!("/v1/conversations/{id}/items/{}", i["id"].as_str().unwrap()),
            "",
        );
        assert_eq!((status, &one), (200, i));
    }
    let (text, _) = turn(&server.base, &id, "What do I like?");
    // A stateless server given the edited item list and the same turn.
    let input: Vec<Value> = edited
        .iter()
        .cloned()
        .chain([json!({"role": "user", "content": "What do I like?"})])
        .collect();
    // The items hold the instructions as the conversation's system message.
    assert_eq!(edited[0]["role"], "system");
    let body = json!({"input": input, "store": false, "max_output_tokens": 12, "temperature": 0});
    let (status, r) = post(&reference.base, "/v1/responses", &body.to_string());
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["output"][0]["content"][0]["text"].as_str().unwrap(), text);
}

#[test]
fn unknown_conversations_and_items_answer_404_and_bad_bodies_400() {
    let server = start(&["--model", "tiny"]);
    let b = &server.base;
    for (method, path) in [
        (
            "GET",
            "/v1/conversations/conv_00000000000000000000000000000000",
        ),
        (
            "DELETE",
            "/v1/conversations/conv_00000000000000000000000000000000",
        ),
        (
            "GET",
            "/v1/conversations/conv_00000000000000000000000000000000/items",
        ),
        ("GET", "/v1/conversations/resp_1/items"),
    ] {
        let (status, e) = request(method, b, path, "");
        assert_eq!(status, 404, "{method} {path}: {e}");
        assert!(e["error"]["message"].is_string(), "{e}");
    }
    let id = create(b, json!([]));
    let (status, _) = request("GET", b, &format!("/v1/conversations/{id}/items/msg_x"), "");
    assert_eq!(status, 404);
    for body in [
        json!({"items": [{"type": "web_search_call"}]}),
        json!({"metadata": {"a": 1}}),
        json!({"itemz": []}),
    ] {
        let (status, e) = post(b, "/v1/conversations", &body.to_string());
        assert_eq!(status, 400, "{body}: {e}");
    }
    let (status, c) = post(
        b,
        &format!("/v1/conversations/{id}"),
        &json!({"metadata": {"topic": "x"}}).to_string(),
    );
    assert_eq!((status, &c["metadata"]), (200, &json!({"topic": "x"})));
}

/// A chat turn of the named conversation `name`: the answer, and whether the server said it
/// rewrote the conversation's history.
fn named_chat(base: &str, name: &str, messages: Value) -> (Value, bool) {
    let body = json!({"messages": messages, "conversation_id": name, "max_tokens": 4});
    let r = ureq::post(&format!("{base}/v1/chat/completions"))
        .set("content-type", "application/json")
        .send_string(&body.to_string())
        .unwrap();
    let rewritten = r.header("x-conversation-rewritten") == Some("true");
    (
        serde_json::from_str(&r.into_string().unwrap()).unwrap(),
        rewritten,
    )
}

#[test]
fn real_model_a_system_message_resent_each_turn_continues_and_a_rewrite_is_announced() {
    let server = start(&[]);
    let base = &server.base;
    let system = json!({"role": "system", "content": "You are terse."});
    let user = |text: &str| json!({"role": "user", "content": text});
    let (_, rewritten) = named_chat(base, "habit", json!([system, user("Name a colour.")]));
    assert!(!rewritten);
    // The system message again, then only the new message: the conversation goes on (it
    // became the last exchange alone before).
    let (on, rewritten) = named_chat(base, "habit", json!([system, user("Another?")]));
    assert!(!rewritten, "{on}");
    let (fresh, _) = named_chat(base, "fresh", json!([system, user("Another?")]));
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        tokens(&on) > tokens(&fresh) + 4,
        "the second turn saw the first exchange: {on} {fresh}"
    );
    // Another system message is another history: the client is told it replaced the held one.
    let other = json!({"role": "system", "content": "You are verbose."});
    let (answer, rewritten) = named_chat(base, "habit", json!([other, user("Another?")]));
    assert!(rewritten, "{answer}");
    let (answer, rewritten) = named_chat(base, "habit", json!([other, user("And?")]));
    assert!(!rewritten, "{answer}");
}
