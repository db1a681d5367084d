//! The Conversations API's guarantees (issue 73), each from outside through HTTP on a server
//! of the tiny model (what is checked is what is stored, not what the model says):
//! - concurrent item adds all land, on one server and across a fleet;
//! - a deletion that answered 200 is final, whatever raced it;
//! - an edit is acknowledged only once the store has it: with the store frozen it answers
//!   503 and changes nothing;
//! - an item's id names that item for its life;
//! - an empty conversation, its metadata and creation time outlive `kill -9`;
//! - metadata is held to OpenAI's limits on every route that takes it;
//! - `--api-key` is taken whole.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::redis_server;
use common::server::{post, request, start, Server};
use serde_json::{json, Value};

fn folder_server(store: &tempfile::TempDir) -> Server {
    start(&["--model", "tiny", "--store", store.path().to_str().unwrap()])
}

fn create(base: &str, body: Value) -> String {
    let (status, c) = post(base, "/v1/conversations", &body.to_string());
    assert_eq!(status, 200, "{c}");
    c["id"].as_str().unwrap().to_string()
}

fn add(base: &str, id: &str, text: &str) -> (u16, Value) {
    let body = json!({"items": [{"type": "message", "role": "user", "content": text}]});
    post(
        base,
        &format!("/v1/conversations/{id}/items"),
        &body.to_string(),
    )
}

/// The items of `id` as (id, text), oldest first; `None` for a 404.
fn items(base: &str, id: &str) -> Option<Vec<(String, String)>> {
    let path = format!("/v1/conversations/{id}/items?order=asc&limit=100");
    let (status, l) = request("GET", base, &path, "");
    if status == 404 {
        return None;
    }
    assert_eq!(status, 200, "{l}");
    let data = l["data"].as_array().unwrap();
    Some(
        data.iter()
            .map(|i| {
                let text = i["content"][0]["text"].as_str().unwrap_or_default();
                (i["id"].as_str().unwrap().to_string(), text.to_string())
            })
            .collect(),
    )
}

fn texts(base: &str, id: &str) -> Vec<String> {
    items(base, id)
        .unwrap()
        .into_iter()
        .map(|(_, t)| t)
        .collect()
}

/// Two servers of the tiny model on one Valkey under `prefix`, and the Valkey.
fn tiny_fleet(prefix: &str) -> (redis_server::Server, Server, Server) {
    let redis = redis_server::Server::start(None);
    let url = redis.url();
    let args = ["--model", "tiny", "--redis", &url, "--redis-prefix", prefix];
    let (a, b) = (start(&args), start(&args));
    (redis, a, b)
}

fn kill_9(server: &mut Server) {
    server.child.kill().unwrap();
    server.child.wait().unwrap();
}

/// Sends every `(base, text)` add to `id` at once; the statuses, in order.
fn adds_at_once(id: &str, adds: &[(String, String)]) -> Vec<(u16, Value)> {
    std::thread::scope(|scope| {
        let calls: Vec<_> = (adds.iter())
            .map(|(base, text)| scope.spawn(move || add(base, id, text)))
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    })
}

#[test]
fn concurrent_item_adds_all_land_and_outlive_kill_9() {
    let store = tempfile::tempdir().unwrap();
    let mut server = folder_server(&store);
    let id = create(&server.base, json!({}));
    for round in 0..3 {
        let adds: Vec<(String, String)> = (0..10)
            .map(|i| (server.base.clone(), format!("round {round} add {i}")))
            .collect();
        let answers = adds_at_once(&id, &adds);
        let listed = texts(&server.base, &id);
        for ((_, text), (status, out)) in adds.iter().zip(&answers) {
            // One server, no turn running: every add is taken.
            assert_eq!(*status, 200, "{text}: {out}");
            assert!(
                listed.contains(text),
                "round {round}: {text:?} lost: {listed:?}"
            );
        }
        assert_eq!(listed.len(), 10 * (round + 1), "{listed:?}");
    }
    let before = items(&server.base, &id);
    kill_9(&mut server);
    let server = folder_server(&store);
    assert_eq!(items(&server.base, &id), before, "after kill -9");
}

