//! The attention op in the Pensieve paper's Figure 10 shape: a batch of 32 sequences with 8
//! queries each over contexts in non-contiguous slots. Our kernel against
//! - the contiguous ideal: the same kernel with every context in consecutive slots (what a
//!   non-contiguous layout costs);
//! - gathering the context into contiguous memory, then attending with candle ops;
//! - one query at a time: a single-query (decode) call per query, as a decode-only kernel
//!   would have to run a multi-token turn.
//!
//! Plus the batches the engine runs: decode-only (32 sequences x 1 query) and mixed (one
//! 512-token prefill with 31 decodes); and by KV precision, pools written as the engine writes
//! them (8 decode rows, and a 512-token prefill, over 2,048 tokens); and decode over agents'
//! contexts (8k-32k tokens) against the copy bandwidth.
//!
//! ```text
//! cargo bench --bench attention
//! ```

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pensieve::attention::{
    attention, attention_gather, attention_in_window, Attend, AttentionBatch, KvPool, KvShape,
};
use pensieve::engine::KvPrecision;

/// SmolLM2's attention shape: 9 query heads over 3 kv heads of 64.
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const SEQS: usize = 32;

/// Slot of position `p` of sequence `s`.
#[derive(Clone, Copy)]
enum Layout {
    /// Sequences interleaved token by token: no two neighbours of a context are adjacent.
    Interleaved,
    /// Each sequence's context in one run of slots.
    Contiguous,
}

struct Case {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    batch: AttentionBatch,
}

/// `queries[s]` queries at the end of sequence `s`'s `ctx` tokens.
fn case(ctx: usize, queries: &[usize], layout: Layout) -> candle_core::Result<Case> {
    let dev = Device::Cpu;
    let n = queries.len();
    let mut batch = AttentionBatch::new(1);
    for (s, &nq) in queries.iter().enumerate() {
        let slots: Vec<u32> = (0..ctx)
            .map(|p| match layout {
                Layout::Interleaved => (p * n + s) as u32,
                Layout::Contiguous => (s * ctx + p) as u32,
            })
            .collect();
        let q_positions: Vec<u32> = ((ctx - nq) as u32..ctx as u32).collect();
        if let Err(e) = batch.push_sequence(&q_positions, &slots, ctx) {
            candle_core::bail!("{e}")
        }
    }
    let rows: usize = queries.iter().sum();
    Ok(Case {
        q: Tensor::randn(0f32, 1.0, (rows, HEADS, HEAD_DIM), &dev)?,
        k: Tensor::randn(0f32, 1.0, (n * ctx, KV_HEADS, HEAD_DIM), &dev)?,
        v: Tensor::randn(0f32, 1.0, (n * ctx, KV_HEADS, HEAD_DIM), &dev)?,
        batch,
    })
}

/// The same work split into single-query calls: `(row of q, batch of one query)`.
fn one_query_calls(ctx: usize, nq: usize) -> candle_core::Result<Vec<(usize, AttentionBatch)>> {
    let mut calls = Vec::new();
    for s in 0..SEQS {
        for j in 0..nq {
            let pos = ctx - nq + j;
            let slots: Vec<u32> = (0..=pos).map(|p| (p * SEQS + s) as u32).collect();
            let mut b = AttentionBatch::new(1);
            if let Err(e) = b.push_sequence(&[pos as u32], &slots, pos + 1) {
                candle_core::bail!("{e}")
            }
            calls.push((s * nq + j, b));
        }
    }
    Ok(calls)
}

fn scale() -> f32 {
    1.0 / (HEAD_DIM as f32).sqrt()
}

fn figure10(c: &mut Criterion) {
    let mut group = c.benchmark_group("attention_32x8");
    group.sample_size(10);
    let queries = [8; SEQS];
    for ctx in [256, 1024, 4096] {
        let (Ok(ours), Ok(ideal), Ok(calls)) = (
            case(ctx, &queries, Layout::Interleaved),
            case(ctx, &queries, Layout::Contiguous),
            one_query_calls(ctx, 8),
        ) else {
            continue;
        };
        let Case { q, k, v, batch } = &ours;
        group.bench_with_input(BenchmarkId::new("pensieve", ctx), &ctx, |b, _| {
            b.iter(|| attention(q, k, v, batch, scale()))
        });
        group.bench_with_input(BenchmarkId::new("contiguous_ideal", ctx), &ctx, |b, _| {
            b.iter(|| attention(&ideal.q, &ideal.k, &ideal.v, &ideal.batch, scale()))
        });
        group.bench_with_input(BenchmarkId::new("gather_then_attend", ctx), &ctx, |b, _| {
            b.iter(|| attention_gather(q, k, v, Attend::new(batch, scale())))
        });
        group.bench_with_input(
            BenchmarkId::new("one_query_at_a_time", ctx),
            &ctx,
            |b, _| {
                b.iter(|| -> pensieve::Result<()> {
                    for (row, one) in &calls {
                        let qi = q.narrow(0, *row, 1)?;
                        attention(&qi, k, v, one, scale())?;
                    }
                    Ok(())
                })
            },
        );
    }
    group.finish();
}

