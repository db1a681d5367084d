//! OpenAI's Responses API through the official `openai` client, on two servers sharing a
//! Redis store (a fleet): a response continues the one it names from the conversation that
//! response stored, sending only its new input, on whichever server it lands, and answers as
//! a stateless request with the whole history does.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::server::{client, fleet, start};
use serde_json::{json, Value};

/// A stream's event types, checked to open with the response's creation and close with its
/// completion.
fn framed_events<'a>(events: &'a Value, out: &Value) -> Vec<&'a str> {
    let events: Vec<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(events.first(), Some(&"response.created"), "{out}");
    // The terminal event: completed, or incomplete where `max_output_tokens` cut it short.
    let last = events.last().copied();
    assert!(
        matches!(last, Some("response.completed" | "response.incomplete")),
        "{out}"
    );
    events
}

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
    let events = framed_events(&streamed["events"], &out);
    assert!(events.contains(&"response.output_text.delta"), "{out}");
    assert!(streamed["usage"]["cached"].as_u64().unwrap() > 0, "{out}");
    // A stream cut short by `max_output_tokens` says so in its last event.
    let cut = &out["cut"];
    assert_eq!(cut["last"], "response.incomplete", "{out}");
    assert_eq!(cut["status"], "incomplete", "{out}");
    assert_eq!(cut["reason"], "max_output_tokens", "{out}");
    // The other server of the fleet continued the second response from the shared store.
    let fleet = &out["fleet"];
    assert!(!fleet["text"].as_str().unwrap().is_empty(), "{out}");
    assert!(fleet["usage"]["cached"].as_u64().unwrap() > 0, "{out}");
    assert_eq!(out["retrieved"], second["text"], "{out}");
    // Retrieved, a response reports how it ended, when it was made and its usage (on either
    // server of the fleet), not `completed` at the time of asking.
    let kept = &out["kept"];
    assert_eq!(kept["short"]["status"], "incomplete", "{out}");
    for again in kept["again"].as_array().unwrap() {
        assert_eq!(again["status"], "incomplete", "{out}");
        assert_eq!(again["reason"], "max_output_tokens", "{out}");
        assert_eq!(again["created_at"], kept["short"]["created_at"], "{out}");
        assert_eq!(again["usage"], kept["short"]["usage"], "{out}");
    }
    assert_eq!(
        kept["retrieved"]["status"], kept["second"]["status"],
        "{out}"
    );
    assert_eq!(
        kept["retrieved"]["created_at"], kept["second"]["created_at"],
        "{out}"
    );
    assert_eq!(kept["retrieved"]["usage"], kept["second"]["usage"], "{out}");
    // `text.format` holds the reply to a schema, and is echoed.
    let structured = out["structured"].as_str().unwrap();
    let number: Value = serde_json::from_str(structured).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(number["n"].is_i64(), "{out}");
    assert_eq!(out["structured_format"], "json_schema", "{out}");
    // Deleted, a response is no longer found.
    assert_eq!(out["deleted"], true, "{out}");
    assert_eq!(out["gone"], true, "{out}");
}

