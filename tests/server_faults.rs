//! The server under hostile input and faults (issue 22), on the real SmolLM2 weights: the
//! requests that used to kill the engine or leak queue places are answered and the server
//! serves on; an acknowledged turn of a named conversation survives SIGINT, SIGTERM, SIGHUP
//! and SIGKILL sent the moment its answer arrives; shutdown completes within its deadline with a
//! stream and a half-sent request open; a turn cut short leaves no trace; a stop string ends
//! the reply and the history alike; a store that cannot write says so.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::server::{metric, post, start, Server};
use serde_json::{json, Value};

fn chat(base: &str, body: Value) -> (u16, Value) {
    post(base, "/v1/chat/completions", &body.to_string())
}

/// A normal request is answered normally.
fn serves(base: &str) {
    let (status, v) = chat(
        base,
        json!({"messages": [{"role": "user", "content": "What is two plus two?"}],
               "max_tokens": 4}),
    );
    assert_eq!(status, 200, "{v}");
    let health = ureq::get(&format!("{base}/health")).call().unwrap();
    assert_eq!(health.status(), 200);
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn host_port(base: &str) -> String {
    base.trim_start_matches("http://").to_string()
}

/// Sends a chat request over a raw connection (so the test decides when it goes away); the
/// connection.
fn raw_chat(base: &str, body: &Value) -> TcpStream {
    let body = body.to_string();
    let mut s = TcpStream::connect(host_port(base)).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s
}

fn signal(server: &Server, sig: i32) {
    // SAFETY: kill(2) on our own child's pid.
    let r = unsafe { libc::kill(server.child.id() as i32, sig) };
    assert_eq!(r, 0);
}

/// Waits for the server to exit; its status.
fn exit_within(server: &mut Server, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not stop in {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn real_model_hostile_requests_get_errors_and_the_server_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    // A short window: the largest max_tokens runs to its end in seconds, not minutes.
    let store = dir.path().to_str().unwrap();
    let server = start(&["--store", store, "--max-context", "384"]);
    let user = json!([{"role": "user", "content": "Hi"}]);
    let long_name = "n".repeat(2000);
    let cases = [
        (
            json!({"messages": user, "max_tokens": 4, "expect_resume_s": 1e19}),
            400,
        ),
        (
            json!({"messages": user, "max_tokens": 4, "expect_resume_s": 1e20}),
            400,
        ),
        (
            json!({"messages": user, "max_tokens": 4, "expect_resume_s": -1}),
            400,
        ),
        (json!({"messages": user, "max_tokens": 4, "pin": true}), 400),
        (
            json!({"messages": user, "max_tokens": 4, "conversation_id": long_name}),
            400,
        ),
        (json!({"messages": user, "max_tokens": 1e300}), 400),
        (
            json!({"messages": user, "max_tokens": 18446744073709551615u64}),
            200,
        ),
        // Past f32's range a temperature made the logits NaN: refused (at most 100).
        (
            json!({"messages": user, "max_tokens": 2, "temperature": 1e308}),
            400,
        ),
        (
            json!({"messages": user, "max_tokens": 2, "temperature": 100}),
            200,
        ),
        (
            json!({"messages": user, "max_tokens": 2, "temperature": -1}),
            400,
        ),
        (
            json!({"messages": user, "max_tokens": 2, "seed": 18446744073709551615u64}),
            200,
        ),
        (
            json!({"messages": user, "max_tokens": 2, "logit_bias": {"99999999999": 1}}),
            400,
        ),
        // A name past the file system's 255 bytes as hex is stored under a digest.
        (
            json!({"messages": user, "max_tokens": 2, "conversation_id": "x".repeat(200),
                "expect_resume_s": 5, "pin": true}),
            200,
        ),
    ];
    for (body, want) in cases {
        let (status, v) = chat(&server.base, body.clone());
        // A huge max_tokens is capped by the context window, so it may run long: 200 only
        // after the reply ends.
        assert_eq!(status, want, "{body}: {v}");
        if status != 200 {
            let message = v["error"]["message"].as_str().unwrap();
            assert!(
                message.len() < 700,
                "the error echoes unbounded input: {message}"
            );
        }
        serves(&server.base);
    }
}

#[test]
fn real_model_clients_that_disconnect_before_an_answer_leak_no_queue_place() {
    let server = start(&["--max-queue", "8"]);
    // Prompts the engine refuses (longer than the context window) take a while to tokenize:
    // the clients are gone before the refusal.
    let long = "word ".repeat(12_000);
    let body = json!({"messages": [{"role": "user", "content": long}], "max_tokens": 4});
    for _ in 0..24 {
        drop(raw_chat(&server.base, &body));
    }
    wait_for("the queue to empty", || {
        metric(&server.base, "pensieve_queue_depth") == 0.0
    });
    for _ in 0..10 {
        serves(&server.base);
    }
}

#[test]
fn real_model_an_acknowledged_named_turn_survives_any_signal() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().to_str().unwrap().to_string();
    let mut before = 0;
    for (i, sig) in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGKILL]
        .iter()
        .cycle()
        .take(16)
        .enumerate()
    {
        let mut server = start(&["--store", &store]);
        let (status, v) = chat(
            &server.base,
            json!({"messages": [{"role": "user", "content": format!("Remember the number {i}.")}],
                   "max_tokens": 6, "conversation_id": "durable"}),
        );
        assert_eq!(status, 200, "{v}");
        signal(&server, *sig);
        let status = exit_within(&mut server, Duration::from_secs(30));
        if *sig != libc::SIGKILL {
            assert!(status.success(), "signal {sig}: {status}");
        }
        // Every turn acknowledged so far is in the history the next one continues.
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let total = v["usage"]["total_tokens"].as_u64().unwrap();
        assert!(
            prompt > before,
            "turn {i}: prompt {prompt} after {before}: a turn was lost"
        );
        before = total;
    }
}

