//! Huge content outside a request's new message (a chat history holding megabytes in an
//! assistant or system message, a response's megabytes of `instructions` or thousands of
//! input items) is templated and tokenized off the engine thread: a stream that runs
//! meanwhile keeps its pace. The verdict is a ratio measured in the same run, so a slow or
//! busy machine moves both sides: the stream's worst gap against the time the server takes
//! to tokenize a third of one such history (`/tokenize`, on its blocking threads, refuses
//! more than the window could hold), a third of what each of them would have frozen the
//! stream for on the engine thread.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use common::server::{post, raw_chat, start};
use serde_json::{json, Value};

/// A streamed chat of `tokens` tokens on a connection of its own: the times its chunks
/// arrived, read on a thread.
fn bystander(base: &str, tokens: usize) -> std::thread::JoinHandle<Vec<Instant>> {
    let body = json!({"messages": [{"role": "user", "content": "Count to a thousand."}],
                      "max_tokens": tokens, "ignore_eos": true, "stream": true});
    let stream = raw_chat(base, &body);
    std::thread::spawn(move || {
        let mut arrivals = Vec::new();
        for line in BufReader::new(stream).lines() {
            let line = line.unwrap();
            if line.starts_with("data: {") {
                arrivals.push(Instant::now());
            }
        }
        arrivals
    })
}

#[test]
fn real_model_huge_histories_and_instructions_are_tokenized_off_the_engine_thread() {
    let server = start(&[]);
    let base = server.base.as_str();
    let huge = "word ".repeat(360_000);
    let history = json!([
        {"role": "user", "content": "Tell me everything."},
        {"role": "assistant", "content": huge},
        {"role": "user", "content": "Thanks. Now a summary?"},
    ]);
    // What tokenizing a third of such a history costs this machine now.
    let third = json!([{"role": "user", "content": "word ".repeat(120_000)}]);
    let started = Instant::now();
    let (status, t) = post(base, "/tokenize", &json!({"messages": third}).to_string());
    assert_eq!(status, 200, "{t}");
    let tokenizing = started.elapsed();

    let stream = bystander(base, 200);
    std::thread::sleep(Duration::from_millis(500));
    let items: Vec<Value> = (0..20_000)
        .map(|i| json!({"role": "user", "content": format!("item {i}")}))
        .collect();
    let bodies = [
        (
            "/v1/chat/completions",
            json!({"messages": history, "max_tokens": 2}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [
            {"role": "system", "content": huge}, {"role": "user", "content": "Hi"}],
            "max_tokens": 2}),
        ),
        (
            "/v1/responses",
            json!({"instructions": huge, "input": "Hi", "max_output_tokens": 2}),
        ),
        (
            "/v1/responses",
            json!({"input": items, "max_output_tokens": 2}),
        ),
    ];
    let answers: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let calls: Vec<_> = bodies
            .iter()
            .map(|(path, body)| {
                let body = body.to_string();
                scope.spawn(move || post(base, path, &body))
            })
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    for (status, answer) in &answers {
        // Served, or refused as too long for the window; never a failure.
        assert!(matches!(status, 200 | 400), "{status}: {answer}");
    }
    let arrivals = stream.join().unwrap();
    assert!(arrivals.len() > 150, "{} chunks", arrivals.len());
    let worst = arrivals.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    println!("worst gap {worst:?}; tokenizing a third of a history {tokenizing:?}");
    assert!(
        worst < tokenizing || worst < Duration::from_millis(500),
        "the stream stalled {worst:?}, against {tokenizing:?} to tokenize a third of a history"
    );
}
