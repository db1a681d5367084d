//! Random attention batches for the attention tests (the CPU op, the CUDA kernel on a GPU and
//! under the emulator): shapes, GQA ratios, block tables of shuffled blocks of several sizes, disjoint query runs in one
//! sequence, decode and prefill mixed, sliding windows.

use candle_core::{DType, Device, Tensor};
use pensieve::attention::{AttentionBatch, KvPool, KvShape};
use pensieve::engine::KvPrecision;
use proptest::prelude::*;

/// One generated sequence: its context length and which of its positions are queried.
#[derive(Clone, Debug)]
pub struct SeqCase {
    pub ctx_len: usize,
    /// Queried positions: either the last token (decode), a trailing run (prefill), or a
    /// leading run plus a trailing run (recompute of dropped tokens plus the new prompt).
    pub queries: Vec<u32>,
}

pub fn seq_case() -> impl Strategy<Value = SeqCase> {
    (1usize..200, 0usize..3, any::<u64>()).prop_map(|(ctx_len, kind, r)| {
        let n = ctx_len as u32;
        let queries = match kind {
            0 => vec![n - 1],
            1 => {
                let run = 1 + (r as u32 % n);
                (n - run..n).collect()
            }
            _ => {
                let lead = (r as u32 % n).min(n - 1);
                let tail_start = lead + (r as u32 >> 8) % (n - lead);
                (0..lead).chain(tail_start..n).collect()
            }
        };
        SeqCase { ctx_len, queries }
    })
}

#[derive(Clone, Debug)]
pub struct Case {
    pub n_kv_heads: usize,
    pub group: usize,
    pub head_dim: usize,
    pub seqs: Vec<SeqCase>,
    pub seed: u64,
    /// A sliding window (Gemma 3's local layers), or the whole causal context.
    pub window: Option<u32>,
}

pub fn window() -> impl Strategy<Value = Option<u32>> {
    prop_oneof![Just(None), (1u32..80).prop_map(Some)]
}

pub fn case() -> impl Strategy<Value = Case> {
    (
        1usize..4,
        prop_oneof![Just(1usize), Just(2), Just(3), Just(4)],
        prop_oneof![Just(8usize), Just(64), Just(20), Just(128), Just(256)],
        prop::collection::vec(seq_case(), 1..6),
        any::<u64>(),
        window(),
    )
        .prop_map(|(n_kv_heads, group, head_dim, seqs, seed, window)| Case {
            n_kv_heads,
            group,
            head_dim,
            seqs,
            seed,
            window,
        })
}

/// Tiny deterministic generator so that tensors follow the proptest seed.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// Builds q, pools and batch; every sequence's context lives in a shuffled set of blocks of
/// 1, 3 or 16 slots (by the seed: a table of single slots, an odd size, the engine's kind).
pub fn build(c: &Case) -> (Tensor, Tensor, Tensor, AttentionBatch) {
    let bs = [1usize, 3, 16][(c.seed % 3) as usize];
    let n_blocks = c.seqs.iter().map(|s| s.ctx_len.div_ceil(bs)).sum::<usize>() + 2;
    let n_slots = n_blocks * bs;
    // A seeded permutation of the pool's blocks hands them out in no order.
    let mut blocks: Vec<u32> = (0..n_blocks as u32).collect();
    let keys = values(n_blocks, c.seed ^ 0xabc);
    blocks.sort_by(|a, b| keys[*a as usize].total_cmp(&keys[*b as usize]));
    let mut next = 0;
    let mut batch = AttentionBatch::new(bs);
    for s in &c.seqs {
        let n = s.ctx_len.div_ceil(bs);
        batch
            .push_sequence(&s.queries, &blocks[next..next + n], s.ctx_len)
            .unwrap();
        next += n;
    }
    let n_heads = c.n_kv_heads * c.group;
    let t = batch.num_queries();
    let dev = Device::Cpu;
    let q = Tensor::from_vec(
        values(t * n_heads * c.head_dim, c.seed),
        (t, n_heads, c.head_dim),
        &dev,
    )
    .unwrap();
    let kv_shape = (n_slots, c.n_kv_heads, c.head_dim);
    let k = Tensor::from_vec(
        values(n_slots * c.n_kv_heads * c.head_dim, c.seed ^ 1),
        kv_shape,
        &dev,
    )
    .unwrap();
    let v = Tensor::from_vec(
        values(n_slots * c.n_kv_heads * c.head_dim, c.seed ^ 2),
        kv_shape,
        &dev,
    )
    .unwrap();
    (q, k, v, batch)
}

