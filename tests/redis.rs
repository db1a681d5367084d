//! The shared Redis tier on the real SmolLM2 weights, against a real `redis-server` (the
//! Debian package; `.ci/run` installs it) started on a free port in its own temporary folder:
//! a conversation served by one engine continues on another from the KV in Redis, resent
//! histories find other engines' chunks by content, and a Redis that dies, loses keys or
//! returns damaged bytes costs recomputes, never wrong outputs. Every output equals a
//! `Stateless` engine's.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::redis_server::{store_config as config, Server};
use common::redis_server::{tutor, QUESTIONS};

use futures_util::FutureExt;
use pensieve::engine::{
    CacheMode, ConversationId, ConversationOptions, Durability, Engine, Event, RedisConfig,
    SamplingParams, Turn, TurnStats,
};
use pensieve::kv::StoreError;
use pensieve::model::{Message, Model, WeightFormat};
use pensieve::service::{Chat, Service, ServiceConfig, TurnEvent};
use pensieve::Error;

fn model() -> Arc<Model> {
    Arc::new(common::real_model(WeightFormat::F32))
}

/// How a member of the fleet under `prefix` reaches `server`.
fn fleet_config(server: &Server, prefix: &str) -> RedisConfig {
    let mut config = RedisConfig::new(server.url()).key_prefix(prefix);
    config.ca_file = server.tls.then(|| server.cert());
    config
}

fn fleet_member(model: &Arc<Model>, server: &Server, prefix: &str) -> Engine {
    let r = fleet_config(server, prefix);
    Engine::with_model(model.clone(), config(CacheMode::Tiered, Some(r))).unwrap()
}

/// A member of the fleet under `prefix` that served alice's first turn and stored it.
fn alice_served(model: &Arc<Model>, server: &Server, prefix: &str) -> Engine {
    let mut a = fleet_member(model, server, prefix);
    let c = a.open(tutor(Some("alice"))).unwrap();
    turn(&mut a, c, 0);
    a.flush();
    a
}

/// Runs question `q` as the next turn of `conv`; its tokens, stats and text.
fn turn(e: &mut Engine, conv: ConversationId, q: usize) -> (Vec<u32>, TurnStats, String) {
    let params = SamplingParams::greedy().max_tokens(8).ignore_eos(true);
    let r = common::run_turn(e, conv, Turn::user(QUESTIONS[q]), params);
    (r.tokens, r.stats, r.text)
}

/// Puts `server` to sleep for `seconds` (`DEBUG SLEEP`, from a connection of its own), once it
/// has begun: the thread ends when it wakes.
fn stall(server: &Server, seconds: u32) -> std::thread::JoinHandle<redis::RedisResult<()>> {
    let mut raw = server.raw().unwrap();
    let sleeper = std::thread::spawn(move || {
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(seconds)
            .query::<()>(&mut raw)
    });
    std::thread::sleep(Duration::from_millis(300));
    sleeper
}

/// The outputs of questions `0..n` in one conversation of a stateless engine.
fn stateless(model: &Arc<Model>, n: usize) -> Vec<Vec<u32>> {
    let mut e = Engine::with_model(model.clone(), config(CacheMode::Stateless, None)).unwrap();
    let c = e.open(tutor(None)).unwrap();
    (0..n).map(|q| turn(&mut e, c, q).0).collect()
}

