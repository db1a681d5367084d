//! pensieve servers as the workers of vLLM's router (`vllm-router` 0.1.17, which
//! `scripts/fetch-assets` installs from PyPI): three servers on one Valkey, each conversation
//! routed by its `X-Session-Id` (the router's consistent hash), and servers killed with
//! SIGKILL. Every reply is checked against the same conversation on a server of its own.
//!
//! - Killed between turns: clients that send only their new message (the conversation named
//!   in `conversation_id`) continue on another server from what the store holds, so every
//!   turn answered before the kill is in the history the next reply is computed from.
//! - Killed with turns in flight: a request either gets its reply, identical to the
//!   reference, or fails as a client retries (a 5xx from the router or a cut connection),
//!   never a 200 with another reply; the client resends its whole history, and the retry
//!   gets the reference reply.
//!
//! - Restarted one after another (SIGTERM, then started again on its port) while clients
//!   talk: with `--shutdown-grace-s` a server leaving answers its health check 503 and serves
//!   on, so the router stops sending it requests before it stops taking them, and no request
//!   fails; every conversation keeps its history across the moves. The grace is long and
//!   ended by a second SIGTERM once the router reports the server unhealthy, so that a slow
//!   machine's late health checks do not decide the verdict.
//!
//! The verdicts do not depend on when the kill lands: a turn in flight or not, the same holds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::redis_server::{self, free_port};
use common::server::{metric, start, start_on, Server};
use serde_json::{json, Value};

const CONVERSATIONS: usize = 6;

