//! The CUDA kernel's work list (`kernels/attention.cu`), plain data built on the host once per
//! step and shared by every layer: the batch and the items in one buffer of 32-bit words, so a
//! step costs one host-to-device copy.

use crate::attention::AttentionBatch;
use crate::{Error, Result};

/// Queries per item (`MAX_Q` in the kernel).
pub(crate) const MAX_Q: usize = 32;
/// Words per item: seq, g, q0, q1, t0, t1, part (-1: written to out directly), lowest and
/// highest query position (`ITEM_WORDS` in the kernel).
pub(crate) const ITEM_WORDS: usize = 9;
/// Words per merge: first part, part count, seq, g, q0, q1 (`MERGE_WORDS` in the kernel).
pub(crate) const MERGE_WORDS: usize = 6;
/// Bytes of K staged per tile (`TILE_BYTES` in the kernel).
const TILE_BYTES: usize = 16384;
/// A split decode row's segments hold at least this many context entries: shorter ones cost
/// more in partials and merging than they gain in parallelism.
const MIN_SEGMENT_ENTRIES: usize = 256;
/// Blocks per streaming multiprocessor below which decode rows are split (FlashDecoding's
/// rule: split the context only when the grid would not fill the GPU).
const WAVES: usize = 2;
/// Items of at least this many queries go to the tensor-core kernel (`attend_mma`), when it
/// exists for the shape: one 16-row tile of its products is then at least full.
pub(crate) const MMA_MIN_Q: usize = 16;
/// The kernel's `window` for a layer without one.
pub(crate) const NO_WINDOW: u32 = u32::MAX;

/// Bytes of dynamic shared memory the tensor-core kernel of `head_dim` is launched with
/// (`mma_shared_bytes` in the kernel, which lays its arrays out within them): the 48 KiB every
/// kernel may take, 96 KiB at head dim 256 (past 48 KiB the launch opts in).
pub(crate) fn mma_shared_bytes(head_dim: usize) -> u32 {
    if head_dim > 128 {
        96 * 1024
    } else {
        48 * 1024
    }
}

/// Context entries per tile for a head dim and storage type (`k_tile` in the kernel).
pub(crate) fn k_tile(head_dim: usize, dtype_bytes: usize) -> usize {
    TILE_BYTES / (head_dim * dtype_bytes)
}

/// The kernels' by-value argument: where each array lies in the plan's words, and the
/// scalars of the call (`Params` in the kernel, field for field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Params {
    pub q_offsets: i32,
    pub q_positions: i32,
    pub block_offsets: i32,
    pub blocks: i32,
    pub ctx_lens: i32,
    pub items: i32,
    pub merges: i32,
    pub mma_items: i32,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub block_size: i32,
    pub scale: f32,
    pub window: u32,
}

/// The shapes a plan is cut for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PlanShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Bytes per K/V value in the pool.
    pub dtype_bytes: usize,
    /// The GPU's streaming multiprocessors.
    pub sms: usize,
    /// Whether items of many queries may go to the tensor-core kernel (which exists for f16 and
    /// bf16 pools); off only to compare the two kernels.
    pub mma: bool,
}

impl PlanShape {
    /// The shape of a call of `dims` over pools of `dtype_bytes` values, cut for `sms`
    /// processors.
    pub(crate) fn of(
        dims: crate::attention::Dims,
        dtype_bytes: usize,
        sms: usize,
        mma: bool,
    ) -> Self {
        Self {
            n_heads: dims.n_heads,
            n_kv_heads: dims.n_kv_heads,
            head_dim: dims.head_dim,
            dtype_bytes,
            sms,
            mma,
        }
    }

    /// Whether the tensor-core kernel takes this shape's items of many queries.
    pub(crate) fn uses_mma(&self) -> bool {
        self.mma && self.dtype_bytes == 2 && matches!(self.head_dim, 64 | 128 | 256)
    }
}

