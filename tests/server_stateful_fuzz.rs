//! A stateful fuzzer of the server through HTTP (issue 38), on the real SmolLM2 weights: random
//! sequences over named and unnamed conversations of turns, rewritten histories, invalid
//! parameters, streams cancelled mid-reply, `end_conversation`, two turns on one name at once,
//! raw completions, and SIGTERM or SIGKILL with restarts on the same store, checked against a
//! model of what was acknowledged:
//! - after every operation (restarts included), the store holds exactly the acknowledged state
//!   of every named conversation (its manifest's messages), and nothing for a name that has
//!   none;
//! - every reply equals a stateless recompute: a second server in `--mode stateless` (KV
//!   released after every turn) is sent every acknowledged turn in the order the first server
//!   acknowledged it, and must answer the same text.
//!
//! `PENSIEVE_HTTP_FUZZ_OPS` operations (10,000 by default) from the seed
//! `PENSIEVE_HTTP_FUZZ_SEED` (random by default; a failure prints it).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::server::{metric, post, start, stored_manifest, Server};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// Conversation names the operations use.
const NAMES: [&str; 4] = ["ada", "grace", "edsger", "barbara"];
/// Client-side histories of unnamed conversations kept at once.
const UNNAMED: usize = 4;
/// Past this many messages, a conversation is ended or rewritten (prompts stay short, so that
/// the stateless reference's recompute stays cheap).
const LONGEST: usize = 7;

const WORDS: [&str; 16] = [
    "apple", "river", "blue", "seven", "quiet", "train", "honey", "stone", "north", "lamp",
    "cloud", "tiger", "paper", "salt", "violin", "frost",
];

/// What the client was acknowledged.
#[derive(Default)]
struct Acknowledged {
    /// Per name, the conversation's messages as stored.
    named: BTreeMap<&'static str, Vec<Value>>,
    /// Histories of unnamed conversations, continued by resending them.
    unnamed: Vec<Vec<Value>>,
}

struct Fuzz {
    rng: StdRng,
    store: tempfile::TempDir,
    server: Server,
    reference: Server,
    model: Acknowledged,
    /// Per kind of operation, how many ran and how long they took.
    ops: BTreeMap<&'static str, (usize, Duration)>,
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

/// The request number of an answer (`chatcmpl-N`): later submissions have larger ones.
fn request_number(v: &Value) -> u64 {
    let id = v["id"].as_str().unwrap();
    id.rsplit('-').next().unwrap().parse().unwrap()
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

fn host_port(base: &str) -> String {
    base.trim_start_matches("http://").to_string()
}

fn start_server(store: &Path) -> Server {
    start(&["--store", store.to_str().unwrap()])
}

impl Fuzz {
    fn new(seed: u64) -> Self {
        let store = tempfile::tempdir().unwrap();
        let server = start_server(store.path());
        let reference = start(&["--mode", "stateless"]);
        Self {
            rng: StdRng::seed_from_u64(seed),
            store,
            server,
            reference,
            model: Acknowledged::default(),
            ops: BTreeMap::new(),
        }
    }

    fn count(&mut self, op: &'static str, took: Duration) {
        let entry = self.ops.entry(op).or_default();
        entry.0 += 1;
        entry.1 += took;
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

    /// The reference's answer to the same acknowledged turn (`body` without the server's
    /// extensions), which must be `answer`'s text.
    fn check_against_reference(&self, path: &str, body: Value, answer: &Value) {
        let (status, v) = post(&self.reference.base, path, &stateless(&body).to_string());
        assert_eq!(status, 200, "the reference refused {body}: {v}");
        same_text(path, &body, &v, answer);
    }

    /// Sends `body` to the server and the same turn (`reference`: a stateless client's body)
    /// to the reference at once; the server's answer, which must be a 200 saying what the
    /// reference says.
    fn serve_both(&self, path: &str, body: &Value, reference: &Value) -> Value {
        let reference = stateless(reference);
        let ((status, mine), (ref_status, theirs)) = std::thread::scope(|scope| {
            let r = scope.spawn(|| post(&self.reference.base, path, &reference.to_string()));
            let mine = post(&self.server.base, path, &body.to_string());
            (mine, r.join().unwrap())
        });
        assert_eq!(status, 200, "{body}: {mine}");
        assert_eq!(
            ref_status, 200,
            "the reference refused {reference}: {theirs}"
        );
        same_text(path, body, &theirs, &mine);
        mine
    }

    /// Every name's stored messages are what was acknowledged.
    fn check_store(&self, after: &str) {
        for name in NAMES {
            let stored = stored_manifest(self.store.path(), name).map(|m| {
                let messages = m["messages"].as_array().unwrap().clone();
                messages
                    .iter()
                    .map(|m| json!({"role": m["role"], "content": m["content"]}))
                    .collect::<Vec<_>>()
            });
            assert_eq!(
                stored.as_ref(),
                self.model.named.get(name),
                "after {after}: the store's {name:?} is not what was acknowledged"
            );
        }
    }

    /// A turn on `name` with `messages` (a history and a new user message, or the new message
    /// alone, which continues what the name holds); the answer.
    fn named_turn(&mut self, name: &'static str, messages: Vec<Value>, extra: Value) -> Value {
        let mut body = json!({"messages": messages, "conversation_id": name});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let mut acknowledged = match messages.len() {
            1 => self.model.named.get(name).cloned().unwrap_or_default(),
            _ => Vec::new(),
        };
        acknowledged.extend(messages);
        // The stateless reference is sent the whole history, as a stateless client would.
        let mut reference = body.clone();
        reference["messages"] = json!(acknowledged);
        let v = self.serve_both("/v1/chat/completions", &body, &reference);
        acknowledged.push(json!({"role": "assistant", "content": reply_of(&v)}));
        match body["end_conversation"] == true {
            true => self.model.named.remove(name),
            false => self.model.named.insert(name, acknowledged),
        };
        v
    }

    /// The acknowledged history of `name` and a new user message.
    fn continuation(&mut self, name: &str) -> Vec<Value> {
        let mut messages = self.model.named.get(name).cloned().unwrap_or_default();
        messages.push(json!({"role": "user", "content": user_text(&mut self.rng)}));
        messages
    }

    fn pick_name(&mut self) -> &'static str {
        NAMES[self.rng.random_range(0..NAMES.len())]
    }

    fn op(&mut self) -> &'static str {
        let roll = self.rng.random_range(0..1000);
        match roll {
            0..=249 => self.continue_named(),
            250..=399 => self.unnamed_turn(),
            400..=649 => self.invalid(),
            650..=699 => self.rewrite(),
            700..=759 => self.cancel(),
            760..=789 => self.end(),
            790..=819 => self.concurrent(),
            820..=996 => self.completion(),
            _ => self.restart(),
        }
    }

    fn continue_named(&mut self) -> &'static str {
        let name = self.pick_name();
        if self
            .model
            .named
            .get(name)
            .is_some_and(|m| m.len() >= LONGEST)
        {
            return self.end_named(name);
        }
        let messages = self.continuation(name);
        let sampling = self.sampling();
        self.named_turn(name, messages, sampling);
        "named turn"
    }

