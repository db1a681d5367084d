//! The reference outputs of llama.cpp in `tests/fixtures/llamacpp/` (written by
//! `scripts/reference/llamacpp-fixtures`), and the files they were computed from.

use std::path::PathBuf;

use pensieve::attention::KvPool;
use pensieve::engine::KvPrecision;
use pensieve::model::{default_cache_dir, ForwardBatch, Model};
use serde_json::Value;

/// A fixture file, parsed.
pub fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llamacpp")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The 200 ShareGPT texts the token fixtures tokenize.
pub fn texts() -> Vec<String> {
    serde_json::from_value(fixture("texts.json")).unwrap()
}

/// llama.cpp's ids of every text for `vocab` (`gemma3`, `llama-bpe`, `qwen2`, `llama-spm`).
pub fn token_ids(vocab: &str) -> Vec<Vec<u32>> {
    serde_json::from_value(fixture(&format!("tokens-{vocab}.json"))["ids"].clone()).unwrap()
}

/// A vocabulary-only GGUF of llama.cpp's (fetched by `scripts/fetch-assets`).
pub fn vocab_gguf(vocab: &str) -> PathBuf {
    let p = default_cache_dir().join(format!("llamacpp-vocabs/ggml-vocab-{vocab}.gguf"));
    assert!(
        p.is_file(),
        "{} is missing: run scripts/fetch-assets --tests",
        p.display()
    );
    p
}

/// The Gemma 3 270M file (fetched by `scripts/fetch-assets --model gemma3-270m`).
pub fn gemma_path() -> PathBuf {
    let p = default_cache_dir().join("gemma3-270m/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run scripts/fetch-assets --model gemma3-270m",
        p.display()
    );
    p
}

/// `ids` as a vector of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

/// The negative log-likelihood of each of a fixture's held-back replies under `model` with KV
/// at `kv`, after its context, with the reply's token count. The context (all but its last
/// token) is prefilled without logits, then the rest is scored: the output layer (Gemma's is
/// 262k rows) runs only for the rows that predict a reply token.
pub fn reply_nlls(model: &Model, replies: &[Value], kv: KvPrecision) -> Vec<(f64, usize)> {
    let llama = model.transformer();
    replies
        .iter()
        .map(|r| {
            let (context, reply) = (ids(&r["context"]), ids(&r["reply"]));
            let tokens: Vec<u32> = context.iter().chain(&reply).copied().collect();
            let idx: Vec<u32> = (0..tokens.len() as u32).collect();
            let pool =
                KvPool::new(llama.config().kv_shape(), tokens.len(), kv, llama.device()).unwrap();
            let (first, last) = (context.len() - 1, tokens.len() - 1);
            if first > 0 {
                let mut batch = ForwardBatch::new();
                let prefix = &idx[..first];
                batch
                    .push(&tokens[..first], prefix, prefix, prefix, first, false)
                    .unwrap();
                llama.forward(&batch, &pool).unwrap();
            }
            let mut batch = ForwardBatch::new();
            let scored = &idx[first..last];
            batch
                .push_scored(&tokens[first..last], scored, scored, &idx[..last], last)
                .unwrap();
            let logits = llama.forward(&batch, &pool).unwrap();
            let mut nll = 0f64;
            for (i, &t) in reply.iter().enumerate() {
                let row = logits.get(i).unwrap().to_vec1::<f32>().unwrap();
                let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
                let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
                nll -= row[t as usize] as f64 - max - sum.ln();
            }
            (nll, reply.len())
        })
        .collect()
}

/// The perplexity of replies' negative log-likelihoods and token counts.
pub fn perplexity(nlls: &[(f64, usize)]) -> f64 {
    let (nll, count) = nlls
        .iter()
        .fold((0f64, 0usize), |(a, n), &(x, c)| (a + x, n + c));
    (nll / count as f64).exp()
}
