//! The reference outputs of llama.cpp in `tests/fixtures/llamacpp/` (written by
//! `scripts/reference/llamacpp-fixtures`), and the files they were computed from.

use std::path::PathBuf;

use pensieve::model::default_cache_dir;
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
        "{} is missing: run scripts/fetch-assets",
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