#[test]
fn a_conversation_continues_on_whichever_engine_its_turn_lands() {
    let server = Server::start(None);
    let model = model();
    let want = stateless(&model, 3);
    let mut a = fleet_member(&model, &server, "fleet");
    let mut b = fleet_member(&model, &server, "fleet");

    let c = a.open(tutor(Some("alice"))).unwrap();
    assert_eq!(turn(&mut a, c, 0).0, want[0]);
    a.flush();
    let computed = a.tokens(c).unwrap().len() - 1;

    assert_eq!(b.stored_conversations(), ["alice"]);
    // Turn 2 lands on B: it has never seen alice, and prefills only the new message.
    let c = b.resume("alice").unwrap();
    assert_eq!(
        b.tokens(c).unwrap(),
        a.tokens(a.find("alice").unwrap()).unwrap()
    );
    let (out, stats, _) = turn(&mut b, c, 1);
    assert_eq!(out, want[1]);
    assert_eq!(stats.reused_from_store_tokens, computed, "{stats:?}");
    assert_eq!(stats.recomputed_tokens, 0, "{stats:?}");
    assert_eq!(stats.prefilled_tokens, stats.prompt_tokens + 1, "{stats:?}");
    let store = b.stats().store.unwrap();
    assert!(
        store.chunks_discovered > 0 && store.faults.total() == 0,
        "{store:?}"
    );
    b.flush();

    // Turn 3 is back on A, whose copy is a turn behind: B's replaces it, with the full chunks
    // A holds in memory shared and the rest fetched.
    let stale = a.find("alice").unwrap();
    let c = a.resume("alice").unwrap();
    assert_ne!(c, stale);
    assert_eq!(a.find("alice"), Some(c));
    assert_eq!(
        a.tokens(c).unwrap(),
        b.tokens(b.find("alice").unwrap()).unwrap()
    );
    let (out, stats, _) = turn(&mut a, c, 2);
    assert_eq!(out, want[2]);
    assert_eq!(stats.recomputed_tokens, 0, "{stats:?}");
    assert!(stats.reused_tokens > computed, "{stats:?}");
    let in_memory = stats.reused_tokens - stats.reused_from_store_tokens;
    assert_eq!(in_memory, computed / 32 * 32, "{stats:?}");
    // A copy that is current is kept as is.
    a.flush();
    assert_eq!(a.resume("alice").unwrap(), c);
    assert!(matches!(b.resume("bob"), Err(Error::NotStored(n)) if n == "bob"));
}

#[test]
fn a_resent_history_finds_the_chunks_another_engine_computed() {
    let server = Server::start(None);
    let model = model();
    let mut a = fleet_member(&model, &server, "fleet");
    let mut b = fleet_member(&model, &server, "fleet");
    let c = a.open(tutor(None)).unwrap();
    let reply = turn(&mut a, c, 0).2;
    a.flush();

    // A client of a stateless API resends the whole chat to B.
    let history = vec![
        Message::new("user", QUESTIONS[0]),
        Message::new("assistant", reply),
    ];
    let resent = tutor(None).history(history.clone());
    let c = b.open(resent.clone()).unwrap();
    let (out, stats, _) = turn(&mut b, c, 1);
    let mut fresh = Engine::with_model(model.clone(), config(CacheMode::Stateless, None)).unwrap();
    let r = fresh.open(resent).unwrap();
    assert_eq!(out, turn(&mut fresh, r, 1).0);
    assert!(stats.reused_from_store_tokens >= 64, "{stats:?}");
    assert!(b.stats().shared_tokens >= 64);
}

#[test]
fn turns_finish_by_recompute_when_redis_dies_and_the_tier_reconnects() {
    let mut server = Server::start(None);
    let model = model();
    let want = stateless(&model, 4);
    let mut a = fleet_member(&model, &server, "fleet");
    let mut b = fleet_member(&model, &server, "fleet");
    let c = a.open(tutor(Some("alice"))).unwrap();
    turn(&mut a, c, 0);
    a.flush();
    let c = b.resume("alice").unwrap();

    // Redis dies with alice's KV in it, before B reads any.
    server.stop();
    let (out, stats, _) = turn(&mut b, c, 1);
    assert_eq!(out, want[1]);
    assert!(stats.recomputed_tokens > 0, "{stats:?}");
    let faults = b.stats().store.unwrap().faults;
    assert!(faults.io > 0, "{faults:?}");
    // Nothing is stored while it is down, and the engine goes on serving.
    let (out, _, _) = turn(&mut b, c, 2);
    assert_eq!(out, want[2]);
    // An engine may even start while Redis is down, and serve.
    let mut late = fleet_member(&model, &server, "fleet");
    assert!(matches!(late.resume("alice"), Err(Error::Store { .. })));
    let fresh = late.open(tutor(None)).unwrap();
    assert_eq!(turn(&mut late, fresh, 0).0, want[0]);

    // Back (empty): B reconnects on its own and stores alice again at her next turn's end, so
    // a third engine continues her from it.
    server.restart();
    std::thread::sleep(Duration::from_millis(2100));
    let before = b.stats().store.unwrap();
    b.submit(
        c,
        Turn::user(QUESTIONS[3]),
        SamplingParams::greedy().max_tokens(1),
    )
    .unwrap();
    while b.has_work() {
        b.step().unwrap();
    }
    b.flush();
    let after = b.stats().store.unwrap();
    assert!(after.connects > before.connects, "{after:?}");
    assert!(after.chunks_written > before.chunks_written, "{after:?}");
    let mut d = fleet_member(&model, &server, "fleet");
    let c = d.resume("alice").unwrap();
    assert_eq!(
        d.tokens(c).unwrap(),
        b.tokens(b.find("alice").unwrap()).unwrap()
    );
    let stats = turn(&mut d, c, 0).1;
    assert_eq!(stats.recomputed_tokens, 0, "{stats:?}");
}

