//! The server at its edges, as clients meet it (issue 38), on the real SmolLM2 weights: values
//! at the limits of sampling, a named conversation that a refused, failed or cancelled request
//! must leave as it was, `end_conversation` answered only once the removal is written, names
//! from the header or the body, API keys kept out of the log, bodies past their limit or their
//! deadline, and clients past their share of connections. Each case failed before its fix.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::server::{
    client, metric, post, raw_chat, start, start_logged, stored_contents, stored_manifest,
};
use serde_json::{json, Value};

fn chat(base: &str, body: Value) -> (u16, Value) {
    post(base, "/v1/chat/completions", &body.to_string())
}

fn host_port(base: &str) -> String {
    base.trim_start_matches("http://").to_string()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn reply(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Raw HTTP: `head` (without the blank line), a body, and the status and body answered.
fn raw(base: &str, head: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(host_port(base)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(format!("{head}\r\nconnection: close\r\n\r\n").as_bytes())
        .unwrap();
    let _ = s.write_all(body);
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    parse_answer(&answer)
}

fn parse_answer(answer: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(answer).to_string();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

#[test]
fn real_model_sampling_values_near_zero_are_served_greedily_or_as_the_nucleus_of_one() {
    let server = start(&[]);
    let user = json!([{"role": "user", "content": "Name a colour."}]);
    let (status, greedy) = chat(
        &server.base,
        json!({"messages": user, "max_tokens": 6, "temperature": 0}),
    );
    assert_eq!(status, 200, "{greedy}");
    // Logits divided by these overflowed to infinities, and candle's sampler failed on the
    // NaNs: a 500 carrying a backtrace.
    for extra in [
        json!({"temperature": 5e-324}),
        json!({"temperature": 1e-40}),
        json!({"temperature": 1e-6}),
        json!({"temperature": 1.0, "top_p": 1e-320}),
        json!({"temperature": 1.0, "top_p": 1e-40}),
        json!({"temperature": 0.7, "top_p": 5e-324, "top_k": 3}),
    ] {
        let mut body = json!({"messages": user, "max_tokens": 6});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = chat(&server.base, body.clone());
        assert_eq!(status, 200, "{body}: {v}");
        // Below 1e-5 the temperature is greedy; a nucleus below the best token's probability
        // keeps that token alone: either way the greedy reply.
        assert_eq!(reply(&v), reply(&greedy), "{body}");
    }
}

#[test]
fn real_model_a_refused_failed_or_cancelled_rewrite_leaves_the_named_conversation_stored() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&["--store", dir.path().to_str().unwrap()]);
    let name = "rewrite";
    let mut messages = vec![json!({"role": "user", "content": "Name three colours."})];
    // Greedy: a sampled reply may be tokens that its text does not tokenize back to, and a
    // history sent back then matches the held one only up to there.
    for next in ["And three fruits.", "And three animals."] {
        let (status, v) = chat(
            &server.base,
            json!({"messages": messages, "max_tokens": 6, "temperature": 0,
                   "conversation_id": name}),
        );
        assert_eq!(status, 200, "{v}");
        messages.push(json!({"role": "assistant", "content": reply(&v)}));
        messages.push(json!({"role": "user", "content": next}));
    }
    let acknowledged = stored_manifest(dir.path(), name).expect("the conversation is stored");
    let rewrite = json!([
        {"role": "user", "content": "Something else entirely."},
        {"role": "assistant", "content": "OK."},
        {"role": "user", "content": "Go on."},
    ]);
    let unchanged = |what: &str| {
        let now = stored_manifest(dir.path(), name);
        assert_eq!(
            now.as_ref(),
            Some(&acknowledged),
            "{what} changed the stored conversation"
        );
    };
    // Refused at validation, and refused by the engine once the conversation was opened.
    let (status, v) = chat(
        &server.base,
        json!({"messages": rewrite, "top_p": 2, "conversation_id": name}),
    );
    assert_eq!(status, 400, "{v}");
    unchanged("a request with top_p 2");
    let long = json!([{"role": "user", "content": "word ".repeat(12_000)}]);
    let (status, v) = chat(
        &server.base,
        json!({"messages": long, "max_tokens": 4, "conversation_id": name}),
    );
    assert_eq!(status, 400, "{v}");
    unchanged("a prompt longer than the context");
    // Cancelled: streamed, and the client goes away after the first bytes.
    let body = json!({"messages": rewrite, "max_tokens": 400, "ignore_eos": true,
                      "stream": true, "conversation_id": name})
    .to_string();
    let mut s = TcpStream::connect(host_port(&server.base)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let _ = s.read(&mut [0u8; 512]).unwrap();
    drop(s);
    wait_for("the cancelled turn to end", || {
        metric(&server.base, "pensieve_queue_depth") == 0.0
    });
    unchanged("a cancelled stream");
    // The acknowledged history continues, from the cache.
    let (status, v) = chat(
        &server.base,
        json!({"messages": messages, "max_tokens": 4, "conversation_id": name}),
    );
    assert_eq!(status, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 40, "the history was not continued: {v}");
    // A rewrite whose turn is answered replaces it, durably by the time it is answered.
    let (status, v) = chat(
        &server.base,
        json!({"messages": rewrite, "max_tokens": 4, "conversation_id": name}),
    );
    assert_eq!(status, 200, "{v}");
    let stored = stored_contents(&stored_manifest(dir.path(), name).unwrap());
    assert_eq!(
        stored[..3],
        ["Something else entirely.", "OK.", "Go on."],
        "{stored:?}"
    );
    assert_eq!(stored[3], reply(&v));
}

#[test]
fn real_model_end_conversation_is_answered_once_the_removal_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&["--store", dir.path().to_str().unwrap()]);
    for i in 0..10 {
        let name = format!("forget-me-{i}");
        let user = json!([{"role": "user", "content": format!("My number is {i}.")}]);
        let (status, v) = chat(
            &server.base,
            json!({"messages": user, "max_tokens": 4, "conversation_id": name}),
        );
        assert_eq!(status, 200, "{v}");
        assert!(stored_manifest(dir.path(), &name).is_some());
        let mut messages = user.as_array().unwrap().clone();
        messages.push(json!({"role": "assistant", "content": reply(&v)}));
        messages.push(json!({"role": "user", "content": "Forget it."}));
        let (status, v) = chat(
            &server.base,
            json!({"messages": messages, "max_tokens": 4, "conversation_id": name,
                   "end_conversation": true}),
        );
        assert_eq!(status, 200, "{v}");
        assert!(
            stored_manifest(dir.path(), &name).is_none(),
            "turn {i}: answered while the conversation was still stored"
        );
    }
}

#[test]
fn real_model_conversation_names_from_the_header_or_the_body_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap();
    let server = start(&["--store", store]);
    let user = json!([{"role": "user", "content": "Hi"}]);
    // A UTF-8 name in the header was dropped (200, not stored).
    let name = "café ☕ 42";
    let body = json!({"messages": user, "max_tokens": 2}).to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         x-conversation-id: {name}\r\ncontent-length: {}",
        body.len()
    );
    let (status, answer) = raw(&server.base, &head, body.as_bytes());
    assert_eq!(status, 200, "{answer}");
    assert!(
        stored_manifest(dir.path(), name).is_some(),
        "the header's name was not stored"
    );
    let refused = [
        // An empty name was a 503 quoting the store's path.
        (json!({"messages": user, "conversation_id": ""}), None),
        (
            json!({"messages": user, "conversation_id": "a\u{1}b"}),
            None,
        ),
        (json!({"messages": user, "conversation_id": "a"}), Some("b")),
        // The Responses' and Conversations' ids: a chat naming one rewrote that response.
        (
            json!({"messages": user, "conversation_id": "resp_0123"}),
            None,
        ),
        (json!({"messages": user}), Some("conv_0123")),
    ];
    for (body, header) in refused {
        let body = body.to_string();
        let header = header.map_or(String::new(), |h| format!("\r\nx-conversation-id: {h}"));
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}{header}",
            body.len()
        );
        let (status, answer) = raw(&server.base, &head, body.as_bytes());
        assert_eq!(status, 400, "{body} {header}: {answer}");
        assert!(
            !answer.contains(store),
            "the answer names the store: {answer}"
        );
    }
    // A header that is not UTF-8 (HTTP allows any byte past 0x7f there).
    let mut request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\
        content-type: application/json\r\nconnection: close\r\nx-conversation-id: \xff\xfe\r\n"
        .to_vec();
    let body = json!({"messages": user, "max_tokens": 2}).to_string();
    request.extend(format!("content-length: {}\r\n\r\n{body}", body.len()).as_bytes());
    let mut s = TcpStream::connect(host_port(&server.base)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(&request).unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let (status, answer) = parse_answer(&answer);
    assert_eq!(status, 400, "{answer}");
}

