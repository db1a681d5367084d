//! A stateful fuzzer of the server through HTTP (issue 38), on the real SmolLM2 weights: four
//! clients at once, each with a conversation name of its own and unnamed conversations, send
//! random sequences of turns, rewritten histories, invalid parameters, streams cancelled
//! mid-reply, `end_conversation`, two turns on their name at once and raw completions; any of
//! them may stop the server with SIGTERM or SIGKILL and start it again on the same store. Each
//! is checked against a model of what it was acknowledged:
//! - after every operation (restarts included), the store holds exactly the acknowledged state
//!   of the client's named conversation (its manifest's messages), and nothing when it has
//!   none;
//! - every reply equals a stateless recompute: a second server in `--mode stateless` (KV
//!   released after every turn) is sent every acknowledged turn, in the order the first server
//!   acknowledged it, and must answer the same text. Conversations of different clients share
//!   steps (and prefix KV), which batch invariance makes invisible.
//!
//! `PENSIEVE_HTTP_FUZZ_OPS` operations in all (3,000 by default: about 100 s, a third of the
//! whole suite's time at 10,000) from the seed `PENSIEVE_HTTP_FUZZ_SEED` (random by default,
//! so CI's runs add up; a failure prints it).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use common::server::{post, start, stored_manifest, Server};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// The clients' conversation names, one each.
const NAMES: [&str; 4] = ["ada", "grace", "edsger", "barbara"];
/// Unnamed conversations a client keeps at once.
const UNNAMED: usize = 2;
/// Past this many messages (the opening system message included), a conversation is ended or
/// started again (prompts stay short, so that the stateless reference's recompute stays cheap).
const LONGEST: usize = 6;

const WORDS: [&str; 16] = [
    "apple", "river", "blue", "seven", "quiet", "train", "honey", "stone", "north", "lamp",
    "cloud", "tiger", "paper", "salt", "violin", "frost",
];

/// Per kind of operation, how many ran and how long they took.
type Tally = BTreeMap<&'static str, (usize, Duration)>;

/// The servers the clients share.
struct Servers {
    store: tempfile::TempDir,
    /// The server under test; a restart replaces it (the clients' operations hold it read).
    server: RwLock<Server>,
    /// Restarts so far.
    generation: AtomicU64,
    /// The stateless reference.
    reference: Server,
}

impl Servers {
    fn start_server(store: &std::path::Path) -> Server {
        start(&["--store", store.to_str().unwrap()])
    }

    /// SIGTERM (drained: exit 0) or SIGKILL, then a new server on the same store, once no
    /// client is in the middle of an operation.
    fn restart(&self, sig: i32) {
        let mut server = self.server.write().unwrap();
        // SAFETY: kill(2) on our own child's pid.
        let r = unsafe { libc::kill(server.child.id() as i32, sig) };
        assert_eq!(r, 0);
        let status = server.child.wait().unwrap();
        if sig == libc::SIGTERM {
            assert!(status.success(), "SIGTERM: {status}");
        }
        *server = Self::start_server(self.store.path());
        self.generation.fetch_add(1, Ordering::SeqCst);
    }
}

/// One client: its name, what it was acknowledged, its own random sequence.
struct Client<'a> {
    servers: &'a Servers,
    name: &'static str,
    rng: StdRng,
    /// The named conversation's messages as stored, if it has any.
    named: Option<Vec<Value>>,
    /// Histories of unnamed conversations, continued by resending them.
    unnamed: Vec<Vec<Value>>,
    /// The server's generation the unnamed conversations were held by.
    generation: u64,
    /// A stream on the name was dropped: its turn may still be winding down, so a turn on the
    /// name may be refused as busy until it has.
    cancelling: bool,
    tally: Tally,
}

fn user_text(rng: &mut StdRng) -> String {
    let n = rng.random_range(1..5);
    let words: Vec<&str> = (0..n)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect();
    format!("Say {}.", words.join(" "))
}

fn reply_of(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no reply in {v}"))
        .to_string()
}

/// Where an answer's turn came in its conversation: a later turn's prompt holds the earlier
/// ones' replies, so it is longer.
fn turn_order(v: &Value) -> u64 {
    v["usage"]["prompt_tokens"].as_u64().unwrap()
}