/// Damages alice's stored chunks: one flipped payload byte (the first key returned), one chunk
/// evicted (the second), one replaced by another chunk's bytes (the third).
fn damage(server: &Server) -> Vec<String> {
    let mut raw = server.raw().unwrap();
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("fleet:*:chunk:*")
        .query(&mut raw)
        .unwrap();
    keys.sort();
    assert!(keys.len() >= 3, "{keys:?}");
    let mut bytes: Vec<u8> = redis::cmd("GET").arg(&keys[0]).query(&mut raw).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    let set = |key: &str, bytes: &[u8], raw: &mut redis::Connection| {
        redis::cmd("SET")
            .arg(key)
            .arg(bytes)
            .query::<()>(raw)
            .unwrap();
    };
    set(&keys[0], &bytes, &mut raw);
    redis::cmd("DEL")
        .arg(&keys[1])
        .query::<()>(&mut raw)
        .unwrap();
    set(&keys[2], &bytes, &mut raw);
    keys
}

#[test]
fn damaged_and_evicted_keys_are_refused_and_recomputed() {
    let server = Server::start(None);
    let model = model();
    let want = stateless(&model, 2);
    let a = alice_served(&model, &server, "fleet");
    let computed = a.tokens(a.find("alice").unwrap()).unwrap().len() - 1;
    damage(&server);

    let mut b = fleet_member(&model, &server, "fleet");
    let c = b.resume("alice").unwrap();
    let (out, stats, _) = turn(&mut b, c, 1);
    assert_eq!(out, want[1]);
    assert!(stats.recomputed_tokens > 0, "{stats:?}");
    assert_eq!(stats.reused_tokens + stats.recomputed_tokens, computed);
    let faults = b.stats().store.unwrap().faults;
    assert_eq!(faults.missing, 1, "{faults:?}");
    assert_eq!(faults.corrupt + faults.wrong_content, 2, "{faults:?}");
}

/// A key whose bytes a read proved bad is deleted, though the failed restore let its chunk go
/// before the read's verdict came back from the reader thread: no other turn or engine reads
/// it again.
#[test]
fn keys_proven_bad_are_deleted_after_their_restore_let_them_go() {
    let server = Server::start(None);
    let model = model();
    alice_served(&model, &server, "fleet");
    let keys = damage(&server);
    let mut b = fleet_member(&model, &server, "fleet");
    let c = b.resume("alice").unwrap();
    let params = SamplingParams::greedy().max_tokens(64).ignore_eos(true);
    b.submit(c, Turn::user(QUESTIONS[1]), params).unwrap();
    let refused = |b: &Engine| {
        let f = b.stats().store.unwrap().faults;
        f.corrupt + f.wrong_content
    };
    while refused(&b) < 2 {
        assert!(b.has_work(), "the turn ended before both keys were refused");
        b.step().unwrap();
    }
    // Still running: the recomputed chunks are not saved again until the turn ends.
    assert!(b.has_work());
    b.flush();
    let mut raw = server.raw().unwrap();
    for key in [&keys[0], &keys[2]] {
        let there: bool = redis::cmd("EXISTS").arg(key).query(&mut raw).unwrap();
        assert!(!there, "{key} still holds bytes proven bad");
    }
}

