//! KV shared by content on the real SmolLM2 weights: conversations that open with the same long
//! system prompt find its chunks, computed by the first one, in memory (one more reference to
//! its blocks) or in the content-addressed store tier, instead of prefilling them; each chunk is
//! stored once, shared chunks move between tiers under pressure, and every conversation's
//! outputs equal those of a `Stateless` engine.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use pensieve::engine::{
    Budgets, CacheMode, ConversationId, ConversationOptions, CostModel, CostProfile, Engine,
    EngineConfig, Event, SamplingParams, StoreConfig, Turn, TurnStats,
};
use pensieve::kv::Address;
use pensieve::model::{Model, WeightFormat};

const SYSTEM: &str = "You are a patient tutor for a class of curious twelve-year-olds. \
    Explain every idea with one everyday example, avoid jargon, keep answers under three \
    sentences, and end with a short question that checks understanding. If a question is \
    unclear, ask for what is missing instead of guessing. Never invent facts; say when you \
    are not sure. Use metric units. Be warm, but do not flatter, and do not repeat the \
    question back before answering it.";

const QUESTIONS: [&str; 4] = [
    "Why do we have seasons?",
    "What makes a rainbow?",
    "How do plants drink water?",
    "Why does ice float?",
];

fn engine(model: &Arc<Model>, mode: CacheMode, dir: Option<&std::path::Path>) -> Engine {
    sized(model, mode, dir, 2048, 1 << 30)
}

fn sized(
    model: &Arc<Model>,
    mode: CacheMode,
    dir: Option<&std::path::Path>,
    device_tokens: usize,
    host_bytes: usize,
) -> Engine {
    let config = EngineConfig::default()
        .mode(mode)
        .budgets(
            Budgets::default()
                .device_tokens(device_tokens)
                .host_bytes(host_bytes),
        )
        .cost_profile(CostProfile::Fixed(CostModel::new(1e-3, 1e-6)))
        .store(dir.map(StoreConfig::new))
        .check_invariants(true);
    Engine::with_model(model.clone(), config).unwrap()
}

/// Runs one turn of each of `convs` together (question `i` for conversation `i`).
fn turns(e: &mut Engine, convs: &[(usize, ConversationId)]) -> Vec<(Vec<u32>, TurnStats)> {
    let params = SamplingParams::greedy().max_tokens(8).ignore_eos(true);
    let ids: Vec<_> = convs
        .iter()
        .map(|&(i, c)| {
            e.submit(c, Turn::user(QUESTIONS[i]), params.clone())
                .unwrap()
        })
        .collect();
    let mut out = vec![(Vec::new(), TurnStats::default()); convs.len()];
    while e.has_work() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { request, token, .. } => {
                    let k = ids.iter().position(|&r| r == request).unwrap();
                    out[k].0.push(token);
                }
                Event::Finished { request, stats, .. } => {
                    let k = ids.iter().position(|&r| r == request).unwrap();
                    out[k].1 = stats;
                }
                other => panic!("unexpected event {other:?}"),
            }
        }
    }
    out
}

fn open(e: &mut Engine) -> ConversationId {
    e.open(ConversationOptions::default().system(SYSTEM))
        .unwrap()
}

/// Addresses of the chunks holding `c`'s KV: its history but the last reply token (which has
/// no KV yet).
fn chunks_of(e: &Engine, c: ConversationId) -> Vec<Address> {
    let tokens = e.tokens(c).unwrap();
    Address::of_chunks(&tokens[..tokens.len() - 1], e.config().chunk_size)
}

/// Stateless outputs of one conversation's question 0, then three others' together.
fn stateless_four(model: &Arc<Model>) -> Vec<(Vec<u32>, TurnStats)> {
    let mut fresh = engine(model, CacheMode::Stateless, None);
    let refs: Vec<(usize, ConversationId)> = (0..4).map(|i| (i, open(&mut fresh))).collect();
    let mut want = turns(&mut fresh, &refs[..1]);
    want.extend(turns(&mut fresh, &refs[1..]));
    want
}

