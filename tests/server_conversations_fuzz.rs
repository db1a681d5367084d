//! A stateful fuzzer of the Conversations API through HTTP (issue 73): clients at once add
//! items, delete their items, run turns (`/v1/responses` with `conversation`), create, update
//! and delete conversations, all on a few conversations they share, so that their edits of one
//! conversation race; between rounds a server is stopped by SIGKILL or SIGTERM and started again
//! on the same store, or the store (Valkey) is frozen for a round. After every round each
//! server is checked against a model of what was acknowledged, as the turn fuzzer
//! (`server_stateful_fuzz.rs`) checks the store:
//! - an item whose add answered 200 is listed, with the id it was given, until a deletion of it
//!   answered 200; a deleted item is never listed again; an item is listed only if some request
//!   added it (answered or not: a 503 or a dropped answer may or may not have landed);
//! - one client's acknowledged items keep the order they were added in;
//! - a conversation whose deletion answered 200 answers 404 ever after, on every server;
//! - a round with the store frozen acknowledges no change (a write answers 503 or 409, never
//!   200), and nothing acknowledged before it is lost;
//! - the metadata a conversation was last acknowledged is what it answers.
//!
//! Two setups: two servers on one Valkey (a fleet: the edits of one conversation alternate
//! between them) and one server on a folder store (kill -9 right after an answer). Turns run
//! on `--model tiny` (their text is not what is checked here; the turn fuzzer checks replies
//! against a stateless recompute). `PENSIEVE_CONV_FUZZ_OPS` operations per setup (400 by
//! default; 10,000 by hand), from the seed `PENSIEVE_CONV_FUZZ_SEED` (random by default; a
//! failure prints it).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::redis_server;
use common::server::{request, start_with_env, Server};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// Clients at once, each with its own operations in every round.
const CLIENTS: usize = 4;
/// Conversations alive at most (their edits race).
const LIVE: usize = 3;
/// Items a conversation grows to before clients stop adding to it and delete it.
const LONGEST: usize = 30;

/// What the model knows of an item a client sent.
#[derive(Clone, Debug, PartialEq)]
enum Fate {
    /// Acknowledged (200): it is listed.
    Present,
    /// Sent, not acknowledged (503, 409 while the store was down, a lost answer): it may be
    /// listed or not.
    Maybe,
    /// Its deletion was acknowledged: never listed again.
    Deleted,
    /// Its deletion was sent and not acknowledged.
    MaybeDeleted,
}

#[derive(Clone, Debug)]
struct Known {
    /// Its text (unique: the client, its operation and the item's place).
    text: String,
    /// Its id, once an answer or a listing gave it.
    id: Option<String>,
    fate: Fate,
    /// The client that sent it (the only one that deletes it), and its order among that
    /// client's items.
    client: usize,
    order: u64,
}

/// A conversation as the model knows it.
#[derive(Debug, Default)]
struct Conv {
    items: Vec<Known>,
    /// Its deletion was acknowledged (in or before the round of this number).
    deleted: Option<u64>,
    /// Its deletion was sent and not acknowledged.
    maybe_deleted: bool,
    /// In this round: a request on it answered 404, and a deletion of it was sent (the only
    /// reason for a 404 while it exists: a deletion in flight).
    saw_404: bool,
    delete_sent: bool,
    /// The metadata last acknowledged, and any sent since without an answer.
    metadata: Value,
    maybe_metadata: Vec<Value>,
}

/// The system under test: its servers and its store.
struct System {
    servers: Vec<Server>,
    args: Vec<String>,
    redis: Option<redis_server::Server>,
    _folder: Option<tempfile::TempDir>,
}

impl System {
    fn fleet() -> Self {
        let redis = redis_server::Server::start(None);
        let args = vec![
            "--model".into(),
            "tiny".into(),
            "--redis".into(),
            redis.url(),
            "--redis-prefix".into(),
            "conv-fuzz".into(),
        ];
        let servers = (0..2).map(|_| start_with(&args)).collect();
        Self {
            servers,
            args,
            redis: Some(redis),
            _folder: None,
        }
    }