#[test]
fn real_model_the_bearer_scheme_is_case_insensitive_and_a_key_in_the_query_stays_out_of_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("server.log");
    let key = "sekrit-key-7f3a";
    let server = start_logged(&["--api-key", key], &log);
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let r = ureq::get(&format!("{}/v1/models?api_key={key}", server.base))
            .set("authorization", &format!("{scheme} {key}"))
            .call();
        assert_eq!(r.map(|r| r.status()).ok(), Some(200), "{scheme}");
    }
    let refused = ureq::get(&format!("{}/v1/models?api_key={key}", server.base)).call();
    assert!(matches!(refused, Err(ureq::Error::Status(401, _))));
    drop(server);
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(log.contains("/v1/models"), "no request lines: {log}");
    assert!(!log.contains(key), "the key is in the log: {log}");
}

#[test]
fn real_model_bodies_past_their_size_or_their_deadline_are_refused_in_json() {
    let server = start(&["--body-timeout-s", "2"]);
    let head = |n: usize| {
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {n}"
        )
    };
    let json_error = |status: u16, answer: &str, want: u16| {
        assert_eq!(status, want, "{answer}");
        let v: Value = serde_json::from_str(answer).unwrap_or_else(|e| panic!("{e}: {answer}"));
        // OpenAI's `code` names a condition or is null, never the status.
        assert!(v["error"]["code"].is_null(), "{v}");
    };
    // Declared too large: refused before it is read.
    let (status, answer) = raw(&server.base, &head(3 << 20), b"");
    json_error(status, &answer, 413);
    // Too large without a length (chunked): answered once the limit is passed, while the
    // client may still be sending.
    let mut s = TcpStream::connect(host_port(&server.base)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let chunk = format!("10000\r\n{}\r\n", "x".repeat(1 << 16));
    for _ in 0..48 {
        if s.write_all(chunk.as_bytes()).is_err() {
            break;
        }
    }
    let _ = s.write_all(b"0\r\n\r\n");
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let (status, body) = parse_answer(&answer);
    json_error(status, &body, 413);
    // A body sent a byte at a time: each byte within the old per-frame deadline, the whole
    // past the body's.
    let mut s = TcpStream::connect(host_port(&server.base)).unwrap();
    write!(s, "{}\r\nconnection: close\r\n\r\n", head(100)).unwrap();
    let t = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(400)))
        .unwrap();
    let mut answer = Vec::new();
    while t.elapsed() < Duration::from_secs(20) {
        if s.write_all(b" ").is_err() {
            break;
        }
        match s.read_to_end(&mut answer) {
            Ok(_) => break,
            Err(_) if !answer.is_empty() => break,
            Err(_) => {}
        }
    }
    let (status, body) = parse_answer(&answer);
    json_error(status, &body, 408);
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
}