/// A router process, killed when dropped.
struct Router {
    child: Child,
    base: String,
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn router(workers: &[&Server]) -> Router {
    let exe = pensieve::model::default_cache_dir().join("routers/bin/vllm-router");
    assert!(
        exe.exists(),
        "{} is missing: run scripts/fetch-assets --tests (it installs vLLM's router)",
        exe.display()
    );
    let port = free_port();
    let child = Command::new(exe)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .arg("--worker-urls")
        .args(workers.iter().map(|w| w.base.as_str()))
        .args(["--policy", "consistent_hash"])
        .args(["--health-check-interval-secs", "1"])
        .args(["--prometheus-port", &free_port().to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Router {
        child,
        base: format!("http://127.0.0.1:{port}"),
    }
}

/// What one request came back with.
enum Outcome {
    Reply {
        text: String,
        prompt_tokens: u64,
    },
    /// A status a client retries (5xx), or no answer at all (a cut connection).
    Retryable(String),
}

fn ask(base: &str, name: &str, messages: &[Value], max_tokens: usize) -> Outcome {
    let body = json!({"model": "pensieve", "messages": messages, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true, "conversation_id": name});
    let answer = ureq::post(&format!("{base}/v1/chat/completions"))
        .set("content-type", "application/json")
        .set("x-session-id", name)
        .timeout(Duration::from_secs(120))
        .send_string(&body.to_string());
    match answer {
        Ok(r) => {
            let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
            Outcome::Reply {
                text: v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string(),
                prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap(),
            }
        }
        Err(ureq::Error::Status(code, r)) => {
            let body = r.into_string().unwrap_or_default();
            assert!(
                code >= 500,
                "{name}: {code} is not a retryable failure: {body}"
            );
            Outcome::Retryable(format!("{code}: {body}"))
        }
        Err(e) => Outcome::Retryable(e.to_string()),
    }
}

/// Asks until a reply comes (a client's retries), within a minute.
fn reply(base: &str, name: &str, messages: &[Value], max_tokens: usize) -> (String, u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match ask(base, name, messages, max_tokens) {
            Outcome::Reply {
                text,
                prompt_tokens,
            } => return (text, prompt_tokens),
            Outcome::Retryable(why) => {
                assert!(Instant::now() < deadline, "{name}: no reply: {why}");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

fn user(name: &str, turn: usize) -> Value {
    json!({"role": "user", "content": format!("Turn {turn}: tell me something about {name}.")})
}

/// Each conversation's replies and prompt sizes on a server of its own, turn by turn.
fn reference(turns: usize, max_tokens: &[usize]) -> Vec<Vec<(String, u64)>> {
    let server = start(&[]);
    (0..CONVERSATIONS)
        .map(|k| {
            let name = format!("conv-{k}");
            (0..turns)
                .map(|t| reply(&server.base, &name, &[user(&name, t)], max_tokens[t]))
                .collect()
        })
        .collect()
}

/// The server holding the most conversations.
fn busiest(servers: &[Server]) -> usize {
    (0..servers.len())
        .max_by_key(|&i| metric(&servers[i].base, "pensieve_conversations") as u64)
        .unwrap()
}

#[test]
fn real_model_servers_killed_behind_vllm_s_router_lose_no_answered_turn() {
    let max_tokens = [8, 8, 8, 40];
    let expected = reference(max_tokens.len(), &max_tokens);
    let redis = redis_server::Server::start(None);
    let url = redis.url();
    let args = ["--redis", url.as_str(), "--redis-prefix", "failover"];
    let mut servers: Vec<Server> = (0..3).map(|_| start(&args)).collect();
    let router = router(&servers.iter().collect::<Vec<_>>());
    let names: Vec<String> = (0..CONVERSATIONS).map(|k| format!("conv-{k}")).collect();

    // Two turns each, then the server holding the most of them is killed between turns.
    for t in 0..2 {
        for (k, name) in names.iter().enumerate() {
            let got = reply(&router.base, name, &[user(name, t)], max_tokens[t]);
            assert_eq!(got, expected[k][t], "{name}, turn {t}");
        }
    }
    let victim = busiest(&servers);
    assert!(metric(&servers[victim].base, "pensieve_conversations") > 0.0);
    let mut killed = servers.remove(victim);
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    // Sending only the new message: the history is the store's, with both answered turns.
    for (k, name) in names.iter().enumerate() {
        let got = reply(&router.base, name, &[user(name, 2)], max_tokens[2]);
        assert_eq!(got, expected[k][2], "{name}, turn 2, after the kill");
    }

    // Turns in flight when another server dies: each client resends its whole history, so a
    // retry asks the same question.
    let history = |k: usize, name: &str| -> Vec<Value> {
        let mut messages = Vec::new();
        for (t, (answer, _)) in expected[k].iter().enumerate().take(3) {
            messages.push(user(name, t));
            messages.push(json!({"role": "assistant", "content": answer}));
        }
        messages.push(user(name, 3));
        messages
    };
    let clients: Vec<_> = (names.iter().enumerate())
        .map(|(k, name)| {
            let (base, name, messages) = (router.base.clone(), name.clone(), history(k, name));
            std::thread::spawn(move || {
                let mut failures = Vec::new();
                loop {
                    match ask(&base, &name, &messages, max_tokens[3]) {
                        Outcome::Reply {
                            text,
                            prompt_tokens,
                        } => return ((text, prompt_tokens), failures),
                        Outcome::Retryable(why) => failures.push(why),
                    }
                    assert!(failures.len() < 300, "{name}: no reply: {failures:?}");
                    std::thread::sleep(Duration::from_millis(200));
                }
            })
        })
        .collect();
    // Killed once a turn runs on it (or after ten seconds: the verdict holds either way).
    let victim = busiest(&servers);
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&servers[victim].base, "pensieve_num_requests_running") == 0.0
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let running = metric(&servers[victim].base, "pensieve_num_requests_running");
    let mut killed = servers.remove(victim);
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    eprintln!("killed a server with {running} turns running");
    for ((k, name), client) in names.iter().enumerate().zip(clients) {
        let (got, failures) = client.join().unwrap();
        eprintln!(
            "{name}: {} failed attempts before its reply",
            failures.len()
        );
        assert_eq!(
            got, expected[k][3],
            "{name}, turn 3, in flight ({failures:?})"
        );
    }
    drop(redis);
}

/// Waits (up to two minutes) until `router` reports `worker` healthy or not, as asked.
fn wait_for_health(router: &Router, worker: &str, healthy: bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let workers: Value = ureq::get(&format!("{}/workers", router.base))
            .call()
            .ok()
            .and_then(|r| r.into_json().ok())
            .unwrap_or_default();
        let listed = workers["workers"].as_array().into_iter().flatten();
        if let Some(w) = listed.into_iter().find(|w| w["url"] == worker)
            && w["is_healthy"] == healthy
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{worker} never healthy = {healthy}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn real_model_a_rolling_restart_behind_vllm_s_router_fails_no_request() {
    let redis = redis_server::Server::start(None);
    let url = redis.url();
    let args = [
        "--redis",
        url.as_str(),
        "--redis-prefix",
        "rolling",
        "--shutdown-grace-s",
        "120",
    ];
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut servers: Vec<Server> = ports.iter().map(|&p| start_on(p, &args)).collect();
    let router = router(&servers.iter().collect::<Vec<_>>());
    // The router routes once it has found its workers healthy.
    reply(&router.base, "warm-up", &[user("warm-up", 0)], 1);
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CONVERSATIONS)
        .map(|k| {
            let (base, stop) = (router.base.clone(), stop.clone());
            std::thread::spawn(move || {
                let name = format!("rolling-{k}");
                let (mut turns, mut last) = (0, 0);
                while !stop.load(Ordering::Relaxed) {
                    match ask(&base, &name, &[user(&name, turns)], 8) {
                        Outcome::Reply { prompt_tokens, .. } => {
                            // The history keeps every answered turn (8 tokens each), wherever
                            // the conversation moved.
                            assert!(
                                prompt_tokens > last + 8 || turns == 0,
                                "{name}, turn {turns}: {prompt_tokens} prompt tokens after {last}"
                            );
                            (turns, last) = (turns + 1, prompt_tokens);
                        }
                        Outcome::Retryable(why) => panic!("{name}, turn {turns} failed: {why}"),
                    }
                }
                turns
            })
        })
        .collect();
    for (i, &port) in ports.iter().enumerate() {
        let pid = servers[i].child.id().to_string();
        let term = || {
            let status = Command::new("kill").args(["-TERM", &pid]).status();
            assert!(status.unwrap().success());
        };
        term();
        wait_for_health(&router, &servers[i].base, false);
        // The router has let go of it: the second signal ends the grace.
        term();
        assert!(servers[i].child.wait().unwrap().success());
        servers[i] = start_on(port, &args);
        wait_for_health(&router, &servers[i].base, true);
    }
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        assert!(client.join().unwrap() > 0);
    }
    drop(redis);
}