#[test]
fn real_model_an_agent_s_tool_calls_stream_as_response_items_on_the_stored_conversation() {
    let server = start(&["--chat-template", "chatml-tools"]);
    let out = client(&server.base, &["responses_agent"]);
    let steps = out["steps"].as_array().unwrap();
    for (i, step) in steps.iter().enumerate() {
        let events = framed_events(&step["events"], &out);
        assert!(events.contains(&"response.output_item.added"), "{out}");
        assert!(
            events.contains(&"response.function_call_arguments.done"),
            "{out}"
        );
        // The call streamed as it was written: its arguments in pieces adding up to JSON...
        let call = &step["calls"][0];
        assert!(
            call["call_id"].as_str().unwrap().starts_with("call_"),
            "{out}"
        );
        assert!(step["fragments"].as_u64().unwrap() >= 2, "step {i}: {out}");
        assert_eq!(step["arguments"], call["arguments"], "step {i}: {out}");
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("step {i}: {e}: {out}"));
        assert!(args["path"].is_string(), "step {i}: {out}");
        // ...and is the call the same request makes whole.
        assert_eq!(call["name"], step["whole"][0]["name"], "step {i}: {out}");
        assert_eq!(
            call["arguments"], step["whole"][0]["arguments"],
            "step {i}: {out}"
        );
        // Each response after the first continued the stored conversation: its history,
        // calls and outputs included, came from the cache.
        if i > 0 {
            let before = steps[i - 1]["usage"]["input"].as_u64().unwrap();
            let cached = step["usage"]["cached"].as_u64().unwrap();
            assert!(cached + 32 >= before && cached > 0, "step {i}: {out}");
        }
    }
    assert_eq!(out["retrieved"], steps[2]["calls"], "{out}");
}

#[test]
fn real_model_a_responses_answer_reports_the_log_probabilities_chat_reports() {
    let server = start(&[]);
    let out = client(&server.base, &["responses_logprobs"]);
    let entries = out["entries"].as_array().unwrap();
    assert!(!entries.is_empty(), "{out}");
    // The answer's text is its tokens', each with its two best alternatives.
    let text: String = entries.iter().map(|e| e[0].as_str().unwrap()).collect();
    assert_eq!(text, out["text"].as_str().unwrap(), "{out}");
    assert!(
        entries.iter().all(|e| e[2].as_array().unwrap().len() == 2),
        "{out}"
    );
    // Greedy, the same question: the chat endpoint's tokens and log-probabilities.
    assert_eq!(out["text"], out["chat_text"], "{out}");
    for (r, c) in entries.iter().zip(out["chat"].as_array().unwrap()) {
        assert_eq!(r[0], c[0], "{out}");
        let (a, b) = (r[1].as_f64().unwrap(), c[1].as_f64().unwrap());
        assert!((a - b).abs() < 1e-4, "{a} vs {b}: {out}");
    }
    // Streamed: the deltas carry them in order, the done event all of them.
    let whole: Vec<Value> = entries.iter().map(|e| json!([e[0], e[1]])).collect();
    assert_eq!(out["streamed"], json!(whole), "{out}");
    assert_eq!(out["done"], json!(whole), "{out}");
    // Not asked for, none.
    assert!(out["plain"][0].is_null(), "{out}");
}

#[test]
fn real_model_an_agent_s_loop_over_a_websocket_keeps_its_kv_and_answers_as_over_http() {
    let server = start(&["--chat-template", "chatml-tools"]);
    let out = client(&server.base, &["responses_socket", "4"]);
    let (socket, http) = (
        out["socket"].as_array().unwrap(),
        out["http"].as_array().unwrap(),
    );
    assert_eq!(socket.len(), 4, "{out}");
    for (i, step) in socket.iter().enumerate() {
        framed_events(&step["events"], &out);
        // The same loop over HTTP makes the same calls, greedy: the socket changes nothing
        // of what is computed.
        let made = |calls: &Value| -> Vec<(Value, Value)> {
            let calls = calls.as_array().unwrap().iter();
            calls
                .map(|c| (c["name"].clone(), c["arguments"].clone()))
                .collect()
        };
        assert_eq!(
            made(&step["calls"]),
            made(&http[i]["calls"]),
            "step {i}: {out}"
        );
        assert_eq!(step["usage"]["input"], http[i]["usage"]["input"], "{out}");
        if i > 0 {
            // A `store: false` response continued on its socket: its history came from the
            // cache (shared by content, a chunk at a time; a forced call's tokens recomputed
            // where they are not how its text tokenizes), as a stored one's does over HTTP.
            let before = socket[i - 1]["usage"]["input"].as_u64().unwrap();
            let cached = step["usage"]["cached"].as_u64().unwrap();
            assert!(cached + 48 >= before, "step {i}: {out}");
            assert_eq!(
                cached,
                http[i]["usage"]["cached"].as_u64().unwrap(),
                "{out}"
            );
        }
    }
    // Two lanes in flight on one socket: each one's events came back with its stream_id.
    let lanes = out["lanes"].as_object().unwrap();
    for lane in ["a", "b"] {
        let events = &lanes[lane];
        framed_events(events, &out);
    }
    assert_eq!(out["refused"]["type"], "error", "{out}");
    assert!(
        out["refused"]["message"]
            .as_str()
            .unwrap()
            .contains("response.create"),
        "{out}"
    );
    // What was not to be stored is gone once the socket closed.
    assert_eq!(out["gone_after_close"], true, "{out}");
}

