//! `pensieve::service` on the real SmolLM2 weights: many async clients at once (chats resent
//! whole, turns of opened conversations, streams dropped mid-turn, named conversations
//! detached and resumed, closes), every reply checked against a stateless recompute; a
//! dropped stream frees what its turn held; the engine thread sleeps when there is no work.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use pensieve::engine::{
    Budgets, CacheMode, ConversationId, ConversationOptions, Engine, EngineConfig, FinishReason,
    SamplingParams, StoreConfig, Turn,
};
use pensieve::model::{Message, Model, WeightFormat};
use pensieve::service::{Chat, Reply, Service, ServiceConfig, TurnEvent};

mod common;

fn model() -> Arc<Model> {
    Arc::new(common::real_model(WeightFormat::default()))
}

fn params(n: usize) -> SamplingParams {
    SamplingParams::greedy().max_tokens(n).ignore_eos(true)
}

/// A device pool small enough that eight clients' KV moves between the tiers.
fn engine(model: &Arc<Model>, store: &std::path::Path) -> Engine {
    let chunk = common::chunk_bytes(model);
    let config = EngineConfig::default()
        .budgets(
            Budgets::default()
                .device_tokens(1024)
                .host_bytes(24 * chunk),
        )
        .mode(CacheMode::Tiered)
        .check_invariants(true)
        .store(StoreConfig::new(store));
    Engine::with_model(model.clone(), config).unwrap()
}

/// The reply is what greedy decoding over the whole history gives, token by token, and the
/// conversation's history ends with it (less the tokens of a character cut at the end).
async fn check(service: &Service, conv: ConversationId, reply: &Reply) {
    assert_eq!(reply.end.reason, FinishReason::Length, "{:?}", reply.end);
    let history = service.tokens(conv).await.unwrap();
    assert_eq!(history.len(), reply.end.history_tokens);
    let n = reply.tokens.len();
    let kept = (n.saturating_sub(3)..=n)
        .rev()
        .find(|&k| history.ends_with(&reply.tokens[..k]))
        .unwrap_or_else(|| panic!("{conv}: the history does not end with the reply"));
    let logits = common::score_all(service.model(), &history);
    let start = history.len() - kept;
    for (i, &token) in reply.tokens[..kept].iter().enumerate() {
        assert_eq!(
            common::argmax(&logits[start + i - 1]),
            token,
            "{conv} position {}",
            start + i
        );
    }
}

const QUESTIONS: [&str; 6] = [
    "What is the capital of France?",
    "Name three colours.",
    "Why is the sky blue?",
    "Count to five.",
    "What do bees make?",
    "Say something kind.",
];

/// A client resending its whole history each turn: the service continues its conversation.
async fn resending_client(service: Service, k: usize) {
    let mut messages = vec![Message::new("system", format!("You are assistant {k}."))];
    let mut conv = None;
    for t in 0..3 {
        messages.push(Message::new("user", QUESTIONS[(k + t) % QUESTIONS.len()]));
        let turn = service
            .chat(Chat::new(messages.clone()), params(6))
            .await
            .unwrap();
        let c = turn.conversation();
        assert!(
            conv.is_none_or(|old| old == c),
            "a resent history continues"
        );
        conv = Some(c);
        let reply = turn.reply().await.unwrap();
        if t > 0 {
            assert!(
                reply.end.stats.reused_tokens > 0,
                "turn {t}: {:?}",
                reply.end
            );
        }
        check(&service, c, &reply).await;
        messages.push(Message::new("assistant", reply.text));
    }
}

/// A client of an opened conversation that drops one turn's stream after its first token and
/// cancels another (neither leaves a trace), then closes the conversation.
async fn dropping_client(service: Service, k: usize) {
    let conv = service.open(ConversationOptions::default()).await.unwrap();
    for t in 0..3 {
        let question = QUESTIONS[(k + 2 * t) % QUESTIONS.len()];
        let before = messages(&service, conv).await;
        if t >= 1 {
            let mut turn = service
                .submit(conv, Turn::user(question), params(64))
                .await
                .unwrap();
            assert!(matches!(
                turn.next_event().await,
                Some(TurnEvent::Token { .. })
            ));
            // Turn 1's stream is dropped; turn 2's turn is cancelled.
            if t == 2 {
                let request = turn.request();
                service.cancel(request).await.unwrap();
                let cancelled = turn.reply().await.unwrap();
                assert_eq!(cancelled.end.reason, FinishReason::Cancelled);
                assert!(
                    service.cancel(request).await.is_err(),
                    "an ended turn is not cancelled again"
                );
            }
        }
        // A turn is refused while the cancelled one still runs: retry, as a client would.
        let turn = loop {
            match service.submit(conv, Turn::user(question), params(6)).await {
                Err(pensieve::Error::ConversationBusy(_)) => {
                    tokio::time::sleep(Duration::from_millis(5)).await
                }
                other => break other.unwrap(),
            }
        };
        let reply = turn.reply().await.unwrap();
        // A cancelled turn leaves no trace: this turn's exchange is all that was added.
        assert_eq!(messages(&service, conv).await, before + 2);
        check(&service, conv, &reply).await;
    }
    service.close(conv).await.unwrap();
    assert!(service.close(conv).await.is_err(), "closed once");
}

