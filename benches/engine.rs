//! One engine `step()` on the real SmolLM2 weights: a mixed batch (one conversation's new
//! 128-token turn prefilled beside 7 decoding conversations) and a decode-only batch of 8.
//! Only `step()` is timed; submitting and replacing conversations happens between steps.
//!
//! ```text
//! scripts/fetch-assets && cargo bench --bench engine
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use pensieve::engine::{
    Budgets, ConversationId, ConversationOptions, CostModel, CostProfile, Engine, EngineConfig,
    SamplingParams, Turn,
};
use pensieve::model::{LoadOptions, Model, ModelSource};

const DECODERS: usize = 7;
const HISTORY: usize = 512;
const NEW_TURN: usize = 128;

/// Ordinary vocabulary ids (SmolLM2's special tokens sit below 17).
fn tokens(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| 100 + ((i + salt * 131) as u32 * 7919) % 40_000)
        .collect()
}

fn long_reply() -> SamplingParams {
    SamplingParams::greedy().max_tokens(4096).ignore_eos(true)
}

/// An engine with `n` conversations that have `HISTORY` tokens of KV and are decoding.
fn engine_with_decoders(model: &Arc<Model>, n: usize) -> (Engine, Vec<ConversationId>) {
    let config = EngineConfig::default()
        .budgets(Budgets::default().device_tokens(8 * 1024))
        .cost_profile(CostProfile::Fixed(CostModel::new(1e-4, 1e-8)));
    let mut engine = Engine::with_model(model.clone(), config).unwrap();
    let convs: Vec<ConversationId> = (0..n)
        .map(|i| {
            let c = engine.open(ConversationOptions::default()).unwrap();
            engine
                .submit(c, Turn::Tokens(tokens(HISTORY, i)), long_reply())
                .unwrap();
            c
        })
        .collect();
    // Run until every prompt is prefilled and all are decoding.
    let mut started = std::collections::HashSet::new();
    while started.len() < n {
        for event in engine.step().unwrap() {
            if let pensieve::engine::Event::Token { conversation, .. } = event {
                started.insert(conversation);
            }
        }
    }
    (engine, convs)
}

fn bench(c: &mut Criterion) {
    let model = match Model::load(&ModelSource::Default, &LoadOptions::default()) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            eprintln!("engine bench skipped: {e}");
            return;
        }
    };
    let mut group = c.benchmark_group("engine_step");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(20));

    group.bench_function("decode_8", |b| {
        let (mut engine, _) = engine_with_decoders(&model, DECODERS + 1);
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                engine.step().unwrap();
            }
            start.elapsed()
        })
    });

    group.bench_function("mixed_128_prefill+7_decode", |b| {
        let (mut engine, _) = engine_with_decoders(&model, DECODERS);
        let mut target = engine.open(ConversationOptions::default()).unwrap();
        let mut salt = 0;
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                // Keep the prefilling conversation's history bounded so that every step
                // does the same work.
                if engine.tokens(target).unwrap().len() > 2048 {
                    engine.close(target).unwrap();
                    target = engine.open(ConversationOptions::default()).unwrap();
                }
                salt += 1;
                let one = SamplingParams::greedy().max_tokens(1);
                engine
                    .submit(target, Turn::Tokens(tokens(NEW_TURN, salt)), one)
                    .unwrap();
                let start = Instant::now();
                engine.step().unwrap();
                timed += start.elapsed();
            }
            timed
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
