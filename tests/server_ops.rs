//! The server's operation (`pensieve-server`), on the real SmolLM2 weights: the API
//! key and the environment forms of its flags, its request log (text or JSON), the origins
//! browsers may call it from, and its idleness (no thread polls when there is nothing to do).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Read;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

mod common;

use common::server::{client, forced_call, post, server_exe, start};

/// `--api-key` (here from its environment variable, as every flag can be given) guards the
/// generation and tokenizer routes; probes and scrapers need no key.
#[test]
fn an_api_key_guards_the_generation_routes_and_flags_read_the_environment() {
    let server = common::server::start_with_env(
        &[],
        &[
            ("PENSIEVE_API_KEY", "s3cret"),
            ("PENSIEVE_SERVED_MODEL_NAME", "house-model"),
        ],
    );
    let b = &server.base;
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let chat = |auth: Option<&str>| {
        let mut r = ureq::post(&format!("{b}/v1/chat/completions"));
        if let Some(a) = auth {
            r = r.set("authorization", a);
        }
        match r.send_string(&body.to_string()) {
            Ok(r) => r.status(),
            Err(ureq::Error::Status(s, _)) => s,
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(chat(None), 401);
    assert_eq!(chat(Some("Bearer wrong")), 401);
    assert_eq!(chat(Some("Bearer s3cret")), 200);
    let (status, _) = post(b, "/tokenize", r#"{"prompt": "hi"}"#);
    assert_eq!(status, 401);
    for open in ["/health", "/metrics"] {
        assert_eq!(
            ureq::get(&format!("{b}{open}")).call().unwrap().status(),
            200
        );
    }
    let models = ureq::get(&format!("{b}/v1/models"))
        .set("authorization", "Bearer s3cret")
        .call()
        .unwrap()
        .into_json::<Value>()
        .unwrap();
    assert_eq!(models["data"][0]["id"], "house-model");
}

/// Each request is logged when it ends (method, path, status), on stderr through `tracing`.
/// The server's log after two completions (one refused), run with `extra` flags.
fn log_of_two_requests(extra: &[&str]) -> String {
    use std::io::BufRead;
    let mut child = Command::new(server_exe())
        .args(["--port", "0"])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_string();
    let (status, _) = post(
        &base,
        "/v1/completions",
        r#"{"prompt": "Hi", "max_tokens": 2}"#,
    );
    assert_eq!(status, 200);
    let (status, _) = post(&base, "/v1/completions", r#"{"prompt": 7}"#);
    assert_eq!(status, 400);
    child.kill().unwrap();
    let mut log = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    child.wait().unwrap();
    log
}

#[test]
fn requests_are_logged_as_text_or_as_json() {
    let log = log_of_two_requests(&[]);
    // Loading shows its progress, a quarter of the layers at a time.
    assert!(log.contains("weights loaded layers=30 of=30"), "{log}");
    let requests: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("path=/v1/completions") && l.contains("finished processing"))
        .collect();
    assert_eq!(requests.len(), 2, "{log}");
    assert!(
        requests[0].contains("status=200") && requests[1].contains("status=400"),
        "{log}"
    );
    // As JSON, every line is an object, and a request's line carries its span's fields.
    let log = log_of_two_requests(&["--log-format", "json"]);
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let statuses: Vec<&Value> = lines
        .iter()
        .filter(|l| {
            l["span"]["path"] == "/v1/completions"
                && l["fields"]["message"] == "finished processing request"
        })
        .map(|l| &l["fields"]["status"])
        .collect();
    assert_eq!(statuses, [200, 400], "{log}");
}

/// A browser page of an allowed origin may call the API, its preflight answered before the
/// key is asked for; other origins get no CORS headers, and none is allowed by default.
#[test]
fn browsers_may_call_from_the_allowed_origins_only() {
    let server = start(&["--allowed-origins", "http://app.example", "--api-key", "k"]);
    let b = &server.base;
    let preflight = |origin: &str| {
        ureq::request("OPTIONS", &format!("{b}/v1/chat/completions"))
            .set("origin", origin)
            .set("access-control-request-method", "POST")
            .set(
                "access-control-request-headers",
                "authorization, content-type",
            )
            .call()
            .unwrap()
    };
    let allowed = preflight("http://app.example");
    assert_eq!(
        allowed.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    let methods = allowed.header("access-control-allow-methods").unwrap();
    assert!(methods.contains("POST"), "{methods}");
    assert!(preflight("http://evil.example")
        .header("access-control-allow-origin")
        .is_none());
    let answer = ureq::post(&format!("{b}/v1/completions"))
        .set("origin", "http://app.example")
        .set("authorization", "Bearer k")
        .send_string(r#"{"prompt": "Hi", "max_tokens": 1}"#)
        .unwrap();
    assert_eq!(
        answer.header("access-control-allow-origin"),
        Some("http://app.example")
    );
    drop(server);
    let closed = start(&[]);
    let answer = ureq::get(&format!("{}/v1/models", closed.base))
        .set("origin", "http://app.example")
        .call()
        .unwrap();
    assert!(answer.header("access-control-allow-origin").is_none());
}

/// With nothing to do, the server sleeps: no thread polls (the engine thread waits on its
/// channel, the store wakes it, timed work has a deadline), so an idle server uses no CPU
/// to speak of, after a turn that went through the store as much as before any.
#[cfg(target_os = "linux")]
#[test]
fn an_idle_server_uses_no_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&["--store", dir.path().to_str().unwrap()]);
    // Clock ticks (utime + stime) the server's process has used.
    let ticks = || {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", server.child.id())).unwrap();
        let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split(' ').collect();
        fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
    };
    let idle = |what: &str| {
        std::thread::sleep(Duration::from_millis(300));
        let before = ticks();
        std::thread::sleep(Duration::from_secs(2));
        let used = ticks() - before;
        // 100 ticks a second: at most 2.5% of one core over the two seconds.
        assert!(used <= 5, "{used} ticks in 2 s idle {what}");
    };
    idle("after start");
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "conversation_id": "idle-check"});
    let (status, answer) = post(&server.base, "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{answer}");
    idle("after a stored turn");
}

#[test]
fn several_choices_come_from_forks_a_client_may_continue() {
    let server = start(&[]);
    let b = &server.base;
    let question = json!({"role": "user", "content": "Name a fruit."});
    let body = json!({"messages": [question], "max_tokens": 8, "n": 3, "temperature": 1.0,
        "seed": 11, "ignore_eos": true});
    let (status, answer) = post(b, "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{answer}");
    let choices = answer["choices"].as_array().unwrap();
    let texts: Vec<&str> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i, "{answer}");
            assert_eq!(c["finish_reason"], "length", "{answer}");
            c["message"]["content"].as_str().unwrap()
        })
        .collect();
    // Each choice has a seed of its own: sampled at this temperature, they differ.
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    assert_eq!(answer["usage"]["completion_tokens"], 24, "{answer}");
    // Whichever choice the client keeps, its history is a conversation the server holds.
    let kept = json!({"role": "assistant", "content": texts[2]});
    let next = json!({"messages": [question, kept, {"role": "user", "content": "Another?"}],
        "max_tokens": 4});
    let (status, answer) = post(b, "/v1/chat/completions", &next.to_string());
    assert_eq!(status, 200, "{answer}");
    let (cached, prompt) = cached_of(&answer);
    assert!(cached + 16 >= prompt, "{answer}");
    // Streamed: every choice's chunks carry its index, and each ends once.
    let body = json!({"prompt": "The sky is", "max_tokens": 4, "n": 2, "stream": true,
        "stream_options": {"include_usage": true}, "ignore_eos": true});
    let (text, chunks) = streamed(b, "/v1/completions", &body);
    let ends: Vec<&Value> = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap())
        .filter(|c| !c["finish_reason"].is_null())
        .map(|c| &c["index"])
        .collect();
    assert_eq!(ends.len(), 2, "{text}");
    assert_ne!(ends[0], ends[1], "{text}");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 8, "{text}");
    for n in [0, 17] {
        let body = json!({"prompt": "x", "n": n});
        let (status, _) = post(b, "/v1/completions", &body.to_string());
        assert_eq!(status, 400, "n = {n}");
    }
}