    fn unnamed_turn(&mut self) -> &'static str {
        let unnamed = &mut self.model.unnamed;
        if unnamed.len() < UNNAMED && (unnamed.is_empty() || self.rng.random_bool(0.3)) {
            unnamed.push(Vec::new());
        }
        let i = self.rng.random_range(0..unnamed.len());
        if unnamed[i].len() >= LONGEST {
            unnamed[i].clear();
        }
        let mut messages = self.model.unnamed[i].clone();
        messages.push(json!({"role": "user", "content": user_text(&mut self.rng)}));
        let mut body = self.sampling();
        body["messages"] = json!(messages);
        let v = self.serve_both("/v1/chat/completions", &body, &body);
        messages.push(json!({"role": "assistant", "content": reply_of(&v)}));
        self.model.unnamed[i] = messages;
        "unnamed turn"
    }

    /// A request the server must refuse, on a named conversation (continued or rewritten):
    /// nothing stored may change.
    fn invalid(&mut self) -> &'static str {
        let name = self.pick_name();
        let messages = match self.rng.random_bool(0.5) {
            true => self.continuation(name),
            false => vec![json!({"role": "user", "content": user_text(&mut self.rng)})],
        };
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
        let mut body = json!({"messages": messages, "conversation_id": name, "max_tokens": 2});
        let pick = &bad[self.rng.random_range(0..bad.len())];
        for (k, v) in pick.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = post(&self.server.base, "/v1/chat/completions", &body.to_string());
        assert_eq!(status, 400, "{body}: {v}");
        "invalid request"
    }

    /// A turn on a name whose history is not the acknowledged one: it replaces it.
    fn rewrite(&mut self) -> &'static str {
        let name = self.pick_name();
        let mut messages = self.model.named.get(name).cloned().unwrap_or_default();
        // Drop the last exchange, or start over from another (a history of one exchange: a
        // new message alone would continue what the name holds).
        match messages.len() {
            0..=2 => {
                messages = vec![
                    json!({"role": "user", "content": user_text(&mut self.rng)}),
                    json!({"role": "assistant", "content": "Sure."}),
                ]
            }
            n => messages.truncate(n - 2),
        }
        messages.push(json!({"role": "user", "content": user_text(&mut self.rng)}));
        let sampling = self.sampling();
        self.named_turn(name, messages, sampling);
        "rewrite"
    }

    /// A streamed turn (continuing or rewriting a name) the client drops after its first
    /// bytes: nothing stored may change.
    fn cancel(&mut self) -> &'static str {
        let name = self.pick_name();
        let messages = match self.rng.random_bool(0.5) {
            true => self.continuation(name),
            false => vec![json!({"role": "user", "content": user_text(&mut self.rng)})],
        };
        let body = json!({"messages": messages, "conversation_id": name, "max_tokens": 200,
                          "ignore_eos": true, "stream": true})
        .to_string();
        let mut s = TcpStream::connect(host_port(&self.server.base)).unwrap();
        write!(
            s,
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let _ = s.read(&mut [0u8; 256]);
        drop(s);
        let deadline = Instant::now() + Duration::from_secs(60);
        while metric(&self.server.base, "pensieve_queue_depth") != 0.0 {
            assert!(Instant::now() < deadline, "a cancelled turn never ended");
            std::thread::sleep(Duration::from_millis(5));
        }
        "cancelled stream"
    }

    fn end(&mut self) -> &'static str {
        let name = self.pick_name();
        self.end_named(name)
    }

    fn end_named(&mut self, name: &'static str) -> &'static str {
        let messages = self.continuation(name);
        self.named_turn(
            name,
            messages,
            json!({"max_tokens": 1, "temperature": 0, "end_conversation": true}),
        );
        "end_conversation"
    }

    /// Two turns on one name at once: one is refused as busy (409), or both are served one
    /// after the other (the later replacing the earlier's history, which it did not continue).
    fn concurrent(&mut self) -> &'static str {
        let name = self.pick_name();
        let bodies: Vec<Value> = (0..2)
            .map(|_| {
                let messages = self.continuation(name);
                json!({"messages": messages, "conversation_id": name, "max_tokens": 2,
                       "temperature": 0})
            })
            .collect();
        let answers: Vec<(u16, Value)> = std::thread::scope(|scope| {
            let calls: Vec<_> = bodies
                .iter()
                .map(|b| {
                    let base = self.server.base.clone();
                    scope.spawn(move || post(&base, "/v1/chat/completions", &b.to_string()))
                })
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
        served.sort_by_key(|(_, v)| request_number(v));
        for (body, v) in served {
            self.check_against_reference("/v1/chat/completions", body.clone(), v);
            let mut acknowledged = body["messages"].as_array().unwrap().clone();
            acknowledged.push(json!({"role": "assistant", "content": reply_of(v)}));
            self.model.named.insert(name, acknowledged);
        }
        "concurrent turns"
    }

    /// A raw completion of a short text.
    fn completion(&mut self) -> &'static str {
        let mut body = self.sampling();
        body["prompt"] = json!(user_text(&mut self.rng));
        self.serve_both("/v1/completions", &body, &body);
        "completion"
    }

    /// SIGTERM (drained) or SIGKILL, then a new server on the same store. Unnamed
    /// conversations are gone with the process: their clients start new ones.
    fn restart(&mut self) -> &'static str {
        let sig = match self.rng.random_bool(0.5) {
            true => libc::SIGTERM,
            false => libc::SIGKILL,
        };
        // SAFETY: kill(2) on our own child's pid.
        let r = unsafe { libc::kill(self.server.child.id() as i32, sig) };
        assert_eq!(r, 0);
        let status = self.server.child.wait().unwrap();
        if sig == libc::SIGTERM {
            assert!(status.success(), "SIGTERM: {status}");
        }
        self.server = start_server(self.store.path());
        self.model.unnamed.clear();
        match sig {
            libc::SIGTERM => "restart after SIGTERM",
            _ => "restart after SIGKILL",
        }
    }
}

