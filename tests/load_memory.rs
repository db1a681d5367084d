//! Loading a model's weights takes about the memory of its file: the Gemma 3 270M Q4_K_M
//! file (Q8_0, Q4_K, Q5_0 and Q6_K tensors) is repacked a panel of rows at a time into its
//! own codes, the embedding table is looked up in the packed output projection it is tied
//! to, and nothing holds the whole file a second time. The packed weights take at most 1.1×
//! the file; the peak resident memory of this process (one test, alone in its binary, so no
//! other test's allocations count) grows by at most 1.3× the file plus the KV pool from before
//! the weights are read to after a prefill.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use candle_core::Device;
use common::llamacpp;
use pensieve::attention::KvPool;
use pensieve::model::{tokenizer_from_gguf, ForwardBatch, GgufHeader, Transformer, WeightFormat};

/// The process's peak resident set (`VmHWM`), in bytes.
fn peak_rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: usize = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib * 1024
}

#[test]
fn gemma3_loads_in_about_its_file_size() {
    let path = llamacpp::gemma_path();
    let file_len = std::fs::metadata(&path).unwrap().len() as usize;
    let mut file = std::fs::File::open(&path).unwrap();
    let header = GgufHeader::read(&mut file).unwrap();
    // What the vocabulary takes (262,144 pieces) is the tokenizer's, not the weights'.
    let tokenizer = tokenizer_from_gguf(&header.content).unwrap();
    let before = peak_rss();
    let llama =
        Transformer::from_gguf(&header, &mut file, WeightFormat::Packed, &Device::Cpu).unwrap();
    let loaded = peak_rss();
    let weights = llama.weight_bytes();
    let tokens = 4096;
    let pool = KvPool::new(
        llama.config().kv_shape(),
        tokens,
        pensieve::engine::KvPrecision::F16,
        &Device::Cpu,
    )
    .unwrap();
    let pool_bytes = tokens
        * llama
            .config()
            .kv_shape()
            .token_bytes(pensieve::engine::KvPrecision::F16);
    // A prefill touches every weight and some of the pool's slots (logits of its last row,
    // as the engine asks).
    let ids: Vec<u32> = (0..64).map(|i| 1000 + i * 13).collect();
    let idx: Vec<u32> = (0..64).collect();
    let mut batch = ForwardBatch::new();
    batch.push(&ids, &idx, &idx, &idx, idx.len(), true).unwrap();
    llama.forward(&batch, &pool).unwrap();
    let peak = peak_rss();
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    eprintln!(
        "file {:.1} MiB, packed weights {:.1} MiB, KV pool {:.1} MiB; peak RSS {:.1} MiB with \
         the tokenizer and metadata, {:.1} MiB before the weights, {:.1} MiB once loaded: the \
         peak grew by {:.2}x the file over the load and a prefill",
        mib(file_len),
        mib(weights),
        mib(pool_bytes),
        mib(peak),
        mib(before),
        mib(loaded),
        (peak - before) as f64 / file_len as f64
    );
    assert!(
        weights as f64 <= 1.1 * file_len as f64,
        "packed weights {:.1} MiB",
        mib(weights)
    );
    assert!(
        (peak - before) as f64 <= 1.3 * file_len as f64 + pool_bytes as f64,
        "peak RSS {:.1} MiB over {:.1} MiB before the weights, for a {:.1} MiB file and a \
         {:.1} MiB pool",
        mib(peak),
        mib(before),
        mib(file_len),
        mib(pool_bytes)
    );
    drop(tokenizer);
}