#[test]
fn tool_calls_round_trip_with_their_history_cached_and_replies_follow_a_schema() {
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let question = json!({"role": "user", "content": "What is the weather in Paris?"});
    let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
        "type": "function", "function": {"name": "get_weather",
        "arguments": "{\"city\": \"Paris\"}"}}]});
    let result = json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"});
    // SmolLM2's own template lists no tools: offering some is refused, never ignored.
    let plain = start(&[]);
    let body = json!({"messages": [question], "tools": tools, "max_tokens": 4});
    let (status, answer) = post(&plain.base, "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 400, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tools"),
        "{answer}"
    );
    drop(plain);

    let server = start(&["--chat-template", "chatml-tools"]);
    let b = &server.base;
    // The assistant's call and the tool's result: the reply answers after the result.
    let body = json!({"messages": [question, call, result], "tools": tools, "max_tokens": 16,
        "temperature": 0});
    let (status, first) = post(b, "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{first}");
    let reply = first["choices"][0]["message"].clone();
    assert!(reply["content"].is_string(), "{first}");
    // Streamed, the same reply arrives.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let (text, chunks) = streamed(b, "/v1/chat/completions", &stream_body);
    let content: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(content, reply["content"].as_str().unwrap(), "{text}");
    // The agent goes on: the whole history, tool call and result included, is cached.
    let next = json!({"messages": [question, call, result, reply,
        {"role": "user", "content": "And tomorrow?"}], "tools": tools, "max_tokens": 4});
    let (status, second) = post(b, "/v1/chat/completions", &next.to_string());
    assert_eq!(status, 200, "{second}");
    let (cached, prompt) = cached_of(&second);
    assert!(cached + 32 >= prompt && cached > 100, "{second}");
    // A call the model makes: tool_choice "required" holds the reply to one, parsed.
    let made = forced_call(b, json!([question]), &tools, json!("required"));
    let call = &made["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather", "{made}");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string(), "{made}");
    // Its result comes back; the conversation, the call included, is the one the server holds.
    let result = json!({"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"});
    let body = json!({"messages": [question, made, result], "tools": tools, "max_tokens": 8});
    let (status, answer) = post(b, "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{answer}");
    let (cached, prompt) = cached_of(&answer);
    assert!(cached + 48 >= prompt, "{answer}");
    // Parameters as pydantic writes them, with `$defs` and `$ref` (and a tool that refers to
    // itself): forced calls failed on them while `auto` worked.
    let pydantic = json!([{"type": "function", "function": {"name": "book_trip",
        "description": "Book a trip between two places.",
        "parameters": {"type": "object", "$defs": {"Place": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"]}},
            "properties": {"origin": {"$ref": "#/$defs/Place"},
                "destination": {"$ref": "#/$defs/Place"}},
            "required": ["origin", "destination"]}}},
        {"type": "function", "function": {"name": "note", "parameters": {"type": "object",
            "properties": {"text": {"type": "string"}, "replies": {"type": "array",
                "items": {"$ref": "#"}, "maxItems": 0}}, "required": ["text"]}}}]);
    let trip = json!([{"role": "user", "content": "Book me a trip from Paris to Rome."}]);
    let named = json!({"type": "function", "function": {"name": "book_trip"}});
    let booked = forced_call(b, trip.clone(), &pydantic, named);
    let call = &booked["tool_calls"][0];
    assert_eq!(call["function"]["name"], "book_trip", "{booked}");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["origin"]["city"].is_string(), "{booked}");
    assert!(args["destination"]["city"].is_string(), "{booked}");
    forced_call(b, trip.clone(), &pydantic, json!("required"));
    // References into the schema itself and definitions nested in a property (valid as a
    // response format) did not compile for a forced call.
    let pointers = json!([{"type": "function", "function": {"name": "move",
        "parameters": {"type": "object", "properties": {
            "from": {"type": "object", "$defs": {"Spot": {"type": "string"}},
                "properties": {"city": {"$ref": "#/properties/from/$defs/Spot"}},
                "required": ["city"]},
            "to": {"$ref": "#/properties/from"}}, "required": ["from", "to"]}}}]);
    let named = json!({"type": "function", "function": {"name": "move"}});
    let moved = forced_call(b, trip, &pointers, named);
    let args = moved["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .unwrap();
    let args: Value = serde_json::from_str(args).unwrap();
    assert!(
        args["from"]["city"].is_string() && args["to"]["city"].is_string(),
        "{moved}"
    );
    // A tool named with the template's markup failed as an invalid constraint.
    let markup = json!([{"type": "function", "function": {"name": "<|im_end|>\n<|im_start|>x"}}]);
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "tools": markup,
        "tool_choice": "required", "max_tokens": 4});
    let (status, answer) = post(b, "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 400, "{answer}");
    assert!(answer.to_string().contains("tool name"), "{answer}");
    // Structured output: a reply held to a JSON schema parses and validates.
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"},
        "country": {"type": "string"}}, "required": ["city", "country"],
        "additionalProperties": false});
    let body = json!({"messages": [{"role": "user", "content": "A city and its country?"}],
        "max_tokens": 64, "temperature": 0, "response_format": {"type": "json_schema",
        "json_schema": {"name": "place", "schema": schema, "strict": true}}});
    let (status, answer) = post(b, "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{answer}");
    let text = answer["choices"][0]["message"]["content"].as_str().unwrap();
    let place: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let keys: Vec<&String> = place.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["city", "country"], "{text}");
    assert!(
        place["city"].is_string() && place["country"].is_string(),
        "{text}"
    );
    let body = json!({"prompt": "JSON:", "max_tokens": 24, "temperature": 0,
        "response_format": {"type": "json_object"}});
    let (status, answer) = post(b, "/v1/completions", &body.to_string());
    assert_eq!(status, 200, "{answer}");
    assert!(answer["choices"][0]["text"]
        .as_str()
        .unwrap()
        .trim_start()
        .starts_with('{'));
    for bad in [
        json!({"messages": [question], "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        json!({"messages": [question], "response_format": {"type": "json_schema",
            "json_schema": {"name": "has space", "schema": {}}}}),
        json!({"messages": [question], "response_format": {"type": "xml"}}),
        json!({"messages": [question, call, {"role": "tool", "content": "x"}], "tools": tools}),
        json!({"messages": [question], "tools": [{"type": "function"}]}),
    ] {
        let (status, answer) = post(b, "/v1/chat/completions", &bad.to_string());
        assert_eq!(status, 400, "{bad}: {answer}");
    }
    // A response format beside tools, as OpenAI takes them: a forced call is a call (the
    // format is for the answer after the calls); unforced, the reply is a call or an answer
    // that follows the format.
    let forced = json!({"messages": [question], "tools": tools, "tool_choice": "required",
        "response_format": {"type": "json_object"}, "max_tokens": 64, "temperature": 0});
    let (status, answer) = post(b, "/v1/chat/completions", &forced.to_string());
    assert_eq!(status, 200, "{answer}");
    let message = &answer["choices"][0]["message"];
    assert_eq!(
        message["tool_calls"][0]["function"]["name"], "get_weather",
        "{answer}"
    );
    let result = json!({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
        "content": "Sunny, 24 C."});
    let schema = json!({"type": "object", "properties": {"summary": {"type": "string",
        "maxLength": 40}}, "required": ["summary"], "additionalProperties": false});
    let after = json!({"messages": [question, message, result], "tools": tools,
        "max_tokens": 64, "temperature": 0, "response_format": {"type": "json_schema",
        "json_schema": {"name": "weather", "schema": schema}}});
    let (status, answer) = post(b, "/v1/chat/completions", &after.to_string());
    assert_eq!(status, 200, "{answer}");
    let reply = &answer["choices"][0]["message"];
    match reply["tool_calls"].as_array() {
        Some(calls) => assert_eq!(calls[0]["function"]["name"], "get_weather", "{answer}"),
        None => {
            let text = reply["content"].as_str().unwrap();
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert!(v["summary"].is_string(), "{text}");
        }
    }
}