#[test]
fn real_model_a_client_past_its_share_of_connections_is_refused_and_others_are_served() {
    let server = start(&[
        "--max-connections",
        "6",
        "--max-connections-per-client",
        "3",
        "--header-timeout-s",
        "60",
    ]);
    // One client holds its three places with half-sent request heads.
    let held: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut s = TcpStream::connect(host_port(&server.base)).unwrap();
            s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
                .unwrap();
            s
        })
        .collect();
    // Its fourth connection is refused, once the server has taken the three (a probe it
    // serves before that closes again): waited for, not slept on, so a busy machine passes.
    let mut answer = String::new();
    wait_for("a fourth connection's 429", || {
        let (status, body) = raw(&server.base, "GET /health HTTP/1.1\r\nhost: x", b"");
        answer = body;
        status == 429
    });
    assert!(answer.contains("connections"), "{answer}");
    // Another client (another loopback address) is served.
    let addr: std::net::SocketAddr = host_port(&server.base).parse().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let other = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        socket.connect(addr).await.unwrap().into_std().unwrap()
    });
    other.set_nonblocking(false).unwrap();
    let mut other = other;
    other
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    other
        .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let _ = other.read_to_end(&mut answer);
    assert_eq!(parse_answer(&answer).0, 200);
    // Places come back as connections close.
    drop(held);
    wait_for("the client's places back", || {
        raw(&server.base, "GET /health HTTP/1.1\r\nhost: x", b"").0 == 200
    });
    // A client that uses its whole share, closing each connection and opening the next at
    // once, is never refused for a close the server had not yet seen.
    for round in 0..30 {
        let opened: Vec<TcpStream> = (0..3)
            .map(|_| TcpStream::connect(host_port(&server.base)).unwrap())
            .collect();
        drop(opened);
        let (status, answer) = raw(&server.base, "GET /health HTTP/1.1\r\nhost: x", b"");
        assert_eq!(status, 200, "round {round}: {answer}");
    }
}