#[test]
fn passwords_and_key_prefixes_keep_deployments_apart() {
    let server = Server::start(Some("fleet-secret"));
    let model = model();
    alice_served(&model, &server, "blue");

    // Another deployment on the same server sees none of blue's conversations or chunks.
    let mut green = fleet_member(&model, &server, "green");
    assert!(matches!(green.resume("alice"), Err(Error::NotStored(_))));
    assert!(green.stored_conversations().is_empty());
    assert_eq!(
        fleet_member(&model, &server, "blue").stored_conversations(),
        ["alice"]
    );
    let c = green.open(tutor(None)).unwrap();
    let stats = turn(&mut green, c, 0).1;
    assert_eq!(stats.reused_tokens, 0, "{stats:?}");

    // A wrong password is refused when the engine is built, without echoing it.
    let wrong = RedisConfig::new(format!("redis://:not-it@127.0.0.1:{}/", server.port));
    let e = Engine::with_model(model.clone(), config(CacheMode::Tiered, Some(wrong)))
        .err()
        .unwrap();
    let text = e.to_string();
    assert!(matches!(e, Error::Store { .. }), "{text}");
    assert!(!text.contains("not-it") && text.contains("***"), "{text}");

    // An ACL user limited to blue's keys serves blue's conversations...
    let mut raw = server.raw().unwrap();
    redis::cmd("ACL")
        .arg(
            &[
                "SETUSER",
                "blue-fleet",
                "on",
                ">blue-pw",
                "~blue:*",
                "+@all",
            ][..],
        )
        .query::<()>(&mut raw)
        .unwrap();
    let url = format!("redis://blue-fleet:blue-pw@127.0.0.1:{}/", server.port);
    let member = |prefix: &str| {
        let r = RedisConfig::new(url.clone()).key_prefix(prefix);
        Engine::with_model(model.clone(), config(CacheMode::Tiered, Some(r))).unwrap()
    };
    let mut blue = member("blue");
    let c = blue.resume("alice").unwrap();
    let stats = turn(&mut blue, c, 1).1;
    assert_eq!(stats.recomputed_tokens, 0, "{stats:?}");
    // ...and is refused green's: its reads and writes fail, and it serves on by computing.
    let mut intruder = member("green");
    assert!(matches!(intruder.resume("alice"), Err(Error::Store { .. })));
    let c = intruder.open(tutor(None)).unwrap();
    turn(&mut intruder, c, 0);
    intruder.flush();
    let store = intruder.stats().store.unwrap();
    assert!(
        store.save_failures > 0 && store.chunks_written == 0,
        "{store:?}"
    );
}

#[test]
fn a_fleet_shares_kv_over_tls() {
    let server = Server::start_tls();
    let model = model();
    let want = stateless(&model, 2);
    alice_served(&model, &server, "fleet");
    let mut b = fleet_member(&model, &server, "fleet");
    let c = b.resume("alice").unwrap();
    let (out, stats, _) = turn(&mut b, c, 1);
    assert_eq!(out, want[1]);
    assert_eq!(stats.recomputed_tokens, 0, "{stats:?}");
    assert!(stats.reused_from_store_tokens > 0, "{stats:?}");

    // Without the CA that signed the server's certificate, the handshake is refused.
    let untrusted = RedisConfig::new(server.url());
    let e = Engine::with_model(model.clone(), config(CacheMode::Tiered, Some(untrusted)));
    assert!(matches!(e, Err(Error::Store { .. })));
}

#[test]
fn a_redis_too_slow_for_its_deadline_costs_a_recompute() {
    let server = Server::start(None);
    let model = model();
    let want = stateless(&model, 2);
    alice_served(&model, &server, "fleet");
    let r = fleet_config(&server, "fleet").timeout(Duration::from_millis(200));
    let mut b = Engine::with_model(model.clone(), config(CacheMode::Tiered, Some(r))).unwrap();
    let c = b.resume("alice").unwrap();

    // The server stalls for 5 s, far past B's 200 ms deadline, while B's turn reads alice's KV.
    let chunks = |raw: &mut redis::Connection| {
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("fleet:*:chunk:*")
            .query(raw)
            .unwrap();
        keys
    };
    let stored = chunks(&mut server.raw().unwrap());
    let stall = stall(&server, 5);
    let (out, stats, _) = turn(&mut b, c, 1);
    assert_eq!(out, want[1]);
    assert!(stats.recomputed_tokens > 0, "{stats:?}");
    let faults = b.stats().store.unwrap().faults;
    assert!(faults.io > 0, "{faults:?}");
    stall.join().unwrap().unwrap();
    // A read that timed out says nothing against the bytes: nothing was deleted.
    let mut raw = server.raw().unwrap();
    let now = chunks(&mut raw);
    assert!(stored.iter().all(|k| now.contains(k)), "{stored:?} {now:?}");
}

