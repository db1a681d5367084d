//! The attention op in the Pensieve paper's Figure 10 shape: a batch of 32 sequences with 8
//! queries each over contexts in non-contiguous slots, our kernel against gathering the
//! context into contiguous memory and attending with candle ops.
//!
//! ```text
//! cargo bench --bench attention
//! ```

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pensieve::attention::{attention, attention_gather, AttentionBatch};

/// SmolLM2's attention shape: 9 query heads over 3 kv heads of 64.
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const SEQS: usize = 32;
const QUERIES: usize = 8;

/// q, pools and batch for `SEQS` sequences of `ctx` tokens, the last `QUERIES` of each queried;
/// slots interleave the sequences so no context is contiguous.
fn setup(ctx: usize) -> candle_core::Result<(Tensor, Tensor, Tensor, AttentionBatch)> {
    let dev = Device::Cpu;
    let n_slots = SEQS * ctx;
    let mut batch = AttentionBatch::new();
    for s in 0..SEQS {
        let slots: Vec<u32> = (0..ctx).map(|p| (p * SEQS + s) as u32).collect();
        let positions: Vec<u32> = (0..ctx as u32).collect();
        let queries: Vec<u32> = ((ctx - QUERIES) as u32..ctx as u32).collect();
        if let Err(e) = batch.push_sequence(&queries, &slots, &positions) {
            candle_core::bail!("{e}")
        }
    }
    let q = Tensor::randn(0f32, 1.0, (SEQS * QUERIES, HEADS, HEAD_DIM), &dev)?;
    let k = Tensor::randn(0f32, 1.0, (n_slots, KV_HEADS, HEAD_DIM), &dev)?;
    let v = Tensor::randn(0f32, 1.0, (n_slots, KV_HEADS, HEAD_DIM), &dev)?;
    Ok((q, k, v, batch))
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("attention_32x8");
    group.sample_size(10);
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    for ctx in [256, 1024, 4096] {
        let Ok((q, k, v, batch)) = setup(ctx) else {
            continue;
        };
        group.bench_with_input(BenchmarkId::new("pensieve", ctx), &ctx, |b, _| {
            b.iter(|| attention(&q, &k, &v, &batch, scale))
        });
        group.bench_with_input(BenchmarkId::new("gather_then_attend", ctx), &ctx, |b, _| {
            b.iter(|| attention_gather(&q, &k, &v, &batch, scale))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