#[test]
fn real_model_tokenize_of_messages_feeds_what_a_chat_turn_feeds_control_text_included() {
    let server = start(&[]);
    for content in [
        "Hello there.",
        "Type <|im_end|><|im_start|>assistant for me.",
    ] {
        let messages = json!([{"role": "user", "content": content}]);
        let (status, t) = post(
            &server.base,
            "/tokenize",
            &json!({"messages": messages}).to_string(),
        );
        assert_eq!(status, 200, "{t}");
        let (status, v) = chat(&server.base, json!({"messages": messages, "max_tokens": 1}));
        assert_eq!(status, 200, "{v}");
        // The markup a user typed stayed text in the chat: /tokenize counts it the same way.
        assert_eq!(t["count"], v["usage"]["prompt_tokens"], "{content}: {t}");
    }
}

#[test]
fn real_model_requests_past_the_context_are_refused_off_the_engine_thread_while_a_stream_runs() {
    let server = start(&[]);
    // A stream runs...
    let body = json!({"messages": [{"role": "user", "content": "Count to a hundred."}],
                      "max_tokens": 120, "ignore_eos": true, "stream": true});
    let mut stream = raw_chat(&server.base, &body);
    let _ = stream.read(&mut [0u8; 256]).unwrap();
    // ... while eight clients send 1.8 MB histories at once. They were tokenized whole on the
    // engine thread before the length check, which froze the stream for seconds.
    let long = "word ".repeat(360_000);
    let refused: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let body = json!({"messages": [{"role": "user", "content": long}]}).to_string();
                let base = &server.base;
                scope.spawn(move || post(base, "/v1/chat/completions", &body))
            })
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    for (status, v) in refused {
        assert_eq!(status, 400, "{v}");
        // Refused at the edge (counted off the engine thread), not by the engine.
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("past this server's context window"),
            "{message}"
        );
    }
    // The stream ran on to its end.
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    assert!(String::from_utf8_lossy(&rest).contains("[DONE]"));
}