/// One batch's work list.
#[derive(Debug, PartialEq)]
pub(crate) struct Plan {
    pub words: Vec<u32>,
    /// Offsets and head counts; `scale` and `window` are the layer's, set per launch.
    pub params: Params,
    /// Items for the kernel of one query per warp, then items for the tensor-core kernel.
    pub items: usize,
    pub mma_items: usize,
    pub merges: usize,
    /// Partial results the split rows write, each `MAX_Q` queries of `head_dim` plus (m, l).
    pub parts: usize,
}

/// One item before its part is known.
struct Item {
    seq: usize,
    g: usize,
    q0: usize,
    q1: usize,
    tiles: usize,
    decode: bool,
    q_lo: u32,
    q_hi: u32,
}

impl Item {
    /// Each kv head's queries of each sequence in runs of at most [`MAX_Q`], over the whole
    /// context (tiles of `tile` entries).
    fn all(batch: &AttentionBatch, shape: PlanShape, tile: usize) -> Vec<Item> {
        let group = shape.n_heads / shape.n_kv_heads.max(1);
        let mut all = Vec::new();
        for (seq, view) in batch.sequences().enumerate() {
            let rows = view.q_positions.len();
            let tiles = view.ctx_len.div_ceil(tile);
            for g in 0..shape.n_kv_heads {
                for q0 in (0..rows * group).step_by(MAX_Q) {
                    let q1 = (q0 + MAX_Q).min(rows * group);
                    let positions = &view.q_positions[q0 / group..=(q1 - 1) / group];
                    all.push(Item {
                        seq,
                        g,
                        q0,
                        q1,
                        tiles,
                        decode: rows == 1,
                        q_lo: positions.iter().copied().min().unwrap_or(0),
                        q_hi: positions.iter().copied().max().unwrap_or(0),
                    });
                }
            }
        }
        all
    }
}

/// The plan's lists of words: items for each kernel, merges of split items, partials.
struct Lists {
    items: Vec<u32>,
    mma_items: Vec<u32>,
    merges: Vec<u32>,
    parts: usize,
}

impl Lists {
    /// Lists `base`, splitting decode rows into segments of context when the grid would not
    /// fill `shape.sms` processors.
    fn cut(base: &[Item], shape: PlanShape, tile: usize) -> Self {
        let target = WAVES * shape.sms.max(1);
        let split_to = if base.len() < target {
            target.div_ceil(base.len().max(1))
        } else {
            1
        };
        let min_tiles = MIN_SEGMENT_ENTRIES.div_ceil(tile);
        let mut lists = Lists {
            items: Vec::with_capacity(base.len() * ITEM_WORDS),
            mma_items: Vec::new(),
            merges: Vec::new(),
            parts: 0,
        };
        for it in base {
            let segments = if it.decode {
                split_to.min(it.tiles / min_tiles).max(1)
            } else {
                1
            };
            let head = [it.seq, it.g, it.q0, it.q1].map(|x| x as u32);
            let list = match shape.uses_mma() && it.q1 - it.q0 >= MMA_MIN_Q {
                true => &mut lists.mma_items,
                false => &mut lists.items,
            };
            if segments == 1 {
                list.extend(head);
                list.extend([0, it.tiles as u32, u32::MAX, it.q_lo, it.q_hi]);
                continue;
            }
            lists.merges.extend([lists.parts as u32, segments as u32]);
            lists.merges.extend(head);
            for s in 0..segments {
                let (t0, t1) = (it.tiles * s / segments, it.tiles * (s + 1) / segments);
                list.extend(head);
                list.extend([t0 as u32, t1 as u32, lists.parts as u32, it.q_lo, it.q_hi]);
                lists.parts += 1;
            }
        }
        lists
    }
}