#[test]
fn a_deletion_that_answered_200_is_final_against_racing_adds() {
    let store = tempfile::tempdir().unwrap();
    let mut server = folder_server(&store);
    let base = server.base.clone();
    let mut deleted = Vec::new();
    for round in 0..20 {
        let id = create(
            &base,
            json!({"items": [{"role": "user", "content": "first"}]}),
        );
        let path = format!("/v1/conversations/{id}");
        let answers: Vec<u16> = std::thread::scope(|scope| {
            let adds: Vec<_> = (0..4)
                .map(|i| {
                    let (base, id) = (&base, &id);
                    scope.spawn(move || add(base, id, &format!("add {i}")).0)
                })
                .collect();
            let delete = scope.spawn(|| request("DELETE", &base, &path, "").0);
            let mut all: Vec<u16> = adds.into_iter().map(|a| a.join().unwrap()).collect();
            all.push(delete.join().unwrap());
            all
        });
        assert!(
            answers.iter().all(|s| matches!(s, 200 | 404)),
            "{answers:?}"
        );
        assert_eq!(
            answers[4], 200,
            "round {round}: the deletion of a conversation that exists"
        );
        let (status, out) = request("GET", &base, &format!("/v1/conversations/{id}"), "");
        assert_eq!(status, 404, "round {round}: deleted, then {out}");
        deleted.push(id);
    }
    kill_9(&mut server);
    let server = folder_server(&store);
    for id in &deleted {
        assert_eq!(
            items(&server.base, id),
            None,
            "{id} came back after kill -9"
        );
    }
}

#[test]
fn adds_alternating_between_two_servers_of_a_fleet_all_land() {
    let (_redis, a, b) = tiny_fleet("edits");
    let id = create(&a.base, json!({}));
    let mut acknowledged = Vec::new();
    for round in 0..3 {
        let adds: Vec<(String, String)> = (0..6)
            .map(|i| {
                let base = [&a.base, &b.base][i % 2].clone();
                (base, format!("round {round} add {i}"))
            })
            .collect();
        for ((_, text), (status, out)) in adds.iter().zip(adds_at_once(&id, &adds)) {
            // Each server decides again on what the other stored; a 409 only after a few tries.
            assert!(matches!(status, 200 | 409), "{text}: {status} {out}");
            if status == 200 {
                acknowledged.push(text.clone());
            }
        }
        for server in [&a, &b] {
            let listed = texts(&server.base, &id);
            for text in &acknowledged {
                assert!(
                    listed.contains(text),
                    "{text:?} lost on {}: {listed:?}",
                    server.base
                );
            }
        }
    }
    assert!(acknowledged.len() >= 9, "most adds land: {acknowledged:?}");
    assert_eq!(items(&a.base, &id), items(&b.base, &id));
}