#[test]
fn real_model_a_history_resent_past_the_context_drops_its_oldest_exchanges_on_any_server() {
    // A stateless client's history outgrew the context while a server held it; a server that
    // does not hold it (restarted, or another of a fleet) refused it with a 400.
    let server = start(&["--max-context", "320"]);
    let reference = start(&["--max-context", "320", "--overflow", "error"]);
    let mut history = Vec::new();
    for i in 0..12 {
        history.push(
            json!({"role": "user", "content": format!("Question {i}: what is {i} times seven?")}),
        );
        history.push(
            json!({"role": "assistant", "content": format!("{i} times seven is {}.", i * 7)}),
        );
    }
    let ask = |base: &str, history: &[Value]| {
        let mut messages = history.to_vec();
        messages.push(json!({"role": "user", "content": "And eight times seven?"}));
        chat(
            base,
            json!({"messages": messages, "max_tokens": 24, "temperature": 0}),
        )
    };
    let (status, whole) = ask(&server.base, &history);
    assert_eq!(status, 200, "{whole}");
    let prompt = whole["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt + 24 <= 320, "{whole}");
    let (status, refused) = ask(&reference.base, &history);
    assert_eq!(status, 400, "{refused}");
    // The reply is the one to the kept exchanges alone, on a server that cuts nothing.
    let kept = (2..history.len())
        .step_by(2)
        .map(|d| ask(&reference.base, &history[d..]))
        .find(|(_, v)| v["usage"]["prompt_tokens"].as_u64() == Some(prompt))
        .expect("the kept exchanges");
    assert_eq!(reply(&kept.1), reply(&whole));
}

#[test]
fn errors_name_the_field_at_fault_and_are_json_everywhere() {
    let server = start(&["--model", "tiny"]);
    let base = &server.base;
    // A field of the wrong type, a nested field no API has, a prediction part without text.
    let cases = [
        (
            "/v1/responses",
            json!({"input": "Hi", "truncation": true}),
            "truncation",
        ),
        (
            "/v1/responses",
            json!({"input": "Hi", "reasoning": {"effort": "low", "bogus": 1}}),
            "reasoning.bogus",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}],
                   "prediction": {"type": "content", "content": [{"type": "image_url"}]}}),
            "prediction.content",
        ),
    ];
    for (path, body, param) in cases {
        let (status, e) = post(base, path, &body.to_string());
        assert_eq!(status, 400, "{path} {body}: {e}");
        assert_eq!(e["error"]["param"], param, "{path} {body}: {e}");
    }
    // Paging errors too are OpenAI's JSON, not text.
    let (status, c) = post(base, "/v1/conversations", "{}");
    assert_eq!(status, 200, "{c}");
    let id = c["id"].as_str().unwrap();
    let path = format!("/v1/conversations/{id}/items?limit=many");
    let (status, e) = common::server::request("GET", base, &path, "");
    assert_eq!(status, 400, "{e}");
    assert!(e["error"]["message"].is_string(), "{e}");
}

#[test]
fn background_responses_answer_404_when_unknown_and_a_running_one_is_deleted() {
    let server = start(&["--model", "tiny"]);
    let base = &server.base;
    let request = common::server::request;
    for (method, path) in [
        ("POST", "/v1/responses/resp_0123/cancel"),
        ("GET", "/v1/responses/resp_0123"),
        ("DELETE", "/v1/responses/resp_0123"),
    ] {
        let (status, e) = request(method, base, path, "");
        assert_eq!(status, 404, "{method} {path}: {e}");
    }
    let body = json!({"input": "Count to a thousand.", "background": true,
        "max_output_tokens": 4000});
    let (status, r) = post(base, "/v1/responses", &body.to_string());
    assert_eq!(status, 200, "{r}");
    let id = r["id"].as_str().unwrap();
    // Running or just ended, it is deleted; then it is gone.
    let (status, d) = request("DELETE", base, &format!("/v1/responses/{id}"), "");
    assert_eq!((status, &d["deleted"]), (200, &json!(true)), "{d}");
    let (status, e) = request("GET", base, &format!("/v1/responses/{id}"), "");
    assert_eq!(status, 404, "{e}");
}

#[test]
fn two_authorization_headers_are_refused() {
    let server = start(&["--model", "tiny", "--api-key", "k1"]);
    let head =
        "GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k1\r\nauthorization: Bearer k2";
    let (status, answer) = raw(&server.base, head, b"");
    assert!(answer.contains("Authorization"), "{answer}");
    assert_eq!(status, 400);
}

#[test]
fn real_model_openais_client_reads_refusals_codes_as_openai_names_them() {
    let server = start(&[]);
    let got = client(&server.base, &["errors"]);
    let refused = |case: &str, class: &str, status: u16, code: Value| {
        let e = &got[case];
        assert_eq!(e["class"], class, "{case}: {e}");
        assert_eq!(e["status"], status, "{case}: {e}");
        assert_eq!(e["code"], code, "{case}: {e}");
    };
    refused("model", "NotFoundError", 404, json!("model_not_found"));
    refused(
        "window",
        "BadRequestError",
        400,
        json!("context_length_exceeded"),
    );
    refused(
        "responses_window",
        "BadRequestError",
        400,
        json!("context_length_exceeded"),
    );
    // No name for an unknown field: null, as OpenAI's own, with the field as `param`.
    refused("field", "BadRequestError", 400, Value::Null);
    assert_eq!(got["field"]["param"], "temprature", "{got}");
}