/// A streamed request's body and its data chunks (`[DONE]` left out).
fn streamed(base: &str, path: &str, body: &Value) -> (String, Vec<Value>) {
    let text = ureq::post(&format!("{base}{path}"))
        .set("content-type", "application/json")
        .send_string(&body.to_string())
        .unwrap()
        .into_string()
        .unwrap();
    let chunks = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    (text, chunks)
}

/// An answer's cached prompt tokens and prompt tokens.
fn cached_of(answer: &Value) -> (u64, u64) {
    let usage = &answer["usage"];
    let cached = &usage["prompt_tokens_details"]["cached_tokens"];
    (
        cached.as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap(),
    )
}

/// vLLM's guided decoding fields hold a reply as `response_format` does: to one of some
/// strings, to a regular expression, to a schema; two of them at once are refused.
#[test]
fn vllm_guided_fields_hold_the_reply() {
    let server = start(&[]);
    let b = &server.base;
    let ask = |extra: Value| {
        let mut body = json!({
            "messages": [{"role": "user", "content": "Is the sky blue? Answer in one word."}],
            // Greedy: sampled (the checkpoint's defaults), a JSON reply could take more
            // than the 24 tokens to close.
            "max_tokens": 24, "temperature": 0,
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(b, "/v1/chat/completions", &body.to_string())
    };
    let reply = |extra: Value| {
        let (status, answer) = ask(extra);
        assert_eq!(status, 200, "{answer}");
        answer["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let choice = reply(json!({"guided_choice": ["yes (sure)", "no."]}));
    assert!(["yes (sure)", "no."].contains(&choice.as_str()), "{choice}");
    let digits = reply(json!({"guided_regex": "[0-9]{3}"}));
    assert!(
        digits.len() == 3 && digits.chars().all(|c| c.is_ascii_digit()),
        "{digits}"
    );
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}},
        "required": ["n"], "additionalProperties": false});
    let text = reply(json!({"guided_json": schema}));
    let object: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert!(object["n"].is_i64(), "{object}");
    let (status, answer) = ask(json!({"guided_regex": "a", "guided_choice": ["b"]}));
    assert_eq!(status, 400, "{answer}");
    let (status, answer) = ask(json!({"guided_regex": "a",
        "response_format": {"type": "json_object"}}));
    assert_eq!(status, 400, "{answer}");
}