/// The case's K and V written into a pool at `kv` on `device` (quantized, in turned heads, as
/// the engine writes them): the layer's pool tensors.
pub fn stored(
    c: &Case,
    k: &Tensor,
    v: &Tensor,
    kv: KvPrecision,
    device: &Device,
) -> (Tensor, Tensor) {
    let shape = KvShape {
        num_layers: 1,
        num_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
    };
    let n = k.dim(0).unwrap();
    let pool = KvPool::new(shape, n, kv, device).unwrap();
    let slots: Vec<u32> = (0..n as u32).collect();
    let index = pool.write_index(&slots, device).unwrap();
    let on = |t: &Tensor| t.to_device(device).unwrap();
    pool.write(0, &index, &on(k), &on(v)).unwrap();
    let (kp, vp) = pool.layer(0).unwrap();
    (kp.clone(), vp.clone())
}

/// How a test's pools keep their values: converted to a type, or written as codes.
#[derive(Clone, Copy, Debug)]
pub enum Pool {
    Values(DType),
    Codes(KvPrecision),
}

impl Pool {
    /// Every kind the kernels read: f32, f16, bf16, 8- and 4-bit codes.
    pub const ALL: [Pool; 5] = [
        Pool::Values(DType::F32),
        Pool::Values(DType::F16),
        Pool::Values(DType::BF16),
        Pool::Codes(KvPrecision::Q8),
        Pool::Codes(KvPrecision::Q4),
    ];

    /// The case's K and V kept this way on `device`.
    pub fn keep(self, c: &Case, k: &Tensor, v: &Tensor, device: &Device) -> (Tensor, Tensor) {
        match self {
            Pool::Values(dtype) => {
                let kept = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(device).unwrap();
                (kept(k), kept(v))
            }
            Pool::Codes(kv) => stored(c, k, v, kv, device),
        }
    }
}

/// One of [`Pool::ALL`].
pub fn pool() -> impl Strategy<Value = Pool> {
    proptest::sample::select(Pool::ALL.to_vec())
}

/// Outputs are weighted means of values in [-2, 2]; one near zero is a cancellation whose
/// absolute f32 rounding (about 1e-6 over a few hundred keys) says nothing about the kernel, so
/// relative error is floored at this magnitude. A wrong mask, slot or scale moves outputs by
/// 1e-2 or more.
pub const REL_FLOOR: f32 = 0.1;

/// The largest error of `a` against `b`, relative to `b` (floored at [`REL_FLOOR`]); infinite
/// where `a` holds a NaN or an infinity (`f32::max` would pass over a NaN).
pub fn max_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| match x.is_finite() {
            true => (x - y).abs() / y.abs().max(REL_FLOOR),
            false => f32::INFINITY,
        })
        .fold(0.0, f32::max)
}

/// The error of `a` against `b` as a whole: the norm of their difference over `b`'s. Where a
/// lossy store is measured: its largest relative error is one entry's, and over thousands of
/// entries that tail is long.
pub fn rms_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    let diff: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum();
    let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    match a.iter().all(|x| x.is_finite()) {
        true => (diff / norm.max(f64::MIN_POSITIVE)).sqrt() as f32,
        false => f32::INFINITY,
    }
}

/// Contexts of several segments (512 entries each): decode rows, prefill runs, recompute.
pub fn long_case() -> impl Strategy<Value = Case> {
    // Contexts of several segments (512 entries each): decode rows, prefill runs, recompute.
    let seq = (500usize..1400, 0usize..3, any::<u64>()).prop_map(|(ctx_len, kind, r)| {
        let n = ctx_len as u32;
        let queries = match kind {
            0 => vec![n - 1],
            1 => (n - 1 - r as u32 % 40..n).collect(),
            _ => (0..3).chain(n - 5..n).collect(),
        };
        SeqCase { ctx_len, queries }
    });
    // Gemma 3's 512-position window over contexts past it, among others.
    let window = prop_oneof![Just(None), Just(Some(512)), (1u32..1400).prop_map(Some)];
    (prop::collection::vec(seq, 1..3), any::<u64>(), window).prop_map(|(seqs, seed, window)| Case {
        n_kv_heads: 2,
        group: 3,
        head_dim: 64,
        seqs,
        seed,
        window,
    })
}

/// Cases for the kernel: its head dims, any GQA group up to 48 query heads per kv head.
pub fn kernel_case() -> impl Strategy<Value = Case> {
    (
        1usize..3,
        prop_oneof![
            Just(1usize),
            Just(2),
            Just(3),
            Just(4),
            Just(8),
            Just(32),
            Just(33),
            Just(40),
            Just(48)
        ],
        prop_oneof![Just(64usize), Just(128), Just(256)],
        prop::collection::vec(seq_case(), 1..4),
        any::<u64>(),
        window(),
    )
        .prop_map(|(n_kv_heads, group, head_dim, mut seqs, seed, window)| {
            // Large groups multiply the queries: keep each case to a few thousand of them.
            let rows = (96 / group).max(1);
            for s in &mut seqs {
                let keep = s.queries.len().saturating_sub(rows);
                s.queries.drain(..keep);
            }
            Case {
                n_kv_heads,
                group,
                head_dim,
                seqs,
                seed,
                window,
            }
        })
}