#[test]
fn real_model_a_compacted_agent_loop_continues_prefilling_only_the_summary_and_new_input() {
    let server = start(&["--chat-template", "chatml-tools"]);
    let out = client(&server.base, &["responses_compaction"]);
    let compacted = &out["compacted"];
    // The window: the user's message, then the compaction item carrying the summary.
    assert_eq!(compacted["object"], "response.compaction", "{out}");
    assert_eq!(
        compacted["types"],
        json!(["message", "compaction"]),
        "{out}"
    );
    assert_eq!(compacted["roles"][0], "user", "{out}");
    let content = compacted["content"].as_str().unwrap();
    assert!(content.starts_with("pensieve-compaction-v1:"), "{out}");
    let summary = compacted["usage"]["output"].as_u64().unwrap();
    assert!(summary > 0, "{out}");
    // The summary's turn read the loop's history from the cache: it computed its prompt.
    let before = out["before"]["input"].as_u64().unwrap();
    let cached = compacted["usage"]["cached"].as_u64().unwrap();
    assert!(cached + 32 >= before, "{out}");
    // The turn after it shared the window's opening (system prompt, task) by content and
    // computed the summary and the new input: less than a chunk more than those.
    let after = &out["after"];
    let (input, cached) = (
        after["input"].as_u64().unwrap(),
        after["cached"].as_u64().unwrap(),
    );
    assert!(cached > 0, "{out}");
    assert!(input - cached <= summary + 32 + 40, "{out}");
    eprintln!(
        "after a compaction: {input} prompt tokens, {cached} from the cache, summary {summary}; \
         recomputed: {}",
        out["recomputed"]["input"]
    );
    // A server that recomputes the compacted input (here: the same window under other
    // instructions, which nothing cached begins with) computes all of it.
    let recomputed = &out["recomputed"];
    assert_eq!(recomputed["cached"], 0, "{out}");
    assert!(recomputed["input"].as_u64().unwrap() >= input, "{out}");
    // A create ending with a `compaction_trigger` answered the compaction item alone, and the
    // response after it continued the compacted context: far shorter than the loop's, its
    // opening from the cache.
    assert_eq!(out["triggered"], json!(["compaction"]), "{out}");
    let after_trigger = &out["after_trigger"];
    assert!(after_trigger["cached"].as_u64().unwrap() > 0, "{out}");
    assert!(
        after_trigger["input"].as_u64().unwrap() < before / 2,
        "{out}"
    );
    // Past `context_management`'s threshold the server compacted first: the output opens
    // with the compaction item, and the response continues as any stored one, from cache.
    assert_eq!(out["managed"]["types"][0], "compaction", "{out}");
    assert_eq!(out["managed"]["types"][1], "message", "{out}");
    assert!(out["continued"]["cached"].as_u64().unwrap() > 0, "{out}");
    let events: Vec<&str> = framed_events(&out["events"], &out);
    assert!(events.contains(&"response.output_item.done"), "{out}");
    // A compaction item made elsewhere cannot be read here.
    let foreign = out["foreign"].as_str().unwrap();
    assert!(foreign.contains("not made by this server"), "{out}");
}
