//! The executor: turns a [`StepPlan`] into KV copies and one forward pass. With
//! [`KvPool`], the only place where the engine touches tensors.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;

use crate::attention::{KvPool, Span};
use crate::ids::ConversationId;
use crate::kv::{CacheManager, CostModel, Moves};
use crate::model::{ForwardBatch, Model};
use crate::scheduler::RowPlan;
use crate::Result;

/// Copies the planned chunks between tiers in one batch (swap-outs first, so host room booked
/// by drops is used before swap-ins need blocks; on a GPU in layer order, `pipelined` letting
/// the pass start before the last layer has arrived) and completes or aborts each move.
/// Returns the conversations whose swap-in failed: their KV has a hole this step, so their
/// rows must not run (they are requeued to recompute it).
pub(super) fn transfer(
    pool: &KvPool,
    cache: &mut CacheManager,
    moves: &Moves,
    faults: &mut Faults,
    pipelined: bool,
) -> HashSet<ConversationId> {
    let mut lost = HashSet::new();
    let mut outs = Vec::new();
    for s in &moves.swap_out {
        if Faults::fail(&mut faults.swap_out) {
            cache.abort_swap_out(s);
        } else {
            outs.push(s);
        }
    }
    let mut ins = Vec::new();
    // Every read is queued before the first is waited for: the reader thread goes on with the
    // next chunks meanwhile.
    let layered = pipelined && pool.restores_by_layer();
    let taken: Vec<_> = (moves.swap_in.iter())
        .map(|s| (s, cache.take_swap_in(s, layered)))
        .collect();
    for (s, data) in taken {
        match data {
            // Bytes still being read ahead wait here, unless they come layer by layer (the
            // pass waits per layer; see `restored`); a file refused by a read fails only its
            // own swap-in.
            Some(data)
                if (data.is_layered() || data.bytes().is_ok())
                    && !Faults::fail(&mut faults.swap_in) =>
            {
                ins.push((s, data));
            }
            _ => lost.extend(cache.abort_swap_in(s)),
        }
    }
    let out_ranges: Vec<Span> = outs
        .iter()
        .map(|s| Span {
            start: cache.first_slot(s.block),
            len: s.len,
            narrow: s.narrow,
        })
        .collect();
    let (in_moves, in_data): (Vec<_>, Vec<_>) = ins
        .into_iter()
        .map(|(s, data)| {
            let span = Span {
                start: cache.first_slot(s.block),
                len: s.len,
                narrow: s.narrow,
            };
            (s, (span, data))
        })
        .unzip();
    match pool.copy_chunks(&out_ranges, in_data, pipelined) {
        Ok(copied) => {
            for (s, data) in outs.into_iter().zip(copied) {
                cache.complete_swap_out(s, Arc::new(data));
            }
            for s in in_moves {
                cache.complete_swap_in(s);
            }
        }
        Err(_) => {
            for s in outs {
                cache.abort_swap_out(s);
            }
            for s in in_moves {
                lost.extend(cache.abort_swap_in(s));
            }
        }
    }
    lost
}

/// After a pass: finishes the restores that came layer by layer, and aborts those whose file
/// was refused partway (their chunks are dropped, to be recomputed). Returns those
/// conversations (their rows' results must be discarded) and the time the pass waited for
/// layers still being read.
pub(super) fn restored(
    pool: &KvPool,
    cache: &mut CacheManager,
    moves: &Moves,
) -> (HashSet<ConversationId>, std::time::Duration) {
    let (failed, waited) = pool.finish_restore();
    let mut lost = HashSet::new();
    for start in failed {
        if let Some(s) = moves
            .swap_in
            .iter()
            .find(|s| cache.first_slot(s.block) == start)
        {
            lost.extend(cache.abort_swap_in(s));
        }
    }
    (lost, waited)
}

/// Copies to fail on purpose, to test the recovery paths. Empty outside tests.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    /// Fail the next this many swap-outs.
    pub swap_out: usize,
    /// Fail the next this many swap-ins.
    pub swap_in: usize,
}

impl Faults {
    /// Whether to fail this copy, counting the faults left down.
    fn fail(n: &mut usize) -> bool {
        let fail = *n > 0;
        *n = n.saturating_sub(1);
        fail
    }
}

/// One forward pass over `rows`, whose block tables name blocks of `chunk` slots; logits of
/// the rows that sample, in row order.
pub(super) fn forward(
    model: &Model,
    pool: &KvPool,
    chunk: usize,
    rows: &[&RowPlan],
) -> Result<Option<Tensor>> {
    if rows.is_empty() {
        return Ok(None);
    }
    let mut batch = ForwardBatch::paged(chunk);
    for r in rows {
        let (tokens, positions, slots) = (&r.tokens, &r.positions, &r.slots);
        match r.drafted {
            // The logits after the fed-back token and after each drafted one.
            0 => batch.push(tokens, positions, slots, &r.blocks, r.ctx_len, r.sample)?,
            _ => batch.push_scored(tokens, positions, slots, &r.blocks, r.ctx_len)?,
        }
    }
    let logits = model.transformer().forward(&batch, pool)?;
    Ok((batch.num_logit_rows() > 0).then_some(logits))
}

/// Measures the recompute cost curve on the loaded model: the time per token of prefilling one
/// chunk at several context offsets, fitted to `a + b * position`. Uses the (still empty)
/// pool as scratch.
pub(super) fn measure_cost(model: &Model, pool: &KvPool, chunk: usize) -> Result<CostModel> {
    let max = pool.num_slots().min(model.config().max_position_embeddings);
    let mut samples = Vec::new();
    for offset in [0, max / 8, max / 4, max / 2] {
        if offset + chunk > max {
            continue;
        }
        let end = (offset + chunk) as u32;
        let positions: Vec<u32> = (offset as u32..end).collect();
        let blocks: Vec<u32> = (0..(end as usize).div_ceil(chunk) as u32).collect();
        let vocab = model.config().vocab_size.max(1) as u32;
        let tokens: Vec<u32> = positions.iter().map(|p| (100 + p) % vocab).collect();
        let mut batch = ForwardBatch::paged(chunk);
        batch.push(&tokens, &positions, &positions, &blocks, end as usize, true)?;
        // The first pass warms caches and allocations; time the second.
        model.transformer().forward(&batch, pool)?;
        let started = Instant::now();
        model.transformer().forward(&batch, pool)?;
        let per_token = started.elapsed().as_secs_f64() / chunk as f64;
        samples.push((offset as f64 + chunk as f64 / 2.0, per_token));
    }
    Ok(CostModel::fit(&samples))
}
