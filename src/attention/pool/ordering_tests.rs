//! The pool's ordering rules, checked with a copier whose copies complete only when the pool
//! waits for their layer (as a GPU's copy stream may finish them at any point before): a pool
//! that touched a layer without waiting would read bytes not yet swapped in, have its own
//! writes overwritten by a late swap-in, or let a new token overwrite KV that a swap-out had
//! not read yet.

use std::sync::{Arc, OnceLock};

use candle_core::{Device, Tensor};
use parking_lot::Mutex;

use super::{Copier, KvPool, KvShape, Span};
use crate::kv::{ChunkBytes, LayerCells};
use crate::Result;

const SHAPE: KvShape = KvShape {
    num_layers: 2,
    num_kv_heads: 3,
    head_dim: 4,
};
const ROW: usize = 12;

/// One layer's part of a copy, done when the pool waits for that layer.
#[derive(Debug)]
enum Job {
    Out {
        start: usize,
        len: usize,
        cells: Arc<LayerCells>,
    },
    In {
        start: usize,
        data: Arc<ChunkBytes>,
    },
}

#[derive(Debug, Default)]
struct LateCopier {
    /// Per layer, in order: swap-outs, then swap-ins (as the GPU's mover queues them).
    pending: Mutex<Vec<Vec<Job>>>,
}

impl Copier for LateCopier {
    fn copy(
        &self,
        k: &[Tensor],
        _: &[Tensor],
        row_bytes: usize,
        outs: &[(usize, usize)],
        ins: Vec<(usize, Arc<ChunkBytes>)>,
        _: bool,
    ) -> Result<Vec<ChunkBytes>> {
        let layers = k.len();
        let mut pending = self.pending.lock();
        pending.resize_with(layers, Vec::new);
        let mut chunks = Vec::new();
        for &(start, len) in outs {
            let cells: Arc<LayerCells> = Arc::new((0..layers).map(|_| OnceLock::new()).collect());
            for jobs in pending.iter_mut() {
                let cells = Arc::clone(&cells);
                jobs.push(Job::Out { start, len, cells });
            }
            chunks.push(ChunkBytes::layered(2 * layers * len * row_bytes, cells));
        }
        for (start, data) in ins {
            for jobs in pending.iter_mut() {
                let data = Arc::clone(&data);
                jobs.push(Job::In { start, data });
            }
        }
        Ok(chunks)
    }

    fn await_layer(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let jobs = match self.pending.lock().get_mut(layer) {
            Some(jobs) => std::mem::take(jobs),
            None => return Ok(()),
        };
        let layers = SHAPE.num_layers;
        for job in jobs {
            match job {
                Job::Out { start, len, cells } => {
                    let mut bytes = Vec::new();
                    for pool in [k, v] {
                        let rows = pool.narrow(0, start, len)?.flatten_all()?;
                        bytes.extend(rows.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()));
                    }
                    let _ = cells[layer].set(Ok(bytes));
                }
                Job::In { start, data } => {
                    let bytes = data.layer(layer, layers)?;
                    let values: Vec<f32> = bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect();
                    let len = values.len() / (2 * ROW);
                    for (pool, part) in [k, v].into_iter().zip(values.chunks_exact(len * ROW)) {
                        let src = Tensor::from_slice(part, (len, ROW), &Device::Cpu)?;
                        pool.reshape((pool.dim(0)?, ROW))?
                            .slice_set(&src, 0, start)?;
                    }
                }
            }
        }
        Ok(())
    }
}

fn late_pool() -> Result<KvPool> {
    let mut pool = KvPool::new(SHAPE, 10, crate::attention::KvPrecision::F32, &Device::Cpu)?;
    pool.copier = Some(Box::new(LateCopier::default()));
    Ok(pool)
}

/// Three tokens of KV, `base` and up, in every layer of `pool` at slots `slots`.
fn write_tokens(pool: &KvPool, slots: &[u32], base: f32) -> Result<()> {
    let k = Tensor::arange(base, base + (3 * ROW) as f32, &Device::Cpu)?;
    let k = k.reshape((3, SHAPE.num_kv_heads, SHAPE.head_dim))?;
    let v = (&k * -1.0)?;
    let index = pool.write_index(slots, &Device::Cpu)?;
    for layer in 0..SHAPE.num_layers {
        pool.write(layer, &index, &k, &v)?;
    }
    Ok(())
}

/// The bytes of three tokens written from `base`, as a chunk holds them.
fn token_bytes(base: f32) -> Result<Vec<u8>> {
    let plain = KvPool::new(SHAPE, 10, crate::attention::KvPrecision::F32, &Device::Cpu)?;
    write_tokens(&plain, &[0, 1, 2], base)?;
    plain.read_slots(0, 3)
}

/// Every layer as a forward pass would ask for it.
fn pass(pool: &KvPool) -> Result<()> {
    for layer in 0..SHAPE.num_layers {
        pool.layer(layer)?;
    }
    Ok(())
}

#[test]
fn reads_and_writes_of_slots_wait_for_the_swap_ins_of_their_layer() -> Result<()> {
    let (a, b) = (token_bytes(1.0)?, token_bytes(100.0)?);
    let pool = late_pool()?;
    pool.copy_chunks(
        &[],
        vec![(Span::whole(4, 3), Arc::new(ChunkBytes::from(a.clone())))],
        true,
    )?;
    assert_eq!(pool.read_slots(4, 3)?, a, "read before the swap-in landed");
    // The overflow path writes slots directly: after a swap-in of the same slots, its bytes
    // must be the ones that stay.
    pool.copy_chunks(
        &[],
        vec![(Span::whole(4, 3), Arc::new(ChunkBytes::from(a)))],
        true,
    )?;
    pool.write_slots(4, &b)?;
    pass(&pool)?;
    assert_eq!(
        pool.read_slots(4, 3)?,
        b,
        "a late swap-in overwrote a write"
    );
    Ok(())
}

#[test]
fn new_tokens_do_not_overwrite_kv_that_a_swap_out_has_not_read() -> Result<()> {
    let pool = late_pool()?;
    write_tokens(&pool, &[0, 1, 2], 1.0)?;
    let out = pool.copy_chunks(&[Span::whole(0, 3)], vec![], true)?;
    // The swapped-out slots are free: this step's new tokens take them.
    write_tokens(&pool, &[0, 1, 2], 100.0)?;
    pass(&pool)?;
    assert_eq!(out.len(), 1);
    let swapped = out[0].bytes()?;
    assert_eq!(swapped, token_bytes(1.0)?.as_slice());
    assert_eq!(pool.read_slots(0, 3)?, token_bytes(100.0)?);
    Ok(())
}