/// `body` without the server's extensions: what a stateless client sends.
fn stateless(body: &Value) -> Value {
    let mut body = body.clone();
    let object = body.as_object_mut().unwrap();
    for hint in ["conversation_id", "end_conversation", "stream"] {
        object.remove(hint);
    }
    body
}

/// The reference's answer `theirs` and the server's `mine` to `body` say the same.
fn same_text(path: &str, body: &Value, theirs: &Value, mine: &Value) {
    let text = |v: &Value| match path {
        "/v1/completions" => v["choices"][0]["text"].as_str().unwrap().to_string(),
        _ => reply_of(v),
    };
    assert_eq!(
        text(theirs),
        text(mine),
        "{path} {body}: stateful and stateless differ"
    );
}

/// The server's `usage` adds up, and counts the reply as the reference does.
fn same_usage(path: &str, body: &Value, theirs: &Value, mine: &Value) {
    let n = |v: &Value, key: &str| v["usage"][key].as_u64().unwrap();
    let cached = mine["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    let (prompt, completion) = (n(mine, "prompt_tokens"), n(mine, "completion_tokens"));
    assert_eq!(
        n(mine, "total_tokens"),
        prompt + completion,
        "{path} {body}: {mine}"
    );
    assert!(cached <= prompt, "{path} {body}: {mine}");
    assert_eq!(
        completion,
        n(theirs, "completion_tokens"),
        "{path} {body}: {mine} against {theirs}"
    );
}

/// The store holds `acknowledged` for `name` (nothing for `None`).
fn check_stored(servers: &Servers, name: &str, acknowledged: &Option<Vec<Value>>, after: &str) {
    let stored = stored_manifest(servers.store.path(), name).map(|m| {
        let messages = m["messages"].as_array().unwrap().clone();
        messages
            .iter()
            .map(|m| json!({"role": m["role"], "content": m["content"]}))
            .collect::<Vec<_>>()
    });
    assert_eq!(
        &stored, acknowledged,
        "after {after}: the store's {name:?} is not what was acknowledged"
    );
}

fn user(text: String) -> Value {
    json!({"role": "user", "content": text})
}

/// A new history: a short system message, which stands in for the template's default one
/// (SmolLM2's takes 20 tokens, which the stateless reference would recompute on every turn).
fn opening() -> Vec<Value> {
    vec![json!({"role": "system", "content": "Be brief."})]
}

impl<'a> Client<'a> {
    fn new(servers: &'a Servers, name: &'static str, seed: u64) -> Self {
        Self {
            servers,
            name,
            rng: StdRng::seed_from_u64(seed),
            named: None,
            unnamed: Vec::new(),
            generation: 0,
            cancelling: false,
            tally: Tally::new(),
        }
    }

    /// Sampling fields: greedy or seeded sampling, one or two tokens.
    fn sampling(&mut self) -> Value {
        let max_tokens = self.rng.random_range(1..3);
        match self.rng.random_bool(0.5) {
            true => json!({"max_tokens": max_tokens, "temperature": 0}),
            false => json!({"max_tokens": max_tokens, "temperature": 0.8,
                            "seed": self.rng.random_range(0..1000u64)}),
        }
    }

    /// One operation, on the server of the moment; its kind.
    fn op(&mut self) -> &'static str {
        if self.rng.random_range(0..1000) == 0 {
            return self.restart();
        }
        let server = self.servers.server.read().unwrap();
        let generation = self.servers.generation.load(Ordering::SeqCst);
        if generation != self.generation {
            // Gone with the process: the clients of unnamed conversations start new ones.
            self.unnamed.clear();
            self.generation = generation;
        }
        let base = server.base.clone();
        let roll = self.rng.random_range(0..1000);
        // Refusals and dropped streams are cheap and are where stored state used to be lost:
        // half the operations; turns (each recomputed by the reference) the other half.
        let op = match roll {
            0..=199 => self.continue_named(&base),
            200..=299 => self.unnamed_turn(&base),
            300..=699 => self.invalid(&base),
            700..=739 => self.rewrite(&base),
            740..=839 => self.cancel(&base),
            840..=869 => self.end(&base),
            870..=899 if !self.cancelling => self.concurrent(&base),
            870..=899 => self.continue_named(&base),
            _ => self.completion(&base),
        };
        drop(server);
        op
    }

    /// Sends `body` to the server and the same turn (`reference`: a stateless client's body)
    /// to the reference at once; the server's answer, which must be a 200 saying what the
    /// reference says. A turn on the client's name refused as busy while a dropped stream's
    /// turn winds down is sent again.
    fn serve_both(&mut self, base: &str, path: &str, body: &Value, reference: &Value) -> Value {
        let reference = stateless(reference);
        let ((status, mine), (ref_status, theirs)) = std::thread::scope(|scope| {
            let r =
                scope.spawn(|| post(&self.servers.reference.base, path, &reference.to_string()));
            let deadline = Instant::now() + Duration::from_secs(60);
            let mine = loop {
                let (status, v) = post(base, path, &body.to_string());
                if status != 409 || !self.cancelling || Instant::now() > deadline {
                    break (status, v);
                }
                std::thread::sleep(Duration::from_millis(5));
            };
            (mine, r.join().unwrap())
        });
        assert_eq!(status, 200, "{body}: {mine}");
        assert_eq!(
            ref_status, 200,
            "the reference refused {reference}: {theirs}"
        );
        same_text(path, body, &theirs, &mine);
        same_usage(path, body, &theirs, &mine);
        mine
    }

    /// The store holds what this client's name was acknowledged.
    fn check_store(&self, after: &str) {
        check_stored(self.servers, self.name, &self.named, after);
    }

    /// A turn on the name with `messages` (a history and a new user message, or the new
    /// message alone, which continues what the name holds); the answer.
    fn named_turn(&mut self, base: &str, messages: Vec<Value>, extra: Value) -> Value {
        let mut body = json!({"messages": messages, "conversation_id": self.name});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let mut acknowledged = match messages.len() {
            1 => self.named.clone().unwrap_or_default(),
            _ => Vec::new(),
        };
        acknowledged.extend(messages);
        // The stateless reference is sent the whole history, as a stateless client would.
        let mut reference = body.clone();
        reference["messages"] = json!(acknowledged);
        let v = self.serve_both(base, "/v1/chat/completions", &body, &reference);
        self.cancelling = false;
        acknowledged.push(json!({"role": "assistant", "content": reply_of(&v)}));
        self.named = match body["end_conversation"] == true {
            true => None,
            false => Some(acknowledged),
        };
        v
    }

    /// The acknowledged history of the name (or a new one) and a new user message.
    fn continuation(&mut self) -> Vec<Value> {
        let mut messages = self.named.clone().unwrap_or_else(opening);
        messages.push(user(user_text(&mut self.rng)));
        messages
    }

    fn continue_named(&mut self, base: &str) -> &'static str {
        if self.named.as_ref().is_some_and(|m| m.len() >= LONGEST) {
            return self.end(base);
        }
        // The whole history, or (as a client that names its conversation may) the new
        // message alone.
        let messages = match self.rng.random_bool(0.7) {
            true => self.continuation(),
            false => vec![user(user_text(&mut self.rng))],
        };
        let sampling = self.sampling();
        self.named_turn(base, messages, sampling);
        "named turn"
    }

    fn unnamed_turn(&mut self, base: &str) -> &'static str {
        let unnamed = &mut self.unnamed;
        if unnamed.len() < UNNAMED && (unnamed.is_empty() || self.rng.random_bool(0.3)) {
            unnamed.push(opening());
        }
        let i = self.rng.random_range(0..unnamed.len());
        if unnamed[i].len() >= LONGEST {
            unnamed[i] = opening();
        }
        let mut messages = self.unnamed[i].clone();
        messages.push(user(user_text(&mut self.rng)));
        let mut body = self.sampling();
        body["messages"] = json!(messages);
        let v = self.serve_both(base, "/v1/chat/completions", &body, &body);
        messages.push(json!({"role": "assistant", "content": reply_of(&v)}));
        self.unnamed[i] = messages;
        "unnamed turn"
    }

    /// The acknowledged history and a new message, or (half the time) a history of another
    /// exchange that rewrites it.
    fn continuation_or_rewrite(&mut self) -> Vec<Value> {
        match self.rng.random_bool(0.5) {
            true => self.continuation(),
            false => {
                let mut messages = opening();
                messages.extend([
                    user(user_text(&mut self.rng)),
                    json!({"role": "assistant", "content": "Sure."}),
                    user(user_text(&mut self.rng)),
                ]);
                messages
            }
        }
    }

    /// A request the server must refuse, on the name (continued or rewritten): nothing
    /// stored may change.
    fn invalid(&mut self, base: &str) -> &'static str {
        let messages = self.continuation_or_rewrite();
        let bad = [
            json!({"top_p": 2}),
            json!({"temperature": -1}),
            json!({"max_tokens": 0}),
            json!({"max_tokens": 2, "min_tokens": 3}),
            json!({"n": 0}),
            json!({"logit_bias": {"99999999": 1}}),
            json!({"presence_penalty": 9}),
            json!({"top_k": -7}),
            json!({"frobnicate": true}),
            json!({"expect_resume_s": -1}),
            json!({"response_format": {"type": "xml"}}),
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
        ];
        let mut body = json!({"messages": messages, "conversation_id": self.name,
                              "max_tokens": 2});
        let pick = &bad[self.rng.random_range(0..bad.len())];
        for (k, v) in pick.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = post(base, "/v1/chat/completions", &body.to_string());
        assert_eq!(status, 400, "{body}: {v}");
        "invalid request"
    }

    /// A turn on the name whose history is not the acknowledged one: it replaces it.
    fn rewrite(&mut self, base: &str) -> &'static str {
        let mut messages = self.named.clone().unwrap_or_default();
        // Drop the last exchange, or start over from another (a history of one exchange: a
        // new message alone would continue what the name holds).
        match messages.len() {
            0..=3 => {
                messages = opening();
                messages.extend([
                    user(user_text(&mut self.rng)),
                    json!({"role": "assistant", "content": "Sure."}),
                ]);
            }
            n => messages.truncate(n - 2),
        }
        messages.push(user(user_text(&mut self.rng)));
        let sampling = self.sampling();
        self.named_turn(base, messages, sampling);
        "rewrite"
    }

    /// A streamed turn (continuing or rewriting the name) the client drops after its first
    /// bytes: nothing stored may change.
    fn cancel(&mut self, base: &str) -> &'static str {
        let messages = self.continuation_or_rewrite();
        let body = json!({"messages": messages, "conversation_id": self.name,
                          "max_tokens": 200, "ignore_eos": true, "stream": true})
        .to_string();
        let mut s = TcpStream::connect(base.trim_start_matches("http://")).unwrap();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut first = [0u8; 256];
        let n = s.read(&mut first).unwrap_or(0);
        let answer = String::from_utf8_lossy(&first[..n]);
        // A turn still winding down from an earlier drop makes this one busy: nothing ran.
        if !answer.starts_with("HTTP/1.1 409") {
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            self.cancelling = true;
        }
        drop(s);
        "cancelled stream"
    }

    fn end(&mut self, base: &str) -> &'static str {
        let messages = self.continuation();
        let extra = json!({"max_tokens": 1, "temperature": 0, "end_conversation": true});
        self.named_turn(base, messages, extra);
        "end_conversation"
    }

    /// Two turns on the name at once: one is refused as busy (409), or both are served one
    /// after the other (the later replacing the earlier's history, which it did not continue).
    fn concurrent(&mut self, base: &str) -> &'static str {
        let bodies: Vec<Value> = (0..2)
            .map(|_| {
                json!({"messages": self.continuation(), "conversation_id": self.name,
                       "max_tokens": 2, "temperature": 0})
            })
            .collect();
        let answers: Vec<(u16, Value)> = std::thread::scope(|scope| {
            let calls: Vec<_> = (bodies.iter())
                .map(|b| scope.spawn(move || post(base, "/v1/chat/completions", &b.to_string())))
                .collect();
            calls.into_iter().map(|c| c.join().unwrap()).collect()
        });
        let mut served: Vec<(&Value, &Value)> = bodies
            .iter()
            .zip(&answers)
            .filter_map(|(b, (status, v))| match status {
                200 => Some((b, v)),
                409 => None,
                other => panic!("a concurrent turn got {other}: {v}"),
            })
            .collect();
        assert!(
            !served.is_empty(),
            "both concurrent turns were refused: {answers:?}"
        );
        served.sort_by_key(|(_, v)| turn_order(v));
        for (body, v) in served {
            let reference = stateless(body);
            let (status, theirs) = post(
                &self.servers.reference.base,
                "/v1/chat/completions",
                &reference.to_string(),
            );
            assert_eq!(status, 200, "the reference refused {reference}: {theirs}");
            same_text("/v1/chat/completions", body, &theirs, v);
            let mut acknowledged = body["messages"].as_array().unwrap().clone();
            acknowledged.push(json!({"role": "assistant", "content": reply_of(v)}));
            self.named = Some(acknowledged);
        }
        "concurrent turns"
    }

    /// A raw completion of a short text.
    fn completion(&mut self, base: &str) -> &'static str {
        let mut body = self.sampling();
        body["prompt"] = json!(user_text(&mut self.rng));
        self.serve_both(base, "/v1/completions", &body, &body);
        "completion"
    }

    fn restart(&mut self) -> &'static str {
        match self.rng.random_bool(0.5) {
            true => {
                self.servers.restart(libc::SIGTERM);
                "restart after SIGTERM"
            }
            false => {
                self.servers.restart(libc::SIGKILL);
                "restart after SIGKILL"
            }
        }
    }

    /// `ops` operations, each followed by a check of the store; what they did, and what the
    /// name was acknowledged in the end.
    fn run(mut self, ops: usize, seed: u64, started: Instant) -> (Tally, Option<Vec<Value>>) {
        let trace = std::env::var_os("PENSIEVE_HTTP_FUZZ_TRACE").is_some();
        for i in 0..ops {
            let t = Instant::now();
            let op = self.op();
            if trace {
                eprintln!("{} operation {i}: {op}", self.name);
            }
            let entry = self.tally.entry(op).or_default();
            entry.0 += 1;
            entry.1 += t.elapsed();
            self.check_store(&format!(
                "{}'s operation {i} ({op}), seed {seed}",
                self.name
            ));
            if (i + 1) % 500 == 0 {
                eprintln!(
                    "{}: {} operations in {:.0?}",
                    self.name,
                    i + 1,
                    started.elapsed()
                );
            }
        }
        (self.tally, self.named)
    }
}

