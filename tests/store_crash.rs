//! Crash safety of the store: a child process chats in four named conversations on the
//! real weights, saving after every turn, and is killed with SIGKILL at a random moment, over
//! and over (50 times, `PENSIEVE_CRASH_KILLS` to change). Each child resumes what the last one
//! left. Afterwards a new engine resumes every conversation: each one's next turn equals a
//! stateless recompute of its whole history (served from disk where files are whole, by
//! recompute where not), and no temporary file survives the start-up scan.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use pensieve::engine::{
    ConversationOptions, CostModel, CostProfile, Engine, EngineConfig, Event, SamplingParams,
    StoreConfig, Turn,
};
use pensieve::model::{Model, WeightFormat};
use rand::{Rng, SeedableRng};

const DIR_VAR: &str = "PENSIEVE_CRASH_DIR";
const NAMES: [&str; 4] = ["ada", "grace", "edsger", "barbara"];
const QUESTIONS: [&str; 4] = [
    "Tell me about rivers.",
    "Why is the sea salty?",
    "Name three birds.",
    "What is rain?",
];

fn engine(model: Arc<Model>, dir: &Path) -> Engine {
    let config = EngineConfig::default()
        .cost_profile(CostProfile::Fixed(CostModel::new(1e-3, 1e-6)))
        .store(StoreConfig::new(dir))
        .check_invariants(true);
    Engine::with_model(model, config).unwrap()
}

fn params(n: usize) -> SamplingParams {
    SamplingParams::greedy().max_tokens(n).ignore_eos(true)
}

/// The child's work: chat round-robin in the named conversations until killed (or 400
/// turns, should the parent be gone). Does nothing outside a child.
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var(DIR_VAR) else {
        return;
    };
    let model = Arc::new(common::real_model(WeightFormat::default()));
    let mut e = engine(model, Path::new(&dir));
    let convs: Vec<_> = NAMES
        .iter()
        .map(|n| match e.find(n) {
            Some(c) => c,
            None => e
                .open(ConversationOptions::default().name(n.to_string()))
                .unwrap(),
        })
        .collect();
    println!("ready");
    for k in 0..400 {
        // Two conversations at once, so saves of one overlap the other's steps.
        let pair = [convs[k % 4], convs[(k + 1) % 4]];
        for &c in &pair {
            let q = QUESTIONS[(k + c.as_u64() as usize) % QUESTIONS.len()];
            e.submit(c, Turn::user(q), params(4)).unwrap();
        }
        while e.has_work() {
            e.step().unwrap();
        }
    }
}

#[test]
fn killed_at_random_moments_while_saving_every_conversation_resumes_correctly() {
    if std::env::var(DIR_VAR).is_ok() {
        return;
    }
    let kills: usize = std::env::var("PENSIEVE_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for _ in 0..kills {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "crash_child",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(DIR_VAR, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.contains("ready") {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "the child ended early"
            );
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(0..700)));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    let model = Arc::new(common::real_model(WeightFormat::default()));
    let mut e = engine(model.clone(), dir.path());
    // The store's folder of this model (beside it, the names' registrations).
    let chunks = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path().join("chunks"))
        .find(|p| p.is_dir())
        .unwrap();
    let debris = std::fs::read_dir(chunks)
        .unwrap()
        .filter(|f| f.as_ref().unwrap().path().extension().unwrap() != "kvc")
        .count();
    assert_eq!(debris, 0, "temporary files survived the start-up scan");
    let stored = e.named_conversations();
    assert!(!stored.is_empty(), "no conversation was ever stored");
    let mut reference = Engine::with_model(
        model,
        EngineConfig::default().mode(pensieve::engine::CacheMode::Stateless),
    )
    .unwrap();
    let mut from_store = 0;
    for (name, c) in stored {
        let (_, stats) = e
            .run_turn(c, Turn::user("And then?"), params(6), |_| {})
            .unwrap();
        from_store += stats.reused_from_store_tokens;
        let tokens = e.tokens(c).unwrap().to_vec();
        let (prompt, got) = tokens.split_at(tokens.len() - stats.output_tokens);
        let r = reference.open(ConversationOptions::default()).unwrap();
        reference
            .submit(r, Turn::Tokens(prompt.to_vec()), params(got.len()))
            .unwrap();
        let mut want = Vec::new();
        while reference.has_work() {
            for ev in reference.step().unwrap() {
                if let Event::Token { token, .. } = ev {
                    want.push(token);
                }
            }
        }
        assert_eq!(got, want, "{name} after {kills} kills: {stats:?}");
    }
    assert!(from_store > 0, "nothing was resumed from store");
}