fn engine_batches(c: &mut Criterion) {
    let mut group = c.benchmark_group("attention_batches");
    group.sample_size(10);
    let decode = [1; SEQS];
    let mut mixed = [1; SEQS];
    mixed[0] = 512;
    for (name, queries) in [("decode_32x1", &decode), ("mixed_512+31x1", &mixed)] {
        for ctx in [1024, 4096] {
            let Ok(Case { q, k, v, batch }) = case(ctx, queries, Layout::Interleaved) else {
                continue;
            };
            let id = format!("{name}/pensieve");
            group.bench_with_input(BenchmarkId::new(id, ctx), &ctx, |b, _| {
                b.iter(|| attention(&q, &k, &v, &batch, scale()))
            });
            let id = format!("{name}/gather_then_attend");
            group.bench_with_input(BenchmarkId::new(id, ctx), &ctx, |b, _| {
                b.iter(|| attention_gather(&q, &k, &v, Attend::new(&batch, scale())))
            });
        }
    }
    group.finish();
}

/// `k` and `v` written into a pool of `kv` (quantized, turned, as the engine writes them).
fn stored(k: &Tensor, v: &Tensor, kv: KvPrecision) -> pensieve::Result<(Tensor, Tensor)> {
    let shape = KvShape {
        num_layers: 1,
        num_kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
    };
    let n = k.dim(0)?;
    let pool = KvPool::new(shape, n, kv, &Device::Cpu)?;
    let slots: Vec<u32> = (0..n as u32).collect();
    pool.write(0, &pool.write_index(&slots, &Device::Cpu)?, k, v)?;
    let (k, v) = pool.layer(0)?;
    Ok((k.clone(), v.clone()))
}

fn precisions(c: &mut Criterion) {
    let mut group = c.benchmark_group("attention_by_kv_precision");
    group.sample_size(10);
    let ctx = 2048;
    for (name, queries) in [("decode_8x1", vec![1; 8]), ("prefill_512", vec![512])] {
        let Ok(Case { q, k, v, batch }) = case(ctx, &queries, Layout::Interleaved) else {
            continue;
        };
        for kv in [KvPrecision::F16, KvPrecision::Q8, KvPrecision::Q4] {
            let Ok((k, v)) = stored(&k, &v, kv) else {
                continue;
            };
            let id = format!("{name}/{kv:?}");
            group.bench_with_input(BenchmarkId::new(id, ctx), &ctx, |b, _| {
                b.iter(|| attention_in_window(&q, &k, &v, Attend::new(&batch, scale())))
            });
        }
    }
    group.finish();
}

/// Pools of one layer each, so that a step over `LAYERS` of them reads from memory, not cache.
const LAYERS: usize = 8;

/// Decode at agent lengths (issue 74): 1 and 4 sequences of one query over 8k-32k tokens at
/// every KV precision, each sample over [`LAYERS`] layers' pools in turn (what a step reads),
/// reported as KV bytes read per second; `copy` beside them copies as many bytes, reported as
/// bytes read per second (the bytes it writes come on top): the ratio of the two is the share
/// of the machine's copy bandwidth the op reads KV at.
fn long_context(c: &mut Criterion) {
    let mut group = c.benchmark_group("long_context_decode");
    group.sample_size(10);
    for (agents, ctx) in [(1, 8192), (1, 32768), (4, 32768)] {
        let Ok(Case { q, k, v, batch }) = case(ctx, &vec![1; agents], Layout::Contiguous) else {
            continue;
        };
        for kv in [KvPrecision::F16, KvPrecision::Q8, KvPrecision::Q4] {
            let Ok(layers) = (0..LAYERS)
                .map(|_| stored(&k, &v, kv))
                .collect::<pensieve::Result<Vec<_>>>()
            else {
                continue;
            };
            let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
            let read: usize = layers.iter().map(|(k, v)| bytes(k) + bytes(v)).sum();
            group.throughput(Throughput::Bytes(read as u64));
            let id = format!("{agents}x{ctx}/{kv:?}");
            group.bench_function(id, |b| {
                b.iter(|| {
                    for (k, v) in &layers {
                        let _ = attention_in_window(&q, k, v, Attend::new(&batch, scale()));
                    }
                })
            });
            if kv == KvPrecision::F16 {
                let src = vec![1u8; read];
                let mut dst = vec![0u8; read];
                group.bench_function(format!("{agents}x{ctx}/copy"), |b| {
                    b.iter(|| dst.copy_from_slice(std::hint::black_box(&src)))
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, figure10, engine_batches, precisions, long_context);
criterion_main!(benches);