impl Plan {
    /// Cuts `batch` into items: each kv head's queries in runs of at most [`MAX_Q`], each over
    /// its sequence's whole context, except that decode rows are split into segments of
    /// context when the grid would not fill `shape.sms` processors. Items of at least
    /// [`MMA_MIN_Q`] queries go to the tensor-core kernel where the shape has one.
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] if the batch does not fit 32-bit offsets.
    pub(crate) fn new(batch: &AttentionBatch, shape: PlanShape) -> Result<Self> {
        let tile = k_tile(shape.head_dim, shape.dtype_bytes).max(1);
        let Lists {
            items,
            mma_items,
            merges,
            parts,
        } = Lists::cut(&Item::all(batch, shape, tile), shape, tile);

        let mut words = Vec::new();
        let place = |words: &mut Vec<u32>, data: &[u32]| -> Result<i32> {
            let at = i32::try_from(words.len())
                .map_err(|_| Error::InvalidBatch("a batch too large for the CUDA kernel".into()))?;
            words.extend_from_slice(data);
            Ok(at)
        };
        let words32 = |o: &[usize]| o.iter().map(|&x| x as u32).collect::<Vec<u32>>();
        let params = Params {
            q_offsets: place(&mut words, &words32(&batch.q_offsets))?,
            q_positions: place(&mut words, &batch.q_positions)?,
            block_offsets: place(&mut words, &words32(&batch.block_offsets))?,
            blocks: place(&mut words, &batch.blocks)?,
            ctx_lens: place(&mut words, &words32(&batch.ctx_lens))?,
            items: place(&mut words, &items)?,
            merges: place(&mut words, &merges)?,
            mma_items: place(&mut words, &mma_items)?,
            n_heads: shape.n_heads as i32,
            n_kv_heads: shape.n_kv_heads as i32,
            block_size: batch.block_size as i32,
            scale: 1.0,
            window: NO_WINDOW,
        };
        // Every word, context entry and block size is a 32-bit number in the kernel.
        let too_large = |n: usize| n > i32::MAX as usize;
        if too_large(words.len())
            || batch.ctx_lens.iter().any(|&n| too_large(n))
            || too_large(batch.block_size)
        {
            return Err(Error::InvalidBatch(
                "a batch too large for the CUDA kernel".into(),
            ));
        }
        Ok(Self {
            params,
            items: items.len() / ITEM_WORDS,
            mma_items: mma_items.len() / ITEM_WORDS,
            merges: merges.len() / MERGE_WORDS,
            parts,
            words,
        })
    }

    /// The words of item `i`, counting the tensor-core kernel's after the others.
    #[cfg(test)]
    pub(crate) fn item(&self, i: usize) -> &[u32] {
        let at = match i.checked_sub(self.items) {
            None => self.params.items as usize + i * ITEM_WORDS,
            Some(j) => self.params.mma_items as usize + j * ITEM_WORDS,
        };
        &self.words[at..][..ITEM_WORDS]
    }

    /// The words of merge `i`.
    #[cfg(test)]
    pub(crate) fn merge(&self, i: usize) -> &[u32] {
        &self.words[self.params.merges as usize + i * MERGE_WORDS..][..MERGE_WORDS]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n_heads: usize, n_kv_heads: usize, head_dim: usize, sms: usize) -> PlanShape {
        PlanShape {
            n_heads,
            n_kv_heads,
            head_dim,
            dtype_bytes: 2,
            sms,
            mma: true,
        }
    }

    /// Every (query row, query head) is computed by exactly one item (or one merge of split
    /// items); items hold at most `MAX_Q` queries; an item's tiles, or a merge's segments
    /// together, cover the whole context in order; only decode rows are split, and the
    /// partials are bounded by the grid, not by the context.
    #[test]
    fn the_plan_covers_every_query_and_tile_once() -> crate::Result<()> {
        let mut batch = AttentionBatch::new(16);
        let blocks: Vec<u32> = (0..313).rev().collect();
        batch.push_sequence(&[4999], &blocks, 5000)?; // a long decode row
        let rows: Vec<u32> = (0..50).collect();
        batch.push_sequence(&rows, &blocks[..4], 50)?; // a prefill run
        batch.push_sequence(&[0], &[], 0)?; // no context at all
        for (heads, kv_heads, head_dim, sms) in [
            (9, 3, 64, 132),
            (32, 8, 128, 132),
            (4, 4, 64, 1),
            (40, 1, 64, 132),
            (48, 2, 256, 8),
        ] {
            let s = shape(heads, kv_heads, head_dim, sms);
            let plan = Plan::new(&batch, s)?;
            let group = heads / kv_heads;
            let tile = k_tile(head_dim, 2);
            let ctx_len = [5000usize, 50, 0];
            let first_row = [0usize, 1, 51];
            let mut seen = vec![0; 52 * heads];
            let mut mark = |it: &[u32]| {
                let (seq, g, q0, q1) = (it[0] as usize, it[1] as usize, it[2], it[3]);
                assert!(q1 > q0 && (q1 - q0) as usize <= MAX_Q);
                for i in q0 as usize..q1 as usize {
                    seen[(first_row[seq] + i / group) * heads + g * group + i % group] += 1;
                }
            };
            let mut split = 0;
            for i in 0..plan.items + plan.mma_items {
                let it = plan.item(i);
                assert_eq!(
                    i >= plan.items,
                    it[3] - it[2] >= MMA_MIN_Q as u32,
                    "the tensor-core kernel takes the items of many queries, at every head dim"
                );
                let tiles = ctx_len[it[0] as usize].div_ceil(tile) as u32;
                if it[6] == u32::MAX {
                    assert_eq!((it[4], it[5]), (0, tiles));
                    mark(it);
                } else {
                    split += 1;
                    assert_eq!(it[0], 0, "only the decode row is split");
                }
            }
            for m in 0..plan.merges {
                let mg = plan.merge(m);
                let (first, count) = (mg[0], mg[1]);
                let (mut next, mut k) = (0, 0);
                for i in 0..plan.items + plan.mma_items {
                    let it = plan.item(i);
                    if it[6] != u32::MAX && (first..first + count).contains(&it[6]) {
                        assert_eq!(&it[..4], &mg[2..6]);
                        assert_eq!(it[6], first + k, "parts numbered in order");
                        assert_eq!(it[4], next, "segments in context order");
                        (next, k) = (it[5], k + 1);
                    }
                }
                assert_eq!((next as usize, k), (5000usize.div_ceil(tile), count));
                mark(&mg[2..6]);
            }
            assert_eq!(split, plan.parts);
            assert!(plan.parts <= 2 * WAVES * sms.max(1), "{} parts", plan.parts);
            assert!(seen.iter().all(|&n| n == 1), "{heads}/{kv_heads}: {seen:?}");
        }
        Ok(())
    }

    /// A grid already full, or a decode row too short to split, is not split.
    #[test]
    fn decode_rows_are_split_only_to_fill_the_gpu() -> crate::Result<()> {
        let blocks: Vec<u32> = (0..128).collect();
        let mut batch = AttentionBatch::new(32);
        for _ in 0..300 {
            batch.push_sequence(&[4095], &blocks, 4096)?;
        }
        let full = Plan::new(&batch, shape(32, 8, 128, 132))?;
        assert_eq!((full.parts, full.merges), (0, 0));
        let mut one = AttentionBatch::new(32);
        one.push_sequence(&[4095], &blocks, 4096)?;
        let spread = Plan::new(&one, shape(32, 8, 128, 132))?;
        assert!(spread.merges == 8 && spread.parts >= 8 * 4, "{spread:?}");
        let mut short = AttentionBatch::new(32);
        short.push_sequence(&[100], &blocks[..4], 101)?;
        assert_eq!(Plan::new(&short, shape(32, 8, 128, 132))?.parts, 0);
        Ok(())
    }
}
