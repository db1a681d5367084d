//! The executor: turns a [`StepPlan`] into KV copies and one forward pass. The only place
//! (with `KvPool`) where the engine touches tensors.

use std::time::Instant;

use candle_core::Tensor;

use crate::conversation::Conversations;
use crate::kv::cache::CacheManager;
use crate::kv::{CostModel, KvPool};
use crate::model::{ForwardBatch, Model};
use crate::scheduler::{RowPlan, StepPlan};
use crate::Result;

/// Copies the planned chunks between tiers (swap-outs first, so host room booked by drops is
/// used before swap-ins need blocks) and completes the moves. A failed copy drops the chunk:
/// its raw tokens rebuild it.
pub(super) fn transfer(
    pool: &KvPool,
    cache: &mut CacheManager,
    convs: &mut Conversations,
    plan: &StepPlan,
) {
    for s in &plan.swap_out {
        let start = cache.blocks.slot(s.block, 0) as usize;
        let stored = pool
            .read_slots(start, s.len)
            .map(|data| cache.host.store(s.host, data));
        match stored {
            Ok(true) => cache.complete_swap_out(convs, s),
            _ => cache.abort_swap(convs, s.conv, s.chunk),
        }
    }
    for s in &plan.swap_in {
        let start = cache.blocks.slot(s.block, 0) as usize;
        let copied = cache
            .host
            .take(s.host)
            .map(|data| pool.write_slots(start, &data));
        match copied {
            Some(Ok(())) => cache.complete_swap_in(convs, s),
            _ => {
                // The data is gone either way; the chunk is recomputed next time it is needed.
                cache.blocks.release(s.block);
                if let Some(c) = convs.get_mut(&s.conv) {
                    c.chunks[s.chunk] = crate::kv::ChunkLoc::Dropped;
                }
            }
        }
    }
}

/// One forward pass over every row; logits of the rows that sample, in row order.
pub(super) fn forward(model: &Model, pool: &KvPool, rows: &[RowPlan]) -> Result<Option<Tensor>> {
    if rows.is_empty() {
        return Ok(None);
    }
    let mut batch = ForwardBatch::new();
    for r in rows {
        batch.push(
            &r.tokens,
            &r.positions,
            &r.slots,
            &r.ctx_slots,
            &r.ctx_positions,
            r.sample,
        )?;
    }
    let logits = model.llama.forward(&batch, pool)?;
    Ok((batch.num_logit_rows() > 0).then_some(logits))
}

/// Measures the recompute cost curve on the loaded model: the time per token of prefilling one
/// chunk at several context offsets, fitted to `a + b * position`. Uses the (still empty)
/// pool as scratch.
pub(super) fn measure_cost(model: &Model, pool: &KvPool, chunk: usize) -> Result<CostModel> {
    let max = pool
        .num_slots()
        .min(model.llama.config().max_position_embeddings);
    let mut samples = Vec::new();
    for offset in [0, max / 8, max / 4, max / 2] {
        if offset + chunk > max {
            continue;
        }
        let end = (offset + chunk) as u32;
        let positions: Vec<u32> = (offset as u32..end).collect();
        let context: Vec<u32> = (0..end).collect();
        let tokens: Vec<u32> = positions.iter().map(|p| 100 + p % 1000).collect();
        let mut batch = ForwardBatch::new();
        batch.push(&tokens, &positions, &positions, &context, &context, true)?;
        // The first pass warms caches and allocations; time the second.
        model.llama.forward(&batch, pool)?;
        let started = Instant::now();
        model.llama.forward(&batch, pool)?;
        let per_token = started.elapsed().as_secs_f64() / chunk as f64;
        samples.push((offset as f64 + chunk as f64 / 2.0, per_token));
    }
    Ok(CostModel::fit(&samples))
}