/// Issue 27: a lookup by content in a stalled Redis runs behind the step thread. The turn that
/// asked waits in the queue while the others go on decoding, then runs (here on its own KV:
/// the lookup timed out), its output the stateless one.
#[test]
fn a_stalled_lookup_holds_only_the_turn_that_asked() {
    let server = Server::start(None);
    let model = model();
    let want = stateless(&model, 1);
    // Alice's stored turn holds the chunks of the tutor's system prompt.
    alice_served(&model, &server, "fleet");
    let mut b = fleet_member(&model, &server, "fleet");
    let decoder = b.open(ConversationOptions::default()).unwrap();
    let long = SamplingParams::greedy().max_tokens(64).ignore_eos(true);
    let d = b.submit(decoder, Turn::user(QUESTIONS[3]), long).unwrap();
    let token_of = |events: &[Event], r| {
        (events.iter()).any(|e| matches!(e, Event::Token { request, .. } if *request == r))
    };
    while !token_of(&b.step().unwrap(), d) {}

    let stall = stall(&server, 3);
    let newcomer = b.open(tutor(None)).unwrap();
    let params = SamplingParams::greedy().max_tokens(8).ignore_eos(true);
    let n = b
        .submit(newcomer, Turn::user(QUESTIONS[0]), params)
        .unwrap();
    for _ in 0..3 {
        let events = b.step().unwrap();
        assert!(token_of(&events, d), "the decoder waited: {events:?}");
        assert!(
            !token_of(&events, n),
            "the newcomer ran before its lookup was answered"
        );
    }
    assert!(!stall.is_finished(), "the steps waited for Redis");
    stall.join().unwrap().unwrap();

    let mut out = Vec::new();
    loop {
        let events = b.step().unwrap();
        for e in &events {
            match e {
                Event::Token { request, token, .. } if *request == n => out.push(*token),
                Event::Finished { request, .. } if *request == n => {
                    assert_eq!(out, want[0]);
                    return;
                }
                _ => {}
            }
        }
    }
}

/// Issue 27: the service reads a named conversation's manifest off the engine thread. With a
/// deadline longer than the stall, a resume read on the engine thread would stop every turn
/// until Redis wakes; the decoder goes on instead.
#[test]
fn a_resume_or_a_named_open_through_the_service_does_not_hold_the_engine_thread() {
    let server = Server::start(None);
    let model = model();
    alice_served(&model, &server, "fleet");
    let patient = fleet_config(&server, "fleet").timeout(Duration::from_secs(10));
    let b = Engine::with_model(model.clone(), config(CacheMode::Tiered, Some(patient))).unwrap();
    let service = Service::spawn(b, ServiceConfig::default()).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let long = SamplingParams::greedy().max_tokens(200).ignore_eos(true);
        let chat = Chat::new(vec![Message::new("user", QUESTIONS[3])]);
        let mut decoder = service.chat(chat, long).await.unwrap();
        let token = async |d: &mut pensieve::service::TurnStream| loop {
            match d.next_event().await {
                Some(TurnEvent::Token { .. }) => return,
                Some(_) => {}
                None => panic!("the decoder ended"),
            }
        };
        token(&mut decoder).await;

        let stall = stall(&server, 3);
        let (resume, open) = {
            let (s1, s2) = (service.clone(), service.clone());
            let resume = tokio::spawn(async move { s1.resume("alice").await });
            (
                resume,
                tokio::spawn(async move { s2.open(tutor(Some("bob"))).await }),
            )
        };
        // Past the tokens already waiting in the stream, new ones keep coming.
        tokio::time::sleep(Duration::from_millis(50)).await;
        while decoder.next_event().now_or_never().is_some() {}
        for _ in 0..10 {
            token(&mut decoder).await;
        }
        assert!(!stall.is_finished(), "the decoder waited for Redis");
        stall.join().unwrap().unwrap();
        // Once Redis answers, the resume and the open do too.
        resume.await.unwrap().unwrap();
        open.await.unwrap().unwrap();
    });
}