    fn folder() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let args = vec![
            "--model".into(),
            "tiny".into(),
            "--store".into(),
            dir.path().to_str().unwrap().into(),
        ];
        Self {
            servers: vec![start_with(&args)],
            args,
            redis: None,
            _folder: Some(dir),
        }
    }

    fn restart(&mut self, i: usize, sig: i32) {
        let server = &mut self.servers[i];
        // SAFETY: kill(2) on our own child's pid.
        let r = unsafe { libc::kill(server.child.id() as i32, sig) };
        assert_eq!(r, 0);
        let status = server.child.wait().unwrap();
        if sig == libc::SIGTERM {
            assert!(status.success(), "SIGTERM: {status}");
        }
        *server = start_with(&self.args);
    }

    fn base(&self, i: usize) -> String {
        self.servers[i % self.servers.len()].base.clone()
    }
}

/// A server of `args`, logging only what went wrong (every request at 10,000 operations would
/// bury it).
fn start_with(args: &[String]) -> Server {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    start_with_env(&args, &[("RUST_LOG", "warn")])
}

/// Whether a status acknowledges a change.
fn acked(status: u16) -> bool {
    status == 200
}

/// Statuses that leave a change unknown: the store down (503), a turn on the conversation
/// running (409), the request's deadline (504).
fn unknown(status: u16) -> bool {
    matches!(status, 409 | 503 | 504)
}

/// The model of every conversation, shared by the clients of a round.
#[derive(Default)]
struct Model {
    convs: BTreeMap<String, Conv>,
}

impl Model {
    fn live(&self) -> Vec<String> {
        (self.convs.iter())
            .filter(|(_, c)| c.deleted.is_none() && !c.maybe_deleted)
            .map(|(id, _)| id.clone())
            .collect()
    }
}

/// One client's operations, on the round's server `base`.
struct Client {
    index: usize,
    rng: StdRng,
    /// Items sent so far (orders them).
    sent: u64,
}

/// [`request`], traced on stderr when `PENSIEVE_CONV_FUZZ_TRACE` is set.
fn call(method: &str, base: &str, path: &str, body: &str) -> (u16, Value) {
    let (status, out) = request(method, base, path, body);
    if std::env::var_os("PENSIEVE_CONV_FUZZ_TRACE").is_some() {
        let body: String = body.chars().take(160).collect();
        let out: String = out.to_string().chars().take(200).collect();
        eprintln!("{method} {base}{path} {body} -> {status} {out}");
    }
    (status, out)
}

/// What a write on conversation `conv` answered: never an acknowledgement while the
/// store was frozen; a 404 noted (only a deletion in flight explains one while the
/// conversation exists, which the round's check holds it to).
fn answered(round: Round, what: &str, status: u16, out: &Value, conv: &mut Conv) -> Answer {
    check_frozen(round, what, status, out);
    match status {
        200 => Answer::Acked,
        404 => {
            conv.maybe_deleted = true;
            conv.saw_404 = true;
            Answer::Gone
        }
        s if unknown(s) => Answer::Unknown,
        s => panic!("{what}: {s} {out}"),
    }
}

/// A write's answer during a frozen round is never an acknowledgement.
fn check_frozen(round: Round, what: &str, status: u16, out: &Value) {
    assert!(
        !(round.frozen && acked(status)),
        "round {}: {what} acknowledged while the store was down: {out}",
        round.n
    );
}

/// How a write on a conversation was answered.
enum Answer {
    Acked,
    /// 404: the conversation is gone (deleted meanwhile, which the check settles).
    Gone,
    /// Not acknowledged: it may or may not have landed.
    Unknown,
}

/// What a round is: its number, and whether the store is frozen for it.
#[derive(Clone, Copy)]
struct Round {
    n: u64,
    frozen: bool,
}

impl Client {
    fn text(&mut self) -> (String, u64) {
        self.sent += 1;
        (format!("item c{} n{}", self.index, self.sent), self.sent)
    }

    /// A conversation alive in the model, if any.
    fn pick(&mut self, model: &Mutex<Model>) -> Option<String> {
        let live = model.lock().unwrap().live();
        (!live.is_empty()).then(|| live[self.rng.random_range(0..live.len())].clone())
    }