#[test]
fn real_model_the_store_holds_what_was_acknowledged_and_replies_equal_a_stateless_recompute() {
    let ops: usize = std::env::var("PENSIEVE_HTTP_FUZZ_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3_000);
    let seed: u64 = std::env::var("PENSIEVE_HTTP_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    eprintln!("stateful HTTP fuzz: {ops} operations, seed {seed} (PENSIEVE_HTTP_FUZZ_SEED)");
    let store = tempfile::tempdir().unwrap();
    let servers = Servers {
        server: RwLock::new(Servers::start_server(store.path())),
        store,
        generation: AtomicU64::new(0),
        reference: start(&["--mode", "stateless"]),
    };
    let started = Instant::now();
    let ends: Vec<(Tally, Option<Vec<Value>>)> = std::thread::scope(|scope| {
        let clients: Vec<_> = (NAMES.iter().enumerate())
            .map(|(i, &name)| {
                let client = Client::new(&servers, name, seed.wrapping_add(i as u64));
                let share = ops / NAMES.len() + usize::from(i < ops % NAMES.len());
                scope.spawn(move || client.run(share, seed, started))
            })
            .collect();
        clients.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let mut total = Tally::new();
    for (op, (n, took)) in ends.iter().flat_map(|(tally, _)| tally) {
        let entry = total.entry(op).or_default();
        entry.0 += n;
        entry.1 += *took;
    }
    eprintln!("{ops} operations in {:.0?}: {total:?}", started.elapsed());
    // A last restart, by SIGKILL: every name holds what it was acknowledged.
    servers.restart(libc::SIGKILL);
    for (&name, (_, acknowledged)) in NAMES.iter().zip(&ends) {
        check_stored(
            &servers,
            name,
            acknowledged,
            &format!("the last restart, seed {seed}"),
        );
    }
    let kinds = [
        "named turn",
        "unnamed turn",
        "invalid request",
        "rewrite",
        "cancelled stream",
    ];
    for kind in kinds {
        assert!(total.contains_key(kind) || ops < 1000, "no {kind}");
    }
}