#[test]
fn edits_while_the_store_is_frozen_answer_503_and_change_nothing() {
    let (redis, a, b) = tiny_fleet("frozen");
    let id = create(
        &a.base,
        json!({"items": [{"role": "user", "content": "kept"}],
        "metadata": {"topic": "before"}}),
    );
    let before = items(&a.base, &id).unwrap();
    let kept_id = before[0].0.clone();
    redis.freeze(true);
    for server in [&a, &b] {
        let (status, out) = add(&server.base, &id, "added while frozen");
        assert_eq!(status, 503, "an add: {out}");
        let path = format!("/v1/conversations/{id}/items/{kept_id}");
        let (status, out) = request("DELETE", &server.base, &path, "");
        assert_eq!(status, 503, "an item's deletion: {out}");
        let update = json!({"metadata": {"topic": "during"}}).to_string();
        let (status, out) = post(&server.base, &format!("/v1/conversations/{id}"), &update);
        assert_eq!(status, 503, "an update: {out}");
        let (status, out) = post(&server.base, "/v1/conversations", "{}");
        assert_eq!(status, 503, "a creation: {out}");
    }
    redis.freeze(false);
    for server in [&a, &b] {
        // The store's client backs off for a while after an outage: read until it answers.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let path = format!("/v1/conversations/{id}");
        let object = loop {
            let (status, out) = request("GET", &server.base, &path, "");
            if status == 200 || std::time::Instant::now() > deadline {
                break out;
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        };
        assert_eq!(object["metadata"], json!({"topic": "before"}), "{object}");
        assert_eq!(items(&server.base, &id).unwrap(), before);
    }
}

#[test]
fn an_item_id_names_one_item_for_its_life() {
    let server = start(&["--model", "tiny"]);
    let base = &server.base;
    let hello = json!({"role": "user", "content": "Hello"});
    let id = create(base, json!({"items": [hello, hello]}));
    let before = items(base, &id).unwrap();
    let (first, second) = (before[0].0.clone(), before[1].0.clone());
    assert_ne!(first, second, "equal items, distinct ids");
    let path = format!("/v1/conversations/{id}/items/{first}");
    let (status, out) = request("DELETE", base, &path, "");
    assert_eq!(status, 200, "{out}");
    // The second "Hello" keeps its id, and a retried deletion of the first removes nothing.
    assert_eq!(
        items(base, &id).unwrap(),
        vec![(second.clone(), "Hello".into())]
    );
    let (status, out) = request("DELETE", base, &path, "");
    assert_eq!(status, 404, "{out}");
    assert_eq!(items(base, &id).unwrap().len(), 1);
    // A "Hello" added later is another item, with an id never used.
    let (status, out) = add(base, &id, "Hello");
    assert_eq!(status, 200, "{out}");
    let new = out["data"][0]["id"].as_str().unwrap();
    assert!(new != first && new != second, "{new} reused");
}

#[test]
fn an_empty_conversation_and_its_metadata_outlive_kill_9() {
    let store = tempfile::tempdir().unwrap();
    let mut server = folder_server(&store);
    let (status, made) = post(
        &server.base,
        "/v1/conversations",
        &json!({"metadata": {"topic": "empty"}}).to_string(),
    );
    assert_eq!(status, 200, "{made}");
    let id = made["id"].as_str().unwrap();
    kill_9(&mut server);
    let server = folder_server(&store);
    let (status, object) = request("GET", &server.base, &format!("/v1/conversations/{id}"), "");
    assert_eq!((status, &object), (200, &made), "after kill -9");
    assert_eq!(items(&server.base, id), Some(Vec::new()));
}

#[test]
fn metadata_is_held_to_openai_limits_on_every_route() {
    let server = start(&["--model", "tiny"]);
    let base = &server.base;
    let id = create(base, json!({}));
    let many: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    let bad = [
        Value::Object(many),
        json!({"k".repeat(65): "v"}),
        json!({"k": "v".repeat(513)}),
        json!({"k": 1}),
    ];
    let routes: [(&str, Value); 4] = [
        ("/v1/conversations", json!({})),
        (&format!("/v1/conversations/{id}"), json!({})),
        (
            "/v1/responses",
            json!({"input": "Hi", "max_output_tokens": 1}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
        ),
    ];
    for (path, body) in &routes {
        for metadata in &bad {
            let mut body = body.clone();
            body["metadata"] = metadata.clone();
            let (status, e) = post(base, path, &body.to_string());
            assert_eq!(status, 400, "{path} {metadata}: {e}");
            assert_eq!(e["error"]["param"], "metadata", "{path}: {e}");
        }
        // At the limits, taken.
        let mut body = body.clone();
        let full: serde_json::Map<String, Value> = (0..16)
            .map(|i| (format!("{i:02}{}", "k".repeat(62)), json!("v".repeat(512))))
            .collect();
        body["metadata"] = Value::Object(full);
        let (status, e) = post(base, path, &body.to_string());
        assert_eq!(status, 200, "{path}: {e}");
    }
}

#[test]
fn an_api_key_with_a_comma_is_taken_whole() {
    let server = start(&["--model", "tiny", "--api-key", "a,b"]);
    let models = format!("{}/v1/models", server.base);
    let status = |key: &str| match ureq::get(&models)
        .set("authorization", &format!("Bearer {key}"))
        .call()
    {
        Ok(r) => r.status(),
        Err(ureq::Error::Status(s, _)) => s,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(status("a,b"), 200);
    assert_eq!(status("a"), 401);
    assert_eq!(status("b"), 401);
}

#[test]
fn conversations_past_the_limit_are_left_to_the_store_and_come_back() {
    // The server holds at most --max-conversations in memory, whatever only reads them; the
    // store keeps the rest, which come back whole at their next request.
    let store = tempfile::tempdir().unwrap();
    let server = start(&[
        "--model",
        "tiny",
        "--store",
        store.path().to_str().unwrap(),
        "--max-conversations",
        "3",
    ]);
    let base = &server.base;
    let made: Vec<(String, Vec<(String, String)>)> = (0..10)
        .map(|i| {
            let id = create(
                base,
                json!({"items": [{"role": "user", "content": format!("conversation {i}")}],
                       "metadata": {"n": format!("{i}")}}),
            );
            let listed = items(base, &id).unwrap();
            (id, listed)
        })
        .collect();
    for _ in 0..2 {
        for (i, (id, listed)) in made.iter().enumerate() {
            assert_eq!(items(base, id).as_ref(), Some(listed));
            let (status, c) = request("GET", base, &format!("/v1/conversations/{id}"), "");
            assert_eq!(
                (status, &c["metadata"]),
                (200, &json!({"n": format!("{i}")}))
            );
            let held = common::server::metric(base, "pensieve_conversations");
            assert!(held <= 3.0, "{held} conversations held after a read");
        }
        // A turn (a completion's session counts too) brings the gauge up to date whatever
        // else does.
        let completion = r#"{"prompt": "Hi", "max_tokens": 1}"#;
        let (status, out) = post(base, "/v1/completions", completion);
        assert_eq!(status, 200, "{out}");
        let held = common::server::metric(base, "pensieve_conversations");
        assert!(held <= 3.0, "{held} conversations held");
    }
}