    /// One operation; its name.
    fn op(&mut self, base: &str, model: &Mutex<Model>, round: Round) -> &'static str {
        let live = model.lock().unwrap().live().len();
        let roll = self.rng.random_range(0..100);
        match roll {
            _ if live == 0 => self.create(base, model, round),
            0..=9 if live < LIVE => self.create(base, model, round),
            0..=39 => self.add(base, model, round),
            40..=59 => self.delete_item(base, model, round),
            60..=74 => self.turn(base, model, round),
            75..=79 => self.delete_conversation(base, model, round),
            80..=84 if self.index == 0 => self.update(base, model, round),
            _ => self.read(base, model),
        }
    }

    fn create(&mut self, base: &str, model: &Mutex<Model>, round: Round) -> &'static str {
        let n = self.rng.random_range(0..3);
        let texts: Vec<(String, u64)> = (0..n).map(|_| self.text()).collect();
        let items: Vec<Value> = (texts.iter())
            .map(|(t, _)| json!({"type": "message", "role": "user", "content": t}))
            .collect();
        let metadata = json!({"by": format!("c{}", self.index)});
        let body = json!({"items": items, "metadata": metadata});
        let (status, out) = call("POST", base, "/v1/conversations", &body.to_string());
        check_frozen(round, "a creation", status, &out);
        if !acked(status) {
            assert!(unknown(status), "create: {status} {out}");
            return "create (refused)";
        }
        let id = out["id"].as_str().unwrap().to_string();
        let mut conv = Conv {
            metadata,
            ..Conv::default()
        };
        for (text, order) in texts {
            conv.items.push(Known {
                text,
                id: None,
                fate: Fate::Present,
                client: self.index,
                order,
            });
        }
        model.lock().unwrap().convs.insert(id, conv);
        "create"
    }

    fn add(&mut self, base: &str, model: &Mutex<Model>, round: Round) -> &'static str {
        let Some(id) = self.pick(model) else {
            return "add (none alive)";
        };
        if model.lock().unwrap().convs[&id].items.len() >= LONGEST {
            return self.delete_conversation(base, model, round);
        }
        let n = self.rng.random_range(1..4);
        let texts: Vec<(String, u64)> = (0..n).map(|_| self.text()).collect();
        let items: Vec<Value> = (texts.iter())
            .map(|(t, _)| json!({"type": "message", "role": "user", "content": t}))
            .collect();
        let path = format!("/v1/conversations/{id}/items");
        let (status, out) = call("POST", base, &path, &json!({"items": items}).to_string());
        let mut m = model.lock().unwrap();
        let conv = m.convs.get_mut(&id).unwrap();
        let (fate, name) = match answered(round, "an add", status, &out, conv) {
            Answer::Acked => {
                let data = out["data"].as_array().unwrap();
                assert_eq!(data.len(), texts.len(), "add to {id}: {out}");
                for ((text, order), item) in texts.into_iter().zip(data) {
                    assert_eq!(item["content"][0]["text"], json!(text), "{out}");
                    conv.items.push(Known {
                        text,
                        id: Some(item["id"].as_str().unwrap().to_string()),
                        fate: Fate::Present,
                        client: self.index,
                        order,
                    });
                }
                return "add";
            }
            Answer::Gone => (Fate::Maybe, "add (404)"),
            Answer::Unknown => (Fate::Maybe, "add (refused)"),
        };
        for (text, order) in texts {
            conv.items.push(Known {
                text,
                id: None,
                fate: fate.clone(),
                client: self.index,
                order,
            });
        }
        name
    }

    fn delete_item(&mut self, base: &str, model: &Mutex<Model>, round: Round) -> &'static str {
        let Some(id) = self.pick(model) else {
            return "delete item (none alive)";
        };
        let target = {
            let m = model.lock().unwrap();
            let mine: Vec<(usize, String)> = (m.convs[&id].items.iter().enumerate())
                .filter(|(_, k)| k.client == self.index && k.fate == Fate::Present)
                .filter_map(|(i, k)| Some((i, k.id.clone()?)))
                .collect();
            match mine.is_empty() {
                true => None,
                false => Some(mine[self.rng.random_range(0..mine.len())].clone()),
            }
        };
        let Some((at, item)) = target else {
            return self.add(base, model, round);
        };
        let path = format!("/v1/conversations/{id}/items/{item}");
        let (status, out) = call("DELETE", base, &path, "");
        let mut m = model.lock().unwrap();
        let conv = m.convs.get_mut(&id).unwrap();
        let (fate, name) = match answered(round, "an item's deletion", status, &out, conv) {
            Answer::Acked => {
                assert_eq!(out["id"], json!(id), "{out}");
                (Fate::Deleted, "delete item")
            }
            // The conversation went meanwhile (settled at the check), or the item was lost,
            // which the check finds.
            Answer::Gone => (Fate::MaybeDeleted, "delete item (404)"),
            Answer::Unknown => (Fate::MaybeDeleted, "delete item (refused)"),
        };
        conv.items[at].fate = fate;
        name
    }

    fn turn(&mut self, base: &str, model: &Mutex<Model>, round: Round) -> &'static str {
        let Some(id) = self.pick(model) else {
            return "turn (none alive)";
        };
        let (text, order) = self.text();
        let body = json!({"conversation": id, "input": text, "max_output_tokens": 2,
            "temperature": 0});
        let (status, out) = call("POST", base, "/v1/responses", &body.to_string());
        let mut m = model.lock().unwrap();
        let conv = m.convs.get_mut(&id).unwrap();
        let fate = match answered(round, "a turn", status, &out, conv) {
            Answer::Acked => Fate::Present,
            Answer::Gone | Answer::Unknown => Fate::Maybe,
        };
        conv.items.push(Known {
            text,
            id: None,
            fate,
            client: self.index,
            order,
        });
        "turn"
    }

    fn delete_conversation(
        &mut self,
        base: &str,
        model: &Mutex<Model>,
        round: Round,
    ) -> &'static str {
        let Some(id) = self.pick(model) else {
            return "delete conversation (none alive)";
        };
        (model.lock().unwrap().convs.get_mut(&id).unwrap()).delete_sent = true;
        let (status, out) = call("DELETE", base, &format!("/v1/conversations/{id}"), "");
        let mut m = model.lock().unwrap();
        let conv = m.convs.get_mut(&id).unwrap();
        match answered(round, "a conversation's deletion", status, &out, conv) {
            Answer::Acked => {
                assert_eq!(out["deleted"], json!(true), "{out}");
                conv.deleted = Some(round.n);
                "delete conversation"
            }
            Answer::Gone => "delete conversation (404)",
            Answer::Unknown => {
                conv.maybe_deleted = true;
                "delete conversation (refused)"
            }
        }
    }

    fn update(&mut self, base: &str, model: &Mutex<Model>, round: Round) -> &'static str {
        let Some(id) = self.pick(model) else {
            return "update (none alive)";
        };
        let metadata = json!({"topic": format!("t{}", self.rng.random_range(0..1000))});
        let body = json!({"metadata": metadata}).to_string();
        let (status, out) = call("POST", base, &format!("/v1/conversations/{id}"), &body);
        let mut m = model.lock().unwrap();
        let conv = m.convs.get_mut(&id).unwrap();
        match answered(round, "an update", status, &out, conv) {
            Answer::Acked => {
                assert_eq!(out["metadata"], metadata, "{out}");
                conv.metadata = metadata;
                conv.maybe_metadata.clear();
                "update"
            }
            Answer::Gone => "update (404)",
            Answer::Unknown => {
                conv.maybe_metadata.push(metadata);
                "update (refused)"
            }
        }
    }

    /// A read during the round: a 200 or a refusal, whatever the others do.
    fn read(&mut self, base: &str, model: &Mutex<Model>) -> &'static str {
        let Some(id) = self.pick(model) else {
            return "read (none alive)";
        };
        let (status, out) = call("GET", base, &format!("/v1/conversations/{id}/items"), "");
        assert!(
            matches!(status, 200 | 404) || unknown(status),
            "{status} {out}"
        );
        "read"
    }
}