#[test]
fn real_model_shutdown_completes_within_its_deadline_with_a_stream_and_a_half_sent_request() {
    let mut server = start(&["--drain-timeout-s", "2"]);
    let body = json!({"messages": [{"role": "user", "content": "Tell me a long story."}],
                      "max_tokens": 4000, "ignore_eos": true, "stream": true});
    let mut stream = raw_chat(&server.base, &body);
    let mut first = [0u8; 256];
    let _ = stream.read(&mut first).unwrap();
    let mut half = TcpStream::connect(host_port(&server.base)).unwrap();
    half.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"mess",
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    signal(&server, libc::SIGTERM);
    let status = exit_within(&mut server, Duration::from_secs(15));
    assert!(status.success(), "{status}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    // The stream ended (cancelled), not cut mid-chunk forever.
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
}

#[test]
fn real_model_a_turn_cut_short_or_stopped_leaves_the_state_the_client_saw() {
    let dir = tempfile::tempdir().unwrap();
    for store in [None, Some(dir.path().to_str().unwrap())] {
        let mut args = vec![];
        if let Some(s) = store {
            args.extend(["--store", s]);
        }
        let server = start(&args);
        let named = |content: &str, max: u32| {
            json!({"messages": [{"role": "user", "content": content}], "max_tokens": max,
                   "conversation_id": "cut-short"})
        };
        let (status, v) = chat(&server.base, named("What is the capital of France?", 16));
        assert_eq!(status, 200, "{v}");
        let history = v["usage"]["total_tokens"].as_u64().unwrap();
        // A turn whose client goes away mid-reply.
        let body = json!({"messages": [{"role": "user", "content": "Tell me a long story."}],
                          "max_tokens": 3000, "ignore_eos": true, "stream": true,
                          "conversation_id": "cut-short"});
        let mut s = raw_chat(&server.base, &body);
        let mut got = [0u8; 2048];
        let _ = s.read(&mut got).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        drop(s);
        wait_for("the cancelled turn to leave the queue", || {
            metric(&server.base, "pensieve_queue_depth") == 0.0
        });
        // The next turn continues from the last completed one, without the cancelled message.
        let (status, v) = chat(&server.base, named("And of Spain?", 4));
        assert_eq!(status, 200, "{v}");
        let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(
            prompt > history && prompt < history + 24,
            "store {store:?}: prompt {prompt} after a history of {history}"
        );
    }
}

#[test]
fn real_model_a_stop_string_inside_a_token_ends_the_reply_and_the_resend_continues() {
    let server = start(&[]);
    let question = json!({"role": "user", "content": "What is the capital of France?"});
    let (_, plain) = chat(
        &server.base,
        json!({"messages": [question], "max_tokens": 24, "temperature": 0}),
    );
    let whole = plain["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    // Two letters from inside a word: the stop string begins within a token.
    let word = whole
        .split(' ')
        .find(|w| w.len() >= 5 && w.is_ascii())
        .unwrap();
    let stop = &word[2..4];
    let (status, v) = chat(
        &server.base,
        json!({"messages": [question], "max_tokens": 24, "stop": [stop], "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let reply = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        reply,
        whole[..whole.find(stop).unwrap()],
        "{whole:?} stop {stop:?}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // The prompt the model saw is the same whole or cut (the history kept after a cut inside
    // a token told less).
    assert_eq!(
        v["usage"]["prompt_tokens"], plain["usage"]["prompt_tokens"],
        "{v}"
    );
    // The client resends the history with the reply it got: the conversation continues, and
    // answers as a server that never saw it does.
    let messages = json!([question, {"role": "assistant", "content": reply},
                          {"role": "user", "content": "And of Spain?"}]);
    let body = json!({"messages": messages, "max_tokens": 16, "temperature": 0});
    let (_, a) = chat(&server.base, body.clone());
    let cached = a["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "{a}");
    let fresh = start(&[]);
    let (_, b) = chat(&fresh.base, body);
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );
}

#[test]
fn real_model_an_engine_thread_that_dies_stops_the_server_with_a_failure() {
    // The engine thread panics on this message (a stand-in for a bug).
    let mut server = start(&["--fault-panic-on", "BOOM"]);
    serves(&server.base);
    let r = ureq::post(&format!("{}/v1/chat/completions", server.base))
        .timeout(Duration::from_secs(30))
        .send_json(json!({"messages": [{"role": "user", "content": "BOOM"}], "max_tokens": 4}));
    assert!(
        !matches!(&r, Ok(resp) if resp.status() == 200),
        "answered 200 by a dead engine"
    );
    // It does not linger answering 503: it stops, and says it failed.
    let status = exit_within(&mut server, Duration::from_secs(20));
    assert!(!status.success(), "{status:?}");
}

#[test]
fn real_model_half_sent_heads_and_idle_connections_are_cut_off_and_connections_are_bounded() {
    let server = start(&[
        "--header-timeout-s",
        "1",
        "--max-connections",
        "4",
        "--max-connections-per-client",
        "4",
    ]);
    // Four connections take every place: each sends half a request head, then stalls.
    let stalled: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = TcpStream::connect(host_port(&server.base)).unwrap();
            s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
                .unwrap();
            s
        })
        .collect();
    // A fifth client waits for a place, and is served once the stalled ones are cut off.
    let base = server.base.clone();
    let fifth = std::thread::spawn(move || serves(&base));
    for mut s in stalled {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut buf = [0u8; 256];
        let closed = match s.read(&mut buf) {
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
        assert!(closed, "a half-sent head kept its connection");
    }
    fifth.join().unwrap();
    // A connection that sends nothing, one byte, or an HTTP/2 preface is closed too, four of
    // each at once (every place): the header deadline counts from the connection's start.
    // The read's own timeout only bounds a broken server: an open connection fails the test
    // whenever it times out, on a machine of any speed.
    let openings: [&[u8]; 3] = [b"", b"P", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"];
    for opening in openings {
        let held: Vec<TcpStream> = (0..4)
            .map(|_| {
                let mut s = TcpStream::connect(host_port(&server.base)).unwrap();
                s.write_all(opening).unwrap();
                s
            })
            .collect();
        for mut s in held {
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let mut answer = Vec::new();
            match s.read_to_end(&mut answer) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
                Err(e) => panic!("{opening:?}: the connection stayed open ({e})"),
            }
        }
        serves(&server.base);
    }
}

/// A connection from `ip` (a loopback address of its own) to `base`.
fn connect_from(base: &str, ip: &str) -> TcpStream {
    let addr: std::net::SocketAddr = host_port(base).parse().unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let stream = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
        socket.connect(addr).await.unwrap().into_std().unwrap()
    });
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    stream
}

/// `GET /health` on `stream` (kept alive): the answer's status line.
fn health(stream: &mut TcpStream) -> String {
    stream
        .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            other => return format!("closed ({other:?}) after {head:?}"),
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let length = (head.lines())
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length: ")
                .map(str::to_string)
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).unwrap();
    head.lines().next().unwrap_or_default().to_string()
}

#[test]
fn connections_that_never_send_a_request_cannot_keep_a_client_waiting() {
    // Every place held by connections from as many addresses (each within its share), none of
    // which sends a byte: a client that sends a request takes the oldest one's place, where it
    // used to wait for their header deadline (here ten minutes).
    let server = start(&[
        "--model",
        "tiny",
        "--max-connections",
        "4",
        "--header-timeout-s",
        "600",
    ]);
    let mut silent: Vec<TcpStream> = (2..6)
        .map(|i| connect_from(&server.base, &format!("127.0.0.{i}")))
        .collect();
    for round in 0..3 {
        let mut client = connect_from(&server.base, "127.0.0.9");
        assert_eq!(health(&mut client), "HTTP/1.1 200 OK", "round {round}");
        drop(client);
        // The silent ones come back for the place.
        silent.push(connect_from(
            &server.base,
            &format!("127.0.0.{}", 10 + round),
        ));
    }
    // A connection that sent a request is never closed for another: more silent ones arrive,
    // and it is served again.
    let mut kept = connect_from(&server.base, "127.0.0.20");
    assert_eq!(health(&mut kept), "HTTP/1.1 200 OK");
    for i in 0..8 {
        silent.push(connect_from(&server.base, &format!("127.0.1.{i}")));
    }
    assert_eq!(health(&mut kept), "HTTP/1.1 200 OK");
}