#[test]
fn conversations_with_one_system_prompt_hold_it_once_in_memory() {
    let model = Arc::new(common::real_model(WeightFormat::default()));
    let want = stateless_four(&model);
    let mut e = engine(&model, CacheMode::Tiered, None);
    let convs: Vec<(usize, ConversationId)> = (0..4).map(|i| (i, open(&mut e))).collect();
    let mut got = turns(&mut e, &convs[..1]);
    got.extend(turns(&mut e, &convs[1..]));
    for (i, ((out, stats), (want, _))) in got.iter().zip(&want).enumerate() {
        assert_eq!(out, want, "conversation {i}: {stats:?}");
    }
    let chunk = e.config().chunk_size;
    let system_chunks = model.encode(SYSTEM).unwrap().len() / chunk;
    assert!(system_chunks >= 2);
    for (_, stats) in &got[1..] {
        // The system prompt's full chunks were found on the device, not prefilled.
        assert!(stats.reused_tokens >= system_chunks * chunk, "{stats:?}");
        assert!(stats.prefilled_tokens + system_chunks * chunk <= stats.prompt_tokens);
    }
    // The device holds each distinct chunk once.
    let mut all = 0;
    let mut distinct = HashSet::new();
    for &(_, c) in &convs {
        let chunks = chunks_of(&e, c);
        all += chunks.len();
        distinct.extend(chunks);
    }
    let s = e.stats();
    assert!(
        s.shared_tokens as usize >= 3 * system_chunks * chunk,
        "{s:?}"
    );
    assert_eq!(s.device_slots_used, distinct.len() * chunk, "{s:?}");
    assert!(distinct.len() + 3 * system_chunks <= all);
    assert!(s.shared_bytes_saved > 0, "{s:?}");
    // A closed holder leaves the others theirs.
    e.close(convs[0].1).unwrap();
    assert!(e.stats().device_slots_used < s.device_slots_used);
    let again = turns(&mut e, &convs[1..2]);
    assert!(
        again[0].1.reused_tokens >= again[0].1.prompt_tokens.min(1),
        "{:?}",
        again[0].1
    );
    e.check_invariants().unwrap();
}

#[test]
fn conversations_with_one_system_prompt_store_it_once_on_store() {
    let model = Arc::new(common::real_model(WeightFormat::default()));
    let want = stateless_four(&model);
    let dir = tempfile::tempdir().unwrap();
    // The first conversation (named, so that its files outlive its engine) runs on one
    // engine, which saves its chunks; the other three run on a second engine over the same
    // folder, which has nothing in memory.
    let mut first = engine(&model, CacheMode::Tiered, Some(dir.path()));
    let c0 = first
        .open(ConversationOptions::default().system(SYSTEM).name("first"))
        .unwrap();
    let mut got = turns(&mut first, &[(0, c0)]);
    first.flush();
    let first_chunks = chunks_of(&first, c0);
    drop(first);
    let mut e = engine(&model, CacheMode::Tiered, Some(dir.path()));
    let convs: Vec<(usize, ConversationId)> = (1..4).map(|i| (i, open(&mut e))).collect();
    got.extend(turns(&mut e, &convs));
    for (i, ((out, stats), (want, _))) in got.iter().zip(&want).enumerate() {
        assert_eq!(out, want, "conversation {i}: {stats:?}");
    }
    let chunk = e.config().chunk_size;
    let system_chunks = model.encode(SYSTEM).unwrap().len() / chunk;
    for (_, stats) in &got[1..] {
        // The system prompt's full chunks were read, not prefilled.
        assert!(
            stats.reused_from_store_tokens + stats.reused_tokens >= system_chunks * chunk,
            "{stats:?}"
        );
    }
    assert!(got[1..]
        .iter()
        .any(|(_, s)| s.reused_from_store_tokens >= system_chunks * chunk));
    assert!(e.stats().shared_tokens as usize >= 3 * system_chunks * chunk);
    e.flush();
    // Every chunk's content is stored once: the files are the distinct addresses of every
    // conversation's saved chunks, fewer than the chunks the conversations hold.
    let mut all = first_chunks.len();
    let mut distinct: HashSet<Address> = first_chunks.into_iter().collect();
    for &(_, c) in &convs {
        let chunks = chunks_of(&e, c);
        all += chunks.len();
        distinct.extend(chunks);
    }
    let files = walk(dir.path());
    assert_eq!(files, distinct.len());
    assert!(
        files + 3 * system_chunks <= all,
        "{files} files for {all} chunks"
    );
}

