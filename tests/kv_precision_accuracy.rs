//! What KV in 8 and 4 bits costs in accuracy, against what llama.cpp's own quantized cache
//! costs on the same file and text: the perplexity of the 100 held-back ShareGPT replies of the
//! model tests with f16, Q8 and Q4 KV, on SmolLM2-135M-Instruct Q4_1 and Gemma 3 270M Q4_K_M;
//! the rise over f16 at Q8 and Q4 may be no larger than llama.cpp's with `q8_0` and `q4_0`
//! (`tests/fixtures/llamacpp/kv-precision.json`, written by `scripts/reference/llamacpp-kv`)
//! by more than [`SLACK`]. Greedy agreement with f16 KV over the same prompts is reported.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::llamacpp;
use pensieve::engine::{
    CacheMode, ConversationOptions, Engine, EngineConfig, Event, KvPrecision, SamplingParams, Turn,
};
use pensieve::model::{LoadOptions, Model, ModelSource, WeightFormat};
use serde_json::Value;

/// How much more the perplexity may rise over f16 than llama.cpp's does with the same cache
/// type: the two engines' K and V differ in their last bits before they are quantized (their
/// matmuls round differently), so their rises differ by noise of this order (measured: see the
/// output and docs/BENCHMARKS.md).
const SLACK: f64 = 0.005;

/// Tokens each prompt is continued greedily for the agreement report.
const GREEDY_TOKENS: usize = 16;

#[test]
fn smollm2_quantized_kv_loses_no_more_than_llama_cpps() {
    let fx = llamacpp::fixture("kv-precision.json");
    let entry = &fx["models"]["smollm2"];
    let replies = entry["replies"].as_array().unwrap();
    let model = Arc::new(common::real_model(WeightFormat::default()));
    compare("SmolLM2-135M", &model, replies, &entry["perplexity"]);
}

#[test]
fn gemma3_quantized_kv_loses_no_more_than_llama_cpps() {
    let fx = llamacpp::fixture("kv-precision.json");
    let entry = &fx["models"]["gemma3-270m"];
    let replies = llamacpp::fixture("gemma3-270m.json")["perplexity"]["replies"].clone();
    let source = ModelSource::Gguf(llamacpp::gemma_path());
    let model = Arc::new(Model::load(&source, &LoadOptions::default()).unwrap());
    compare(
        "Gemma 3 270M",
        &model,
        replies.as_array().unwrap(),
        &entry["perplexity"],
    );
}

fn compare(name: &str, model: &Arc<Model>, replies: &[Value], theirs: &Value) {
    assert_eq!(replies.len(), 100);
    let ppl = |kv| llamacpp::perplexity(&llamacpp::reply_nlls(model, replies, kv));
    let base = ppl(KvPrecision::F16);
    let their_base = theirs["f16"].as_f64().unwrap();
    let prompts: Vec<Vec<u32>> = replies
        .iter()
        .map(|r| llamacpp::ids(&r["context"]))
        .collect();
    let f16_greedy = greedy(model, &prompts, KvPrecision::F16);
    println!("{name}: perplexity with f16 KV {base:.4} (llama.cpp {their_base:.4})");
    for (kv, cache) in [(KvPrecision::Q8, "q8_0"), (KvPrecision::Q4, "q4_0")] {
        let ours = ppl(kv);
        let (rise, their_rise) = (
            ours / base - 1.0,
            theirs[cache].as_f64().unwrap() / their_base - 1.0,
        );
        let agree = agreement(&f16_greedy, &greedy(model, &prompts, kv));
        println!(
            "{name}: {kv:?} KV perplexity {ours:.4} ({:+.3}%; llama.cpp's {cache} {:+.3}%); \
             greedy continuations equal to f16 KV's: {:.1}% of tokens, {} of {} whole",
            100.0 * rise,
            100.0 * their_rise,
            100.0 * agree.0,
            agree.1,
            prompts.len()
        );
        assert!(
            rise <= their_rise.max(0.0) + SLACK,
            "{name}, {kv:?}: perplexity rises {rise:.4} over f16, llama.cpp's {cache} {their_rise:.4}"
        );
    }
}

/// Each prompt continued greedily for [`GREEDY_TOKENS`] tokens, all in one engine at `kv`.
fn greedy(model: &Arc<Model>, prompts: &[Vec<u32>], kv: KvPrecision) -> Vec<Vec<u32>> {
    let config = EngineConfig::default()
        .mode(CacheMode::Stateless)
        .kv_precision(kv);
    let mut e = Engine::with_model(model.clone(), config).unwrap();
    let params = SamplingParams::greedy()
        .max_tokens(GREEDY_TOKENS)
        .ignore_eos(true);
    let convs: Vec<_> = prompts
        .iter()
        .map(|p| {
            let c = e.open(ConversationOptions::default()).unwrap();
            e.submit(c, Turn::Tokens(p.clone()), params.clone())
                .unwrap();
            c
        })
        .collect();
    while e.has_work() {
        for ev in e.step().unwrap() {
            if let Event::Finished { reason, .. } = ev {
                assert_eq!(reason, pensieve::engine::FinishReason::Length);
            }
        }
    }
    convs
        .iter()
        .zip(prompts)
        .map(|(&c, p)| e.tokens(c).unwrap()[p.len()..].to_vec())
        .collect()
}

/// The share of tokens each continuation of `b` agrees with `a` on before they part, and how
/// many agree whole.
fn agreement(a: &[Vec<u32>], b: &[Vec<u32>]) -> (f64, usize) {
    let same = |x: &[u32], y: &[u32]| x.iter().zip(y).take_while(|(p, q)| p == q).count();
    let tokens: usize = a.iter().zip(b).map(|(x, y)| same(x, y)).sum();
    let whole = a.iter().zip(b).filter(|(x, y)| x == y).count();
    (tokens as f64 / (a.len() * GREEDY_TOKENS) as f64, whole)
}
