//! KV shared by content on the real SmolLM2 weights: conversations that open with the same long
//! system prompt find its chunks, stored by the first one, in the content-addressed disk tier,
//! and read them instead of prefilling them; each chunk is stored once, and every
//! conversation's outputs equal those of a `Stateless` engine.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use pensieve::engine::{
    Budgets, CacheMode, ConversationId, ConversationOptions, CostModel, CostProfile, DiskConfig,
    Engine, EngineConfig, Event, SamplingParams, Turn, TurnStats,
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
    let config = EngineConfig {
        mode,
        budgets: Budgets {
            device_tokens: 2048,
            device_bytes: None,
            host_bytes: 1 << 30,
        },
        cost_profile: CostProfile::Fixed(CostModel {
            per_token_s: 1e-3,
            per_token_per_position_s: 1e-6,
        }),
        disk: dir.map(DiskConfig::new),
        check_invariants: true,
        ..EngineConfig::default()
    };
    Engine::with_model(model.clone(), config).unwrap()
}

/// Runs one turn of each of `convs` together (question `i` for conversation `i`).
fn turns(e: &mut Engine, convs: &[(usize, ConversationId)]) -> Vec<(Vec<u32>, TurnStats)> {
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy().with_max_tokens(8)
    };
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
            }
        }
    }
    out
}

fn open(e: &mut Engine) -> ConversationId {
    e.open(ConversationOptions {
        system: Some(SYSTEM.into()),
        ..ConversationOptions::default()
    })
    .unwrap()
}

#[test]
fn conversations_with_one_system_prompt_store_it_once_and_share_it() {
    let model = Arc::new(common::real_model(WeightFormat::default()));
    let mut fresh = engine(&model, CacheMode::Stateless, None);
    let refs: Vec<(usize, ConversationId)> = (0..4).map(|i| (i, open(&mut fresh))).collect();
    let mut want = turns(&mut fresh, &refs[..1]);
    want.extend(turns(&mut fresh, &refs[1..]));

    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(&model, CacheMode::Tiered, Some(dir.path()));
    let convs: Vec<(usize, ConversationId)> = (0..4).map(|i| (i, open(&mut e))).collect();
    // The first conversation stores its chunks; the other three then start.
    let mut got = turns(&mut e, &convs[..1]);
    got.extend(turns(&mut e, &convs[1..]));
    for (i, ((out, stats), (want, _))) in got.iter().zip(&want).enumerate() {
        assert_eq!(out, want, "conversation {i}: {stats:?}");
    }
    let chunk = e.config().chunk_size;
    let system_chunks = model.encode(SYSTEM).unwrap().len() / chunk;
    assert!(system_chunks >= 2);
    assert_eq!(got[0].1.reused_tokens, 0);
    for (out, stats) in &got[1..] {
        assert!(!out.is_empty());
        // The system prompt's full chunks were read, not prefilled.
        assert!(
            stats.reused_from_disk_tokens >= system_chunks * chunk,
            "{stats:?}"
        );
    }
    let s = e.stats();
    assert!(
        s.shared_tokens as usize >= 3 * system_chunks * chunk,
        "{s:?}"
    );
    e.flush();
    // Every chunk's content is stored once: the files are the distinct addresses of every
    // conversation's saved chunks, fewer than the chunks the conversations hold.
    let mut all = 0;
    let mut distinct = HashSet::new();
    for &(_, c) in &convs {
        // The last reply token has no KV yet: the rest is saved, the last chunk partial.
        let tokens = e.tokens(c).unwrap();
        let saved = Address::of_chunks(&tokens[..tokens.len() - 1], chunk);
        all += saved.len();
        distinct.extend(saved);
    }
    let files = walk(dir.path());
    assert_eq!(files, distinct.len());
    assert!(
        files + 3 * system_chunks <= all,
        "{files} files for {all} chunks"
    );
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

    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(&model, CacheMode::Tiered, Some(dir.path()));
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
    // Every full chunk of the forked history came from the source's files.
    assert!(
        got[0].1.reused_from_disk_tokens >= history / chunk * chunk,
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
    assert!(matches!(
        e.fork(ConversationId(999), None),
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