#[test]
fn real_model_the_store_holds_what_was_acknowledged_and_replies_equal_a_stateless_recompute() {
    let ops: usize = std::env::var("PENSIEVE_HTTP_FUZZ_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let seed: u64 = std::env::var("PENSIEVE_HTTP_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    eprintln!("stateful HTTP fuzz: {ops} operations, seed {seed} (PENSIEVE_HTTP_FUZZ_SEED)");
    let mut fuzz = Fuzz::new(seed);
    let started = Instant::now();
    let trace = std::env::var_os("PENSIEVE_HTTP_FUZZ_TRACE").is_some();
    for i in 0..ops {
        let t = Instant::now();
        let op = fuzz.op();
        if trace {
            eprintln!("operation {i}: {op}");
        }
        fuzz.count(op, t.elapsed());
        fuzz.check_store(&format!("operation {i} ({op}), seed {seed}"));
        if (i + 1) % 1000 == 0 {
            eprintln!("{} operations in {:.0?}", i + 1, started.elapsed());
        }
    }
    // A last restart: what every name holds survives it.
    fuzz.restart();
    fuzz.check_store(&format!("the last restart, seed {seed}"));
    eprintln!("{:?}", fuzz.ops);
    for kind in [
        "named turn",
        "unnamed turn",
        "invalid request",
        "rewrite",
        "cancelled stream",
    ] {
        assert!(
            fuzz.ops.get(kind).is_some_and(|&(n, _)| n > 0) || ops < 1000,
            "no {kind}"
        );
    }
}
