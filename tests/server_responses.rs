//! OpenAI's Responses API through the official `openai` client, on two servers sharing a
//! Redis store (a fleet): a response continues the one it names from the conversation that
//! response stored, sending only its new input, on whichever server it lands, and answers as
//! a stateless request with the whole history does.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::server::{client, fleet};

#[test]
fn real_model_responses_continue_stored_conversations_across_a_fleet() {
    let (_redis, a, b) = fleet("responses-test");
    let out = client(&a.base, &["responses", &b.base]);
    let (first, second) = (&out["first"], &out["second"]);
    assert!(first["id"].as_str().unwrap().starts_with("resp_"), "{out}");
    assert!(!first["text"].as_str().unwrap().is_empty(), "{out}");
    assert_eq!(second["previous"], first["id"], "{out}");
    // The second response read the first's conversation from the cache...
    let cached = second["usage"]["cached"].as_u64().unwrap();
    let before = first["usage"]["input"].as_u64().unwrap();
    assert!(cached + 32 >= before && cached > 0, "{out}");
    // ...and answered as the same history sent whole does.
    assert_eq!(second["text"], out["stateless"]["text"], "{out}");
    assert_eq!(
        second["usage"]["input"], out["stateless"]["usage"]["input"],
        "{out}"
    );
    // Streamed: the deltas add up to the response, between its first and last events.
    let streamed = &out["streamed"];
    assert_eq!(streamed["text"], streamed["completed"], "{out}");
    let events: Vec<&str> = streamed["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(events.first(), Some(&"response.created"), "{out}");
    assert_eq!(events.last(), Some(&"response.completed"), "{out}");
    assert!(events.contains(&"response.output_text.delta"), "{out}");
    assert!(streamed["usage"]["cached"].as_u64().unwrap() > 0, "{out}");
    // The other server of the fleet continued the second response from the shared store.
    let fleet = &out["fleet"];
    assert!(!fleet["text"].as_str().unwrap().is_empty(), "{out}");
    assert!(fleet["usage"]["cached"].as_u64().unwrap() > 0, "{out}");
    assert_eq!(out["retrieved"], second["text"], "{out}");
    // Deleted, a response is no longer found.
    assert_eq!(out["deleted"], true, "{out}");
    assert_eq!(out["gone"], true, "{out}");
}