#[test]
fn real_model_an_agent_s_streamed_tool_calls_round_trip_with_the_history_cached() {
    let server = start(&["--chat-template", "chatml-tools"]);
    let out = client(&server.base, &["agent"]);
    let steps = out["steps"].as_array().unwrap();
    for (i, step) in steps.iter().enumerate() {
        assert_eq!(step["finish_reason"], "tool_calls", "step {i}: {out}");
        let call = &step["calls"][0];
        assert!(call["id"].as_str().unwrap().starts_with("call_"), "{out}");
        // The call streamed as it was written: its arguments in pieces that add up to JSON...
        assert!(step["fragments"].as_u64().unwrap() >= 2, "step {i}: {out}");
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("step {i}: {e}: {out}"));
        assert!(args["path"].is_string(), "step {i}: {out}");
        // ...and is the call the same request makes whole.
        assert_eq!(call["name"], step["whole"]["name"], "step {i}: {out}");
        assert_eq!(
            call["arguments"], step["whole"]["arguments"],
            "step {i}: {out}"
        );
        assert_eq!(step["whole"]["finish_reason"], "tool_calls", "{out}");
        // Each turn after the first continued the conversation the server held: its
        // history, calls and results included, came from the cache.
        if i > 0 {
            let before = steps[i - 1]["prompt_tokens"].as_u64().unwrap();
            let cached = step["cached_tokens"].as_u64().unwrap();
            assert!(cached + 32 >= before && cached > 0, "step {i}: {out}");
        }
    }
    // tool_choice "none" keeps the tools in the prompt, so the whole history comes from the
    // cache (with them dropped, the prompt differed from its first lines on), and the reply
    // is text, no call read out of it.
    let reflection = &out["reflection"];
    let before = steps[steps.len() - 1]["prompt_tokens"].as_u64().unwrap();
    let cached = reflection["cached_tokens"].as_u64().unwrap();
    assert!(cached + 32 >= before, "{reflection}");
    assert!(reflection["tool_calls"].is_null(), "{reflection}");
    assert!(reflection["content"].is_string(), "{reflection}");
    assert_ne!(reflection["finish_reason"], "tool_calls", "{reflection}");
}