/// A named conversation detached after each turn and resumed from the store for the next.
async fn resuming_client(service: Service, k: usize) {
    let name = format!("client-{k}");
    let mut conv = service
        .open(ConversationOptions::default().name(name.clone()))
        .await
        .unwrap();
    for t in 0..3 {
        let question = QUESTIONS[(k + t) % QUESTIONS.len()];
        let reply = service
            .submit(conv, Turn::user(question), params(6))
            .await
            .unwrap()
            .reply()
            .await
            .unwrap();
        check(&service, conv, &reply).await;
        // The stream ended once the turn was durable: the store has it now.
        service.detach(conv).await.unwrap();
        conv = service.resume(&name).await.unwrap();
        assert_eq!(tokens(&service, conv).await.len(), reply.end.history_tokens);
    }
    // A fork shares the history; named, the store keeps it under its own name.
    let fork = service.fork(conv, None).await.unwrap();
    assert_eq!(tokens(&service, fork).await, tokens(&service, conv).await);
    let forked = format!("{name}-fork");
    service.name(fork, forked.clone()).await.unwrap();
    wait(|| async {
        service
            .stored_conversations()
            .await
            .unwrap()
            .contains(&forked)
    })
    .await;
    service.close(fork).await.unwrap();
    service.close(conv).await.unwrap();
    assert!(service.resume(&name).await.is_err(), "closing deletes it");
}

async fn messages(service: &Service, conv: ConversationId) -> usize {
    service.messages(conv).await.unwrap().len()
}

async fn tokens(service: &Service, conv: ConversationId) -> Vec<u32> {
    service.tokens(conv).await.unwrap()
}

async fn wait<F: std::future::Future<Output = bool>>(mut done: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done().await {
        assert!(Instant::now() < deadline, "timed out");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_many_async_clients_get_the_stateless_greedy_replies() {
    let store = tempfile::tempdir().unwrap();
    let model = model();
    let service = Service::spawn(engine(&model, store.path()), ServiceConfig::default()).unwrap();
    let mut clients = Vec::new();
    for k in 0..9 {
        let s = service.clone();
        clients.push(match k % 3 {
            0 => tokio::spawn(resending_client(s, k)),
            1 => tokio::spawn(dropping_client(s, k)),
            _ => tokio::spawn(resuming_client(s, k)),
        });
    }
    for c in clients {
        c.await.unwrap();
    }
    let stats = service.stats();
    assert_eq!(stats.in_flight, 0);
    assert!(
        stats.engine.reused_host_tokens + stats.engine.recomputed_tokens > 0,
        "{stats:?}"
    );
    service.shutdown().unwrap();
    assert!(matches!(
        service.open(ConversationOptions::default()).await,
        Err(pensieve::Error::ServiceStopped)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_a_dropped_stream_frees_its_reservation_and_the_engine_thread_sleeps() {
    let store = tempfile::tempdir().unwrap();
    let model = model();
    let config = ServiceConfig::default().thread_name("idle-engine-test");
    let service = Service::spawn(engine(&model, store.path()), config).unwrap();
    let conv = service.open(ConversationOptions::default()).await.unwrap();
    let slots = || async {
        let s = service.with_engine(|e| e.stats()).await.unwrap();
        (s.device_slots_used, s.requests_running + s.requests_waiting)
    };
    let (idle, _) = slots().await;
    let mut turn = service
        .submit(conv, Turn::user(QUESTIONS[0]), params(400))
        .await
        .unwrap();
    assert!(matches!(
        turn.next_event().await,
        Some(TurnEvent::Token { .. })
    ));
    let (running, n) = slots().await;
    assert!(
        running > idle && n == 1,
        "{idle} -> {running} slots, {n} turns"
    );
    drop(turn);
    wait(|| async { slots().await == (idle, 0) && service.in_flight() == 0 }).await;

    // Idle: the engine thread waits for a command; it must not spin.
    let cpu = || engine_thread_ticks("idle-engine-tes");
    let before = cpu();
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu() - before;
    assert!(
        used <= 2,
        "the idle engine thread used {used} ticks in a second"
    );
    service.shutdown().unwrap();
}

/// CPU ticks (user and system) of this process's thread named `comm` (15 bytes at most).
fn engine_thread_ticks(comm: &str) -> u64 {
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = task.unwrap().path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if name.trim_end() != comm {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).unwrap();
        // Fields after the parenthesised name: state is the 3rd field; utime and stime the
        // 14th and 15th.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let fields: Vec<&str> = rest.split(' ').collect();
        return fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    }
    panic!("no thread named {comm}");
}