/// `GET path` on `base` until it answers other than 503 (the store's client backs off for a
/// while after an outage), within a deadline.
fn settled_get(base: &str, path: &str) -> (u16, Value) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, out) = request("GET", base, path, "");
        if status != 503 || Instant::now() > deadline {
            return (status, out);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every item of conversation `id` on `base`, oldest first; `None` if it answers 404.
fn listed(base: &str, id: &str) -> Option<Vec<Value>> {
    let mut all = Vec::new();
    let mut after = String::new();
    loop {
        let path = format!("/v1/conversations/{id}/items?order=asc&limit=100{after}");
        let (status, page) = settled_get(base, &path);
        match status {
            404 => return None,
            200 => {}
            s => panic!("listing {id}: {s} {page}"),
        }
        all.extend(page["data"].as_array().unwrap().iter().cloned());
        if page["has_more"] != true {
            return Some(all);
        }
        after = format!("&after={}", page["last_id"].as_str().unwrap());
    }
}

/// Checks every server against the model after `round`, and learns what it can: which
/// unacknowledged changes landed.
/// Conversations deleted rounds ago are checked again only at the end (`all`).
fn check(system: &System, model: &mut Model, round: u64, seed: u64, all: bool) {
    let ctx = |id: &str| format!("after round {round} (seed {seed}), conversation {id}");
    for (id, conv) in model.convs.iter_mut() {
        if conv.deleted.is_some_and(|d| d + 2 < round) && !all {
            continue;
        }
        for s in 0..system.servers.len() {
            let base = system.base(s);
            let (status, object) = settled_get(&base, &format!("/v1/conversations/{id}"));
            let listing = match status {
                404 => None,
                200 => listed(&base, id),
                other => panic!("{}: {other} {object}", ctx(id)),
            };
            let Some(items) = listing else {
                assert!(
                    conv.deleted.is_some() || conv.maybe_deleted,
                    "{}: the conversation is lost on server {s}",
                    ctx(id)
                );
                conv.deleted.get_or_insert(round);
                conv.maybe_deleted = false;
                continue;
            };
            assert!(
                conv.deleted.is_none(),
                "{}: deleted in round {:?}, it came back on server {s}: {items:?}",
                ctx(id),
                conv.deleted
            );
            check_metadata(conv, &object, &ctx(id));
            check_items(conv, &items, &format!("{} on server {s}", ctx(id)));
            let shown: Vec<String> = (items.iter())
                .map(|i| format!("{} {}", i["id"], i["content"][0]["text"]))
                .collect();
            assert!(
                !conv.saw_404 || conv.delete_sent,
                "{}: a request answered 404 with no deletion sent, yet it exists on server {s}: \
                 {shown:?}",
                ctx(id)
            );
        }
        // Listed by every server: the deletion that answered otherwise did not happen.
        if conv.deleted.is_none() {
            conv.maybe_deleted = false;
        }
        conv.saw_404 = false;
        conv.delete_sent = false;
    }
}

fn check_metadata(conv: &mut Conv, object: &Value, ctx: &str) {
    let got = &object["metadata"];
    if *got == conv.metadata {
        return;
    }
    let landed = conv.maybe_metadata.iter().position(|m| m == got);
    assert!(
        landed.is_some(),
        "{ctx}: metadata {got} is neither the acknowledged {} nor one sent since",
        conv.metadata
    );
    conv.metadata = got.clone();
    conv.maybe_metadata.clear();
}

fn check_items(conv: &mut Conv, items: &[Value], ctx: &str) {
    let ids: HashSet<&str> = items.iter().filter_map(|i| i["id"].as_str()).collect();
    assert_eq!(ids.len(), items.len(), "{ctx}: two items share an id");
    // User items by text (every text is unique; replies are not checked).
    let mut by_text: HashMap<String, (usize, String)> = HashMap::new();
    for (place, i) in items.iter().enumerate() {
        if i["role"] == "user" {
            let text = i["content"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let id = i["id"].as_str().unwrap_or_default().to_string();
            let phantom = !conv.items.iter().any(|k| k.text == text);
            assert!(!phantom, "{ctx}: item {text:?} was never sent");
            by_text.insert(text, (place, id));
        }
    }
    let mut last_place: HashMap<usize, (usize, u64)> = HashMap::new();
    for k in conv.items.iter_mut() {
        let found = by_text.get(&k.text);
        match (&k.fate, found) {
            (Fate::Present, None) => panic!("{ctx}: acknowledged item {:?} is lost", k.text),
            (Fate::Deleted, Some(_)) => {
                panic!("{ctx}: item {:?} came back after its deletion", k.text)
            }
            (Fate::Maybe, Some(_)) => k.fate = Fate::Present,
            (Fate::MaybeDeleted, None) => k.fate = Fate::Deleted,
            _ => {}
        }
        if let Some((place, id)) = found {
            match &k.id {
                Some(known) => assert_eq!(known, id, "{ctx}: item {:?} changed its id", k.text),
                None => k.id = Some(id.clone()),
            }
            // Within one client, an acknowledged item's place follows its earlier ones'.
            if k.fate == Fate::Present {
                if let Some(&(before, order)) = last_place.get(&k.client) {
                    assert!(
                        *place > before || k.order < order,
                        "{ctx}: item {:?} listed before an earlier one of its client",
                        k.text
                    );
                }
                last_place.insert(k.client, (*place, k.order));
            }
        }
    }
}

fn run(mut system: System, label: &str) {
    let ops: usize = std::env::var("PENSIEVE_CONV_FUZZ_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let seed: u64 = std::env::var("PENSIEVE_CONV_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    eprintln!("{label}: {ops} operations, seed {seed} (PENSIEVE_CONV_FUZZ_SEED)");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut clients: Vec<Client> = (0..CLIENTS)
        .map(|i| Client {
            index: i,
            rng: StdRng::seed_from_u64(seed.wrapping_add(1 + i as u64)),
            sent: 0,
        })
        .collect();
    let mut model = Model::default();
    let mut tally: BTreeMap<&'static str, usize> = BTreeMap::new();
    let started = Instant::now();
    let rounds = ops.div_ceil(CLIENTS) as u64;
    for n in 0..rounds {
        // Faults between rounds: a server stopped and started again, or the store frozen for
        // the round.
        let fault = rng.random_range(0..100);
        let frozen = system.redis.is_some() && fault < 6;
        if (6..9).contains(&fault) {
            let i = rng.random_range(0..system.servers.len());
            let sig = [libc::SIGKILL, libc::SIGTERM][rng.random_range(0..2)];
            system.restart(i, sig);
            if std::env::var_os("PENSIEVE_CONV_FUZZ_TRACE").is_some() {
                eprintln!("restarted server {i} after signal {sig}");
            }
            *tally.entry("restart").or_default() += 1;
        }
        if frozen {
            system.redis.as_ref().unwrap().freeze(true);
            *tally.entry("frozen round").or_default() += 1;
        }
        let round = Round { n, frozen };
        if std::env::var_os("PENSIEVE_CONV_FUZZ_TRACE").is_some() {
            eprintln!("round {n}{}", if frozen { " (store frozen)" } else { "" });
        }
        let shared = Mutex::new(std::mem::take(&mut model));
        let bases: Vec<String> = (0..CLIENTS).map(|c| system.base(c + n as usize)).collect();
        let names: Vec<&'static str> = std::thread::scope(|scope| {
            let calls: Vec<_> = (clients.iter_mut().zip(&bases))
                .map(|(c, base)| {
                    let shared = &shared;
                    scope.spawn(move || c.op(base, shared, round))
                })
                .collect();
            calls.into_iter().map(|c| c.join().unwrap()).collect()
        });
        model = shared.into_inner().unwrap();
        if frozen {
            system.redis.as_ref().unwrap().freeze(false);
        }
        for name in names {
            *tally.entry(name).or_default() += 1;
        }
        check(&system, &mut model, n, seed, false);
        if (n + 1) % 100 == 0 {
            eprintln!("{label}: {} rounds in {:.0?}", n + 1, started.elapsed());
        }
    }
    // The end: every server stopped by SIGKILL and started again, and checked once more.
    for i in 0..system.servers.len() {
        system.restart(i, libc::SIGKILL);
    }
    check(&system, &mut model, rounds, seed, true);
    eprintln!(
        "{label}: {ops} operations in {:.0?}: {tally:?}",
        started.elapsed()
    );
    for kind in ["add", "delete item", "turn", "create"] {
        assert!(
            tally.contains_key(kind) || ops < 200,
            "no {kind}: {tally:?}"
        );
    }
}

#[test]
fn conversations_on_a_fleet_keep_what_was_acknowledged_through_kills_and_store_outages() {
    run(System::fleet(), "fleet");
}

#[test]
fn conversations_on_a_folder_store_keep_what_was_acknowledged_through_kills() {
    run(System::folder(), "folder");
}