#[test]
fn turns_queued_together_share_what_the_first_computed() {
    let model = Arc::new(common::real_model(WeightFormat::default()));
    let want = stateless_four(&model);
    // A step runs at most 128 tokens: the first turn's prefill fills it, the others wait and
    // are looked up again before they are admitted.
    let config = engine(&model, CacheMode::Tiered, None)
        .config()
        .clone()
        .step_token_budget(128);
    let mut e = Engine::with_model(model.clone(), config).unwrap();
    let convs: Vec<(usize, ConversationId)> = (0..4).map(|i| (i, open(&mut e))).collect();
    let got = turns(&mut e, &convs);
    for (i, ((out, stats), (want, _))) in got.iter().zip(&want).enumerate() {
        assert_eq!(out, want, "conversation {i}: {stats:?}");
    }
    let chunk = e.config().chunk_size;
    let system_chunks = model.encode(SYSTEM).unwrap().len() / chunk;
    // The two not admitted with the first share its system prompt.
    let sharing = got
        .iter()
        .filter(|(_, s)| s.reused_tokens >= system_chunks * chunk);
    assert!(sharing.count() >= 2, "{got:?}");
    assert!(e.stats().shared_tokens as usize >= 2 * system_chunks * chunk);
}

#[test]
fn shared_chunks_move_between_tiers_under_pressure_and_outputs_stay_equal() {
    let model = Arc::new(common::real_model(WeightFormat::default()));
    // Six conversations, three turns each, two at a time: the device holds about two
    // conversations, the host a few chunks, so shared chunks are swapped, dropped and
    // brought back while other holders wait.
    let schedule: Vec<[usize; 2]> = (0..3).flat_map(|_| [[0, 1], [2, 3], [4, 5]]).collect();
    let run = |e: &mut Engine| {
        let convs: Vec<ConversationId> = (0..6).map(|_| open(e)).collect();
        let mut outs = vec![Vec::new(); 6];
        for (step, pair) in schedule.iter().enumerate() {
            let q = step / 3;
            let got = turns(e, &[(q, convs[pair[0]]), (q + 1, convs[pair[1]])]);
            for (k, (out, _)) in pair.iter().zip(got) {
                outs[*k].push(out);
            }
        }
        outs
    };
    let want = run(&mut engine(&model, CacheMode::Stateless, None));
    let kv = model
        .config()
        .kv_shape()
        .token_bytes(EngineConfig::default().kv_precision);
    let mut e = sized(&model, CacheMode::Tiered, None, 512, 8 * 32 * kv);
    let got = run(&mut e);
    assert_eq!(got, want);
    let s = e.stats();
    assert!(s.shared_tokens > 0, "{s:?}");
    assert!(s.bytes_swapped_out > 0 && s.bytes_swapped_in > 0, "{s:?}");
    assert!(
        s.chunks_dropped_from_host + s.chunks_dropped_from_device > 0,
        "{s:?}"
    );
    e.check_invariants().unwrap();
}

#[test]
fn a_fork_after_turn_two_reads_turns_one_and_two_and_equals_stateless_of_its_history() {
    let model = Arc::new(common::real_model(WeightFormat::default()));
    // Stateless reference of the forked history: turns 1 and 2, then the fork's own turn.
    let mut fresh = engine(&model, CacheMode::Stateless, None);
    let r = open(&mut fresh);
    turns(&mut fresh, &[(0, r)]);
    turns(&mut fresh, &[(1, r)]);
    let want = turns(&mut fresh, &[(3, r)]);

    let mut e = engine(&model, CacheMode::Tiered, None);
    let a = open(&mut e);
    for q in 0..3 {
        turns(&mut e, &[(q, a)]);
    }
    let f = e.fork(a, Some(2)).unwrap();
    let history = e.tokens(f).unwrap().len();
    // The fork holds turns 1 and 2 as the model saw them: a prefix of the reference's history.
    assert!(fresh.tokens(r).unwrap().starts_with(e.tokens(f).unwrap()));
    let got = turns(&mut e, &[(3, f)]);
    assert_eq!(got[0].0, want[0].0, "{:?}", got[0].1);
    let chunk = e.config().chunk_size;
    // Every full chunk of the forked history is the source's, shared on the device.
    assert!(
        got[0].1.reused_tokens >= history / chunk * chunk,
        "{:?}",
        got[0].1
    );
    assert!(
        got[0].1.prefilled_tokens < chunk + got[0].1.prompt_tokens,
        "{:?}",
        got[0].1
    );
    // The source goes on unchanged.
    let before = e.tokens(a).unwrap().len();
    turns(&mut e, &[(2, a)]);
    assert!(e.tokens(a).unwrap().len() > before);
    let gone = open(&mut e);
    e.close(gone).unwrap();
    assert!(matches!(
        e.fork(gone, None),
        Err(pensieve::Error::UnknownConversation(_))
    ));
}

/// Chunk files under `dir`.
fn walk(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            if p.is_dir() {
                walk(&p)
            } else {
                usize::from(p.extension().is_some_and(|x| x == "kvc"))
            }
        })
        .sum()
}