#[test]
fn a_turn_waiting_in_the_queue_reads_its_history_ahead_from_redis() {
    let server = Server::start(None);
    let model = model();
    let want = stateless(&model, 2);
    alice_served(&model, &server, "fleet");
    // Small steps, so that a long prompt ahead of alice's turn keeps it waiting a while.
    let config =
        config(CacheMode::Tiered, Some(fleet_config(&server, "fleet"))).step_token_budget(64);
    let mut b = Engine::with_model(model.clone(), config).unwrap();
    let other = b.open(tutor(None)).unwrap();
    let long = QUESTIONS.repeat(40).join(" ");
    let params = SamplingParams::greedy().max_tokens(1);
    b.submit(other, Turn::user(long), params).unwrap();
    let c = b.resume("alice").unwrap();
    let (out, stats, _) = turn(&mut b, c, 1);
    assert_eq!(out, want[1]);
    assert!(b.stats().store.unwrap().chunks_prefetched > 0);
    assert!(stats.reused_from_host_tokens > 0, "{stats:?}");
    assert_eq!(stats.recomputed_tokens, 0, "{stats:?}");
}

/// Issue 22, case 5: two engines serve one conversation, one of them during a Redis write
/// stall. A's write times out and its turn is reported not stored; B, holding a copy from
/// before, serves a turn on it: the store keeps one line of turns, never a fork, and each
/// engine's next resume continues it. Then B serves a turn on a copy A has since moved past:
/// its write is refused as a conflict instead of overwriting A's turn.
#[test]
fn two_engines_writing_one_conversation_conflict_instead_of_forking() {
    let server = Server::start(None);
    let model = model();
    let mut a = alice_served(&model, &server, "fleet");
    let mut b = fleet_member(&model, &server, "fleet");
    let b_copy = b.resume("alice").unwrap();
    let a_copy = a.resume("alice").unwrap();

    let mut raw = server.raw().unwrap();
    // Writes held until told (ten minutes is never reached): A's write fails by its own
    // deadline, however long the turn before it took on a busy machine (a 3 s pause let a slow
    // turn's write land after it).
    let pause = |raw: &mut redis::Connection, what: &str| {
        let mut cmd = redis::cmd("CLIENT");
        match what {
            "pause" => cmd.arg("PAUSE").arg(600_000).arg("WRITE"),
            _ => cmd.arg("UNPAUSE"),
        };
        cmd.query::<()>(raw).unwrap();
    };
    pause(&mut raw, "pause");
    turn(&mut a, a_copy, 1);
    a.flush();
    match a.durability(a_copy).unwrap() {
        Durability::Failed(why) => assert!(
            matches!(why, StoreError::Redis { .. } | StoreError::BackingOff),
            "{why}"
        ),
        other => panic!("A's write should have timed out: {other:?}"),
    }
    pause(&mut raw, "unpause");
    turn(&mut b, b_copy, 2);
    b.flush();
    let b_stored = b.durability(b_copy).unwrap();
    assert!(
        matches!(b_stored, Durability::Durable | Durability::Conflict(_)),
        "{b_stored:?}"
    );
    // One line of turns: both engines resume the same state.
    let b_copy = b.resume("alice").unwrap();
    let a_copy = a.resume("alice").unwrap();
    assert_eq!(b.tokens(b_copy).unwrap(), a.tokens(a_copy).unwrap());

    // A moves on; B serves a turn on its copy from before that, without resuming.
    turn(&mut a, a_copy, 3);
    a.flush();
    assert_eq!(a.durability(a_copy).unwrap(), Durability::Durable);
    turn(&mut b, b_copy, 3);
    b.flush();
    match b.durability(b_copy).unwrap() {
        Durability::Conflict(why) => assert!(why.contains("another writer"), "{why}"),
        other => panic!("B's write should conflict with A's: {other:?}"),
    }
    let b_now = b.resume("alice").unwrap();
    assert_ne!(b_now, b_copy, "B kept its forked copy");
    assert_eq!(b.tokens(b_now).unwrap(), a.tokens(a_copy).unwrap());
    turn(&mut b, b_now, 0);
    b.flush();
    assert_eq!(b.durability(b_now).unwrap(), Durability::Durable);
    let a_next = a.resume("alice").unwrap();
    assert_eq!(a.tokens(a_next).unwrap(), b.tokens(b_now).unwrap());
}
